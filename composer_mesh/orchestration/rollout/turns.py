"""Turns waiting for a generator: any free generator takes every waiting turn as one request.

Why a queue shared by the generators rather than an episode pinned to one: episodes wait on tools between
turns, so the generator that sampled turn k is rarely the one free for turn k+1; and a generator with several
turns waiting samples them as one batch, which is what makes CPU and GPU generation fast. Each turn keeps its
own seed (`GenerationRequest.seeds`), so which turns share a request, and which generator runs it, changes no
token (the samplers make a row a function of its seed).

Why a taker lingers: the turns of a round of episodes come back from their tools a few at a time (a thread hop
each, even for an instant tool), and a free generator that took the first one alone would run a one-row request
while the rest queue behind it: requests alternate between 1 row and the rest, and the decode steps double.
So `take` waits, at most `linger_s`, until every episode that could put a turn soon has put it (the episodes
playing minus the turns already being sampled), or until it has its share of them: with `takers` generators a
request holds at most ceil(playing / takers) turns, so a round is split evenly instead of one generator taking
it all while the others idle. With instant tools the wait is a millisecond; with slow tools it costs at most
`linger_s` per request.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from composer_mesh.actors.messages import GenerationRequest, Prompt, Rollout, RolloutGroup


@dataclass
class TurnRequest:
    """One policy turn to sample: the conversation so far as `prompt`, its seed, and the step it works for;
    `max_new_tokens` a cap of its own below the run's (an OpenAI client's `max_tokens`; None: the run's)."""

    prompt: Prompt
    seed: int
    step: int
    max_new_tokens: int | None = None
    result: asyncio.Future[Rollout] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass(frozen=True)
class TurnSampling:
    """What every turn request carries besides its prompts: per-turn token cap and temperature."""

    max_new_tokens: int
    temperature: float

    def request(self, turns: list[TurnRequest]) -> GenerationRequest:
        return GenerationRequest(prompts=[t.prompt for t in turns], samples_per_prompt=1,
                                 max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                 seeds=[t.seed for t in turns])


class PlayingEpisodes:
    """The episodes playing, counted under the condition a lingering request waits on: what it waits for is every
    playing episode's turn (less those it need not wait for)."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._playing = 0  # episodes between their start and their end (`playing`)

    @asynccontextmanager
    async def playing(self) -> AsyncIterator[None]:
        """Counts an episode as one that may put turns (what a lingering request waits for) while it plays."""
        async with self._changed:
            self._playing += 1
        try:
            yield
        finally:
            async with self._changed:
                self._playing -= 1
                self._changed.notify_all()


class TurnQueue(PlayingEpisodes):
    """Episodes put turns in (`sample` waits for the turn's rollout); generators take them out in batches."""

    def __init__(self, linger_s: float = 0.0, takers: int = 1) -> None:
        super().__init__()
        self.linger_s, self.takers = linger_s, max(1, takers)
        self._waiting: deque[TurnRequest] = deque()
        self._in_service = 0  # turns taken by a generator and not yet delivered (`finished`)

    async def sample(self, prompt: Prompt, seed: int, step: int, max_new_tokens: int | None = None) -> Rollout:
        """The turn sampled by whichever generator takes it next."""
        turn = TurnRequest(prompt, seed, step, max_new_tokens)
        async with self._changed:
            self._waiting.append(turn)
            self._changed.notify_all()
        return await turn.result

    async def take(self, limit: int) -> list[TurnRequest]:
        """At least one and up to `limit` waiting turns, oldest first: waits for one, then lingers (module
        docstring). A cancelled episode's turn is skipped. The caller reports the taken turns back with
        `finished`. Another taker may take the turns while this one lingers (the lock is released while it
        waits): then it waits for the next turn, rather than answer with an empty request."""
        async with self._changed:
            while True:
                await self._changed.wait_for(lambda: self._live() > 0)
                out = await self._linger_and_pop(min(limit, self._share()))
                if out:
                    self._in_service += len(out)
                    return out

    async def _linger_and_pop(self, limit: int) -> list[TurnRequest]:
        """Wait (holding the condition; at most `linger_s`) for the turns a round may still bring, then pop."""
        try:
            async with asyncio.timeout(self.linger_s):
                await self._changed.wait_for(lambda: self._live() >= min(limit, self._expected()))
        except TimeoutError:
            pass
        out: list[TurnRequest] = []
        while self._waiting and len(out) < limit:
            turn = self._waiting.popleft()
            if not turn.result.done():
                out.append(turn)
        return out

    async def finished(self, turns: list[TurnRequest]) -> None:
        """`turns` (from `take`) were delivered or failed: they no longer count as being sampled."""
        async with self._changed:
            self._in_service -= len(turns)
            self._changed.notify_all()

    @asynccontextmanager
    async def serving(self, turns: list[TurnRequest]) -> AsyncIterator[None]:
        """Around the request that samples `turns` (from `take`): if it fails their episodes see the error
        (`fail`), and either way the turns stop counting as being sampled (`finished`), so every take is paired
        with its release in one place."""
        try:
            yield
        except BaseException as e:
            fail(turns, e)
            raise
        finally:
            await self.finished(turns)

    def _live(self) -> int:
        return sum(1 for t in self._waiting if not t.result.done())

    def _expected(self) -> int:
        """Turns a taker may wait for: every playing episode not waiting on a generator already."""
        return max(1, self._playing - self._in_service)

    def _share(self) -> int:
        """One taker's share of a round: the playing episodes split evenly over the takers."""
        return max(1, -(-self._playing // self.takers))

    def __len__(self) -> int:
        return len(self._waiting)


def deliver(turns: list[TurnRequest], groups: list[RolloutGroup]) -> None:
    """Each turn's sampled rollout to the episode waiting for it (one that gave up on it is skipped)."""
    for t, g in zip(turns, groups, strict=True):
        if not t.result.done():
            t.result.set_result(g.rollouts[0])


def fail(turns: list[TurnRequest], error: BaseException) -> None:
    """The request failed: its episodes see the error (or are cancelled with the run)."""
    for t in turns:
        if not t.result.done():
            if isinstance(error, asyncio.CancelledError):
                t.result.cancel()
            else:
                t.result.set_exception(error)


class IdleClock(Protocol):
    def add_idle(self, seconds: float) -> None: ...


async def next_turns(queue: TurnQueue, limit: int, idle: IdleClock) -> list[TurnRequest]:
    """A generator's next waiting turns (at most `limit`); the wait counts as its idle time: no turn to sample
    meanwhile (none admitted, or every episode on its environment or agent)."""
    t0 = time.perf_counter()
    try:
        return await queue.take(limit)
    finally:
        idle.add_idle(time.perf_counter() - t0)
