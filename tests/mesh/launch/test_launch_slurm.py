"""Slurm tier: a real single-node Slurm (slurmctld + slurmd + munge, no systemd) runs the trainer mesh,
and `watch_jobs` sees a warned, a cancelled and a timed-out job (test_slurm_notices.py: the same without daemons).

The module fixture brings the cluster up with scripts/slurm_up.sh and down with scripts/slurm_down.sh
(as root). Locally the tier skips when the Debian packages are missing; in CI (`CI=true`) it fails.
Monarch 0.7 vs Slurm 22.05 (squeue --json layout, loopback-only hostname) is handled by launch itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from composer_mesh.actors.configs import RoleConfig
from composer_mesh.app.launch import launch
from composer_mesh.mesh.launch import ActorPlacement, LaunchedMeshes, MeshFailureError, launch_meshes
from composer_mesh.mesh.spec import MeshSpec, SlurmOptions, mesh_spec
from composer_mesh.roles import ROLES
from tests.mesh.launch.probe_actors import ProbeActor
from tests.mesh.launch.proc_utils import descendants, new_descendants_after_exit, wait_gone
from tests.mesh.launch.slurm_utils import cluster, ignores_usr1

pytestmark = pytest.mark.slurm

HERE = Path(__file__).parent
PROBES = dict.fromkeys(ROLES, ProbeActor)


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[None]:
    yield from cluster("slurm_up.sh", "slurm_down.sh", ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "munged"),
                       "slurmctld slurmd slurm-client munge",
                       {"SLURM_APT": "0"},  # never apt-get from a test; .ci/run installs the packages
                       up_timeout=180)


def _squeue(job_id: str) -> str:
    """The job's state letters per squeue ('' once Slurm no longer lists it)."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%t %j"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def _wait_job_gone(job_id: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    state = _squeue(job_id)
    while state and time.monotonic() < deadline:
        time.sleep(0.2)
        state = _squeue(job_id)
    return state


async def test_trainer_mesh_runs_in_a_slurm_job_and_everything_is_cleaned_up(
    slurm_cluster: None, tmp_path: Path
) -> None:
    before = descendants()
    job_id = ""
    pids: set[int] = set()
    with pytest.raises(KeyError, match="leave the block with an error"):
        async with launch(HERE / "slurm_probe.yaml", actors=PROBES, log_dir=tmp_path / "slurm") as mesh:
            job_id = mesh.launched.slurm_job_ids["learner"]
            trainer = list((await mesh.trainer.where.call()).values())
            gens = list((await mesh.generators.where.call()).values())
            # The trainer's procs run inside the Slurm job (they inherit SLURM_JOB_ID from the srun'd
            # Monarch worker); squeue lists that job as running under our unique job name.
            assert len(trainer) == 2
            assert {w["slurm_job_id"] for w in trainer} == {job_id}
            assert {w["mesh"] for w in trainer} == {"learner"}
            assert all(w["probe_env"] == {"PROBE_MESH_TAG": "learner"} for w in trainer)
            state, name = _squeue(job_id).split()
            assert state == "R"
            assert name == f"probe_slurm_learner_{os.getpid()}"  # <topology>_<mesh>_<controller pid>
            # The other meshes are plain local procs in the same controller.
            assert all(w["slurm_job_id"] is None and w["ppid"] == os.getpid() for w in gens)
            pids = {w["pid"] for w in trainer + gens} | {w["ppid"] for w in trainer}
            raise KeyError("leave the block with an error")
    assert job_id
    assert _wait_job_gone(job_id) == "", "the Slurm job outlived the launch block"
    assert not wait_gone(pids), "procs or the Slurm worker outlived the launch block"
    assert not new_descendants_after_exit(before)


# --- watch_jobs: time-limit warnings and jobs that stop running (the controller is outside the job) ---


def _watched_mesh(port: int, **slurm: Any) -> dict[str, MeshSpec]:
    """One Slurm mesh on its own worker port: Monarch 0.7's client fails to attach to a second worker at an
    address it attached to before in the same process (the next attempt works again)."""
    options = SlurmOptions(start_timeout=120, exclusive=False, monarch_port=port, **slurm)
    return {"gpu": mesh_spec(backend="slurm", slurm=options)}


PROBE_ON_GPU = [ActorPlacement("probe", "gpu", ProbeActor, (RoleConfig(role="trainer", mesh="gpu"),))]


async def _probe(launched: LaunchedMeshes) -> dict[str, Any]:
    """The one probe actor's `where` (an actor call through the Slurm job's worker)."""
    result: dict[str, Any] = await launched.actors["probe"].where.call_one()
    return result


