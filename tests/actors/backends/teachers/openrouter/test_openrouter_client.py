"""The OpenRouter teacher binding against a fake OpenRouter on 127.0.0.1 (real HTTP, no network, no Monarch).

Backoff sleeps are recorded (and skipped) through the client's injectable `sleep`, so the file runs in a few
seconds while still asserting which delays were chosen. Every test also checks that the API key never
appears in any log record (DEBUG, including httpx/httpcore).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import random
import socket
import time
from email.utils import formatdate
from typing import Any

import pytest
from fake_openrouter import (
    FakeOpenRouter,
    Reply,
    addition_answer,
    completion_body,
    error_body,
    serving,
    teacher_text,
)
from pydantic import ValidationError

from composer_mesh.actors.backends.teachers.openrouter import (
    OpenRouterTeacher,
    TeacherCapabilityError,
    TeacherTraceError,
    load_student_tokenizer,
)
from composer_mesh.actors.backends.teachers.openrouter_client import OpenRouterClient, OpenRouterSettings
from composer_mesh.actors.backends.teachers.openrouter_wire import (
    OpenRouterConfigError,
    OpenRouterHTTPError,
    OpenRouterMissingLogprobs,
    OpenRouterResponseError,
    OpenRouterTimeout,
    OpenRouterTransportError,
    parse_retry_after,
)
from composer_mesh.actors.messages import Prompt, Rollout, TeacherRequest
from composer_mesh.actors.teacher_errors import TeacherFailed, TeacherUnavailable
from composer_mesh.roles import resolve_binding

KEY = "sk-or-v1-TEST-c0ffee-DISTINCTIVE-5f3a9e"
ENV = "COMPOSER_MESH_TEST_OR_KEY"
MODEL = "fake/teacher-1"


class ByteTokenizer:
    """A stand-in student tokenizer (ids = UTF-8 bytes): different from the teacher's word tokens."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class RecordingSleep:
    """Records requested backoff delays and yields once instead of waiting them out."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await asyncio.sleep(0)


@pytest.fixture(scope="module")
def fake() -> Any:
    with serving(KEY) as server:
        yield server


@pytest.fixture(autouse=True)
def _env_and_leak_check(fake: FakeOpenRouter, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Any:
    fake.reset()
    monkeypatch.setenv(ENV, KEY)
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore", "composer_mesh", "asyncio"):
        caplog.set_level(logging.DEBUG, logger=name)
    yield
    for record in caplog.records:
        line = record.getMessage()
        assert KEY not in line, f"API key leaked into log record from {record.name}"
        assert "c0ffee-DISTINCTIVE" not in line
    assert KEY not in caplog.text


def assert_no_key(exc: BaseException) -> None:
    """The key is in no text or repr of the exception, its args, or anything chained to it."""
    seen: BaseException | None = exc
    while seen is not None:
        for text in (str(seen), repr(seen), *(repr(a) for a in seen.args)):
            assert KEY not in text
        seen = seen.__cause__ or seen.__context__


def settings(fake: FakeOpenRouter, **kw: Any) -> OpenRouterSettings:
    base: dict[str, Any] = {
        "base_url": fake.base_url,
        "models": [MODEL],
        "api_key_env": ENV,
        "top_logprobs": 3,
        "backoff_base": 0.2,
        "request_timeout": 5.0,
        "max_retries": 3,
    }
    base.update(kw)
    return OpenRouterSettings(**base)


def client(fake: FakeOpenRouter, sleep: RecordingSleep | None = None, **kw: Any) -> OpenRouterClient:
    return OpenRouterClient(settings(fake, **kw), sleep=sleep or RecordingSleep(), rng=random.Random(0))


def teacher(fake: FakeOpenRouter, sleep: RecordingSleep | None = None, **kw: Any) -> OpenRouterTeacher:
    t = OpenRouterTeacher(settings(fake, **kw), sleep=sleep or RecordingSleep(), rng=random.Random(0))
    t.start(ByteTokenizer(), "t0")
    return t


def prompts(n: int) -> list[Prompt]:
    return [Prompt(prompt_id=f"p{i}", text=f"question {i}", token_ids=[]) for i in range(n)]


# ------------------------------------------------------------------------------------------ success paths
async def test_success_with_logprobs_and_request_shape(fake: FakeOpenRouter) -> None:
    t = teacher(fake, top_logprobs=3, temperature=0.5, seed=7)
    traces = await t.traces(prompts(2), max_new_tokens=64)

    assert [tr.prompt_id for tr in traces] == ["p0", "p1"]
    for i, tr in enumerate(traces):
        assert tr.teacher == "t0"
        assert tr.text == teacher_text(f"question {i}")
        assert tr.completion_ids == ByteTokenizer().encode(tr.text)  # re-tokenised into student ids
    # The two requests run concurrently: the server may see them in either order.
    assert sorted(r["messages"][0]["content"] for r in fake.requests) == ["question 0", "question 1"]
    req = next(r for r in fake.requests if r["messages"][0]["content"] == "question 0")
    assert req["model"] == MODEL and "models" not in req  # one model: no routing list
    assert req["messages"] == [{"role": "user", "content": "question 0"}]
    assert req["logprobs"] is True and req["top_logprobs"] == 3
    assert req["provider"] == {"require_parameters": True}
    assert req["max_tokens"] == 64 and req["temperature"] == 0.5 and req["seed"] == 7
    assert "authorization" not in {k.lower() for k in fake.headers[0]}  # (stripped by the fake; auth passed)
    await t.aclose()


async def test_client_returns_teacher_logprobs(fake: FakeOpenRouter) -> None:
    c = client(fake, top_logprobs=4)
    r = await c.complete("question 9", max_tokens=100)
    expected = completion_body({"messages": [{"content": "question 9"}], "logprobs": True, "top_logprobs": 4})
    want = expected["choices"][0]["logprobs"]["content"]
    assert r.logprobs is not None and not r.logprobs_missing
    assert [lp.token for lp in r.logprobs] == [w["token"] for w in want]
    assert "".join(lp.token for lp in r.logprobs) == r.text
    assert all(len(lp.top) == 4 for lp in r.logprobs)
    assert r.logprobs[1].logprob == pytest.approx(-0.2)
    assert r.provider == "FakeProvider" and r.finish_reason == "stop" and r.attempts == 1
    await c.aclose()


async def test_max_tokens_cap_and_student_budget(fake: FakeOpenRouter) -> None:
    t = teacher(fake, max_tokens=3)
    [tr] = await t.traces(prompts(1), max_new_tokens=10)
    assert fake.requests[0]["max_tokens"] == 3  # min(settings cap, caller budget)
    # the fake's 3 teacher tokens are "The answer to" = 13 student (byte) tokens: cut to the budget of 10
    assert len(tr.completion_ids) == 10
    assert tr.text == "The answer" and ByteTokenizer().encode(tr.text) == tr.completion_ids
    await t.aclose()


# ------------------------------------------------------------------------------------------ retries
async def test_429_with_retry_after_is_honoured(fake: FakeOpenRouter) -> None:
    sleep = RecordingSleep()
    c = client(fake, sleep)
    fake.push(Reply(429, error_body(429, "Rate limit exceeded"), headers={"Retry-After": "2"}))
    r = await c.complete("question 1", max_tokens=8)
    assert r.text and r.attempts == 2
    assert sleep.delays == [2.0]  # the server's value, not the client's backoff
    u = c.usage()
    assert u["requests"] == 2 and u["retries"] == 1 and u["failed_requests"] == 0 and u["completions"] == 1
    await c.aclose()


async def test_429_retry_after_is_capped(fake: FakeOpenRouter) -> None:
    sleep = RecordingSleep()
    c = client(fake, sleep, retry_after_max=5.0)
    fake.push(Reply(429, error_body(429, "slow down"), headers={"Retry-After": "3600"}))
    await c.complete("q", max_tokens=8)
    assert sleep.delays == [5.0]
    await c.aclose()


async def test_429_without_retry_after_uses_exponential_backoff_with_jitter(fake: FakeOpenRouter) -> None:
    sleep = RecordingSleep()
    c = client(fake, sleep, backoff_base=0.2, backoff_max=10.0)
    fake.push(*[Reply(429, error_body(429, "Rate limit exceeded")) for _ in range(3)])
    r = await c.complete("q", max_tokens=8)
    assert r.attempts == 4 and len(sleep.delays) == 3
    for i, d in enumerate(sleep.delays):  # base * 2**i, jittered into [50%, 100%]
        assert 0.2 * 2**i * 0.5 <= d <= 0.2 * 2**i
    assert len(set(sleep.delays)) == 3
    await c.aclose()


def test_parse_retry_after_seconds_and_http_date() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("7", cap=60) == 7.0
    assert parse_retry_after("0.5", cap=60) == 0.5
    assert parse_retry_after(formatdate(now + 30, usegmt=True), cap=60, now=now) == pytest.approx(30.0)
    assert parse_retry_after(formatdate(now + 300, usegmt=True), cap=60, now=now) == 60.0  # capped
    assert parse_retry_after(formatdate(now - 30, usegmt=True), cap=60, now=now) == 0.0  # past date
    assert parse_retry_after("-4", cap=60) == 0.0
    assert parse_retry_after(None, cap=60) is None
    assert parse_retry_after("soon", cap=60) is None


async def test_429_with_http_date_retry_after(fake: FakeOpenRouter) -> None:
    sleep = RecordingSleep()
    c = client(fake, sleep)
    fake.push(Reply(429, error_body(429, "later"), headers={"Retry-After": formatdate(time.time() + 20, usegmt=True)}))
    await c.complete("q", max_tokens=8)
    assert len(sleep.delays) == 1 and 15.0 <= sleep.delays[0] <= 20.0
    await c.aclose()


async def test_500_then_success(fake: FakeOpenRouter) -> None:
    sleep = RecordingSleep()
    t = teacher(fake, sleep)
    fake.push(Reply(500, error_body(500, "internal error")), Reply(502, raw=b"Bad Gateway"))
    [tr] = await t.traces(prompts(1), max_new_tokens=64)
    assert tr.text == teacher_text("question 0")
    assert len(sleep.delays) == 2
    u = t.usage()
    assert u["requests"] == 3 and u["retries"] == 2 and u["failed_requests"] == 0
    await t.aclose()


async def test_5xx_exhausts_retries(fake: FakeOpenRouter) -> None:
    c = client(fake, max_retries=2)
    fake.push(*[Reply(503, error_body(503, "No endpoints found matching your data policy")) for _ in range(3)])
    with pytest.raises(OpenRouterHTTPError) as info:
        await c.complete("q", max_tokens=8)
    assert info.value.status == 503 and "gave up after 3 attempts" in str(info.value)
    assert "No endpoints found" in str(info.value) and "FakeProvider" in str(info.value)
    assert c.usage()["failed_requests"] == 1 and c.usage()["requests"] == 3
    assert_no_key(info.value)
    await c.aclose()


async def test_non_retryable_status_is_not_retried(fake: FakeOpenRouter) -> None:
    sleep = RecordingSleep()
    c = client(fake, sleep)
    fake.push(Reply(402, error_body(402, "Insufficient credits")))
    with pytest.raises(OpenRouterHTTPError) as info:
        await c.complete("q", max_tokens=8)
    assert info.value.status == 402 and "credits" in str(info.value)
    assert sleep.delays == [] and len(fake.requests) == 1
    await c.aclose()


async def test_timeout_then_success_and_timeout_exhausted(fake: FakeOpenRouter) -> None:
    sleep = RecordingSleep()
    # 1 s: a localhost answer on a loaded machine must still beat it (it was 0.25 s); the slow replies take 3 s
    c = client(fake, sleep, request_timeout=1.0, max_retries=1)
    fake.push(Reply(success=True, delay=3.0))
    r = await c.complete("q", max_tokens=8)  # first attempt times out, the retry succeeds
    assert r.attempts == 2 and len(sleep.delays) == 1

    fake.push(Reply(success=True, delay=3.0), Reply(success=True, delay=3.0))
    with pytest.raises(OpenRouterTimeout) as info:
        await c.complete("q", max_tokens=8)
    msg = str(info.value)
    assert "timed out after 1.0s" in msg and "gave up after 2 attempts" in msg
    assert info.value.__context__ is None  # no httpx exception (holding the request) chained on
    assert_no_key(info.value)
    assert c.usage()["failed_requests"] == 1
    await c.aclose()


async def test_connection_refused_is_a_redacted_transport_error(fake: FakeOpenRouter) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = client(fake, base_url=f"http://127.0.0.1:{port}/api/v1", max_retries=1)
    with pytest.raises(OpenRouterTransportError) as info:
        await c.complete("q", max_tokens=8)
    assert "ConnectError" in str(info.value) and f"127.0.0.1:{port}" in str(info.value)
    assert info.value.__context__ is None  # the httpx exception (which holds the request) is not chained
    assert_no_key(info.value)
    await c.aclose()


# ------------------------------------------------------------------------------------------ bad bodies
async def test_malformed_body_is_a_clear_error(fake: FakeOpenRouter) -> None:
    c = client(fake, max_retries=1)
    fake.push(Reply(200, raw=b"<html>upstream proxy says hi"), Reply(200, raw=b"{\"choices\": []}"))
    with pytest.raises(OpenRouterResponseError) as info:
        await c.complete("q", max_tokens=8)
    assert "malformed completion: `choices` is missing or empty" in str(info.value)
    assert len(fake.requests) == 2  # the bad JSON (first) was retried once

    fake.push(Reply(200, raw=b"<html>upstream proxy says hi"))
    c2 = client(fake, max_retries=0)
    with pytest.raises(OpenRouterResponseError) as info:
        await c2.complete("q", max_tokens=8)
    assert "malformed response body (JSONDecodeError" in str(info.value) and "<html>upstream" in str(info.value)
    await c.aclose()
    await c2.aclose()


async def test_wrong_types_in_completion(fake: FakeOpenRouter) -> None:
    c = client(fake, max_retries=0)
    body = completion_body({"messages": [{"content": "q"}], "logprobs": True, "top_logprobs": 1})
    body["choices"][0]["logprobs"]["content"][0]["logprob"] = "very likely"
    fake.push(Reply(200, body))
    with pytest.raises(OpenRouterResponseError, match=r"logprobs.content\[0\].logprob` is not a number"):
        await c.complete("q", max_tokens=8)
    await c.aclose()


async def test_error_inside_http_200(fake: FakeOpenRouter) -> None:
    sleep = RecordingSleep()
    c = client(fake, sleep)
    fake.push(Reply(200, error_body(502, "Provider returned error")))  # upstream failure mid-request: retried
    r = await c.complete("q", max_tokens=8)
    assert r.attempts == 2 and len(sleep.delays) == 1

    fake.push(Reply(200, error_body(400, "context length exceeded")))  # a request error: not retried
    with pytest.raises(OpenRouterHTTPError) as info:
        await c.complete("q", max_tokens=8)
    assert "error object inside an HTTP 200 (code 400)" in str(info.value) and info.value.status == 400
    assert len(sleep.delays) == 1

    body = completion_body({"messages": [{"content": "q"}]})
    body["choices"][0]["finish_reason"] = "error"
    fake.push(Reply(200, body))
    r = await c.complete("q", max_tokens=8)  # finish_reason "error" counts as an upstream failure
    assert r.attempts == 2
    await c.aclose()


async def test_missing_logprobs_is_an_error_by_default(fake: FakeOpenRouter) -> None:
    t = teacher(fake)
    fake.push(Reply(success=True, logprobs=False))
    with pytest.raises(TeacherUnavailable) as info:  # the teacher's error, from the client's
        await t.traces(prompts(1), max_new_tokens=64)
    assert isinstance(info.value.__cause__, OpenRouterMissingLogprobs)
    assert "log-probs were requested but the response has none" in str(info.value)
    assert "require_parameters" in str(info.value) and "p0" in str(info.value)
    assert len(fake.requests) == 1  # not retried
    assert t.usage()["missing_logprobs"] == 1 and t.usage()["failed_requests"] == 1
    await t.aclose()


async def test_missing_logprobs_flagged(fake: FakeOpenRouter) -> None:
    t = teacher(fake, missing_logprobs="flag")
    fake.push(Reply(success=True, logprobs=False))
    [tr] = await t.traces(prompts(1), max_new_tokens=64)
    assert tr.text == teacher_text("question 0")
    assert t.usage()["missing_logprobs"] == 1 and t.usage()["failed_requests"] == 0
    c = client(fake, missing_logprobs="flag")
    fake.push(Reply(success=True, logprobs=False))
    r = await c.complete("q", max_tokens=8)
    assert r.logprobs is None and r.logprobs_missing
    await t.aclose()
    await c.aclose()


async def test_logprobs_not_requested(fake: FakeOpenRouter) -> None:
    c = client(fake, logprobs=False)
    r = await c.complete("q", max_tokens=8)
    assert "logprobs" not in fake.requests[0] and "top_logprobs" not in fake.requests[0]
    assert r.logprobs is None and not r.logprobs_missing
    await c.aclose()


# ------------------------------------------------------------------------------------------ model routing
async def test_openrouter_models_routing_field(fake: FakeOpenRouter) -> None:
    c = client(fake, models=["a/first", "b/second"], require_parameters=False)
    await c.complete("q", max_tokens=8)
    req = fake.requests[0]
    assert req["model"] == "a/first" and req["models"] == ["a/first", "b/second"]
    assert "provider" not in req
    await c.aclose()


async def test_client_side_model_fallback(fake: FakeOpenRouter) -> None:
    c = client(fake, models=["a/first", "b/second"], model_fallback="client", max_retries=0)
    fake.push(Reply(success=True, logprobs=False))  # the first model's provider drops log-probs
    r = await c.complete("q", max_tokens=8)
    assert [q["model"] for q in fake.requests] == ["a/first", "b/second"]
    assert all("models" not in q for q in fake.requests)
    assert r.model == "b/second" and r.logprobs

    fake.reset()
    fake.push(Reply(401, error_body(401, "User not found")))  # auth fails alike for every model: no fallback
    with pytest.raises(OpenRouterHTTPError):
        await c.complete("q", max_tokens=8)
    assert len(fake.requests) == 1
    await c.aclose()


# ------------------------------------------------------------------------------------------ key handling
def test_missing_key_names_the_variable(fake: FakeOpenRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV)
    t = OpenRouterTeacher(settings(fake))
    with pytest.raises(OpenRouterConfigError) as info:
        t.start(ByteTokenizer(), "t0")
    assert ENV in str(info.value) and "not set" in str(info.value)
    monkeypatch.setenv(ENV, "   ")
    with pytest.raises(OpenRouterConfigError, match=ENV):
        OpenRouterClient(settings(fake))
    bad = KEY + "\u00e9x"  # a header library would quote this value in its error: rejected up front
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(OpenRouterConfigError, match="printable ASCII") as info:
        OpenRouterClient(settings(fake))
    assert bad not in str(info.value) and KEY not in repr(info.value)


async def test_wrong_key_is_a_non_retryable_401_without_the_key(fake: FakeOpenRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = KEY + "-WRONG"
    monkeypatch.setenv(ENV, wrong)
    c = client(fake)
    with pytest.raises(OpenRouterHTTPError) as info:
        await c.complete("q", max_tokens=8)
    assert info.value.status == 401 and ENV in str(info.value) and len(fake.requests) == 0
    assert wrong not in str(info.value)
    await c.aclose()


async def test_key_echoed_by_server_is_redacted(fake: FakeOpenRouter) -> None:
    c = client(fake, max_retries=1)
    fake.push(
        Reply(429, error_body(429, f"key {KEY} is rate limited")),
        Reply(500, raw=f"oops Authorization: Bearer {KEY}".encode()),
    )
    with pytest.raises(OpenRouterHTTPError) as info:
        await c.complete("q", max_tokens=8)
    assert "[REDACTED]" in str(info.value)
    assert_no_key(info.value)
    fake.push(Reply(200, raw=f"not json {KEY}".encode()))
    with pytest.raises(OpenRouterResponseError) as info2:
        await client(fake, max_retries=0).complete("q", max_tokens=8)
    assert_no_key(info2.value)
    await c.aclose()


async def test_key_absent_from_reprs_pickles_usage_and_settings(fake: FakeOpenRouter) -> None:
    t = teacher(fake)
    await t.traces(prompts(1), max_new_tokens=8)
    assert t._client is not None
    for obj in (t, t.settings, t._client, t._client._auth, t._client._http):
        assert KEY not in repr(obj) and KEY not in str(obj)
    assert KEY not in repr(t.settings.model_dump()) and KEY not in t.settings.model_dump_json()
    assert KEY not in repr(t.usage())
    assert KEY.encode() not in pickle.dumps(t)  # the teacher pickles without its client
    restored = pickle.loads(pickle.dumps(t))
    assert restored._client is None and restored.settings == t.settings
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(t._client)
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(t._client._auth)
    await t.aclose()


def test_settings_validation_never_echoes_a_pasted_key(fake: FakeOpenRouter) -> None:
    with pytest.raises(ValidationError) as info:
        OpenRouterSettings(models=[MODEL], api_key_env=KEY)  # the key pasted where its NAME belongs
    assert "api_key_env" in str(info.value) and KEY not in str(info.value)
    with pytest.raises(ValidationError) as info:
        OpenRouterSettings.model_validate({"models": [MODEL], "api_key": KEY})  # extra="forbid"
    assert "api_key" in str(info.value) and KEY not in str(info.value)
    with pytest.raises(ValidationError, match="top_logprobs"):
        OpenRouterSettings(models=[MODEL], top_logprobs=21)
    with pytest.raises(ValidationError, match="models"):
        OpenRouterSettings(models=[])
    with pytest.raises(ValidationError, match="base_url"):
        OpenRouterSettings(models=[MODEL], base_url="openrouter.ai/api/v1")


# ------------------------------------------------------------------------------------------ concurrency
async def test_concurrency_bound_is_respected(fake: FakeOpenRouter) -> None:
    t = teacher(fake, max_concurrency=2)
    fake.default_delay = 0.15
    traces = await t.traces(prompts(6), max_new_tokens=64)
    assert [tr.prompt_id for tr in traces] == [f"p{i}" for i in range(6)]  # order kept
    assert len(fake.requests) == 6
    assert fake.max_inflight == 2  # requests overlapped, but never more than the bound
    await t.aclose()


async def test_slow_teacher_does_not_block_the_event_loop(fake: FakeOpenRouter) -> None:
    t = teacher(fake)
    fake.default_delay = 0.5
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    tick_task = asyncio.create_task(ticker())
    await t.traces(prompts(2), max_new_tokens=8)
    ticks_during_request = ticks
    done.set()
    await tick_task
    assert ticks_during_request >= 5  # other coroutines kept running while the requests were in flight
    await t.aclose()


async def test_batch_failure_waits_for_all_and_names_the_prompt(fake: FakeOpenRouter) -> None:
    t = teacher(fake, max_retries=0, max_concurrency=1, partial_traces=False)
    fake.push(Reply(success=True), Reply(400, error_body(400, "bad prompt")))
    with pytest.raises(TeacherUnavailable) as info:  # the pool applies the member's on_failure
        await t.traces(prompts(4), max_new_tokens=8)
    assert "1/4 requests failed" in str(info.value) and "prompt 'p1'" in str(info.value)
    assert "OpenRouterHTTPError" in str(info.value) and "bad prompt" in str(info.value)
    assert isinstance(info.value.__cause__, OpenRouterHTTPError) and info.value.__cause__.status == 400
    assert len(fake.requests) == 4  # the other requests still completed (no orphaned, still-billing tasks)
    u = t.usage()
    assert u["completions"] == 3 and u["failed_requests"] == 1
    await t.aclose()


async def test_partial_traces_keep_the_successful_prompts(fake: FakeOpenRouter) -> None:
    t = teacher(fake, max_retries=0, max_concurrency=1)  # partial_traces defaults to True
    fake.push(Reply(success=True), Reply(400, error_body(400, "bad prompt")))
    traces = await t.traces(prompts(4), max_new_tokens=64)
    assert [tr.prompt_id for tr in traces] == ["p0", "p2", "p3"]
    assert t.usage()["failed_requests"] == 1

    fake.push(*[Reply(400, error_body(400, "bad prompt")) for _ in range(2)])
    with pytest.raises(TeacherUnavailable, match="2/2 requests failed"):  # nothing usable: raise
        await t.traces(prompts(2), max_new_tokens=64)
    await t.aclose()


async def test_usage_and_cost_accumulate(fake: FakeOpenRouter) -> None:
    t = teacher(fake)
    fake.push(Reply(429, error_body(429, "slow")))
    ps = prompts(3)
    await t.traces(ps, max_new_tokens=64)
    await t.traces(ps[:1], max_new_tokens=64)
    bodies = [completion_body({"messages": [{"content": p.text}], "max_tokens": 64}) for p in [*ps, ps[0]]]
    u = t.usage()
    assert u["prompt_tokens"] == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert u["completion_tokens"] == sum(b["usage"]["completion_tokens"] for b in bodies)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["cost"] == pytest.approx(sum(b["usage"]["cost"] for b in bodies))
    assert u["completions"] == 4 and u["requests"] == 5 and u["retries"] == 1 and u["failed_requests"] == 0
    assert all(isinstance(v, float) for v in u.values())
    await t.aclose()


# ------------------------------------------------------------------------------------------ binding
async def test_binding_is_replay_only_and_distributions_raise(fake: FakeOpenRouter) -> None:
    b = resolve_binding("teachers", "openrouter")
    assert b.cls is OpenRouterTeacher and b.capabilities == frozenset({"replay"})
    assert "distill" not in OpenRouterTeacher.capabilities
    t = b.build({"models": [MODEL], "base_url": fake.base_url, "api_key_env": ENV})
    t.start(ByteTokenizer(), "t0")
    rollout = Rollout(prompt_id="p0", prompt_ids=[1], completion_ids=[2, 3], logprobs=[-1.0, -1.0], weight_version=0)
    with pytest.raises(TeacherCapabilityError, match=r"channels: \[replay\]"):
        await t.distributions([rollout], top_k=5)
    assert len(fake.requests) == 0


async def test_traces_before_start_is_a_clear_error(fake: FakeOpenRouter) -> None:
    t = OpenRouterTeacher(settings(fake))
    with pytest.raises(RuntimeError, match="call start"):
        await t.traces(prompts(1), max_new_tokens=8)


class DigitTokenizer:
    """A character-level student (like the tiny model's): characters outside its alphabet are dropped."""

    alphabet = "0123456789+=;"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.alphabet.index(ch) for ch in text if ch in self.alphabet]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i] for i in ids)


