"""Backend `local`: procs on the controller's own host (Monarch's `this_host()`); no job to start or end.

`this_host()` has no `hosts` dimension (Monarch's `LocalJob` neither), so procs get one added here: every
backend gives proc meshes the same `{hosts, procs}` shape.
"""

from __future__ import annotations

from typing import Any

from composer_mesh.mesh.jobs.base import JobBase


class LocalJob(JobBase):
    """The controller's host, once per local mesh (each mesh gets its own procs there)."""

    def create(self) -> None:
        """Nothing to start: the host is the controller's."""

    async def wait(self) -> None:
        from monarch.actor import this_host

        self.hosts = {name: this_host() for name in self.specs}

    def spawn_procs(self, mesh: str, per_host: dict[str, int], *, name: str, host: int | None = None,
                    **spawn: Any) -> Any:
        """Procs with a `hosts` dimension of 1; `host` can only be 0, this host."""
        return self.host_mesh(mesh).spawn_procs(per_host={"hosts": 1, **per_host}, name=name, **spawn)

    def stop(self) -> None:
        """Nothing to end: the procs are stopped by launch, the host is the controller's."""
