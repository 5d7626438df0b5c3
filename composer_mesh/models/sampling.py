"""Batched sampling with per-token log-probs, and teacher-forced logits, for any transformers causal LM.

Shared by the hf generator, the hf teacher and warm-start evaluation, so that all three agree on one
convention:

- Sampling: prompts are left-padded (explicit `position_ids`, so padding changes nothing but rounding) and
  decoded with the KV cache. At temperature `T > 0` a token is drawn from `softmax(logits / T)` and its
  recorded log-prob is `log_softmax(logits / T)[token]` — the log-prob under the distribution actually
  sampled from. At `T == 0` decoding is greedy and the recorded log-prob is `log_softmax(logits)[token]`.
  The loop keeps tokens, log-probs, lengths and stop flags on the device and copies them to the host once
  per batch; the host reads only how many rows are still running, every `CHECK_EVERY` tokens (every token on
  the CPU, where a read costs nothing). When that check finds a quarter of the rows finished, they leave the
  batch (their KV cache rows are dropped), so rows that end early stop costing forwards. Row i's draw at step t
  is an inverse-CDF draw with a uniform that is a hash of (its seed, t): same seed, same tokens, whatever else
  is in the batch, how it is padded or when other rows leave it (up to float rounding of the batch shape).
- In-flight weight updates: with `refresh` (a host-side callable) the sampler calls `refresh()` before every
  forward — the prefill and each decode step — and `refresh()` returns the weight version active for that
  forward (it may first have copied a newer version into the model's parameters in place). Each row then
  carries `token_versions[t]`, the version whose forward produced token t's logits. The KV cache built by
  older weights is KEPT across a swap, not recomputed: recomputing would cost a prefill of every prompt and
  every token so far per swap, and PipelineRL and AReaL keep it too. The staleness this leaves is explicit:
  the per-token versions say which weights scored each token, and a rollout's `weight_version` (its policy
  lag) counts from its OLDEST token. Without `refresh` nothing changes (no version bookkeeping at all).
- Teacher forcing: for a sequence `prompt + completion`, row `t` of the returned logits is the model's
  output at position `len(prompt) - 1 + t`, i.e. the distribution that scores completion token `t`.
  The trainer aligns the student's logits the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from composer_mesh.models.prefix_cache import LayerKV, PrefixCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")
R = TypeVar("R")
IntLike = TypeVar("IntLike", int, torch.Tensor)


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled; it is included) or "length"
    # token_versions[t]: version of the weights whose forward produced token t's logits (None without refresh)
    token_versions: list[int] | None = None


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


# Host reads in the decode loop: on an accelerator every `.item()`/`bool()` drains the device queue, so the
# "all rows done?" check runs once per this many tokens (the rest of the bookkeeping never leaves the device).
# On the CPU there is no queue to drain, and checking every token saves the forwards of a finished batch.
CHECK_EVERY = 16
UNIFORM_BLOCK = 64  # steps of per-row uniforms made at once
_M32 = 0xFFFFFFFF


def _mix32(x: IntLike) -> IntLike:
    """A 32-bit integer hash of an int or an int64 tensor of 32-bit values (xorshift-multiply; the multipliers
    are < 2**31, so int64 products never overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _row_keys(
    n: int, seeds: Sequence[int] | None, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """[n, 2] 32-bit halves of each row's 64-bit seed: given, or drawn from `generator` (else torch's global RNG)."""
    if seeds is None:
        gen_device = generator.device if generator is not None else torch.device("cpu")
        seeds = torch.randint(0, 2**62, (n,), generator=generator, device=gen_device).tolist()
    elif len(seeds) != n:
        raise ValueError(f"sample(): {len(seeds)} seeds for {n} prompts")
    return torch.tensor([[s & _M32, (s >> 32) & _M32] for s in seeds], dtype=torch.long, device=device)


def _uniforms(keys: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """[B, count] float64 in (0, 1): row b's uniform at step `start + j` is a pure function of (row seed, step),
    so a row's stream does not depend on which other rows share its batch, and nothing advances a generator
    inside the loop. Made `UNIFORM_BLOCK` steps at a time: a few kernels per block, not per token."""
    t = torch.arange(start, start + count, device=keys.device)
    a = _mix32(keys[:, :1] ^ _mix32((t + 0x9E3779B9) & _M32))
    a = _mix32(a ^ keys[:, 1:])
    b = _mix32(a ^ 0x5BD1E995)
    return ((a >> 6) * 2**27 + (b >> 5)).double().add_(0.5).mul_(2.0**-53)


def _pick(logits: torch.Tensor, temperature: float, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its log-prob) per row, on the device. T > 0: inverse-CDF draw from softmax(logits / T) with the
    row's uniform `u`, log-prob under that distribution; T == 0: argmax, log-prob under softmax(logits)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature > 0:
        assert u is not None
        logp = torch.log_softmax(logits / temperature, dim=-1)
        cdf = logp.exp().cumsum(dim=-1)
        x = u.to(cdf.dtype) * cdf[:, -1]
        tok = torch.searchsorted(cdf, x[:, None], right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    else:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.argmax(dim=-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _decode_mask(model: PreTrainedModel) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """How a decode step gets its mask from the [B, width + max_new] padding mask (True = a real token).

    With sdpa and only full-attention layers the step's 4D mask is a view of it ([B, 1, 1, kv]), which
    transformers passes to sdpa as is. Otherwise it gets the 2D prefix and builds its own mask (which may read
    the mask on the host each step: transformers checks whether any position is padded).
    """
    if _plain_sdpa(model):
        return lambda mask, n: mask[:, None, None, :n]
    return lambda mask, n: mask[:, :n]


def _plain_sdpa(model: PreTrainedModel) -> bool:
    """Whether every layer is full attention through sdpa (no sliding window): its cache is plain
    `DynamicLayer`s and a [B, 1, 1, kv] boolean mask is all a decode step needs."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or ["full_attention"]
    sliding = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    return getattr(cfg, "_attn_implementation", None) == "sdpa" and set(types) == {"full_attention"} and not sliding


def _left_padded(
    prompts: Sequence[Sequence[int]], pad_id: int, extra: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [B, W], padding mask [B, W + extra] with the generated columns already True, position ids
    [B, W]): built on the host and moved in one copy each."""
    bsz, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    mask = torch.ones((bsz, width + extra), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, : width - len(p)] = False
    positions = (mask[:, :width].long().cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


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
    seeds: Sequence[int] | None = None,
    check_every: int | None = None,
    refresh: Callable[[], int] | None = None,
    prefix_cache: PrefixCache | None = None,
    prefix_lengths: Sequence[Sequence[int]] | None = None,
) -> list[Sample]:
    """Sample one completion per prompt (one batch). See the module docstring for the conventions.

    Row i draws from its own random stream, a function of `seeds[i]` (drawn from `generator` when no seeds
    are given) and the step only, so its tokens do not depend on the rest of the batch. `check_every` is how
    often (in tokens) the host reads "are all rows done?": default 1 on the CPU, `CHECK_EVERY` elsewhere.

    `refresh`, when given, is called on the host before the prefill and before every decode forward; it may
    swap the model's weights in place and returns the version now active. Each `Sample.token_versions[t]` is
    then the version returned just before the forward that produced token t's logits (the KV cache of
    earlier tokens is kept across a swap). It is not called after the last token, nor when
    `max_new_tokens < 1` (no forward runs; `token_versions` is then `[]`).

    `prefix_cache` (`models.prefix_cache`): prefill each prompt in chunks ending at its `prefix_lengths` (an
    episode's earlier turns' prompt lengths, one list per prompt), from the longest one stored, and store the
    prompts' KV; its owner clears it when the weights change.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("sample(): every prompt needs at least one token")
    if temperature < 0:
        raise ValueError(f"sample(): temperature must be >= 0, got {temperature}")
    if max_new_tokens < 1:
        return [Sample([], [], "length", [] if refresh is not None else None) for _ in prompts]
    device = _device(model)
    keys = _row_keys(len(prompts), seeds, generator, device) if temperature > 0 else None
    if check_every is None:
        check_every = 1 if device.type == "cpu" else CHECK_EVERY
    ids, mask, positions = _left_padded(prompts, pad_id, max_new_tokens, device)
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    versions: list[int] = []  # filled by decode when refresh is given: the version of each step
    toks, logps, lengths, stopped = decode(
        model, ids, mask, positions, max_new_tokens=max_new_tokens, choose=Draws(temperature, keys, max_new_tokens),
        stop=stop, check_every=max(1, check_every), refresh=refresh, versions=versions, prefix_cache=prefix_cache,
        prefix_lengths=prefix_lengths,
    )
    toks_l, logps_l, lengths_l, stopped_l = toks.tolist(), logps.tolist(), lengths.tolist(), stopped.tolist()
    return [
        Sample(t[:n], lp[:n], "stop" if s else "length", versions[:n] if refresh is not None else None)
        for t, lp, n, s in zip(toks_l, logps_l, lengths_l, stopped_l)
    ]


def _prefill(
    model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, extra: dict[str, int],
    prefix_cache: PrefixCache | None = None, prefix_lengths: Sequence[Sequence[int]] | None = None,
) -> tuple[object, torch.Tensor]:
    """(KV cache, last-position logits [B, V]) of the left-padded prompts `ids` ([B, W], `mask` True = real).

    On the CPU, prompts of different lengths are run as one unpadded forward per length and their caches
    left-padded into one: a padded batch needs an attention mask, which sends CPU sdpa down its math path
    (the full [B, H, W, W] scores; 2.6x slower than the unpadded forwards on the agentic benchmark's rounds of
    turns), while an unpadded batch takes the fused causal kernel. The padded columns' keys are zeros that the
    decode mask hides, so the result is the padded forward's up to float rounding. Identical prompts (the
    samples of one prompt) run once. With `prefix_cache` (any device) a prompt is prefilled in chunks ending at
    its `prefix_lengths` (an episode's earlier turns' prompts), starting after the longest one stored, and its
    KV is stored for the next turn. Elsewhere (or for layers whose caches this cannot merge: `_plain_sdpa`) it
    is the one padded forward: GPU kernels take masks at full speed."""
    grouped = _plain_sdpa(model) and (prefix_cache is not None or ids.device.type == "cpu")
    lengths = mask.sum(1).tolist() if grouped else []
    if not grouped or (prefix_cache is None and len(set(lengths)) < 2):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
        return out.past_key_values, out.logits[:, -1, :]
    width, host_ids = ids.shape[1], ids.tolist()
    rows_of: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, n in enumerate(lengths):
        cuts = prefix_lengths[i] if prefix_cache is not None and prefix_lengths is not None else ()
        key = (tuple(host_ids[i][width - n :]), tuple(sorted({c for c in cuts if 0 < c < n})))
        rows_of.setdefault(key, []).append(i)
    prompts = _prefill_chunks(model, list(rows_of), prefix_cache, extra, ids.device)
    logits = prompts[0].logits.new_zeros((ids.shape[0], prompts[0].logits.shape[-1]))
    layers = [(k.new_zeros((ids.shape[0], k.shape[0], width, k.shape[-1])),
               v.new_zeros((ids.shape[0], v.shape[0], width, v.shape[-1]))) for k, v in prompts[0].kv]
    for prompt, rows in zip(prompts, rows_of.values(), strict=True):
        at = torch.tensor(rows, device=ids.device)
        logits[at] = prompt.logits
        for (keys, values), (k, v) in zip(layers, prompt.kv, strict=True):
            keys[at, :, width - len(prompt.ids) :] = k
            values[at, :, width - len(prompt.ids) :] = v
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=layers), logits


@dataclass
class _Prefilling:
    """One distinct prompt being prefilled: the chunk ends still to run (the last its length), the KV of the
    tokens before `start` ([kv_heads, start, head_dim] per layer) and the logits after the last chunk."""

    ids: tuple[int, ...]
    ends: list[int]
    start: int = 0
    kv: list[LayerKV] = field(default_factory=list)
    logits: torch.Tensor | None = None


def _prefill_chunks(
    model: PreTrainedModel, prompts: list[tuple[tuple[int, ...], tuple[int, ...]]], prefix_cache: PrefixCache | None,
    extra: dict[str, int], device: torch.device,
) -> list[_Prefilling]:
    """Each (ids, cuts) prompt prefilled chunk by chunk from the longest cut stored in `prefix_cache`: prompts
    at the same (start, end) run as one unpadded forward, in which prompts that agree up to `end` are one row
    (a GRPO group's samples share their first prompt). Stores each prompt's KV in the cache."""
    rows = []
    for ids, cuts in prompts:
        start, kv = prefix_cache.lookup(ids, cuts) if prefix_cache is not None else (0, None)
        rows.append(_Prefilling(ids, [c for c in cuts if c > start] + [len(ids)], start, kv or []))
    while any(r.ends for r in rows):
        chunks: dict[tuple[int, int], list[_Prefilling]] = {}
        for r in rows:
            if r.ends:
                chunks.setdefault((r.start, r.ends[0]), []).append(r)
        for (start, end), group in sorted(chunks.items()):
            first = {r.ids[:end]: r for r in reversed(group)}  # rows that share the tokens so far share the chunk
            unique = list(first.values())
            kv, logits = _forward_chunk(model, [r.ids[start:end] for r in unique], start, [r.kv for r in unique],
                                        extra, device)
            at = {id(r): j for j, r in enumerate(unique)}
            for r in group:
                j = at[id(first[r.ids[:end]])]
                r.kv, r.logits, r.start = [(k[j], v[j]) for k, v in kv], logits[j], r.ends.pop(0)
    if prefix_cache is not None:
        for r in rows:
            prefix_cache.store(r.ids, r.kv)
    return rows


def _forward_chunk(
    model: PreTrainedModel, chunks: list[tuple[int, ...]], start: int, past: list[list[LayerKV]],
    extra: dict[str, int], device: torch.device,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """One unpadded forward of equally long `chunks` at positions `start`.. after `past` (each row's KV of its
    first `start` tokens): every layer's KV [g, heads, start + chunk, head_dim] and the last logits [g, V]."""
    from transformers import DynamicCache

    ids = torch.tensor(chunks, dtype=torch.long, device=device)
    positions = torch.arange(start, start + ids.shape[1], device=device).expand(len(chunks), -1)
    cache = None
    if start:
        cache = DynamicCache(ddp_cache_data=[(torch.stack([row[i][0] for row in past]),
                                              torch.stack([row[i][1] for row in past]))
                                             for i in range(len(past[0]))])
    out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, **extra)
    return _cache_tensors(out.past_key_values), out.logits[:, -1, :]


def _cache_tensors(cache: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) [b, heads, length, head_dim] of a transformers `DynamicCache`."""
    return [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[attr-defined]


# Chooses each decode step's tokens: (logits [b, V] of the rows still decoding, their indices in the batch [b],
# the step) -> (token [b], its log-prob [b]). Sampling draws (`Draws`); a benchmark may force a script instead.
Choose = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


class Draws:
    """`sample`'s choice: row r's token at step t is `_pick`'s with its uniform (row seed, t); greedy at T 0.
    Indexed by the rows' batch indices, so a row draws the same whatever rows have left the batch."""

    def __init__(self, temperature: float, keys: torch.Tensor | None, max_new_tokens: int) -> None:
        self.temperature, self.keys, self.max_new_tokens = temperature, keys, max_new_tokens
        self._block: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            return _pick(logits, self.temperature, None)
        if step % UNIFORM_BLOCK == 0 or self._block is None:
            self._block = _uniforms(self.keys, step, min(UNIFORM_BLOCK, self.max_new_tokens - step))
        return _pick(logits, self.temperature, self._block[rows, step % UNIFORM_BLOCK])


# A check that finds at most this share of the decoding rows still running drops the finished ones from the
# batch (their KV cache, mask and positions): a batch whose completions end at different lengths (short answers
# beside long tool calls, a finished sample beside a rambling one) stops paying forwards for rows already done.
COMPACT_AT = 0.75


def decode(
    model: PreTrainedModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    *,
    max_new_tokens: int,
    choose: Choose,
    stop: torch.Tensor,
    check_every: int,
    refresh: Callable[[], int] | None = None,
    versions: list[int] | None = None,
    prefix_cache: PrefixCache | None = None,
    prefix_lengths: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode loop, all on the device: (tokens [B, S], log-probs [B, S], lengths [B], stopped [B]), S the
    steps run. A row's length counts its tokens up to and including its first stop token; later columns are
    what it kept decoding, or zeros once it left the batch (discarded either way). The only host read is the
    check every `check_every` steps: are all rows done, and have enough finished to compact (`COMPACT_AT`)?

    With `refresh`, it is called before each forward and its result appended to `versions` (one entry per
    step: the version that produced that column's logits). Neither touches the device queue."""
    bsz, width = ids.shape
    step_mask = _decode_mask(model)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    versions = [] if versions is None else versions
    if refresh is not None:
        versions.append(refresh())
    cache, logits = _prefill(model, ids, mask[:, :width], positions, extra, prefix_cache, prefix_lengths)
    toks = torch.zeros((bsz, max_new_tokens), dtype=torch.long, device=ids.device)
    logps = torch.zeros((bsz, max_new_tokens), dtype=torch.promote_types(logits.dtype, torch.float32), device=ids.device)
    lengths = torch.zeros(bsz, dtype=torch.long, device=ids.device)
    done = torch.zeros(bsz, dtype=torch.bool, device=ids.device)
    rows = torch.arange(bsz, device=ids.device)  # the batch indices of the rows still decoding
    pos = positions[:, -1:] + 1
    steps = 0
    for step in range(max_new_tokens):
        tok, tok_logp = choose(logits, rows, step)
        toks[rows, step] = tok
        logps[rows, step] = tok_logp
        lengths[rows] += ~done[rows]
        done[rows] |= torch.isin(tok, stop)
        steps = step + 1
        if steps == max_new_tokens:
            break
        if steps % check_every == 0:
            live = ~done[rows]
            running = int(live.sum())
            if running == 0:
                break
            if running <= COMPACT_AT * len(rows) and hasattr(cache, "batch_select_indices"):
                keep = live.nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, mask, pos, tok = rows[keep], mask[keep], pos[keep], tok[keep]
        if refresh is not None:
            versions.append(refresh())  # may swap the weights in place; the KV cache is kept
        out = model(
            input_ids=tok[:, None], attention_mask=step_mask(mask, width + steps), position_ids=pos,
            past_key_values=cache, use_cache=True,
        )
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        pos = pos + 1
    return toks[:, :steps], logps[:, :steps], lengths, done


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
