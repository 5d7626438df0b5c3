"""How much of a [tokens x vocab] tensor the loss materialises at once, and in which float dtype it computes.

One rule for every chunked loop in `loss/` (token log-probs, channel 2, log-probs from hidden states): a chunk
holds about `elements` values, so `tokens = elements // vocab`. A fixed token count was right for one vocab and
wrong for another (32 tokens: fine at 152k, 2.5-4.3x slower than naive at 32k on an H100, where per-chunk launch
overhead dominates small chunks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from composer_mesh.loss.config import DEFAULT_LOSS_CHUNK_ELEMENTS as DEFAULT_CHUNK_ELEMENTS

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "chunk_tokens", "compute_dtype", "flat_chunks", "row_chunks"]


def chunk_tokens(vocab: int, elements: int = DEFAULT_CHUNK_ELEMENTS, override: int | None = None) -> int:
    """Tokens per chunk: `override` when given, else `elements // vocab` (at least 1)."""
    if override is not None:
        if override < 1:
            raise ValueError(f"chunk token override must be >= 1, got {override}")
        return override
    if vocab < 1 or elements < 1:
        raise ValueError(f"vocab ({vocab}) and chunk elements ({elements}) must be >= 1")
    return max(1, elements // vocab)


def compute_dtype(t: Tensor) -> torch.dtype:
    """float64 inputs stay float64 (exactness tests); everything else (bf16, fp16, fp32) computes in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def row_chunks(x: Tensor, tokens: int) -> list[tuple[int, int, int]]:
    """(row b, t0, t1) spans covering a [B, T, V] tensor, `tokens` positions at a time, never crossing a row.

    Rows are walked one by one so a non-contiguous view (e.g. `logits[:, p - 1 : -1]`) is only ever sliced, never
    copied; with many short rows that is B small chunks, which is why callers with flat data use `flat_chunks`.
    """
    b, t = x.shape[0], x.shape[1]
    return [(i, t0, min(t, t0 + tokens)) for i in range(b) for t0 in range(0, t, tokens)]


def flat_chunks(n: int, tokens: int) -> list[tuple[int, int]]:
    """[start, stop) spans of `tokens` rows covering n rows."""
    return [(s, min(n, s + tokens)) for s in range(0, n, tokens)]
