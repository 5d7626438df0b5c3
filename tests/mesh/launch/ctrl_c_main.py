"""Controller script for the Ctrl-C test: launch a topology, print the pids it spawned, wait forever."""

from __future__ import annotations

import asyncio
import os
import sys

from composer_mesh.app.launch import launch
from composer_mesh.roles import ROLES


async def main(path: str) -> None:
    from tests.mesh.launch.probe_actors import ProbeActor

    async with launch(path, actors=dict.fromkeys(ROLES, ProbeActor)) as mesh:
        pids: set[int] = set()
        for role in mesh.roles:
            for w in (await getattr(mesh, role).where.call()).values():
                pids |= {w["pid"], w["ppid"]}
        pids.discard(os.getpid())
        print("READY", *sorted(pids), flush=True)
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
