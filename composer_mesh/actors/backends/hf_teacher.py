"""The `hf` teacher binding: a local transformers model as teacher (channel 2 distributions, channel 3 traces).

Channel 2 needs the teacher's distribution over the *student's* tokens, so it is only offered when the
teacher's tokenizer is the student's (same vocabulary and EOS); otherwise `distributions` (and
`check_distill`) raise an error naming the teacher, and the teacher can still serve channel 3 (`replay`),
whose traces are re-tokenised into the student's vocabulary from their text.

Alignment (the trainer's): for a rollout `prompt + completion`, row t of the distribution is the
teacher's output at position `len(prompt) - 1 + t`, i.e. the distribution that scores completion token t.
Dense rows are raw float32 logits over the student's model vocabulary; top-k rows are the k most likely
ids with their log-probs (log_softmax over the whole vocabulary). Compute runs in a worker thread so the
actor's event loop stays responsive; one computation runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from composer_mesh.actors.backends.local_model import (
    as_model_config,
    check_device,
    prompt_ids,
    task_stop_texts,
)
from composer_mesh.actors.messages import Prompt, Rollout, TeacherTrace, TokenDistribution
from composer_mesh.models.config import ModelConfig, WarmStartConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# Logit given to student-vocabulary ids the teacher's head lacks (finite, so KL terms stay finite).
_ABSENT_LOGIT = -1e9


class TeacherTokenizerMismatch(ValueError):
    """Channel 2 was asked of a teacher whose tokenizer differs from the student's."""


def _default_teacher_model() -> ModelConfig:
    return ModelConfig(warmstart=WarmStartConfig(steps=150))


