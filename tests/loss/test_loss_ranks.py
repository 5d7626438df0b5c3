"""The sharded loss merge (`loss/ranks.py`) with N ranks simulated in one process, a thread each: the packed
exchange gives exactly what merging field by field gives, `finish` on the ranks gives one process's metrics, and
a `finish` costs one gather whatever the number of fields."""

from __future__ import annotations

import dataclasses
import operator
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from functools import reduce
from typing import Any, TypeVar

import pytest
import torch
from torch import Tensor

from composer_mesh.loss.compose import BatchTotals, LossAccumulator, LossBatch, new_loss_state
from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.grpo import PolicyTerms
from composer_mesh.loss.ranks import BOOLEAN, CHANNELS, DISTILL, Local, Ranks, merge

R = TypeVar("R")
TEACHERS = ["t0", "t1"]
EVERYTHING = LossConfig(alpha_sdpo=0.5, beta_replay=0.3, kl_beta=0.1, off_policy_correction="tis", tis_cap=1.2,
                        dppo_mask=True, sdpo_token_clip=0.4)
# Per rank, its pieces (make_batch knobs): every channel, then GRPO only, then none at all.
LAYOUT: list[list[dict[str, Any]]] = [
    [{"teacher": "dense", "replay": True, "seed": 1}, {"teacher": "dense", "replay": True, "seed": 2, "b": 2}],
    [{"seed": 3, "b": 3}],
    [],
]


class ThreadRanks:
    """`Ranks` for `world` threads of one process: `gather` meets the other ranks' threads at a barrier, and
    counts its calls per rank."""

    def __init__(self, world: int) -> None:
        self.slots: list[Tensor | None] = [None] * world
        self.calls = [0] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def rank(self, k: int) -> Ranks:
        shared = self

        class Rank:
            def gather(self, t: Tensor) -> list[Tensor]:
                shared.calls[k] += 1
                shared.slots[k] = t.clone()
                shared.barrier.wait()
                out = [s.clone() for s in shared.slots if s is not None]
                shared.barrier.wait()  # nobody overwrites a slot before every rank has read them all
                return out

        return Rank()


def on_ranks(world: int, work: Callable[[int, Ranks], R]) -> tuple[list[R], list[int]]:
    """`work(rank, ranks)` on `world` threads; the results and the gathers per rank, in rank order."""
    ranks = ThreadRanks(world)
    with ThreadPoolExecutor(world) as pool:
        results = list(pool.map(lambda k: work(k, ranks.rank(k)), range(world)))
    return results, ranks.calls


def _pieces(make_batch: Callable[..., LossBatch], layout: list[list[dict[str, Any]]]) -> list[list[LossBatch]]:
    """Float64 pieces (their replay pairs too), so that one process's metrics are those of the merged float64."""
    def f64(batch: LossBatch) -> LossBatch:
        if batch.replay is not None:
            batch.replay = dataclasses.replace(batch.replay, **{
                f.name: v.double() for f in fields(batch.replay) if (v := getattr(batch.replay, f.name)) is not None
                and isinstance(v, Tensor) and v.is_floating_point()})
        return batch

    return [[f64(make_batch(dtype=torch.float64, ref=True, **knobs)) for knobs in rank] for rank in layout]


def _accumulators(config: LossConfig, pieces: list[list[LossBatch]]) -> list[LossAccumulator]:
    """One accumulator per rank holding its pieces, each divided by the whole batch's counts."""
    totals = reduce(operator.add, (BatchTotals.of(p) for rank in pieces for p in rank))
    out = []
    for rank in pieces:
        acc = LossAccumulator(config, totals, step=3, state=new_loss_state(config))
        for piece in rank:
            acc.add(piece)
        out.append(acc)
    return out


def _local(acc: LossAccumulator) -> Local:
    d = acc._diag
    return Local(dict(acc._sums), dict(acc._saw), list(d.policy), list(d.advantages), list(d.distill),
                 list(d.replay))


def _cat(ranks: list[list[Tensor | None]], boolean: bool = False) -> Tensor | None:
    """Merging one field by hand: every rank's parts flattened in rank order; None when no rank has any."""
    parts = [p.reshape(-1).double() for rank in ranks for p in rank if p is not None]
    if not parts:
        return None
    out = torch.cat(parts)
    return out.bool() if boolean else out


