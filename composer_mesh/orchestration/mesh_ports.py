"""The role protocols of `ports.py` over a launched `RoleMesh`: thin adapters, the only part of the loop that
holds Monarch handles.

`MeshRoles` owns the `Recovery` of the run and the handles it refreshes: a call that fails because its proc
died is re-issued (same inputs) once `Recovery` has replaced the role's mesh and `MeshRoles` has set the new
actors up (models built, the generators' current weights pulled).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from composer_mesh.actors.messages import (
    GenerationRequest,
    RolloutGroup,
    ScoredGroup,
    SelfTeacherRequest,
    TeacherRequest,
    TeacherSignals,
    TokenDistribution,
    WeightVersion,
)
from composer_mesh.actors.teacher_errors import TeacherFailed
from composer_mesh.mesh.weights.manifest import WeightManifest
from composer_mesh.orchestration.metrics import MetricsWriter
from composer_mesh.orchestration.recovery import Recovery
from composer_mesh.roles import RoleMesh

log = logging.getLogger("composer_mesh.loop")


async def build(actors: dict[str, Any]) -> None:
    """Build the models of new role actors (by role): the roles whose `setup` does (the rewarder needs none)."""
    await asyncio.gather(*(actors[role].setup.call() for role in ("generators", "teachers") if role in actors))


class MeshGenerators:
    """`ports.Generators` over the generators role: one handle per proc, the weights they hold (a replacement
    pulls them) and how each one's weights arrive (`links`: its latest answer naming a transport)."""

    def __init__(self, mesh: RoleMesh, recovery: Recovery) -> None:
        self.mesh = mesh
        self.recovery = recovery
        self.procs = mesh.procs("generators")
        self.manifest: WeightManifest | None = None  # the weights the generators hold
        self.links: dict[str, WeightVersion] = {}

    def __len__(self) -> int:
        return len(self.procs)

    def refresh(self) -> None:
        """The generators' mesh was replaced: new handles."""
        self.procs = self.mesh.procs("generators")

    async def setup(self) -> None:
        await self.mesh.generators.setup.call()

    async def generate(self, index: int, request: GenerationRequest) -> list[RolloutGroup]:
        return await self.recovery.attempt("generators", lambda: self.procs[index].generate.call_one(request))

    async def generate_versioned(self, index: int, request: GenerationRequest) -> tuple[int, list[RolloutGroup]]:
        async def versioned() -> tuple[int, list[RolloutGroup]]:
            gen = self.procs[index]
            version = await gen.version.call_one()  # applies any pulled weights first
            return version, await gen.generate.call_one(request)

        return await self.recovery.attempt("generators", versioned)

    async def distributions(self, index: int, request: SelfTeacherRequest) -> tuple[
            int, list[TokenDistribution | None]]:
        return await self.recovery.attempt("generators", lambda: self.procs[index].distributions.call_one(request))

    async def update_weights(self, manifest: WeightManifest) -> None:
        self.manifest = manifest  # a generator replaced from now on pulls these weights
        self.heard(await self.recovery.attempt(
            "generators", lambda: self.mesh.generators.update_weights.call(manifest)))

    async def load_weights(self, manifest: WeightManifest) -> None:
        self.manifest = manifest
        self.heard(await self.mesh.generators.update_weights.call(manifest))

    def heard(self, answers: Any) -> None:
        """Keep each generator's transport from its `update_weights` answers (a value mesh of `WeightVersion`)."""
        for answer in answers.values():
            if answer.transport:
                self.links[answer.generator] = answer


class MeshRewarder:
    """`ports.Rewarder` over the rewarder role's actors, taken round-robin."""

    def __init__(self, mesh: RoleMesh, recovery: Recovery) -> None:
        self.mesh = mesh
        self.recovery = recovery
        self.procs = mesh.procs("rewarder")
        self._next = 0

    def refresh(self) -> None:
        self.procs = self.mesh.procs("rewarder")

    def _rewarder(self) -> Any:
        self._next = (self._next + 1) % len(self.procs)
        return self.procs[self._next]

    async def score(self, groups: list[RolloutGroup]) -> list[ScoredGroup]:
        return await self.recovery.attempt("rewarder", lambda: self._rewarder().score.call_one(groups))  # type: ignore[no-any-return]


