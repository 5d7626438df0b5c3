"""A teacher that plays episodes at the message level (a hosted model): its turns as the environment reads them,
and the environment's answers as the teacher's API reads them.

Why a translation at all: a hosted model is asked in chat messages and answers with `content` and OpenAI
`tool_calls`; an environment session reads a turn as the text a policy writes, tool calls in the Hermes form
(`envs.tools`: one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` per call, content outside), and
answers with tool messages in the calls' order, without ids. So a teacher's turn becomes that text, and each
tool result going back to it gets the id of the call it answers (OpenAI pairs them by `tool_call_id`).
"""

from __future__ import annotations

import json
from typing import Any

from composer_mesh.envs.session import Message
from composer_mesh.envs.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, format_tool_call


def call_arguments(call: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments of an OpenAI tool call as an object, or None when they are not a JSON object."""
    raw = (call.get("function") or {}).get("arguments")
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def action_text(message: dict[str, Any]) -> str:
    """The teacher's turn as the environment parses it: its content, then each call in the Hermes form. A call
    whose arguments are not a JSON object is written with them as they came, so the environment answers it as
    the malformed call it is (as it would a policy's)."""
    parts = [str(message.get("content") or "")]
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        name, arguments = str(fn.get("name", "")), call_arguments(call)
        if arguments is not None:
            parts.append(format_tool_call(name, arguments))
        else:
            parts.append(f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {fn.get("arguments")}}}'
                         f"{TOOL_CALL_CLOSE}")
    return "".join(parts)


def answered_calls(message: dict[str, Any]) -> list[str]:
    """The ids of a turn's calls the environment answers with a tool message, in order: its well-formed ones (a
    malformed call is answered, if at all, by a user message naming the format)."""
    return [str(c.get("id")) for c in message.get("tool_calls") or [] if call_arguments(c) is not None]


def with_call_ids(messages: list[Message], ids: list[str]) -> list[Message]:
    """The environment's `messages` for the teacher's API: its tool messages, in order, answer the calls `ids`."""
    left = iter(ids)
    out: list[Message] = []
    for m in messages:
        ident = next(left, None) if m.get("role") == "tool" else None
        out.append({**m, "tool_call_id": ident} if ident is not None else dict(m))
    return out
