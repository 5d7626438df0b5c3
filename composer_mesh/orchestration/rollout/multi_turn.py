"""The multi-turn rollout driver (`run.rollout.kind: multi_turn`): every sample is an episode played against
`run.environment`, many at once.

How the work flows. One intake task takes the admitted chunks from the scheduler and starts an episode per
prompt and sample (at most `run.rollout.max_episodes` in flight). An episode puts each policy turn on a queue
shared by the generators (`turns.TurnQueue`); every generator's `drive` task takes all waiting turns as one
request, so a turn goes to whichever generator is free and episodes waiting on tools cost no generator time.
A chunk whose episodes are all done is scored by its environment's rewards, sent to the teachers for channel-2
distributions over every turn and, with channel 3 on, played by each replay teacher (`teacher_episodes`: same task,
same environment seed), then handed back to the scheduler like a single-turn chunk.

Determinism: episode j of stream prompt i has the seed a single completion of that row would have
(`row_seed`), its environment session is made from (prompt, seed), and its turn k samples with seed + k·2^48
(`episode.TURN_SEED_STRIDE`), so which generator takes a turn and what shares its request changes nothing; at
`max_policy_lag: 0` a seed gives the same run. Lag: the scheduler admits a step only once the generators hold
the weights the lag bound allows, and versions only grow, so every turn of an admitted episode is within the
bound when trained on (the rollout's `weight_version` is its oldest turn's).

Recovery: a generator whose proc dies has the request re-issued on its replacement with the same prompts and
seeds (`ports.Generators`), i.e. each turn of it continues the same token prefix with the same seed; episodes
waiting on that request just wait longer, so at lag 0 the run trains the tokens it would have without the death
(tests/orchestration/test_episode_faults.py). An environment that fails ends only its episode
(`error_environment`, played again first while `run.rollout.environment_retries` last); a chunk lost to a resume
is played again from its prompts with the same seeds.

Generator idle time (`generator_idle_s` in the step records) means what it means for single completions: the
seconds a generator had nothing to sample. Here that is a generator waiting for a turn (no episode admitted, or
every episode in flight waiting on its environment), not the intake waiting for admission.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from composer_mesh.actors.messages import (
    Prompt,
    RolloutGroup,
    ScoredGroup,
    TeacherTrace,
    TokenDistribution,
    TrainBatch,
)
from composer_mesh.actors.teacher_topk import AUTO, TopK
from composer_mesh.envs.session import EpisodeEnvironment
from composer_mesh.orchestration.config import HintsConfig, RunConfig
from composer_mesh.orchestration.ports import Generators, RestartsExhausted
from composer_mesh.orchestration.rollout.base import ChunkSource, RolloutFactory, RolloutServices
from composer_mesh.orchestration.rollout.episode import Episode, EpisodeLimits, TurnSampler, play_episode
from composer_mesh.orchestration.rollout.hints import SelfTeacher, overlay
from composer_mesh.orchestration.rollout.single_turn import group_results, spread
from composer_mesh.orchestration.rollout.teacher_episodes import TeacherEpisodes, TeacherTurns
from composer_mesh.orchestration.rollout.turns import (
    TurnQueue,
    TurnRequest,
    TurnSampling,
    deliver,
    next_turns,
)
from composer_mesh.orchestration.schedule import Chunk, GroupResult, StepTimes, row_seed

log = logging.getLogger("composer_mesh.rollout")
EVERY_TURN = 1 << 30  # `take` limit of an evaluation: one request samples every turn waiting


@dataclass(frozen=True)
class MultiTurnConfig:
    """The run's settings an episode driver uses (`run:` and `run.rollout:`)."""

    samples_per_prompt: int
    seed: int
    limits: EpisodeLimits
    sampling: TurnSampling
    max_episodes: int
    environment_retries: int
    dynamic_sampling: bool = False
    turn_linger_s: float = 0.0
    hints: HintsConfig = field(default_factory=HintsConfig)
    teacher_top_k: TopK = AUTO

    @classmethod
    def of(cls, run: RunConfig, context: int | None = None) -> MultiTurnConfig:
        return cls(samples_per_prompt=run.samples_per_prompt, seed=run.seed,
                   limits=EpisodeLimits.of(run, context),
                   sampling=TurnSampling(run.max_new_tokens, run.temperature),
                   max_episodes=run.rollout.max_episodes, environment_retries=run.rollout.environment_retries,
                   dynamic_sampling=run.dynamic_sampling, turn_linger_s=run.rollout.turn_linger_s,
                   hints=run.rollout.hints, teacher_top_k=run.teacher_top_k)


