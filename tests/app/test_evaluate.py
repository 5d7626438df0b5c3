"""`composer-mesh eval` scores what a run scores: its held-out greedy reward and pass@k of a run checkpoint, of
the run's final model directory and of the initial policy equal the run's own `eval` events (metrics.jsonl)
at the same weights. Real meshes, a real run of the tiny topology."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_mesh.app.evaluate import EvalTarget, eval_roles, evaluate_target
from composer_mesh.app.launch import launch
from composer_mesh.cli import EXIT_INVALID, main
from composer_mesh.orchestration.checkpoint import RunCheckpointError
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.topology import Topology, load_topology
from composer_mesh.topology.overrides import Override

TOPOLOGY = Path(__file__).resolve().parent.parent / "orchestration" / "tiny_run.yaml"
# More held-out prompts than the file's 8, so that the numbers are not all 0 or 1.
SETS = [Override("run.steps", 2), Override("run.eval_prompts", 16)]


def _evals(run_dir: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {e["when"]: e for e in lines if e.get("event") == "eval"}


async def _run(run_dir: Path, topology: Path = TOPOLOGY) -> tuple[Topology, dict[str, dict]]:
    topo = load_topology(topology, [*SETS, Override("run.run_dir", str(run_dir))])
    async with launch(topo) as mesh:
        await RLLoop(mesh, topo.run, topo.loss).run()
    return topo, _evals(run_dir)


@pytest.mark.slow  # a run, then eval launching the trainer and generators: about 2 min each
@pytest.mark.parametrize("topology", [TOPOLOGY, TOPOLOGY.with_name("tiny_sharded_run.yaml")],
                         ids=["one-proc-trainer", "sharded-trainer"])
async def test_eval_of_a_run_checkpoint_is_the_runs_eval_at_that_step(tmp_path: Path, topology: Path) -> None:
    run_dir = tmp_path / "run"
    topo, events = await _run(run_dir, topology)
    after = events["after"]
    target = EvalTarget.of(str(run_dir))  # a run directory: its newest full checkpoint, as --resume takes it
    assert target.kind == "run" and target.step == 2 and eval_roles(target, topo) == ["generators", "rewarder", "trainer"]
    result = await evaluate_target(topo, target)
    assert (result.greedy, result.pass_at_k, result.k, result.weight_version) == (
        after["reward"], after["pass_at_k"], after["k"], after["weight_version"])


@pytest.mark.slow  # a run and two evaluations: 1-4 min
async def test_eval_of_the_final_model_and_of_the_initial_policy_are_the_runs_evals(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    topo, events = await _run(run_dir)
    before, after = events["before"], events["after"]
    model = EvalTarget.of(str(run_dir / "checkpoint"))  # the final model directory: no trainer launched
    assert model.kind == "model" and model.step == 2 and eval_roles(model, topo) == ["generators", "rewarder"]
    result = await evaluate_target(load_topology(TOPOLOGY, [*SETS, *model.overrides()]), model)
    assert (result.greedy, result.pass_at_k) == (after["reward"], after["pass_at_k"])

    result = await evaluate_target(topo, EvalTarget.of(None))  # the initial policy
    assert (result.greedy, result.pass_at_k) == (before["reward"], before["pass_at_k"])
    assert (before["reward"], before["pass_at_k"]) != (after["reward"], after["pass_at_k"])  # it tells them apart


def test_a_path_that_is_no_checkpoint_is_one_line_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RunCheckpointError, match="no such checkpoint or run directory"):
        EvalTarget.of(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(TOPOLOGY), "--checkpoint", str(tmp_path / "empty")]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert f"composer-mesh: cannot evaluate --checkpoint {tmp_path / 'empty'}: " in err and "holds no committed" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["eval", str(TOPOLOGY), "--set", "run.eval_promptz=3"]) == EXIT_INVALID
    assert "--set run.eval_promptz: unknown key" in capsys.readouterr().err
    assert main(["eval", str(TOPOLOGY), "--set", "run.eval_prompts=0"]) == EXIT_INVALID
    assert "run.eval_prompts is 0: no held-out prompt to score" in capsys.readouterr().err


def test_a_model_directory_is_the_policy_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "trainer_state.json").write_text('{"step": 7, "weight_version": 8}')
    target = EvalTarget.of(str(tmp_path))
    assert (target.kind, target.step) == ("model", 7)
    topo = load_topology(TOPOLOGY, target.overrides())
    assert topo.model.source == str(tmp_path.resolve()) and topo.model.warmstart is None  # no warm start on top
