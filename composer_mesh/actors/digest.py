"""A content digest of named tensors, so a test or a script can check that two actors hold equal weights
without moving the weights themselves."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def weights_digest(named: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes, in name order (bitwise equality ⇔ equal digests)."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
