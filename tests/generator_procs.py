"""A generator actor in a test module's own Monarch proc: the proc (with Monarch's fault hook turned into a list the
module checks) and the generators' role config of a small topology, as the launcher hands it to the actor."""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator
from typing import Any

from composer_mesh.mesh import runtime  # first: sets Monarch env defaults before monarch is imported


@contextlib.contextmanager
def one_proc(name: str, faults: list[Any]) -> Iterator[Any]:
    """One proc on this host. While it lives an actor fault is appended to `faults` (a test fails on it) instead
    of Monarch's default hook exiting the pytest session; installed here, not at import, so that a hook set during
    collection does not collect other modules' faults."""
    import monarch.actor
    from monarch.actor import this_host

    previous_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append
    faults.clear()
    pm = this_host().spawn_procs(per_host={"procs": 1}, name=name, bootstrap=runtime.proc_setup)
    yield pm
    pm.stop().get()
    monarch.actor.unhandled_fault_hook = previous_hook


def generators_config(name: str, generators: str, weights: str = "{transport: auto}") -> Any:
    """The generators' role config of `small_topology(name, generators, weights)`."""
    return small_topology(name, generators, weights).role_configs()["generators"]


def small_topology(name: str, generators: str, weights: str = "{transport: auto}") -> Any:
    """A topology on the tiny addition model with `generators` (a YAML flow mapping: mesh, binding, settings) and
    `weights`; the other roles are the cheapest real ones."""
    from composer_mesh.topology import parse_topology

    text = textwrap.dedent(
        f"""
        name: {name}
        model: {{source: tiny, task: addition, seed: 4}}
        meshes:
          trainer: {{backend: local}}
          generators: {{backend: local}}
          rewarder: {{backend: local}}
        roles:
          trainer: {{mesh: trainer, binding: hf}}
          generators: {generators}
          rewarder:
            mesh: rewarder
            binding: python
            settings: {{functions: [{{path: "composer_mesh.tasks.arithmetic:exact_match"}}]}}
        loss: {{alpha_sdpo: 0.0, beta_replay: 0.0}}
        weights: {weights}
        """
    )
    return parse_topology(text, source="<test>")
