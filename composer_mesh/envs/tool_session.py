"""`ToolSession`: an episode of a tool-using task, as an `EnvSession` (`envs/session.py`).

The shape every such task shares: the policy sees the opening conversation and the tools; each turn it either
calls tools (their results are the observation, the episode goes on) or answers (no tool call: the answer is
graded, the episode is done). A subclass gives the opening messages, the tools and `grade`; nothing else.

A turn with a malformed call is not the end: the policy is told the expected format (a user message, since no
tool ran) and plays on, so a parse error costs it a turn and `max_turns`, not the episode; the driver's turn
and context limits end an episode that never answers. Its well-formed calls in the same turn still run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from composer_mesh.envs.session import Message, Observation, StepResult
from composer_mesh.envs.tools import Toolbox, ToolCall, parse_tool_calls


class ToolSession(ABC):
    """One episode of a tool-using task. `messages`: the opening conversation; `toolbox`: the tools it may call;
    `max_calls_per_turn`: calls of one turn beyond it are answered with an error, not run (a policy that writes
    hundreds of calls does not get them run concurrently); `timeout_s`: per call (None: the toolbox's)."""

    def __init__(self, messages: list[Message], toolbox: Toolbox, max_calls_per_turn: int = 8,
                 timeout_s: float | None = None) -> None:
        self.messages = [dict(m) for m in messages]
        self.toolbox = toolbox
        self.max_calls_per_turn = max_calls_per_turn
        self.timeout_s = timeout_s
        self.done = False
        self.closed = False

    @abstractmethod
    def grade(self, answer: str) -> float:
        """The reward of the policy's final answer (its last turn's text outside tool calls, stripped)."""

    def answer_feedback(self, answer: str, reward: float) -> str | None:
        """What was wrong with a final answer graded `reward`, in words (`StepResult.feedback`, which targeted
        feedback may turn into a hint); None: nothing to say. A task that can say more overrides it."""
        return None

    async def reset(self) -> Observation:
        return Observation(messages=[dict(m) for m in self.messages], tools=self.toolbox.schemas)

    async def step(self, action: str) -> StepResult:
        """Act on a policy turn: run its tool calls (concurrently), tell it about malformed ones, or grade it."""
        if self.done:
            raise RuntimeError(f"{type(self).__name__}.step after the episode ended")
        turn = parse_tool_calls(action)
        if turn.is_final:
            self.done = True
            reward = float(self.grade(turn.content))
            return StepResult(reward=reward, done=True, status="done", feedback=self.answer_feedback(turn.content,
                              reward), info={"tool_calls": 0.0, "tool_errors": 0.0, "parse_errors": 0.0})
        calls_before, errors_before = self.toolbox.calls, self.toolbox.errors
        messages = await self._run(turn.calls)
        if turn.errors:
            messages.append(format_error_message(turn.errors))
        info = {"tool_calls": float(self.toolbox.calls - calls_before),
                "tool_errors": float(self.toolbox.errors - errors_before), "parse_errors": float(len(turn.errors))}
        return StepResult(messages=messages, info=info, feedback=mistakes(messages))

    async def _run(self, calls: list[ToolCall]) -> list[Message]:
        run, refused = calls[: self.max_calls_per_turn], calls[self.max_calls_per_turn:]
        out = await self.toolbox.call_all(run, self.timeout_s)
        for call in refused:
            self.toolbox.calls += 1
            out.append(self.toolbox.error(call.name, f"not run: more than {self.max_calls_per_turn} tool calls "
                                           "in one turn"))
        return out

    async def close(self) -> None:
        self.closed = True


def mistakes(messages: list[Message]) -> str | None:
    """A turn's feedback: the error lines among its observations (failed tool calls, malformed calls), if any."""
    lines = [line for m in messages for line in str(m.get("content", "")).splitlines() if line.startswith("error: ")]
    return "\n".join(lines) or None


def format_error_message(errors: list[str]) -> dict[str, Any]:
    """The observation for a turn's malformed tool calls: a user message, one line per call."""
    return {"role": "user", "content": "\n".join(f"error: {e}" for e in errors)}
