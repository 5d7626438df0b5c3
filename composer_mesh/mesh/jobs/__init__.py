"""Job backends: one module per backend behind one protocol (`base.Job`), and the one table that names them.

`JOB_BACKENDS` pairs each `MeshSpec` member with the job class that runs its meshes, in the order launch
creates them: Slurm first, because constructing Monarch's `SlurmJob` reconfigures the client's transport, which
must happen before anything else uses it. A new backend is one module here, one member of
`composer_mesh.mesh.spec.MeshSpec` and one row of this table; nothing else in the package branches on backends
(tests/mesh/jobs/test_no_backend_branches.py checks that).
"""

from __future__ import annotations

from collections.abc import Mapping

from composer_mesh.mesh.jobs.base import Job, JobBase, JobContext, JobError, JobNotice
from composer_mesh.mesh.jobs.local import LocalJob
from composer_mesh.mesh.jobs.process import ProcessJob
from composer_mesh.mesh.jobs.slurm import SlurmJob
from composer_mesh.mesh.spec import LocalMeshSpec, MeshSpecBase, ProcessMeshSpec, SlurmMeshSpec

# (spec member, job class), in creation order.
JOB_BACKENDS: tuple[tuple[type[MeshSpecBase], type[Job]], ...] = (
    (SlurmMeshSpec, SlurmJob),
    (ProcessMeshSpec, ProcessJob),
    (LocalMeshSpec, LocalJob),
)


def create_jobs(specs: Mapping[str, MeshSpecBase], context: JobContext) -> list[Job]:
    """One job per backend that has meshes in `specs` (not started yet: the caller holds them first, so that it
    can `stop` whatever `create` started even when it fails half way)."""
    orphans = sorted(name for name, spec in specs.items() if all(type(spec) is not m for m, _ in JOB_BACKENDS))
    if orphans:
        raise JobError(f"no job backend runs mesh(es) {', '.join(orphans)}: add its MeshSpec member to JOB_BACKENDS")
    jobs = []
    for member, job_class in JOB_BACKENDS:
        mine = {name: spec for name, spec in specs.items() if type(spec) is member}
        if mine:
            jobs.append(job_class(mine, context))
    return jobs


__all__ = ["JOB_BACKENDS", "Job", "JobBase", "JobContext", "JobError", "JobNotice", "create_jobs"]