class MultiTurnRollout:
    """`RolloutDriver` of episodes: an intake of chunks, episodes in flight, generators serving their turns."""

    def __init__(self, cfg: MultiTurnConfig, services: RolloutServices, environment: EpisodeEnvironment) -> None:
        self.cfg, self.environment = cfg, environment
        self.generators, self.scoring = services.generators, services.scoring
        self.spawn, self.stop = services.spawn, services.stop
        self.queue = TurnQueue(cfg.turn_linger_s, takers=len(services.generators))
        self.replay = self._teacher_episodes(services)
        self.self_teacher = None if cfg.hints.source == "none" else SelfTeacher(
            cfg.hints, services.generators, cfg.teacher_top_k, services.scoring.teachers)
        self._intake: asyncio.Task[None] | None = None
        self._slots: asyncio.Semaphore | None = None

    async def drive(self, index: int, chunks: ChunkSource) -> None:
        """Generator `index` samples waiting turns until the run cancels it (the first call starts the intake)."""
        if self._intake is None:
            self._slots = asyncio.Semaphore(self.cfg.max_episodes)
            self._intake = self.spawn(self._take_chunks(chunks))
        try:
            while True:
                turns = await next_turns(self.queue, self.cfg.max_episodes, chunks)
                await self._sample(index, turns, chunks)
        except RestartsExhausted as e:
            self.stop(str(e))

    async def _sample(self, index: int, turns: list[TurnRequest], chunks: ChunkSource) -> None:
        t0 = time.perf_counter()
        async with self.queue.serving(turns):
            groups = await self.generators.generate(index, self.cfg.sampling.request(turns))
        deliver(turns, groups)
        share = (time.perf_counter() - t0) / len(turns)
        for step, n in Counter(t.step for t in turns).items():
            chunks.times(step).generate_s += share * n

    async def _take_chunks(self, chunks: ChunkSource) -> None:
        while True:
            chunk = await chunks.next_chunk(counts_idle=False)  # the generators' idle time is `drive`'s to count
            self.spawn(self._play_chunk(chunk, chunks))

    async def _play_chunk(self, chunk: Chunk, chunks: ChunkSource) -> None:
        try:
            played = await asyncio.gather(*(self._play_group(p, chunk.first + i, chunk.step)
                                            for i, p in enumerate(chunk.prompts)))
            await chunks.finish(chunk, await self._complete(chunk, list(played), chunks))
        except RestartsExhausted as e:
            self.stop(str(e))

    async def _play_group(self, prompt: Prompt, index: int, step: int) -> tuple[ScoredGroup, list[Episode]]:
        """The prompt's `samples_per_prompt` episodes, scored by their environment (and the episodes, whose steps
        targeted feedback reads); an episode of several segments is that many rollouts."""
        first = row_seed(self.cfg.seed, index, self.cfg.samples_per_prompt)
        episodes = await asyncio.gather(*(self._play(prompt, first + j, step)
                                          for j in range(self.cfg.samples_per_prompt)))
        return scored_episodes(prompt, list(episodes)), list(episodes)

    async def _play(self, prompt: Prompt, seed: int, step: int) -> Episode:
        """One episode (played again from its start, same seed, while its environment fails and retries last)."""
        assert self._slots is not None
        async with self._slots, self.queue.playing():
            for attempt in range(self.cfg.environment_retries + 1):
                episode = await play_in_session(self.environment, prompt, seed, self.cfg.limits,
                                                lambda p, s: self.queue.sample(p, s, step))
                if episode.rollout.status != "error_environment":
                    break
                if attempt < self.cfg.environment_retries:
                    log.warning("episode %s: playing it again (%d of %d)", prompt.prompt_id, attempt + 1,
                                self.cfg.environment_retries)
            return episode

    async def _complete(self, chunk: Chunk, played: list[tuple[ScoredGroup, list[Episode]]],
                        chunks: ChunkSource) -> list[GroupResult]:
        """Teacher distributions over the episodes (channel 2: the teachers', and the hint-conditioned policy's
        where targeted feedback gave an episode a hint) and the replay teachers' own episodes (channel 3), then one
        result per prompt. With dynamic sampling only groups whose rewards differ are sent to the teachers (the
        scheduler sets the others aside)."""
        times = chunks.times(chunk.step)
        scored = [g for g, _ in played]
        asked = [i for i, g in enumerate(scored)
                 if not self.cfg.dynamic_sampling or len({r.score for r in g.rewards}) > 1]
        signals, traces, hints = await asyncio.gather(
            self.scoring.signals([scored[i].group for i in asked], chunk.first, times, traces=False),
            self._replay(chunk, scored, asked, times), self._hints(chunk, played, asked, times))
        distributions = spread(scored, asked, signals)
        if hints is not None:
            distributions = overlay(distributions, hints)
        return group_results(chunk, TrainBatch(scored, distributions, traces))

    async def _hints(self, chunk: Chunk, played: list[tuple[ScoredGroup, list[Episode]]], asked: list[int],
                     times: StepTimes) -> list[TokenDistribution | None] | None:
        """Targeted feedback's channel-2 targets, one entry per rollout of the chunk (None: targeted feedback
        off)."""
        if self.self_teacher is None:
            return None
        prompts, episodes = [], []
        for i in asked:
            group, eps = played[i]
            prompts += [group.group.prompt] * len(eps)
            episodes += eps
        seed = row_seed(self.cfg.seed, chunk.first, 1)  # a hint writer's sampling: the chunk's, as its traces'
        found = iter(await self.self_teacher.distributions(prompts, episodes, times, seed))
        keep = set(asked)
        return [d for i, (_, eps) in enumerate(played) for e in eps  # a hint belongs to an episode's last segment
                for d in [*[None] * len(e.earlier), next(found) if i in keep else None]]

    def _teacher_episodes(self, services: RolloutServices) -> TeacherEpisodes | None:
        """Channel 3's players when the loss weights it (`loss.beta_replay > 0`) and the run has teachers."""
        teachers = self.scoring.teachers
        if teachers is None or not self.scoring.cfg.traces:
            return None
        turns = TeacherTurns(teachers, self.cfg.sampling.max_new_tokens, services.spawn, self.cfg.turn_linger_s)
        return TeacherEpisodes(turns, lambda p, s, sample: play_in_session(self.environment, p, s, self.cfg.limits,
                                                                           sample), self.cfg.environment_retries)

    async def _replay(self, chunk: Chunk, scored: list[ScoredGroup], asked: list[int],
                      times: StepTimes) -> list[TeacherTrace]:
        """Channel 3: each replay teacher plays the asked groups' tasks with their first episode's seed."""
        if self.replay is None:
            return []
        groups = [(scored[i].group.prompt, row_seed(self.cfg.seed, chunk.first + i, self.cfg.samples_per_prompt))
                  for i in asked]
        return await self.replay.traces(groups, times, self._slots)

    def counters(self) -> dict[str, float]:
        """Teacher episodes played, failed, skipped and sat out (`teacher_episodes/*`), when replay is on; hints
        given (`hints/*`), with targeted feedback."""
        out = {} if self.replay is None else self.replay.counters()
        return out | ({} if self.self_teacher is None else self.self_teacher.counters())

    async def evaluate(self, prompts: list[Prompt], samples: int, temperature: float,
                       seed: int) -> tuple[int, list[ScoredGroup]]:
        """`samples` episodes of each prompt on generator 0 at `temperature` (0: greedy), scored by the
        environment; the oldest weight version any of their turns used."""
        queue, versions = TurnQueue(self.cfg.turn_linger_s), []
        sampling = TurnSampling(self.cfg.sampling.max_new_tokens, temperature)
        server = asyncio.ensure_future(serve_turns(self.generators, 0, queue, sampling, versions))
        try:
            groups = await asyncio.gather(*(
                _episodes(self.environment, p, [seed + i * samples + j for j in range(samples)], self.cfg.limits,
                          queue)
                for i, p in enumerate(prompts)))
        finally:
            server.cancel()
        return min(versions, default=0), list(groups)


