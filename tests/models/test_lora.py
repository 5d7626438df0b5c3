"""LoRA on the `hf` trainer (`trainer.settings.lora`, `composer_mesh/models/lora.py`), on tiny models built
offline (no Monarch): only the adapters train, generators get merged weights (or the adapters), the reference is
the base with the adapters off (no copy), and the trainer state holds only the adapters and resumes bitwise."""

from __future__ import annotations

import random
import types
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

pytest.importorskip("peft")

from composer_mesh.actors.backends.trainer import hf_trainer as hf_trainer_module
from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
from composer_mesh.actors.backends.trainer.train_batch import StudentPass, completion_logprobs
from composer_mesh.actors.backends.trainer.trainer_state import (
    TrainerStateError,
    read_trainer_state,
    restore_trainer_state,
)
from composer_mesh.loss.config import LossConfig
from composer_mesh.models.config import LoraConfig, ModelConfig
from composer_mesh.models.loading import load_pretrained, named_weights
from composer_mesh.models.lora import (
    adapter_disabled,
    adapter_weights,
    apply_lora,
    load_adapter_weights,
    merged_weights,
)
from tests.actors.backends.trainer.test_hf_trainer import make_batch

MODEL = ModelConfig(source="tiny", seed=3)
LORA = LoraConfig(r=4, alpha=8)
# Every channel: KL to the reference and DPO (reference log-probs) on the replay pairs, plus distillation.
LOSS = LossConfig(alpha_sdpo=1.0, beta_replay=1.0, kl_beta=0.05)


def lora_trainer(model: ModelConfig = MODEL, lora: LoraConfig = LORA, loss: LossConfig = LOSS, **settings) -> HFTrainer:
    t = HFTrainer(HFTrainerSettings(lr=1e-2, lora=lora, **settings))
    t.start(model, loss)
    return t


