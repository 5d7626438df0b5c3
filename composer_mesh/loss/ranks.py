"""A loss accumulated on several ranks (the procs of a sharded trainer replica), made the whole batch's again.

Each rank of a sharded replica adds only its own pieces of the batch to its `LossAccumulator`; every piece is
already divided by the WHOLE batch's counts, so the ranks' gradients sum to the whole batch's. What differs per
rank is what `finish` reports: the channel sums and the per-token diagnostics its metrics are built from. Before
`finish`, `merge` replaces them with every rank's (sums added, diagnostics concatenated in rank order), so the
total, the metrics and the adaptive TAID step are the same on every rank and equal one process's (up to the
order of floating-point sums). Only tensors cross ranks: names (replay teachers) travel as indices into a list
every rank knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Protocol

import torch
from torch import Tensor

from composer_mesh.loss.distill import DistillOutput
from composer_mesh.loss.grpo import PolicyTerms

CHANNELS = ("grpo", "sdpo", "replay")
Replay = tuple[Tensor, Tensor, Tensor, list[str]]


class Ranks(Protocol):
    """Collectives over the ranks of one replica (every rank calls each one, in the same order)."""

    def sum(self, t: Tensor) -> Tensor:
        """Elementwise sum over ranks of a tensor of the same shape on every rank."""

    def cat(self, t: Tensor) -> Tensor:
        """Concatenation in rank order along dim 0 (the ranks' lengths may differ, trailing shapes may not)."""


def merge_sums(ranks: Ranks, sums: dict[str, Tensor], saw: dict[str, bool]) -> tuple[dict[str, Tensor], dict[str, bool]]:
    """Every rank's channel sums added (a channel present on any rank is present) and `saw` or-ed."""
    dtype = next(iter(sums.values())).dtype if sums else torch.float32
    local = torch.tensor([float(sums[c]) if c in sums else 0.0 for c in CHANNELS], dtype=torch.float64)
    flags = torch.tensor([c in sums for c in CHANNELS] + [saw[k] for k in sorted(saw)], dtype=torch.float64)
    total, seen = ranks.sum(local), ranks.sum(flags)
    merged = {c: total[i].to(dtype) for i, c in enumerate(CHANNELS) if seen[i] > 0}
    return merged, {k: bool(seen[len(CHANNELS) + i] > 0) for i, k in enumerate(sorted(saw))}


# Diagnostics that are masks: they come back as bool on every rank, also one that had none of its own.
BOOLEAN = frozenset({"clipped_low", "clipped_high", "dppo_masked", "dppo_masked_low", "dppo_masked_high",
                     "tis_truncated", "clipped"})


def _cat(ranks: Ranks, parts: list[Tensor | None], present: bool, boolean: bool = False) -> Tensor | None:
    """One diagnostic over every rank (float64 on the wire; bool back where `boolean`)."""
    local = [p for p in parts if p is not None]
    if not present:
        return None
    mine = torch.cat([p.reshape(-1).double() for p in local]) if local else torch.zeros(0, dtype=torch.float64)
    out = ranks.cat(mine)
    return out.bool() if boolean else out


def _present(ranks: Ranks, flags: list[bool]) -> list[bool]:
    seen = ranks.sum(torch.tensor(flags, dtype=torch.float64))
    return [bool(x > 0) for x in seen]


def merge_policy(ranks: Ranks, terms: list[PolicyTerms], advantages: list[Tensor]) -> tuple[list[PolicyTerms], list[Tensor]]:
    """Every rank's channel-1 diagnostics, as one piece's."""
    names = [f.name for f in fields(PolicyTerms)]
    present = _present(ranks, [any(getattr(t, n) is not None for t in terms) for n in names])
    merged = {n: _cat(ranks, [getattr(t, n) for t in terms], p, n in BOOLEAN) for n, p in zip(names, present, strict=True)}
    adv = _cat(ranks, list(advantages), True)
    assert adv is not None
    return [PolicyTerms(**merged)], [adv]  # type: ignore[arg-type]


def merge_distill(ranks: Ranks, outputs: list[DistillOutput]) -> list[DistillOutput]:
    """Every rank's channel-2 diagnostics, as one piece's (the loss is set by `finish` from the merged sums)."""
    [any_output, lacks_entropy] = _present(ranks, [bool(outputs), any(not o.has_entropy for o in outputs)])
    if not any_output:
        return []
    cols = {n: _cat(ranks, [getattr(o, n) for o in outputs], True, n in BOOLEAN)
            for n in ("per_token", "teacher_entropy", "gate", "clipped")}
    zero = torch.zeros((), dtype=torch.float64)
    return [DistillOutput(zero, has_entropy=not lacks_entropy, **cols)]  # type: ignore[arg-type]


def merge_replay(ranks: Ranks, pairs: list[Replay], teachers: Sequence[str]) -> list[Replay]:
    """Every rank's channel-3 diagnostics, as one piece's; teacher names travel as indices into `teachers`."""
    index = {name: i for i, name in enumerate(teachers)}
    [any_pairs] = _present(ranks, [bool(pairs)])
    if not any_pairs:
        return []
    chosen, rejected, losses = (_cat(ranks, [p[i] for p in pairs], True) for i in range(3))
    ids = _cat(ranks, [torch.tensor([float(index[t]) for t in p[3]], dtype=torch.float64) for p in pairs], True)
    assert chosen is not None and rejected is not None and losses is not None and ids is not None
    return [(chosen, rejected, losses, [teachers[int(i)] for i in ids.tolist()])]
