"""The ready-made async RL loop (`composer-mesh run`): generation, scoring, teacher signals and training
overlap over the launched role actors, paced by the policy-lag bound (see `schedule.py` for which prompts are
generated when)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composer_mesh.actors.messages import (
    GenerationRequest,
    Prompt,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TeacherRequest,
    TeacherSignals,
    TeacherTrace,
    TokenDistribution,
    TrainBatch,
    TrainMetrics,
)
from composer_mesh.actors.teacher_errors import TeacherFailed
from composer_mesh.loss.config import LossConfig
from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.orchestration.checkpoint import (
    CheckpointPolicy,
    CheckpointStore,
    ControllerState,
    RunCheckpointError,
)
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.metrics import MetricsWriter, RunSummary, StepRecord, window_mean
from composer_mesh.orchestration.plotting import plot_run
from composer_mesh.orchestration.prompts import PromptSource, PromptSourceError, prompt_source
from composer_mesh.orchestration.recovery import Recovery, RestartsExhausted
from composer_mesh.orchestration.replicas import TrainerReplicas
from composer_mesh.orchestration.schedule import (
    Chunk,
    GroupResult,
    StepPlan,
    StepScheduler,
    StepTimes,
    row_seed,
)
from composer_mesh.orchestration.trackers import Trackers
from composer_mesh.roles import RoleMesh

log = logging.getLogger("composer_mesh.loop")

# ---------------------------------------------------------------------------------------------------
# The loop. Everything below moves small typed messages; model-sized tensors never pass through here.
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation: greedy mean reward, pass@k (None when `run.eval_pass_k` is 0) and the weight
    version generator 0 evaluated (at lag > 0 it can trail the trainer's by the lag)."""

    greedy: float
    pass_at_k: float | None
    k: int
    weight_version: int


