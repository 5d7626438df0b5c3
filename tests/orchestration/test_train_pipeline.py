"""The train pipeline replayed with fake trainers and generators: steps sent and recorded in order, the
double-buffer rule (step s waits for step s-2's weight sync), the lag check, the version check and where
checkpoints are taken."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from orchestration.fakes import FakeGenerators, FakeTrainers, FakeWriter, prompts
from waiting import eventually

from composer_mesh.actors.messages import GenerationRequest, RewardResult, ScoredGroup
from composer_mesh.errors import UserInputError, user_error_of
from composer_mesh.orchestration.background import Background, StopRequest
from composer_mesh.orchestration.checkpoint import CheckpointPolicy
from composer_mesh.orchestration.pipeline import (
    LagGate,
    PipelineConfig,
    PipelineHooks,
    StepRefused,
    TrainPipeline,
    Versions,
)
from composer_mesh.orchestration.schedule import GroupResult, StepScheduler


class Run:
    """A pipeline over fakes, fed by a generator loop that finishes every chunk the scheduler admits."""

    def __init__(self, steps: int, lag: int, trainers: FakeTrainers, every: int = 0, stale: bool = False,
                 stop_at: int | None = None) -> None:
        self.trainers, self.gens, self.stale, self.stop_at = trainers, FakeGenerators(version=1), stale, stop_at
        self.background, self.stop, self.writer = Background(), StopRequest(), FakeWriter()
        self.versions, self.gate = Versions(), LagGate(lag)
        self.versions.set(1)
        self.versions.begin()
        drawn = [0]

        def draw(n: int) -> list[Any]:
            drawn[0] += n
            return prompts(drawn[0] - n, n)

        self.schedule = StepScheduler(draw, steps=steps, groups_per_step=2 * len(trainers), generators=1,
                                      max_policy_lag=lag)
        self.pipeline = TrainPipeline(PipelineConfig(steps, prompts_per_step=2, max_policy_lag=lag), trainers,
                                      self.gens, self.versions, self.gate, CheckpointPolicy(url="unused", every=every),
                                      self.background, self.stop)
        self.recorded: list[int] = []
        self.lags: list[int] = []
        self.checkpoints: list[tuple[int, int]] = []  # (step, train calls sent by then)
        self.synced: list[int] = []
        self.salvaged: list[tuple[int, list[int]]] = []  # (refused step, steps recorded by then)
        self.wrote: list[str] = []  # state writes the trainers' answers reported

    async def _feed(self) -> None:
        while True:
            chunk = await self.schedule.next_chunk()
            groups = await self.gens.generate(0, GenerationRequest(chunk.prompts, samples_per_prompt=2))
            if self.stale:
                for g in groups:
                    for r in g.rollouts:
                        r.weight_version = 1
            await self.schedule.finish(chunk, [
                GroupResult(chunk.first + i, ScoredGroup(g, [RewardResult(0.0), RewardResult(1.0)]), [None, None])
                for i, g in enumerate(groups)])

    def _synced(self, step: int) -> None:
        self.synced.append(step)
        if step == self.stop_at:
            self.stop.request("test stop")

    def _record(self, done: Any) -> None:
        self.recorded.append(done.step)
        self.lags.append(done.lag)

    async def train(self) -> int:
        async def finish() -> None:
            pass

        async def salvage(step: int) -> None:
            self.salvaged.append((step, list(self.recorded)))

        hooks = PipelineHooks(record=self._record, wrote=self.wrote.extend, finish=finish,
                              checkpoint=lambda s: self.checkpoints.append((s, len(self.trainers.log))),
                              synced=self._synced, salvage=salvage)
        self.background.open()
        self.background.spawn(self._feed())
        try:
            return await self.pipeline.train(1, self.schedule, self.writer, hooks)  # type: ignore[arg-type]
        finally:
            await self.background.close()


async def test_steps_are_sent_synced_and_recorded_in_order() -> None:
    run = Run(steps=5, lag=1, trainers=FakeTrainers(replicas=2))
    assert await asyncio.wait_for(run.train(), 10) == 5
    assert run.trainers.log == [("train", s) for s in range(1, 6)]
    assert run.recorded == run.synced == [1, 2, 3, 4, 5]
    assert [m.version for m in run.gens.manifests] == [2, 3, 4, 5, 6] and run.versions.current == 6
    assert all(0 <= lag <= 1 for lag in run.lags)
    # Each replica trains its own slice of the step's groups, in stream order.
    first, second = run.trainers.batches[1]
    assert [g.group.prompt.prompt_id for g in first.groups] == ["p0", "p1"]
    assert [g.group.prompt.prompt_id for g in second.groups] == ["p2", "p3"]


async def _sent_after(run: Run, n: int) -> list[int]:
    """Steps sent once `n` train calls went out and the pipeline had time to send more (the 0.1 s only lets a
    wrong extra send show: a loaded machine can hide one, never invent one)."""
    await eventually(lambda: len(run.trainers.log) >= n, f"{n} train calls sent")
    await asyncio.sleep(0.1)
    return [s for _, s in run.trainers.log]


async def test_step_s_is_sent_only_once_step_s_minus_2_is_synced() -> None:
    run = Run(steps=4, lag=2, trainers=FakeTrainers(hold=True))
    task = asyncio.create_task(run.train())
    # Steps 1..3 are admitted at lag 2, but step 3 publishes into the slot step 1's sync reads.
    assert await _sent_after(run, 2) == [1, 2]
    run.trainers.release(1)
    assert await _sent_after(run, 3) == [1, 2, 3]  # step 4 waits for step 2's sync
    run.trainers.release(2)
    assert await _sent_after(run, 4) == [1, 2, 3, 4]
    run.trainers.release(3)
    run.trainers.release(4)
    assert await asyncio.wait_for(task, 10) == 4 and run.recorded == [1, 2, 3, 4]


async def test_a_stale_batch_fails_the_step_and_is_counted() -> None:
    run = Run(steps=3, lag=0, trainers=FakeTrainers(), stale=True)  # every rollout at version 1
    with pytest.raises(RuntimeError, match="step 2: a batch is more than 0 versions stale"):
        await asyncio.wait_for(run.train(), 10)
    assert run.writer.events == [("dropped", {"step": 2, "policy_lag": 1, "rollouts": 4})]
    assert (run.gate.dropped_batches, run.gate.dropped_rollouts) == (1, 4)
    assert run.trainers.log == [("train", 1)]


async def test_a_version_published_out_of_order_fails_the_run() -> None:
    run = Run(steps=2, lag=1, trainers=FakeTrainers(wrong_version=True))
    with pytest.raises(RuntimeError, match="step 1: the trainer published version 3, expected 2"):
        await asyncio.wait_for(run.train(), 10)


async def test_checkpoints_are_taken_right_behind_their_step_and_at_the_end() -> None:
    run = Run(steps=5, lag=1, trainers=FakeTrainers(), every=2)
    await asyncio.wait_for(run.train(), 10)
    # Step s's checkpoint is taken after step s is sent and before step s+1 is.
    assert run.checkpoints == [(2, 2), (4, 4), (5, 5)]


async def test_a_stop_ends_the_run_after_a_checkpointed_step() -> None:
    run = Run(steps=8, lag=0, trainers=FakeTrainers(), stop_at=2)
    last = await asyncio.wait_for(run.train(), 10)
    assert 2 <= last < 8 and run.checkpoints[-1][0] == last and run.recorded[-1] == last
    assert run.stop.reason == "test stop"


@pytest.mark.parametrize(("replicas", "lag"), [(1, 0), (2, 1)])
async def test_a_refused_step_records_the_steps_before_it_then_salvages_their_checkpoints(replicas: int,
                                                                                        lag: int) -> None:
    """A live trainer refuses step 4 (a `UserInputError`, like a non-finite loss): the run fails with that
    error (found by the CLI as the user's, not a bug), but first steps 1-3 are recorded and the checkpoints
    before step 4 are salvaged, in that order (a commit waits for its step's record)."""
    run = Run(steps=8, lag=lag, trainers=FakeTrainers(replicas=replicas, refuse=4), every=1)
    with pytest.raises(StepRefused, match="trainer step 4: non-finite loss") as info:
        await asyncio.wait_for(run.train(), 10)
    assert info.value.step == 4 and isinstance(user_error_of(info.value)[0], UserInputError)  # type: ignore[index]
    assert run.recorded == [1, 2, 3] and run.salvaged == [(4, [1, 2, 3])]
    # the other replica answered step 4: the writes it reported reach the commits too
    assert ("r1/before-step-4" in run.wrote) == (replicas == 2) and "r0/before-step-4" not in run.wrote
