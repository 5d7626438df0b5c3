"""The train pipeline: steps sent to the trainer replicas in order, pipelined, with double-buffered weight sync
to the generators and the lag check.

Step s is sent to the trainer as soon as its batch is ready, so it waits in the trainer's mailbox while step
s-1 trains (no round trip between steps), and step s's weight sync runs while step s+1 trains. The weight plane
is double-buffered: step s publishes into the slot that step s-2's sync read, so step s is sent only once that
sync is done. At lag 0 the schedule itself holds step s back until step s-1's weights reach the generators.
A checkpoint of step s is taken right behind step s, before step s+1 (the trainer's mailbox keeps that order).

A step a live trainer refuses (a `UserInputError` from its train_step, e.g. a non-finite loss under
`run.on_nonfinite: stop`) fails the run as `StepRefused`, but first the steps before it are recorded and their
checkpoints still being written are committed (`PipelineHooks.salvage`): the run then points at the newest
step it trained, not at an older one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from composer_mesh.actors.messages import TrainBatch, TrainMetrics
from composer_mesh.errors import user_error_of
from composer_mesh.orchestration.background import Background, StopRequest
from composer_mesh.orchestration.checkpoint import CheckpointPolicy
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.metrics import MetricsWriter
from composer_mesh.orchestration.ports import Generators, RestartsExhausted, Trainers
from composer_mesh.orchestration.schedule import GroupResult, StepPlan, StepScheduler

SALVAGE_TIMEOUT_S = 300.0  # how long a refused step's run waits for the earlier checkpoints' writes
OTHER_REPLICAS_S = 60.0  # ... and for the other replicas' answers to that step (a DiLoCo round may wait on it)

log = logging.getLogger(__name__)


class StepRefused(Exception):
    """Trainer step `step` was refused by a live trainer (`error`: its `UserInputError`, e.g. a non-finite loss):
    the steps before it are whole, and their checkpoints can still commit. `calls` are the step's calls to every
    replica (the others' answers report state writes too). The message is the refusal's."""

    def __init__(self, step: int, error: BaseException, calls: list[asyncio.Future[Any]]) -> None:
        super().__init__(str(error))
        self.step, self.calls = step, calls


class Versions:
    """The trainer's weight version: one per step, step s trains from `first + s - 1` (step 0 = setup's)."""

    def __init__(self) -> None:
        self.current = 0  # the version the trainer holds (or the step being sent trains from)
        self.first = 0  # the initial policy's version

    def set(self, version: int) -> None:
        """The trainer holds `version` (the one setup published, or a script's own step)."""
        self.current = version

    def begin(self) -> None:
        """A fresh run (no resume) starts from the version setup published."""
        self.first = self.current

    def restore(self, version: int, first: int) -> None:
        self.current, self.first = version, first

    def after(self, step: int) -> int:
        """The weight version the trainer publishes with step `step`."""
        return self.first + step

    def trained(self, step: int) -> None:
        """Steps up to `step` are trained (or sent): the trainer is at `after(step)`."""
        self.current = self.after(step)


@dataclass
class LagGate:
    """Drops batches whose oldest rollout is more than `max_policy_lag` versions behind the trainer.

    The built-in loop admits work so that this never happens (a drop there is a bug, and is counted); scripts
    that generate ahead freely use it to keep the bound."""

    max_policy_lag: int
    dropped_batches: int = 0
    dropped_rollouts: int = 0

    def lag(self, batch: TrainBatch, trainer_version: int) -> int:
        """Versions between the trainer and the batch's oldest sampled token. A rollout with no completion (an
        episode whose agent or environment failed before its first turn) sampled nothing, so it is never stale:
        its `weight_version` is 0, not a version it was sampled at."""
        versions = [r.weight_version for r in batch.rollouts() if r.completion_ids]
        return trainer_version - min(versions, default=trainer_version)

    def admit(self, batch: TrainBatch, trainer_version: int) -> bool:
        if self.lag(batch, trainer_version) <= self.max_policy_lag:
            return True
        self.dropped_batches += 1
        self.dropped_rollouts += len(batch.rollouts())
        return False

    def restore(self, counters: dict[str, Any]) -> None:
        self.dropped_batches, self.dropped_rollouts = int(counters["dropped_batches"]), int(counters["dropped_rollouts"])


@dataclass
class StepDone:
    """One step on its way through the trainer and the weight sync, until its record is written."""

    step: int
    lag: int
    batches: list[TrainBatch]
    plan: StepPlan
    ready_s: float  # how long the loop waited for the step's batch
    metrics: TrainMetrics | None = None
    trained_s: float = 0.0  # perf_counter when the trainer's answer arrived
    sync_s: float = 0.0


@dataclass(frozen=True)
class PipelineConfig:
    steps: int
    prompts_per_step: int  # groups each replica trains on per step
    max_policy_lag: int

    @classmethod
    def of(cls, run: RunConfig) -> PipelineConfig:
        return cls(steps=run.steps, prompts_per_step=run.prompts_per_step, max_policy_lag=run.max_policy_lag)


@dataclass(frozen=True)
class PipelineHooks:
    """What the pipeline tells the rest of the run: `record(done)` a step's answer (in step order),
    `checkpoint(step)` take a checkpoint right behind `step`, `wrote(urls)` the trainers reported state writes
    finished, `synced(step)` its weights reached the generators, `finish()` wait for every checkpoint,
    `salvage(step)` commit the checkpoints of the steps before `step`, which a live trainer refused."""

    record: Callable[[StepDone], None]
    checkpoint: Callable[[int], None]
    wrote: Callable[[list[str]], None]
    synced: Callable[[int], None]
    finish: Callable[[], Awaitable[None]]
    salvage: Callable[[int], Awaitable[None]]


class TrainPipeline:
    """Trains steps `first`.. in order (see the module's docstring); `train` returns the last step trained."""

    def __init__(self, cfg: PipelineConfig, trainers: Trainers, generators: Generators, versions: Versions,
                 gate: LagGate, policy: CheckpointPolicy, background: Background, stop: StopRequest) -> None:
        self.cfg = cfg
        self.trainers = trainers
        self.generators = generators
        self.versions = versions
        self.gate = gate
        self.policy = policy
        self.background = background
        self.stop = stop

    def _can_stop_after(self, step: int, first: int) -> bool:
        """The run may end after `step`: nothing trained yet in this session, or `step` can be checkpointed."""
        return step < first or self.policy.checkpointable(step)

    async def train(self, first: int, schedule: StepScheduler, writer: MetricsWriter, hooks: PipelineHooks) -> int:
        """Train steps `first`.. in order, pipelined; returns the last step trained (earlier than `steps` after a
        stop request). Records are written in step order. A refused step raises `StepRefused` once the steps
        before it are recorded and checkpointed (`_salvage`)."""
        steps: dict[int, asyncio.Task[StepDone]] = {}
        try:
            return await self._train(first, schedule, writer, hooks, steps)
        except StepRefused as refused:
            await self._salvage(refused, steps, hooks)
            raise

    async def _train(self, first: int, schedule: StepScheduler, writer: MetricsWriter, hooks: PipelineHooks,
                     steps: dict[int, asyncio.Task[StepDone]]) -> int:
        until = self.background.until
        last, checkpointed = first - 1, 0
        for step in range(first, self.cfg.steps + 1):
            if self.stop.is_set() and self._can_stop_after(last, first):
                break
            t_wait = time.perf_counter()
            taken = await until(schedule.take(step), self.stop.event if self._can_stop_after(last, first) else None)
            if taken is None:  # stop requested while waiting
                break
            if step - 2 in steps:  # frees the slot this step publishes into
                hooks.record(await until(steps.pop(step - 2)))
            done, calls = self._send(step, *taken, writer, t_wait)
            steps[step] = self.background.spawn(self._train_and_sync(done, calls, schedule, hooks))
            last = step
            if self.policy.due(step, self.cfg.steps) or (self.stop.is_set() and self._can_stop_after(step, first)):
                hooks.checkpoint(step)
                checkpointed = step
        if last >= first and last != checkpointed and self.policy.checkpointable(last):
            hooks.checkpoint(last)  # stopped while waiting for the next step
        for step in sorted(steps):
            hooks.record(await until(steps.pop(step)))
        self.versions.trained(last)
        await hooks.finish()
        return last

    async def _salvage(self, refused: StepRefused, steps: dict[int, asyncio.Task[StepDone]],
                       hooks: PipelineHooks) -> None:
        """A step was refused: complete what came before it, within SALVAGE_TIMEOUT_S. Anything failing here is
        logged (a checkpoint is lost) and the refusal stays the run's error."""
        try:
            await asyncio.wait_for(self._complete_before(refused, steps, hooks), SALVAGE_TIMEOUT_S)
        except Exception as e:
            log.warning("step %d was refused; the checkpoints before it could not be completed: %s: %s", refused.step,
                        type(e).__name__, e)

    @staticmethod
    async def _complete_before(refused: StepRefused, steps: dict[int, asyncio.Task[StepDone]],
                               hooks: PipelineHooks) -> None:
        """Record the steps sent before the refused one (awaited directly: the run's failure is already set),
        take the state writes its other replicas report, and commit the checkpoints before it."""
        for step in sorted(s for s in steps if s < refused.step):
            hooks.record(await steps.pop(step))
        answered, training = await asyncio.wait(refused.calls, timeout=OTHER_REPLICAS_S)
        if training:  # a replica still in the step (e.g. a DiLoCo round waiting for the refusing one)
            raise TimeoutError(f"{len(training)} trainer replica(s) still in step {refused.step} after "
                               f"{OTHER_REPLICAS_S:g} s: their state writes are unknown")
        for call in answered:
            if call.exception() is None:
                hooks.wrote(call.result()[0].states_written)
        await hooks.salvage(refused.step)

    def _send(self, step: int, results: list[GroupResult], plan: StepPlan, writer: MetricsWriter,
              t_wait: float) -> tuple[StepDone, list[Any]]:
        """Split the step's groups over the replicas, check their lag and send them to the trainers now."""
        per = self.cfg.prompts_per_step
        batches = [_batch(results[i * per : (i + 1) * per]) for i in range(len(self.trainers))]
        self.versions.trained(step - 1)  # the version this step trains from
        lags = self._check_lag(step, batches, writer)
        calls = self.trainers.train(step, batches)  # sent now, in order
        return StepDone(step, max(lags), batches, plan, ready_s=time.perf_counter() - t_wait), calls

    async def _train_and_sync(self, done: StepDone, calls: list[Any], schedule: StepScheduler,
                              hooks: PipelineHooks) -> StepDone:
        """Await one step's training (already sent), then every generator pulls its weights and the schedule
        admits what the new weights allow."""
        calls = [asyncio.ensure_future(c) for c in calls]
        try:
            outputs = await asyncio.gather(*calls)
        except Exception as e:
            if user_error_of(e) is not None:
                raise StepRefused(done.step, e, calls) from e
            raise
        done.metrics, manifest = outputs[0]
        hooks.wrote([url for m, _ in outputs for url in m.states_written])
        if manifest.version != self.versions.after(done.step):
            raise RuntimeError(f"step {done.step}: the trainer published version {manifest.version}, expected "
                               f"{self.versions.after(done.step)} (steps trained out of order?)")
        if len(outputs) > 1:
            done.metrics.metrics["reward_mean_all_replicas"] = sum(m.metrics["reward_mean"] for m, _ in outputs) / len(outputs)
        done.trained_s = time.perf_counter()
        try:
            await self.generators.update_weights(manifest)
        except RestartsExhausted as e:
            self.stop.request(str(e))
            return done
        await schedule.synced(done.step)
        done.sync_s = time.perf_counter() - done.trained_s
        hooks.synced(done.step)
        return done

    def _check_lag(self, step: int, batches: list[TrainBatch], writer: MetricsWriter) -> list[int]:
        """Each batch's policy lag. Admission keeps it within the bound: a stale batch is a bug upstream."""
        version = self.versions.current
        lags = [self.gate.lag(b, version) for b in batches]
        for b, lag in zip(batches, lags):
            if not self.gate.admit(b, version):
                writer.write_event("dropped", step=step, policy_lag=lag, rollouts=len(b.rollouts()))
                raise RuntimeError(f"step {step}: a batch is more than {self.cfg.max_policy_lag} versions stale {lags}")
        return lags


def _batch(results: list[GroupResult]) -> TrainBatch:
    return TrainBatch(
        groups=[r.group for r in results],
        distributions=[d for r in results for d in r.distributions],
        traces=[t for r in results for t in r.traces],
    )
