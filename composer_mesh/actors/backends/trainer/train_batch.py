"""TrainBatch -> LossBatch pieces: the inputs `compose_loss` takes, computed from a batch and a policy module.

Plain functions over any transformers causal LM (no model server, optimizer or Monarch), so they are tested on
their own; the `hf` trainer drives them once per micro-batch.

- `TrainRows` is a batch as flat rows (rollouts, rewards, groups, teacher distributions, replay pairs) with the
  whole batch's `BatchTotals`; `micro_batches` cuts it into pieces under a token budget.
- `Layout` is how one forward sees a piece: right-padded rows, or one packed row with per-rollout position ids
  (padding-free; transformers reads sequence boundaries from the position ids when no attention mask is given).
- `student_forward` returns the student as logits [B, T, V] (`head="full"`) or as `HiddenStates` (`"chunked"`):
  only completion positions' hidden states, and the LM head, so no [tokens x vocab] tensor is ever built.

Alignment used everywhere (student, reference, teachers): for a sequence `prompt + completion`, the logits at
position `len(prompt) - 1 + t` score completion token `t`. The policy's logits are divided by the sampling
temperature before any log-prob (generators report log-probs under `softmax(logits / T)`).

Episodes (`Rollout.turns`) take the same path: `completion_ids` holds every token after the opening prompt, so
the alignment above scores each policy turn given everything before it. Only `LossBatch.mask` differs: it is
the real-token mask AND `Rollout.loss_mask()`, so environment tokens are scored by the forward but no channel
trains on them or counts them (`TrainRows.totals` counts policy tokens only).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from composer_mesh.actors.messages import Rollout, TeacherTrace, TokenDistribution, TrainBatch, Turn
from composer_mesh.loss.compose import BatchTotals, HiddenStates, LossBatch, ReplayPairs, student_logprobs
from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.credit import episode_turn_rewards, padded_turns, token_advantages, turn_advantages
from composer_mesh.loss.grpo import episode_advantages

Head = Literal["chunked", "full"]


class TeacherSignalsMissing(UserWarning):
    """A TrainBatch with no `distributions` at all reached a trainer whose loss weights channel 2
    (`loss.alpha_sdpo > 0`): that step trains without distillation (GRPO, KL and replay only).

    A warning, not an error: a script may mean it (GRPO-only batches against a topology with a teacher), and the
    built-in loop never sends one: its batches always carry one entry per rollout (None where a teacher with
    `on_failure: skip` gave none, which is the teacher's own, reported, policy). Only an empty list, the
    dataclass default a script gets by leaving the field out, is warned about. `warnings.filterwarnings("error",
    category=TeacherSignalsMissing)` in the trainer makes it an error."""


def warn_missing_teacher_signals(batch: TrainBatch, loss: LossConfig) -> None:
    if loss.alpha_sdpo > 0 and not batch.distributions and batch.rollouts():
        warnings.warn(TeacherSignalsMissing(
            f"TrainBatch has no teacher distributions (distributions=[]) while loss.alpha_sdpo={loss.alpha_sdpo}: "
            "this step trains without distillation (channel 2). Pass the teachers' distributions (one per rollout, "
            "None where there is none) or set loss.alpha_sdpo: 0 (--set loss.alpha_sdpo=0)"), stacklevel=3)


def pad(
    rows: list[list[int]] | list[list[float]], value: float, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Right-padded [len(rows), max(longest row, 1)] tensor of `rows` (one host tensor built, one copy)."""
    width = max(max((len(r) for r in rows), default=0), 1)
    return torch.tensor([[*r, *[value] * (width - len(r))] for r in rows], dtype=dtype).reshape(len(rows), width).to(device)


def policy_mask(real: torch.Tensor, loss_masks: list[list[int]] | None) -> torch.Tensor:
    """`real` [B, T] AND each row's loss mask (`Rollout.loss_mask()`, 1 policy 0 environment): what is trained
    on. None: `real` (every token is the policy's)."""
    if loss_masks is None or all(all(m) for m in loss_masks):
        return real
    return real & pad(loss_masks, 0, torch.bool, real.device)


def _mask(rows: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """[B, T] bool, True on the real tokens of each row (T as in `pad`)."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = max(int(lengths.max()) if len(rows) else 0, 1)
    return (torch.arange(width)[None, :] < lengths[:, None]).to(device)


# ---- one forward -----------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """The model inputs for a set of (prompt, completion) sequences and where each completion is scored."""

    input_ids: torch.Tensor  # [R, L]
    attention_mask: torch.Tensor | None  # [R, L] (padded) or None (packed)
    position_ids: torch.Tensor | None  # [R, L] (packed) or None
    index: torch.Tensor  # [B, T] flat position in [R * L] whose output scores completion token t of sequence b
    mask: torch.Tensor  # [B, T] bool, real completion tokens


def layout(
    prompts: list[list[int]], completions: list[list[int]], device: torch.device | str, packed: bool = False
) -> Layout:
    """Padded rows ([B, longest]) or one packed row ([1, total]) of `prompt + completion` sequences."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(max((len(c) for c in completions), default=1), 1)
    t = torch.arange(width)
    if packed:
        starts = [0]
        for s in seqs[:-1]:
            starts.append(starts[-1] + len(s))
        ids = torch.tensor([[tok for s in seqs for tok in s]], dtype=torch.long)
        positions = torch.tensor([[i for s in seqs for i in range(len(s))]], dtype=torch.long)
        index = _score_index(t, prompts, completions, torch.tensor(starts))
        return Layout(ids.to(device), None, positions.to(device), index.to(device), _mask(completions, device))
    ids = pad(seqs, 0, torch.long, device)
    attn = _mask(seqs, device).long()
    index = _score_index(t, prompts, completions, torch.arange(len(seqs)) * ids.shape[1])
    return Layout(ids, attn, None, index.to(device), _mask(completions, device))


def _score_index(t: torch.Tensor, prompts: list[list[int]], completions: list[list[int]],
                 offsets: torch.Tensor) -> torch.Tensor:
    """[B, T] flat positions scoring completion token t of sequence b: its offset + len(prompt) - 1 + t, clamped
    to its last position (padding columns repeat it; the mask hides them)."""
    p = torch.tensor([len(x) for x in prompts], dtype=torch.long)[:, None]
    c = torch.tensor([len(x) for x in completions], dtype=torch.long)[:, None]
    first = offsets[:, None] + p - 1
    return torch.minimum(first + t[None, :], first + c)


def _output_head(model: torch.nn.Module) -> torch.nn.Linear:
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"head='chunked' needs a linear output head, {type(model).__name__} has {type(head).__name__}; "
            "use the trainer setting lm_head: full"
        )
    return head


def check_chunked_head(model: torch.nn.Module) -> None:
    """Raise unless logits are exactly `hidden @ head.T + bias` (no soft-capping or logit scaling)."""
    _output_head(model)
    config = model.config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1.0):
            raise ValueError(
                f"{type(model).__name__} transforms its logits ({name}={getattr(config, name)}): head='chunked' would "
                "compute different log-probs; use the trainer setting lm_head: full"
            )


