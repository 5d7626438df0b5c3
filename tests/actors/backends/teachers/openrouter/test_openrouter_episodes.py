"""The OpenRouter teacher playing episode turns at the message level, against the fake OpenRouter (real HTTP).

An episode turn (a request with per-turn seeds) is sent as the conversation in chat messages with the tools; the
answer comes back as a chat message (content, OpenAI `tool_calls`) and, for training, as the conversation and the
turn rendered by the student's chat template (the tiny byte tokenizer's, which writes tool calls in the Hermes
form), with what the request cost as OpenRouter reported it. A template that ignores tool calls gives no ids."""

from __future__ import annotations

import random
from typing import Any

import pytest
from fake_openrouter import FakeOpenRouter, serving

from composer_mesh.actors.backends.teachers.openrouter import OpenRouterTeacher
from composer_mesh.actors.backends.teachers.openrouter_client import OpenRouterSettings
from composer_mesh.actors.messages import Prompt, TeacherTrace
from composer_mesh.envs.calculator import CALCULATOR
from composer_mesh.models.chat import chat_token_ids
from composer_mesh.models.tokenizer import BYTE_CHAT_TEMPLATE, build_byte_tokenizer

KEY = "sk-or-v1-TEST-episodes-7d1e"
ENV = "COMPOSER_MESH_TEST_OR_EPISODE_KEY"
TOOLS = [CALCULATOR.schema]
OPENING = [{"role": "user", "content": "47*83"}]


@pytest.fixture(scope="module")
def fake() -> Any:
    with serving(KEY) as server:
        yield server


@pytest.fixture(autouse=True)
def _env(fake: FakeOpenRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.reset()
    monkeypatch.setenv(ENV, KEY)


def teacher(fake: FakeOpenRouter, tokenizer: Any) -> OpenRouterTeacher:
    t = OpenRouterTeacher(OpenRouterSettings(base_url=fake.base_url, models=["fake/tools"], api_key_env=ENV),
                          rng=random.Random(0))
    t.start(tokenizer, "hosted")
    return t


async def turn(t: OpenRouterTeacher, messages: list[dict[str, Any]]) -> TeacherTrace:
    [trace] = await t.traces([Prompt("p0", "", messages=messages, tools=TOOLS)], 64, seeds=[5])
    return trace


async def test_an_episode_turn_is_asked_with_tools_and_answered_as_a_message_in_the_students_tokens(
        fake: FakeOpenRouter) -> None:
    tok = build_byte_tokenizer()
    t = teacher(fake, tok)
    first = await turn(t, OPENING)
    assert fake.requests[0]["tools"] == TOOLS and fake.requests[0]["messages"] == OPENING
    [call] = first.message["tool_calls"]  # type: ignore[index]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "47*83"}'}
    assert first.prompt_ids == chat_token_ids(tok, OPENING, tools=TOOLS)  # the student's own opening ids
    assert tok.decode(first.completion_ids) == \
        '<tool_call>{"name": "calculator", "arguments": {"expression": "47*83"}}</tool_call><|im_end|>'
    assert first.usage == {k: float(v) for k, v in fake.responses[0]["usage"].items() if k != "is_byok"}
    assert first.usage["cost"] > 0

    result = {"role": "tool", "name": "calculator", "content": "3901", "tool_call_id": call["id"]}
    second = await turn(t, [*OPENING, first.message, result])  # type: ignore[list-item]
    assert fake.requests[1]["messages"][-1] == result and second.message == {"role": "assistant", "content": "3901"}
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == \
        first.prompt_ids + first.completion_ids  # the conversation's ids go on as a prefix chain
    assert tok.decode(second.completion_ids) == "3901<|im_end|>"
    assert t.usage()["cost"] == pytest.approx(sum(r["usage"]["cost"] for r in fake.responses))


async def test_a_student_template_that_drops_tool_calls_gives_the_turn_no_ids_and_counts_it(
        fake: FakeOpenRouter) -> None:
    tok = build_byte_tokenizer()
    start = BYTE_CHAT_TEMPLATE.index("{%- if message.tool_calls")
    tok.chat_template = BYTE_CHAT_TEMPLATE[:start] + BYTE_CHAT_TEMPLATE[BYTE_CHAT_TEMPLATE.index("{%- endif %}", start) + 12:]
    t = teacher(fake, tok)
    trace = await turn(t, OPENING)
    assert trace.message is not None and trace.message["tool_calls"]  # the teacher played ...
    assert trace.prompt_ids == [] and trace.completion_ids == []  # ... but its turn cannot be written for training
    assert t.usage()["misrendered_turns"] == 1


async def test_a_single_turn_trace_is_asked_without_tools_and_carries_its_cost(fake: FakeOpenRouter) -> None:
    t = teacher(fake, build_byte_tokenizer())
    [trace] = await t.traces([Prompt("p0", "", messages=OPENING, tools=TOOLS)], 64)  # no seeds: not an episode
    assert "tools" not in fake.requests[0] and trace.message is None and trace.prompt_ids == []
    assert trace.usage["cost"] == fake.responses[0]["usage"]["cost"]
