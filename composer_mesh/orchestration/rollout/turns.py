"""Turns waiting for a generator: any free generator takes every waiting turn as one request.

Why a queue shared by the generators rather than an episode pinned to one: episodes wait on tools between
turns, so the generator that sampled turn k is rarely the one free for turn k+1; and a generator with several
turns waiting samples them as one batch, which is what makes CPU and GPU generation fast. Each turn keeps its
own seed (`GenerationRequest.seeds`), so which turns share a request, and which generator runs it, changes no
token (the samplers make a row a function of its seed).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from composer_mesh.actors.messages import GenerationRequest, Prompt, Rollout, RolloutGroup


@dataclass
class TurnRequest:
    """One policy turn to sample: the conversation so far as `prompt`, its seed, and the step it works for."""

    prompt: Prompt
    seed: int
    step: int
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


class TurnQueue:
    """Episodes put turns in (`sample` waits for the turn's rollout); generators take them out in batches."""

    def __init__(self) -> None:
        self._waiting: deque[TurnRequest] = deque()
        self._changed = asyncio.Condition()

    async def sample(self, prompt: Prompt, seed: int, step: int) -> Rollout:
        """The turn sampled by whichever generator takes it next."""
        turn = TurnRequest(prompt, seed, step)
        async with self._changed:
            self._waiting.append(turn)
            self._changed.notify()
        return await turn.result

    async def take(self, limit: int) -> list[TurnRequest]:
        """Up to `limit` waiting turns, oldest first (waits for one). A cancelled episode's turn is skipped."""
        async with self._changed:
            await self._changed.wait_for(lambda: any(not t.result.done() for t in self._waiting))
            out: list[TurnRequest] = []
            while self._waiting and len(out) < limit:
                turn = self._waiting.popleft()
                if not turn.result.done():
                    out.append(turn)
            return out

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
