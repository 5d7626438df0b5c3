"""The step scheduler without actors: admission by staleness, chunks for free generators, DAPO backfill."""

from __future__ import annotations

import asyncio

import pytest

from composer_mesh.actors.messages import Prompt, RewardResult, Rollout, RolloutGroup, ScoredGroup
from composer_mesh.orchestration.schedule import Chunk, GroupResult, StepScheduler, row_seed


def stream() -> tuple[list[Prompt], object]:
    drawn: list[Prompt] = []

    def draw(n: int) -> list[Prompt]:
        out = [Prompt(f"p{len(drawn) + i}", "q", []) for i in range(n)]
        drawn.extend(out)
        return out

    return drawn, draw


def results(chunk: Chunk, scores: list[list[float]] | None = None) -> list[GroupResult]:
    out = []
    for i, p in enumerate(chunk.prompts):
        s = scores[i] if scores else [0.0, 1.0]
        rollouts = [Rollout(p.prompt_id, [1], [2], [0.0], 1) for _ in s]
        out.append(GroupResult(chunk.first + i, ScoredGroup(RolloutGroup(p, rollouts), [RewardResult(x) for x in s]),
                               [None] * len(s)))
    return out


def make(draw, **kw) -> StepScheduler:
    args = {"steps": 10, "groups_per_step": 4, "generators": 1, "max_policy_lag": 0} | kw
    return StepScheduler(draw, **args)


async def pending_chunk(s: StepScheduler) -> Chunk | None:
    """A chunk if one is admitted now, else None (the scheduler would make a generator wait). Not a race on a
    loaded machine: an admitted chunk is returned without yielding to the loop, before the timer can fire."""
    try:
        return await asyncio.wait_for(s.next_chunk(), 0.05)
    except TimeoutError:
        return None


async def test_lag_0_admits_a_step_only_after_the_previous_one_is_synced():
    drawn, draw = stream()
    s = make(draw, max_policy_lag=0)
    chunk = await pending_chunk(s)
    assert chunk is not None and chunk.step == 1 and len(chunk.prompts) == 4
    assert await pending_chunk(s) is None  # step 2 needs the weights of step 1
    assert len(drawn) == 4  # nothing drawn for step 2 yet
    await s.finish(chunk, results(chunk))
    groups, plan = await s.take(1)
    assert [g.index for g in groups] == [0, 1, 2, 3] and not plan.short
    assert await pending_chunk(s) is None  # trained, but not yet synced to the generators
    await s.synced(1)
    chunk2 = await pending_chunk(s)
    assert chunk2 is not None and chunk2.step == 2 and chunk2.first == 4


async def test_lag_k_admits_k_steps_ahead_and_no_further():
    _, draw = stream()
    s = make(draw, max_policy_lag=2)
    steps = [(await pending_chunk(s)).step for _ in range(3)]
    assert steps == [1, 2, 3] and await pending_chunk(s) is None
    await s.synced(1)
    assert (await pending_chunk(s)).step == 4


async def test_a_step_is_split_over_the_generators_and_assembled_in_stream_order():
    _, draw = stream()
    s = make(draw, groups_per_step=5, generators=2)
    a, b = await pending_chunk(s), await pending_chunk(s)
    assert (len(a.prompts), len(b.prompts)) == (3, 2) and (a.first, b.first) == (0, 3)
    await s.finish(b, results(b))  # the second half finishes first
    assert not s.plans[1].ready.is_set()
    await s.finish(a, results(a))
    groups, _ = await s.take(1)
    assert [g.index for g in groups] == [0, 1, 2, 3, 4]


async def test_the_run_never_draws_past_its_last_step():
    drawn, draw = stream()
    s = make(draw, steps=2, max_policy_lag=5)
    assert [(await pending_chunk(s)).step for _ in range(2)] == [1, 2]
    assert await pending_chunk(s) is None and len(drawn) == 8


async def test_dynamic_sampling_sets_aside_flat_groups_and_backfills_them():
    _, draw = stream()
    s = make(draw, dynamic_sampling=True)
    chunk = await pending_chunk(s)
    await s.finish(chunk, results(chunk, [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]))
    assert not s.plans[1].ready.is_set() and s.zero_variance_groups == 2 and s.backfilled_groups == 2
    refill = await pending_chunk(s)
    assert refill.step == 1 and refill.first == 4 and len(refill.prompts) == 2
    await s.finish(refill, results(refill))
    groups, plan = await s.take(1)
    assert [g.index for g in groups] == [1, 3, 4, 5] and all(g.informative for g in groups) and not plan.short


async def test_dynamic_sampling_out_of_draws_fills_with_set_aside_groups():
    drawn, draw = stream()
    s = make(draw, dynamic_sampling=True, max_draws=1, groups_per_step=2)
    chunk = await pending_chunk(s)
    await s.finish(chunk, results(chunk, [[1.0, 1.0], [0.0, 1.0]]))
    groups, plan = await s.take(1)
    assert plan.short and [g.index for g in groups] == [0, 1] and len(drawn) == 2


def test_row_seeds_are_disjoint_across_requests_and_runs():
    spp = 4
    rows = {row_seed(seed, first, spp) + r for seed in (0, 1) for first in range(0, 40, 8) for r in range(8 * spp)}
    assert len(rows) == 2 * 5 * 8 * spp


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="generators >= 1"):
        StepScheduler(lambda n: [], steps=1, groups_per_step=1, generators=0, max_policy_lag=0)


async def test_take_waits_for_a_step_that_is_not_admitted_yet():
    _, draw = stream()
    s = make(draw, max_policy_lag=0)
    chunk = await pending_chunk(s)
    await s.finish(chunk, results(chunk))
    await s.take(1)
    later = asyncio.ensure_future(s.take(2))  # the trainer asks before step 2's weights reach the generators
    await asyncio.sleep(0.05)
    assert not later.done()
    await s.synced(1)
    chunk2 = await pending_chunk(s)
    await s.finish(chunk2, results(chunk2))
    groups, _ = await asyncio.wait_for(later, 30)
    assert [g.index for g in groups] == [4, 5, 6, 7]
