"""The store protocol of ObjectStoreManager, driven directly (replicas as threads, real file:// store).

Bad shards are written by the test itself, acting as a faulty third replica.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from composer_mesh.mesh.objectstore import DiLoCoConfig
from composer_mesh.mesh.objectstore.manager import ObjectStoreManager, RoundReport
from composer_mesh.mesh.objectstore.store import Store, encode_shard

NUMEL = 12


def _cfg(tmp_path, **kw) -> DiLoCoConfig:
    base = {"store_uri": f"file://{tmp_path}/store", "run_id": "run-a", "replicas": 3, "quorum_deadline_s": 2.0,
            "poll_interval_s": 0.01}
    return DiLoCoConfig(**{**base, **kw})


def _vec(r: int, n: int = NUMEL) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + r))


class _ReadLog(Store):
    """A Store that records every object it reads in a round, with its size: (key, bytes)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.reads: list[tuple[str, int]] = []

    def get(self, key: str) -> bytearray:
        data = super().get(key)
        self.reads.append((key, len(data)))
        return data

    def read_shard_into(self, key, out, expect, expected_size=None):  # type: ignore[no-untyped-def]
        meta = super().read_shard_into(key, out, expect, expected_size)
        self.reads.append((key, self.fs.size(self.path(key))))
        return meta


def _rounds(cfg: DiLoCoConfig, replica_ids: list[int], tensors: dict[int, torch.Tensor],
            delays: dict[int, float] | None = None, reads: dict[int, list[tuple[str, int]]] | None = None,
            ) -> dict[int, tuple[bool, torch.Tensor, RoundReport]]:
    """One round on each replica (in threads); returns (should_commit, tensor after wait, report).

    With `reads`, each replica's store logs what it reads during its round into reads[replica]."""
    out: dict[int, tuple[bool, torch.Tensor, RoundReport]] = {}
    errors: list[BaseException] = []

    def go(r: int) -> None:
        try:
            time.sleep((delays or {}).get(r, 0.0))
            store = None
            if reads is not None:
                store = _ReadLog.from_config(cfg)
                reads[r] = store.reads
            m = ObjectStoreManager(cfg, r, store)
            m.start_quorum()
            if store is not None:
                store.reads.clear()  # reads before the round (looking for a checkpoint) are not the round's
            t = tensors[r].clone()
            work = m.allreduce(t)
            work.wait()
            ok = m.should_commit()
            out[r] = (ok, t, m.reports[-1])
            m.shutdown()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in replica_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def _fake_replica(cfg: DiLoCoConfig, r: int, tensor: torch.Tensor, *, defect: str | None = None,
                  bad_slice: int = 0, marker_run: str | None = None) -> str:
    """Publish replica `r`'s round-1 shards + marker like a real replica would, optionally with a defect."""
    store = Store.from_config(cfg)
    base = "rounds/q00000001"
    sizes, bad_key = [], ""
    n = cfg.replicas
    for j in range(n):
        lo, hi = j * NUMEL // n, (j + 1) * NUMEL // n
        meta = {"run_id": cfg.run_id, "quorum_id": 1, "replica": r, "slice": j, "kind": "shard"}
        if defect == "other_run" and j == bad_slice:
            meta["run_id"] = "run-b"
        blob = encode_shard({"data": tensor[lo:hi]}, meta)
        sizes.append(len(blob))
        if j == bad_slice and defect == "truncated":
            blob = blob[: len(blob) - 7]
        elif j == bad_slice and defect == "checksum":
            blob = blob[:-1] + bytes([blob[-1] ^ 0x01])
        elif j == bad_slice and defect == "metadata_not_mapping":
            from mesh.objectstore.shards import rewrite_header

            blob = rewrite_header(blob, lambda h: h.update(__metadata__=[h["__metadata__"]]))
            sizes[-1] = len(blob)
        key = f"{base}/shards/r{r:03d}/s{j:03d}.safetensors"
        if j == bad_slice:
            bad_key = key
        store.put(key, blob)
    store.put_json(f"{base}/arrived/r{r:03d}.json", {
        "run_id": marker_run or cfg.run_id, "quorum_id": 1, "replica": r, "numel": NUMEL,
        "dtype": "torch.float32", "abstain": False, "sizes": sizes})
    return bad_key


def test_three_replicas_average_bitwise_identical(tmp_path):
    cfg = _cfg(tmp_path)
    vecs = {r: _vec(r) for r in range(3)}
    res = _rounds(cfg, [0, 1, 2], vecs)
    want = (vecs[0] + vecs[1] + vecs[2]) / 3
    for r in range(3):
        ok, t, rep = res[r]
        assert ok and rep.members == [0, 1, 2] and rep.epoch == 0
        assert torch.equal(t, res[0][1])
        assert torch.allclose(t, want, atol=1e-6)


