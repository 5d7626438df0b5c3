"""The two reward signatures' examples in docs/bindings.md run: written to a module, named by import path in a
`python` rewarder, each scores as the page says (the batched one once per batch, None left out)."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from composer_mesh.actors.backends.rewards.rewards import PythonRewarder, PythonRewarderSettings
from composer_mesh.actors.messages import Prompt, Rollout

DOC = Path(__file__).parents[4] / "docs" / "bindings.md"


def signature_examples() -> str:
    """The Python blocks of the section "Two signatures: per rollout, or TRL's batched one"."""
    text = DOC.read_text()
    section = text.split("### Two signatures: per rollout, or TRL's batched one", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    return "\n\n".join(blocks)


@pytest.fixture
def doc_module(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "doc_rewards.py").write_text(signature_examples())
    sys.path.insert(0, str(tmp_path))  # the rewarder's workers get the parent's import path
    yield "doc_rewards"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("doc_rewards", None)


def test_both_documented_signatures_score(doc_module: str):
    settings = PythonRewarderSettings(functions=[{"path": f"{doc_module}:exact"},
                                                 {"path": f"{doc_module}:contains_answer", "weight": 0.5}])
    assert [f.style for f in settings.functions] == ["rollout", "batch"]
    rewarder = PythonRewarder(settings)
    try:
        def ro(text: str) -> Rollout:
            return Rollout(prompt_id="p", prompt_ids=[], completion_ids=[1], logprobs=[0.0], weight_version=0,
                           text=text)

        seven, no_answer = Prompt("p0", "3+4=", [], "7"), Prompt("p1", "hi", [], None)
        right, close, free = rewarder.score_batch([(seven, ro("7;")), (seven, ro("17;")), (no_answer, ro("x"))])
        assert (right.score, right.components) == (1.5, {"exact": 1.0, "contains_answer": 1.0})
        assert (close.score, close.components) == (0.5, {"exact": 0.0, "contains_answer": 1.0})
        assert free.ok and free.components == {"exact": 0.0}  # the batched one gave None: left out
    finally:
        rewarder.close()
