"""What the rewarder actor needs of its binding (a plain class, no Monarch): `RewardBackend`."""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel

from composer_mesh.actors.messages import Prompt, RewardResult, Rollout


@runtime_checkable
class RewardBackend(Protocol):
    Settings: ClassVar[type[BaseModel]]

    def score(self, prompt: Prompt, rollout: Rollout) -> RewardResult:
        """Never raises for a grader failure: returns `RewardResult(ok=False, error=...)`."""
