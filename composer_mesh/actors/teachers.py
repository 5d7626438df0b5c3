"""TeacherPoolActor: the teacher pool on one proc. Members are spread round-robin over the mesh's procs."""

from __future__ import annotations

import asyncio
from typing import Any

from monarch.actor import Actor, concurrent_endpoint, endpoint

from composer_mesh.actors.messages import TeacherRequest, TeacherSignals
from composer_mesh.actors.position import actor_position
from composer_mesh.actors.teacher_pool import PoolMember, TeacherPool
from composer_mesh.mesh.launch import RoleConfig


def members_for_rank(topology: Any, rank: int, size: int) -> list[Any]:
    """The teacher specs hosted by proc `rank` of `size` (round-robin)."""
    return [m for i, m in enumerate(topology.teachers.members) if i % size == rank]


class TeacherPoolActor(Actor):
    def __init__(self, config: RoleConfig) -> None:
        self.topology = config.topology
        self.pool: TeacherPool | None = None

    def _pool(self) -> TeacherPool:
        if self.pool is None:
            raise RuntimeError("TeacherPoolActor.setup() was not called")
        return self.pool

    @endpoint
    async def ready(self) -> bool:
        """Answered once `__init__` succeeded: the launcher waits for it on every actor."""
        return True

    @endpoint
    async def setup(self) -> list[str]:
        rank, size = actor_position()
        specs = members_for_rank(self.topology, rank, size)
        pool = TeacherPool([PoolMember(s.name, frozenset(s.channels), s.build()) for s in specs])
        await asyncio.to_thread(pool.start, self.topology.model)
        self.pool = pool
        return [s.name for s in specs]

    @concurrent_endpoint
    async def signals(self, request: TeacherRequest) -> TeacherSignals:
        return await self._pool().signals(request)

    @endpoint
    async def usage(self) -> dict[str, float]:
        return self._pool().usage()
