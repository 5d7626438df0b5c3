"""Async client for OpenRouter's OpenAI-compatible chat completions API (no Monarch, no model code).

Why a hand-written client instead of the `openai`/`openrouter` SDKs: we need exact control over retries
(429 with `Retry-After`, 5xx, timeouts, an error object inside an HTTP 200), over what counts as a usable
response (the requested log-probs must be present), and over secrets (the API key must never reach a log
line, an exception text, a repr or a pickle). Request/response/error shapes follow
https://openrouter.ai/docs (see `shared/notes/vllm_tiny.md` §3).

The key is read from the environment variable NAMED in the settings (`api_key_env`) when the client is
built, held only inside a `_BearerAuth` whose repr is masked and which refuses to be pickled, and scrubbed
from every message this module produces (`OpenRouterClient.redact`).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import os
import random
import re
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import SecretStr

from composer_mesh.actors.backends.teachers.config import OpenRouterSettings

log = logging.getLogger("composer_mesh.openrouter")

# OpenRouter: 408 timeout, 429 rate limit, 502 upstream down/invalid, 503 no provider available; any 5xx.
_RETRYABLE_STATUS = frozenset({408, 429})
_REDACTED = "[REDACTED]"

# What one request asks: a text (sent as one user message, after `system_prompt`) or chat messages, sent as given.
ChatInput = str | list[dict[str, str]]


# ---------------------------------------------------------------------------------------------- errors
class OpenRouterError(RuntimeError):
    """Any failure of an OpenRouter request. Messages are built here and never contain the key."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class OpenRouterConfigError(OpenRouterError):
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
    """One completion. `logprobs` is None when none were requested, or when missing and flagged."""

    text: str
    model: str
    provider: str | None
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    logprobs_missing: bool = False
    usage: dict[str, float] = field(default_factory=dict)
    attempts: int = 1


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

    async def complete(self, prompt: ChatInput, *, max_tokens: int) -> ChatResult:
        """One completion for `prompt` (a text: one user message; or chat messages, sent as given), waiting for
        a concurrency slot first."""
        _, sem = self._ensure_loop_state()
        async with sem:
            try:
                return await self._complete_with_fallback(prompt, max_tokens)
            except OpenRouterError:
                self._counters.failed_requests += 1
                raise

    async def complete_many(self, prompts: list[ChatInput], *, max_tokens: int) -> list[ChatResult | OpenRouterError]:
        """Concurrent `complete` for every prompt (bounded by `max_concurrency`); errors are returned in place.

        Every request finishes (or fails) before this returns: no orphaned tasks keep spending credits.
        """
        results = await asyncio.gather(
            *(self.complete(p, max_tokens=max_tokens) for p in prompts), return_exceptions=True
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

    def _payload(self, prompt: ChatInput, model: str, max_tokens: int) -> dict[str, Any]:
        s = self.settings
        messages: list[dict[str, str]] = []
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

    async def _complete_with_fallback(self, prompt: ChatInput, max_tokens: int) -> ChatResult:
        s = self.settings
        models = s.models if s.model_fallback == "client" else s.models[:1]
        errors: list[str] = []
        for i, model in enumerate(models):
            try:
                return await self._complete_one_model(prompt, model, max_tokens)
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

    async def _complete_one_model(self, prompt: ChatInput, model: str, max_tokens: int) -> ChatResult:
        s = self.settings
        payload = self._payload(prompt, model, max_tokens)
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
            return self._http_error(where, status, err_obj, raw), retry_after
        if parse_error is not None or not isinstance(body, dict):
            snippet = self.redact(raw[:200].decode("utf-8", "replace"))
            return OpenRouterResponseError(
                f"{where}: malformed response body ({parse_error or 'not a JSON object'}); starts with {snippet!r}",
                status=status,
                retryable=True,
            ), None
        try:
            return self._parse_completion(where, model, body), None
        except OpenRouterError as e:
            return e, None

    def _http_error(self, where: str, status: int, err_obj: Any, raw: bytes) -> OpenRouterError:
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
            hint = f" (check the key in ${self.settings.api_key_env})"
        elif code == 402:
            hint = " (insufficient OpenRouter credits)"
        elif code == 503:
            hint = " (no provider meets the routing requirements; require_parameters with logprobs narrows them)"
        return OpenRouterHTTPError(
            self.redact(f"{where}: {what}: {message.strip()}{hint}"), status=code, retryable=retryable
        )

    def _parse_completion(self, where: str, model: str, body: dict[str, Any]) -> ChatResult:
        def bad(msg: str) -> OpenRouterResponseError:
            return OpenRouterResponseError(self.redact(f"{where}: malformed completion: {msg}"), status=200, retryable=True)

        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise bad("`choices` is missing or empty")
        choice = choices[0]
        finish = choice.get("finish_reason")
        if finish == "error":
            raise OpenRouterHTTPError(
                self.redact(f"{where}: the provider ended the generation with finish_reason 'error'"),
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
        if self.settings.logprobs:
            logprobs = self._parse_logprobs(choice.get("logprobs"), bad)
            if logprobs is None or (text and not logprobs):
                logprobs = None
                missing = True
                self._counters.missing_logprobs += 1
                if self.settings.missing_logprobs == "error":
                    raise OpenRouterMissingLogprobs(
                        self.redact(
                            f"{where}: log-probs were requested but the response has none (provider "
                            f"{body.get('provider')!r}); keep require_parameters: true and pick a model listed "
                            f"by /models?supported_parameters=logprobs, or set missing_logprobs: flag"
                        ),
                        status=200,
                        retryable=False,
                    )

        usage = self._account(body.get("usage"))
        self._counters.completions += 1
        return ChatResult(
            text=text,
            model=str(body.get("model") or model),
            provider=body.get("provider") if isinstance(body.get("provider"), str) else None,
            finish_reason=finish if isinstance(finish, str) else None,
            logprobs=logprobs,
            logprobs_missing=missing,
            usage=usage,
        )

    def _parse_logprobs(self, lp: Any, bad: Callable[[str], OpenRouterResponseError]) -> list[TokenLogprob] | None:
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

    def _account(self, usage: Any) -> dict[str, float]:
        if not isinstance(usage, dict):
            return {}
        got: dict[str, float] = {}
        for name in ("prompt_tokens", "completion_tokens", "total_tokens", "cost"):
            v = usage.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
                got[name] = float(v)
        c = self._counters
        c.prompt_tokens += int(got.get("prompt_tokens", 0))
        c.completion_tokens += int(got.get("completion_tokens", 0))
        c.total_tokens += int(got.get("total_tokens", got.get("prompt_tokens", 0) + got.get("completion_tokens", 0)))
        c.cost += got.get("cost", 0.0)
        return got
