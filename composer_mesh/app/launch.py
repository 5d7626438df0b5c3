"""Launch a topology: every mesh it declares, one actor mesh per role, typed handles, guaranteed cleanup.

    from composer_mesh.api import launch

    async with launch("topologies/local.yaml") as mesh:
        metrics = await mesh.trainer.train_step.call_one(batch)
        rollouts = await mesh.generators.generate.call(prompts)

Each role's actor class (`composer_mesh.roles.ROLE_TABLE`) is spawned on every proc of the role's mesh
with the config `Topology.role_configs()` builds for it: exactly the sections it needs. Meshes, jobs,
failures and cleanup are `composer_mesh.mesh.launch`'s (see there).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

from composer_mesh.bindings import BindingError, import_object
from composer_mesh.mesh.launch import ActorPlacement, LaunchError, check_actor_class, launch_meshes
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.roles import ROLE_TABLE, ROLES, Role, RoleMesh
from composer_mesh.topology import Topology, load_topology


def launch(
    topology: str | os.PathLike[str] | Topology,
    *,
    actors: Mapping[str, type | str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    ready_timeout: float = 900.0,
    stop_timeout: float = 30.0,
) -> AbstractAsyncContextManager[RoleMesh]:
    """Launch `topology` (a YAML path or a `Topology`) for the duration of an `async with` block.

    actors: per-role actor class (or `"module:Class"`) replacing the role's default, e.g. probe actors
        in tests. Classes must live in an importable module (procs import them by reference); each is
        constructed with the role's config (`composer_mesh.actors.configs`).
    log_dir, ready_timeout, stop_timeout: see `composer_mesh.mesh.launch.launch_meshes`.
    """
    topo = _load(topology)
    placements = role_placements(topo, actors)
    return _launch(topo, placements, log_dir, ready_timeout, stop_timeout)


@asynccontextmanager
async def _launch(
    topo: Topology,
    placements: list[ActorPlacement],
    log_dir: str | os.PathLike[str] | None,
    ready_timeout: float,
    stop_timeout: float,
) -> AsyncIterator[RoleMesh]:
    async with launch_meshes(
        topo.meshes,
        placements,
        run_name=topo.name,
        log_dir=log_dir,
        ready_timeout=ready_timeout,
        stop_timeout=stop_timeout,
    ) as launched:
        yield RoleMesh(launched, topo.name, topo.roles.trainer.procs_per_replica)


def role_placements(topo: Topology, actors: Mapping[str, type | str] | None = None) -> list[ActorPlacement]:
    """One placement per role the topology declares: its actor class on its mesh, with its config."""
    overrides = dict(actors or {})
    unknown = sorted(set(overrides) - set(ROLES))
    if unknown:
        raise LaunchError(f"actors= names unknown role(s) {unknown}; roles are {', '.join(ROLES)}")
    placements = []
    for role, config in topo.role_configs().items():
        cls = _actor_class(role, overrides.get(role))
        placements.append(ActorPlacement(name=role, mesh=config.mesh, actor_class=cls, args=(config,)))
    return placements


def _actor_class(role: Role, override: type | str | None) -> type:
    target = ROLE_TABLE[role].actor if override is None else override
    if isinstance(target, str):
        try:
            target = import_object(target)
        except BindingError as e:
            hint = " (the default; pass actors={...} to override)" if override is None else ""
            raise LaunchError(f"actor class for role {role!r}{hint}: {e}") from e
    return check_actor_class(role, target)


def _load(topology: str | os.PathLike[str] | Topology) -> Topology:
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, (str, os.PathLike)):
        return load_topology(Path(topology))
    raise LaunchError(f"launch() needs a topology file path or a Topology, got {type(topology).__name__}")


def run_config(topology: Topology) -> RunConfig:
    """The topology's `run:` section with what only the model knows filled in: an episode run's
    `rollout.max_context` defaults to the policy's context length (so the driver ends an episode that would not
    fit, instead of a generator refusing its turn)."""
    run = topology.run
    if run.rollout.kind == "single_turn" or run.rollout.max_context is not None:
        return run
    from composer_mesh.models.compat import context_length

    rollout = run.rollout.model_copy(update={"max_context": context_length(topology.model)})
    return run.model_copy(update={"rollout": rollout})
