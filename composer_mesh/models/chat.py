"""Prompt token ids and stop token ids of a model: one definition for every generator and teacher binding.

Why one place: the same prompt must become the same ids in the hf and vllm generators and teachers (the trainer
and channel-2 teachers score exactly the ids the generator sampled from), and every binding must stop on the
same tokens. A text prompt is encoded as it always was (no special tokens, checked to round-trip); a chat
prompt (`messages`) goes through the tokenizer's chat template with the generation prompt appended. A model
stops on its tokenizer's EOS, its `generation_config.eos_token_id` (an int or a list) and its chat template's
end-of-turn token (e.g. `<|im_end|>`), plus whatever single-token texts the caller adds (a task's ';').

Multi-turn episodes are token in, token out: a later turn's ids are the exact ids of the conversation so far
(what was sampled, never re-tokenized from text) plus the environment's messages rendered by the chat template
as the suffix that bridges from the end of an assistant turn to the next generation prompt
(`bridge_token_ids`, `next_turn_token_ids`). A template that cannot render such a suffix (it re-renders
earlier turns) is refused with `TemplateBridgeError` rather than silently training on a drifting prefix.
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
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None


class NoChatTemplateError(UserInputError, ValueError):
    """A chat (messages) prompt was given to a model whose tokenizer has no chat template."""


class TemplateToolsError(UserInputError, ValueError):
    """A prompt declares tools the model's chat template does not render (or a text prompt declares tools):
    the model would be trained to call tools it was never shown."""


class BadMessageError(UserInputError, ValueError):
    """An environment message that is not a chat message (a mapping with a string 'role')."""


class TemplateBridgeError(UserInputError, ValueError):
    """The model's chat template cannot render environment messages as a suffix of the conversation so far
    (it re-renders earlier turns, e.g. drops the reasoning of earlier assistant turns, or has no single
    end-of-turn token), so a multi-turn episode cannot continue token in, token out on it."""


def model_name(tokenizer: Any, fallback: str = "") -> str:
    """The model a tokenizer belongs to, for error messages (its load path, else `fallback`)."""
    return str(getattr(tokenizer, "name_or_path", "") or fallback or "<unnamed model>")


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _require_template(tokenizer: Any, model: str, what: str) -> None:
    if not has_chat_template(tokenizer):
        raise NoChatTemplateError(
            f"{what} is given as chat messages, but the tokenizer of model {model_name(tokenizer, model)!r} has no "
            "chat template to render them. Give the prompt as text, or use a model whose tokenizer has a chat template."
        )


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """`messages` (and `tools`, when given) rendered as text by the tokenizer's chat template."""
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    return str(out)


def chat_token_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], model: str = "", what: str = "a chat prompt",
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """`messages` (with `tools` declared) through the tokenizer's chat template, generation prompt appended.
    Raises `NoChatTemplateError` (naming the model) when the tokenizer has none: guessing a format would train
    the model on prompts it never sees at inference; `TemplateToolsError` when the template ignores `tools`."""
    _require_template(tokenizer, model, what)
    if tools and render_chat(tokenizer, messages, tools) == render_chat(tokenizer, messages):
        raise TemplateToolsError(
            f"{what} declares tools, but the chat template of model {model_name(tokenizer, model)!r} does not render "
            "them (its rendering is the same without them). Use a model whose chat template supports tools."
        )
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )
    if isinstance(out, Mapping):  # transformers versions that ignore return_dict=False
        out = out["input_ids"]
    return [int(i) for i in out]


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase, prompt: ChatPrompt, model: str = "", checked: bool = True
) -> list[int]:
    """A prompt's token ids for `tokenizer`: `messages` (and `tools`) through the chat template, else `text`
    encoded without special tokens (checked to decode back to the text unless `checked` is False), exactly as
    before chat prompts existed."""
    tools = getattr(prompt, "tools", None)
    if prompt.messages is not None:
        return chat_token_ids(tokenizer, prompt.messages, model, f"prompt {prompt.prompt_id!r}", tools)
    if tools:
        raise TemplateToolsError(f"prompt {prompt.prompt_id!r} declares tools but is given as text: give it as chat "
                                 "messages, so that the model's chat template declares the tools")
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


