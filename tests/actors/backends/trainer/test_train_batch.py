"""The TrainBatch -> LossBatch adapter on its own (no trainer, no optimizer): log-probs against a float64
full-softmax reference, and each channel's inputs."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_mesh.actors.backends.trainer.train_batch import (
    TrainRows,
    build_loss_batch,
    completion_logprobs,
    pad,
    teacher_inputs,
)
from composer_mesh.actors.messages import (
    Prompt,
    RewardResult,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TeacherTrace,
    TokenDistribution,
    TrainBatch,
)
from composer_mesh.loss.compose import token_logprobs
from composer_mesh.loss.config import LossConfig
from composer_mesh.models.config import ModelConfig
from composer_mesh.models.tiny import build_tiny

# These batches leave out teacher distributions on purpose (the default loss weights them): no warning wanted.
pytestmark = pytest.mark.filterwarnings("ignore::composer_mesh.actors.backends.trainer.train_batch.TeacherSignalsMissing")


@pytest.fixture(scope="module")
def model32():
    """The tiny model with a sharper head, so log-probs are far from uniform (down to about -5)."""
    m, _ = build_tiny(ModelConfig(seed=3))
    with torch.no_grad():
        m.lm_head.weight.mul_(5.0)
    return m


@pytest.fixture(scope="module")
def model(model32):
    """The same in float64: the adapter's own error is then what its float32 output rounds away."""
    return copy.deepcopy(model32).double()


