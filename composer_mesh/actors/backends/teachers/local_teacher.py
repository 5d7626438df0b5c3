"""What the `hf` and `vllm` teachers share: a local teacher model checked against the student's tokenizer.

`LocalTeacher` holds everything that does not depend on how the teacher model runs: the tokenizer check that
decides whether channel 2 is possible, the argument checks, the usage counters, running one computation at a
time in a worker thread (so the actor's event loop stays responsive), re-tokenising channel-3 traces into
the student's vocabulary, and trimming/padding dense rows to the student's vocabulary. A binding supplies
`_require_started`, `_compute_distributions` (teacher-forced rows for rollouts it has checked) and
`_sample_traces` (the teacher's own token ids for each prompt). `LocalTeacherSettings` holds the settings
both bindings share. A computation that fails for a reason outside our code (out of memory; for vllm, a
failed engine: `_unavailable_reason`) raises `TeacherUnavailable`; any other error is a bug and propagates.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from composer_mesh.actors.backends.local_model import as_model_config, prompt_ids
from composer_mesh.actors.messages import Prompt, Rollout, TeacherTrace, TokenDistribution
from composer_mesh.actors.teacher_errors import TeacherUnavailable
from composer_mesh.actors.teacher_topk import TopK, resolve_top_k
from composer_mesh.models.chat import prompt_token_ids

log = logging.getLogger(__name__)

# Logit given to student-vocabulary ids the teacher's head lacks (finite, so KL terms stay finite).
_ABSENT_LOGIT = -1e9


class TeacherTokenizerMismatch(ValueError):
    """Channel 2 was asked of a teacher whose tokenizer differs from the student's."""