async def test_traces_the_student_cannot_represent_are_dropped_not_mangled(fake: FakeOpenRouter) -> None:
    t = OpenRouterTeacher(settings(fake, max_concurrency=1), sleep=RecordingSleep())
    t.start(DigitTokenizer(), "t0")
    body = completion_body({"messages": [{"content": "1+2="}], "logprobs": True}, answer=addition_answer)
    fake.push(Reply(200, body))  # p0 gets "3;" (representable); the rest get English the student cannot spell
    traces = await t.traces([Prompt("p0", "1+2=", []), Prompt("p1", "2+2=", [])], max_new_tokens=8)
    assert [(tr.prompt_id, tr.text, tr.completion_ids) for tr in traces] == [("p0", "3;", [3, 12])]
    assert t.usage()["untokenizable_traces"] == 1

    with pytest.raises(TeacherTraceError, match="cannot be written in the student's vocabulary") as info:
        await t.traces([Prompt("p1", "2+2=", [])], max_new_tokens=8)
    assert isinstance(info.value, TeacherUnavailable)  # the hosted model's text: an expected failure
    assert t.usage()["untokenizable_traces"] == 2
    await t.aclose()


def test_fake_addition_teacher() -> None:
    assert addition_answer("3+4=") == "7;" and addition_answer("12+30=") == "42;"