@dataclass
class LagGate:
    """Drops batches whose oldest rollout is more than `max_policy_lag` versions behind the trainer.

    The built-in loop admits work so that this never happens (a drop there is a bug, and is counted); scripts
    that generate ahead freely use it to keep the bound."""

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
    """The built-in loop over launched role actors: each generator takes chunks of admitted steps, each chunk is
    scored and sent to the teachers in its own task, and the trainer takes the steps in order.

    `mesh` is what `launch(topology)` yields; `run` and `loss` are the topology's `run:` and `loss:`
    sections (the loss only decides which teacher signals to ask for: none for a channel weighted 0).
    `checkpoints`: where and when full checkpoints go (default: the run config's); `resume`: a checkpoint to
    continue from (`ResumePoint`, read and checked before launching). `request_stop` ends the run at the next
    step that can be checkpointed, with a checkpoint. `prompts`: the prompt source (default: `prompt_source(run)`,
    `run.data` or `run.task`; build it before launching to catch bad data early).
    """

    def __init__(
        self,
        mesh: RoleMesh,
        run: RunConfig,
        loss: LossConfig,
        progress: Callable[[StepRecord], None] | None = None,
        checkpoints: CheckpointPolicy | None = None,
        resume: ResumePoint | None = None,
        diloco: DiLoCoConfig | None = None,
        prompts: PromptSource | None = None,
    ) -> None:
        self.mesh = mesh
        self.cfg = run
        self.loss = loss
        self.progress = progress
        self.checkpoints = checkpoints or CheckpointPolicy(
            url=run.checkpoints_url, every=run.checkpoint_every,
            keep=run.keep_checkpoints,
        )
        self.store = CheckpointStore(self.checkpoints.url)
        self.resume = resume
        self.stop_reason: str | None = None
        self._stop = asyncio.Event()
        self._commits: dict[int, _PendingCheckpoint] = {}  # checkpoints taken and not committed yet
        self._checkpointed = 0  # the last step a checkpoint was taken of
        self._recorded_through = 0  # the last step whose record is written
        self.last_checkpoint: str | None = None
        self.prompts = prompts if prompts is not None else prompt_source(run)
        self.gate = LagGate(run.max_policy_lag)
        self.trainer_version = 0
        self.teacher_usage: dict[str, float] = {}
        # One handle per actor: each generator runs its own generation loop; each trainer proc is one
        # DiLoCo replica fed its own batches (replica 0's weights go to the generators).
        self.generators = mesh.procs("generators")
        self.rewarders = mesh.procs("rewarder")
        self._next_rewarder = 0
        self.teachers = mesh.teachers if mesh.has("teachers") else None  # optional role
        self.recovery = Recovery(mesh, run.max_restarts, self._set_up)
        self.trainers = TrainerReplicas(mesh, self.recovery, diloco, lambda: self._first_version)
        self._manifest: Any = None  # the weights the generators hold (a replacement generator pulls them)
        self.traces_scored = 0
        self._idle_seen = 0.0  # generator idle seconds already reported
        self._last_trained_s: float | None = None  # when the previous step's training answer arrived
        self._first_version = 0

    def request_stop(self, reason: str) -> None:
        """Stop at the next step that can be checkpointed: checkpoint it, finish, return (`stop_reason` set)."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()

    def _rewarder(self) -> Any:
        """Rewarder actors take requests round-robin."""
        self._next_rewarder = (self._next_rewarder + 1) % len(self.rewarders)
        return self.rewarders[self._next_rewarder]

    # ---- stages -------------------------------------------------------------------------------------
    async def setup(self) -> None:
        m = self.mesh
        tasks = [self.trainers.each("setup"), m.generators.setup.call()]
        if self.teachers is not None:
            tasks.append(self.teachers.setup.call())
        manifests, *_ = await asyncio.gather(*tasks)
        manifest = manifests[0]
        self.trainer_version = manifest.version
        self._manifest = manifest
        await m.generators.update_weights.call(manifest)

    async def _set_up(self, roles: list[str], warm: bool = False) -> None:
        """Build replaced role actors (`Recovery`; a warm spare's are built already): generators also pull the
        weights the others hold. Then a new spare is prepared for the mesh if it keeps one."""
        if not warm:
            await self._build({role: getattr(self.mesh, role) for role in roles})
        if "generators" in roles:
            self.generators = self.mesh.procs("generators")
            await self.mesh.generators.update_weights.call(self._manifest)
        if "rewarder" in roles:
            self.rewarders = self.mesh.procs("rewarder")
        if "teachers" in roles and self.teachers is not None:
            self.teachers = self.mesh.teachers
        if roles:
            self._prepare_spares({self.mesh.mesh_of(roles[0])})  # type: ignore[arg-type]

    @staticmethod
    async def _build(actors: dict[str, Any]) -> None:
        """Build the models of new role actors (by role): the roles whose `setup` does (the rewarder needs none)."""
        await asyncio.gather(*(actors[role].setup.call() for role in ("generators", "teachers") if role in actors))

    def _prepare_spares(self, meshes: set[str]) -> None:
        """Start preparing a warm spare (procs, actors, models) for each of `meshes` that keeps one."""
        for mesh in sorted(meshes):
            spec = self.mesh.launched.specs[mesh]
            if spec.spare and "trainer" not in self.mesh.roles_on(mesh) and not self.mesh.launched.has_spare(mesh):
                self._spawn(self._prepare_spare(mesh))

    async def _prepare_spare(self, mesh: str) -> None:
        """A warm spare for `mesh`: spawned and set up ahead of any death. If that fails, dead procs are still
        replaced, only slower: logged, never fatal."""
        t0 = time.perf_counter()
        try:
            procs, actors = await self.mesh.launched.spawn_spare(mesh)
            t1 = time.perf_counter()
            await self._build(actors)
            self.mesh.launched.keep_spare(mesh, (procs, actors))
            log.info("warm spare for mesh %s ready in %.1f s (procs %.1f s, set up %.1f s)", mesh,
                     time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1)
        except Exception as e:
            log.warning("preparing a warm spare for mesh %s failed (%s: %s); a dead proc there is replaced by "
                        "new procs instead", mesh, type(e).__name__, e)

    def request(self, prompts: list[Prompt], first: int) -> GenerationRequest:
        """Sampling request for `prompts`, the first of which is prompt `first` of the stream."""
        cfg = self.cfg
        return GenerationRequest(
            prompts=prompts, samples_per_prompt=cfg.samples_per_prompt, max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, seed=row_seed(cfg.seed, first, cfg.samples_per_prompt),
        )

    async def _signals(self, groups: list[RolloutGroup], first: int, times: StepTimes | None = None) -> TeacherSignals:
        """Channel-2 distributions and channel-3 traces for `groups` (prompts from stream index `first` on: the
        traces' sampling seed, so they do not depend on which request reaches the teachers first)."""
        rollouts = [r for g in groups for r in g.rollouts]
        if self.teachers is None or not groups:
            return TeacherSignals(distributions=[None] * len(rollouts))
        loss = self.loss
        request = TeacherRequest(
            rollouts=rollouts if loss.alpha_sdpo > 0 else [],
            prompts=[g.prompt for g in groups] if loss.beta_replay > 0 else [],
            top_k=self.cfg.teacher_top_k,
            max_new_tokens=self.cfg.max_new_tokens,
            seed=row_seed(self.cfg.seed, first, 1),
        )
        t0 = time.perf_counter()
        try:
            answers = await self.recovery.attempt("teachers", lambda: self.teachers.signals.call(request))
        except Exception as e:  # `on_failure: stop`: the teacher's own error, without Monarch's wrapper
            if isinstance(getattr(e, "exception", None), TeacherFailed):
                raise e.exception from None  # type: ignore[attr-defined]
            raise
        if times is not None:
            times.teacher_s += time.perf_counter() - t0
        signals = merge_signals(list(answers.values()), len(rollouts))
        self.teacher_usage = signals.usage
        return signals

    async def _score(self, groups: list[RolloutGroup], times: StepTimes | None = None) -> list[ScoredGroup]:
        t0 = time.perf_counter()
        scored: list[ScoredGroup] = await self.recovery.attempt("rewarder", lambda: self._rewarder().score.call_one(groups))
        if times is not None:
            times.score_s += time.perf_counter() - t0
        return scored

    async def _score_traces(self, traces: list[TeacherTrace], groups: list[RolloutGroup],
                            times: StepTimes | None = None) -> None:
        """Score teacher traces with the rewarder like rollouts (sets `trace.reward`): a replay pair is formed
        only when its trace scores above the student rollout it is preferred to."""
        if not traces:
            return
        prompt_of = {g.prompt.prompt_id: g.prompt for g in groups}
        as_groups = [
            RolloutGroup(prompt_of[t.prompt_id], [Rollout(
                prompt_id=t.prompt_id, prompt_ids=[], completion_ids=list(t.completion_ids),
                logprobs=[0.0] * len(t.completion_ids), weight_version=0, text=t.text, generator=t.teacher,
            )])
            for t in traces
        ]
        for trace, s in zip(traces, await self._score(as_groups, times)):
            trace.reward = s.rewards[0].score
        self.traces_scored += len(traces)

    async def complete(self, groups: list[RolloutGroup], first: int, times: StepTimes | None = None) -> TrainBatch:
        """Score `groups` (prompts from stream index `first` on) and ask the teachers, concurrently; then score
        the teachers' traces."""
        scored, signals = await asyncio.gather(self._score(groups, times), self._signals(groups, first, times))
        await self._score_traces(signals.traces, groups, times)
        return TrainBatch(groups=scored, distributions=signals.distributions, traces=signals.traces)

    async def make_batch(self, generator: Any) -> TrainBatch:
        """One whole batch on `generator`, stage by stage (for scripts and tests; `run` schedules its own)."""
        first = self.prompts.count
        prompts = self.prompts.take(self.cfg.prompts_per_step)
        groups = await generator.generate.call_one(self.request(prompts, first))
        return await self.complete(groups, first)

    async def evaluate(self, n: int, seed: int) -> Evaluation:
        """Greedy mean reward and pass@k (`run.eval_pass_k` completions at the run's temperature) on `n` held-out
        prompts: the prompt source's eval set, disjoint from every prompt the run trains on, the same each time."""
        if n == 0:
            return Evaluation(float("nan"), None, 0, self.trainer_version)
        cfg, prompts = self.cfg, self._eval_prompts(n, seed)
        requests = [GenerationRequest(prompts=prompts, samples_per_prompt=1, max_new_tokens=cfg.max_new_tokens,
                                      temperature=0.0, seed=seed)]
        if cfg.eval_pass_k:
            requests.append(GenerationRequest(prompts=prompts, samples_per_prompt=cfg.eval_pass_k,
                                              max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                              seed=seed + 1))

        async def generate(request: GenerationRequest) -> tuple[int, list[RolloutGroup]]:
            gen = self.generators[0]
            version = await gen.version.call_one()  # applies any pulled weights first
            return version, await gen.generate.call_one(request)

        results = [await self.recovery.attempt("generators", lambda r=r: generate(r)) for r in requests]  # type: ignore[misc]
        scored = [await self._score(groups) for _, groups in results]
        greedy = [rw.score for g in scored[0] for rw in g.rewards]
        passed = [any(rw.score >= 1.0 for rw in g.rewards) for g in scored[1]] if cfg.eval_pass_k else []
        return Evaluation(sum(greedy) / len(greedy), sum(passed) / len(passed) if passed else None,
                          cfg.eval_pass_k, results[0][0])

    def _eval_prompts(self, n: int, seed: int) -> list[Prompt]:
        """`n` prompts of the source's eval set (disjoint from its train stream; the same prompts every time)."""
        return self.prompts.eval_prompts(n)

    def _write_eval(self, writer: MetricsWriter, when: str, step: int, result: Evaluation) -> None:
        writer.write_event("eval", when=when, step=step, reward=result.greedy, pass_at_k=result.pass_at_k,
                           k=result.k, weight_version=result.weight_version)

    async def _evaluate_during(self, step: int, writer: MetricsWriter) -> None:
        """`run.eval_every`: evaluate while training goes on (generator 0 interleaves it with its chunks)."""
        self._write_eval(writer, "during", step, await self.evaluate(self.cfg.eval_prompts, self.cfg.seed))

    # ---- chunk work (one task per generator, one per generated chunk) -------------------------------
    async def _generate_chunks(self, index: int, schedule: StepScheduler) -> None:
        """Generator `index`'s loop: the next admitted chunk, generated (again on a replacement if its proc
        dies meanwhile), then completed in a task of its own."""
        try:
            while True:
                chunk = await schedule.next_chunk()
                request = self.request(chunk.prompts, chunk.first)
                t0 = time.perf_counter()
                groups = await self.recovery.attempt(
                    "generators", lambda r=request: self.generators[index].generate.call_one(r))
                schedule.plans[chunk.step].times.generate_s += time.perf_counter() - t0
                self._spawn(self._complete_chunk(chunk, groups, schedule))
        except RestartsExhausted as e:
            self.request_stop(str(e))

    async def _complete_chunk(self, chunk: Chunk, groups: list[RolloutGroup], schedule: StepScheduler) -> None:
        """Score the chunk and get its teacher signals. With dynamic sampling the teachers are asked only
        about groups whose rewards differ (the others are set aside), so scoring comes first."""
        try:
            await self._complete(chunk, groups, schedule)
        except RestartsExhausted as e:
            self.request_stop(str(e))

    async def _complete(self, chunk: Chunk, groups: list[RolloutGroup], schedule: StepScheduler) -> None:
        times = schedule.plans[chunk.step].times
        if not self.cfg.dynamic_sampling:
            results = _group_results(chunk, await self.complete(groups, chunk.first, times))
        else:
            scored = await self._score(groups, times)
            informative = [i for i, g in enumerate(scored) if len({r.score for r in g.rewards}) > 1]
            signals = await self._signals([groups[i] for i in informative], chunk.first, times)
            await self._score_traces(signals.traces, groups, times)
            results = _group_results(chunk, TrainBatch(scored, _spread(scored, informative, signals), signals.traces))
        await schedule.finish(chunk, results)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        """A background task of the run: cancelled when the run ends, and its failure fails the run."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not self._failed.done():
            self._failed.set_exception(task.exception())  # type: ignore[arg-type]

    async def _until(self, awaitable: Any, stop: asyncio.Event | None = None) -> Any:
        """Await `awaitable`, unless a background task fails first (then raise its error) or `stop` is set first
        (then cancel it and return None)."""
        waiting = asyncio.ensure_future(awaitable)
        racers: list[asyncio.Future[Any]] = [waiting, self._failed]
        stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
        if stopped is not None:
            racers.append(stopped)
        try:
            await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stopped is not None:
                stopped.cancel()
        if not waiting.done():
            waiting.cancel()
            if self._failed.done():
                self._failed.result()  # raises the background task's error
            return None
        return waiting.result()

    # ---- the run ------------------------------------------------------------------------------------
    async def run(self) -> RunSummary:
        t_start = time.perf_counter()
        cfg = self.cfg
        resumed = self.resume.state.step if self.resume is not None else 0
        resume_step = resumed if self.resume is not None else None
        trackers = Trackers.open(cfg, {"run": cfg.model_dump(mode="json"), "loss": self.loss.model_dump(mode="json")},
                                 self.resume.state.trackers if self.resume is not None else None, resume_step)
        writer = MetricsWriter(cfg.run_dir, resume_step=resume_step, trackers=trackers)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        schedule = StepScheduler(
            self.prompts.take, steps=cfg.steps, groups_per_step=cfg.prompts_per_step * len(self.trainers),
            generators=len(self.generators), max_policy_lag=cfg.max_policy_lag,
            dynamic_sampling=cfg.dynamic_sampling, max_draws=cfg.dynamic_sampling_max_draws,
        )
        eval_after: float | None = None
        try:
            # Spares get ready while the actors are set up (they need no weights until they take over).
            self._prepare_spares({self.mesh.mesh_of(r) for r in ("generators", "rewarder", "teachers")  # type: ignore[arg-type]
                                  if self.mesh.has(r)})  # type: ignore[arg-type]
            await self.setup()
            if self.resume is not None:
                eval_before = await self._restore(self.resume, schedule, writer)
            else:
                self._first_version = self.trainer_version
                before = await self.evaluate(cfg.eval_prompts, cfg.seed)
                self._write_eval(writer, "before", 0, before)
                eval_before = before.greedy
            self._eval_before = eval_before
            self._writer = writer
            train_start = time.perf_counter() - t_start
            writer.write_event("train_start", elapsed_s=train_start, step=resumed + 1)
            for index in range(len(self.generators)):
                self._spawn(self._generate_chunks(index, schedule))
            try:
                last = await self._train(schedule, writer, t_start, resumed + 1)
            finally:
                pending = list(self._tasks)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                if not self._failed.done():
                    self._failed.cancel()
            if last == cfg.steps:  # finished, not stopped early
                after = await self.evaluate(cfg.eval_prompts, cfg.seed)
                self._write_eval(writer, "after", last, after)
                eval_after = after.greedy
                checkpoint = await self.trainers.handles[0].save_checkpoint.call_one(
                    str((cfg.run_dir / "checkpoint").resolve()))
                writer.write_event("model", path=checkpoint, weight_version=self.trainer_version)
            else:
                writer.write_event("stopped", step=last, reason=self.stop_reason, checkpoint=self.last_checkpoint)
            self._forgive_idle_deaths(writer)
            await self.trainers.each("close")
        finally:
            try:
                writer.close()
            finally:
                self.prompts.close()  # e.g. stops run.environment's server: the rewarder is done with it
        if writer.records:
            plot_run(writer.records, cfg.run_dir / "plot.png")
        return self._summary(writer, schedule, t_start, train_start, resumed, last, eval_before, eval_after)

    def _forgive_idle_deaths(self, writer: MetricsWriter) -> None:
        """A generators/rewarder/teachers proc that died after its last call cost the run nothing: it is
        recorded (event `died_idle`) and not raised when the launch block ends. The trainer's death always is."""
        for failure in self.mesh.failures:
            if "trainer" not in self.mesh.roles_on(failure.mesh):
                writer.write_event("died_idle", mesh=failure.mesh, actor=failure.actor)
                self.mesh.launched.give_up(failure.mesh)

    def _summary(self, writer: MetricsWriter, schedule: StepScheduler, t_start: float, train_start: float,
                 resumed: int, last: int, eval_before: float, eval_after: float | None) -> RunSummary:
        """The whole run's rewards (earlier sessions' records included); this session's throughput."""
        rewards = [r.reward for r in writer.records]
        session = [r for r in writer.records if r.step > resumed]
        return RunSummary(
            steps=len(writer.records), run_dir=self.cfg.run_dir, reward_first=window_mean(rewards, True),
            reward_last=window_mean(rewards, False), eval_before=eval_before, eval_after=eval_after,
            dropped_batches=self.gate.dropped_batches, dropped_rollouts=self.gate.dropped_rollouts,
            seconds=time.perf_counter() - t_start, teacher_usage=self.teacher_usage,
            rollouts_trained=sum(r.rollouts for r in session),
            train_seconds=session[-1].elapsed_s - train_start if session else 0.0,
            zero_variance_groups=schedule.zero_variance_groups, resumed_from=resumed or None,
            stopped=self.stop_reason if last < self.cfg.steps else None,
            checkpoint=self.last_checkpoint,
        )

    async def _restore(self, resume: ResumePoint, schedule: StepScheduler, writer: MetricsWriter) -> float:
        """Continue from a checkpoint: every trainer replica loads its state (all before any trains again), the
        generators pull its weights, the prompt stream and the scheduler continue where they were."""
        st = resume.state
        if st.replicas != len(self.trainers):
            raise RunCheckpointError(f"{resume.url} holds {st.replicas} trainer replica(s), this run has "
                                     f"{len(self.trainers)}")
        if st.step > self.cfg.steps:
            raise RunCheckpointError(f"{resume.url} is at step {st.step}, beyond run.steps={self.cfg.steps}: raise "
                                     "run.steps (--steps) to train on from it")
        try:
            manifests = await asyncio.gather(*(t.load_state.call_one(f"{resume.url}/trainer/r{i}")
                                               for i, t in enumerate(self.trainers.handles)))
        except Exception as e:  # the replica's refusal (TrainerStateError) arrives wrapped in Monarch's ActorError
            raise RunCheckpointError(f"a trainer replica could not load its state: {_last_line(e)}") from e
        if manifests[0].version != st.weight_version:
            raise RuntimeError(f"{resume.url}: the trainer state is at weight version {manifests[0].version}, the "
                               f"controller state at {st.weight_version}")
        self.trainer_version, self._first_version = st.weight_version, st.first_version
        self._manifest = manifests[0]
        await self.mesh.generators.update_weights.call(manifests[0])
        try:  # checkpoints before `prompts` hold a task stream's count and RNG
            self.prompts.restore(st.prompts or {"kind": "task", "count": st.prompts_count, "rng": st.prompts_rng})
        except PromptSourceError as e:
            raise RunCheckpointError(f"{resume.url}: {e}") from e
        schedule.restore(st.schedule)
        c = st.counters
        self.traces_scored, self.teacher_usage = int(c["traces_scored"]), dict(c["teacher_usage"])
        self.gate.dropped_batches, self.gate.dropped_rollouts = int(c["dropped_batches"]), int(c["dropped_rollouts"])
        self.recovery.restore(c.get("recovery", {}))
        self._recorded_through = st.step
        self.last_checkpoint = resume.url
        writer.write_event("resumed", step=st.step, checkpoint=resume.url, weight_version=st.weight_version)
        return float(c["eval_before"])

    async def _train(self, schedule: StepScheduler, writer: MetricsWriter, t_start: float, first: int) -> int:
        """Train steps `first`.. in order, pipelined; returns the last step trained (earlier than `run.steps`
        after `request_stop`). Step s is sent to the trainer as soon as its batch is ready, so it waits in the
        trainer's mailbox while step s-1 trains (no round trip between steps), and step s's weight sync runs
        while step s+1 trains. The plane is double-buffered: step s publishes into the slot that step s-2's sync
        read, so step s is sent only once that sync is done. At lag 0 the schedule itself holds step s back
        until step s-1's weights reach the generators. Records are written in step order. A checkpoint of step
        s is sent right behind step s, before step s+1 (the trainer's mailbox keeps that order)."""
        per_replica = self.cfg.prompts_per_step
        steps: dict[int, asyncio.Task[_StepDone]] = {}
        last = first - 1
        for step in range(first, self.cfg.steps + 1):
            if self._stop.is_set() and self._can_stop_after(last, first):
                break
            t_wait = time.perf_counter()
            taken = await self._until(schedule.take(step), self._stop if self._can_stop_after(last, first) else None)
            if taken is None:  # stop requested while waiting
                break
            results, plan = taken
            if step - 2 in steps:  # frees the slot this step publishes into
                self._write(await self._until(steps.pop(step - 2)), schedule, writer, t_start)
            batches = [_batch(results[i * per_replica : (i + 1) * per_replica]) for i in range(len(self.trainers))]
            self.trainer_version = self.trainer_version_after(step - 1)  # the version this step trains from
            lags = self._check_lag(step, batches, writer)
            calls = self.trainers.train(step, batches)  # sent now, in order
            done = _StepDone(step, max(lags), batches, plan, ready_s=time.perf_counter() - t_wait)
            steps[step] = self._spawn(self._train_and_sync(done, calls, schedule))
            last = step
            if self.checkpoints.due(step, self.cfg.steps) or (self._stop.is_set() and self._can_stop_after(step, first)):
                self._checkpoint(step, schedule, writer)
        if last >= first and last != self._checkpointed and self.checkpoints.checkpointable(last):
            self._checkpoint(last, schedule, writer)  # stopped while waiting for the next step
        for step in sorted(steps):
            self._write(await self._until(steps.pop(step)), schedule, writer, t_start)
        self.trainer_version = self.trainer_version_after(last)
        await self._finish_checkpoints()
        return last

    def _can_stop_after(self, step: int, first: int) -> bool:
        """The run may end after `step`: nothing trained yet in this session, or `step` can be checkpointed."""
        return step < first or self.checkpoints.checkpointable(step)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def _checkpoint(self, step: int, schedule: StepScheduler, writer: MetricsWriter) -> None:
        """Checkpoint step `step` (just sent to the trainers): each replica is asked to copy its state right
        behind the step, the controller's state is taken now, and a background task writes, waits for every
        part, and commits."""
        urls = [self.store.trainer_url(step, i) for i in range(len(self.trainers))]
        saves = self.trainers.save_state(step, urls)  # before step+1
        prompts = self.prompts.state()
        state = ControllerState(
            step=step, weight_version=self.trainer_version_after(step), first_version=self._first_version,
            prompts_count=self.prompts.count, prompts_rng=prompts.get("rng"),
            schedule=schedule.state(trained=step), counters=self._counters(),
            fingerprint=self.checkpoints.fingerprint, replicas=len(self.trainers), prompts=prompts,
            trackers=writer.tracker_ids,
        )
        pending = _PendingCheckpoint(step, set(urls))
        if self._recorded_through >= step:
            pending.recorded.set()
        self._commits[step] = pending
        self._checkpointed = step
        pending.task = self._spawn(self._commit(pending, saves, state, writer))

    def _counters(self) -> dict[str, Any]:
        return {"eval_before": self._eval_before, "traces_scored": self.traces_scored,
                "teacher_usage": dict(self.teacher_usage), "dropped_batches": self.gate.dropped_batches,
                "dropped_rollouts": self.gate.dropped_rollouts, "recovery": self.recovery.state()}

    async def _commit(self, pending: _PendingCheckpoint, saves: list[Any], state: ControllerState,
                      writer: MetricsWriter) -> None:
        """Write the controller's part, wait for the trainers' parts and the step's record, then commit, after
        every earlier checkpoint of this session: a commit deletes the older steps that are not committed (half
        written by a stopped session), and one still being written here must not be taken for one of them."""
        earlier = [p.task for s, p in self._commits.items() if s < pending.step and p.task is not None]
        await asyncio.gather(*saves)
        await asyncio.to_thread(self.store.write_controller, state)
        await pending.trainers.wait()
        await pending.recorded.wait()
        await asyncio.gather(*earlier)
        url = await asyncio.to_thread(self.store.commit, pending.step, self.checkpoints.keep)
        self._commits.pop(pending.step, None)
        self.last_checkpoint = url
        writer.write_event("checkpoint", step=pending.step, url=url, weight_version=state.weight_version)

    def _trainers_wrote(self, urls: list[str]) -> None:
        self.trainers.reported(urls)
        for pending in self._commits.values():
            pending.written.update(u for u in urls if u in pending.urls)
            if pending.written == pending.urls:
                pending.trainers.set()

    async def _finish_checkpoints(self) -> None:
        """Wait for the trainers' background writes and every commit (a failure fails the run)."""
        if not self._commits:
            return
        for written in await self._until(self.trainers.each("flush_states")):
            self._trainers_wrote(written)
        for pending in list(self._commits.values()):
            assert pending.task is not None
            await self._until(pending.task)

    def trainer_version_after(self, step: int) -> int:
        """The weight version the trainer publishes with step `step` (one version per step; step 0 = setup's)."""
        return self._first_version + step

    async def _train_and_sync(self, done: _StepDone, calls: list[Any], schedule: StepScheduler) -> _StepDone:
        """Await one step's training (already sent), then every generator pulls its weights and the schedule
        admits what the new weights allow."""
        outputs = await asyncio.gather(*calls)
        done.metrics, manifest = outputs[0]
        self._trainers_wrote([url for m, _ in outputs for url in m.states_written])
        if manifest.version != self.trainer_version_after(done.step):
            raise RuntimeError(f"step {done.step}: the trainer published version {manifest.version}, expected "
                               f"{self.trainer_version_after(done.step)} (steps trained out of order?)")
        if len(outputs) > 1:
            done.metrics.metrics["reward_mean_all_replicas"] = sum(m.metrics["reward_mean"] for m, _ in outputs) / len(outputs)
        done.trained_s = time.perf_counter()
        self._manifest = manifest  # a generator replaced from now on pulls these weights
        try:
            await self.recovery.attempt("generators", lambda: self.mesh.generators.update_weights.call(manifest))
        except RestartsExhausted as e:
            self.request_stop(str(e))
            return done
        await schedule.synced(done.step)
        done.sync_s = time.perf_counter() - done.trained_s
        if self.cfg.eval_every and done.step % self.cfg.eval_every == 0 and done.step < self.cfg.steps:
            self._spawn(self._evaluate_during(done.step, self._writer))
        return done

    def _check_lag(self, step: int, batches: list[TrainBatch], writer: MetricsWriter) -> list[int]:
        """Each batch's policy lag. Admission keeps it within the bound: a stale batch is a bug upstream."""
        lags = [self.gate.lag(b, self.trainer_version) for b in batches]
        for b, lag in zip(batches, lags):
            if not self.gate.admit(b, self.trainer_version):
                writer.write_event("dropped", step=step, policy_lag=lag, rollouts=len(b.rollouts()))
                raise RuntimeError(f"step {step}: a batch is more than {self.cfg.max_policy_lag} versions stale {lags}")
        return lags

    def _write(self, done: _StepDone, schedule: StepScheduler, writer: MetricsWriter, t_start: float) -> None:
        """The step's record: its trainer time is the trainer's own (`train_step_s`, reported by the trainer);
        the rest of the time since the previous step finished training is the trainer's idle time."""
        assert done.metrics is not None
        times = done.plan.times
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
                 "sampling/short_step": float(done.plan.short), "replay/traces_scored": float(self.traces_scored),
                 "sampling/generators": float(len({r.generator for r in rollouts})), **self.recovery.metrics()}
        record = self._record(done.step, done.metrics, done.lag, done.sync_s, since, timing, extra,
                              len(rollouts), time.perf_counter() - t_start)
        record.prompts = [g.group.prompt.prompt_id for b in done.batches for g in b.groups]
        writer.write(record)
        self._recorded_through = done.step
        if done.step in self._commits:
            self._commits[done.step].recorded.set()
        if self.progress is not None:
            self.progress(record)

    def _record(self, step: int, m: TrainMetrics, lag: int, sync_s: float, step_s: float, timing: dict[str, float],
                extra_metrics: dict[str, float], rollouts: int, elapsed_s: float) -> StepRecord:
        extra = dict(m.metrics)
        extra.update(extra_metrics)
        extra.update({f"teacher/{k}": v for k, v in self.teacher_usage.items()})
        return StepRecord(
            step=step, weight_version=m.weight_version, reward=m.metrics.get("reward_mean", float("nan")),
            loss=m.loss, channels=m.channels, policy_lag=lag, weight_sync_s=sync_s, step_s=step_s,
            dropped_batches=self.gate.dropped_batches, rollouts=rollouts, elapsed_s=elapsed_s, timing=timing,
            metrics=extra,
        )


@dataclass
class _StepDone:
    """One step on its way through the trainer and the weight sync, until its record is written."""

    step: int
    lag: int
    batches: list[TrainBatch]
    plan: StepPlan
    ready_s: float  # how long the loop waited for the step's batch
    metrics: TrainMetrics | None = None
    trained_s: float = 0.0  # perf_counter when the trainer's answer arrived
    sync_s: float = 0.0


@dataclass
class ResumePoint:
    """A committed checkpoint to continue from (`read_checkpoint(url)`, fingerprint checked)."""

    url: str
    state: ControllerState


@dataclass
class _PendingCheckpoint:
    """A checkpoint on its way: committed once every trainer reported its state written and the step's record
    is written."""

    step: int
    urls: set[str]
    written: set[str] = field(default_factory=set)
    trainers: asyncio.Event = field(default_factory=asyncio.Event)
    recorded: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


def _last_line(error: BaseException) -> str:
    """The gist of a remote error: Monarch's ActorError carries the remote traceback, whose last line is it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _spread(scored: list[ScoredGroup], informative: list[int], signals: TeacherSignals) -> list[TokenDistribution | None]:
    """Teacher distributions asked for the informative groups only, spread back over all groups' rollouts."""
    out: list[TokenDistribution | None] = []
    asked = iter(signals.distributions)
    for i, g in enumerate(scored):
        n = len(g.rewards)
        out.extend([next(asked, None) for _ in range(n)] if i in informative else [None] * n)
    return out


def _group_results(chunk: Chunk, batch: TrainBatch) -> list[GroupResult]:
    """A completed chunk as one `GroupResult` per prompt (distributions and traces split by group)."""
    out, offset = [], 0
    for i, g in enumerate(batch.groups):
        n = len(g.group.rollouts)
        dists = batch.distributions[offset : offset + n] if batch.distributions else [None] * n
        pid = g.group.prompt.prompt_id
        out.append(GroupResult(chunk.first + i, g, list(dists), [t for t in batch.traces if t.prompt_id == pid]))
        offset += n
    return out


def _batch(results: list[GroupResult]) -> TrainBatch:
    return TrainBatch(
        groups=[r.group for r in results],
        distributions=[d for r in results for d in r.distributions],
        traces=[t for r in results for t in r.traces],
    )
