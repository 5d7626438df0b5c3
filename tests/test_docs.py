"""Docs that run: every Python block (```python / ```py) in README.md and docs/*.md is executed here, in a
fresh interpreter with the repository on PYTHONPATH and a temporary working directory that has the checkout's
`topologies/` (snippets use paths as a user in a checkout does), or is marked as an illustration by an
`<!-- illustration -->` line right before it (blank lines between are allowed). A block that is neither cannot
exist: it is run, so it either works or fails this test."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- illustration -->"
FENCE = re.compile(r"^```(python|py|python3)\s*$")
# Optional extras a block may import (pyproject's test extra installs them where they install): without one, its
# block is skipped with the reason, as the extra's own tests are.
OPTIONAL = ("verifiers", "reasoning_gym")
TIMEOUT_S = 300  # the launch.md script starts four meshes (~30 s on an idle machine, 90 s on a loaded one)


@dataclass(frozen=True)
class Block:
    """One Python block: its file, the line of its opening fence, its code and whether it is an illustration."""

    doc: Path
    line: int
    code: str
    illustration: bool

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        if FENCE.match(lines[i]):
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            out.append(Block(doc, i + 1, "\n".join(lines[i + 1 : end]) + "\n", before == MARKER))
        i = end + 1
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]
RUNNABLE = [b for b in ALL if not b.illustration]


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess[str]:
    (cwd / "topologies").symlink_to(ROOT / "topologies")
    script = cwd / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


LAUNCH_SCRIPT = blocks(ROOT / "docs" / "launch.md")[0]
# The launch.md script launches meshes and trains a step (about a minute): the slow tier runs it.
PARAMS = [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b == LAUNCH_SCRIPT else []) for b in RUNNABLE]


@pytest.mark.parametrize("block", PARAMS)
def test_every_unmarked_python_block_runs(block: Block, tmp_path: Path) -> None:
    for module in OPTIONAL:
        if re.search(rf"^\s*(import|from) {module}\b", block.code, re.M) and importlib.util.find_spec(module) is None:
            pytest.skip(f"{block.id} imports {module}, not installed here (an optional extra)")
    result = run_block(block, tmp_path)
    assert result.returncode == 0, f"{block.id} failed (exit {result.returncode}):\n{result.stderr[-3000:]}"
    if block == LAUNCH_SCRIPT:  # the minimal script trained one step and said so
        assert re.search(r"^reward \d\.\d\d, loss -?\d+\.\d{4}, weights v2$", result.stdout, re.M), result.stdout


def test_markers_stand_before_python_blocks_only() -> None:
    """A marker with no Python block after it (a typo'd fence, a moved block) would mark nothing: refused."""
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            if line.strip() == MARKER:
                after = next((s for s in lines[n + 1 :] if s.strip()), "")
                assert FENCE.match(after), f"{doc.relative_to(ROOT)}:{n + 1}: {MARKER} is not followed by a Python block"


def test_the_collector_sees_marked_and_unmarked_blocks(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(f"text\n```python\nprint(1)\n```\n{MARKER}\n\n```py\nundefined_name\n```\n```bash\nls\n```\n")
    found = blocks(doc)
    assert [(b.line, b.illustration, b.code) for b in found] == [(2, False, "print(1)\n"), (7, True, "undefined_name\n")]
    failing = Block(doc, 7, "undefined_name\n", False)
    result = run_block(failing, tmp_path)
    assert result.returncode != 0 and "NameError" in result.stderr  # an unmarked broken block fails its case
