"""A coding episode: the task's statement and tools (`read_file`, `write_file`, `run_tests`, `run_python`,
`submit`) over a private sandbox work dir; the episode ends on `submit` or a turn without tool calls, graded by
the task's hidden tests in a separate sandbox run (they are never in the episode's work dir).

Why grading copies the work dir to a fresh one: the hidden tests must not be readable by the policy during the
episode, and a fresh directory holds nothing the episode left running or half-written beyond its files.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_mesh.envs.coding.calls import ToolCall, parse_tool_calls
from composer_mesh.envs.coding.catalog import TASKS, CodingTask, split_ids
from composer_mesh.envs.coding.config import CodingConfig
from composer_mesh.envs.session import EpisodePrompt, Message, Observation, StepResult
from composer_mesh.errors import UserInputError
from composer_mesh.sandbox.pool import SandboxBox, SandboxPool, copy_work_dir
from composer_mesh.sandbox.run import SandboxResult, check_available
from composer_mesh.tasks.episode import EpisodeStatus

RUNNER = Path(__file__).with_name("runner.py").read_text()  # sent to the sandbox's python with -c
VISIBLE, HIDDEN = "test_visible", "test_hidden"


class UnknownCodingTask(UserInputError):
    """A prompt row names a coding task that is not shipped."""


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
    schemas (transformers' `get_json_schema`). Every answer is text for the policy, never an exception."""

    NAMES = ("read_file", "write_file", "run_tests", "run_python", "submit")

    def __init__(self, box: SandboxBox) -> None:
        self.box = box

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
        return f"{passed} of {len(lines)} visible tests passed ({result.summary()})\n{body}".rstrip()

    async def run_python(self, code: str) -> str:
        """Run Python code in the work dir (it can import solution.py) and show its output.

        Args:
            code: The Python source to run.
        """
        return (await self.box.run_python(code)).observation()

    async def submit(self) -> str:
        """Finish: solution.py is graded by the hidden tests and the episode ends."""
        return "submitted"

    def schemas(self) -> list[dict[str, Any]]:
        from transformers.utils import get_json_schema

        return [get_json_schema(getattr(self, name)) for name in self.NAMES]

    async def call(self, call: ToolCall) -> str:
        """Run one parsed call; an unknown tool or bad arguments is an error line."""
        if call.name not in self.NAMES:
            return f"error: unknown tool {call.name!r}; the tools are {', '.join(self.NAMES)}"
        method = getattr(self, call.name)
        try:
            inspect.signature(method).bind(**call.arguments)
        except TypeError as e:
            return f"error: {call.name}: {e}"
        bad = [k for k, v in call.arguments.items() if not isinstance(v, str)]
        if bad:
            return f"error: {call.name}: argument {bad[0]!r} must be a string"
        return await method(**call.arguments)


def opening(task: CodingTask) -> str:
    """The user message that opens an episode: the task and how to work on it."""
    return (f"{task.statement}\n\nThe work dir holds solution.py and test_visible.py (a few of the tests). "
            "Use the tools to read, edit and test the code; call submit when solution.py is done (hidden tests "
            "grade it; the reward is the fraction they pass).")


class CodingSession:
    """One coding episode (`envs.session.EnvSession`): a private sandbox work dir seeded with the task's
    `solution.py` and visible tests; each policy turn's Hermes tool calls run in order, their answers are
    `tool` messages; `submit` (or a turn without a tool call, or the last allowed turn) ends it, graded."""

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
        calls, any_call = parse_tool_calls(action)
        if not any_call:
            return await self._finish("done", {})
        messages: list[Message] = []
        info = {"tool_calls": 0.0, "tool_errors": 0.0}
        for i, call in enumerate(calls):
            if isinstance(call, ToolCall) and call.name == "submit":
                return await self._finish("done", info)
            answer = await self._answer(call, i)
            info["tool_calls"] += 1
            info["tool_errors"] += answer.startswith("error: ")
            messages.append({"role": "tool", "content": answer}
                            | ({"name": call.name} if isinstance(call, ToolCall) else {}))
        if self.turns >= self.config.max_turns:
            return await self._finish("truncated_turns", info)
        return StepResult(messages=messages, info=info)

    async def _answer(self, call: ToolCall | str, index: int) -> str:
        if isinstance(call, str):
            return call
        if index >= self.config.max_calls_per_turn:
            return f"error: more than {self.config.max_calls_per_turn} tool calls in one turn; this one was not run"
        assert self.tools is not None
        return await self.tools.call(call)

    async def _finish(self, status: EpisodeStatus, info: dict[str, float]) -> StepResult:
        assert self.tools is not None
        self.grade = await grade(self.pool, self.task, self.tools.box.workdir)
        info = info | {"tests_passed": float(self.grade.passed), "tests_total": float(self.grade.total)}
        return StepResult(reward=self.grade.reward, done=True, status=status, info=info)

    async def close(self) -> None:
        await self._stack.aclose()


class CodingEnvironment:
    """The coding tasks as an `envs.session.EpisodeEnvironment`: rows for the prompt source (`prompts`) and one
    `CodingSession` per episode, all sharing one sandbox pool (its concurrency bounds the commands running)."""

    name = "coding"

    def __init__(self, config: CodingConfig) -> None:
        self.config = config
        self.pool = SandboxPool(config.sandbox)

    def check(self) -> None:
        """Refuse early (`SandboxUnavailable`) when the configured sandbox cannot run here."""
        check_available(self.config.sandbox)

    def prompts(self, split: str) -> list[dict[str, Any]]:
        """The rows of `split` ('train' or 'eval', disjoint): prompt_id, the opening text, extra.task_id."""
        return [{"prompt_id": f"coding/{t}", "text": opening(TASKS[t]), "extra": {"task_id": t}}
                for t in split_ids(split)]

    def session(self, prompt: EpisodePrompt, seed: int) -> CodingSession:
        """A new episode of the prompt's task (the tasks draw nothing: `seed` changes nothing)."""
        task_id = prompt.extra.get("task_id", prompt.prompt_id.removeprefix("coding/"))
        if task_id not in TASKS:
            raise UnknownCodingTask(f"prompt {prompt.prompt_id!r}: unknown coding task {task_id!r}; shipped: "
                                    f"{', '.join(TASKS)}")
        return CodingSession(TASKS[task_id], self.pool, self.config)
