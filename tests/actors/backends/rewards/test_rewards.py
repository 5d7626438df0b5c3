"""PythonRewarder: import-path functions and shell graders; every grader failure is scored data.

Python functions run in worker processes: a hung or crashed one is a scored failure, its worker is replaced,
and no worker outlives its rewarder (closed, collected, or its process killed). The graders of a batch run
concurrently (checked by calls that wait for each other, not by timing).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from composer_mesh.actors.backends.rewards.rewards import PythonRewarder, PythonRewarderSettings
from composer_mesh.actors.messages import Prompt, Rollout, RolloutGroup
from composer_mesh.roles import resolve_binding

GRADERS = Path(__file__).parents[3] / "graders"
PROMPT = Prompt(prompt_id="p0", text="3+4=", token_ids=[], answer="7")


def rollout(text: str) -> Rollout:
    return Rollout(prompt_id="p0", prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], weight_version=0, text=text)


def shell(name: str, timeout: float = 5.0) -> dict:
    return {"command": [sys.executable, str(GRADERS / f"{name}.py")], "timeout_s": timeout}


MISBEHAVE = "graders.pyfuncs:misbehave"
_MADE: list[PythonRewarder] = []


def make(**settings) -> PythonRewarder:
    binding = resolve_binding("rewarder", "python")
    rewarder = binding.cls(binding.parse_settings(settings))
    _MADE.append(rewarder)
    return rewarder


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """The pids of `pids` still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.fixture(autouse=True)
def no_worker_outlives_its_rewarder() -> Iterator[None]:
    """Closes every rewarder a test made; none of the worker processes they ever started may still run."""
    yield
    pids = [pid for r in _MADE if r.pool is not None for pid in r.pool.started_pids]
    for r in _MADE:
        r.close()
    _MADE.clear()
    assert [p for p in pids if alive(p)] == []


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


def test_a_prompts_extra_columns_reach_functions_that_ask_and_shell_graders():
    """`run.data.extra` columns ride on the prompt: a function with an `extra` parameter gets them, one without
    is called as before, and shell graders read them from the JSON on stdin."""
    r = make(functions=[{"path": "graders.pyfuncs:unit_bonus"}, {"path": "graders.pyfuncs:length_bonus"}],
             shell=[shell("extra_echo")])
    with_extra = Prompt(prompt_id="p1", text="3 m + 4 m =", token_ids=[], answer="7", extra={"unit": "m", "weight": 0.25})
    res = r.score(with_extra, rollout("7 m;"))
    assert res.ok, res.error
    assert res.components == {"unit_bonus": 1.0, "length_bonus": 1.0, "extra_echo.py": 0.25}
    bare = r.score(PROMPT, rollout("7;"))
    assert bare.ok and bare.components["unit_bonus"] == 0.0 and bare.components["extra_echo.py"] == 0.0


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


def test_output_that_is_not_utf8_is_a_scored_failure():
    res = make(shell=[shell("binary")]).score(PROMPT, rollout("7;"))
    assert not res.ok and "grader 'binary.py' printed" in res.error


def test_missing_program_is_a_scored_failure():
    res = make(shell=[{"command": ["/nonexistent/grader"]}]).score(PROMPT, rollout("7;"))
    assert not res.ok and "could not start" in res.error


def test_raising_or_nan_function_is_a_scored_failure_and_others_still_count():
    r = make(functions=[{"path": "graders.pyfuncs:broken"}, {"path": "graders.pyfuncs:not_finite"},
                        {"path": "graders.pyfuncs:not_a_number"},
                        {"path": "composer_mesh.tasks.arithmetic:exact_match"}])
    res = r.score(PROMPT, rollout("7;"))
    assert not res.ok
    assert "reward function 'broken' raised KeyError: 'no such field'" in res.error
    assert "reward function 'not_finite' returned nan" in res.error
    assert "reward function 'not_a_number' returned dict {'score': 1.0}, expected a number" in res.error
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
    with pytest.raises(ValidationError, match="timeout_s"):
        PythonRewarderSettings(functions=[{"path": MISBEHAVE, "timeout_s": 0}])
    with pytest.raises(ValidationError, match="workers"):
        PythonRewarderSettings(functions=[{"path": MISBEHAVE}], workers=0)


