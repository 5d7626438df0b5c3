"""Helpers shared by the Slurm notice tests (no test functions here)."""

from __future__ import annotations

import signal


def ignores_usr1(pid: int) -> bool:
    """Whether process `pid` ignores SIGUSR1 (the SigIgn mask of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGUSR1 - 1) & 1)
