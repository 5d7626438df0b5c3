"""Store primitives: checksummed shards, atomic and create-only puts on file://, memory://, S3 (moto) and GCS
(gcp-storage-emulator behind the create-only proxy of `gcs.py`)."""

from __future__ import annotations

import uuid

import pytest
import torch

from composer_mesh.mesh.objectstore import DiLoCoConfig
from composer_mesh.mesh.objectstore.store import ShardError, Store, StoreError, decode_shard, encode_shard

META = {"run_id": "r1", "quorum_id": 3, "replica": 1, "slice": 0, "kind": "shard"}


def _blob() -> bytes:
    return encode_shard({"data": torch.arange(10, dtype=torch.float32)}, META)


def test_shard_roundtrip():
    tensors, meta = decode_shard("k", _blob(), expect=META, expected_size=len(_blob()))
    assert torch.equal(tensors["data"], torch.arange(10, dtype=torch.float32))
    assert meta["run_id"] == "r1" and len(meta["sha256"]) == 64


@pytest.mark.parametrize("cut", [3, 20, -1])
def test_truncated_shard_named(cut):
    blob = _blob()
    with pytest.raises(ShardError, match=r"^some/key: truncated") as ei:
        decode_shard("some/key", blob[:cut], expect=META)
    assert ei.value.key == "some/key"


def test_checksum_mismatch_named():
    blob = bytearray(_blob())
    blob[-3] ^= 0xFF
    with pytest.raises(ShardError, match=r"^k: checksum mismatch"):
        decode_shard("k", bytes(blob), expect=META)


def test_shard_from_another_run_named():
    with pytest.raises(ShardError, match=r"^k: a shard from another run: metadata run_id='r1', expected 'r2'"):
        decode_shard("k", _blob(), expect={**META, "run_id": "r2"})


def test_wrong_round_and_size_named():
    with pytest.raises(ShardError, match="wrong quorum_id"):
        decode_shard("k", _blob(), expect={**META, "quorum_id": 4})
    with pytest.raises(ShardError, match="size mismatch"):
        decode_shard("k", _blob(), expect=META, expected_size=len(_blob()) + 1)


def test_garbage_is_not_unpickled():
    import pickle

    with pytest.raises(ShardError, match=r"not a safetensors object|truncated"):
        decode_shard("k", pickle.dumps({"x": 1}), expect=META)


def _exercise(store: Store) -> None:
    store.put("a/b/x.bin", b"one")
    assert store.get("a/b/x.bin") == b"one"
    store.put("a/b/x.bin", b"two")
    assert store.get("a/b/x.bin") == b"two"
    assert store.put_if_absent("a/c.json", b"first") is True
    assert store.put_if_absent("a/c.json", b"second") is False
    assert store.get("a/c.json") == b"first"
    assert store.list("a") == ["b", "c.json"]
    assert store.list("nothing/here") == []
    assert store.get_or_none("a/missing") is None
    store.rm_prefix("a")
    assert store.list("a") == []


def test_file_store(tmp_path):
    s = Store(f"file://{tmp_path}/root")
    _exercise(s)
    r, w = s.counters()
    assert r > 0 and w > 0


def test_memory_store():
    _exercise(Store(f"memory://store-{uuid.uuid4().hex[:8]}"))


def test_credentials_only_from_named_env(monkeypatch):
    cfg = DiLoCoConfig(store_uri="s3://bucket/x", run_id="r", credentials_env={"secret": "DILOCO_TEST_SECRET"})
    monkeypatch.delenv("DILOCO_TEST_SECRET", raising=False)
    with pytest.raises(StoreError, match="DILOCO_TEST_SECRET is not set"):
        Store.from_config(cfg)


@pytest.mark.s3
def test_s3_store(s3_store, monkeypatch):
    cfg = DiLoCoConfig(run_id="r", **s3_store)
    s = Store.from_config(cfg)
    assert "testing" not in repr(s)
    _exercise(s)
    # another client's write is visible at once (no stale listing cache)
    other = Store.from_config(cfg)
    s.list("fresh")
    other.put("fresh/new.bin", b"x")
    assert s.list("fresh") == ["new.bin"] and s.exists("fresh/new.bin")


@pytest.mark.gcs
def test_gs_store(gcs_store, gcs_endpoint):
    cfg = DiLoCoConfig(run_id="r", **gcs_store)
    s = Store.from_config(cfg)
    assert s.backend.create_only == "precondition" and "anon" not in repr(s)
    _exercise(s)  # its second put_if_absent is refused only because the server enforces ifGenerationMatch=0


@pytest.mark.gcs
def test_gs_create_only_race_has_one_winner(gcs_store):
    """Replicas racing for one create-only key (a membership record, an averaged slice): exactly one wins, and
    every loser reads the winner's bytes."""
    import threading

    cfg = DiLoCoConfig(run_id="race", **gcs_store)
    stores = [Store.from_config(cfg) for _ in range(4)]
    won: list[bool] = [False] * 4
    start = threading.Barrier(4)

    def go(i: int) -> None:
        start.wait()
        won[i] = stores[i].put_if_absent("rounds/q00000001/members.json", f"replica {i}".encode())

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won.count(True) == 1, won
    assert stores[0].get("rounds/q00000001/members.json") == f"replica {won.index(True)}".encode()


