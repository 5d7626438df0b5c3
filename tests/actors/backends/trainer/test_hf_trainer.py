"""HFTrainer: TrainBatch -> compose_loss inputs (`train_batch`) -> one AdamW step, on the real tiny model (no Monarch)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
from composer_mesh.actors.backends.trainer.train_batch import build_loss_batch, completion_logits
from composer_mesh.actors.messages import (
    Prompt,
    RewardResult,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TeacherTrace,
    TokenDistribution,
    TrainBatch,
    TrainMetrics,
)
from composer_mesh.loss.compose import LossBatch, token_logprobs
from composer_mesh.loss.config import LossConfig
from composer_mesh.models.config import ModelConfig

MODEL = ModelConfig(source="tiny", seed=3)


def make_trainer(**loss) -> HFTrainer:
    trainer = HFTrainer(HFTrainerSettings(lr=1e-2))
    trainer.start(MODEL, LossConfig(**loss))
    return trainer


def loss_batch(trainer: HFTrainer, batch: TrainBatch) -> LossBatch:
    """What `train_step` feeds `compose_loss`."""
    return build_loss_batch(batch, trainer.model, trainer.loss, temperature=trainer.temperature, reference=trainer.reference)


def make_batch(trainer: HFTrainer, with_teacher: bool = True, top_k: int = 0) -> TrainBatch:
    """Two prompts x three rollouts with the trainer's own log-probs as the sampler's."""
    tok = trainer.tokenizer
    groups, dists, traces = [], [], []
    g = torch.Generator().manual_seed(0)
    for i, (text, answer) in enumerate([("3+4=", "7"), ("9+9=", "18")]):
        prompt_ids = tok.encode(text)
        prompt = Prompt(prompt_id=f"p{i}", text=text, token_ids=prompt_ids, answer=answer)
        rollouts, rewards = [], []
        for j in range(3):
            comp = torch.randint(3, len(tok), (2 + j,), generator=g).tolist()
            with torch.no_grad():
                lp = token_logprobs(completion_logits(trainer.model, [prompt_ids], [comp]), torch.tensor([comp]))[0]
            rollouts.append(Rollout(f"p{i}", prompt_ids, comp, lp.tolist(), weight_version=1))
            rewards.append(RewardResult(score=float(j == 0)))
            if with_teacher:
                logits = torch.randn(len(comp), trainer.model.config.vocab_size, generator=g)
                if top_k:
                    lps, ids = torch.log_softmax(logits, -1).topk(top_k, -1)
                    dists.append(TokenDistribution(teacher="t", topk_ids=ids, topk_logprobs=lps))
                else:
                    dists.append(TokenDistribution(teacher="t", logits=logits))
        groups.append(ScoredGroup(RolloutGroup(prompt, rollouts), rewards))
        traces.append(TeacherTrace(teacher=f"t{i}", prompt_id=f"p{i}", text=answer + ";", completion_ids=tok.encode(answer + ";")))
    return TrainBatch(groups=groups, distributions=dists, traces=traces if with_teacher else [])


def test_all_three_channels_step_and_change_weights():
    trainer = make_trainer(alpha_sdpo=1.0, beta_replay=1.0, kl_beta=0.01)
    before = {k: v.clone() for k, v in trainer.named_weights().items()}
    m = trainer.train_step(make_batch(trainer))
    assert set(m.channels) >= {"grpo", "sdpo", "replay"}
    assert all(torch.isfinite(torch.tensor(v)) for v in m.channels.values())
    assert m.step == 1 and m.weight_version == 0  # the trainer service stamps the published version
    changed = [k for k, v in trainer.named_weights().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)  # every parameter got a gradient through some channel
    assert m.metrics["reward_mean"] == pytest.approx(1 / 3)


def test_sparse_topk_teacher_and_simpo():
    trainer = make_trainer(alpha_sdpo=1.0, beta_replay=1.0, dpo_variant="simpo")
    assert trainer.reference is None  # SimPO and no KL: no reference copy kept
    m = trainer.train_step(make_batch(trainer, top_k=4))
    assert m.channels["sdpo"] > 0 and "replay" in m.channels


def test_channels_off_without_teacher_inputs_equal_grpo_only():
    a = make_trainer(alpha_sdpo=1.0, beta_replay=1.0)
    b = make_trainer(alpha_sdpo=0.0, beta_replay=0.0)
    batch_a, batch_b = make_batch(a, with_teacher=False), make_batch(b, with_teacher=False)
    la = loss_batch(a, batch_a)
    lb = loss_batch(b, batch_b)
    assert torch.equal(la.logits, lb.logits)  # same seed, same model, same batch
    from composer_mesh.loss.compose import compose_loss

    ra = compose_loss(la, a.loss)
    rb = compose_loss(lb, b.loss)
    assert torch.equal(ra.total, rb.total)


def test_old_logprobs_equal_current_policy_gives_ratio_one():
    trainer = make_trainer(alpha_sdpo=0.0, beta_replay=0.0)
    lb = loss_batch(trainer, make_batch(trainer, with_teacher=False))
    cur = token_logprobs(lb.logits, lb.token_ids)
    assert torch.allclose(cur[lb.mask], lb.old_logprobs[lb.mask], atol=1e-5)


def test_bad_teacher_shapes_name_the_problem():
    trainer = make_trainer(alpha_sdpo=1.0, beta_replay=0.0)
    batch = make_batch(trainer)
    batch.distributions = batch.distributions[:-1]
    with pytest.raises(ValueError, match="5 teacher distributions for 6 rollouts"):
        trainer.train_step(batch)
    batch = make_batch(trainer)
    d = batch.distributions[0]
    batch.distributions[0] = TokenDistribution(teacher="bad", logits=d.logits[:-1])
    with pytest.raises(ValueError, match="teacher 'bad' gave 1 token distributions from token 0 for a 2-token completion"):
        trainer.train_step(batch)


def test_checkpoint_is_safetensors_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(alpha_sdpo=0.0, beta_replay=0.0)
    trainer.train_step(make_batch(trainer, with_teacher=False))
    out = trainer.save_checkpoint(tmp_path / "ckpt", weight_version=7)
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    assert json.loads((out / "trainer_state.json").read_text()) == {"step": 1, "weight_version": 7}
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for k, v in trainer.named_weights().items():
        assert torch.equal(reloaded.state_dict()[k], v), k


def _step(settings: dict, batch: TrainBatch | None = None, **loss) -> tuple[HFTrainer, TrainMetrics, TrainBatch]:
    """A fresh trainer's first step on `batch` (default: `make_batch` before any step)."""
    trainer = HFTrainer(HFTrainerSettings(lr=1e-2, **settings))
    trainer.start(MODEL, LossConfig(**loss))
    batch = batch or make_batch(trainer)
    return trainer, trainer.train_step(batch), batch


