"""The sampler's prefix cache (`models.prefix_cache`): the longest stored prompt a prompt extends, LRU bounds, and
sampling through it: an episode's later turns prefill only what they add and get what a full prefill gives."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_mesh.models.config import ModelConfig
from composer_mesh.models.prefix_cache import PrefixCache
from composer_mesh.models.sampling import sample

STUDENT = ModelConfig(warmstart={"steps": 30})  # same as tests/models: one cache build per session


def kv(length: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A stand-in entry: per layer (keys, values) [1 head, length, 2 dims] float32, 16 bytes a token each."""
    return [(torch.full((1, length, 2), float(length)), torch.zeros((1, length, 2))) for _ in range(layers)]


def test_lookup_finds_the_longest_stored_prompt_the_ids_extend():
    cache = PrefixCache(1 << 20)
    cache.store([1, 2], kv(2))
    cache.store([1, 2, 3, 4], kv(4))
    cache.store([9, 9, 9], kv(3))
    n, found = cache.lookup([1, 2, 3, 4, 5, 6])
    assert n == 4 and found is not None and float(found[0][0][0, 0, 0]) == 4.0
    assert cache.lookup([1, 2, 3])[0] == 2  # [1, 2, 3, 4] is not a prefix of it
    assert cache.lookup([1, 2, 3, 4])[0] == 2  # a whole stored prompt leaves no token to run: the next shorter one
    assert cache.lookup([5, 1, 2, 3]) == (0, None)
    assert cache.stats() == {"prefix_hits": 3, "prefix_misses": 1, "prefix_reused_tokens": 8}


def test_least_recently_used_entries_leave_once_over_the_byte_budget():
    per_token = 2 * 2 * (1 * 2 * 4)  # 2 layers x (keys + values) x 1 head x 2 dims x 4 bytes
    cache = PrefixCache(10 * per_token)
    cache.store([1, 1, 1, 1], kv(4))
    cache.store([2, 2, 2, 2], kv(4))
    assert cache.lookup([1, 1, 1, 1, 0])[0] == 4  # [1...] is now the most recently used
    cache.store([3, 3, 3, 3], kv(4))  # 12 tokens > 10: the least recently used ([2...]) goes
    assert len(cache) == 2 and cache.nbytes == 8 * per_token
    assert cache.lookup([2, 2, 2, 2, 0]) == (0, None)
    assert cache.lookup([1, 1, 1, 1, 0])[0] == 4 and cache.lookup([3, 3, 3, 3, 0])[0] == 4
    cache.store([4] * 11, kv(11))  # larger than the whole budget: not kept, nothing evicted for it
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.lookup([1, 1, 1, 1, 0]) == (0, None)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    """float64: a prefill that reuses stored keys differs from a full one by ~1e-16, so tokens must be equal."""
    from composer_mesh.models.loading import load_pretrained

    model, tok = load_pretrained(STUDENT, str(tmp_path_factory.getbasetemp() / "composer_mesh_models"))
    return copy.deepcopy(model).double().eval(), tok


def play(model, tok, cache: PrefixCache | None, turns: int = 3) -> list[list]:
    """Episodes of `turns` turns: each turn's prompt is the last prompt + its sampled tokens + an environment
    reply, as the rollout driver builds them. Rows: two samples each of two prompts of different lengths."""
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("3+4=", "3+4=", "12+5+1=", "12+5+1=")]
    seeds, out = [11, 12, 13, 14], []
    for turn in range(turns):
        got = sample(model, prompts, max_new_tokens=6, temperature=1.0, stop_ids=[tok.eos_token_id], pad_id=0,
                     seeds=[s + 100 * turn for s in seeds], prefix_cache=cache)
        out.append(got)
        reply = tok.encode(f" ok{turn}:", add_special_tokens=False)
        prompts = [p + g.token_ids + reply for p, g in zip(prompts, got)]
    return out


def test_later_turns_reuse_the_stored_prompt_and_sample_what_a_full_prefill_samples(model64):
    model, tok = model64
    cache = PrefixCache(1 << 24)
    cached, plain = play(model, tok, cache), play(model, tok, None)
    for turn_c, turn_p in zip(cached, plain, strict=True):
        for c, p in zip(turn_c, turn_p, strict=True):
            assert c.token_ids == p.token_ids and c.finish_reason == p.finish_reason
            assert c.logprobs == pytest.approx(p.logprobs, abs=1e-12)
    # Turn 1: two distinct prompts (each prefilled once for its two samples), no hit. Turns 2 and 3: all four
    # rows extend their own last prompt (the two samples of a prompt sampled differently, so 4 distinct rows).
    assert cache.stats()["prefix_misses"] == 2 and cache.stats()["prefix_hits"] == 8
    first_lengths = [len(tok.encode(t, add_special_tokens=False)) for t in ("3+4=", "12+5+1=")]
    assert cache.stats()["prefix_reused_tokens"] > 2 * sum(first_lengths) * 2


def test_a_prompt_that_extends_no_entry_is_prefilled_whole_beside_rows_that_hit(model64):
    model, tok = model64
    cache = PrefixCache(1 << 24)
    base = tok.encode("7+8=", add_special_tokens=False)
    kw = dict(max_new_tokens=5, temperature=0.0, stop_ids=[tok.eos_token_id], pad_id=0)
    sample(model, [base], prefix_cache=cache, **kw)
    batch = [base + tok.encode("15; and 1+1=", add_special_tokens=False), tok.encode("9+9+9+9=", add_special_tokens=False)]
    hit, miss = sample(model, batch, prefix_cache=cache, **kw)
    assert cache.stats()["prefix_hits"] == 1 and cache.stats()["prefix_reused_tokens"] == len(base)
    for row, got in zip(batch, (hit, miss)):
        [alone] = sample(model, [row], **kw)
        assert got.token_ids == alone.token_ids and got.logprobs == pytest.approx(alone.logprobs, abs=1e-12)