def test_hanging_function_is_killed_at_its_timeout_and_its_worker_replaced():
    r = make(functions=[{"path": MISBEHAVE, "timeout_s": 0.5}], workers=1)
    first = int(r.score(PROMPT, rollout("pid")).score)
    t0 = time.monotonic()
    res = r.score(PROMPT, rollout("hang"))
    assert time.monotonic() - t0 < 30  # killed, not waited for (an hour)
    assert not res.ok and res.score == 0.0
    assert res.error == "reward function 'misbehave' timed out after 0.5s"
    after = r.score(PROMPT, rollout("pid"))
    assert after.ok and int(after.score) != first and not alive(first)
    assert r.pool is not None and r.pool.started_pids == [first, int(after.score)]
    assert (r.calls, r.failures) == (3, 1)


@pytest.mark.parametrize(
    ("completion", "error"),
    [
        ("exit", "crashed: its worker exited with code 7"),
        ("sigkill", "crashed: its worker was killed by signal SIGKILL"),
    ],
)
def test_function_that_kills_its_worker_is_a_scored_failure_and_the_pool_recovers(completion, error):
    r = make(functions=[{"path": MISBEHAVE}], workers=1, failure_score=-1.0)
    first = int(r.score(PROMPT, rollout("pid")).score)
    res = r.score(PROMPT, rollout(completion))
    assert not res.ok and res.score == -1.0 and res.error == f"reward function 'misbehave' {error}"
    after = r.score(PROMPT, rollout("pid"))
    assert after.ok and int(after.score) not in (first, -1)


def test_sys_exit_in_a_function_is_a_raise_and_keeps_its_worker():
    r = make(functions=[{"path": MISBEHAVE}], workers=1)
    first = r.score(PROMPT, rollout("pid")).score
    res = r.score(PROMPT, rollout("exit_call"))
    assert not res.ok and res.error == "reward function 'misbehave' raised SystemExit: 5"
    assert r.score(PROMPT, rollout("pid")).score == first


def test_failures_in_a_batch_cost_only_their_own_rollouts():
    r = make(functions=[{"path": MISBEHAVE, "timeout_s": 1.0}], workers=2)
    results = r.score_batch([(PROMPT, rollout(c)) for c in ("pid", "hang", "exit", "pid", "sigkill", "pid")])
    assert [x.ok for x in results] == [True, False, False, True, False, True]
    assert [x.error.rsplit(" ", 1)[-1] for x in results if not x.ok] == ["1s", "7", "SIGKILL"]
    assert (r.calls, r.failures) == (6, 3)


def test_function_calls_of_a_batch_run_at_once_in_different_workers(tmp_path: Path):
    """Through the actor's `score_groups`: 2 groups x 2 rollouts, each call waits until all 4 are in flight."""
    from composer_mesh.actors.rewarder import score_groups

    r = make(functions=[{"path": "graders.pyfuncs:together", "timeout_s": 60}], workers=4)
    prompt = Prompt(prompt_id="p0", text="", token_ids=[], answer="4")
    groups = [RolloutGroup(prompt=prompt, rollouts=[rollout(str(tmp_path))] * 2) for _ in range(2)]
    scored = score_groups(r, groups)
    assert [[x.score for x in g.rewards] for g in scored] == [[1.0, 1.0], [1.0, 1.0]]
    assert len({f.name.split(".")[0] for f in tmp_path.iterdir()}) == 4  # four worker pids


def test_shell_graders_of_a_batch_run_at_once(tmp_path: Path):
    r = make(shell=[{**shell("together"), "timeout_s": 60}], workers=3)
    prompt = Prompt(prompt_id="p0", text="", token_ids=[], answer="3")
    results = r.score_batch([(prompt, rollout(str(tmp_path)))] * 3)
    assert [x.score for x in results] == [1.0, 1.0, 1.0], [x.error for x in results]


def test_timeout_also_kills_what_the_function_started(tmp_path: Path):
    child_pid = tmp_path / "child.pid"
    r = make(functions=[{"path": "graders.pyfuncs:leave_child_and_hang", "timeout_s": 3}], workers=1)
    res = r.score(PROMPT, rollout(str(child_pid)))
    assert not res.ok and "timed out after 3s" in res.error
    assert wait_gone([int(child_pid.read_text())]) == []


