"""Channel 3 on episodes, replayed against fakes: each replay teacher plays the group's task (same environment seed)
token in, token out, and its episode comes back as a `TeacherTrace` in the group's result.

The fake teachers continue a turn's exact ids as a local teacher does (the opening through the "template", a later
turn as its `token_ids` plus one token per bridge message) and sample tokens that are a function of the teacher and
the turn's seed, as the real samplers are. What is checked: the trace's spans tile its completion, its opening ids
are the student's, its reward is the environment's, its turns use the student's seed scheme and the group's
environment seed, batching teacher turns changes no token, a teacher without prompt ids is skipped with one
warning and counted, failures follow the student's rules, and the trainer pairs the traces."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch
from orchestration.fakes import prompts
from orchestration.test_multi_turn import BRIDGE, Counting, TurnGenerators, limits, run_chunks

from composer_mesh.actors.messages import (
    Prompt,
    TeacherRequest,
    TeacherSignals,
    TeacherTrace,
    TokenDistribution,
    TrainBatch,
)
from composer_mesh.actors.teacher_errors import TeacherFailed
from composer_mesh.envs.session import StepResult
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.rollout.episode import TURN_SEED_STRIDE
from composer_mesh.orchestration.rollout.multi_turn import play_in_session
from composer_mesh.orchestration.rollout.teacher_episodes import TeacherEpisodes, TeacherTurns
from composer_mesh.orchestration.schedule import Chunk, row_seed

REWARD = {"a": 1.0, "b": 0.5}  # the graded environment's reward of an episode whose last turn is this teacher's


class TurnTeachers:
    """`ports.Teachers` of two pool procs whose replay members continue token in, token out. `playable[name]`
    False: the member's traces have no prompt ids (another tokenizer). `down`: members that are unavailable and
    skipped (no trace); `stop`: a member whose `on_failure: stop` raises."""

    def __init__(self, playable: dict[str, bool], down: frozenset[str] = frozenset(), stop: str | None = None) -> None:
        self.playable, self.down, self.stop = playable, down, stop
        self.requests: list[TeacherRequest] = []

    def _trace(self, name: str, p: Prompt, seed: int) -> TeacherTrace:
        if p.bridge_messages is None:
            ids = [1, 2, 3]  # the opening conversation through the "template", as TurnGenerators renders it
        else:
            ids = [*p.token_ids, *(BRIDGE + len(str(m["content"])) for m in p.bridge_messages)]
        tokens = [100 + ord(name[0]) % 50, seed % 97, (seed >> 48) % 97]
        return TeacherTrace(name, p.prompt_id, f"{name}:{seed}", tokens, prompt_ids=ids if self.playable[name] else [],
                            usage={"prompt_tokens": float(len(ids)), "completion_tokens": 3.0})

    async def signals(self, request: TeacherRequest) -> list[TeacherSignals]:
        self.requests.append(request)
        await asyncio.sleep(0)
        if request.rollouts:  # the chunk's channel-2 request
            assert not request.prompts
            return [TeacherSignals(distributions=[TokenDistribution("a", logits=torch.zeros(1, 2))] * len(request.rollouts))]
        assert request.seeds is not None and len(request.seeds) == len(request.prompts)
        asked = [n for n in sorted(self.playable) if request.teachers is None or n in request.teachers]
        if self.stop in asked:
            raise TeacherFailed(f"teacher {self.stop!r} could not give channel-3 traces (on_failure: stop)",
                                teacher=self.stop, channel="replay")
        procs = [[n for i, n in enumerate(asked) if i % 2 == r and n not in self.down] for r in range(2)]
        return [TeacherSignals(traces=[self._trace(n, p, s) for n in names for p, s in zip(request.prompts, request.seeds)])
                for names in procs]


class Graded(Counting):
    """Counting's episodes, graded by who played the last turn (`REWARD`; the student's turns get 0)."""

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        if result.done:
            result.reward = REWARD.get(action.split(":")[0], 0.0)
        return result


class GradedEnv:
    name = "graded"

    def __init__(self, **session: Any) -> None:
        self.kw, self.seeds = session, []

    def session(self, prompt: Prompt, seed: int) -> Graded:
        self.seeds.append((prompt.prompt_id, seed))
        return Graded(**self.kw)


def run() -> RunConfig:
    return RunConfig(samples_per_prompt=2, max_new_tokens=2, seed=3)


def spans_tile(trace: TeacherTrace) -> bool:
    turns = trace.turns or []
    ends = [0] + [t.end for t in turns]
    return all(t.start == e for t, e in zip(turns, ends)) and ends[-1] == len(trace.completion_ids)


async def test_each_replay_teacher_plays_the_groups_task_token_in_token_out() -> None:
    teachers, env = TurnTeachers({"a": True, "b": True}), GradedEnv(calls=2)
    source = await run_chunks(TurnGenerators(), env, [Chunk(1, 0, prompts(0, 2))], teachers)  # type: ignore[arg-type]
    results = source.finished[0]
    for r in results:
        first = row_seed(3, r.index, 2)  # the seed of the group's first episode
        assert [t.teacher for t in r.traces] == ["a", "b"]
        for t in r.traces:
            assert t.prompt_id == r.group.group.prompt.prompt_id and spans_tile(t)
            assert t.prompt_ids == r.group.group.rollouts[0].prompt_ids  # the student's opening ids
            assert t.reward == REWARD[t.teacher]  # the environment's reward, not a rewarder's
            assert [x.policy for x in t.turns or []] == [True, False, True, False, True]
            assert t.loss_mask() == [1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1]
            # turn k of the teacher's episode sampled with the group's first seed + k * TURN_SEED_STRIDE
            policy = [t.completion_ids[x.start : x.end] for x in t.turns or [] if x.policy]
            assert [p[1:] for p in policy] == [[(first + k * TURN_SEED_STRIDE) % 97, k] for k in range(3)]
            assert t.text == "".join(f"{t.teacher}:{first + k * TURN_SEED_STRIDE}" for k in range(3))
            # what the episode cost: its three turns' usage, summed (each turn's prompt is the conversation so far)
            assert t.usage == {"prompt_tokens": 3.0 + 7 + 11, "completion_tokens": 9.0}
        # the teachers played in sessions made from the group's prompt and its first episode's seed
        pid = r.group.group.prompt.prompt_id
        assert [s for p, s in env.seeds if p == pid].count(first) == 1 + 2  # the student's first episode + a + b
    # after the first turn (asked of every replay teacher) each teacher is asked for its own turns only
    turns = [q for q in teachers.requests if not q.rollouts]
    assert turns[0].teachers is None
    assert {tuple(q.teachers or ()) for q in turns[1:]} == {("a",), ("b",)}


async def test_the_trainer_pairs_a_teacher_episode_that_beats_the_groups_worst() -> None:
    from composer_mesh.actors.backends.trainer.train_batch import _replay_pairs_of

    source = await run_chunks(TurnGenerators(), GradedEnv(calls=1), [Chunk(1, 0, prompts(0, 1))],
                              TurnTeachers({"a": True, "b": True}))  # type: ignore[arg-type]
    [r] = source.finished[0]
    pairs, not_better = _replay_pairs_of(TrainBatch([r.group], r.distributions, r.traces))
    assert [t.teacher for t, _ in pairs] == ["a", "b"] and not_better == 0  # 1.0 and 0.5 beat the student's 0.0


async def test_batching_teacher_turns_changes_no_token() -> None:
    together = TurnTeachers({"a": True, "b": True})
    a = await run_chunks(TurnGenerators(), GradedEnv(calls=2), [Chunk(1, 0, prompts(0, 4))], together)  # type: ignore[arg-type]
    assert max(len(q.prompts) for q in together.requests) > 1  # turns of several episodes in one request
    alone = []
    for i in range(4):
        t = TurnTeachers({"a": True, "b": True})
        alone += (await run_chunks(TurnGenerators(), GradedEnv(calls=2), [Chunk(1, i, prompts(i, 1))], t)).finished[i]  # type: ignore[arg-type]
        assert max(len(q.prompts) for q in t.requests) == 1
    assert [[(t.teacher, t.completion_ids, t.turns) for t in r.traces] for r in a.finished[0]] == \
        [[(t.teacher, t.completion_ids, t.turns) for t in r.traces] for r in alone]


async def test_a_teacher_without_prompt_ids_is_skipped_with_one_warning_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    teachers = TurnTeachers({"a": True, "remote": False})
    with caplog.at_level(logging.WARNING, logger="composer_mesh"):
        source = await run_chunks(TurnGenerators(), GradedEnv(calls=1),
                                  [Chunk(1, 0, prompts(0, 2)), Chunk(1, 2, prompts(2, 2))], teachers)  # type: ignore[arg-type]
    assert [[t.teacher for t in r.traces] for c in (0, 2) for r in source.finished[c]] == [["a"]] * 4
    [warning] = [r.getMessage() for r in caplog.records if "'remote'" in r.getMessage()]
    assert "cannot play episodes" in warning and "no prompt ids" in warning
    assert not any(q.teachers and "remote" in q.teachers for q in teachers.requests)  # not asked again


def episodes(teachers: TurnTeachers, env: GradedEnv, retries: int = 0) -> TeacherEpisodes:
    async def play(p: Prompt, seed: int, sample: Any) -> Any:
        return await play_in_session(env, p, seed, limits(), sample)  # type: ignore[arg-type]

    return TeacherEpisodes(TeacherTurns(teachers, 3, asyncio.ensure_future), play, retries)  # type: ignore[arg-type]


async def test_counters_say_what_each_teacher_played_or_sat_out() -> None:
    eps = episodes(TurnTeachers({"a": True, "remote": False}), GradedEnv(calls=1))
    traces = await eps.traces([(Prompt("p0", "q"), 5), (Prompt("p1", "q"), 6)])
    assert [(t.prompt_id, t.teacher) for t in traces] == [("p0", "a"), ("p1", "a")]
    assert eps.names == ["a"] and eps.counters() == {
        "teacher_episodes/played": 2.0, "teacher_episodes/failed": 0.0, "teacher_episodes/skipped": 0.0,
        "teacher_episodes/unplayable/remote": 2.0}


async def test_an_unavailable_teacher_gives_no_trace_and_a_stopping_one_stops_the_run() -> None:
    teachers = TurnTeachers({"a": True, "b": True})
    eps = episodes(teachers, GradedEnv(calls=2))
    await eps.traces([(Prompt("p0", "q"), 5)])  # learns a and b
    teachers.down = frozenset({"b"})
    traces = await eps.traces([(Prompt("p1", "q"), 6)])
    assert [t.teacher for t in traces] == ["a"] and eps.skipped == 1
    teachers.down, teachers.stop = frozenset(), "b"
    with pytest.raises(TeacherFailed, match="on_failure: stop"):
        await eps.traces([(Prompt("p2", "q"), 7)])


async def test_an_environment_error_ends_the_teacher_episode_and_is_played_again_while_retries_last() -> None:
    env = GradedEnv(calls=2, fail_at=2)
    eps = episodes(TurnTeachers({"a": True}), env, retries=1)
    assert await eps.traces([(Prompt("p0", "q"), 5)]) == []
    assert eps.failed == 1 and env.seeds == [("p0", 5)] * 2  # played again from its start, same seed


async def test_no_teacher_episodes_when_the_loss_does_not_weight_channel_3() -> None:
    from composer_mesh.orchestration.rollout.base import RolloutServices
    from composer_mesh.orchestration.rollout.multi_turn import MultiTurnConfig, MultiTurnRollout
    from composer_mesh.orchestration.scoring import Scoring, ScoringConfig

    cfg = ScoringConfig(seed=3, max_new_tokens=2, teacher_top_k="auto", distributions=True, traces=False)
    services = RolloutServices(TurnGenerators(), Scoring(cfg, None, TurnTeachers({"a": True})),  # type: ignore[arg-type]
                               asyncio.ensure_future, print)
    assert MultiTurnRollout(MultiTurnConfig.of(run()), services, GradedEnv()).replay is None  # type: ignore[arg-type]


class EchoTeachers:
    """`ports.Teachers` with one replay member that answers every turn; notes each request's size."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def signals(self, request: TeacherRequest) -> list[TeacherSignals]:
        self.sizes.append(len(request.prompts))
        await asyncio.sleep(0.01)
        return [TeacherSignals(traces=[TeacherTrace("a", p.prompt_id, "", [1], prompt_ids=[1]) for p in request.prompts])]


