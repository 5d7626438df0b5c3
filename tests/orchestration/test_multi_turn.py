"""The multi-turn driver replayed against fakes: a token-in/token-out generator fake, a scripted environment.

What is checked: an episode is one Rollout whose turns tile its completion (policy spans with the sampler's
log-probs and versions, environment spans with 0.0); each turn is sent as the exact conversation so far; the
limits end episodes with their statuses; an environment failure is data (and retried when asked); turns of
concurrent episodes share requests without changing a token; chunks come back scored with teacher
distributions and no single-turn traces; evaluation plays greedy episodes on generator 0."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from orchestration.fakes import FakeChunks, FakeTeachers, prompts

from composer_mesh.actors.messages import (
    GenerationRequest,
    Prompt,
    RewardResult,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TrainBatch,
)
from composer_mesh.envs.session import Observation, StepResult
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.pipeline import LagGate
from composer_mesh.orchestration.rollout.base import RolloutServices
from composer_mesh.orchestration.rollout.episode import (
    TURN_SEED_STRIDE,
    EpisodeLimits,
    EpisodeTokens,
    TokenDrift,
    play_episode,
)
from composer_mesh.orchestration.rollout.multi_turn import MultiTurnConfig, MultiTurnRollout
from composer_mesh.orchestration.schedule import Chunk, row_seed
from composer_mesh.orchestration.scoring import Scoring, ScoringConfig

BRIDGE = 900  # the fake template renders each environment message as one token 900 + len(content)


class TurnGenerators:
    """`ports.Generators` speaking token in, token out: a turn's prompt ids are its `token_ids` plus one token per
    bridge message; it samples 2 tokens that are a function of the turn's seed (as the real samplers are). The
    turn's text is `policy(prompt)` when given (a scripted policy playing a real environment), else the seed."""

    def __init__(self, n: int = 1, version: int = 1, drift: bool = False,
                 policy: Callable[[Prompt], str] | None = None) -> None:
        self.n, self.version, self.drift, self.policy = n, version, drift, policy
        self.requests: list[tuple[int, GenerationRequest]] = []

    def __len__(self) -> int:
        return self.n

    def _turn(self, p: Prompt, seed: int, index: int) -> Rollout:
        if p.bridge_messages is None:
            ids = [1, 2, 3]  # the opening conversation through the "template"
        else:
            sent = [*list(p.token_ids[:-1]), p.token_ids[-1] + 1] if self.drift else list(p.token_ids)
            ids = sent + [BRIDGE + len(str(m["content"])) for m in p.bridge_messages]
        tokens = [seed % 97, (seed >> 48) % 97]
        text = f"seed{seed}" if self.policy is None else self.policy(p)
        return Rollout(p.prompt_id, ids, tokens, [-0.5, -0.25], self.version, text=text, generator=f"generator{index}")

    async def generate(self, index: int, request: GenerationRequest) -> list[RolloutGroup]:
        self.requests.append((index, request))
        await asyncio.sleep(0)
        assert request.seeds is not None and request.samples_per_prompt == 1
        return [RolloutGroup(p, [self._turn(p, s, index)]) for p, s in zip(request.prompts, request.seeds)]

    async def generate_versioned(self, index: int, request: GenerationRequest) -> tuple[int, list[RolloutGroup]]:
        return self.version, await self.generate(index, request)


class Counting:
    """A session that wants `calls` tool turns, then an answer: each turn before gets a tool message back;
    reward 1 at the end. `fail_at` raises on that step; `slow_at` sleeps there (`pause` seconds)."""

    def __init__(self, calls: int = 2, fail_at: int | None = None, slow_at: int | None = None,
                 pause: float = 10.0) -> None:
        self.calls, self.fail_at, self.slow_at, self.pause = calls, fail_at, slow_at, pause
        self.steps: list[str] = []
        self.closed = False

    async def reset(self) -> Observation:
        return Observation([{"role": "user", "content": "go"}], tools=[{"type": "function"}])

    async def step(self, action: str) -> StepResult:
        self.steps.append(action)
        k = len(self.steps)
        if k == self.fail_at:
            raise ConnectionError("server gone")
        if k == self.slow_at:
            await asyncio.sleep(self.pause)
        if k <= self.calls:
            return StepResult([{"role": "tool", "content": "x" * k}], info={"tool_calls": 1.0})
        return StepResult(reward=1.0, done=True)

    async def close(self) -> None:
        self.closed = True


