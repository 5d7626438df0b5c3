"""Reading topology files: `parse_topology` (text) and `load_topology` (a path) validate the whole file and
raise one `TopologyError` listing every problem with its field path, line and column. `overrides` (the CLI's
`--set`, `topology/overrides.py`) change the document before it is validated."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer_mesh.topology.checks import cross_check
from composer_mesh.topology.overrides import Override, apply_overrides, relocate
from composer_mesh.topology.schema import Topology
from composer_mesh.topology.yaml_errors import finish, parse_document, read_text, validate_into


def parse_topology(text: str, source: str | None = None, overrides: Sequence[Override] = ()) -> Topology:
    """Validate topology YAML text (with `overrides` applied); raises TopologyError listing every problem with
    its line and column (a problem with an overridden value: its `--set` key)."""
    doc = parse_document(text, source)
    applied = apply_overrides(doc, overrides)
    add_python_path(_listed_dirs(doc.data), Path(source).parent if source else Path.cwd())
    topology = validate_into(doc, Topology)
    doc.issues.extend(doc.issue(loc, message) for loc, message in cross_check(doc.data))
    finish(relocate(doc.issues, applied), source)
    assert topology is not None
    return topology


def load_topology(path: str | os.PathLike[str], overrides: Sequence[Override] = ()) -> Topology:
    """Load and validate a topology file (with `overrides` applied). Raises TopologyError (all problems, with
    lines) if it is invalid."""
    topology = parse_topology(read_text(path), str(path), overrides)
    topology._source = Path(path)
    return topology


def add_python_path(dirs: Sequence[str | os.PathLike[str]], base: Path | None = None) -> list[str]:
    """Put `dirs` (relative to `base`, default the working directory) first on `sys.path` and on `PYTHONPATH`,
    which the launcher forwards to every proc: the user's own modules import in the controller and in every
    actor alike. Directories already there are not added twice. Returns the absolute directories."""
    added = [str(((base or Path.cwd()) / Path(d).expanduser()).resolve()) for d in dirs]
    for directory in reversed(added):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    env = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*[d for d in added if d not in env], *env])
    return added


def _listed_dirs(data: Any) -> list[str]:
    """The file's `python_path:` entries, read before validation (which resolves import paths that may need
    them); a malformed value is left to validation to report with its line."""
    listed = data.get("python_path") if isinstance(data, dict) else None
    return [d for d in listed if isinstance(d, str)] if isinstance(listed, list) else []
