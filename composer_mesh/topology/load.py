"""Reading topology files: `parse_topology` (text) and `load_topology` (a path) validate the whole file and
raise one `TopologyError` listing every problem with its field path, line and column. `overrides` (the CLI's
`--set`, `topology/overrides.py`) change the document before it is validated."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from composer_mesh.topology.checks import cross_check
from composer_mesh.topology.overrides import Override, apply_overrides, relocate
from composer_mesh.topology.schema import Topology
from composer_mesh.topology.yaml_errors import finish, parse_document, read_text, validate_into


def parse_topology(text: str, source: str | None = None, overrides: Sequence[Override] = ()) -> Topology:
    """Validate topology YAML text (with `overrides` applied); raises TopologyError listing every problem with
    its line and column (a problem with an overridden value: its `--set` key)."""
    doc = parse_document(text, source)
    applied = apply_overrides(doc, overrides)
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