def _max_diff(a: HFTrainer, b: HFTrainer) -> float:
    """Largest gradient difference of the last step, relative to the largest gradient (AdamW's first update is
    ~lr * sign(grad), so the weights would magnify rounding of near-zero gradients)."""
    grads_b = dict(b.model.named_parameters())
    diff = max(float((p.grad.float() - grads_b[n].grad.float()).abs().max()) for n, p in a.model.named_parameters())
    return diff / max(float(p.grad.abs().max()) for p in a.model.parameters())


LOSS = {"alpha_sdpo": 1.0, "beta_replay": 1.0, "kl_beta": 0.01}


@pytest.mark.parametrize("settings", [
    {"micro_batch_tokens": 8},
    {"micro_batch_tokens": 12, "packing": True},
    {"activation_checkpointing": True},
    {"lm_head": "full"},
], ids=["micro-batches", "packed-micro-batches", "activation-checkpointing", "full-head"])
def test_step_options_give_the_same_update_as_one_plain_pass(settings):
    plain, m_plain, batch = _step({}, **LOSS)
    other, m_other, _ = _step(settings, batch, **LOSS)
    assert m_other.loss == pytest.approx(m_plain.loss, rel=1e-5, abs=1e-6)
    assert m_other.channels.keys() == m_plain.channels.keys() == {"grpo", "sdpo", "replay"}
    assert _max_diff(plain, other) < 1e-5
    if "micro_batch_tokens" in settings:
        assert m_other.metrics["micro_batches"] > 1 and m_plain.metrics["micro_batches"] == 1


