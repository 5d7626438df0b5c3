"""Launch meshes on Monarch and spawn named actor meshes on them, with guaranteed cleanup.

This module knows meshes, not roles: it is given mesh specs and a list of `ActorPlacement`s (a name, a
mesh, an actor class and its constructor arguments). The layer above builds those from a
topology's roles.

What `launch_meshes` does, in order:
1. creates the jobs, one per backend that has meshes (`composer_mesh.mesh.jobs`: one `SlurmJob` per `slurm`
   mesh, sbatch'ed and waited for until RUNNING; one `ProcessJob` for all `process` meshes, a local worker process
   per host; `this_host()` for `local` meshes), and waits until their hosts are up;
2. spawns one proc mesh per mesh, with extent `{hosts: H, procs: P}` on every backend, each proc running
   `runtime.proc_setup` (GPU pinning from `gpus_per_proc` and, for `local` meshes, the host GPUs
   `gpus.assign_gpus` gives them, so that local meshes never share a GPU; the mesh's `env`; quiet logs);
3. spawns each placement's actor class over all procs of its mesh as `ActorClass(*args)`, then calls the
   class's `ready` endpoint if it has one, so that `__init__` errors surface as a `MeshFailureError`;
4. on exit, normal or not (exception, Ctrl-C / task cancellation, SIGTERM), stops every proc mesh and then
   every job (kills the process job, `scancel`s every Slurm job).

Failures: Monarch's default fault hook exits the controller. Ours records each failure with the actor
mesh and mesh it belongs to. An exception leaving the block after an actor failure is re-raised as
`MeshFailureError` (the original chained); failures recorded during a block that ended normally raise at
exit; `launched.check()` raises them on demand, e.g. between training steps.

Jobs can end outside the controller (Slurm: preemption, time limit): `launched.watch_jobs()` returns a
`JobNotice` when one is warned (`--signal` before its limit) or stops running, so the caller can checkpoint.
Launch knows no backend: everything backend-specific is behind the `Job` protocol of `composer_mesh.mesh.jobs`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# `runtime` sets Monarch's import-time environment; it must run before the first `import monarch`, so
# this module imports monarch only inside functions.
from composer_mesh.mesh import runtime
from composer_mesh.mesh.gpus import assign_gpus, format_gpus, shared_gpus
from composer_mesh.mesh.jobs import Job, JobContext, JobError, JobNotice, create_jobs
from composer_mesh.mesh.spec import MeshSpec

if TYPE_CHECKING:
    from monarch.actor import ProcMesh

log = logging.getLogger("composer_mesh.mesh.launch")

# Name of the optional readiness endpoint launch calls on every actor mesh before returning.
READY_ENDPOINT = "ready"


class LaunchError(RuntimeError):
    """The meshes could not be launched (bad actor class, Slurm job that never ran, ...)."""


@dataclass(frozen=True)
class ActorPlacement:
    """One actor mesh to spawn: `actor_class(*args)` on every proc of `mesh`, reported under `name`."""

    name: str  # identifier-like, unique per launch (failures and handles are keyed by it)
    mesh: str
    actor_class: type
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class PlacedActor:
    """Where a spawned actor mesh runs: its mesh, backend, shape and actor class."""

    name: str
    mesh: str
    backend: str
    hosts: int
    procs_per_host: int
    gpus_per_proc: int
    actor_class: str  # "module:Class"


@dataclass(frozen=True)
class ActorFailure:
    """One Monarch failure event, attributed to an actor mesh (None: the proc mesh itself) and a mesh."""

    actor: str | None
    mesh: str
    monarch_mesh: str  # Monarch's name of the failed actor/proc mesh
    report: str


class MeshFailureError(RuntimeError):
    """An actor or proc of a launch failed. `failures` says which actor mesh on which mesh."""

    def __init__(self, failures: Sequence[ActorFailure], during: str) -> None:
        self.failures = list(failures)
        places = sorted({(f.actor or "(procs)", f.mesh) for f in self.failures})
        self.actors = sorted({f.actor for f in self.failures if f.actor is not None})
        where = ", ".join(f"{actor!r} on mesh {mesh!r}" for actor, mesh in places)
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


def check_actor_class(name: str, cls: Any) -> type:
    """`cls` if it is a Monarch `Actor` subclass; a `LaunchError` naming the placement otherwise."""
    from monarch.actor import Actor

    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise LaunchError(f"actor class for {name!r} must be a monarch.actor.Actor subclass, got {cls!r}")
    return cls


class _FailureSink:
    """Fault-hook claimer of one launch: records failures of the Monarch meshes it created.

    After the launch has begun stopping, failures of its meshes are expected (actors being stopped)
    and swallowed; the sink stays registered so late reports never reach the unhandled-failure log.
    """

    def __init__(self) -> None:
        self.names: dict[str, tuple[str | None, str]] = {}  # monarch name -> (actor mesh, mesh)
        self.failures: list[ActorFailure] = []
        self.recovered: list[ActorFailure] = []  # failures of meshes since replaced (`LaunchedMeshes.respawn`)
        self.retired: set[str] = set()  # monarch names of replaced meshes: their late reports are expected
        self.stopping = False

    def retire(self, mesh: str) -> None:
        """Mesh `mesh` is being replaced, or given up on by a caller that handles it (e.g. a run that stops
        with a checkpoint): its failures so far are recovered, later reports of it expected."""
        old = {name for name, (_, m) in self.names.items() if m == mesh}
        self.retired |= old
        self.recovered += [f for f in self.failures if f.mesh == mesh]
        self.failures = [f for f in self.failures if f.mesh != mesh]

    def __call__(self, failure: Any) -> bool:
        name = str(getattr(failure, "mesh_name", ""))
        # Monarch names a mesh "<given name>-<unique suffix>"; the names we give contain no '-'.
        owner = self.names.get(name.split("-", 1)[0])
        if owner is None:
            return False
        if self.stopping or name.split("-", 1)[0] in self.retired:
            return True
        actor, mesh = owner
        try:
            report = str(failure.report())
        except Exception:
            report = repr(failure)
        self.failures.append(ActorFailure(actor=actor, mesh=mesh, monarch_mesh=name, report=report))
        first = report.strip().splitlines()[:1]
        # A warning, not an error: the run replaces a dead generator, rewarder or teacher proc; when it cannot,
        # the run stops and the command line says so (`MeshFailureError`, exit 3).
        log.warning("%s on mesh %s failed: %s", actor or "(procs)", mesh, first[0] if first else "")
        return True


class LaunchedMeshes:
    """What `launch_meshes` yields: the actor meshes by name, the proc meshes and where everything runs.

    `actors[name]` spans all procs of its mesh (extent `{hosts, procs}`); `per_proc(name)` gives one
    handle per proc. `gpu_devices[mesh]` lists the host GPUs of each `local` mesh.
    """

    def __init__(self, specs: Mapping[str, MeshSpec], launch_id: str) -> None:
        self.specs = dict(specs)
        self.launch_id = launch_id
        self.gpu_devices: dict[str, list[int]] = assign_gpus(self.specs)
        self.proc_meshes: dict[str, ProcMesh] = {}
        self.actors: dict[str, Any] = {}
        self.placements: dict[str, PlacedActor] = {}
        self.jobs: list[Job] = []  # one per backend with meshes here, in creation order (`mesh.jobs.create_jobs`)
        self.placed: list[ActorPlacement] = []  # what was spawned, in order (respawn spawns it again)
        self.respawns: dict[str, int] = {}  # mesh -> times its procs were replaced
        self.spares: dict[str, tuple[Any, dict[str, Any]]] = {}  # mesh -> (spare proc mesh, its actor meshes)
        self._preparing: dict[str, Any] = {}  # mesh -> proc mesh of a spare not set up yet
        self._spawned = 0  # replacement and spare proc meshes spawned (unique names)
        self.stand_ins: dict[tuple[str, int], Any] = {}  # (actor mesh, rank) -> actor on a one-proc stand-in
        self._stand_in_procs: dict[str, Any] = {}  # Monarch name -> one-proc stand-in proc mesh (stopped on exit)
        self.ready_timeout = 900.0
        self._sink = _FailureSink()
        self._stopping: set[asyncio.Future[None]] = set()  # replaced proc meshes being stopped

    def job_of(self, mesh: str) -> Job:
        """The job that holds mesh `mesh`'s hosts."""
        return next(job for job in self.jobs if mesh in job.specs)

    @property
    def job_ids(self) -> dict[str, str]:
        """Mesh -> the scheduler's id of its job now (meshes on a scheduler only, e.g. Slurm)."""
        return {mesh: job_id for job in self.jobs for mesh, job_id in job.job_ids.items()}

    @property
    def slurm_job_ids(self) -> dict[str, str]:
        """`job_ids` (Slurm is the one scheduler backend today; the name scripts and tests know)."""
        return self.job_ids

    def per_proc(self, name: str) -> list[Any]:
        """One handle per actor of actor mesh `name`, in (host, proc) order (a proc replaced alone by
        `respawn_proc` is its one-proc stand-in)."""
        spec = self.specs[self.placements[name].mesh]
        handle = self.actors[name]
        return [self.stand_ins.get((name, h * spec.procs_per_host + p)) or handle.slice(hosts=h, procs=p)
                for h in range(spec.hosts) for p in range(spec.procs_per_host)]

    @property
    def failures(self) -> list[ActorFailure]:
        """Failures recorded so far (a copy)."""
        return list(self._sink.failures)

    def check(self) -> None:
        """Raise `MeshFailureError` if any actor or proc of this launch has failed."""
        if self._sink.failures:
            raise MeshFailureError(self._sink.failures, during="while running")

    async def watch_jobs(self, poll_s: float = 5.0) -> JobNotice:
        """The next notice about this launch's jobs: a time-limit warning or a job that stopped running.

        The controller runs outside its jobs, so preemption and time limits reach it only this way: race
        this against the work (`asyncio.wait(..., return_when=FIRST_COMPLETED)`) and checkpoint on a
        notice (`JobNotice.replaceable` says whether a new job can take over the mesh instead). Each job
        watches itself (`Job.watch`: Slurm polls squeue every `poll_s` s in a thread); cancellable. Without
        jobs that can end on their own it waits until cancelled.
        """
        watches = [asyncio.ensure_future(job.watch(poll_s)) for job in self.jobs]
        if not watches:
            await asyncio.Event().wait()  # never set: no job, nothing to hear of
        try:
            done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
            return next(iter(done)).result()
        finally:
            for watch in watches:
                watch.cancel()
            await asyncio.gather(*watches, return_exceptions=True)

    def actors_on(self, mesh: str) -> list[str]:
        """The actor meshes placed on mesh `mesh` (they live and die with its procs)."""
        return [p.name for p in self.placed if p.mesh == mesh]

    async def respawn(self, mesh: str, stop_timeout: float = 10.0) -> tuple[list[str], bool]:
        """Replace mesh `mesh`'s procs and every actor on it after one of its procs died; returns the actor
        meshes replaced (their handles in `actors` are new: the callers set them up again) and whether they
        came from a warm spare (then already set up by the caller, see `spawn_spare`).

        Without a spare, a new proc mesh on the same hosts: Monarch 0.7 cannot add a proc to a proc mesh, and
        spawning on a proc mesh with a dead rank hangs. The old proc mesh is stopped (its surviving procs too;
        in the background when a spare takes over); its failures move to `recovered`, its late reports are
        expected. A mesh whose job has ended (Slurm) gets a new job (`_respawn_on_new_job`)."""
        if await self.job_of(mesh).confirm_ended(mesh):
            return await _respawn_on_new_job(self, mesh)
        self._sink.retire(mesh)
        t0 = time.perf_counter()
        self._retire_stand_ins(mesh)
        old, count = self.proc_meshes[mesh], self.respawns.get(mesh, 0) + 1
        self.respawns[mesh] = count
        if mesh in self.spares:
            self.proc_meshes[mesh], actors = self.spares.pop(mesh)
            self.actors.update(actors)
            self._stopping.add(asyncio.ensure_future(_stop_quietly(mesh, old, stop_timeout)))
            log.warning("mesh %s: its warm spare took over (respawn %d) in %.2f s", mesh, count,
                        time.perf_counter() - t0)
            return list(actors), True
        await _stop_quietly(mesh, old, stop_timeout)
        self.proc_meshes[mesh], actors = await self._spawn_mesh(mesh)
        self.actors.update(actors)
        log.warning("mesh %s: procs replaced (respawn %d) in %.2f s; actors %s spawned again", mesh, count,
                    time.perf_counter() - t0, ", ".join(actors))
        return list(actors), False

    async def respawn_proc(self, mesh: str, rank: int) -> dict[str, Any]:
        """Replace proc `rank` of mesh `mesh` alone, after it died, by a one-proc stand-in mesh on the same host
        (pinned to the dead proc's GPUs) with every actor placed on the mesh spawned there and ready; returns
        those actors by name (`per_proc` hands them out from now on; the caller sets them up).

        For procs that are independent replicas (DiLoCo trainers): the mesh's other procs stay and go on, so
        the damaged proc mesh is not stopped until exit (Monarch 0.7: its live ranks still answer calls made
        through slices; a call over the whole mesh fails). Its failures move to `recovered`."""
        spec = self.specs[mesh]
        if not 0 <= rank < spec.hosts * spec.procs_per_host:
            raise LaunchError(f"mesh {mesh!r} has no proc {rank} ({spec.hosts} x {spec.procs_per_host} procs)")
        self._sink.retire(mesh)
        t0 = time.perf_counter()
        self.respawns[mesh] = self.respawns.get(mesh, 0) + 1
        _, actors = await self._spawn_mesh(mesh, rank=rank)
        self.stand_ins.update({(name, rank): handle for name, handle in actors.items()})
        log.warning("mesh %s: proc %d replaced alone (respawn %d) in %.2f s; actors %s spawned again", mesh, rank,
                    self.respawns[mesh], time.perf_counter() - t0, ", ".join(actors))
        return actors

    def _retire_stand_ins(self, mesh: str) -> None:
        """A whole-mesh respawn replaces the one-proc stand-ins of `mesh` too: they stop in the background."""
        names = {name for name, _ in self.stand_ins if self.placements[name].mesh == mesh}
        self.stand_ins = {k: v for k, v in self.stand_ins.items() if k[0] not in names}
        for key in [k for k in self._stand_in_procs if k.startswith(f"{mesh} proc ")]:
            procs = self._stand_in_procs.pop(key)
            self._stopping.add(asyncio.ensure_future(_stop_quietly(key, procs, 10.0)))

    async def spawn_spare(self, mesh: str) -> tuple[Any, dict[str, Any]]:
        """Procs and actors for a warm spare of mesh `mesh` (`MeshSpec.spare`), ready; the caller sets the
        actors up (e.g. builds models), then hands them to `keep_spare`, from where `respawn` swaps them in."""
        return await self._spawn_mesh(mesh, preparing=True)

    def has_spare(self, mesh: str) -> bool:
        """A spare of mesh `mesh` is ready or being prepared."""
        return mesh in self.spares or mesh in self._preparing

    def keep_spare(self, mesh: str, spare: tuple[Any, dict[str, Any]]) -> None:
        self._preparing.pop(mesh, None)
        self.spares[mesh] = spare

    async def _spawn_mesh(self, mesh: str, preparing: bool = False,
                          rank: int | None = None) -> tuple[Any, dict[str, Any]]:
        """New procs for mesh `mesh` on its hosts (with `rank`: one proc standing in for that proc, on its host),
        every actor placed on it spawned there and ready. A spare's (`preparing`) or a stand-in's procs are noted
        at once, so they are stopped on exit even if they never get ready."""
        self._spawned += 1
        suffix = f"r{self._spawned}"
        host, proc_index = None, None
        if rank is not None:
            host, proc_index = divmod(rank, self.specs[mesh].procs_per_host)
        procs = _spawn_proc_mesh(self, mesh, suffix, host, proc_index)
        if preparing:
            self._preparing[mesh] = procs
        if rank is not None:
            self._stand_in_procs[f"{mesh} proc {rank} ({suffix})"] = procs
        placements = [p for p in self.placed if p.mesh == mesh]
        actors = _spawn_actors(self, placements, suffix, procs)
        await asyncio.gather(*(_ready(self, p, self.ready_timeout, actors[p.name]) for p in placements))
        return procs, actors

    def give_up(self, mesh: str) -> None:
        """The caller handles mesh `mesh`'s failure itself (it stops cleanly without it): leaving the `launch`
        block does not raise for it. Its procs are still stopped on exit."""
        log.warning("mesh %s: failed and not replaced; the caller handles it", mesh)
        self._sink.retire(mesh)

    async def settled_failures(self, wait: float) -> list[ActorFailure]:
        """Failures, waiting up to `wait` s for the fault hook when a supervision error is in flight."""
        deadline = time.monotonic() + wait
        while not self._sink.failures and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.failures


