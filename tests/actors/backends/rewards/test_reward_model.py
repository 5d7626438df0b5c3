"""The `reward_model` rewarder: a sequence-classification directory (a tiny Qwen2 with the byte tokenizer,
built offline here) scores (prompt, completion) pairs as TRL does, logits[:, 0] of prompt + completion, in
padded batches equal to one forward per pair; through a real rewarder actor on a Monarch proc too. A bad
directory is a one-line validation error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from composer_mesh.actors.backends.rewards.config import RewardModelSettings
from composer_mesh.actors.messages import Prompt, Rollout, RolloutGroup
from composer_mesh.models.tokenizer import build_byte_tokenizer
from composer_mesh.roles import resolve_binding


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_byte_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
                         pad_token_id=int(tokenizer.pad_token_id))
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    path = tmp_path_factory.mktemp("rm") / "reward-model"
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def rollout(text: str) -> Rollout:
    return Rollout(prompt_id="p0", prompt_ids=[1], completion_ids=[2], logprobs=[0.0], weight_version=0, text=text)


PAIRS = [(Prompt("p0", "3+4=", [], "7"), rollout("7;")), (Prompt("p1", "12+30=", [], "42"), rollout("41 or so;")),
         (Prompt("p2", "1+1=", [], "2"), rollout(""))]


def direct(path: Path, text: str) -> float:
    """One unpadded forward of the saved model on `text`: what each batched score must equal."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    ids = AutoTokenizer.from_pretrained(str(path))(text, add_special_tokens=False, return_tensors="pt")
    with torch.inference_mode():
        return float(model(**ids).logits[0, 0])


def test_scores_are_the_models_logit_of_prompt_plus_completion_in_padded_batches(model_dir: Path):
    binding = resolve_binding("rewarder", "reward_model")
    rewarder = binding.build({"path": str(model_dir), "batch_size": 2})  # 3 pairs: a batch of 2 and one of 1
    results = rewarder.score_batch(PAIRS)
    expected = [direct(model_dir, p.text + r.text) for p, r in PAIRS]
    assert all(r.ok for r in results)
    assert [r.score for r in results] == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == 3  # the pairs differ: a wrong pairing or padding would show
    assert results[0].components == {"reward_model": results[0].score}
    assert (rewarder.calls, rewarder.failures) == (3, 0)


@pytest.mark.gpu
def test_on_a_gpu_the_scores_are_the_cpus(model_dir: Path):
    cpu = resolve_binding("rewarder", "reward_model").build({"path": str(model_dir)})
    gpu = resolve_binding("rewarder", "reward_model").build({"path": str(model_dir), "device": "cuda"})
    assert next(gpu.model.parameters()).device.type == "cuda"
    assert [r.score for r in gpu.score_batch(PAIRS)] == pytest.approx([r.score for r in cpu.score_batch(PAIRS)],
                                                                      abs=1e-4)
    gpu.close()


def test_a_chat_prompt_is_read_through_the_models_chat_template(model_dir: Path):
    rewarder = resolve_binding("rewarder", "reward_model").build({"path": str(model_dir)})
    chat = Prompt("p0", "3+4=", [], "7", messages=[{"role": "user", "content": "3+4="}])
    [text] = rewarder.texts([(chat, rollout("7;"))])
    assert text == rewarder.tokenizer.apply_chat_template(
        [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7;"}], tokenize=False)
    assert rewarder.score(chat, rollout("7;")).score == pytest.approx(direct(model_dir, text), abs=1e-5)


def test_a_bad_directory_is_a_one_line_error(tmp_path: Path, model_dir: Path):
    from composer_mesh.models.small import build_small_model_dir

    causal = build_small_model_dir(tmp_path / "causal", hidden_size=16, num_layers=1)
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((model_dir / "config.json").read_text())
    cases = {
        str(tmp_path / "missing"): "no config.json there",
        str(causal): "is not a sequence-classification model (architectures: ['LlamaForCausalLM'])",
        str(no_tokenizer): "has no tokenizer files",
    }
    for path, problem in cases.items():
        with pytest.raises(ValidationError) as e:
            RewardModelSettings(path=path)
        [error] = e.value.errors()
        assert problem in error["msg"] and "\n" not in error["msg"]
    with pytest.raises(ValidationError, match="device 'gpu': give 'cpu', 'cuda' or 'cuda:N'"):
        RewardModelSettings(path=str(model_dir), device="gpu")
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]



async def test_a_real_rewarder_actor_scores_groups_with_the_model(rewarder_procs, model_dir: Path):
    from composer_mesh.actors.configs import RewarderConfig
    from composer_mesh.actors.rewarder import RewarderActor
    from composer_mesh.bindings import BoundBinding

    binding = resolve_binding("rewarder", "reward_model")
    bound = BoundBinding("reward_model", binding.import_path, binding.parse_settings({"path": str(model_dir)}))
    actor = rewarder_procs.spawn("rewarder", RewarderActor, RewarderConfig("rewarder", "rewarder", bound))
    groups = [RolloutGroup(p, [r, rollout("x")]) for p, r in PAIRS[:2]]
    scored = await actor.score.call_one(groups)
    got = [rw.score for g in scored for rw in g.rewards]
    expected = [direct(model_dir, p.text + t) for p, r in PAIRS[:2] for t in (r.text, "x")]
    assert got == pytest.approx(expected, abs=1e-5)
    assert await actor.stats.call_one() == {"calls": 4.0, "failures": 0.0}
    await actor.stop()
