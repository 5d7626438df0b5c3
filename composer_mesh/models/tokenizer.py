"""The tiny model's tokenizers (character-level or byte-level), and the token helpers every binding uses.

`build_tokenizer(alphabet)` gives the built-in model's character tokenizer, `build_byte_tokenizer()` its
byte-level one with a chat template (`tiny_tokenizer(config)` picks by `model.tokenizer`); `encode_checked`
and `stop_token_ids` work on any transformers tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from composer_mesh.errors import UserInputError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from composer_mesh.models.config import ModelConfig

EOS_TOKEN = "<|endoftext|>"  # end of text; also the pad token
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # the byte tokenizer's chat turn markers (Qwen's)

# Qwen2.5's chat template without the default system prompt and with a compact tool format (every prompt token
# costs a tiny model). Per message `<|im_start|>{role}\n{content}<|im_end|>\n` (any role: system, user,
# assistant, tool), then `<|im_start|>assistant\n` with add_generation_prompt. With `tools`, one system turn
# first declares them by name and parameter names: `<|im_start|>system\ntools: calculator(expression),
# search(query)<|im_end|>\n`. An assistant message's `tool_calls` follow its content in the Hermes/Qwen form,
# one `<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>` per call (JSON on one
# line; `arguments` given as a JSON string are written as is), before its `<|im_end|>`. Without tools and tool
# calls the rendering is byte-identical to the template's first version (text-only chat).
BYTE_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools: ' }}"
    "{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}"
    "{%- set params = f.parameters.properties if f.parameters is defined and f.parameters.properties is defined "
    "else {} %}"
    "{{- (', ' if not loop.first else '') + f.name + '(' + (params | list | join(', ')) + ')' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- if message.tool_calls is defined and message.tool_calls %}{%- for tc in message.tool_calls %}"
    "{%- set call = tc.function if tc.function is defined else tc %}"
    "{{- '<tool_call>{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' + (call.arguments if call.arguments "
    "is string else (call.arguments | tojson)) + '}</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def trl_chat_template(name: str = "qwen2_5") -> str:
    """The text of TRL's chat template `trl/chat_templates/{name}.jinja` (e.g. `qwen2_5`, `qwen3`). TRL
    recognises a tool-calling tokenizer by its template's exact text, so a tiny offline tokenizer given this
    template is one TRL's `GRPOTrainer(tools=...)` accepts (the agentic benchmark's comparison). Raises
    `UserInputError` when trl is not installed or has no such template."""
    try:
        import trl
    except ImportError:
        raise UserInputError(f"the chat template {name!r} is TRL's and trl is not installed (pip install trl)") from None
    path = Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        raise UserInputError(f"trl {trl.__version__} has no chat template {name!r} (looked for {path})")
    return path.read_text()


def task_alphabet_and_eos(task_name: str) -> tuple[str, str | None]:
    """The characters a task's prompts and answers use, and its end marker (e.g. ';') if it has one."""
    from composer_mesh.tasks import get_task

    task = get_task(task_name)
    return task.alphabet, getattr(task, "eos", None)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a byte-level BPE stores in its vocab)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _qwen2_tokenizer_class() -> type:
    """`Qwen2Tokenizer` from wherever this transformers exports it: some 5.x builds leave it out of the
    top-level namespace (5.17 on the GPU image), all keep it in its model module."""
    try:
        from transformers import Qwen2Tokenizer
    except ImportError:
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
    return Qwen2Tokenizer


def build_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: `<|endoftext|>` (id 0, also pad) then one id per character of `alphabet`.

    It is a `Qwen2Tokenizer` (byte-level BPE) with no merges and a vocabulary holding only the alphabet's
    bytes. That is deliberate: transformers 5 (and so vLLM) always rebuilds a qwen2 model's tokenizer as
    `Qwen2Tokenizer` from the saved vocab, so building it the same way here makes the in-memory tokenizer
    and every reloaded copy identical. ASCII characters are one id each (`"3+4="` -> 4 ids); nothing is
    added around the text. Characters outside the alphabet are dropped by the BPE (it has no unk), so
    encode untrusted text with `encode_checked`.
    """
    Qwen2Tokenizer = _qwen2_tokenizer_class()

    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {EOS_TOKEN: 0}
    for ch in alphabet:
        for byte in ch.encode("utf-8"):
            vocab.setdefault(b2u[byte], len(vocab))
    return Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, unk_token=EOS_TOKEN)


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with a chat template: id b is byte b (0-255), then `<|endoftext|>` (256, EOS and
    pad), `<|im_start|>` (257) and `<|im_end|>` (258, the end of a chat turn).

    Any text is representable (no task alphabet, nothing dropped), so it reads prompts of any environment;
    chat prompts go through `BYTE_CHAT_TEMPLATE`. Like `build_tokenizer` it is a `Qwen2Tokenizer` without
    merges, so the saved and reloaded copies (transformers, vLLM) are the same tokenizer. The special tokens
    are matched in text as well (as in Qwen's own tokenizer).
    """
    Qwen2Tokenizer = _qwen2_tokenizer_class()

    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {b2u[byte]: byte for byte in range(256)}
    for token in (EOS_TOKEN, IM_START, IM_END):
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                               unk_token=EOS_TOKEN, extra_special_tokens=[IM_START, IM_END])
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


def tiny_tokenizer(config: ModelConfig) -> PreTrainedTokenizerFast:
    """The built-in model's tokenizer for `config`: byte-level, or character-level over its task's alphabet."""
    if config.tokenizer == "byte":
        return build_byte_tokenizer()
    alphabet, _ = task_alphabet_and_eos(config.task)
    return build_tokenizer(alphabet)


class UnencodableTextError(UserInputError, ValueError):
    """A prompt the model's tokenizer cannot represent (e.g. words given to the tiny model's character
    tokenizer): the input does not fit the model, which is the user's to fix, not a bug."""


def encode_checked(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Encode without special tokens; raise UnencodableTextError if the ids do not decode back to `text`
    (characters not covered)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    back = tokenizer.decode(ids)
    if back != text:
        missing = sorted({ch for ch in text if ch not in back})
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise UnencodableTextError(
            f"the tokenizer cannot represent {shown!r} (characters not covered: {''.join(missing)!r})"
        )
    return ids


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, extra_texts: tuple[str, ...] = ()) -> list[int]:
    """The tokenizer's EOS plus every `extra_texts` string that is a single token (e.g. the task's ';')."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    for text in extra_texts:
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) == 1 and enc[0] not in ids:
            ids.append(int(enc[0]))
    return ids
