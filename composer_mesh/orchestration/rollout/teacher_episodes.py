"""Channel 3 on episodes: each replay teacher plays the group's task itself, with the same environment seed.

Why a whole episode and not a trace of the opening prompt: an episode's reward comes from the environment, turn by
turn, so a teacher shows what to do only by playing, its tool calls answered by the same environment the student
met. The replay pair is (the teacher's episode, the group's worst student episode); only the teacher's own tokens
are trained on (`TeacherTrace.turns` / `loss_mask`), and a trace is paired only when its reward beats the worst.

How. For a finished group (its prompt and its first episode's seed), each replay teacher plays one episode with
`play_episode` in a fresh environment session made from (prompt, seed), i.e. the task the student's first episode
got. Its turns are sampled by that teacher token in, token out: a turn is one prompt of a `TeacherRequest` with the
conversation's exact ids (`Prompt.token_ids` + `bridge_messages`, rendered by the teacher as the generators do),
the turn's seed (the student's scheme: seed + k·`TURN_SEED_STRIDE`) and the teacher's name (`teachers`). The
teacher's trace carries the ids it continued from (`TeacherTrace.prompt_ids`), which place its tokens in the
conversation exactly as a generator's `Rollout.prompt_ids` do (`EpisodeTokens.add`). Teacher turns of concurrent
episodes wait in `TeacherTurns`, which sends every waiting turn of a teacher as one request (like
`turns.TurnQueue` does for generators); the per-turn seeds make that batching change no token.

Hosted teachers (OpenRouter) play at the message level: their turns are asked as the conversation in chat messages
with the tools, and answered with a chat message (`TeacherTrace.message`: content, `tool_calls`), which the session
gets as the text a policy writes (`message_turns.action_text`); the environment's tool results go back as tool
messages answering the calls' ids. The binding renders each turn in the student's tokens with its chat template
(`prompt_ids`: the conversation, `completion_ids`: the turn), so the episode is a trace like any other; turns that
do not extend the conversation's ids as a prefix chain drop the episode, counted (`misaligned/<teacher>`), never
trained on misaligned ids; so does an environment that rewrites the conversation (`StepResult.rewrite`): a trace
is one prefix chain.

Which teachers play. The driver does not know the pool's members: the first teacher turn is asked of every replay
teacher (`teachers: None`), and the answers name them. A teacher whose trace has `prompt_ids` continues the
student's ids (a local teacher with the student's tokenizer) and plays token in, token out; one whose trace has a
`message` plays at the message level; one with neither (a local teacher with another tokenizer) cannot play: it is
warned about once and counted (`unplayable`) for every group it sits out. Until some teacher has answered, each
group's first turn asks them all; after that only the teachers that can play are asked (a teacher unavailable at
that first answer is not learnt). Each episode's trace carries its turns' summed `usage` (tokens; USD `cost` as
a hosted teacher's provider reports it), which the step's metrics show per teacher (`episode_metrics`).

Failures follow the student's rules: an environment error ends that episode (played again from its start while
`environment_retries` last; one that still fails gives no trace); a teacher unavailable with `on_failure: skip`
ends its episode without a trace (`skipped`); a teacher's `TeacherFailed` (`on_failure: stop`), a binding's bug or
a local teacher's token drift propagates and the run stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from composer_mesh.actors.messages import Prompt, Rollout, TeacherRequest, TeacherTrace
from composer_mesh.orchestration.ports import Teachers
from composer_mesh.orchestration.rollout.episode import Episode, TurnSampler
from composer_mesh.orchestration.rollout.message_turns import action_text, answered_calls, with_call_ids
from composer_mesh.orchestration.rollout.turns import PlayingEpisodes
from composer_mesh.orchestration.schedule import StepTimes

log = logging.getLogger("composer_mesh.rollout")

Spawn = Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]
PlaySession = Callable[[Prompt, int, TurnSampler], Awaitable[Episode]]  # (task, seed, sampler) -> the episode


@dataclass
class TeacherTurn:
    """One teacher turn to sample: the conversation so far as `prompt`, its seed, and the step whose time it is."""

    prompt: Prompt
    seed: int
    times: StepTimes | None
    result: asyncio.Future[dict[str, TeacherTrace]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class TeacherTurns(PlayingEpisodes):
    """Teacher turns of concurrent episodes, batched: one request per teacher at a time (key None: every replay
    teacher), carrying every turn waiting for it. A turn's answer is each answering teacher's trace by name.

    Why a request lingers (as `turns.TurnQueue` does for generators): the turns of a round of teacher episodes come
    back from their tools a few at a time, and a request sent with the first one alone would leave the rest to
    queue behind it. So a request waits, at most `linger_s`, until every teacher episode that could put a turn
    soon has put one: those playing, minus those whose turn is being sampled or waits for another key."""

    def __init__(self, teachers: Teachers, max_new_tokens: int, spawn: Spawn, linger_s: float = 0.0) -> None:
        super().__init__()
        self.teachers, self.max_new_tokens, self.spawn, self.linger_s = teachers, max_new_tokens, spawn, linger_s
        self._waiting: dict[str | None, list[TeacherTurn]] = {}
        self._serving: dict[str | None, asyncio.Task[Any]] = {}
        self._in_service = 0  # turns in a request not yet answered
        self.requests: list[int] = []  # turns per request sent (what batching achieved)

    async def sample(self, teacher: str | None, prompt: Prompt, seed: int,
                     times: StepTimes | None = None) -> dict[str, TeacherTrace]:
        """The turn's traces by teacher (`teacher` None: every replay teacher's; a skipped one is absent)."""
        turn = TeacherTurn(prompt, seed, times)
        async with self._changed:
            self._waiting.setdefault(teacher, []).append(turn)
            self._changed.notify_all()
        if teacher not in self._serving:
            self._serving[teacher] = self.spawn(self._serve(teacher))
        return await turn.result

    async def _serve(self, key: str | None) -> None:
        """Ask `key` for every waiting turn (after lingering), again while turns came in meanwhile; then end (the
        next turn starts another). No await between finding nothing and leaving `_serving`: no turn is left
        unserved."""
        try:
            while True:
                turns = await self._take(key)
                if not turns:
                    return
                try:
                    await self._ask(key, turns)
                finally:
                    async with self._changed:
                        self._in_service -= len(turns)
                        self._changed.notify_all()
        finally:
            del self._serving[key]

    async def _take(self, key: str | None) -> list[TeacherTurn]:
        """Every live turn waiting for `key`, once the episodes that could add one soon have (at most `linger_s`)."""
        await asyncio.sleep(0)  # episodes resumed by the same event put their turns in first
        async with self._changed:
            if self.linger_s > 0 and self._live(key):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.linger_s):
                        await self._changed.wait_for(lambda: self._live(key) >= self._expected(key))
            turns = [t for t in self._waiting.pop(key, []) if not t.result.done()]
            self._in_service += len(turns)
            return turns

    def _live(self, key: str | None) -> int:
        return sum(1 for t in self._waiting.get(key, []) if not t.result.done())

    def _expected(self, key: str | None) -> int:
        """Turns `key`'s request may wait for: every playing episode not being sampled nor waiting for another key."""
        elsewhere = sum(self._live(k) for k in self._waiting if k != key)
        return max(1, self._playing - self._in_service - elsewhere)

    async def _ask(self, key: str | None, turns: list[TeacherTurn]) -> None:
        # Tagged prompt ids: the pool's traces are a flat list (a member may drop one), not aligned with prompts.
        tagged = [replace(t.prompt, prompt_id=f"{t.prompt.prompt_id}#{i}") for i, t in enumerate(turns)]
        request = TeacherRequest(prompts=tagged, max_new_tokens=self.max_new_tokens, seeds=[t.seed for t in turns],
                                 teachers=None if key is None else [key])
        self.requests.append(len(turns))
        t0 = time.perf_counter()
        try:
            answers = await self.teachers.signals(request)
        except asyncio.CancelledError:
            for t in turns:
                t.result.cancel()
            raise
        except Exception as e:  # the episodes see it (a stop or a bug ends the run through them)
            for t in turns:
                if not t.result.done():
                    t.result.set_exception(e)
            return
        share = (time.perf_counter() - t0) / len(turns)
        by_tag: dict[str, dict[str, TeacherTrace]] = {p.prompt_id: {} for p in tagged}
        for trace in (t for a in answers for t in a.traces):
            got = by_tag.get(trace.prompt_id)
            if got is not None:
                got[trace.teacher] = trace
        for t, p in zip(turns, tagged):
            if t.times is not None:
                t.times.teacher_s += share
            if not t.result.done():
                t.result.set_result({n: replace(tr, prompt_id=t.prompt.prompt_id) for n, tr in by_tag[p.prompt_id].items()})