class Env:
    name = "counting"

    def __init__(self, **session: Any) -> None:
        self.kw, self.sessions = session, []

    def session(self, prompt: Any, seed: int) -> Counting:
        s = Counting(**self.kw)
        self.sessions.append(s)
        return s


def limits(**kw: Any) -> EpisodeLimits:
    base = {"max_turns": 8, "max_new_tokens": 2, "max_context": None, "step_timeout_s": 5.0, "episode_timeout_s": None}
    return EpisodeLimits(**{**base, **kw})


async def play(session: Counting, gens: TurnGenerators, seed: int = 5, **kw: Any) -> Any:
    async def sample(p: Prompt, s: int) -> Rollout:
        return (await gens.generate(0, GenerationRequest([p], 1, 2, seeds=[s])))[0].rollouts[0]

    return await play_episode(session, Prompt("p0", "q"), seed, limits(**kw), sample)


async def test_an_episode_is_one_rollout_whose_turns_tile_it() -> None:
    gens = TurnGenerators(version=3)
    ep = await play(Counting(calls=2), gens)
    r = ep.rollout
    assert r.status == "done" and ep.reward == 1.0 and ep.info == {"tool_calls": 2.0}
    assert r.prompt_ids == [1, 2, 3]
    # policy (2 tokens), bridge (1 token), policy, bridge, policy
    assert [(t.start, t.end, t.policy) for t in r.turns or []] == [
        (0, 2, True), (2, 3, False), (3, 5, True), (5, 6, False), (6, 8, True)]
    assert r.completion_ids[2] == BRIDGE + 1 and r.completion_ids[5] == BRIDGE + 2
    assert r.loss_mask() == [1, 1, 0, 1, 1, 0, 1, 1]
    assert r.logprobs == [-0.5, -0.25, 0.0, -0.5, -0.25, 0.0, -0.5, -0.25]
    assert [t.reward for t in r.turns or [] if t.policy] == [None, None, 1.0]
    # every turn after the first was sent as the exact ids of the conversation so far, with its seed
    sent = [req.prompts[0] for _, req in gens.requests]
    assert sent[1].token_ids == r.prompt_ids + r.completion_ids[:2]
    assert sent[2].token_ids == r.prompt_ids + r.completion_ids[:5]
    assert [req.seeds for _, req in gens.requests] == [[5], [5 + TURN_SEED_STRIDE], [5 + 2 * TURN_SEED_STRIDE]]
    assert sent[0].tools == [{"type": "function"}] and sent[0].messages == [{"role": "user", "content": "go"}]


async def test_a_generator_that_re_tokenizes_the_conversation_is_refused() -> None:
    with pytest.raises(TokenDrift, match="exact ids"):
        await play(Counting(calls=2), TurnGenerators(drift=True))


@pytest.mark.parametrize(("session", "kw", "status"), [
    (Counting(calls=5), {"max_turns": 3}, "truncated_turns"),
    (Counting(calls=5), {"max_context": 3 + 2 + 34 + 2}, "truncated_context"),  # turn 2 fits, turn 3 does not
    (Counting(calls=5, slow_at=2), {"step_timeout_s": 0.05}, "error_timeout"),
    (Counting(calls=5, slow_at=2), {"episode_timeout_s": 0.05}, "truncated_time"),
    (Counting(calls=5, fail_at=2), {}, "error_environment"),
])
async def test_limits_and_failures_end_an_episode_with_their_status(session: Counting, kw: dict[str, Any],
                                                                    status: str) -> None:
    ep = await play(session, TurnGenerators(), **kw)
    assert ep.rollout.status == status
    result = ep.reward_result()
    assert result.ok is (status != "error_environment")
    if status == "error_environment":
        assert "ConnectionError: server gone" in (result.error or "")
    assert ep.rollout.turns and ep.rollout.turns[-1].policy  # what was played is kept, ending on a policy turn


