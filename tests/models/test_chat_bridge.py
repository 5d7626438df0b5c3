"""Token in, token out (`models.chat.bridge_token_ids`, `next_turn_token_ids`): environment messages rendered
by the chat template as the suffix after an assistant turn, on the byte tokenizer's template and on Qwen2.5's
tool template (TRL's copy, the text TRL recognises), and the templates that cannot do it refused by name."""

from __future__ import annotations

import pytest

from composer_mesh.actors.backends.local_model import PromptTooLongError, check_generation_request, prompt_ids
from composer_mesh.actors.messages import GenerationRequest, Prompt
from composer_mesh.models.chat import (
    NoChatTemplateError,
    TemplateBridgeError,
    TemplateToolsError,
    bridge_text,
    bridge_token_ids,
    chat_end_token_id,
    chat_token_ids,
    next_turn_token_ids,
    prompt_token_ids,
    render_chat,
)
from composer_mesh.models.tokenizer import build_byte_tokenizer, build_tokenizer, trl_chat_template

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {"query": {}, "k": {}}}}  # bare form
TOOLS = [CALC, SEARCH]


def call(name: str, **arguments: object) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# A whole episode: a tool call, its result, two parallel calls, their results, an answer, a follow-up.
CONVERSATION = [
    {"role": "user", "content": "What is 12*7+5?"},
    {"role": "assistant", "content": "", "tool_calls": [call("calculator", expression="12*7")]},
    {"role": "tool", "name": "calculator", "tool_call_id": "c1", "content": "84"},
    {"role": "assistant", "content": "Now add.", "tool_calls": [call("calculator", expression="84+5"),
                                                                 call("search", query="89", k=1)]},
    {"role": "tool", "name": "calculator", "tool_call_id": "c2", "content": "89"},
    {"role": "tool", "name": "search", "tool_call_id": "c3", "content": "89 is prime"},
    {"role": "assistant", "content": "89"},
    {"role": "user", "content": "And doubled?"},
]

# The byte template before it learnt tools: text-only chat must render exactly as it did.
OLD_BYTE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_tokenizer(template: str | None = None):
    tok = build_byte_tokenizer()
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.fixture(params=["byte", "qwen2_5"])
def tok(request):
    """The byte tokenizer with its own template, or with Qwen2.5's tool template (same special tokens)."""
    return byte_tokenizer(None if request.param == "byte" else trl_chat_template("qwen2_5"))


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


# -- the byte template ------------------------------------------------------------------------------------------
def test_byte_template_declares_tools_and_writes_tool_calls_compactly():
    text = render_chat(byte_tokenizer(), CONVERSATION[:3], TOOLS)
    assert text == (
        "<|im_start|>system\ntools: calculator(expression), search(query, k)<|im_end|>\n"
        "<|im_start|>user\nWhat is 12*7+5?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
        "<|im_end|>\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    )
    string_args = [{"role": "assistant", "content": "ok", "tool_calls": [
        {"function": {"name": "search", "arguments": '{"query": "x"}'}}]}]  # OpenAI style: arguments as JSON text
    assert render_chat(byte_tokenizer(), string_args, add_generation_prompt=False) == (
        '<|im_start|>assistant\nok<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call><|im_end|>\n')


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "3+4?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Über 日本?"}],
])
def test_byte_template_renders_text_only_chat_as_before(messages):
    for generation_prompt in (True, False):
        assert render_chat(byte_tokenizer(), messages, add_generation_prompt=generation_prompt) == render_chat(
            byte_tokenizer(OLD_BYTE_TEMPLATE), messages, add_generation_prompt=generation_prompt)


# -- the bridge ---------------------------------------------------------------------------------------------------
def test_bridge_of_tool_results_and_a_user_turn_on_the_byte_template():
    tok = byte_tokenizer()
    tool = [{"role": "tool", "name": "calculator", "content": "5"}]
    assert bridge_text(tok, tool, tools=TOOLS) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert bridge_token_ids(tok, tool, tools=TOOLS) == (
        [10, 257, *b"tool\n5", 258, 10, 257, *b"assistant\n"])
    two = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}]
    assert bridge_text(tok, two) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    user = [{"role": "user", "content": "go on"}]
    assert bridge_token_ids(tok, user) == encode(tok, "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")


def test_bridge_on_qwen25_groups_tool_results_in_one_user_turn():
    tok = byte_tokenizer(trl_chat_template("qwen2_5"))
    two = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}]
    assert bridge_text(tok, two, tools=TOOLS) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert bridge_text(tok, [{"role": "user", "content": "go on"}]) == (
        "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")


def _assistant_ids(tok, conversation: list[dict], k: int, so_far: list[int], tools) -> list[int]:
    """What the policy sampled for assistant message k: its rendered ids after the conversation so far, up to
    and including the end-of-turn token."""
    rendered = encode(tok, render_chat(tok, conversation[: k + 1], tools, add_generation_prompt=False))
    assert rendered[: len(so_far)] == so_far
    rest = rendered[len(so_far) :]
    return rest[: rest.index(chat_end_token_id(tok)) + 1]


