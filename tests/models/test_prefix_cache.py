"""The sampler's prefix cache (`models.prefix_cache`): the longest stored prompt a prompt extends, LRU bounds, and
sampling through it: an episode's later turns prefill only what they add and get what a full prefill gives."""

from __future__ import annotations

import pytest
import torch

from composer_mesh.models.config import ModelConfig
from composer_mesh.models.prefix_cache import PrefixCache
from composer_mesh.models.sampling import sample

STUDENT = ModelConfig(warmstart={"steps": 30})  # same as tests/models: one cache build per session


def kv(length: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A stand-in entry: per layer (keys, values) [1 head, length, 2 dims] float32, 16 bytes a token each."""
    return [(torch.full((1, length, 2), float(length)), torch.zeros((1, length, 2))) for _ in range(layers)]


def test_lookup_finds_the_longest_stored_prompt_among_the_given_lengths():
    cache = PrefixCache(1 << 20)
    cache.store([1, 2], kv(2))
    cache.store([1, 2, 3, 4], kv(4))
    cache.store([9, 9, 9], kv(3))
    n, found = cache.lookup([1, 2, 3, 4, 5, 6], [2, 4])
    assert n == 4 and found is not None and float(found[0][0][0, 0, 0]) == 4.0
    assert cache.lookup([1, 2, 3, 4, 5, 6], [2])[0] == 2  # only the lengths asked for: where the chunks end
    assert cache.lookup([1, 2, 3], [2, 3])[0] == 2  # [1, 2, 3] is not stored
    assert cache.lookup([1, 2, 3, 4], [2, 4])[0] == 2  # a whole stored prompt leaves no token to run
    assert cache.lookup([5, 1, 2, 3], [2, 3]) == (0, None)
    assert cache.lookup([1, 2, 3, 4, 5], []) == (0, None)  # not a later turn: nothing to look for
    assert cache.stats() == {"prefix_hits": 4, "prefix_misses": 2, "prefix_reused_tokens": 10}


def test_least_recently_used_entries_leave_once_over_the_byte_budget():
    per_token = 2 * 2 * (1 * 2 * 4)  # 2 layers x (keys + values) x 1 head x 2 dims x 4 bytes
    cache = PrefixCache(10 * per_token)
    cache.store([1, 1, 1, 1], kv(4))
    cache.store([2, 2, 2, 2], kv(4))
    assert cache.lookup([1, 1, 1, 1, 0], [4])[0] == 4  # [1...] is now the most recently used
    cache.store([3, 3, 3, 3], kv(4))  # 12 tokens > 10: the least recently used ([2...]) goes
    assert len(cache) == 2 and cache.nbytes == 8 * per_token
    assert cache.lookup([2, 2, 2, 2, 0], [4]) == (0, None)
    assert cache.lookup([1, 1, 1, 1, 0], [4])[0] == 4 and cache.lookup([3, 3, 3, 3, 0], [4])[0] == 4
    cache.store([4] * 11, kv(11))  # larger than the whole budget: not kept, nothing evicted for it
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.lookup([1, 1, 1, 1, 0], [4]) == (0, None)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    from composer_mesh.models.loading import load_pretrained

    model, tok = load_pretrained(STUDENT, str(tmp_path_factory.getbasetemp() / "composer_mesh_models"))
    return model.eval(), tok


def play(model, tok, cache: PrefixCache | None, turns: int = 3, forget: bool = False) -> list[list]:
    """Episodes of `turns` turns: each turn's prompt is the last prompt + its sampled tokens + an environment
    reply, with the earlier turns' prompt lengths, as the rollout driver builds them. Rows: two samples each of
    two prompts of different lengths. `forget`: empty the cache before every turn (every lookup misses)."""
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("3+4=", "3+4=", "12+5+1=", "12+5+1=")]
    marks: list[list[int]] = [[] for _ in prompts]
    seeds, out = [11, 12, 13, 14], []
    for turn in range(turns):
        if forget and cache is not None:
            cache.clear()
        got = sample(model, prompts, max_new_tokens=6, temperature=1.0, stop_ids=[tok.eos_token_id], pad_id=0,
                     seeds=[s + 100 * turn for s in seeds], prefix_cache=cache, prefix_lengths=marks)
        out.append(got)
        reply = tok.encode(f" ok{turn}:", add_special_tokens=False)
        marks = [[*m, len(p)] for m, p in zip(marks, prompts)]
        prompts = [p + g.token_ids + reply for p, g in zip(prompts, got)]
    return out


def test_a_hit_gives_the_bits_of_a_miss_and_a_full_prefills_tokens(model_tok):
    """float32, as generators run: the same episodes with the cache kept (later turns hit) and emptied before
    every turn (every lookup misses, the prompt is prefilled in the same chunks) are bitwise equal; without a
    cache (one prefill) the tokens are the same and the log-probs equal up to float32 rounding."""
    model, tok = model_tok
    kept, emptied = PrefixCache(1 << 24), PrefixCache(1 << 24)
    cached, missed, plain = play(model, tok, kept), play(model, tok, emptied, forget=True), play(model, tok, None)
    for turn_c, turn_m, turn_p in zip(cached, missed, plain, strict=True):
        for c, m, p in zip(turn_c, turn_m, turn_p, strict=True):
            assert (c.token_ids, c.logprobs, c.finish_reason) == (m.token_ids, m.logprobs, m.finish_reason)
            assert c.token_ids == p.token_ids and c.logprobs == pytest.approx(p.logprobs, abs=1e-5)
    # Turn 1: two distinct prompts (each prefilled once for its two samples), no hit. Turns 2 and 3: all four
    # rows extend their own last prompt (the two samples of a prompt sampled differently: 4 distinct rows).
    assert kept.stats()["prefix_misses"] == 2 and kept.stats()["prefix_hits"] == 8
    assert emptied.stats()["prefix_hits"] == 0 and emptied.stats()["prefix_misses"] == 10
    assert kept.stats()["prefix_reused_tokens"] == sum(m for turn in (1, 2) for m in _last_marks(cached, tok, turn))


def _last_marks(turns: list[list], tok, turn: int) -> list[int]:
    """The prompt lengths of turn `turn - 1` (what turn `turn` reuses), rebuilt from the sampled tokens."""
    lengths = [len(tok.encode(t, add_special_tokens=False)) for t in ("3+4=", "3+4=", "12+5+1=", "12+5+1=")]
    for k in range(turn - 1):
        reply = len(tok.encode(f" ok{k}:", add_special_tokens=False))
        lengths = [n + len(g.token_ids) + reply for n, g in zip(lengths, turns[k])]
    return lengths


def test_a_prompt_with_nothing_stored_is_prefilled_beside_rows_that_hit(model_tok):
    model, tok = model_tok
    cache = PrefixCache(1 << 24)
    base = tok.encode("7+8=", add_special_tokens=False)
    kw = dict(max_new_tokens=5, temperature=0.0, stop_ids=[tok.eos_token_id], pad_id=0)
    sample(model, [base], prefix_cache=cache, prefix_lengths=[[]], **kw)
    batch = [base + tok.encode("15; and 1+1=", add_special_tokens=False), tok.encode("9+9+9+9=", add_special_tokens=False)]
    marks = [[len(base)], [3]]  # the second row's cut has nothing stored: it is prefilled in two chunks
    hit, miss = sample(model, batch, prefix_cache=cache, prefix_lengths=marks, **kw)
    assert cache.stats()["prefix_hits"] == 1 and cache.stats()["prefix_reused_tokens"] == len(base)
    for row, got in zip(batch, (hit, miss)):
        [alone] = sample(model, [row], **kw)  # a plain prefill, alone: float32 rounding of another batch apart
        assert got.token_ids == alone.token_ids and got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
