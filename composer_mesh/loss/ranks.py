"""A loss accumulated on several ranks (the procs of a sharded trainer replica), made the whole batch's again.

Each rank of a sharded replica adds only its own pieces of the batch to its `LossAccumulator`; every piece is
already divided by the WHOLE batch's counts, so the ranks' gradients sum to the whole batch's. What differs per
rank is what `finish` reports: the channel sums and the per-token diagnostics its metrics are built from. Before
`finish`, `merge` replaces them with every rank's (sums added, diagnostics concatenated in rank order), so the
total, the metrics and the adaptive TAID step are the same on every rank and equal one process's (up to the
order of floating-point sums).

One exchange per step, whatever the number of fields: each rank packs all it has into one float64 vector (a
header of per-field lengths, `ABSENT` for a field it lacks, then the values), `Ranks.gather` hands every rank
every rank's vector, and each rank unpacks them in the same field order. A collective costs a round trip (on
gloo, more than the data), so one gather (two collectives in `TorchRanks`) replaces the 23-45 a field-by-field
merge took. Only numbers cross ranks: names (replay teachers) travel as indices into a list every rank knows,
masks as 0/1 (bool again on return).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import reduce
from typing import Protocol

import torch
from torch import Tensor

from composer_mesh.loss.distill import DistillOutput
from composer_mesh.loss.grpo import PolicyTerms

CHANNELS = ("grpo", "sdpo", "replay")
DISTILL = ("per_token", "teacher_entropy", "gate", "clipped")
Replay = tuple[Tensor, Tensor, Tensor, list[str]]
ABSENT = -1  # a field's length in the header when the rank has none of it
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the sums' dtype travels as an index

# Diagnostics that are masks: they come back as bool on every rank, also one that had none of its own.
BOOLEAN = frozenset({"clipped_low", "clipped_high", "dppo_masked", "dppo_masked_low", "dppo_masked_high",
                     "tis_truncated", "clipped"})


class Ranks(Protocol):
    """The one collective the merge needs, over the ranks of one replica (every rank calls it, in the same order)."""

    def gather(self, t: Tensor) -> list[Tensor]:
        """Every rank's 1-D `t`, in rank order (the ranks' lengths may differ, their dtypes may not)."""


@dataclass
class Local:
    """What one rank's `LossAccumulator` holds at `finish`: its channel sums and its pieces' diagnostics."""

    sums: dict[str, Tensor]
    saw: dict[str, bool]
    policy: list[PolicyTerms]
    advantages: list[Tensor]
    distill: list[DistillOutput]
    replay: list[Replay]


def merge(ranks: Ranks, local: Local, teachers: Sequence[str]) -> Local:
    """Every rank's sums added in rank order (a channel present on any rank is present), `saw` or-ed, and the
    diagnostics concatenated in rank order, each group as one piece's; one `ranks.gather`."""
    out = _Writer(local.policy[0].per_token.device if local.policy else torch.device("cpu"))
    _write(out, local, teachers)
    got = _Reader(ranks.gather(out.vector()), len(out.lengths))
    sums = _read_sums(got)
    saw = dict(zip(sorted(local.saw), torch.stack(got.take()).sum(0).gt(0).tolist(), strict=True))
    policy, advantages = _read_policy(got)
    return Local(sums, saw, policy, advantages, _read_distill(got), _read_replay(got, teachers))


def _write(out: _Writer, local: Local, teachers: Sequence[str]) -> None:
    """Every field of `local`, in the order `merge` reads them back."""
    for c in CHANNELS:
        out.put([local.sums.get(c)])
    dtypes = [DTYPES.index(s.dtype) for s in local.sums.values()][:1]
    out.put([torch.tensor(dtypes, dtype=torch.float64)] if dtypes else [])
    out.put([torch.tensor([float(local.saw[k]) for k in sorted(local.saw)], dtype=torch.float64)])
    for f in fields(PolicyTerms):
        out.put([getattr(t, f.name) for t in local.policy])
    out.put(list(local.advantages) or [torch.zeros(0)])  # present on every rank, as one with no pieces had
    outputs = local.distill
    out.put([torch.tensor([float(any(not o.has_entropy for o in outputs))], dtype=torch.float64)] if outputs else [])
    for name in DISTILL:
        out.put([getattr(o, name) for o in outputs])
    index = {name: i for i, name in enumerate(teachers)}
    for i in range(3):
        out.put([p[i] for p in local.replay])
    out.put([torch.tensor([float(index[t]) for t in p[3]], dtype=torch.float64) for p in local.replay])


