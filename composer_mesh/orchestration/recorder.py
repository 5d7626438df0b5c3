"""The step recorder: one `StepRecord` per trained step (metrics.jsonl, trackers, the progress callback), with
where the step's time went, and the run's summary at the end."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composer_mesh.actors.messages import TrainMetrics
from composer_mesh.loss.config import LossConfig
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.episode_metrics import episode_metrics, teacher_episode_metrics
from composer_mesh.orchestration.metrics import MetricsWriter, RunSummary, StepRecord, window_mean
from composer_mesh.orchestration.pipeline import LagGate, StepDone
from composer_mesh.orchestration.schedule import StepScheduler
from composer_mesh.orchestration.trackers import Trackers


def open_writer(run: RunConfig, loss: LossConfig, resumed: tuple[int, dict[str, str]] | None,
                on_event: Callable[[str, dict[str, Any]], None] | None = None) -> MetricsWriter:
    """The run's metrics.jsonl and trackers; `resumed`: the checkpoint's step and tracker run ids, continued;
    `on_event`: told each event as it is written."""
    step, ids = resumed if resumed is not None else (None, None)
    trackers = Trackers.open(run, {"run": run.model_dump(mode="json"), "loss": loss.model_dump(mode="json")}, ids, step)
    return MetricsWriter(run.run_dir, resume_step=step, trackers=trackers, on_event=on_event)


@dataclass(frozen=True)
class RecordSources:
    """Run-wide counters a record reports, read when it is written: teacher traces scored, the teachers' latest
    usage, the fault counters (`Recovery.metrics`) and the batches dropped as stale."""

    traces_scored: Callable[[], int]
    teacher_usage: Callable[[], dict[str, float]]
    faults: Callable[[], dict[str, float]]
    dropped_batches: Callable[[], int]
    rollout: Callable[[], dict[str, float]] = dict  # the rollout driver's counters (`RolloutDriver.counters`)
    weights: Callable[[], dict[str, float]] = dict  # each generator's weight transport (`weight_transports`)


@dataclass
class StepRecorder:
    """Writes each step's record (in step order) to `writer`; `recorded(step)` is told after each one, then
    `progress(record)`. `t_start`: perf_counter at the run's start (records carry the seconds since)."""

    writer: MetricsWriter
    schedule: StepScheduler
    sources: RecordSources
    t_start: float
    recorded: Callable[[int], None]
    progress: Callable[[StepRecord], None] | None = None
    _last_trained_s: float | None = field(default=None, init=False)  # when the previous step's answer arrived
    _idle_seen: float = field(default=0.0, init=False)  # generator idle seconds already reported

    def write(self, done: StepDone) -> StepRecord:
        """The step's record (returned once written): its trainer time is the trainer's own (`train_step_s`,
        reported by the trainer); the rest of the time since the previous step finished training is the
        trainer's idle time."""
        assert done.metrics is not None
        times, schedule = done.plan.times, self.schedule
        train_s = done.metrics.metrics.get("train_step_s", 0.0)
        previous = self._last_trained_s if self._last_trained_s is not None else done.trained_s - train_s - done.ready_s
        since = done.trained_s - previous  # the step's wall time, as the trainer sees it
        self._last_trained_s = done.trained_s
        timing = {
            "generate_s": times.generate_s, "score_s": times.score_s, "teacher_s": times.teacher_s,
            "train_s": train_s, "sync_s": done.sync_s, "trainer_idle_s": max(0.0, since - train_s),
            "generator_idle_s": schedule.idle_s - self._idle_seen,
        }
        self._idle_seen = schedule.idle_s
        rollouts = [r for b in done.batches for r in b.rollouts()]
        extra = {"sampling/zero_variance_groups": float(schedule.zero_variance_groups),
                 "sampling/backfilled_groups": float(schedule.backfilled_groups),
                 "sampling/short_step": float(done.plan.short),
                 "replay/traces_scored": float(self.sources.traces_scored()),
                 "sampling/generators": float(len({r.generator for r in rollouts})), **self.sources.faults(),
                 **self.sources.rollout(), **self.sources.weights(),
                 **episode_metrics([g for b in done.batches for g in b.groups]),
                 **teacher_episode_metrics([t for b in done.batches for t in b.traces])}
        record = self._record(done, since, timing, extra, len(rollouts))
        record.prompts = [g.group.prompt.prompt_id for b in done.batches for g in b.groups]
        failed = [rw.error or "(no error given)" for b in done.batches for g in b.groups for rw in g.rewards
                  if not rw.ok]
        record.reward_failures, record.reward_error = len(failed), failed[0] if failed else ""
        self.writer.write(record)
        self.recorded(done.step)
        if self.progress is not None:
            self.progress(record)
        return record

    def _record(self, done: StepDone, step_s: float, timing: dict[str, float], extra_metrics: dict[str, float],
                rollouts: int) -> StepRecord:
        m: TrainMetrics = done.metrics  # type: ignore[assignment]
        extra = dict(m.metrics)
        extra.update(extra_metrics)
        extra.update({f"teacher/{k}": v for k, v in self.sources.teacher_usage().items()})
        return StepRecord(
            step=done.step, weight_version=m.weight_version, reward=m.metrics.get("reward_mean", float("nan")),
            loss=m.loss, channels=m.channels, policy_lag=done.lag, weight_sync_s=done.sync_s, step_s=step_s,
            dropped_batches=self.sources.dropped_batches(), rollouts=rollouts,
            elapsed_s=time.perf_counter() - self.t_start, timing=timing, metrics=extra,
        )


@dataclass(frozen=True)
class SessionEnd:
    """How this session of the run ended (what the summary reports besides the records)."""

    resumed: int  # the checkpoint's step this session continued from (0: a fresh run)
    last: int  # the last step trained
    train_start: float  # seconds from the run's start to training's
    eval_before: float
    eval_after: float | None
    stopped: str | None
    checkpoint: str | None


def summarize(run: RunConfig, writer: MetricsWriter, schedule: StepScheduler, t_start: float, end: SessionEnd,
              gate: LagGate, teacher_usage: dict[str, float]) -> RunSummary:
    """The whole run's rewards (earlier sessions' records included); this session's throughput."""
    rewards = [r.reward for r in writer.records]
    session = [r for r in writer.records if r.step > end.resumed]
    evals = {e.get("when"): e for e in writer.evals()}  # the newest of each kind
    before, after = evals.get("before", {}), evals.get("after", {})
    return RunSummary(
        steps=len(writer.records), run_dir=run.run_dir, reward_first=window_mean(rewards, True),
        reward_last=window_mean(rewards, False), eval_before=end.eval_before, eval_after=end.eval_after,
        dropped_batches=gate.dropped_batches, dropped_rollouts=gate.dropped_rollouts,
        seconds=time.perf_counter() - t_start, teacher_usage=teacher_usage,
        rollouts_trained=sum(r.rollouts for r in session),
        train_seconds=session[-1].elapsed_s - end.train_start if session else 0.0,
        zero_variance_groups=schedule.zero_variance_groups, resumed_from=end.resumed or None,
        stopped=end.stopped if end.last < run.steps else None, checkpoint=end.checkpoint,
        eval_prompts=after.get("prompts") or before.get("prompts") or run.eval_prompts, pass_k=before.get("k") or after.get("k") or None,
        pass_before=before.get("pass_at_k"), pass_after=after.get("pass_at_k"),
    )
