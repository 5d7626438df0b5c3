"""The ready-made async RL loop (`composer-mesh run`): generation, scoring, teacher signals and training
overlap over the launched role actors, paced by the policy-lag bound (`schedule.py`).

`RLLoop` only wires components, each in a file with its own small config: the rollout driver (`rollout/`),
scoring and teacher signals (`scoring.py`), the train pipeline (`pipeline.py`), checkpoint commits
(`commits.py`), evaluation (`evaluation.py`), the step recorder (`recorder.py`), the reward-failure stop
(`reward_health.py`), warm spares (`spares.py`) and
resume (`resume.py`); they reach the roles through `ports.py`'s protocols (over the meshes: `mesh_ports.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from composer_mesh.actors.messages import GenerationRequest, Prompt, RolloutGroup, TrainBatch
from composer_mesh.loss.config import LossConfig
from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.orchestration import recorder as records
from composer_mesh.orchestration import weight_transports
from composer_mesh.orchestration.background import Background, StopRequest
from composer_mesh.orchestration.checkpoint import CheckpointPolicy, CheckpointStore
from composer_mesh.orchestration.commits import CheckpointCommits
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.evaluation import EvalConfig, Evaluation, Evaluator
from composer_mesh.orchestration.mesh_ports import MeshRoles, MeshSpares
from composer_mesh.orchestration.metrics import MetricsWriter, RunSummary, StepRecord
from composer_mesh.orchestration.pipeline import (
    LagGate,
    PipelineConfig,
    PipelineHooks,
    TrainPipeline,
    Versions,
)
from composer_mesh.orchestration.plotting import plot_run
from composer_mesh.orchestration.prompts import PromptSource, prompt_source
from composer_mesh.orchestration.replicas import TrainerReplicas
from composer_mesh.orchestration.resume import ResumePoint, RunState
from composer_mesh.orchestration.reward_health import RewardHealth, RewardHealthConfig
from composer_mesh.orchestration.rollout import single_turn
from composer_mesh.orchestration.rollout.base import RolloutFactory, RolloutServices
from composer_mesh.orchestration.rollout.choose import rollout_factory
from composer_mesh.orchestration.schedule import StepScheduler, StepTimes
from composer_mesh.orchestration.scoring import Scoring, ScoringConfig
from composer_mesh.orchestration.spares import WarmSpares
from composer_mesh.roles import RoleMesh


class RLLoop:
    """The built-in loop: each generator's rollout driver finishes chunks of admitted steps, the trainer takes
    the steps in order. `mesh`: what `launch(topology)` yields; `run`, `loss`: the topology's sections (the
    loss only decides which teacher signals to ask for). `checkpoints`: where and when full checkpoints go
    (default: the run config's); `resume`: a checkpoint to continue from (`ResumePoint`, read and checked
    before launching). `request_stop` ends the run at the next checkpointable step, with a checkpoint.
    `prompts`: the prompt source (default: `prompt_source(run)`; build it before launching to catch bad data
    early). `rollout`: the rollout driver's factory (default: `run.rollout.kind`'s, `rollout/choose.py`). `events`: told each event
    of metrics.jsonl as it is written (evaluations, stops), as `progress` is told each step's record."""

    def __init__(self, mesh: RoleMesh, run: RunConfig, loss: LossConfig,
                 progress: Callable[[StepRecord], None] | None = None, checkpoints: CheckpointPolicy | None = None,
                 resume: ResumePoint | None = None, diloco: DiLoCoConfig | None = None,
                 prompts: PromptSource | None = None, rollout: RolloutFactory | None = None,
                 events: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.mesh, self.cfg, self.loss, self.progress, self.resume = mesh, run, loss, progress, resume
        self.events = events
        self.checkpoints = checkpoints or CheckpointPolicy(url=run.checkpoints_url, every=run.checkpoint_every,
                                                           keep=run.keep_checkpoints)
        self.store = CheckpointStore(self.checkpoints.url)
        self.prompts = prompts if prompts is not None else prompt_source(run)
        self.stop, self.background = StopRequest(), Background()
        self.spares = WarmSpares(MeshSpares(mesh), self.background.spawn)
        self.roles = MeshRoles(mesh, run.max_restarts, self.spares.prepare)
        self.recovery = self.roles.recovery
        self.versions, self.gate = Versions(), LagGate(run.max_policy_lag)
        # Each trainer proc is one DiLoCo replica fed its own batches (replica 0's weights go to the generators).
        self.trainers = TrainerReplicas(mesh, self.recovery, diloco, lambda: self.versions.first)
        self.scoring = Scoring(ScoringConfig.of(run, loss), self.roles.rewarder, self.roles.teachers)
        services = RolloutServices(self.roles.generators, self.scoring, self.background.spawn, self.request_stop)
        self.rollout = (rollout or rollout_factory(run, self.prompts))(services)
        self.evaluator = Evaluator(EvalConfig.of(run), self.rollout.evaluate, self.prompts.eval_prompts,
                                   lambda: self.versions.current, self.background.spawn)
        self.commits = CheckpointCommits(self.store, self.checkpoints.keep, self.trainers, self.background)
        self.state = RunState(self.versions, self.prompts, self.scoring, self.gate, self.recovery, self.checkpoints,
                              len(self.trainers), lambda: self.evaluator.before)
        self.pipeline = TrainPipeline(PipelineConfig.of(run), self.trainers, self.roles.generators, self.versions,
                                      self.gate, self.checkpoints, self.background, self.stop)

    def request_stop(self, reason: str) -> None:
        """Stop at the next step that can be checkpointed: checkpoint it, finish, return (`stop_reason` set)."""
        self.stop.request(reason)

    @property
    def stop_reason(self) -> str | None:
        return self.stop.reason

    @property
    def last_checkpoint(self) -> str | None:
        """The newest committed checkpoint's URL (the one resumed from until this session commits one)."""
        return self.commits.last

    @property
    def trainer_version(self) -> int:
        return self.versions.current

    @trainer_version.setter
    def trainer_version(self, version: int) -> None:
        self.versions.set(version)

    def trainer_version_after(self, step: int) -> int:
        """The weight version the trainer publishes with step `step` (one version per step; step 0 = setup's)."""
        return self.versions.after(step)

    @property
    def generators(self) -> list[object]:
        """One handle per generator actor (`make_batch` takes one)."""
        return list(self.roles.generators.procs)

    async def setup(self) -> None:
        """Build every role's model; the trainer publishes its first version and the generators pull it."""
        manifests, _ = await asyncio.gather(self.trainers.setup(), self.roles.setup())
        self.versions.set(manifests[0].version)
        await self.roles.generators.load_weights(manifests[0])

    def request(self, prompts: list[Prompt], first: int) -> GenerationRequest:
        """Sampling request for `prompts`, the first of which is prompt `first` of the stream."""
        return single_turn.generation_request(single_turn.SingleTurnConfig.of(self.cfg), prompts, first)

    async def complete(self, groups: list[RolloutGroup], first: int, times: StepTimes | None = None) -> TrainBatch:
        """Score `groups` (prompts from stream index `first` on) and ask the teachers; then score their traces."""
        return await self.scoring.complete(groups, first, times)

    async def make_batch(self, generator: object) -> TrainBatch:
        """One whole batch on `generator`, stage by stage (for scripts and tests; `run` schedules its own)."""
        first = self.prompts.count
        prompts = self.prompts.take(self.cfg.prompts_per_step)
        groups = await generator.generate.call_one(self.request(prompts, first))  # type: ignore[attr-defined]
        return await self.complete(groups, first)

    async def evaluate(self, n: int, seed: int) -> Evaluation:
        """Greedy mean reward and pass@k on `n` held-out prompts (`Evaluator.evaluate`)."""
        return await self.evaluator.evaluate(n, seed)

    async def run(self) -> RunSummary:
        t_start, cfg, point = time.perf_counter(), self.cfg, self.resume
        resumed = point.state.step if point is not None else 0
        writer = records.open_writer(cfg, self.loss, (resumed, point.state.trackers) if point is not None else None,
                                     self.events)
        self.background.open()
        schedule = StepScheduler.of(cfg, self.prompts.take, len(self.trainers), len(self.roles.generators))
        try:
            self.spares.prepare_all()  # spares get ready while the actors are set up (they need no weights yet)
            await self.setup()
            weight_transports.announce(self.roles.generators.links, writer)
            eval_before = await self._begin(schedule, writer)
            train_start = time.perf_counter() - t_start
            writer.write_event("train_start", elapsed_s=train_start, step=resumed + 1)
            for index in range(len(self.roles.generators)):
                self.background.spawn(self.rollout.drive(index, schedule))
            try:
                last = await self.pipeline.train(resumed + 1, schedule, writer, self._hooks(schedule, writer, t_start))
            finally:
                await self.background.close()
            eval_after = await self._end(last, writer)
            self.roles.forgive_idle_deaths(writer)
            await self.trainers.each("close")
        finally:
            try:
                writer.close()
            finally:
                self.prompts.close()  # e.g. stops run.environment's server: the rewarder is done with it
        if writer.records:
            plot_run(writer.records, cfg.run_dir / "plot.png", writer.evals())
        end = records.SessionEnd(resumed, last, train_start, eval_before, eval_after, self.stop.reason, self.commits.last)
        summary = records.summarize(cfg, writer, schedule, t_start, end, self.gate, self.scoring.teacher_usage)
        summary.weight_transports = weight_transports.transport_lines(self.roles.generators.links)
        return summary

    async def _begin(self, schedule: StepScheduler, writer: MetricsWriter) -> float:
        """Restore the checkpoint to resume from, or evaluate the initial policy; the greedy reward before."""
        if self.resume is None:
            self.versions.begin()
            return (await self.evaluator.run(writer, "before", 0)).greedy
        self.state.check(self.resume, self.cfg.steps)
        before = await self.state.restore(self.resume, self.trainers.handles, self.roles.generators, schedule, writer)
        self.commits.resumed(self.resume.state.step, self.resume.url)
        self.evaluator.restore(before)
        return before

    def _hooks(self, schedule: StepScheduler, writer: MetricsWriter, t_start: float) -> PipelineHooks:
        sources = records.RecordSources(lambda: self.scoring.traces_scored, lambda: self.scoring.teacher_usage,
                                        self.recovery.metrics, lambda: self.gate.dropped_batches,
                                        self.rollout.counters,
                                        lambda: weight_transports.transport_metrics(self.roles.generators.links))
        recorder = records.StepRecorder(writer, schedule, sources, t_start, self.commits.recorded, self.progress)
        health = RewardHealth(RewardHealthConfig.of(self.cfg))  # raises RewardsFailing: the run stops
        return PipelineHooks(
            record=lambda done: health.observe(recorder.write(done)), wrote=self.commits.wrote,
            finish=self.commits.finish, salvage=self.commits.salvage,
            checkpoint=lambda step: self.commits.take(self.state.capture(step, schedule, writer.tracker_ids), writer),
            synced=lambda step: self.evaluator.synced(step, writer),
        )

    async def _end(self, last: int, writer: MetricsWriter) -> float | None:
        """After the last step: evaluate and save the final model; after a stop: say why. The eval after."""
        if last < self.cfg.steps:
            writer.write_event("stopped", step=last, reason=self.stop.reason, checkpoint=self.commits.last)
            return None
        after = await self.evaluator.run(writer, "after", last)
        checkpoint = await self.trainers.handles[0].save_checkpoint.call_one(
            str((self.cfg.run_dir / "checkpoint").resolve()))
        writer.write_event("model", path=checkpoint, weight_version=self.versions.current)
        return after.greedy
