"""Fixtures shared by the loss tests: small random batches (CPU, float32, seeded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from composer_mesh.loss.compose import LossBatch, ReplayPairs


def _make_batch(
    b: int = 4,
    t: int = 6,
    v: int = 11,
    *,
    seed: int = 0,
    teacher: str | None = None,
    k: int = 4,
    replay: bool = False,
    pad: bool = True,
    ref: bool = False,
    requires_grad: bool = True,
    dtype: torch.dtype = torch.float32,
) -> LossBatch:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=dtype)
    logits.requires_grad_(requires_grad)
    token_ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    if pad:
        lengths = torch.randint(2, t + 1, (b,), generator=g)
        lengths[0] = t
        mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    with torch.no_grad():
        cur = torch.log_softmax(logits.float(), -1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    old = cur + 0.3 * torch.randn(b, t, generator=g)
    rewards = torch.randint(0, 2, (b,), generator=g).float() + 0.1 * torch.arange(b).float()
    group_ids = torch.arange(b) // 2
    kwargs: dict[str, Any] = {}
    if ref:
        kwargs["ref_logprobs"] = cur + 0.2 * torch.randn(b, t, generator=g)
    if teacher == "dense":
        kwargs["teacher_logits"] = torch.randn(b, t, v, generator=g)
    elif teacher == "topk":
        kwargs["teacher_topk_ids"] = torch.stack(
            [torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(t)]) for _ in range(b)]
        )
        kwargs["teacher_topk_logprobs"] = torch.log_softmax(torch.randn(b, t, k, generator=g), -1) - 0.5
    if replay:
        p, tc, tr = 3, 5, 4
        clog = torch.log_softmax(torch.randn(p, tc, v, generator=g), -1)[..., 0]
        rlog = torch.log_softmax(torch.randn(p, tr, v, generator=g), -1)[..., 0]
        kwargs["replay"] = ReplayPairs(
            chosen_logps=clog,
            chosen_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool),
            rejected_logps=rlog,
            rejected_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool),
            ref_chosen_logps=-torch.rand(p, generator=g) * 3,
            ref_rejected_logps=-torch.rand(p, generator=g) * 3,
            teachers=["t0", "t1", "t0"],
        )
    return LossBatch(
        logits=logits,
        token_ids=token_ids,
        mask=mask,
        old_logprobs=old,
        rewards=rewards,
        group_ids=group_ids,
        **kwargs,
    )


@pytest.fixture
def make_batch() -> Callable[..., LossBatch]:
    """Factory for a small random LossBatch (see `_make_batch` for the knobs)."""
    return _make_batch