class HFTeacherSettings(BaseModel):
    """Settings of the `hf` teacher binding."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(
        default_factory=_default_teacher_model,
        description="The teacher model (same schema as the topology's model:). Default: the tiny model "
        "warm-started for 150 SFT steps on the addition task, so it already solves it.",
    )
    device: str = Field("cpu", description="torch device: 'cpu', 'cuda', 'cuda:<index>' or 'mps'.")
    torch_threads: int | None = Field(
        1, ge=1, description="torch CPU threads for this process (null = leave torch's default)."
    )
    max_batch: int = Field(64, ge=1, description="Maximum sequences per teacher forward pass.")
    trace_temperature: float = Field(
        0.0, ge=0, description="Sampling temperature of channel-3 traces (0 = greedy)."
    )
    seed: int = Field(0, description="Base seed of trace sampling (call i uses seed + i) when trace_temperature > 0.")
    stop_at_task_eos: bool = Field(
        True, description="Traces also stop at the teacher model task's end marker (e.g. ';'), besides EOS."
    )
    cache_dir: str | None = Field(
        None, description="Where the teacher model is materialized (null = $COMPOSER_MESH_CACHE or ~/.cache/composer_mesh)."
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_device(v)


def tokenizer_mismatch(teacher: PreTrainedTokenizerBase, student: PreTrainedTokenizerBase) -> str | None:
    """None when both tokenizers map every token to the same id and share EOS; else what differs."""
    tv, sv = teacher.get_vocab(), student.get_vocab()
    if tv != sv:
        differ = sum(1 for k in set(tv) | set(sv) if tv.get(k) != sv.get(k))
        return f"vocabularies differ ({len(tv)} vs {len(sv)} tokens, {differ} tokens map to different ids)"
    if teacher.eos_token_id != student.eos_token_id:
        return f"EOS ids differ ({teacher.eos_token_id} vs {student.eos_token_id})"
    return None


def _student_vocab_size(student: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> int:
    """Rows of the student's output head (what the trainer's logits are over)."""
    if student.is_tiny:
        return len(tokenizer)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(student.source, local_files_only=True)
    return int(getattr(cfg, "vocab_size", None) or len(tokenizer))


class HFTeacher:
    """A local transformers teacher. Capabilities: "distill" (shared tokenizer only) and "replay"."""

    Settings: ClassVar[type[BaseModel]] = HFTeacherSettings
    capabilities: ClassVar[frozenset[str]] = frozenset({"distill", "replay"})

    def __init__(self, settings: HFTeacherSettings | None = None) -> None:
        self.settings = settings or HFTeacherSettings()
        self.name = "hf"
        self.model: PreTrainedModel | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.student_tokenizer: PreTrainedTokenizerBase | None = None
        self.mismatch: str | None = None
        self._calls = 0
        self._lock = threading.Lock()
        self._usage = {
            "requests": 0.0,
            "distill_rollouts": 0.0,
            "distill_tokens": 0.0,
            "trace_prompts": 0.0,
            "trace_tokens": 0.0,
            "failures": 0.0,
            "untokenizable_traces": 0.0,
            "cost": 0.0,
            "seconds": 0.0,
        }

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self, student_model: Any, name: str) -> None:
        """Load the teacher and the student's tokenizer; decide whether channel 2 is possible."""
        from composer_mesh.models.tiny import load_pretrained, load_tokenizer, stop_token_ids

        self.name = name
        student = as_model_config(student_model)
        if self.settings.torch_threads is not None:
            torch.set_num_threads(self.settings.torch_threads)
        self.model, self.tokenizer = load_pretrained(self.settings.model, self.settings.cache_dir, self.settings.device)
        self.model.requires_grad_(False)
        self.student_tokenizer = load_tokenizer(student)
        self.mismatch = tokenizer_mismatch(self.tokenizer, self.student_tokenizer)
        self.student_vocab = _student_vocab_size(student, self.student_tokenizer)
        self._vocab = int(self.model.get_output_embeddings().weight.shape[0])
        extra = task_stop_texts(self.settings.model) if self.settings.stop_at_task_eos else ()
        self.stop_ids = stop_token_ids(self.tokenizer, extra)
        pad = self.tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else self.stop_ids[0])

    @property
    def shares_tokenizer(self) -> bool:
        """True when channel 2 is possible (the teacher's tokenizer is the student's)."""
        return self.mismatch is None

    def check_distill(self) -> None:
        """Raise unless this teacher can give channel-2 distributions over the student's tokens."""
        self._require_started()
        if self.mismatch is not None:
            raise TeacherTokenizerMismatch(
                f"teacher {self.name!r} (binding hf, model {self.settings.model.source!r}) cannot supply channel-2 "
                f"(distill) distributions: its tokenizer is not the student's ({self.mismatch}). "
                "Give it channels: [replay] only, or use a teacher with the student's tokenizer."
            )

    def _require_started(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        if self.model is None or self.tokenizer is None:
            raise RuntimeError("HFTeacher: call start(student_model, name) first")
        return self.model, self.tokenizer

    def usage(self) -> dict[str, float]:
        return dict(self._usage)

    # -- channel 2 ---------------------------------------------------------------------------------------
    async def distributions(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        self.check_distill()
        if top_k < 0:
            raise ValueError(f"teacher {self.name!r}: top_k must be >= 0 (0 = dense logits), got {top_k}")
        return await self._run(self._distributions, rollouts, top_k)

    def _distributions(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        from composer_mesh.models.sampling import chunks, teacher_forced_logits

        model, _ = self._require_started()
        for r in rollouts:
            bad = [i for i in (*r.prompt_ids, *r.completion_ids) if not 0 <= i < self._vocab]
            if not r.prompt_ids or bad:
                raise ValueError(
                    f"teacher {self.name!r}: rollout {r.prompt_id!r} has no prompt tokens or token ids {bad[:5]} "
                    f"outside the teacher's vocabulary [0, {self._vocab})"
                )
        out: list[TokenDistribution] = []
        for batch in chunks(rollouts, self.settings.max_batch):
            logits = teacher_forced_logits(
                model, [r.prompt_ids for r in batch], [r.completion_ids for r in batch], pad_id=self._pad_id
            )
            out += [self._to_distribution(lg, top_k) for lg in logits]
        self._usage["distill_rollouts"] += len(rollouts)
        self._usage["distill_tokens"] += sum(len(r.completion_ids) for r in rollouts)
        return out

    def _to_student_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        v = self.student_vocab
        if logits.shape[-1] == v:
            return logits
        if logits.shape[-1] > v:  # extra (padding) rows of the teacher's head: not student tokens
            return logits[:, :v].contiguous()
        pad = torch.full((logits.shape[0], v - logits.shape[-1]), _ABSENT_LOGIT, dtype=logits.dtype)
        return torch.cat([logits, pad], dim=-1)

    def _to_distribution(self, logits: torch.Tensor, top_k: int) -> TokenDistribution:
        logits = self._to_student_vocab(logits.cpu().float())
        if top_k == 0:
            return TokenDistribution(teacher=self.name, logits=logits)
        logp = torch.log_softmax(logits, dim=-1)
        vals, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
        return TokenDistribution(teacher=self.name, topk_ids=ids.to(torch.long), topk_logprobs=vals)

    # -- channel 3 ---------------------------------------------------------------------------------------
    async def traces(self, prompts: list[Prompt], max_new_tokens: int) -> list[TeacherTrace]:
        self._require_started()
        if max_new_tokens < 1:
            raise ValueError(f"teacher {self.name!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        return await self._run(self._traces, prompts, max_new_tokens)

    def _traces(self, prompts: list[Prompt], max_new_tokens: int) -> list[TeacherTrace]:
        from composer_mesh.models.sampling import chunks, sample

        model, tokenizer = self._require_started()
        assert self.student_tokenizer is not None
        if self.shares_tokenizer:
            ids = [prompt_ids(p, tokenizer, self._vocab, f"teacher {self.name!r}") for p in prompts]
        else:  # the prompt's ids are the student's: re-tokenise its text
            ids = [list(tokenizer.encode(p.text, add_special_tokens=False)) for p in prompts]
            for p, i in zip(prompts, ids):
                if not i:
                    raise ValueError(f"teacher {self.name!r}: prompt {p.prompt_id!r} has no text to re-tokenise")
        temp = self.settings.trace_temperature
        gen = torch.Generator(device=self.settings.device).manual_seed(self.settings.seed + self._calls)
        self._calls += 1
        samples = []
        for batch in chunks(ids, self.settings.max_batch):
            samples += sample(
                model, batch, max_new_tokens=max_new_tokens, temperature=temp,
                stop_ids=self.stop_ids, pad_id=self._pad_id, generator=gen if temp > 0 else None,
            )
        traces = []
        for p, s in zip(prompts, samples):
            text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
            if self.shares_tokenizer:
                traces.append(TeacherTrace(self.name, p.prompt_id, text, list(s.token_ids)))
                continue
            # Another tokenizer: write the text in the student's vocabulary. A text the student cannot
            # represent is dropped (a silently shortened trace would teach something the teacher never said).
            completion = list(self.student_tokenizer.encode(text, add_special_tokens=False))
            if self.student_tokenizer.decode(completion) != text:
                self._usage["untokenizable_traces"] += 1
                log.warning("teacher %r: trace for prompt %r cannot be written in the student's vocabulary; dropped",
                            self.name, p.prompt_id)
                continue
            ended_on_eos = bool(s.token_ids) and s.token_ids[-1] == tokenizer.eos_token_id  # not in the text
            if ended_on_eos and self.student_tokenizer.eos_token_id is not None:
                completion.append(int(self.student_tokenizer.eos_token_id))
            completion = completion[:max_new_tokens]
            text = self.student_tokenizer.decode(completion, skip_special_tokens=True)
            traces.append(TeacherTrace(self.name, p.prompt_id, text, completion))
        self._usage["trace_prompts"] += len(prompts)
        self._usage["trace_tokens"] += sum(len(s.token_ids) for s in samples)
        return traces

    # -- plumbing ----------------------------------------------------------------------------------------
    async def _run(self, fn: Any, *args: Any) -> Any:
        """Run `fn` in a worker thread (one at a time), counting requests, failures and time."""

        def locked() -> Any:
            with self._lock:
                return fn(*args)

        t0 = time.perf_counter()
        self._usage["requests"] += 1
        try:
            return await asyncio.to_thread(locked)
        except Exception:
            self._usage["failures"] += 1
            raise
        finally:
            self._usage["seconds"] += time.perf_counter() - t0
