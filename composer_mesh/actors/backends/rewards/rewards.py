"""Reward functions by import path plus shell graders, combined as a weighted sum.

A grader that crashes, hangs past its timeout, prints garbage or returns the wrong thing scores `failure_score`
with `ok=False` and an error saying what happened; it never raises into the actor. Python functions run in
worker processes (`reward_pool`), since only a process can be killed at a timeout; shell graders are
subprocesses. Every (rollout, grader) pair of a batch is submitted at once, so graders run concurrently; a
function with TRL's batched signature gets one call for the whole batch.

A function may return None for a rollout: no score from it (TRL's "not mine", e.g. a function for one task of
a mixed data set). The rollout's reward is then the weighted sum of the other graders' scores. A rollout no
grader scored (every one returned None) is a failure, not a 0: training on a score nobody gave would push
the policy towards noise, and as a failure it is counted, shown on the console and can stop the run
(`run.stop_after_failed_reward_steps`).
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

from pydantic import BaseModel

from composer_mesh.actors.backends.rewards.config import (
    PYTHON_REWARDER_CAPABILITIES,
    FunctionReward,
    PythonRewarderSettings,
    ShellGrader,
)
from composer_mesh.actors.backends.rewards.reward_pool import CallFailed, FunctionPool, Score
from composer_mesh.actors.messages import Prompt, RewardResult, Rollout


def run_shell_grader(grader: ShellGrader, prompt: str, completion: str, answer: str | None,
                     extra: dict[str, Any] | None = None) -> float:
    """Run one grader; raises `GraderFailure` describing a crash, timeout or unparsable output."""
    payload = json.dumps({"prompt": prompt, "completion": completion, "answer": answer, "extra": extra or {}})
    try:
        proc = subprocess.run(
            grader.command,
            input=payload,
            capture_output=True,
            text=True,
            errors="replace",  # bytes that are not UTF-8 make garbage output, not an exception
            timeout=grader.timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise GraderFailure(f"grader {grader.label!r} timed out after {grader.timeout_s:g}s") from None
    except OSError as e:
        raise GraderFailure(f"grader {grader.label!r} could not start: {e.strerror or e}") from None
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        raise GraderFailure(f"grader {grader.label!r} exited with code {proc.returncode}: {tail[0][:200]}")
    out = proc.stdout.strip()
    try:
        score = float(out.splitlines()[-1]) if out else math.nan
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        raise GraderFailure(f"grader {grader.label!r} printed {out[:80]!r}, expected one finite number")
    return score


class GraderFailure(Exception):
    """A grader that did not produce a score; becomes `RewardResult(ok=False)`."""


class PythonRewarder:
    """Binding `python` for the rewarder role. `close()` (or garbage collection) stops its worker processes."""

    Settings: ClassVar[type[BaseModel]] = PythonRewarderSettings
    capabilities: ClassVar[frozenset[str]] = PYTHON_REWARDER_CAPABILITIES

    def __init__(self, settings: PythonRewarderSettings) -> None:
        self.settings = settings
        n = settings.concurrency
        self.pool = FunctionPool([f.path for f in settings.functions], n) if settings.functions else None
        self._shell = ThreadPoolExecutor(n, thread_name_prefix="shell-grader") if settings.shell else None
        self._finalizer = weakref.finalize(self, _close, self.pool, self._shell)
        self._count_lock = threading.Lock()
        self.calls = 0
        self.failures = 0

    def close(self) -> None:
        self._finalizer()

    def score(self, prompt: Prompt, rollout: Rollout) -> RewardResult:
        return self.score_batch([(prompt, rollout)])[0]

    def score_batch(self, items: list[tuple[Prompt, Rollout]]) -> list[RewardResult]:
        """Score many rollouts: every call (one per rollout and per-rollout grader, one per batched function)
        is submitted before any is waited for."""
        parts: list[list[Part]] = [[] for _ in items]
        for f in self.settings.functions:
            for i, outcome in enumerate(self._function(f, items)):
                parts[i].append((f.name, f.weight, outcome))
        for i, (prompt, rollout) in enumerate(items):
            parts[i].extend(self._shell_parts(prompt, rollout))
        results = [self._combine(p) for p in parts]
        with self._count_lock:
            self.calls += len(results)
            self.failures += sum(not r.ok for r in results)
        return results

    def _function(self, f: FunctionReward, items: list[tuple[Prompt, Rollout]]) -> list[Outcome]:
        """Each rollout's outcome of function `f`: its own call, or its entry of one batched call."""
        assert self.pool is not None
        if f.style == "rollout":
            futures = [self.pool.submit(f.path, (p.text, r.text, p.answer), f.timeout_s, p.extra) for p, r in items]
            return [_one(f.name, future) for future in futures]
        batch = self.pool.submit_batch(f.path, trl_kwargs(items), f.timeout_s)
        return [_entry(f.name, batch, i) for i in range(len(items))]

    def _shell_parts(self, prompt: Prompt, rollout: Rollout) -> list[Part]:
        parts: list[Part] = []
        for grader in self.settings.shell:
            assert self._shell is not None
            future = self._shell.submit(run_shell_grader, grader, prompt.text, rollout.text, prompt.answer,
                                        extra=prompt.extra)
            parts.append((grader.label, grader.weight, _one(grader.label, future)))
        return parts

    def _combine(self, parts: list[Part]) -> RewardResult:
        """The weighted sum of the graders that gave a score (None: left out); a failed one adds
        `failure_score`. No score at all is a failure too."""
        total, scores, errors = 0.0, {}, []
        for label, weight, outcome in parts:
            try:
                value = outcome()
            except GraderFailure as e:
                errors.append(str(e))
                value = self.settings.failure_score
            if value is None:
                continue
            scores[label] = value
            total += weight * value
        if errors:
            return RewardResult(score=total, ok=False, error="; ".join(errors), components=scores)
        if not scores:
            return RewardResult(score=self.settings.failure_score, ok=False,
                                error=f"no score: every reward function returned None ({', '.join(p[0] for p in parts)})")
        return RewardResult(score=total, components=scores)


