"""The three-channel RL loss. Pure torch: never imports Monarch.

`from composer_mesh.loss.config import LossConfig` stays cheap (no torch import); the tensor API is loaded
lazily: `from composer_mesh.loss import compose_loss, LossBatch, LossResult, ReplayPairs, TAIDState`.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "LossConfig": "composer_mesh.loss.config",
    "LossBatch": "composer_mesh.loss.compose",
    "LossResult": "composer_mesh.loss.compose",
    "ReplayPairs": "composer_mesh.loss.compose",
    "TAIDState": "composer_mesh.loss.compose",
    "compose_loss": "composer_mesh.loss.compose",
    "new_loss_state": "composer_mesh.loss.compose",
    "token_logprobs": "composer_mesh.loss.compose",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'composer_mesh.loss' has no attribute {name!r}")
