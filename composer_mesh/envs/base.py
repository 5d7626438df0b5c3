"""What an environment gives the controller's prompt source (`Environment`)."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from composer_mesh.errors import UserInputError
from composer_mesh.tasks.data import DataRow


class EnvironmentConfigError(UserInputError, ValueError):
    """A `run.environment` section the library refuses: an unknown dataset name, a config it rejects."""


class EnvironmentStateError(ValueError):
    """A checkpointed stream position that belongs to another environment (its settings or library changed)."""


class StreamPosition:
    """The state of an environment's train stream: `position` (entries drawn, `skipped` ones included: those left
    out because they ask an eval prompt) under a `digest` of what the stream draws from, so that a checkpoint of
    another environment is refused rather than continued at a meaningless position."""

    name: str
    digest: str
    position: int = 0
    skipped: int = 0
    changed: ClassVar[str] = "run.environment or the seed changed"  # why digests differ, said in the refusal

    def state(self) -> dict[str, Any]:
        return {"environment": self.name, "digest": self.digest, "position": self.position, "skipped": self.skipped}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("digest") != self.digest:
            raise EnvironmentStateError(
                f"the checkpoint's prompts are {state.get('environment')} (digest {state.get('digest')}), this run's "
                f"{self.name} (digest {self.digest}): {self.changed}")
        self.position, self.skipped = int(state["position"]), int(state.get("skipped", 0))


class Environment(Protocol):
    """A train stream of rows (drawn in order; the position is the whole state) and a fixed eval set of rows
    that share no question with it. A row's `extra` is JSON and carries what the reward function needs."""

    name: str

    def train_rows(self, n: int) -> list[DataRow]:
        """The next `n` rows of the train stream (endless: it starts over after the last entry)."""

    def eval_rows(self, n: int) -> list[DataRow]:
        """The first `n` rows of the eval set (fewer if it is smaller), the same on every call."""

    def state(self) -> dict[str, Any]:
        """The train stream's position and an identity of the environment, JSON-able."""

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()`; `EnvironmentStateError` if it is another environment's."""

    def close(self) -> None:
        """Release what the environment started (e.g. an OpenEnv server), so it does not outlive the run;
        idempotent."""

