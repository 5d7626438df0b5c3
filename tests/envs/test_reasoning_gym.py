"""reasoning-gym as a run's environment, with the real library (no fakes): prompts are the library's entries, train
and eval share no question, the library's own `score_answer` scores completions (also through the `python`
rewarder's worker processes), the stream survives a checkpoint, the topology validates, and a few RL steps run
on CPU with every loss channel on real Monarch meshes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import reasoning_gym
import yaml
from pydantic import ValidationError

from composer_mesh.actors.messages import Prompt
from composer_mesh.envs.reasoning_gym import score
from composer_mesh.envs.tasks import TINY_ADDITION, tiny_addition
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.prompts import EnvironmentPrompts, PromptSourceError, prompt_source
from envs.e2e import run_every_channel, scores_in_workers, shortened

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "topologies" / "reasoning_gym.yaml"
CHAIN = {"kind": "reasoning_gym", "dataset": "chain_sum", "config": {"min_terms": 2, "max_terms": 3}, "size": 500,
         "eval_size": 32}


def source(env: dict, **run) -> EnvironmentPrompts:
    src = prompt_source(RunConfig(environment=env, **run))
    assert isinstance(src, EnvironmentPrompts)
    return src


def test_prompts_are_the_librarys_entries_as_chat_with_json_extra() -> None:
    src = source({**CHAIN, "seed": 7}, eval_prompts=4)
    library = reasoning_gym.create_dataset("chain_sum", min_terms=2, max_terms=3, seed=7, size=500)
    prompts = src.take(5)
    assert [p.prompt_id for p in prompts] == ["p0", "p1", "p2", "p3", "p4"]
    for p in prompts:
        where = p.extra["reasoning_gym"]
        entry = library[where["index"]]
        assert (p.text, p.answer) == (entry["question"], entry["answer"])
        system = reasoning_gym.utils.SYSTEM_PROMPTS["default"]  # the default asks for <answer> tags
        assert p.messages == [{"role": "system", "content": system}, {"role": "user", "content": entry["question"]}]
        assert json.loads(json.dumps(p.extra)) == p.extra  # crosses to the reward workers as JSON
        assert where == {"dataset": "chain_sum", "config": {"min_terms": 2, "max_terms": 3}, "seed": 7,
                         "size": 500, "index": where["index"]}
    assert [p.prompt_id for p in src.eval_prompts(3)] == ["eval0", "eval1", "eval2"]


def test_train_and_eval_share_no_question() -> None:
    # 121 distinct questions: train entries hit the 16 eval questions often, and are skipped.
    small = source(TINY_ADDITION.model_dump(), eval_prompts=16)
    eval_texts = {p.text for p in small.eval_prompts(16)}
    assert len(eval_texts) == 16
    train = small.take(400)
    while small.env.position < TINY_ADDITION.size:  # one whole pass over the train entries
        train += small.take(1)
    train_texts = {p.text for p in train}
    assert not train_texts & eval_texts
    assert small.env.skipped > 0 and small.env.position == len(train) + small.env.skipped
    library = reasoning_gym.create_dataset("basic_arithmetic", **TINY_ADDITION.config, seed=0, size=1000)
    assert train_texts == {library[i]["question"] for i in range(1000)} - eval_texts  # all the others, in a pass
    # A large question space: different seeds for the two sets, and still no overlap.
    big = source(CHAIN, eval_prompts=32)
    seeds = {p.extra["reasoning_gym"]["seed"] for p in big.eval_prompts(32)}
    assert seeds == {10**9} and {p.extra["reasoning_gym"]["seed"] for p in big.take(50)} == {0}
    assert not {p.text for p in big.take(450)} & {p.text for p in big.eval_prompts(32)}
    # The eval set is fixed: the same on every call and in every run with the settings.
    assert [p.text for p in big.eval_prompts(8)] == [p.text for p in source(CHAIN).eval_prompts(8)]


def _prompt(src: EnvironmentPrompts) -> Prompt:
    return src.take(1)[0]


def test_the_librarys_score_answer_scores_the_last_answer_tag() -> None:
    p = _prompt(source(CHAIN, eval_prompts=0))
    assert p.answer is not None
    assert score(p.text, f"Adding up... <answer>{p.answer}</answer>", p.answer, p.extra) == 1.0
    wrong = str(int(p.answer) + 1)
    assert score(p.text, f"<answer>{wrong}</answer>", p.answer, p.extra) == 0.0
    assert score(p.text, f"<answer>{wrong}</answer> no: <answer>{p.answer}</answer>", p.answer, p.extra) == 1.0
    assert score(p.text, p.answer, p.answer, p.extra) == 0.0  # no tags: no answer
    # chain_sum's own scoring tolerates what its docs say it does ("+01,000.00" == "1000").
    assert score(p.text, f"<answer>{p.answer}.00</answer>", p.answer, p.extra) == 1.0
    with pytest.raises(ValueError, match="no extra"):
        score(p.text, "<answer>1</answer>", p.answer, {})
    moved = {"reasoning_gym": {**p.extra["reasoning_gym"], "index": p.extra["reasoning_gym"]["index"] + 1}}
    with pytest.raises(ValueError, match="regenerates another question"):
        score(p.text, f"<answer>{p.answer}</answer>", p.answer, moved)


def test_scoring_uses_the_exact_entry_not_a_json_copy() -> None:
    """arc_agi's metadata holds tuples: a JSON copy of the entry scores its own reference answer 0.05."""
    arc = {"kind": "reasoning_gym", "dataset": "arc_agi", "size": 20, "eval_size": 2}
    p = _prompt(source(arc, eval_prompts=0))
    library = reasoning_gym.create_dataset("arc_agi", seed=0, size=20)
    entry = library[p.extra["reasoning_gym"]["index"]]
    assert library.score_answer(entry["answer"], json.loads(json.dumps(entry))) < 1.0
    assert score(p.text, f"<answer>{p.answer}</answer>", p.answer, p.extra) == 1.0


