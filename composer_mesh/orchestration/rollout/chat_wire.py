"""The OpenAI Chat Completions wire format of the harness endpoint (`harness.py`, served by `chat_server.py`).

Why a module of plain functions: what the endpoint accepts and answers is the contract an unchanged `openai`
client relies on, so it is kept apart from the web framework and from the episode bookkeeping, and tested alone.
A request is read into a `ChatRequest` whose messages are in one canonical form (content as text, tool calls
with their arguments parsed), so "does this conversation extend what was served" is a list comparison. A served
turn's text is read as the Hermes/Qwen tool-call format (`envs.tools.parse_tool_calls`, what the chat template
taught the model) into an assistant message with `tool_calls`; a turn with a malformed call is served as plain
content, as vLLM's hermes parser does.

Supported: `messages`, `tools`, `tool_choice` "auto" (or absent), `max_tokens` / `max_completion_tokens` (capped
by `run.max_new_tokens`), `stream` with `stream_options.include_usage`, `logprobs`, `top_logprobs` (answered with
empty lists), `metadata.episode_id`, and vLLM's `return_token_ids` (the served ids in the answer). Ignored, as
the policy samples at the run's own settings: `model`, `temperature`, `top_p`, `seed`, penalties, `user`,
`parallel_tool_calls`, `store`. Refused with a 400 naming the field: `n` > 1, `stop`, a `tool_choice` other than
"auto", a `response_format` other than text, content parts other than text.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from composer_mesh.envs.tools import parse_tool_calls

Message = dict[str, Any]
ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = ("model", "temperature", "top_p", "seed", "frequency_penalty", "presence_penalty", "user",
           "parallel_tool_calls", "store", "logit_bias", "service_tier", "prompt_cache_key", "safety_identifier")


class WireError(ValueError):
    """A request the endpoint refuses: answered with `status` and an OpenAI-style error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error"}.get(
            self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclass
class ChatRequest:
    """A chat completion request as the episode needs it (canonical messages, the per-turn cap, the answer's form)."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    episode_id: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False


def read_request(body: Any) -> ChatRequest:
    """`body` (the request's JSON) checked and read; a `WireError` names the first field that is wrong."""
    if not isinstance(body, dict):
        raise WireError("the request body must be a JSON object")
    _refuse_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise WireError("messages: a non-empty list of messages is required", "messages")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools)):
        raise WireError("tools: a list of {type: function, function: {name, parameters}} is expected", "tools")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise WireError("metadata: an object is expected", "metadata")
    episode = metadata.get("episode_id")
    if episode is not None and not isinstance(episode, str):
        raise WireError("metadata.episode_id: a string is expected", "metadata")
    stream_options = body.get("stream_options") or {}
    return ChatRequest(messages=[canonical(m, f"messages[{i}]") for i, m in enumerate(messages)],
                       tools=tools or None, episode_id=episode, max_tokens=_max_tokens(body),
                       stream=bool(body.get("stream")), include_usage=bool(stream_options.get("include_usage")),
                       logprobs=bool(body.get("logprobs")), return_token_ids=bool(body.get("return_token_ids")))


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("n") not in (None, 1):
        raise WireError(f"n: only 1 choice per request is served (got {body['n']!r}); send n requests", "n")
    if body.get("stop") not in (None, [], ""):
        raise WireError("stop: not supported (a turn ends at the chat template's end of turn)", "stop")
    if body.get("tool_choice") not in (None, "auto"):
        raise WireError("tool_choice: only 'auto' is served (the policy decides whether to call a tool)",
                        "tool_choice")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise WireError("response_format: only text is served", "response_format")


def _is_function_tool(tool: Any) -> bool:
    return (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)
            and isinstance(tool["function"].get("name"), str))


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise WireError(f"{name}: a positive integer is expected (got {value!r})", name)
            return value
    return None


