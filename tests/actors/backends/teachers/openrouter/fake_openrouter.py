"""A fake OpenRouter chat-completions server on 127.0.0.1 (real HTTP, `http.server` in a thread).

It speaks the documented shapes (see shared/notes/vllm_tiny.md §3): bearer auth, `POST /api/v1/chat/completions`,
completions with `logprobs.content[]`, `usage` with `cost`, and errors as `{"error": {"code", "message"}}`.
Tests queue scripted replies (`FakeOpenRouter.push`); with none queued it answers a deterministic success. A request
that offers `tools` is answered by its `tool_policy` (e.g. `calculator_policy`) with a message that may hold OpenAI
`tool_calls` (`finish_reason: "tool_calls"`), its usage counted as for any completion.
Importable (not a test module) so other tiers — e.g. a whole run with the openrouter binding — can reuse it.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CHAT_PATH = "/api/v1/chat/completions"
COST_PER_TOKEN = 1e-6


@dataclass
class Reply:
    """One scripted reply. `body` (JSON-able) or `raw` (bytes); `delay` seconds before answering.

    `success=True` builds the normal completion (after `delay`), optionally without log-probs.
    """

    status: int = 200
    body: Any = None
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    success: bool = False
    logprobs: bool = True


def teacher_text(prompt: str) -> str:
    """The fake teacher's deterministic answer."""
    return f"The answer to {prompt} is 42."


def addition_answer(prompt: str) -> str:
    """A correct teacher for the built-in addition task (`"3+4="` -> `"7;"`), in the tiny student's alphabet."""
    left = prompt.strip().rstrip("=")
    try:
        return f"{sum(int(x) for x in left.split('+'))};"
    except ValueError:
        return "0;"


def teacher_tokens(text: str) -> list[str]:
    """The fake teacher's own 'tokenizer': words with their leading space (not the student's)."""
    words = text.split(" ")
    return [words[0]] + [" " + w for w in words[1:]]


def completion_body(
    request: dict[str, Any], *, logprobs: bool = True, answer: Callable[[str], str] = teacher_text
) -> dict[str, Any]:
    """The completion the fake teacher gives for `request` (its last message is the prompt)."""
    messages = request.get("messages") or [{"content": ""}]
    prompt = str(messages[-1].get("content", ""))
    tokens = teacher_tokens(answer(prompt))[: int(request.get("max_tokens") or 10**6)]
    text = "".join(tokens)
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": text},
    }
    if logprobs and request.get("logprobs"):
        k = int(request.get("top_logprobs") or 0)
        choice["logprobs"] = {
            "content": [
                {
                    "token": t,
                    "logprob": -0.1 * (i + 1),
                    "bytes": list(t.encode()),
                    "top_logprobs": [{"token": t if j == 0 else f"alt{j}", "logprob": -0.1 * (i + 1) - j, "bytes": None}
                                     for j in range(k)],
                }
                for i, t in enumerate(tokens)
            ],
            "refusal": None,
        }
    prompt_tokens = len(prompt.split()) + 3
    completion_tokens = len(tokens)
    return {
        "id": "gen-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.get("model", "unknown"),
        "provider": "FakeProvider",
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "cost": COST_PER_TOKEN * (prompt_tokens + completion_tokens),
            "is_byok": False,
        },
    }


