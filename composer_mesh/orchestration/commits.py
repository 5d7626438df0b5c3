"""Checkpoint commits: a checkpoint of step s is committed only once every part of it is written.

Taking a checkpoint (right behind step s, before step s+1 is sent) asks each trainer replica to copy its state
in the background and captures the controller's state at once; a background task then writes the controller's
part, waits until every replica reported its part written and the step's record is in metrics.jsonl, and
commits, after every earlier checkpoint of this session: a commit deletes the older steps that are not
committed (half written by a stopped session), and one still being written here must not be taken for one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from composer_mesh.orchestration.background import Background
from composer_mesh.orchestration.checkpoint import CheckpointStore, ControllerState
from composer_mesh.orchestration.metrics import MetricsWriter
from composer_mesh.orchestration.ports import Trainers


@dataclass
class PendingCheckpoint:
    """A checkpoint on its way: committed once every trainer reported its state written and the step's record
    is written."""

    step: int
    urls: set[str]
    written: set[str] = field(default_factory=set)
    trainers: asyncio.Event = field(default_factory=asyncio.Event)
    recorded: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class CheckpointCommits:
    """The run's checkpoints in flight, committed in step order into `store` (keeping the newest `keep`)."""

    def __init__(self, store: CheckpointStore, keep: int, trainers: Trainers, background: Background) -> None:
        self.store = store
        self.keep = keep
        self.trainers = trainers
        self.background = background
        self.pending: dict[int, PendingCheckpoint] = {}  # checkpoints taken and not committed yet
        self.recorded_through = 0  # the last step whose record is written
        self.last: str | None = None  # the newest committed checkpoint's URL

    def take(self, state: ControllerState, writer: MetricsWriter) -> None:
        """Checkpoint step `state.step` (just sent to the trainers): each replica is asked to copy its state
        right behind the step, and a background task writes, waits for every part, and commits."""
        step = state.step
        urls = [self.store.trainer_url(step, i) for i in range(len(self.trainers))]
        saves = self.trainers.save_state(step, urls)  # before step+1
        pending = PendingCheckpoint(step, set(urls))
        if self.recorded_through >= step:
            pending.recorded.set()
        self.pending[step] = pending
        pending.task = self.background.spawn(self._commit(pending, saves, state, writer))

    async def _commit(self, pending: PendingCheckpoint, saves: list[Any], state: ControllerState,
                      writer: MetricsWriter) -> None:
        earlier = [p.task for s, p in self.pending.items() if s < pending.step and p.task is not None]
        await asyncio.gather(*saves)
        await asyncio.to_thread(self.store.write_controller, state)
        await pending.trainers.wait()
        await pending.recorded.wait()
        await asyncio.gather(*earlier)
        url = await asyncio.to_thread(self.store.commit, pending.step, self.keep)
        self.pending.pop(pending.step, None)
        self.last = url
        writer.write_event("checkpoint", step=pending.step, url=url, weight_version=state.weight_version)

    def wrote(self, urls: list[str]) -> None:
        """The trainers reported these state writes finished."""
        self.trainers.reported(urls)
        for pending in self.pending.values():
            pending.written.update(u for u in urls if u in pending.urls)
            if pending.written == pending.urls:
                pending.trainers.set()

    def recorded(self, step: int) -> None:
        """Step `step`'s record is written (or, on resume, was)."""
        self.recorded_through = step
        if step in self.pending:
            self.pending[step].recorded.set()

    def resumed(self, step: int, url: str) -> None:
        """The run continues from the committed checkpoint of `step` at `url`."""
        self.recorded(step)
        self.last = url

    async def salvage(self, before: int) -> None:
        """Step `before` was refused by a live trainer: commit the checkpoints of the steps before it (each
        replica copied their state before that step ran; `flush_states` waits for their writes). Later
        checkpoints stay uncommitted: they would claim a step that was not trained."""
        earlier = [p.task for step, p in sorted(self.pending.items()) if step < before and p.task is not None]
        if not earlier:
            return
        for written in await self.trainers.each("flush_states"):
            self.wrote(written)
        await asyncio.gather(*earlier)

    async def finish(self) -> None:
        """Wait for the trainers' background writes and every commit (a failure fails the run)."""
        if not self.pending:
            return
        for written in await self.background.until(self.trainers.each("flush_states")):
            self.wrote(written)
        for pending in list(self.pending.values()):
            assert pending.task is not None
            await self.background.until(pending.task)
