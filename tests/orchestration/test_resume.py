"""Stop a real run part way (as SIGTERM does: `request_stop`), resume it from its checkpoint, and compare with the
run that was never stopped: bitwise at lag 0 (weights and optimizer state), same steps and every prompt trained
exactly once at lag 1, and the same for two DiLoCo replicas. The CLI's real-signal path is in test_cli_resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from composer_mesh.app.launch import launch, run_config
from composer_mesh.app.runner import apply_overrides, checkpoint_policy, resume_point
from composer_mesh.orchestration.checkpoint import RunCheckpointError
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.orchestration.metrics import RunSummary, StepRecord
from composer_mesh.topology import Topology, load_topology

HERE = Path(__file__).parent


def topology(name: str, run_dir: Path, **run: object) -> Topology:
    topo = apply_overrides(load_topology(HERE / name), None, run_dir)
    topo = topo.model_copy(update={"run": topo.run.model_copy(update=run)})
    if topo.diloco is not None:  # each run its own store, shared by its sessions
        topo = topo.model_copy(update={"diloco": topo.diloco.model_copy(update={"store_uri": f"file://{run_dir}/store"})})
    topo._source = HERE / name
    return topo


async def run_session(topo: Topology, stop_after: int | None = None, resume: bool = False) -> RunSummary:
    """One `composer-mesh run` session; `stop_after`: ask the loop to stop once that step's record is written."""
    point = resume_point(topo, None) if resume else None
    async with launch(topo) as mesh:
        loop: RLLoop

        def progress(record: StepRecord) -> None:
            if stop_after is not None and record.step >= stop_after:
                loop.request_stop("test stop")

        loop = RLLoop(mesh, run_config(topo), topo.loss, progress=progress, checkpoints=checkpoint_policy(topo),
                      resume=point)
        return await loop.run()


def final_state(run_dir: Path, steps: int, replica: int = 0) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{steps:08d}" / "trainer" / f"r{replica}" / "state.safetensors")


def records(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "event" not in r]


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


async def stop_and_resume(topo: Topology, stop_after: int) -> tuple[RunSummary, RunSummary]:
    stopped = await run_session(topo, stop_after=stop_after)
    assert stopped.stopped == "test stop" and stopped.checkpoint is not None
    assert stopped_at(stopped) < topo.run.steps, "the run finished before the stop took effect"
    resumed = await run_session(topo, resume=True)
    assert resumed.stopped is None and resumed.resumed_from == stopped_at(stopped)
    return stopped, resumed


def stopped_at(summary: RunSummary) -> int:
    assert summary.checkpoint is not None
    return int(summary.checkpoint.rsplit("step-", 1)[1])


@pytest.mark.slow  # two runs, one stopped and resumed: about 70 s in CI
async def test_lag_0_resumed_run_is_bitwise_the_uninterrupted_run(tmp_path):
    kw = {"steps": 4, "max_policy_lag": 0, "eval_prompts": 0}
    await run_session(topology("tiny_run.yaml", tmp_path / "whole", **kw))
    cut = topology("tiny_run.yaml", tmp_path / "cut", **kw)
    await stop_and_resume(cut, stop_after=1)
    assert_bitwise(final_state(tmp_path / "whole", 4), final_state(tmp_path / "cut", 4))
    whole, resumed = records(tmp_path / "whole"), records(tmp_path / "cut")
    keys = ("step", "weight_version", "reward", "loss", "channels", "policy_lag", "rollouts", "prompts")
    assert [{k: r[k] for k in keys} for r in whole] == [{k: r[k] for k in keys} for r in resumed]


@pytest.mark.slow  # a stopped and resumed run at lag 1: about 50 s in CI
async def test_lag_1_resumed_run_trains_every_prompt_exactly_once(tmp_path):
    topo = topology("tiny_run.yaml", tmp_path / "cut", steps=5, max_policy_lag=1, eval_prompts=0, checkpoint_every=2)
    stopped, resumed = await stop_and_resume(topo, stop_after=2)
    rows = records(tmp_path / "cut")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    trained = [p for r in rows for p in r["prompts"]]
    assert sorted(trained, key=lambda p: int(p[1:])) == [f"p{i}" for i in range(5 * 4)]  # none twice, none lost
    assert sum(r["rollouts"] for r in rows) == 5 * 4 * 2
    assert [r["weight_version"] for r in rows] == [2, 3, 4, 5, 6]  # one version counter across both sessions
    assert resumed.steps == 5 and resumed.rollouts_trained == (5 - stopped_at(stopped)) * 4 * 2