def student_forward(
    model: torch.nn.Module, lay: Layout, *, head: Head = "full", temperature: float = 1.0,
    chunk_elements: int | None = None,
) -> torch.Tensor | HiddenStates:
    """The student at each completion token: logits [B, T, V] / temperature, or `HiddenStates` (no full logits)."""
    inputs = {"input_ids": lay.input_ids, "attention_mask": lay.attention_mask, "position_ids": lay.position_ids}
    if head == "full":
        logits = model(**inputs, use_cache=False).logits
        return logits.reshape(-1, logits.shape[-1])[lay.index] / temperature
    hidden = _last_hidden(model, inputs)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the head runs in the autocast dtype, as model(...) would run it
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    out = _output_head(model)  # read after the forward: an FSDP2 root holds its parameters gathered until backward
    extra = {} if chunk_elements is None else {"chunk_elements": chunk_elements}
    return HiddenStates(
        hidden.reshape(-1, hidden.shape[-1])[lay.index], out.weight, out.bias, scale=1.0 / temperature, **extra
    )


def _last_hidden(model: torch.nn.Module, inputs: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """The base model's last hidden state (after its final norm). A model sharded with FSDP2 is run through its
    root's forward (which gathers the embeddings, final norm and head), asking the head for no positions
    (`logits_to_keep` empty) and taking the hidden state from the base model's output."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return model.base_model(**inputs, use_cache=False).last_hidden_state  # type: ignore[no-any-return]
    captured: list[torch.Tensor] = []
    handle = model.base_model.register_forward_hook(lambda _m, _a, out: captured.append(out.last_hidden_state))
    try:
        none = torch.zeros(0, dtype=torch.long, device=next(iter(v for v in inputs.values() if v is not None)).device)
        model(**inputs, use_cache=False, logits_to_keep=none)
    finally:
        handle.remove()
    return captured[0]


def completion_logits(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    """Logits [B, T, V] where [b, t] scores completion token t of row b (T = longest completion)."""
    lay = layout(prompts, completions, next(model.parameters()).device)
    logits = student_forward(model, lay)
    assert isinstance(logits, torch.Tensor)
    return logits


def completion_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], temperature: float = 1.0,
    *, head: Head = "full", packed: bool = False, loss_masks: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, T] of each completion token under softmax(logits / temperature), mask [B, T]); with
    `loss_masks` (episodes' `loss_mask()`), the mask keeps only their policy tokens."""
    run = StudentPass(model, LossConfig(), temperature, head=head, packed=packed)
    return run.logprobs(model, prompts, completions, loss_masks)


# ---- the batch as rows -----------------------------------------------------------------------------------------


def _lowest_reward_rows(batch: TrainBatch) -> dict[str, tuple[int, float]]:
    """Prompt id -> (flat row, reward) of its lowest-reward rollout (the first of equals)."""
    worst: dict[str, tuple[int, float]] = {}
    row = 0
    for g in batch.groups:
        for r, rw in zip(g.group.rollouts, g.rewards):
            if r.prompt_id not in worst or rw.score < worst[r.prompt_id][1]:
                worst[r.prompt_id] = (row, rw.score)
            row += 1
    return worst


def _replay_pairs_of(batch: TrainBatch) -> tuple[list[tuple[TeacherTrace, int]], int]:
    """(chosen trace, rejected row) per replay pair, and how many traces scored no higher than their rejected
    rollout. A trace with a `reward` is paired only when it beats the lowest-reward rollout of its prompt;
    an unscored trace (`reward` None) is always paired. Traces without tokens of their own (none, or an episode
    of environment tokens only) or without rollouts are skipped."""
    worst = _lowest_reward_rows(batch)
    pairs: list[tuple[TeacherTrace, int]] = []
    not_better = 0
    for t in batch.traces:
        if t.prompt_id not in worst or not any(t.loss_mask()):
            continue
        row, rejected_reward = worst[t.prompt_id]
        if t.reward is not None and not t.reward > rejected_reward:
            not_better += 1
            continue
        pairs.append((t, row))
    return pairs, not_better


@dataclass
class Piece:
    """One micro-batch: flat rollout rows and the replay pairs whose rejected side is one of them."""

    rows: list[int]
    pairs: list[int] = field(default_factory=list)


@dataclass
class TrainRows:
    """A TrainBatch as flat rows, with only the inputs `loss` weights (teacher distributions, replay pairs)."""

    rollouts: list[Rollout]
    rewards: torch.Tensor  # [N] float32
    group_ids: torch.Tensor  # [N] long
    episode_ids: torch.Tensor  # [N] long: rows with one label are segments of one episode (`Rollout.episode_id`)
    distributions: list[TokenDistribution | None]  # [N]
    pairs: list[tuple[TeacherTrace, int]]  # (chosen trace, rejected row) per replay pair
    turn_rewards: torch.Tensor  # [N, K] float32: r_k per policy turn (`loss/credit.py`), K = the most turns
    turn_mask: torch.Tensor  # [N, K] bool: row n has a k-th policy turn
    traces_not_better: int = 0  # scored traces left unpaired: reward <= the rejected rollout's

    @classmethod
    def of(cls, batch: TrainBatch, loss: LossConfig) -> TrainRows:
        rollouts = batch.rollouts()
        if not rollouts:
            raise ValueError("TrainBatch has no rollouts")
        warn_missing_teacher_signals(batch, loss)
        dists: list[TokenDistribution | None] = [None] * len(rollouts)
        if loss.alpha_sdpo > 0 and batch.distributions and any(d is not None for d in batch.distributions):
            if len(batch.distributions) != len(rollouts):
                raise ValueError(
                    f"TrainBatch has {len(batch.distributions)} teacher distributions for {len(rollouts)} rollouts"
                )
            dists = list(batch.distributions)
            _check_distributions(dists, rollouts)
        pairs: list[tuple[TeacherTrace, int]] = []
        not_better = 0
        if loss.beta_replay > 0 and batch.traces:
            pairs, not_better = _replay_pairs_of(batch)
        scores = [rw.score for g in batch.groups for rw in g.rewards]
        labels = episode_labels(batch)
        turn_rewards, turn_mask = padded_turns(_turn_rewards(rollouts, scores, labels))
        return cls(
            rollouts=rollouts,
            rewards=torch.tensor(scores, dtype=torch.float32),
            group_ids=torch.tensor([i for i, g in enumerate(batch.groups) for _ in g.group.rollouts]),
            episode_ids=torch.tensor(labels, dtype=torch.long),
            distributions=dists,
            pairs=pairs,
            turn_rewards=turn_rewards,
            turn_mask=turn_mask,
            traces_not_better=not_better,
        )

    def advantages(self, loss: LossConfig) -> torch.Tensor:
        """The whole batch's advantages under `loss.credit`: [N] group-normalised scores ("episode", GRPO), or
        [N, T] per completion token (the per-turn modes; 0 on environment tokens and padding), T as `pad` gives
        the batch's completions. Computed once per batch: a micro-batch may split a group. The unit is the
        episode: the segments of one (a rewritten conversation) count once in their group and take its
        advantages, per-turn ones from its turns over all its segments."""
        if loss.credit == "episode":
            return episode_advantages(self.rewards, self.group_ids, self.episode_ids, loss.scale_std,
                                      loss.advantage_eps)
        rows = episode_rows(self.episode_ids)
        rewards, mask = padded_turns([torch.cat([self.turn_rewards[n][self.turn_mask[n]] for n in e]).tolist()
                                      for e in rows])
        per_turn = turn_advantages(rewards, mask, self.group_ids[[e[0] for e in rows]], loss.credit,
                                   loss.credit_gamma, loss.scale_std, loss.advantage_eps)
        return token_advantages(_segment_turns(per_turn, rows, self.turn_mask), _token_turns(self.rollouts))

    def episode_rewards(self) -> torch.Tensor:
        """[episodes] the reward of each episode once (the rows that open one), for the step's reward mean."""
        return self.rewards[[i for i, r in enumerate(self.rollouts) if r.opens_episode]]

    def totals(self) -> BatchTotals:
        """The whole batch's denominators (what `BatchTotals.of` gives for the whole batch as one piece)."""
        return BatchTotals(
            tokens=sum(r.policy_tokens for r in self.rollouts),
            sequences=len(self.rollouts),
            distill_tokens=sum(sum(r.loss_mask()[d.offset:]) for r, d in zip(self.rollouts, self.distributions)
                               if d is not None),
            replay_pairs=len(self.pairs),
        )

    def micro_batches(self, budget_tokens: int | None, packed: bool = False,
                      rows: list[int] | None = None) -> list[Piece]:
        """Pieces of `rows` (default: every row) whose forward holds at most `budget_tokens` tokens (padded rows x
        longest, or packed total), counting each row's replay traces with it. A row over the budget on its own
        still gets a piece."""
        traces_of: dict[int, list[int]] = {}
        for i, (_, row) in enumerate(self.pairs):
            traces_of.setdefault(row, []).append(i)
        rows = list(range(len(self.rollouts))) if rows is None else rows
        if budget_tokens is None:
            return [Piece(rows, [p for r in rows for p in traces_of.get(r, [])])]
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in self.rollouts]
        trace_len = [len(self.rollouts[row].prompt_ids) + len(t.completion_ids) for t, row in self.pairs]
        # Padded rows are taken longest first, so rows of similar length share a piece and little is padding.
        order = rows if packed else sorted(rows, key=lambda i: -lengths[i])
        pieces: list[Piece] = []
        current: list[int] = []
        for row in order:
            if current and _cost([*current, row], lengths, traces_of, trace_len, packed) > budget_tokens:
                pieces.append(Piece(current, [p for r in current for p in traces_of.get(r, [])]))
                current = []
            current.append(row)
        pieces.append(Piece(current, [p for r in current for p in traces_of.get(r, [])]))
        return pieces