def canonical(message: Any, where: str) -> Message:
    """One message in the form conversations are compared in: role, content as text, an assistant's tool calls
    as {id, name, arguments (parsed)}, a tool message's tool_call_id. `where` names it in errors."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise WireError(f"{where}: a message with a role of {', '.join(ROLES)} is expected", "messages")
    role = "system" if message["role"] == "developer" else message["role"]
    out: Message = {"role": role, "content": _text(message.get("content"), where)}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(message["tool_calls"])]
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise WireError(f"{where}: a tool message needs its tool_call_id", "messages")
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise WireError(f"{where}.content: text, or a list of text parts, is expected", "messages")


def _call(call: Any, where: str) -> Message:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise WireError(f"{where}: a function call with a name is expected", "messages")
    arguments = fn.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as e:
        raise WireError(f"{where}.function.arguments: not JSON ({e.msg})", "messages") from None
    return {"id": call.get("id"), "name": fn["name"], "arguments": parsed}


def template_messages(messages: list[Message], call_names: dict[str, str]) -> list[Message]:
    """Canonical messages as the generator's chat template takes them (transformers' format: a call's arguments
    as a dict, a tool result with the called tool's `name`, looked up by its call id in `call_names`)."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "tool", "name": call_names.get(m["tool_call_id"], ""), "content": m["content"],
                        "tool_call_id": m["tool_call_id"]})
        elif m.get("tool_calls"):
            calls = [{"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": m["content"], "tool_calls": calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def served_message(text: str, call_prefix: str) -> Message:
    """A served turn's text as a canonical assistant message: its Hermes tool calls (ids `<call_prefix>_<i>`)
    and the text outside them; a turn with a malformed call is all content, as the policy wrote it."""
    turn = parse_tool_calls(text)
    if turn.errors or not turn.calls:
        return {"role": "assistant", "content": text if turn.errors else turn.content}
    calls = [{"id": f"{call_prefix}_{i}", "name": c.name, "arguments": c.arguments} for i, c in enumerate(turn.calls)]
    return {"role": "assistant", "content": turn.content, "tool_calls": calls}


@dataclass
class ServedTurn:
    """What the generator served for one request: the assistant message and the tokens behind it."""

    message: Message
    completion_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int
    truncated: bool  # the turn hit its token cap
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        if self.message.get("tool_calls"):
            return "tool_calls"
        return "length" if self.truncated else "stop"

    def usage(self) -> dict[str, int]:
        n = len(self.completion_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}


def wire_message(message: Message) -> Message:
    """A canonical assistant message as the API answers it (arguments as a JSON string, content null if empty
    and calls were made)."""
    out: Message = {"role": "assistant", "content": message["content"] or (None if message.get("tool_calls") else "")}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                             for c in message["tool_calls"]]
    return out


def logprobs_content(turn: ServedTurn) -> dict[str, Any]:
    """`choices[0].logprobs`: one entry per served token, named `token_id:<id>` (vLLM's
    `return_tokens_as_token_ids` form: the controller holds no tokenizer, and ids are what a trainer needs)."""
    return {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(turn.completion_ids, turn.logprobs, strict=True)], "refusal": None}


def completion(request: ChatRequest, turn: ServedTurn, completion_id: str, model: str) -> dict[str, Any]:
    """The non-streaming answer (`chat.completion`)."""
    choice: dict[str, Any] = {"index": 0, "message": wire_message(turn.message), "finish_reason": turn.finish_reason,
                              "logprobs": logprobs_content(turn) if request.logprobs else None}
    body = {"id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": turn.usage()}
    if request.return_token_ids:
        choice["token_ids"] = list(turn.completion_ids)
        body["prompt_token_ids"] = list(turn.prompt_ids)
    return body


def stream_chunks(request: ChatRequest, turn: ServedTurn, completion_id: str, model: str) -> list[dict[str, Any]]:
    """The streaming answer as `chat.completion.chunk` events: the whole turn at once (generation is batched, so
    it arrives whole), its tool calls, the finish reason, then the usage when `stream_options.include_usage`."""
    head = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    message = wire_message(turn.message)
    first: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": message["content"]},
                             "logprobs": logprobs_content(turn) if request.logprobs else None, "finish_reason": None}
    chunks = [{**head, "choices": [first]}]
    if message.get("tool_calls"):
        calls = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        chunks.append({**head, "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]})
    last: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": turn.finish_reason}
    if request.return_token_ids:
        last["token_ids"] = list(turn.completion_ids)
    chunks.append({**head, "choices": [last]})
    if request.include_usage:
        chunks.append({**head, "choices": [], "usage": turn.usage()})
    return chunks
