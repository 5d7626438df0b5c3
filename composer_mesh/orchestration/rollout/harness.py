"""The harness rollout driver (`run.rollout.kind: harness`): your own agent plays the episodes, through an
OpenAI-compatible Chat Completions endpoint the generators serve (docs/agentic.md, "Your agent harness as the
rollout").

How the work flows. The intake takes the scheduler's admitted chunks, as the episode driver does, so the lag
bound admits agents' work exactly as it admits built-in episodes, and a resumed run hands out the same tasks
with the same seeds. Each prompt x sample becomes an episode with an id (`<stream index>-<sample>`), a
`HarnessTask` given to the agent: the Python callback `run.rollout.harness.agent` (run concurrently, at most
`max_episodes`), or else whoever polls `GET /v1/episodes/next`. The agent's requests name the episode; each is a
turn on the queue every generator takes turns from (`turns.TurnQueue`: concurrent agents' turns batch into one
request, each with its own seed, so batching changes no token), recorded token for token
(`harness_episodes`). The agent's reported end (the callback's return, or `POST /v1/episodes/{id}/end`) closes
the episode; a prompt's episodes are a group, scored by their reported rewards (or the rewarder where an agent
reported none), sent to the teachers for channel-2 distributions, and handed back to the scheduler like any
chunk. Weight updates land between generator requests, so between an agent's requests; each turn keeps the
version that sampled it and the episode's lag counts from its oldest.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from composer_mesh.actors.messages import (
    GenerationRequest,
    Prompt,
    RewardResult,
    RolloutGroup,
    ScoredGroup,
    TrainBatch,
)
from composer_mesh.bindings import import_object
from composer_mesh.errors import UserInputError
from composer_mesh.orchestration.config import HarnessConfig, RunConfig
from composer_mesh.orchestration.ports import Generators, RestartsExhausted
from composer_mesh.orchestration.rollout.base import ChunkSource, RolloutFactory, RolloutServices
from composer_mesh.orchestration.rollout.harness_episodes import (
    EpisodeRegistry,
    HarnessEpisode,
    HarnessTask,
    TurnLimits,
)
from composer_mesh.orchestration.rollout.single_turn import group_results, spread
from composer_mesh.orchestration.rollout.turns import TurnQueue, TurnRequest, deliver, next_turns
from composer_mesh.orchestration.schedule import Chunk, row_seed

if TYPE_CHECKING:  # the web framework is imported only when a harness run starts its endpoint
    from composer_mesh.orchestration.rollout.chat_server import ChatServer

log = logging.getLogger("composer_mesh.harness")
Agent = Callable[[HarnessTask], Awaitable[float | None]]


class MissingToken(UserInputError, RuntimeError):
    """`run.rollout.harness.token_env` names an environment variable that is not set."""


@dataclass(frozen=True)
class HarnessRunConfig:
    """The run's settings a harness driver uses (`run:`, `run.rollout:` and `run.rollout.harness:`)."""

    endpoint: HarnessConfig
    samples_per_prompt: int
    seed: int
    temperature: float
    limits: TurnLimits
    max_episodes: int
    episode_timeout_s: float | None
    turn_linger_s: float

    @classmethod
    def of(cls, run: RunConfig, context: int | None = None) -> HarnessRunConfig:
        r = run.rollout
        return cls(endpoint=r.harness, samples_per_prompt=run.samples_per_prompt, seed=run.seed,
                   temperature=run.temperature, limits=TurnLimits(r.max_turns, run.max_new_tokens,
                                                                  r.max_context or context),
                   max_episodes=r.max_episodes, episode_timeout_s=r.episode_timeout_s, turn_linger_s=r.turn_linger_s)

    def token(self) -> str | None:
        """The bearer token from the environment (None: no token_env, a loopback endpoint open to local callers)."""
        name = self.endpoint.token_env
        if name is None:
            return None
        token = os.environ.get(name)
        if not token:
            raise MissingToken(f"run.rollout.harness.token_env: the environment variable {name} is not set (it holds "
                               "the endpoint's bearer token)")
        return token


def load_agent(path: str | None) -> Agent | None:
    """`run.rollout.harness.agent` ('pkg.mod:fn'), imported once when the run starts."""
    return None if path is None else import_object(path)


def requests_by_cap(turns: list[TurnRequest], max_new_tokens: int,
                    temperature: float) -> list[tuple[list[TurnRequest], GenerationRequest]]:
    """The waiting turns as one generator request per token cap (agents asking for `max_tokens` below the run's
    get a request of their own; every turn keeps its seed, so the split changes no token)."""
    by_cap: dict[int, list[TurnRequest]] = defaultdict(list)
    for t in turns:
        by_cap[t.max_new_tokens or max_new_tokens].append(t)
    return [(group, GenerationRequest(prompts=[t.prompt for t in group], samples_per_prompt=1, max_new_tokens=cap,
                                      temperature=temperature, seeds=[t.seed for t in group]))
            for cap, group in by_cap.items()]