def driver(gens: TurnGenerators, env: Env, run: RunConfig | None = None, teachers: Any = None,
           spawned: list[asyncio.Task[Any]] | None = None) -> MultiTurnRollout:
    run = run or RunConfig(samples_per_prompt=2, max_new_tokens=2, seed=3)
    scoring = Scoring(ScoringConfig(seed=3, max_new_tokens=2, teacher_top_k="auto", distributions=True, traces=True),
                      None, teachers)  # type: ignore[arg-type]
    tasks = spawned if spawned is not None else []

    def spawn(coro: Any) -> asyncio.Task[Any]:
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]

    return MultiTurnRollout(MultiTurnConfig.of(run), RolloutServices(gens, scoring, spawn, print), env)  # type: ignore[arg-type]


async def run_chunks(gens: TurnGenerators, env: Env, chunks: list[Chunk], teachers: Any = None,
                     run: RunConfig | None = None) -> FakeChunks:
    source, tasks = FakeChunks(chunks), []
    d = driver(gens, env, run, teachers, tasks)
    tasks += [asyncio.ensure_future(d.drive(i, source)) for i in range(gens.n)]
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(source.done.wait(), 10)
        escaped = [e for t in tasks if t.done() and not t.cancelled() and (e := t.exception()) is not None]
    finally:
        for t in tasks:
            t.cancel()
    assert escaped == []  # nothing raised out of the driver's tasks (a generator's drive, a chunk's play)
    assert source.done.is_set(), "the driver did not hand every chunk back within 10 s"
    return source


async def test_chunks_come_back_as_scored_episodes_with_teacher_distributions_only() -> None:
    teachers = FakeTeachers()
    source = await run_chunks(TurnGenerators(), Env(calls=1), [Chunk(1, 0, prompts(0, 2))], teachers)
    results = source.finished[0]
    assert [r.index for r in results] == [0, 1]
    for r in results:
        assert [rw.score for rw in r.group.rewards] == [1.0, 1.0]
        assert all(rw.components == {"tool_calls": 1.0, "turns": 2.0} for rw in r.group.rewards)
        assert len(r.distributions) == 2 and all(d is not None for d in r.distributions)
        assert r.traces == []
    [dist] = [req for req in teachers.requests if req.rollouts]
    assert dist.prompts == [] and len(dist.rollouts) == 4  # no single-turn traces for episodes
    # the rest are teacher turns of channel-3 episodes (tests/orchestration/test_teacher_episodes.py); this fake's
    # traces have no prompt ids, so no teacher plays and no trace comes back
    assert all(req.seeds is not None and not req.rollouts for req in teachers.requests if req is not dist)
    assert source.step_times[1].generate_s > 0


async def test_concurrent_episodes_share_requests_and_batching_changes_no_token() -> None:
    chunks = [Chunk(1, 0, prompts(0, 2)), Chunk(1, 2, prompts(2, 2))]
    one, two = TurnGenerators(n=1), TurnGenerators(n=2)
    a = await run_chunks(one, Env(calls=2), [*chunks])
    b = await run_chunks(two, Env(calls=2), [*chunks])
    assert max(len(req.prompts) for _, req in one.requests) > 1  # turns of several episodes in one request
    assert {i for i, _ in two.requests} == {0, 1}  # both generators served turns
    for first in (0, 2):
        ids_a = [r.completion_ids for g in a.finished[first] for r in g.group.group.rollouts]
        ids_b = [r.completion_ids for g in b.finished[first] for r in g.group.group.rollouts]
        assert ids_a == ids_b
    # episode j of stream prompt i samples its first turn with the row's seed, as a single completion would
    seeds = {s for _, req in one.requests for s in req.seeds or []}
    assert {row_seed(3, i, 2) + j for i in range(4) for j in range(2)} <= seeds


async def test_an_episode_spanning_a_weight_update_counts_its_lag_from_the_oldest_turn() -> None:
    gens = TurnGenerators(version=4)

    async def sample(p: Prompt, s: int) -> Rollout:
        out = (await gens.generate(0, GenerationRequest([p], 1, 2, seeds=[s])))[0].rollouts[0]
        gens.version += 1  # the next turn is sampled with newer weights
        return out

    ep = await play_episode(Counting(calls=2), Prompt("p0", "q"), 1, limits(), sample)
    assert [t.weight_version for t in ep.rollout.turns or [] if t.policy] == [4, 5, 6]
    assert ep.rollout.weight_version == 4