def launch_meshes(
    meshes: Mapping[str, MeshSpec],
    actors: Sequence[ActorPlacement],
    *,
    run_name: str,
    log_dir: str | os.PathLike[str] | None = None,
    ready_timeout: float = 900.0,
    stop_timeout: float = 30.0,
) -> AbstractAsyncContextManager[LaunchedMeshes]:
    """Launch `meshes` and spawn `actors` on them for the duration of an `async with` block.

    run_name: names Slurm jobs (`<run_name>_<mesh>` unless a mesh sets `slurm.job_name`).
    log_dir: where Slurm writes job stdout/stderr (default `./slurm_logs`); unused without Slurm meshes.
    ready_timeout: seconds to wait for each actor mesh's `ready` endpoint (if its class defines one).
    stop_timeout: seconds to wait for each proc mesh to stop before killing jobs anyway.
    """
    names = [a.name for a in actors]
    if len(set(names)) != len(names):
        raise LaunchError(f"actor mesh names must be unique, got {names}")
    for placement in actors:
        if placement.mesh not in meshes:
            raise LaunchError(f"{placement.name!r} is placed on mesh {placement.mesh!r}, which is not defined")
        check_actor_class(placement.name, placement.actor_class)
    clashes = shared_gpus(assign_gpus(meshes))
    if clashes:
        raise LaunchError(
            "; ".join(f"local meshes {a!r} and {b!r} would share {format_gpus(c)}" for a, b, c in clashes)
            + ": give them disjoint gpu_devices / gpu_offset (or put what should share a GPU on one mesh)"
        )
    slurm_logs = str(Path(log_dir or "slurm_logs").resolve())
    return _launch(dict(meshes), list(actors), run_name, slurm_logs, ready_timeout, stop_timeout)


