"""`topologies/openenv_tools.yaml` through `composer-mesh run`, shortened: the run starts the shipped lookup MCP
server (a real uvicorn process), plays every prompt as a multi-step episode against it (reset, list_tools, a
CallToolAction per tool call) on real local Monarch meshes, trains on the episodes without a rewarder role, and
stops the server when it ends.

What must show: episodes of more than one policy turn, tool calls that reached the server, the environment's
tokens bridged in and never trained on (GRPO counts policy tokens only), every step's statuses summing to 1, the
held-out episodes evaluated before and after, and nothing left answering on the port."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from composer_mesh import cli
from composer_mesh.tasks.episode import EPISODE_STATUSES
from envs.test_openenv import free_port

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "topologies" / "openenv_tools.yaml"


@pytest.mark.e2e  # a shipped topology run end to end: its own tier (`pytest -m e2e`), run by .ci/run
def test_the_openenv_tools_topology_plays_mcp_episodes_against_its_server(tmp_path: Path) -> None:
    pytest.importorskip("openenv")
    url = f"http://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    sets = [f"run.environment.url={url}", "run.environment.eval_size=2", "run.eval_prompts=2", "run.eval_every=0",
            "run.prompts_per_step=2", "run.samples_per_prompt=2", "run.max_policy_lag=0"]
    argv = ["run", str(TOPOLOGY), "--run-dir", str(run_dir), "--steps", "2"]
    assert cli.main([*argv, *(x for s in sets for x in ("--set", s))]) == cli.EXIT_OK
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        m = r["metrics"]
        assert math.isfinite(r["loss"]) and "grpo" in r["channels"] and r["reward_failures"] == 0
        assert math.isclose(sum(m[f"episode/status_{s}"] for s in EPISODE_STATUSES), 1.0)
        assert m["episode/status_error_environment"] == m["episode/status_error_timeout"] == 0
        assert m["episode/policy_turns"] > r["rollouts"]  # episodes of more than one policy turn
        assert m["episode/env_tokens"] > 0  # tool results (and reminders) bridged in by the chat template
        assert m["grpo/tokens"] == m["episode/policy_tokens"] > 0  # ... and never trained on
    assert sum(r["metrics"]["episode/tool_calls"] for r in steps) > 0  # CallToolActions that reached the server
    assert [e["when"] for e in lines if e.get("event") == "eval"] == ["before", "after"]
    with pytest.raises(httpx.ConnectError):  # the run stopped the server it started
        httpx.get(f"{url}/health", timeout=1.0)