async def test_lag_1_resumed_run_from_data_trains_every_prompt_exactly_once(tmp_path):
    """`run.data` instead of a task: the stream's position (within an epoch and across) survives stop/resume."""
    from composer_mesh.tasks.data import DataConfig, load_prompt_data

    path = tmp_path / "addition.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(4) for b in range(4)))
    data = DataConfig(path=str(path), eval_size=2)  # 14 train rows: 5 steps x 4 prompts run into a second epoch
    topo = topology("slim_run.yaml", tmp_path / "cut", steps=5, eval_prompts=2, checkpoint_every=2, data=data)
    stopped, resumed = await stop_and_resume(topo, stop_after=2)
    rows = records(tmp_path / "cut")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    trained = [p for r in rows for p in r["prompts"]]
    assert sorted(trained, key=lambda p: int(p[1:])) == [f"p{i}" for i in range(5 * 4)]  # none twice, none lost
    assert resumed.rollouts_trained == (5 - stopped_at(stopped)) * 4 * 2
    saved = json.loads((tmp_path / "cut" / "checkpoints" / "step-00000005" / "controller.json").read_text())
    assert saved["prompts"] == {"kind": "data", "count": 20, "seed": 0, "digest": load_prompt_data(data).digest}
    events = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [e["when"] for e in events if e.get("event") == "eval"] == ["before", "after"]  # on the held-out rows


@pytest.mark.slow  # two DiLoCo replicas run, stopped and resumed: about 50 s in CI
async def test_two_diloco_replicas_resume_bitwise(tmp_path):
    kw = {"steps": 4, "max_policy_lag": 0, "eval_prompts": 0}
    await run_session(topology("diloco_run.yaml", tmp_path / "whole", **kw))
    cut = topology("diloco_run.yaml", tmp_path / "cut", **kw)
    await stop_and_resume(cut, stop_after=1)
    for replica in (0, 1):
        assert_bitwise(final_state(tmp_path / "whole", 4, replica), final_state(tmp_path / "cut", 4, replica))


def test_resume_refuses_a_checkpoint_of_another_topology(tmp_path):
    from composer_mesh.orchestration.checkpoint import CheckpointStore, ControllerState
    from composer_mesh.orchestration.schedule import SchedulerState

    topo = topology("tiny_run.yaml", tmp_path / "run")
    store = CheckpointStore(checkpoint_policy(topo).url)
    saved = topo.training_fingerprint()
    saved["model"]["hidden_size"] = 32
    saved["run"]["prompts_per_step"] = 16
    store.write_controller(ControllerState(1, 2, 1, 4, [3, [0] * 625, None], SchedulerState(1, 4, 1, 0, 0, []), {},
                                           saved, 1))
    store.commit(1, keep=1)
    with pytest.raises(RunCheckpointError) as e:
        resume_point(topo, None)
    assert "model.hidden_size: 32 in the checkpoint, now 64" in str(e.value)
    assert "run.prompts_per_step: 16 in the checkpoint, now 4" in str(e.value)
    # What may change between sessions does not matter: more steps, another run dir for outputs.
    longer = topology("tiny_run.yaml", tmp_path / "run", steps=50, eval_prompts=0)
    assert longer.training_fingerprint() == topo.training_fingerprint()


@pytest.mark.slow  # builds a warm-started byte model once (cached), then three sessions of episode runs
async def test_lag_0_resumed_episode_run_is_bitwise_the_uninterrupted_run(tmp_path):
    """Multi-turn episodes: the episodes finished but not trained are in the checkpoint, the ones in flight are
    played again from their start with the same seeds, and the resumed run is bitwise the uninterrupted one."""
    kw = {"steps": 5, "max_policy_lag": 0}  # 3 steps were over before a stop asked at step 1 took effect
    await run_session(topology("tiny_agentic.yaml", tmp_path / "whole", **kw))
    await stop_and_resume(topology("tiny_agentic.yaml", tmp_path / "cut", **kw), stop_after=1)
    assert_bitwise(final_state(tmp_path / "whole", 5), final_state(tmp_path / "cut", 5))
    whole, resumed = records(tmp_path / "whole"), records(tmp_path / "cut")
    keys = ("step", "weight_version", "reward", "loss", "channels", "rollouts", "prompts")
    assert [{k: r[k] for k in keys} for r in whole] == [{k: r[k] for k in keys} for r in resumed]
    assert any(r["metrics"]["episode/policy_turns"] > r["rollouts"] for r in whole)  # episodes of several turns
