"""The round protocol: one DiLoCo sync as a reduce-scatter through the object store.

One round is keyed by the quorum id; every `allreduce` of the round is packed into one flat vector and reduced
together:

1. publish  : the replica cuts its vector into `replicas` slices, PUTs each as a checksummed safetensors
              shard, then PUTs `arrived/rNNN.json` (data first, marker last).
2. quorum   : once all replicas arrived or `quorum_deadline_s` passed, the first replica to decide writes
              `members/e0.json` create-only; everyone adopts that record, so membership is identical
              (`membership.py`).
3. reduce   : slice j is averaged by member `members[j % k]`, reading slice j of every member (≈ M bytes)
              in member order, and written to `reduced/eE/sJ` (≈ M/N bytes).
4. gather   : everyone reads all reduced slices (≈ M bytes). A slice whose reducer died is reduced by the
              waiting replica after the deadline (same inputs, same order: same bytes).
A bad shard found in step 3 (truncated, checksum, another run) moves the round to epoch E+1 without that
replica (create-only `members/eE+1.json`), so the round still completes over the good replicas.

So a replica reads ≈ 2×M and writes ≈ M(1 + 1/N) per round whatever N, and every replica copies the very
same reduced bytes: results are bitwise identical. Replicas that arrive late, or that just healed, read
the result without contributing and commit the same outer step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.mesh.objectstore.membership import Membership, poll_delay
from composer_mesh.mesh.objectstore.store import ShardError, Store, decode_shard, encode_shard_parts

log = logging.getLogger(__name__)

ROUNDS = "rounds"  # the store prefix of every round's objects: rounds/qNNNNNNNN/...


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


class _RoundFailed(RuntimeError):
    """The round cannot complete (consistently for all replicas, e.g. no member left)."""


class RoundProtocol:
    """One replica's side of the rounds. `run` is called on the round thread, one round at a time.

    `latest` reads the newest committed checkpoint's marker; `on_error` receives a local failure as it happens
    (the façade's `report_error`)."""

    def __init__(self, config: DiLoCoConfig, replica_id: int, store: Store,
                 latest: Callable[[], dict[str, Any] | None], on_error: Callable[[Exception], None]) -> None:
        self.config = config
        self.replica_id = replica_id
        self.store = store
        self.wire_dtype = torch.bfloat16 if config.compression == "bf16" else torch.float32
        self._on_error = on_error
        self._own: dict[str, Any] = {"wire": None, "reduced": {}}  # per round, used by the round thread only
        self._io = ThreadPoolExecutor(4, thread_name_prefix=f"objstore-io-r{replica_id}")
        self.membership = Membership(config, replica_id, store, self.wire_dtype, self._io, latest)

    def drop_buffers(self) -> None:
        """Forget the round's own buffers (the wire vector, own reduced slices): about 1 + 1/N model sizes."""
        self._own = {"wire": None, "reduced": {}}

    def close(self, wait: bool) -> None:
        self._io.shutdown(wait=wait)

    def run(self, q: int, flat: torch.Tensor | None, numel: int) -> tuple[torch.Tensor | None, RoundReport]:
        """Round `q` whole: this replica's `flat` vector in (None: read the result only), the average out."""
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
            self._on_error(e)
            log.exception("replica %d round %d failed locally", self.replica_id, q)
        r1, w1 = self.store.counters()
        report.bytes_read, report.bytes_written = r1 - r0, w1 - w0
        report.seconds = time.perf_counter() - t0
        return result, report

    def _slice_bounds(self, numel: int, j: int) -> tuple[int, int]:
        n = self.config.replicas
        return j * numel // n, (j + 1) * numel // n

    def _round(self, q: int, flat: torch.Tensor | None, numel: int, report: RoundReport) -> torch.Tensor:
        base = f"{ROUNDS}/q{q:08d}"
        t_start = time.perf_counter()
        self._publish(base, q, flat, numel, report)
        t_pub = time.perf_counter()
        report.phases["publish"] = t_pub - t_start
        # 2. quorum
        record = self.membership.decide(base, q, numel)
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
            "dtype": str(self.wire_dtype),
            "abstain": flat is None,
            "sizes": [],
        }
        wire = flat.to(self.wire_dtype) if flat is not None else None
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
                    amendment = self.membership.seal(base, record)
                    if amendment is not None:
                        record = amendment
                        continue
                return out
            except ShardError as bad:
                nxt = self.membership.amend(base, record, bad)
                if nxt.get("sealed"):
                    if sealed:  # the sealed result is unreadable here: fail locally, heal next round
                        raise RuntimeError(f"round {q} epoch {record['epoch']} is sealed but unreadable here: "
                                           f"{bad}") from bad
                    sealed = True  # others completed this epoch: its reduced slices stand, just read them
                    continue
                record, sealed = nxt, False

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
            if t is None or t.dtype != self.wire_dtype or t.numel() != hi - lo:
                raise ShardError(
                    key,
                    f"unexpected payload: {None if t is None else (t.dtype, t.numel())}, "
                    f"expected ({self.wire_dtype}, {hi - lo})",
                )
            return t

        acc: torch.Tensor | None = None
        for t in self._io.map(fetch, members):  # fetched concurrently, summed in member order
            acc = t.to(torch.float32, copy=True) if acc is None else acc.add_(t)
        assert acc is not None
        avg = acc.div_(len(members)).to(self.wire_dtype)
        parts = encode_shard_parts({"data": avg}, self._meta(q, -1, j, kind="reduced", epoch=epoch))
        if self.store.put_if_absent(out_key, parts):  # first writer wins; a fallback writes the same bytes
            self._own["reduced"][(epoch, j)] = avg

    def _gather(
        self, base: str, q: int, record: dict[str, Any], numel: int, report: RoundReport
    ) -> torch.Tensor | dict[str, Any]:
        cfg, n, epoch = self.config, self.config.replicas, record["epoch"]
        out = torch.empty(numel, dtype=self.wire_dtype)
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
            time.sleep(poll_delay(self.config, polls))
        return out