class _EpisodeEnds(BaseException):
    """Ends a teacher episode from inside its sampler, past `play_episode`'s handling of environment failures (a
    teacher's error is not the environment's): `cause` None = the teacher gave no turn (skipped, or `misaligned`:
    its turn is not a continuation of the conversation's ids), else raised."""

    def __init__(self, cause: BaseException | None, misaligned: bool = False) -> None:
        super().__init__(cause)
        self.cause, self.misaligned = cause, misaligned


class _TeacherSampler:
    """A teacher episode's `TurnSampler`: its turns asked of `teacher`. `teacher` None: the first turn is asked of
    every replay teacher; the answers tell `owner` who they are, and the episode goes on as the first that plays.
    A teacher that answers with messages plays at the message level: the sampler keeps the conversation as chat
    messages (`chat`) and asks each later turn with it instead of the turn's token ids."""

    def __init__(self, owner: TeacherEpisodes, teacher: str | None, times: StepTimes | None) -> None:
        self.owner, self.teacher, self.times = owner, teacher, times
        self.usage: Counter[str] = Counter()  # the episode's turns' usage, its attempts included
        self.restart()

    def restart(self) -> None:
        """A new attempt at the episode (after an environment error): the conversation starts again."""
        self.chat: list[dict[str, Any]] | None = None  # message level: the conversation, as the teacher's API has it
        self.tools: list[dict[str, Any]] | None = None
        self.calls: list[str] = []  # the ids of the last turn's calls that tool results answer
        self.sent: list[int] = []  # message level: the conversation's student ids so far

    async def __call__(self, prompt: Prompt, seed: int) -> Rollout:
        ask = prompt
        if self.chat is not None and prompt.bridge_messages is not None:
            ask = Prompt(prompt.prompt_id, "", answer=prompt.answer, extra=prompt.extra, tools=self.tools,
                         messages=[*self.chat, *with_call_ids(prompt.bridge_messages, self.calls)])
        try:
            answers = await self.owner.turns.sample(self.teacher, ask, seed, self.times)
        except Exception as e:
            raise _EpisodeEnds(e) from e
        if self.teacher is None:
            self.teacher = self.owner.learn(answers)
        trace = answers.get(self.teacher) if self.teacher is not None else None
        if trace is None:
            raise _EpisodeEnds(None)
        self.usage.update(trace.usage)
        if trace.message is not None:
            return self._message_turn(ask, trace)
        if not trace.prompt_ids:
            raise _EpisodeEnds(None)
        return _turn(ask, trace, trace.text)

    def _message_turn(self, ask: Prompt, trace: TeacherTrace) -> Rollout:
        """A turn played at the message level: the conversation goes on with the teacher's message; the turn is
        the text the environment parses, in the student's ids the binding rendered, checked to extend the ids of
        the conversation so far (else the episode ends as `misaligned`)."""
        assert trace.message is not None
        if not trace.prompt_ids or trace.prompt_ids[: len(self.sent)] != self.sent:
            raise _EpisodeEnds(None, misaligned=True)
        self.chat, self.tools = [*(ask.messages or []), trace.message], ask.tools
        self.calls = answered_calls(trace.message)
        self.sent = [*trace.prompt_ids, *trace.completion_ids]
        return _turn(ask, trace, action_text(trace.message))