# -- multi-turn: token in, token out ------------------------------------------------------------------------------
_BASE_USER = {"role": "user", "content": "x"}


def _probe_reply(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The stand-in assistant turn the environment messages follow: it calls one tool per tool message (named
    and identified as they say), for templates that pair tool results with the calls before them."""
    calls = [
        {"type": "function", "id": str(m.get("tool_call_id") or f"call_{i}"),
         "function": {"name": str(m.get("name") or "tool"), "arguments": {}}}
        for i, m in enumerate(messages) if m.get("role") == "tool"
    ]
    reply: dict[str, Any] = {"role": "assistant", "content": _PROBE}
    if calls:
        reply["tool_calls"] = calls
    return reply


def _bridge_error(tokenizer: Any, model: str, why: str) -> TemplateBridgeError:
    return TemplateBridgeError(
        f"the chat template of model {model_name(tokenizer, model)!r} cannot continue a multi-turn episode token in, "
        f"token out: {why}. Give its tokenizer a prefix-preserving chat template, one that renders earlier turns "
        "the same whatever follows them and ends an assistant turn with one special token (for Qwen3, TRL's "
        "trl/chat_templates/qwen3_training.jinja), or play the task as single-turn prompts."
    )


def _check_messages(messages: list[dict[str, Any]]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise BadMessageError(f"environment message {i} is not a chat message with a 'role': {m!r:.80}")


def _bridge_split(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, model: str
) -> tuple[str, str]:
    """(the base conversation up to its assistant end-of-turn token, the suffix after it): see `bridge_text`."""
    _require_template(tokenizer, model, "an episode's environment messages")
    _check_messages(messages)
    end = chat_end_token_id(tokenizer)
    if end is None:
        raise _bridge_error(tokenizer, model, "it writes no single special end-of-turn token after an assistant turn")
    base = [_BASE_USER, _probe_reply(messages)]
    try:
        base_text = render_chat(tokenizer, base, tools, add_generation_prompt=False)
        full = render_chat(tokenizer, base + list(messages), tools, add_generation_prompt=True)
    except Exception as e:  # jinja's raise_exception, missing fields: the template refuses these messages
        raise _bridge_error(tokenizer, model, f"rendering the messages failed ({e})") from None
    if not full.startswith(base_text):
        raise _bridge_error(tokenizer, model, "it renders the earlier turns differently once messages follow them")
    end_text = tokenizer.decode([end], skip_special_tokens=False)
    cut = base_text.find(end_text, base_text.index(_PROBE) + len(_PROBE))
    if cut < 0:
        raise _bridge_error(tokenizer, model, f"its end-of-turn token {end_text!r} does not follow the assistant turn")
    cut += len(end_text)
    suffix = full[cut:]
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and content.strip() and content.strip() not in suffix:
            raise _bridge_error(tokenizer, model, f"it leaves out the {m['role']!r} message {content.strip()!r:.60}")
    return full[:cut], suffix


def bridge_text(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], *,
    tools: list[dict[str, Any]] | None = None, model: str = "",
) -> str:
    """The text the chat template writes after an assistant turn's end-of-turn token for the environment
    `messages` (tool results, a user turn), up to and including the next assistant generation prompt.

    Why a fixed base: the suffix is rendered after a stand-in conversation (user "x", an assistant probe),
    never after the real one, whose turns stay exactly the ids that were sampled. The base rendered alone
    must be a prefix of the base with the messages, else the template rewrites earlier turns when more follow
    (Qwen3's dropping of earlier reasoning is one) and `TemplateBridgeError` says so; so does a template that
    leaves a message's content out or fails on the messages."""
    return _bridge_split(tokenizer, messages, tools, model)[1]


def bridge_token_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], *,
    tools: list[dict[str, Any]] | None = None, model: str = "",
) -> list[int]:
    """`bridge_text` as token ids: what follows an assistant turn that ended with `chat_end_token_id` when the
    environment says `messages`, up to the next generation prompt. Checked to be exactly the ids the whole
    rendered conversation has after that end token, so a conversation continued turn by turn is the ids a
    full render would give (the end token must be a clean token boundary)."""
    head, suffix = _bridge_split(tokenizer, messages, tools, model)
    ids = [int(i) for i in tokenizer.encode(suffix, add_special_tokens=False)]
    whole = [int(i) for i in tokenizer.encode(head + suffix, add_special_tokens=False)]
    if whole[len(whole) - len(ids) :] != ids or whole[: len(whole) - len(ids)] != tokenizer.encode(
        head, add_special_tokens=False
    ):
        raise _bridge_error(tokenizer, model, "its tokenizer merges tokens across the end-of-turn token")
    return ids


