"""Prompt token ids and stop token ids of a model: one definition for every generator and teacher binding.

Why one place: the same prompt must become the same ids in the hf and vllm generators and teachers (the trainer
and channel-2 teachers score exactly the ids the generator sampled from), and every binding must stop on the
same tokens. A text prompt is encoded as it always was (no special tokens, checked to round-trip); a chat
prompt (`messages`) goes through the tokenizer's chat template with the generation prompt appended. A model
stops on its tokenizer's EOS, its `generation_config.eos_token_id` (an int or a list) and its chat template's
end-of-turn token (e.g. `<|im_end|>`), plus whatever single-token texts the caller adds (a task's ';').
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from composer_mesh.errors import UserInputError
from composer_mesh.models.tokenizer import encode_checked

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A stand-in assistant reply, used to find what the chat template writes right after a turn's content.
_PROBE = "PROBE7REPLY"


class ChatPrompt(Protocol):
    """What `prompt_token_ids` reads of a prompt (`composer_mesh.actors.messages.Prompt` has it)."""

    prompt_id: str
    text: str
    messages: list[dict[str, str]] | None


class NoChatTemplateError(UserInputError, ValueError):
    """A chat (messages) prompt was given to a model whose tokenizer has no chat template."""


def model_name(tokenizer: Any, fallback: str = "") -> str:
    """The model a tokenizer belongs to, for error messages (its load path, else `fallback`)."""
    return str(getattr(tokenizer, "name_or_path", "") or fallback or "<unnamed model>")


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_token_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], model: str = "", what: str = "a chat prompt"
) -> list[int]:
    """`messages` through the tokenizer's chat template, generation prompt appended. Raises
    `NoChatTemplateError` (naming the model) when the tokenizer has none: guessing a format would train the
    model on prompts it never sees at inference."""
    if not has_chat_template(tokenizer):
        raise NoChatTemplateError(
            f"{what} is given as chat messages, but the tokenizer of model {model_name(tokenizer, model)!r} has no "
            "chat template to render them. Give the prompt as text, or use a model whose tokenizer has a chat template."
        )
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(out, Mapping):  # transformers versions that ignore return_dict=False
        out = out["input_ids"]
    return [int(i) for i in out]


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase, prompt: ChatPrompt, model: str = "", checked: bool = True
) -> list[int]:
    """A prompt's token ids for `tokenizer`: `messages` through the chat template, else `text` encoded without
    special tokens (checked to decode back to the text unless `checked` is False), exactly as before chat
    prompts existed."""
    if prompt.messages is not None:
        return chat_token_ids(tokenizer, prompt.messages, model, f"prompt {prompt.prompt_id!r}")
    if checked:
        return encode_checked(tokenizer, prompt.text)
    return [int(i) for i in tokenizer.encode(prompt.text, add_special_tokens=False)]


def _is_special(tokenizer: Any, token_id: int) -> bool:
    if token_id in set(getattr(tokenizer, "all_special_ids", ()) or ()):
        return True
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tok = added.get(token_id)
    return bool(tok is not None and getattr(tok, "special", False))


def chat_end_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template writes right after an assistant turn's content (e.g. `<|im_end|>`),
    or None: no template, a template that cannot render a user/assistant exchange, or no single special token
    there. Found by rendering a probe reply, so it follows the template rather than a list of known names."""
    if not has_chat_template(tokenizer):
        return None
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # templates may insist on roles or features we do not give; then no end token
        return None
    if not isinstance(rendered, str) or _PROBE not in rendered:
        return None
    after = rendered.split(_PROBE, 1)[1].lstrip(" ")
    ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    return int(ids[0]) if ids and _is_special(tokenizer, int(ids[0])) else None


def generation_eos_ids(generation_config: Any) -> list[int]:
    """`eos_token_id` of a transformers `GenerationConfig` (or its dict): an int, a list, or none -> a list."""
    if generation_config is None:
        return []
    eos = generation_config.get("eos_token_id") if isinstance(generation_config, Mapping) else getattr(
        generation_config, "eos_token_id", None
    )
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def load_generation_config(model_dir: str | os.PathLike[str]) -> Any:
    """The `GenerationConfig` transformers' `from_pretrained` gives a model saved in `model_dir` (its
    generation_config.json, else one derived from config.json), or None; for bindings that never load the
    model with transformers (vLLM), so that they stop where the hf bindings do."""
    from transformers import AutoConfig, GenerationConfig

    path = Path(model_dir)
    if (path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(path), local_files_only=True)
    try:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(path), local_files_only=True))
    except (OSError, ValueError):
        return None


def model_stop_ids(
    tokenizer: PreTrainedTokenizerBase,
    generation_config: Any = None,
    extra_texts: Iterable[str] = (),
    skip_texts: Iterable[str] = (),
) -> list[int]:
    """The ids a model's generation stops on, in this order: the tokenizer's EOS, each `extra_texts` string
    that is one token (a task's ';'), the generation config's EOS ids, the chat template's end-of-turn token.
    A generation-config id that is the single token of a `skip_texts` string is left out (the tiny model's
    generation config lists its task's ';', which a binding told not to stop at must not stop at)."""

    def single(text: str) -> int | None:
        enc = tokenizer.encode(text, add_special_tokens=False)
        return int(enc[0]) if len(enc) == 1 else None

    ids: list[int] = []

    def add(i: int | None) -> None:
        if i is not None and i not in ids:
            ids.append(int(i))

    add(tokenizer.eos_token_id)
    for text in extra_texts:
        add(single(text))
    skip = {s for s in map(single, skip_texts) if s is not None} - set(ids)
    for i in generation_eos_ids(generation_config):
        if i not in skip:
            add(i)
    add(chat_end_token_id(tokenizer))
    return ids
