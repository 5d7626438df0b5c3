"""`ModelConfig`: the topology's `model:` section (the policy model shared by trainer and generators), and
`LoraConfig`: low-rank adapters on it (the `hf` trainer's `lora` setting; applied by `models/lora.py`).

A model is either the built-in tiny Qwen2 (`source: tiny`, built offline and deterministically from the
knobs below and `seed`) or a local directory written by transformers' `save_pretrained`. An optional
`warmstart` trains it briefly on a task (supervised, in-process) before anyone uses it: that is how the
main job gets a teacher that already knows the task and a weak-but-not-random student.
Everything is resolved to a save_pretrained directory by `composer_mesh.models.loading.materialize`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from composer_mesh.errors import FieldError
from composer_mesh.tasks.data import DataConfig

DType = Literal["float32", "bfloat16", "float16"]
LoraSync = Literal["merged", "adapter"]

# Bumped when what a config builds changes without the config changing (cached models of older recipes are
# rebuilt): 2 = warm starts train on the task's train split only (the eval split is held out).
MATERIALIZE_RECIPE = 2
# Bumped when the byte tokenizer changes (only byte-tokenizer models are rebuilt; character ones keep their
# caches): 2 = its chat template declares tools and renders tool calls (a cached copy has the old template).
BYTE_TOKENIZER_VERSION = 2


class WarmStartConfig(BaseModel):
    """Brief supervised fine-tuning on (prompt, target) pairs of a task, or of your own data (`data`), done once and
    cached with the model."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(
        "addition",
        description="Task to learn: a built-in task name (e.g. 'addition') or an import path 'pkg.mod:Task'.",
    )
    steps: int = Field(200, ge=0, description="Optimizer steps of SFT (0 = no training, only the cache key).")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate of the warm start.")
    batch_size: int = Field(64, ge=1, description="Task samples per SFT step.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay of the warm start.")
    seed: int = Field(0, description="Seed of the task sampler and of the SFT batch order.")
    threads: int = Field(
        1, ge=1, description="torch CPU threads during the warm start. 1 is fastest for tiny models on a shared "
        "CPU and makes the result independent of the machine's core count."
    )
    data: DataConfig | None = Field(
        None,
        description="Warm-start from your own data instead of `task`: a data set in `run.data`'s format (same keys). "
        "Each (prompt, target) pair is a train row's prompt (its chat messages through the tokenizer's chat "
        "template, as generators see them) and its `answer` column followed by the task's end marker (`task`'s: "
        "';' for the built-in tasks); point `answer` at your completion column. Held-out rows (the data's eval "
        "split, chosen by a hash of the prompt) are never trained on; with the source of `run.data` it must hold "
        "out the same rows.",
    )

    episodes: Literal["turn", "whole"] = Field(
        "turn", description="For a task that demonstrates episodes: 'turn' learns one assistant turn of a "
        "demonstration per sequence (the conversation before it only read); 'whole' learns every assistant turn "
        "of one demonstration in one sequence, about half the compute for the same turns learnt (docs/agentic.md)."
    )

    @model_serializer(mode="wrap")
    def _omit_defaults_added_later(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A dump leaves out `data: null` and `episodes: turn`, so the cache keys and checkpoint fingerprints of
        every config written before those fields existed stay what they were."""
        out: dict[str, Any] = handler(self)
        if out.get("data", 0) is None:
            del out["data"]
        if out.get("episodes") == "turn":
            del out["episodes"]
        return out


class ModelConfig(BaseModel):
    """The policy model: the built-in tiny Qwen2 or a local transformers causal LM, plus an optional warm start."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        "tiny",
        description="'tiny' (built-in tiny Qwen2 with a character-level tokenizer, built offline) or the path "
        "of a local directory holding a transformers causal LM saved with save_pretrained (must contain config.json).",
    )
    task: str = Field(
        "addition",
        description="The model's task (built-in name or 'pkg.mod:Task'): the tiny character-level tokenizer "
        "covers its alphabet, and generators/teachers with stop_at_task_eos also stop at its end marker (';').",
    )
    tokenizer: Literal["char", "byte"] = Field(
        "char",
        description="Tiny model: 'char' (one id per character of the task's alphabet, no chat template) or 'byte' "
        "(256 byte ids + <|endoftext|>, <|im_start|>, <|im_end|> and a Qwen-style chat template: reads any text "
        "and chat prompts). Unset: 'char' for a task run, 'byte' for a run on run.data or run.environment (a tiny "
        "teacher's: the policy's).",
    )
    hidden_size: int = Field(64, ge=8, description="Tiny model: hidden (embedding) size.")
    num_layers: int = Field(2, ge=1, description="Tiny model: number of transformer layers.")
    num_heads: int = Field(
        2, ge=1, description="Tiny model: attention heads. hidden_size / num_heads is the head dim; vLLM-CPU "
        "needs a head dim in {32, 64, 80, 96, 112, 128, ...}."
    )
    num_kv_heads: int = Field(1, ge=1, description="Tiny model: key/value heads (must divide num_heads).")
    intermediate_size: int = Field(256, ge=8, description="Tiny model: MLP intermediate size.")
    max_position_embeddings: int = Field(128, ge=8, description="Tiny model: maximum sequence length.")
    seed: int = Field(0, description="Seed of the tiny model's initial weights (same seed -> bitwise same weights).")
    dtype: DType = Field("float32", description="Parameter dtype: float32, bfloat16 or float16.")
    warmstart: WarmStartConfig | None = Field(
        None, description="Optional brief SFT on a task before use (cached with the model); null = none."
    )

    @field_validator("source")
    @classmethod
    def _check_source(cls, v: str) -> str:
        if v == "tiny":
            return v
        path = Path(v).expanduser()
        if not path.is_dir():
            raise ValueError(
                f"model.source {v!r} is neither 'tiny' nor an existing directory "
                "(give a local transformers save_pretrained directory)"
            )
        if not (path / "config.json").is_file():
            raise ValueError(f"model.source {v!r} has no config.json (not a transformers save_pretrained directory)")
        return str(path.resolve())

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.source != "tiny":
            if self.tokenizer != "char":
                raise FieldError("tokenizer", f"model.tokenizer={self.tokenizer!r} is for the tiny model; a local "
                                 "source brings its own tokenizer")
            return self
        if self.hidden_size % self.num_heads:
            raise FieldError("num_heads", f"model.num_heads={self.num_heads} must divide model.hidden_size="
                             f"{self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise FieldError("num_kv_heads", f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads="
                             f"{self.num_heads}")
        return self

    @model_serializer(mode="wrap")
    def _omit_char_tokenizer(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A dump leaves out `tokenizer: char` (the default), so the cache keys, materialized metadata and
        checkpoint fingerprints of every config written before the field existed stay what they were."""
        data: dict[str, Any] = handler(self)
        if data.get("tokenizer") == "char":
            del data["tokenizer"]
        return data

    @property
    def is_tiny(self) -> bool:
        return self.source == "tiny"

    def cache_key(self) -> str:
        """Stable hash of everything that determines the materialized weights and tokenizer."""
        payload = self.model_dump(mode="json")
        payload["recipe"] = MATERIALIZE_RECIPE
        if self.is_tiny and self.tokenizer == "byte":
            payload["byte_tokenizer"] = BYTE_TOKENIZER_VERSION
        if self.warmstart is not None and self.warmstart.data is not None:  # the rows themselves, not their path
            from composer_mesh.tasks.data import load_prompt_data

            payload["warmstart_data_digest"] = load_prompt_data(self.warmstart.data).digest
        if not self.is_tiny:
            # A local source is identified by its path and the mtimes/sizes of its files.
            src = Path(self.source)
            payload["source_files"] = sorted(
                (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in src.iterdir() if p.is_file()
            )
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class LoraConfig(BaseModel):
    """Low-rank adapters (LoRA, via peft) on the policy: only the adapters train, the base stays frozen."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, ge=1, description="Rank of each adapter (lora_A: r x in, lora_B: out x r).")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator: the adapter's update is (alpha / r) * B @ A.")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapters' input while training (the frozen base path has none)."
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Modules that get adapters: 'all-linear' (every linear layer but the LM head) or a list of module "
        "names, each matching a module's full name or its last parts (e.g. q_proj, v_proj). A name matching no "
        "module of the model, the LM head or the input embeddings is refused by validate (before launch).",
    )
    sync: LoraSync = Field(
        "merged",
        description="What generators receive over the weight plane: 'merged' (the full weights, base + adapter, "
        "under the plain model's names: every generator binding takes them) or 'adapter' (only the adapter tensors, "
        "for generator bindings with capability 'adapters', which apply the same LoRA config themselves).",
    )

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list):
            if not v:
                raise ValueError("lora.target_modules is empty; give module names or 'all-linear'")
            bad = [name for name in v if not name or name != name.strip() or name.startswith(".") or name.endswith(".")]
            if bad:
                raise ValueError(f"lora.target_modules: {bad} are not module names (e.g. q_proj or self_attn.q_proj)")
            if len(set(v)) != len(v):
                raise ValueError(f"lora.target_modules names a module twice: {v}")
        return v
