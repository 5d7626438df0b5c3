"""RewarderActor: scores rollout groups with its binding. Grader failures come back as data."""

from __future__ import annotations

import asyncio

from monarch.actor import endpoint

from composer_mesh.actors.backends.rewards.base import RewardBackend
from composer_mesh.actors.configs import RewarderConfig
from composer_mesh.actors.messages import RolloutGroup, ScoredGroup
from composer_mesh.actors.role_actor import RoleActor


def score_groups(backend: RewardBackend, groups: list[RolloutGroup]) -> list[ScoredGroup]:
    """All rollouts of the request in one `score_batch` call where the binding has one (its graders then
    run concurrently), else one `score` call per rollout."""
    pairs = [(g.prompt, r) for g in groups for r in g.rollouts]
    score_batch = getattr(backend, "score_batch", None)
    rewards = score_batch(pairs) if score_batch is not None else [backend.score(p, r) for p, r in pairs]
    scored, start = [], 0
    for g in groups:
        scored.append(ScoredGroup(group=g, rewards=rewards[start : start + len(g.rollouts)]))
        start += len(g.rollouts)
    return scored


class RewarderActor(RoleActor[RewardBackend]):
    """One rewarder per proc of the rewarder mesh; its binding is cheap to build, so `__init__` builds it."""

    def __init__(self, config: RewarderConfig) -> None:
        super().__init__()
        self._service = config.binding.build()

    @endpoint
    async def score(self, groups: list[RolloutGroup]) -> list[ScoredGroup]:
        # Graders are subprocesses and worker processes we wait for: keep them off the actor's event loop.
        return await asyncio.to_thread(score_groups, self.service, groups)

    @endpoint
    async def stats(self) -> dict[str, float]:
        backend = self.service
        return {k: float(getattr(backend, k)) for k in ("calls", "failures") if hasattr(backend, k)}

    async def __cleanup__(self, exc: Exception | None) -> None:
        """Monarch calls this when the actor stops: stop the binding's worker processes, if it has any."""
        close = getattr(self._service, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
