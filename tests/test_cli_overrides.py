"""`--set a.b.c=value` on validate / plan / run: applied to the YAML document before validation, so a bad
override fails like a bad line of the file, named by its `--set` key, and the value is never echoed."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_mesh.cli import EXIT_INVALID, EXIT_OK, EXIT_USAGE, main
from composer_mesh.topology import TopologyError, load_topology
from composer_mesh.topology.overrides import Override, OverrideSyntaxError

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ROOT / "topologies" / "local.yaml"
TINY = ROOT / "tests" / "orchestration" / "tiny_run.yaml"


def _sets(*texts: str) -> list[Override]:
    return [Override.parse(t) for t in texts]


def test_values_are_yaml_and_reach_any_field() -> None:
    topo = load_topology(TINY, _sets("run.steps=7", "loss.kl_beta=0", "run.run_dir=out/x",
                                     "roles.rewarder.settings.functions.0.path=composer_mesh.tasks.arithmetic:exact_match",
                                     "meshes.generators.procs_per_host=1", "run.steps=9"))
    assert topo.run.steps == 9  # the last of two overrides of one field wins
    assert topo.loss.kl_beta == 0.0
    assert str(topo.run.run_dir) == "out/x"
    assert topo.meshes["generators"].procs_per_host == 1
    base = load_topology(TINY)
    assert base.run.steps == 3 and base.meshes["generators"].procs_per_host == 2


def test_an_override_creates_the_sections_the_file_lacks_and_null_removes_one() -> None:
    assert load_topology(LOCAL).model.warmstart is not None
    assert load_topology(LOCAL, _sets("model.warmstart=")).model.warmstart is None
    assert load_topology(LOCAL, _sets("model.warmstart=null")).model.warmstart is None
    topo = load_topology(LOCAL, _sets("model.warmstart=null", "model.warmstart.steps=5"))
    assert topo.model.warmstart is not None and topo.model.warmstart.steps == 5
    assert load_topology(LOCAL, _sets("run.eval_pass_k=4")).run.eval_pass_k == 4


@pytest.mark.parametrize(("sets", "expected"), [
    (["run.stepz=3"], "--set run.stepz: unknown key 'stepz' (did you mean 'steps'?)"),
    (["run.steps=0"], "--set run.steps: Input should be greater than or equal to 1 (got 0)"),
    (["run.steps.every=1"], "--set run.steps.every: run.steps is not a mapping (it holds a int value)"),
    (["roles.rewarder.settings.functions.5.path=x:y"],
     "--set roles.rewarder.settings.functions.5.path: roles.rewarder.settings.functions is a list of 1 item(s)"),
    (["model.warmstart={stepz: 3}"], "--set model.warmstart: model.warmstart.stepz: unknown key 'stepz'"),
])
def test_a_bad_override_is_named_by_its_set_key(sets: list[str], expected: str) -> None:
    with pytest.raises(TopologyError) as info:
        load_topology(TINY, _sets(*sets))
    assert expected in str(info.value)
    assert len(info.value.errors) == 1 and info.value.errors[0].line is None  # not a line of the file


def test_validate_exits_1_naming_the_key_and_never_echoes_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(LOCAL), "--set", "run.steps=sk-secret-123"]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "--set run.steps: Input should be a valid integer" in err
    assert "sk-secret" not in err and "Traceback" not in err
    assert main(["validate", str(LOCAL), "--set", "run.steps=12"]) == EXIT_OK
    assert main(["plan", str(LOCAL), "--set", "run.stepz=1"]) == EXIT_INVALID
    assert "--set run.stepz: unknown key" in capsys.readouterr().err
    assert main(["run", str(TINY), "--set", "run.max_policy_lag=-1"]) == EXIT_INVALID  # before anything launches
    assert "--set run.max_policy_lag: Input should be greater than or equal to 0" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["run.steps", "=3", "run..steps=3", "run.steps=[1", "run.steps=sk-x: {"])
def test_a_malformed_set_is_a_usage_error(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(OverrideSyntaxError):
        Override.parse(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(LOCAL), "--set", text])
    assert exit_info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "argument --set" in err and "sk-x" not in err


def test_run_flags_are_overrides_applied_after_set() -> None:
    from composer_mesh.app.runner import flag_overrides

    topo = load_topology(TINY, [*_sets("run.steps=5", "run.run_dir=a"), *flag_overrides(8, "b/c")])
    assert topo.run.steps == 8 and str(topo.run.run_dir) == "b/c"
    assert load_topology(TINY, flag_overrides(None, "123")).run.run_dir == Path("123")  # a name, not a number


def test_a_value_given_twice_is_copied_not_shared() -> None:
    lora = {"r": 4}
    sets = [Override("roles.trainer.settings.lora", lora), Override("roles.trainer.settings.lora.r", 2)]
    assert load_topology(TINY, sets).trainer.settings.lora.r == 2
    assert lora == {"r": 4}  # the override's own value is untouched: the next load sees it as given
    assert load_topology(TINY, sets[:1]).trainer.settings.lora.r == 4
