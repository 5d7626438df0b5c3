"""The rollout seam: the step's unit of work behind one protocol.

The loop starts one `RolloutDriver.drive(index, chunks)` task per generator and knows nothing of what happens
inside: a driver takes chunks of admitted prompts from the scheduler (`ChunkSource`), makes finished groups of
them (generated, scored, with their teacher signals) and hands them back with `chunks.finish`. What it may use
is `RolloutServices`: the generators one request at a time, scoring (rewarder and teachers), the run's
background tasks and its stop. Which driver runs is `RLLoop(rollout=...)`, a factory of services -> driver.

A driver must keep the scheduler's determinism contract: a chunk's rows sample with the seeds `row_seed` gives
their stream index (so which generator takes a chunk, and when, changes nothing), and a chunk whose work was
lost (a proc death, a resume) is done again from its prompts alone.

Another kind of driver is a module beside `single_turn.py` and `multi_turn.py` (the episode driver: its
generators take every waiting turn of the episodes in flight as one request, the environment answers between
turns, and each turn's weight version is recorded so the lag counts from the oldest; docs/agentic.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from composer_mesh.actors.messages import Prompt, ScoredGroup
from composer_mesh.orchestration.ports import Generators
from composer_mesh.orchestration.schedule import Chunk, GroupResult, StepTimes
from composer_mesh.orchestration.scoring import Scoring


class ChunkSource(Protocol):
    """What a driver needs of the scheduler (`schedule.StepScheduler`)."""

    async def next_chunk(self, counts_idle: bool = True) -> Chunk:
        """The next chunk of the oldest admitted step (waits while the lag bound admits nothing). The wait counts
        as generator idle time unless `counts_idle` is false: a caller that is not a generator waiting for work
        (the episode driver's intake) says so, and its driver reports its generators' idle time itself."""
        ...

    def add_idle(self, seconds: float) -> None:
        """A generator had nothing to sample for `seconds` (the step records' `generator_idle_s`)."""
        ...

    async def finish(self, chunk: Chunk, results: list[GroupResult]) -> None:
        """`chunk`'s groups, one `GroupResult` per prompt, scored and with their teacher signals."""
        ...

    def times(self, step: int) -> StepTimes:
        """Where step `step`'s work time goes (add generate/score/teacher seconds here)."""
        ...


@dataclass(frozen=True)
class RolloutServices:
    """What the loop lends a driver. `spawn` starts a background task of the run (its failure fails the run);
    `stop(reason)` ends the run at the next checkpointable step (e.g. on `RestartsExhausted`)."""

    generators: Generators
    scoring: Scoring
    spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]
    stop: Callable[[str], None]


class RolloutDriver(Protocol):
    async def drive(self, index: int, chunks: ChunkSource) -> None:
        """Generator `index`'s share of the run: take chunks and finish them, until the run cancels it."""
        ...

    async def evaluate(self, prompts: list[Prompt], samples: int, temperature: float,
                       seed: int) -> tuple[int, list[ScoredGroup]]:
        """`samples` rollouts of each held-out prompt on generator 0 at `temperature` (0: greedy), scored, and
        the weight version they were sampled with (the `Evaluator` asks; nothing here is trained on)."""
        ...

    def counters(self) -> dict[str, float]:
        """The driver's run-wide counters for each step's record (e.g. teacher episodes played); may be empty."""
        ...


RolloutFactory = Callable[[RolloutServices], RolloutDriver]
