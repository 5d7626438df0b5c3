"""RewarderActor: scores rollout groups with its binding. Grader failures come back as data."""

from __future__ import annotations

import asyncio

from monarch.actor import Actor, endpoint

from composer_mesh.actors.backends.base import RewardBackend
from composer_mesh.actors.messages import RolloutGroup, ScoredGroup
from composer_mesh.mesh.launch import RoleConfig


def score_groups(backend: RewardBackend, groups: list[RolloutGroup]) -> list[ScoredGroup]:
    return [ScoredGroup(group=g, rewards=[backend.score(g.prompt, r) for r in g.rollouts]) for g in groups]


class RewarderActor(Actor):
    def __init__(self, config: RoleConfig) -> None:
        self.backend: RewardBackend = config.topology.rewarder.build()

    @endpoint
    async def ready(self) -> bool:
        """Answered once `__init__` succeeded: the launcher waits for it on every actor."""
        return True

    @endpoint
    async def score(self, groups: list[RolloutGroup]) -> list[ScoredGroup]:
        # Graders may be subprocesses: keep them off the actor's event loop.
        return await asyncio.to_thread(score_groups, self.backend, groups)

    @endpoint
    async def stats(self) -> dict[str, float]:
        return {k: float(getattr(self.backend, k)) for k in ("calls", "failures") if hasattr(self.backend, k)}