def calculator_policy(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A teacher that solves the calculator task with its tool: the user's problem goes to `calculator` as one
    call; the tool's result comes back as the answer."""
    last = messages[-1]
    if last.get("role") == "tool":
        return {"role": "assistant", "content": str(last.get("content", ""))}
    calls = sum(len(m.get("tool_calls") or []) for m in messages)
    call = {"id": f"call_{calls}", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": str(last.get("content", ""))})}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """`usage` as OpenRouter documents it: token counts and `cost` (credits, USD) of the generation."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "cost": COST_PER_TOKEN * (prompt_tokens + completion_tokens), "is_byok": False}


def tool_policy_body(request: dict[str, Any], policy: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> dict[str, Any]:
    """The completion of a request with tools: `policy(messages)`'s message; usage counts words, as ours do."""
    messages = request.get("messages") or []
    message = policy(messages)
    prompt_tokens = sum(len(str(m.get("content") or "").split()) + 3 for m in messages)
    completion_tokens = len(str(message.get("content") or "").split()) + 8 * len(message.get("tool_calls") or [])
    choice: dict[str, Any] = {"index": 0, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                              "message": message}
    if request.get("logprobs"):
        words = teacher_tokens(message["content"]) if message.get("content") else []
        choice["logprobs"] = {"content": [{"token": w, "logprob": -0.1, "top_logprobs": []} for w in words]}
    return {
        "id": "gen-fake-tools", "object": "chat.completion", "created": int(time.time()),
        "model": request.get("model", "unknown"), "provider": "FakeProvider", "choices": [choice],
        "usage": usage_of(prompt_tokens, completion_tokens),
    }


def error_body(code: int, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "metadata": {"provider_name": "FakeProvider"}}}


class FakeOpenRouter:
    """Start with `start()` (returns the base URL), stop with `stop()`; `reset()` between tests."""

    def __init__(self, api_key: str, answer: Callable[[str], str] = teacher_text,
                 tool_policy: Callable[[list[dict[str, Any]]], dict[str, Any]] = calculator_policy) -> None:
        """`answer(prompt) -> text` is the fake teacher (e.g. `addition_answer` for the tiny addition task);
        `tool_policy(messages) -> message` answers requests that offer tools."""
        self.api_key = api_key
        self.answer = answer
        self.tool_policy = tool_policy
        self.responses: list[dict[str, Any]] = []  # bodies of the successes sent, in order (their usage, cost)
        self._lock = threading.Lock()
        self._script: deque[Reply] = deque()
        self.requests: list[dict[str, Any]] = []  # JSON bodies of authorised chat requests, in arrival order
        self.headers: list[dict[str, str]] = []  # their headers (Authorization removed)
        self.inflight = 0
        self.max_inflight = 0
        self.default_delay = 0.0
        self._generation = 0  # bumped by reset(): late finishers of an earlier test do not skew counters
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- control ------------------------------------------------------------------------------------------
    def push(self, *replies: Reply) -> None:
        with self._lock:
            self._script.extend(replies)

    def reset(self) -> None:
        with self._lock:
            self._script.clear()
            self.requests.clear()
            self.responses.clear()
            self.headers.clear()
            self.inflight = 0
            self.max_inflight = 0
            self.default_delay = 0.0
            self._generation += 1

    @property
    def base_url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/api/v1"

    def start(self) -> str:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # silence stderr access logs
                pass

            def do_POST(self) -> None:
                fake._handle(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-openrouter", daemon=True)
        self._thread.start()
        return self.base_url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -- serving ------------------------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        if h.path != CHAT_PATH:
            self._send(h, 404, error_body(404, f"no route {h.path}"))
            return
        if h.headers.get("Authorization") != f"Bearer {self.api_key}":
            self._send(h, 401, error_body(401, "No auth credentials found"))
            return
        try:
            request = json.loads(raw)
        except ValueError:
            self._send(h, 400, error_body(400, "invalid JSON"))
            return
        with self._lock:
            self.requests.append(request)
            self.headers.append({k: v for k, v in h.headers.items() if k.lower() != "authorization"})
            reply = self._script.popleft() if self._script else Reply(success=True, delay=self.default_delay)
            generation = self._generation
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if reply.delay:
                time.sleep(reply.delay)
            if reply.success:
                body = (tool_policy_body(request, self.tool_policy) if request.get("tools") else
                        completion_body(request, logprobs=reply.logprobs, answer=self.answer))
                with self._lock:
                    self.responses.append(body)
                self._send(h, 200, body, reply.headers)
            elif reply.raw is not None:
                self._send_bytes(h, reply.status, reply.raw, reply.headers)
            else:
                self._send(h, reply.status, reply.body, reply.headers)
        except OSError:
            pass  # the client gave up (timeout test): nothing to answer
        finally:
            with self._lock:
                if generation == self._generation:
                    self.inflight -= 1

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        self._send_bytes(h, status, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})

    @staticmethod
    def _send_bytes(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str]) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
        h.wfile.flush()


@contextmanager
def serving(api_key: str) -> Iterator[FakeOpenRouter]:
    """A started fake, stopped when the block ends (a module fixture's body)."""
    server = FakeOpenRouter(api_key=api_key)
    server.start()
    try:
        yield server
    finally:
        server.stop()
