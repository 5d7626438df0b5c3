"""What an environment gives the controller's prompt source (`Environment`)."""

from __future__ import annotations

from typing import Any, Protocol

from composer_mesh.tasks.data import DataRow


class EnvironmentStateError(ValueError):
    """A checkpointed stream position that belongs to another environment (its settings or library changed)."""


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