async def test_student_tokenizer_from_model_config(fake: FakeOpenRouter) -> None:
    """The real path: ModelConfig -> the tiny model's tokenizer (imports transformers; no model is built)."""
    from composer_mesh.models.config import ModelConfig

    with pytest.raises(OpenRouterConfigError, match="student's model config"):
        load_student_tokenizer(None)
    tok = load_student_tokenizer(ModelConfig())
    server = FakeOpenRouter(api_key=KEY, answer=addition_answer)
    server.start()
    try:
        t = OpenRouterTeacher(settings(fake, base_url=server.base_url))
        t.start(ModelConfig(), "t0")
        [tr] = await t.traces([Prompt("p0", "3+4=", [])], max_new_tokens=8)
        assert tr.text == "7;" and tr.completion_ids == list(tok.encode("7;", add_special_tokens=False))
        assert len(tr.completion_ids) == 2
        await t.aclose()
    finally:
        server.stop()


TOPOLOGY = """
name: or-check
model: {source: tiny}
meshes:
  cpu: {backend: local}
roles:
  trainer: {mesh: cpu, binding: hf}
  generators: {mesh: cpu, binding: hf}
  rewarder: {mesh: cpu, binding: python, settings: {functions: [{path: "composer_mesh.tasks.arithmetic:exact_match"}]}}
  teachers:
    mesh: cpu
    members:
      - {name: api, binding: openrouter, channels: CHANNELS, settings: SETTINGS}
loss: {alpha_sdpo: 0, beta_replay: 0.2}
"""


