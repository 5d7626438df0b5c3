"""Waiting on a condition instead of for a fixed time, so a test holds on a loaded machine (issue 29): the
wait ends as soon as `predicate()` is true, and the deadline only bounds a hang, so it can be generous."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEADLINE_S = 60.0  # bounds a hang only: a condition met in milliseconds when idle still has 1000x that


def wait_until(predicate: Callable[[], object], what: str, timeout: float = DEADLINE_S, every: float = 0.01) -> None:
    """Poll `predicate` until it is true; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:g} s"
        time.sleep(every)


async def eventually(predicate: Callable[[], object], what: str, timeout: float = DEADLINE_S,
                     every: float = 0.01) -> None:
    """`wait_until` for a coroutine: polls without blocking the event loop (the tasks it waits on run)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:g} s"
        await asyncio.sleep(every)
