"""Episodes (`Rollout.turns`) through the trainer's TrainBatch -> LossBatch adapter: the same code path as plain
completions, with `LossBatch.mask` = real tokens AND `Rollout.loss_mask()`. Real tiny Qwen2, float64, CPU."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from composer_mesh.actors.backends.trainer.train_batch import (
    StudentPass,
    TrainRows,
    build_loss_batch,
    build_piece,
    completion_logprobs,
    episode_metrics,
    policy_mask,
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
    Turn,
)
from composer_mesh.loss.compose import BatchTotals, LossAccumulator, compose_loss, token_logprobs
from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.grpo import group_advantages
from composer_mesh.models.config import ModelConfig
from composer_mesh.models.tiny import build_tiny

TEMPERATURE = 0.8
LOSSES = {
    "token-dpo-dense": (LossConfig(kl_beta=0.05, beta_replay=1.0, dpo_variant="dpo", normalization="token"), False),
    "sequence-simpo-topk": (LossConfig(kl_beta=0.05, beta_replay=0.5, dpo_variant="simpo", normalization="sequence",
                                       sdpo_jsd_beta=0.2, dppo_mask=True), True),
    "token-tis-topk": (LossConfig(kl_beta=0.02, beta_replay=1.0, dpo_variant="dpo", off_policy_correction="tis"), True),
}


@pytest.fixture(scope="module")
def model():
    """The tiny model in float64 with a sharper head (log-probs far from uniform)."""
    m, _ = build_tiny(ModelConfig(seed=3))
    with torch.no_grad():
        m.lm_head.weight.mul_(5.0)
    return m.double()


@pytest.fixture(scope="module")
def reference(model):
    """A perturbed copy: the KL and DPO terms are not zero."""
    ref = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return ref


def episode(prompt_id: str, prompt_ids: list[int], spans: list[tuple[int, bool]], vocab: int,
            g: torch.Generator) -> Rollout:
    """An episode of `spans` ((length, policy) in order): random tokens, sampler log-probs on policy tokens,
    0.0 on the environment's (as generators report them)."""
    turns, at = [], 0
    for n, policy in spans:
        turns.append(Turn(at, at + n, policy, weight_version=1 if policy else None))
        at += n
    ids = torch.randint(1, vocab, (at,), generator=g).tolist()
    mask = [1 if t.policy else 0 for t in turns for _ in range(t.start, t.end)]
    logprobs = [-float(torch.rand(1, generator=g)) * m for m in mask]
    return Rollout(prompt_id, prompt_ids, ids, logprobs, 1, turns=turns, status="truncated_turns")


def _teacher(n: int, vocab: int, topk: bool, g: torch.Generator) -> TokenDistribution:
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    if not topk:
        return TokenDistribution(teacher="t", logits=logits)
    vals, ids = torch.log_softmax(logits, -1).topk(4, -1)
    return TokenDistribution(teacher="t", topk_ids=ids, topk_logprobs=vals)


ROWS = [  # per group: each rollout's spans; a 1-span policy list is a plain completion (turns None)
    [[(4, True), (3, False), (2, True)], [(5, True)], [(2, True), (6, False), (3, True), (2, False), (1, True)]],
    [[(3, True)], [(1, True), (4, False), (4, True)], [(6, True)]],
    [[(2, True), (2, False), (2, True), (3, False), (2, True)], [(7, True)], [(3, True), (5, False), (1, True)]],
]


