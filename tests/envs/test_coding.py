"""The coding task family end to end in real bubblewrap: a scripted policy that writes the fix solves every
shipped task (reward 1.0) through `CodingSession`; doing nothing does not; bad tool calls are observations."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from composer_mesh.envs.coding.calls import ToolCall, parse_tool_calls
from composer_mesh.envs.coding.catalog import EVAL_IDS, TASKS, split_ids
from composer_mesh.envs.coding.config import CodingConfig
from composer_mesh.envs.coding.session import CodingEnvironment, CodingSession, UnknownCodingTask
from tests.sandbox.conftest import bwrap_config


@dataclass
class Row:
    """A prompt row as the run's prompt source gives it (the fields `EpisodePrompt` names)."""

    prompt_id: str
    text: str = ""
    answer: str | None = None
    messages: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture
def env() -> CodingEnvironment:
    return CodingEnvironment(CodingConfig(kind="coding", sandbox=bwrap_config(wall_s=5.0), max_turns=4))


@pytest.fixture
async def fizz(env: CodingEnvironment) -> AsyncIterator[CodingSession]:
    session = env.session(Row("coding/fizzbuzz", extra={"task_id": "fizzbuzz"}), seed=0)
    await session.reset()
    yield session
    await session.close()


def test_eval_tasks_are_held_out() -> None:
    train, held_out = set(split_ids("train")), set(split_ids("eval"))
    assert not train & held_out and train | held_out == set(TASKS) and held_out == set(EVAL_IDS)
    env = CodingEnvironment(CodingConfig(kind="coding"))
    assert {r["prompt_id"] for r in env.prompts("train")}.isdisjoint(r["prompt_id"] for r in env.prompts("eval"))
    with pytest.raises(ValueError, match="unknown coding split"):
        split_ids("test")


async def test_reset_shows_the_task_and_the_tools(env: CodingEnvironment) -> None:
    session = env.session(Row("coding/flatten"), seed=0)
    try:
        obs = await session.reset()
    finally:
        await session.close()
    assert obs.messages[0]["role"] == "user" and TASKS["flatten"].statement in obs.messages[0]["content"]
    schemas = {t["function"]["name"]: t["function"] for t in obs.tools}
    assert list(schemas) == ["read_file", "write_file", "run_tests", "run_python", "submit"]
    assert schemas["write_file"]["parameters"]["required"] == ["path", "content"]
    assert "hidden" not in session.tools.box.read("solution.py") and session.grade is None


@pytest.mark.parametrize("task_id", sorted(TASKS))
async def test_scripted_policy_solves_every_task(env: CodingEnvironment, task_id: str) -> None:
    session = env.session(Row(f"coding/{task_id}", extra={"task_id": task_id}), seed=0)
    await session.reset()
    try:
        wrote = await session.step(call("write_file", path="solution.py", content=TASKS[task_id].reference))
        tested = await session.step(call("run_tests"))
        end = await session.step(call("submit"))
    finally:
        await session.close()
    assert wrote.messages[0]["content"].startswith("wrote ") and not wrote.done
    assert tested.messages[0]["content"].startswith("1 of 1 visible tests passed (exit code 0)")
    assert end.done and end.status == "done" and end.reward == 1.0
    assert end.info["tests_passed"] == end.info["tests_total"] == len(TASKS[task_id].hidden_test_names())


@pytest.mark.parametrize("task_id", sorted(TASKS))
async def test_doing_nothing_scores_below_one(env: CodingEnvironment, task_id: str) -> None:
    session = env.session(Row(f"coding/{task_id}"), seed=0)
    await session.reset()
    try:
        end = await session.step("I am done.")  # a final message without a tool call ends the episode
    finally:
        await session.close()
    assert end.done and end.status == "done" and end.reward is not None and end.reward < 1.0


async def test_bad_calls_are_observations_and_the_episode_goes_on(fizz: CodingSession) -> None:
    turn = await fizz.step(call("rm_rf") + "<tool_call>{not json}</tool_call>"
                           + call("read_file", path="/etc/passwd") + call("read_file", file="x")
                           + call("write_file", path="../escape.py", content="x") + "<tool_call>{\"name\": 1")
    answers = [m["content"] for m in turn.messages]
    assert not turn.done and turn.info == {"tool_calls": 6.0, "tool_errors": 6.0}
    assert answers[0].startswith("error: unknown tool 'rm_rf'; the tools are read_file")
    assert answers[1].startswith("error: tool call 2 is not valid JSON")
    assert answers[2].startswith("error: cannot read '/etc/passwd'")
    assert answers[3] == "error: read_file: missing a required argument: 'path'"
    assert answers[4].startswith("error: '../escape.py' not written")
    assert answers[5] == "error: tool call 6 has no closing </tool_call>"
    assert (await fizz.step(call("submit"))).reward == 0.5  # fizz and buzz pass; fizzbuzz and number do not


async def test_hidden_tests_are_not_in_the_work_dir(fizz: CodingSession) -> None:
    turn = await fizz.step(call("read_file", path="test_hidden.py") + call("run_python",
                           code="import os; print(sorted(os.listdir('.')))"))
    assert turn.messages[0]["content"].startswith("error: cannot read 'test_hidden.py'")
    assert "['solution.py', 'test_visible.py']" in turn.messages[1]["content"]


async def test_a_solution_cannot_forge_the_graders_report(fizz: CodingSession) -> None:
    names = TASKS["fizzbuzz"].hidden_test_names()
    forged = "".join(f"print('\\nTEST PASS {n}')\n" for n in names) + TASKS["fizzbuzz"].starter
    await fizz.step(call("write_file", path="solution.py", content=forged))
    assert (await fizz.step(call("submit"))).reward == 0.5


async def test_grading_copies_only_files_dirs_and_links(fizz: CodingSession) -> None:
    fixed = call("write_file", path="solution.py", content=TASKS["fizzbuzz"].reference)
    await fizz.step(call("run_python", code="import os; os.mkfifo('pipe'); os.symlink('/etc', 'etc')") + fixed)
    assert (await fizz.step(call("submit"))).reward == 1.0  # a FIFO in the work dir does not block the grader


async def test_last_turn_is_graded_as_truncated(fizz: CodingSession) -> None:
    fixed = call("write_file", path="solution.py", content=TASKS["fizzbuzz"].reference)
    results = [await fizz.step(call("run_tests")) for _ in range(3)] + [await fizz.step(fixed)]
    assert [r.done for r in results] == [False, False, False, True]
    assert results[-1].status == "truncated_turns" and results[-1].reward == 1.0


def test_unknown_task_is_a_one_line_error(env: CodingEnvironment) -> None:
    with pytest.raises(UnknownCodingTask, match=r"prompt 'coding/nope': unknown coding task 'nope'; shipped: "):
        env.session(Row("coding/nope"), seed=0)


def test_parser_reads_hermes_calls() -> None:
    calls, any_call = parse_tool_calls('think <tool_call>{"name": "run_tests"}</tool_call> and '
                                       '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"a\\"}"}'
                                       "</tool_call>")
    assert any_call and calls == [ToolCall("run_tests"), ToolCall("read_file", {"path": "a"})]
    assert parse_tool_calls("no calls here") == ([], False)
    assert parse_tool_calls('<tool_call>["x"]</tool_call>')[0][0].startswith("error: tool call 1 must be")
    assert "'arguments' must be a JSON object" in parse_tool_calls(
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call>')[0][0]
