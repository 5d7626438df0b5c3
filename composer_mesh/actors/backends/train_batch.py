"""TrainBatch -> LossBatch: the inputs `compose_loss` takes, computed from a batch and a policy module.

Plain functions over any causal LM that maps `input_ids`/`attention_mask` to `.logits` (no model server,
optimizer or Monarch), so they are tested on their own; the `hf` trainer calls `build_loss_batch` once per step.

Alignment used everywhere (student, reference, teachers): for a sequence `prompt + completion`, the logits at
position `len(prompt) - 1 + t` score completion token `t`. The policy's logits are divided by the sampling
temperature before any log-prob (generators report log-probs under `softmax(logits / T)`), and per-token
log-probs are `composer_mesh.loss.compose.token_logprobs` (chunked: no full float32 softmax copy).
"""

from __future__ import annotations

import math

import torch

from composer_mesh.actors.messages import Rollout, TeacherTrace, TokenDistribution, TrainBatch
from composer_mesh.loss.compose import LossBatch, ReplayPairs, token_logprobs
from composer_mesh.loss.config import LossConfig


def pad(
    rows: list[list[int]] | list[list[float]], value: float, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Right-padded [len(rows), max(longest row, 1)] tensor of `rows`."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), value, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.to(device)


def _mask(rows: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """[B, T] bool, True on the real tokens of each row (T as in `pad`)."""
    return pad([[1] * len(r) for r in rows], 0, torch.long, device).bool()


def completion_logits(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    """Logits [B, T, V] where [b, t] scores completion token t of row b (T = longest completion)."""
    device = next(model.parameters()).device
    seqs = [p + c for p, c in zip(prompts, completions)]
    ids = pad(seqs, 0, torch.long, device)
    attn = pad([[1] * len(s) for s in seqs], 0, torch.long, device)
    logits = model(input_ids=ids, attention_mask=attn).logits  # [B, L, V]
    width = max(max((len(c) for c in completions), default=1), 1)
    index = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        pos = torch.arange(width) + len(p) - 1
        index[b] = pos.clamp(max=len(p) + len(c) - 1)
    index = index.to(device)
    return logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def completion_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, T] float32 of each completion token under softmax(logits / temperature), mask [B, T])."""
    logits = completion_logits(model, prompts, completions) / temperature
    return token_logprobs(logits, pad(completions, 0, torch.long, logits.device)), _mask(completions, logits.device)


# ---- channel 2: teacher distributions ------------------------------------------------------------------


def _distill_mask(dists: list[TokenDistribution | None], rollouts: list[Rollout], width: int) -> torch.Tensor:
    """[B, T] bool: the tokens that have a teacher distribution. Raises on a length mismatch."""
    mask = torch.zeros(len(rollouts), width, dtype=torch.bool)
    for b, (d, r) in enumerate(zip(dists, rollouts)):
        if d is None:
            continue
        if d.num_tokens != len(r.completion_ids):
            raise ValueError(
                f"teacher {d.teacher!r} gave {d.num_tokens} token distributions for a {len(r.completion_ids)}-token "
                f"completion of prompt {r.prompt_id!r}"
            )
        mask[b, : d.num_tokens] = True
    return mask


def _dense_teacher(dists: list[TokenDistribution | None], width: int, vocab: int) -> torch.Tensor:
    """[B, T, V] teacher logits (zeros where a row has none)."""
    out = torch.zeros(len(dists), width, vocab)
    for b, d in enumerate(dists):
        if d is not None and d.logits is not None:
            if d.logits.shape[-1] != vocab:
                raise ValueError(f"teacher {d.teacher!r} logits have vocab {d.logits.shape[-1]}, student has {vocab}")
            out[b, : d.num_tokens] = d.logits.float()
    return out


def _topk_teacher(dists: list[TokenDistribution | None], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, k] teacher top-k ids and log-probs (k = the widest given; missing entries get -inf)."""
    k = max(d.topk_ids.shape[-1] for d in dists if d is not None and d.topk_ids is not None)
    ids = torch.zeros(len(dists), width, k, dtype=torch.long)
    lps = torch.full((len(dists), width, k), -math.inf)
    for b, d in enumerate(dists):
        if d is not None and d.topk_ids is not None and d.topk_logprobs is not None:
            n, kk = d.topk_ids.shape
            ids[b, :n, :kk] = d.topk_ids
            lps[b, :n, :kk] = d.topk_logprobs.float()
    return ids, lps


def teacher_inputs(
    batch: TrainBatch, width: int, vocab: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The `LossBatch` teacher fields (dense `teacher_logits` if any distribution is dense, else top-k) and
    `distill_mask`; {} when the batch has no distributions."""
    dists = batch.distributions
    if not dists or all(d is None for d in dists):
        return {}
    rollouts = batch.rollouts()
    if len(dists) != len(rollouts):
        raise ValueError(f"TrainBatch has {len(dists)} teacher distributions for {len(rollouts)} rollouts")
    out = {"distill_mask": _distill_mask(dists, rollouts, width)}
    if any(d is not None and d.logits is not None for d in dists):
        out["teacher_logits"] = _dense_teacher(dists, width, vocab)
    else:
        out["teacher_topk_ids"], out["teacher_topk_logprobs"] = _topk_teacher(dists, width)
    return {k: v.to(device) for k, v in out.items()}


# ---- channel 3: replay pairs ---------------------------------------------------------------------------


def _lowest_reward_rows(batch: TrainBatch) -> dict[str, int]:
    """Prompt id -> flat row of its lowest-reward rollout (the first of equals)."""
    row_of: dict[str, int] = {}
    worst: dict[str, float] = {}
    row = 0
    for g in batch.groups:
        for r, rw in zip(g.group.rollouts, g.rewards):
            if r.prompt_id not in worst or rw.score < worst[r.prompt_id]:
                worst[r.prompt_id], row_of[r.prompt_id] = rw.score, row
            row += 1
    return row_of


def _sequence_logps(
    reference: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], temperature: float
) -> torch.Tensor:
    """[P] summed log-probs of each completion under `reference` (no grad)."""
    with torch.no_grad():
        logps, mask = completion_logprobs(reference, prompts, completions, temperature)
    return (logps * mask).sum(-1)


def replay_pairs(
    batch: TrainBatch,
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    model: torch.nn.Module,
    temperature: float = 1.0,
    reference: torch.nn.Module | None = None,
) -> ReplayPairs | None:
    """chosen = each teacher trace, rejected = the lowest-reward student rollout of the same prompt.

    `logits`, `token_ids`, `mask` are the batch's (temperature already applied); the traces get a forward of
    `model` with grad. With `reference` (DPO), both sides also get its summed log-probs.
    """
    row_of = _lowest_reward_rows(batch)
    traces: list[TeacherTrace] = [t for t in batch.traces if t.prompt_id in row_of and t.completion_ids]
    if not traces:
        return None
    rollouts = batch.rollouts()
    prompt_of = {r.prompt_id: r.prompt_ids for r in rollouts}
    rows = [row_of[t.prompt_id] for t in traces]
    chosen_prompts = [prompt_of[t.prompt_id] for t in traces]
    chosen_ids = [t.completion_ids for t in traces]
    chosen_logps, chosen_mask = completion_logprobs(model, chosen_prompts, chosen_ids, temperature)
    rejected_logps = token_logprobs(logits[rows], token_ids[rows])
    ref_chosen = ref_rejected = None
    if reference is not None:
        ref_chosen = _sequence_logps(reference, chosen_prompts, chosen_ids, temperature)
        rejected = [rollouts[i] for i in rows]
        ref_rejected = _sequence_logps(
            reference, [r.prompt_ids for r in rejected], [r.completion_ids for r in rejected], temperature
        )
    return ReplayPairs(
        chosen_logps=chosen_logps, chosen_mask=chosen_mask, rejected_logps=rejected_logps,
        rejected_mask=mask[rows], ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
        teachers=[t.teacher for t in traces],
    )


# ---- the whole batch -----------------------------------------------------------------------------------


def build_loss_batch(
    batch: TrainBatch,
    model: torch.nn.Module,
    loss: LossConfig,
    *,
    temperature: float = 1.0,
    reference: torch.nn.Module | None = None,
) -> LossBatch:
    """One `LossBatch` for `batch` under `model` (logits with grad). Each channel's inputs are computed only
    when `loss` weights it: the reference's log-probs for `kl_beta > 0`, teacher inputs for `alpha_sdpo > 0`,
    replay pairs for `beta_replay > 0` with traces (reference log-probs for them with `dpo_variant='dpo'`)."""
    rollouts = batch.rollouts()
    if not rollouts:
        raise ValueError("TrainBatch has no rollouts")
    prompts = [r.prompt_ids for r in rollouts]
    completions = [r.completion_ids for r in rollouts]
    logits = completion_logits(model, prompts, completions) / temperature
    dev = logits.device
    token_ids = pad(completions, 0, torch.long, dev)
    mask = _mask(completions, dev)
    old_logprobs = pad([r.logprobs for r in rollouts], 0.0, torch.float32, dev)
    rewards = torch.tensor([rw.score for g in batch.groups for rw in g.rewards], dtype=torch.float32, device=dev)
    group_ids = torch.tensor(
        [i for i, g in enumerate(batch.groups) for _ in g.group.rollouts], dtype=torch.long, device=dev
    )
    ref_logprobs = None
    if reference is not None and loss.kl_beta > 0:
        with torch.no_grad():
            ref_logprobs, _ = completion_logprobs(reference, prompts, completions, temperature)
    teacher = teacher_inputs(batch, logits.shape[1], logits.shape[-1], dev) if loss.alpha_sdpo > 0 else {}
    replay = None
    if loss.beta_replay > 0 and batch.traces:
        replay_ref = reference if loss.dpo_variant == "dpo" else None
        replay = replay_pairs(batch, logits, token_ids, mask, model, temperature, replay_ref)
    return LossBatch(
        logits=logits, token_ids=token_ids, mask=mask, old_logprobs=old_logprobs, rewards=rewards,
        group_ids=group_ids, ref_logprobs=ref_logprobs, replay=replay, **teacher,
    )