def test_an_episode_that_played_no_turn_does_not_count_as_stale() -> None:
    """An agent or environment that failed before its first turn leaves a rollout with no completion and
    weight_version 0: it sampled nothing, so the batch's lag is its sampled rollouts' (a harness run under load
    used to stop with "a batch is more than 3 versions stale [11]")."""
    played = Rollout("p0", [1], [2, 3], [-0.1, -0.2], weight_version=10)
    empty = EpisodeTokens().rollouts(Prompt("p0", "q"), "error_environment", "0-1")[0]
    assert empty.completion_ids == [] and empty.weight_version == 0
    batch = TrainBatch([ScoredGroup(RolloutGroup(Prompt("p0", "q"), [played, empty]),
                                    [RewardResult(1.0), RewardResult(0.0, ok=False)])])
    gate = LagGate(max_policy_lag=3)
    assert gate.lag(batch, 11) == 1 and gate.admit(batch, 11)
    only_empty = TrainBatch([ScoredGroup(RolloutGroup(Prompt("p0", "q"), [empty]), [RewardResult(0.0, ok=False)])])
    assert gate.lag(only_empty, 11) == 0


async def test_failed_environments_are_played_again_from_the_start_when_retries_allow() -> None:
    env = Env(calls=1, fail_at=1)
    run = RunConfig(samples_per_prompt=2, max_new_tokens=2, seed=3, rollout={"kind": "multi_turn",
                                                                               "environment_retries": 2},
                    environment={"kind": "calculator"})
    source = await run_chunks(TurnGenerators(), env, [Chunk(1, 0, prompts(0, 1))], run=run)
    rewards = source.finished[0][0].group.rewards
    assert [rw.ok for rw in rewards] == [False, False]
    assert len(env.sessions) == 2 * 3 and all(s.closed for s in env.sessions)  # each sample: 1 + 2 retries


class Flaky(Env):
    """Sessions of the seeds in `failing` raise on their first step (a server that died), their first
    `attempts` times; every other session plays as `Env`'s."""

    def __init__(self, failing: set[int], attempts: int, **session: Any) -> None:
        super().__init__(**session)
        self.failing, self.attempts, self.tries = failing, attempts, Counter[int]()

    def session(self, prompt: Any, seed: int) -> Counting:
        self.tries[seed] += 1
        if seed in self.failing and self.tries[seed] <= self.attempts:
            s = Counting(**{**self.kw, "fail_at": 1})
            self.sessions.append(s)
            return s
        return super().session(prompt, seed)


def multi_turn_run(retries: int) -> RunConfig:
    return RunConfig(samples_per_prompt=2, max_new_tokens=2, seed=3, environment={"kind": "calculator"},
                     rollout={"kind": "multi_turn", "environment_retries": retries})


def episodes(source: FakeChunks) -> dict[tuple[int, int], Rollout]:
    return {(r.index, j): e for results in source.finished.values() for r in results
            for j, e in enumerate(r.group.group.rollouts)}


async def test_a_dead_environment_ends_its_episode_with_an_error_and_the_run_goes_on() -> None:
    dead = row_seed(3, 1, 2) + 1  # stream prompt 1, its second episode
    env = Flaky({dead}, attempts=1, calls=1)
    chunks = [Chunk(1, 0, prompts(0, 2)), Chunk(2, 2, prompts(2, 2))]
    source = await run_chunks(TurnGenerators(n=2), env, chunks, run=multi_turn_run(0))
    played = episodes(source)
    assert sorted(played) == [(i, j) for i in range(4) for j in range(2)]  # both chunks came back: the run went on
    assert {k: e.status for k, e in played.items() if e.status != "done"} == {(1, 1): "error_environment"}
    rewards = {(r.index, j): rw for results in source.finished.values() for r in results
               for j, rw in enumerate(r.group.rewards)}
    assert not rewards[1, 1].ok and "ConnectionError: server gone" in (rewards[1, 1].error or "")
    assert all(rw.ok and rw.score == 1.0 for k, rw in rewards.items() if k != (1, 1))
    assert len(env.sessions) == 8 and all(s.closed for s in env.sessions)  # not played again: no retries