def test_python_rewarder_scores_with_the_library_in_its_workers() -> None:
    p = _prompt(source(CHAIN, eval_prompts=0))
    right, wrong = f"<answer>{p.answer}</answer>", "<answer>-1</answer>"
    assert scores_in_workers(p, (right, wrong, "I think 3"), "composer_mesh.envs.reasoning_gym:score") == [1.0, 0.0, 0.0]


def test_state_restores_the_stream_and_refuses_another_environment() -> None:
    a = source(TINY_ADDITION.model_dump(), eval_prompts=4)
    a.take(30)
    state = json.loads(json.dumps(a.state()))  # as in controller.json
    b = source(TINY_ADDITION.model_dump(), eval_prompts=4)
    b.restore(state)
    assert [(p.prompt_id, p.text) for p in b.take(20)] == [(p.prompt_id, p.text) for p in a.take(20)]
    other = source({**TINY_ADDITION.model_dump(), "seed": 1}, eval_prompts=4)
    with pytest.raises(PromptSourceError, match=r"run\.environment, the seed or reasoning-gym changed"):
        other.restore(state)
    with pytest.raises(PromptSourceError, match="'task' source"):
        b.restore({"kind": "task", "count": 0, "rng": []})


def test_config_errors_are_named() -> None:
    with pytest.raises(ValidationError, match=r"set seed as run\.environment\.seed"):
        RunConfig(environment={**CHAIN, "config": {"seed": 3}})
    with pytest.raises(ValidationError, match=r"run\.environment and run\.data are two prompt sources"):
        RunConfig(environment=CHAIN, data={"path": "x.jsonl"})
    with pytest.raises(ValidationError, match=r"run\.environment and run\.task"):
        RunConfig(environment=CHAIN, task="pkg.mod:Task")
    with pytest.raises(ValueError, match="cannot create dataset 'no_such_set'"):
        source({**CHAIN, "dataset": "no_such_set", "config": {}})
    with pytest.raises(ValueError, match=r"cannot create dataset 'chain_sum'.*colour"):
        source({**CHAIN, "config": {"colour": "red"}})
    with pytest.raises(PromptSourceError, match="has no eval set"):
        source({**CHAIN, "eval_size": 0}, eval_prompts=4)
    assert source({**CHAIN, "eval_size": 0}, eval_prompts=0).eval_prompts(0) == []


def _topology_data() -> dict:
    return yaml.safe_load(TOPOLOGY.read_text())


def test_topology_validates_with_every_channel_and_the_warm_start_tasks_environment() -> None:
    from composer_mesh.topology import load_topology

    t = load_topology(TOPOLOGY)
    assert t.run.environment == TINY_ADDITION  # the warm starts' task draws from exactly this environment
    assert tiny_addition.cfg == TINY_ADDITION
    assert t.model.tokenizer == "byte" and t.model.warmstart is not None
    assert t.loss.alpha_sdpo > 0 and t.loss.beta_replay > 0 and t.loss.kl_beta > 0
    assert t.teachers is not None and [set(m.channels) for m in t.teachers.members] == [{"distill", "replay"}]
    assert t.teachers.members[0].settings.model.tokenizer == "byte"  # channel 2 needs the student's tokenizer
    assert t.rewarder.settings.functions[0].path == "composer_mesh.envs.reasoning_gym:score"
    assert all(m.backend == "local" and m.gpus_held == 0 for m in t.meshes.values())


@pytest.mark.e2e  # a shipped topology run end to end: its own tier (`pytest -m e2e`), run by .ci/run
async def test_a_few_steps_on_cpu_with_every_loss_channel(tmp_path: Path) -> None:
    """The shipped topology, shortened (smaller warm starts and batches), on real local Monarch meshes."""
    data = shortened(TOPOLOGY, tmp_path)
    data["model"]["warmstart"].update(steps=10, batch_size=16)
    # A 40-step teacher is right on few questions (mostly one answer), but 24 prompts hold some of them, so
    # channel 3 gets pairs; the full topology's teacher trains 300 steps.
    data["roles"]["teachers"]["members"][0]["settings"]["model"]["warmstart"].update(steps=40, batch_size=32)
    await run_every_channel(data, TOPOLOGY)