def mixed_batch(vocab: int, topk: bool = False) -> TrainBatch:
    """Three groups mixing episodes and plain completions, a teacher on most rows (over every completion token,
    environment ones included), a plain and an episode replay trace."""
    g = torch.Generator().manual_seed(5)
    groups, dists = [], []
    for i, rows in enumerate(ROWS):
        prompt_ids = torch.randint(1, vocab, (3 + i,), generator=g).tolist()
        rollouts = []
        for j, spans in enumerate(rows):
            r = episode(f"p{i}", prompt_ids, spans, vocab, g)
            rollouts.append(r if len(spans) > 1 else Rollout(r.prompt_id, prompt_ids, r.completion_ids, r.logprobs, 1))
            dists.append(_teacher(len(r.completion_ids), vocab, topk, g) if (i + j) % 3 else None)
        scores = [RewardResult(score=float((i + j) % 2) + 0.1 * j) for j in range(len(rows))]
        groups.append(ScoredGroup(RolloutGroup(Prompt(f"p{i}", "", prompt_ids), rollouts), scores))
    trace_ep = episode("p2", [], [(2, True), (3, False), (2, True)], vocab, g)
    traces = [TeacherTrace(teacher="t0", prompt_id="p0", text="", completion_ids=[3, 4, 5]),
              TeacherTrace(teacher="t2", prompt_id="p2", text="", completion_ids=trace_ep.completion_ids,
                           turns=trace_ep.turns)]
    return TrainBatch(groups=groups, distributions=dists, traces=traces)


def step(model, reference, loss: LossConfig, batch: TrainBatch, budget=None, head="full", packed=False):
    """The hf trainer's step without the optimizer: (loss, grads, #pieces, the rows' totals)."""
    model.zero_grad(set_to_none=True)
    data = TrainRows.of(batch, loss)
    run = StudentPass(model, loss, TEMPERATURE, reference, head, packed)
    adv = group_advantages(data.rewards, data.group_ids, loss.scale_std, loss.advantage_eps)
    acc = LossAccumulator(loss, data.totals())
    pieces = data.micro_batches(budget, packed)
    for piece in pieces:
        acc.add(build_piece(data, piece, run, adv)).total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(acc.finish().total), grads, len(pieces), data.totals()


def assert_same_step(a, b, atol=1e-10):
    assert a[0] == pytest.approx(b[0], rel=1e-12, abs=atol)
    assert set(a[1]) == set(b[1]) and a[1]
    for name, grad in a[1].items():
        torch.testing.assert_close(grad, b[1][name], rtol=0, atol=atol, msg=name)


# ---- (c) one code path: micro-batches, packing and the chunked head on a mixed batch -------------------------


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize(("budget", "head", "packed"), [
    (30, "full", False), (None, "chunked", False), (30, "chunked", False), (None, "chunked", True),
    (25, "chunked", True),
])
def test_micro_batched_packed_and_chunked_episodes_equal_one_padded_pass(model, reference, name, budget, head,
                                                                        packed):
    loss, topk = LOSSES[name]
    batch = mixed_batch(model.config.vocab_size, topk)
    expected = step(model, reference, loss, batch)
    got = step(model, reference, loss, batch, budget, head, packed)
    assert got[2] > 1 if budget else got[2] == 1
    assert_same_step(got, expected)


@pytest.mark.parametrize("name", list(LOSSES))
def test_totals_count_policy_tokens_as_the_whole_loss_batch_does(model, reference, name):
    loss, topk = LOSSES[name]
    batch = mixed_batch(model.config.vocab_size, topk)
    data = TrainRows.of(batch, loss)
    lb = build_loss_batch(batch, model, loss, temperature=TEMPERATURE, reference=reference)
    assert data.totals() == BatchTotals.of(lb)
    policy = [sum(m for m in r.loss_mask()) for r in batch.rollouts()]
    assert data.totals().tokens == sum(policy) < sum(len(r.completion_ids) for r in batch.rollouts())
    assert data.totals().distill_tokens == sum(p for p, d in zip(policy, batch.distributions) if d is not None)
    assert lb.mask.sum(-1).tolist() == policy and torch.equal(lb.distill_mask, lb.distill_mask & lb.mask)
    assert lb.replay is not None and lb.replay.chosen_mask.sum(-1).tolist() == [3, 4]  # the episode trace: 2 + 2


# ---- (a) nothing at environment positions matters ----------------------------------------------------------


