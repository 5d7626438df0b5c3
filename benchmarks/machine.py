"""What every benchmark prints about the machine it ran on (imported by the bench_*.py scripts)."""

from __future__ import annotations

import json
import os
import platform
from argparse import Namespace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def child_env(root: str, threads: int, **extra: str) -> dict[str, str]:
    """The environment of a benchmark's child process: `threads` OpenMP/MKL threads, offline, unbuffered,
    `root` (the repository) importable; `extra` variables on top."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return env


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def total_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def available_memory_gib() -> float:
    """MemAvailable from /proc/meminfo (inf where unknown): what a case may use before it should be skipped."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20  # the file reports KiB
    except (OSError, ValueError):
        pass
    return float("inf")


def maxrss_bytes() -> int:
    """This process's peak RSS (`ru_maxrss`, which sees torch's CPU allocations, unlike tracemalloc)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def package_versions(*names: str) -> dict[str, str]:
    """Installed distribution versions ('?' when absent)."""
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "?"
    return out


def cli_settings(args: Namespace, *skip: str) -> dict[str, object]:
    """The command line's settings for a results file: paths as strings, `skip` left out."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}


def write_results(out: Path, payload: dict[str, object], copy: Path | None = None) -> None:
    """`payload` as `<out>/results.json` (said on stdout), and the same text at `copy` when given (`--json`)."""
    text = json.dumps(payload, indent=2, default=str) + "\n"
    (out / "results.json").write_text(text)
    print(f"\nresults: {out / 'results.json'}")
    if copy:
        copy.write_text(text)
