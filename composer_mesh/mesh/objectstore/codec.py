"""The DiLoCo state codec: registered state dicts (nested dicts, lists, tuples, tensors, JSON scalars) as one
checksummed safetensors object, the non-tensor structure as a JSON skeleton in its metadata. Nothing is pickled.

Dict keys keep their type (the skeleton stores `[key, value]` pairs), so what a state-dict fn returns comes back
as it was, and identical states encode to identical bytes on every replica.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from composer_mesh.mesh.objectstore.store import ShardError, decode_shard, encode_shard

StateDict = dict[str, Any]


def flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON skeleton of `obj` with tensors replaced by references into `tensors` (dict keys keep their type)."""
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors):06d}:{prefix}"
        tensors[name] = obj.detach().to("cpu").clone().contiguous()
        return {"__tensor__": name}
    if isinstance(obj, dict):
        return {"__dict__": [[k, flatten(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {
            "__list__": [flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)],
            "tuple": isinstance(obj, tuple),
        }
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"cannot store {type(obj).__name__} at {prefix!r} in a checkpoint (tensors and JSON only)"
    )


def _unflatten(skel: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skel, dict):
        if "__tensor__" in skel:
            return tensors[skel["__tensor__"]]
        if "__dict__" in skel:
            return {k: _unflatten(v, tensors) for k, v in skel["__dict__"]}
        if "__list__" in skel:
            items = [_unflatten(v, tensors) for v in skel["__list__"]]
            return tuple(items) if skel.get("tuple") else items
    return skel


def encode_flat(tensors: dict[str, torch.Tensor], skeleton: Any, meta: dict[str, Any]) -> bytes:
    return encode_shard(tensors, {**meta, "kind": "state", "skeleton": json.dumps(skeleton)})


def encode_state(state: dict[str, StateDict], meta: dict[str, Any]) -> bytes:
    """Checkpoint bytes: safetensors for the tensors, a JSON skeleton (in the metadata) for the rest."""
    tensors: dict[str, torch.Tensor] = {}
    skel = flatten(state, "", tensors)
    return encode_flat(tensors, skel, meta)


def decode_state(
    key: str, blob: bytes, run_id: str, expected_size: int | None = None
) -> tuple[dict[str, Any], dict]:
    tensors, meta = decode_shard(
        key, blob, expect={"run_id": run_id, "kind": "state"}, expected_size=expected_size
    )
    try:
        skel = json.loads(meta["skeleton"])
    except (KeyError, json.JSONDecodeError) as e:
        raise ShardError(key, f"checkpoint skeleton unreadable: {e}") from None
    return _unflatten(skel, tensors), meta
