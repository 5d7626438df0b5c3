"""Async client for OpenRouter's OpenAI-compatible chat completions API (no Monarch, no model code).

Why a hand-written client instead of the `openai`/`openrouter` SDKs: we need exact control over retries
(429 with `Retry-After`, 5xx, timeouts, an error object inside an HTTP 200), over what counts as a usable
response (the requested log-probs must be present), and over secrets (the API key must never reach a log
line, an exception text, a repr or a pickle). This module sends, retries, falls back and counts; what is sent
and how a response reads (errors, completions, log-probs, usage) is `openrouter_wire.py`'s.

The key is read from the environment variable NAMED in the settings (`api_key_env`) when the client is
built, held only inside a `_BearerAuth` whose repr is masked and which refuses to be pickled, and scrubbed
from every message the client produces, those built by `openrouter_wire` included (`OpenRouterClient.redact`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import SecretStr

from composer_mesh.actors.backends.teachers.config import OpenRouterSettings
from composer_mesh.actors.backends.teachers.openrouter_wire import (
    ChatInput,
    ChatResult,
    OpenRouterConfigError,
    OpenRouterError,
    OpenRouterMissingLogprobs,
    OpenRouterResponseError,
    OpenRouterTimeout,
    OpenRouterTransportError,
    chat_payload,
    http_error,
    parse_completion,
    parse_retry_after,
)

log = logging.getLogger("composer_mesh.openrouter")

_REDACTED = "[REDACTED]"


@dataclass
class UsageCounters:
    """Cumulative per-client counters reported in the run's metrics (no secrets, only numbers)."""

    requests: int = 0  # HTTP attempts sent
    completions: int = 0  # successful completions
    retries: int = 0
    failed_requests: int = 0  # calls that raised after all retries/fallbacks (the pool keeps its own `failures`)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cost: float = 0.0  # credits (USD) as reported in `usage.cost`
    missing_logprobs: int = 0

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}

    def add_usage(self, got: dict[str, float]) -> None:
        """Add one response's `read_usage` (total tokens = prompt + completion when the response has no total)."""
        self.prompt_tokens += int(got.get("prompt_tokens", 0))
        self.completion_tokens += int(got.get("completion_tokens", 0))
        self.total_tokens += int(got.get("total_tokens", got.get("prompt_tokens", 0) + got.get("completion_tokens", 0)))
        self.cost += got.get("cost", 0.0)


# ---------------------------------------------------------------------------------------------- secrets
class _BearerAuth(httpx.Auth):
    """Adds `Authorization: Bearer <key>` per request; the key lives only here, masked and unpicklable."""

    def __init__(self, key: str) -> None:
        self._key = SecretStr(key)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self._key.get_secret_value()}"
        yield request

    def secret(self) -> str:
        return self._key.get_secret_value()

    def __repr__(self) -> str:
        return "_BearerAuth(key=**********)"

    def __reduce__(self) -> Any:
        raise TypeError("the OpenRouter credentials are not picklable (they must never reach a checkpoint)")


def read_api_key(env_name: str) -> str:
    """The key from the environment variable `env_name`; the error names the variable, never a value."""
    key = os.environ.get(env_name, "").strip()
    if not key:
        raise OpenRouterConfigError(
            f"environment variable {env_name} is not set or empty; it must hold the OpenRouter API key "
            f"(the teacher's settings.api_key_env names it)"
        )
    if not all(33 <= ord(ch) <= 126 for ch in key):
        # Checked here because an HTTP library rejecting the header later would quote the value.
        raise OpenRouterConfigError(
            f"environment variable {env_name} must hold the API key as printable ASCII without spaces "
            f"(it has {len(key)} characters, some outside that range)"
        )
    return key


# ---------------------------------------------------------------------------------------------- client
SleepFn = Callable[[float], Awaitable[Any]]