async def serve_queue(generators: Generators, index: int, queue: TurnQueue, turns: list[TurnRequest],
                      cfg: HarnessRunConfig, temperature: float) -> list[int]:
    """Generator `index` samples `turns` (taken from `queue`); the weight version of each request it made."""
    versions = []
    async with queue.serving(turns):
        for group, request in requests_by_cap(turns, cfg.limits.max_new_tokens, temperature):
            version, groups = await generators.generate_versioned(index, request)
            versions.append(version)
            deliver(group, groups)
    return versions


class HarnessRollout:
    """`RolloutDriver` whose episodes an agent plays through the endpoint: an intake of chunks, the episodes
    open to agents, generators serving their turns."""

    def __init__(self, cfg: HarnessRunConfig, services: RolloutServices, agent: Agent | None) -> None:
        self.cfg, self.agent = cfg, agent
        self.generators, self.scoring = services.generators, services.scoring
        self.spawn, self.stop = services.spawn, services.stop
        self.queue = TurnQueue(cfg.turn_linger_s, takers=len(services.generators))
        self.registry = EpisodeRegistry(needs_reward=services.scoring.rewarder is None)
        self.token = cfg.token()
        self.server = self._server()
        self._intake: asyncio.Task[None] | None = None
        self._serving: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(cfg.max_episodes)

    def _server(self) -> ChatServer:
        from composer_mesh.orchestration.rollout.chat_server import ChatServer

        e = self.cfg.endpoint
        return ChatServer(self.registry, e.host, e.port, self.token, e.model_name)

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def _serve(self, spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]) -> asyncio.Task[None]:
        """The task serving the endpoint, started with `spawn` unless one is serving. An endpoint whose task
        ended (cancelled with the run's tasks, or after an evaluation) closed its socket: a new one replaces it
        (a new port if port 0; tasks handed out from then on carry its base_url)."""
        if self._serving is not None and self._serving.done():
            self.server, self._serving = self._server(), None
        if self._serving is None:
            self._serving = spawn(self.server.serve())
        return self._serving

    async def drive(self, index: int, chunks: ChunkSource) -> None:
        """Generator `index` samples waiting turns until the run cancels it (the first call starts the endpoint
        and the intake)."""
        self._serve(self.spawn)
        if self._intake is None:
            self._intake = self.spawn(self._take_chunks(chunks))
        try:
            while True:
                turns = await next_turns(self.queue, self.cfg.max_episodes, chunks)
                t0 = time.perf_counter()
                await serve_queue(self.generators, index, self.queue, turns, self.cfg, self.cfg.temperature)
                share = (time.perf_counter() - t0) / len(turns)
                for step, n in Counter(t.step for t in turns).items():
                    chunks.times(step).generate_s += share * n
        except RestartsExhausted as e:
            self.stop(str(e))

    async def _take_chunks(self, chunks: ChunkSource) -> None:
        while True:
            chunk = await chunks.next_chunk(counts_idle=False)
            self.spawn(self._play_chunk(chunk, chunks))

    async def _play_chunk(self, chunk: Chunk, chunks: ChunkSource) -> None:
        try:
            scored = await asyncio.gather(*(self._play_group(p, chunk.first + i, chunk.step, self.queue)
                                            for i, p in enumerate(chunk.prompts)))
            times = chunks.times(chunk.step)
            signals = await self.scoring.signals([g.group for g in scored], chunk.first, times, traces=False)
            distributions = spread(list(scored), list(range(len(scored))), signals)
            await chunks.finish(chunk, group_results(chunk, TrainBatch(list(scored), distributions, [])))
        except RestartsExhausted as e:
            self.stop(str(e))

    async def _play_group(self, prompt: Prompt, index: int, step: int, queue: TurnQueue, seeds: list[int] | None = None,
                          tag: str = "") -> ScoredGroup:
        """The prompt's episodes, each handed to an agent; rewards as reported, or the rewarder's where none was
        (it scores an episode's last segment, which holds its final answer). Every segment of an episode whose
        agent rewrote the conversation is a rollout with the episode's reward."""
        first = row_seed(self.cfg.seed, index, self.cfg.samples_per_prompt)
        seeds = seeds or [first + j for j in range(self.cfg.samples_per_prompt)]
        played = await asyncio.gather(*(self._play(prompt, s, step, f"{tag}{index}-{j}", queue)
                                        for j, s in enumerate(seeds)))
        segments = [e.rollouts() for e in played]
        reported = [e.ended.result() for e in played]
        if any(r is None for r in reported):
            scored = (await self.scoring.score([RolloutGroup(prompt, [s[-1] for s in segments])]))[0].rewards
            reported = [r if r is not None else s for r, s in zip(reported, scored, strict=True)]
        rewards = [_counted(r, e) for r, e in zip(reported, played, strict=True) if r is not None]
        return ScoredGroup(RolloutGroup(prompt, [r for s in segments for r in s]),
                           [rw for rw, s in zip(rewards, segments, strict=True) for _ in s])

    async def _play(self, prompt: Prompt, seed: int, step: int, episode_id: str, queue: TurnQueue) -> HarnessEpisode:
        """One episode, from handing its task out to its reported end (or `episode_timeout_s`)."""
        async with self._slots, queue.playing():
            episode = HarnessEpisode(episode_id, prompt, seed, step, queue, self.cfg.limits)
            self.registry.open(episode)
            try:
                await self._hand_out(episode)
                try:
                    await asyncio.wait_for(asyncio.shield(episode.ended), self.cfg.episode_timeout_s)
                except TimeoutError:
                    episode.end(RewardResult(0.0), "truncated_time")
            finally:
                self.registry.close(episode_id)
            return episode

    async def _hand_out(self, episode: HarnessEpisode) -> None:
        task = HarnessTask(episode.id, episode.prompt.prompt_id,
                           episode.prompt.messages or [{"role": "user", "content": episode.prompt.text}],
                           episode.prompt.tools, episode.seed, self.base_url, self.token or "none",
                           episode.prompt.answer, dict(episode.prompt.extra))
        if self.agent is None:
            await self.registry.waiting.put(task)
        else:
            self.spawn(self._run_agent(self.agent, task, episode))

    async def _run_agent(self, agent: Agent, task: HarnessTask, episode: HarnessEpisode) -> None:
        """The callback plays the episode; its return is the reward, its exception the episode's failure."""
        try:
            reward = await agent(task)
        except Exception as e:  # the agent's failure ends its episode, never the run
            log.warning("episode %s: the agent failed: %s: %s", task.episode_id, type(e).__name__, e)
            episode.end(RewardResult(0.0, ok=False, error=f"{type(e).__name__}: {e}"), "error_environment")
            return
        if reward is None and self.registry.needs_reward:
            episode.end(RewardResult(0.0, ok=False, error="the agent returned no reward and the run has no rewarder"))
        else:
            episode.end(None if reward is None else RewardResult(float(reward)))

    def counters(self) -> dict[str, float]:
        return {}

    async def evaluate(self, prompts: list[Prompt], samples: int, temperature: float,
                       seed: int) -> tuple[int, list[ScoredGroup]]:
        """`samples` episodes of each held-out prompt, played by the agent, sampled on generator 0 at
        `temperature`; the oldest weight version used. The endpoint is up meanwhile: the run's, or one of the
        evaluation's own, stopped after it (the run evaluates before its first step and after its tasks ended)."""
        own = None if self._serving is not None and not self._serving.done() else self._serve(asyncio.ensure_future)
        queue, versions = TurnQueue(self.cfg.turn_linger_s), []

        async def serve() -> None:
            while True:
                turns = await queue.take(1 << 30)
                versions.extend(await serve_queue(self.generators, 0, queue, turns, self.cfg, temperature))

        server = asyncio.ensure_future(serve())
        try:
            groups = await asyncio.gather(*(
                self._play_group(p, i, 0, queue, [seed + i * samples + j for j in range(samples)], tag="eval-")
                for i, p in enumerate(prompts)))
        finally:
            server.cancel()
            if own is not None:
                own.cancel()
                await asyncio.gather(own, return_exceptions=True)
        return min(versions, default=0), [episodes_once(g) for g in groups]


def episodes_once(group: ScoredGroup) -> ScoredGroup:
    """`group` with one rollout per episode (its first segment, which carries the episode's reward): held-out
    scores count episodes, not training samples."""
    kept = [(r, rw) for r, rw in zip(group.group.rollouts, group.rewards, strict=True) if r.opens_episode]
    return ScoredGroup(RolloutGroup(group.group.prompt, [r for r, _ in kept]), [rw for _, rw in kept])


def _counted(reward: RewardResult, episode: HarnessEpisode) -> RewardResult:
    """The reward with the episode's policy turns among its components (`episode/turns` in the step records)."""
    turns = float(len(episode.tokens.policy_turns()))
    return RewardResult(reward.score, reward.ok, reward.error, {**reward.components, "turns": turns})


def factory(run: RunConfig, context: int | None = None) -> RolloutFactory:
    """The harness driver for `run` (`context`: the model's longest sequence)."""
    agent = load_agent(run.rollout.harness.agent)
    return lambda services: HarnessRollout(HarnessRunConfig.of(run, context), services, agent)
