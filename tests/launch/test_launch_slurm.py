"""Slurm tier: a real single-node Slurm (slurmctld + slurmd + munge, no systemd) runs the trainer mesh.

The module fixture brings the cluster up with scripts/slurm_up.sh and down with scripts/slurm_down.sh
(as root). Locally the tier skips when the Debian packages are missing; in CI (`CI=true`) it fails.
Monarch 0.7 vs Slurm 22.05 (squeue --json layout, loopback-only hostname) is handled by launch itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from composer_mesh.app.launch import launch
from composer_mesh.roles import ROLES
from tests.launch.probe_actors import ProbeActor
from tests.launch.proc_utils import descendants, new_descendants_after_exit, wait_gone
from tests.services import require

pytestmark = pytest.mark.slurm

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
PROBES = dict.fromkeys(ROLES, ProbeActor)


def _script(name: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLURM_APT": "0"}  # never apt-get from a test; .ci/run installs the packages
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / name)], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[None]:
    missing = [
        b for b in ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "munged") if not shutil.which(b)
    ]
    require(
        not missing,
        f"Slurm packages (missing {', '.join(missing)}; apt-get install slurmctld slurmd slurm-client munge)",
    )
    require(os.geteuid() == 0, "root (the Slurm tier starts slurmctld/slurmd)")
    _script("slurm_down.sh", 60)  # a cluster left over from an interrupted run
    up = _script("slurm_up.sh", 180)
    if up.returncode != 0:
        _script("slurm_down.sh", 60)
        pytest.fail(f"scripts/slurm_up.sh failed ({up.returncode}):\n{up.stdout}\n{up.stderr}")
    try:
        yield
    finally:
        down = _script("slurm_down.sh", 60)
        assert down.returncode == 0, down.stderr


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
