"""Launch a topology on Monarch: jobs, proc meshes, one actor mesh per role, and guaranteed cleanup.

    from composer_mesh.mesh.launch import launch        # import before anything imports monarch

    async with launch("topologies/local.yaml") as mesh:
        metrics = await mesh.trainer.train_step.call_one(batch)
        rollouts = await mesh.generators.generate.call(prompts)

What `launch` does, in order:
1. loads and validates the topology (a path or a `Topology` object) and imports every role's actor
   class, so a bad import path fails before anything starts;
2. creates the Monarch jobs: one `SlurmJob` per `slurm` mesh (sbatch; waits until RUNNING), one
   `ProcessJob` for all `process` meshes (a local worker process per host), and `this_host()` for
   `local` meshes;
3. spawns one proc mesh per topology mesh, with extent `{hosts: H, procs: P}` on every backend, each
   proc running `runtime.proc_setup` (GPU pinning from `gpus_per_proc`, the mesh's `env`, quiet logs);
4. spawns each role's actor class over all procs of its mesh as `ActorClass(role_config)` (see
   `RoleConfig`), then calls the class's `ready` endpoint if it has one, so that `__init__` errors
   surface here as a `MeshFailureError` naming the role;
5. on exit, normal or not (exception, Ctrl-C / task cancellation), stops every proc mesh, kills the
   process job and `scancel`s every Slurm job. An `atexit` hook scancels Slurm jobs if the controller
   dies without unwinding.

Failures: Monarch's default fault hook exits the controller. Ours records each failure with its role
and mesh. An exception leaving the block after an actor failure is re-raised as `MeshFailureError`
(role + mesh, original chained); failures recorded during a block that ended normally raise at exit;
`mesh.check()` raises them on demand, e.g. between training steps.

Role-actor constructor convention: every role actor class takes exactly one argument, a `RoleConfig`.
"""

from __future__ import annotations

import asyncio
import atexit
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from composer_mesh.bindings import BindingError, import_object

# `runtime` sets Monarch's import-time environment; it must run before the first `import monarch`, so
# this module imports monarch only inside functions (isort would otherwise move monarch first).
from composer_mesh.mesh import runtime

if TYPE_CHECKING:
    from monarch.actor import ProcMesh

    from composer_mesh.actors.generator import GeneratorActor
    from composer_mesh.actors.rewarder import RewarderActor
    from composer_mesh.actors.teachers import TeacherPoolActor
    from composer_mesh.actors.trainer import TrainerActor
    from composer_mesh.topology import MeshSpec

log = logging.getLogger("composer_mesh.mesh.launch")

RoleName = Literal["trainer", "generators", "rewarder", "teachers"]
ROLE_NAMES: tuple[RoleName, ...] = ("trainer", "generators", "rewarder", "teachers")

# Default actor class per role, imported lazily (the actors import model code; launch must not).
DEFAULT_ACTORS: dict[RoleName, str] = {
    "trainer": "composer_mesh.actors.trainer:TrainerActor",
    "generators": "composer_mesh.actors.generator:GeneratorActor",
    "rewarder": "composer_mesh.actors.rewarder:RewarderActor",
    "teachers": "composer_mesh.actors.teachers:TeacherPoolActor",
}

# Top-level topology sections handed to every role (absent ones are None).
SHARED_SECTIONS: tuple[str, ...] = ("model", "loss", "weights", "diloco", "run")

# Name of the optional readiness endpoint launch calls on every role actor before returning.
READY_ENDPOINT = "ready"


class LaunchError(RuntimeError):
    """The topology could not be launched (bad actor class, Slurm job that never ran, ...)."""


@dataclass(frozen=True)
class RoleFailure:
    """One Monarch failure event, attributed to a role (None: the proc mesh itself) and a topology mesh."""

    role: str | None
    mesh: str
    monarch_mesh: str  # Monarch's name of the failed actor/proc mesh
    report: str