def _scramble_env(batch: TrainBatch) -> TrainBatch:
    """The same batch with garbage wherever the loss mask is 0: sampler log-probs, the teacher's distributions,
    environment turns' rewards."""
    out = copy.deepcopy(batch)
    g = torch.Generator().manual_seed(99)
    for r, d in zip(out.rollouts(), out.distributions):
        env = [i for i, m in enumerate(r.loss_mask()) if not m]
        for i in env:
            r.logprobs[i] = -5.0 * float(torch.rand(1, generator=g))
        for t in r.turns or []:
            t.reward = None if t.policy else 123.0
        if d is not None and env:
            if d.logits is not None:
                d.logits[env] = 10 * torch.randn(len(env), d.logits.shape[-1], generator=g, dtype=d.logits.dtype)
            else:
                d.topk_logprobs[env] = torch.log_softmax(torch.randn(len(env), 4, generator=g, dtype=torch.float64), -1)
                d.topk_ids[env] = d.topk_ids[env].flip(-1)
    return out


@pytest.mark.parametrize("name", list(LOSSES))
def test_environment_positions_change_nothing(model, reference, name):
    loss, topk = LOSSES[name]
    batch = mixed_batch(model.config.vocab_size, topk)
    scrambled = _scramble_env(batch)
    assert scrambled.rollouts()[0].logprobs != batch.rollouts()[0].logprobs  # the scramble did something
    assert_same_step(step(model, reference, loss, scrambled, 30, "chunked", True), step(model, reference, loss, batch))


def test_reference_and_per_token_advantages_at_environment_positions_change_nothing(model, reference):
    """LossBatch fields the trainer fills from the model (reference log-probs) or a caller may give per token
    (advantages [B, T]): their environment positions are masked like every other."""
    loss, _ = LOSSES["token-dpo-dense"]
    batch = mixed_batch(model.config.vocab_size)
    results = []
    for garbage in (0.0, 1.0):
        model.zero_grad(set_to_none=True)
        lb = build_loss_batch(batch, model, loss, temperature=TEMPERATURE, reference=reference)
        env = ~lb.mask
        lb.advantages = torch.linspace(-1, 1, lb.mask.numel(), dtype=torch.float64).reshape(lb.mask.shape)
        lb.advantages[env] = 7.0 * garbage
        lb.ref_logprobs[env] = -9.0 * garbage
        lb.old_logprobs[env] = -3.0 * garbage
        out = compose_loss(lb, loss)
        out.total.backward()
        results.append((out.total.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert_same_step(results[0], results[1], atol=0.0)


# ---- (b) against a hand computation over policy tokens ----------------------------------------------------


def _hand_grpo(model, batch: TrainBatch, loss: LossConfig) -> torch.Tensor:
    """PPO-clip over policy tokens only, from `completion_logprobs` (all completion tokens scored, the policy's
    picked by hand from the turns), token- or sequence-normalised over policy tokens."""
    rollouts = batch.rollouts()
    logps, _ = completion_logprobs(model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts],
                                      TEMPERATURE)
    data = TrainRows.of(batch, loss)
    adv = group_advantages(data.rewards, data.group_ids, loss.scale_std, loss.advantage_eps)
    rows = []
    for b, r in enumerate(rollouts):
        idx = torch.tensor([i for t in r.turns or [Turn(0, len(r.completion_ids), True)] if t.policy
                            for i in range(t.start, t.end)])
        ratio = torch.exp(logps[b, idx] - torch.tensor(r.logprobs, dtype=torch.float64)[idx])
        a = adv[b].double()
        rows.append(-torch.minimum(ratio * a, ratio.clamp(1 - loss.eps_low, 1 + loss.eps_high) * a))
    if loss.normalization == "token":
        return torch.cat(rows).sum() / sum(len(x) for x in rows)
    return torch.stack([x.mean() for x in rows]).mean()


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_grpo_on_episodes_equals_a_hand_computation_over_policy_tokens(model, normalization):
    loss = LossConfig(alpha_sdpo=0.0, beta_replay=0.0, normalization=normalization)
    batch = mixed_batch(model.config.vocab_size)
    assert any(r.turns for r in batch.rollouts())
    model.zero_grad(set_to_none=True)
    got = compose_loss(build_loss_batch(batch, model, loss, temperature=TEMPERATURE), loss).total
    got.backward()
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = _hand_grpo(model, batch, loss)
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got_grads[n], p.grad, rtol=0, atol=1e-12, msg=n)


