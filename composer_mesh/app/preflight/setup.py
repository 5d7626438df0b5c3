"""Checks of what a topology names outside itself, before launch: environment variables (API keys, storage
credentials), the `python_path:` directories, and the import paths and task names its fields give.

Why before launch: each of these otherwise fails inside an actor after the meshes started (tens of seconds),
as a remote traceback. Each problem is one line naming the field and the fix; an environment variable is named,
its value never read out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from composer_mesh.bindings import import_object
from composer_mesh.errors import UserInputError
from composer_mesh.tasks import get_task
from composer_mesh.topology.schema import Topology

# `package.module:Name`: how every field that names your own code spells it, and the keys of such fields (other
# strings may look alike: a Slurm `gres: gpu:h100`).
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_CODE_KEYS = frozenset({"path", "binding", "agent", "rule"})  # + a harness agent, a hint rule


def setup_problems(topology: Topology) -> list[str]:
    """Every problem with the environment variables, python_path directories, import paths and tasks that
    `topology` names, one line each (empty when all resolve)."""
    tree = topology.model_dump(mode="json")
    given = {name for mesh in topology.meshes.values() for name in mesh.env}  # set for a mesh's procs
    return [*env_var_problems(tree, given), *python_path_problems(topology), *import_problems(tree)]


def walk(tree: Any, where: str = "") -> Iterator[tuple[str, str, Any]]:
    """(field path, key, value) of every field of a dumped topology, depth first, in file order."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            path = f"{where}.{key}" if where else str(key)
            yield path, str(key), value
            yield from walk(value, path)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from walk(value, f"{where}[{i}]")


def env_var_problems(tree: dict[str, Any], given: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Fields named `*_env` hold environment variable NAMES (a name, or option → name): each must be set and
    non-empty here, where the procs inherit it from, or be `given` to the procs by a mesh's `env:`."""
    problems = []
    for where, key, value in walk(tree):
        if not key.endswith("_env"):
            continue
        named = {where: value} if isinstance(value, str) else \
            {f"{where}[{k!r}]": v for k, v in value.items()} if isinstance(value, dict) else {}
        for field, name in named.items():
            if isinstance(name, str) and name not in given and not os.environ.get(name, "").strip():
                problems.append(f"{field} names the environment variable {name}, which is not set (or empty): "
                                f"export {name} before the run (its value is never printed)")
    return problems


def python_path_problems(topology: Topology) -> list[str]:
    """Each `python_path:` entry must be a directory (relative to the topology file)."""
    base = topology.source.parent if topology.source is not None else Path.cwd()
    problems = []
    for i, entry in enumerate(topology.python_path):
        directory = (base / Path(entry).expanduser()).resolve()
        if not directory.is_dir():
            problems.append(f"python_path[{i}]: {directory} is not a directory (entries are relative to the "
                            "topology file)")
    return problems


def import_problems(tree: dict[str, Any]) -> list[str]:
    """Every task name (`*.task`) resolves to a task, and every `pkg.mod:Name` in a `path` or `binding` field
    (reward functions, bindings) imports."""
    problems = []
    for where, key, value in walk(tree):
        if not isinstance(value, str):
            continue
        try:
            if key == "task":
                get_task(value)
            elif key in _CODE_KEYS and _IMPORT_PATH.match(value):
                import_object(value)
        except UserInputError as e:  # BindingError: says how to add your own module's directory
            problems.append(f"{where}: {e}")
    return problems
