"""Reward functions by import path plus shell graders, combined as a weighted sum.

A grader that crashes, hangs past its timeout or prints garbage scores `failure_score` with `ok=False`
and an error saying what happened; it never raises into the actor. Python functions run in worker
processes (`reward_pool`), since only a process can be killed at a timeout; shell graders are
subprocesses. Every (rollout, grader) pair of a batch is submitted at once, so graders run concurrently.
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

from pydantic import BaseModel

from composer_mesh.actors.backends.rewards.config import (
    PYTHON_REWARDER_CAPABILITIES,
    PythonRewarderSettings,
    ShellGrader,
)
from composer_mesh.actors.backends.rewards.reward_pool import CallFailed, FunctionPool
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
        """Score many rollouts: every (rollout, grader) call is submitted before any is waited for."""
        pending = [self._submit(prompt, rollout) for prompt, rollout in items]
        results = [self._combine(parts) for parts in pending]
        with self._count_lock:
            self.calls += len(results)
            self.failures += sum(not r.ok for r in results)
        return results

    def _submit(self, prompt: Prompt, rollout: Rollout) -> list[tuple[str, float, Future[float]]]:
        """(label, weight, future score) of each grader for one rollout; the futures raise `GraderFailure`."""
        args = (prompt.text, rollout.text, prompt.answer)
        parts = []
        for f in self.settings.functions:
            assert self.pool is not None
            parts.append((f.name, f.weight, self.pool.submit(f.path, args, f.timeout_s, prompt.extra)))
        for grader in self.settings.shell:
            assert self._shell is not None
            parts.append((grader.label, grader.weight,
                          self._shell.submit(run_shell_grader, grader, *args, extra=prompt.extra)))
        return parts

    def _combine(self, parts: list[tuple[str, float, Future[float]]]) -> RewardResult:
        total, scores, errors = 0.0, {}, []
        for label, weight, future in parts:
            try:
                value = _finite(label, future)
            except GraderFailure as e:
                errors.append(str(e))
                value = self.settings.failure_score
            scores[label] = value
            total += weight * value
        if errors:
            return RewardResult(score=total, ok=False, error="; ".join(errors), components=scores)
        return RewardResult(score=total, components=scores)


def _finite(label: str, future: Future[float]) -> float:
    """The future's score; `GraderFailure` naming the function for a failed call or a non-finite number."""
    try:
        value = future.result()
    except CallFailed as e:
        raise GraderFailure(f"reward function {label!r} {e}") from None
    if not math.isfinite(value):
        raise GraderFailure(f"reward function {label!r} returned {value}")
    return value


def _close(pool: FunctionPool | None, shell: ThreadPoolExecutor | None) -> None:
    """Stop the worker processes and shell threads; a `weakref.finalize` callback, so it holds no rewarder."""
    if pool is not None:
        pool.close()
    if shell is not None:
        shell.shutdown(wait=True, cancel_futures=True)
