"""The ready-made async RL loop (`composer-mesh run`): overlapping generation, scoring, teacher signals and
training over the launched role actors, under a policy-lag bound."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from composer_mesh.actors.messages import (
    GenerationRequest,
    Prompt,
    RolloutGroup,
    ScoredGroup,
    TeacherRequest,
    TeacherSignals,
    TokenDistribution,
    TrainBatch,
    TrainMetrics,
)
from composer_mesh.loss.config import LossConfig
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.metrics import MetricsWriter, RunSummary, StepRecord, window_mean
from composer_mesh.orchestration.plotting import plot_run
from composer_mesh.roles import RoleMesh
from composer_mesh.tasks import get_task

# ---------------------------------------------------------------------------------------------------
# The loop. Everything below moves small typed messages; model-sized tensors never pass through here.
# ---------------------------------------------------------------------------------------------------


class PromptSource:
    """Deterministic stream of task prompts (token ids are filled in by the generators' tokenizer)."""

    def __init__(self, task_name: str, seed: int) -> None:
        self.task = get_task(task_name)
        self.rng = random.Random(seed)
        self.count = 0

    def take(self, n: int, prefix: str = "p") -> list[Prompt]:
        out = []
        for _ in range(n):
            text, answer = self.task.sample(self.rng)
            out.append(Prompt(prompt_id=f"{prefix}{self.count}", text=text, token_ids=[], answer=answer))
            self.count += 1
        return out


@dataclass
class LagGate:
    """Drops batches whose oldest rollout is more than `max_policy_lag` versions behind the trainer."""

    max_policy_lag: int
    dropped_batches: int = 0
    dropped_rollouts: int = 0

    def lag(self, batch: TrainBatch, trainer_version: int) -> int:
        return trainer_version - min(r.weight_version for r in batch.rollouts())

    def admit(self, batch: TrainBatch, trainer_version: int) -> bool:
        if self.lag(batch, trainer_version) <= self.max_policy_lag:
            return True
        self.dropped_batches += 1
        self.dropped_rollouts += len(batch.rollouts())
        return False


def merge_signals(parts: list[TeacherSignals], num_rollouts: int) -> TeacherSignals:
    """Combine the answers of the teacher-pool procs (each hosts some members)."""
    dists: list[TokenDistribution | None] = [None] * num_rollouts
    traces, usage = [], {}
    for part in parts:
        for i, d in enumerate(part.distributions):
            if d is not None and dists[i] is None:
                dists[i] = d
        traces.extend(part.traces)
        usage.update(part.usage)
    return TeacherSignals(distributions=dists, traces=traces, usage=usage)


class RLLoop:
    """The built-in async loop over launched role actors: overlapping generation, scoring, teacher signals
    and training, with a policy-lag bound.

    `mesh` is what `launch(topology)` yields; `run` and `loss` are the topology's `run:` and `loss:`
    sections (the loss only decides which teacher signals to ask for: none for a channel weighted 0).
    """

    def __init__(
        self,
        mesh: RoleMesh,
        run: RunConfig,
        loss: LossConfig,
        progress: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.mesh = mesh
        self.cfg = run
        self.loss = loss
        self.progress = progress
        self.prompts = PromptSource(run.task, run.seed)
        self.gate = LagGate(run.max_policy_lag)
        self.trainer_version = 0
        self.teacher_usage: dict[str, float] = {}
        # One handle per actor: each generator runs its own generation loop; each trainer proc is one
        # DiLoCo replica fed its own batches (replica 0's weights go to the generators).
        self.generators = mesh.procs("generators")
        self.trainers = mesh.procs("trainer")
        self.rewarders = mesh.procs("rewarder")
        self._next_rewarder = 0
        self.teachers = mesh.teachers if mesh.has("teachers") else None  # optional role

    def _rewarder(self) -> Any:
        """Rewarder actors take batches round-robin."""
        self._next_rewarder = (self._next_rewarder + 1) % len(self.rewarders)
        return self.rewarders[self._next_rewarder]

    # ---- stages -------------------------------------------------------------------------------------
    async def setup(self) -> None:
        m = self.mesh
        tasks = [asyncio.gather(*(t.setup.call_one() for t in self.trainers)), m.generators.setup.call()]
        if self.teachers is not None:
            tasks.append(self.teachers.setup.call())
        manifests, *_ = await asyncio.gather(*tasks)
        manifest = manifests[0]
        self.trainer_version = manifest.version
        await m.generators.update_weights.call(manifest)

    async def _signals(self, groups: list[RolloutGroup]) -> TeacherSignals:
        rollouts = [r for g in groups for r in g.rollouts]
        if self.teachers is None:
            return TeacherSignals(distributions=[None] * len(rollouts))
        loss = self.loss
        request = TeacherRequest(
            rollouts=rollouts if loss.alpha_sdpo > 0 else [],
            prompts=[g.prompt for g in groups] if loss.beta_replay > 0 else [],
            top_k=self.cfg.teacher_top_k,
            max_new_tokens=self.cfg.max_new_tokens,
        )
        answers = await self.teachers.signals.call(request)
        signals = merge_signals(list(answers.values()), len(rollouts))
        self.teacher_usage = signals.usage
        return signals

    async def generate_groups(self, generator: Any) -> list[RolloutGroup]:
        """Sample the next `prompts_per_step` prompts on `generator`."""
        request = GenerationRequest(
            prompts=self.prompts.take(self.cfg.prompts_per_step),
            samples_per_prompt=self.cfg.samples_per_prompt,
            max_new_tokens=self.cfg.max_new_tokens,
            temperature=self.cfg.temperature,
            seed=self.prompts.count + self.cfg.seed,
        )
        return await generator.generate.call_one(request)

    async def complete_batch(self, groups: list[RolloutGroup]) -> TrainBatch:
        """Score the groups and ask the teachers, concurrently."""
        scored, signals = await asyncio.gather(self._rewarder().score.call_one(groups), self._signals(groups))
        return TrainBatch(groups=scored, distributions=signals.distributions, traces=signals.traces)

    async def make_batch(self, generator: Any) -> TrainBatch:
        """One whole batch, step by step (for scripts and tests; `run` overlaps the two stages)."""
        return await self.complete_batch(await self.generate_groups(generator))

    async def evaluate(self, n: int, seed: int) -> float:
        """Mean reward of greedy completions on `n` held-out prompts (fixed seed: same prompts each time)."""
        if n == 0:
            return float("nan")
        held_out = PromptSource(self.cfg.task, seed=10_000 + seed)
        request = GenerationRequest(
            prompts=held_out.take(n, prefix="eval"), samples_per_prompt=1,
            max_new_tokens=self.cfg.max_new_tokens, temperature=0.0, seed=seed,
        )
        gen = self.generators[0]
        await gen.version.call_one()  # apply any pulled weights before evaluating
        groups = await gen.generate.call_one(request)
        scored: list[ScoredGroup] = await self._rewarder().score.call_one(groups)
        scores = [rw.score for g in scored for rw in g.rewards]
        return sum(scores) / len(scores)

    # ---- the run ------------------------------------------------------------------------------------
    async def run(self) -> RunSummary:
        t_start = time.perf_counter()
        cfg = self.cfg
        writer = MetricsWriter(cfg.run_dir)
        # Generation never waits for scoring or teachers: each generated batch is completed in its own task,
        # and a generator goes straight on to its next batch. `slots` bounds the batches between the start of
        # their generation and the trainer taking them, which bounds staleness; `done` holds completed (or
        # failed) tasks in completion order.
        slots = asyncio.Semaphore(cfg.rollout_queue_size)
        done: asyncio.Queue[asyncio.Task[TrainBatch]] = asyncio.Queue()
        completing: set[asyncio.Task[TrainBatch]] = set()

        def completed(task: asyncio.Task[TrainBatch]) -> None:
            completing.discard(task)
            if not task.cancelled():
                done.put_nowait(task)

        async def produce(generator: Any) -> None:
            while True:
                await slots.acquire()
                groups = await self.generate_groups(generator)
                task = asyncio.create_task(self.complete_batch(groups))
                completing.add(task)
                task.add_done_callback(completed)

        try:
            await self.setup()
            eval_before = await self.evaluate(cfg.eval_prompts, cfg.seed)
            writer.write_event("eval", when="before", reward=eval_before, weight_version=self.trainer_version)
            producers = [asyncio.create_task(produce(g)) for g in self.generators]
            try:
                await self._train(done, slots, writer, producers)
            finally:
                pending = [*producers, *completing]
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            eval_after = await self.evaluate(cfg.eval_prompts, cfg.seed)
            writer.write_event("eval", when="after", reward=eval_after, weight_version=self.trainer_version)
            checkpoint = await self.trainers[0].save_checkpoint.call_one(str((cfg.run_dir / "checkpoint").resolve()))
            writer.write_event("checkpoint", path=checkpoint, weight_version=self.trainer_version)
            await self.mesh.trainer.close.call()
        finally:
            writer.close()
        if writer.records:
            plot_run(writer.records, cfg.run_dir / "plot.png")
        rewards = [r.reward for r in writer.records]
        return RunSummary(
            steps=len(writer.records), run_dir=cfg.run_dir, reward_first=window_mean(rewards, True),
            reward_last=window_mean(rewards, False), eval_before=eval_before, eval_after=eval_after,
            dropped_batches=self.gate.dropped_batches, dropped_rollouts=self.gate.dropped_rollouts,
            seconds=time.perf_counter() - t_start, teacher_usage=self.teacher_usage,
        )

    async def _next_batch(self, done: asyncio.Queue[asyncio.Task[TrainBatch]], slots: asyncio.Semaphore,
                          writer: MetricsWriter, producers: list[asyncio.Task]) -> tuple[TrainBatch, int]:
        """The next batch within the lag bound (stale ones are dropped and logged) and its policy lag.

        A failed scoring or teacher stage raises here; so does a generator that died."""
        while True:
            get = asyncio.ensure_future(done.get())
            finished, _ = await asyncio.wait([get, *producers], return_when=asyncio.FIRST_COMPLETED)
            if get not in finished:  # a producer died: surface its error instead of waiting forever
                get.cancel()
                for p in producers:
                    if p.done() and not p.cancelled() and p.exception() is not None:
                        raise p.exception()  # type: ignore[misc]
                continue
            slots.release()  # the trainer has taken it (or drops it): a generator may start another batch
            batch = get.result().result()
            lag = self.gate.lag(batch, self.trainer_version)
            if self.gate.admit(batch, self.trainer_version):
                return batch, lag
            writer.write_event("dropped", policy_lag=lag, rollouts=len(batch.rollouts()))

    async def _train(self, done: asyncio.Queue[asyncio.Task[TrainBatch]], slots: asyncio.Semaphore,
                     writer: MetricsWriter, producers: list[asyncio.Task]) -> None:
        for step in range(1, self.cfg.steps + 1):
            picked = [await self._next_batch(done, slots, writer, producers) for _ in self.trainers]
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(t.train_step.call_one(batch) for t, (batch, _) in zip(self.trainers, picked))
            )
            metrics, manifest = results[0]
            if len(results) > 1:
                metrics.metrics["reward_mean_all_replicas"] = sum(m.metrics["reward_mean"] for m, _ in results) / len(results)
            t1 = time.perf_counter()
            await self.mesh.generators.update_weights.call(manifest)
            sync_s = time.perf_counter() - t1
            self.trainer_version = manifest.version
            record = self._record(step, metrics, max(lag for _, lag in picked), sync_s, time.perf_counter() - t0)
            writer.write(record)
            if self.progress is not None:
                self.progress(record)

    def _record(self, step: int, m: TrainMetrics, lag: int, sync_s: float, step_s: float) -> StepRecord:
        extra = dict(m.metrics)
        extra.update({f"teacher/{k}": v for k, v in self.teacher_usage.items()})
        return StepRecord(
            step=step, weight_version=m.weight_version, reward=m.metrics.get("reward_mean", float("nan")),
            loss=m.loss, channels=m.channels, policy_lag=lag, weight_sync_s=sync_s, step_s=step_s,
            dropped_batches=self.gate.dropped_batches, metrics=extra,
        )
