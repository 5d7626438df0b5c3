"""The hf sampler's prefix cache: the KV of recent prompts, so a later turn of an episode prefills only what it adds.

An episode's turn k+1 is its turn-k prompt, the turn's sampled tokens and the environment's reply: everything
but the last two was prefilled one turn ago. `sampling.sample(..., prefix_cache=, prefix_lengths=)` looks each
prompt up here (the longest stored prompt among its earlier turns' prompts), runs the forward over the rest
only, and stores the prompt's KV for the next turn. vLLM's automatic prefix caching does the same by blocks;
here an entry is one whole prompt, because a turn's prompt always extends an earlier prompt of its episode.

A hit runs the computations a miss runs: with a cache the sampler prefills an episode's prompt in chunks that
end at its earlier turns' prompt lengths whether it finds them stored or not, so a stored chunk is the one a
miss would compute again. What can still differ is float rounding from which other rows shared a chunk's
forward (a matmul's result may depend on its batch), as without a cache. Entries are only valid for the
weights that computed them: the owner `clear()`s the cache when it loads new weights (as the vllm binding
resets vLLM's prefix cache after every push). Memory is bounded by `max_bytes`; the least recently used
entries go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

# One layer's (keys, values), each [kv_heads, length, head_dim]: a single prompt's slice of a batch cache.
LayerKV = tuple[torch.Tensor, torch.Tensor]


class PrefixCache:
    """Prompt token ids -> their per-layer KV, least recently used out first once over `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"PrefixCache: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], list[LayerKV]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def lookup(self, ids: Sequence[int], lengths: Sequence[int]) -> tuple[int, list[LayerKV] | None]:
        """(n, KV) of the longest stored prompt `ids[:n]` for n in `lengths` (an episode's earlier turns' prompt
        lengths) shorter than `ids` (at least one token is left to run, whose logits the sampler needs); (0, None)
        when none is stored. Only those lengths: they are where the sampler cuts its prefill into chunks, cached
        or not, so a hit replaces exactly the chunks a miss would run."""
        key = tuple(ids)
        for length in sorted(set(lengths), reverse=True):
            kv = self._entries.get(key[:length]) if 0 < length < len(key) else None
            if kv is not None:
                self._entries.move_to_end(key[:length])
                self.hits += 1
                self.reused_tokens += length
                return length, kv
        self.misses += 1
        return 0, None

    def store(self, ids: Sequence[int], kv: list[LayerKV]) -> None:
        """Keep a copy of `kv` (one prompt's, [kv_heads, len(ids), head_dim] per layer, typically views of a batch
        cache) for `ids`, unless it is stored already; evict the least recently used entries while over
        `max_bytes`. Copied here, after those checks, so a prompt already stored costs no copy."""
        key = tuple(ids)
        size = _nbytes(kv)
        if not key or size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = [(k.clone(), v.clone()) for k, v in kv]
        self._bytes += size
        while self._bytes > self.max_bytes:
            self._evict()

    def clear(self) -> None:
        """Drop every entry (new weights: the stored KV is no longer what they compute)."""
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> dict[str, float]:
        """Lookups that found a prompt, that did not, and the prompt tokens whose forward they saved."""
        return {"prefix_hits": self.hits, "prefix_misses": self.misses, "prefix_reused_tokens": self.reused_tokens}

    def _evict(self) -> None:
        _, kv = self._entries.popitem(last=False)
        self._bytes -= _nbytes(kv)


def _nbytes(kv: list[LayerKV]) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
