"""A teacher binding whose failures are scripted, for the teacher-failure tests (plain pool and real actor mesh).

Importable by path (`tests.actors.teacher_pool.scripted_teachers:ScriptedTeacher`, the repo root is on the procs'
path) because a Monarch proc builds the binding from its import path. No model: distributions are zeros, traces
fixed text.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from composer_mesh.actors.messages import Prompt, Rollout, TeacherTrace, TokenDistribution
from composer_mesh.actors.teacher_errors import TeacherUnavailable
from composer_mesh.actors.teacher_topk import TopK

VOCAB = 14


class ScriptedSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fail: Literal["never", "unavailable", "bug"] = Field("never", description="How calls fail.")
    fail_calls: int | None = Field(None, ge=0, description="Only the first n calls fail (None: every call).")


class ScriptedTeacher:
    """Both channels; `fail: unavailable` raises `TeacherUnavailable` (an expected failure, e.g. an HTTP 503),
    `fail: bug` raises a `TypeError` (a programming error in a binding)."""

    Settings: ClassVar[type[BaseModel]] = ScriptedSettings
    capabilities: ClassVar[frozenset[str]] = frozenset({"distill", "replay"})

    def __init__(self, settings: ScriptedSettings | None = None) -> None:
        self.settings = settings or ScriptedSettings()
        self.name = "scripted"
        self.calls = 0
        self.trace_seeds: list[list[int] | None] = []  # the `seeds` of each traces call

    def start(self, student_model: Any, name: str) -> None:
        self.name = name

    async def distributions(self, rollouts: list[Rollout], top_k: TopK) -> list[TokenDistribution]:
        self._maybe_fail("distributions")
        return [TokenDistribution(self.name, logits=torch.zeros(len(r.completion_ids), VOCAB)) for r in rollouts]

    async def traces(self, prompts: list[Prompt], max_new_tokens: int, seed: int | None = None,
                     seeds: list[int] | None = None) -> list[TeacherTrace]:
        self._maybe_fail("traces")
        self.trace_seeds.append(seeds)
        return [TeacherTrace(self.name, p.prompt_id, "7;", [7, 13]) for p in prompts]

    def usage(self) -> dict[str, float]:
        return {"calls": float(self.calls)}

    def _maybe_fail(self, what: str) -> None:
        self.calls += 1
        s = self.settings
        if s.fail == "never" or (s.fail_calls is not None and self.calls > s.fail_calls):
            return
        if s.fail == "unavailable":
            raise TeacherUnavailable(f"teacher {self.name!r}: HTTP 503 from the provider (scripted) in {what}")
        raise TypeError(f"scripted bug in {what}: unsupported operand type(s)")
