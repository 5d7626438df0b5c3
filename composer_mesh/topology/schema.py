"""The topology schema: one YAML describes every mesh of a run, what runs on it, and the sections it runs with.

The mesh part (`MeshSpec`, `SlurmOptions`) is `composer_mesh.mesh.spec`'s; this module owns the role part and
composes the components' own config models (model, loss, weights, diloco, run) into one validated `Topology`.
`Topology.role_configs()` gives each role actor exactly what it is built with (`composer_mesh.actors.configs`).

Validation never imports Monarch or torch; it imports the binding classes named in the file (to check their
settings), so binding modules keep heavy imports inside functions. Reading files with line/column errors is
`composer_mesh.topology.load`'s; the checks across sections are `composer_mesh.topology.checks`'.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationInfo,
    field_validator,
    model_validator,
)

from composer_mesh.actors.configs import (
    GeneratorConfig,
    OnFailure,
    RewarderConfig,
    RoleConfig,
    TeacherMemberConfig,
    TeachersConfig,
    TrainerConfig,
)
from composer_mesh.bindings import Binding, BindingError, BoundBinding
from composer_mesh.errors import FieldError
from composer_mesh.loss.config import LossConfig
from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.mesh.spec import BACKENDS, Identifier, MeshSpec, SlurmJobName, StrictModel
from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.models.config import LoraConfig, ModelConfig
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.roles import Role, resolve_binding


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


# ---------------------------------------------------------------------------------------------------------
# Roles: each role names a mesh and a binding; `settings` is validated with the binding class's `Settings`.
# Adding a role = one spec class (with its `binding_role`) + one field in `RolesSpec` + one entry in
# `composer_mesh.roles.ROLE_TABLE` (+ its config in `Topology.role_configs`).
# Adding a built-in binding = one line in `ROLE_TABLE` (or an import path in the file).
# ---------------------------------------------------------------------------------------------------------

Channel = Literal["distill", "replay", "hint"]
# A role's settings once validated: an instance of its binding's `Settings` (dumped as that model, not as
# the bare `BaseModel` of the annotation).
Settings = SerializeAsAny[BaseModel]


@functools.cache
def _resolve(role: Role, name: str) -> Binding:
    return resolve_binding(role, name)


def _resolve_or_explain(role: Role, name: str) -> Binding:
    """`resolve_binding` with every failure (including errors raised while importing) as a ValueError."""
    try:
        return _resolve(role, name)
    except BindingError as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # a binding module that fails to import for another reason
        raise ValueError(f"cannot load {role} binding {name!r}: {type(e).__name__}: {e}") from None


class _Unchecked(BaseModel):
    """Placeholder settings of a binding that does not resolve (the file is invalid; the binding error says why)."""


class BoundSpec(StrictModel):
    """A part of a role bound to one implementation: `binding` + its validated `settings`.

    Subclasses declare `binding` before `settings` (the settings are validated with the binding's model).
    """

    binding_role: ClassVar[Role]  # the role whose built-in bindings `binding` may name

    if TYPE_CHECKING:  # fields of every subclass (declared there, to keep each subclass's field order)
        binding: str
        settings: BaseModel

    @field_validator("binding", check_fields=False)
    @classmethod
    def _binding_resolves(cls, v: str) -> str:
        _resolve_or_explain(cls.binding_role, v)
        return v

    @field_validator("settings", mode="before", check_fields=False)
    @classmethod
    def _settings_typed(cls, v: Any, info: ValidationInfo) -> BaseModel:
        if isinstance(v, BaseModel):
            return v
        name = info.data.get("binding")
        if name is None:  # the binding itself is wrong: that error is reported, settings cannot be checked
            return _Unchecked()
        return _resolve(cls.binding_role, name).parse_settings({} if v is None else v)

    @classmethod
    def field_model(cls, name: str, raw: Any) -> type[BaseModel] | None:
        """For error messages (`yaml_errors`): `settings` is typed by the binding named in `raw`."""
        if name != "settings":
            return None
        binding = raw.get("binding") if isinstance(raw, dict) else None
        return _resolve(cls.binding_role, binding or cls.model_fields["binding"].default).settings_model

    @property
    def resolved(self) -> Binding:
        """The resolved binding (class, import path, capabilities)."""
        return _resolve(self.binding_role, self.binding)

    def bound(self) -> BoundBinding:
        """The binding with its validated settings, as an actor receives it (it calls `.build()` on its proc)."""
        return BoundBinding(name=self.binding, import_path=self.resolved.import_path, settings=self.settings)


_BINDING_DOC = "Built-in binding name (see the table of built-ins) or an import path `package.module:Class`."
_SETTINGS_DOC = "Settings of the binding, validated with the binding class's `Settings` model."


def _settings_field() -> Any:
    return Field(default_factory=dict, validate_default=True, description=_SETTINGS_DOC)


class TrainerSpec(BoundSpec):
    """The trainer: `replicas` DiLoCo replicas, each on `procs_per_replica` procs of its mesh."""

    binding_role: ClassVar[Role] = "trainer"
    mesh: Identifier = Field(description="Mesh the trainer runs on (a key of `meshes`).")
    binding: str = Field("hf", validate_default=True, description=_BINDING_DOC)
    replicas: int = Field(
        1,
        ge=1,
        description="Trainer replicas. More than 1 needs a `diloco:` section (they synchronise through the "
        "object store); the mesh's procs are split evenly between replicas.",
    )
    procs_per_replica: int = Field(
        1,
        ge=1,
        description="Procs that train one replica together: more than 1 shards the replica over them with FSDP2 "
        "(binding capability `sharded`; docs/trainer.md). The trainer's mesh has `replicas` × this many procs.",
    )
    settings: Settings = _settings_field()


class GeneratorsSpec(BoundSpec):
    """Generators: one generator actor per proc of the mesh."""

    binding_role: ClassVar[Role] = "generators"
    mesh: Identifier = Field(description="Mesh the generators run on; one generator per proc.")
    binding: str = Field("hf", validate_default=True, description=_BINDING_DOC)
    settings: Settings = _settings_field()


class RewarderSpec(BoundSpec):
    """Rewarders: one rewarder actor per proc of the mesh."""

    binding_role: ClassVar[Role] = "rewarder"
    mesh: Identifier = Field(description="Mesh the rewarders run on; one rewarder per proc.")
    binding: str = Field("python", validate_default=True, description=_BINDING_DOC)
    settings: Settings = _settings_field()


class TeacherSpec(BoundSpec):
    """One teacher of the teacher pool and the loss channels it feeds."""

    binding_role: ClassVar[Role] = "teachers"
    name: Identifier = Field(description="Teacher name, unique in the pool (used in metrics and logs).")
    binding: str = Field(description=_BINDING_DOC)
    channels: list[Channel] = Field(
        min_length=1,
        description="Loss channels this teacher feeds: `distill` (channel 2: per-token distributions over the "
        "student's tokens; binding capability `distill`) and/or `replay` (channel 3: full traces; capability "
        "`replay`), and/or `hint`: it writes targeted-feedback hints (`run.rollout.hints.source: teacher`; a "
        "binding that writes text: capability `replay`).",
    )
    on_failure: OnFailure = Field(
        "skip",
        description="When this teacher is unavailable (an HTTP error or timeout that outlived the binding's "
        "retries, a malformed response, out of memory, a dead engine): `skip` turns its channels off for that "
        "request only (the run goes on; counted in `teacher/<name>/failures`, warned the first time and every "
        "10th) or `stop` stops the run naming the teacher. A bug in a binding always stops the run.",
    )
    settings: Settings = _settings_field()

    @field_validator("channels")
    @classmethod
    def _no_repeats(cls, v: list[Channel]) -> list[Channel]:
        if len(set(v)) != len(v):
            raise ValueError(f"channels must not repeat, got {v}")
        return v


class TeachersSpec(StrictModel):
    """The teacher pool: its members are spread round-robin over the procs of one mesh."""

    mesh: Identifier = Field(
        description="Mesh the teacher pool runs on; members go round-robin over its procs."
    )
    members: list[TeacherSpec] = Field(min_length=1, description="The teachers of the pool.")

    @field_validator("members")
    @classmethod
    def _unique_names(cls, v: list[TeacherSpec]) -> list[TeacherSpec]:
        seen: set[str] = set()
        for i, m in enumerate(v):
            if m.name in seen:
                raise FieldError((i, "name"), f"teacher name {m.name!r} is used twice; names must be unique")
            seen.add(m.name)
        return v


class RolesSpec(StrictModel):
    """What runs where. Several roles may share a mesh (their actors share its procs)."""

    trainer: TrainerSpec = Field(description="The policy trainer.")
    generators: GeneratorsSpec = Field(description="Rollout generators (sample completions from the policy).")
    rewarder: RewarderSpec | None = Field(
        None, description="Reward functions / graders: required by `single_turn` runs (each completion is scored by "
        "it); left out of `multi_turn` runs, whose episodes `run.environment` scores (one there is refused)."
    )
    teachers: TeachersSpec | None = Field(
        None, description="Teacher pool for loss channels 2 and 3; omit when both channels are off."
    )

    def placements(self) -> list[tuple[Role, str]]:
        """(role, mesh name) for every role present, in file order."""
        out: list[tuple[Role, str]] = []
        for role in type(self).model_fields:
            spec = getattr(self, role)
            if spec is not None:
                out.append((role, spec.mesh))
        return out


# ---------------------------------------------------------------------------------------------------------
# The whole file. Sections are the components' own config models.
# ---------------------------------------------------------------------------------------------------------


def _null_is_defaults(value: Any) -> Any:
    """`model:` with nothing after it (null) means the defaults, like leaving the section out."""
    return {} if value is None else value


_DEFAULTS_WHEN_NULL = BeforeValidator(_null_is_defaults)


# Fields that may change between a checkpoint and its resume: where things run, how long the run is and
# where it writes, and knobs that change memory or speed but not the math.
_RESUMABLE_RUN = frozenset({"steps", "run_dir", "checkpoint_every", "keep_checkpoints", "checkpoint_url",
                            "eval_prompts", "eval_every", "eval_pass_k", "max_restarts", "loggers", "trackers",
                            "progress"})
_RESUMABLE_TRAINER = frozenset({"device", "torch_threads", "micro_batch_tokens", "activation_checkpointing"})
_RESUMABLE_DILOCO = frozenset({"store_uri", "storage_options", "credentials_env", "quorum_deadline_s",
                               "poll_interval_s", "keep_rounds"})


class Topology(StrictModel):
    """A validated topology file. Sections are instances of their owners' config models."""

    name: SlurmJobName = Field(description="Run name (used in Slurm job names and logs).")
    python_path: list[str] = Field(
        default_factory=list,
        description="Directories holding your own modules (reward functions, tasks, bindings named 'pkg.mod:Name'), "
        "relative to this file: put first on sys.path before the file's import paths are resolved, and on "
        "PYTHONPATH for every proc of the run. The command line's --python-path DIR does the same.",
    )
    model: Annotated[ModelConfig, _DEFAULTS_WHEN_NULL] = Field(
        default_factory=dict,  # type: ignore[arg-type]  # validated into the defaults (validate_default)
        validate_default=True,
        description="The policy model shared by trainer and generators (`ModelConfig`).",
    )
    meshes: dict[Identifier, MeshSpec] = Field(
        min_length=1, description="Mesh name → where it runs and how big it is."
    )
    roles: RolesSpec = Field(description="Role → mesh, binding and settings.")
    loss: Annotated[LossConfig, _DEFAULTS_WHEN_NULL] = Field(
        default_factory=dict,  # type: ignore[arg-type]
        validate_default=True,
        description="The three-channel loss (`LossConfig`).",
    )
    weights: Annotated[WeightPlaneConfig, _DEFAULTS_WHEN_NULL] = Field(
        default_factory=dict,  # type: ignore[arg-type]
        validate_default=True,
        description="Trainer → generator weight plane (`WeightPlaneConfig`).",
    )
    diloco: DiLoCoConfig | None = Field(
        None,
        description="DiLoCo across trainer replicas through an object store (`DiLoCoConfig`); needed exactly "
        "when `roles.trainer.replicas` > 1.",
    )
    run: Annotated[RunConfig, _DEFAULTS_WHEN_NULL] = Field(
        default_factory=dict,  # type: ignore[arg-type]
        validate_default=True,
        description="The built-in RL loop (`RunConfig`).",
    )

    _source: Path | None = PrivateAttr(None)

    @property
    def source(self) -> Path | None:
        """The file this topology was loaded from, if any."""
        return self._source

    @model_validator(mode="after")
    def _tiny_reads_any_text(self) -> Topology:
        """The tiny model's character tokenizer reads only its task's characters (`0-9+=;` for addition): on a
        run of your own data or an environment (`run.data`, `run.environment`) a tiny policy whose `tokenizer`
        is not set gets the byte tokenizer, which reads any text and has a chat template, and a tiny local
        teacher whose `tokenizer` is not set gets the policy's (distillation needs one tokenizer). A task run
        keeps the character tokenizer; a `tokenizer` set in the file is kept."""
        if (self.run.data is None and self.run.environment is None) or not self.model.is_tiny:
            return self
        if "tokenizer" not in self.model.model_fields_set:
            self.model.tokenizer = "byte"
        for member in self.roles.teachers.members if self.roles.teachers is not None else []:
            model = getattr(member.settings, "model", None)
            if isinstance(model, ModelConfig) and model.is_tiny and "tokenizer" not in model.model_fields_set:
                model.tokenizer = self.model.tokenizer
        return self
        members = self.roles.teachers.members if self.roles.teachers is not None else []
        models = [self.model, *(getattr(m.settings, "model", None) for m in members)]
        for model in models:
            if isinstance(model, ModelConfig) and model.is_tiny and "tokenizer" not in model.model_fields_set:
                model.tokenizer = "byte"
        return self

    def training_fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed under this topology: the model, the loss, the trainer and
        its settings, DiLoCo's shape and the run's data and batch shape. Meshes, bindings of the other roles,
        `run.steps` and output locations may change (a resumed run may move to other machines or run longer)."""
        trainer = self.roles.trainer.model_dump(mode="json", exclude={"mesh"})
        settings = trainer.get("settings")
        if isinstance(settings, dict):
            trainer["settings"] = {k: v for k, v in settings.items() if k not in _RESUMABLE_TRAINER}
        return {
            "model": self.model.model_dump(mode="json"),
            "loss": self.loss.model_dump(mode="json"),
            "trainer": trainer,
            "diloco": None if self.diloco is None else self.diloco.model_dump(mode="json", exclude=set(_RESUMABLE_DILOCO)),
            "run": self.run.model_dump(mode="json", exclude=set(_RESUMABLE_RUN)),
        }

    @property
    def trainer(self) -> TrainerSpec:
        return self.roles.trainer

    @property
    def generators(self) -> GeneratorsSpec:
        return self.roles.generators

    @property
    def rewarder(self) -> RewarderSpec | None:
        """None in a multi-turn episode run: its environment scores the episodes (`checks.check_rewarder_role`)."""
        return self.roles.rewarder

    @property
    def teachers(self) -> TeachersSpec | None:
        return self.roles.teachers

    def summary(self) -> str:
        """One line: meshes by backend, procs and GPUs, and where each role runs."""
        counts = Counter(m.backend for m in self.meshes.values())
        backends = ", ".join(f"{counts[b]} {b}" for b in BACKENDS if counts[b])
        procs = sum(m.procs for m in self.meshes.values())
        gpus = sum(m.gpus_held for m in self.meshes.values())
        placed = ", ".join(f"{role} → {mesh}" for role, mesh in self.roles.placements())
        n = len(self.meshes)
        return (
            f"topology {self.name!r}: {_plural(n, 'mesh', 'meshes')} ({backends}), {_plural(procs, 'proc')}, "
            f"{_plural(gpus, 'GPU')}; {placed}"
        )

    def job_name(self, mesh: str) -> str:
        """The name of the job that runs mesh `mesh`: `<topology>_<mesh>`, or what its backend's options set
        (a Slurm mesh's `slurm.job_name`)."""
        return self.meshes[mesh].job_name(self.name, mesh)

    def role_configs(self) -> dict[Role, RoleConfig]:
        """What each role's actors are built with (exactly the sections that role needs), for every role present."""
        configs: dict[Role, RoleConfig] = {
            "trainer": self._trainer_config(),
            "generators": GeneratorConfig(
                role="generators",
                mesh=self.generators.mesh,
                binding=self.generators.bound(),
                model=self.model,
                weights=self.weights,
                adapter=self._published_adapter(),
            ),
        }
        if self.rewarder is not None:
            configs["rewarder"] = RewarderConfig(role="rewarder", mesh=self.rewarder.mesh, binding=self.rewarder.bound())
        if self.teachers is not None:
            configs["teachers"] = self._teachers_config(self.teachers)
        return configs

    def _published_adapter(self) -> LoraConfig | None:
        """The trainer's LoRA when it publishes adapters only (`lora.sync: adapter`); None when it publishes
        full (merged) weights."""
        lora = getattr(self.trainer.settings, "lora", None)
        return lora if isinstance(lora, LoraConfig) and lora.sync == "adapter" else None

    def _trainer_config(self) -> TrainerConfig:
        spec = self.trainer
        return TrainerConfig(
            role="trainer",
            mesh=spec.mesh,
            binding=spec.bound(),
            replicas=spec.replicas,
            procs_per_replica=spec.procs_per_replica,
            model=self.model,
            loss=self.loss,
            weights=self.weights,
            temperature=self.run.temperature,
            seed=self.run.seed,
            diloco=self.diloco,
            on_nonfinite=self.run.on_nonfinite,
        )

    def _teachers_config(self, spec: TeachersSpec) -> TeachersConfig:
        members = tuple(
            TeacherMemberConfig(name=m.name, channels=tuple(m.channels), binding=m.bound(), on_failure=m.on_failure)
            for m in spec.members
        )
        return TeachersConfig(role="teachers", mesh=spec.mesh, members=members, student=self.model)
