"""Reading topology files: `parse_topology` (text) and `load_topology` (a path) validate the whole file and
raise one `TopologyError` listing every problem with its field path, line and column."""

from __future__ import annotations

import os
from pathlib import Path

from composer_mesh.topology.checks import cross_check
from composer_mesh.topology.schema import Topology
from composer_mesh.topology.yaml_errors import finish, parse_document, read_text, validate_into


def parse_topology(text: str, source: str | None = None) -> Topology:
    """Validate topology YAML text; raises TopologyError listing every problem with its line and column."""
    doc = parse_document(text, source)
    topology = validate_into(doc, Topology)
    doc.issues.extend(doc.issue(loc, message) for loc, message in cross_check(doc.data))
    finish(doc.issues, source)
    assert topology is not None
    return topology


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Load and validate a topology file. Raises TopologyError (all problems, with lines) if it is invalid."""
    topology = parse_topology(read_text(path), str(path))
    topology._source = Path(path)
    return topology
