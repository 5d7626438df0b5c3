"""Where procs run: the schema of one mesh (`MeshSpec`), one union member per job backend.

`MeshSpec` is a union discriminated by `backend`: `LocalMeshSpec`, `ProcessMeshSpec`, `SlurmMeshSpec` (with
its `SlurmOptions`). The fields every backend has (shape, GPUs per proc, env, spare) are on `MeshSpecBase`;
each backend's own fields are on its member only, and a field of another backend is refused with a message
saying whose it is. What the rest of the code asks of a mesh (its job's name, the host GPUs it pins, a line for
`plan`, checks across meshes) are methods of the members, so no code outside the members and `mesh/jobs/`
branches on the backend. A new backend is one member here and one module in `composer_mesh.mesh.jobs`.

Pydantic only: a topology validates meshes without importing Monarch. `composer_mesh.mesh.launch` turns
specs into Monarch jobs (`composer_mesh.mesh.jobs`) and proc meshes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)


def _matches(pattern: str, what: str) -> Any:
    """An AfterValidator that explains the expected form instead of printing a regex."""
    rx = re.compile(pattern)

    def check(v: str) -> str:
        if not rx.fullmatch(v):
            raise ValueError(f"{v!r} is not a valid {what}")
        return v

    return AfterValidator(check)


# Mesh names become Monarch mesh names and Slurm job-name parts: keep them identifier-like.
Identifier = Annotated[
    str, _matches(r"[A-Za-z][A-Za-z0-9_]*", "name (letters, digits and '_', starting with a letter)")
]
EnvName = Annotated[
    str, _matches(r"[A-Za-z_][A-Za-z0-9_]*", "environment variable name (letters, digits and '_')")
]
# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or INFINITE/UNLIMITED.
SlurmTime = Annotated[
    str,
    _matches(
        r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|INFINITE|UNLIMITED",
        "Slurm time limit (forms: MM, HH:MM:SS, D-HH, D-HH:MM:SS, UNLIMITED)",
    ),
]
SlurmMem = Annotated[
    str, _matches(r"\d+[KMGT]?", "Slurm memory size (a number with optional K/M/G/T, e.g. 512G)")
]
SlurmJobName = Annotated[str, _matches(r"[A-Za-z0-9_.-]+", "Slurm job name (letters, digits, '_', '.', '-')")]


def slurm_time_seconds(limit: str | None) -> int | None:
    """Seconds of a Slurm `--time` value (a valid `SlurmTime`); None when unset or unlimited."""
    if limit is None or limit in ("INFINITE", "UNLIMITED"):
        return None
    days, _, clock = limit.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, s = [*parts, 0, 0][:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if len(parts) == 1:  # M
        return parts[0] * 60
    if len(parts) == 2:  # M:S
        return parts[0] * 60 + parts[1]
    h, m, s = parts  # H:M:S
    return (h * 60 + m) * 60 + s


class StrictModel(BaseModel):
    """Frozen, unknown keys refused, inputs never echoed in errors."""

    # hide_input_in_errors: a secret pasted into a topology must never be echoed by a validation error.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class SlurmOptions(StrictModel):
    """Options of the one Slurm job a `slurm` mesh gets (maps onto `monarch.job.SlurmJob` arguments)."""

    partition: str | None = Field(
        None, description="Slurm partition (`--partition`); cluster default if unset."
    )
    time_limit: SlurmTime | None = Field(
        None,
        description="Wall-clock limit in a Slurm `--time` format, e.g. `04:00:00` or `1-12:00:00`.",
    )
    account: str | None = Field(None, description="Account charged (`--account`); cluster default if unset.")
    qos: str | None = Field(None, description="Quality of service (`--qos`); cluster default if unset.")
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        description="GPUs requested per node (`--gpus-per-node`). Default: procs_per_host × gpus_per_proc "
        "(none requested when that is 0). Must be at least that product.",
    )
    cpus_per_task: int | None = Field(
        None, ge=1, description="CPUs per node task (`--cpus-per-task`); the node's worker runs all procs."
    )
    mem: SlurmMem | None = Field(
        None, description="Memory per node (`--mem`), e.g. `512G`; cluster default if unset."
    )
    exclusive: bool = Field(True, description="Request whole nodes (`--exclusive`), Monarch's default.")
    start_timeout: int | None = Field(
        None,
        ge=1,
        description="Seconds to wait for the job to start running before cancelling it; unset waits forever.",
    )
    job_name: SlurmJobName | None = Field(
        None,
        description="Slurm job name; default `<topology name>_<mesh name>`.",
    )
    monarch_port: int = Field(
        22222,
        ge=1024,
        le=65535,
        description="TCP port of the Monarch worker on each node; two Slurm meshes sharing a node need different ports.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More sbatch options, each written as `#SBATCH <arg>`, e.g. `--constraint=h100`.",
    )
    warning_s: int | None = Field(
        120,
        ge=1,
        le=65535,
        validate_default=True,  # the default too must fit under time_limit
        description="Seconds before the time limit at which Slurm warns the job (`--signal=USR1@<warning_s>`; "
        "Slurm may send it up to 60 s earlier); the controller then sees a `warning` notice and can "
        "checkpoint. Must be below `time_limit`; null sends no warning.",
    )

    @field_validator("extra_args")
    @classmethod
    def _options_only(cls, v: list[str]) -> list[str]:
        for arg in v:
            if not arg.startswith("-"):
                raise ValueError(f"extra_args entry {arg!r} must be an sbatch option starting with '-'")
        return v

    @field_validator("warning_s")
    @classmethod
    def _warning_fits(cls, v: int | None, info: ValidationInfo) -> int | None:
        """The warning must come before the limit, and be the only `--signal` (sbatch keeps one)."""
        if v is None:
            return v
        if any(arg.startswith("--signal") for arg in info.data.get("extra_args") or []):
            raise ValueError("extra_args has a --signal option: set warning_s: null to use your own")
        limit = slurm_time_seconds(info.data.get("time_limit"))
        if limit is not None and v >= limit:
            raise ValueError(
                f"warning_s={v} is not below time_limit {info.data['time_limit']!r} ({limit} s): "
                "lower it or set warning_s: null"
            )
        return v


Problem = tuple[tuple[str | int, ...], str]  # (field loc from the top of the file, message): a check's finding


@dataclass(frozen=True)
class HostGpus:
    """The controller host's GPUs a mesh's procs use, as its spec asks (`gpus.assign_gpus` decides which)."""

    count: int  # procs_per_host × gpus_per_proc
    pinned: list[int] | None  # exactly these; None: the lowest GPUs no other mesh holds
    pinned_by: str | None = None  # the field that pinned them (where an overlap is reported)


def _field_error(model: str, field: str, value: Any, message: str) -> ValidationError:
    """A validation error located at `field` (raised from a validator of the model or of a parent field)."""
    return ValidationError.from_exception_data(
        model,
        [{"type": "value_error", "loc": (field,), "input": value, "ctx": {"error": ValueError(message)}}],
        hide_input=True,
    )


class MeshSpecBase(StrictModel):
    """What every mesh has, whatever runs it: `hosts` × `procs_per_host` procs, their GPUs, env and spare."""

    backend: str = Field(description="The job backend that runs the mesh (each member narrows it to its name).")
    hosts: int = Field(
        1, ge=1, description="Number of hosts (a Slurm mesh's nodes, a process mesh's worker processes); 1 for `local`."
    )
    procs_per_host: int = Field(1, ge=1, description="Procs spawned on each host.")
    gpus_per_proc: int = Field(
        0,
        ge=0,
        description="GPUs visible to each proc (`CUDA_VISIBLE_DEVICES` is set per proc); 0 = CPU only.",
    )
    env: dict[EnvName, str] = Field(
        default_factory=dict,
        description="Environment variables set in every proc of this mesh (quote numbers).",
    )
    spare: bool = Field(
        False,
        description="Keep a warm spare of this mesh's procs, with its actors spawned and set up (models built): "
        "when a proc dies the spare takes over in about a second instead of new procs being started and set up, "
        "and a new spare is prepared in the background. Costs a second set of the mesh's processes and memory. "
        "CPU meshes on backends `local` and `process` (a GPU mesh's spare would hold GPUs idle).",
    )

    # Why this backend keeps no spare (None: it can).
    spare_refused: ClassVar[str | None] = None
    # Why a field of another backend means nothing here, by field name (added to the refusal).
    foreign_notes: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _no_foreign_fields(cls, data: Any) -> Any:
        """A key of another backend's member says whose it is, instead of pydantic's "extra inputs"."""
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            owners = [backend_of(m) for m in MESH_SPECS if key in m.model_fields]
            if not owners or key in cls.model_fields:
                continue
            note = cls.foreign_notes.get(str(key))
            here = repr(backend_of(cls)) + (f": {note}" if note else "")
            which = " or ".join(repr(owner) for owner in owners)
            raise _field_error(cls.__name__, str(key), value, f"{key} is only for backend {which} (this mesh is {here})")
        return data

    @field_validator("spare")
    @classmethod
    def _spare_on_cpu_meshes(cls, v: bool, info: ValidationInfo) -> bool:
        per_proc = info.data.get("gpus_per_proc")
        if v and cls.spare_refused:
            raise ValueError(cls.spare_refused)
        if v and per_proc:
            raise ValueError(f"spare would hold gpus_per_proc={per_proc} GPU(s) per proc idle; only CPU meshes "
                             "keep a spare")
        return v

    @property
    def procs(self) -> int:
        """Total procs of the mesh."""
        return self.hosts * self.procs_per_host

    @property
    def gpus(self) -> int:
        """Total GPUs used by the mesh's procs."""
        return self.procs * self.gpus_per_proc

    @property
    def gpus_held(self) -> int:
        """GPUs the mesh holds (and is billed for): hosts × gpus_per_node."""
        return self.hosts * self.gpus_per_node

    @property
    def gpus_per_node(self) -> int:
        """GPUs each host holds for the mesh: what its procs use, unless the backend asks for more."""
        return self.procs_per_host * self.gpus_per_proc

    def job_name(self, run_name: str, mesh: str) -> str:
        """The name of the job that runs this mesh: `<run name>_<mesh name>` unless the backend sets one."""
        return f"{run_name}_{mesh}"

    def host_gpus(self) -> HostGpus | None:
        """The controller host's GPUs this mesh uses; None when its hosts are not the controller's."""
        return None

    def time_limit_s(self) -> int | None:
        """The most seconds the mesh's job may run (`plan` bounds a run's cost with it); None: no limit."""
        return None

    def launch_summary(self, run_name: str, mesh: str) -> str:
        """How the mesh is launched, in a few words (`plan`'s launch column)."""
        raise NotImplementedError

    @classmethod
    def check_meshes(cls, meshes: Mapping[str, Any]) -> Iterator[Problem]:
        """Problems between this backend's meshes of one topology (all meshes are given; none by default)."""
        return iter(())


