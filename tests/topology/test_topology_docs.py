"""docs/topology.md is generated from the schema (scripts/render_topology_docs.py); the committed file must be up to date."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "topology.md"
SCRIPT = ROOT / "scripts" / "render_topology_docs.py"


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_topology_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_doc_is_up_to_date() -> None:
    generated = _renderer().render_docs()
    assert DOC.read_text() == generated, (
        "docs/topology.md is stale: run `python scripts/render_topology_docs.py > docs/topology.md`"
    )


def test_doc_shows_real_errors_and_plan() -> None:
    text = _renderer().render_docs()
    assert "$ composer-mesh validate topologies/broken.yaml" in text
    assert "topologies/broken.yaml:18:22: roles.generators.mesh: unknown mesh 'gpus'" in text
    assert "Estimated cost:" in text
    for heading in (
        "#### meshes.&lt;name&gt;.slurm (`SlurmOptions`)",
        "#### loss (",
        "#### teachers `openrouter`",
    ):
        assert heading in text
