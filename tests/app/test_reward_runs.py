"""Reward functions in `composer-mesh run`: checked on a sample prompt before launch (exit 1 naming the
function), TRL's batched signature trains, and a reward failing on every rollout stops the run (exit 3 naming
the function and its error) instead of training on nothing. The real runs use tests/orchestration/slim_run.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_mesh import cli
from composer_mesh.actors.backends.rewards.rewards import PythonRewarderSettings, check_reward_functions
from composer_mesh.actors.messages import Prompt
from composer_mesh.app.preflight import RewardPreflightError, check_rewards
from composer_mesh.topology import load_topology

SLIM = Path(__file__).parents[1] / "orchestration" / "slim_run.yaml"
EXACT = 'functions: [{path: "composer_mesh.tasks.arithmetic:exact_match"}]'


def topology_file(tmp_path: Path, functions: str, run: str = "", name: str = "run") -> Path:
    text = SLIM.read_text().replace(EXACT, functions)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text + run)  # the run: section is the file's last
    return path


def test_the_sample_check_names_what_raises_hangs_or_returns_the_wrong_type():
    settings = PythonRewarderSettings(functions=[
        {"path": "graders.pyfuncs:trl_reward"}, {"path": "graders.pyfuncs:never_mine"},
        {"path": "graders.pyfuncs:trl_needs_column"}, {"path": "graders.pyfuncs:not_a_number"},
        {"path": "graders.pyfuncs:hang_batch", "timeout_s": 1}])
    sample = Prompt(prompt_id="p0", text="3+4=", token_ids=[], answer="7")
    problems = check_reward_functions(settings, sample)
    assert problems == [
        "reward function 'trl_needs_column' raised TypeError: trl_needs_column() missing 1 required positional "
        "argument: 'solution' (graders.pyfuncs:trl_needs_column, called on a sample prompt '3+4=' with completion '7')",
        "reward function 'not_a_number' returned dict {'score': 1.0}, expected a number (or None: no score) "
        "(graders.pyfuncs:not_a_number, called on a sample prompt '3+4=' with completion '7')",
        "reward function 'hang_batch' timed out after 1s (graders.pyfuncs:hang_batch, called on a sample prompt "
        "'3+4=' with completion '7')",
    ]


def test_a_raising_function_stops_run_before_launch_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = topology_file(tmp_path, 'functions: [{path: "graders.pyfuncs:trl_raises"}]')
    with pytest.raises(RewardPreflightError, match="reward function 'trl_raises' raised ValueError: always"):
        check_rewards(load_topology(path))
    check_rewards(load_topology(topology_file(tmp_path, 'functions: [{path: "graders.pyfuncs:trl_reward"}]',
                                              name="good")))
    assert cli.main(["run", str(path), "--run-dir", str(tmp_path / "run")]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "composer-mesh: reward functions fail on a sample prompt of the run:",
        err.splitlines()[1],
    ] and err.splitlines()[1].startswith("  reward function 'trl_raises' raised ValueError: always (graders.")
    assert "Traceback" not in err and not (tmp_path / "run" / "metrics.jsonl").exists()


def steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r]


@pytest.mark.slow  # a real run: 35-45 s
def test_trl_batched_function_trains_with_a_reward(tmp_path: Path):
    """The function of issue 25 (`def reward(completions, **kwargs)`): every rollout used to fail, reward 0."""
    path = topology_file(tmp_path, 'functions: [{path: "graders.pyfuncs:trl_digits"}]')
    assert cli.main(["run", str(path), "--run-dir", str(tmp_path / "run"), "--steps", "2"]) == cli.EXIT_OK
    records = steps(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["reward_failures"] == 0 and r["reward"] > 0 for r in records), records


@pytest.mark.slow  # a real run: 35-45 s
def test_a_reward_failing_on_every_rollout_stops_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = topology_file(tmp_path, 'functions: [{path: "graders.pyfuncs:trl_service_down"}]',
                         "  stop_after_failed_reward_steps: 2\n")
    assert cli.main(["run", str(path), "--run-dir", str(tmp_path / "run"), "--steps", "6"]) == cli.EXIT_RUN_FAILED
    out, err = capsys.readouterr()
    error = "reward function 'trl_service_down' raised ConnectionError: grader service at localhost:9 refused the connection"
    assert f"step 1: 8/8 rollouts' rewards failed: {error}" in out  # shown as it happens, with the progress
    assert (f"composer-mesh: run stopped: every rollout's reward failed in 2 consecutive steps (steps 1-2); last "
            f"error: {error} (fix the reward, or set run.stop_after_failed_reward_steps: 0 to train on)") in err
    assert "Traceback" not in err
    records = steps(tmp_path / "run")
    assert [(r["step"], r["reward_failures"], r["rollouts"]) for r in records] == [(1, 8, 8), (2, 8, 8)]
