"""A pool of teachers of mixed bindings behind one request: channel-2 distributions and channel-3 traces.

Distill teachers share the student's tokenizer; rollouts are spread over them round-robin (one teacher per
rollout). Every replay teacher gives one trace per prompt (N-teacher trace replay). Teachers are queried
concurrently, and a failing teacher costs only its own signals: the failure is counted and reported.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from composer_mesh.actors.backends.base import TeacherBackend
from composer_mesh.actors.messages import TeacherRequest, TeacherSignals, TeacherTrace, TokenDistribution

log = logging.getLogger(__name__)


@dataclass
class PoolMember:
    name: str
    channels: frozenset[str]
    backend: TeacherBackend


@dataclass
class TeacherPool:
    members: list[PoolMember]
    failures: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [m.name for m in self.members]
        if len(set(names)) != len(names):
            raise ValueError(f"teacher names must be unique, got {names}")
        for m in self.members:
            missing = m.channels - frozenset(getattr(m.backend, "capabilities", frozenset()))
            if missing:
                raise ValueError(f"teacher {m.name!r} is asked for channels {sorted(missing)} its binding cannot supply")

    @property
    def distill(self) -> list[PoolMember]:
        return [m for m in self.members if "distill" in m.channels]

    @property
    def replay(self) -> list[PoolMember]:
        return [m for m in self.members if "replay" in m.channels]

    def start(self, student_model: Any) -> None:
        """Start every member; a `distill` member whose tokenizer is not the student's fails here, at setup
        (its `check_distill`), instead of failing every later call while the run goes on without channel 2."""
        for m in self.members:
            m.backend.start(student_model, m.name)
            check = getattr(m.backend, "check_distill", None)
            if "distill" in m.channels and check is not None:
                check()

    def _failed(self, member: PoolMember, what: str, error: BaseException) -> None:
        self.failures[member.name] = self.failures.get(member.name, 0) + 1
        log.warning("teacher %s failed to give %s: %s: %s", member.name, what, type(error).__name__, error)

    async def _distributions(self, request: TeacherRequest) -> list[TokenDistribution | None]:
        out: list[TokenDistribution | None] = [None] * len(request.rollouts)
        teachers = self.distill
        if not teachers or not request.rollouts:
            return out
        assigned = [list(range(i, len(request.rollouts), len(teachers))) for i in range(len(teachers))]

        async def ask(member: PoolMember, rows: list[int]) -> None:
            if not rows:
                return
            try:
                dists = await member.backend.distributions([request.rollouts[i] for i in rows], request.top_k)
            except Exception as e:
                self._failed(member, "distributions", e)
                return
            for i, d in zip(rows, dists):
                out[i] = d

        await asyncio.gather(*(ask(m, rows) for m, rows in zip(teachers, assigned)))
        return out

    async def _traces(self, request: TeacherRequest) -> list[TeacherTrace]:
        if not request.prompts:
            return []

        async def ask(member: PoolMember) -> list[TeacherTrace]:
            try:
                return await member.backend.traces(request.prompts, request.max_new_tokens, seed=request.seed)
            except Exception as e:
                self._failed(member, "traces", e)
                return []

        results = await asyncio.gather(*(ask(m) for m in self.replay))
        return [t for traces in results for t in traces]

    async def signals(self, request: TeacherRequest) -> TeacherSignals:
        dists, traces = await asyncio.gather(self._distributions(request), self._traces(request))
        return TeacherSignals(distributions=dists, traces=traces, usage=self.usage())

    def usage(self) -> dict[str, float]:
        """Per-teacher counters, flattened as `<teacher>/<counter>` for the run's metrics."""
        out: dict[str, float] = {}
        for m in self.members:
            for k, v in m.backend.usage().items():
                out[f"{m.name}/{k}"] = float(v)
            out[f"{m.name}/failures"] = float(self.failures.get(m.name, 0))
        return out