@pytest.mark.parametrize(("defect", "bad_slice", "problem"), [
    ("truncated", 1, "truncated"),
    ("checksum", 0, "checksum mismatch"),
    ("other_run", 0, "a shard from another run"),
    ("metadata_not_mapping", 1, "__metadata__ is a JSON list, not an object"),
])
def test_bad_shard_rejected_and_round_completes(tmp_path, defect, bad_slice, problem):
    cfg = _cfg(tmp_path)
    vecs = {r: _vec(r) for r in range(3)}
    bad_key = _fake_replica(cfg, 2, vecs[2], defect=defect, bad_slice=bad_slice)
    res = _rounds(cfg, [0, 1], vecs)
    want = (vecs[0] + vecs[1]) / 2
    for r in (0, 1):
        ok, t, rep = res[r]
        assert ok, rep.error
        assert rep.members == [0, 1] and rep.epoch == 1
        msg = rep.rejected["r002"]
        assert bad_key in msg and problem in msg, msg
        assert torch.equal(t, res[0][1]) and torch.allclose(t, want, atol=1e-7)


def test_marker_from_another_run_is_rejected(tmp_path):
    cfg = _cfg(tmp_path)
    vecs = {r: _vec(r) for r in range(3)}
    _fake_replica(cfg, 2, vecs[2], marker_run="run-b")
    res = _rounds(cfg, [0, 1], vecs)
    for r in (0, 1):
        ok, _, rep = res[r]
        assert ok and rep.members == [0, 1] and rep.epoch == 0
        assert "another run" in rep.rejected["r002"] and "arrived/r002.json" in rep.rejected["r002"]


def test_corrupt_reduced_slice_fails_the_round_cleanly_everywhere(tmp_path):
    cfg = _cfg(tmp_path, replicas=2)
    vecs = {r: _vec(r) for r in range(2)}
    key = "rounds/q00000001/reduced/e0/s000.safetensors"
    Store.from_config(cfg).put(key, b"\x0a\x00\x00\x00\x00\x00\x00\x00{not json}")
    res = _rounds(cfg, [0, 1], vecs)
    for r in (0, 1):
        ok, t, rep = res[r]
        assert not ok and rep.error is not None
        assert rep.error.startswith("round aborted") and key in rep.error and "not a safetensors" in rep.error
        assert torch.equal(t, vecs[r]), "a failed round must leave the tensor untouched"


def test_dead_reducer_slice_is_reduced_by_a_survivor(tmp_path):
    cfg = _cfg(tmp_path, quorum_deadline_s=0.5)
    vecs = {r: _vec(r) for r in range(3)}
    _fake_replica(cfg, 2, vecs[2])  # a member that published, then died before reducing slice 2
    res = _rounds(cfg, [0, 1], vecs)
    want = (vecs[0] + vecs[1] + vecs[2]) / 3
    fallbacks = set()
    for r in (0, 1):
        ok, t, rep = res[r]
        assert ok and rep.members == [0, 1, 2]
        assert torch.equal(t, res[0][1]) and torch.allclose(t, want, atol=1e-6)
        fallbacks |= set(rep.fallback_slices)
    assert fallbacks == {2}


def test_late_replica_left_out_but_commits_the_same_result(tmp_path):
    cfg = _cfg(tmp_path, replicas=2, quorum_deadline_s=0.3)
    vecs = {r: _vec(r) for r in range(2)}
    res = _rounds(cfg, [0, 1], vecs, delays={1: 1.5})
    for r in (0, 1):
        ok, t, rep = res[r]
        assert ok and rep.members == [0]
        assert torch.equal(t, vecs[0])
    assert res[1][2].late and not res[1][2].contributed and 1 not in res[1][2].members


def test_bf16_compression_halves_bytes_and_stays_identical(tmp_path):
    n = 4096
    vecs = {r: _vec(r, n) for r in range(2)}
    fp32 = _rounds(_cfg(tmp_path / "a", replicas=2, run_id="fp32"), [0, 1], vecs)
    bf16 = _rounds(_cfg(tmp_path / "b", replicas=2, run_id="bf16", compression="bf16"), [0, 1], vecs)
    want = ((vecs[0].bfloat16().float() + vecs[1].bfloat16().float()) / 2).bfloat16().float()
    for r in (0, 1):
        assert bf16[r][0] and torch.equal(bf16[r][1], want)
        assert bf16[r][2].bytes_written < 0.6 * fp32[r][2].bytes_written
    assert torch.equal(bf16[0][1], bf16[1][1])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bytes_read_per_replica_is_the_reduce_scatter_volume(tmp_path, n):
    """Each replica reads exactly 2(N-1)/N x M tensor bytes per round: (N-1) shards of the N-1 other members
    for each slice it reduces (one slice each), then the N-1 averaged slices it did not reduce itself. On top,
    only the safetensors headers and the small JSON records; nothing is read twice."""
    numel = 1 << 18  # 1 MiB of fp32, divisible by N
    model_bytes = numel * 4
    vecs = {r: _vec(r, numel) for r in range(n)}
    reads: dict[int, list[tuple[str, int]]] = {}
    # A generous deadline: a slow reducer (2 shared cores, N=8 threads) must not trigger a fallback reduction.
    res = _rounds(_cfg(tmp_path, replicas=n, quorum_deadline_s=60.0), list(range(n)), vecs, reads=reads)
    want = 2 * (n - 1) * model_bytes // n
    for r in range(n):
        ok, t, rep = res[r]
        assert ok and torch.equal(t, res[0][1]) and rep.members == list(range(n)) and not rep.fallback_slices
        tensor_reads = [(key, size) for key, size in reads[r] if key.endswith(".safetensors")]
        payload = sum(size - _header_bytes(tmp_path, key) for key, size in tensor_reads)
        assert payload == want, (payload / model_bytes, tensor_reads)
        assert len(tensor_reads) == len({key for key, _ in tensor_reads}) == 2 * (n - 1), tensor_reads
        assert rep.bytes_read == sum(size for _, size in reads[r]), "reads the accounting did not see"
        assert rep.bytes_read - payload < 4096 * n, rep.bytes_read - payload  # headers + JSON records only
        assert rep.bytes_written <= (1 + 1 / n) * model_bytes * 1.05, rep.bytes_written / model_bytes


