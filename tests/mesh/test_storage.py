"""The storage primitive: committed directories on a local path, on S3 (moto) and on GCS (gcp-storage-emulator):
listing, retention, markers, and each file's size and sha256 checked against its marker."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest
import torch

from composer_mesh.mesh.storage import (
    MARKER_VERSION,
    CommittedDir,
    CommittedSeries,
    ContentError,
    FsspecBlobs,
    NotCommitted,
    StorageError,
)
from mesh.objectstore.conftest import S3_ENV, gcs_endpoint, moto_endpoint  # noqa: F401  (the servers' fixtures)
from mesh.objectstore.gcs import create_bucket


def _gcs_blobs(endpoint: str, bucket: str, **options: object) -> FsspecBlobs:
    """Options as a deployment gives them; no listing-cache setting (the gs row of `mesh.storage.backends` adds it)."""
    return FsspecBlobs(f"gs://{bucket}/root", endpoint_url=endpoint, token="anon", project="test", **options)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3), pytest.param("gcs", marks=pytest.mark.gcs)])
def blobs(request, tmp_path) -> FsspecBlobs:
    """A fresh root on a local path, or in a fresh bucket of the moto server or of the GCS emulator."""
    if request.param == "local":
        return FsspecBlobs(str(tmp_path / "root"))
    if request.param == "gcs":
        endpoint = request.getfixturevalue("gcs_endpoint")
        bucket = f"storage-{uuid.uuid4().hex[:10]}"
        create_bucket(endpoint, bucket)
        return _gcs_blobs(endpoint, bucket)
    import boto3

    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = f"storage-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=bucket)
    return FsspecBlobs(f"s3://{bucket}/root", client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
                       key=S3_ENV["AWS_ACCESS_KEY_ID"], secret=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                       use_listings_cache=False, skip_instance_cache=True)


def _write_step(series: CommittedSeries, step: int, commit: bool = True) -> CommittedDir:
    part = series.at(step)
    part.write_tensors("t.safetensors", {"w": torch.full((3,), float(step))})
    part.write_json("meta.json", {"step": step})
    if commit:
        part.commit({"step": step})
    return part


def test_a_directory_is_visible_only_once_its_marker_is_written_last(blobs):
    series = CommittedSeries(blobs)
    part = _write_step(series, 7, commit=False)
    assert series.steps() == [7] and series.committed() == [] and series.newest() is None
    assert part.marker() is None and not part.committed()
    marker = part.commit({"step": 7})
    assert series.committed() == [7]
    found = series.newest()
    assert found is not None and (found.step, found.key) == (7, "step-00000007")
    assert found.marker == marker and marker["step"] == 7 and marker["marker_version"] == MARKER_VERSION
    assert [f["name"] for f in marker["files"]] == ["t.safetensors", "meta.json"]
    assert [f["size"] for f in marker["files"]] == [len(part.read("t.safetensors")), len(part.read("meta.json"))]
    assert [f["sha256"] for f in marker["files"]] == [hashlib.sha256(part.read(n)).hexdigest()
                                                      for n in ("t.safetensors", "meta.json")]
    assert part.verify() == marker
    assert torch.equal(part.read_tensors("t.safetensors")["w"], torch.full((3,), 7.0))
    assert part.read_json("meta.json") == {"step": 7}


def test_newest_skips_uncommitted_directories_above_it(blobs):
    series = CommittedSeries(blobs)
    _write_step(series, 3)
    _write_step(series, 4, commit=False)
    found = series.newest()
    assert found is not None and found.step == 3


def test_retention_keeps_the_newest_committed_and_deletes_older_and_abandoned(blobs):
    series = CommittedSeries(blobs)
    _write_step(series, 1)
    _write_step(series, 2, commit=False)  # abandoned half-written by a stopped writer
    _write_step(series, 3)
    _write_step(series, 4)
    _write_step(series, 6, commit=False)  # being written above: not this commit's business
    assert series.retain(4, keep=2) == [1, 2]
    assert series.steps() == [3, 4, 6] and series.committed() == [3, 4]
    _write_step(series, 5)  # commits go in step order: 6 is only ever judged by a later commit
    assert series.retain(5, keep=2) == [3]
    assert series.steps() == [4, 5, 6]


def test_retention_deletes_an_uncommitted_step_below_in_step_order(blobs):
    """Why commits go in step order: committing step k deletes k-1 if k-1 has no marker yet."""
    series = CommittedSeries(blobs)
    _write_step(series, 1, commit=False)  # still being written, had k-1 been committed out of order
    _write_step(series, 2)
    assert series.retain(2, keep=5) == [1] and series.steps() == [2]


def test_keep_zero_keeps_every_committed_step(blobs):
    series = CommittedSeries(blobs)
    for step in (1, 2, 3):
        _write_step(series, step)
        series.retain(step, keep=0)
    assert series.committed() == [1, 2, 3]


def _entry(data: bytes, name: str = "t.safetensors") -> dict:
    return {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize(("body", "problem"), [
    (b"xx", "not JSON"),
    (b"{half a mark", "not JSON"),
    (b"[1, 2]", "a JSON list, not an object"),
    (json.dumps({"step": 2, "marker_version": MARKER_VERSION + 1, "files": []}).encode(),
     f"commit marker version {MARKER_VERSION + 1}"),
    (json.dumps({"format": 1, "step": 2, "time": 1.0}).encode(), "commit marker version 0"),  # before markers
    (json.dumps({"step": 2, "marker_version": 1, "files": [{"name": "t.safetensors", "size": 3}]}).encode(),
     "commit marker version 1"),  # before hashes
    (json.dumps({"step": 2, "marker_version": MARKER_VERSION, "files": "t.safetensors"}).encode(),
     "'files' is \"t.safetensors\", expected a list"),
    (json.dumps({"step": 2, "marker_version": MARKER_VERSION, "files": [{"name": "t.safetensors", "size": 3}]}
                ).encode(), r"files\[0\] is not a \{name, size, sha256\} entry"),
    (json.dumps({"step": 2, "marker_version": MARKER_VERSION,
                 "files": [{"name": "t", "size": -1, "sha256": "0" * 64}]}).encode(), r"files\[0\] is not"),
    (json.dumps({"marker_version": MARKER_VERSION, "files": []}).encode(), "'step' is missing, expected an integer"),
    (json.dumps({"step": "2", "marker_version": MARKER_VERSION, "files": []}).encode(),
     "'step' is \"2\", expected an integer"),
])
def test_an_invalid_marker_is_not_committed_and_listings_skip_it(tmp_path, body, problem):
    """`xx` in a marker, half a marker, one of an older version (no hashes), wrong types, missing fields: the
    directory is not committed; the newest valid one below is picked; with none valid, the newest invalid is
    named rather than starting over as if nothing had been committed."""
    blobs = FsspecBlobs(str(tmp_path / "root"))
    series = CommittedSeries(blobs, fields={"step": int}, where="run/checkpoints")
    _write_step(series, 1)
    _write_step(series, 2)
    blobs.put("step-00000002/COMMITTED.json", body)
    assert series.committed() == [1] and series.newest().step == 1  # type: ignore[union-attr]
    assert not series.at(2).committed() and series.at(2).marker() is None
    with pytest.raises(NotCommitted, match=rf"^run/checkpoints/step-00000002/COMMITTED\.json: not committed: "
                                           f".*{problem}") as e:
        series.at(2).read_marker()
    assert e.value.key == "step-00000002/COMMITTED.json" and "\n" not in str(e.value)
    assert series.retain(2, keep=5) == [] and series.retain(3, keep=5) == [2]  # deleted like an abandoned one
    blobs.put("step-00000001/COMMITTED.json", body)
    with pytest.raises(NotCommitted, match=r"^run/checkpoints/step-00000001/COMMITTED\.json: not committed"):
        series.newest()


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda b: b[:40], r"40 bytes, COMMITTED\.json says \d+ \(truncated or overwritten\)"),
    (lambda b: b[:-12] + b"\xff" * 12, r"content differs from COMMITTED\.json \(sha256 [0-9a-f]{16}…, the "
                                              r"marker says [0-9a-f]{16}…\)"),
    (lambda b: b + b"\0", r"\d+ bytes, COMMITTED\.json says \d+"),
])
def test_a_file_that_differs_from_its_marker_is_named_with_what_differs(tmp_path, damage, problem):
    blobs = FsspecBlobs(str(tmp_path / "root"))
    series = CommittedSeries(blobs, where="ckpts")
    part = _write_step(series, 3)
    marker = part.verify()
    good = bytes(part.read("t.safetensors"))
    blobs.put(part.key("t.safetensors"), damage(good))
    assert part.committed()  # the marker is fine: it is the content that lies
    for check in (part.verify, lambda: part.read("t.safetensors", marker),
                  lambda: part.read_committed("meta.json", "t.safetensors", missing="-", what="step")):
        with pytest.raises(ContentError, match=rf"^ckpts/step-00000003/t\.safetensors: {problem}") as e:
            check()
        assert "\n" not in str(e.value)
    blobs.rm_prefix(part.key("t.safetensors"))
    with pytest.raises(ContentError, match=r"^ckpts/step-00000003/t\.safetensors: missing, although COMMITTED"):
        part.verify()


def test_on_every_store_xx_in_a_marker_is_not_committed_and_a_changed_file_is_named(blobs):
    series = CommittedSeries(blobs)
    _write_step(series, 1)
    part = _write_step(series, 2)
    blobs.put(part.key("t.safetensors"), b"\xff" * len(part.read("t.safetensors")))
    with pytest.raises(ContentError, match=r"^step-00000002/t\.safetensors: content differs from COMMITTED\.json"):
        part.verify()
    blobs.put("step-00000002/COMMITTED.json", b"xx")
    assert series.committed() == [1] and series.newest().step == 1  # type: ignore[union-attr]


def test_files_are_hashed_in_pieces_without_reading_them_whole(blobs, monkeypatch):
    """`verify` streams: a file several chunks long is never asked of `get` (which reads it whole)."""
    from composer_mesh.mesh.storage import blobs as blobs_module

    monkeypatch.setattr(blobs_module, "CHUNK", 1000)
    part = CommittedDir(blobs, "big")
    data = bytes(range(256)) * 20  # 5 chunks
    part.write("big.bin", data)
    marker = part.commit()
    assert marker["files"] == [_entry(data, "big.bin")]
    get = type(blobs).get
    monkeypatch.setattr(type(blobs), "get", lambda self, key: pytest.fail(f"read {key} whole") if key.endswith(
        ".bin") else get(self, key))
    pieces = list(blobs.chunks("big/big.bin"))
    assert [len(p) for p in pieces] == [1000] * 5 + [120]
    assert part.verify() == marker


def test_reopen_removes_the_marker_before_a_rewrite(blobs):
    part = CommittedDir(blobs, "state", "COMPLETE")
    part.write("x.bin", b"old")
    part.commit()
    part.reopen()
    assert not part.committed() and part.files == []
    part.write("x.bin", b"newer")
    assert part.commit()["files"] == [_entry(b"newer", "x.bin")]


def test_files_written_by_another_writer_are_listed_by_note(blobs):
    """A sharded writer (each rank writes its own files) records them in the one marker."""
    part = CommittedDir(blobs, "dcp")
    for rank in range(2):
        blobs.put(f"dcp/__{rank}_0.distcp", bytes(10 + rank))
        part.note(f"__{rank}_0.distcp")
    assert part.commit()["files"] == [_entry(bytes(10), "__0_0.distcp"), _entry(bytes(11), "__1_0.distcp")]
    assert part.verify()["files"][1]["size"] == 11


@pytest.mark.gcs
def test_a_commit_by_another_host_is_seen_by_a_reader_that_listed_before(request):
    """A resuming controller or a healing replica lists the series while others commit into it: with gcsfs's
    default listing cache, `committed()` would keep answering from its first look (fails with the cache on)."""
    endpoint = request.getfixturevalue("gcs_endpoint")
    bucket = f"fresh-{uuid.uuid4().hex[:10]}"
    create_bucket(endpoint, bucket)
    reader, writer = (CommittedSeries(_gcs_blobs(endpoint, bucket, skip_instance_cache=True))  # two hosts' clients
                      for _ in range(2))
    _write_step(writer, 1)
    part = _write_step(writer, 2, commit=False)
    assert reader.committed() == [1] and reader.at(2).marker() is None
    assert reader.blobs.list(part.prefix) == ["meta.json", "t.safetensors"]  # a reader looks into the step
    part.commit({"step": 2})
    _write_step(writer, 3)
    assert reader.committed() == [1, 2, 3] and reader.newest().step == 3  # type: ignore[union-attr]


def test_the_diloco_store_serves_as_blobs(tmp_path):
    """The object-store plane's `Store` (atomic puts, byte accounting) holds committed directories unchanged."""
    from composer_mesh.mesh.objectstore.store import Store

    store = Store(f"file://{tmp_path}/s")
    series = CommittedSeries(store, "ckpt", name="q")
    _write_step(series, 2)
    part = _write_step(series, 3)
    part.reopen()  # deletes the one marker object
    assert series.committed() == [2] and series.newest().step == 2  # type: ignore[union-attr]
    assert store.counters()[1] > 0


def test_read_committed_gives_the_parts_or_one_line_saying_what_is_wrong(blobs):
    series = CommittedSeries(blobs)
    part = _write_step(series, 3, commit=False)
    with pytest.raises(StorageError, match=r"^step 3 was never finished$"):
        part.read_committed("meta.json", "t.safetensors", missing="step 3 was never finished", what="step")
    part.commit({"step": 3})
    doc, tensors = part.read_committed("meta.json", "t.safetensors", missing="-", what="step")
    assert doc == {"step": 3} and torch.equal(tensors["w"], torch.full((3,), 3.0))
    blobs.put(part.key("t.safetensors"), b"not safetensors")
    part.reopen()
    part.write("t.safetensors", b"not safetensors")  # committed as it is: its bytes are what the marker says
    part.write_json("meta.json", {"step": 3})
    part.commit({"step": 3})
    with pytest.raises(StorageError, match=r"^step-00000003: unreadable step: \w+") as e:
        part.read_committed("meta.json", "t.safetensors", missing="-", what="step")
    assert "\n" not in str(e.value)
