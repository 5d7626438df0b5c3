"""Slurm compatibility for Monarch 0.7: one Slurm job per mesh, on the Slurm versions clusters run (the helpers
of the `slurm` job backend, `composer_mesh.mesh.jobs.slurm`).

Monarch's `SlurmJob` reads `squeue --json` in the layout of Slurm >= 23.11 and polls it blocking; this
module normalises older layouts (Debian 12 ships 22.05), waits for a job cancellably, and detects a
hostname that only resolves to loopback (Monarch's client transport then needs `TcpWithLocalhost`).

The controller runs outside the jobs, so it also watches them (`watch`): Slurm's time-limit warning
(`--signal=USR1@N`, recorded by `slurm_worker` in the log dir) and a job leaving RUNNING (preempted,
timed out, cancelled) become `JobNotice`s the caller can checkpoint on.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ipaddress
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from composer_mesh.mesh.jobs.base import JobNotice
from composer_mesh.mesh.slurm_worker import notice_path

log = logging.getLogger("composer_mesh.mesh.jobs.slurm")


class SlurmStartError(RuntimeError):
    """A mesh's Slurm job never reached RUNNING (it ended, left the queue or missed its start timeout)."""


_SLURM_TERMINAL = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
}  # fmt: skip
# A job in these states still runs: SIGNALING is the moment Slurm delivers a signal (e.g. the `--signal`
# warning itself), shown for a poll or two in place of RUNNING; taking it for an end would replace a mesh that
# was only being warned.
_SLURM_STILL_RUNNING = {"RUNNING", "SIGNALING"}


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


class SlurmQueryError(RuntimeError):
    """`squeue` itself failed (slurmctld unreachable, unparseable output): the job's state is unknown."""


