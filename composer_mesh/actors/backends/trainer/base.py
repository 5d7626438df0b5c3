"""What the trainer actor needs of its binding (a plain class, no Monarch): `TrainerBackend`.

`TrainerService` (`actors/trainer.py`) owns one backend per trainer proc and calls nothing else on it, so a new
trainer (e.g. one replica sharded over several procs with FSDP2) is a new binding of this protocol, not a change
to the actor. The weight version is not the binding's: the service's weight publisher counts versions and hands
the published one to `save_checkpoint`.

Where a binding runs: a trainer replica is `procs_per_replica` procs of the trainer mesh (`TrainerConfig`), and
the mesh holds `replicas x procs_per_replica` procs; the actor gives `start` the proc's replica and, for a replica
of several procs, the proc's `ShardGroup` (its rank in the replica and where the ranks meet). Such a binding is
SPMD: every rank gets every call, with the same arguments, in the same order (the controller sends each replica's
calls to all its ranks and reads rank 0's answer). `named_weights` are the full tensors on every rank (gathered:
a collective), and the state is one snapshot per rank (`url/rank<r>`). Capability `sharded` says a binding can.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from pydantic import BaseModel

from composer_mesh.actors.messages import TrainBatch, TrainMetrics
from composer_mesh.errors import UserInputError

OnNonFinite = Literal["stop", "skip"]


class NonFiniteError(UserInputError):
    """A step whose loss or gradient is not finite, under `run.on_nonfinite: stop`: the update was not applied.

    A `UserInputError` (a learning rate too high, a bad row or reward, a loss setting), not a bug: the command
    line prints its one line and the last checkpoint, which is from before this step, with no traceback."""


@runtime_checkable
class TrainerBackend(Protocol):
    """Takes optimizer steps on `TrainBatch`es and hands out its weights, its full state and checkpoints."""

    Settings: ClassVar[type[BaseModel]]
    capabilities: ClassVar[frozenset[str]]

    def start(self, model_config: Any, loss: Any, temperature: float = 1.0, diloco: Any = None,
              replica_id: int = 0, shard: Any = None, on_nonfinite: OnNonFinite = "stop") -> None:
        """Build the policy (`model_config`: a `ModelConfig`), optimizer and loss state (`loss`: a `LossConfig`);
        with `diloco` (a `DiLoCoConfig`), as DiLoCo replica `replica_id`; with `shard` (a `sharding.ShardGroup`),
        as one rank of a sharded replica. Called once, on the proc's thread that then runs every other call.
        `on_nonfinite` (`run.on_nonfinite`; passed only when it is "skip"): a step whose loss or gradient is not
        finite raises `NonFiniteError` ("stop") or is counted and skipped without an optimizer step ("skip")."""

    def rejoin(self, round_id: int) -> int:
        """Right after `start`, in place of a dead DiLoCo replica: heal from the store at round `round_id`; the
        optimizer steps behind the healed weights."""

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """The tensors generators load, by the names their `weight_specs` give (published on the weight plane
        after every step; also digested to compare with the generators'). A sharded binding may read them
        lazily, one tensor at a time (`mesh.weights.plane.ShapedWeights`): then every rank reads them all."""

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        """One optimizer step on `batch`; the metrics' `weight_version` is left for the service to stamp. A
        non-finite loss or gradient never reaches the weights (`start`'s `on_nonfinite`)."""

    def snapshot_state(self, extra: dict[str, Any] | None = None) -> Any:
        """A copy of everything needed to continue training bitwise, with `extra` (JSON) stored beside it; taken
        between steps and cheap (no I/O): `write_state` writes it, off the training thread."""

    def write_state(self, url: str, snapshot: Any) -> None:
        """Write a `snapshot_state` copy under `url` (any fsspec URL). Runs on the service's writer thread while
        training goes on, so it touches only `snapshot`."""

    def load_state(self, url: str) -> dict[str, Any]:
        """Continue from a state `write_state` wrote (after `start` with the same topology); its `extra`."""

    def save_checkpoint(self, directory: Path, weight_version: int) -> Path:
        """The policy as a checkpoint others can load, stamped with the published `weight_version`."""

    def close(self) -> None:
        """Finish pending writes and release what `start` took (the service calls it once, last)."""