async def test_an_episode_whose_environment_died_is_played_again_and_matches_the_one_never_failed() -> None:
    dead = row_seed(3, 0, 2)
    env = Flaky({dead}, attempts=1, calls=2)
    chunks = [Chunk(1, 0, prompts(0, 2))]
    retried = episodes(await run_chunks(TurnGenerators(n=2), env, [*chunks], run=multi_turn_run(1)))
    clean = episodes(await run_chunks(TurnGenerators(n=2), Env(calls=2), [*chunks], run=multi_turn_run(1)))
    assert env.tries[dead] == 2 and all(n == 1 for seed, n in env.tries.items() if seed != dead)
    assert all(e.status == "done" for e in retried.values())
    assert {k: (e.prompt_ids, e.completion_ids, e.turns) for k, e in retried.items()} == {
        k: (e.prompt_ids, e.completion_ids, e.turns) for k, e in clean.items()}


async def test_generator_idle_time_is_the_generators_wait_for_a_turn_not_the_intakes_for_a_chunk() -> None:
    """Both generators have nothing to sample while the only episodes wait 0.3 s on their environment: at least
    2 x 0.3 s idle (a wait is counted when it ends, here when the run cancels it). The intake waits for chunks
    without counting (it is no generator)."""
    source = FakeChunks([Chunk(1, 0, prompts(0, 1))])
    tasks: list[asyncio.Task[Any]] = []
    d = driver(TurnGenerators(n=2), Env(calls=1, slow_at=1, pause=0.3), spawned=tasks)
    t0 = asyncio.get_running_loop().time()
    tasks += [asyncio.ensure_future(d.drive(i, source)) for i in range(2)]
    try:
        await asyncio.wait_for(source.done.wait(), 10)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = asyncio.get_running_loop().time() - t0
    assert source.uncounted >= 1  # the intake asked for chunks, and said its wait is not a generator's
    assert 2 * 0.3 * 0.9 <= source.idle_s <= 2 * wall


async def test_evaluation_plays_greedy_episodes_on_generator_0() -> None:
    gens = TurnGenerators(n=2, version=7)
    d = driver(gens, Env(calls=1))
    version, groups = await d.evaluate(prompts(0, 3), 1, 0.0, seed=11)
    assert version == 7 and [len(g.rewards) for g in groups] == [1, 1, 1]
    assert all(rw.score == 1.0 for g in groups for rw in g.rewards)
    assert {i for i, _ in gens.requests} == {0}
    assert all(req.temperature == 0.0 for _, req in gens.requests)


async def test_a_steps_episode_metrics_count_statuses_tokens_and_the_environments_counters() -> None:
    from composer_mesh.actors.messages import ScoredGroup
    from composer_mesh.orchestration.episode_metrics import episode_metrics

    done = await play(Counting(calls=2), TurnGenerators())
    cut = await play(Counting(calls=5), TurnGenerators(), max_turns=2)
    group = ScoredGroup(RolloutGroup(Prompt("p0", "q"), [done.rollout, cut.rollout]),
                        [done.reward_result(), cut.reward_result()])
    m = episode_metrics([group])
    assert m["episode/status_done"] == 0.5 and m["episode/status_truncated_turns"] == 0.5
    assert m["episode/status_error_environment"] == 0.0
    assert m["episode/turns"] == (3 + 2) / 2 and m["episode/tool_calls"] == (2 + 2) / 2
    single = ScoredGroup(RolloutGroup(Prompt("p1", "q"), [Rollout("p1", [1], [2], [-0.1], 1)]), [done.reward_result()])
    assert episode_metrics([single]) == {}