def _same(got: Tensor | None, expected: Tensor | None) -> None:
    assert (got is None) == (expected is None)
    if got is not None and expected is not None:
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_packed_merge_equals_merging_by_hand(make_batch: Callable[..., LossBatch]) -> None:
    locals_ = [_local(a) for a in _accumulators(EVERYTHING, _pieces(make_batch, LAYOUT))]
    merged, calls = on_ranks(len(LAYOUT), lambda k, ranks: merge(ranks, locals_[k], TEACHERS))
    assert calls == [1, 1, 1]
    for got in merged:
        for c in CHANNELS:  # added in rank order, float64, in the pieces' dtype on every rank
            expected = reduce(operator.add, [r.sums[c].double() for r in locals_ if c in r.sums])
            assert got.sums[c].dtype == torch.float64 and float(got.sums[c]) == float(expected)
        assert got.saw == {"teacher": True, "replay": True}
        [terms] = got.policy
        for f in fields(PolicyTerms):
            _same(getattr(terms, f.name), _cat([[getattr(t, f.name) for t in r.policy] for r in locals_],
                                               f.name in BOOLEAN))
        assert terms.clipped_low.dtype == torch.bool and terms.tis_weight is not None
        _same(got.advantages[0], _cat([r.advantages for r in locals_]))
        [distill] = got.distill
        for name in DISTILL:
            _same(getattr(distill, name), _cat([[getattr(o, name) for o in r.distill] for r in locals_],
                                               name in BOOLEAN))
        assert distill.clipped.dtype == torch.bool
        assert distill.has_entropy == all(o.has_entropy for r in locals_ for o in r.distill)
        [(chosen, rejected, losses, teachers)] = got.replay
        for i, col in enumerate((chosen, rejected, losses)):
            _same(col, _cat([[p[i] for p in r.replay] for r in locals_]))
        assert teachers == [t for r in locals_ for p in r.replay for t in p[3]]


def test_absent_channels_stay_absent(make_batch: Callable[..., LossBatch]) -> None:
    """GRPO only on every rank (one with no pieces): no distill, no replay, optional fields None, masks bool."""
    config = LossConfig(alpha_sdpo=0.5, beta_replay=0.3)
    locals_ = [_local(a) for a in _accumulators(config, _pieces(make_batch, LAYOUT[1:]))]
    merged, calls = on_ranks(2, lambda k, ranks: merge(ranks, locals_[k], TEACHERS))
    assert calls == [1, 1]
    for got in merged:
        assert set(got.sums) == {"grpo"} and got.saw == {"teacher": False, "replay": False}
        assert got.distill == [] and got.replay == []
        [terms] = got.policy
        assert terms.kl_ref is None and terms.tis_weight is None and terms.tis_truncated is None
        assert terms.dppo_masked.dtype == torch.bool and terms.ratio.dtype == torch.float64
        _same(terms.ratio, locals_[0].policy[0].ratio.double())


@pytest.mark.parametrize("config", [LossConfig(alpha_sdpo=0.0, beta_replay=0.0), EVERYTHING],
                         ids=["grpo-only", "every-field"])
def test_finish_on_ranks_is_one_process_with_one_gather(make_batch: Callable[..., LossBatch],
                                                         config: LossConfig) -> None:
    pieces = _pieces(make_batch, LAYOUT)
    [one] = _accumulators(config, [[p for rank in pieces for p in rank]])
    expected = one.finish(teachers=TEACHERS).metrics
    accumulators = _accumulators(config, pieces)
    results, calls = on_ranks(len(LAYOUT), lambda k, ranks: accumulators[k].finish(ranks, TEACHERS))
    assert calls == [1] * len(LAYOUT)  # one gather per finish, whatever the number of fields
    for result in results:
        assert result.metrics.keys() == expected.keys()
        for key, value in expected.items():
            assert result.metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
        assert result.metrics == results[0].metrics  # every rank reports the same, the one without pieces too
        assert result.total.dtype == torch.float64