def episode_labels(batch: TrainBatch) -> list[int]:
    """One label per flat row: the segments of an episode (same group, same `episode_id`) share one, every other
    row has its own."""
    labels: list[int] = []
    seen: dict[tuple[int, str | int], int] = {}
    for g, group in enumerate(batch.groups):
        for r in group.group.rollouts:
            key = (g, len(labels) if r.episode_id is None else r.episode_id)
            labels.append(seen.setdefault(key, len(seen)))
    return labels


def episode_rows(episode_ids: torch.Tensor) -> list[list[int]]:
    """The rows of each episode, in row order (its segments in order), episodes in order of their first row."""
    rows: dict[int, list[int]] = {}
    for n, e in enumerate(episode_ids.tolist()):
        rows.setdefault(e, []).append(n)
    return list(rows.values())


def _turn_rewards(rollouts: list[Rollout], scores: list[float], labels: list[int]) -> list[list[float]]:
    """r_k of each row's policy turns: an episode's over all its segments' turns in order, summing to its score
    (`episode_turn_rewards`: the remainder on its last turn), cut back into its segments. A completion, or an
    episode without a policy turn, is one turn holding its score."""
    own = [[None] if r.turns is None else [t.reward for t in r.turns if t.policy] for r in rollouts]
    whole: dict[int, list[float | None]] = {}
    for turns, label in zip(own, labels):
        whole.setdefault(label, []).extend(turns)
    score = dict(zip(labels, scores))
    episode = {label: episode_turn_rewards(turns, score[label]) for label, turns in whole.items()}
    out, at = [], dict.fromkeys(whole, 0)
    for turns, label in zip(own, labels):
        n = len(turns) or len(episode[label])
        out.append(episode[label][at[label] : at[label] + n])
        at[label] += n
    return out


