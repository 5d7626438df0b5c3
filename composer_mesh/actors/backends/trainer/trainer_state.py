"""The trainer's full state on disk: what a resumed run needs to continue as if it had never stopped.

One directory (any fsspec URL: a local path, `file://`, `s3://`) holds:

- `state.safetensors`: the model's parameters and persistent buffers (`model/<name>`; saved with `trainable_only`,
  only the optimizer's parameters: LoRA adapters, whose frozen base is rebuilt from the model source), every AdamW
  state tensor (`optim/<param index>/<key>`), torch's CPU RNG state (`rng/torch`) and the caller's extra tensor
  groups (`<group>/<name>`, e.g. a DiLoCo replica's `diloco/...`). Tensors only: nothing is pickled.
- `state.json`: the optimizer step, AdamW's param groups (without the parameters), the parameter names in optimizer
  order, which model tensors are saved (`model_tensors`: "all" or "trainable"), Python's and NumPy's RNG states,
  the loss state (TAID's t and momentum), whatever `extra` the caller adds (e.g. the weight version) and the JSON
  part of the extra groups (`extra_json`).
- `COMPLETE`: written last (the storage primitive's commit marker, `mesh/storage`: JSON with the files, their
  sizes and sha256). A directory without a valid one is a half-written state and is never loaded; a file whose
  bytes differ from it is refused, named (`check_trainer_state` streams every file before a resume launches
  anything; loading checks the bytes it reads).

Saving is two steps so that the slow one can run off the training path: `capture_trainer_state` copies everything
(tensors to CPU, no serialisation, no I/O) into a `TrainerSnapshot` that training can no longer change, and
`write_trainer_state` writes a snapshot (in a background thread, if the caller likes).

Loading checks names, shapes and dtypes against the live model before copying anything, and says which differ.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import torch

from composer_mesh.mesh.storage import CommittedDir, FsspecBlobs, NotCommitted, StorageError

FORMAT = 1
_MARKER = "COMPLETE"
_RESERVED = frozenset({"model", "optim", "rng"})  # tensor name prefixes of the trainer's own state


class TrainerStateError(ValueError):
    """A trainer state that cannot be saved now or loaded: half-written, foreign, or for another model."""


@dataclass(frozen=True)
class TrainerSnapshot:
    """A trainer's full state in memory, detached from the live trainer: CPU copies of the tensors under their
    `state.safetensors` names, and the JSON part (`state.json`)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.meta["extra"])

    @property
    def groups(self) -> list[str]:
        """Names of the extra tensor groups."""
        return sorted({k.split("/", 1)[0] for k in self.tensors} - _RESERVED)

    def group(self, name: str) -> dict[str, torch.Tensor]:
        """Extra tensor group `name`, keyed without the `name/` prefix (empty if there is none)."""
        prefix = f"{name}/"
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _state_dir(url: str) -> CommittedDir:
    """The state's directory, committed by `COMPLETE`."""
    return CommittedDir(FsspecBlobs(url), marker=_MARKER, where=url)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that owns its memory: `copy=True` copies even a CPU tensor (a plain `.cpu()` of
    one returns the tensor itself, which training would go on changing). A sharded tensor (a `DTensor`, FSDP2)
    is this rank's shard: each rank of a sharded replica saves its own."""
    return _local(t).detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a view of its storage), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _sharded_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A saved AdamW state tensor of a sharded parameter as a DTensor sharded like it (its moments have the
    parameter's shard shape; scalars such as the step stay plain)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or value.dim() == 0 or value.shape != param.to_local().shape:
        return value
    return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def capture_trainer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, loss_state: dict[str, Any] | None,
    extra: dict[str, Any] | None = None, extra_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
    extra_json: dict[str, Any] | None = None, *, trainable_only: bool = False,
) -> TrainerSnapshot:
    """Copy the state now, so that training can go on while it is written: every tensor to CPU, the JSON part
    through JSON (which also refuses anything that is not JSON here rather than in the writer).

    `extra_tensors` are named groups of tensors (stored as `<group>/<name>`), `extra_json` named JSON parts.
    `trainable_only`: of the model, only the optimizer's parameters (LoRA adapters: the frozen rest is rebuilt)."""
    import numpy as np

    groups = extra_tensors or {}
    bad = sorted(g for g in groups if g in _RESERVED or not g or "/" in g)
    if bad:
        raise ValueError(f"extra tensor groups {bad}: names must be non-empty, without '/', and not {sorted(_RESERVED)}")
    tensors = {f"model/{k}": _copy(v) for k, v in _model_tensors(model, optimizer, trainable_only).items()}
    state = optimizer.state_dict()
    for index, entry in state["state"].items():
        for key, value in entry.items():
            tensors[f"optim/{index}/{key}"] = _copy(torch.as_tensor(value))
    tensors["rng/torch"] = torch.get_rng_state()  # a new tensor already
    for group, named in groups.items():
        tensors.update({f"{group}/{name}": _copy(t) for name, t in named.items()})
    np_state = np.random.get_state()
    meta = {
        "format": FORMAT, "step": step, "param_names": _param_names(model, optimizer),
        "model_tensors": "trainable" if trainable_only else "all",
        "param_groups": state["param_groups"], "loss_state": loss_state, "extra": extra or {},
        "extra_json": extra_json or {},
        "python_rng": _jsonable(random.getstate()),
        "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    return TrainerSnapshot(tensors, json.loads(json.dumps(meta)))


def write_trainer_state(url: str, snapshot: TrainerSnapshot) -> None:
    """Write `snapshot` under `url`: the state files first, the `COMPLETE` marker last. Over an earlier state the
    old marker is removed first, so a write that dies half-way never leaves a marker over mixed files."""
    state_dir = _state_dir(url)
    state_dir.reopen()
    state_dir.write_tensors("state.safetensors", snapshot.tensors)
    state_dir.write_json("state.json", snapshot.meta)
    state_dir.commit()


def save_trainer_state(
    url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
    loss_state: dict[str, Any] | None, extra: dict[str, Any] | None = None,
    extra_tensors: dict[str, dict[str, torch.Tensor]] | None = None, extra_json: dict[str, Any] | None = None,
    *, trainable_only: bool = False,
) -> None:
    """Capture and write in one go (on the caller's thread)."""
    write_trainer_state(url, capture_trainer_state(model, optimizer, step, loss_state, extra, extra_tensors, extra_json,
                                                   trainable_only=trainable_only))


def read_trainer_state(url: str) -> TrainerSnapshot:
    """Read the state under `url` without applying it. Raises TrainerStateError if it is half-written,
    unreadable or of another format."""
    try:
        meta, tensors = _state_dir(url).read_committed(
            "state.json", "state.safetensors", what="trainer state",
            missing=f"{url}: no {_MARKER} marker: not a trainer state, or one that was never finished")
    except StorageError as e:
        raise TrainerStateError(str(e)) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TrainerStateError(f"{url}/state.json: format {meta.get('format') if isinstance(meta, dict) else meta!r}, "
                                f"expected {FORMAT}")
    meta.setdefault("extra_json", {})  # states written before extra groups existed
    meta.setdefault("model_tensors", "all")  # ... and before trainable-only states
    return TrainerSnapshot(tensors, meta)


def check_trainer_state(url: str) -> None:
    """What `read_trainer_state` would refuse, found without loading the tensors (a large model's state is
    gigabytes): the marker, every file's size and sha256 against it (streamed), `state.json` and its format,
    and the safetensors header of `state.safetensors` against the file's size. Raises TrainerStateError naming
    the file."""
    world = sharded_world(url)
    if world is not None:  # a sharded replica: one state per rank
        for rank in range(world):
            check_trainer_state(f"{url}/rank{rank}")
        return
    state = _state_dir(url)
    try:
        meta = state.read_json("state.json", state.verify())
        _check_safetensors(FsspecBlobs(url), "state.safetensors")
    except NotCommitted as e:
        if e.missing:
            raise TrainerStateError(f"{url}: no {_MARKER} marker: not a trainer state, or one that was never "
                                    "finished") from e
        raise TrainerStateError(str(e)) from e
    except StorageError as e:
        raise TrainerStateError(str(e)) from e
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise TrainerStateError(f"{url}: unreadable trainer state: {type(e).__name__}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TrainerStateError(f"{url}/state.json: format {meta.get('format') if isinstance(meta, dict) else meta!r}, "
                                f"expected {FORMAT}")


def sharded_world(url: str) -> int | None:
    """The ranks of the sharded replica whose state is under `url` (one state per rank, `rank<r>/`), or None for
    a state of one proc."""
    if not FsspecBlobs(url).exists("rank0/state.json"):
        return None
    try:
        meta = _state_dir(f"{url}/rank0").read_json("state.json")
        return int(meta["extra_json"]["shard"]["world"])
    except (StorageError, KeyError, TypeError, ValueError) as e:
        raise TrainerStateError(f"{url}/rank0/state.json: not a sharded trainer state: {type(e).__name__}: {e}") from e


def _check_safetensors(blobs: FsspecBlobs, name: str) -> None:
    """A safetensors file's header (8-byte length, JSON) parses and its tensors end where the file does."""
    path = blobs.path(name)
    with blobs.fs.open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 2 <= length <= 100 * 2**20:
            raise ValueError(f"{name}: not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    expected, size = 8 + length + max(ends, default=0), int(blobs.fs.size(path))
    if size != expected:
        raise ValueError(f"{name}: {size} bytes, its header describes {expected} (truncated or overwritten)")


def restore_trainer_state(
    url: str, snapshot: TrainerSnapshot, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    *, trainable_only: bool = False,
) -> None:
    """Load `snapshot` into `model` and `optimizer` and restore the RNGs, after checking it fits them (names,
    shapes, dtypes, optimizer order). Extra groups are the caller's to apply. `url` names it in errors.
    `trainable_only` as it was saved: the state then holds (and sets) only the optimizer's parameters."""
    import numpy as np

    meta, tensors = snapshot.meta, snapshot.tensors
    kind = "trainable" if trainable_only else "all"
    if meta["model_tensors"] != kind:
        held = {"all": "the whole model", "trainable": "only the trainable parameters (LoRA adapters)"}
        raise TrainerStateError(f"{url}: the state holds {held[meta['model_tensors']]}, this trainer needs {held[kind]}")
    live = _model_tensors(model, optimizer, trainable_only)
    _check_model(url, {k: _local(v) for k, v in live.items()}, tensors,
                 "adapter (trainable parameters)" if trainable_only else "model")
    names = _param_names(model, optimizer)
    if meta["param_names"] != names:
        first = next((i, a, b) for i, (a, b) in enumerate(zip([*meta["param_names"], None], [*names, None])) if a != b)
        raise TrainerStateError(f"{url}: the optimizer's parameters differ (saved {len(meta['param_names'])}, live "
                                f"{len(names)}); the first difference is at {first[0]}: saved {first[1]}, live {first[2]}")
    saved = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    with torch.no_grad():
        if trainable_only or _is_sharded(live):
            for name, t in live.items():  # a sharded model: each rank's shard, in place
                _local(t).copy_(saved[name])
        else:
            model.load_state_dict(saved)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            _, index, name = key.split("/", 2)
            optim_state.setdefault(int(index), {})[name] = _sharded_like(value, params[int(index)])
    optimizer.load_state_dict({"state": optim_state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng/torch"])
    random.setstate(_tupled(meta["python_rng"]))
    kind, keys, *rest = meta["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))


def load_trainer_state(
    url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, trainable_only: bool = False,
) -> dict[str, Any]:
    """Load the state under `url` into `model` and `optimizer` and restore the RNGs; returns the JSON part
    (`step`, `loss_state`, `extra`, `extra_json`) plus `extra_tensors` (group -> name -> tensor), for the caller
    to apply. Raises TrainerStateError naming what is wrong and where."""
    snapshot = read_trainer_state(url)
    restore_trainer_state(url, snapshot, model, optimizer, trainable_only=trainable_only)
    return {**snapshot.meta, "extra_tensors": {g: snapshot.group(g) for g in snapshot.groups}}


def _model_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool,
) -> dict[str, torch.Tensor]:
    """The model tensors a state holds: the whole state dict, or only the optimizer's parameters (by name)."""
    if not trainable_only:
        return model.state_dict()
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {n: p for n, p in model.named_parameters() if id(p) in trained}


def _is_sharded(tensors: dict[str, torch.Tensor]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tensors.values())


def _check_model(url: str, model_tensors: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                 what: str = "model") -> None:
    live = {f"model/{k}": v for k, v in model_tensors.items()}
    saved = {k: v for k, v in tensors.items() if k.startswith("model/")}
    problems = [f"missing {k}" for k in sorted(live.keys() - saved.keys())]
    problems += [f"unexpected {k}" for k in sorted(saved.keys() - live.keys())]
    problems += [
        f"{k}: saved {tuple(saved[k].shape)} {saved[k].dtype}, live {tuple(v.shape)} {v.dtype}"
        for k, v in live.items() if k in saved and (saved[k].shape != v.shape or saved[k].dtype != v.dtype)
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise TrainerStateError(f"{url}: the state is for another {what}: {shown}")


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model's name of each optimizer parameter, in optimizer order (how AdamW's state is indexed)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id.get(id(p), "?") for group in optimizer.param_groups for p in group["params"]]


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tupled(x: Any) -> Any:
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x
