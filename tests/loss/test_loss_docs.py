"""docs/loss.md carries the current LossConfig knob table."""

from __future__ import annotations

from pathlib import Path

from composer_mesh.loss.config import loss_config_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "loss.md"


def test_docs_knob_table_is_current() -> None:
    text = DOC.read_text()
    begin, end = "<!-- BEGIN loss-config-table -->\n", "\n<!-- END loss-config-table -->"
    assert begin in text and end in text
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table.strip() == loss_config_table().strip(), (
        "docs/loss.md is stale: regenerate the table with `python -m composer_mesh.loss.config`"
    )
