"""`composer-mesh run`: launch a topology, run the built-in loop with a progress bar, print a summary."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from composer_mesh.app.launch import launch
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.orchestration.metrics import RunSummary, StepRecord
from composer_mesh.topology import Topology, load_topology


def _fmt(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def apply_overrides(topology: Topology, steps: int | None, run_dir: Path | None) -> Topology:
    """A copy of `topology` with `run.steps` / `run.run_dir` replaced (validated like the file)."""
    update: dict[str, Any] = {}
    if steps is not None:
        update["steps"] = steps
    if run_dir is not None:
        update["run_dir"] = run_dir
    if not update:
        return topology
    run = type(topology.run).model_validate({**topology.run.model_dump(), **update})
    new = topology.model_copy(update={"run": run})
    new._source = topology.source
    return new


async def run_topology(topology: Topology, console: Console | None = None) -> RunSummary:
    """Launch every mesh of `topology`, run the loop, tear everything down (also on errors)."""
    console = console or Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), console=console, transient=False,
    )
    with progress:
        task = progress.add_task("train", total=topology.run.steps, status="launching meshes…")

        def on_step(r: StepRecord) -> None:
            ch = " ".join(f"{k}={_fmt(v)}" for k, v in sorted(r.channels.items()))
            t = r.timing
            status = (
                f"reward={_fmt(r.reward)} {ch} lag={r.policy_lag} sync={r.weight_sync_s * 1000:.0f}ms "
                f"train={t.get('train_s', 0.0):.2f}s idle={t.get('trainer_idle_s', 0.0):.2f}s dropped={r.dropped_batches}"
            )
            progress.update(task, completed=r.step, status=status)

        async with launch(topology) as mesh:
            progress.update(task, status="setting up actors (building models)…")
            loop = RLLoop(mesh, topology.run, topology.loss, progress=on_step)
            summary = await loop.run()
    return summary


def print_summary(summary: RunSummary, console: Console) -> None:
    table = Table(title=f"run finished in {summary.seconds:.0f}s", show_header=False)
    table.add_row("steps", str(summary.steps))
    table.add_row("train reward (first 20% → last 20%)", f"{_fmt(summary.reward_first)} → {_fmt(summary.reward_last)}")
    table.add_row("held-out reward (before → after)", f"{_fmt(summary.eval_before)} → {_fmt(summary.eval_after)}")
    table.add_row("dropped stale batches", f"{summary.dropped_batches} ({summary.dropped_rollouts} rollouts)")
    table.add_row("rollouts trained / s (startup excluded)", f"{summary.rollouts_trained} / {_fmt(summary.samples_per_s)}")
    table.add_row("run dir", f"{summary.run_dir}  (metrics.jsonl, plot.png, checkpoint/)")
    console.print(table)


def main(path: str, steps: int | None = None, run_dir: str | None = None) -> int:
    console = Console()
    topology = apply_overrides(load_topology(path), steps, Path(run_dir) if run_dir else None)
    summary = asyncio.run(run_topology(topology))
    print_summary(summary, console)
    return 0
