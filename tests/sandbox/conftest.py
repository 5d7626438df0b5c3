"""Sandbox fixtures: real bubblewrap (skipped locally without it, required in CI) and small limits so that
every containment test ends in a second or two."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator

import pytest
from services import require

from composer_mesh.sandbox.config import SandboxConfig
from composer_mesh.sandbox.pool import SandboxBox, SandboxPool
from composer_mesh.sandbox.run import SandboxUnavailable, check_available

SMALL = dict(cpu_s=1, wall_s=2.0, memory_mb=256, processes=16, file_mb=1, output_bytes=1024, concurrency=2)


def bwrap_config(**over: object) -> SandboxConfig:
    """A bubblewrap sandbox config with small limits; skips (locally) or fails (CI) without bubblewrap."""
    require(shutil.which("bwrap") is not None, "command 'bwrap' (Debian bubblewrap)")
    return SandboxConfig(**(SMALL | over))


def rlimits_config(**over: object) -> SandboxConfig:
    """An rlimits-only config whose interpreter the sandbox uid can run: the trainer's own, or (when the
    trainer is root and its interpreter lies under /root) the system's python3."""
    config = SandboxConfig(mode="rlimits", **(SMALL | over))
    for python in (None, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")):
        candidate = config.model_copy(update={"python": python})
        try:
            check_available(candidate)
            return candidate
        except SandboxUnavailable:
            continue
    require(False, f"an interpreter uid {config.uid} can run (uid {os.getuid()})")
    raise AssertionError  # unreachable: require skipped or failed


@pytest.fixture
async def box() -> AsyncIterator[SandboxBox]:
    async with SandboxPool(bwrap_config()).session() as b:
        yield b


@pytest.fixture
async def rbox() -> AsyncIterator[SandboxBox]:
    async with SandboxPool(rlimits_config()).session() as b:
        yield b