def next_turn_token_ids(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], messages: list[dict[str, Any]], *,
    tools: list[dict[str, Any]] | None = None, model: str = "",
) -> list[int]:
    """The prompt ids of an episode's next turn: `token_ids` (the exact conversation so far, ending with the
    last assistant turn's sampled ids), the chat end-of-turn token when that turn did not end with it (cut by
    `max_new_tokens`, or stopped on another stop token), then `bridge_token_ids(messages)`. Earlier turns are
    never re-tokenized."""
    bridge = bridge_token_ids(tokenizer, messages, tools=tools, model=model)
    end = chat_end_token_id(tokenizer)
    assert end is not None  # bridge_token_ids raised otherwise
    ids = [int(i) for i in token_ids]
    return ids + ([] if ids and ids[-1] == end else [end]) + bridge


# -- a conversation played at the message level (a hosted teacher's episode), in a model's tokens ----------------
class TurnRenderError(ValueError):
    """The chat template cannot render an assistant turn as a continuation of the conversation before it (it
    re-renders earlier turns, drops the turn's tool calls, or writes no end-of-turn token after it)."""


def _ids(out: Any) -> list[int]:
    if isinstance(out, Mapping):  # transformers versions that ignore return_dict=False
        out = out["input_ids"]
    return [int(i) for i in out]


def turn_token_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], reply: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """(the conversation `messages` with the generation prompt, the assistant `reply` after it through the
    template's end-of-turn token), both in `tokenizer`'s ids, rendered by its chat template. What a turn played
    by another model (a hosted teacher, at the message level) is in this model's tokens.

    Why checked: the turn is trained on as the continuation of the conversation's ids, so the whole conversation
    rendered with the reply must start with the conversation rendered alone, the reply's tool calls must be
    rendered (a template that ignores `tool_calls` would train a turn without its calls), and the turn must end
    with the template's single end-of-turn token (where the next turn's ids continue). Raises `TurnRenderError`
    saying which failed."""
    prompt = chat_token_ids(tokenizer, messages, tools=tools)
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    full = _ids(tokenizer.apply_chat_template([*messages, reply], add_generation_prompt=False, tokenize=True,
                                              return_dict=False, **kwargs))
    if full[: len(prompt)] != prompt:
        raise TurnRenderError("the template renders the conversation differently once the reply follows it")
    if reply.get("tool_calls"):
        bare = {k: v for k, v in reply.items() if k != "tool_calls"}
        if render_chat(tokenizer, [*messages, bare], tools, False) == render_chat(tokenizer, [*messages, reply],
                                                                                  tools, False):
            raise TurnRenderError("the template does not render an assistant turn's tool_calls")
    end = chat_end_token_id(tokenizer)
    turn = full[len(prompt):]
    if end is None or end not in turn:
        raise TurnRenderError("the template writes no single end-of-turn token after the assistant turn")
    return prompt, turn[: turn.index(end) + 1]
