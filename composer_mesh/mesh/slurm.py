"""Slurm compatibility for Monarch 0.7: one Slurm job per mesh, on the Slurm versions clusters run.

Monarch's `SlurmJob` reads `squeue --json` in the layout of Slurm >= 23.11 and polls it blocking; this
module normalises older layouts (Debian 12 ships 22.05), waits for a job cancellably, and detects a
hostname that only resolves to loopback (Monarch's client transport then needs `TcpWithLocalhost`).
"""

from __future__ import annotations

import asyncio
import atexit
import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

log = logging.getLogger("composer_mesh.mesh.slurm")


class SlurmStartError(RuntimeError):
    """A mesh's Slurm job never reached RUNNING (it ended, left the queue or missed its start timeout)."""


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


def create_jobs(job_kwargs: dict[str, dict[str, Any]], hosts: dict[str, int], log_dir: str) -> dict[str, Any]:
    """One `SlurmJob` per mesh (name -> `SlurmJob` keyword arguments), not yet submitted.

    Must run before the client uses Monarch's transport: `SlurmJob()` reconfigures it. The caller holds the
    jobs before `submit` runs, so a submission that fails half way still cancels the ones already queued.
    """
    cls = slurm_job_class()
    os.makedirs(log_dir, exist_ok=True)
    jobs = {
        name: cls(meshes={name: hosts[name]}, python_exe=sys.executable, log_dir=log_dir, **kwargs)
        for name, kwargs in job_kwargs.items()
    }
    if hostname_is_loopback_only():
        from monarch.actor import ChannelTransport
        from monarch.config import configure

        log.warning(
            "hostname %r resolves only to loopback: the Monarch client listens on localhost, which works "
            "only when every Slurm node is this machine",
            socket.gethostname(),
        )
        configure(default_transport=ChannelTransport.TcpWithLocalhost)
    return jobs


def submit(jobs: dict[str, Any]) -> None:
    """`sbatch` every job, synchronously (~0.1 s each): in a thread, a cancellation could let a job be
    submitted after cleanup ran. Each is also cancelled at interpreter exit unless unregistered first."""
    for job in jobs.values():
        register_atexit(job)
        job.apply()


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
