"""Helpers shared by the Slurm tests (no test functions here)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services import require

SCRIPTS = Path(__file__).parents[3] / "scripts"


def run_script(name: str, timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """scripts/<name> with `env` on top of this process's environment."""
    return subprocess.run(["bash", str(SCRIPTS / name)], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)


def cluster(up: str, down: str, needs: tuple[str, ...], install: str, env: dict[str, str],
            up_timeout: float) -> Iterator[None]:
    """A module fixture's body: a Slurm cluster brought up with scripts/<up> (after <down>, for one left over from
    an interrupted run) and torn down after. Locally it skips when a binary of `needs` or root is missing (`install`
    says which packages give them); under CI=true it fails (`services.require`)."""
    missing = [b for b in needs if not shutil.which(b)]
    require(not missing, f"Slurm packages (missing {', '.join(missing)}; apt-get install {install})")
    require(os.geteuid() == 0, "root (the Slurm tier starts slurmctld/slurmd)")
    run_script(down, 60, env)
    started = run_script(up, up_timeout, env)
    if started.returncode != 0:
        run_script(down, 60, env)
        pytest.fail(f"scripts/{up} failed ({started.returncode}):\n{started.stdout}\n{started.stderr}")
    try:
        yield
    finally:
        stopped = run_script(down, 60, env)
        assert stopped.returncode == 0, stopped.stderr


def ignores_usr1(pid: int) -> bool:
    """Whether process `pid` ignores SIGUSR1 (the SigIgn mask of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGUSR1 - 1) & 1)
