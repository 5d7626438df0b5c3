"""`run.rollout.hints` is checked before launch: it feeds channel 2 (so a run with hints and no distill teacher
validates, and one with `loss.alpha_sdpo: 0` is refused), it needs generators that score continuations and an
episode run, and its own fields are refused on their own line."""

from __future__ import annotations

import pytest

from composer_mesh.topology import TopologyError, parse_topology

HEAD = """\
name: t
meshes:
  cpu: {backend: local}
roles:
  trainer: {mesh: cpu, binding: hf}
  generators: {mesh: cpu, binding: GENERATOR}
"""
EPISODES = "run:\n  rollout:\n    kind: multi_turn\n    hints: HINTS\n  environment: {kind: calculator}\n"


def topology(loss: str = "{alpha_sdpo: 0.5, beta_replay: 0}", hints: str = "{source: environment}",
             generator: str = "hf", run: str = EPISODES) -> str:
    return HEAD.replace("GENERATOR", generator) + f"loss: {loss}\n" + run.replace("HINTS", hints)


def refusal(text: str) -> tuple[str, int, str]:
    with pytest.raises(TopologyError) as info:
        parse_topology(text, "hints.yaml")
    [issue] = info.value.errors
    assert "\n" not in issue.message
    return issue.path, issue.line, issue.message


def test_hints_feed_channel_2_without_a_teacher() -> None:
    topo = parse_topology(topology(), "hints.yaml")
    assert topo.run.rollout.hints.source == "environment" and topo.roles.teachers is None
    path, _, message = refusal(topology(hints="{source: none}"))  # the same run without hints has no channel 2
    assert path == "loss.alpha_sdpo" and "no teacher has channel 'distill'" in message


def test_hints_with_channel_2_off_are_refused() -> None:
    path, line, message = refusal(topology(loss="{alpha_sdpo: 0, beta_replay: 0}"))
    assert (path, line) == ("run.rollout.hints.source", 11)
    assert message.startswith("run.rollout.hints feeds channel 2, which loss.alpha_sdpo = 0 switches off")


def test_hints_need_generators_that_score_continuations() -> None:
    path, _, message = refusal(topology(generator='"topology.fake_bindings:Generator"'))
    assert path == "run.rollout.hints.source"
    assert "capability 'self_teacher'" in message and "use the hf or vllm generator" in message


def test_hint_fields_are_refused_on_their_line() -> None:
    path, _, message = refusal(topology(hints="{source: rule}"))
    assert path == "run.rollout.hints.source" and "names the rule function exactly when source is rule" in message
    path, _, message = refusal(topology(hints='{source: rule, rule: "no_colon"}'))
    assert path == "run.rollout.hints.rule" and "is not an import path 'pkg.mod:fn'" in message
    path, _, message = refusal(topology(hints='{source: environment, template: "Hint!"}'))
    assert path == "run.rollout.hints.template" and "has no {feedback} placeholder" in message
    path, _, message = refusal(topology(hints="{source: psychic}"))
    assert path == "run.rollout.hints.source"
    single = "run:\n  rollout: {kind: single_turn, hints: {source: environment}}\n"
    with pytest.raises(TopologyError) as info:
        parse_topology(topology(run=single), "hints.yaml")
    assert any("it needs run.rollout.kind multi_turn" in e.message for e in info.value.errors)


POOL = """\
  teachers:
    mesh: cpu
    members:
      - {name: writer, binding: openrouter, channels: [hint], settings: {models: ["openai/gpt-4o-mini"]}}
"""


def test_a_hint_writing_teacher_is_a_member_with_channel_hint() -> None:
    hints = "{source: teacher, teacher: writer}"
    text = HEAD.replace("GENERATOR", "hf") + POOL + "loss: {alpha_sdpo: 0.5, beta_replay: 0}\n" + \
        EPISODES.replace("HINTS", hints)
    topo = parse_topology(text, "hints.yaml")
    assert topo.run.rollout.hints.teacher == "writer" and topo.roles.teachers.members[0].channels == ["hint"]
    path, _, message = refusal(text.replace("teacher: writer}", "teacher: critic}"))
    assert path == "run.rollout.hints.teacher"
    assert message == ("run.rollout.hints.teacher 'critic' is not a teachers member with channels [hint] (members "
                       "with it: ['writer'])")
    path, _, message = refusal(text.replace("channels: [hint]", "channels: [replay]").replace("beta_replay: 0",
                                                                                              "beta_replay: 0.1"))
    assert path == "run.rollout.hints.teacher" and "members with it: none" in message


def test_a_hint_rule_that_does_not_import_is_refused_before_launch() -> None:
    from composer_mesh.app.preflight.setup import setup_problems

    topo = parse_topology(topology(hints='{source: rule, rule: "no_such_module_xyz:hint"}'), "hints.yaml")
    [problem] = setup_problems(topo)
    assert problem.startswith("run.rollout.hints.rule: cannot import module 'no_such_module_xyz'")
    good = topology(hints='{source: rule, rule: "composer_mesh.orchestration.rollout.hints:feedback_rule"}')
    assert setup_problems(parse_topology(good, "hints.yaml")) == []