@pytest.mark.parametrize(
    ("channels", "settings_yaml", "expected"),
    [
        ("[replay]", "{models: [a/b]}", None),
        ("[distill, replay]", "{models: [a/b]}", "cannot feed channel 'distill'"),
        ("[replay]", "{models: [a/b], api_key: KEY}", "unknown key 'api_key'"),
        ("[replay]", "{models: [a/b], api_key_env: KEY}", "must be the NAME of an environment variable"),
    ],
)
def test_topology_validation_of_an_openrouter_teacher(channels: str, settings_yaml: str, expected: str | None) -> None:
    """The validator rejects channel 2 for this binding (capability) and never echoes a pasted key."""
    from composer_mesh.topology import TopologyError, parse_topology

    text = TOPOLOGY.replace("CHANNELS", channels).replace("SETTINGS", settings_yaml.replace("KEY", KEY))
    if expected is None:
        topo = parse_topology(text)
        assert [m.name for m in topo.teachers.members] == ["api"]
        return
    with pytest.raises(TopologyError) as info:
        parse_topology(text)
    assert expected in str(info.value)
    assert_no_key(info.value)


def test_errors_cross_process_boundaries_intact() -> None:
    """Errors are pickled when they reach the controller from an actor: type, text and fields survive."""
    err = OpenRouterHTTPError("POST x: HTTP 429: slow down", status=429, retryable=True)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is OpenRouterHTTPError and str(back) == str(err)
    assert back.status == 429 and back.retryable is True


