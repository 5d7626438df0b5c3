"""OpenRouter's wire format, without a connection: the errors and results of a request, the request body, and
reading a response (an error status or error object, a completion, its log-probs, its usage, `Retry-After`).

Pure functions of the settings and a `redact` callable (the client's, which scrubs the key from every message):
`OpenRouterClient` (`openrouter_client.py`) sends and retries; this module says what is sent and what came back.
Shapes follow https://openrouter.ai/docs (see `shared/notes/vllm_tiny.md` §3).
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composer_mesh.actors.backends.teachers.config import OpenRouterSettings
from composer_mesh.errors import UserInputError

# OpenRouter: 408 timeout, 429 rate limit, 502 upstream down/invalid, 503 no provider available; any 5xx.
_RETRYABLE_STATUS = frozenset({408, 429})

# What one request asks: a text (sent as one user message, after `system_prompt`) or chat messages, sent as given
# (an episode's conversation: assistant turns may carry `tool_calls`, tool results a `tool_call_id`).
ChatInput = str | list[dict[str, Any]]
Redact = Callable[[str], str]


# ---------------------------------------------------------------------------------------------- errors
class OpenRouterError(RuntimeError):
    """Any failure of an OpenRouter request. Messages are built here and never contain the key."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class OpenRouterConfigError(OpenRouterError, UserInputError):
    """Missing key or unusable settings: fails before any request is made."""


class OpenRouterHTTPError(OpenRouterError):
    """An HTTP error status, or an `{"error": ...}` object (also inside an HTTP 200)."""


class OpenRouterTimeout(OpenRouterError):
    """A transport timeout (no complete response within `request_timeout`)."""


class OpenRouterTransportError(OpenRouterError):
    """A connection-level failure (refused, reset, protocol error)."""


class OpenRouterResponseError(OpenRouterError):
    """A 200 whose body is not a chat completion (bad JSON, no choices, wrong field types)."""


class OpenRouterMissingLogprobs(OpenRouterError):
    """Log-probs were requested but the chosen provider returned none."""


# ---------------------------------------------------------------------------------------------- results
@dataclass
class TokenLogprob:
    """One generated teacher token (a string in the TEACHER's tokenizer) with its top alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class ChatResult:
    """One completion. `logprobs` is None when none were requested, or when missing and flagged. `tool_calls`:
    the calls of a request that offered tools, as OpenAI writes them (`{"id", "type": "function", "function":
    {"name", "arguments": a JSON string}}`)."""

    text: str
    model: str
    provider: str | None
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    logprobs_missing: bool = False
    usage: dict[str, float] = field(default_factory=dict)
    attempts: int = 1
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- requests
def chat_payload(settings: OpenRouterSettings, prompt: ChatInput, model: str, max_tokens: int,
                 tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The request body of one chat completion for `model`; `tools` (OpenAI function schemas) are offered to it."""
    s = settings
    messages: list[dict[str, Any]] = []
    if not isinstance(prompt, str):  # chat messages: the hosted model applies its own template
        messages = [dict(m) for m in prompt]
    else:
        if s.system_prompt:
            messages.append({"role": "system", "content": s.system_prompt})
        messages.append({"role": "user", "content": prompt})
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": s.temperature,
        "stream": False,
    }
    if tools:
        body["tools"] = [dict(t) for t in tools]
    if s.model_fallback == "openrouter" and len(s.models) > 1:
        body["models"] = list(s.models)
    if s.logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = s.top_logprobs
    if s.seed is not None:
        body["seed"] = s.seed
    if s.require_parameters:
        body["provider"] = {"require_parameters": True}
    return body


