"""What a run records: one `StepRecord` per step in `metrics.jsonl`, events between them, and the summary."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_mesh.orchestration.trackers import Trackers


@dataclass
class StepRecord:
    """One line of metrics.jsonl."""

    step: int
    weight_version: int
    reward: float
    loss: float
    channels: dict[str, float]
    policy_lag: int
    weight_sync_s: float
    step_s: float
    dropped_batches: int
    rollouts: int = 0  # rollouts trained on in this step
    elapsed_s: float = 0.0  # seconds since the run started (setup included; see the `train_start` event)
    timing: dict[str, float] = field(default_factory=dict)  # where the step's time went (see `recorder.StepRecorder`)
    metrics: dict[str, float] = field(default_factory=dict)
    prompts: list[str] = field(default_factory=list)  # ids of the prompts trained on, in batch order
    reward_failures: int = 0  # rollouts trained on whose reward failed (`RewardResult.ok` false)
    reward_error: str = ""  # the first of those failures' errors, e.g. "reward function 'f' raised KeyError: 'x'"

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


def step_scalars(record: StepRecord) -> dict[str, float]:
    """The scalars every tracker gets for one step, under the same names everywhere: `train/*` (reward, loss,
    policy lag, weight version, rollouts), `loss/<channel>`, `time/*` (the step's time breakdown),
    `perf/samples_per_s`, and the trainer's and loop's own metrics (bare names go under `train/`). Non-finite
    values are left out (metrics.jsonl keeps them)."""
    out: dict[str, float] = {k if "/" in k else f"train/{k}": v for k, v in record.metrics.items()}
    out.update({f"loss/{k}": v for k, v in record.channels.items()})
    out.update({f"time/{k}": v for k, v in record.timing.items()})
    out.setdefault("time/sync_s", record.weight_sync_s)
    out.update({
        "train/reward": record.reward, "train/loss": record.loss, "train/policy_lag": record.policy_lag,
        "train/weight_version": record.weight_version, "train/rollouts": record.rollouts,
        "train/dropped_batches": record.dropped_batches, "time/step_s": record.step_s,
        "time/elapsed_s": record.elapsed_s,
        "perf/samples_per_s": record.rollouts / record.step_s if record.step_s > 0 else math.nan,
    })
    return _finite(out)


def event_scalars(kind: str, values: dict[str, Any]) -> dict[str, float]:
    """The scalars an event carries for the trackers: an evaluation's reward and pass@k (`eval/*`)."""
    if kind != "eval":
        return {}
    out = {"eval/reward": values.get("reward")}
    if values.get("k"):
        out[f"eval/pass_at_{values['k']}"] = values.get("pass_at_k")
    return _finite(out)


def _finite(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class MetricsWriter:
    """Appends one JSON object per step to `run_dir/metrics.jsonl` (flushed each line), and sends the step's
    scalars (`step_scalars`) and the events to the run's other trackers (`run.loggers`), if any.

    `resume_step`: continue a resumed run's file: its lines up to the record of that step are kept (and its
    records reloaded), what followed (steps trained after the checkpoint, then lost) is dropped. `events` keeps
    every event (a resumed run's earlier ones included: the plot and the summary show them); `on_event` hears
    each new one as it is written (the console's progress display prints evaluations)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, trackers: Trackers | None = None,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.records: list[StepRecord] = []
        self.events: list[dict[str, Any]] = []
        self.on_event = on_event
        self.trackers = trackers
        kept = self._kept_lines(resume_step) if resume_step is not None else []
        self._f = self.path.open("w")
        self._f.writelines(kept)
        self._f.flush()

    def _kept_lines(self, step: int) -> list[str]:
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines(keepends=True)
        kept: list[str] = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill: nothing after it is kept
                break
            if "event" not in row:
                if row.get("step", step + 1) > step:
                    break
                self.records.append(StepRecord(**row))
            else:
                self.events.append(row)
            kept.append(line)
            if self.records and self.records[-1].step == step:
                break
        return kept

    @property
    def tracker_ids(self) -> dict[str, str]:
        """Tracker → run id, for the checkpoint (a resumed run continues these runs)."""
        return dict(self.trackers.ids) if self.trackers is not None else {}

    def write(self, record: StepRecord) -> None:
        self.records.append(record)
        self._f.write(record.to_json() + "\n")
        self._f.flush()
        if self.trackers is not None:
            self._tracker_failures(self.trackers.log(record.step, step_scalars(record)))

    def write_event(self, kind: str, **values: Any) -> None:
        self._f.write(json.dumps({"event": kind, **values}, sort_keys=True) + "\n")
        self._f.flush()
        self.events.append({"event": kind, **values})
        if self.on_event is not None:
            self.on_event(kind, values)
        if self.trackers is not None:
            step = values.get("step")
            if not isinstance(step, int):
                step = self.records[-1].step if self.records else 0
            scalars = event_scalars(kind, values)
            failures = self.trackers.log(step, scalars) if scalars else []
            self._tracker_failures(failures + self.trackers.event(step, kind, values))

    def evals(self) -> list[dict[str, Any]]:
        """The held-out evaluations written so far (`eval` events: when, step, reward, pass_at_k, k)."""
        return [e for e in self.events if e.get("event") == "eval"]

    def _tracker_failures(self, failures: list[str]) -> None:
        for failure in failures:  # the tracker is dropped; the JSONL says so
            self.write_event("tracker_failed", error=failure)

    def close(self, failed: bool | None = None) -> None:
        """Close the file and finish the trackers' runs (as failed when an exception is on its way, unless
        `failed` says otherwise)."""
        self._f.close()
        if self.trackers is not None:
            self.trackers.close(failed if failed is not None else sys.exc_info()[0] is not None)


@dataclass
class RunSummary:
    steps: int
    run_dir: Path
    reward_first: float  # mean train reward over the first 20% of steps
    reward_last: float  # ... and over the last 20%
    eval_before: float | None
    eval_after: float | None
    dropped_batches: int
    dropped_rollouts: int
    seconds: float
    teacher_usage: dict[str, float] = field(default_factory=dict)
    rollouts_trained: int = 0
    train_seconds: float = 0.0  # from the end of setup and the first evaluation to the last step
    zero_variance_groups: int = 0  # set aside by dynamic sampling
    resumed_from: int | None = None  # the checkpoint's step this session continued from
    stopped: str | None = None  # why the run stopped before its last step (it left a checkpoint to resume)
    checkpoint: str | None = None  # the newest committed full checkpoint
    eval_prompts: int = 0  # held-out prompts each evaluation scores
    pass_k: int | None = None  # the k of the evaluations' pass@k (None: greedy only)
    pass_before: float | None = None  # pass@k before training ...
    pass_after: float | None = None  # ... and after
    launch_seconds: float = 0.0  # launching the meshes, before `seconds` began (set by the runner)
    weight_transports: list[str] = field(default_factory=list)  # "generator0: shm (why)", one per kind

    @property
    def samples_per_s(self) -> float:
        """Rollouts trained on per second of training (startup excluded)."""
        return self.rollouts_trained / self.train_seconds if self.train_seconds > 0 else float("nan")


def window_mean(values: list[float], first: bool) -> float:
    n = max(1, len(values) // 5)
    chunk = values[:n] if first else values[-n:]
    return sum(chunk) / len(chunk) if chunk else float("nan")
