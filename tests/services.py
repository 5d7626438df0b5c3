"""Real-service tiers: skip locally when a service is missing, fail in CI (CI=true) where it must exist."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require(available: bool, what: str) -> None:
    """Skip (locally) or fail (in CI) when `what` is not available."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI but is not available: .ci/run must install it")
    pytest.skip(f"{what} not available")


def require_module(name: str) -> None:
    require(importlib.util.find_spec(name) is not None, f"python module {name!r}")


def require_command(name: str) -> None:
    require(shutil.which(name) is not None, f"command {name!r}")