@asynccontextmanager
async def _launch(
    meshes: dict[str, MeshSpec],
    actors: list[ActorPlacement],
    run_name: str,
    slurm_logs: str,
    ready_timeout: float,
    stop_timeout: float,
) -> AsyncIterator[LaunchedMeshes]:
    runtime.setup_controller()
    launched = LaunchedMeshes(meshes, uuid.uuid4().hex[:8])
    launched.ready_timeout = ready_timeout
    launched.jobs = create_jobs(meshes, JobContext(run_name=run_name, log_dir=slurm_logs))
    runtime.add_failure_claimer(launched._sink)
    restore_sigterm = _cancel_on_sigterm()
    body_started = False
    try:
        await _start_meshes(launched)
        _spawn_actors(launched, actors)
        await asyncio.gather(*(_ready(launched, a, ready_timeout) for a in actors))
        body_started = True
        yield launched
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit, MeshFailureError):
        raise
    except BaseException as exc:
        failures = await launched.settled_failures(2.5 if is_proc_death(exc) else 0.0)
        if failures:
            during = "inside the launch block" if body_started else "while launching"
            raise MeshFailureError(failures, during=during) from exc
        raise
    finally:
        try:
            await _stop(launched, stop_timeout)
        finally:
            for job in launched.jobs:
                job.stop()
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


