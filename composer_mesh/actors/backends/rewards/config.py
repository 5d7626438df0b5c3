"""The rewarder bindings' settings (`PythonRewarderSettings`: reward functions and shell graders): import-cheap,
so that validating a topology imports neither the worker pool nor the binding (`roles.ROLE_TABLE` names it by
import path and its settings from here). Validation does import each reward function (`path`) to check it is
callable."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from composer_mesh.bindings import import_object

PYTHON_REWARDER_CAPABILITIES: frozenset[str] = frozenset()


class FunctionReward(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Import path 'pkg.mod:fn' of `fn(prompt, completion, answer) -> float`; a function "
                      "with an `extra` parameter also gets the prompt's extra data columns (`run.data.extra`).")
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a call may take before its worker process is killed and the call scored as a failure.",
    )

    @field_validator("path")
    @classmethod
    def _importable(cls, v: str) -> str:
        fn = import_object(v)
        if not callable(fn):
            raise ValueError(f"reward function {v!r} is not callable")
        return v

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
