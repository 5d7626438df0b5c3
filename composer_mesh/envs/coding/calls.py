"""Hermes-style tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen's chat templates
emit them) read out of a policy's turn.

Private to the coding environment until the shared parser (`composer_mesh/envs/tools.py`) lands; then this
module goes. What it never does: raise on a policy's text. A malformed call comes back as an error string that
the environment shows the policy as the tool's answer.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


def parse_tool_calls(text: str) -> tuple[list[ToolCall | str], bool]:
    """The calls in `text`, in order: a `ToolCall`, or an error line for a call that cannot be read; and whether
    `text` holds any `<tool_call>` at all (a turn without one is a final answer)."""
    found: list[ToolCall | str] = []
    for i, match in enumerate(CALL.finditer(text), 1):
        body, closed = match.group(1).strip(), bool(match.group(2))
        found.append(_one(body, i) if closed else f"error: tool call {i} has no closing </tool_call>")
    return found, bool(found)


def _one(body: str, i: int) -> ToolCall | str:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return f"error: tool call {i} is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return f'error: tool call {i} must be a JSON object {{"name": ..., "arguments": {{...}}}}'
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments JSON-encoded
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return f"error: tool call {i} ({call['name']}): 'arguments' must be a JSON object"
    return ToolCall(call["name"], arguments)
