"""Full run checkpoints: everything a stopped run needs to continue as if it had never stopped.

A checkpoint of step k is one directory under the run's checkpoint URL (a path, `file://`, `s3://`, any fsspec
destination the trainer procs can reach too):

    step-0000000k/
      trainer/r0/ ...        each trainer replica's full state (weights, AdamW, RNGs, loss and DiLoCo state),
                             written by the replica itself in the background (`TrainerService.save_state`)
      controller.json        the controller's state: step, weight versions, the prompt stream's RNG and position,
                             the scheduler (admitted steps, their queued prompts, finished groups), run counters
                             and the training fingerprint of the topology
      controller.safetensors the tensors of finished groups (teacher distributions)
      COMMITTED.json         written last, once every part above is complete (the storage primitive's marker:
                             format, step, time, and the controller's files with their sizes and sha256)

A directory without a valid `COMMITTED.json` is never picked: the latest checkpoint is the highest committed step
found by listing (no mutable pointer that a slow writer could move backwards). `verify_checkpoint` checks the
controller's files against their marker (each trainer part has its own marker, checked by its reader). After a commit, checkpoints beyond the
newest `keep` committed ones are deleted, and so are abandoned half-written ones below the new one.

Rollouts still generating when the checkpoint is taken are not saved: their chunks go back to their step's
queue and are generated again on resume with the same prompts and row seeds. Nothing here is pickled: the
controller state is JSON whose dataclasses come from a fixed list of message types, tensors are safetensors.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_mesh.actors.messages import (
    Prompt,
    RewardResult,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TeacherTrace,
    TokenDistribution,
    Turn,
)
from composer_mesh.mesh.storage import (
    CommittedDir,
    CommittedSeries,
    FsspecBlobs,
    NotCommitted,
    StorageError,
    absolute,
)
from composer_mesh.orchestration.schedule import Chunk, GroupResult, SchedulerState, StepPlan

FORMAT = 1
COMMITTED = "COMMITTED.json"
_STEP_PREFIX = "step-"
_MARKER_FIELDS = {"format": int, "step": int, "time": (int, float)}  # the writer's fields in COMMITTED.json


class RunCheckpointError(RuntimeError):
    """A run checkpoint that cannot be used: missing, half-written, corrupted, or from another topology."""


@dataclass
class CheckpointPolicy:
    """Where and when the loop checkpoints, and what a resumed run must match.

    `fingerprint`: the topology's training-defining fields (model, loss, trainer, batch shape, ...); a checkpoint
    whose fingerprint differs is refused, naming the fields. `checkpointable(step)`: whether the trainer can save
    right after that step (DiLoCo with a fragment sync delay cannot while a sync is in flight)."""

    url: str
    every: int = 0  # 0: only at the end of the run (and on a stop)
    keep: int = 2
    fingerprint: dict[str, Any] = field(default_factory=dict)
    checkpointable: Callable[[int], bool] = lambda step: True

    def due(self, step: int, last_step: int) -> bool:
        return (step == last_step or (self.every > 0 and step % self.every == 0)) and self.checkpointable(step)


@dataclass
class ControllerState:
    """The controller's part of a checkpoint of step `step`."""

    step: int
    weight_version: int  # the trainer's version after `step` (what generators hold on resume)
    first_version: int  # the initial policy's version: step s trains from first_version + s - 1
    prompts_count: int  # train prompts drawn (the next one's stream index)
    prompts_rng: Any  # a task source's `random.Random.getstate()`; None for data (`prompts` has the whole state)
    schedule: SchedulerState
    counters: dict[str, Any]  # the loop's run-wide counters (eval before, traces scored, drops, ...)
    fingerprint: dict[str, Any]
    replicas: int
    prompts: dict[str, Any] = field(default_factory=dict)  # `PromptSource.state()`; {} in older checkpoints
    trackers: dict[str, str] = field(default_factory=dict)  # tracker → run id, continued on resume (trackers.py)


# ---- where checkpoints live --------------------------------------------------------------------------------


