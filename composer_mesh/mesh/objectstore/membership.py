"""Who is in a round: the create-only decisions every replica adopts (step 2 of a round, and its amendments).

`members/e0.json` is written once, by the first replica to decide (all arrived, or the quorum deadline passed),
from the arrival markers it can validate; everyone adopts the record that won, so membership is identical on every
replica. A bad shard found while reducing moves the round to epoch E+1 without its replica (an amendment in
`members/eE+1.json`); a completed epoch claims the same slot with a seal, so no replica can commit epoch E while
another moves on to E+1.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.mesh.objectstore.store import ShardError, Store

log = logging.getLogger(__name__)


def poll_delay(config: DiLoCoConfig, polls: int) -> float:
    """Poll quickly at first (most waits are short), then every poll_interval_s."""
    return min(config.poll_interval_s, 0.002 * 2 ** min(polls, 12))


class Membership:
    """The membership decisions of one replica's rounds. `latest` reads the newest committed checkpoint's marker
    (a round it names was committed by the others and must never be decided again)."""

    def __init__(self, config: DiLoCoConfig, replica_id: int, store: Store, wire_dtype: torch.dtype,
                 io: ThreadPoolExecutor, latest: Callable[[], dict[str, Any] | None]) -> None:
        self.config = config
        self.replica_id = replica_id
        self.store = store
        self.wire_dtype = wire_dtype
        self.io = io
        self.latest = latest

    def decide(self, base: str, q: int, numel: int) -> dict[str, Any]:
        """The round's epoch-0 record: adopted if written, else decided here once all arrived or time is up."""
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
                latest = self.latest()
                if latest is not None and latest["quorum_id"] >= q:
                    # The others committed this round long ago (its records may be gone): never re-decide it.
                    raise RuntimeError(
                        f"round {q} was already committed by other replicas; this replica is behind"
                    )
                return self.publish(key, self._record(base, q, numel, arrived))
            polls += 1
            time.sleep(poll_delay(cfg, polls))

    def _record(self, base: str, q: int, numel: int, arrived: list[str]) -> dict[str, Any]:
        """Epoch 0's record from the arrival markers: valid contributors are members, the rest rejected."""
        members: list[int] = []
        sizes: dict[str, list[int]] = {}
        rejected: dict[str, str] = {}
        keys = [f"{base}/arrived/{name}" for name in arrived]
        for name, mkey, got in zip(arrived, keys, self.io.map(self._try_get_json, keys)):
            try:
                m = self._check_arrival(name, mkey, got, q, numel)
                if m is None:
                    continue
            except ShardError as e:
                log.error("round %d: rejecting %s", q, e)
                rejected[name.removesuffix(".json")] = str(e)
                continue
            except (KeyError, TypeError, ValueError) as e:
                rejected[name.removesuffix(".json")] = f"{mkey}: unreadable arrival marker ({e!r})"
                continue
            r = int(m["replica"])
            members.append(r)
            sizes[str(r)] = [int(s) for s in m["sizes"]]
        return {
            "epoch": 0,
            "members": sorted(members),
            "sizes": sizes,
            "rejected": rejected,
            "numel": numel,
            "decided_by": self.replica_id,
            "arrived": arrived,
        }

    def _check_arrival(self, name: str, mkey: str, got: Any, q: int, numel: int) -> dict[str, Any] | None:
        """The arrival marker `got` if it makes its replica a member; None if it abstains; ShardError if bad."""
        cfg = self.config
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
            return None
        if int(m["numel"]) != numel or m["dtype"] != str(self.wire_dtype):
            raise ShardError(
                mkey,
                f"layout mismatch: numel={m['numel']} dtype={m['dtype']}, "
                f"expected numel={numel} dtype={self.wire_dtype}",
            )
        if not 0 <= r < cfg.replicas or len(m["sizes"]) != cfg.replicas:
            raise ShardError(mkey, f"bad replica id {r} or slice count {len(m['sizes'])}")
        return m

    def _try_get_json(self, key: str) -> Any:
        try:
            return self.store.get_json(key)
        except (ShardError, FileNotFoundError) as e:
            return e

    def publish(self, key: str, record: dict[str, Any]) -> dict[str, Any]:
        """Create-only write of a decision; returns the record that won (ours or an earlier one)."""
        if self.store.put_json_if_absent(key, record):
            return json.loads(json.dumps(record, sort_keys=True))
        return self.store.get_json(key)

    def seal(self, base: str, record: dict[str, Any]) -> dict[str, Any] | None:
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

    def amend(self, base: str, record: dict[str, Any], bad: ShardError) -> dict[str, Any]:
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
        return self.publish(f"{base}/members/e{epoch}.json", new)