@pytest.mark.parametrize("kind", [pytest.param("s3", marks=pytest.mark.s3), pytest.param("gcs", marks=pytest.mark.gcs)])
def test_a_replica_sees_other_replicas_writes_at_once(request, kind):
    """A replica discovers the others' rounds and markers by listing; s3fs and gcsfs cache listings with no expiry
    by default, so a replica that listed a prefix once would never see what the others add to it. Their rows in
    `mesh.storage.backends` turn the cache off (this fails with `listings_cache=True`)."""
    cfg = DiLoCoConfig(run_id="fresh", **request.getfixturevalue(f"{kind}_store"))
    mine, theirs = Store.from_config(cfg), Store.from_config(cfg)
    assert mine.fs is not theirs.fs  # two replicas are two clients, as on two hosts, even as threads of one process
    mine.put("rounds/q00000001/arrived/r000.json", b"{}")
    assert mine.list("rounds/q00000001/arrived") == ["r000.json"] and mine.list("rounds") == ["q00000001"]
    assert not mine.exists("rounds/q00000001/arrived/r001.json")
    theirs.put("rounds/q00000001/arrived/r001.json", b"{}")
    theirs.put("rounds/q00000002/arrived/r001.json", b"{}")
    assert mine.list("rounds/q00000001/arrived") == ["r000.json", "r001.json"]
    assert mine.exists("rounds/q00000001/arrived/r001.json")
    assert mine.list("rounds") == ["q00000001", "q00000002"]
    theirs.rm_prefix("rounds/q00000001")
    assert mine.list("rounds") == ["q00000002"] and not mine.exists("rounds/q00000001/arrived/r000.json")


def test_interoperates_with_the_safetensors_library():
    from safetensors.torch import load, save

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.bfloat16), "c": torch.ones(2, dtype=torch.int64)}
    ours = encode_shard(tensors, META)
    back = load(ours)  # the real safetensors reader accepts what we write
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    meta = {k: str(v) for k, v in META.items()}
    from composer_mesh.mesh.objectstore.store import SHARD_FORMAT, tensor_digest

    theirs = save(tensors, metadata={**meta, "format": SHARD_FORMAT, "sha256": tensor_digest(tensors)})
    got, _ = decode_shard("k", bytearray(theirs), expect=META)  # and we read what safetensors writes
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_read_shard_into_validates_like_decode(tmp_path, scheme):
    uri = f"file://{tmp_path}/r" if scheme == "file" else f"memory://into-{uuid.uuid4().hex[:8]}"
    s = Store(uri)
    data = torch.randn(1000)
    good = encode_shard({"data": data}, META)
    s.put("good", good)
    out = torch.empty(1000)
    s.read_shard_into("good", out, expect=META, expected_size=len(good))
    assert torch.equal(out, data)
    s.put("trunc", good[:-5])
    with pytest.raises(ShardError, match=r"^trunc: truncated"):
        s.read_shard_into("trunc", torch.empty(1000), expect=META)
    bad = bytearray(good)
    bad[-1] ^= 1
    s.put("flip", bytes(bad))
    with pytest.raises(ShardError, match=r"^flip: checksum mismatch"):
        s.read_shard_into("flip", torch.empty(1000), expect=META)
    with pytest.raises(ShardError, match=r"^good: a shard from another run"):
        s.read_shard_into("good", torch.empty(1000), expect={**META, "run_id": "r2"})
    with pytest.raises(ShardError, match=r"^good: unexpected payload"):
        s.read_shard_into("good", torch.empty(999), expect=META)


def _set_metadata(value):  # type: ignore[no-untyped-def]
    def edit(header: dict) -> None:
        header["__metadata__"] = value

    return edit


NOT_A_MAPPING = [["format", "composer-mesh-shard-v1"], "composer-mesh-shard-v1", 7, True]


@pytest.mark.parametrize("metadata", NOT_A_MAPPING, ids=["list", "str", "int", "bool"])
def test_metadata_not_a_mapping_is_a_shard_error(tmp_path, metadata):
    """Foreign bytes whose `__metadata__` is not a JSON object: a ShardError naming the key, not AttributeError."""
    from mesh.objectstore.shards import rewrite_header

    blob = rewrite_header(_blob(), _set_metadata(metadata))
    with pytest.raises(ShardError, match=r"^some/key: not a safetensors object \(__metadata__ is a JSON \w+, not"):
        decode_shard("some/key", blob, expect=META)
    s = Store(f"file://{tmp_path}/r")
    s.put("a/shard", blob)
    with pytest.raises(ShardError, match=r"^a/shard: not a safetensors object \(__metadata__ is a JSON"):
        s.read_shard_into("a/shard", torch.empty(10), expect=META)


def test_metadata_values_must_be_strings():
    """A state checkpoint whose skeleton is not a string: ShardError (was a TypeError from json.loads)."""
    from composer_mesh.mesh.objectstore.manager import decode_state, encode_state
    from mesh.objectstore.shards import rewrite_header

    good = encode_state({"S": {"w": torch.ones(3)}}, {"run_id": "r1", "quorum_id": 1, "step": 1})

    def edit(header: dict) -> None:
        header["__metadata__"]["skeleton"] = 5

    with pytest.raises(ShardError, match=r"^ckpt/x: not a safetensors object \(__metadata__ values must be "
                                         r"strings: \['skeleton'\]\)"):
        decode_state("ckpt/x", rewrite_header(good, edit), "r1")


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [-1, -10], "data_offsets": [0, 40]},
    {"dtype": "F32", "shape": ["10"], "data_offsets": [0, 40]},
    {"dtype": ["F32"], "shape": [10], "data_offsets": [0, 40]},
    {"dtype": "F32", "shape": [10], "data_offsets": [0, 20, 40]},
    "not an entry",
], ids=["negative-shape", "string-dim", "list-dtype", "three-offsets", "string-entry"])
def test_malformed_tensor_entry_is_a_shard_error(entry):
    from mesh.objectstore.shards import rewrite_header

    def edit(header: dict) -> None:
        header["data"] = entry

    with pytest.raises(ShardError, match=r"^k: not a safetensors object \(bad entry 'data'\)"):
        decode_shard("k", rewrite_header(_blob(), edit), expect=META)