def _turn(prompt: Prompt, trace: TeacherTrace, text: str) -> Rollout:
    """A teacher's turn as `play_episode` takes a sampled one (no log-probs: a teacher's tokens are not scored)."""
    n = len(trace.completion_ids)
    return Rollout(prompt.prompt_id, list(trace.prompt_ids), list(trace.completion_ids), [0.0] * n,
                   weight_version=0, text=text, finish_reason="stop", generator=trace.teacher)


class TeacherEpisodes:
    """Replay episodes: every replay teacher that can play plays each group's task once (see the module doc)."""

    def __init__(self, turns: TeacherTurns, play: PlaySession, retries: int) -> None:
        self.turns, self.play, self.retries = turns, play, retries
        self.names: list[str] | None = None  # the replay teachers that play, once some teacher has answered
        self.cannot_play: set[str] = set()  # replay teachers without prompt ids (warned about once)
        self.unplayable: Counter[str] = Counter()  # groups each of them sat out
        self.played = 0  # episodes that gave a trace
        self.failed = 0  # episodes whose environment still failed after the retries
        self.skipped = 0  # episodes ended by an unavailable teacher (on_failure: skip)
        self.misaligned: Counter[str] = Counter()  # message-level episodes dropped: turns not a prefix chain

    async def traces(self, groups: list[tuple[Prompt, int]], times: StepTimes | None = None,
                     slots: asyncio.Semaphore | None = None) -> list[TeacherTrace]:
        """One trace per group and playing teacher, groups in order, teachers by name. `groups`: each group's prompt
        and its first episode's seed; `slots`: the driver's episodes in flight (teacher episodes take them too)."""
        found = await asyncio.gather(*(self._group(p, seed, times, slots) for p, seed in groups))
        return [t for ts in found for t in ts]

    def learn(self, answers: dict[str, TeacherTrace]) -> str | None:
        """The replay teachers from a first turn asked of them all; the first (by name) that can play, or None."""
        playable = sorted(n for n, t in answers.items() if t.prompt_ids or t.message is not None)
        for name in sorted(set(answers) - set(playable) - self.cannot_play):
            self.cannot_play.add(name)
            log.warning("teacher %r cannot play episodes (its traces have no prompt ids and no message: it neither "
                        "continues the student's token ids, e.g. a local teacher with another tokenizer, nor plays "
                        "at the message level as a hosted one); it gives no channel-3 episodes", name)
        if answers and self.names is None:
            self.names = playable
            log.info("replay teachers playing episodes: %s", playable or "none")
        return playable[0] if playable else None

    def counters(self) -> dict[str, float]:
        """The run's counts of teacher episodes, for its metrics."""
        out = {"teacher_episodes/played": float(self.played), "teacher_episodes/failed": float(self.failed),
               "teacher_episodes/skipped": float(self.skipped)}
        out.update({f"teacher_episodes/unplayable/{n}": float(c) for n, c in sorted(self.unplayable.items())})
        out.update({f"teacher_episodes/misaligned/{n}": float(c) for n, c in sorted(self.misaligned.items())})
        return out

    async def _group(self, prompt: Prompt, seed: int, times: StepTimes | None,
                     slots: asyncio.Semaphore | None) -> list[TeacherTrace]:
        out: list[TeacherTrace | None] = []
        if self.names is None:  # not learnt yet: this group's first turn asks every replay teacher
            lead = _TeacherSampler(self, None, times)
            out.append(await self._episode(prompt, seed, lead, slots))
            if self.names is None:
                return [t for t in out if t is not None]
            rest = [n for n in self.names if n != lead.teacher]
        else:
            rest = list(self.names)
        for name in self.cannot_play:
            self.unplayable[name] += 1
        out += await asyncio.gather(*(self._episode(prompt, seed, _TeacherSampler(self, n, times), slots)
                                      for n in rest))
        return sorted((t for t in out if t is not None), key=lambda t: t.teacher)

    async def _episode(self, prompt: Prompt, seed: int, sampler: _TeacherSampler,
                       slots: asyncio.Semaphore | None) -> TeacherTrace | None:
        """One teacher episode (played again, same seed, while its environment fails and retries last)."""
        async with slots if slots is not None else contextlib.nullcontext():
            for attempt in range(self.retries + 1):
                sampler.restart()
                try:
                    async with self.turns.playing():
                        episode = await self.play(prompt, seed, sampler)
                except _EpisodeEnds as e:
                    if e.cause is not None:
                        raise e.cause from None
                    if e.misaligned:
                        self._misaligned(prompt, sampler)
                    else:
                        self.skipped += 1
                    return None
                if episode.rollout.status != "error_environment":
                    break
                if attempt < self.retries:
                    log.warning("teacher episode %s (%s): playing it again (%d of %d)", prompt.prompt_id,
                                sampler.teacher, attempt + 1, self.retries)
        if episode.rollout.status == "error_environment" or sampler.teacher is None:
            self.failed += 1
            return None
        if episode.earlier:  # the environment rewrote the conversation: no one prefix chain to replay
            self._misaligned(prompt, sampler)
            return None
        self.played += 1
        r = episode.rollout
        return TeacherTrace(sampler.teacher, prompt.prompt_id, r.text, list(r.completion_ids),
                            reward=episode.reward_result().score, turns=list(r.turns or []),
                            prompt_ids=list(r.prompt_ids), usage=dict(sampler.usage))

    def _misaligned(self, prompt: Prompt, sampler: _TeacherSampler) -> None:
        name = sampler.teacher or "?"
        if not self.misaligned[name]:
            log.warning("teacher episode %s (%s): a turn in the student's tokens does not extend the conversation's "
                        "ids (the student's chat template re-renders earlier turns or cannot write the turn); "
                        "dropped, as are later such episodes (counted: teacher_episodes/misaligned/%s)",
                        prompt.prompt_id, name, name)
        self.misaligned[name] += 1
