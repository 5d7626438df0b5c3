"""The tiny model: deterministic offline build, char-level tokenizer, cached atomic materialize, warm start."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from composer_mesh.models.config import ModelConfig
from composer_mesh.models.loading import (
    META_FILE,
    cache_root,
    load_pretrained,
    materialize,
    materialized_meta,
)
from composer_mesh.models.tiny import build_tiny
from composer_mesh.models.tokenizer import build_tokenizer, encode_checked
from composer_mesh.tasks.arithmetic import AdditionTask

STUDENT = ModelConfig(warmstart={"steps": 30})  # the same configs as tests/actors/backends: one cache build per session
WELL_TRAINED = ModelConfig(warmstart={"steps": 150})


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "composer_mesh_models")


def state_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


_CHILD = """
import hashlib, json, os, sys, torch
from composer_mesh.models.config import ModelConfig
from composer_mesh.models.loading import materialize
from composer_mesh.models.tiny import build_tiny
cfg = ModelConfig.model_validate_json(sys.argv[1])
model, _ = build_tiny(ModelConfig.model_validate({**cfg.model_dump(), "warmstart": None}))
h = hashlib.sha256()
for name, t in sorted(model.state_dict().items()):
    h.update(name.encode()); h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
path = materialize(cfg, sys.argv[2])
print(json.dumps({"hash": h.hexdigest(), "path": str(path), "pid": os.getpid()}))
"""


def test_same_config_same_weights_across_processes_and_one_concurrent_build(tmp_path):
    cfg = ModelConfig(seed=3, warmstart={"steps": 5})
    cache = str(tmp_path / "cache")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, cfg.model_dump_json(), cache],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)},  # thread count must not change the weights
        )
        for threads in (1, 2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    untrained, _ = build_tiny(ModelConfig(seed=3))
    assert {r["hash"] for r in results} == {state_hash(untrained)}
    assert len({r["path"] for r in results}) == 1
    # Built once (by one of them) and renamed into place: no temporary directories are left behind.
    path = results[0]["path"]
    assert materialized_meta(path)["built_by_pid"] in {r["pid"] for r in results}
    entries = [e for e in os.listdir(cache) if not e.endswith(".lock")]
    assert entries == [os.path.basename(path)]
    # Another seed gives other weights.
    assert state_hash(build_tiny(ModelConfig(seed=4))[0]) != state_hash(untrained)


def test_tokenizer_is_character_level_and_round_trips():
    task = AdditionTask()
    tok = build_tokenizer(task.alphabet)
    assert len(tok) == len(task.alphabet) + 1  # + <|endoftext|>
    ids = tok.encode("3+4=", add_special_tokens=False)
    assert len(ids) == 4 and len(set(ids)) == 4
    assert [tok.decode([i]) for i in ids] == ["3", "+", "4", "="]
    for text in ("12+3=15;", "9+9=18;", task.alphabet):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.decode([tok.eos_token_id, *ids], skip_special_tokens=True) == "3+4="
    with pytest.raises(ValueError, match=r"cannot represent '3\+x=' \(characters not covered: 'x'\)"):
        encode_checked(tok, "3+x=")


def test_materialized_dir_reloads_with_auto_classes(cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = ModelConfig()
    path = materialize(cfg, cache)
    assert materialize(cfg, cache) == path  # reused
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    ref_tok = build_tokenizer(AdditionTask.alphabet)
    assert tok.get_vocab() == ref_tok.get_vocab() and tok.eos_token_id == ref_tok.eos_token_id == 0
    for text in ("3+4=", "17+2=19;"):
        assert tok.encode(text, add_special_tokens=False) == ref_tok.encode(text, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    assert state_hash(model) == state_hash(build_tiny(cfg)[0])
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # vLLM-CPU needs >= 32
    semicolon = tok.encode(";", add_special_tokens=False)[0]
    assert model.generation_config.eos_token_id == [tok.eos_token_id, semicolon]
    assert sorted(os.listdir(path)) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         META_FILE]
    )


def test_cache_dir_defaults_to_env(monkeypatch, tmp_path):
    monkeypatch.setenv("COMPOSER_MESH_CACHE", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x"
    monkeypatch.delenv("COMPOSER_MESH_CACHE")
    assert cache_root() == cache_root(os.path.expanduser("~/.cache/composer_mesh"))


def test_warm_start_teaches_the_task(cache):
    from composer_mesh.models.warmstart import task_accuracy

    task = AdditionTask()
    untrained, tok = load_pretrained(ModelConfig(), cache)
    trained, _ = load_pretrained(WELL_TRAINED, cache)
    before = task_accuracy(untrained, tok, task, n=100, seed=999)
    after = task_accuracy(trained, tok, task, n=100, seed=999)  # prompts drawn apart from the SFT stream
    assert before < 0.2 and after > 0.8, (before, after)
    meta = materialized_meta(materialize(WELL_TRAINED, cache))["warmstart"]
    assert meta["loss_last"] < meta["loss_first"] and meta["accuracy_after"] > 0.8
    # The short warm start gives the weak-but-not-random student the main job starts from.
    student, _ = load_pretrained(STUDENT, cache)
    assert 0.0 < task_accuracy(student, tok, task, n=100, seed=999) < after


def test_local_source_is_used_in_place_or_warm_started(cache):
    base = materialize(ModelConfig(), cache)
    local = ModelConfig(source=str(base))
    assert materialize(local, cache) == base  # no warm start: nothing to write
    tuned_cfg = ModelConfig(source=str(base), warmstart={"steps": 3})
    tuned = materialize(tuned_cfg, cache)
    assert tuned.name.startswith("local-") and tuned != base
    a, _ = load_pretrained(local, cache)
    b, _ = load_pretrained(tuned_cfg, cache)
    assert state_hash(a) != state_hash(b)


def test_dtype_is_applied(cache):
    model, _ = load_pretrained(ModelConfig(dtype="bfloat16"), cache)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
