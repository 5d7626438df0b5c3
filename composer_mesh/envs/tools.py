"""Tool calls as the policy writes them and tools as Python functions: parse a turn, run its calls, answer each
with a tool message.

Format: the Hermes/Qwen one that Qwen2.5/Qwen3 chat templates teach their models, one JSON object per call,
`<tool_call>{"name": "calculator", "arguments": {"expression": "47*83"}}</tool_call>`; a turn may hold several,
and the text outside them is the turn's content. A tool is a plain function (sync or async) with type hints and a
Google-style docstring: its JSON schema is what transformers' `get_json_schema` makes of it, which is what chat
templates render into the prompt (`Prompt.tools`).

Why nothing here raises at the policy: the policy writes the calls, so a malformed one, an unknown tool, wrong
arguments, a tool that fails or runs too long are things it did (or caused) and must learn from. Each becomes data
(`ParsedTurn.errors`) or a tool message whose content says, on one line naming the tool, what went wrong; the
episode goes on. Only a bad tool *definition* (the developer's) raises, when the `Tool` is made.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from composer_mesh.errors import UserInputError

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
EXPECTED_FORMAT = (f'call a tool as {TOOL_CALL_OPEN}{{"name": "<tool>", "arguments": {{...}}}}{TOOL_CALL_CLOSE}, '
                   "or answer without a tool call")
MAX_ERROR_CHARS = 300  # an error shown to the model: one line, this long at most (every byte is a token)


class ToolDefinitionError(UserInputError, ValueError):
    """A function that cannot be a tool: no type hints or docstring for an argument, a duplicate tool name."""


@dataclass
class ToolCall:
    """One call the policy wrote: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedTurn:
    """A policy turn read: its text outside tool calls (`content`, stripped), the well-formed `calls` in order,
    and one line per malformed call (`errors`)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def is_final(self) -> bool:
        """No tool call, well-formed or not: the turn is the policy's answer."""
        return not self.calls and not self.errors


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line (whitespace runs collapsed), cut to `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _read_call(body: str, index: int) -> ToolCall | str:
    """The call in one `<tool_call>` body, or the error line (index: 1-based position in the turn)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"tool call {index}: not valid JSON ({e.msg} at char {e.pos}); {EXPECTED_FORMAT}"
    if not isinstance(obj, dict):
        return f"tool call {index}: expected a JSON object, got {type(obj).__name__}; {EXPECTED_FORMAT}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'tool call {index}: no "name" (a string); {EXPECTED_FORMAT}'
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return f'tool call {index} ({name}): "arguments" must be a JSON object, got {type(arguments).__name__}'
    return ToolCall(name=name, arguments=arguments)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Read a policy turn in the Hermes/Qwen tool-call format. Never raises: a malformed call (bad JSON, no
    name, arguments not an object, a `<tool_call>` never closed) is an entry of `errors`."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    outside: list[str] = []
    at = 0
    for index, match in enumerate(_CALL.finditer(text), start=1):
        outside.append(text[at:match.start()])
        at = match.end()
        read = _read_call(match.group(1).strip(), index)
        (errors if isinstance(read, str) else calls).append(read)  # type: ignore[arg-type]
    rest = text[at:]
    if TOOL_CALL_OPEN in rest:
        cut = rest.index(TOOL_CALL_OPEN)
        errors.append(f"tool call {len(calls) + len(errors) + 1}: {TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}; "
                      f"{EXPECTED_FORMAT}")
        rest = rest[:cut]
    outside.append(rest)
    return ParsedTurn(content="".join(outside).strip(), calls=calls, errors=errors)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as the policy should write it (what `parse_tool_calls` reads back): for demonstrations."""
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_CLOSE}"


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _show(value: Any) -> str:
    try:
        return one_line(json.dumps(value), 40)
    except (TypeError, ValueError):
        return one_line(repr(value), 40)


def type_error(value: Any, schema: dict[str, Any], where: str) -> str | None:
    """Why `value` does not fit the JSON `schema` (type, nullable, enum, array items), or None if it does."""
    if value is None and schema.get("nullable"):
        return None
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    known = [k for k in kinds if k in _JSON_TYPES]
    if known and not any(_JSON_TYPES[k](value) for k in known):
        return f"{where} must be {' or '.join(known)}, got {type(value).__name__} {_show(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {_show(value)}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = type_error(item, schema["items"], f"{where}[{i}]")
            if problem:
                return problem
    return None


class Tool:
    """A Python function the policy may call. `schema` is transformers' `get_json_schema` of it (type hints and
    a Google-style docstring with an `Args:` line per argument), checked now so a bad definition fails at
    start-up, not in an episode. `timeout_s`: this tool's default per-call limit (None: the toolbox's)."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, timeout_s: float | None = None) -> None:
        # lazily: transformers is heavy, and only a run with tools needs it
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ToolDefinitionError(f"tool {getattr(fn, '__name__', fn)!r}: {one_line(str(e))}") from e
        if name is not None:
            schema["function"]["name"] = name
        self.fn, self.schema, self.timeout_s = fn, schema, timeout_s
        self.name: str = schema["function"]["name"]
        self.signature = inspect.signature(fn)
        self.is_async = inspect.iscoroutinefunction(fn)

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})

    def argument_error(self, arguments: dict[str, Any]) -> str | None:
        """What is wrong with `arguments` for this tool (missing, unknown, wrongly typed), or None."""
        properties = self.parameters.get("properties", {})
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)}; it takes {', '.join(properties) or 'none'}"
        missing = [p for p in self.parameters.get("required", []) if p not in arguments]
        if missing:
            return f"missing argument(s) {', '.join(missing)}"
        for key, value in arguments.items():
            problem = type_error(value, properties[key], f"argument {key}")
            if problem:
                return problem
        try:
            self.signature.bind(**arguments)
        except TypeError as e:
            return one_line(str(e))
        return None

    async def run(self, arguments: dict[str, Any]) -> Any:
        """Call the function: a coroutine function awaited, a plain one in a worker thread (so a slow tool does
        not stall the event loop that drives every other episode)."""
        if self.is_async:
            return await self.fn(**arguments)
        return await asyncio.to_thread(self.fn, **arguments)


def result_text(value: Any) -> str:
    """A tool's return value as message content: strings as they are, anything else as JSON (str() if not)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


class Toolbox:
    """The tools of an episode by name; `call` runs one call and answers it with a tool message. `calls` and
    `errors` count what it answered, for the metrics. `timeout_s`: the per-call limit of tools without their own."""

    def __init__(self, tools: Sequence[Tool | Callable[..., Any]], timeout_s: float | None = 10.0) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            tool = t if isinstance(t, Tool) else Tool(t)
            if tool.name in self.tools:
                raise ToolDefinitionError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.timeout_s = timeout_s
        self.calls = 0
        self.errors = 0

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for the chat template (`Observation.tools`, `Prompt.tools`)."""
        return [tool.schema for tool in self.tools.values()]

    def error(self, name: str, what: str) -> dict[str, Any]:
        """An error answer to a call of `name` (counted): `error: <name>: <what>`, one line."""
        self.errors += 1
        return {"role": "tool", "name": name, "content": f"error: {name}: {one_line(what)}"}

    async def call(self, call: ToolCall, timeout_s: float | None = None) -> dict[str, Any]:
        """Run `call`; its tool message `{"role": "tool", "name", "content"}`. Never raises for what the policy
        did: an unknown tool, bad arguments, an exception in the tool or a timeout is an `error: <tool>: ...`
        content. A timed-out sync tool's thread runs on until it returns (Python cannot stop a thread): tools
        that may not return belong in the sandbox, whose process is killed."""
        self.calls += 1
        tool = self.tools.get(call.name)
        if tool is None:
            return self.error(call.name, f"no such tool; the tools are {', '.join(self.tools) or 'none'}")
        problem = tool.argument_error(call.arguments)
        if problem:
            return self.error(call.name, problem)
        limit = next((t for t in (timeout_s, tool.timeout_s, self.timeout_s) if t is not None), None)
        try:
            value = await asyncio.wait_for(tool.run(call.arguments), limit)
        except TimeoutError:
            return self.error(call.name, f"timed out after {limit:g} s")
        except Exception as e:  # the tool's own failure is the policy's observation
            return self.error(call.name, f"{type(e).__name__}: {e}")
        return {"role": "tool", "name": call.name, "content": result_text(value)}

    async def call_all(self, calls: Sequence[ToolCall], timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Run `calls` concurrently; their tool messages in the calls' order."""
        return list(await asyncio.gather(*(self.call(c, timeout_s) for c in calls)))
