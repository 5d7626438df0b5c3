"""A coding episode: the task's statement and tools (`read_file`, `write_file`, `run_tests`, `run_python`,
`submit`) over a private sandbox work dir; the episode ends on `submit` or a turn without tool calls, graded by
the task's hidden tests in a separate sandbox run (they are never in the episode's work dir).

Why grading copies the work dir to a fresh one: the hidden tests must not be readable by the policy during the
episode, and a fresh directory holds nothing the episode left running or half-written beyond its files.
"""

from __future__ import annotations

import asyncio
import secrets
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_mesh.envs.coding.catalog import CodingTask
from composer_mesh.envs.coding.config import CodingConfig
from composer_mesh.envs.session import Message, Observation, StepResult
from composer_mesh.envs.tool_session import format_error_message
from composer_mesh.envs.tools import Tool, Toolbox, ToolCall, parse_tool_calls
from composer_mesh.sandbox.pool import SandboxBox, SandboxPool, copy_work_dir
from composer_mesh.sandbox.run import SandboxResult
from composer_mesh.tasks.episode import EpisodeStatus

RUNNER = Path(__file__).with_name("runner.py").read_text()  # sent to the sandbox's python with -c
VISIBLE, HIDDEN = "test_visible", "test_hidden"


@dataclass
class Grade:
    """The hidden tests' verdict: `passed` of `total`, and the runner's lines (for logs)."""

    passed: int
    total: int
    report: str

    @property
    def reward(self) -> float:
        return self.passed / self.total if self.total else 0.0


def count_passed(result: SandboxResult, tag: str, names: list[str]) -> int:
    """Tests of `names` the runner reported passing under `tag` (a run cut short counts what it reported)."""
    passed = {line.split()[2] for line in result.stdout.splitlines() if line.startswith(f"{tag} PASS ")}
    return len(passed & set(names))


async def grade(pool: SandboxPool, task: CodingTask, workdir: Path) -> Grade:
    """Run `task`'s hidden tests against a copy of `workdir` in a fresh sandbox session."""
    async with pool.session() as judge:
        await asyncio.to_thread(copy_work_dir, workdir, judge.workdir)
        judge.write(f"{HIDDEN}.py", task.hidden_tests)
        tag = secrets.token_hex(16)
        result = await judge.run([judge.python, "-I", "-S", "-c", RUNNER, HIDDEN], stdin=tag + "\n")
    names = task.hidden_test_names()
    return Grade(count_passed(result, tag, names), len(names), result.summary())


class CodingTools:
    """The tools a coding episode offers, as plain async methods whose type hints and docstrings are their JSON
    schemas (transformers' `get_json_schema`), run through a `Toolbox`: an unknown tool or bad arguments is its
    `error: <tool>: ...` answer, and the sandbox's own failures (a bad path, a killed command) are answered as
    text too. No per-call timeout here: the sandbox's `wall_s` kills a command that runs too long."""

    NAMES = ("read_file", "write_file", "run_tests", "run_python", "submit")

    def __init__(self, box: SandboxBox) -> None:
        self.box = box
        self.toolbox = Toolbox([Tool(getattr(self, name)) for name in self.NAMES], timeout_s=None)

    async def read_file(self, path: str) -> str:
        """Read a text file of the work dir.

        Args:
            path: The file's path relative to the work dir, e.g. "solution.py".
        """
        return self.box.read(path)

    async def write_file(self, path: str, content: str) -> str:
        """Write a text file in the work dir, replacing the file if it exists.

        Args:
            path: The file's path relative to the work dir, e.g. "solution.py".
            content: The file's whole new text.
        """
        return self.box.write(path, content)

    async def run_tests(self) -> str:
        """Run the visible tests (test_visible.py) against solution.py and report each test's result."""
        result = await self.box.run([self.box.python, "-I", "-S", "-c", RUNNER, VISIBLE], stdin="TEST\n")
        lines = [line for line in result.stdout.splitlines() if line.startswith("TEST ")]
        passed = sum(line.startswith("TEST PASS ") for line in lines)
        body = "\n".join(line.removeprefix("TEST ") for line in lines)
        answer = f"{passed} of {len(lines)} visible tests passed ({result.summary()})\n{body}".rstrip()
        return killed_is_error(result, answer)

    async def run_python(self, code: str) -> str:
        """Run Python code in the work dir (it can import solution.py) and show its output.

        Args:
            code: The Python source to run.
        """
        result = await self.box.run_python(code)
        return killed_is_error(result, result.observation())

    async def submit(self) -> str:
        """Finish: solution.py is graded by the hidden tests and the episode ends."""
        return "submitted"

    def schemas(self) -> list[dict[str, Any]]:
        return self.toolbox.schemas

    async def call(self, call: ToolCall) -> Message:
        """Run one parsed call: its tool message (an error line for an unknown tool or bad arguments)."""
        return await self.toolbox.call(call)


