"""Warm spares: procs with their actors set up ahead of any death, so a replacement costs a swap, not a build.

Prepared at the start of a run (while the role actors are set up) and again after each replacement took a
spare. A spare that fails to get ready is logged, never fatal: a dead proc is then replaced by new procs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from composer_mesh.orchestration.ports import SpareMeshes

log = logging.getLogger("composer_mesh.loop")


class WarmSpares:
    """Starts preparing a spare for each mesh that keeps one (`spawn`: the run's background tasks)."""

    def __init__(self, meshes: SpareMeshes, spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]) -> None:
        self.meshes = meshes
        self.spawn = spawn

    def prepare_all(self) -> None:
        """A spare for every replaceable role's mesh that keeps one."""
        self.prepare(self.meshes.meshes())

    def prepare(self, meshes: set[str]) -> None:
        """Start preparing a warm spare (procs, actors, models) for each of `meshes` that keeps one."""
        for mesh in sorted(meshes):
            if self.meshes.wants_spare(mesh):
                self.spawn(self._prepare(mesh))

    async def _prepare(self, mesh: str) -> None:
        try:
            await self.meshes.prepare(mesh)
        except Exception as e:
            log.warning("preparing a warm spare for mesh %s failed (%s: %s); a dead proc there is replaced by "
                        "new procs instead", mesh, type(e).__name__, e)
