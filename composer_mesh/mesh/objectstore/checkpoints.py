"""DiLoCo checkpoints in the object store: write after a commit, find the latest, bootstrap, heal, GC, rewind.

After a commit the round's designated member checkpoints the DiLoCo state (global parameters and outer
optimizer, via the registered state-dict fns) to `ckpt/qNNNNNNNN/`, a committed directory of the storage primitive
(`mesh/storage`): `state.safetensors` first, then the `COMMITTED.json` marker (the run id, round, step and byte
size, plus the primitive's file list with each file's size and sha256). A restarted replica loads it and
rejoins at the next round identical to the others. A marker that is not valid is no checkpoint (listings skip
it), and a state whose bytes differ from its marker is refused with a warning naming it: healing then uses the
newest older checkpoint that verifies (never θ0 while checkpoints exist: then it is an error).

The latest checkpoint is not a mutable pointer (a `latest.json` read-then-written by a slow writer could go
backwards, s3 has no compare-and-swap): it is the highest `ckpt/qNNNNNNNN/` holding a `COMMITTED.json`, found
by listing. Markers are immutable and only ever added, and garbage collection runs only after its writer's
own marker and deletes only checkpoints `keep_rounds` below it, so the newest committed checkpoint is never
deleted and the latest never moves backwards. A checkpoint write that fails is raised (`CheckpointError`, naming
the object and the cause) at the next `maybe_checkpoint`/`start_quorum` or at `shutdown`, unless a newer
checkpoint was committed meanwhile (then nothing depends on it).

Before any round is checkpointed, replicas agree on one θ0: `ckpt/init/COMMITTED.json`, written create-only,
names the first replica's own `ckpt/init/rNNN.safetensors`.

A replica resumed from its own saved state rewinds: the rounds and checkpoints after the saved round are the
stopped run's abandoned future, and are deleted before anyone trains again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from composer_mesh.mesh.objectstore.codec import StateDict, decode_state, encode_flat, encode_state, flatten
from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.mesh.objectstore.rounds import ROUNDS
from composer_mesh.mesh.objectstore.store import ShardError, Store, StoreError
from composer_mesh.mesh.storage import Committed, CommittedSeries, ContentError, NotCommitted

log = logging.getLogger(__name__)

CKPT = "ckpt"
MARKER = "COMMITTED.json"
INIT_POINTER = f"{CKPT}/init/{MARKER}"
STATE = "state.safetensors"
_MARKER_FIELDS = {"quorum_id": int, "step": int, "bytes": int, "run_id": str}  # the writer's fields in MARKER
StateFns = Mapping[str, tuple[Callable[[StateDict], None], Callable[[], StateDict]]]


class CheckpointError(RuntimeError):
    """A DiLoCo checkpoint could not be written; the message names the object and the cause."""


def _round_of(name: str) -> int | None:
    """The round of a `ckpt/` or `rounds/` entry named `qNNNNNNNN`, else None (`init`, temp names)."""
    return int(name[1:]) if name.startswith("q") and name[1:].isdigit() else None


class DiLoCoCheckpoints:
    """One replica's DiLoCo checkpoints. `states` is the façade's registry of state-dict fns (read only here);
    `on_load` receives every state loaded from the store (bootstrap or heal)."""

    def __init__(self, config: DiLoCoConfig, replica_id: int, store: Store, states: StateFns,
                 on_load: Callable[[dict[str, StateDict]], None]) -> None:
        self.config = config
        self.replica_id = replica_id
        self.store = store
        self.states = states
        self._on_load = on_load
        self.series = CommittedSeries(store, CKPT, name="q", marker=MARKER, fields=_MARKER_FIELDS)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"objstore-ckpt-r{replica_id}")
        self.future: Future | None = None  # the write in the background, if any

    # ---- finding the latest -----------------------------------------------------------------------------------
    def read_latest(self, below: int | None = None) -> dict[str, Any] | None:
        """The newest committed checkpoint (below round `below`, if given): the highest `ckpt/qNNNNNNNN/` that
        holds a valid `COMMITTED.json` (invalid ones are skipped).

        Returns its marker plus `key` (the checkpoint's prefix), or None when no round was checkpointed yet.
        Markers that are all invalid, or one that is not this run's marker for that round, raise ShardError
        naming it (bad store contents must never silently restart the run from θ0)."""
        try:
            found = self.series.newest(below)
        except NotCommitted as e:
            raise ShardError(e.key, e.problem) from None
        return None if found is None else self._record(found)

    def _record(self, found: Committed) -> dict[str, Any]:
        rec, q, key = found.marker, found.step, f"{found.key}/{MARKER}"
        if rec["quorum_id"] != q or rec["run_id"] != self.config.run_id:
            raise ShardError(key, f"not a checkpoint marker of run {self.config.run_id!r} round {q}: "
                                  f"{json.dumps(rec)[:200]}")
        return {**rec, "key": found.key}

    def newest_round(self) -> int | None:
        """Like `read_latest()["quorum_id"]`, for error paths: None when it cannot be read either."""
        try:
            latest = self.read_latest()
        except Exception:
            return None
        return None if latest is None else int(latest["quorum_id"])

    # ---- writing ----------------------------------------------------------------------------------------------
    def collect_state(self) -> dict[str, StateDict]:
        """What the registered state-dict fns return now (DiLoCo: global params + outer optimizer per fragment)."""
        return {key: save() for key, (_, save) in sorted(self.states.items())}

    def raise_error(self, block: bool) -> None:
        """Re-raise the background writer's failure (once). `block`: wait for a write in progress."""
        fut = self.future
        if fut is None or not (block or fut.done()):
            return
        self.future = None
        fut.result()

    def write(self, q: int, step: int, wait: bool) -> None:
        """Checkpoint the state now as round `q` (outer step `step`): cloned here, written in the background."""
        self.raise_error(block=True)  # one write at a time
        tensors: dict[str, torch.Tensor] = {}
        skeleton = flatten(self.collect_state(), "", tensors)  # cloned now: training moves on meanwhile
        meta = {"run_id": self.config.run_id, "quorum_id": q, "step": step}
        self.future = self._executor.submit(self._write, q, step, tensors, skeleton, meta)
        if wait:
            self.raise_error(block=True)

    def _write(self, q: int, step: int, tensors: dict[str, torch.Tensor], skeleton: Any, meta: dict[str, Any]) -> None:
        ckpt = self.series.at(q)
        key = ckpt.key(STATE)
        try:
            blob = encode_flat(tensors, skeleton, meta)
            ckpt.write(STATE, blob)
            key = ckpt.key(MARKER)  # last: a checkpoint without its marker is never picked
            ckpt.commit({"quorum_id": q, "step": step, "bytes": len(blob), "run_id": self.config.run_id})
        except Exception as e:
            newest = self.newest_round()
            if newest is not None and newest > q:  # superseded while this slow write ran: nothing needs it
                log.warning("replica %d: checkpoint of round %d failed at %s/%s (%s: %s), but round %d is "
                            "already checkpointed", self.replica_id, q, self.store.uri, key, type(e).__name__, e,
                            newest)
                return
            raise CheckpointError(
                f"replica {self.replica_id}: DiLoCo checkpoint of round {q} (step {step}) failed writing "
                f"{self.store.uri}/{key}: {type(e).__name__}: {e}"
            ) from e
        self._collect_garbage(q)

    def _collect_garbage(self, q: int) -> None:
        """Delete rounds and checkpoints `keep_rounds` or more below round `q`, whose checkpoint is committed.

        The newest committed checkpoint is >= q, so it is never deleted. Failures only leak storage: logged."""
        keep = self.config.keep_rounds
        for top in (ROUNDS, CKPT):
            try:
                for name in [name for r, name in self._numbered(top) if r <= q - keep]:
                    self.store.rm_prefix(f"{top}/{name}")
            except Exception as e:
                log.warning("replica %d: garbage collection of %s/%s below round %d failed (%s: %s)",
                            self.replica_id, self.store.uri, top, q - keep + 1, type(e).__name__, e)

    def _numbered(self, top: str) -> list[tuple[int, str]]:
        """(round, name) of the `qNNNNNNNN` entries under `top` (`rounds` or `ckpt`)."""
        return [(r, name) for name in self.store.list(top) if (r := _round_of(name)) is not None]

    # ---- loading ----------------------------------------------------------------------------------------------
    def bootstrap(self) -> tuple[str, tuple[int, int] | None]:
        """The latest checkpoint, else one agreed θ0: ("resumed", (round, step)) or ("initialized", None)."""
        latest = self.read_latest()
        if latest is not None:
            return "resumed", self.heal(latest)
        if not self.store.exists(INIT_POINTER):
            blob = encode_state(
                self.collect_state(), {"run_id": self.config.run_id, "quorum_id": 0, "step": 0}
            )
            own = f"{CKPT}/init/r{self.replica_id:03d}.safetensors"
            self.store.put(own, blob)
            self.store.put_json_if_absent(
                INIT_POINTER, {"key": own, "bytes": len(blob), "quorum_id": 0, "step": 0}
            )
        ptr = self.store.get_json(INIT_POINTER)
        self._load(ptr["key"], ptr)
        return "initialized", None

    def heal(self, latest: dict[str, Any] | None = None) -> tuple[int, int] | None:
        """Load the latest committed state (a `read_latest()` record) whose bytes match its marker; its (round,
        step), None if there is none. A state that differs from its marker is refused with a warning, and the
        newest older one that verifies is used; ShardError if none does."""
        latest = latest if latest is not None else self.read_latest()
        while True:
            if latest is None:
                ptr = self.store.get_json_or_none(INIT_POINTER)
                if ptr is None:
                    return None
                self._load(ptr["key"], ptr)
                return 0, 0
            key = f"{latest['key']}/{STATE}"
            try:
                blob = self.series.at(latest["quorum_id"]).read(STATE, latest)
            except FileNotFoundError:
                # Garbage-collected under a slow reader: a newer checkpoint was committed meanwhile.
                newer = self.read_latest()
                if newer is None or newer["quorum_id"] <= latest["quorum_id"]:
                    raise ShardError(key, "missing, although its checkpoint is the newest committed one") from None
                latest = newer
                continue
            except ContentError as e:
                latest = self._older_than(latest["quorum_id"], e)
                continue
            self._load(key, latest, blob)
            return int(latest["quorum_id"]), int(latest["step"])

    def _older_than(self, q: int, refused: ContentError) -> dict[str, Any]:
        """The newest committed checkpoint below round `q`, whose state `refused` named; ShardError if none."""
        log.warning("replica %d: refusing the DiLoCo checkpoint of round %d: %s", self.replica_id, q, refused)
        older = self.read_latest(below=q)
        if older is None:
            raise ShardError(refused.where, f"{refused.problem}; no older checkpoint to heal from")
        return older

    def _load(self, key: str, record: dict[str, Any], blob: bytes | bytearray | None = None) -> None:
        """Decode the state at `key` (`blob`: its bytes, already read and checked) and hand it to the registered
        state-dict fns and `on_load`."""
        blob = self.store.get(key) if blob is None else blob
        state, meta = decode_state(key, blob, self.config.run_id, expected_size=record.get("bytes"))
        missing = sorted(set(self.states) - set(state))
        if missing:
            raise ShardError(key, f"checkpoint lacks state for {missing}; it has {sorted(state)}")
        for k, (load, _) in self.states.items():
            load(state[k])
        self._on_load(state)
        log.info(
            "replica %d loaded %s (round %s, step %s)",
            self.replica_id,
            key,
            meta.get("quorum_id"),
            meta.get("step"),
        )

    # ---- rewinding --------------------------------------------------------------------------------------------
    def discard_after(self, quorum_id: int) -> None:
        """Delete the checkpoints (first, so the latest never names a deleted future) and rounds newer than
        `quorum_id`, and check they are gone; a write still pending here belongs to that future and is dropped.
        Idempotent: every replica of a resumed run does it."""
        pending, self.future = self.future, None
        if pending is not None and pending.exception() is not None:  # its round is being abandoned anyway
            log.warning("replica %d: a checkpoint write failed before the rewind: %s", self.replica_id,
                        pending.exception())
        for top in (CKPT, ROUNDS):
            newer = self._newer_than(top, quorum_id)
            for _ in range(3):  # another replica may be deleting the same objects: look again
                for name in newer:
                    self.store.rm_prefix(f"{top}/{name}")
                newer = self._newer_than(top, quorum_id)
                if not newer:
                    break
            if newer:
                raise StoreError(f"replica {self.replica_id}: rewinding to round {quorum_id}: {self.store.uri}/{top} "
                                 f"still holds {newer}")

    def _newer_than(self, top: str, quorum_id: int) -> list[str]:
        """Entries `qNNNNNNNN` under `top` (`rounds` or `ckpt`) of rounds after `quorum_id`."""
        return [name for r, name in self._numbered(top) if r > quorum_id]

    def close(self, wait: bool) -> None:
        self._executor.shutdown(wait=wait)
