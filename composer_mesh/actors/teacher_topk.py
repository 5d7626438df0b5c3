"""How many teacher log-probs per token channel 2 asks for: dense for small vocabularies, top-k for large ones.

A dense teacher row is the student's whole vocabulary in float32: `tokens x vocab x 4` bytes per rollout
(1,024 tokens at Qwen's 151,936 ids is ~622 MB through the actor messages), while top-k costs
`tokens x k x 12` bytes (int64 id + float32 log-prob; ~393 KB at k=32). So `"auto"` (the default) is dense
up to `DENSE_VOCAB_LIMIT` ids and `DEFAULT_TOP_K` above it; 0 forces dense and any k > 0 forces top-k.
The teacher resolves it (it knows the student's vocabulary after binding to the student), so the run config
and the request stay vocabulary-agnostic.

Import-cheap (no torch): the `run:` config imports these constants for its description and validation.
"""

from __future__ import annotations

from typing import Literal

TopK = int | Literal["auto"]
"""A channel-2 request's top-k: "auto", 0 (dense logits) or k > 0."""

AUTO: Literal["auto"] = "auto"
DENSE_VOCAB_LIMIT = 32_768  # largest student vocabulary "auto" sends dense (128 KB per token in float32)
DEFAULT_TOP_K = 32  # what "auto" asks for above DENSE_VOCAB_LIMIT


def resolve_top_k(requested: TopK, student_vocab: int) -> int:
    """The k to compute (0 = dense): "auto" picks by `student_vocab`; an explicit k >= 0 is kept as given."""
    if requested == AUTO:
        return 0 if student_vocab <= DENSE_VOCAB_LIMIT else DEFAULT_TOP_K
    if isinstance(requested, bool) or not isinstance(requested, int):
        raise ValueError(f"top_k must be 'auto' or an int >= 0 (0 = dense logits), got {requested!r}")
    if requested < 0:
        raise ValueError(f"top_k must be >= 0 (0 = dense logits) or 'auto', got {requested}")
    return requested
