"""Warm spares with a fake `SpareMeshes`: prepared only for meshes that want one, and a spare that fails to
get ready is logged, never fatal."""

from __future__ import annotations

import asyncio
import logging

import pytest

from composer_mesh.orchestration.spares import WarmSpares


class FakeSpareMeshes:
    def __init__(self, wanting: set[str], broken: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.wanting, self.broken = wanting, broken
        self.prepared: list[str] = []

    def meshes(self) -> set[str]:
        return {"gen", "rew", "teach"}

    def wants_spare(self, mesh: str) -> bool:
        return mesh in self.wanting

    async def prepare(self, mesh: str) -> None:
        if mesh in self.broken:
            raise RuntimeError(f"no host for {mesh}")
        self.prepared.append(mesh)


async def test_spares_are_prepared_for_the_meshes_that_want_one(caplog: pytest.LogCaptureFixture) -> None:
    meshes = FakeSpareMeshes(wanting={"gen", "teach"}, broken={"teach"})
    tasks: list[asyncio.Task[None]] = []
    spares = WarmSpares(meshes, lambda c: tasks.append(asyncio.create_task(c)) or tasks[-1])  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="composer_mesh.loop"):
        spares.prepare_all()
        await asyncio.gather(*tasks)  # the broken one does not raise
    assert meshes.prepared == ["gen"] and len(tasks) == 2
    assert "preparing a warm spare for mesh teach failed (RuntimeError: no host for teach)" in caplog.text