def _segment_turns(per_turn: torch.Tensor, rows: list[list[int]], turn_mask: torch.Tensor) -> torch.Tensor:
    """[N, K] each row's turns' advantages, cut from its episode's [E, K_e] ones (`rows`: each episode's rows)."""
    out = torch.zeros(turn_mask.shape, dtype=per_turn.dtype)
    for e, members in enumerate(rows):
        at = 0
        for n in members:
            k = int(turn_mask[n].sum())
            out[n, :k] = per_turn[e, at : at + k]
            at += k
    return out


def _token_turns(rollouts: list[Rollout]) -> torch.Tensor:
    """[N, T] (T as `pad` gives the completions): each completion token's policy turn index (0, 1, ...), -1 on
    the environment's tokens and padding. Filled a turn span at a time (a batch has N x K spans, N x T tokens)."""
    width = max(max((len(r.completion_ids) for r in rollouts), default=0), 1)
    out = torch.full((len(rollouts), width), -1, dtype=torch.long)
    for n, r in enumerate(rollouts):
        policy = [t for t in r.turns if t.policy] if r.turns is not None else [Turn(0, len(r.completion_ids), True)]
        for k, t in enumerate(policy):
            out[n, t.start : t.end] = k
    return out


def episode_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """`episode/*` sums over a batch holding at least one episode (`turns` set; {} otherwise): the policy tokens
    trained on, the environment tokens only conditioned on, and the policy turns."""
    episodes = [r for r in rollouts if r.turns is not None]
    if not episodes:
        return {}
    policy = sum(r.policy_tokens for r in rollouts)
    return {
        "episode/policy_tokens": float(policy),
        "episode/env_tokens": float(sum(len(r.completion_ids) for r in rollouts) - policy),
        "episode/policy_turns": float(sum(t.policy for r in episodes for t in r.turns or [])),
    }