def plain_model(model: ModelConfig = MODEL) -> torch.nn.Module:
    return load_pretrained(model)[0].float()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    """A tiny Llama with tied embeddings, saved as a local transformers directory with the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from composer_mesh.models.tokenizer import tiny_tokenizer

    tok = tiny_tokenizer(MODEL)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return ModelConfig(source=str(path))


def adapters_of(t: HFTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in adapter_weights(t.model).items()}


def frozen_of(t: HFTrainer) -> dict[str, torch.Tensor]:
    adapters = adapter_weights(t.model)
    return {k: v.clone() for k, v in t.model.state_dict().items() if k not in adapters}


# ---- training ------------------------------------------------------------------------------------------------


def test_only_the_adapters_train_and_every_channel_runs():
    t = lora_trainer()
    adapters = adapter_weights(t.model)
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    again = lora_trainer()  # the adapters' init depends on nothing the RNGs went through
    assert all(torch.equal(v, adapter_weights(again.model)[k]) for k, v in adapters.items())
    params = dict(t.model.named_parameters())
    assert [id(p) for g in t.optimizer.param_groups for p in g["params"]] == [id(params[n]) for n in adapters]
    assert [n for n, p in t.model.named_parameters() if p.requires_grad] == list(adapters)
    base, before = frozen_of(t), adapters_of(t)
    batch = make_batch(t)
    for _ in range(2):  # lora_B starts at zero, so lora_A only gets a gradient from the second step on
        m = t.train_step(batch)
        assert m.channels.keys() == {"grpo", "sdpo", "replay"} and all(map(torch.isfinite, map(torch.tensor, m.channels.values())))
    after = frozen_of(t)
    assert base.keys() == after.keys() and all(torch.equal(base[k], after[k]) for k in base)  # the base: bitwise
    changed = [k for k, v in adapter_weights(t.model).items() if not torch.equal(v, before[k])]
    assert changed == list(before)
    assert all(p.requires_grad for n, p in t.model.named_parameters() if n in before)  # the reference pass restored them


def test_merged_weights_are_the_plain_models_weights_with_the_adapters_merged():
    import peft

    t = lora_trainer()
    batch = make_batch(t)
    for _ in range(2):
        t.train_step(batch)
    merged = merged_weights(t.model)
    plain_names = list(named_weights(plain_model()))
    assert list(merged) == plain_names
    assert list(t.named_weights()) == plain_names and t.weight_kind == "full"
    # peft's own merge of the same adapters into a fresh base model
    fresh = peft.get_peft_model(plain_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    load_adapter_weights(fresh.get_base_model(), adapter_weights(t.model))
    expected = named_weights(fresh.merge_and_unload())
    assert expected.keys() == merged.keys()
    assert all(torch.allclose(merged[k], expected[k], rtol=0, atol=1e-6) for k in expected)
    assert any(not torch.equal(merged[k], v) for k, v in named_weights(plain_model()).items())  # it trained
    assert any(".base_layer." in k for k in t.model.state_dict())  # merging did not change the model


def test_llama_with_tied_embeddings_and_named_targets(llama):
    t = lora_trainer(llama, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]), LossConfig(alpha_sdpo=0, beta_replay=0))
    assert {k.split(".")[-4] for k in adapter_weights(t.model)} == {"q_proj", "v_proj"}
    t.train_step(make_batch(t, with_teacher=False))
    t.train_step(make_batch(t, with_teacher=False))
    plain = plain_model(llama)
    merged = t.named_weights()
    assert list(merged) == list(named_weights(plain)) and "lm_head.weight" not in merged  # tied: once
    changed = {k for k, v in named_weights(plain).items() if not torch.equal(v, merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)


def test_the_reference_is_the_base_model_with_the_adapters_off_not_a_copy(monkeypatch):
    def no_copy(*_args, **_kwargs):
        raise AssertionError("the LoRA reference must not copy the model")

    monkeypatch.setattr(hf_trainer_module, "copy", types.SimpleNamespace(deepcopy=no_copy))  # the trainer's copy
    t = lora_trainer()
    monkeypatch.undo()
    assert t.reference is t.model
    assert sum(p.numel() for p in t.model.parameters()) == (
        sum(p.numel() for p in plain_model().parameters()) + sum(p.numel() for p in adapter_weights(t.model).values())
    )
    batch = make_batch(t)
    prompts = [r.prompt_ids for r in batch.rollouts()]
    completions = [r.completion_ids for r in batch.rollouts()]
    base_lp, mask = completion_logprobs(plain_model(), prompts, completions)
    run = StudentPass(t.model, t.loss, reference=t.reference, head="chunked", reference_scope=t.reference_scope)

    def reference() -> torch.Tensor:
        lp, m = run.reference_logprobs(prompts, completions)
        assert torch.equal(m, mask)
        return lp

    assert torch.allclose(reference()[mask], base_lp[mask], rtol=0, atol=1e-6)
    for _ in range(2):
        t.train_step(batch)
    assert t.model.training
    assert torch.allclose(reference()[mask], base_lp[mask], rtol=0, atol=1e-6)  # the base never trains
    policy, _ = run.logprobs(t.model, prompts, completions)
    assert not torch.allclose(policy[mask], base_lp[mask], atol=1e-4)  # the adapters are on outside the scope


def test_adapter_disabled_restores_the_adapters_state():
    model = apply_lora(plain_model(), LORA)
    model.requires_grad_(False)  # a generator's model: nothing trains
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(0.1)
    ids = torch.tensor([[3, 4, 5, 6]])
    on = model(input_ids=ids).logits
    with adapter_disabled(model):
        off = model(input_ids=ids).logits
    assert torch.equal(model(input_ids=ids).logits, on) and not torch.allclose(on, off)
    assert not any(p.requires_grad for p in model.parameters())
    assert torch.allclose(off, plain_model()(input_ids=ids).logits, atol=1e-6)


# ---- what generators get ------------------------------------------------------------------------------------


def test_adapter_sync_publishes_the_adapters_a_generator_loads():
    t = lora_trainer(lora=LoraConfig(r=4, alpha=8, sync="adapter"), loss=LossConfig(alpha_sdpo=0, beta_replay=0))
    assert t.weight_kind == "adapter"
    t.train_step(make_batch(t, with_teacher=False))
    t.train_step(make_batch(t, with_teacher=False))
    published = t.named_weights()
    assert published.keys() == adapter_weights(t.model).keys()
    assert {v.dtype for v in published.values()} == {torch.float32}
    generator = apply_lora(plain_model(), LORA)  # a generator applies the same config to its own copy
    load_adapter_weights(generator, published)
    mine, theirs = merged_weights(t.model), merged_weights(generator)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    other = apply_lora(plain_model(), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"do not fit this model's LoRA adapters.*unexpected .*k_proj"):
        load_adapter_weights(other, published)
    narrow = apply_lora(plain_model(), LoraConfig(r=2))
    with pytest.raises(ValueError, match=r"got \(4, 64\), the model's is \(2, 64\)"):
        load_adapter_weights(narrow, published)


# ---- checkpoints ---------------------------------------------------------------------------------------------


def state_of(t: HFTrainer) -> dict[str, torch.Tensor]:
    out = {f"w/{k}": v.clone() for k, v in t.model.state_dict().items()}
    for i, s in t.optimizer.state_dict()["state"].items():
        out.update({f"o/{i}/{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return out


def test_the_state_holds_only_the_adapters_and_resumes_bitwise(tmp_path: Path):
    loss = LossConfig(kl_beta=0.05, sdpo_wrapper="taid", taid_total_steps=10)
    a = lora_trainer(loss=loss)
    batch = make_batch(a)
    for _ in range(2):
        a.train_step(batch)
    a.save_state(str(tmp_path / "s"), extra={"weight_version": 3})
    after_save = (torch.rand(4), random.random())
    snapshot = read_trainer_state(str(tmp_path / "s"))
    saved_model = {k[len("model/"):] for k in snapshot.tensors if k.startswith("model/")}
    assert saved_model == set(adapter_weights(a.model)) and snapshot.meta["model_tensors"] == "trainable"
    assert snapshot.meta["extra_json"]["lora"] == {"r": 4, "alpha": 8.0, "target_modules": "all-linear"}
    for _ in range(2):
        a.train_step(batch)

    b = lora_trainer(loss=loss)
    b.train_step(batch)  # another history before loading: the state replaces it
    assert b.load_state(str(tmp_path / "s")) == {"weight_version": 3} and b.step == 2
    assert torch.equal(torch.rand(4), after_save[0]) and random.random() == after_save[1]
    for _ in range(2):
        b.train_step(batch)
    sa, sb = state_of(a), state_of(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])][:3]
    assert a.loss_state.state_dict() == b.loss_state.state_dict() and a.step == b.step == 4


def test_states_of_another_adapter_or_without_lora_are_refused(tmp_path: Path):
    loss = LossConfig(alpha_sdpo=0, beta_replay=0)
    a = lora_trainer(loss=loss)
    a.save_state(str(tmp_path / "lora"))
    with pytest.raises(TrainerStateError, match=r"lora \{'r': 4, .*this trainer has lora \{'r': 2"):
        lora_trainer(lora=LoraConfig(r=2), loss=loss).load_state(str(tmp_path / "lora"))
    full = HFTrainer(HFTrainerSettings(lr=1e-2))
    full.start(MODEL, loss)
    with pytest.raises(TrainerStateError, match="this trainer has lora off"):
        full.load_state(str(tmp_path / "lora"))
    full.save_state(str(tmp_path / "full"))
    with pytest.raises(TrainerStateError, match="saved by a trainer with lora off"):
        a.load_state(str(tmp_path / "full"))
    # Below the trainer: the state's own checks (what it holds, then names and shapes).
    with pytest.raises(TrainerStateError, match="holds the whole model, this trainer needs only the trainable"):
        restore_trainer_state("full", read_trainer_state(str(tmp_path / "full")), a.model, a.optimizer,
                              trainable_only=True)
    narrow = lora_trainer(lora=LoraConfig(r=2), loss=loss)
    with pytest.raises(TrainerStateError, match=r"another adapter \(trainable parameters\): .*saved \(4, 64\)"):
        restore_trainer_state("lora", read_trainer_state(str(tmp_path / "lora")), narrow.model, narrow.optimizer,
                              trainable_only=True)


def test_checkpoint_is_the_merged_model_plus_the_adapter(tmp_path: Path):
    import peft
    from transformers import AutoModelForCausalLM

    t = lora_trainer(loss=LossConfig(alpha_sdpo=0, beta_replay=0))
    for _ in range(2):
        t.train_step(make_batch(t, with_teacher=False))
    out = t.save_checkpoint(tmp_path / "ckpt", weight_version=5)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    merged = merged_weights(t.model)
    assert list(named_weights(reloaded)) == list(merged)
    assert all(torch.equal(v, merged[k]) for k, v in named_weights(reloaded).items())
    assert (out / "adapter" / "adapter_config.json").is_file()
    with_adapter = peft.PeftModel.from_pretrained(plain_model(), out / "adapter")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(with_adapter(input_ids=ids).logits, t.model.eval()(input_ids=ids).logits, atol=1e-5)


# ---- settings ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "field"), [
    ({"r": 0}, "r"),
    ({"dropout": 1.0}, "dropout"),
    ({"alpha": 0}, "alpha"),
    ({"target_modules": []}, "target_modules"),
    ({"target_modules": "q_proj"}, "target_modules"),
    ({"target_modules": ["q_proj", "q_proj"]}, "target_modules"),
    ({"sync": "delta"}, "sync"),
    ({"rank": 4}, "rank"),
])
def test_bad_lora_settings_are_pydantic_errors(raw, field):
    with pytest.raises(ValidationError) as info:
        HFTrainerSettings(lora=raw)
    assert any(err["loc"][:2] == ("lora", field) for err in info.value.errors()), info.value


def test_bad_targets_and_diloco_are_refused_when_the_trainer_starts():
    with pytest.raises(ValueError, match=r"'nope' names no module of Qwen2ForCausalLM \(its linear layers: .*q_proj"):
        lora_trainer(lora=LoraConfig(target_modules=["q_proj", "nope"]))
    with pytest.raises(ValueError, match="'lm_head' matches 'lm_head', the model's LM head"):
        lora_trainer(lora=LoraConfig(target_modules=["lm_head"]))
    with pytest.raises(ValueError, match=r"trainer\.settings\.lora and diloco"):
        HFTrainer(HFTrainerSettings(lora=LORA)).start(MODEL, LOSS, diloco=object())


@pytest.mark.parametrize("settings", [
    {"micro_batch_tokens": 12, "packing": True},
    {"activation_checkpointing": True},
    {"lm_head": "full"},
], ids=["packed-micro-batches", "activation-checkpointing", "full-head"])
def test_step_options_give_the_same_adapter_update(settings):
    plain = lora_trainer()
    batch = make_batch(plain)
    m_plain = plain.train_step(batch)
    other = lora_trainer(**settings)
    m_other = other.train_step(batch)
    assert m_other.loss == pytest.approx(m_plain.loss, rel=1e-5, abs=1e-6)
    grads = {n: p.grad for n, p in other.model.named_parameters() if p.grad is not None}
    assert grads.keys() == set(adapter_weights(other.model))
    for n, p in plain.model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(p.grad, grads[n], rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize(("precision", "base"), [("bf16", torch.bfloat16), ("bf16-mixed", torch.float32)])
def test_bf16_precisions_keep_float32_adapters(precision, base):
    t = lora_trainer(precision=precision, loss=LossConfig(alpha_sdpo=0, beta_replay=0, kl_beta=0.05))
    adapters = adapter_weights(t.model)
    assert {v.dtype for v in adapters.values()} == {torch.float32}
    assert {p.dtype for n, p in t.model.named_parameters() if n not in adapters} == {base}
    m = t.train_step(make_batch(t, with_teacher=False))
    assert torch.isfinite(torch.tensor(m.loss))
    assert {v.dtype for v in t.named_weights().values()} == {torch.float32}  # the model config's dtype


def test_a_plain_generator_takes_the_published_merged_weights():
    from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings
    from composer_mesh.actors.trainer import TrainerService
    from composer_mesh.mesh.weights.config import WeightPlaneConfig

    service = TrainerService(HFTrainer(HFTrainerSettings(lr=1e-2, lora=LORA)), WeightPlaneConfig(transport="endpoint"))
    service.start(MODEL, LOSS, temperature=1.0)
    service.publish()
    metrics, manifest = service.train_step(make_batch(service.backend))
    assert manifest.version == metrics.weight_version == 2
    assert [s.name for s in manifest.tensors] == list(named_weights(plain_model()))
    generator = HFGenerator(HFGeneratorSettings())
    generator.start(MODEL)
    generator.load_weights(service.backend.named_weights())  # names, shapes and dtypes checked
    merged = merged_weights(service.backend.model)
    assert all(torch.equal(v, merged[k]) for k, v in generator.named_weights().items())
    service.close()
