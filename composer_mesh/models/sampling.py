"""Batched sampling with per-token log-probs, and teacher-forced logits, for any transformers causal LM.

Shared by the hf generator, the hf teacher and warm-start evaluation, so that all three agree on one
convention:

- Sampling: prompts are left-padded (explicit `position_ids`, so padding changes nothing but rounding) and
  decoded with the KV cache. At temperature `T > 0` a token is drawn from `softmax(logits / T)` and its
  recorded log-prob is `log_softmax(logits / T)[token]` — the log-prob under the distribution actually
  sampled from. At `T == 0` decoding is greedy and the recorded log-prob is `log_softmax(logits)[token]`.
- Teacher forcing: for a sequence `prompt + completion`, row `t` of the returned logits is the model's
  output at position `len(prompt) - 1 + t`, i.e. the distribution that scores completion token `t`.
  The trainer aligns the student's logits the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled; it is included) or "length"


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def token_budget_chunks(lengths: Sequence[int], max_tokens: int, max_rows: int | None = None) -> list[range]:
    """Consecutive index ranges whose padded batch (rows x longest row) stays within `max_tokens`.

    Bounds one forward's activations and logits (they scale with padded tokens, not with rows). Order is
    kept; a single sequence longer than the budget gets a range of its own (it cannot be split).
    """
    if max_tokens < 1 or (max_rows is not None and max_rows < 1):
        raise ValueError(f"token_budget_chunks(): max_tokens and max_rows must be >= 1, got {max_tokens}, {max_rows}")
    out: list[range] = []
    start, width = 0, 0
    for i, n in enumerate(lengths):
        rows = i - start + 1
        wider = max(width, n)
        if rows > 1 and (rows * wider > max_tokens or (max_rows is not None and rows > max_rows)):
            out.append(range(start, i))
            start, wider = i, n
        width = wider
    if len(lengths) > start:
        out.append(range(start, len(lengths)))
    return out


def _device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def sample(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator | None = None,
) -> list[Sample]:
    """Sample one completion per prompt (one batch). See the module docstring for the log-prob convention."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("sample(): every prompt needs at least one token")
    if temperature < 0:
        raise ValueError(f"sample(): temperature must be >= 0, got {temperature}")
    device = _device(model)
    bsz, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((bsz, width), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros((bsz, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        attn[i, width - len(p) :] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=True)
    cache = out.past_key_values
    logits = out.logits[:, -1, :].float()
    next_pos = position_ids[:, -1] + 1
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    results = [Sample([], [], "length") for _ in range(bsz)]
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        if temperature > 0:
            logp = torch.log_softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        else:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logp.argmax(dim=-1)
        tok_logp = logp.gather(-1, tok[:, None]).squeeze(-1)
        is_stop = torch.isin(tok, stop)
        for i in torch.nonzero(~done).flatten().tolist():
            results[i].token_ids.append(int(tok[i]))
            results[i].logprobs.append(float(tok_logp[i]))
            if is_stop[i]:
                results[i].finish_reason = "stop"
        done |= is_stop
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones((bsz, 1), dtype=attn.dtype, device=device)], dim=1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=attn,
            position_ids=next_pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float()
        next_pos = next_pos + 1
    return results


def teacher_forced_logits(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int,
) -> list[torch.Tensor]:
    """Float32 logits [len(completion), V] per sequence: row t scores completion token t (one batch)."""
    return teacher_forced_map(model, prompts, completions, pad_id=pad_id, fn=torch.Tensor.clone)


@torch.inference_mode()
def teacher_forced_map(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int,
    fn: Callable[[torch.Tensor], R],
) -> list[R]:
    """`fn(rows)` per sequence, rows = its float32 logits [len(completion), V] on the model's device (one batch).

    The batch's [B, L, V] logits live only inside this call, and only the rows of one sequence are ever cast
    to float32 at a time, so a caller that reduces them (top-k) or moves them off the device in `fn` never
    holds the whole batch in float32. `rows` may be a view of the batch's logits: `fn` copies what it keeps.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("teacher forcing: every prompt needs at least one token")
    device = _device(model)
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros_like(input_ids)
    for i, s in enumerate(seqs):  # right padding: real tokens keep positions 0..len-1
        input_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    logits = model(input_ids=input_ids, attention_mask=attn).logits
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        start = len(p) - 1
        out.append(fn(logits[i, start : start + len(c)].float()))
    return out
