"""A hosted teacher's turn as the environment parses it, and the environment's answers as the teacher's API pairs
them: calls become Hermes text that `envs.tools.parse_tool_calls` reads back; a call whose arguments are not a
JSON object reaches the environment as the malformed call it is, and no tool result is paired with it."""

from __future__ import annotations

from composer_mesh.envs.tools import parse_tool_calls
from composer_mesh.orchestration.rollout.message_turns import action_text, answered_calls, with_call_ids


def call(ident: str, arguments: str) -> dict[str, object]:
    return {"id": ident, "type": "function", "function": {"name": "calculator", "arguments": arguments}}


def test_a_turns_calls_are_the_hermes_text_the_environment_parses_and_its_content_stays_outside() -> None:
    message = {"role": "assistant", "content": "let me check",
               "tool_calls": [call("a", '{"expression": "2*3"}'), call("b", '{"expression": "4*5"}')]}
    turn = parse_tool_calls(action_text(message))
    assert turn.content == "let me check" and turn.errors == []
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "2*3"}),
                                                           ("calculator", {"expression": "4*5"})]
    assert action_text({"role": "assistant", "content": "6"}) == "6"  # no call: the answer


def test_a_call_with_malformed_arguments_is_malformed_for_the_environment_and_answered_by_no_tool_result() -> None:
    message = {"role": "assistant", "content": None,
               "tool_calls": [call("bad", '{"expression": '), call("good", '{"expression": "1+1"}')]}
    turn = parse_tool_calls(action_text(message))
    assert [c.arguments for c in turn.calls] == [{"expression": "1+1"}] and "not valid JSON" in turn.errors[0]
    assert answered_calls(message) == ["good"]
    results = [{"role": "tool", "name": "calculator", "content": "2"},
               {"role": "user", "content": "error: tool call 1: not valid JSON"}]
    assert with_call_ids(results, ["good"]) == [{**results[0], "tool_call_id": "good"}, results[1]]
