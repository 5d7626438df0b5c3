"""Whether models can work together, read from their directories without loading weights: the same tokenizer
(a distillation teacher's distributions are over the student's token ids), the head's vocabulary, and the
context length (a prompt plus `max_new_tokens` must fit)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from composer_mesh.models.config import ModelConfig


def tokenizer_mismatch(teacher: PreTrainedTokenizerBase, student: PreTrainedTokenizerBase) -> str | None:
    """None when both tokenizers map every token to the same id and share EOS; else what differs."""
    tv, sv = teacher.get_vocab(), student.get_vocab()
    if tv != sv:
        differ = sum(1 for k in set(tv) | set(sv) if tv.get(k) != sv.get(k))
        return f"vocabularies differ ({len(tv)} vs {len(sv)} tokens, {differ} tokens map to different ids)"
    if teacher.eos_token_id != student.eos_token_id:
        return f"EOS ids differ ({teacher.eos_token_id} vs {student.eos_token_id})"
    return None


def _hf_config(config: ModelConfig) -> object:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config.source, local_files_only=True)


def vocab_rows(config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> int:
    """Rows of the model's output head (what its logits are over)."""
    if config.is_tiny:
        return len(tokenizer)
    return int(getattr(_hf_config(config), "vocab_size", None) or len(tokenizer))


def context_length(config: ModelConfig) -> int | None:
    """The longest sequence (prompt + completion) the model takes; None when its config does not say."""
    if config.is_tiny:
        return config.max_position_embeddings
    value = getattr(_hf_config(config), "max_position_embeddings", None)
    return int(value) if value else None


def skeleton(config: ModelConfig, vocab_size: int) -> torch.nn.Module:
    """The model's modules and parameter shapes, built on the meta device from its config: no weights are read
    or allocated (what the checks before launch inspect: its tensors, its module names)."""
    import torch
    from transformers import AutoModelForCausalLM

    if config.is_tiny:
        from composer_mesh.models.tiny import tiny_hf_config

        hf_config = tiny_hf_config(config, vocab_size, eos_ids=[0], pad_id=0)  # ids change no tensor
    else:
        hf_config = _hf_config(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-any-return]


def parameter_tensors(config: ModelConfig, vocab_size: int) -> int:
    """How many parameter tensors the model has (what streaming DiLoCo splits into fragments)."""
    return sum(1 for _ in skeleton(config, vocab_size).parameters())


def model_problems(config: ModelConfig, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                   who: str) -> list[str]:
    """What keeps `config` from generating `max_new_tokens` after a prompt: a tokenizer with ids beyond the
    head, or a context that leaves no room for a prompt."""
    problems = []
    rows = vocab_rows(config, tokenizer)
    if len(tokenizer) > rows:
        problems.append(f"{who}: its tokenizer has {len(tokenizer)} tokens but the model's head only {rows} "
                        f"(model.source {config.source!r}: tokenizer and weights of different models?)")
    context = context_length(config)
    if context is not None and max_new_tokens >= context:
        problems.append(f"{who}: run.max_new_tokens={max_new_tokens} leaves no room for a prompt in its context of "
                        f"{context} tokens (max_position_embeddings of {config.source!r})")
    return problems
