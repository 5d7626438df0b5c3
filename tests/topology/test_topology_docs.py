"""docs/topology.md is generated from the schema; the committed file must be up to date."""

from __future__ import annotations

from pathlib import Path

from composer_mesh.topology import render_docs

DOC = Path(__file__).resolve().parents[2] / "docs" / "topology.md"


def test_committed_doc_is_up_to_date() -> None:
    generated = render_docs()
    assert DOC.read_text() == generated, (
        "docs/topology.md is stale: run `python -m composer_mesh.topology --docs > docs/topology.md`"
    )


def test_doc_shows_real_errors_and_plan() -> None:
    text = render_docs()
    assert "$ composer-mesh validate topologies/broken.yaml" in text
    assert "topologies/broken.yaml:18:22: roles.generators.mesh: unknown mesh 'gpus'" in text
    assert "Estimated cost:" in text
    for heading in (
        "#### meshes.&lt;name&gt;.slurm (`SlurmOptions`)",
        "#### loss (",
        "#### teacher `openrouter`",
    ):
        assert heading in text