class CheckpointStore:
    """The checkpoints of one run under `url` (any fsspec URL or a local path): a `CommittedSeries` of
    `step-NNNNNNNN/` directories, each committed by its `COMMITTED.json`."""

    def __init__(self, url: str) -> None:
        self.url = absolute(url)
        self.blobs = FsspecBlobs(self.url)
        self.fs, self.root = self.blobs.fs, self.blobs.root
        self.series = CommittedSeries(self.blobs, name=_STEP_PREFIX, marker=COMMITTED, fields=_MARKER_FIELDS,
                                      where=self.url)
        self._parts: dict[int, CommittedDir] = {}  # step -> the directory the controller's part went to

    def step_url(self, step: int) -> str:
        return f"{self.url}/{_STEP_PREFIX}{step:08d}"

    def trainer_url(self, step: int, replica: int) -> str:
        return f"{self.step_url(step)}/trainer/r{replica}"

    def steps(self) -> list[int]:
        """Every step that has a directory here, committed or not (listed afresh: other processes write here)."""
        return self.series.steps()

    def committed(self) -> list[int]:
        return self.series.committed()

    def latest(self, below: int | None = None) -> str | None:
        """URL of the newest committed checkpoint (below step `below`, if given), or None; `NotCommitted` when
        markers are there but none is valid."""
        found = self.series.newest(below)
        return self.step_url(found.step) if found is not None else None

    def write_controller(self, state: ControllerState) -> None:
        """The controller's part (JSON + safetensors); the trainers write theirs themselves."""
        tensors: dict[str, torch.Tensor] = {}
        doc = {"format": FORMAT, **encode(_state_fields(state), tensors)}
        part = self.series.at(state.step)
        part.write_tensors("controller.safetensors", tensors)
        part.write_json("controller.json", doc)
        self._parts[state.step] = part  # its marker lists these files

    def commit(self, step: int, keep: int) -> str:
        """Mark step `step` complete (every part is written), then delete what is no longer needed: checkpoints
        beyond the newest `keep` committed ones, and abandoned half-written ones below this one (so commits go in
        step order: see `CommittedSeries.retain`). The marker lists the controller's files when this store wrote
        them; each trainer part has its own marker listing its files."""
        step_dir = self._parts.pop(step, None) or self.series.at(step)
        step_dir.commit({"format": FORMAT, "step": step, "time": time.time()})
        self.series.retain(step, keep)
        return self.step_url(step)


def _step_dir(url: str) -> CommittedDir:
    return CommittedDir(FsspecBlobs(url), marker=COMMITTED, fields=_MARKER_FIELDS, where=url)


def find_checkpoint(path: str) -> str:
    """The checkpoint `path` names: a step directory itself, else the newest committed one under `path` (a
    checkpoints directory, or a run dir holding `checkpoints/`)."""
    url = absolute(path)
    step_dir = _step_dir(url)
    if step_dir.blobs.exists("controller.json") or step_dir.blobs.exists(COMMITTED):
        try:
            step_dir.read_marker()
        except NotCommitted as e:
            raise RunCheckpointError(f"{e}: a checkpoint whose writing never finished or whose marker was damaged; "
                                     "resume from an earlier one") from None
        return url
    for candidate in (url, f"{url}/checkpoints"):
        try:
            latest = CheckpointStore(candidate).latest()
        except NotCommitted as e:
            raise RunCheckpointError(f"{e}; no checkpoint there has a valid marker") from None
        if latest is not None:
            return latest
    if not step_dir.blobs.exists(""):
        raise RunCheckpointError(f"{url}: no such checkpoint or run directory")
    raise RunCheckpointError(f"{url}: holds no committed checkpoint (looked for {_STEP_PREFIX}NNNNNNNN/{COMMITTED} "
                             "here and under checkpoints/)")


def verify_checkpoint(url: str) -> None:
    """Check the controller's files of the checkpoint at `url` against the sizes and sha256 its `COMMITTED.json`
    lists (streamed); RunCheckpointError naming the file and what differs. The trainer parts are checked by
    their own reader (`trainer_state.check_trainer_state`)."""
    try:
        _step_dir(url).verify()
    except StorageError as e:
        raise RunCheckpointError(str(e)) from None