async def request_sizes(linger_s: float) -> list[int]:
    """Four teacher episodes of two turns whose tools answer after 0, 20, 40 and 60 ms: the sizes of the requests.
    Without a linger, episode i's tool answers only once episode i-1 is over (20 ms apart is no order on a
    loaded machine, where two turns can come in the same loop turn and share a request)."""
    teachers = EchoTeachers()
    turns = TeacherTurns(teachers, 2, asyncio.ensure_future, linger_s=linger_s)  # type: ignore[arg-type]
    over = [asyncio.Event() for _ in range(4)]

    async def episode(i: int) -> None:
        async with turns.playing():
            assert "a" in await turns.sample("a", Prompt(f"p{i}", "q"), seed=i)
            await (over[i - 1].wait() if i and not linger_s else asyncio.sleep(0.02 * i))
            assert "a" in await turns.sample("a", Prompt(f"p{i}", "q"), seed=100 + i)
        over[i].set()

    await asyncio.gather(*(episode(i) for i in range(4)))
    return teachers.sizes


async def test_a_teacher_request_lingers_for_the_turns_of_every_playing_episode() -> None:
    """Teacher turns coming back from their tools a few at a time go out as one request when it lingers (as the
    generators' turns do), and one request each when it does not."""
    assert await request_sizes(linger_s=5.0) == [4, 4]
    assert await request_sizes(linger_s=0.0) == [4, 1, 1, 1, 1]


