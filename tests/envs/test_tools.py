"""Tool calls (`composer_mesh.envs.tools`): the Hermes/Qwen format read from policy text, schemas from typed
functions by transformers' `get_json_schema`, and every way a call can go wrong answered as a tool message, never
raised; calls of one turn run concurrently. `ToolSession` turns that into episodes."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from composer_mesh.envs.session import EnvSession
from composer_mesh.envs.tool_session import ToolSession
from composer_mesh.envs.tools import (
    Tool,
    Toolbox,
    ToolCall,
    ToolDefinitionError,
    format_tool_call,
    parse_tool_calls,
)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def lookup(words: list[str], mode: str = "first", limit: float | None = None) -> str:
    """Pick a word.

    Args:
        words: candidates.
        mode: which one (choices: ["first", "last"])
        limit: unused.
    """
    return words[0] if mode == "first" else words[-1]


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: ignored.
    """
    raise RuntimeError("disk on fire\nsecond line")


async def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long.
    """
    await asyncio.sleep(seconds)
    return "awake"


def blocking(seconds: float) -> str:
    """Block the thread, then answer.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


# ---- parsing ---------------------------------------------------------------------------------------------
def test_parse_one_call_with_text_around() -> None:
    turn = parse_tool_calls('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                            '</tool_call>\nDone.')
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2})]
    assert turn.errors == []
    assert turn.content == "Let me compute.\n\nDone."
    assert not turn.is_final


def test_parse_several_calls_in_order_and_no_arguments() -> None:
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>  {"name": "lookup",\n "arguments": {"words": ["x"]}}  </tool_call>'
            '<tool_call>{"name": "now"}</tool_call>')
    turn = parse_tool_calls(text)
    assert [c.name for c in turn.calls] == ["add", "lookup", "now"]
    assert turn.calls[1].arguments == {"words": ["x"]}
    assert turn.calls[2].arguments == {}
    assert turn.content == ""


def test_plain_text_is_a_final_answer() -> None:
    turn = parse_tool_calls("  3901\n")
    assert turn.is_final and turn.content == "3901" and turn.calls == []


