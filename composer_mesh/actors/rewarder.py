"""RewarderActor: scores rollout groups with its binding. Grader failures come back as data."""

from __future__ import annotations

import asyncio

from monarch.actor import endpoint

from composer_mesh.actors.backends.base import RewardBackend
from composer_mesh.actors.configs import RewarderConfig
from composer_mesh.actors.messages import RolloutGroup, ScoredGroup
from composer_mesh.actors.role_actor import RoleActor


def score_groups(backend: RewardBackend, groups: list[RolloutGroup]) -> list[ScoredGroup]:
    return [ScoredGroup(group=g, rewards=[backend.score(g.prompt, r) for r in g.rollouts]) for g in groups]


class RewarderActor(RoleActor[RewardBackend]):
    """One rewarder per proc of the rewarder mesh; its binding is cheap to build, so `__init__` builds it."""

    def __init__(self, config: RewarderConfig) -> None:
        super().__init__()
        self._service = config.binding.build()

    @endpoint
    async def score(self, groups: list[RolloutGroup]) -> list[ScoredGroup]:
        # Graders may be subprocesses: keep them off the actor's event loop.
        return await asyncio.to_thread(score_groups, self.service, groups)

    @endpoint
    async def stats(self) -> dict[str, float]:
        backend = self.service
        return {k: float(getattr(backend, k)) for k in ("calls", "failures") if hasattr(backend, k)}