def sequences(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and completions of mixed lengths; one completion is longer than the 64-position chunk."""
    g = torch.Generator().manual_seed(0)
    lengths = [(4, 2), (6, 70), (3, 1), (5, 9)]
    prompts = [torch.randint(1, vocab, (p,), generator=g).tolist() for p, _ in lengths]
    completions = [torch.randint(1, vocab, (c,), generator=g).tolist() for _, c in lengths]
    return prompts, completions


def reference_logprobs(model, prompts, completions, temperature: float) -> list[torch.Tensor]:
    """float64 model, one unpadded sequence at a time, full log_softmax."""
    m64 = copy.deepcopy(model).double()
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            logits = m64(input_ids=torch.tensor([p + c])).logits[0]
            rows = logits[len(p) - 1 : len(p) - 1 + len(c)] / temperature
            out.append(torch.log_softmax(rows, dim=-1).gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("dtype", "atol"), [("float64", 1e-10), ("float32", 1e-5)])
@pytest.mark.parametrize(("head", "packed"), [("full", False), ("chunked", False), ("chunked", True)])
def test_logprobs_equal_a_float64_full_softmax(model, model32, temperature, dtype, atol, head, packed):
    """Padded or packed batch, alignment, temperature and the chunked log-softmax (from logits or from hidden
    states) against one unpadded float64 forward per sequence. float64 weights: float64 throughout (1e-10);
    float32 weights: their forward's rounding."""
    policy = model if dtype == "float64" else model32
    prompts, completions = sequences(policy.config.vocab_size)
    with torch.no_grad():
        logps, mask = completion_logprobs(policy, prompts, completions, temperature, head=head, packed=packed)
    assert logps.dtype == getattr(torch, dtype) and logps.shape == mask.shape == (4, 70)
    assert mask.sum(-1).tolist() == [len(c) for c in completions]
    ref = reference_logprobs(policy, prompts, completions, temperature)
    assert min(float(r.min()) for r in ref) < -4.0  # not a near-uniform model: the check means something
    for b, r in enumerate(ref):
        assert torch.allclose(logps[b, : len(r)].double(), r, atol=atol, rtol=0), b


def _batch(prompts, completions, old_logprobs, traces=(), dists=()) -> TrainBatch:
    """Two groups (rows 0-1 and 2-3); rewards 1, 0, 0, 1."""
    rollouts = [Rollout(f"p{i // 2}", p, c, lp, weight_version=1)
                for i, (p, c, lp) in enumerate(zip(prompts, completions, old_logprobs))]
    groups = []
    for g in range(2):
        rs = rollouts[2 * g : 2 * g + 2]
        prompt = Prompt(f"p{g}", "", rs[0].prompt_ids)
        scores = [RewardResult(score=1.0), RewardResult(score=0.0)][:: 1 if g == 0 else -1]
        groups.append(ScoredGroup(RolloutGroup(prompt, rs), scores))
    return TrainBatch(groups=groups, distributions=list(dists), traces=list(traces))


def test_loss_batch_log_probs_reference_and_replay_pairs(model):
    prompts, completions = sequences(model.config.vocab_size)
    prompts[1] = prompts[0]  # two rollouts per prompt
    prompts[3] = prompts[2]
    with torch.no_grad():
        logps, _ = completion_logprobs(model, prompts, completions, 0.7)
    old = [logps[b, : len(c)].tolist() for b, c in enumerate(completions)]
    trace = TeacherTrace(teacher="t", prompt_id="p1", text="", completion_ids=[5, 6, 7])
    batch = _batch(prompts, completions, old, traces=[trace])
    reference = copy.deepcopy(model).requires_grad_(False)
    loss = LossConfig(kl_beta=0.1, beta_replay=1.0, dpo_variant="dpo")
    lb = build_loss_batch(batch, model, loss, temperature=0.7, reference=reference)
    lb.validate()
    assert lb.logits.requires_grad
    cur = token_logprobs(lb.logits, lb.token_ids)
    assert torch.allclose(cur[lb.mask].float(), lb.old_logprobs[lb.mask], atol=1e-6)
    assert torch.allclose(lb.ref_logprobs[lb.mask].float(), lb.old_logprobs[lb.mask], atol=1e-6)
    assert lb.group_ids.tolist() == [0, 0, 1, 1] and lb.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    # Replay: p1's trace against p1's lowest-reward rollout (row 2).
    pairs = lb.replay
    assert pairs is not None and pairs.teachers == ["t"]
    [chosen_ref] = reference_logprobs(model, [prompts[2]], [trace.completion_ids], 0.7)
    assert torch.allclose(pairs.chosen_logps[0].double(), chosen_ref, atol=1e-6, rtol=0)
    assert torch.allclose(pairs.rejected_logps[0][pairs.rejected_mask[0]], cur[2][lb.mask[2]])
    assert pairs.ref_chosen_logps.item() == pytest.approx(float(chosen_ref.sum()), abs=1e-5)
    assert pairs.ref_rejected_logps.item() == pytest.approx(float(cur[2][lb.mask[2]].sum().detach()), abs=1e-5)
    # Channels the config does not weight get no inputs.
    off = build_loss_batch(batch, model, LossConfig(kl_beta=0.0, alpha_sdpo=0.0, beta_replay=0.0), reference=reference)
    assert off.ref_logprobs is None and off.replay is None and not off.has_teacher


def test_teacher_inputs_dense_and_topk():
    prompts, completions = [[1], [1], [2], [2]], [[3, 4], [5], [6, 7, 8], []]
    old = [[0.0] * len(c) for c in completions]
    dense = [TokenDistribution(teacher="t", logits=torch.randn(len(c), 9)) if c else None for c in completions]
    out = teacher_inputs(dense, width=3, vocab=9)
    assert set(out) == {"teacher_logits", "distill_mask"} and out["teacher_logits"].shape == (4, 3, 9)
    assert out["distill_mask"].sum(-1).tolist() == [2, 1, 3, 0]
    assert torch.equal(out["teacher_logits"][2], dense[2].logits)
    topk = []
    for c in completions:
        vals, ids = torch.log_softmax(torch.randn(len(c), 9), -1).topk(2 if len(c) != 1 else 1, -1)
        topk.append(TokenDistribution(teacher="t", topk_ids=ids, topk_logprobs=vals))
    out = teacher_inputs(topk, width=3, vocab=9)
    assert set(out) == {"teacher_topk_ids", "teacher_topk_logprobs", "distill_mask"}
    assert out["teacher_topk_ids"].shape == (4, 3, 2)
    assert out["teacher_topk_logprobs"][1, 0, 1] == -float("inf")  # narrower top-k padded with -inf
    with pytest.raises(ValueError, match="1 teacher distributions for 4 rollouts"):
        TrainRows.of(_batch(prompts, completions, old, dists=dense[:1]), LossConfig())
    assert teacher_inputs([None] * 4, width=3, vocab=9) == {}


@pytest.mark.parametrize("sparse", [False, True])
def test_a_student_equal_to_its_teacher_has_zero_distillation_at_any_sampling_temperature(model, sparse):
    """The teacher is tempered like the student: a teacher whose raw logits are the student's own gives a zero
    divergence at T = 0.6 (dense, and top-k renormalised on its support). Against an untempered teacher the
    divergence would be far from 0 and its minimum would sit at T x the teacher's logits (a flatter policy)."""
    prompts, completions = sequences(model.config.vocab_size)
    temperature, k = 0.6, 5
    dists = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            raw = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) - 1 + len(c)]
            if sparse:
                vals, ids = torch.log_softmax(raw, -1).topk(k, -1)
                dists.append(TokenDistribution(teacher="t", topk_ids=ids, topk_logprobs=vals.float()))
            else:
                dists.append(TokenDistribution(teacher="t", logits=raw))
    old = [[0.0] * len(c) for c in completions]
    lb = build_loss_batch(_batch(prompts, completions, old, dists=dists), model, LossConfig(alpha_sdpo=1.0),
                          temperature=temperature)
    sel = lb.mask & lb.distill_mask
    student = lb.logits[sel]
    if sparse:
        student = student.gather(-1, lb.teacher_topk_ids[sel].long())
        teacher = lb.teacher_topk_logprobs[sel]
    else:
        teacher = lb.teacher_logits[sel]
    kl = (torch.log_softmax(teacher, -1).exp() * (torch.log_softmax(teacher, -1) - torch.log_softmax(student, -1)))
    assert kl.sum(-1).abs().max().item() < 1e-6
    untempered = teacher * temperature  # what the teacher was before this change
    drift = torch.log_softmax(untempered, -1).exp() * (torch.log_softmax(untempered, -1) - torch.log_softmax(student, -1))
    assert drift.sum(-1).mean().item() > 1e-2