def _cost(rows: list[int], lengths: list[int], traces_of: dict[int, list[int]], trace_len: list[int],
          packed: bool) -> int:
    """Tokens a piece's forwards hold: its rows (padded to the longest unless packed) plus its replay traces."""
    traces = [trace_len[p] for r in rows for p in traces_of.get(r, [])]
    if packed:
        return sum(lengths[r] for r in rows) + sum(traces)
    return len(rows) * max(lengths[r] for r in rows) + len(traces) * max(traces, default=0)


def _check_distributions(dists: list[TokenDistribution | None], rollouts: list[Rollout]) -> None:
    for d, r in zip(dists, rollouts):
        if d is not None and d.offset + d.num_tokens != len(r.completion_ids):
            raise ValueError(
                f"teacher {d.teacher!r} gave {d.num_tokens} token distributions from token {d.offset} for a "
                f"{len(r.completion_ids)}-token completion of prompt {r.prompt_id!r}"
            )


# ---- channel 2: teacher distributions ------------------------------------------------------------------


def _dense_teacher(dists: list[TokenDistribution | None], width: int, vocab: int) -> torch.Tensor:
    """[B, T, V] teacher logits (zeros where a row has none)."""
    out = torch.zeros(len(dists), width, vocab)
    for b, d in enumerate(dists):
        if d is not None and d.logits is not None:
            if d.logits.shape[-1] != vocab:
                raise ValueError(f"teacher {d.teacher!r} logits have vocab {d.logits.shape[-1]}, student has {vocab}")
            out[b, d.offset : d.offset + d.num_tokens] = d.logits.float()
    return out