@pytest.mark.parametrize(("body", "says"), [
    ('{"name": "add", "arguments": {"a": 1}', "not valid JSON"),
    ('["add"]', "expected a JSON object, got list"),
    ('{"arguments": {"a": 1}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),
    ('{"name": "add", "arguments": "a=1"}', '"arguments" must be a JSON object, got str'),
])
def test_malformed_calls_are_errors_not_exceptions(body: str, says: str) -> None:
    turn = parse_tool_calls(f'ok <tool_call>{body}</tool_call><tool_call>{{"name": "add"}}</tool_call>')
    assert len(turn.errors) == 1 and says in turn.errors[0], turn.errors
    assert turn.errors[0].startswith("tool call 1")
    assert "\n" not in turn.errors[0]
    assert turn.calls == [ToolCall("add", {})]  # the well-formed one is still read
    assert turn.content == "ok"
    assert not turn.is_final


def test_unclosed_tag_is_an_error_and_not_content() -> None:
    turn = parse_tool_calls('answer <tool_call>{"name": "add", "arguments": {"a": 1}}')
    assert turn.calls == []
    assert turn.errors == ['tool call 1: <tool_call> without </tool_call>; call a tool as <tool_call>{"name": '
                           '"<tool>", "arguments": {...}}</tool_call>, or answer without a tool call']
    assert turn.content == "answer"


def test_format_tool_call_round_trips() -> None:
    text = format_tool_call("add", {"a": 4, "b": 5})
    assert text == '<tool_call>{"name": "add", "arguments": {"a": 4, "b": 5}}</tool_call>'
    assert parse_tool_calls(text).calls == [ToolCall("add", {"a": 4, "b": 5})]


# ---- schemas ---------------------------------------------------------------------------------------------
def test_schema_of_a_typed_function() -> None:
    schema = Tool(lookup).schema
    assert schema["type"] == "function"
    fn = schema["function"]
    assert (fn["name"], fn["description"]) == ("lookup", "Pick a word.")
    props = fn["parameters"]["properties"]
    assert props["words"] == {"type": "array", "items": {"type": "string"}, "description": "candidates."}
    assert props["mode"]["enum"] == ["first", "last"]
    assert props["limit"]["type"] == "number" and props["limit"]["nullable"] is True
    assert fn["parameters"]["required"] == ["words"]
    assert Tool(add, name="plus").schema["function"]["name"] == "plus"


def test_a_function_without_documented_args_is_refused_at_definition() -> None:
    def undocumented(x: int) -> int:
        """No Args section."""
        return x

    with pytest.raises(ToolDefinitionError, match=r"tool 'undocumented'.*argument 'x'"):
        Tool(undocumented)
    with pytest.raises(ToolDefinitionError, match="two tools are named 'add'"):
        Toolbox([add, Tool(lookup, name="add")])


# ---- calls -----------------------------------------------------------------------------------------------
def call(box: Toolbox, name: str, timeout_s: float | None = None, **arguments: object) -> dict:
    return asyncio.run(box.call(ToolCall(name, dict(arguments)), timeout_s))


def test_a_good_call_answers_with_the_result() -> None:
    box = Toolbox([add, lookup])
    assert call(box, "add", a=2, b=3) == {"role": "tool", "name": "add", "content": "5"}
    assert call(box, "lookup", words=["x", "y"], mode="last")["content"] == "y"
    assert call(box, "lookup", words=["x"], limit=None)["content"] == "x"  # nullable
    assert (box.calls, box.errors) == (3, 0)


@pytest.mark.parametrize(("name", "arguments", "says"), [
    ("sub", {"a": 1}, "error: sub: no such tool; the tools are add, lookup, broken"),
    ("add", {}, "error: add: missing argument(s) a"),
    ("add", {"a": 1, "c": 2}, "error: add: unknown argument(s) c; it takes a, b"),
    ("add", {"a": "1"}, 'error: add: argument a must be integer, got str "1"'),
    ("add", {"a": True}, "error: add: argument a must be integer, got bool true"),
    ("lookup", {"words": ["x", 3]}, "error: lookup: argument words[1] must be string, got int 3"),
    ("lookup", {"words": ["x"], "mode": "middle"}, "error: lookup: argument mode must be one of ['first', 'last']"),
    ("broken", {"x": 1}, "error: broken: RuntimeError: disk on fire second line"),
])
def test_every_bad_call_is_a_one_line_observation(name: str, arguments: dict, says: str) -> None:
    box = Toolbox([add, lookup, broken])
    answer = asyncio.run(box.call(ToolCall(name, arguments)))
    assert answer["role"] == "tool" and answer["name"] == name
    assert answer["content"].startswith(says), answer["content"]
    assert "\n" not in answer["content"]
    assert (box.calls, box.errors) == (1, 1)


def test_timeouts_of_async_and_sync_tools_are_observations() -> None:
    box = Toolbox([slow, blocking, Tool(slow, name="patient", timeout_s=5.0)], timeout_s=0.2)
    assert call(box, "slow", seconds=2.0) == {"role": "tool", "name": "slow",
                                              "content": "error: slow: timed out after 0.2 s"}
    assert call(box, "blocking", timeout_s=0.1, seconds=0.5)["content"] == "error: blocking: timed out after 0.1 s"
    assert call(box, "patient", seconds=0.3)["content"] == "awake"  # the tool's own limit beats the toolbox's
    assert (box.calls, box.errors) == (3, 2)


def test_calls_run_concurrently_and_sync_tools_off_the_event_loop() -> None:
    """Each call waits until all eight are in flight: calls run one after another would each answer "alone"
    (no timing: a loaded machine only makes them meet later)."""
    threads: set[int] = set()
    lock, arrived, everyone = threading.Lock(), [0], threading.Event()

    def arrive() -> None:
        with lock:
            arrived[0] += 1
            if arrived[0] == 8:
                everyone.set()

    def wait(seconds: float) -> str:
        """Wait in a thread until every call is in flight.

        Args:
            seconds: at most how long.
        """
        threads.add(threading.get_ident())
        arrive()
        return "done" if everyone.wait(seconds) else "alone"

    async def meet(seconds: float) -> str:
        """Wait on the event loop until every call is in flight.

        Args:
            seconds: at most how long.
        """
        arrive()
        deadline = time.monotonic() + seconds
        while not everyone.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return "awake" if everyone.is_set() else "alone"

    box = Toolbox([wait, meet])
    calls = [ToolCall("wait", {"seconds": 10.0})] * 4 + [ToolCall("meet", {"seconds": 10.0})] * 4
    answers = asyncio.run(box.call_all(calls))
    assert [a["content"] for a in answers] == ["done"] * 4 + ["awake"] * 4, "the calls did not run concurrently"
    assert threading.main_thread().ident not in threads and len(threads) == 4


# ---- ToolSession ----------------------------------------------------------------------------------------
class SumSession(ToolSession):
    """Answer 2+3 with the `add` tool."""

    def grade(self, answer: str) -> float:
        return 1.0 if answer == "5" else 0.0


def play(session: ToolSession, turns: list[str]) -> list:
    async def run() -> list:
        out: list = [await session.reset()]
        for turn in turns:
            out.append(await session.step(turn))
        await session.close()
        return out

    return asyncio.run(run())


def test_tool_session_runs_calls_then_grades_the_answer() -> None:
    session = SumSession([{"role": "user", "content": "2+3"}], Toolbox([add]))
    protocol: EnvSession = session  # what the rollout driver holds (checked by mypy)
    assert protocol is session
    obs, called, answered = play(session, [format_tool_call("add", {"a": 2, "b": 3}), "5"])
    assert obs.messages == [{"role": "user", "content": "2+3"}]
    assert [t["function"]["name"] for t in obs.tools] == ["add"]
    assert called.messages == [{"role": "tool", "name": "add", "content": "5"}]
    assert (called.done, called.reward) == (False, None)
    assert called.info == {"tool_calls": 1.0, "tool_errors": 0.0, "parse_errors": 0.0}
    assert (answered.done, answered.status, answered.reward, answered.messages) == (True, "done", 1.0, [])
    assert session.closed
    with pytest.raises(RuntimeError, match="after the episode ended"):
        asyncio.run(session.step("5"))


def test_malformed_call_tells_the_format_and_the_episode_goes_on() -> None:
    session = SumSession([{"role": "user", "content": "2+3"}], Toolbox([add]), max_calls_per_turn=2)
    good = format_tool_call("add", {"a": 2, "b": 3})
    _, bad, mixed, many, answered = play(session, [
        '<tool_call>{"name": add}</tool_call>',
        good + "<tool_call>{oops</tool_call>",
        good * 3,
        "4",
    ])
    assert not bad.done and bad.info["parse_errors"] == 1.0
    assert bad.messages[0]["role"] == "user" and bad.messages[0]["content"].startswith("error: tool call 1: not valid")
    assert '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>' in bad.messages[0]["content"]
    assert [m["role"] for m in mixed.messages] == ["tool", "user"]  # the good call ran, the bad one is explained
    assert mixed.info == {"tool_calls": 1.0, "tool_errors": 0.0, "parse_errors": 1.0}
    assert [m["content"] for m in many.messages] == ["5", "5", "error: add: not run: more than 2 tool calls in one turn"]
    assert many.info == {"tool_calls": 3.0, "tool_errors": 1.0, "parse_errors": 0.0}
    assert (answered.done, answered.reward) == (True, 0.0)
