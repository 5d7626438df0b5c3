"""A small real-architecture model directory (Llama or Qwen2 config, byte-level tokenizer with a chat template),
built offline: what `model.source: PATH` expects from a user, at a size a CPU trains in minutes.

    python -m composer_mesh.models.small models/small-llama            # then: topologies/hf_model.yaml

It is a plain `save_pretrained` directory (config.json, model.safetensors, tokenizer files, generation_config.json):
nothing in it is specific to composer-mesh, so it exercises the same loading, chat-template and weight paths a
downloaded model does. Weights are random (seeded): pair it with `model.warmstart` to give it a start.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from composer_mesh.models.tokenizer import IM_END, build_byte_tokenizer, stop_token_ids

Architecture = Literal["llama", "qwen2"]


def build_small_model_dir(
    path: str | Path, arch: Architecture = "llama", hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
    num_kv_heads: int = 2, max_position_embeddings: int = 256, tie_word_embeddings: bool = False, seed: int = 0,
) -> Path:
    """Write a randomly initialised (`seed`) `arch` causal LM with the byte tokenizer to `path` (created; must not
    hold a model already). Generation stops at EOS and at the end of a chat turn, as a chat model's does."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out = Path(path)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a model (config.json); choose an empty directory")
    tokenizer = build_byte_tokenizer()
    eos_ids = stop_token_ids(tokenizer, (IM_END,))
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_ids[0], pad_token_id=int(tokenizer.pad_token_id), bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=int(tokenizer.pad_token_id))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m composer_mesh.models.small", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("path", help="directory to create (e.g. models/small-llama)")
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        out = build_small_model_dir(args.path, args.arch, args.hidden_size, args.layers, seed=args.seed)
    except (FileExistsError, ValueError) as e:
        parser.error(str(e))
    print(f"wrote a {args.arch} model with the byte tokenizer to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
