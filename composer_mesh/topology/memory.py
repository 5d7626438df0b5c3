"""What one trainer rank holds, estimated from the model's config before anything launches (`composer-mesh plan`).

An estimate, not a measurement: parameter counts come from the decoder's shapes (embeddings, per layer attention
with its grouped key/value heads and biases, a gated MLP, norms, the head unless tied), the bytes per parameter
from `settings.precision`, and activations from a rule of thumb (about 34 bytes per token, hidden unit and layer
in 16-bit without activation checkpointing, 2 with it plus one layer recomputed). A sharded replica divides the
parameters, gradients and AdamW state by its ranks; each rank also holds the gathered root (embeddings and head,
kept from forward to backward) and two gathered decoder layers (the one running and the one prefetched).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 2**30
# Bytes per parameter of (weights, gradients, AdamW moments) by `settings.precision`.
_BYTES = {"fp32": (4, 4, 8), "bf16-mixed": (4, 4, 8), "bf16": (2, 2, 4), "fp64": (8, 8, 16)}


@dataclass(frozen=True)
class Shapes:
    """The decoder's shapes that decide its size (HF config.json names)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool

    @classmethod
    def of_config(cls, cfg: dict[str, Any]) -> Shapes:
        heads = int(cfg["num_attention_heads"])
        return cls(vocab=int(cfg["vocab_size"]), hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]),
                   heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   intermediate=int(cfg["intermediate_size"]), tied=bool(cfg.get("tie_word_embeddings", False)))

    @property
    def layer_parameters(self) -> int:
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        attention = h * h + 2 * h * kv + h * h + h + 2 * kv  # q, k, v, o (+ q/k/v biases, as Qwen2 has)
        return attention + 3 * h * self.intermediate + 2 * h  # gated MLP, two norms

    @property
    def root_parameters(self) -> int:
        """Embeddings, final norm and head (once when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def parameters(self) -> int:
        return self.layers * self.layer_parameters + self.root_parameters


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of a trainer replica holds, by part."""

    parameters: int  # the model's parameter count
    ranks: int
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {_size(size)}" for name, size in self.parts.items() if size)
        shards = f"sharded over {self.ranks} ranks" if self.ranks > 1 else "one proc"
        return f"≈ {_size(self.total)} per rank ({shards}; {_count(self.parameters)} parameters): {parts}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def model_shapes(model: Any) -> Shapes | None:
    """The policy's shapes from its `ModelConfig`: the built-in tiny model's fields, or the config.json of a
    local directory or of a hub model already in the local cache (nothing is downloaded); None if unknown."""
    if model.source == "tiny":
        vocab = 259 if model.tokenizer == "byte" else 64  # the byte tokenizer; the character one is smaller
        return Shapes(vocab, model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads,
                      model.intermediate_size, tied=False)
    path = Path(model.source) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model.source, "config.json", revision=getattr(model, "revision", None))
        except Exception:  # not a hub id, or no cache
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        cfg = json.loads(path.read_text())
        return Shapes.of_config(cfg.get("text_config", cfg))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def rank_memory(shapes: Shapes, settings: Any, ranks: int, reference: bool, tokens: int | None) -> RankMemory:
    """`shapes` trained with the hf trainer's `settings` on `ranks` procs per replica; `reference`: a frozen
    copy for KL / DPO; `tokens`: one micro-batch's tokens (None: activations not estimated)."""
    n = shapes.parameters
    weights, grads, adam = _BYTES.get(settings.precision, _BYTES["fp32"])
    if settings.lora is not None:  # only adapters train: their grads and AdamW are small next to the base
        grads = adam = 0
    compute = 2 if settings.precision in ("bf16-mixed", "bf16") else weights
    parts = {
        "weights": n * weights // ranks,
        "gradients": n * grads // ranks,
        "AdamW": n * adam // ranks,
        "reference": n * (2 if settings.precision == "bf16-mixed" else weights) // ranks if reference else 0,
    }
    if ranks > 1:
        parts["gathered"] = (shapes.root_parameters + 2 * shapes.layer_parameters) * compute
    if tokens is not None:
        per_layer = tokens * shapes.hidden * (2 if settings.activation_checkpointing else 34)
        parts["activations"] = per_layer * shapes.layers + (tokens * shapes.hidden * 34
                                                              if settings.activation_checkpointing else 0)
        if settings.lm_head == "full":
            parts["activations"] += tokens * shapes.vocab * 4
    return RankMemory(parameters=n, ranks=ranks, parts=parts)