def read_checkpoint(url: str) -> ControllerState:
    """The controller state of the committed checkpoint at `url`; RunCheckpointError naming what is wrong."""
    step_dir = _step_dir(url)
    try:
        doc, tensors = step_dir.read_committed(
            "controller.json", "controller.safetensors", what="controller state",
            missing=f"{url}: not a committed run checkpoint ({COMMITTED} is missing)")
    except StorageError as e:
        raise RunCheckpointError(str(e)) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise RunCheckpointError(f"{url}/controller.json: format {found!r}, expected {FORMAT} (not a checkpoint of "
                                 "this composer-mesh version)")
    try:
        fields = decode(doc, tensors)
        fields.pop("format")
        fields["schedule"] = _schedule_state(fields["schedule"])
        return ControllerState(**fields)
    except (KeyError, TypeError, ValueError) as e:
        raise RunCheckpointError(f"{url}/controller.json: malformed controller state: {type(e).__name__}: {e}") from e


def check_fingerprint(url: str, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume under a topology whose training-defining fields differ, naming each."""
    diffs = differences(saved, current)
    if diffs:
        shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
        raise RunCheckpointError(f"{url} was written under a different topology: {shown}")


def differences(saved: Any, current: Any, where: str = "") -> list[str]:
    """`path: saved X, now Y` for every leaf that differs between two JSON-like trees."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            path = f"{where}.{key}" if where else str(key)
            if key not in saved:
                if current[key] is not None:  # None: a setting newer than the checkpoint, left unset
                    out.append(f"{path}: not in the checkpoint, now {current[key]!r}")
            elif key not in current:
                out.append(f"{path}: {saved[key]!r} in the checkpoint, now absent")
            else:
                out.extend(differences(saved[key], current[key], path))
        return out
    return [] if saved == current else [f"{where}: {saved!r} in the checkpoint, now {current!r}"]


def restore_rng(rng: random.Random, state: Any) -> None:
    """Set `rng` to a state saved through JSON (lists where Python had tuples)."""
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


# ---- JSON + tensors, for a fixed list of message types ------------------------------------------------------

_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (Prompt, Rollout, RolloutGroup, RewardResult, ScoredGroup, TokenDistribution, TeacherTrace,
                Turn, GroupResult, Chunk)
}


def encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON tree of `obj`: listed dataclasses as `{"__type__": name, ...}`, tensors moved into `tensors`."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if _TYPES.get(name) is not type(obj):
            raise TypeError(f"cannot checkpoint a {name} (not one of {sorted(_TYPES)})")
        return {"__type__": name, **{f.name: encode(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj)}}
    if isinstance(obj, (list, tuple, deque)):
        return [encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"cannot checkpoint a dict with non-string keys: {list(obj)[:3]}")
        return {k: encode(v, tensors) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}")


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `encode`; a type not in the fixed list, or a missing tensor, is a ValueError."""
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        if tree["__tensor__"] not in tensors:
            raise ValueError(f"tensor {tree['__tensor__']!r} is missing from controller.safetensors")
        return tensors[tree["__tensor__"]]
    values = {k: decode(v, tensors) for k, v in tree.items() if k != "__type__"}
    if "__type__" not in tree:
        return values
    cls = _TYPES.get(tree["__type__"])
    if cls is None:
        raise ValueError(f"unknown type {tree['__type__']!r} (expected one of {sorted(_TYPES)})")
    return cls(**values)


def _state_fields(state: ControllerState) -> dict[str, Any]:
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    s = state.schedule
    fields["schedule"] = {
        "trained": s.trained, "drawn": s.drawn, "opened": s.opened,
        "zero_variance_groups": s.zero_variance_groups, "backfilled_groups": s.backfilled_groups,
        "plans": [{"step": p.step, "needed": p.needed, "pending": list(p.pending), "kept": p.kept,
                   "set_aside": p.set_aside, "drawn": p.drawn, "short": p.short} for p in s.plans],
    }
    return fields


def _schedule_state(tree: dict[str, Any]) -> SchedulerState:
    plans = [StepPlan(step=p["step"], needed=p["needed"], pending=deque(p["pending"]), kept=p["kept"],
                      set_aside=p["set_aside"], drawn=p["drawn"], short=p["short"]) for p in tree.pop("plans")]
    return SchedulerState(plans=plans, **tree)
