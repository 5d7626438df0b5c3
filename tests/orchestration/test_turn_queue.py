"""The turn queue shared by generators: a free generator lingers for the turns of every playing episode, so one
request samples a whole round instead of the first turn alone."""

from __future__ import annotations

import asyncio
import time

from composer_mesh.actors.messages import Prompt
from composer_mesh.orchestration.rollout.turns import TurnQueue


async def _episode(queue: TurnQueue, name: str, delay_s: float, started: asyncio.Event | None = None) -> None:
    """An episode that puts one turn after `delay_s` (its tool call) and is done once it is sampled."""
    async with queue.playing():
        if started is not None:
            started.set()
        await asyncio.sleep(delay_s)
        await queue.sample(Prompt(name, name, [1]), seed=0, step=1)


async def _serve_once(queue: TurnQueue, limit: int = 64) -> list[str]:
    turns = await queue.take(limit)
    for t in turns:
        t.result.set_result(None)
    await queue.finished(turns)
    return [t.prompt.prompt_id for t in turns]


async def test_a_lingering_taker_gets_the_turns_of_every_playing_episode():
    queue = TurnQueue(linger_s=60.0)
    episodes = [asyncio.create_task(_episode(queue, f"e{i}", 0.01 * i)) for i in range(4)]
    t0 = time.perf_counter()
    assert sorted(await _serve_once(queue)) == ["e0", "e1", "e2", "e3"]
    assert time.perf_counter() - t0 < 30.0  # all four came: no need to wait out the linger
    await asyncio.gather(*episodes)


async def test_without_linger_the_first_turn_goes_alone():
    queue = TurnQueue(linger_s=0.0)
    episodes = [asyncio.create_task(_episode(queue, f"e{i}", 0.05 * i)) for i in range(3)]
    assert [await _serve_once(queue) for _ in range(3)] == [["e0"], ["e1"], ["e2"]]
    await asyncio.gather(*episodes)


async def test_linger_ends_after_linger_s_when_an_episode_stays_in_its_tool():
    queue = TurnQueue(linger_s=0.1)
    slow = asyncio.create_task(_episode(queue, "slow", 30.0))
    fast = asyncio.create_task(_episode(queue, "fast", 0.0))
    t0 = time.perf_counter()
    assert await _serve_once(queue) == ["fast"]
    assert 0.09 <= time.perf_counter() - t0 < 10.0
    slow.cancel()
    await asyncio.gather(fast, slow, return_exceptions=True)


async def test_turns_already_being_sampled_are_not_waited_for():
    """Generator A holds two episodes' turns; generator B takes the other two without lingering for A's."""
    queue = TurnQueue(linger_s=30.0)
    first = [asyncio.create_task(_episode(queue, f"a{i}", 0.0)) for i in range(2)]
    held = await queue.take(2)  # A: sampling, not finished
    assert sorted(t.prompt.prompt_id for t in held) == ["a0", "a1"]
    second = [asyncio.create_task(_episode(queue, f"b{i}", 0.0)) for i in range(2)]
    t0 = time.perf_counter()
    assert sorted(await _serve_once(queue)) == ["b0", "b1"]
    assert time.perf_counter() - t0 < 10.0
    for t in held:
        t.result.set_result(None)
    await queue.finished(held)
    await asyncio.gather(*first, *second)


async def test_an_episode_ending_stops_the_wait_for_its_turn():
    queue = TurnQueue(linger_s=30.0)
    started = asyncio.Event()

    async def quits() -> None:  # plays, then ends without a turn (its environment said done)
        async with queue.playing():
            started.set()
            await asyncio.sleep(0.05)

    quitter = asyncio.create_task(quits())
    await started.wait()
    turn = asyncio.create_task(_episode(queue, "e", 0.0))
    t0 = time.perf_counter()
    assert await _serve_once(queue) == ["e"]
    assert time.perf_counter() - t0 < 10.0
    await asyncio.gather(quitter, turn)


async def test_two_takers_split_a_round_evenly():
    queue = TurnQueue(linger_s=30.0, takers=2)
    episodes = [asyncio.create_task(_episode(queue, f"e{i}", 0.005 * i)) for i in range(6)]
    first, second = await asyncio.gather(_serve_once(queue), _serve_once(queue))
    assert (len(first), len(second)) == (3, 3) and sorted(first + second) == [f"e{i}" for i in range(6)]
    await asyncio.gather(*episodes)


async def test_a_taker_whose_turns_another_took_while_it_lingered_waits_for_the_next():
    """Two generators linger for a round of four episodes of which one put its turn: when their lingers end, one
    takes the turn and the other waits for the next one (it answered with an empty request before, which the
    driver sent to its generator and then divided its time by zero turns)."""
    queue = TurnQueue(linger_s=0.05, takers=2)
    tools = [asyncio.create_task(_episode(queue, f"tool{i}", 30.0)) for i in range(3)]
    fast = asyncio.create_task(_episode(queue, "fast", 0.0))
    takers = [asyncio.create_task(queue.take(64)) for _ in range(2)]
    done, waiting = await asyncio.wait(takers, return_when=asyncio.FIRST_COMPLETED)
    assert [[t.prompt.prompt_id for t in task.result()] for task in done] == [["fast"]]
    await asyncio.sleep(2 * queue.linger_s)  # the other's linger, begun with the first's, is over
    (other,) = waiting
    assert not other.done()
    nxt = asyncio.create_task(_episode(queue, "next", 0.0))
    assert [t.prompt.prompt_id for t in await other] == ["next"]
    for t in [*done.pop().result(), *other.result()]:
        t.result.set_result(None)
    for t in tools:
        t.cancel()
    await asyncio.gather(fast, nxt, *tools, return_exceptions=True)