def test_episode_loss_equals_the_plain_rollout_masked_by_hand(model, reference):
    """Every channel: the batch with turns equals the same tokens as plain completions (turns dropped) whose
    LossBatch masks (policy, distillation, replay) are cut to the policy tokens by hand."""
    loss = LossConfig(kl_beta=0.05, beta_replay=1.0, dpo_variant="simpo", normalization="sequence")
    batch = mixed_batch(model.config.vocab_size)
    plain = copy.deepcopy(batch)
    for r in [*plain.rollouts(), *plain.traces]:
        r.turns = None
    got = compose_loss(build_loss_batch(batch, model, loss, temperature=TEMPERATURE, reference=reference), loss)
    lb = build_loss_batch(plain, model, loss, temperature=TEMPERATURE, reference=reference)
    by_hand = torch.zeros_like(lb.mask)
    for b, r in enumerate(batch.rollouts()):
        by_hand[b, : len(r.completion_ids)] = torch.tensor(r.loss_mask(), dtype=torch.bool)
    assert not torch.equal(lb.mask, by_hand)
    lb.mask, lb.distill_mask = by_hand, lb.distill_mask & by_hand
    lb.replay.rejected_mask = lb.replay.rejected_mask & by_hand[[0, 6]]  # p0's and p2's lowest-reward rows
    lb.replay.chosen_mask[1, 2:5] = False  # the episode trace's environment span
    want = compose_loss(lb, loss)
    assert set(got.parts) == {"grpo", "sdpo", "replay"}
    for part, value in want.parts.items():
        assert got.parts[part].item() == pytest.approx(value.item(), rel=1e-12), part


# ---- (d) a single turn is today's completion ----------------------------------------------------------------


def test_one_policy_turn_is_bitwise_a_plain_completion(model, reference):
    loss, _ = LOSSES["token-dpo-dense"]
    batch = mixed_batch(model.config.vocab_size)
    plain = [r for r in batch.rollouts() if r.turns is None]
    one_turn = copy.deepcopy(batch)
    for r in one_turn.rollouts():
        if r.turns is None:
            r.turns = [Turn(0, len(r.completion_ids), True, weight_version=1)]
    assert plain and all(r.turns is not None for r in one_turn.rollouts())
    assert_same_step(step(model, reference, loss, one_turn, 30, "chunked", True),
                     step(model, reference, loss, batch, 30, "chunked", True), atol=0.0)
    real = torch.ones(2, 3, dtype=torch.bool)
    assert policy_mask(real, None) is real and policy_mask(real, [[1, 1, 1], [1, 1]]) is real


# ---- (e) alignment across turn boundaries -------------------------------------------------------------------