class MessageTeachers:
    """`ports.Teachers` of one replay member that plays at the message level, as a hosted teacher does: each turn
    answers with a message (a call until the conversation holds a tool result, then the answer "done") and the
    turn in "student ids" (one id per message of the conversation: an assistant turn's is 77, as the turn's own). `drift_at`: the turn whose
    ids re-render the conversation (they do not extend the earlier turns' ids)."""

    def __init__(self, drift_at: int | None = None) -> None:
        self.drift_at = drift_at
        self.asked: list[Prompt] = []

    async def signals(self, request: TeacherRequest) -> list[TeacherSignals]:
        self.asked += request.prompts
        return [TeacherSignals(traces=[self._trace(p) for p in request.prompts])]

    def _trace(self, p: Prompt) -> TeacherTrace:
        messages = p.messages or []
        k = sum(m["role"] == "assistant" for m in messages)
        call = {"id": f"c{k}", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        message = ({"role": "assistant", "content": "done"} if k == 2 else
                   {"role": "assistant", "content": "", "tool_calls": [call]})
        ids = [77 if m["role"] == "assistant" else len(str(m["content"])) + 50 * (k == self.drift_at) for m in messages]
        return TeacherTrace("hosted", p.prompt_id, "", [77], prompt_ids=ids, message=message,
                            usage={"prompt_tokens": 10.0, "completion_tokens": 2.0, "cost": 0.25})


class ToolSessionEnv:
    """Counting's sessions (two tool turns, then the answer) whose tool messages are named, as a toolbox's are."""

    name = "tools"

    def __init__(self) -> None:
        self.sessions: list[Counting] = []

    def session(self, prompt: Prompt, seed: int) -> Counting:
        self.sessions.append(Counting(calls=2))
        return self.sessions[-1]


async def test_a_message_level_teacher_plays_with_the_conversation_as_messages_and_its_tool_results_answer_its_calls(
        ) -> None:
    teachers, env = MessageTeachers(), ToolSessionEnv()
    eps = episodes(teachers, env)  # type: ignore[arg-type]
    [trace] = await eps.traces([(Prompt("p0", "q"), 5)])
    # the session read the teacher's calls as a policy's Hermes text, its answer as the final turn
    assert env.sessions[0].steps == ['<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'] * 2 + ["done"]
    last = teachers.asked[-1].messages or []
    assert [m["role"] for m in last] == ["user", "assistant", "tool", "assistant", "tool"]
    assert [m.get("tool_call_id") for m in last if m["role"] == "tool"] == ["c0", "c1"]  # each answers its call
    assert teachers.asked[-1].tools == [{"type": "function"}] and teachers.asked[-1].token_ids == []
    assert [t.policy for t in trace.turns or []] == [True, False, True, False, True] and trace.reward == 1.0
    assert trace.usage == {"prompt_tokens": 30.0, "completion_tokens": 6.0, "cost": 0.75}  # three turns' usage
    assert eps.counters()["teacher_episodes/played"] == 1.0 and not eps.cannot_play


async def test_a_turn_that_does_not_extend_the_conversations_ids_drops_the_episode_and_is_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    eps = episodes(MessageTeachers(drift_at=1), ToolSessionEnv())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="composer_mesh"):
        assert await eps.traces([(Prompt("p0", "q"), 5), (Prompt("p1", "q"), 6)]) == []
    assert eps.counters()["teacher_episodes/misaligned/hosted"] == 2.0 and eps.skipped == 0
    assert len([r for r in caplog.records if "does not extend" in r.getMessage()]) == 1  # warned about once
