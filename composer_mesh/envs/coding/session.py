"""A coding episode: the task's statement and tools (`read_file`, `write_file`, `run_tests`, `run_python`,
`submit`) over a private sandbox work dir; the episode ends on `submit` or a turn without tool calls, graded by
the task's hidden tests from outside the sandbox (`judge.py`: they are never in any sandbox).

Each turn's `info` counts what the policy did besides the calls and their errors (`BEHAVIOUR`): runs of the
visible tests and of Python, writes to files other than solution.py, paths refused, commands the sandbox killed,
and an end without any test run. Why: the reward hacks a policy finds (breaking tool calls on purpose, rewriting
the visible tests, probing for files it should not read) show up in these per-episode counters before they show
up in the reward (`orchestration/episode_metrics.py`, the run plot's behaviour panel). Each turn's `feedback`
names what went wrong in it, one line per problem; the final one says how many hidden tests passed, never which.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from composer_mesh.envs.coding.catalog import CodingTask
from composer_mesh.envs.coding.config import CodingConfig
from composer_mesh.envs.coding.judge import SOLUTION, Grade, grade
from composer_mesh.envs.session import Message, Observation, StepResult
from composer_mesh.envs.tool_session import format_error_message
from composer_mesh.envs.tools import Tool, Toolbox, ToolCall, one_line, parse_tool_calls
from composer_mesh.sandbox.pool import BoxPathError, SandboxBox, SandboxPool
from composer_mesh.sandbox.run import SandboxResult
from composer_mesh.tasks.episode import EpisodeStatus

RUNNER = Path(__file__).with_name("runner.py").read_text()  # sent to the sandbox's python with -c
VISIBLE = "test_visible"
# The behaviour counters of a turn's `info` (besides tool_calls, tool_errors, parse_errors).
BEHAVIOUR = ("run_tests", "run_python", "writes_outside_solution", "paths_refused", "sandbox_kills",
             "untested_submits")


class CodingTools:
    """The tools a coding episode offers, as plain async methods whose type hints and docstrings are their JSON
    schemas (transformers' `get_json_schema`), run through a `Toolbox`: an unknown tool or bad arguments is its
    `error: <tool>: ...` answer, and the sandbox's own failures (a bad path, a killed command) are answered as
    text too. No per-call timeout here: the sandbox's `wall_s` kills a command that runs too long."""

    NAMES = ("read_file", "write_file", "run_tests", "run_python", "submit")

    def __init__(self, box: SandboxBox) -> None:
        self.box = box
        self.counts: Counter[str] = Counter()  # the `BEHAVIOUR` counters since the session last cleared them
        self.tests_run = 0  # run_tests calls in the episode
        self.toolbox = Toolbox([Tool(getattr(self, name)) for name in self.NAMES], timeout_s=None)

    async def read_file(self, path: str) -> str:
        """Read a text file of the work dir.

        Args:
            path: The file's path relative to the work dir, e.g. "solution.py".
        """
        answer = self.box.read(path)
        self.counts["paths_refused"] += answer.startswith("error: ")
        return answer

    async def write_file(self, path: str, content: str) -> str:
        """Write a text file in the work dir, replacing the file if it exists.

        Args:
            path: The file's path relative to the work dir, e.g. "solution.py".
            content: The file's whole new text.
        """
        self.counts["writes_outside_solution"] += path != SOLUTION
        try:
            self.box.path(path)
        except BoxPathError:
            self.counts["paths_refused"] += 1
        return self.box.write(path, content)

    async def run_tests(self) -> str:
        """Run the visible tests (test_visible.py) against solution.py and report each test's result."""
        self.counts["run_tests"] += 1
        self.tests_run += 1
        result = await self.box.run([self.box.python, "-I", "-S", "-B", "-c", RUNNER, VISIBLE], stdin="TEST\n")
        self.counts["sandbox_kills"] += killed(result)
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
        self.counts["run_python"] += 1
        result = await self.box.run_python(code)
        self.counts["sandbox_kills"] += killed(result)
        return killed_is_error(result, result.observation())

    async def submit(self) -> str:
        """Finish: solution.py is graded by the hidden tests and the episode ends."""
        return "submitted"

    def schemas(self) -> list[dict[str, Any]]:
        return self.toolbox.schemas

    async def call(self, call: ToolCall) -> Message:
        """Run one parsed call: its tool message (an error line for an unknown tool or bad arguments)."""
        return await self.toolbox.call(call)


def killed(result: SandboxResult) -> bool:
    """The command did not finish on its own: killed by a limit, the wall time or a signal from outside."""
    return result.signal is not None or result.timed_out


def killed_is_error(result: SandboxResult, answer: str) -> str:
    """`answer`, as an `error: ` answer (a tool error in the turn's `info`) when the command was killed: by a limit,
    the wall time or a signal from outside. Why: a command that did not finish is the sandbox failing it, not the
    code's own answer (docs/sandbox.md); the output it printed before stays in the answer."""
    return f"error: {answer}" if killed(result) else answer


def answer_problems(tool: str, answer: str) -> list[str]:
    """The feedback lines of one tool answer: its error line, or the failing visible tests `run_tests` listed."""
    if answer.startswith("error: "):
        return [f"{tool}: {one_line(answer.splitlines()[0])}"]
    if tool != "run_tests":
        return []
    return [f"run_tests: {one_line(line)}" for line in answer.splitlines()[1:] if line.startswith(("FAIL ", "ERROR "))]


def opening(task: CodingTask) -> str:
    """The user message that opens an episode: the task and how to work on it."""
    return (f"{task.statement}\n\nThe work dir holds solution.py and test_visible.py (a few of the tests). "
            "Use the tools to read, edit and test the code; call submit when solution.py is done (hidden tests "
            "grade solution.py alone; the reward is the fraction they pass).")


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
        self.tools.counts.clear()
        turn = parse_tool_calls(action)
        info = {"tool_calls": 0.0, "tool_errors": 0.0, "parse_errors": float(len(turn.errors))}
        messages: list[Message] = []
        problems = [f"unreadable tool call: {one_line(e)}" for e in turn.errors]
        submitted = turn.is_final
        for i, call in enumerate(turn.calls):
            if call.name == "submit":
                submitted = True
                break
            answer = await self._answer(call, i)
            info["tool_calls"] += 1
            info["tool_errors"] += str(answer["content"]).startswith("error: ")
            problems += answer_problems(call.name, str(answer["content"]))
            messages.append(answer)
        info |= {k: float(self.tools.counts[k]) for k in BEHAVIOUR}
        if submitted:
            info["untested_submits"] = float(self.tools.tests_run == 0)
            return await self._finish("done", info, problems)
        if turn.errors:
            messages.append(format_error_message(turn.errors))
        if self.turns >= self.config.max_turns:
            return await self._finish("truncated_turns", info, problems)
        return StepResult(messages=messages, info=info, feedback="\n".join(problems) or None)

    async def _answer(self, call: ToolCall, index: int) -> Message:
        assert self.tools is not None
        if index >= self.config.max_calls_per_turn:
            return self.tools.toolbox.error(call.name, f"not run: more than {self.config.max_calls_per_turn} tool "
                                            "calls in one turn")
        return await self.tools.call(call)

    async def _finish(self, status: EpisodeStatus, info: dict[str, float], problems: list[str]) -> StepResult:
        assert self.tools is not None
        self.grade = await grade(self.pool, self.task, self.tools.box)
        info = info | {"tests_passed": float(self.grade.passed), "tests_total": float(self.grade.total)}
        if self.grade.passed < self.grade.total:
            problems = [*problems, f"hidden tests: {self.grade.passed} of {self.grade.total} passed"]
        return StepResult(reward=self.grade.reward, done=True, status=status, info=info,
                          feedback="\n".join(problems) or None)

    async def close(self) -> None:
        await self._stack.aclose()
