"""OpenRouter's wire format read without a client or a connection: a completion body becomes a `ChatResult`, an
error status a retryable-or-not error, every message through the caller's `redact`."""

from __future__ import annotations

import pytest

from composer_mesh.actors.backends.teachers.config import OpenRouterSettings
from composer_mesh.actors.backends.teachers.openrouter_wire import (
    OpenRouterHTTPError,
    OpenRouterMissingLogprobs,
    chat_payload,
    http_error,
    parse_completion,
)

SETTINGS = OpenRouterSettings(models=["a/m", "b/m"], system_prompt="Be brief.", seed=3)


def redact(text: str) -> str:
    return text.replace("SECRET", "[REDACTED]")


def test_a_completion_body_reads_into_a_result_with_its_usage() -> None:
    body = {"model": "a/m", "provider": "P", "usage": {"prompt_tokens": 4, "completion_tokens": 2, "cost": True},
            "choices": [{"finish_reason": "stop", "message": {"content": "7;"},
                         "logprobs": {"content": [{"token": "7", "logprob": -0.1, "top_logprobs": [
                             {"token": "7", "logprob": -0.1}, {"token": "8", "logprob": -2.5}]},
                             {"token": ";", "logprob": 0}]}}]}
    result = parse_completion(SETTINGS, redact, "POST x", "a/m", body)
    assert (result.text, result.provider, result.finish_reason, result.logprobs_missing) == ("7;", "P", "stop", False)
    assert [(t.token, t.logprob, t.top) for t in result.logprobs or []] == [
        ("7", -0.1, [("7", -0.1), ("8", -2.5)]), (";", 0.0, [])]
    assert result.usage == {"prompt_tokens": 4.0, "completion_tokens": 2.0}  # a bool cost is not a number


def test_missing_logprobs_raise_or_are_flagged() -> None:
    body = {"choices": [{"message": {"content": "7;"}}]}
    with pytest.raises(OpenRouterMissingLogprobs, match="SECRET") as info:
        parse_completion(SETTINGS, lambda s: s + " SECRET", "POST x", "a/m", body)
    assert info.value.retryable is False
    flagged = parse_completion(SETTINGS.model_copy(update={"missing_logprobs": "flag"}), redact, "w", "a/m", body)
    assert flagged.logprobs is None and flagged.logprobs_missing


def test_errors_say_whether_they_are_retried_and_go_through_redact() -> None:
    limited = http_error(SETTINGS, redact, "POST x", 429, {"message": "slow down SECRET"}, b"")
    assert isinstance(limited, OpenRouterHTTPError) and limited.retryable and "[REDACTED]" in str(limited)
    denied = http_error(SETTINGS, redact, "POST x", 401, None, b"no")
    assert not denied.retryable and "$OPENROUTER_API_KEY" in str(denied)
    in_200 = http_error(SETTINGS, redact, "POST x", 200, {"message": "provider died", "code": 200}, b"")
    assert (in_200.status, in_200.retryable) == (502, True)


def test_the_request_body() -> None:
    body = chat_payload(SETTINGS, "3+4=", "a/m", 8)
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4="}]
    assert (body["models"], body["seed"], body["max_tokens"], body["provider"]) == (
        ["a/m", "b/m"], 3, 8, {"require_parameters": True})
    chat = chat_payload(SETTINGS, [{"role": "user", "content": "hi"}], "a/m", 8)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]  # messages as given: no system prompt added
