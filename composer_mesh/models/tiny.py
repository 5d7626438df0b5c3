"""The tiny built-in model: a small Qwen2 built offline and deterministically from a `ModelConfig`.

The same config gives bitwise the same weights in every process (weights are initialised under a forked RNG
seeded with `config.seed`). Roles do not call this directly: `composer_mesh.models.loading.materialize`
builds it once (warm-started if asked) into a cached save_pretrained directory that everyone loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from composer_mesh.models.tokenizer import (
    IM_END,
    build_byte_tokenizer,
    build_tokenizer,
    stop_token_ids,
    task_alphabet_and_eos,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

    from composer_mesh.models.config import ModelConfig


def tiny_hf_config(config: ModelConfig, vocab_size: int, eos_ids: list[int], pad_id: int) -> Any:
    """The transformers `Qwen2Config` of the tiny model (also what the preflight counts its tensors from)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,  # no aliased tensors: simpler for the weight plane and vLLM reloads
        eos_token_id=eos_ids[0],
        pad_token_id=pad_id,
        bos_token_id=None,
    )


def build_tiny_model(config: ModelConfig, vocab_size: int, eos_ids: list[int], pad_id: int) -> PreTrainedModel:
    """A randomly initialised tiny Qwen2, bitwise identical for the same config in every process."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    hf_cfg = tiny_hf_config(config, vocab_size, eos_ids, pad_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen2ForCausalLM(hf_cfg)
    # Both EOS and the task's end marker stop generation (transformers generate() and vLLM read this).
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id)
    return model.to(torch.float32).eval()


def build_tiny(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Untrained tiny model + tokenizer from `config` (no cache, no warm start)."""
    if not config.is_tiny:
        raise ValueError(f"build_tiny needs model.source='tiny', got {config.source!r}")
    if config.tokenizer == "byte":  # task-independent: it stops at EOS and at the end of a chat turn
        tokenizer = build_byte_tokenizer()
        eos_ids = stop_token_ids(tokenizer, (IM_END,))
    else:
        alphabet, eos = task_alphabet_and_eos(config.task)
        tokenizer = build_tokenizer(alphabet)
        eos_ids = stop_token_ids(tokenizer, (eos,) if eos else ())
    model = build_tiny_model(config, len(tokenizer), eos_ids, int(tokenizer.pad_token_id))
    return model, tokenizer