async def test_in_a_teacher_pool(fake: FakeOpenRouter) -> None:
    """The binding as the pool uses it (plain classes, no Monarch): traces and `<teacher>/<counter>` usage."""
    from composer_mesh.actors.teacher_pool import PoolMember, TeacherPool

    t = OpenRouterTeacher(settings(fake))
    pool = TeacherPool([PoolMember("api", frozenset({"replay"}), t)])
    pool.start(ByteTokenizer())
    signals = await pool.signals(TeacherRequest(prompts=prompts(3), max_new_tokens=64))
    assert sorted(tr.prompt_id for tr in signals.traces) == ["p0", "p1", "p2"]
    assert {tr.teacher for tr in signals.traces} == {"api"}
    assert signals.usage["api/completions"] == 3 and signals.usage["api/failures"] == 0
    assert signals.usage["api/cost"] > 0
    with pytest.raises(ValueError, match="cannot supply"):
        TeacherPool([PoolMember("api", frozenset({"distill"}), OpenRouterTeacher(settings(fake)))])
    await t.aclose()


# ------------------------------------------------------------------------------------------ failures in the pool
@pytest.mark.parametrize(
    ("replies", "cause", "says"),
    [
        (lambda: [Reply(500, error_body(500, "internal error")) for _ in range(2)], OpenRouterHTTPError, "HTTP 500"),
        (lambda: [Reply(429, error_body(429, f"key {KEY} is rate limited")) for _ in range(2)], OpenRouterHTTPError,
         "HTTP 429"),
        (lambda: [Reply(success=True, delay=3.0) for _ in range(2)], OpenRouterTimeout, "timed out after 1.0s"),
        (lambda: [Reply(200, raw=b"<html>upstream proxy") for _ in range(2)], OpenRouterResponseError,
         "malformed response body"),
    ],
    ids=["500", "429", "timeout", "malformed"],
)
async def test_failures_after_retries_are_teacher_unavailable(
    fake: FakeOpenRouter, replies: Any, cause: type, says: str
) -> None:
    """What the client gives up on (after `max_retries`) reaches the pool as `TeacherUnavailable`, from the
    client's error, redacted (the 429 body echoes the key)."""
    t = teacher(fake, max_retries=1, request_timeout=1.0)
    fake.push(*replies())
    with pytest.raises(TeacherUnavailable) as info:
        await t.traces(prompts(1), max_new_tokens=8)
    msg = str(info.value)
    assert "teacher 't0' (binding openrouter): 1/1 requests failed" in msg and cause.__name__ in msg
    assert says in msg and "gave up after 2 attempts" in msg
    assert isinstance(info.value.__cause__, cause)
    assert_no_key(info.value)
    assert t.usage()["failed_requests"] == 1
    await t.aclose()