class MeshFailureError(RuntimeError):
    """An actor or proc of a launched topology failed. `failures` says which role on which mesh."""

    def __init__(self, failures: Sequence[RoleFailure], during: str) -> None:
        self.failures = list(failures)
        places = sorted({(f.role or "(procs)", f.mesh) for f in self.failures})
        self.roles = sorted({f.role for f in self.failures if f.role is not None})
        where = ", ".join(f"role {role!r} on mesh {mesh!r}" for role, mesh in places)
        reasons = list(dict.fromkeys(failure_reason(f.report) for f in self.failures))
        super().__init__(
            f"actor failure {during} in {where}: {'; '.join(reasons[:3])}"
            + ("" if len(reasons) <= 3 else f" (+{len(reasons) - 3} more)")
            + " (Monarch's full reports are in .failures)"
        )


def failure_reason(report: str) -> str:
    """The gist of a Monarch failure report: the exception line ending its traceback, else its last line."""
    lines = [line.strip() for line in report.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no report)"


class RoleConfig(BaseModel):
    """The single constructor argument of every role actor: `ActorClass(role_config)`.

    It carries the whole validated topology (small, picklable pydantic models) plus which role this is
    and where it runs; `section` is the role's own topology entry (binding name + validated settings,
    teacher members, ...), and `model`/`loss`/`weights`/`diloco`/`run` are the shared top-level
    sections (None when the topology has none). Resolve the role's binding with
    `composer_mesh.bindings.resolve_binding(<binding role>, role_config.section.binding)`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    role: RoleName = Field(
        description="Which role this actor plays: trainer, generators, rewarder or teachers."
    )
    mesh: str = Field(description="Name of the topology mesh the role's actors run on.")
    topology: Any = Field(description="The validated `composer_mesh.topology.Topology` of the run.")

    @property
    def section(self) -> Any:
        """The role's own validated topology entry (e.g. `topology.roles.trainer`)."""
        return role_sections(self.topology)[self.role]

    @property
    def mesh_spec(self) -> MeshSpec:
        return self.topology.meshes[self.mesh]

    @property
    def model(self) -> Any:
        return getattr(self.topology, "model", None)

    @property
    def loss(self) -> Any:
        return getattr(self.topology, "loss", None)

    @property
    def weights(self) -> Any:
        return getattr(self.topology, "weights", None)

    @property
    def diloco(self) -> Any:
        return getattr(self.topology, "diloco", None)

    @property
    def run(self) -> Any:
        return getattr(self.topology, "run", None)


@dataclass(frozen=True)
class RolePlacement:
    """Where a role runs: its mesh, backend, shape and actor class."""

    role: RoleName
    mesh: str
    backend: str
    hosts: int
    procs_per_host: int
    gpus_per_proc: int
    actor_class: str  # "module:Class"

    @property
    def procs(self) -> int:
        return self.hosts * self.procs_per_host


def role_sections(topology: Any) -> dict[RoleName, Any]:
    """The roles a topology declares, by role name (roles that are absent/None are left out)."""
    roles = getattr(topology, "roles", None)
    if roles is None:
        return {}
    out: dict[RoleName, Any] = {}
    for name in ROLE_NAMES:
        section = roles.get(name) if isinstance(roles, Mapping) else getattr(roles, name, None)
        if section is not None:
            out[name] = section
    return out


