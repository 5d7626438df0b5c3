"""The run's status line while its actors build models: what the warm starts report (`models.build_progress`).

A first run of `topologies/agentic.yaml` trains two warm starts for minutes inside the actors' processes; without
this, its only line for that time is "setting up actors (building models)…". Local meshes share the
controller's disk, so the controller reads the builders' progress files under the cache roots the topology's
bindings use. On other hosts there is nothing to read and the status stays as it was.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from composer_mesh.models.build_progress import builds_in_progress, describe
from composer_mesh.models.loading import cache_root
from composer_mesh.topology import Topology


def model_cache_roots(topology: Topology) -> list[Path]:
    """Where the topology's local-model bindings build their models: each one's `cache_dir`, and the default."""
    roles = topology.roles
    specs = [roles.trainer, roles.generators, *(roles.teachers.members if roles.teachers else [])]
    dirs = [None, *(getattr(spec.settings, "cache_dir", None) for spec in specs)]
    return list(dict.fromkeys(cache_root(d) for d in dirs))


async def show_builds(set_status: Callable[[str], None], roots: list[Path], every_s: float = 1.0) -> None:
    """Until cancelled: every `every_s`, set the status to the builds in progress when what it says changed
    (whole tenths of each warm start, so a log gets a line per tenth)."""
    said = ""
    while True:
        text = describe(builds_in_progress(roots))
        if text and text != said:
            set_status(f"setting up actors: {text}…")
            said = text
        await asyncio.sleep(every_s)
