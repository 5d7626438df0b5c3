"""Backend `process`: Monarch's `ProcessJob`, one local worker process per host, the stand-in for a cluster's
nodes in tests and demos (same `{hosts, procs}` meshes and per-host slicing as Slurm, on this machine)."""

from __future__ import annotations

import logging
from typing import Any

from composer_mesh.mesh.jobs.base import JobBase

log = logging.getLogger("composer_mesh.mesh.jobs")


class ProcessJob(JobBase):
    """One `monarch.job.ProcessJob` for every process mesh of the launch."""

    job: Any = None  # the monarch ProcessJob, once created

    def create(self) -> None:
        from monarch.job import ProcessJob as MonarchProcessJob

        self.job = MonarchProcessJob({name: spec.hosts for name, spec in self.specs.items()})

    async def wait(self) -> None:
        state = self.job.state(cached_path=None)
        self.hosts = {name: getattr(state, name) for name in self.specs}

    def stop(self) -> None:
        if self.job is None:
            return
        try:
            self.job.kill()
        except Exception:
            log.exception("killing the process job failed")
        self.job = None
