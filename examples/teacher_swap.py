"""Run a topology with whichever teachers it binds: this script does not change when the binding does.

    python examples/teacher_swap.py topologies/teachers_hf.yaml --steps 20 --run-dir runs/swap_hf
    python examples/teacher_swap.py topologies/teachers_vllm.yaml --steps 20 --run-dir runs/swap_vllm
    OPENROUTER_API_KEY=... python examples/teacher_swap.py topologies/teachers_openrouter.yaml --steps 20

The three topology files differ only in `roles.teachers` (see docs/bindings.md, "Swapping teachers"). The
script validates the file, shows which teacher feeds which loss channel, runs the built-in async loop
(`composer_mesh.app.runner.run_topology`: launch every mesh, train, write metrics.jsonl, plot.png and
checkpoint/ to the run dir, tear down) and prints each teacher's usage counters (requests, tokens, cost).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from composer_mesh.api import TopologyError, apply_overrides, load_topology, print_summary, run_topology


def teachers_table(topology) -> Table:
    """Which teacher (and binding) feeds which channel: the only thing that differs between the files."""
    table = Table(title=f"teachers of {topology.name!r}")
    for col in ("name", "binding", "channels"):
        table.add_column(col)
    members = topology.teachers.members if topology.teachers is not None else []
    for m in members:
        table.add_row(m.name, str(m.binding), ", ".join(m.channels))
    return table


def usage_table(usage: dict[str, float]) -> Table:
    """The pool's cumulative `<teacher>/<counter>` values (also in metrics.jsonl as `teacher/...`)."""
    table = Table(title="teacher usage")
    table.add_column("counter")
    table.add_column("value", justify="right")
    for key, value in sorted(usage.items()):
        table.add_row(key, f"{value:g}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topology", help="topology YAML file (e.g. topologies/teachers_hf.yaml)")
    parser.add_argument("--steps", type=int, default=None, help="override run.steps")
    parser.add_argument("--run-dir", type=Path, default=None, help="override run.run_dir")
    args = parser.parse_args(argv)

    console = Console()
    try:
        topology = apply_overrides(load_topology(args.topology), args.steps, args.run_dir)
    except (TopologyError, ValueError) as e:  # a bad file, or a bad --steps / --run-dir
        print(str(e), file=sys.stderr)
        return 1
    console.print(teachers_table(topology))
    summary = asyncio.run(run_topology(topology))
    print_summary(summary, console)
    console.print(usage_table(summary.teacher_usage))
    return 0


if __name__ == "__main__":
    sys.exit(main())
