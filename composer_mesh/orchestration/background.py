"""How a run's concurrent work ends: background tasks whose failure fails the run, and a requested stop.

Every component that starts work of its own (a generator's work loop, a chunk's scoring, a step's training and
weight sync, a checkpoint commit, a warm spare) starts it with `Background.spawn`, and every wait of the run's
main line goes through `Background.until`, so the first failure anywhere surfaces there at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any


class StopRequest:
    """A stop asked for (a signal, a Slurm notice, restarts exhausted): the run ends at the next step that can
    be checkpointed, with a checkpoint. The first reason is kept."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.event = asyncio.Event()

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


class Background:
    """The run's background tasks: cancelled when the run ends (`close`); the first failure fails the run."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failed: asyncio.Future[None] | None = None

    def open(self) -> None:
        """Start a session (in the running event loop): spawned tasks fail it from now on."""
        self._failed = asyncio.get_running_loop().create_future()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A background task of the run: cancelled when the run ends, and its failure fails the run."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        failed = self._failed
        if failed is not None and not task.cancelled() and task.exception() is not None and not failed.done():
            failed.set_exception(task.exception())  # type: ignore[arg-type]

    async def until(self, awaitable: Awaitable[Any], stop: asyncio.Event | None = None) -> Any:
        """Await `awaitable`, unless a background task fails first (then raise its error) or `stop` is set first
        (then cancel it and return None)."""
        assert self._failed is not None, "Background.open() first"
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

    async def close(self) -> None:
        """Cancel every task still running and wait for them; later failures no longer count."""
        pending = list(self._tasks)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._failed is not None and not self._failed.done():
            self._failed.cancel()