def _header_bytes(tmp_path, key: str) -> int:
    """Length prefix + JSON header of a safetensors object in the test store."""
    import struct

    with open(tmp_path / "store" / "run-a" / key, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_memory_store_real_diloco_in_threads():
    import uuid

    from mesh.objectstore.worker import WorkerArgs, run

    uri = f"memory://diloco-{uuid.uuid4().hex[:8]}"
    res: dict[int, dict] = {}

    def go(r: int) -> None:
        res[r] = run(WorkerArgs(store_uri=uri, run_id="mem", replicas=2, replica_id=r,
                                out_dir=f"/tmp/diloco-mem-{uuid.uuid4().hex[:6]}", target_outer_steps=2))

    threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(res) == [0, 1]
    assert all(rep["committed"] for r in res.values() for rep in r["reports"])
    assert res[0]["outer_step"] == res[1]["outer_step"] == 2


def test_replica_that_fell_rounds_behind_heals_abstains_and_ends_identical(tmp_path):
    from mesh.objectstore.worker import WorkerArgs, run

    common = {"store_uri": f"file://{tmp_path}/store", "run_id": "behind", "replicas": 2,
              "out_dir": str(tmp_path / "out"), "sync_every": 2, "target_outer_steps": 5,
              "require_full_final_round": True, "quorum_deadline_s": 0.3}
    res: dict[int, dict] = {}
    errors: list[BaseException] = []

    def go(r: int, **kw) -> None:
        try:
            res[r] = run(WorkerArgs(replica_id=r, **common, **kw))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=go, args=(0,), kwargs={"step_sleep_s": 0.02}),
               threading.Thread(target=go, args=(1,), kwargs={"pause_at_outer_step": 1, "pause_s": 2.5})]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    behind = res[1]["reports"]
    healed = [rep for rep in behind if rep["abstained"]]
    assert healed, f"replica 1 never healed: {behind}"
    assert all(rep["committed"] and not rep["contributed"] and 1 not in rep["members"] for rep in healed)
    assert any(rep["members"] == [0] for rep in res[0]["reports"])  # replica 0 went on alone meanwhile
    assert res[0]["round_id"] == res[1]["round_id"]
    from safetensors.torch import load_file

    g0 = load_file(f"{common['out_dir']}/{res[0]['tag']}.global.safetensors")
    g1 = load_file(f"{common['out_dir']}/{res[1]['tag']}.global.safetensors")
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)


def _run_pair(tmp_path, name: str, **kw) -> dict[int, dict]:
    from mesh.objectstore.worker import WorkerArgs, run

    res: dict[int, dict] = {}
    errors: list[BaseException] = []

    def go(r: int) -> None:
        try:
            res[r] = run(WorkerArgs(store_uri=f"file://{tmp_path}/{name}", run_id=name, replicas=2, replica_id=r,
                                    out_dir=str(tmp_path / f"out-{name}"), init_seed=0, **kw))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return res


def test_bucketized_diloco_matches_per_parameter_bitwise(tmp_path):
    """torchft's bucketized path (flat buffer + get_future().then scatter-back) gives the very same bits."""
    from safetensors.torch import load_file

    plain = _run_pair(tmp_path, "plain", target_outer_steps=2)
    bucket = _run_pair(tmp_path, "bucket", target_outer_steps=2, bucket_cap_mb=1.0)
    a = load_file(f"{tmp_path}/out-plain/{plain[0]['tag']}.global.safetensors")
    b = load_file(f"{tmp_path}/out-bucket/{bucket[1]['tag']}.global.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(a["f0/param/0.weight"], load_file(
        f"{tmp_path}/out-plain/{plain[0]['tag']}.theta0.safetensors")["0.weight"])
