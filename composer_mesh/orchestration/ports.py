"""What the loop's components need of the roles, as typed protocols.

The components (rollout drivers, scoring, the train pipeline, checkpoint commits, evaluation, spares) never
touch a `RoleMesh` or a Monarch handle: they are given objects of these protocols. `mesh_ports.py` implements
them over the launched meshes (each call re-issued on a replacement through `Recovery`); unit tests implement
them with a few lines of plain Python (tests/orchestration/fakes.py).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

from composer_mesh.actors.messages import (
    GenerationRequest,
    RolloutGroup,
    ScoredGroup,
    SelfTeacherRequest,
    TeacherRequest,
    TeacherSignals,
    TokenDistribution,
    TrainBatch,
    TrainMetrics,
)
from composer_mesh.mesh.weights.manifest import WeightManifest


class RestartsExhausted(RuntimeError):
    """A role's procs died more often than `run.max_restarts` allows (or hold the trainer): the run stops.
    Raised by the role adapters' calls (`Recovery`); a component that gets it asks the run to stop."""


class Generators(Protocol):
    """The generator actors, addressed one by one (`index` in 0..len-1); calls survive a proc's replacement."""

    def __len__(self) -> int: ...

    async def generate(self, index: int, request: GenerationRequest) -> list[RolloutGroup]:
        """One request on generator `index` (re-issued, same inputs, if its proc dies meanwhile)."""
        ...

    async def generate_versioned(self, index: int, request: GenerationRequest) -> tuple[int, list[RolloutGroup]]:
        """Like `generate`, with the weight version generator `index` sampled with (pulled weights applied first)."""
        ...

    async def distributions(self, index: int, request: SelfTeacherRequest) -> tuple[
            int, list[TokenDistribution | None]]:
        """Generator `index`'s policy as a teacher: its distributions over each continuation (None where one does
        not fit the model's context) and the weight version that gave them (re-issued on a replacement, like
        `generate`)."""
        ...

    async def update_weights(self, manifest: WeightManifest) -> None:
        """Every generator pulls `manifest` (a replaced generator pulls it too); `RestartsExhausted` when the
        generators cannot be replaced any more."""
        ...

    async def load_weights(self, manifest: WeightManifest) -> None:
        """Every generator pulls `manifest` at setup or resume (not re-issued: a death there fails the run)."""
        ...


class Rewarder(Protocol):
    async def score(self, groups: list[RolloutGroup]) -> list[ScoredGroup]:
        """Score `groups` (the rewarder actors take requests round-robin; re-issued on a replacement)."""
        ...


class Teachers(Protocol):
    async def signals(self, request: TeacherRequest) -> list[TeacherSignals]:
        """Each teacher-pool proc's answer to `request` (merge them with `scoring.merge_signals`). A teacher's
        own failure (`TeacherFailed`, `on_failure: stop`) is raised as itself."""
        ...


class Trainers(Protocol):
    """The trainer replicas, each a lane of calls kept in its mailbox order (`replicas.TrainerReplicas`)."""

    def __len__(self) -> int: ...

    def train(self, step: int, batches: list[TrainBatch]) -> list[Coroutine[Any, Any, tuple[TrainMetrics, WeightManifest]]]:
        """Send train step `step` to every replica now (replica i trains `batches[i]`); their answers."""
        ...

    def save_state(self, step: int, urls: list[str]) -> list[Coroutine[Any, Any, str]]:
        """Send every replica a background state write to `urls[i]`, right behind step `step`; their answers."""
        ...

    def reported(self, urls: list[str]) -> None:
        """The replicas reported these state writes finished."""
        ...

    async def each(self, endpoint: str, *args: Any) -> list[Any]:
        """Call `endpoint(*args)` on every replica, answers in replica order."""
        ...


class SpareMeshes(Protocol):
    """Where warm spares come from (`LaunchedMeshes`): which meshes want one, and making one ready."""

    def meshes(self) -> set[str]:
        """The meshes of the roles that are replaced when a proc dies (generators, rewarder, teachers)."""
        ...

    def wants_spare(self, mesh: str) -> bool:
        """`mesh` keeps a spare (`MeshSpec.spare`), holds no trainer, and has none ready or being prepared."""
        ...

    async def prepare(self, mesh: str) -> None:
        """Spawn a spare of `mesh`, set its actors up (models built) and keep it for the next replacement."""
        ...
