"""Experiment trackers (`run.loggers`): step records go through `MetricsWriter` to TensorBoard, W&B (offline)
and MLflow (local store) under the same scalar names, and each library's own reader gets them back; a resumed
session continues the same tracker runs (ids through the checkpoint); bad settings and a missing extra are
errors that say what to do. No Monarch here but the last test, one short stopped-and-resumed run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.metrics import MetricsWriter, StepRecord, step_scalars
from composer_mesh.orchestration.trackers import Trackers, TrackerUnavailable

SECRET = "sk-test-0123456789abcdef0123456789abcdef"  # must never reach a tracker's files


def record(step: int, reward: float) -> StepRecord:
    return StepRecord(
        step=step, weight_version=step + 1, reward=reward, loss=0.5 * step, channels={"grpo": 0.4, "sdpo": 0.1},
        policy_lag=1, weight_sync_s=0.05, step_s=2.0, dropped_batches=0, rollouts=8, elapsed_s=10.0 + step,
        timing={"generate_s": 1.0, "train_s": 0.75, "sync_s": 0.05}, prompts=["p0"],
        metrics={"grad_norm": 1.5, "reward_mean": reward, "sampling/generators": 1.0, "nan_metric": float("nan")},
    )


def session(cfg: RunConfig, steps: range, rewards: float, resume: tuple[dict[str, str], int] | None = None,
            config: dict[str, Any] | None = None) -> dict[str, str]:
    """One run session as the loop drives the writer: trackers opened (continued when `resume` gives the
    checkpoint's tracker ids and step), an eval event, one record per step; returns the ids to checkpoint."""
    ids, step = resume if resume is not None else (None, None)
    trackers = Trackers.open(cfg, config or {"run": cfg.model_dump(mode="json")}, ids, step)
    writer = MetricsWriter(cfg.run_dir, resume_step=step, trackers=trackers)
    try:
        if resume is None:
            writer.write_event("eval", when="before", step=0, reward=0.25, pass_at_k=0.5, k=4, weight_version=1)
        for s in steps:
            writer.write(record(s, rewards + s / 10))
        writer.write_event("checkpoint", step=steps[-1], url="file:///ckpt")
        return writer.tracker_ids
    finally:
        writer.close()


def stopped_and_resumed(cfg: RunConfig) -> tuple[dict[str, str], dict[str, str]]:
    """Session 1 trains steps 1-3 and is checkpointed at step 2 (step 3's logging is then superseded);
    session 2 resumes from that checkpoint and trains steps 3-4 again, with other rewards."""
    first = session(cfg, range(1, 4), rewards=0.0)
    second = session(cfg, range(3, 5), rewards=100.0, resume=(first, 2))
    return first, second


def assert_no_secret(run_dir: Path) -> None:
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []


def test_one_set_of_scalar_names_for_every_tracker() -> None:
    scalars = step_scalars(record(3, 0.7))
    assert scalars["train/reward"] == 0.7 and scalars["train/loss"] == 1.5 and scalars["train/policy_lag"] == 1
    assert scalars["loss/grpo"] == 0.4 and scalars["loss/sdpo"] == 0.1
    assert scalars["time/train_s"] == 0.75 and scalars["time/generate_s"] == 1.0 and scalars["time/step_s"] == 2.0
    assert scalars["perf/samples_per_s"] == 4.0 and scalars["train/rollouts"] == 8
    assert scalars["train/grad_norm"] == 1.5 and scalars["sampling/generators"] == 1.0  # namespaced kept as is
    assert "train/nan_metric" not in scalars  # non-finite values stay in metrics.jsonl only
    assert all(isinstance(v, float) for v in scalars.values())


def test_jsonl_is_always_on_and_trackers_are_validated() -> None:
    assert RunConfig().loggers == ["jsonl"]
    assert RunConfig(loggers=["tensorboard"]).loggers == ["jsonl", "tensorboard"]
    assert RunConfig(loggers=["mlflow", "jsonl", "mlflow"]).loggers == ["jsonl", "mlflow"]
    with pytest.raises(ValidationError, match="'jsonl', 'tensorboard', 'wandb' or 'mlflow'"):
        RunConfig(loggers=["neptune"])
    with pytest.raises(ValidationError, match="'offline' or 'online'"):
        RunConfig(loggers=["wandb"], trackers={"wandb_mode": "cloud"})
    with pytest.raises(ValidationError, match=r"run.trackers.wandb_project is set but run.loggers \['jsonl', "
                       r"'mlflow'\] does not name 'wandb'"):
        RunConfig(loggers=["mlflow"], trackers={"wandb_project": "p"})
    with pytest.raises(ValidationError, match="extra"):
        RunConfig(trackers={"wandb_key": "x"})


def test_a_bad_tracker_setting_is_a_topology_error_with_its_line(tmp_path: Path) -> None:
    from composer_mesh.topology import TopologyError, load_topology

    topo = tmp_path / "t.yaml"
    slim = Path(__file__).with_name("slim_run.yaml").read_text()
    topo.write_text(slim + "  loggers: [jsonl, wandb, comet]\n")
    with pytest.raises(TopologyError) as e:
        load_topology(topo)
    assert "run.loggers" in str(e.value) and "comet" in str(e.value) and f"{topo.name}:" in str(e.value)


def test_a_missing_extra_names_the_pip_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    message = "run.loggers names 'wandb' but wandb is not installed: pip install 'composer-mesh[wandb]'"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValidationError) as e:  # when the topology is validated, before anything launches
        RunConfig(loggers=["wandb"])
    assert message in str(e.value)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    cfg = RunConfig(run_dir=tmp_path, loggers=["tensorboard", "wandb"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # uninstalled since (or a config built without validation)
    with pytest.raises(TrackerUnavailable) as err:
        Trackers.open(cfg, {})
    assert str(err.value) == message


def test_tensorboard_reads_back_and_a_resume_purges_the_lost_steps(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = RunConfig(run_dir=tmp_path / "run", loggers=["tensorboard"])
    first, second = stopped_and_resumed(cfg)
    assert first == second == {"tensorboard": "tensorboard"}
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert set(step_scalars(record(1, 0.0))) <= set(events.Tags()["scalars"])
    rewards = [(e.step, round(e.value, 4)) for e in events.Scalars("train/reward")]
    assert rewards == [(1, 0.1), (2, 0.2), (3, 100.3), (4, 100.4)]  # session 1's step 3 purged
    assert [(e.step, e.value) for e in events.Scalars("loss/grpo")] == [(s, pytest.approx(0.4)) for s in (1, 2, 3, 4)]
    assert [(e.step, e.value) for e in events.Scalars("eval/reward")] == [(0, 0.25)]
    assert [e.step for e in events.Scalars("eval/pass_at_4")] == [0]


def test_mlflow_reads_back_and_a_resume_continues_the_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    cfg = RunConfig(run_dir=tmp_path / "run", loggers=["mlflow"], trackers={"mlflow_experiment": "tests"})
    first, second = stopped_and_resumed(cfg)
    run_id = first["mlflow"]
    assert second == first  # the same run, continued
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    assert run.data.params["run.steps"] == "40" and run.data.tags["composer_mesh.resumed_from_step"] == "2"
    assert set(step_scalars(record(1, 0.0))) <= set(run.data.metrics)
    history = sorted((m.step, round(m.value, 4)) for m in client.get_metric_history(run_id, "train/reward"))
    # MLflow cannot delete points: the superseded step 3 of session 1 stays beside the resumed session's
    assert history == [(1, 0.1), (2, 0.2), (3, 0.3), (3, 100.3), (4, 100.4)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "time/train_s")][-1] == (4, 0.75)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/reward")] == [(0, 0.25)]
    assert json.loads(run.data.tags["events/checkpoint"])["step"] == 4


def wandb_logs(run_dir: Path) -> list[list[dict[str, Any]]]:
    """The records of each offline W&B session under `run_dir`, read by W&B's own reader of its transaction log
    (`wandb leet inspect --json`), oldest session first."""
    sessions = []
    for path in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                             capture_output=True, text=True, timeout=120, check=True)
        sessions.append([json.loads(line) for line in out.stdout.splitlines() if line.strip()])
    return sorted(sessions, key=lambda rows: next(r["run"]["start_time"] for r in rows if r["type"] == "run"))


def test_wandb_offline_reads_back_and_a_resume_continues_the_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    cfg = RunConfig(run_dir=tmp_path / "run", loggers=["wandb"], trackers={"wandb_project": "tests", "name": "demo"})
    config = {"run": cfg.model_dump(mode="json"), "teacher": {"api_key": SECRET, "model": "m"}}
    first = session(cfg, range(1, 4), rewards=0.0, config=config)
    second = session(cfg, range(3, 5), rewards=100.0, resume=(first, 2), config=config)
    assert second == first
    logs = wandb_logs(tmp_path / "run")
    assert len(logs) == 2  # one offline log per session, both of the same run (`wandb sync` joins them)
    runs = [next(r["run"] for r in rows if r["type"] == "run") for rows in logs]
    assert [r["run_id"] for r in runs] == [first["wandb"]] * 2 and runs[1].get("resume") is True
    assert runs[0]["project"] == "tests" and runs[0]["display_name"] == "demo"
    assert runs[0]["config"]["update"]["teacher"] == {"model": "m"}  # the key was never sent
    history = [[r["history"]["item"] for r in rows if r["type"] == "history"] for rows in logs]
    assert [(h["train/step"], round(h["train/reward"], 4)) for h in history[0] if "train/reward" in h] == [
        (1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(h["train/step"], round(h["train/reward"], 4)) for h in history[1]] == [(3, 100.3), (4, 100.4)]
    assert set(step_scalars(record(1, 0.0))) <= set(history[1][0])
    assert {k: history[0][0][k] for k in ("train/step", "eval/reward")} == {"train/step": 0, "eval/reward": 0.25}
    assert not any(r["type"] == "output_raw" for rows in logs for r in rows)  # the console is not captured
    assert_no_secret(tmp_path / "run")


def test_every_tracker_at_once_with_one_id_each_and_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    cfg = RunConfig(run_dir=tmp_path / "run", loggers=["tensorboard", "wandb", "mlflow"])
    first, second = stopped_and_resumed(cfg)
    assert first == second and set(first) == {"tensorboard", "wandb", "mlflow"}
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "event" not in r] == [1, 2, 3, 4]  # JSONL truncated at the checkpoint
    assert_no_secret(tmp_path / "run")


class _Broken:
    name = "broken"

    def start(self, run_name: str, config: dict[str, Any], resume_id: str | None = None,
              resume_step: int | None = None) -> str:
        return "b1"

    def log(self, step: int, scalars: Any) -> None:
        raise ConnectionError("server gone")

    def event(self, step: int, kind: str, values: Any) -> None:
        raise AssertionError("dropped trackers get nothing more")

    def close(self, failed: bool = False) -> None:
        raise AssertionError("dropped trackers are not closed")


def test_a_tracker_failing_mid_run_is_dropped_and_the_jsonl_says_so(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, trackers=Trackers([_Broken()], {"broken": "b1"}))
    writer.write(record(1, 0.5))
    writer.write(record(2, 0.5))
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event", r.get("step")) for r in lines] == [1, "tracker_failed", 2]
    assert lines[1]["error"] == "broken: ConnectionError: server gone"
    assert writer.tracker_ids == {"broken": "b1"}  # still checkpointed: a later session may continue it


def test_tracker_ids_ride_in_the_checkpoint(tmp_path: Path) -> None:
    from composer_mesh.orchestration.checkpoint import CheckpointStore, ControllerState, read_checkpoint
    from composer_mesh.orchestration.schedule import SchedulerState

    store = CheckpointStore(str(tmp_path / "ckpt"))
    state = ControllerState(1, 2, 1, 4, None, SchedulerState(1, 4, 1, 0, 0, []), {}, {}, 1,
                            trackers={"wandb": "abc123", "mlflow": "f00"})
    store.write_controller(state)
    url = store.commit(1, keep=1)
    assert read_checkpoint(url).trackers == {"wandb": "abc123", "mlflow": "f00"}
    # (a checkpoint from before trackers has a marker without content hashes: never resumed, test_resume_verification)



async def test_the_loop_logs_to_every_tracker_and_checkpoints_their_ids(tmp_path: Path) -> None:
    """End to end on the slim topology (2 steps): the loop opens the trackers from `run.loggers`, every step
    reaches each of them, and the run's checkpoint keeps their ids for a resume."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from composer_mesh.app.launch import launch
    from composer_mesh.app.runner import apply_overrides, checkpoint_policy, resume_point
    from composer_mesh.orchestration.loop import RLLoop
    from composer_mesh.topology import load_topology

    run_dir = tmp_path / "run"
    topo = apply_overrides(load_topology(Path(__file__).with_name("slim_run.yaml")), 2, run_dir)
    run = RunConfig.model_validate({**topo.run.model_dump(), "eval_prompts": 0,
                                    "loggers": ["tensorboard", "wandb", "mlflow"]})
    topo = topo.model_copy(update={"run": run})
    async with launch(topo) as mesh:
        await RLLoop(mesh, topo.run, topo.loss, checkpoints=checkpoint_policy(topo)).run()

    ids = resume_point(topo, None).state.trackers
    assert set(ids) == {"tensorboard", "wandb", "mlflow"}
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss/grpo")] == [1, 2]
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "time/train_s")] == [1, 2]
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"
    (log,) = wandb_logs(run_dir)
    assert next(r["run"]["run_id"] for r in log if r["type"] == "run") == ids["wandb"]
    assert [r["history"]["item"]["train/step"] for r in log if r["type"] == "history"] == [1, 2]