def check_reward_functions(settings: PythonRewarderSettings, sample: Prompt) -> list[str]:
    """Call each reward function once on `sample` (completion: its answer, or "" without one), in worker
    processes with its timeout, as the run would: one line per function that raised, timed out or returned
    the wrong thing, for a check before launch. A None is fine (no score for this row)."""
    if not settings.functions:
        return []
    completion = sample.answer or ""
    rollout = Rollout(prompt_id=sample.prompt_id, prompt_ids=[], completion_ids=[], logprobs=[], weight_version=0,
                      text=completion)
    checker = PythonRewarder(settings.model_copy(update={"shell": []}))
    try:
        outcomes = [(f, checker._function(f, [(sample, rollout)])[0]) for f in settings.functions]
        problems = []
        for f, outcome in outcomes:
            try:
                outcome()
            except GraderFailure as e:
                problems.append(f"{e} ({f.path}, called on a sample prompt {sample.text[:40]!r} with completion "
                                f"{completion[:40]!r})")
        return problems
    finally:
        checker.close()


Outcome = Callable[[], Score]  # a grader's score for one rollout, or `GraderFailure`
Part = tuple[str, float, Outcome]  # (label, weight, outcome)


def trl_kwargs(items: list[tuple[Prompt, Rollout]]) -> dict[str, list[Any]]:
    """The keyword arguments TRL's GRPOTrainer gives a reward function, one entry per completion: `prompts`,
    `completions` (chat prompts: as messages, the completion as `[{"role": "assistant", "content": ...}]`, as
    TRL's conversational format), `completion_ids`, and the data columns: `answer` and each `extra` column."""
    kwargs: dict[str, list[Any]] = {
        "prompts": [p.messages if p.messages else p.text for p, _ in items],
        "completions": [[{"role": "assistant", "content": r.text}] if p.messages else r.text for p, r in items],
        "completion_ids": [list(r.completion_ids) for _, r in items],
        "answer": [p.answer for p, _ in items],
    }
    columns = sorted({k for p, _ in items for k in p.extra} - set(kwargs))
    kwargs.update({k: [p.extra.get(k) for p, _ in items] for k in columns})
    return kwargs


def _one(label: str, future: Future[Any]) -> Outcome:
    return lambda: _checked(label, future, None)


def _entry(label: str, future: Future[Any], index: int) -> Outcome:
    return lambda: _checked(label, future, index)


def _checked(label: str, future: Future[Any], index: int | None) -> Score:
    """The future's score (its `index`th for a batched call): `GraderFailure` naming the function for a failed
    call or a non-finite number."""
    try:
        value = future.result()
    except CallFailed as e:
        raise GraderFailure(f"reward function {label!r} {e}") from None
    if index is not None:
        value = value[index]
    if value is not None and not math.isfinite(value):
        raise GraderFailure(f"reward function {label!r} returned {value}")
    return value  # type: ignore[no-any-return]


def _close(pool: FunctionPool | None, shell: ThreadPoolExecutor | None) -> None:
    """Stop the worker processes and shell threads; a `weakref.finalize` callback, so it holds no rewarder."""
    if pool is not None:
        pool.close()
    if shell is not None:
        shell.shutdown(wait=True, cancel_futures=True)
