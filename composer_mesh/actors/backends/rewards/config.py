"""The rewarder bindings' settings (`PythonRewarderSettings`: reward functions and shell graders;
`RewardModelSettings`: a sequence-classification model): import-cheap, so that validating a topology imports
neither the worker pool nor a binding, nor torch (`roles.ROLE_TABLE` names each binding by import path and its
settings from here). Validation does import each reward function (`path`), to check it is callable and which of
the two signatures it has (`reward_style`)."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from composer_mesh.bindings import import_object

PYTHON_REWARDER_CAPABILITIES: frozenset[str] = frozenset()
REWARD_MODEL_CAPABILITIES: frozenset[str] = frozenset()

# "rollout": `fn(prompt, completion, answer[, extra]) -> float | None`, called once per rollout.
# "batch": TRL's `fn(prompts=, completions=, completion_ids=, **columns) -> list[float | None]`, once per batch.
RewardStyle = Literal["rollout", "batch"]
BATCH_ARGUMENTS = ("prompts", "completions", "completion_ids")  # what TRL's GRPOTrainer passes every function


def reward_style(fn: Callable[..., Any], path: str) -> RewardStyle:
    """Which signature `fn` has, from its parameters: a parameter named like one of TRL's batch arguments
    (`completions`, ...) makes it batched; one that takes three positional arguments is per-rollout; one that
    takes only keywords (`**kwargs`) is batched. ValueError naming `path` when it fits neither."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a readable signature: called as it always was
        return "rollout"
    positional_only = any(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in params.values())
    if any(name in params for name in BATCH_ARGUMENTS) and not positional_only:
        return "batch"
    try:
        inspect.signature(fn).bind("", "", None)
        return "rollout"
    except TypeError:
        pass
    if any(p.kind is p.VAR_KEYWORD for p in params.values()) and not positional_only:
        return "batch"
    raise ValueError(
        f"reward function {path!r} fits neither signature: fn(prompt, completion, answer) -> float (one rollout) "
        "or TRL's fn(completions, **kwargs) -> list[float] (one batch)")


class FunctionReward(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Import path 'pkg.mod:fn' of a reward function: per rollout, "
                      "`fn(prompt, completion, answer) -> float | None` (with an `extra` parameter it also gets the "
                      "prompt's extra data columns, `run.data.extra`); or batched as TRL's GRPOTrainer calls them, "
                      "`fn(completions, **kwargs) -> list[float | None]` (decided from the signature). None: no "
                      "score from this function.")
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a call may take before its worker process is killed and the call scored as a failure "
        "(a batched function: its one call per batch).",
    )

    @field_validator("path")
    @classmethod
    def _importable(cls, v: str) -> str:
        fn = import_object(v)
        if not callable(fn):
            raise ValueError(f"reward function {v!r} is not callable")
        reward_style(fn, v)
        return v

    @property
    def style(self) -> RewardStyle:
        """How the rewarder calls it: once per rollout, or once per batch (TRL's signature)."""
        return reward_style(import_object(self.path), self.path)

    @property
    def name(self) -> str:
        """Label in metrics and errors: the function's name."""
        return self.path.rsplit(":", 1)[-1]


class ShellGrader(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: list[str] = Field(
        description="argv of the grader. It reads one JSON object {prompt, completion, answer, extra} on stdin and prints "
        "one number (the score) on stdout."
    )
    timeout_s: float = Field(10.0, gt=0, description="Seconds before the grader is killed and scored as a failure.")
    weight: float = Field(1.0, description="Weight of this grader in the summed reward.")
    name: str = Field("", description="Label for metrics; defaults to the program name.")

    @field_validator("command")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not v or not v[0]:
            raise ValueError("command must be a non-empty argv list, e.g. ['python', 'grade.py']")
        return v

    @property
    def label(self) -> str:
        """`name`, else the script (for `python grade.py`) or program name."""
        if self.name:
            return self.name
        program = self.command[0].rsplit("/", 1)[-1]
        if program.startswith(("python", "bash", "sh", "node")) and len(self.command) > 1:
            return self.command[1].rsplit("/", 1)[-1]
        return program


class PythonRewarderSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    functions: list[FunctionReward] = Field(
        default_factory=list, description="Python reward callables by import path, summed with their weights."
    )
    shell: list[ShellGrader] = Field(default_factory=list, description="External grader programs, summed with weights.")
    failure_score: float = Field(0.0, description="Score given for a grader that crashed, timed out or printed garbage.")
    workers: int | None = Field(
        None,
        ge=1,
        description="Worker processes for the reward functions, and the most shell graders run at once "
        "(null: min(4, CPU count)).",
    )

    @property
    def concurrency(self) -> int:
        return self.workers or min(4, os.cpu_count() or 1)

    @model_validator(mode="after")
    def _something(self) -> PythonRewarderSettings:
        if not self.functions and not self.shell:
            raise ValueError("give at least one reward: `functions` (import paths) or `shell` (grader commands)")
        return self


class RewardModelSettings(BaseModel):
    """Settings of the `reward_model` rewarder: a sequence-classification model scoring prompt + completion.

    As TRL's GRPOTrainer takes a reward model: a transformers directory whose logits[:, 0] is the score."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Directory of a transformers sequence-classification model "
                      "(`AutoModelForSequenceClassification`: config.json, weights, tokenizer files).")
    device: str = Field("cpu", description="Where it runs on the rewarder's proc: 'cpu', 'cuda' or 'cuda:N'.")
    batch_size: int = Field(16, ge=1, description="(prompt, completion) pairs scored per forward pass.")
    max_length: int | None = Field(None, ge=1, description="Tokens kept of each pair (its start); null: all.")

    @field_validator("path")
    @classmethod
    def _classifier_dir(cls, v: str) -> str:
        config = Path(v).expanduser() / "config.json"
        if not config.is_file():
            raise ValueError(f"reward model {v!r}: no config.json there (give a directory written by save_pretrained)")
        try:
            archs = json.loads(config.read_text()).get("architectures") or []
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"reward model {v!r}: config.json is not readable JSON ({e})") from None
        if not any(str(a).endswith("ForSequenceClassification") for a in archs):
            raise ValueError(f"reward model {v!r} is not a sequence-classification model (architectures: {archs}); "
                             "give a directory saved from an AutoModelForSequenceClassification")
        if not any((config.parent / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"reward model {v!r} has no tokenizer files (tokenizer.json or tokenizer_config.json): "
                             "save its tokenizer there too (tokenizer.save_pretrained)")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        head, _, index = v.partition(":")
        if head not in ("cpu", "cuda") or (index and (head != "cuda" or not index.isdigit())):
            raise ValueError(f"device {v!r}: give 'cpu', 'cuda' or 'cuda:N'")
        return v