def test_continuing_turn_by_turn_gives_the_ids_of_a_full_render(tok):
    """Playing the episode turn by turn (first turn from messages + tools, then sampled ids + bridges) gives,
    at every turn, exactly the ids of rendering the whole conversation so far: nothing re-tokenized, nothing
    lost. Every other turn is 'cut by max_new_tokens' (its end token dropped): the bridge puts it back."""
    first = next(i for i, m in enumerate(CONVERSATION) if m["role"] == "assistant")
    ids = chat_token_ids(tok, CONVERSATION[:first], tools=TOOLS)
    k, cut = first, False
    while k < len(CONVERSATION):
        sampled = _assistant_ids(tok, CONVERSATION, k, ids, TOOLS)
        nxt = next((i for i in range(k + 1, len(CONVERSATION)) if CONVERSATION[i]["role"] == "assistant"),
                   len(CONVERSATION))
        so_far = ids + (sampled[:-1] if cut else sampled)
        ids = next_turn_token_ids(tok, so_far, CONVERSATION[k + 1 : nxt], tools=TOOLS)
        assert ids[: len(so_far)] == so_far  # the conversation so far is kept as is
        assert ids == encode(tok, render_chat(tok, CONVERSATION[:nxt], TOOLS))  # = a full render
        k, cut = nxt, not cut


def test_prompt_ids_continue_a_turn_and_keep_the_checks():
    tok = byte_tokenizer()
    so_far = prompt_token_ids(tok, Prompt("e0", "", messages=CONVERSATION[:1], tools=TOOLS)) + list(b"84")
    tool = [{"role": "tool", "content": "84"}]
    turn = Prompt("e0", "", token_ids=so_far, tools=TOOLS, bridge_messages=tool)
    ids = prompt_ids(turn, tok, 259, "gen")
    assert ids == [*so_far, 258, *bridge_token_ids(tok, tool, tools=TOOLS)]  # cut turn: end token added once
    ended = Prompt("e0", "", token_ids=[*so_far, 258], tools=TOOLS, bridge_messages=tool)
    assert prompt_ids(ended, tok, 259, "gen") == ids
    with pytest.raises(ValueError, match="gen: prompt 'e0' has bridge_messages but no token_ids"):
        prompt_ids(Prompt("e0", "", bridge_messages=tool), tok, 259, "gen")
    with pytest.raises(ValueError, match=r"token ids \[300\] outside the model's vocabulary"):
        prompt_ids(Prompt("e0", "", token_ids=[300], bridge_messages=tool), tok, 259, "gen")
    with pytest.raises(PromptTooLongError, match=f"is {len(ids)} tokens; with max_new_tokens=8"):
        prompt_ids(turn, tok, 259, "gen", max_new_tokens=8, context=len(ids) + 7)


# -- what is refused ----------------------------------------------------------------------------------------------
def test_a_template_that_rewrites_earlier_turns_is_refused_by_name():
    tok = byte_tokenizer(trl_chat_template("qwen3"))  # drops the reasoning of turns before the last query
    tok.name_or_path = "org/qwen3-like"
    with pytest.raises(TemplateBridgeError, match=r"model 'org/qwen3-like'.*renders the earlier turns differently"
                                                  r".*prefix-preserving chat template"):
        bridge_token_ids(tok, [{"role": "tool", "content": "5"}])
    tok.chat_template = trl_chat_template("qwen3_training")  # TRL's prefix-preserving variant bridges
    assert bridge_text(tok, [{"role": "tool", "content": "5"}]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("template", "why"), [
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "no single special end-of-turn token"),
    (OLD_BYTE_TEMPLATE.replace("{%- for message in messages %}",
                               "{%- for message in messages if message.role != 'tool' %}"), "leaves out the 'tool'"),
    ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
     "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}", "rendering the messages failed.*no tools"),
])
def test_templates_that_cannot_bridge_say_why(template, why):
    with pytest.raises(TemplateBridgeError, match=why):
        bridge_token_ids(byte_tokenizer(template), [{"role": "tool", "content": "5"}], model="m")


def test_no_template_bad_messages_and_tools_that_are_not_rendered():
    plain = build_tokenizer("abc")
    with pytest.raises(NoChatTemplateError, match="has no chat template"):
        bridge_token_ids(plain, [{"role": "user", "content": "a"}])
    with pytest.raises(ValueError, match="environment message 0 is not a chat message"):
        bridge_token_ids(byte_tokenizer(), [{"content": "no role"}])
    prompt = Prompt("t0", "", messages=CONVERSATION[:1], tools=TOOLS)
    with pytest.raises(TemplateToolsError, match=r"prompt 't0' declares tools.*does not render them"):
        prompt_token_ids(byte_tokenizer(OLD_BYTE_TEMPLATE), prompt)
    with pytest.raises(TemplateToolsError, match="prompt 't1' declares tools but is given as text"):
        prompt_token_ids(byte_tokenizer(), Prompt("t1", "hi", tools=TOOLS))
    with_tools = prompt_token_ids(byte_tokenizer(), prompt)
    assert with_tools == encode(byte_tokenizer(), render_chat(byte_tokenizer(), CONVERSATION[:1], TOOLS))


def test_seeds_need_one_sample_per_prompt_and_one_seed_each():
    prompts = [Prompt("a", "x"), Prompt("b", "y")]
    check_generation_request(GenerationRequest(prompts, samples_per_prompt=1, seeds=[1, 2]))
    with pytest.raises(ValueError, match=r"seeds \(one seed per prompt\) needs samples_per_prompt == 1, got 4"):
        check_generation_request(GenerationRequest(prompts, samples_per_prompt=4, seeds=[1, 2]))
    with pytest.raises(ValueError, match="has 1 seeds for 2 prompts"):
        check_generation_request(GenerationRequest(prompts, samples_per_prompt=1, seeds=[1]))
