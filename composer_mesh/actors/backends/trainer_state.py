"""The trainer's full state on disk: what a resumed run needs to continue as if it had never stopped.

One directory (any fsspec URL: a local path, `file://`, `s3://`) holds:

- `state.safetensors`: the model's parameters and persistent buffers (`model/<name>`), every AdamW state tensor
  (`optim/<param index>/<key>`) and torch's CPU RNG state (`rng/torch`). Tensors only: nothing is pickled.
- `state.json`: the optimizer step, AdamW's param groups (without the parameters), the parameter names in optimizer
  order, Python's and NumPy's RNG states, the loss state (TAID's t and momentum) and whatever `extra` the caller
  adds (e.g. the weight version).
- `COMPLETE`: written last. A directory without it is a half-written state and is never loaded.

Loading checks names, shapes and dtypes against the live model before copying anything, and says which differ.
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch

FORMAT = 1
_MARKER = "COMPLETE"


class TrainerStateError(ValueError):
    """A trainer state that cannot be loaded: half-written, foreign, or for another model."""


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(url)


def save_trainer_state(
    url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
    loss_state: dict[str, Any] | None, extra: dict[str, Any] | None = None,
) -> None:
    """Write the state under `url` (files first, the `COMPLETE` marker last)."""
    import numpy as np
    from safetensors.torch import save

    fs, root = _fs(url)
    names = _param_names(model, optimizer)
    tensors = {f"model/{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    state = optimizer.state_dict()
    for index, entry in state["state"].items():
        for key, value in entry.items():
            tensors[f"optim/{index}/{key}"] = torch.as_tensor(value).detach().contiguous().cpu()
    tensors["rng/torch"] = torch.get_rng_state()
    np_state = np.random.get_state()
    meta = {
        "format": FORMAT, "step": step, "param_names": names,
        "param_groups": state["param_groups"], "loss_state": loss_state, "extra": extra or {},
        "python_rng": _jsonable(random.getstate()),
        "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/state.safetensors", "wb") as f:
        f.write(save(tensors))
    with fs.open(f"{root}/state.json", "w") as f:
        f.write(json.dumps(meta))
    with fs.open(f"{root}/{_MARKER}", "w") as f:
        f.write("ok\n")


def load_trainer_state(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the state under `url` into `model` and `optimizer` and restore the RNGs; returns the JSON part
    (`step`, `loss_state`, `extra`). Raises TrainerStateError naming what is wrong and where."""
    import numpy as np
    from safetensors.torch import load

    fs, root = _fs(url)
    if not fs.exists(f"{root}/{_MARKER}"):
        raise TrainerStateError(f"{url}: no {_MARKER} marker: not a trainer state, or one that was never finished")
    try:
        with fs.open(f"{root}/state.json", "r") as f:
            meta = json.loads(f.read())
        with fs.open(f"{root}/state.safetensors", "rb") as f:
            tensors = load(f.read())
    except (OSError, ValueError) as e:
        raise TrainerStateError(f"{url}: unreadable trainer state: {type(e).__name__}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TrainerStateError(f"{url}/state.json: format {meta.get('format') if isinstance(meta, dict) else meta!r}, "
                                f"expected {FORMAT}")
    _check_model(url, model, tensors)
    names = _param_names(model, optimizer)
    if meta["param_names"] != names:
        first = next((i, a, b) for i, (a, b) in enumerate(zip([*meta["param_names"], None], [*names, None])) if a != b)
        raise TrainerStateError(f"{url}: the optimizer's parameters differ (saved {len(meta['param_names'])}, live "
                                f"{len(names)}); the first difference is at {first[0]}: saved {first[1]}, live {first[2]}")
    with torch.no_grad():
        model.load_state_dict({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
    optim_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            _, index, name = key.split("/", 2)
            optim_state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": optim_state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng/torch"])
    random.setstate(_tupled(meta["python_rng"]))
    kind, keys, *rest = meta["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    return meta


def _check_model(url: str, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    live = {f"model/{k}": v for k, v in model.state_dict().items()}
    saved = {k: v for k, v in tensors.items() if k.startswith("model/")}
    problems = [f"missing {k}" for k in sorted(live.keys() - saved.keys())]
    problems += [f"unexpected {k}" for k in sorted(saved.keys() - live.keys())]
    problems += [
        f"{k}: saved {tuple(saved[k].shape)} {saved[k].dtype}, live {tuple(v.shape)} {v.dtype}"
        for k, v in live.items() if k in saved and (saved[k].shape != v.shape or saved[k].dtype != v.dtype)
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise TrainerStateError(f"{url}: the state is for another model: {shown}")


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model's name of each optimizer parameter, in optimizer order (how AdamW's state is indexed)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id.get(id(p), "?") for group in optimizer.param_groups for p in group["params"]]


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tupled(x: Any) -> Any:
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x