def test_pad_is_right_padded_and_never_empty():
    assert pad([[1, 2], [3]], 0, torch.long).tolist() == [[1, 2], [3, 0]]
    assert pad([[], []], -1.0, torch.float32).tolist() == [[-1.0], [-1.0]]


# ---- micro-batches, hidden states and packing against one padded pass (float64, real tiny model) ---------------


def _rich_batch(model) -> TrainBatch:
    """Three groups of ragged rollouts, a dense teacher on some rows, two replay traces."""
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    groups, dists = [], []
    for i in range(3):
        prompt_ids = torch.randint(1, vocab, (3 + i,), generator=g).tolist()
        rollouts, scores = [], []
        for j in range(3):
            comp = torch.randint(1, vocab, (1 + (2 * i + 3 * j) % 7,), generator=g).tolist()
            rollouts.append(Rollout(f"p{i}", prompt_ids, comp, (-torch.rand(len(comp), generator=g)).tolist(), 1))
            scores.append(RewardResult(score=float((i + j) % 2) + 0.1 * j))
            dense = (i + j) % 3 != 0
            dists.append(TokenDistribution(teacher="t", logits=torch.randn(len(comp), vocab, generator=g)) if dense else None)
        groups.append(ScoredGroup(RolloutGroup(Prompt(f"p{i}", "", prompt_ids), rollouts), scores))
    traces = [TeacherTrace(teacher=f"t{i}", prompt_id=f"p{i}", text="", completion_ids=[3, 4, 5][: i + 1]) for i in (0, 2)]
    return TrainBatch(groups=groups, distributions=dists, traces=traces)


def _accumulated_grads(model, loss: LossConfig, batch: TrainBatch, budget, head, packed) -> tuple[dict, float]:
    from composer_mesh.actors.backends.trainer.train_batch import StudentPass, build_piece
    from composer_mesh.loss.compose import LossAccumulator
    from composer_mesh.loss.grpo import group_advantages

    model.zero_grad(set_to_none=True)
    data = TrainRows.of(batch, loss)
    reference = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    run = StudentPass(model, loss, 0.8, reference, head, packed)
    adv = group_advantages(data.rewards, data.group_ids, loss.scale_std, loss.advantage_eps)
    acc = LossAccumulator(loss, data.totals())
    pieces = data.micro_batches(budget, packed)
    for piece in pieces:
        acc.add(build_piece(data, piece, run, adv)).total.backward()
    total = float(acc.finish().total)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, total, len(pieces)