@pytest.mark.parametrize(("head", "packed"), [("full", False), ("chunked", False), ("chunked", True)])
def test_policy_token_logprobs_equal_per_turn_recomputation(model, head, packed):
    """Each policy turn of an episode, scored as its own completion after prompt + every earlier token (what the
    generator saw when it sampled the turn), gets the log-probs the trainer computes on the whole episode."""
    batch = mixed_batch(model.config.vocab_size)
    rollouts = [r for r in batch.rollouts() if r.turns is not None]
    with torch.no_grad():
        logps, mask = completion_logprobs(model, [r.prompt_ids for r in rollouts],
                                          [r.completion_ids for r in rollouts], TEMPERATURE, head=head, packed=packed,
                                          loss_masks=[r.loss_mask() for r in rollouts])
        lb = build_loss_batch(batch, model, LossConfig(alpha_sdpo=0.0, beta_replay=0.0), temperature=TEMPERATURE)
        whole = token_logprobs(lb.logits, lb.token_ids)
    rows = {id(r): b for b, r in enumerate(batch.rollouts())}
    checked = 0
    for b, r in enumerate(rollouts):
        assert mask[b, : len(r.completion_ids)].tolist() == [bool(m) for m in r.loss_mask()]
        for t in (t for t in r.turns if t.policy):
            prefix = r.prompt_ids + r.completion_ids[: t.start]
            with torch.no_grad():
                alone, _ = completion_logprobs(model, [prefix], [r.completion_ids[t.start : t.end]], TEMPERATURE)
            torch.testing.assert_close(logps[b, t.start : t.end], alone[0], rtol=0, atol=1e-10)
            torch.testing.assert_close(whole[rows[id(r)], t.start : t.end], alone[0], rtol=0, atol=1e-10)
            checked += 1
    assert checked == sum(t.policy for r in rollouts for t in r.turns) >= 10


def test_episode_metrics_sum_policy_and_environment_tokens(model):
    batch = mixed_batch(model.config.vocab_size)
    rollouts = batch.rollouts()
    policy = sum(sum(r.loss_mask()) for r in rollouts)
    total = sum(len(r.completion_ids) for r in rollouts)
    assert episode_metrics(rollouts) == {
        "episode/policy_tokens": float(policy), "episode/env_tokens": float(total - policy),
        "episode/policy_turns": 12.0,
    }
    assert episode_metrics([r for r in rollouts if r.turns is None]) == {}


def test_the_hf_trainer_steps_on_episodes_and_reports_them():
    """One AdamW step of the `hf` trainer (micro-batched, packed, chunked head) on the mixed batch: every channel
    runs, counts policy tokens only, and the step reports the episode sums."""
    from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings

    trainer = HFTrainer(HFTrainerSettings(lr=1e-2, micro_batch_tokens=30, packing=True, lm_head="chunked"))
    trainer.start(ModelConfig(source="tiny", seed=3), LossConfig(kl_beta=0.01, beta_replay=1.0, dpo_variant="dpo"))
    batch = mixed_batch(trainer.model.config.vocab_size)
    m = trainer.train_step(batch)
    policy = sum(sum(r.loss_mask()) for r in batch.rollouts())
    assert set(m.channels) == {"grpo", "sdpo", "replay"} and m.metrics["micro_batches"] > 1
    assert m.metrics["grpo/tokens"] == m.metrics["episode/policy_tokens"] == policy
    assert m.metrics["episode/env_tokens"] == sum(len(r.completion_ids) for r in batch.rollouts()) - policy
    distilled = sum(sum(r.loss_mask()) for r, d in zip(batch.rollouts(), batch.distributions) if d is not None)
    assert m.metrics["sdpo/tokens"] == distilled < sum(d.num_tokens for d in batch.distributions if d is not None)


def test_a_teacher_episode_without_turns_of_its_own_makes_no_replay_pair(model):
    batch = mixed_batch(model.config.vocab_size)
    batch.traces[1].turns = [Turn(0, len(batch.traces[1].completion_ids), False)]
    data = TrainRows.of(batch, LossConfig(beta_replay=1.0))
    assert [t.teacher for t, _ in data.pairs] == ["t0"] and data.totals().replay_pairs == 1


# ---- (c) an episode of several segments (a rewritten conversation) ----------------------------------------------