def _topk_teacher(dists: list[TokenDistribution | None], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, k] teacher top-k ids and log-probs (k = the widest given; missing entries get -inf)."""
    k = max(d.topk_ids.shape[-1] for d in dists if d is not None and d.topk_ids is not None)
    ids = torch.zeros(len(dists), width, k, dtype=torch.long)
    lps = torch.full((len(dists), width, k), -math.inf)
    for b, d in enumerate(dists):
        if d is not None and d.topk_ids is not None and d.topk_logprobs is not None:
            n, kk = d.topk_ids.shape
            ids[b, d.offset : d.offset + n, :kk] = d.topk_ids
            lps[b, d.offset : d.offset + n, :kk] = d.topk_logprobs.float()
    return ids, lps


def teacher_inputs(
    dists: list[TokenDistribution | None], width: int, vocab: int, device: torch.device | str = "cpu",
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """The `LossBatch` teacher fields of rows with distributions `dists` (dense `teacher_logits` if any is dense,
    else top-k) and `distill_mask`; {} when no row has one. Lengths are checked by `TrainRows.of`.

    The teacher is divided by the sampling `temperature`, as the student's logits are (`student_forward`): channel
    2 then matches the policy's sampling distribution softmax(z/T) to the teacher's at the same T, whose fixed
    point is the teacher's own logits. Against the untempered teacher the fixed point is T * teacher logits, so at
    T < 1 distillation flattened what the policy samples (docs/loss.md). Dividing log-probs by T and
    renormalising (the loss's log_softmax) is exact for a dense teacher and renormalises a top-k one on its
    support, as the loss already does."""
    if all(d is None for d in dists):
        return {}
    mask = torch.zeros(len(dists), width, dtype=torch.bool)
    for b, d in enumerate(dists):
        if d is not None:
            mask[b, d.offset : d.offset + d.num_tokens] = True
    out = {"distill_mask": mask}
    if any(d is not None and d.logits is not None for d in dists):
        out["teacher_logits"] = _dense_teacher(dists, width, vocab) / temperature
    else:
        ids, lps = _topk_teacher(dists, width)
        out["teacher_topk_ids"], out["teacher_topk_logprobs"] = ids, lps / temperature
    return {k: v.to(device) for k, v in out.items()}


# ---- one piece ------------------------------------------------------------------------------------------------


@dataclass
class StudentPass:
    """How the trainer runs the policy for a piece (settings of the `hf` trainer, resolved).

    The reference runs under `reference_scope()` (and no grad): a frozen copy needs nothing, while a LoRA policy
    is its own reference with `reference=model` and a scope that disables its adapters."""

    model: torch.nn.Module
    loss: LossConfig
    temperature: float = 1.0
    reference: torch.nn.Module | None = None
    head: Head = "full"
    packed: bool = False
    reference_scope: Callable[[], AbstractContextManager[Any]] = nullcontext

    def forward(self, model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]]) -> tuple[
        torch.Tensor | HiddenStates, Layout
    ]:
        lay = layout(prompts, completions, next(model.parameters()).device, self.packed)
        student = student_forward(
            model, lay, head=self.head, temperature=self.temperature, chunk_elements=self.loss.loss_chunk_elements
        )
        return student, lay

    def logprobs(self, model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]],
                 loss_masks: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [B, T], mask [B, T]): the mask is `policy_mask` (real tokens AND `loss_masks`); only its
        positions' log-probs mean anything (a chunked head computes no others: 0 there)."""
        student, lay = self.forward(model, prompts, completions)
        ids = pad(completions, 0, torch.long, lay.mask.device)
        mask = policy_mask(lay.mask, loss_masks)
        return student_logprobs(student, ids, mask, self.loss.loss_chunk_elements), mask

    def reference_logprobs(self, prompts: list[list[int]], completions: list[list[int]],
                           loss_masks: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs` under the reference policy (no grad, inside `reference_scope`)."""
        assert self.reference is not None, "no reference model"
        with torch.no_grad(), self.reference_scope():
            return self.logprobs(self.reference, prompts, completions, loss_masks)


def _span(student: torch.Tensor | HiddenStates, start: int, stop: int, width: int) -> torch.Tensor | HiddenStates:
    """Rows `start:stop`, first `width` completion columns, of one forward's student output."""
    if isinstance(student, HiddenStates):
        return HiddenStates(student.hidden[start:stop, :width], student.weight, student.bias, student.scale,
                            student.chunk_elements)
    return student[start:stop, :width]


def _rows_of(student: torch.Tensor | HiddenStates, rows: list[int]) -> torch.Tensor | HiddenStates:
    if isinstance(student, HiddenStates):
        return HiddenStates(student.hidden[rows], student.weight, student.bias, student.scale, student.chunk_elements)
    return student[rows]


def _width(completions: list[list[int]]) -> int:
    """The completion columns `layout` and `pad` give these completions alone."""
    return max(max((len(c) for c in completions), default=1), 1)


@dataclass
class _PieceInputs:
    """A piece's sequences as one forward: its rows, then the chosen side of its replay pairs (teacher traces,
    conditioned on the rejected row's prompt). The rejected side is among the rows (`rejected`: row positions)."""

    rollouts: list[Rollout]
    traces: list[TeacherTrace]
    rejected: list[int]

    @classmethod
    def of(cls, data: TrainRows, piece: Piece) -> _PieceInputs:
        local = {row: i for i, row in enumerate(piece.rows)}
        return cls(rollouts=[data.rollouts[i] for i in piece.rows], traces=[data.pairs[p][0] for p in piece.pairs],
                   rejected=[local[data.pairs[p][1]] for p in piece.pairs])

    def prompts(self) -> list[list[int]]:
        return [r.prompt_ids for r in self.rollouts] + [self.rollouts[i].prompt_ids for i in self.rejected]

    def completions(self) -> list[list[int]]:
        return [r.completion_ids for r in self.rollouts] + [t.completion_ids for t in self.traces]

    def loss_masks(self) -> list[list[int]]:
        return [r.loss_mask() for r in self.rollouts] + [t.loss_mask() for t in self.traces]  # a trace: its turns


def needs_reference(data: TrainRows, run: StudentPass) -> bool:
    """Whether a piece's loss reads the reference: KL to it, or DPO's reference log-probs of a replay pair."""
    if run.reference is None:
        return False
    return run.loss.kl_beta > 0 or (bool(data.pairs) and run.loss.beta_replay > 0 and run.loss.dpo_variant == "dpo")


def build_piece(
    data: TrainRows, piece: Piece, run: StudentPass, advantages: torch.Tensor | None = None,
    uniform: bool = False,
) -> LossBatch:
    """The `LossBatch` of one piece under `run.model` (with grad). Each channel's inputs are computed only when
    `run.loss` weights it: reference log-probs for `kl_beta > 0`, teacher inputs for `alpha_sdpo > 0`, replay
    pairs for `beta_replay > 0`. `advantages` are the WHOLE batch's (a piece may split a group): [N], or [N, T]
    per token (`TrainRows.advantages` under a per-turn `loss.credit`), cut to the piece's rows and width.

    One student forward holds the piece's rows and its replay traces, and at most one reference forward (no
    grad) holds them too: the model runs the same forwards for every piece of a batch. `uniform` runs the
    reference forward for every piece of a batch that needs one (`needs_reference`), also one without pairs:
    ranks of a sharded replica must call the sharded model equally often (`sharding.py`)."""
    inputs = _PieceInputs.of(data, piece)
    n, width = len(inputs.rollouts), _width([r.completion_ids for r in inputs.rollouts])
    everything, lay = run.forward(run.model, inputs.prompts(), inputs.completions())
    dev = lay.mask.device
    all_masks = policy_mask(lay.mask, inputs.loss_masks())
    student, mask = _span(everything, 0, n, width), all_masks[:n, :width]
    token_ids = pad([r.completion_ids for r in inputs.rollouts], 0, torch.long, dev)
    reference = None
    if needs_reference(data, run) and (uniform or run.loss.kl_beta > 0 or inputs.traces):
        reference, _ = run.reference_logprobs(inputs.prompts(), inputs.completions(), inputs.loss_masks())
    teacher = {}
    if run.loss.alpha_sdpo > 0:
        teacher = teacher_inputs([data.distributions[i] for i in piece.rows], mask.shape[1], student.shape[-1], dev,
                                 run.temperature)
    if teacher:  # a teacher scores every completion token; only the policy's are distilled
        teacher["distill_mask"] = teacher["distill_mask"] & mask
    rows = torch.tensor(piece.rows)
    return LossBatch(
        logits=student, token_ids=token_ids, mask=mask,
        old_logprobs=pad([r.logprobs for r in inputs.rollouts], 0.0, torch.float32, dev),
        rewards=data.rewards[rows].to(dev), group_ids=data.group_ids[rows].to(dev),
        ref_logprobs=reference[:n, :width] if reference is not None and run.loss.kl_beta > 0 else None,
        replay=_replay_pairs(inputs, run, everything, all_masks, token_ids, reference) if inputs.traces else None,
        advantages=_piece_advantages(advantages, rows, width, dev), **teacher,
    )


def _piece_advantages(advantages: torch.Tensor | None, rows: torch.Tensor, width: int,
                      device: torch.device) -> torch.Tensor | None:
    """The piece's rows of the whole batch's advantages ([N] or [N, T]), per-token ones cut to its `width`."""
    if advantages is None:
        return None
    picked = advantages[rows]
    return (picked[:, :width] if picked.dim() == 2 else picked).to(device)


def _replay_pairs(
    inputs: _PieceInputs, run: StudentPass, everything: torch.Tensor | HiddenStates, all_masks: torch.Tensor,
    token_ids: torch.Tensor, reference: torch.Tensor | None,
) -> ReplayPairs:
    """chosen = each teacher trace (its rows of the piece's forward, with grad), rejected = the lowest-reward
    student rollout of the same prompt (its row). With a reference (DPO), both sides also get its summed
    log-probs, from the piece's reference forward."""
    n, width = len(inputs.rollouts), token_ids.shape[1]
    chosen_width = _width([t.completion_ids for t in inputs.traces])
    chosen_ids = pad([t.completion_ids for t in inputs.traces], 0, torch.long, all_masks.device)
    chosen_mask = all_masks[n:, :chosen_width]
    chosen_logps = student_logprobs(_span(everything, n, len(all_masks), chosen_width), chosen_ids, chosen_mask,
                                    run.loss.loss_chunk_elements)
    rows = inputs.rejected
    rejected_mask = all_masks[:n, :width][rows]
    rejected_logps = student_logprobs(_rows_of(_span(everything, 0, n, width), rows), token_ids[rows], rejected_mask,
                                      run.loss.loss_chunk_elements)
    ref_chosen = ref_rejected = None
    if reference is not None and run.loss.dpo_variant == "dpo":
        ref_chosen = (reference[n:, :chosen_width] * chosen_mask).sum(-1)
        ref_rejected = (reference[:n, :width][rows] * rejected_mask).sum(-1)
    return ReplayPairs(
        chosen_logps=chosen_logps, chosen_mask=chosen_mask, rejected_logps=rejected_logps,
        rejected_mask=rejected_mask, ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
        teachers=[t.teacher for t in inputs.traces],
    )


def build_loss_batch(
    batch: TrainBatch,
    model: torch.nn.Module,
    loss: LossConfig,
    *,
    temperature: float = 1.0,
    reference: torch.nn.Module | None = None,
    head: Head = "full",
    packed: bool = False,
    reference_scope: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> LossBatch:
    """The whole batch as one `LossBatch` (one piece; the advantages of `TrainRows.advantages`: "episode" credit,
    group advantages from its own rewards, each episode once; a per-turn `loss.credit`: per token)."""
    data = TrainRows.of(batch, loss)
    run = StudentPass(model, loss, temperature, reference, head, packed, reference_scope)
    return build_piece(data, data.micro_batches(None)[0], run, data.advantages(loss))