def is_proc_death(exc: BaseException) -> bool:
    """Whether a call failed because the actor's proc died: Monarch's SupervisionError (private class path),
    directly or as the cause, as opposed to an exception raised by the endpoint (`ActorError`)."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if type(seen).__name__ == "SupervisionError":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _bootstrap_command(mesh: str, spec: MeshSpec, gpu_devices: list[int] | None, proc_index: int | None = None) -> Any:
    from monarch.actor import default_bootstrap_cmd

    env = {str(k): str(v) for k, v in spec.env.items()}
    if proc_index is not None:  # one proc standing in for proc `proc_index` of its host: pin that proc's GPUs
        env[runtime.ENV_PROC_INDEX] = str(proc_index)
    env[runtime.ENV_MESH] = mesh
    env[runtime.ENV_GPUS_PER_PROC] = str(spec.gpus_per_proc)
    if gpu_devices is not None:  # a local mesh: its share of this host's GPUs
        env[runtime.ENV_GPU_DEVICES] = ",".join(map(str, gpu_devices))
    env.update(forwarded_python_path(env.get("PYTHONPATH")))
    return default_bootstrap_cmd().with_env(env)


def forwarded_python_path(mesh_path: str | None) -> dict[str, str]:
    """PYTHONPATH for a proc: the mesh's own `env` entry, then the controller's (which holds the topology's
    `python_path:` and `--python-path` directories), so every proc imports the user's modules as the controller
    does, on any backend."""
    parts = [p for p in (mesh_path, os.environ.get("PYTHONPATH")) if p]
    return {"PYTHONPATH": os.pathsep.join(parts)} if parts else {}


async def _start_meshes(launched: LaunchedMeshes) -> None:
    """Every job created and its hosts up, one backend after the other (Slurm's first: `mesh.jobs.JOB_BACKENDS`),
    then one proc mesh per mesh."""
    for job in launched.jobs:
        job.create()
        try:
            await job.wait()
        except JobError as e:
            raise LaunchError(str(e)) from None
    for name in launched.specs:
        launched.proc_meshes[name] = _spawn_proc_mesh(launched, name)


def _spawn_proc_mesh(launched: LaunchedMeshes, name: str, suffix: str = "", host: int | None = None,
                     proc_index: int | None = None) -> Any:
    """Mesh `name`'s procs on its hosts, named for the failure sink (`suffix` tells a replacement apart). With
    `host` and `proc_index`, one proc on that host standing in for that proc of it (`LaunchedMeshes.respawn_proc`)."""
    spec = launched.specs[name]
    monarch_name = f"mesh_{name}_{launched.launch_id}{suffix}"
    launched._sink.names[monarch_name] = (None, name)
    return launched.job_of(name).spawn_procs(
        name,
        {"procs": spec.procs_per_host if proc_index is None else 1},
        name=monarch_name,
        host=host,
        bootstrap=runtime.proc_setup,
        bootstrap_command=_bootstrap_command(name, spec, launched.gpu_devices.get(name), proc_index),
    )


def _spawn_actors(
    launched: LaunchedMeshes, actors: list[ActorPlacement], suffix: str = "", procs: Any = None
) -> dict[str, Any]:
    """Spawn each placement on its mesh's procs (on `procs` for a replacement or spare); the handles by name."""
    spawned = {}
    for placement in actors:
        spec = launched.specs[placement.mesh]
        monarch_name = f"{placement.name}_{launched.launch_id}{suffix}"
        launched._sink.names[monarch_name] = (placement.name, placement.mesh)
        cls = placement.actor_class
        on = procs if procs is not None else launched.proc_meshes[placement.mesh]
        spawned[placement.name] = on.spawn(monarch_name, cls, *placement.args)
        if procs is not None:
            continue
        launched.actors[placement.name] = spawned[placement.name]
        launched.placed.append(placement)
        launched.placements[placement.name] = PlacedActor(
            name=placement.name,
            mesh=placement.mesh,
            backend=spec.backend,
            hosts=spec.hosts,
            procs_per_host=spec.procs_per_host,
            gpus_per_proc=spec.gpus_per_proc,
            actor_class=f"{cls.__module__}:{cls.__qualname__}",
        )
    return spawned


async def _ready(launched: LaunchedMeshes, placement: ActorPlacement, timeout: float, handle: Any = None) -> None:
    """Wait until every actor of `placement` has finished `__init__` (if the class has a `ready` endpoint)."""
    from monarch._src.actor.endpoint import EndpointProperty

    if not isinstance(getattr(placement.actor_class, READY_ENDPOINT, None), EndpointProperty):
        return
    endpoint = getattr(handle if handle is not None else launched.actors[placement.name], READY_ENDPOINT)
    where = f"{placement.name!r} on mesh {placement.mesh!r}"
    try:
        await asyncio.wait_for(endpoint.call(), timeout)
    except asyncio.TimeoutError:
        raise LaunchError(f"{where} was not ready after {timeout:g}s") from None
    except Exception as e:
        failures = await launched.settled_failures(2.5 if is_proc_death(e) else 0.0)
        if failures:
            raise MeshFailureError(failures, during="while starting") from e
        raise LaunchError(f"{where} failed its ready check: {e}") from e


async def _stop_quietly(name: str, procs: Any, timeout: float) -> None:
    """Stop a proc mesh, bounded (stopping one with a dead proc can hang); a failure is only logged."""
    try:
        await asyncio.wait_for(procs.stop(), timeout)
    except Exception as e:
        log.warning("stopping proc mesh %s failed (%s)", name, e)


async def _stop(launched: LaunchedMeshes, timeout: float) -> None:
    """Stop every proc mesh (in parallel, bounded; then the jobs are killed); errors are logged, never raised
    over the real one."""

    # Stopping meshes ends actors: failures reported from here on are expected, not news.
    launched._sink.stopping = True
    # A mesh whose job has ended has no procs left; stopping it would only wait out `timeout`.
    live = {n: pm for n, pm in launched.proc_meshes.items() if not launched.job_of(n).ended(n)}
    spares = {f"{n} (spare)": pm for n, (pm, _) in launched.spares.items()}
    spares.update({f"{n} (spare being prepared)": pm for n, pm in launched._preparing.items()})
    spares.update(launched._stand_in_procs)
    await asyncio.gather(*(_stop_quietly(n, pm, timeout) for n, pm in {**live, **spares}.items()),
                         *launched._stopping)


async def _respawn_on_new_job(launched: LaunchedMeshes, mesh: str) -> tuple[list[str], bool]:
    """`respawn` of a mesh whose job ended (Slurm: node died, job cancelled): a new job from its backend
    (`Job.respawn`), the mesh's procs and every actor placed on it spawned there and ready.

    The old job's procs (and any spare or stand-in) died with it, so nothing is stopped: stopping dead procs
    only waits out the timeout. The job stops the new job at exit like the old one."""
    job = launched.job_of(mesh)
    old_id = job.job_ids.get(mesh)
    launched._sink.retire(mesh)
    t0 = time.perf_counter()
    count = launched.respawns[mesh] = launched.respawns.get(mesh, 0) + 1
    launched.spares.pop(mesh, None)
    launched._preparing.pop(mesh, None)
    launched._retire_stand_ins(mesh)
    launched.proc_meshes.pop(mesh, None)
    try:
        await job.respawn(mesh)
    except JobError as e:
        raise LaunchError(str(e)) from None
    launched.proc_meshes[mesh], actors = await launched._spawn_mesh(mesh)
    launched.actors.update(actors)
    log.warning("mesh %s: job %s ended; new job %s (respawn %d) running its procs in %.2f s; actors %s "
                "spawned again", mesh, old_id, job.job_ids.get(mesh), count, time.perf_counter() - t0,
                ", ".join(actors))
    return list(actors), False
