"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases and MLflow (`run.loggers`).

Every tracker gets the same scalars per step (`metrics.step_scalars`) from `MetricsWriter`, so the dashboards
agree with metrics.jsonl and with each other. Each library is imported only when its tracker starts (they are
pip extras, and slow to import). A tracker's run id goes into the run checkpoint (`ControllerState.trackers`):
a resumed run passes it back to `start`, so it continues the same tracker run instead of opening a new one.
What a tracker is sent never holds a secret (`public`), and W&B does not capture the console.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from composer_mesh.orchestration.config import RunConfig, TrackersConfig, tracker_missing

log = logging.getLogger("composer_mesh.trackers")

# Config keys never sent to a tracker (their values may be credentials).
_SECRET_WORDS = ("api_key", "apikey", "token", "secret", "password", "credential")


class TrackerUnavailable(RuntimeError):
    """A tracker named in `run.loggers` whose library is not installed (the message names the pip extra)."""


class Tracker(Protocol):
    """One experiment tracker. `start` opens (or, given `resume_id`, continues) a run and returns its id;
    `resume_step` is the checkpoint's step: what was logged after it was trained again and is superseded."""

    name: str

    def start(self, run_name: str, config: dict[str, Any], resume_id: str | None = None,
              resume_step: int | None = None) -> str: ...

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def event(self, step: int, kind: str, values: Mapping[str, Any]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def public(config: Any) -> Any:
    """`config` without keys that may hold credentials (api keys, tokens, passwords), at any depth."""
    if isinstance(config, Mapping):
        return {k: public(v) for k, v in config.items() if not any(w in str(k).lower() for w in _SECRET_WORDS)}
    if isinstance(config, (list, tuple)):
        return [public(v) for v in config]
    return config


def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (`run.steps`), for trackers whose parameters are flat."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class TensorBoardTracker:
    """Event files under `<run_dir>/tensorboard`. A resumed run writes into the same directory with
    `purge_step`, so TensorBoard drops what the stopped session logged after the checkpoint's step."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        self.log_dir = run_dir / "tensorboard"
        self._writer: Any = None

    def start(self, run_name: str, config: dict[str, Any], resume_id: str | None = None,
              resume_step: int | None = None) -> str:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackerUnavailable(tracker_missing(self.name)) from e
        purge = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)
        if resume_step is None:
            text = json.dumps(public(config), indent=2, sort_keys=True, default=str)
            self._writer.add_text("config", f"run `{run_name}`\n\n```\n{text}\n```", 0)
        return self.log_dir.name

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()  # dashboards follow the run step by step

    def event(self, step: int, kind: str, values: Mapping[str, Any]) -> None:
        self._writer.add_text(f"events/{kind}", json.dumps(dict(values), sort_keys=True, default=str), step)

    def close(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbTracker:
    """A W&B run, offline by default (`<run_dir>/wandb`, uploaded later with `wandb sync`). Steps are plotted
    against `train/step` (not W&B's own monotonic `_step`), so a resumed run can log the steps it trains again."""

    name = "wandb"

    def __init__(self, settings: TrackersConfig, run_dir: Path) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self._run: Any = None

    def start(self, run_name: str, config: dict[str, Any], resume_id: str | None = None,
              resume_step: int | None = None) -> str:
        try:
            import wandb
        except ImportError as e:
            raise TrackerUnavailable(tracker_missing(self.name)) from e
        s = self.settings
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=s.wandb_project, entity=s.wandb_entity, name=run_name, mode=s.wandb_mode,
            dir=str(self.run_dir), id=resume_id, resume="allow" if resume_id else None, config=public(config),
            allow_val_change=True, reinit="create_new",  # never the caller's own wandb.run
            settings=wandb.Settings(console="off", save_code=False, silent=True),  # stdout stays out of the run
        )
        self._run.define_metric("train/step")
        self._run.define_metric("*", step_metric="train/step")
        return str(self._run.id)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log({"train/step": step, **scalars})

    def event(self, step: int, kind: str, values: Mapping[str, Any]) -> None:
        self._run.summary[f"events/{kind}"] = json.dumps({"step": step, **values}, sort_keys=True, default=str)

    def close(self, failed: bool = False) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run; by default in a local file store at `<run_dir>/mlruns` (MLflow 3 keeps that store in
    maintenance mode behind `MLFLOW_ALLOW_FILE_STORE`, which is set for it; sqlite:/// or a server URL in
    `run.trackers.mlflow_tracking_uri` need no such opt-in). Config goes in as parameters, once per run."""

    name = "mlflow"
    _BATCH = 100  # MLflow takes at most 100 params (1000 metrics) per log_batch

    def __init__(self, settings: TrackersConfig, run_dir: Path) -> None:
        self.settings = settings
        uri = settings.mlflow_tracking_uri or str(run_dir / "mlruns")
        if "://" not in uri and not uri.startswith("file:"):
            uri = Path(uri).resolve().as_uri()
        self.uri = uri
        self._client: Any = None
        self.run_id = ""

    def start(self, run_name: str, config: dict[str, Any], resume_id: str | None = None,
              resume_step: int | None = None) -> str:
        try:
            from mlflow.entities import Param
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise TrackerUnavailable(tracker_missing(self.name)) from e
        if self.uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(tracking_uri=self.uri)
        if resume_id:
            try:
                client.update_run(resume_id, status="RUNNING")
                client.set_tag(resume_id, "composer_mesh.resumed_from_step", str(resume_step))
                self.run_id = resume_id
                return resume_id
            except MlflowException as e:  # the store moved or was cleared: a new run, said so
                log.warning("MLflow run %s not found in %s (%s); starting a new run", resume_id, self.uri, e)
        exp = client.get_experiment_by_name(self.settings.mlflow_experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.settings.mlflow_experiment)
        self.run_id = client.create_run(exp_id, run_name=run_name, tags={"composer_mesh.run_name": run_name}).info.run_id
        params = [Param(k[:250], str(v)[:500]) for k, v in flat(public(config)).items()]
        for i in range(0, len(params), self._BATCH):
            client.log_batch(self.run_id, params=params[i : i + self._BATCH])
        return self.run_id

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def event(self, step: int, kind: str, values: Mapping[str, Any]) -> None:
        text = json.dumps({"step": step, **values}, sort_keys=True, default=str)
        self._client.set_tag(self.run_id, f"events/{kind}", text[:5000])

    def close(self, failed: bool = False) -> None:
        if self._client is not None and self.run_id:
            self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def make_tracker(name: str, run: RunConfig) -> Tracker:
    """The tracker `run.loggers` names `name` (not started)."""
    if name == "tensorboard":
        return TensorBoardTracker(run.run_dir)
    if name == "wandb":
        return WandbTracker(run.trackers, run.run_dir)
    if name == "mlflow":
        return MlflowTracker(run.trackers, run.run_dir)
    raise ValueError(f"unknown tracker {name!r} (run.loggers takes jsonl, tensorboard, wandb, mlflow)")


class Trackers:
    """The trackers of one run session, started together; `ids` (tracker → run id) goes into checkpoints.

    A tracker that fails to start fails the run (a configuration error, found before training). One that
    fails later is dropped with a warning and the run goes on: metrics.jsonl stays the complete record."""

    def __init__(self, trackers: list[Tracker], ids: dict[str, str]) -> None:
        self.trackers = trackers
        self.ids = ids

    @classmethod
    def open(cls, run: RunConfig, config: dict[str, Any], resume_ids: Mapping[str, str] | None = None,
             resume_step: int | None = None) -> Trackers:
        """Start every tracker of `run.loggers` (but JSONL); `resume_ids` from the checkpoint continue its runs."""
        name = run.trackers.name or run.run_dir.resolve().name
        ids = dict(resume_ids or {})  # a tracker left out this session keeps its id for a later one
        started: list[Tracker] = []
        try:
            for logger in run.loggers:
                if logger == "jsonl":
                    continue
                tracker = make_tracker(logger, run)
                ids[logger] = tracker.start(name, config, ids.get(logger), resume_step)
                started.append(tracker)
        except BaseException:
            for tracker in started:
                tracker.close(failed=True)
            raise
        return cls(started, ids)

    def log(self, step: int, scalars: Mapping[str, float]) -> list[str]:
        """Log to every tracker; returns what failed (those trackers are dropped)."""
        return self._each(lambda t: t.log(step, scalars))

    def event(self, step: int, kind: str, values: Mapping[str, Any]) -> list[str]:
        return self._each(lambda t: t.event(step, kind, values))

    def _each(self, call: Any) -> list[str]:
        failures = []
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as e:
                self.trackers.remove(tracker)
                failures.append(f"{tracker.name}: {type(e).__name__}: {e}")
                log.warning("tracker %s failed and is dropped for the rest of the run: %s: %s",
                            tracker.name, type(e).__name__, e)
        return failures

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            try:
                tracker.close(failed)
            except Exception as e:  # closing one must not keep the others from flushing
                log.warning("closing tracker %s failed: %s: %s", tracker.name, type(e).__name__, e)
        self.trackers = []