def resolve_role_actors(
    topology: Any, actors: Mapping[str, type | str] | None = None
) -> dict[RoleName, type]:
    """Import the actor class of every role the topology declares (overrides first, then defaults)."""
    overrides = dict(actors or {})
    unknown = sorted(set(overrides) - set(ROLE_NAMES))
    if unknown:
        raise LaunchError(f"actors= names unknown role(s) {unknown}; roles are {', '.join(ROLE_NAMES)}")
    from monarch.actor import Actor

    classes: dict[RoleName, type] = {}
    for role in role_sections(topology):
        target = overrides.get(role, DEFAULT_ACTORS[role])
        if isinstance(target, str):
            try:
                target = import_object(target)
            except BindingError as e:
                hint = "" if role in overrides else " (the default; pass actors={...} to override)"
                raise LaunchError(f"actor class for role {role!r}{hint}: {e}") from e
        if not (isinstance(target, type) and issubclass(target, Actor)):
            raise LaunchError(
                f"actor class for role {role!r} must be a monarch.actor.Actor subclass, got {target!r}"
            )
        if target.__module__ == "__main__" or "<locals>" in target.__qualname__:
            log.debug("role %s actor %s is pickled by value", role, target.__qualname__)
        classes[role] = target
    return classes


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_topology(topology: Any) -> Any:
    if isinstance(topology, (str, os.PathLike)):
        from composer_mesh.topology import load_topology

        return load_topology(Path(topology))
    if not hasattr(topology, "meshes"):
        raise LaunchError(
            f"launch() needs a topology file path or a Topology object, got {type(topology).__name__}"
        )
    return topology


# ------------------------------------------------------------------------------------ launched handles
class _FailureSink:
    """Fault-hook claimer of one launch: records failures of the Monarch meshes it created.

    After the launch has begun stopping, failures of its meshes are expected (actors being stopped)
    and swallowed; the sink stays registered so late reports never reach the unhandled-failure log.
    """

    def __init__(self) -> None:
        self.names: dict[str, tuple[str | None, str]] = {}  # monarch name -> (role, topology mesh)
        self.failures: list[RoleFailure] = []
        self.stopping = False

    def __call__(self, failure: Any) -> bool:
        name = str(getattr(failure, "mesh_name", ""))
        # Monarch names a mesh "<given name>-<unique suffix>"; the names we give contain no '-'.
        owner = self.names.get(name.split("-", 1)[0])
        if owner is None:
            return False
        if self.stopping:
            return True
        role, mesh = owner
        try:
            report = str(failure.report())
        except Exception:
            report = repr(failure)
        self.failures.append(RoleFailure(role=role, mesh=mesh, monarch_mesh=name, report=report))
        first = report.strip().splitlines()[:1]
        log.error(
            "actor failure in role %s on mesh %s: %s", role or "(procs)", mesh, first[0] if first else ""
        )
        return True


class LaunchedMesh:
    """What `launch` yields: typed role handles, proc meshes and where everything runs.

    `trainer`, `generators`, `rewarder`, `teachers` are Monarch actor meshes spanning all procs of the
    role's mesh (extent `{hosts, procs}`); call endpoints on them as usual (`await h.ep.call(...)`,
    `.call_one` on a single-proc mesh, `.slice(hosts=.., procs=..)`).
    """

    def __init__(self, topology: Any, launch_id: str) -> None:
        self.topology = topology
        self.launch_id = launch_id
        self.proc_meshes: dict[str, ProcMesh] = {}
        self.actors: dict[RoleName, Any] = {}
        self.roles: dict[RoleName, RolePlacement] = {}
        self.slurm_job_ids: dict[str, str] = {}
        self._sink = _FailureSink()
        self._failures = self._sink.failures

    # typed role handles -----------------------------------------------------------------------
    def _role(self, role: RoleName) -> Any:
        try:
            return self.actors[role]
        except KeyError:
            raise LookupError(
                f"topology {getattr(self.topology, 'name', '?')!r} declares no {role!r} role "
                f"(it has: {', '.join(self.actors) or 'none'})"
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

    def mesh_of(self, role: RoleName) -> str:
        """Name of the topology mesh a role runs on."""
        return self.roles[role].mesh

    # failures --------------------------------------------------------------------------------------
    @property
    def failures(self) -> list[RoleFailure]:
        """Failures recorded so far (a copy)."""
        return list(self._failures)

    def check(self) -> None:
        """Raise `MeshFailureError` if any actor or proc of this launch has failed."""
        if self._failures:
            raise MeshFailureError(self._failures, during="while running")

    def _register(self, monarch_name: str, role: str | None, mesh: str) -> None:
        self._sink.names[monarch_name] = (role, mesh)

    async def _settled_failures(self, wait: float) -> list[RoleFailure]:
        """Failures, waiting up to `wait` s for the fault hook when a supervision error is in flight."""
        deadline = time.monotonic() + wait
        while not self._failures and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.failures

    def __repr__(self) -> str:
        placed = ", ".join(f"{r}@{p.mesh}" for r, p in self.roles.items())
        return f"LaunchedMesh({getattr(self.topology, 'name', '?')!r}: {placed})"


# ------------------------------------------------------------------------------------- Slurm helpers
_SLURM_TERMINAL = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
}  # fmt: skip