class OpenRouterClient:
    """Chat completions with retries, validation, usage accounting and a concurrency bound.

    Build it on any thread; the `httpx.AsyncClient` and semaphore are created lazily on the running event
    loop (and rebuilt if a later call runs on a different loop). `sleep` is injectable so tests can record
    backoff delays without waiting them out; `transport` lets tests use `httpx.MockTransport`.
    """

    def __init__(
        self,
        settings: OpenRouterSettings,
        *,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: SleepFn | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self._auth = _BearerAuth(api_key if api_key is not None else read_api_key(settings.api_key_env))
        self._transport = transport
        self._sleep: SleepFn = sleep or asyncio.sleep
        self._rng = rng or random.Random()
        self._counters = UsageCounters()
        self._http: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        s = self.settings
        return f"OpenRouterClient(base_url={s.base_url!r}, models={s.models!r}, key_env={s.api_key_env!r})"

    def __reduce__(self) -> Any:
        raise TypeError("OpenRouterClient is not picklable (it holds credentials and a live connection pool)")

    # -- public -------------------------------------------------------------------------------------------
    def usage(self) -> dict[str, float]:
        return self._counters.as_dict()

    def redact(self, text: str) -> str:
        """`text` with the key (and any bearer token) replaced; applied to every message we emit."""
        key = self._auth.secret()
        if key:
            text = text.replace(key, _REDACTED)
        return re.sub(r"(?i)(bearer\s+)\S+", r"\1" + _REDACTED, text)

    async def aclose(self) -> None:
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._http = None
        self._sem = None
        self._loop = None

    async def complete(self, prompt: ChatInput, *, max_tokens: int,
                       tools: list[dict[str, Any]] | None = None) -> ChatResult:
        """One completion for `prompt` (a text: one user message; or chat messages, sent as given), offered
        `tools` when given, waiting for a concurrency slot first."""
        _, sem = self._ensure_loop_state()
        async with sem:
            try:
                return await self._complete_with_fallback(prompt, max_tokens, tools)
            except OpenRouterError:
                self._counters.failed_requests += 1
                raise

    async def complete_many(self, prompts: list[ChatInput], *, max_tokens: int,
                            tools: list[list[dict[str, Any]] | None] | None = None) -> list[ChatResult | OpenRouterError]:
        """Concurrent `complete` for every prompt (bounded by `max_concurrency`; `tools[i]` offered to prompt i);
        errors are returned in place.

        Every request finishes (or fails) before this returns: no orphaned tasks keep spending credits.
        """
        offered = tools if tools is not None else [None] * len(prompts)
        results = await asyncio.gather(
            *(self.complete(p, max_tokens=max_tokens, tools=t) for p, t in zip(prompts, offered)),
            return_exceptions=True,
        )
        out: list[ChatResult | OpenRouterError] = []
        for r in results:
            if isinstance(r, OpenRouterError):
                out.append(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                out.append(r)
        return out

    # -- internals ----------------------------------------------------------------------------------------
    def _ensure_loop_state(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._http is None or self._sem is None or self._loop is not loop:
            s = self.settings
            headers = {"Content-Type": "application/json"}
            if s.app_title:
                headers["X-OpenRouter-Title"] = s.app_title
            self._http = httpx.AsyncClient(
                base_url=s.base_url,
                auth=self._auth,
                headers=headers,
                timeout=httpx.Timeout(s.request_timeout),
                transport=self._transport,
                limits=httpx.Limits(max_connections=s.max_concurrency, max_keepalive_connections=s.max_concurrency),
                follow_redirects=False,
            )
            self._sem = asyncio.Semaphore(s.max_concurrency)
            self._loop = loop
        return self._http, self._sem

    async def _complete_with_fallback(self, prompt: ChatInput, max_tokens: int,
                                      tools: list[dict[str, Any]] | None) -> ChatResult:
        s = self.settings
        models = s.models if s.model_fallback == "client" else s.models[:1]
        errors: list[str] = []
        for i, model in enumerate(models):
            try:
                return await self._complete_one_model(prompt, model, max_tokens, tools)
            except OpenRouterError as e:
                # Auth, credits, moderation and bad requests fail the same way for every model: stop.
                if e.status in (400, 401, 402, 403) or isinstance(e, OpenRouterConfigError) or i == len(models) - 1:
                    if errors:
                        raise type(e)(
                            self.redact(f"{e} (after trying models {', '.join(errors)} first)"),
                            status=e.status,
                            retryable=e.retryable,
                        ) from None
                    raise
                errors.append(f"{model}: {type(e).__name__}")
                log.warning("openrouter model %s failed (%s); falling back to %s", model, type(e).__name__, models[i + 1])
        raise AssertionError("unreachable")  # pragma: no cover

    async def _complete_one_model(self, prompt: ChatInput, model: str, max_tokens: int,
                                  tools: list[dict[str, Any]] | None) -> ChatResult:
        s = self.settings
        payload = chat_payload(self.settings, prompt, model, max_tokens, tools)
        attempt = 0
        while True:
            attempt += 1
            self._counters.requests += 1
            error, retry_after = await self._attempt(payload, model)
            if isinstance(error, ChatResult):
                error.attempts = attempt
                return error
            if not error.retryable or attempt > s.max_retries:
                if error.retryable:
                    raise type(error)(
                        f"{error} (gave up after {attempt} attempts)", status=error.status, retryable=True
                    )
                raise error
            delay = retry_after if retry_after is not None else self._backoff(attempt)
            self._counters.retries += 1
            log.warning(
                "openrouter %s attempt %d/%d failed: %s; retrying in %.2fs",
                model, attempt, s.max_retries + 1, error, delay,
            )
            await self._sleep(delay)

    def _backoff(self, attempt: int) -> float:
        s = self.settings
        return min(s.backoff_max, s.backoff_base * 2 ** (attempt - 1)) * self._rng.uniform(0.5, 1.0)

    async def _attempt(self, payload: dict[str, Any], model: str) -> tuple[ChatResult | OpenRouterError, float | None]:
        """One HTTP attempt: a result, or an error (never raised) plus a server-requested delay."""
        http, _ = self._ensure_loop_state()
        where = f"POST {self.settings.base_url}/chat/completions (model {model})"
        failure: OpenRouterError | None = None
        timeout = self.settings.request_timeout
        try:
            # httpx's timeout bounds each phase (connect, each read); wait_for bounds the whole attempt, so a
            # server that drips bytes cannot hold a slot forever.
            response = await asyncio.wait_for(http.post("/chat/completions", json=payload), timeout)
            raw = response.content
        except (httpx.TimeoutException, asyncio.TimeoutError) as e:
            failure = OpenRouterTimeout(
                self.redact(f"{where}: timed out after {self.settings.request_timeout}s ({type(e).__name__})"),
                retryable=True,
            )
        except httpx.TransportError as e:
            failure = OpenRouterTransportError(
                self.redact(f"{where}: transport error {type(e).__name__}: {e}"), retryable=True
            )
        # Raised outside the `except` blocks so the httpx exception (which holds the request and its
        # headers) is not chained onto ours as __context__.
        if failure is not None:
            return failure, None

        status = response.status_code
        retry_after = parse_retry_after(response.headers.get("retry-after"), cap=self.settings.retry_after_max)
        body: Any = None
        parse_error: str | None = None
        try:
            body = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError) as e:
            parse_error = f"{type(e).__name__}: {e}"

        err_obj = body.get("error") if isinstance(body, dict) else None
        if status != 200 or err_obj is not None:
            return http_error(self.settings, self.redact, where, status, err_obj, raw), retry_after
        if parse_error is not None or not isinstance(body, dict):
            snippet = self.redact(raw[:200].decode("utf-8", "replace"))
            return OpenRouterResponseError(
                f"{where}: malformed response body ({parse_error or 'not a JSON object'}); starts with {snippet!r}",
                status=status,
                retryable=True,
            ), None
        try:
            return self._completion(where, model, body), None
        except OpenRouterError as e:
            return e, None

    def _completion(self, where: str, model: str, body: dict[str, Any]) -> ChatResult:
        """`parse_completion`, counted: a missing log-probs answer (raised or flagged), the usage, the completion."""
        try:
            result = parse_completion(self.settings, self.redact, where, model, body)
        except OpenRouterMissingLogprobs:
            self._counters.missing_logprobs += 1
            raise
        self._counters.missing_logprobs += int(result.logprobs_missing)
        self._counters.add_usage(result.usage)
        self._counters.completions += 1
        return result
