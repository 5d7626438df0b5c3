"""PythonRewarder: import-path functions and shell graders; every grader failure is scored data."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from composer_mesh.actors.backends.rewards import PythonRewarder, PythonRewarderSettings
from composer_mesh.actors.messages import Prompt, Rollout
from composer_mesh.roles import resolve_binding

GRADERS = Path(__file__).parent.parent / "graders"
PROMPT = Prompt(prompt_id="p0", text="3+4=", token_ids=[], answer="7")


def rollout(text: str) -> Rollout:
    return Rollout(prompt_id="p0", prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], weight_version=0, text=text)


def shell(name: str, timeout: float = 5.0) -> dict:
    return {"command": [sys.executable, str(GRADERS / f"{name}.py")], "timeout_s": timeout}


def make(**settings) -> PythonRewarder:
    binding = resolve_binding("rewarder", "python")
    return binding.cls(binding.parse_settings(settings))


def test_builtin_task_reward_by_import_path():
    r = make(functions=[{"path": "composer_mesh.tasks.arithmetic:exact_match"}])
    assert r.score(PROMPT, rollout("7;")).score == 1.0
    assert r.score(PROMPT, rollout("8;")).score == 0.0


def test_weighted_sum_of_function_and_shell_grader():
    r = make(functions=[{"path": "graders.pyfuncs:length_bonus", "weight": 0.5}], shell=[shell("exact")])
    res = r.score(PROMPT, rollout("7;"))
    assert res.ok and res.error is None
    assert res.score == pytest.approx(0.5 * 0.5 + 1.0)
    assert set(res.components) == {"length_bonus", "exact.py"}


def test_crashing_grader_is_a_scored_failure():
    r = make(shell=[shell("crash")], failure_score=-1.0)
    res = r.score(PROMPT, rollout("7;"))
    assert not res.ok and res.score == -1.0
    assert "exited with code 3" in res.error and "division by zero" in res.error


def test_hanging_grader_is_killed_at_its_timeout():
    r = make(shell=[shell("hang", timeout=0.5)])
    t0 = time.monotonic()
    res = r.score(PROMPT, rollout("7;"))
    assert time.monotonic() - t0 < 30  # killed, not waited for (60 s)
    assert not res.ok and "timed out after 0.5s" in res.error and res.score == 0.0


def test_garbage_output_is_a_scored_failure():
    res = make(shell=[shell("garbage")]).score(PROMPT, rollout("7;"))
    assert not res.ok and "looks good to me" in res.error


def test_missing_program_is_a_scored_failure():
    res = make(shell=[{"command": ["/nonexistent/grader"]}]).score(PROMPT, rollout("7;"))
    assert not res.ok and "could not start" in res.error


def test_raising_or_nan_function_is_a_scored_failure_and_others_still_count():
    r = make(functions=[{"path": "graders.pyfuncs:broken"}, {"path": "graders.pyfuncs:not_finite"},
                        {"path": "composer_mesh.tasks.arithmetic:exact_match"}])
    res = r.score(PROMPT, rollout("7;"))
    assert not res.ok
    assert "KeyError" in res.error and "returned nan" in res.error
    assert res.components["exact_match"] == 1.0 and res.score == 1.0
    assert r.failures == 1 and r.calls == 1


def test_bad_settings_name_the_problem():
    with pytest.raises(ValidationError, match="at least one reward"):
        PythonRewarderSettings()
    with pytest.raises(ValidationError, match=r"no attribute 'nope'"):
        PythonRewarderSettings(functions=[{"path": "composer_mesh.tasks.arithmetic:nope"}])
    with pytest.raises(ValidationError, match="non-empty argv"):
        PythonRewarderSettings(shell=[{"command": []}])
    with pytest.raises(ValidationError, match="timeout_s"):
        PythonRewarderSettings(shell=[{"command": ["x"], "timeout_s": 0}])