def backend_of(member: type[MeshSpecBase]) -> str:
    """The `backend` value of a union member (its field's one literal)."""
    return str(get_args(member.model_fields["backend"].annotation)[0])


class LocalMeshSpec(MeshSpecBase):
    """Procs on the controller's host (Monarch's `this_host()`), numbered from its GPUs."""

    backend: Literal["local"] = Field(description="`local`: procs on this host.")
    gpu_offset: int | None = Field(
        None,
        ge=0,
        description="First host GPU this mesh uses; its procs take the procs_per_host × gpus_per_proc GPUs from "
        "there. Default: the lowest GPUs no other local mesh uses, in mesh order.",
    )
    gpu_devices: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        description="The host GPUs this mesh uses, procs_per_host × gpus_per_proc distinct indices, proc i taking "
        "the i-th gpus_per_proc of them. Indices count what the host exposes (an inherited `CUDA_VISIBLE_DEVICES` "
        "list, else 0..N-1). Not together with gpu_offset.",
    )

    @field_validator("hosts")
    @classmethod
    def _one_host(cls, v: int) -> int:
        if v != 1:
            raise ValueError(
                f"backend 'local' runs on this host only, so hosts must be 1 (got {v}); "
                "use backend 'process' to simulate several hosts"
            )
        return v

    @field_validator("gpu_offset", "gpu_devices")
    @classmethod
    def _gpu_placement(cls, v: int | list[int] | None, info: ValidationInfo) -> int | list[int] | None:
        """Placement pins this host's GPUs: meaningless on a CPU mesh."""
        if v is None:
            return v
        field, per_proc = info.field_name, info.data.get("gpus_per_proc")
        if per_proc == 0:
            raise ValueError(f"{field} places GPUs but gpus_per_proc is 0 (a CPU-only mesh uses none)")
        if not isinstance(v, list):
            return v
        if info.data.get("gpu_offset") is not None:
            raise ValueError("give gpu_offset or gpu_devices, not both")
        procs = info.data.get("procs_per_host")
        needed = None if per_proc is None or procs is None else procs * per_proc
        if needed is not None and len(v) != needed:
            raise ValueError(
                f"gpu_devices lists {len(v)} GPUs but the mesh uses procs_per_host × gpus_per_proc = {needed}"
            )
        repeated = sorted({d for d in v if v.count(d) > 1})
        if repeated:
            raise ValueError(f"gpu_devices lists GPU {', '.join(map(str, repeated))} more than once")
        return v

    def host_gpus(self) -> HostGpus:
        """Local meshes share the controller's host, so each is given its own GPUs of it."""
        count = self.procs_per_host * self.gpus_per_proc
        if self.gpus_per_proc == 0:
            return HostGpus(0, [])
        if self.gpu_devices is not None:
            return HostGpus(count, list(self.gpu_devices), "gpu_devices")
        if self.gpu_offset is not None:
            return HostGpus(count, list(range(self.gpu_offset, self.gpu_offset + count)), "gpu_offset")
        return HostGpus(count, None)

    def launch_summary(self, run_name: str, mesh: str) -> str:
        return "this host"


