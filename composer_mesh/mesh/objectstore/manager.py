"""A torchft `Manager` stand-in whose allreduce is a reduce-scatter through an object store.

`torchft.local_sgd.DiLoCo` (real, unmodified) drives this class through the small surface it uses:
`_use_async_quorum`, `register_state_dict_fn`, `allow/disallow_state_dict_read`, `start_quorum`,
`current_step`, `allreduce(...) -> Work` (in place; `wait()` and `get_future().then`) and `should_commit`.

One DiLoCo sync is one *round*, keyed by the quorum id (bumped by every `start_quorum`, so a failed round
never reuses keys). Every `allreduce` of the round is packed into one flat vector and reduced together:

1. publish  : the replica cuts its vector into `replicas` slices, PUTs each as a checksummed safetensors
              shard, then PUTs `arrived/rNNN.json` (data first, marker last).
2. quorum   : once all replicas arrived or `quorum_deadline_s` passed, the first replica to decide writes
              `members/e0.json` create-only; everyone adopts that record, so membership is identical.
3. reduce   : slice j is averaged by member `members[j % k]`, reading slice j of every member (≈ M bytes)
              in member order, and written to `reduced/eE/sJ` (≈ M/N bytes).
4. gather   : everyone reads all reduced slices (≈ M bytes). A slice whose reducer died is reduced by the
              waiting replica after the deadline (same inputs, same order: same bytes).
A bad shard found in step 3 (truncated, checksum, another run) moves the round to epoch E+1 without that
replica (create-only `members/eE+1.json`), so the round still completes over the good replicas.

So a replica reads ≈ 2×M and writes ≈ M(1 + 1/N) per round whatever N, and every replica copies the very
same reduced bytes: results are bitwise identical. Replicas that arrive late, or that just healed, read
the result without contributing and commit the same outer step.

After a commit the round's designated member checkpoints the DiLoCo state (global parameters and outer
optimizer, via the registered state-dict fns) to `ckpt/qNNNNNNNN/`: `state.safetensors` first, then the
`COMMITTED.json` marker. A restarted replica loads it and rejoins at the next round identical to the others.

The latest checkpoint is not a mutable pointer (a `latest.json` read-then-written by a slow writer could go
backwards, s3 has no compare-and-swap): it is the highest `ckpt/qNNNNNNNN/` holding a `COMMITTED.json`, found
by listing. Markers are immutable and only ever added, and garbage collection runs only after its writer's
own marker and deletes only checkpoints `keep_rounds` below it, so the newest committed checkpoint is never
deleted and the latest never moves backwards. A checkpoint write that fails is raised (`CheckpointError`, naming
the object and the cause) at the next `maybe_checkpoint`/`start_quorum` or at `shutdown`, unless a newer
checkpoint was committed meanwhile (then nothing depends on it).

A replica resumed from its own saved state calls `rewind(quorum_id, step)`: the rounds and checkpoints after the
saved round are the stopped run's abandoned future, and are deleted before anyone trains again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.mesh.objectstore.store import (
    ShardError,
    Store,
    StoreError,
    decode_shard,
    encode_shard,
    encode_shard_parts,
)

log = logging.getLogger(__name__)

StateDict = dict[str, Any]


@dataclass
class RoundReport:
    """What happened in one round, as every replica sees it (members/rejected are identical everywhere)."""

    quorum_id: int
    replica: int
    committed: bool = False
    contributed: bool = False
    abstained: bool = False  # healed into this round: read the result only
    late: bool = False  # the round was decided before this replica published: read the result only
    members: list[int] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    epoch: int = 0
    reduced_slices: list[int] = field(default_factory=list)
    fallback_slices: list[int] = field(default_factory=list)
    numel: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds in publish / quorum / reduce / gather
    error: str | None = None


def _avg_op() -> Any:
    from torch.distributed import ReduceOp

    return ReduceOp.AVG


class CheckpointError(RuntimeError):
    """A DiLoCo checkpoint could not be written; the message names the object and the cause."""


def _ckpt_round(name: str) -> int | None:
    """The round of a `ckpt/` entry named `qNNNNNNNN`, else None (`init`, temp names)."""
    return int(name[1:]) if name.startswith("q") and name[1:].isdigit() else None


class _RoundFailed(RuntimeError):
    """The round cannot complete (consistently for all replicas, e.g. no member left)."""


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
        self._wire_dtype = torch.bfloat16 if config.compression == "bf16" else torch.float32
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
        self._own: dict[str, Any] = {"wire": None, "reduced": {}}  # per round, used by the round thread only
        self._errored: Exception | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"objstore-r{replica_id}")
        self._ckpt_executor = ThreadPoolExecutor(1, thread_name_prefix=f"objstore-ckpt-r{replica_id}")
        self._io = ThreadPoolExecutor(4, thread_name_prefix=f"objstore-io-r{replica_id}")
        self._ckpt_future: Future | None = None
        self.reports: list[RoundReport] = []
        self.on_heal: Callable[[dict[str, StateDict]], None] | None = None

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
        self._raise_checkpoint_error(block=False)
        if not self._round_done:  # a round whose works were never waited: finish it so keys stay in order
            self._complete_round(self._quorum_id)
        self._abstain = False
        self._errored = None
        latest = self.read_latest()
        if self._needs_heal:  # give the others' checkpoint of the round we failed a chance to land
            until = time.monotonic() + self.config.quorum_deadline_s
            while (latest is None or latest["quorum_id"] < self._quorum_id) and time.monotonic() < until:
                time.sleep(self.config.poll_interval_s)
                latest = self.read_latest()
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
        self._round_future = self._executor.submit(self._run_round, self._quorum_id, flat, numel)

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
        self._own = {"wire": None, "reduced": {}}
        for w in self._works:
            w._future.set_result([w.tensor])

    def _run_round(
        self, q: int, flat: torch.Tensor | None, numel: int
    ) -> tuple[torch.Tensor | None, RoundReport]:
        r0, w0 = self.store.counters()
        t0 = time.perf_counter()
        report = RoundReport(quorum_id=q, replica=self.replica_id, abstained=flat is None, numel=numel)
        result = None
        try:
            result = self._round(q, flat, numel, report)
            report.committed = True
        except _RoundFailed as e:
            report.error = f"round aborted: {e}"
            log.error("replica %d round %d: %s", self.replica_id, q, report.error)
        except Exception as e:
            report.error = f"{type(e).__name__}: {e}"
            self._errored = e
            log.exception("replica %d round %d failed locally", self.replica_id, q)
        r1, w1 = self.store.counters()
        report.bytes_read, report.bytes_written = r1 - r0, w1 - w0
        report.seconds = time.perf_counter() - t0
        return result, report

    def _slice_bounds(self, numel: int, j: int) -> tuple[int, int]:
        n = self.config.replicas
        return j * numel // n, (j + 1) * numel // n

    def _round(self, q: int, flat: torch.Tensor | None, numel: int, report: RoundReport) -> torch.Tensor:
        base = f"rounds/q{q:08d}"
        t_start = time.perf_counter()
        self._publish(base, q, flat, numel, report)
        t_pub = time.perf_counter()
        report.phases["publish"] = t_pub - t_start
        # 2. quorum
        record = self._decide_members(base, q, numel)
        report.phases["quorum"] = time.perf_counter() - t_pub
        return self._reduce_and_gather(base, q, record, numel, report)

    def _publish(self, base: str, q: int, flat: torch.Tensor | None, numel: int, report: RoundReport) -> None:
        """1. Publish this replica's shards and arrival marker.

        Not when the round was already decided without us (we are late, or restarted into it): publishing
        could replace shards of an earlier incarnation that others may still be reading."""
        cfg, n, me = self.config, self.config.replicas, self.replica_id
        late = self.store.exists(f"{base}/members/e0.json")
        if late:
            flat = None
            report.late = True
        marker: dict[str, Any] = {
            "run_id": cfg.run_id,
            "quorum_id": q,
            "replica": me,
            "numel": numel,
            "dtype": str(self._wire_dtype),
            "abstain": flat is None,
            "sizes": [],
        }
        wire = flat.to(self._wire_dtype) if flat is not None else None
        # What this replica already holds, so it never reads back its own bytes: its wire vector and the
        # slices it averaged (same bytes as in the store; both are only used for this round).
        self._own = {"wire": wire, "reduced": {}}
        if wire is not None:

            def put_slice(j: int) -> int:
                lo, hi = self._slice_bounds(numel, j)
                parts = encode_shard_parts({"data": wire[lo:hi]}, self._meta(q, me, j, kind="shard"))
                self.store.put(f"{base}/shards/r{me:03d}/s{j:03d}.safetensors", parts)
                return sum(memoryview(b).nbytes for b in parts)

            marker["sizes"] = list(self._io.map(put_slice, range(n)))
            report.contributed = True
        if not late:
            self.store.put_json(f"{base}/arrived/r{me:03d}.json", marker)

    def _reduce_and_gather(
        self, base: str, q: int, record: dict[str, Any], numel: int, report: RoundReport
    ) -> torch.Tensor:
        """3 + 4. Reduce my slices, gather all; a bad shard moves everyone to the next epoch.

        Whether epoch e completes or is amended is itself decided create-only (slot e+1 holds a seal or an
        amendment), so no replica can commit epoch e while another moves on to e+1."""
        n, me = self.config.replicas, self.replica_id
        sealed = False  # epoch `record` was sealed by someone else while this replica found a bad input
        while True:
            members = record["members"]
            report.members, report.rejected, report.epoch = (
                list(members),
                dict(record["rejected"]),
                record["epoch"],
            )
            if not members:
                raise _RoundFailed(
                    f"no usable replica in round {q} (rejected: {record['rejected'] or 'none'})"
                )
            k = len(members)
            mine = [j for j in range(n) if members[j % k] == me]
            try:
                t0 = time.perf_counter()
                if not sealed:
                    for j in mine:
                        self._reduce_slice(base, q, record, j)
                        report.reduced_slices.append(j)
                t1 = time.perf_counter()
                out = self._gather(base, q, record, numel, report)
                report.phases["reduce"] = report.phases.get("reduce", 0.0) + t1 - t0
                report.phases["gather"] = report.phases.get("gather", 0.0) + time.perf_counter() - t1
                if isinstance(out, dict):  # someone amended the membership
                    record, sealed = out, False
                    continue
                if not sealed:
                    amendment = self._seal(base, record)
                    if amendment is not None:
                        record = amendment
                        continue
                return out
            except ShardError as bad:
                nxt = self._amend(base, record, bad)
                if nxt.get("sealed"):
                    if sealed:  # the sealed result is unreadable here: fail locally, heal next round
                        raise RuntimeError(f"round {q} epoch {record['epoch']} is sealed but unreadable here: "
                                           f"{bad}") from bad
                    sealed = True  # others completed this epoch: its reduced slices stand, just read them
                    continue
                record, sealed = nxt, False

    def _backoff(self, polls: int) -> float:
        """Poll quickly at first (most waits are short), then every poll_interval_s."""
        return min(self.config.poll_interval_s, 0.002 * 2 ** min(polls, 12))

    def _meta(self, q: int, replica: int, j: int, kind: str, epoch: int | None = None) -> dict[str, Any]:
        m: dict[str, Any] = {
            "run_id": self.config.run_id,
            "quorum_id": q,
            "replica": replica,
            "slice": j,
            "kind": kind,
        }
        if epoch is not None:
            m["epoch"] = epoch
        return m

    def _decide_members(self, base: str, q: int, numel: int) -> dict[str, Any]:
        cfg = self.config
        deadline = time.monotonic() + cfg.quorum_deadline_s
        key = f"{base}/members/e0.json"
        polls = 0
        while True:
            record = self.store.get_json_or_none(key)
            if record is not None:
                return record
            arrived = [a for a in self.store.list(f"{base}/arrived") if a.endswith(".json")]
            if len(arrived) >= cfg.replicas or time.monotonic() >= deadline:
                latest = self.read_latest()
                if latest is not None and latest["quorum_id"] >= q:
                    # The others committed this round long ago (its records may be gone): never re-decide it.
                    raise RuntimeError(
                        f"round {q} was already committed by other replicas; this replica is behind"
                    )
                members: list[int] = []
                sizes: dict[str, list[int]] = {}
                rejected: dict[str, str] = {}
                keys = [f"{base}/arrived/{name}" for name in arrived]
                for name, mkey, got in zip(arrived, keys, self._io.map(self._try_get_json, keys)):
                    try:
                        if isinstance(got, Exception):
                            raise ShardError(mkey, f"unreadable arrival marker ({got})")
                        m = got
                        r = int(m["replica"])
                        if name != f"r{r:03d}.json":
                            raise ShardError(mkey, f"marker claims to be replica {r}")
                        if m.get("run_id") != cfg.run_id:
                            raise ShardError(
                                mkey,
                                f"a marker from another run: run_id={m.get('run_id')!r}, "
                                f"expected {cfg.run_id!r}",
                            )
                        if int(m["quorum_id"]) != q:
                            raise ShardError(mkey, f"wrong quorum_id {m['quorum_id']}, expected {q}")
                        if m["abstain"]:
                            continue
                        if int(m["numel"]) != numel or m["dtype"] != str(self._wire_dtype):
                            raise ShardError(
                                mkey,
                                f"layout mismatch: numel={m['numel']} dtype={m['dtype']}, "
                                f"expected numel={numel} dtype={self._wire_dtype}",
                            )
                        if not 0 <= r < cfg.replicas or len(m["sizes"]) != cfg.replicas:
                            raise ShardError(mkey, f"bad replica id {r} or slice count {len(m['sizes'])}")
                    except ShardError as e:
                        log.error("round %d: rejecting %s", q, e)
                        rejected[name.removesuffix(".json")] = str(e)
                        continue
                    except (KeyError, TypeError, ValueError) as e:
                        rejected[name.removesuffix(".json")] = f"{mkey}: unreadable arrival marker ({e!r})"
                        continue
                    members.append(r)
                    sizes[str(r)] = [int(s) for s in m["sizes"]]
                record = {
                    "epoch": 0,
                    "members": sorted(members),
                    "sizes": sizes,
                    "rejected": rejected,
                    "numel": numel,
                    "decided_by": self.replica_id,
                    "arrived": arrived,
                }
                return self._publish_record(key, record)
            polls += 1
            time.sleep(self._backoff(polls))

    def _try_get_json(self, key: str) -> Any:
        try:
            return self.store.get_json(key)
        except (ShardError, FileNotFoundError) as e:
            return e

    def _publish_record(self, key: str, record: dict[str, Any]) -> dict[str, Any]:
        """Create-only write of a decision; returns the record that won (ours or an earlier one)."""
        if self.store.put_json_if_absent(key, record):
            return json.loads(json.dumps(record, sort_keys=True))
        return self.store.get_json(key)

    def _seal(self, base: str, record: dict[str, Any]) -> dict[str, Any] | None:
        """Claim slot e+1 for "epoch e completed"; returns the amendment instead if one got there first."""
        key = f"{base}/members/e{record['epoch'] + 1}.json"
        existing = self.store.get_json_or_none(key)
        if existing is None:
            seal = {"epoch": record["epoch"] + 1, "sealed": True, "sealed_epoch": record["epoch"],
                    "members": record["members"], "rejected": record["rejected"], "decided_by": self.replica_id}
            if self.store.put_json_if_absent(key, seal):
                return None
            existing = self.store.get_json(key)
        return None if existing.get("sealed") else existing

    def _amend(self, base: str, record: dict[str, Any], bad: ShardError) -> dict[str, Any]:
        """Drop the replica whose shard is bad; the next epoch record is create-only, so all agree."""
        culprit = int(bad.key.split("/shards/r", 1)[1][:3]) if "/shards/r" in bad.key else None
        log.error("replica %d: rejecting shard %s", self.replica_id, bad)
        epoch = record["epoch"] + 1
        new = {
            **record,
            "epoch": epoch,
            "decided_by": self.replica_id,
            "members": [m for m in record["members"] if m != culprit],
            "rejected": {
                **record["rejected"],
                f"r{culprit:03d}" if culprit is not None else bad.key: str(bad),
            },
        }
        if culprit is None:  # a corrupt reduced slice: no member to blame, fail the round cleanly
            new["members"] = []
        return self._publish_record(f"{base}/members/e{epoch}.json", new)

    def _reduce_slice(self, base: str, q: int, record: dict[str, Any], j: int, fallback: bool = False) -> None:
        epoch, members = record["epoch"], record["members"]
        out_key = f"{base}/reduced/e{epoch}/s{j:03d}.safetensors"
        if (epoch, j) in self._own["reduced"] or (fallback and self.store.exists(out_key)):
            return
        lo, hi = self._slice_bounds(int(record["numel"]), j)

        def fetch(m: int) -> torch.Tensor:
            if m == self.replica_id and self._own["wire"] is not None:
                return self._own["wire"][lo:hi]
            key = f"{base}/shards/r{m:03d}/s{j:03d}.safetensors"
            try:
                blob = self.store.get(key)
            except FileNotFoundError:
                # Shards are written before their marker, so an announced shard only vanishes when the round
                # was garbage-collected: the others are rounds ahead. Never amend on that (the survivors of
                # such an amendment would be this replica alone); fail locally and heal instead.
                raise RuntimeError(
                    f"{key}: missing although announced; round {q} was garbage-collected, this replica is behind"
                ) from None
            tensors, _ = decode_shard(
                key,
                blob,
                expect={
                    "run_id": self.config.run_id,
                    "quorum_id": q,
                    "replica": m,
                    "slice": j,
                    "kind": "shard",
                },
                expected_size=record["sizes"][str(m)][j],
            )
            t = tensors.get("data")
            if t is None or t.dtype != self._wire_dtype or t.numel() != hi - lo:
                raise ShardError(
                    key,
                    f"unexpected payload: {None if t is None else (t.dtype, t.numel())}, "
                    f"expected ({self._wire_dtype}, {hi - lo})",
                )
            return t

        acc: torch.Tensor | None = None
        for t in self._io.map(fetch, members):  # fetched concurrently, summed in member order
            acc = t.to(torch.float32, copy=True) if acc is None else acc.add_(t)
        assert acc is not None
        avg = acc.div_(len(members)).to(self._wire_dtype)
        parts = encode_shard_parts({"data": avg}, self._meta(q, -1, j, kind="reduced", epoch=epoch))
        if self.store.put_if_absent(out_key, parts):  # first writer wins; a fallback writes the same bytes
            self._own["reduced"][(epoch, j)] = avg

    def _gather(
        self, base: str, q: int, record: dict[str, Any], numel: int, report: RoundReport
    ) -> torch.Tensor | dict[str, Any]:
        cfg, n, epoch = self.config, self.config.replicas, record["epoch"]
        out = torch.empty(numel, dtype=self._wire_dtype)
        pending = set(range(n))
        deadline = time.monotonic() + cfg.quorum_deadline_s
        prefix = f"{base}/reduced/e{epoch}"
        polls = 0
        sealed_next = False
        for (e, j), avg in self._own["reduced"].items():
            if e == epoch:
                lo, hi = self._slice_bounds(numel, j)
                out[lo:hi] = avg
                pending.discard(j)
        while pending:
            if not sealed_next:
                later = [
                    m
                    for m in self.store.list(f"{base}/members")
                    if m.startswith("e") and int(m[1:].split(".")[0]) > epoch
                ]
                if later:
                    nxt = self.store.get_json(f"{base}/members/e{epoch + 1}.json")
                    if not nxt.get("sealed"):
                        return nxt  # amended: this epoch will never complete
                    sealed_next = True  # completed by someone: every reduced slice exists
            present = {int(name[1:4]) for name in self.store.list(prefix) if name.endswith(".safetensors")}
            ready = sorted(pending & present)

            def fetch(j: int) -> int:
                lo, hi = self._slice_bounds(numel, j)  # read straight into the result (no extra copy)
                expect = {"run_id": cfg.run_id, "quorum_id": q, "slice": j, "kind": "reduced", "epoch": epoch}
                self.store.read_shard_into(f"{prefix}/s{j:03d}.safetensors", out[lo:hi], expect)
                return j

            for j in self._io.map(fetch, ready):
                pending.discard(j)
            if not pending:
                break
            if time.monotonic() >= deadline:
                for j in sorted(pending):  # the reducer is gone: reduce it here (same inputs -> same bytes)
                    self._reduce_slice(base, q, record, j, fallback=True)
                    report.fallback_slices.append(j)
                    if (epoch, j) in self._own["reduced"]:
                        lo, hi = self._slice_bounds(numel, j)
                        out[lo:hi] = self._own["reduced"][(epoch, j)]
                        pending.discard(j)
                deadline = time.monotonic() + cfg.quorum_deadline_s
                continue
            polls += 1
            time.sleep(self._backoff(polls))
        return out

    # ------------------------------------------------------------------ checkpoint, bootstrap, heal
    def read_latest(self) -> dict[str, Any] | None:
        """The newest committed checkpoint: the highest `ckpt/qNNNNNNNN/` that holds a `COMMITTED.json`.

        Returns its marker plus `key` (the checkpoint's prefix), or None when no round was checkpointed yet.
        A marker that is not this run's marker for that round raises ShardError naming it (bad store contents
        must never silently restart the run from θ0)."""
        rounds = sorted(((q, name) for name in self.store.list("ckpt") if (q := _ckpt_round(name)) is not None),
                        reverse=True)
        for q, name in rounds:
            key = f"ckpt/{name}/COMMITTED.json"
            rec = self.store.get_json_or_none(key)
            if rec is None:  # being written (state first, marker last) or garbage-collected meanwhile
                continue
            try:
                ok = isinstance(rec, dict) and int(rec["quorum_id"]) == q and rec.get("run_id") == self.config.run_id
                step = int(rec["step"]) if ok else 0
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise ShardError(key, f"not a checkpoint marker of run {self.config.run_id!r} round {q}: "
                                      f"{json.dumps(rec)[:200]}")
            return {**rec, "quorum_id": q, "step": step, "key": f"ckpt/{name}"}
        return None

    def _newest_checkpoint_round(self) -> int | None:
        """Like `read_latest()["quorum_id"]`, for error paths: None when it cannot be read either."""
        try:
            latest = self.read_latest()
        except Exception:
            return None
        return None if latest is None else int(latest["quorum_id"])

    def collect_state(self) -> dict[str, StateDict]:
        """What the registered state-dict fns return now (DiLoCo: global params + outer optimizer per fragment)."""
        return {key: save() for key, (_, save) in sorted(self._state_fns.items())}

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
        pending, self._ckpt_future = self._ckpt_future, None
        if pending is not None and pending.exception() is not None:  # its round is being abandoned anyway
            log.warning("replica %d: a checkpoint write failed before the rewind: %s", self.replica_id,
                        pending.exception())
        self._pending_checkpoint = None
        for top in ("ckpt", "rounds"):
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
        self._quorum_id, self._step, self._needs_heal = quorum_id, step, needs_heal
        self._errored = None
        log.info("replica %d rewound to round %d (step %d)", self.replica_id, quorum_id, step)

    def _raise_checkpoint_error(self, block: bool) -> None:
        """Re-raise the background checkpoint writer's failure (once). `block`: wait for a write in progress."""
        fut = self._ckpt_future
        if fut is None or not (block or fut.done()):
            return
        self._ckpt_future = None
        fut.result()

    def maybe_checkpoint(self, wait: bool = False) -> None:
        """After a committed outer step: the round's designated member checkpoints the DiLoCo state.

        The write runs in the background; if it fails, CheckpointError is raised here at a later call (or by
        `start_quorum`/`shutdown`), so a failed write fails the training step instead of going unnoticed."""
        self._raise_checkpoint_error(block=False)
        if self._pending_checkpoint is None:
            return
        q, step, _members = self._pending_checkpoint
        self._pending_checkpoint = None
        self._raise_checkpoint_error(block=True)  # one write at a time
        tensors: dict[str, torch.Tensor] = {}
        skeleton = _flatten(self.collect_state(), "", tensors)  # cloned now: training moves on meanwhile
        meta = {"run_id": self.config.run_id, "quorum_id": q, "step": step}
        self._ckpt_future = self._ckpt_executor.submit(
            self._write_checkpoint, q, step, tensors, skeleton, meta
        )
        if wait:
            self._raise_checkpoint_error(block=True)

    def _write_checkpoint(
        self, q: int, step: int, tensors: dict[str, torch.Tensor], skeleton: Any, meta: dict[str, Any]
    ) -> None:
        prefix = f"ckpt/q{q:08d}"
        key = f"{prefix}/state.safetensors"
        try:
            blob = _encode_flat(tensors, skeleton, meta)
            self.store.put(key, blob)
            key = f"{prefix}/COMMITTED.json"  # last: a checkpoint without its marker is never picked
            self.store.put_json(
                key, {"quorum_id": q, "step": step, "bytes": len(blob), "run_id": self.config.run_id}
            )
        except Exception as e:
            newest = self._newest_checkpoint_round()
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
        for top in ("rounds", "ckpt"):
            try:
                old = [name for name in self.store.list(top) if (r := _ckpt_round(name)) is not None and r <= q - keep]
                for name in old:
                    self.store.rm_prefix(f"{top}/{name}")
            except Exception as e:
                log.warning("replica %d: garbage collection of %s/%s below round %d failed (%s: %s)",
                            self.replica_id, self.store.uri, top, q - keep + 1, type(e).__name__, e)

    def bootstrap(self) -> str:
        """Make every replica start from the same state: the latest checkpoint, else one agreed θ0.

        Returns "resumed" or "initialized". Call after DiLoCo registered its state-dict fns.
        """
        latest = self.read_latest()
        if latest is not None:
            self.heal(latest)
            return "resumed"
        ptr_key = "ckpt/init/COMMITTED.json"
        if not self.store.exists(ptr_key):
            blob = encode_state(
                self.collect_state(), {"run_id": self.config.run_id, "quorum_id": 0, "step": 0}
            )
            own = f"ckpt/init/r{self.replica_id:03d}.safetensors"
            self.store.put(own, blob)
            self.store.put_json_if_absent(
                ptr_key, {"key": own, "bytes": len(blob), "quorum_id": 0, "step": 0}
            )
        ptr = self.store.get_json(ptr_key)
        self._load_checkpoint(ptr["key"], ptr)
        return "initialized"

    def heal(self, latest: dict[str, Any] | None = None) -> bool:
        """Load the latest committed state (a `read_latest()` record); False if the store has none."""
        latest = latest if latest is not None else self.read_latest()
        while True:
            if latest is None:
                ptr = self.store.get_json_or_none("ckpt/init/COMMITTED.json")
                if ptr is None:
                    return False
                self._load_checkpoint(ptr["key"], ptr)
                self._quorum_id, self._step = 0, 0
                return True
            key = f"{latest['key']}/state.safetensors"
            try:
                self._load_checkpoint(key, latest)
            except FileNotFoundError:
                # Garbage-collected under a slow reader: a newer checkpoint was committed meanwhile.
                newer = self.read_latest()
                if newer is None or newer["quorum_id"] <= latest["quorum_id"]:
                    raise ShardError(key, "missing, although its checkpoint is the newest committed one") from None
                latest = newer
                continue
            self._quorum_id, self._step = int(latest["quorum_id"]), int(latest["step"])
            return True

    def _load_checkpoint(self, key: str, record: dict[str, Any]) -> None:
        blob = self.store.get(key)
        state, meta = decode_state(key, blob, self.config.run_id, expected_size=record.get("bytes"))
        missing = sorted(set(self._state_fns) - set(state))
        if missing:
            raise ShardError(key, f"checkpoint lacks state for {missing}; it has {sorted(state)}")
        for k, (load, _) in self._state_fns.items():
            load(state[k])
        if self.on_heal is not None:
            self.on_heal(state)
        log.info(
            "replica %d loaded %s (round %s, step %s)",
            self.replica_id,
            key,
            meta.get("quorum_id"),
            meta.get("step"),
        )

    def _newer_than(self, top: str, quorum_id: int) -> list[str]:
        """Entries `qNNNNNNNN` under `top` (`rounds` or `ckpt`) of rounds after `quorum_id`."""
        return [n for n in self.store.list(top) if (r := _ckpt_round(n)) is not None and r > quorum_id]

    def shutdown(self, wait: bool = True) -> None:
        """Stop the I/O threads; raises CheckpointError if the last checkpoint write failed (waited for if
        `wait`)."""
        try:
            self._raise_checkpoint_error(block=wait)
        finally:
            self._executor.shutdown(wait=wait)
            self._ckpt_executor.shutdown(wait=wait)
            self._io.shutdown(wait=wait)


# ---------------------------------------------------------------------- state (de)serialisation, no pickle
def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON skeleton of `obj` with tensors replaced by references into `tensors` (dict keys keep their type)."""
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors):06d}:{prefix}"
        tensors[name] = obj.detach().to("cpu").clone().contiguous()
        return {"__tensor__": name}
    if isinstance(obj, dict):
        return {"__dict__": [[k, _flatten(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {
            "__list__": [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)],
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


def _encode_flat(tensors: dict[str, torch.Tensor], skeleton: Any, meta: dict[str, Any]) -> bytes:
    return encode_shard(tensors, {**meta, "kind": "state", "skeleton": json.dumps(skeleton)})


def encode_state(state: dict[str, StateDict], meta: dict[str, Any]) -> bytes:
    """Checkpoint bytes: safetensors for the tensors, a JSON skeleton (in the metadata) for the rest."""
    tensors: dict[str, torch.Tensor] = {}
    skel = _flatten(state, "", tensors)
    return _encode_flat(tensors, skel, meta)


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


__all__ = ["CheckpointError", "ObjectStoreManager", "ObjectStoreWork", "RoundReport", "decode_state",
           "encode_state"]
