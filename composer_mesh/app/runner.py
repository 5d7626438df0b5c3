"""`composer-mesh run`: launch a topology, run the built-in loop with its progress shown (`progress.py`), print a
summary."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from composer_mesh.app.build_status import model_cache_roots, show_builds
from composer_mesh.app.launch import launch, run_config
from composer_mesh.app.preflight import preflight
from composer_mesh.app.preflight.resume import instead
from composer_mesh.app.progress import clock, open_progress
from composer_mesh.orchestration.checkpoint import (
    CheckpointPolicy,
    RunCheckpointError,
    check_fingerprint,
    find_checkpoint,
    read_checkpoint,
)
from composer_mesh.orchestration.loop import ResumePoint, RLLoop
from composer_mesh.orchestration.metrics import RunSummary, StepRecord
from composer_mesh.orchestration.recovery import RestartsExhausted
from composer_mesh.roles import RoleMesh
from composer_mesh.topology import Topology, load_topology
from composer_mesh.topology.overrides import Override


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


def checkpoint_policy(topology: Topology) -> CheckpointPolicy:
    """The run's checkpoint settings, the topology's fingerprint, and which steps a DiLoCo trainer can save at."""
    run = topology.run
    diloco = topology.diloco
    return CheckpointPolicy(
        url=run.checkpoints_url, every=run.checkpoint_every,
        keep=run.keep_checkpoints, fingerprint=topology.training_fingerprint(),
        checkpointable=diloco.checkpointable if diloco is not None else (lambda step: True),
    )


def resume_point(topology: Topology, path: str | None) -> ResumePoint:
    """The checkpoint to resume from (`path`, else the newest of the run's), refused when it was written under
    a topology whose training-defining fields differ. Read before anything is launched."""
    where = path or checkpoint_policy(topology).url
    url = find_checkpoint(where)
    try:
        state = read_checkpoint(url)  # its files checked against the marker as read; the trainer parts by preflight
    except RunCheckpointError as e:
        raise RunCheckpointError(f"{e}{instead(url)}") from None
    check_fingerprint(url, state.fingerprint, topology.training_fingerprint())
    if state.step > topology.run.steps:
        raise RunCheckpointError(f"{url} is at step {state.step}, beyond run.steps={topology.run.steps}: raise "
                                 "run.steps (--steps) to train on from it")
    return ResumePoint(url, state)


# The cause of a stop asked by a job notice (the CLI exits with EXIT_PREEMPTED for it).
JOB_STOP = "slurm"


class StopRequests:
    """SIGTERM / SIGINT while the loop runs: the first asks it to checkpoint and stop, a second (or one before the
    loop exists) cancels the run at once. `cause` is what stopped it: the signal's name, or "slurm"."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.loop: RLLoop | None = None
        self.cause: str | None = None
        self._task = asyncio.current_task()

    def stop(self, cause: str, reason: str) -> None:
        if self.loop is None or self.cause is not None:
            self.cause = self.cause or cause
            if self._task is not None:
                self._task.cancel()
            return
        self.cause = cause
        self.console.print(f"[bold yellow]{reason}[/]: checkpointing and stopping after the current step "
                           "(send the signal again to stop at once, without a checkpoint)")
        self.loop.request_stop(reason)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequests]:
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop, sig.name, f"{sig.name} received")
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread: keep the defaults
                pass
        try:
            yield self
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    async def watch_jobs(self, mesh: RoleMesh) -> None:
        """React to the run's job notices (`LaunchedMeshes.watch_jobs`; which notice means what is the job
        backend's policy, `JobNotice.replaceable`): a replaceable one (a Slurm job that died: a dead node, a cancel)
        gets its mesh a new job and the run goes on (`Recovery.replace_mesh`; its calls in flight are re-issued
        there), unless the mesh holds the trainer, whose state died with it; any other notice (a warning of the
        end, a preemption, a time limit) stops the run with a checkpoint, as does going past `run.max_restarts`."""
        while True:
            notice = await mesh.launched.watch_jobs()
            if notice.replaceable and self.loop is not None and "trainer" not in mesh.roles_on(notice.mesh):
                self.console.print(f"[bold yellow]{notice.message()}[/]: submitting a new job for it")
                try:
                    await self.loop.recovery.replace_mesh(notice.mesh, notice.message())
                    continue
                except RestartsExhausted as e:
                    self.stop(JOB_STOP, str(e))
                    return
            self.stop(JOB_STOP, notice.message())
            return


