"""Reward functions by import path plus shell graders, combined as a weighted sum.

A grader that crashes, hangs past its timeout or prints garbage scores `failure_score` with `ok=False`
and an error saying what happened; it never raises into the actor.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Callable
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from composer_mesh.actors.messages import Prompt, RewardResult, Rollout
from composer_mesh.bindings import import_object

RewardFn = Callable[[str, str, "str | None"], float]


class FunctionReward(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Import path 'pkg.mod:fn' of `fn(prompt, completion, answer) -> float`.")
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")

    @field_validator("path")
    @classmethod
    def _importable(cls, v: str) -> str:
        fn = import_object(v)
        if not callable(fn):
            raise ValueError(f"reward function {v!r} is not callable")
        return v


class ShellGrader(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: list[str] = Field(
        description="argv of the grader. It reads one JSON object {prompt, completion, answer} on stdin and prints "
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

    @model_validator(mode="after")
    def _something(self) -> PythonRewarderSettings:
        if not self.functions and not self.shell:
            raise ValueError("give at least one reward: `functions` (import paths) or `shell` (grader commands)")
        return self


def run_shell_grader(grader: ShellGrader, prompt: str, completion: str, answer: str | None) -> float:
    """Run one grader; raises `GraderFailure` describing a crash, timeout or unparsable output."""
    payload = json.dumps({"prompt": prompt, "completion": completion, "answer": answer})
    try:
        proc = subprocess.run(
            grader.command, input=payload, capture_output=True, text=True, timeout=grader.timeout_s, check=False
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
    """Binding `python` for the rewarder role."""

    Settings: ClassVar[type[BaseModel]] = PythonRewarderSettings
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: PythonRewarderSettings) -> None:
        self.settings = settings
        self.functions: list[tuple[str, float, RewardFn]] = [
            (f.path.rsplit(":", 1)[-1], f.weight, import_object(f.path)) for f in settings.functions
        ]
        self.calls = 0
        self.failures = 0

    def score(self, prompt: Prompt, rollout: Rollout) -> RewardResult:
        self.calls += 1
        total, parts, errors = 0.0, {}, []
        for name, weight, fn in self.functions:
            try:
                value = float(fn(prompt.text, rollout.text, prompt.answer))
                if not math.isfinite(value):
                    raise GraderFailure(f"reward function {name!r} returned {value}")
            except Exception as e:  # a user function's bug is a scored failure, not an actor crash
                errors.append(e if isinstance(e, GraderFailure) else f"reward function {name!r} raised {type(e).__name__}: {e}")
                value = self.settings.failure_score
            parts[name] = value
            total += weight * value
        for grader in self.settings.shell:
            try:
                value = run_shell_grader(grader, prompt.text, rollout.text, prompt.answer)
            except GraderFailure as e:
                errors.append(e)
                value = self.settings.failure_score
            parts[grader.label] = value
            total += grader.weight * value
        if errors:
            self.failures += 1
            return RewardResult(score=total, ok=False, error="; ".join(str(e) for e in errors), components=parts)
        return RewardResult(score=total, components=parts)