@contextlib.contextmanager
def _procs_may_die_with_their_job() -> Iterator[None]:
    """The job's procs end with it; if supervision reports that before the block exits, the launch raises
    `MeshFailureError` at exit. Errors inside the block (they become its `__cause__`) still fail the test."""
    try:
        yield
    except MeshFailureError as e:
        if e.__cause__ is not None:
            raise
        assert {f.mesh for f in e.failures} == {"gpu"}


async def _pending(task: asyncio.Task[Any], seconds: float) -> bool:
    await asyncio.sleep(seconds)
    return not task.done()


async def test_watch_jobs_reports_a_warning_the_job_survives_then_its_end(
    slurm_cluster: None, tmp_path: Path
) -> None:
    """`scancel --signal=USR1` reaches every process of the job step, as `--signal` does: the worker and
    its procs survive it (the slurm_worker wrapper), the controller sees a warning, then the cancelled end."""
    job_id = ""
    with _procs_may_die_with_their_job():
        async with launch_meshes(
            _watched_mesh(22231, time_limit="00:10:00"), PROBE_ON_GPU, run_name="watch", log_dir=tmp_path
        ) as launched:
            job_id = launched.slurm_job_ids["gpu"]
            script = subprocess.run(
                ["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, text=True, check=True
            ).stdout
            assert "#SBATCH --signal=USR1@120" in script.splitlines()  # the default warning_s, as Slurm got it
            assert "-m composer_mesh.mesh.slurm_worker --notice-dir" in script
            before = await _probe(launched)
            # The proc and the Monarch worker above it ignore SIGUSR1 (inherited from slurm_worker).
            assert before["slurm_job_id"] == job_id and ignores_usr1(before["pid"]) and ignores_usr1(before["ppid"])

            watch = asyncio.create_task(launched.watch_jobs(poll_s=0.2))
            assert await _pending(watch, 1.0), "a running, unwarned job gave a notice"
            subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
            notice = await asyncio.wait_for(watch, 20)
            assert (notice.kind, notice.mesh, notice.job_id) == ("warning", "gpu", job_id)
            assert notice.message().startswith(f"Slurm job {job_id} of mesh 'gpu' will reach its time limit in ~")

            after = await _probe(launched)  # same proc, still answering: nothing died of SIGUSR1
            assert after["pid"] == before["pid"]
            assert _squeue(job_id).split()[0] == "R"

            watch = asyncio.create_task(launched.watch_jobs(poll_s=0.2))
            assert await _pending(watch, 1.0), "the same warning was returned twice"
            subprocess.run(["scancel", job_id], check=True)
            notice = await asyncio.wait_for(watch, 60)
            assert (notice.kind, notice.job_id) == ("ended", job_id)
            assert "CANCELLED" in notice.detail
            # A job that ended stays ended: every later call says so at once.
            assert (await asyncio.wait_for(launched.watch_jobs(poll_s=0.2), 10)).kind == "ended"
    assert job_id
    assert _wait_job_gone(job_id) == ""


@pytest.mark.slow  # 60-90 s: Slurm checks time limits every 30 s, and one minute is its smallest limit
async def test_watch_jobs_sees_slurms_own_warning_and_the_timeout(slurm_cluster: None, tmp_path: Path) -> None:
    """A real time limit (Slurm's minimum, one minute): `--signal=USR1@30` from Slurm itself gives the
    warning (it may come up to 60 s early, so any time here), the procs survive it, then TIMEOUT."""
    start = time.monotonic()
    with _procs_may_die_with_their_job():
        async with launch_meshes(
            _watched_mesh(22232, time_limit="1", warning_s=30), PROBE_ON_GPU, run_name="timeout", log_dir=tmp_path
        ) as launched:
            job_id = launched.slurm_job_ids["gpu"]
            before = await _probe(launched)
            notice = await asyncio.wait_for(launched.watch_jobs(poll_s=0.5), 90)
            assert (notice.kind, notice.job_id) == ("warning", job_id), notice
            assert "(SIGUSR1 from --signal)" in notice.detail
            assert (await _probe(launched))["pid"] == before["pid"]

            notice = await asyncio.wait_for(launched.watch_jobs(poll_s=0.5), 150)
            assert (notice.kind, notice.job_id) == ("timeout", job_id), notice
            assert notice.message() == (
                f"Slurm job {job_id} of mesh 'gpu' reached its time limit (state TIMEOUT, reason TimeLimit)"
            )
    assert time.monotonic() - start < 150
