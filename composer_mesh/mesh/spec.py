"""Where procs run: the schema of one mesh (`MeshSpec`) and of its Slurm job (`SlurmOptions`).

Pydantic only: a topology validates meshes without importing Monarch. `composer_mesh.mesh.launch` turns
specs into Monarch jobs and proc meshes.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

Backend = Literal["local", "process", "slurm"]
BACKENDS: tuple[Backend, ...] = ("local", "process", "slurm")


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


class MeshSpec(StrictModel):
    """Where one mesh runs and how big it is: `hosts` × `procs_per_host` procs on one backend."""

    backend: Backend = Field(
        description="`local`: procs on this host; `process`: Monarch's local job stand-in with a hosts "
        "dimension (one worker process per host); `slurm`: one Slurm job for this mesh."
    )
    hosts: int = Field(1, ge=1, description="Number of hosts (Slurm nodes). Must be 1 for backend `local`.")
    procs_per_host: int = Field(1, ge=1, description="Procs spawned on each host.")
    gpus_per_proc: int = Field(
        0,
        ge=0,
        description="GPUs visible to each proc (`CUDA_VISIBLE_DEVICES` is set per proc); 0 = CPU only.",
    )
    gpu_offset: int | None = Field(
        None,
        ge=0,
        description="Backend `local` only: first host GPU this mesh uses; its procs take the "
        "procs_per_host × gpus_per_proc GPUs from there. Default: the lowest GPUs no other local mesh uses, "
        "in mesh order.",
    )
    gpu_devices: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        description="Backend `local` only: the host GPUs this mesh uses, procs_per_host × gpus_per_proc "
        "distinct indices, proc i taking the i-th gpus_per_proc of them. Indices count what the host exposes "
        "(an inherited `CUDA_VISIBLE_DEVICES` list, else 0..N-1). Not together with gpu_offset.",
    )
    env: dict[EnvName, str] = Field(
        default_factory=dict,
        description="Environment variables set in every proc of this mesh (quote numbers).",
    )
    slurm: SlurmOptions | None = Field(
        None,
        validate_default=True,
        description="Slurm job options; only for backend `slurm` (defaults apply when omitted).",
    )
    spare: bool = Field(
        False,
        description="Keep a warm spare of this mesh's procs, with its actors spawned and set up (models built): "
        "when a proc dies the spare takes over in about a second instead of new procs being started and set up, "
        "and a new spare is prepared in the background. Costs a second set of the mesh's processes and memory. "
        "CPU meshes on backends `local` and `process` (a GPU mesh's spare would hold GPUs idle).",
    )

    @field_validator("hosts")
    @classmethod
    def _local_is_one_host(cls, v: int, info: ValidationInfo) -> int:
        if info.data.get("backend") == "local" and v != 1:
            raise ValueError(
                f"backend 'local' runs on this host only, so hosts must be 1 (got {v}); "
                "use backend 'process' to simulate several hosts"
            )
        return v

    @field_validator("gpu_offset", "gpu_devices")
    @classmethod
    def _gpu_placement(cls, v: int | list[int] | None, info: ValidationInfo) -> int | list[int] | None:
        """Placement pins this host's GPUs: meaningless on a scheduler's allocation or on a CPU mesh."""
        if v is None:
            return v
        field, backend, per_proc = info.field_name, info.data.get("backend"), info.data.get("gpus_per_proc")
        if backend is not None and backend != "local":
            why = "Slurm allocates its GPUs" if backend == "slurm" else "each of its hosts starts at GPU 0"
            raise ValueError(f"{field} is only for backend 'local' (this mesh is {backend!r}: {why})")
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

    @field_validator("spare")
    @classmethod
    def _spare_on_cpu_meshes(cls, v: bool, info: ValidationInfo) -> bool:
        backend, per_proc = info.data.get("backend"), info.data.get("gpus_per_proc")
        if v and backend == "slurm":
            raise ValueError("spare is not supported on backend 'slurm' (a spare there is a second job)")
        if v and per_proc:
            raise ValueError(f"spare would hold gpus_per_proc={per_proc} GPU(s) per proc idle; only CPU meshes "
                             "keep a spare")
        return v

    @field_validator("slurm")
    @classmethod
    def _slurm_only_for_slurm(cls, v: SlurmOptions | None, info: ValidationInfo) -> SlurmOptions | None:
        backend = info.data.get("backend")
        if v is None:
            return SlurmOptions() if backend == "slurm" else None
        if backend is not None and backend != "slurm":
            raise ValueError(f"slurm options are only allowed for backend 'slurm' (this mesh is {backend!r})")
        needed = info.data.get("procs_per_host", 1) * info.data.get("gpus_per_proc", 0)
        if v.gpus_per_node is not None and v.gpus_per_node < needed:
            # Raised as a nested ValidationError so the error's path ends at slurm.gpus_per_node.
            msg = f"gpus_per_node={v.gpus_per_node} is less than procs_per_host × gpus_per_proc = {needed}"
            raise ValidationError.from_exception_data(
                "SlurmOptions",
                [
                    {
                        "type": "value_error",
                        "loc": ("gpus_per_node",),
                        "input": v.gpus_per_node,
                        "ctx": {"error": ValueError(msg)},
                    }
                ],
            )
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
        """GPUs to request per host: the Slurm override if given, else what the procs use."""
        if self.slurm is not None and self.slurm.gpus_per_node is not None:
            return self.slurm.gpus_per_node
        return self.procs_per_host * self.gpus_per_proc

    def slurm_job_kwargs(self, *, job_name: str) -> dict[str, Any]:
        """Keyword arguments for `monarch.job.SlurmJob` (everything except `meshes`, `python_exe`, `log_dir`)."""
        if self.backend != "slurm":
            raise ValueError(f"slurm_job_kwargs() needs backend 'slurm', this mesh is {self.backend!r}")
        s = self.slurm or SlurmOptions()
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


def slurm_job_name(run_name: str, mesh: str, spec: MeshSpec) -> str:
    """The Slurm job name of a slurm mesh: its `job_name` option or `<run name>_<mesh name>`."""
    return (spec.slurm.job_name if spec.slurm and spec.slurm.job_name else None) or f"{run_name}_{mesh}"
