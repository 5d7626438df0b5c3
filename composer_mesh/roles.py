"""The four roles of a run, in one place: their names, the actor each spawns and the built-in bindings it
can be bound to; and `RoleMesh`, the typed handles a launched topology yields.

Adding a built-in binding is one entry in `ROLE_TABLE` (its class by import path, its settings and capabilities
from its room's `config.py`); a binding outside the package is named in the topology by import path and needs no
line here. Actor and built-in binding classes are named by import path, and their settings come from import-cheap
config modules, so that validating a topology imports neither Monarch nor torch; the classes are imported where
they run, when a topology is launched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from composer_mesh.actors.backends.generation.config import (
    HF_GENERATOR_CAPABILITIES,
    VLLM_GENERATOR_CAPABILITIES,
    HFGeneratorSettings,
    VLLMGeneratorSettings,
)
from composer_mesh.actors.backends.rewards.config import (
    PYTHON_REWARDER_CAPABILITIES,
    REWARD_MODEL_CAPABILITIES,
    PythonRewarderSettings,
    RewardModelSettings,
)
from composer_mesh.actors.backends.teachers.config import (
    HF_TEACHER_CAPABILITIES,
    OPENROUTER_CAPABILITIES,
    VLLM_TEACHER_CAPABILITIES,
    HFTeacherSettings,
    OpenRouterSettings,
    VLLMTeacherSettings,
)
from composer_mesh.actors.backends.trainer.config import HF_TRAINER_CAPABILITIES, HFTrainerSettings
from composer_mesh.bindings import Binding, BuiltinBinding
from composer_mesh.bindings import resolve_binding as _resolve

if TYPE_CHECKING:
    from composer_mesh.actors.generator import GeneratorActor
    from composer_mesh.actors.rewarder import RewarderActor
    from composer_mesh.actors.teachers import TeacherPoolActor
    from composer_mesh.actors.trainer import TrainerActor
    from composer_mesh.mesh.launch import ActorFailure, LaunchedMeshes, PlacedActor

Role = Literal["trainer", "generators", "rewarder", "teachers"]
ROLES: tuple[Role, ...] = ("trainer", "generators", "rewarder", "teachers")


@dataclass(frozen=True)
class RoleEntry:
    """One role: the actor class spawned on every proc of its mesh (constructed with the role's config from
    `composer_mesh.actors.configs`), and the built-in binding names (teachers: of each pool member) with
    the classes they stand for."""

    actor: str  # "module:Class"
    bindings: Mapping[str, BuiltinBinding]


# Teacher capabilities: "distill" = per-token distributions over the student's tokens (channel 2, needs the
# student's tokenizer); "replay" = full traces (channel 3).
ROLE_TABLE: dict[Role, RoleEntry] = {
    "trainer": RoleEntry(
        actor="composer_mesh.actors.trainer:TrainerActor",
        bindings={
            "hf": BuiltinBinding(
                "composer_mesh.actors.backends.trainer.hf_trainer:HFTrainer",
                HFTrainerSettings, HF_TRAINER_CAPABILITIES,
            ),
        },
    ),
    "generators": RoleEntry(
        actor="composer_mesh.actors.generator:GeneratorActor",
        bindings={
            "hf": BuiltinBinding(
                "composer_mesh.actors.backends.generation.hf_generator:HFGenerator",
                HFGeneratorSettings, HF_GENERATOR_CAPABILITIES,
            ),
            "vllm": BuiltinBinding(
                "composer_mesh.actors.backends.generation.vllm_generator:VLLMGenerator",
                VLLMGeneratorSettings, VLLM_GENERATOR_CAPABILITIES,
            ),
        },
    ),
    "rewarder": RoleEntry(
        actor="composer_mesh.actors.rewarder:RewarderActor",
        bindings={
            "python": BuiltinBinding(
                "composer_mesh.actors.backends.rewards.rewards:PythonRewarder",
                PythonRewarderSettings, PYTHON_REWARDER_CAPABILITIES,
            ),
            "reward_model": BuiltinBinding(
                "composer_mesh.actors.backends.rewards.reward_model:RewardModelRewarder",
                RewardModelSettings, REWARD_MODEL_CAPABILITIES,
            ),
        },
    ),
    "teachers": RoleEntry(
        actor="composer_mesh.actors.teachers:TeacherPoolActor",
        bindings={
            "hf": BuiltinBinding(
                "composer_mesh.actors.backends.teachers.hf_teacher:HFTeacher",
                HFTeacherSettings, HF_TEACHER_CAPABILITIES,
            ),
            "vllm": BuiltinBinding(
                "composer_mesh.actors.backends.teachers.vllm_teacher:VLLMTeacher",
                VLLMTeacherSettings, VLLM_TEACHER_CAPABILITIES,
            ),
            "openrouter": BuiltinBinding(
                "composer_mesh.actors.backends.teachers.openrouter:OpenRouterTeacher",
                OpenRouterSettings, OPENROUTER_CAPABILITIES,
            ),
        },
    ),
}


def resolve_binding(role: Role, name: str) -> Binding:
    """The binding class a role's `binding:` names (a built-in of `ROLE_TABLE` or an import path)."""
    return _resolve(role, name, ROLE_TABLE[role].bindings)