def _down_and_up(fake: FakeOpenRouter, on_failure: str) -> tuple[Any, OpenRouterTeacher, OpenRouterTeacher]:
    """A pool of two openrouter teachers: `down` points at a port nobody listens on, `up` at the fake server."""
    from composer_mesh.actors.teacher_pool import PoolMember, TeacherPool

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = OpenRouterTeacher(settings(fake, base_url=f"http://127.0.0.1:{port}/api/v1", max_retries=1),
                             sleep=RecordingSleep())
    up = OpenRouterTeacher(settings(fake))
    pool = TeacherPool([PoolMember("down", frozenset({"replay"}), down, on_failure),  # type: ignore[arg-type]
                        PoolMember("up", frozenset({"replay"}), up)])
    pool.start(ByteTokenizer())
    return pool, down, up


async def test_an_unreachable_teacher_is_skipped_and_counted(fake: FakeOpenRouter) -> None:
    pool, down, up = _down_and_up(fake, "skip")
    signals = await pool.signals(TeacherRequest(prompts=prompts(2), max_new_tokens=64))
    assert sorted((tr.teacher, tr.prompt_id) for tr in signals.traces) == [("up", "p0"), ("up", "p1")]
    u = signals.usage
    assert u["down/failures"] == 1 and u["down/skipped_prompts"] == 2 and u["down/failed_requests"] == 2
    assert u["up/failures"] == 0 and u["up/completions"] == 2
    assert "OpenRouterTransportError" in pool.last_errors["down"]
    await down.aclose()
    await up.aclose()


async def test_an_unreachable_teacher_with_stop_stops_naming_it(fake: FakeOpenRouter) -> None:
    pool, down, up = _down_and_up(fake, "stop")
    with pytest.raises(TeacherFailed) as info:
        await pool.signals(TeacherRequest(prompts=prompts(2), max_new_tokens=64))
    assert info.value.teacher == "down" and info.value.channel == "replay"
    assert "channel-3 traces" in str(info.value) and "OpenRouterTransportError" in str(info.value)
    assert_no_key(info.value)
    assert up.usage()["completions"] == 2  # the other teacher's requests finished (none orphaned)
    await down.aclose()
    await up.aclose()