class MeshTeachers:
    """`ports.Teachers` over the teacher pool (every proc hosts some members; each answers for its own)."""

    def __init__(self, mesh: RoleMesh, recovery: Recovery) -> None:
        self.mesh = mesh
        self.recovery = recovery
        self.pool = mesh.teachers

    def refresh(self) -> None:
        """The teachers' mesh was replaced (and its actors set up): the new pool."""
        self.pool = self.mesh.teachers

    async def setup(self) -> None:
        await self.pool.setup.call()

    async def signals(self, request: TeacherRequest) -> list[TeacherSignals]:
        try:
            answers = await self.recovery.attempt("teachers", lambda: self.pool.signals.call(request))
        except Exception as e:  # `on_failure: stop`: the teacher's own error, without Monarch's wrapper
            if isinstance(getattr(e, "exception", None), TeacherFailed):
                raise e.exception from None  # type: ignore[attr-defined]
            raise
        return list(answers.values())


class MeshSpares:
    """`ports.SpareMeshes` over the launcher's warm spares."""

    def __init__(self, mesh: RoleMesh) -> None:
        self.mesh = mesh

    def meshes(self) -> set[str]:
        return {self.mesh.mesh_of(r) for r in ("generators", "rewarder", "teachers") if self.mesh.has(r)}  # type: ignore[arg-type]

    def wants_spare(self, mesh: str) -> bool:
        spec = self.mesh.launched.specs[mesh]
        return bool(spec.spare) and "trainer" not in self.mesh.roles_on(mesh) and not self.mesh.launched.has_spare(mesh)

    async def prepare(self, mesh: str) -> None:
        t0 = time.perf_counter()
        procs, actors = await self.mesh.launched.spawn_spare(mesh)
        t1 = time.perf_counter()
        await build(actors)
        self.mesh.launched.keep_spare(mesh, (procs, actors))
        log.info("warm spare for mesh %s ready in %.1f s (procs %.1f s, set up %.1f s)", mesh,
                 time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1)


class MeshRoles:
    """The run's role adapters and their `Recovery`. `replaced(meshes)`: called once a mesh's replacement is set
    up (the loop prepares its next warm spare)."""

    def __init__(self, mesh: RoleMesh, max_restarts: int, replaced: Callable[[set[str]], None]) -> None:
        self.mesh = mesh
        self._replaced = replaced
        self.recovery = Recovery(mesh, max_restarts, self._set_up)
        self.generators = MeshGenerators(mesh, self.recovery)
        # optional roles: a multi-turn run has no rewarder (its environment scores), a run may have no teachers
        self.rewarder = MeshRewarder(mesh, self.recovery) if mesh.has("rewarder") else None
        self.teachers = MeshTeachers(mesh, self.recovery) if mesh.has("teachers") else None  # optional role

    async def setup(self) -> None:
        """Build the generators' and teachers' models."""
        await asyncio.gather(self.generators.setup(), *([self.teachers.setup()] if self.teachers else []))

    async def _set_up(self, roles: list[str], warm: bool = False) -> None:
        """Build replaced role actors (`Recovery`; a warm spare's are built already): generators also pull the
        weights the others hold. Then a new spare is prepared for the mesh if it keeps one."""
        if not warm:
            await build({role: getattr(self.mesh, role) for role in roles})
        if "generators" in roles:
            self.generators.refresh()
            self.generators.heard(await self.mesh.generators.update_weights.call(self.generators.manifest))
        if "rewarder" in roles and self.rewarder is not None:
            self.rewarder.refresh()
        if "teachers" in roles and self.teachers is not None:
            self.teachers.refresh()
        if roles:
            self._replaced({self.mesh.mesh_of(roles[0])})  # type: ignore[arg-type]

    def forgive_idle_deaths(self, writer: MetricsWriter) -> None:
        """A generators/rewarder/teachers proc that died after its last call cost the run nothing: it is
        recorded (event `died_idle`) and not raised when the launch block ends. The trainer's death always is."""
        for failure in self.mesh.failures:
            if "trainer" not in self.mesh.roles_on(failure.mesh):
                writer.write_event("died_idle", mesh=failure.mesh, actor=failure.actor)
                self.mesh.launched.give_up(failure.mesh)
