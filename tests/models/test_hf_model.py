"""Bring your own model: a transformers directory of a real architecture (Llama, built offline with the byte
tokenizer) as `model.source`, checked before launch against its teachers and the run, and trained with LoRA
and every loss channel by the shipped topology, shortened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_mesh.app.preflight import ModelPreflightError, check_models
from composer_mesh.models.small import build_small_model_dir, main
from composer_mesh.topology import load_topology, parse_topology

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "topologies" / "hf_model.yaml"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_model_dir(tmp_path_factory.mktemp("byo") / "small-llama")


def test_the_small_model_is_a_plain_transformers_llama_with_a_chat_template(llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == len(tokenizer) == 259
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Calculate 3 + 7."}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id


def test_the_builder_refuses_to_overwrite_a_model(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([str(llama_dir)])
    assert "already holds a model" in capsys.readouterr().err


def topology_text(model_dir: Path) -> str:
    """The shipped topology with its model directory (policy and teacher) at `model_dir`."""
    return TOPOLOGY.read_text().replace("source: models/small-llama", f"source: {model_dir}")


def test_the_shipped_topology_reads_the_model_from_the_directory_it_runs_in(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(llama_dir.parent.parent)
    (llama_dir.parent.parent / "models").mkdir(exist_ok=True)
    link = llama_dir.parent.parent / "models" / "small-llama"
    if not link.exists():
        link.symlink_to(llama_dir)
    t = load_topology(TOPOLOGY)
    assert Path(t.model.source) == link.resolve()
    assert t.roles.trainer.settings.lora is not None and t.roles.trainer.settings.lora.sync == "merged"
    assert t.loss.alpha_sdpo > 0 and t.loss.beta_replay > 0 and t.loss.kl_beta > 0
    check_models(t)  # one tokenizer for the policy and its distill teacher: nothing to report


def test_a_distill_teacher_with_another_tokenizer_is_refused_before_launch(llama_dir: Path) -> None:
    text = topology_text(llama_dir)
    # The teacher becomes the built-in tiny model with a character tokenizer of the addition task.
    text = text.replace(f"""          model:
            source: {llama_dir}
            task: "composer_mesh.envs.tasks:tiny_addition"
            warmstart: {{task: "composer_mesh.envs.tasks:tiny_addition", steps: 300}}""",
                        """          model: {source: tiny, task: addition}""")
    assert "source: tiny" in text
    with pytest.raises(ModelPreflightError, match=r"teacher 'teacher' feeds channel 2 \(distill\) but its tokenizer "
                       r"is not the policy's \(vocabularies differ"):
        check_models(parse_topology(text))
    replay_only = text.replace("channels: [distill, replay]", "channels: [replay]")
    check_models(parse_topology(replay_only.replace("alpha_sdpo: 1.0", "alpha_sdpo: 0.0")))


def test_max_new_tokens_beyond_the_context_and_a_short_head_are_named(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelPreflightError, match=r"run.max_new_tokens=300 leaves no room for a prompt in its "
                       r"context of 256 tokens") as e:
        check_models(parse_topology(topology_text(llama_dir).replace("max_new_tokens: 24", "max_new_tokens: 300")))
    assert "model (the policy)" in str(e.value) and "teacher 'teacher'" in str(e.value)
    short = build_small_model_dir(tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    policy_only = topology_text(llama_dir).replace(f"source: {llama_dir}\n  task", f"source: {short}\n  task", 1)
    with pytest.raises(ModelPreflightError, match=r"its tokenizer has 259 tokens but the model's head only 200"):
        check_models(parse_topology(policy_only))


@pytest.mark.e2e  # a shipped topology run end to end: its own tier (`pytest -m e2e`), run by .ci/run
async def test_a_few_lora_steps_with_every_loss_channel(llama_dir: Path, tmp_path: Path) -> None:
    import yaml
    from envs.e2e import run_every_channel, shortened

    (tmp_path / "t.yaml").write_text(topology_text(llama_dir))
    data = shortened(tmp_path / "t.yaml", tmp_path)
    data["model"]["warmstart"].update(steps=10, batch_size=16)
    # A random Llama needs more SFT than the tiny Qwen2 before its traces beat the student's (channel 3).
    data["roles"]["teachers"]["members"][0]["settings"]["model"]["warmstart"].update(steps=150)
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(data))
    await run_every_channel(data, tmp_path / "short.yaml")
    final = tmp_path / "run" / "checkpoint"
    adapter = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32
    assert json.loads((final / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
