"""A torchft `Manager` stand-in whose allreduce is a reduce-scatter through an object store: the façade.

`torchft.local_sgd.DiLoCo` (real, unmodified) drives this class through the small surface it uses:
`_use_async_quorum`, `register_state_dict_fn`, `allow/disallow_state_dict_read`, `start_quorum`,
`current_step`, `allreduce(...) -> Work` (in place; `wait()` and `get_future().then`) and `should_commit`.

One DiLoCo sync is one *round*, keyed by the quorum id (bumped by every `start_quorum`, so a failed round
never reuses keys). The façade holds the replica's position (round, outer step, whether it must heal) and
hands the work to three parts, each in its own module:
- `rounds.RoundProtocol`: one round's publish / quorum / reduce / gather through the store (`membership.py`
  holds the create-only membership decisions), run on a background thread between `flush` and `wait`;
- `checkpoints.DiLoCoCheckpoints`: after a commit the round's designated member checkpoints the DiLoCo state
  (a committed directory of `mesh/storage`); bootstrap, heal, garbage collection and rewind;
- `codec`: the state dicts as safetensors + a JSON skeleton, never pickle.

A replica resumed from its own saved state calls `rewind(quorum_id, step)`: the rounds and checkpoints after the
saved round are the stopped run's abandoned future, and are deleted before anyone trains again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from composer_mesh.mesh.objectstore.checkpoints import CheckpointError, DiLoCoCheckpoints
from composer_mesh.mesh.objectstore.codec import StateDict, decode_state, encode_state
from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.mesh.objectstore.rounds import RoundProtocol, RoundReport
from composer_mesh.mesh.objectstore.store import Store

log = logging.getLogger(__name__)


def _avg_op() -> Any:
    from torch.distributed import ReduceOp

    return ReduceOp.AVG


class ObjectStoreWork:
    """Work handle returned by `allreduce`. `wait()` finishes the round and writes the average in place."""

    def __init__(self, manager: ObjectStoreManager, round_id: int, tensor: torch.Tensor) -> None:
        self._manager = manager
        self._round_id = round_id
        self.tensor = tensor
        self._future: torch.futures.Future = torch.futures.Future()

    def wait(self, timeout: Any = None) -> bool:
        # Complete in the caller's thread: torch Future callbacks (DiLoCo's bucket scatter-back) then run
        # inline, before wait() returns.
        self._manager._complete_round(self._round_id)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


class ObjectStoreManager:
    """Duck-typed `torchft.Manager` for `torchft.local_sgd.DiLoCo`, synchronising through `Store`."""

    _use_async_quorum = False  # DiLoCo refuses an async quorum; ours is synchronous by construction

    def __init__(self, config: DiLoCoConfig, replica_id: int, store: Store | None = None) -> None:
        if not 0 <= replica_id < config.replicas:
            raise ValueError(f"replica_id={replica_id} must be in [0, diloco.replicas={config.replicas})")
        self.config = config
        self.replica_id = replica_id
        self.store = store or Store.from_config(config)
        self._quorum_id = 0
        self._step = 0
        self._state_fns: dict[str, tuple[Callable[[StateDict], None], Callable[[], StateDict]]] = {}
        self._works: list[ObjectStoreWork] = []
        self._round_future: Future | None = None
        self._round_done = True
        self._round_ok: bool | None = None
        self._abstain = False
        self._needs_heal = False
        self._pending_checkpoint: tuple[int, int, list[int]] | None = None
        self._errored: Exception | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"objstore-r{replica_id}")
        self.checkpoints = DiLoCoCheckpoints(config, replica_id, self.store, self._state_fns,
                                             lambda state: self.on_heal(state) if self.on_heal is not None else None)
        self.rounds = RoundProtocol(config, replica_id, self.store, self.checkpoints.read_latest, self.report_error)
        self.reports: list[RoundReport] = []
        self.on_heal: Callable[[dict[str, StateDict]], None] | None = None

    @property
    def _ckpt_future(self) -> Future | None:
        """The checkpoint write in the background (tests wait on it)."""
        return self.checkpoints.future

    # ------------------------------------------------------------------ torchft Manager surface
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[StateDict], None], state_dict: Callable[[], StateDict]
    ) -> None:
        if key in self._state_fns:
            raise ValueError(f"state dict fn {key!r} is already registered")
        self._state_fns[key] = (load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        """No-op: state is checkpointed from the training thread right after the outer step."""

    def disallow_state_dict_read(self) -> None:
        """No-op (see allow_state_dict_read)."""

    def current_step(self) -> int:
        return self._step

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        """Open the next round. Heals first if this replica fell behind or failed its last round."""
        self.checkpoints.raise_error(block=False)
        if not self._round_done:  # a round whose works were never waited: finish it so keys stay in order
            self._complete_round(self._quorum_id)
        self._abstain = False
        self._errored = None
        latest = self.checkpoints.read_latest()
        if self._needs_heal:  # give the others' checkpoint of the round we failed a chance to land
            until = time.monotonic() + self.config.quorum_deadline_s
            while (latest is None or latest["quorum_id"] < self._quorum_id) and time.monotonic() < until:
                time.sleep(self.config.poll_interval_s)
                latest = self.checkpoints.read_latest()
        if self._needs_heal or (latest is not None and latest["quorum_id"] > self._quorum_id):
            why = (
                "its last round failed"
                if self._needs_heal
                else f"the store is at round {latest['quorum_id']}"
            )
            log.warning(
                "replica %d at round %d heals from the store (%s)", self.replica_id, self._quorum_id, why
            )
            if self.heal(latest):
                self._abstain = True  # local progress is relative to stale globals: read this round only
            self._needs_heal = False
        self._quorum_id += 1
        self._works = []
        self._round_future = None
        self._round_done = False
        self._round_ok = None

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None
    ) -> ObjectStoreWork:
        """Queue `tensor` for this round's average; the result is written into `tensor` by `wait()`.

        `should_quantize` is accepted for DiLoCo's sake; compression is set by `diloco.compression`.
        """
        if reduce_op is not None and reduce_op != _avg_op():
            raise ValueError(f"ObjectStoreManager.allreduce supports ReduceOp.AVG only, got {reduce_op}")
        if self._round_done:
            raise RuntimeError("allreduce called outside a round: DiLoCo must call start_quorum() first")
        if self._round_future is not None:
            raise RuntimeError(f"allreduce after round {self._quorum_id} was already flushed")
        work = ObjectStoreWork(self, self._quorum_id, tensor)
        self._works.append(work)
        return work

    def should_commit(self, timeout: Any = None) -> bool:
        """True iff this round completed; identical on every replica that completed it."""
        if not self._round_done:
            self._complete_round(self._quorum_id)
        ok = bool(self._round_ok)
        report = self.reports[-1] if self.reports else None
        if ok:
            self._step += 1
            if report is not None and report.members:
                writer = report.members[self._quorum_id % len(report.members)]
                if writer == self.replica_id:
                    self._pending_checkpoint = (self._quorum_id, self._step, list(report.members))
        elif report is not None and report.error is not None and not report.error.startswith("round aborted"):
            self._needs_heal = True  # a local failure: the others may have committed
        return ok

    # extras that torchft code paths sometimes read
    def errored(self) -> Exception | None:
        return self._errored

    def report_error(self, e: Exception) -> None:
        self._errored = e

    def num_participants(self) -> int:
        report = self.reports[-1] if self.reports else None
        return len(report.members) if report else self.config.replicas

    def is_participating(self) -> bool:
        return not self._abstain

    @property
    def quorum_id(self) -> int:
        return self._quorum_id

    @property
    def round_open(self) -> bool:
        """A round was started (`start_quorum`) and its result is not applied yet: the sync is in flight."""
        return not self._round_done

    @property
    def needs_heal(self) -> bool:
        """This replica's last round failed locally: it heals from the store at the next `start_quorum`."""
        return self._needs_heal

    # ------------------------------------------------------------------ round driving
    def flush(self) -> None:
        """Start the round's I/O in the background (called right after DiLoCo's prepare_sync)."""
        if self._round_done or self._round_future is not None:
            return
        flat = None
        if not self._abstain:
            # Like torch.distributed async ops, the inputs must not change until wait(); DiLoCo honours this
            # (its pseudo-gradients sit untouched between prepare_sync and perform_sync), so one contiguous
            # fp32 CPU tensor is used as is, without a copy.
            parts = [w.tensor.detach().reshape(-1).to("cpu", torch.float32) for w in self._works]
            flat = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0)
        numel = sum(w.tensor.numel() for w in self._works)
        self._round_future = self._executor.submit(self.rounds.run, self._quorum_id, flat, numel)

    def _complete_round(self, round_id: int) -> None:
        if self._round_done or round_id != self._quorum_id:
            return
        self.flush()
        assert self._round_future is not None
        result: torch.Tensor | None
        result, report = self._round_future.result()
        self.reports.append(report)
        self._round_ok = report.committed
        if result is not None and report.committed:
            off = 0
            with torch.no_grad():
                for w in self._works:
                    n = w.tensor.numel()
                    w.tensor.copy_(result[off : off + n].view_as(w.tensor).to(w.tensor.dtype))
                    off += n
        self._round_done = True
        # Drop the round's buffers now (the result vector, own slices), not at the next round: with a large
        # model they are about 1 + 1/N times its size.
        self._round_future = None
        del result
        self.rounds.drop_buffers()
        for w in self._works:
            w._future.set_result([w.tensor])

    # ------------------------------------------------------------------ checkpoints, bootstrap, heal
    def collect_state(self) -> dict[str, StateDict]:
        """What the registered state-dict fns return now (DiLoCo: global params + outer optimizer per fragment)."""
        return self.checkpoints.collect_state()

    def restore_state(self, state: dict[str, StateDict]) -> None:
        """Hand `state` (as `collect_state` returns it) to the registered load fns. Unlike healing, the model's
        parameters are left alone: a resumed replica's local parameters come from its own saved state."""
        missing = sorted(set(self._state_fns) - set(state))
        if missing:
            raise ValueError(f"state lacks {missing}; it has {sorted(state)}")
        for key, (load, _) in self._state_fns.items():
            load(state[key])

    def rewind(self, quorum_id: int, step: int, needs_heal: bool = False) -> None:
        """Put this replica and the store back at the end of round `quorum_id` (committed outer step `step`), to
        resume a replica's saved state.

        Rounds and checkpoints newer than `quorum_id` belong to the abandoned future of the run the state was
        saved from. Left in place, the next `start_quorum` would heal from a newer checkpoint, or join an old
        round's membership and read its stale averages. They are deleted (checkpoints first, so the latest never
        names a deleted future) and the deletion is checked. Deleting is idempotent: every replica of the
        resumed run rewinds, and none may train before all have (the controller waits for every `load_state`).
        The replicas of the stopped run must be gone: a late write of theirs would bring a newer round back."""
        if self.round_open:
            raise RuntimeError(f"replica {self.replica_id}: cannot rewind while round {self._quorum_id} is open")
        self._pending_checkpoint = None
        self.checkpoints.discard_after(quorum_id)
        self._quorum_id, self._step, self._needs_heal = quorum_id, step, needs_heal
        self._errored = None
        log.info("replica %d rewound to round %d (step %d)", self.replica_id, quorum_id, step)

    def maybe_checkpoint(self, wait: bool = False) -> None:
        """After a committed outer step: the round's designated member checkpoints the DiLoCo state.

        The write runs in the background; if it fails, CheckpointError is raised here at a later call (or by
        `start_quorum`/`shutdown`), so a failed write fails the training step instead of going unnoticed."""
        self.checkpoints.raise_error(block=False)
        if self._pending_checkpoint is None:
            return
        q, step, _members = self._pending_checkpoint
        self._pending_checkpoint = None
        self.checkpoints.write(q, step, wait)

    def bootstrap(self) -> str:
        """Make every replica start from the same state: the latest checkpoint, else one agreed θ0.

        Returns "resumed" or "initialized". Call after DiLoCo registered its state-dict fns.
        """
        mode, position = self.checkpoints.bootstrap()
        if position is not None:
            self._quorum_id, self._step = position
        return mode

    def heal(self, latest: dict[str, Any] | None = None) -> bool:
        """Load the latest committed state (a `checkpoints.read_latest()` record); False if the store has none."""
        position = self.checkpoints.heal(latest)
        if position is None:
            return False
        self._quorum_id, self._step = position
        return True

    def shutdown(self, wait: bool = True) -> None:
        """Stop the I/O threads; raises CheckpointError if the last checkpoint write failed (waited for if
        `wait`)."""
        try:
            self.checkpoints.raise_error(block=wait)
        finally:
            self._executor.shutdown(wait=wait)
            self.checkpoints.close(wait)
            self.rounds.close(wait)


__all__ = ["CheckpointError", "ObjectStoreManager", "ObjectStoreWork", "RoundReport", "StateDict", "decode_state",
           "encode_state"]
