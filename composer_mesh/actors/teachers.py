"""TeacherPoolActor: the teacher pool on one proc. Members are spread round-robin over the mesh's procs."""

from __future__ import annotations

import asyncio

from monarch.actor import concurrent_endpoint, endpoint

from composer_mesh.actors.configs import TeacherMemberConfig, TeachersConfig
from composer_mesh.actors.messages import TeacherRequest, TeacherSignals
from composer_mesh.actors.position import actor_position
from composer_mesh.actors.role_actor import RoleActor
from composer_mesh.actors.teacher_pool import PoolMember, TeacherPool


def members_for_rank(
    members: tuple[TeacherMemberConfig, ...], rank: int, size: int
) -> list[TeacherMemberConfig]:
    """The teachers hosted by proc `rank` of `size` (round-robin)."""
    return [m for i, m in enumerate(members) if i % size == rank]


class TeacherPoolActor(RoleActor[TeacherPool]):
    def __init__(self, config: TeachersConfig) -> None:
        super().__init__()
        self.config = config

    @endpoint
    async def setup(self) -> list[str]:
        rank, size = actor_position()
        mine = members_for_rank(self.config.members, rank, size)
        pool = TeacherPool(
            [PoolMember(m.name, frozenset(m.channels), m.binding.build(), m.on_failure) for m in mine]
        )
        await asyncio.to_thread(pool.start, self.config.student)
        self._service = pool
        return [m.name for m in mine]

    @concurrent_endpoint
    async def signals(self, request: TeacherRequest) -> TeacherSignals:
        """This proc's members' signals. Raises `TeacherFailed` (an unavailable `on_failure: stop` member) or a
        binding's bug; the controller gets it as an endpoint error and the run stops."""
        return await self.service.signals(request)

    @endpoint
    async def usage(self) -> dict[str, float]:
        return self.service.usage()