def test_dropping_the_rewarder_stops_its_workers():
    r = PythonRewarder(PythonRewarderSettings(functions=[{"path": MISBEHAVE}], workers=2))
    assert all(x.ok for x in r.score_batch([(PROMPT, rollout("pid"))] * 4))
    assert r.pool is not None
    pids = list(r.pool.started_pids)
    assert len(pids) == 2 and all(alive(p) for p in pids)
    del r
    gc.collect()
    assert wait_gone(pids, timeout=0) == []


ORPHAN = textwrap.dedent(
    """
    import sys, time
    from composer_mesh.actors.backends.rewards.reward_pool import FunctionPool

    path = "graders.pyfuncs:leave_child_and_hang"
    pool = FunctionPool([path], workers=1)
    pool.submit(path, ("", sys.argv[1], None), 3600.0)
    while not pool.started_pids:
        time.sleep(0.01)
    print(pool.started_pids[0], flush=True)
    time.sleep(3600)
    """
)


def test_workers_exit_when_the_rewarders_process_is_killed(tmp_path: Path):
    """SIGKILL leaves no `close()` to run: the worker notices its lifeline close and takes its group down."""
    child_pid = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN, str(child_pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while not child_pid.exists() and time.monotonic() < deadline:  # the call is running
            time.sleep(0.05)
        child = int(child_pid.read_text())
        assert alive(worker) and alive(child)
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone([worker, child]) == []



async def test_real_rewarder_actor_scores_a_hang_and_a_crash_and_stops_its_workers(rewarder_procs):
    """On a Monarch proc (threads running: workers must not be forked from it): one request mixes a good call,
    a hang and a SIGKILL; stopping the actor (`__cleanup__`) stops its workers while the proc lives on."""
    from composer_mesh.actors.configs import RewarderConfig
    from composer_mesh.actors.rewarder import RewarderActor
    from composer_mesh.bindings import BoundBinding

    settings = PythonRewarderSettings(functions=[{"path": MISBEHAVE, "timeout_s": 1}], workers=2)
    binding = BoundBinding("python", "composer_mesh.actors.backends.rewards.rewards:PythonRewarder", settings)
    actor = rewarder_procs.spawn("rewarder", RewarderActor, RewarderConfig("rewarder", "rewarder", binding))
    group = RolloutGroup(prompt=PROMPT, rollouts=[rollout(c) for c in ("pid", "hang", "sigkill", "pid")])
    [scored] = await actor.score.call_one([group])
    assert [r.ok for r in scored.rewards] == [True, False, False, True]
    assert "'misbehave' timed out after 1s" in scored.rewards[1].error
    assert "'misbehave' crashed: its worker was killed by signal SIGKILL" in scored.rewards[2].error
    [again] = await actor.score.call_one([RolloutGroup(prompt=PROMPT, rollouts=[rollout("pid")] * 4)])
    assert await actor.stats.call_one() == {"calls": 8.0, "failures": 2.0}
    workers = sorted({int(r.score) for r in again.rewards})
    assert workers and all(alive(p) for p in workers)
    await actor.stop()
    assert wait_gone(workers) == []


# ---- the two signatures: per rollout, and TRL's batched one ---------------------------------------------------

def chat_prompt(answer: str = "7") -> Prompt:
    return Prompt(prompt_id="p1", text="user: 3+4=", token_ids=[], answer=answer,
                  messages=[{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="}])


def test_signature_is_read_at_load_time_and_a_misfit_named_in_one_line():
    from composer_mesh.actors.backends.rewards.config import FunctionReward

    assert FunctionReward(path="graders.pyfuncs:trl_reward").style == "batch"
    assert FunctionReward(path="graders.pyfuncs:trl_needs_column").style == "batch"
    assert FunctionReward(path="graders.pyfuncs:unit_bonus").style == "rollout"
    assert FunctionReward(path="composer_mesh.tasks.arithmetic:exact_match").style == "rollout"
    with pytest.raises(ValidationError, match=r"reward function 'graders.pyfuncs:two_args' fits neither signature: "
                       r"fn\(prompt, completion, answer\) -> float \(one rollout\) or TRL's fn\(completions, "
                       r"\*\*kwargs\) -> list\[float\] \(one batch\)") as e:
        PythonRewarderSettings(functions=[{"path": "graders.pyfuncs:two_args"}])
    assert "\n" not in str(e.value.errors()[0]["msg"])


def test_trl_batched_function_scores_every_rollout_of_a_batch_in_one_call():
    """The function of issue 25, `def reward(completions, **kwargs)`: it used to fail on every rollout."""
    r = make(functions=[{"path": "graders.pyfuncs:trl_reward"},
                        {"path": "graders.pyfuncs:trl_batch_size", "weight": 0}], workers=4)
    other = Prompt(prompt_id="p2", text="2+2=", token_ids=[], answer="4")
    results = r.score_batch([(PROMPT, rollout("7;")), (PROMPT, rollout("8;")), (other, rollout("4;"))])
    assert [x.ok for x in results] == [True, True, True], [x.error for x in results]
    assert [x.score for x in results] == [1.0, 0.0, 1.0]
    assert [x.components["trl_batch_size"] for x in results] == [3.0] * 3  # one call for the whole batch


def test_trl_arguments_carry_prompts_completion_ids_and_data_columns():
    r = make(functions=[{"path": "graders.pyfuncs:trl_sees"}, {"path": "graders.pyfuncs:trl_chat", "weight": 0}])
    prompt = Prompt(prompt_id="p0", text="3+4=", token_ids=[], answer="7", extra={"unit": "kg"})
    ro = Rollout(prompt_id="p0", prompt_ids=[1], completion_ids=[5, 6, 7], logprobs=[0.0] * 3, weight_version=0,
                 text="7;")
    [res] = r.score_batch([(prompt, ro)])
    assert res.score == len("3+4=") + 3 + len("kg")
    [chat] = r.score_batch([(chat_prompt(), rollout("7;"))])  # conversational: messages in, messages out
    assert chat.components["trl_chat"] == 2.0 + 1.0


def test_none_is_no_score_from_that_function_and_all_none_is_a_failure():
    r = make(functions=[{"path": "graders.pyfuncs:trl_only_sevens"}, {"path": "graders.pyfuncs:length_bonus",
                                                                      "weight": 2.0}])
    other = Prompt(prompt_id="p2", text="2+2=", token_ids=[], answer="4")
    seven, four = r.score_batch([(PROMPT, rollout("7;")), (other, rollout("4;"))])
    assert seven.ok and seven.score == 1.0 + 2 * 0.5 and seven.components == {"trl_only_sevens": 1.0,
                                                                              "length_bonus": 0.5}
    assert four.ok and four.score == 2 * 0.5 and four.components == {"length_bonus": 0.5}  # left out of the sum
    nobody = make(functions=[{"path": "graders.pyfuncs:never_mine"}, {"path": "graders.pyfuncs:trl_only_sevens"}],
                  failure_score=-1.0)
    [res] = nobody.score_batch([(other, rollout("4;"))])
    assert not res.ok and res.score == -1.0
    assert res.error == "no score: every reward function returned None (never_mine, trl_only_sevens)"


@pytest.mark.parametrize(("path", "error"), [
    ("trl_short", "reward function 'trl_short' returned 1 scores for a batch of 2 completions"),
    ("trl_text", "reward function 'trl_text' returned str 'high' at index 0, expected a number (or None: no score)"),
    ("trl_scalar", "reward function 'trl_scalar' returned float 1.0, expected a list of 2 numbers (or None), one "
                   "per completion"),
    ("trl_raises", "reward function 'trl_raises' raised ValueError: always"),
    ("trl_needs_column", "reward function 'trl_needs_column' raised TypeError: trl_needs_column() missing 1 "
                         "required positional argument: 'solution'"),
    ("not_a_number", "reward function 'not_a_number' returned dict {'score': 1.0}, expected a number (or None: no "
                     "score)"),
])
def test_a_wrong_return_fails_every_rollout_of_the_call_naming_the_function(path: str, error: str):
    r = make(functions=[{"path": f"graders.pyfuncs:{path}"}])
    results = r.score_batch([(PROMPT, rollout("7;")), (PROMPT, rollout("8;"))])
    assert [(x.ok, x.error) for x in results] == [(False, error)] * 2