# ---------------------------------------------------------------------------------------------- responses
def parse_retry_after(value: str | None, *, cap: float, now: float | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header (delta-seconds or HTTP-date), clamped to [0, cap].

    None when the header is absent or unparseable (the caller then uses its own backoff).
    """
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return max(0.0, min(seconds, cap))


def http_error(settings: OpenRouterSettings, redact: Redact, where: str, status: int, err_obj: Any,
               raw: bytes) -> OpenRouterError:
    """The error of an HTTP error status or of an `{"error": ...}` object (also inside an HTTP 200), with
    whether it is retried and a hint for the codes a user can act on."""
    code = status
    message = ""
    if isinstance(err_obj, dict):
        message = str(err_obj.get("message", ""))
        try:
            code = int(err_obj.get("code", status))
        except (TypeError, ValueError):
            code = status
        meta = err_obj.get("metadata")
        if isinstance(meta, dict) and meta.get("provider_name"):
            message += f" [provider {meta['provider_name']}]"
    elif err_obj is not None:
        message = str(err_obj)
    else:
        message = raw[:200].decode("utf-8", "replace")
    if status == 200:
        # Generation had started: OpenRouter reports provider failures in the body. Treat an error
        # code that is not itself retryable-looking as an upstream failure (502) so it is retried.
        if code == 200 or not (400 <= code < 600):
            code = 502
        what = f"error object inside an HTTP 200 (code {code})"
    else:
        what = f"HTTP {status}"
    retryable = code in _RETRYABLE_STATUS or code >= 500
    hint = ""
    if code == 401:
        hint = f" (check the key in ${settings.api_key_env})"
    elif code == 402:
        hint = " (insufficient OpenRouter credits)"
    elif code == 503:
        hint = " (no provider meets the routing requirements; require_parameters with logprobs narrows them)"
    return OpenRouterHTTPError(
        redact(f"{where}: {what}: {message.strip()}{hint}"), status=code, retryable=retryable
    )


def parse_completion(settings: OpenRouterSettings, redact: Redact, where: str, model: str,
                     body: dict[str, Any]) -> ChatResult:
    """The `ChatResult` of a 200 response body; raises the `OpenRouterError` that says what is wrong with it
    (`OpenRouterMissingLogprobs` when requested log-probs are missing and `missing_logprobs` is `error`)."""
    def bad(msg: str) -> OpenRouterResponseError:
        return OpenRouterResponseError(redact(f"{where}: malformed completion: {msg}"), status=200, retryable=True)

    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise bad("`choices` is missing or empty")
    choice = choices[0]
    finish = choice.get("finish_reason")
    if finish == "error":
        raise OpenRouterHTTPError(
            redact(f"{where}: the provider ended the generation with finish_reason 'error'"),
            status=502,
            retryable=True,
        )
    message = choice.get("message")
    if not isinstance(message, dict):
        raise bad("`choices[0].message` is missing")
    text = message.get("content")
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise bad(f"`choices[0].message.content` is {type(text).__name__}, expected a string")

    logprobs: list[TokenLogprob] | None = None
    missing = False
    if settings.logprobs:
        logprobs = parse_logprobs(choice.get("logprobs"), bad)
        if logprobs is None or (text and not logprobs):
            logprobs = None
            missing = True
            if settings.missing_logprobs == "error":
                raise OpenRouterMissingLogprobs(
                    redact(
                        f"{where}: log-probs were requested but the response has none (provider "
                        f"{body.get('provider')!r}); keep require_parameters: true and pick a model listed "
                        f"by /models?supported_parameters=logprobs, or set missing_logprobs: flag"
                    ),
                    status=200,
                    retryable=False,
                )

    return ChatResult(
        text=text,
        tool_calls=parse_tool_calls(message.get("tool_calls"), bad),
        model=str(body.get("model") or model),
        provider=body.get("provider") if isinstance(body.get("provider"), str) else None,
        finish_reason=finish if isinstance(finish, str) else None,
        logprobs=logprobs,
        logprobs_missing=missing,
        usage=read_usage(body.get("usage")),
    )


def parse_logprobs(lp: Any, bad: Callable[[str], OpenRouterResponseError]) -> list[TokenLogprob] | None:
    """`choices[0].logprobs` as `TokenLogprob`s (None when absent); `bad` builds the error of a malformed one."""
    if lp is None:
        return None
    if not isinstance(lp, dict):
        raise bad("`choices[0].logprobs` is not an object")
    content = lp.get("content")
    if content is None:
        return None
    if not isinstance(content, list):
        raise bad("`choices[0].logprobs.content` is not a list")
    out: list[TokenLogprob] = []
    for i, entry in enumerate(content):
        if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
            raise bad(f"`logprobs.content[{i}]` has no string `token`")
        value = entry.get("logprob")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad(f"`logprobs.content[{i}].logprob` is not a number")
        top: list[tuple[str, float]] = []
        for alt in entry.get("top_logprobs") or []:
            if isinstance(alt, dict) and isinstance(alt.get("token"), str) and isinstance(alt.get("logprob"), (int, float)):
                top.append((alt["token"], float(alt["logprob"])))
        out.append(TokenLogprob(token=entry["token"], logprob=float(value), top=top))
    return out


def parse_tool_calls(calls: Any, bad: Callable[[str], OpenRouterResponseError]) -> list[dict[str, Any]]:
    """`choices[0].message.tool_calls` as OpenAI function calls with string arguments ([] when absent); `bad`
    builds the error of a malformed one. A call without an id gets `call_<i>` (ids pair results with calls)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad("`choices[0].message.tool_calls` is not a list")
    out: list[dict[str, Any]] = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"`tool_calls[{i}]` has no `function.name`")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):  # some providers send the object itself
            arguments = json.dumps(arguments)
        ident = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"call_{i}"
        out.append({"id": ident, "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def read_usage(usage: Any) -> dict[str, float]:
    """The numeric, non-negative token counts and cost of a response's `usage` object ({} when absent)."""
    if not isinstance(usage, dict):
        return {}
    got: dict[str, float] = {}
    for name in ("prompt_tokens", "completion_tokens", "total_tokens", "cost"):
        v = usage.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
            got[name] = float(v)
    return got
