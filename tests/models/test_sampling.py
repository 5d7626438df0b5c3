"""The batched sampler (`models.sampling.sample`): per-row seeded streams, padding invariance, the log-prob
convention, stops, and a bounded number of host reads per batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from composer_mesh.models.config import ModelConfig
from composer_mesh.models.sampling import UNIFORM_BLOCK, _uniforms, sample, teacher_forced_logits

STUDENT = ModelConfig(warmstart={"steps": 30})  # same as tests/models and tests/actors/backends: one cache build
TEXTS = ["3+4=", "12+5=", "1+1+1=", "9+9=", "7=", "10+20+3="]  # different lengths: left padding varies


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    from composer_mesh.models.loading import load_pretrained

    model, tok = load_pretrained(STUDENT, str(tmp_path_factory.getbasetemp() / "composer_mesh_models"))
    return model.eval(), tok


@pytest.fixture(scope="module")
def model64(model_tok):
    """A float64 copy: batched and alone differ only by ~1e-16 rounding, so sampled tokens must be equal."""
    import copy

    return copy.deepcopy(model_tok[0]).double()


def ids(tok, texts=TEXTS) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def stops(tok) -> list[int]:
    return [tok.eos_token_id, tok.encode(";", add_special_tokens=False)[0]]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_a_row_gets_the_tokens_it_gets_alone_whatever_the_padding(model64, model_tok, temperature):
    _, tok = model_tok
    prompts, seeds = ids(tok), [101, 7, 2**40 + 3, 0, 55, 9]
    kw = dict(max_new_tokens=8, temperature=temperature, stop_ids=stops(tok), pad_id=0)
    batch = sample(model64, prompts, seeds=seeds, **kw)
    backwards = sample(model64, prompts[::-1], seeds=seeds[::-1], **kw)[::-1]  # other neighbours, other padding
    for i, (p, s) in enumerate(zip(prompts, seeds)):
        [alone] = sample(model64, [p], seeds=[s], **kw)
        for other in (batch[i], backwards[i]):
            assert other.token_ids == alone.token_ids and other.finish_reason == alone.finish_reason, i
            assert other.logprobs == pytest.approx(alone.logprobs, abs=1e-12)
    # The recorded log-probs are those of the distribution sampled from (teacher forcing, in float64).
    rows = teacher_forced_logits(model64, prompts, [b.token_ids for b in batch], pad_id=0)
    for b, logits in zip(batch, rows):
        logp = torch.log_softmax(logits.double() / temperature if temperature > 0 else logits.double(), -1)
        want = logp.gather(-1, torch.tensor(b.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(b.logprobs, dtype=torch.float64), want, atol=1e-6)


def test_same_seed_same_tokens_other_seed_other_tokens(model_tok):
    model, tok = model_tok
    prompts = ids(tok) * 4
    kw = dict(max_new_tokens=6, temperature=1.0, stop_ids=stops(tok), pad_id=0)

    def run(**seeding):
        return [s.token_ids for s in sample(model, prompts, **kw, **seeding)]

    assert run(seeds=range(24)) == run(seeds=range(24))
    assert run(seeds=range(24)) != run(seeds=range(1, 25))
    # One generator per request: rows draw their seeds from it, so a re-seeded generator repeats the batch.
    a = run(generator=torch.Generator().manual_seed(3))
    assert a == run(generator=torch.Generator().manual_seed(3)) and a != run(generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="2 seeds for 24 prompts"):
        run(seeds=[1, 2])


def test_draws_follow_the_tempered_distribution(model_tok):
    """20,000 rows of one prompt, one token each: frequencies match softmax(logits / T) (total variation)."""
    model, tok = model_tok
    [prompt] = ids(tok, ["3+4="])
    n, temperature = 20_000, 1.5
    out = sample(model, [prompt] * n, max_new_tokens=1, temperature=temperature, stop_ids=[], pad_id=0,
                 seeds=range(n))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits / temperature, -1)
    counts = torch.bincount(torch.tensor([s.token_ids[0] for s in out]), minlength=probs.numel()).double()
    assert 0.5 * (counts / n - probs.double()).abs().sum() < 0.02
    first = {s.token_ids[0]: s.logprobs[0] for s in out}
    for t, lp in first.items():
        assert lp == pytest.approx(float(torch.log(probs[t])), abs=1e-5)


def test_row_uniforms_are_uniform_and_independent():
    """The per-row stream: one float64 in (0, 1) per (seed, step), no visible correlation across seeds or steps,
    and the same value whichever block of steps or batch of rows it is made in."""
    keys = torch.tensor([[s & 0xFFFFFFFF, s >> 32] for s in range(4096)], dtype=torch.long)
    u = _uniforms(keys, 0, 16).T  # [steps, rows]
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    hist = torch.histc(u.float(), bins=16, min=0, max=1) / u.numel()
    assert float((hist - 1 / 16).abs().max()) < 0.01
    for a, b in ((u[:-1], u[1:]), (u[:, :-1], u[:, 1:])):  # consecutive steps, consecutive seeds
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.02
    assert torch.equal(_uniforms(keys[7:9], 3, 5), u[3:8, 7:9].T)
    late = _uniforms(keys[:3], 0, UNIFORM_BLOCK + 2)[:, UNIFORM_BLOCK:]
    assert torch.equal(late, _uniforms(keys[:3], UNIFORM_BLOCK, 2))


@pytest.mark.parametrize("check_every", [1, 4, 16])
def test_stops_finish_reasons_and_lengths(model_tok, check_every):
    """A row ends at its first stop token (kept, "stop") or after max_new_tokens ("length"); checking for
    "all done" less often decodes extra columns that are discarded, never different tokens (the log-probs move
    by float rounding only: finished rows leave the batch at other steps, so the batch shapes differ)."""
    model, tok = model_tok
    prompts = ids(tok) * 3
    reasons = set()
    for temperature, new in ((2.0, 5), (1.0, 8)):  # some rows run out of tokens; every row stops early
        kw = dict(max_new_tokens=new, temperature=temperature, pad_id=0, seeds=range(len(prompts)))
        out = sample(model, prompts, stop_ids=stops(tok), check_every=check_every, **kw)
        every = sample(model, prompts, stop_ids=stops(tok), check_every=1, **kw)
        assert [(s.token_ids, s.finish_reason) for s in out] == [(s.token_ids, s.finish_reason) for s in every]
        for s, e in zip(out, every):
            assert s.logprobs == pytest.approx(e.logprobs, abs=1e-5)
        for s in out:
            reasons.add(s.finish_reason)
            at = [i for i, t in enumerate(s.token_ids) if t in stops(tok)]
            assert len(s.logprobs) == len(s.token_ids)
            if s.finish_reason == "stop":
                assert at == [len(s.token_ids) - 1]
            else:
                assert at == [] and len(s.token_ids) == new
        # Without stop ids every row runs to max_new_tokens; the same seeds give the same prefix.
        free = sample(model, prompts, stop_ids=[], check_every=check_every, **kw)
        assert all(f.finish_reason == "length" and len(f.token_ids) == new for f in free)
        assert all(f.token_ids[: len(s.token_ids)] == s.token_ids for f, s in zip(free, out))
    assert reasons == {"stop", "length"}
    empty = sample(model, prompts[:2], max_new_tokens=0, temperature=1.0, stop_ids=[], pad_id=0)
    assert [(s.token_ids, s.logprobs, s.finish_reason) for s in empty] == [([], [], "length")] * 2


def test_finished_rows_leave_the_batch_and_change_nothing(model64, model_tok, monkeypatch):
    """Rows that stop early leave the batch (fewer row-forwards than rows x steps); every row's tokens and
    log-probs equal those of a batch that keeps every row to the end (float64: rounding only)."""
    from composer_mesh.models import sampling

    _, tok = model_tok
    prompts, seeds = ids(tok) * 4, range(24)
    kw = dict(max_new_tokens=12, temperature=1.0, stop_ids=stops(tok), pad_id=0, seeds=seeds)
    widths: list[int] = []
    def decode_step(_module, _args, kwargs):  # a decode step feeds one token per row
        if kwargs["input_ids"].shape[1] == 1:
            widths.append(kwargs["input_ids"].shape[0])

    hook = model64.register_forward_pre_hook(decode_step, with_kwargs=True)
    try:
        compacted = sample(model64, prompts, **kw)
        shrinking = list(widths)  # the decode steps' batch sizes
        monkeypatch.setattr(sampling, "COMPACT_AT", 0.0)  # never compact: every row decodes to the last step
        widths.clear()
        kept = sample(model64, prompts, **kw)
    finally:
        hook.remove()
    assert set(widths) == {24}
    assert shrinking[0] == 24 and shrinking[-1] < 24 and shrinking == sorted(shrinking, reverse=True)
    assert any(len(s.token_ids) < 12 for s in compacted)  # the test needs rows that stop early
    for c, k in zip(compacted, kept):
        assert (c.token_ids, c.finish_reason) == (k.token_ids, k.finish_reason)
        assert c.logprobs == pytest.approx(k.logprobs, abs=1e-12)


def test_cpu_prefill_of_mixed_lengths_runs_unpadded_and_equals_the_padded_forward(model64, model_tok):
    """On the CPU, prompts of different lengths are prefilled one unpadded forward per length (no attention
    mask: CPU sdpa's fused kernel) and their caches left-padded into one; logits and the real columns of every
    layer's keys and values equal one padded forward's (float64)."""
    from composer_mesh.models.sampling import _cache_tensors, _left_padded, _prefill

    _, tok = model_tok
    prompts = ids(tok) * 2
    input_ids, mask, positions = _left_padded(prompts, 0, 0, torch.device("cpu"))
    masks: list[object] = []
    hook = model64.register_forward_pre_hook(lambda _m, _a, k: masks.append(k.get("attention_mask")),
                                             with_kwargs=True)
    try:
        with torch.inference_mode():
            cache, logits = _prefill(model64, input_ids, mask, positions, {})
            padded = model64(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
    finally:
        hook.remove()
    assert masks[:-1] == [None] * len({len(p) for p in prompts})  # one unmasked forward per length
    assert torch.allclose(logits, padded.logits[:, -1], atol=1e-10)
    for (k, v), (pk, pv) in zip(_cache_tensors(cache), _cache_tensors(padded.past_key_values), strict=True):
        real = mask[:, None, :, None].expand_as(k)  # [B, heads, W, head_dim]: the real tokens' columns
        assert torch.allclose(k[real], pk[real], atol=1e-10) and torch.allclose(v[real], pv[real], atol=1e-10)


class _HostReads(TorchDispatchMode):
    """Counts the ops that copy a value to the host and wait for it (item/bool/int, nonzero, equal)."""

    OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,  # item: under inference_mode
           torch.ops.aten.is_nonzero.default, torch.ops.aten.nonzero.default, torch.ops.aten.equal.default)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.OPS
        return func(*args, **(kwargs or {}))


def test_host_reads_do_not_grow_with_rows_or_tokens(model_tok):
    """No per-token host sync: with check_every=16 (the accelerator default) a batch costs a constant number
    of host reads plus one per 16 tokens, the same for 2 rows as for 12 (the old loop read every row's token)."""
    model, tok = model_tok

    def reads(rows: int, new: int) -> int:
        prompts = (ids(tok) * 2)[:rows]
        with _HostReads() as mode:
            out = sample(model, prompts, max_new_tokens=new, temperature=1.0, stop_ids=[], pad_id=0,
                         seeds=range(rows), check_every=16)
        assert all(len(s.token_ids) == new for s in out)
        return mode.count

    assert reads(2, 32) == reads(12, 32)
    assert reads(12, 48) - reads(12, 16) == 2  # one "how many still run?" read per 16 tokens
    assert reads(12, 16) <= 4  # prefill (transformers' mask check) + nothing per token


@pytest.mark.gpu  # tests/conftest.py skips it, with the reason, where CUDA is not available
def test_on_cuda_reads_stay_bounded_and_logprobs_hold(model_tok):
    """The accelerator default (one "all done?" read per CHECK_EVERY tokens) and the log-prob convention on CUDA."""
    import copy

    from composer_mesh.models.sampling import CHECK_EVERY

    cpu_model, tok = model_tok
    model = copy.deepcopy(cpu_model).to("cuda")
    prompts = ids(tok) * 2

    def run(new: int) -> tuple[int, list]:
        with _HostReads() as mode:
            out = sample(model, prompts, max_new_tokens=new, temperature=0.7, stop_ids=[], pad_id=0,
                         seeds=range(len(prompts)))
        return mode.count, out

    (short, _), (long, out) = run(CHECK_EVERY), run(3 * CHECK_EVERY)
    assert long - short == 2 and short <= 4
    rows = teacher_forced_logits(cpu_model, prompts, [s.token_ids for s in out], pad_id=0)
    for s, logits in zip(out, rows):
        want = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4)


def _swapping_refresh(model, new: dict[str, torch.Tensor], at: int, old_version: int = 3, new_version: int = 7):
    """A refresh that copies `new` into `model` in place on its call number `at` (0 = before the prefill)."""
    calls: list[int] = []

    def refresh() -> int:
        if len(calls) == at:
            with torch.no_grad():
                for name, p in model.state_dict().items():
                    p.copy_(new[name])
        calls.append(new_version if len(calls) >= at else old_version)
        return calls[-1]

    return refresh, calls


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_in_flight_swap_at_step_k_stamps_tokens_and_keeps_the_kv_cache(model_tok, temperature):
    """refresh() runs before every forward: a swap on call k gives token_versions [v0]*k + [v1]*(n-k); the k
    tokens before it are those of a run without a swap, the ones after follow the new weights, and the cache of
    the first k positions is the old weights' (not recomputed: token k's log-probs are not the new weights'
    teacher-forced ones)."""
    import copy

    model = copy.deepcopy(model_tok[0])
    _, tok = model_tok
    old = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in old.items()}
    prompts, n, k = ids(tok), 8, 3
    kw = dict(max_new_tokens=n, temperature=temperature, stop_ids=[], pad_id=0, seeds=range(100, 106))

    base = sample(model, prompts, **kw)
    assert all(b.token_versions is None for b in base)
    refresh, calls = _swapping_refresh(model, new, at=k)
    swapped = sample(model, prompts, refresh=refresh, **kw)
    assert calls == [3] * k + [7] * (n - k)  # one call per forward: prefill + n - 1 decode steps
    for b, s in zip(base, swapped):
        assert s.token_versions == [3] * k + [7] * (n - k)
        assert s.token_ids[:k] == b.token_ids[:k] and s.logprobs[:k] == b.logprobs[:k]
    # From token k on the new weights score the tokens.
    assert all(s.logprobs[k] != b.logprobs[k] for b, s in zip(base, swapped))
    # KV cache kept: token k is scored by the new weights over the OLD weights' keys/values of positions < k,
    # which is neither teacher forcing under the new weights nor under the old ones.
    completions = [s.token_ids for s in swapped]
    t = temperature or 1.0

    def forced(weights):
        model.load_state_dict(weights)
        rows = teacher_forced_logits(model, prompts, completions, pad_id=0)
        return [torch.log_softmax(r / t, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
                for r, c in zip(rows, completions)]

    forced_old, forced_new = forced(old), forced(new)
    for s, lo, ln in zip(swapped, forced_old, forced_new):
        assert torch.allclose(torch.tensor(s.logprobs[:k]), lo[:k], atol=1e-4)
        assert not torch.allclose(torch.tensor(s.logprobs[k]), ln[k], atol=1e-4)
        assert not torch.allclose(torch.tensor(s.logprobs[k]), lo[k], atol=1e-4)


@pytest.mark.parametrize("check_every", [1, 4])
def test_a_refresh_that_never_swaps_changes_nothing(model_tok, check_every):
    """Bitwise the same samples as without refresh (stops, lengths, log-probs), every token stamped with the
    one version; refresh is not called after a batch's last token."""
    model, tok = model_tok
    prompts = ids(tok) * 2
    kw = dict(max_new_tokens=4, temperature=3.0, stop_ids=stops(tok), pad_id=0, seeds=range(12),
              check_every=check_every)
    calls: list[int] = []

    def refresh() -> int:
        calls.append(1)
        return 5

    plain = sample(model, prompts, **kw)
    refreshed = sample(model, prompts, refresh=refresh, **kw)
    assert [(s.token_ids, s.logprobs, s.finish_reason) for s in refreshed] == [
        (s.token_ids, s.logprobs, s.finish_reason) for s in plain
    ]
    assert all(s.token_versions == [5] * len(s.token_ids) for s in refreshed)
    assert {s.finish_reason for s in plain} == {"stop", "length"}
    assert len(calls) <= 4 and len(calls) >= max(len(s.token_ids) for s in plain)
    empty = sample(model, prompts[:1], max_new_tokens=0, temperature=1.0, stop_ids=[], pad_id=0, refresh=refresh)
    assert empty[0].token_versions == [] and len(calls) <= 4


def test_refresh_adds_no_host_reads(model_tok):
    """refresh is a host-side call between forwards: the decode loop reads the device exactly as often with it."""
    model, tok = model_tok
    kw = dict(max_new_tokens=32, temperature=1.0, stop_ids=[], pad_id=0, seeds=range(6), check_every=16)

    def reads(**extra) -> int:
        with _HostReads() as mode:
            sample(model, ids(tok), **kw, **extra)
        return mode.count

    assert reads(refresh=lambda: 0) == reads()
