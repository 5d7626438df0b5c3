"""The program Slurm runs for a Monarch worker: `python -m composer_mesh.mesh.slurm_worker --notice-dir DIR -c CODE`.

Monarch's batch script runs `srun <python_exe> -c '<worker bootstrap>'` and we choose `python_exe`. Slurm's
`--signal=USR1@N` warning (and `scancel --signal=USR1`) is sent to every process of the job step, the
Monarch worker *and the procs it spawned*; without a handler SIGUSR1 kills them all. So this wrapper:

- runs CODE as `python -c CODE` in a child whose SIGUSR1 is ignored: an ignored signal stays ignored across
  `exec` and Monarch spawns procs with Rust's `Command`, which resets only SIGPIPE, so every proc ignores it too;
- records each SIGUSR1 it gets itself in `notice_path(DIR, job id)`, on the filesystem the controller shares
  with the jobs (the job's log dir), where the slurm job backend's `watch` looks for it (`composer_mesh.mesh.jobs.slurm`);
- forwards SIGTERM/SIGINT/SIGHUP to the child, waits for it and exits with its status.

Standard library only: it starts before anything else in the job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

# The signal `--signal=USR1@N` asks Slurm for. USR1: no default meaning in Python, Monarch or Slurm.
WARNING_SIGNAL = signal.SIGUSR1
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def notice_path(log_dir: str, job_id: str) -> str:
    """Where the workers of Slurm job `job_id` record that the warning signal arrived."""
    return os.path.join(log_dir, f"slurm_{job_id}.warning")


def record_warning(log_dir: str, job_id: str) -> None:
    """Write the warning file atomically (nodes of one job write the same path; the last one wins)."""
    record = {
        "signal": WARNING_SIGNAL.name,
        "time": time.time(),
        "host": socket.gethostname(),
        "node_id": os.environ.get("SLURM_NODEID"),
    }
    path = notice_path(log_dir, job_id)
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _parse(argv: list[str]) -> tuple[str, list[str]]:
    """`--notice-dir DIR -c CODE [ARG ...]` -> (DIR, ["-c", CODE, ARG, ...])."""
    if len(argv) < 4 or argv[0] != "--notice-dir" or argv[2] != "-c":
        raise SystemExit("usage: python -m composer_mesh.mesh.slurm_worker --notice-dir DIR -c CODE [ARG ...]")
    return argv[1], argv[2:]


def main(argv: list[str] | None = None) -> int:
    notice_dir, python_args = _parse(sys.argv[1:] if argv is None else argv)
    job_id = os.environ.get("SLURM_JOB_ID", "unknown")
    # Ignored while the child starts, so it inherits "ignored"; our own handler is installed right after.
    signal.signal(WARNING_SIGNAL, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, *python_args])

    def on_warning(signum: int, frame: FrameType | None) -> None:
        try:
            record_warning(notice_dir, job_id)
        except OSError as e:  # a full or unreachable disk must not end the job
            print(f"slurm_worker: could not record {WARNING_SIGNAL.name}: {e}", file=sys.stderr, flush=True)

    def forward(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(WARNING_SIGNAL, on_warning)
    for sig in _FORWARDED:
        signal.signal(sig, forward)
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