def normalize_squeue_job(job: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one `squeue --json` job into the layout Monarch 0.7 reads (Slurm >= 23.11).

    Slurm 22.05 (openapi v0.0.38, Debian 12) has `job_state: "RUNNING"` and
    `job_resources.nodes: "vm"` + `allocated_nodes[].nodename`; Monarch wants
    `job_state: ["RUNNING"]` and `job_resources.nodes.allocation[].name`. Newer layouts pass unchanged.
    """
    state = job.get("job_state")
    if isinstance(state, str):
        job["job_state"] = [state]
    res = job.get("job_resources")
    if isinstance(res, dict) and not isinstance(res.get("nodes"), dict):
        alloc = [{"name": n.get("nodename")} for n in res.get("allocated_nodes", []) if isinstance(n, dict)]
        res["nodes"] = {"count": len(alloc), "list": res.get("nodes", ""), "allocation": alloc}
    return job


def select_squeue_job(data: dict[str, Any], job_id: str) -> dict[str, Any] | None:
    """The job with `job_id` from `squeue --json` output (22.05 ignores `--job` and lists every job)."""
    for job in data.get("jobs", []):
        if str(job.get("job_id")) == str(job_id):
            return normalize_squeue_job(job)
    return None


def squeue_job(job_id: str) -> dict[str, Any] | None:
    """Query one job with `squeue --json`, in Monarch's expected layout; None if Slurm no longer lists it."""
    out = subprocess.run(["squeue", "--job", str(job_id), "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        # Newer Slurm fails with "Invalid job id" once the job has left the queue.
        return None
    try:
        return select_squeue_job(json.loads(out.stdout or "{}"), job_id)
    except json.JSONDecodeError:
        log.warning("unparseable squeue --json output for job %s", job_id)
        return None


def _slurm_job_class() -> type:
    """`monarch.job.SlurmJob` that reads Slurm 22.05's `squeue --json` too (built lazily: imports monarch)."""
    global _SlurmJobCls
    if _SlurmJobCls is None:
        from monarch.job import SlurmJob

        class CompatSlurmJob(SlurmJob):  # type: ignore[misc]
            def _get_job_info_json(self, job_id: str) -> dict[str, Any] | None:
                return squeue_job(job_id)

        _SlurmJobCls = CompatSlurmJob
    return _SlurmJobCls


_SlurmJobCls: type | None = None


def hostname_is_loopback_only(host: str | None = None) -> bool:
    """True if this host's name resolves to loopback/link-local addresses only (or not at all).

    Monarch's `TcpWithHostname` transport, which `SlurmJob` switches the client to, panics then
    ("hostname resolved to no non-loopback, non-link-local address").
    """
    try:
        infos = socket.getaddrinfo(host or socket.gethostname(), None)
    except socket.gaierror:
        return True
    addrs = {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}
    return all(a.is_loopback or a.is_link_local for a in addrs)


async def _wait_slurm_running(job: Any, mesh: str, timeout: float | None, log_dir: str) -> str:
    """Poll squeue until the mesh's job runs (cancellable, unlike Monarch's blocking 2 s poll)."""
    job_id = str(job._slurm_job_id)
    start = time.monotonic()
    state: list[str] = []
    while True:
        info = await asyncio.to_thread(squeue_job, job_id)
        if info is None:
            raise LaunchError(
                f"Slurm job {job_id} of mesh {mesh!r} left the queue before running; see {log_dir}"
            )
        state = list(info.get("job_state") or [])
        if "RUNNING" in state:
            return job_id
        if _SLURM_TERMINAL & set(state):
            raise LaunchError(
                f"Slurm job {job_id} of mesh {mesh!r} ended {state} before running; see {log_dir}"
            )
        if timeout is not None and time.monotonic() - start > timeout:
            raise LaunchError(
                f"Slurm job {job_id} of mesh {mesh!r} did not start within start_timeout={timeout:g}s "
                f"(state {state}); it has been cancelled"
            )
        await asyncio.sleep(0.5)


# ---------------------------------------------------------------------------------------- the launch
@dataclass
class _Jobs:
    """Jobs to kill on exit; killing is synchronous so it also runs when the task is being cancelled."""

    process: Any = None
    slurm: dict[str, Any] | None = None

    def kill_all(self) -> None:
        for name, job in list((self.slurm or {}).items()):
            try:
                job.kill()  # scancel
            except Exception:
                log.exception("scancel of the Slurm job of mesh %s failed", name)
            _unregister_atexit(job)
        self.slurm = {}
        if self.process is not None:
            try:
                self.process.kill()
            except Exception:
                log.exception("killing the process job failed")
            self.process = None


_atexit_jobs: dict[int, Any] = {}


def _kill_leftover_jobs() -> None:
    for job in list(_atexit_jobs.values()):
        with suppress(Exception):
            job.kill()
    _atexit_jobs.clear()


atexit.register(_kill_leftover_jobs)


def _register_atexit(job: Any) -> None:
    _atexit_jobs[id(job)] = job


def _unregister_atexit(job: Any) -> None:
    _atexit_jobs.pop(id(job), None)


def _bootstrap_command(mesh: str, spec: MeshSpec) -> Any:
    from monarch.actor import default_bootstrap_cmd

    env = {str(k): str(v) for k, v in spec.env.items()}
    env[runtime.ENV_MESH] = mesh
    env[runtime.ENV_GPUS_PER_PROC] = str(spec.gpus_per_proc)
    return default_bootstrap_cmd().with_env(env)


def launch(
    topology: str | os.PathLike[str] | Any,
    *,
    actors: Mapping[str, type | str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    ready_timeout: float = 900.0,
    stop_timeout: float = 30.0,
) -> AbstractAsyncContextManager[LaunchedMesh]:
    """Launch `topology` (a YAML path or a `Topology`) for the duration of an `async with` block.

    actors: per-role actor class (or `"module:Class"`) overriding `DEFAULT_ACTORS`, e.g. probe actors
        in tests. Classes must live in an importable module (procs import them by reference).
    log_dir: where Slurm writes job stdout/stderr (default `./slurm_logs`); unused without Slurm meshes.
    ready_timeout: seconds to wait for each role's `ready` endpoint (if its class defines one).
    stop_timeout: seconds to wait for each proc mesh to stop before killing jobs anyway.
    """
    return _launch(topology, actors, log_dir, ready_timeout, stop_timeout)


@asynccontextmanager
async def _launch(
    topology: Any,
    actors: Mapping[str, type | str] | None,
    log_dir: str | os.PathLike[str] | None,
    ready_timeout: float,
    stop_timeout: float,
) -> AsyncIterator[LaunchedMesh]:
    topo = _load_topology(topology)
    classes = resolve_role_actors(topo, actors)
    sections = role_sections(topo)
    for role, section in sections.items():
        if section.mesh not in topo.meshes:
            raise LaunchError(
                f"role {role!r} is bound to mesh {section.mesh!r}, which the topology does not define"
            )
    runtime.setup_controller()

    launch_id = uuid.uuid4().hex[:8]
    launched = LaunchedMesh(topo, launch_id)
    jobs = _Jobs()
    slurm_logs = str(Path(log_dir or "slurm_logs").resolve())
    runtime.add_failure_claimer(launched._sink)
    restore_sigterm = _cancel_on_sigterm()
    body_started = False
    try:
        await _start(launched, topo, classes, sections, jobs, slurm_logs, ready_timeout)
        body_started = True
        yield launched
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except MeshFailureError:
        raise
    except BaseException as exc:
        failures = await launched._settled_failures(2.5 if _is_supervision_error(exc) else 0.0)
        if failures:
            during = "inside the launch block" if body_started else "while launching"
            raise MeshFailureError(failures, during=during) from exc
        raise
    finally:
        try:
            await _stop(launched, stop_timeout)
        finally:
            jobs.kill_all()
            restore_sigterm()
    if launched.failures:
        raise MeshFailureError(launched.failures, during="during the launch block")


def _cancel_on_sigterm() -> Callable[[], None]:
    """While launched, SIGTERM cancels the launching task like Ctrl-C does, so cleanup runs.

    Without this, SIGTERM (a scheduler or CI timeout stopping the controller) ends the process without
    unwinding, and Slurm jobs live on until their time limit. Only installed when SIGTERM has its default
    action and we are on the main thread's loop; returns the function that removes it again.
    """
    task = asyncio.current_task()
    try:
        loop = asyncio.get_running_loop()
        if task is None or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return lambda: None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        return lambda: None

    def restore() -> None:
        with suppress(Exception):
            loop.remove_signal_handler(signal.SIGTERM)

    return restore


def _is_supervision_error(exc: BaseException) -> bool:
    """Monarch's SupervisionError (private class path), directly or as the cause: a proc/actor died."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if type(seen).__name__ == "SupervisionError":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def _start(
    launched: LaunchedMesh,
    topo: Any,
    classes: dict[RoleName, type],
    sections: dict[RoleName, Any],
    jobs: _Jobs,
    slurm_logs: str,
    ready_timeout: float,
) -> None:
    from monarch.actor import this_host

    meshes: dict[str, MeshSpec] = dict(topo.meshes)
    by_backend: dict[str, list[str]] = {"local": [], "process": [], "slurm": []}
    for name, spec in meshes.items():
        by_backend[spec.backend].append(name)

    # Slurm first: SlurmJob() reconfigures Monarch's transport and must precede the client's use of it.
    host_meshes: dict[str, Any] = {}
    if by_backend["slurm"]:
        jobs.slurm = {}
        SlurmJob = _slurm_job_class()
        os.makedirs(slurm_logs, exist_ok=True)
        for name in by_backend["slurm"]:
            spec = meshes[name]
            # Monarch appends "_<controller pid>" to the job name.
            if hasattr(topo, "slurm_job_name"):
                job_name = topo.slurm_job_name(name)
            else:
                job_name = f"{getattr(topo, 'name', 'topology')}_{name}"
            kwargs = spec.slurm_job_kwargs(job_name=job_name)
            job = SlurmJob(meshes={name: spec.hosts}, python_exe=sys.executable, log_dir=slurm_logs, **kwargs)
            jobs.slurm[name] = job
        if hostname_is_loopback_only():
            from monarch.actor import ChannelTransport
            from monarch.config import configure

            log.warning(
                "hostname %r resolves only to loopback: the Monarch client listens on localhost, which works "
                "only when every Slurm node is this machine",
                socket.gethostname(),
            )
            configure(default_transport=ChannelTransport.TcpWithLocalhost)
        for job in jobs.slurm.values():
            _register_atexit(job)
            # sbatch, synchronously (~0.1 s): in a thread, a cancellation could let it submit a job
            # after the cleanup already ran.
            job.apply()
        # All jobs are queued already, so waiting for them one after the other costs no extra time.
        for name, job in jobs.slurm.items():
            options = meshes[name].slurm
            timeout = options.start_timeout if options is not None else None
            launched.slurm_job_ids[name] = await _wait_slurm_running(job, name, timeout, slurm_logs)
            host_meshes[name] = getattr(job.state(cached_path=None), name)

    if by_backend["process"]:
        from monarch.job import ProcessJob

        jobs.process = ProcessJob({name: meshes[name].hosts for name in by_backend["process"]})
        state = jobs.process.state(cached_path=None)
        for name in by_backend["process"]:
            host_meshes[name] = getattr(state, name)

    for name in by_backend["local"]:
        host_meshes[name] = this_host()

    for name, spec in meshes.items():
        per_host = {"procs": spec.procs_per_host}
        if spec.backend == "local":
            # this_host() has no hosts dim: add one so every backend gives the same {hosts, procs} shape.
            per_host = {"hosts": 1, **per_host}
        monarch_name = f"mesh_{name}_{launched.launch_id}"
        launched._register(monarch_name, None, name)
        launched.proc_meshes[name] = host_meshes[name].spawn_procs(
            per_host=per_host,
            name=monarch_name,
            bootstrap=runtime.proc_setup,
            bootstrap_command=_bootstrap_command(name, spec),
        )

    for role, cls in classes.items():
        mesh = sections[role].mesh
        spec = meshes[mesh]
        actor_name = f"{role}_{launched.launch_id}"
        launched._register(actor_name, role, mesh)
        config = RoleConfig(role=role, mesh=mesh, topology=topo)
        launched.actors[role] = launched.proc_meshes[mesh].spawn(actor_name, cls, config)
        launched.roles[role] = RolePlacement(
            role=role,
            mesh=mesh,
            backend=spec.backend,
            hosts=spec.hosts,
            procs_per_host=spec.procs_per_host,
            gpus_per_proc=spec.gpus_per_proc,
            actor_class=_class_path(cls),
        )

    await asyncio.gather(*(_ready(launched, role, classes[role], ready_timeout) for role in classes))


async def _ready(launched: LaunchedMesh, role: RoleName, cls: type, timeout: float) -> None:
    """Wait until every actor of `role` has finished `__init__` (only if the class has a `ready` endpoint)."""
    from monarch._src.actor.endpoint import EndpointProperty

    if not isinstance(getattr(cls, READY_ENDPOINT, None), EndpointProperty):
        return
    endpoint = getattr(launched.actors[role], READY_ENDPOINT)
    try:
        await asyncio.wait_for(endpoint.call(), timeout)
    except asyncio.TimeoutError:
        raise LaunchError(
            f"role {role!r} on mesh {launched.mesh_of(role)!r} was not ready after {timeout:g}s"
        ) from None
    except Exception as e:
        failures = await launched._settled_failures(2.5 if _is_supervision_error(e) else 0.0)
        if failures:
            raise MeshFailureError(failures, during="while starting") from e
        raise LaunchError(
            f"role {role!r} on mesh {launched.mesh_of(role)!r} failed its ready check: {e}"
        ) from e


async def _stop(launched: LaunchedMesh, timeout: float) -> None:
    """Stop every proc mesh (in parallel, bounded); errors are logged, never raised over the real one."""

    async def stop_one(name: str, pm: Any) -> None:
        try:
            await asyncio.wait_for(pm.stop(), timeout)
        except Exception as e:
            log.warning("stopping proc mesh %s failed (%s); its job is killed next", name, e)

    # Stopping meshes ends actors: failures reported from here on are expected, not news.
    launched._sink.stopping = True
    await asyncio.gather(*(stop_one(n, pm) for n, pm in launched.proc_meshes.items()))
