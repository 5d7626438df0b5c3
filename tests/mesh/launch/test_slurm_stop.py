"""A Slurm job of a run warned of its end (Slurm's `--signal`, delivered here with `scancel --signal=USR1`
exactly as Slurm sends it) stops `composer-mesh run` with a checkpoint and exit code 75; `--resume` continues
the run from it on a new Slurm job."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from composer_mesh import cli
from tests.mesh.launch.test_launch_slurm import slurm_cluster  # noqa: F401  (the module's cluster fixture)
from tests.test_cli_resume import _command, _steps

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[3]
TOPOLOGY = ROOT / "tests" / "mesh" / "launch" / "slurm_run.yaml"


def _job_of(name_part: str) -> str:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j %t"], capture_output=True, text=True).stdout
    jobs = [line.split() for line in out.splitlines() if name_part in line]
    return jobs[0][0] if jobs else ""


@pytest.mark.slow  # a real Slurm job warned, stopped and resumed: about 45 s in CI
def test_a_slurm_warning_stops_the_run_with_a_checkpoint_and_resume_continues(
    slurm_cluster: None, tmp_path: Path  # noqa: F811
) -> None:
    run_dir = tmp_path / "run"
    cmd, env = _command("run", str(TOPOLOGY), "--run-dir", str(run_dir))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not _steps(run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None and _steps(run_dir), proc.communicate()
        job = _job_of(f"slurm_run_generators_{proc.pid}")
        assert job, "the generators' Slurm job is not listed"
        subprocess.run(["scancel", f"--signal={signal.SIGUSR1.name.removeprefix('SIG')}", job], check=True)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == cli.EXIT_PREEMPTED, err
    assert f"Slurm job {job} of mesh 'generators'" in err and "Traceback" not in err
    assert f"resume with: composer-mesh run {TOPOLOGY} --run-dir {run_dir} --resume" in err
    stopped = _steps(run_dir)[-1]
    assert stopped < 5000 and (run_dir / "checkpoints" / f"step-{stopped:08d}" / "COMMITTED.json").is_file()
    assert _job_of(job) == "", "the Slurm job outlived the run"

    cmd, env = _command("run", str(TOPOLOGY), "--run-dir", str(run_dir), "--resume", "--steps", str(stopped + 2))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == cli.EXIT_OK, done.stderr
    assert _steps(run_dir) == list(range(1, stopped + 3))