def query_job(job_id: str) -> dict[str, Any] | None:
    """One job from `squeue --json`, in Monarch's expected layout; None once Slurm no longer lists it.

    Raises `SlurmQueryError` when squeue fails for another reason, so a watcher does not mistake a
    slurmctld hiccup for the end of the job.
    """
    out = subprocess.run(["squeue", "--job", str(job_id), "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        # Newer Slurm fails with "Invalid job id" once the job has left the queue.
        if "invalid job id" in (out.stderr or "").lower():
            return None
        raise SlurmQueryError(f"squeue failed ({out.returncode}): {(out.stderr or '').strip()[:200]}")
    try:
        return select_squeue_job(json.loads(out.stdout or "{}"), job_id)
    except json.JSONDecodeError:
        raise SlurmQueryError(f"unparseable squeue --json output for job {job_id}") from None


def squeue_job(job_id: str) -> dict[str, Any] | None:
    """`query_job`, with a failed query read as "not listed" (what Monarch's `SlurmJob` expects)."""
    try:
        return query_job(job_id)
    except SlurmQueryError as e:
        log.warning("%s", e)
        return None


def slurm_job_class() -> type:
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


async def wait_until_running(job: Any, mesh: str, timeout: float | None, log_dir: str) -> str:
    """Poll squeue until the mesh's job runs (cancellable, unlike Monarch's blocking 2 s poll)."""
    job_id = str(job._slurm_job_id)
    start = time.monotonic()
    state: list[str] = []
    while True:
        info = await asyncio.to_thread(squeue_job, job_id)
        if info is None:
            raise SlurmStartError(
                f"Slurm job {job_id} of mesh {mesh!r} left the queue before running; see {log_dir}"
            )
        state = list(info.get("job_state") or [])
        if "RUNNING" in state:
            return job_id
        if _SLURM_TERMINAL & set(state):
            raise SlurmStartError(
                f"Slurm job {job_id} of mesh {mesh!r} ended {state} before running; see {log_dir}"
            )
        if timeout is not None and time.monotonic() - start > timeout:
            raise SlurmStartError(
                f"Slurm job {job_id} of mesh {mesh!r} did not start within start_timeout={timeout:g}s "
                f"(state {state}); it has been cancelled"
            )
        await asyncio.sleep(0.5)


def worker_python(log_dir: str) -> str:
    """Monarch's `python_exe`: our `slurm_worker` wrapper, which survives the warning signal and records it.

    Monarch writes it unquoted into `srun <python_exe> -c '<bootstrap>'`, so each word is shell-quoted here.
    """
    exe = f"{shlex.quote(sys.executable)} -m composer_mesh.mesh.slurm_worker"
    return f"{exe} --notice-dir {shlex.quote(log_dir)}"


def warning_args(warning_s: int | None) -> tuple[str, ...]:
    """The sbatch option for the time-limit warning: USR1 to every job step (not `B:`, the batch shell,
    which has no handler and would die of it), `warning_s` seconds before the limit."""
    return () if warning_s is None else (f"--signal=USR1@{warning_s}",)


def _epoch(value: Any) -> float | None:
    """A `squeue --json` time: a number (22.05) or `{"set", "infinite", "number"}` (>= 23.11); 0 = unset."""
    if isinstance(value, dict):
        if not value.get("set") or value.get("infinite"):
            return None
        value = value.get("number")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def job_end_notice(mesh: str, job_id: str, job: dict[str, Any] | None) -> JobNotice | None:
    """The notice for a job that left RUNNING; None while it runs (`job` as `query_job` returns it)."""
    if job is None:
        return JobNotice(mesh, job_id, "ended", "is no longer listed by squeue (it ended)")
    state = [str(s) for s in job.get("job_state") or []]
    if _SLURM_STILL_RUNNING & set(state) and not (_SLURM_TERMINAL & set(state)):
        return None
    reason = str(job.get("state_reason") or "None")
    why = f"state {'+'.join(state) or 'unknown'}" + ("" if reason == "None" else f", reason {reason}")
    if "PREEMPTED" in state:
        return JobNotice(mesh, job_id, "preempted", f"was preempted ({why})")
    if "TIMEOUT" in state:
        return JobNotice(mesh, job_id, "timeout", f"reached its time limit ({why})")
    return JobNotice(mesh, job_id, "ended", f"stopped running ({why})")


def warning_notice(mesh: str, job_id: str, job: dict[str, Any] | None, warning_s: int | None) -> JobNotice:
    """The notice for a job whose worker got the warning signal; the time left is Slurm's end time - now."""
    source = "from --signal" if warning_s is not None else "e.g. from scancel --signal"
    end = _epoch(job.get("end_time")) if job else None
    if end is None:
        return JobNotice(mesh, job_id, "warning", f"got Slurm's warning signal (SIGUSR1 {source})")
    left = max(0, round(end - time.time()))
    return JobNotice(mesh, job_id, "warning", f"will reach its time limit in ~{left} s (SIGUSR1 {source})")


# Slurm 22.05 shows a job that is ending as COMPLETING, without its final state, for a few seconds
# (KillWait + cleanup); the watcher waits this long for the final state before calling it "ended".
COMPLETING_GRACE_S = 60.0


def _still_completing(job: dict[str, Any] | None) -> bool:
    return job is not None and [str(s) for s in job.get("job_state") or []] == ["COMPLETING"]


@dataclass
class JobWatch:
    """What one launch's watcher knows between polls: its jobs, and which warnings were already returned."""

    job_ids: dict[str, str]  # mesh -> Slurm job id
    log_dir: str
    warning_s: dict[str, int | None]  # mesh -> its `slurm.warning_s`
    warned: set[str]  # job ids whose warning was returned

    def poll(self, completing: dict[str, float]) -> JobNotice | None:
        """One round of squeue and warning-file checks (blocking: run it in a thread)."""
        for mesh, old_id in list(self.job_ids.items()):
            # A mesh whose job was replaced (`resubmit`) is watched on its new job from the next poll on.
            job_id = self.job_ids[mesh] = current_job_id(old_id)
            try:
                job = query_job(job_id)
            except SlurmQueryError as e:
                log.warning("cannot tell the state of Slurm job %s of mesh %s: %s", job_id, mesh, e)
                continue
            if _replacement_starting(job_id, job):
                continue
            since = completing.setdefault(job_id, time.monotonic()) if _still_completing(job) else None
            if since is not None and time.monotonic() - since < COMPLETING_GRACE_S:
                continue
            notice = job_end_notice(mesh, job_id, job)
            if notice is not None:
                return notice
            if job_id not in self.warned and os.path.exists(notice_path(self.log_dir, job_id)):
                return warning_notice(mesh, job_id, job, self.warning_s.get(mesh))
        return None

    async def next_notice(self, poll_s: float) -> JobNotice:
        """Poll every `poll_s` s until a notice; cancellable (squeue runs in a thread)."""
        completing: dict[str, float] = {}
        while True:
            notice = await asyncio.to_thread(self.poll, completing)
            if notice is not None:
                if notice.kind == "warning":
                    self.warned.add(notice.job_id)
                return notice
            await asyncio.sleep(poll_s)


# The controller's address as the Slurm nodes reach it, when its hostname does not lead there (e.g. a login
# node whose hostname resolves to an interface the compute nodes cannot route to, or the namespaced test
# cluster of scripts/slurm_netns_up.sh, whose nodes reach the controller only at its bridge address).
CONTROLLER_HOST_ENV = "COMPOSER_MESH_CONTROLLER_HOST"


def controller_transport(host: str) -> str:
    """Monarch's client transport listening on `host` (a name or an IPv4 address), on any free port.

    Monarch's `TcpWithHostname` listens on the first non-loopback address of this machine's hostname, which
    the procs in the Slurm jobs dial back; with `COMPOSER_MESH_CONTROLLER_HOST` the operator names it instead.
    """
    try:
        address = socket.gethostbyname(host)
    except socket.gaierror as e:
        raise ValueError(f"{CONTROLLER_HOST_ENV}={host!r} does not resolve: {e}") from None
    return f"tcp://{address}:0"


def create_jobs(
    job_kwargs: dict[str, dict[str, Any]],
    hosts: dict[str, int],
    log_dir: str,
    warning_s: Mapping[str, int | None],
) -> dict[str, Any]:
    """One `SlurmJob` per mesh (name -> `SlurmJob` keyword arguments), not yet submitted.

    Must run before the client uses Monarch's transport: `SlurmJob()` reconfigures it. The caller holds the
    jobs before `submit` runs, so a submission that fails half way still cancels the ones already queued.
    Every job runs its worker through `slurm_worker` and gets `--signal` from its mesh's `warning_s`.
    """
    cls = slurm_job_class()
    os.makedirs(log_dir, exist_ok=True)
    jobs = {}
    for name, kwargs in job_kwargs.items():
        args = {**kwargs, "slurm_args": (*kwargs.get("slurm_args", ()), *warning_args(warning_s.get(name)))}
        jobs[name] = cls(meshes={name: hosts[name]}, python_exe=worker_python(log_dir), log_dir=log_dir, **args)
    controller_host = os.environ.get(CONTROLLER_HOST_ENV)
    if controller_host:
        from monarch.config import configure

        configure(default_transport=controller_transport(controller_host))
    elif hostname_is_loopback_only():
        from monarch.actor import ChannelTransport
        from monarch.config import configure

        log.warning(
            "hostname %r resolves only to loopback: the Monarch client listens on localhost, which works "
            "only when every Slurm node is this machine",
            socket.gethostname(),
        )
        configure(default_transport=ChannelTransport.TcpWithLocalhost)
    return jobs


def submit(jobs: dict[str, Any], log_dir: str) -> None:
    """`sbatch` every job, synchronously (~0.1 s each): in a thread, a cancellation could let a job be
    submitted after cleanup ran. Each is also cancelled at interpreter exit unless unregistered first.

    A warning file left in `log_dir` by an earlier job with the same id (ids restart when a cluster's
    state is wiped) is removed, so it is not taken for this job's warning.
    """
    for job in jobs.values():
        register_atexit(job)
        if isinstance(port := getattr(job, "_port", None), int):  # Monarch's SlurmJob keeps its worker port there
            _ports_used.add(port)
        job.apply()
        with contextlib.suppress(FileNotFoundError):
            os.remove(notice_path(log_dir, str(job._slurm_job_id)))


# A controller that dies without unwinding (no `finally`) still scancels its jobs at interpreter exit.
_atexit_jobs: dict[int, Any] = {}


def _cancel_leftover_jobs() -> None:
    for job in list(_atexit_jobs.values()):
        try:
            job.kill()
        except Exception:
            log.debug("scancel at exit failed", exc_info=True)
    _atexit_jobs.clear()


atexit.register(_cancel_leftover_jobs)


def register_atexit(job: Any) -> None:
    _atexit_jobs[id(job)] = job


def unregister_atexit(job: Any) -> None:
    _atexit_jobs.pop(id(job), None)
    for old_id in [k for k, (_, owner) in _successors.items() if owner == id(job)]:
        del _successors[old_id]


# --- a mesh whose job ended gets a new job (`LaunchedMeshes.respawn`) ---

_ports_used: set[int] = set()  # worker ports of every job this controller submitted
# job id -> (id of the job that replaced it, id() of the job object), until that object is unregistered: Slurm
# reuses ids once a cluster's state is wiped.
_successors: dict[str, tuple[str, int]] = {}


def replacement_port(port: int) -> int:
    """The worker port of a replacement job: the first above `port` that no job of this controller used.

    Monarch 0.7's client never reaches a worker again at an address (host:port) to which its messages once
    expired (`message_delivery_timeout`, 30 s; an ended job's procs leave such messages behind): the attach
    of a new worker there times out ("config push failed during attach ... reply timed out after
    MESH_ATTACH_CONFIG_TIMEOUT"). A replacement job may start on the same node, so it listens elsewhere.
    """
    candidate = port + 1
    while candidate in _ports_used:
        candidate += 1
    if candidate > 65535:
        raise SlurmStartError(f"no free Monarch worker port above {port} for a replacement job")
    return candidate


def current_job_id(job_id: str) -> str:
    """The id of the job now standing for `job_id`: itself, or the last job that replaced it."""
    seen = {job_id}
    while (successor := _successors.get(job_id)) is not None and successor[0] not in seen:  # read from threads
        job_id = successor[0]
        seen.add(job_id)
    return job_id


def _replacement_starting(job_id: str, job: dict[str, Any] | None) -> bool:
    """A replacement job (`resubmit`) still queued or starting: it has not stopped running, it has yet to run."""
    states = {str(s) for s in (job or {}).get("job_state") or []}
    replacements = {new_id for new_id, _ in list(_successors.values())}
    return bool(states) and states <= {"PENDING", "CONFIGURING"} and job_id in replacements


def resubmit(job: Any, log_dir: str, port: int) -> str:
    """Submit `job` again as a new Slurm job (same options; workers on `port`) and return the new id.

    The same object is reused, so whoever holds it (the launch's `jobs.slurm.SlurmJob`, the exit handler) scancels
    the new job; the old id maps to the new one (`current_job_id`), so a running `JobWatch` follows it.
    """
    old_id = str(job._slurm_job_id)
    job.kill()  # scancel (a job still listed, e.g. COMPLETING, must not come back); forgets its id and hosts
    job._port = port
    job._service_proc_ids = []  # new worker identities: the old ones belong to the dead workers
    submit({"job": job}, log_dir)
    new_id = str(job._slurm_job_id)
    _successors[old_id] = (new_id, id(job))
    return new_id

