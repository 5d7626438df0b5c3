"""What launch asks of a job backend: the `Job` protocol, the `JobNotice`s a job sends, and `JobBase`, what
every backend shares (host meshes by name, procs on them) with the defaults of one whose hosts never go away on
their own (`local`, `process`; `slurm` overrides those).

A job holds the hosts of every mesh of one backend in one launch (Monarch's jobs are objects too: `SlurmJob`,
`ProcessJob`, ... -> `state()` -> host meshes -> `spawn_procs`). `composer_mesh.mesh.launch` only talks to this
protocol, so a new backend is one module of this package (and one `MeshSpec` member), not a branch in launch.

The contract, method by method (launch calls them in this order):
- `create()`: start or submit the jobs, synchronously (no await between submitting and returning, so a
  cancellation cannot leave a job submitted that `stop` does not know of). The launch holds the job before
  calling it: whatever `create` started, `stop` ends, even when `create` fails half way.
- `wait()`: return once every mesh's hosts are up (cancellable); `JobError` if a job never started.
- `host_mesh(mesh)` / `spawn_procs(mesh, per_host, ...)`: the Monarch host mesh of a mesh, and procs on it
  with extent `{hosts, procs}` on every backend (`host`: on that one host only, for a one-proc stand-in).
- `watch(poll_s)`: the next `JobNotice` about these jobs (warned, preempted, timed out, ended); waits forever
  when nothing can happen to them. A notice of a job that stopped running marks its mesh `ended`.
- `ended(mesh)` (what `watch` saw) / `confirm_ended(mesh)` (asked of the scheduler now): the mesh's hosts are
  gone, so its procs are gone too: nothing to stop, and `respawn` must start a new job.
- `respawn(mesh)`: a new job for a mesh whose job ended (same options), its host mesh replaced; `JobError` if it
  cannot. Launch then spawns the mesh's procs there again.
- `stop()`: end every job, synchronously (it runs while the launching task is being cancelled); errors are
  logged, never raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from composer_mesh.mesh.spec import MeshSpecBase

log = logging.getLogger("composer_mesh.mesh.jobs")

NoticeKind = Literal["warning", "preempted", "timeout", "ended"]


class JobError(RuntimeError):
    """A job could not start, or could not be replaced (launch raises it as its `LaunchError`)."""


@dataclass(frozen=True)
class JobNotice:
    """Something the controller must act on: the job of a mesh was warned or stopped running.

    `warning`: the job will end soon (Slurm's `--signal` before the time limit) and still runs; `preempted` /
    `timeout`: the scheduler took the hosts back or the time ran out; `ended`: any other way out of running (a
    node died, the job was cancelled).
    """

    mesh: str
    job_id: str
    kind: NoticeKind
    detail: str  # what happened, phrased to follow "Slurm job 42 of mesh 'gpu' "
    scheduler: str = "Slurm"  # who sent it (Slurm is the one backend whose jobs end on their own today)

    @property
    def job_ended(self) -> bool:
        """The job no longer runs: its mesh's procs are gone."""
        return self.kind != "warning"

    @property
    def replaceable(self) -> bool:
        """The job died but the scheduler still lets the run have hosts: a new job can take over the mesh
        (`respawn`). Warnings, preemptions and time limits mean the run's time there is up: checkpoint and stop."""
        return self.kind == "ended"

    def message(self) -> str:
        """One line for users."""
        return f"{self.scheduler} job {self.job_id} of mesh {self.mesh!r} {self.detail}"


class Job(Protocol):
    """The jobs of one backend in one launch (see the module docstring for what each method guarantees)."""

    specs: Mapping[str, MeshSpecBase]  # the meshes these jobs hold, by name
    job_ids: dict[str, str]  # mesh -> the scheduler's id of its job (backends with a scheduler)

    def create(self) -> None: ...

    async def wait(self) -> None: ...

    def host_mesh(self, mesh: str) -> Any: ...

    def spawn_procs(self, mesh: str, per_host: dict[str, int], *, name: str, host: int | None = None,
                    **spawn: Any) -> Any: ...

    async def watch(self, poll_s: float) -> JobNotice: ...

    def ended(self, mesh: str) -> bool: ...

    async def confirm_ended(self, mesh: str) -> bool: ...

    async def respawn(self, mesh: str) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class JobContext:
    """What every job of a launch is created with besides its meshes."""

    run_name: str  # names jobs (`MeshSpec.job_name`)
    log_dir: str  # absolute; where jobs write their logs (and Slurm workers their warning files)


class JobBase:
    """The parts of `Job` every backend shares (host meshes by name, procs spawned on them), and the defaults of
    one whose hosts stay up as long as the controller: nothing to watch, nothing that ends, nothing to respawn."""

    def __init__(self, specs: Mapping[str, MeshSpecBase], context: JobContext) -> None:
        self.specs = dict(specs)
        self.context = context
        self.hosts: dict[str, Any] = {}  # mesh -> Monarch host mesh, once `wait` returned
        self.job_ids: dict[str, str] = {}

    def host_mesh(self, mesh: str) -> Any:
        return self.hosts[mesh]

    def spawn_procs(self, mesh: str, per_host: dict[str, int], *, name: str, host: int | None = None,
                    **spawn: Any) -> Any:
        """Procs of `mesh` on its hosts (on host `host` only, when given)."""
        hosts = self.host_mesh(mesh) if host is None else self.host_mesh(mesh).slice(hosts=host)
        return hosts.spawn_procs(per_host=per_host, name=name, **spawn)

    async def watch(self, poll_s: float) -> JobNotice:
        await asyncio.Event().wait()  # never set: nothing happens to these jobs that the controller must hear of
        raise AssertionError("unreachable")

    def ended(self, mesh: str) -> bool:
        return False

    async def confirm_ended(self, mesh: str) -> bool:
        return False

    async def respawn(self, mesh: str) -> None:
        raise JobError(f"mesh {mesh!r}: its job cannot be replaced (its hosts live as long as the controller)")