def scored_episodes(prompt: Prompt, episodes: list[Episode]) -> ScoredGroup:
    """A prompt's episodes as a group to train on: every segment of each is a rollout with the episode's reward."""
    return ScoredGroup(RolloutGroup(prompt, [r for e in episodes for r in e.segments]),
                       [e.reward_result() for e in episodes for _ in e.segments])


async def play_in_session(environment: EpisodeEnvironment, prompt: Prompt, seed: int, limits: EpisodeLimits,
                          sample: TurnSampler) -> Episode:
    """One episode in a fresh session of `environment`, closed whatever happens."""
    session = environment.session(prompt, seed)
    try:
        return await play_episode(session, prompt, seed, limits, sample)
    finally:
        try:
            await session.close()
        except Exception as e:  # a session that fails to close costs a warning, not the run
            log.warning("episode %s: closing its environment session failed: %s", prompt.prompt_id, e)


async def _episodes(environment: EpisodeEnvironment, prompt: Prompt, seeds: list[int], limits: EpisodeLimits,
                    queue: TurnQueue) -> ScoredGroup:
    async def play(seed: int) -> Episode:
        async with queue.playing():
            return await play_in_session(environment, prompt, seed, limits, lambda p, s: queue.sample(p, s, 0))

    episodes = await asyncio.gather(*(play(s) for s in seeds))  # held out: each counts once, as its last segment
    return ScoredGroup(RolloutGroup(prompt, [e.rollout for e in episodes]), [e.reward_result() for e in episodes])


async def serve_turns(generators: Generators, index: int, queue: TurnQueue, sampling: TurnSampling,
                      versions: list[int]) -> None:
    """Generator `index` samples `queue`'s turns until cancelled, noting the weight version of each request."""
    while True:
        turns = await queue.take(EVERY_TURN)
        async with queue.serving(turns):
            version, groups = await generators.generate_versioned(index, sampling.request(turns))
        versions.append(version)
        deliver(turns, groups)


def factory(run: RunConfig, environment: EpisodeEnvironment, context: int | None = None) -> RolloutFactory:
    """The episode driver for `run` against `environment` (`context`: the model's longest sequence)."""
    return lambda services: MultiTurnRollout(MultiTurnConfig.of(run, context), services, environment)