class RoleMesh:
    """What `launch(topology)` yields: the role actor meshes by role, typed, over the launched meshes.

    `trainer`, `generators`, `rewarder`, `teachers` span all procs of their role's mesh; call endpoints on
    them as usual (`await h.ep.call(...)`, `.call_one` on one proc). `procs(role)` gives one handle per proc,
    for loops that address actors one by one.
    """

    def __init__(self, launched: LaunchedMeshes, run_name: str, procs_per_replica: int = 1) -> None:
        self.launched = launched
        self.run_name = run_name
        self.procs_per_replica = procs_per_replica  # the trainer's: procs that train one replica together

    def _role(self, role: Role) -> Any:
        try:
            return self.launched.actors[role]
        except KeyError:
            raise LookupError(
                f"topology {self.run_name!r} declares no {role!r} role "
                f"(it has: {', '.join(self.launched.actors) or 'none'})"
            ) from None

    @property
    def trainer(self) -> TrainerActor:
        return self._role("trainer")  # type: ignore[no-any-return]

    @property
    def generators(self) -> GeneratorActor:
        return self._role("generators")  # type: ignore[no-any-return]

    @property
    def rewarder(self) -> RewarderActor:
        return self._role("rewarder")  # type: ignore[no-any-return]

    @property
    def teachers(self) -> TeacherPoolActor:
        return self._role("teachers")  # type: ignore[no-any-return]

    def has(self, role: Role) -> bool:
        return role in self.launched.actors

    @property
    def roles(self) -> dict[str, PlacedActor]:
        """Where each launched role runs (mesh, backend, shape, actor class)."""
        return dict(self.launched.placements)

    def procs(self, role: Role) -> list[Any]:
        """One handle per actor of `role`, in (host, proc) order."""
        self._role(role)
        return self.launched.per_proc(role)

    def mesh_of(self, role: Role) -> str:
        """The mesh `role` runs on."""
        self._role(role)
        return self.launched.placements[role].mesh

    def roles_on(self, mesh: str) -> list[str]:
        """The roles that share mesh `mesh` (they are replaced together)."""
        return self.launched.actors_on(mesh)

    async def respawn(self, role: Role) -> tuple[list[str], bool]:
        """Replace the procs of `role`'s mesh after one died, with every role on it (`LaunchedMeshes.respawn`);
        returns the roles replaced (their handles are new) and whether a warm spare took over (then they are
        set up already; otherwise they need their `setup` again)."""
        return await self.launched.respawn(self.mesh_of(role))

    @property
    def failures(self) -> list[ActorFailure]:
        """Failures recorded so far; each names its role (`actor`) and mesh."""
        return self.launched.failures

    def check(self) -> None:
        """Raise `MeshFailureError` if any actor or proc has failed."""
        self.launched.check()

    def __repr__(self) -> str:
        placed = ", ".join(f"{r}@{p.mesh}" for r, p in self.launched.placements.items())
        return f"RoleMesh({self.run_name!r}: {placed})"