@pytest.mark.parametrize("loss", [
    LossConfig(kl_beta=0.05, beta_replay=1.0, dpo_variant="dpo", normalization="token"),
    LossConfig(kl_beta=0.05, beta_replay=0.5, dpo_variant="simpo", normalization="sequence", sdpo_jsd_beta=0.2),
], ids=["token-dpo", "sequence-simpo"])
@pytest.mark.parametrize(("budget", "head", "packed"), [
    (None, "chunked", False), (40, "full", False), (40, "chunked", False), (None, "chunked", True), (25, "chunked", True),
])
def test_micro_batched_packed_and_hidden_steps_equal_one_padded_pass(model, loss, budget, head, packed):
    """Gradients of all three channels: pieces under a token budget, hidden-state log-probs and packed rows
    against one padded full-logits pass of the whole batch, float64, to 1e-10."""
    torch.manual_seed(0)
    batch = _rich_batch(model)
    expected, expected_total, _ = _accumulated_grads(model, loss, batch, None, "full", False)
    torch.manual_seed(0)
    got, total, pieces = _accumulated_grads(model, loss, batch, budget, head, packed)
    assert pieces > 1 if budget else pieces == 1
    assert total == pytest.approx(expected_total, rel=1e-12)
    assert set(got) == set(expected) and len(got) == len(list(model.parameters()))
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-10, msg=name)


def test_micro_batches_respect_the_budget_and_keep_traces_with_their_rejected_row(model):
    batch = _rich_batch(model)
    data = TrainRows.of(batch, LossConfig(beta_replay=1.0))
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in data.rollouts]
    for packed in (False, True):
        pieces = data.micro_batches(30, packed)
        assert sorted(r for p in pieces for r in p.rows) == list(range(len(data.rollouts)))
        assert sorted(i for p in pieces for i in p.pairs) == list(range(len(data.pairs)))
        for p in pieces:
            assert all(data.pairs[i][1] in p.rows for i in p.pairs)
            own = sum(lengths[r] for r in p.rows) if packed else len(p.rows) * max(lengths[r] for r in p.rows)
            assert own <= 30 or len(p.rows) == 1
    assert data.totals().replay_pairs == 2 and data.totals().sequences == 9


def test_scored_traces_pair_only_when_they_beat_the_rejected_rollout(model):
    """Rejected = the lowest-reward rollout of the prompt (reward 0 for both prompts here). A scored trace is paired
    only when its reward is higher; equal or lower ones are counted in traces_not_better; unscored ones pair."""
    prompts, completions = sequences(model.config.vocab_size)
    old = [[-1.0] * len(c) for c in completions]
    traces = [
        TeacherTrace(teacher="higher", prompt_id="p1", text="", completion_ids=[5, 6], reward=0.5),
        TeacherTrace(teacher="equal", prompt_id="p1", text="", completion_ids=[5, 6], reward=0.0),
        TeacherTrace(teacher="lower", prompt_id="p0", text="", completion_ids=[7], reward=-1.0),
        TeacherTrace(teacher="unscored", prompt_id="p0", text="", completion_ids=[7, 8]),
        TeacherTrace(teacher="nan", prompt_id="p0", text="", completion_ids=[7], reward=float("nan")),
    ]
    batch = _batch(prompts, completions, old, traces=traces)
    data = TrainRows.of(batch, LossConfig(beta_replay=1.0))
    assert [(t.teacher, row) for t, row in data.pairs] == [("higher", 2), ("unscored", 1)]
    assert data.traces_not_better == 3
    assert data.totals().replay_pairs == 2
    off = TrainRows.of(batch, LossConfig(beta_replay=0.0))
    assert off.pairs == [] and off.traces_not_better == 0
    lower_only = TrainRows.of(_batch(prompts, completions, old, traces=traces[1:3]), LossConfig(beta_replay=1.0))
    assert lower_only.pairs == [] and lower_only.traces_not_better == 2