def _read_sums(got: _Reader) -> dict[str, Tensor]:
    """Each channel's sums added in rank order in float64 (a float64 all_reduce adds the same numbers; with two
    ranks, bit for bit), then in the pieces' dtype: a rank without pieces takes the others', so that every rank
    reports the same total and steps adaptive TAID alike."""
    totals = {c: reduce(operator.add, x) for c in CHANNELS if (x := got.floats())}
    dtypes = got.floats()
    dtype = DTYPES[int(dtypes[0])] if dtypes else torch.float32
    return {c: torch.tensor(x, dtype=torch.float64).to(dtype) for c, x in totals.items()}


def _read_policy(got: _Reader) -> tuple[list[PolicyTerms], list[Tensor]]:
    """Every rank's channel-1 diagnostics, as one piece's."""
    terms = PolicyTerms(**{f.name: got.cat(f.name in BOOLEAN) for f in fields(PolicyTerms)})  # type: ignore[arg-type]
    advantages = got.cat()
    assert advantages is not None  # every rank writes them
    return [terms], [advantages]


def _read_distill(got: _Reader) -> list[DistillOutput]:
    """Every rank's channel-2 diagnostics, as one piece's (the loss is set by `finish` from the merged sums)."""
    lacks_entropy = got.floats()
    cols = {name: got.cat(name in BOOLEAN) for name in DISTILL}
    if not lacks_entropy:
        return []
    zero = torch.zeros((), dtype=torch.float64)
    return [DistillOutput(zero, has_entropy=not any(lacks_entropy), **cols)]  # type: ignore[arg-type]


def _read_replay(got: _Reader, teachers: Sequence[str]) -> list[Replay]:
    """Every rank's channel-3 diagnostics, as one piece's; teacher names come back from their indices."""
    chosen, rejected, losses, ids = (got.cat() for _ in range(4))
    if chosen is None or rejected is None or losses is None or ids is None:
        return []
    return [(chosen, rejected, losses, [teachers[int(i)] for i in ids.tolist()])]


class _Writer:
    """One rank's fields in the order every rank writes them: a header of their lengths, then their values."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lengths: list[int] = []
        self.values: list[Tensor] = []

    def put(self, parts: Sequence[Tensor | None]) -> None:
        """One field: its parts' values flattened in order; `ABSENT` when no part is given (all None)."""
        given = [p.detach().reshape(-1).to(self.device, torch.float64) for p in parts if p is not None]
        self.lengths.append(sum(p.numel() for p in given) if given else ABSENT)
        self.values += given

    def vector(self) -> Tensor:
        header = torch.tensor(self.lengths, dtype=torch.float64, device=self.device)
        return torch.cat([header, *self.values])


class _Reader:
    """Every rank's fields, taken back in the order they were written."""

    def __init__(self, vectors: list[Tensor], count: int) -> None:
        self.ranks: list[list[Tensor | None]] = []
        for v in vectors:
            lengths = [int(n) for n in v[:count].tolist()]
            values = torch.split(v[count:], [max(n, 0) for n in lengths])
            self.ranks.append([None if n == ABSENT else x for n, x in zip(lengths, values, strict=True)])
        self.field = 0

    def take(self) -> list[Tensor]:
        """The next field of every rank that has it, in rank order."""
        i, self.field = self.field, self.field + 1
        return [x for r in self.ranks if (x := r[i]) is not None]

    def cat(self, boolean: bool = False) -> Tensor | None:
        """The next field concatenated over the ranks (None when no rank has it; bool again where `boolean`)."""
        got = self.take()
        if not got:
            return None
        out = torch.cat(got)
        return out.bool() if boolean else out

    def floats(self) -> list[float]:
        """The next field's values over the ranks that have it, in rank order (a per-rank scalar or flag)."""
        return [x for t in self.take() for x in t.tolist()]