def test_a_steps_error_rates_divide_the_sums_over_its_episodes() -> None:
    """Tool errors per call and unreadable calls per call attempted, over all of a step's episodes (not a mean of
    per-episode rates: an episode of one failed call weighs one call); none where nothing was attempted."""
    from composer_mesh.actors.messages import RewardResult, ScoredGroup, Turn
    from composer_mesh.orchestration.episode_metrics import episode_metrics

    episode = Rollout("p0", [1], [2, 3], [-0.1, -0.1], 1, turns=[Turn(0, 2, policy=True)])
    counts = [{"tool_calls": 9.0, "tool_errors": 0.0, "parse_errors": 1.0},
              {"tool_calls": 1.0, "tool_errors": 1.0, "parse_errors": 3.0, "sandbox_kills": 1.0}]
    group = ScoredGroup(RolloutGroup(Prompt("p0", "q"), [episode, episode]),
                        [RewardResult(1.0, components=c) for c in counts])
    m = episode_metrics([group])
    assert m["episode/tool_error_rate"] == 1 / 10 and m["episode/parse_error_rate"] == 4 / 14
    assert m["episode/tool_errors"] == 0.5 and m["episode/sandbox_kills"] == 0.5  # per-episode means, as before
    quiet = ScoredGroup(RolloutGroup(Prompt("p0", "q"), [episode]), [RewardResult(1.0, components={"turns": 1.0})])
    assert "episode/tool_error_rate" not in episode_metrics([quiet]) and \
        "episode/parse_error_rate" not in episode_metrics([quiet])


@pytest.mark.parametrize(("fields", "error"), [
    ({"rollout": {"kind": "multi_turn"}}, "no run.environment plays none"),
    ({"rollout": {"kind": "multi_turn"}, "environment": {"kind": "openenv", "url": "http://127.0.0.1:9"}},
     "kind 'openenv' plays none"),
    ({"rollout": {"kind": "multi_turn", "max_turns": 4}, "environment": {"kind": "coding"}},
     r"run.environment.max_turns \(8\) is more than run.rollout.max_turns \(4\)"),
])
def test_an_episode_run_needs_an_environment_that_plays_and_grades_its_episodes(fields: dict[str, Any],
                                                                                  error: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=error):
        RunConfig(**fields)
    assert RunConfig(rollout={"kind": "multi_turn"}, environment={"kind": "calculator"}).rollout.max_turns == 8


class Summarising(Counting):
    """`Counting`, but after turn 1 the conversation is replaced by a summary (`rewrite`), the tool result after it."""

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        if len(self.steps) == 1:
            result.rewrite = [{"role": "user", "content": "summary"}]
        return result


class SummarisingEnv(Env):
    def session(self, prompt: Any, seed: int) -> Counting:
        s = Summarising(**self.kw)
        self.sessions.append(s)
        return s


async def test_an_episode_whose_conversation_is_rewritten_is_two_rollouts_counted_once_in_the_metrics() -> None:
    from composer_mesh.orchestration.episode_metrics import episode_metrics

    gens = TurnGenerators()
    source = await run_chunks(gens, SummarisingEnv(calls=2), [Chunk(1, 0, prompts(0, 1))])
    (result,) = source.finished[0]
    rollouts = result.group.group.rollouts
    assert [(r.segment, r.status) for r in rollouts] == [(0, "done"), (1, "done")] * 2
    assert rollouts[0].episode_id == rollouts[1].episode_id != rollouts[2].episode_id == rollouts[3].episode_id
    first, second = rollouts[:2]
    assert len([t for t in first.turns or [] if t.policy]) == 1 and len([t for t in second.turns or [] if t.policy]) == 2
    assert second.prompt_ids == [1, 2, 3]  # the fake's fresh rendering: the rewritten conversation as an opening
    fresh = [p for _, req in gens.requests for p in req.prompts if p.bridge_messages is None and p.messages]
    assert [p.messages for p in fresh].count([{"role": "user", "content": "summary"}, {"role": "tool",
                                                                                          "content": "x"}]) == 2
    assert all(p.tools == [{"type": "function"}] for p in fresh)  # the opening's tools, declared again
    assert [rw.score for rw in result.group.rewards] == [1.0] * 4 and len(result.distributions) == 4
    m = episode_metrics([result.group])
    assert m["episode/segments"] == 2.0 and m["episode/status_done"] == 1.0 and m["episode/turns"] == 3.0
    seeds = [s for _, req in gens.requests for s in req.seeds or []]
    assert len(seeds) == len(set(seeds)) == 6  # turn k keeps seed + k * stride across segments


async def test_an_empty_rewrite_fails_the_episode_as_the_environments_error() -> None:
    class Empty(Counting):
        async def step(self, action: str) -> StepResult:
            return StepResult(rewrite=[])

    ep = await play(Empty(), TurnGenerators())
    assert ep.rollout.status == "error_environment" and "StepResult.rewrite is empty" in (ep.error or "")