class LocalTeacher(ABC):
    """Base of the teachers that run a local model: channel 2 (shared tokenizer only) and channel 3."""

    binding: ClassVar[str]  # the binding's name, in errors and logs
    settings: Any  # the binding's Settings (a LocalTeacherSettings with a `seed`); `model`, `seed` and
    # `trace_temperature` are read here

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.name = self.binding
        self.tokenizer: Any = None  # the teacher's, set by start()
        self.student_tokenizer: Any = None
        self.mismatch: str | None = None
        self.student_vocab = 0
        self.stop_ids: list[int] = []
        self._vocab = 0  # rows of the teacher's output head
        self._context: int | None = None  # its longest sequence, when its config says
        self._calls = 0
        self._logged_auto = False
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

    # -- what a binding supplies -------------------------------------------------------------------------
    @abstractmethod
    def _require_started(self) -> Any:
        """Raise RuntimeError unless start() ran; return what the binding computes with."""

    @abstractmethod
    def _compute_distributions(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        """One distribution per rollout (ids already checked against the teacher's vocabulary; `top_k`
        resolved: 0 = dense), scored in batches of at most `settings.score_batch_tokens` padded tokens."""

    @abstractmethod
    def _sample_traces(self, ids: list[list[int]], max_new_tokens: int, seed: int,
                       seeds: list[int] | None = None) -> list[list[int]]:
        """The teacher's completion token ids for each prompt (ids in the teacher's vocabulary). With `seeds`,
        prompt i samples with `seeds[i]` alone (its tokens do not depend on what shares the call)."""

    # -- lifecycle ---------------------------------------------------------------------------------------
    def bind_student(self, student_model: Any) -> None:
        """Load the student's tokenizer (from its ModelConfig) and decide whether channel 2 is possible."""
        from composer_mesh.models.compat import tokenizer_mismatch, vocab_rows
        from composer_mesh.models.loading import load_tokenizer

        self._require_started()
        student = as_model_config(student_model)
        self.student_tokenizer = load_tokenizer(student)
        self.mismatch = tokenizer_mismatch(self.tokenizer, self.student_tokenizer)
        self.student_vocab = vocab_rows(student, self.student_tokenizer)
        if self.mismatch is not None:
            log.info("%s teacher %r: not the student's tokenizer (%s): replay only", self.binding, self.name, self.mismatch)

    @property
    def shares_tokenizer(self) -> bool:
        """True when channel 2 is possible (the teacher's tokenizer is the student's)."""
        return self.mismatch is None

    def check_distill(self) -> None:
        """Raise unless this teacher can give channel-2 distributions over the student's tokens."""
        self._require_started()
        if self.mismatch is not None:
            raise TeacherTokenizerMismatch(
                f"teacher {self.name!r} (binding {self.binding}, model {self.settings.model.source!r}) cannot supply "
                f"channel-2 (distill) distributions: its tokenizer is not the student's ({self.mismatch}). "
                "Give it channels: [replay] only, or use a teacher with the student's tokenizer."
            )

    def usage(self) -> dict[str, float]:
        return dict(self._usage)

    # -- channel 2 ---------------------------------------------------------------------------------------
    async def distributions(self, rollouts: list[Rollout], top_k: TopK) -> list[TokenDistribution]:
        """Channel 2; `top_k` "auto" is resolved here, where the student's vocabulary is known."""
        self.check_distill()
        try:
            k = resolve_top_k(top_k, self.student_vocab)
        except ValueError as e:
            raise ValueError(f"teacher {self.name!r}: {e}") from None
        if top_k != k and not self._logged_auto:
            self._logged_auto = True
            log.info("teacher %r: top_k %r -> %s (student vocabulary %d)", self.name, top_k, k or "dense", self.student_vocab)
        return await self._run(self._distributions, rollouts, k)

    def _distributions(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        for r in rollouts:
            bad = [i for i in (*r.prompt_ids, *r.completion_ids) if not 0 <= i < self._vocab]
            if not r.prompt_ids or bad:
                raise ValueError(
                    f"teacher {self.name!r}: rollout {r.prompt_id!r} has no prompt tokens or token ids {bad[:5]} "
                    f"outside the teacher's vocabulary [0, {self._vocab})"
                )
        out = self._compute_distributions(rollouts, top_k)
        self._usage["distill_rollouts"] += len(rollouts)
        self._usage["distill_tokens"] += sum(len(r.completion_ids) for r in rollouts)
        return out

    def _to_student_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, V_teacher] rows -> [T, V_student] on the same device: extra head rows dropped, missing ids get
        `_ABSENT_LOGIT`. Returns `logits` itself when the sizes match."""
        v = self.student_vocab
        if logits.shape[-1] == v:
            return logits
        if logits.shape[-1] > v:  # extra (padding) rows of the teacher's head: not student tokens
            return logits[:, :v].contiguous()
        pad = torch.full((logits.shape[0], v - logits.shape[-1]), _ABSENT_LOGIT, dtype=logits.dtype, device=logits.device)
        return torch.cat([logits, pad], dim=-1)

    # -- channel 3 ---------------------------------------------------------------------------------------
    async def traces(self, prompts: list[Prompt], max_new_tokens: int, seed: int | None = None,
                     seeds: list[int] | None = None) -> list[TeacherTrace]:
        """One trace per prompt (channel 3). `seeds`: one per prompt (a teacher's episode turns). A teacher that
        shares the student's tokenizer continues a prompt's exact ids (`token_ids` + `bridge_messages`, as the
        generators do) and returns them as the trace's `prompt_ids`, so an episode can be played token in,
        token out; another tokenizer re-tokenises, and its traces have no `prompt_ids`."""
        self._require_started()
        if max_new_tokens < 1:
            raise ValueError(f"teacher {self.name!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"teacher {self.name!r}: {len(seeds)} seeds for {len(prompts)} prompts")
        return await self._run(self._traces, prompts, max_new_tokens, seed, seeds)

    def _traces(self, prompts: list[Prompt], max_new_tokens: int, seed: int | None = None,
                seeds: list[int] | None = None) -> list[TeacherTrace]:
        self._require_started()
        if self.shares_tokenizer:
            ids = [prompt_ids(p, self.tokenizer, self._vocab, f"teacher {self.name!r}", max_new_tokens, self._context)
                   for p in prompts]
        else:  # the prompt's ids are the student's: re-tokenise its text (or render its messages) in ours
            ids = [prompt_token_ids(self.tokenizer, p, checked=False) for p in prompts]
            for p, i in zip(prompts, ids):
                if not i:
                    raise ValueError(f"teacher {self.name!r}: prompt {p.prompt_id!r} has no text to re-tokenise")
        seed = seed if seed is not None else self.settings.seed + self._calls
        self._calls += 1
        samples = self._sample_traces(ids, max_new_tokens, seed, seeds)
        traces = []
        for p, i, s in zip(prompts, ids, samples):
            trace = self._trace(p, i, s, max_new_tokens)
            if trace is not None:
                traces.append(trace)
        self._usage["trace_prompts"] += len(prompts)
        self._usage["trace_tokens"] += sum(len(s) for s in samples)
        return traces

    def _trace(self, p: Prompt, ids: list[int], token_ids: list[int], max_new_tokens: int) -> TeacherTrace | None:
        """One trace in the student's vocabulary (continuing `ids`), or None when the student cannot write its
        text."""
        tokenizer = self.tokenizer
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        usage = {"prompt_tokens": float(len(ids)), "completion_tokens": float(len(token_ids))}  # in its tokens
        if self.shares_tokenizer:
            return TeacherTrace(self.name, p.prompt_id, text, list(token_ids), prompt_ids=list(ids), usage=usage)
        # Another tokenizer: write the text in the student's vocabulary. A text the student cannot
        # represent is dropped (a silently shortened trace would teach something the teacher never said).
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
        return TeacherTrace(self.name, p.prompt_id, student.decode(completion, skip_special_tokens=True), completion,
                            usage=usage)

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
        except Exception as e:
            self._usage["failures"] += 1
            reason = self._unavailable_reason(e)
            if reason is None:
                raise
            raise TeacherUnavailable(
                f"teacher {self.name!r} (binding {self.binding}): {reason}: {type(e).__name__}: {e}"
            ) from e
        finally:
            self._usage["seconds"] += time.perf_counter() - t0

    def _unavailable_reason(self, error: Exception) -> str | None:
        """Why `error` is outside our code (then `_run` raises `TeacherUnavailable`), or None for a bug, which
        propagates as it is. Out of memory is the local teacher's expected failure: a batch too large for the
        device now. A binding adds its own (the vllm teacher: a failed or dead engine)."""
        if isinstance(error, torch.OutOfMemoryError):
            torch.cuda.empty_cache()  # give the cached blocks back, so the next (smaller) batch can fit
            return "out of memory"
        return None
