"""The job backends without procs: the registry, how meshes are grouped into jobs, what each backend does with
host meshes (fakes of Monarch's), and the Slurm job-end policy as `JobNotice`s say it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from composer_mesh.mesh.jobs import JOB_BACKENDS, JobContext, JobError, JobNotice, create_jobs
from composer_mesh.mesh.jobs.local import LocalJob
from composer_mesh.mesh.jobs.process import ProcessJob
from composer_mesh.mesh.jobs.slurm import SlurmJob
from composer_mesh.mesh.jobs.slurm_compat import job_end_notice
from composer_mesh.mesh.spec import BACKENDS, MESH_SPECS, LocalMeshSpec, mesh_spec

CONTEXT = JobContext(run_name="run", log_dir="/tmp/logs")


class FakeHostMesh:
    """Records `spawn_procs` and `slice` calls like a Monarch host mesh would receive them."""

    def __init__(self, calls: list[tuple[Any, ...]], where: str = "all") -> None:
        self.calls, self.where = calls, where

    def slice(self, **dims: int) -> FakeHostMesh:
        return FakeHostMesh(self.calls, f"hosts={dims['hosts']}")

    def spawn_procs(self, **kwargs: Any) -> str:
        self.calls.append((self.where, kwargs["per_host"], kwargs["name"]))
        return kwargs["name"]


def test_the_registry_has_one_job_class_per_union_member_slurm_first() -> None:
    assert {member for member, _ in JOB_BACKENDS} == set(MESH_SPECS)
    assert len(JOB_BACKENDS) == len(BACKENDS)
    assert JOB_BACKENDS[0][1] is SlurmJob  # its SlurmJob() reconfigures Monarch's transport: before any other


def test_create_jobs_groups_meshes_by_backend_in_creation_order() -> None:
    specs = {
        "cpu": mesh_spec(backend="local"),
        "gpu": mesh_spec(backend="slurm", gpus_per_proc=1),
        "sim": mesh_spec(backend="process", hosts=2),
        "more": mesh_spec(backend="local", procs_per_host=2),
    }
    jobs = create_jobs(specs, CONTEXT)
    assert [type(job) for job in jobs] == [SlurmJob, ProcessJob, LocalJob]
    assert [list(job.specs) for job in jobs] == [["gpu"], ["sim"], ["cpu", "more"]]
    assert create_jobs({"cpu": specs["cpu"]}, CONTEXT)[0].context is CONTEXT
    assert create_jobs({}, CONTEXT) == []


def test_a_spec_without_a_job_backend_is_refused() -> None:
    class Elsewhere(LocalMeshSpec):
        pass

    with pytest.raises(JobError, match="no job backend runs mesh\\(es\\) far"):
        create_jobs({"far": Elsewhere(backend="local")}, CONTEXT)


async def test_local_procs_get_a_hosts_dimension_and_stay_on_this_host() -> None:
    calls: list[tuple[Any, ...]] = []
    job = LocalJob({"cpu": mesh_spec(backend="local", procs_per_host=2)}, CONTEXT)
    job.hosts = {"cpu": FakeHostMesh(calls)}
    job.spawn_procs("cpu", {"procs": 2}, name="m")
    job.spawn_procs("cpu", {"procs": 1}, name="stand_in", host=0)  # this_host() cannot be sliced by hosts
    assert calls == [("all", {"hosts": 1, "procs": 2}, "m"), ("all", {"hosts": 1, "procs": 1}, "stand_in")]


async def test_process_procs_go_on_the_hosts_of_their_job_and_one_host_for_a_stand_in() -> None:
    calls: list[tuple[Any, ...]] = []
    job = ProcessJob({"sim": mesh_spec(backend="process", hosts=2)}, CONTEXT)
    job.hosts = {"sim": FakeHostMesh(calls)}
    job.spawn_procs("sim", {"procs": 1}, name="m")
    job.spawn_procs("sim", {"procs": 1}, name="stand_in", host=1)
    assert calls == [("all", {"procs": 1}, "m"), ("hosts=1", {"procs": 1}, "stand_in")]


async def test_jobs_that_cannot_end_never_notify_and_cannot_be_respawned() -> None:
    job = ProcessJob({"sim": mesh_spec(backend="process")}, CONTEXT)
    watch = asyncio.create_task(job.watch(0.01))
    await asyncio.sleep(0.05)
    assert not watch.done()
    watch.cancel()
    assert not job.ended("sim") and not await job.confirm_ended("sim") and job.job_ids == {}
    with pytest.raises(JobError, match="cannot be replaced"):
        await job.respawn("sim")
    job.stop()  # nothing created: nothing to kill, no error


async def test_a_slurm_job_that_stopped_running_is_marked_ended_by_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    from composer_mesh.mesh.jobs import slurm_compat

    job = SlurmJob({"gpu": mesh_spec(backend="slurm")}, CONTEXT)
    job.job_ids = {"gpu": "42"}
    gone = job_end_notice("gpu", "42", {"job_state": ["NODE_FAIL"]})
    assert gone is not None

    async def next_notice(self: Any, poll_s: float) -> JobNotice:
        return gone

    monkeypatch.setattr(slurm_compat.JobWatch, "next_notice", next_notice)
    assert not job.ended("gpu")
    assert await job.watch(0.01) is gone
    assert job.ended("gpu") and await job.confirm_ended("gpu")  # known: squeue is not asked again
    with pytest.raises(JobError, match="no job of this launch runs it"):
        await job.respawn("gpu")  # never submitted here


def test_the_slurm_policy_replaces_dead_jobs_and_stops_on_warnings_preemptions_and_time_limits() -> None:
    def notice(states: list[str]) -> JobNotice:
        found = job_end_notice("gpu", "7", {"job_state": states})
        assert found is not None
        return found

    assert job_end_notice("gpu", "7", {"job_state": ["RUNNING"]}) is None
    # Slurm shows SIGNALING while it delivers the warning signal: still running, not an end to replace.
    assert job_end_notice("gpu", "7", {"job_state": ["SIGNALING"]}) is None
    assert job_end_notice("gpu", "7", {"job_state": ["RUNNING", "SIGNALING"]}) is None
    dead, cancelled = notice(["NODE_FAIL"]), notice(["CANCELLED"])
    assert dead.kind == "ended" and dead.replaceable and dead.job_ended and cancelled.replaceable
    for states, kind in ((["PREEMPTED"], "preempted"), (["TIMEOUT"], "timeout")):
        stop = notice(states)
        assert stop.kind == kind and stop.job_ended and not stop.replaceable
    warning = JobNotice("gpu", "7", "warning", "will reach its time limit in ~120 s")
    assert not warning.job_ended and not warning.replaceable
    assert warning.message() == "Slurm job 7 of mesh 'gpu' will reach its time limit in ~120 s"
