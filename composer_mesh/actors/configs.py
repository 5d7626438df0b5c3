"""What each role actor is constructed with: exactly the sections it needs, never the whole topology.

Import-cheap (pydantic configs and dataclasses only): the topology builds these in the controller and the
launcher hands one to every actor of the role (`ActorClass(config)`); Monarch pickles it to the procs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from composer_mesh.bindings import BoundBinding
from composer_mesh.loss.config import LossConfig
from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.models.config import LoraConfig, ModelConfig


@dataclass(frozen=True)
class RoleConfig:
    """What every role actor gets: which role it plays (a name of `composer_mesh.roles.ROLES`) and on which mesh."""

    role: str
    mesh: str


@dataclass(frozen=True)
class TrainerConfig(RoleConfig):
    """The trainer: its binding, the policy model, the loss, the weight plane and (with replicas) DiLoCo."""

    binding: BoundBinding
    replicas: int
    model: ModelConfig
    loss: LossConfig
    weights: WeightPlaneConfig
    temperature: float  # the sampling temperature the generators' log-probs are taken at
    diloco: DiLoCoConfig | None = None
    seed: int = 0  # the run's seed: each replica's RNGs start from it once the model is built
    procs_per_replica: int = 1  # procs that train one replica together (the mesh has replicas x this many)
    on_nonfinite: str = "stop"  # run.on_nonfinite: a non-finite loss or gradient stops the run, or is skipped


@dataclass(frozen=True)
class GeneratorConfig(RoleConfig):
    """A generator: its binding, the policy model and the weight plane it pulls from; `adapter` is the trainer's
    LoRA when it publishes the adapters alone (`lora.sync: adapter`): the generator applies the same LoRA to its
    model and loads adapters, not full weights."""

    binding: BoundBinding
    model: ModelConfig
    weights: WeightPlaneConfig
    adapter: LoraConfig | None = None


@dataclass(frozen=True)
class RewarderConfig(RoleConfig):
    """A rewarder: its binding only."""

    binding: BoundBinding


# What the pool does when a teacher is unavailable (`composer_mesh.actors.teacher_errors`): `skip` turns its
# channel off for that request, `stop` stops the run.
OnFailure = Literal["skip", "stop"]


@dataclass(frozen=True)
class TeacherMemberConfig:
    """One teacher of the pool: its name, the loss channels it feeds, its binding and its `on_failure`."""

    name: str
    channels: tuple[str, ...]
    binding: BoundBinding
    on_failure: OnFailure = "skip"


@dataclass(frozen=True)
class TeachersConfig(RoleConfig):
    """The teacher pool: every member (each proc hosts its round-robin share) and the student model."""

    members: tuple[TeacherMemberConfig, ...]
    student: ModelConfig
