"""Backend `slurm`: one Slurm job per mesh (Monarch's `SlurmJob`, one node per host), and the Slurm job-end policy.

The controller runs outside its jobs, so it learns of their end only by watching them (`watch`): Slurm's
time-limit warning (`--signal`, recorded by `slurm_worker`), a preemption or a time limit are `JobNotice`s that
are not `replaceable` (the run's time on the cluster is up: checkpoint and stop); a job that stopped running any
other way (a dead node, a cancel) is `replaceable`: `respawn` submits a new job with the same options, its workers
on a port this controller never used (`slurm_compat.replacement_port`). The Slurm specifics (squeue layouts,
warning files, ports) are `slurm_compat`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from composer_mesh.mesh.jobs import slurm_compat as slurm
from composer_mesh.mesh.jobs.base import JobBase, JobContext, JobError, JobNotice
from composer_mesh.mesh.spec import SlurmMeshSpec

log = logging.getLogger("composer_mesh.mesh.jobs.slurm")


class SlurmJob(JobBase):
    """The Slurm jobs of a launch's slurm meshes: submitted together, waited for one after the other."""

    specs: dict[str, SlurmMeshSpec]

    def __init__(self, specs: Mapping[str, SlurmMeshSpec], context: JobContext) -> None:
        super().__init__(specs, context)
        self.jobs: dict[str, Any] = {}  # mesh -> its submitted monarch SlurmJob (reused by `respawn`)
        self._warned: set[str] = set()  # job ids whose warning `watch` has returned
        self._ended: set[str] = set()  # meshes whose job `watch` saw stop running

    def create(self) -> None:
        """Build every job (this reconfigures Monarch's transport: before anything else uses it), then sbatch them."""
        run, log_dir = self.context.run_name, self.context.log_dir
        kwargs = {n: s.slurm_job_kwargs(job_name=s.job_name(run, n)) for n, s in self.specs.items()}
        hosts = {n: s.hosts for n, s in self.specs.items()}
        warning_s = {n: s.slurm.warning_s for n, s in self.specs.items()}
        self.jobs = slurm.create_jobs(kwargs, hosts, log_dir, warning_s)
        slurm.submit(self.jobs, log_dir)

    async def wait(self) -> None:
        """Each job RUNNING, then its workers attached. All are queued already, so waiting for them one after the
        other costs no extra time."""
        for name, job in self.jobs.items():
            timeout = self.specs[name].slurm.start_timeout
            try:
                self.job_ids[name] = await slurm.wait_until_running(job, name, timeout, self.context.log_dir)
            except slurm.SlurmStartError as e:
                raise JobError(str(e)) from None
            self.hosts[name] = getattr(job.state(cached_path=None), name)

    async def watch(self, poll_s: float) -> JobNotice:
        """Polls squeue and the warning files every `poll_s` s (in a thread; cancellable). `warning` once per job;
        `preempted` / `timeout` / `ended` once a job left RUNNING (at every call, as it stays so)."""
        if not self.job_ids:
            await asyncio.Event().wait()  # never set: nothing can happen to jobs that do not exist
        warning_s = {m: s.slurm.warning_s for m, s in self.specs.items()}
        watch = slurm.JobWatch(dict(self.job_ids), self.context.log_dir, warning_s, self._warned)
        notice = await watch.next_notice(poll_s)
        if notice.job_ended:
            self._ended.add(notice.mesh)
        return notice

    def ended(self, mesh: str) -> bool:
        return mesh in self._ended

    async def confirm_ended(self, mesh: str) -> bool:
        """`ended`, or squeue says so now: a proc death can be reported before `watch` (which polls every few
        seconds) sees its job end."""
        job_id = self.job_ids.get(mesh)
        if mesh in self._ended or job_id is None:
            return mesh in self._ended
        try:
            job = await asyncio.to_thread(slurm.query_job, job_id)
        except slurm.SlurmQueryError as e:
            log.warning("cannot tell whether Slurm job %s of mesh %s still runs (%s); replacing procs inside it",
                        job_id, mesh, e)
            return False
        return slurm.job_end_notice(mesh, job_id, job) is not None

    async def respawn(self, mesh: str) -> None:
        """The same job object submitted again as a new Slurm job (so `stop` and the exit handler scancel it),
        its workers on a new port; a `JobError` (the new job cancelled) when sbatch fails or it never runs."""
        old_id, job = self.job_ids.get(mesh), self.jobs.get(mesh)
        if job is None:
            raise JobError(f"mesh {mesh!r}: its Slurm job {old_id} has ended and no job of this launch runs it")
        log_dir = self.context.log_dir
        try:
            slurm.resubmit(job, log_dir, slurm.replacement_port(int(job._port)))
            new_id = await slurm.wait_until_running(job, mesh, self.specs[mesh].slurm.start_timeout, log_dir)
            self.hosts[mesh] = getattr(job.state(cached_path=None), mesh)
        except RuntimeError as e:  # sbatch failed, the job never ran (SlurmStartError) or ended before the attach
            job.kill()
            raise JobError(f"mesh {mesh!r}: its Slurm job {old_id} ended and its replacement failed: {e}") from None
        self.job_ids[mesh] = new_id
        self._ended.discard(mesh)

    def stop(self) -> None:
        """scancel every job (synchronously: also while the launching task is being cancelled)."""
        for name, job in list(self.jobs.items()):
            try:
                job.kill()  # scancel
            except Exception:
                log.exception("scancel of the Slurm job of mesh %s failed", name)
            slurm.unregister_atexit(job)
        self.jobs = {}
