"""The rewarder role exists exactly for runs that score single completions: a `multi_turn` episode run (scored
by its environment) validates, plans, passes the reward preflight and launches without one; a `single_turn` run
without one, and a `multi_turn` run with one, are refused with one error naming the line."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from composer_mesh.actors.messages import Prompt, Rollout, RolloutGroup
from composer_mesh.app.preflight import check_rewards
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.scoring import NoRewarder, Scoring, ScoringConfig
from composer_mesh.topology import Topology, TopologyError, parse_topology
from composer_mesh.topology.plan import make_plan, render_plan

ROOT = Path(__file__).resolve().parents[2]
HEAD = """\
name: t
meshes:
  cpu: {backend: local}
roles:
  trainer: {mesh: cpu, binding: "topology.fake_bindings:Trainer"}
  generators: {mesh: cpu, binding: "topology.fake_bindings:Generator"}
"""
REWARDER = '  rewarder: {mesh: cpu, binding: "topology.fake_bindings:Rewarder"}\n'
LOSS = "loss: {alpha_sdpo: 0, beta_replay: 0}\n"
EPISODES = "run:\n  rollout: {kind: multi_turn, max_turns: 3}\n  environment: {kind: calculator}\n"


def episode_run() -> Topology:
    return parse_topology(HEAD + LOSS + EPISODES, "episodes.yaml")


def test_a_multi_turn_run_validates_and_plans_without_a_rewarder() -> None:
    topo = episode_run()
    assert topo.rewarder is None and topo.roles.rewarder is None
    assert list(topo.role_configs()) == ["trainer", "generators"]
    assert "rewarder" not in topo.summary() and "generators → cpu" in topo.summary()
    plan = make_plan(topo)
    assert [m.roles for m in plan.meshes] == [("trainer (topology.fake_bindings:Trainer)",
                                               "generators (topology.fake_bindings:Generator)")]
    buf = io.StringIO()
    render_plan(plan, Console(file=buf, width=200, color_system=None))
    flat = " ".join(buf.getvalue().split())
    assert "rollout multi_turn episodes" in flat and "rewarder" not in flat
    check_rewards(topo)  # the reward preflight has nothing to call: no error


def test_a_single_turn_run_without_a_rewarder_is_one_error_naming_roles() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(HEAD + LOSS, "single.yaml")
    [issue] = info.value.errors
    assert (issue.path, issue.line) == ("roles", 4)
    assert issue.message.startswith("a single_turn run (run.rollout.kind) needs roles.rewarder")
    assert "\n" not in issue.message
    assert parse_topology(HEAD + REWARDER + LOSS, "single.yaml").rewarder is not None  # with one: valid


def test_a_multi_turn_run_that_names_a_rewarder_is_refused_at_its_line() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(HEAD + REWARDER + LOSS + EPISODES, "episodes.yaml")
    [issue] = info.value.errors
    assert (issue.path, issue.line) == ("roles.rewarder", 7)
    assert issue.message == ("a multi_turn run never asks a rewarder (run.environment scores its episodes): remove "
                             "roles.rewarder (and mesh 'cpu' if no other role uses it)")


def test_the_shipped_episode_topologies_have_no_rewarder() -> None:
    from composer_mesh.topology import load_topology

    for name in ("topologies/agentic.yaml", "topologies/coding.yaml", "tests/orchestration/tiny_agentic.yaml"):
        topo = load_topology(ROOT / name)
        assert topo.run.rollout.kind == "multi_turn" and topo.rewarder is None, name
        assert "rewarder" not in topo.meshes, name


async def test_scoring_without_a_rewarder_refuses_to_score_completions() -> None:
    run = RunConfig()
    scoring = Scoring(ScoringConfig.of(run, episode_run().loss), None, None)
    prompt = Prompt(prompt_id="p0", text="1+1=")
    group = RolloutGroup(prompt, [Rollout(prompt_id="p0", prompt_ids=[1], completion_ids=[2], logprobs=[0.0],
                                          weight_version=0, text="2")])
    with pytest.raises(NoRewarder, match=r"no roles\.rewarder: single_turn runs need one"):
        await scoring.score([group])


async def test_a_multi_turn_topology_launches_without_a_rewarder() -> None:
    """Real local meshes with probe actors: the roles launched are the file's; nothing asks for a rewarder."""
    from composer_mesh.app.launch import launch
    from composer_mesh.orchestration.mesh_ports import MeshRoles
    from composer_mesh.roles import ROLES
    from tests.mesh.launch.probe_actors import ProbeActor

    probe = '"tests.mesh.launch.probe_actors:ProbeBinding"'
    text = (HEAD.replace('"topology.fake_bindings:Trainer"', probe).replace('"topology.fake_bindings:Generator"', probe)
            + LOSS + EPISODES)
    async with launch(parse_topology(text, "episodes.yaml"), actors=dict.fromkeys(ROLES, ProbeActor)) as mesh:
        assert sorted(mesh.roles) == ["generators", "trainer"] and not mesh.has("rewarder")
        roles = MeshRoles(mesh, 0, lambda meshes: None)
        assert roles.rewarder is None and roles.teachers is None
        assert roles.generators.procs and {w["role"] for w in (await mesh.generators.where.call()).values()} == {
            "generators"}
        with pytest.raises(LookupError, match="declares no 'rewarder' role"):
            mesh.rewarder  # noqa: B018