def test_bf16_mixed_keeps_float32_master_weights_and_optimizer_state():
    fp32, m32, batch = _step({}, **LOSS)
    mixed, m16, _ = _step({"precision": "bf16-mixed"}, batch, **LOSS)
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    state = next(iter(mixed.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32
    assert mixed.reference is not None and next(mixed.reference.parameters()).dtype == torch.bfloat16
    assert m16.loss == pytest.approx(m32.loss, rel=0.05, abs=0.05)  # bf16 compute: close, not equal
    assert 0 < _max_diff(fp32, mixed) < 5e-2


def test_bf16_holds_weights_and_optimizer_state_in_bf16():
    trainer, metrics, _ = _step({"precision": "bf16"}, **LOSS)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert next(iter(trainer.optimizer.state.values()))["exp_avg"].dtype == torch.bfloat16
    # Generators load model.dtype (float32 here): that is what is published, whatever the training dtype.
    assert {t.dtype for t in trainer.named_weights().values()} == {torch.float32}
    assert torch.isfinite(torch.tensor(metrics.loss))


def test_chunked_head_refuses_a_model_that_transforms_its_logits():
    from composer_mesh.actors.backends.trainer.train_batch import check_chunked_head

    trainer = make_trainer()
    trainer.model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30\.0.*lm_head: full"):
        check_chunked_head(trainer.model)


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        HFTrainerSettings(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="precision"):
        HFTrainerSettings(precision="fp16")


def test_bf16_mixed_runs_the_chunked_head_in_bf16():
    """Under autocast the decoder's last hidden state is float32; the head must still run in bf16, as the
    model's own forward would run it (a float32 head was 74% of a step's matmul work)."""
    from composer_mesh.actors.backends.trainer.train_batch import layout, student_forward
    from composer_mesh.loss.compose import HiddenStates

    trainer = make_trainer()
    lay = layout([[1, 2, 3]], [[4, 5]], "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        student = student_forward(trainer.model, lay, head="chunked")
    assert isinstance(student, HiddenStates) and student.hidden.dtype == torch.bfloat16
    assert student.weight.dtype == torch.float32  # master weights untouched; the head's matmul casts a copy


def test_attn_implementation_is_applied():
    trainer = HFTrainer(HFTrainerSettings(attn_implementation="eager"))
    trainer.start(MODEL, LossConfig())
    assert trainer.model.config._attn_implementation == "eager"


def test_lr_decay_follows_the_trainer_step_and_holds_at_its_floor():
    """`lr_decay_steps` cosine-decays the learning rate each step from `lr` to `lr * lr_min_ratio`, then holds it;
    the optimizer really uses it (AdamW's first step moves each weight by about lr), and without it lr is constant."""
    from composer_mesh.actors.backends.trainer.config import scheduled_lr

    settings = HFTrainerSettings(lr=1e-2, lr_decay_steps=4, lr_min_ratio=0.1)
    lrs = [scheduled_lr(settings, step) for step in range(7)]
    assert lrs[0] == pytest.approx(1e-2) and lrs[2] == pytest.approx(0.55e-2) and lrs[4:] == pytest.approx([1e-3] * 3)
    assert all(a > b for a, b in itertools.pairwise(lrs[:5]))
    assert scheduled_lr(HFTrainerSettings(lr=1e-2), 1000) == 1e-2
    trainer = HFTrainer(settings)
    trainer.start(MODEL, LossConfig(alpha_sdpo=0.0, beta_replay=0.0))
    batch = make_batch(trainer, with_teacher=False)
    trainer.step = 4  # as a resumed trainer: the schedule continues from its step
    before = {k: v.clone() for k, v in trainer.named_weights().items()}
    m = trainer.train_step(batch)
    assert m.metrics["lr"] == pytest.approx(1e-3) and trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    moved = max(float((v - before[k]).abs().max()) for k, v in trainer.named_weights().items())
    assert 0.5e-3 < moved < 1.5e-3  # an AdamW first step of ~lr, not of the undecayed 1e-2
    with pytest.raises(ValueError, match="lr_min_ratio"):
        HFTrainerSettings(lr_min_ratio=2)


def test_lr_warmup_rises_linearly_then_hands_over_to_the_decay():
    """`lr_warmup_steps` scales the first steps' lr by (step + 1) / warmup, on top of the decay; the optimizer's
    first step really is the small one (AdamW's first step moves each weight by about its lr)."""
    from composer_mesh.actors.backends.trainer.config import scheduled_lr

    flat = HFTrainerSettings(lr=1e-2, lr_warmup_steps=4)
    assert [scheduled_lr(flat, s) for s in range(6)] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2, 1e-2])
    decayed = HFTrainerSettings(lr=1e-2, lr_warmup_steps=2, lr_decay_steps=4, lr_min_ratio=0.1)
    plain = HFTrainerSettings(lr=1e-2, lr_decay_steps=4, lr_min_ratio=0.1)
    assert scheduled_lr(decayed, 0) == pytest.approx(scheduled_lr(plain, 0) / 2)
    assert [scheduled_lr(decayed, s) for s in range(1, 7)] == pytest.approx([scheduled_lr(plain, s) for s in range(1, 7)])
    trainer = HFTrainer(HFTrainerSettings(lr=1e-2, lr_warmup_steps=10))
    trainer.start(MODEL, LossConfig(alpha_sdpo=0.0, beta_replay=0.0))
    before = {k: v.clone() for k, v in trainer.named_weights().items()}
    m = trainer.train_step(make_batch(trainer, with_teacher=False))
    assert m.metrics["lr"] == pytest.approx(1e-3)
    moved = max(float((v - before[k]).abs().max()) for k, v in trainer.named_weights().items())
    assert 0.5e-3 < moved < 1.5e-3


# A learning rate that a real run could be given by mistake: step 1 is finite, its update overflows the tiny
# model's activations, and step 2's loss is NaN.
EXPLODING_LR = 1e12


def _exploding(on_nonfinite: str = "stop") -> tuple[HFTrainer, TrainBatch]:
    trainer = HFTrainer(HFTrainerSettings(lr=EXPLODING_LR))
    trainer.start(MODEL, LossConfig(alpha_sdpo=0.0, beta_replay=0.0), on_nonfinite=on_nonfinite)  # type: ignore[arg-type]
    batch = make_batch(trainer, with_teacher=False)
    assert torch.isfinite(torch.tensor(trainer.train_step(batch).loss))
    return trainer, batch


def _state(trainer: HFTrainer) -> dict[str, torch.Tensor]:
    """Weights and every AdamW state tensor, copied."""
    out = {f"w/{k}": v.detach().clone() for k, v in trainer.model.state_dict().items()}  # type: ignore[union-attr]
    for i, entry in trainer.optimizer.state_dict()["state"].items():
        out.update({f"o/{i}/{k}": torch.as_tensor(v).clone() for k, v in entry.items()})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_nonfinite_loss_stops_with_one_line_naming_the_step_and_quantity_before_any_update():
    """By default (`run.on_nonfinite: stop`): a user error (the command line prints its line, not a bug's
    traceback), raised before the optimizer, so the weights and AdamW state are those of step 1."""
    from composer_mesh.actors.backends.trainer.base import NonFiniteError
    from composer_mesh.errors import UserInputError

    trainer, batch = _exploding()
    before = _state(trainer)
    with pytest.raises(NonFiniteError, match=r"^trainer step 2: non-finite loss \(nan\); the update was not applied "
                                             r"\(.*\); run\.on_nonfinite: skip skips such steps instead$") as e:
        trainer.train_step(batch)
    assert isinstance(e.value, UserInputError) and "\n" not in str(e.value)
    assert _same(before, _state(trainer)) and trainer.step == 1


def test_skip_leaves_weights_and_optimizer_bitwise_unchanged_and_counts_the_step():
    trainer, batch = _exploding("skip")
    before = _state(trainer)
    for step in (2, 3):
        m = trainer.train_step(batch)
        assert m.step == step and m.metrics["faults/nonfinite_skipped"] == 1.0 and m.loss != m.loss  # NaN
        assert _same(before, _state(trainer))
    assert all(p.grad is None for p in trainer.model.parameters())  # type: ignore[union-attr]
    fine = HFTrainer(HFTrainerSettings(lr=1e-2))
    fine.start(MODEL, LossConfig(alpha_sdpo=0.0, beta_replay=0.0), on_nonfinite="skip")
    assert fine.train_step(make_batch(fine, with_teacher=False)).metrics["faults/nonfinite_skipped"] == 0.0


def test_skip_is_refused_with_diloco():
    from composer_mesh.mesh.objectstore import DiLoCoConfig

    with pytest.raises(ValueError, match=r"run\.on_nonfinite: skip cannot be combined with diloco"):
        HFTrainer(HFTrainerSettings()).start(MODEL, LossConfig(), diloco=DiLoCoConfig(store_uri="memory://x",
                                                                                       run_id="r", replicas=2), on_nonfinite="skip")