class RewardFailureNotices:
    """One console line for a step whose rewards failed (count and a sample error), as it happens: the first
    such step, then at most one every `every_s` seconds (how many steps had failures in between is said), so a
    reward failing everywhere shows at once without flooding the console."""

    def __init__(self, console: Console, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.console, self.every_s, self.clock = console, every_s, clock
        self._last: float | None = None
        self._skipped = 0  # steps with failures since the last line

    def __call__(self, record: StepRecord) -> None:
        if not record.reward_failures:
            return
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            self._skipped += 1
            return
        since = f" ({self._skipped} more step(s) with failures since the last notice)" if self._skipped else ""
        self.console.print(f"step {record.step}: {record.reward_failures}/{record.rollouts} rollouts' rewards "
                           f"failed{since}: {record.reward_error}", style="yellow", markup=False, highlight=False,
                           soft_wrap=True)
        self._last, self._skipped = now, 0


async def run_topology(topology: Topology, console: Console | None = None, resume: ResumePoint | None = None,
                       stops: StopRequests | None = None) -> RunSummary:
    """Check everything knowable before launch (`preflight`: env vars, modules, models, prompts, the resume
    checkpoint), launch every mesh of `topology`, run the loop (from `resume` if given), tear everything down
    (also on errors). With `stops`, signals and Slurm end-of-job notices stop the
    run with a checkpoint."""
    console = console or Console()
    preflight(topology, resume)
    done = resume.state.step if resume is not None else 0
    with open_progress(console, topology.run.steps, done, topology.run.progress) as progress:
        progress.set_status("launching meshes…")
        started = time.perf_counter()
        reward_notices = RewardFailureNotices(console)

        builds: asyncio.Task[None] | None = None

        def on_step(record: StepRecord) -> None:
            if builds is not None:
                builds.cancel()  # set up: the status line is the steps' now
            progress.step(record)
            reward_notices(record)

        def on_event(kind: str, values: dict[str, Any]) -> None:
            if builds is not None:
                builds.cancel()
            progress.event(kind, values)

        async with launch(topology) as mesh:
            launched = time.perf_counter() - started
            progress.set_status("setting up actors (building models)…")
            builds = asyncio.create_task(show_builds(progress.set_status, model_cache_roots(topology)))
            loop = RLLoop(mesh, run_config(topology), topology.loss, progress=on_step,
                          checkpoints=checkpoint_policy(topology), resume=resume, diloco=topology.diloco,
                          events=on_event)
            watchers = [builds]
            if stops is not None:
                stops.loop = loop
                watchers.append(asyncio.create_task(stops.watch_jobs(mesh)))
            try:
                summary = await loop.run()
                summary.launch_seconds = launched
            finally:
                for watcher in watchers:
                    watcher.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
    return summary


def _rate(x: float) -> str:
    """A rate with as many digits as it needs: 776, 45.2, 0.83."""
    if math.isnan(x):
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def summary_table(summary: RunSummary) -> Table:
    """The end-of-run summary: one quantity per row, each with its unit or metric named (fits 80 columns; long
    paths wrap)."""
    verb = f"stopped ({summary.stopped})" if summary.stopped else "finished"
    total = summary.launch_seconds + summary.seconds
    table = Table(title=f"run {verb} after {clock(total)}", show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    resumed = f" (resumed from step {summary.resumed_from})" if summary.resumed_from else ""
    table.add_row("steps", f"{summary.steps}{resumed}")
    setup = max(0.0, summary.seconds - summary.train_seconds)
    table.add_row("run time (h:mm:ss)", f"{clock(total)}: launch {clock(summary.launch_seconds)}, setup and "
                  f"evaluations {clock(setup)}, training {clock(summary.train_seconds)}")
    table.add_row("train reward", f"{_fmt(summary.reward_first)} → {_fmt(summary.reward_last)} "
                  "(first → last 20% of steps)")
    prompts = f"{summary.eval_prompts} held-out prompts" if summary.eval_prompts else "no evaluation"
    table.add_row("held-out greedy reward", f"{_fmt(summary.eval_before)} → {_fmt(summary.eval_after)} "
                  f"(before → after, {prompts})")
    if summary.pass_k:
        table.add_row(f"held-out pass@{summary.pass_k}",
                      f"{_fmt(summary.pass_before)} → {_fmt(summary.pass_after)} (before → after)")
    table.add_row("rollouts trained", f"{summary.rollouts_trained:,}")
    table.add_row("throughput", f"{_rate(summary.samples_per_s)} rollouts/s (startup excluded)")
    table.add_row("dropped stale batches", f"{summary.dropped_batches} ({summary.dropped_rollouts} rollouts)")
    if summary.weight_transports:
        table.add_row("weight transport", "; ".join(summary.weight_transports))
    table.add_row("run dir", f"{summary.run_dir} (metrics.jsonl, plot.png, checkpoint/)")
    table.add_row("full checkpoint", f"{summary.checkpoint} (for --resume)" if summary.checkpoint else "-")
    return table


def print_summary(summary: RunSummary, console: Console) -> None:
    console.print(summary_table(summary))


def flag_overrides(steps: int | None, run_dir: str | None) -> list[Override]:
    """`--steps N` / `--run-dir DIR` as the `--set run.steps=N` / `--set run.run_dir=DIR` they stand for (the
    directory kept a string, not read as YAML)."""
    return ([Override("run.steps", steps)] if steps is not None else []) + (
        [Override("run.run_dir", run_dir)] if run_dir is not None else [])


def main(path: str, steps: int | None = None, run_dir: str | None = None, resume: str | bool = False,
         overrides: Sequence[Override] = ()) -> tuple[RunSummary, str | None]:
    """`composer-mesh run`: the summary, and what stopped the run early (a signal's name, "slurm") or None.

    `resume`: True for the newest checkpoint of the run, or a checkpoint / run directory path. `overrides`: the
    `--set` fields (`--steps` and `--run-dir` are applied after them)."""
    console = Console()
    topology = load_topology(path, [*overrides, *flag_overrides(steps, run_dir)])
    point = resume_point(topology, resume if isinstance(resume, str) else None) if resume else None

    async def session() -> tuple[RunSummary, str | None]:
        stops = StopRequests(Console(stderr=True))
        with stops.installed():
            try:
                summary = await run_topology(topology, resume=point, stops=stops)
            except asyncio.CancelledError:
                if stops.cause == "SIGINT":
                    raise KeyboardInterrupt from None
                raise
            except Exception as e:  # e.g. the trainer died: say where the run can continue from
                if stops.loop is not None and stops.loop.last_checkpoint is not None:
                    e.checkpoint = stops.loop.last_checkpoint  # type: ignore[attr-defined]
                raise
        if not summary.stopped:
            return summary, None
        return summary, stops.cause or "failure"  # no signal: the loop stopped itself (a role died too often)

    summary, cause = asyncio.run(session())
    print_summary(summary, console)
    return summary, cause