def killed_is_error(result: SandboxResult, answer: str) -> str:
    """`answer`, as an `error: ` answer (a tool error in the turn's `info`) when the command was killed: by a limit,
    the wall time or a signal from outside. Why: a command that did not finish is the sandbox failing it, not the
    code's own answer (docs/sandbox.md); the output it printed before stays in the answer."""
    return f"error: {answer}" if result.signal is not None or result.timed_out else answer


def opening(task: CodingTask) -> str:
    """The user message that opens an episode: the task and how to work on it."""
    return (f"{task.statement}\n\nThe work dir holds solution.py and test_visible.py (a few of the tests). "
            "Use the tools to read, edit and test the code; call submit when solution.py is done (hidden tests "
            "grade it; the reward is the fraction they pass).")


class CodingSession:
    """One coding episode (`envs.session.EnvSession`): a private sandbox work dir seeded with the task's
    `solution.py` and visible tests; each policy turn's Hermes tool calls (`envs.tools.parse_tool_calls`) run in
    order, one after the other (a `write_file` then `run_tests` must see the write), their answers are `tool`
    messages; malformed calls are answered by one user message, as in `ToolSession`. `submit` (or a turn without
    a tool call, or the last allowed turn) ends it, graded."""

    def __init__(self, task: CodingTask, pool: SandboxPool, config: CodingConfig) -> None:
        self.task, self.pool, self.config = task, pool, config
        self.turns, self._stack, self.tools = 0, AsyncExitStack(), None
        self.grade: Grade | None = None

    async def reset(self) -> Observation:
        box = await self._stack.enter_async_context(self.pool.session())
        self.tools = CodingTools(box)
        box.write("solution.py", self.task.starter)
        box.write(f"{VISIBLE}.py", self.task.visible_tests)
        return Observation([{"role": "user", "content": opening(self.task)}], self.tools.schemas())

    async def step(self, action: str) -> StepResult:
        if self.tools is None:
            raise RuntimeError("CodingSession.step before reset")
        self.turns += 1
        turn = parse_tool_calls(action)
        info = {"tool_calls": 0.0, "tool_errors": 0.0, "parse_errors": float(len(turn.errors))}
        if turn.is_final:
            return await self._finish("done", info)
        messages: list[Message] = []
        for i, call in enumerate(turn.calls):
            if call.name == "submit":
                return await self._finish("done", info)
            answer = await self._answer(call, i)
            info["tool_calls"] += 1
            info["tool_errors"] += str(answer["content"]).startswith("error: ")
            messages.append(answer)
        if turn.errors:
            messages.append(format_error_message(turn.errors))
        if self.turns >= self.config.max_turns:
            return await self._finish("truncated_turns", info)
        return StepResult(messages=messages, info=info)

    async def _answer(self, call: ToolCall, index: int) -> Message:
        assert self.tools is not None
        if index >= self.config.max_calls_per_turn:
            return self.tools.toolbox.error(call.name, f"not run: more than {self.config.max_calls_per_turn} tool "
                                            "calls in one turn")
        return await self.tools.call(call)

    async def _finish(self, status: EpisodeStatus, info: dict[str, float]) -> StepResult:
        assert self.tools is not None
        self.grade = await grade(self.pool, self.task, self.tools.box.workdir)
        info = info | {"tests_passed": float(self.grade.passed), "tests_total": float(self.grade.total)}
        return StepResult(reward=self.grade.reward, done=True, status=status, info=info)

    async def close(self) -> None:
        await self._stack.aclose()