def segmented_batch(vocab: int) -> TrainBatch:
    """One group: episode `p0/7` in two segments (reward 1; the second opens with a fresh prompt), and a plain
    episode (reward 0)."""
    g = torch.Generator().manual_seed(4)
    first = replace(episode("p0", [1, 2, 3], [(3, True), (2, False), (4, True)], vocab, g), episode_id="p0/7")
    second = replace(episode("p0", [5, 6], [(2, True), (3, False), (3, True)], vocab, g), episode_id="p0/7",
                     segment=1)
    other = episode("p0", [1, 2, 3], [(4, True), (2, False), (2, True)], vocab, g)
    return TrainBatch([ScoredGroup(RolloutGroup(Prompt("p0", "q"), [first, second, other]),
                                   [RewardResult(1.0), RewardResult(1.0), RewardResult(0.0)])])


def test_segments_share_their_episodes_advantage_and_all_their_policy_tokens_count(model):
    loss = LossConfig(alpha_sdpo=0.0, beta_replay=0.0)
    batch = segmented_batch(model.config.vocab_size)
    data = TrainRows.of(batch, loss)
    assert data.episode_ids.tolist() == [0, 0, 1]
    a = 0.5 / (0.5**0.5 + 1e-4)  # two episodes, rewards 1 and 0 (three rows would give 0.58, 0.58, -1.15)
    want = torch.tensor([a, a, -a])
    torch.testing.assert_close(data.advantages(loss), want, rtol=0, atol=1e-6)
    assert data.totals().tokens == 7 + 5 + 6  # token normalisation: every segment's policy tokens
    assert data.episode_rewards().tolist() == [1.0, 0.0]
    lb = build_loss_batch(batch, model, loss, temperature=TEMPERATURE)
    assert lb.advantages is not None
    torch.testing.assert_close(lb.advantages.float(), want, rtol=0, atol=1e-6)


def test_the_hf_trainer_weighs_an_episode_once_however_many_segments_it_has():
    from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings

    trainer = HFTrainer(HFTrainerSettings(lr=1e-2))
    trainer.start(ModelConfig(source="tiny", seed=3), LossConfig(alpha_sdpo=0.0, beta_replay=0.0))
    m = trainer.train_step(segmented_batch(trainer.model.config.vocab_size))
    a = 0.5 / (0.5**0.5 + 1e-4)
    assert m.metrics["reward_mean"] == 0.5  # over episodes, not rows (2/3)
    # over the 18 policy tokens: 12 (both segments) at a, 6 at -a; rows as samples would give 0
    assert m.metrics["grpo/advantage_mean"] == pytest.approx(a / 3, abs=1e-6)


def test_per_turn_credit_runs_over_an_episodes_turns_across_its_segments(model):
    """Episode A (score 1) has policy turns with rewards 0.25, None in segment 0 and None, None in segment 1:
    r = 0.25, 0, 0, 0.75 (the remainder on the episode's last turn, not on each segment's), G = 1, 0.75, 0.75, 0.75
    (gamma 1). Episode B (score 0): r = G = 0, 0. The group's G_0 are 1 and 0 (mean 0.5, std sqrt(0.5)): A gets
    (1 - 0.5) / s on its first turn and 0.25 / s on the others, B -0.5 / s on both."""
    batch = segmented_batch(model.config.vocab_size)
    first, second, other = batch.rollouts()
    first.turns[0].reward = 0.25
    data = TrainRows.of(batch, LossConfig(alpha_sdpo=0.0, beta_replay=0.0, credit="discounted_return"))
    assert data.turn_rewards.tolist() == [[0.25, 0.0], [0.0, 0.75], [0.0, 0.0]]
    adv = data.advantages(LossConfig(credit="discounted_return"))
    s = 0.5**0.5 + 1e-4
    for row, r, want in [(0, first, [0.5, 0.25]), (1, second, [0.25, 0.25]), (2, other, [-0.5, -0.5])]:
        policy = [t for t in r.turns if t.policy]
        for t, a in zip(policy, want, strict=True):
            torch.testing.assert_close(adv[row, t.start:t.end].float(), torch.full((t.end - t.start,), a / s),
                                       rtol=0, atol=1e-6)
        env = [i for t in r.turns if not t.policy for i in range(t.start, t.end)]
        assert not adv[row, env].any()