class ProcessMeshSpec(MeshSpecBase):
    """Monarch's local job stand-in with a hosts dimension: one worker process per host, on this machine."""

    backend: Literal["process"] = Field(
        description="`process`: Monarch's local job stand-in with a hosts dimension (one worker process per host)."
    )

    foreign_notes: ClassVar[Mapping[str, str]] = {
        "gpu_offset": "each of its hosts starts at GPU 0",
        "gpu_devices": "each of its hosts starts at GPU 0",
    }

    def launch_summary(self, run_name: str, mesh: str) -> str:
        return f"local ProcessJob, {self.hosts} worker process{'es' if self.hosts != 1 else ''}"


class SlurmMeshSpec(MeshSpecBase):
    """One Slurm job for this mesh (`monarch.job.SlurmJob`), one node per host."""

    backend: Literal["slurm"] = Field(description="`slurm`: one Slurm job for this mesh.")
    slurm: SlurmOptions = Field(
        default_factory=SlurmOptions,
        description="Slurm job options (defaults apply when omitted).",
    )

    spare_refused: ClassVar[str | None] = "spare is not supported on backend 'slurm' (a spare there is a second job)"
    foreign_notes: ClassVar[Mapping[str, str]] = {
        "gpu_offset": "Slurm allocates its GPUs",
        "gpu_devices": "Slurm allocates its GPUs",
    }

    @field_validator("slurm", mode="before")
    @classmethod
    def _null_is_defaults(cls, v: Any) -> Any:
        return SlurmOptions() if v is None else v

    @field_validator("slurm")
    @classmethod
    def _enough_gpus_per_node(cls, v: SlurmOptions, info: ValidationInfo) -> SlurmOptions:
        needed = info.data.get("procs_per_host", 1) * info.data.get("gpus_per_proc", 0)
        if v.gpus_per_node is not None and v.gpus_per_node < needed:
            # Raised as a nested ValidationError so the error's path ends at slurm.gpus_per_node.
            msg = f"gpus_per_node={v.gpus_per_node} is less than procs_per_host × gpus_per_proc = {needed}"
            raise _field_error("SlurmOptions", "gpus_per_node", v.gpus_per_node, msg)
        return v

    @property
    def gpus_per_node(self) -> int:
        """GPUs to request per node: the `slurm.gpus_per_node` override if given, else what the procs use."""
        if self.slurm.gpus_per_node is not None:
            return self.slurm.gpus_per_node
        return super().gpus_per_node

    def job_name(self, run_name: str, mesh: str) -> str:
        """Its `slurm.job_name` option or `<run name>_<mesh name>`."""
        return self.slurm.job_name or f"{run_name}_{mesh}"

    def time_limit_s(self) -> int | None:
        return slurm_time_seconds(self.slurm.time_limit)

    def slurm_job_kwargs(self, *, job_name: str) -> dict[str, Any]:
        """Keyword arguments for `monarch.job.SlurmJob` (everything except `meshes`, `python_exe`, `log_dir`)."""
        s = self.slurm
        return {
            "job_name": s.job_name or job_name,
            "time_limit": s.time_limit,
            "partition": s.partition,
            "account": s.account,
            "qos": s.qos,
            "exclusive": s.exclusive,
            "gpus_per_node": self.gpus_per_node or None,
            "cpus_per_task": s.cpus_per_task,
            "mem": s.mem,
            "job_start_timeout": s.start_timeout,
            "monarch_port": s.monarch_port,
            "slurm_args": tuple(s.extra_args),
        }

    def launch_summary(self, run_name: str, mesh: str) -> str:
        s = self.slurm
        opts = [f"job {self.job_name(run_name, mesh)}"]
        named = (("partition", s.partition), ("time", s.time_limit), ("account", s.account), ("qos", s.qos),
                 ("mem", s.mem))
        opts += [f"{k}={v}" for k, v in named if v]
        if not s.exclusive:
            opts.append("shared nodes")
        return "Slurm: " + ", ".join(opts)

    @classmethod
    def check_meshes(cls, meshes: Mapping[str, Any]) -> Iterator[Problem]:
        """Slurm meshes that may share a node (not exclusive, same partition) need different worker ports."""
        ports: dict[tuple[str | None, int], str] = {}
        for name, spec in meshes.items():
            if not isinstance(spec, cls) or spec.slurm.exclusive:
                continue
            slot = (spec.slurm.partition, spec.slurm.monarch_port)
            if slot in ports:
                yield (
                    ("meshes", name, "slurm", "monarch_port"),
                    f"meshes {ports[slot]!r} and {name!r} may share a node (exclusive: false, same partition) and "
                    f"would both bind port {slot[1]}; give one of them another slurm.monarch_port",
                )
            else:
                ports[slot] = name


# The union a topology's `meshes` values validate into; `backend` picks the member. A new backend adds its member
# here (and its job module to `composer_mesh.mesh.jobs.JOB_BACKENDS`).
MeshSpec = Annotated[Union[LocalMeshSpec, ProcessMeshSpec, SlurmMeshSpec], Field(discriminator="backend")]
MESH_SPECS: tuple[type[MeshSpecBase], ...] = get_args(get_args(MeshSpec)[0])
BACKENDS: tuple[str, ...] = tuple(backend_of(member) for member in MESH_SPECS)
_MESH_SPEC: TypeAdapter[MeshSpec] = TypeAdapter(MeshSpec, config=StrictModel.model_config)


def mesh_spec(**fields: Any) -> MeshSpec:
    """One mesh spec from its fields, the member picked by `backend` (as a topology's `meshes` values are)."""
    return _MESH_SPEC.validate_python(fields)
