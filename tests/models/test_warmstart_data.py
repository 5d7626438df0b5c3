"""`model.warmstart.data`: a warm start on the user's own rows. It trains on the data's train rows only (the
held-out split, chosen by a hash of the prompt, never), learns their targets, is cached by the rows' content,
and a topology whose warm start reads `run.data`'s source must hold out the same rows."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from composer_mesh.models.config import ModelConfig, WarmStartConfig
from composer_mesh.models.loading import load_pretrained
from composer_mesh.models.sampling import sample
from composer_mesh.models.tiny import build_tiny
from composer_mesh.models.warmstart import WarmStartDataError, data_pairs
from composer_mesh.tasks import get_task
from composer_mesh.tasks.data import DataConfig, load_prompt_data
from composer_mesh.topology import TopologyError, load_topology
from composer_mesh.topology.overrides import Override

LOCAL = Path(__file__).resolve().parents[2] / "topologies" / "local.yaml"


def _rows(path: Path, n: int = 60) -> Path:
    """Questions starting with 'a' are answered yes, with 'b' no: a rule a tiny model learns in ~100 steps."""
    rng = random.Random(0)
    lines = []
    for i in range(n):
        first = "ab"[i % 2]
        word = first + "".join(rng.choice("cdefg") for _ in range(3))
        lines.append(json.dumps({"prompt": f"{word}?", "completion": "yes" if first == "a" else "no"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _data(path: Path, **fields: object) -> DataConfig:
    return DataConfig(path=str(path), answer="completion", **fields)


def test_only_train_rows_are_trained_on(tmp_path: Path) -> None:
    data = _data(_rows(tmp_path / "rows.jsonl"), eval_size=12)
    split = load_prompt_data(data)
    _, tokenizer = build_tiny(ModelConfig(tokenizer="byte"))
    pairs = data_pairs(data, get_task("addition"), tokenizer)
    prompts = {tokenizer.decode(p) for p, _ in pairs}
    assert prompts == {r.text for r in split.train} and len(pairs) == len(split.train) > 30
    assert not prompts & {r.text for r in split.eval} and len(split.eval) == 12  # disjoint from the held-out rows
    targets = {tokenizer.decode(t) for _, t in pairs}
    assert targets == {"yes;", "no;"}  # the completion column + the task's end marker


def test_the_warm_start_learns_the_rows_and_is_cached_by_their_content(tmp_path: Path) -> None:
    rows = _rows(tmp_path / "rows.jsonl")
    warm = WarmStartConfig(data=_data(rows, eval_size=6), steps=120, batch_size=16, lr=1e-2)
    config = ModelConfig(tokenizer="byte", warmstart=warm)
    model, tokenizer = load_pretrained(config, cache_dir=tmp_path / "cache")
    held_out = load_prompt_data(warm.data).eval  # rows it never saw: the rule generalises to them
    prompts = [tokenizer.encode(r.text, add_special_tokens=False) for r in held_out]
    outs = sample(model, prompts, max_new_tokens=4, temperature=0.0, stop_ids=tokenizer.encode(";"), pad_id=0)
    answers = [tokenizer.decode(o.token_ids) for o in outs]
    assert answers == [f"{r.answer};" for r in held_out], answers
    key = config.cache_key()
    rows.write_text(rows.read_text().replace('"yes"', '"sure"'))
    assert config.cache_key() != key  # other rows at the same path: another model


def test_a_row_without_target_is_named(tmp_path: Path) -> None:
    path = _rows(tmp_path / "rows.jsonl", n=20)
    path.write_text(path.read_text() + json.dumps({"prompt": "zzz?", "completion": None}) + "\n")
    _, tokenizer = build_tiny(ModelConfig(tokenizer="byte"))
    with pytest.raises(WarmStartDataError, match=r"rows.jsonl, row 21: no target \(its 'completion' column"):
        data_pairs(_data(path, eval_size=2), get_task("addition"), tokenizer)


def test_a_warm_start_on_the_runs_data_must_hold_out_the_same_rows(tmp_path: Path) -> None:
    rows = {"path": str(_rows(tmp_path / "rows.jsonl")), "answer": "completion", "eval_size": 8}
    sets = [Override("run.data", rows), Override("model.warmstart", {"steps": 1, "data": rows})]
    topo = load_topology(LOCAL, sets)
    assert topo.model.warmstart is not None and topo.model.warmstart.data == topo.run.data
    other = [*sets, Override("model.warmstart.data.eval_size", 3), Override("model.warmstart.data.answer", "x")]
    with pytest.raises(TopologyError) as info:
        load_topology(LOCAL, other)
    assert [e.format() for e in info.value.errors] == [  # the answer column may differ: it is the target
        "--set model.warmstart.data.eval_size: model.warmstart.data reads run.data's rows but its eval_size differs "
        "from run.data's: it would hold out other rows, and the warm start could train on the run's held-out "
        "prompts; give it run.data's eval_size"]
