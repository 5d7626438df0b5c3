"""DiLoCo checkpoints in the object store: failed writes surface, the latest never goes backwards, GC keeps it.

Replicas are `ObjectStoreManager`s on a real file:// store (and S3 through moto, GCS through
gcp-storage-emulator where marked); the race between
a slow checkpoint writer and a newer one is driven deterministically, at every store operation of either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from composer_mesh.mesh.objectstore import DiLoCoConfig
from composer_mesh.mesh.objectstore.manager import CheckpointError, ObjectStoreManager
from composer_mesh.mesh.objectstore.store import Store

NOT_CALLED = -1


def _cfg(uri: str, **kw: Any) -> DiLoCoConfig:
    return DiLoCoConfig(**{"store_uri": uri, "run_id": "ck", "replicas": 2, "keep_rounds": 1, **kw})


class HookedStore(Store):
    """A Store that calls `before(n, op, key)` before its n-th operation (n from 1)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ops: list[tuple[str, str]] = []
        self.before: Callable[[int, str, str], None] = lambda n, op, key: None

    def _op(self, op: str, key: str) -> None:
        self.ops.append((op, key))
        self.before(len(self.ops), op, key)

    def put(self, key, data):  # type: ignore[no-untyped-def,override]
        self._op("put", key)
        return super().put(key, data)

    def put_if_absent(self, key, data):  # type: ignore[no-untyped-def,override]
        self._op("put_if_absent", key)
        return super().put_if_absent(key, data)

    def get(self, key):  # type: ignore[no-untyped-def,override]
        self._op("get", key)
        return super().get(key)

    def exists(self, key):  # type: ignore[no-untyped-def,override]
        self._op("exists", key)
        return super().exists(key)

    def list(self, prefix):  # type: ignore[no-untyped-def,override]
        self._op("list", prefix)
        return super().list(prefix)

    def rm_prefix(self, prefix):  # type: ignore[no-untyped-def,override]
        self._op("rm_prefix", prefix)
        return super().rm_prefix(prefix)


def _manager(cfg: DiLoCoConfig, replica: int, store: Store | None = None) -> tuple[ObjectStoreManager, dict]:
    """A manager with one registered state ("S": {"w": tensor}) the test reads and sets."""
    m = ObjectStoreManager(cfg, replica, store)
    state = {"w": torch.zeros(4)}
    m.register_state_dict_fn("S", lambda sd: state.update(w=sd["w"].clone()), lambda: {"w": state["w"]})
    return m, state


def _checkpoint(m: ObjectStoreManager, state: dict, q: int, wait: bool = True) -> None:
    """What should_commit() + the DiLoCo hook do after round q commits (step == q: every round committed)."""
    state["w"] = torch.full((4,), float(q))
    m._pending_checkpoint = (q, q, [0, 1])
    m.maybe_checkpoint(wait=wait)


def _resume(cfg: DiLoCoConfig) -> tuple[str, int, float]:
    """What a restarted replica resumes from: (start mode, step, the state's value)."""
    m, state = _manager(cfg, 0)
    try:
        mode = m.bootstrap()
        return mode, m.current_step(), float(state["w"][0])
    finally:
        m.shutdown()


def _race(cfg: DiLoCoConfig, slow: int, fast: int, at: int) -> list[tuple[str, str]]:
    """Round `slow`'s writer runs; just before its `at`-th store operation round `fast`'s writer runs whole."""
    fast_m, fast_state = _manager(cfg, fast % 2)

    def before(n: int, op: str, key: str) -> None:
        if n == at:
            _checkpoint(fast_m, fast_state, fast)

    hooked = HookedStore.from_config(cfg)
    hooked.before = before
    slow_m, slow_state = _manager(cfg, slow % 2, hooked)
    try:
        _checkpoint(slow_m, slow_state, slow)
        if at == NOT_CALLED or at > len(slow_m.store.ops):  # type: ignore[attr-defined]
            _checkpoint(fast_m, fast_state, fast)  # after the slow one, for the count run and the last slot
        return list(slow_m.store.ops)  # type: ignore[attr-defined]
    finally:
        slow_m.shutdown()
        fast_m.shutdown()


@pytest.mark.parametrize(("slow", "fast"), [(5, 6), (6, 5)], ids=["older-finishes-late", "newer-finishes-late"])
def test_latest_never_goes_backwards_and_gc_keeps_it(tmp_path, slow, fast):
    """At every store operation of one writer, the other writes its whole checkpoint (keep_rounds=1, so GC is
    as eager as it gets). Whatever the interleaving, a restart resumes from round 6, whose state is intact."""
    ops = _race(_cfg(f"file://{tmp_path}/count"), slow, fast, NOT_CALLED)
    assert any(op == "put" and key.endswith("state.safetensors") for op, key in ops), ops
    for at in range(1, len(ops) + 2):
        cfg = _cfg(f"file://{tmp_path}/at{at}")
        _race(cfg, slow, fast, at)
        assert _resume(cfg) == ("resumed", 6, 6.0), f"writer {fast} ran before op {at} of {ops}"
        assert (tmp_path / f"at{at}" / "ck" / "ckpt" / "q00000006" / "state.safetensors").exists()


@pytest.mark.parametrize("kind", [pytest.param("s3", marks=pytest.mark.s3), pytest.param("gcs", marks=pytest.mark.gcs)])
def test_latest_never_goes_backwards_on_object_stores(request, kind):
    """The same race on S3 (moto) and GCS (the emulator): the newer writer runs at every store operation of the
    older one, and a restart resumes from the newest round."""
    fields = request.getfixturevalue(f"{kind}_store")
    base = fields["store_uri"]

    def cfg(name: str) -> DiLoCoConfig:
        return _cfg(f"{base}/{name}", storage_options=fields["storage_options"],
                    credentials_env=fields["credentials_env"])

    ops = _race(cfg("count"), 5, 6, NOT_CALLED)
    for at in range(1, len(ops) + 2):
        _race(cfg(f"at{at}"), 5, 6, at)
        assert _resume(cfg(f"at{at}")) == ("resumed", 6, 6.0), f"writer 6 ran before op {at} of {ops}"


class FailingStore(Store):
    """file:// store whose puts under `ckpt/q` fail like a full disk."""

    def put(self, key, data):  # type: ignore[no-untyped-def,override]
        if key.startswith("ckpt/q"):
            raise OSError(28, "No space left on device")
        return super().put(key, data)


FAILED = r"checkpoint of round 3 \(step 3\) failed writing file://.*/ck/ckpt/q00000003/state\.safetensors: " \
         r"OSError: \[Errno 28\] No space left on device"


def test_failed_checkpoint_write_raises_when_waited(tmp_path):
    cfg = _cfg(f"file://{tmp_path}")
    m, state = _manager(cfg, 1, FailingStore.from_config(cfg))
    with pytest.raises(CheckpointError, match=FAILED):
        _checkpoint(m, state, 3, wait=True)
    m.shutdown()  # raised once: not again


@pytest.mark.parametrize("surfaces_at", ["shutdown", "maybe_checkpoint", "start_quorum"])
def test_failed_background_checkpoint_write_is_raised_later(tmp_path, surfaces_at):
    """The write runs in the background: its failure is raised at the next call, or at shutdown."""
    cfg = _cfg(f"file://{tmp_path}")
    m, state = _manager(cfg, 1, FailingStore.from_config(cfg))
    _checkpoint(m, state, 3, wait=False)
    try:
        with pytest.raises(CheckpointError, match=FAILED):
            if surfaces_at == "shutdown":
                m.shutdown()
            else:
                assert m._ckpt_future is not None
                m._ckpt_future.exception(timeout=30)  # let it fail, then the next call must raise it
                getattr(m, surfaces_at)()
    finally:
        m.shutdown()


def test_failed_write_superseded_by_a_newer_checkpoint_is_not_an_error(tmp_path):
    """A slow writer whose round was already checkpointed past: its failure harms nothing (and is logged)."""
    cfg = _cfg(f"file://{tmp_path}")
    newer, newer_state = _manager(cfg, 0)
    _checkpoint(newer, newer_state, 4)
    m, state = _manager(cfg, 1, FailingStore.from_config(cfg))
    _checkpoint(m, state, 3, wait=True)
    m.shutdown()
    newer.shutdown()
    assert _resume(cfg) == ("resumed", 4, 4.0)


def test_diloco_training_fails_when_its_checkpoint_cannot_be_written(tmp_path):
    """End to end: real torchft DiLoCo, one replica; the checkpoint after the first sync fails -> the error
    reaches the training loop (an optimizer step, or close()), naming the object and the cause."""
    from composer_mesh.mesh.objectstore.diloco import ObjectStoreDiLoCo
    from mesh.objectstore.worker import build_model, inner_step

    cfg = DiLoCoConfig(store_uri=f"file://{tmp_path}", run_id="ck", replicas=1, sync_every=2, poll_interval_s=0.01)
    model = build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = ObjectStoreDiLoCo(model, opt, cfg, 0, store=FailingStore.from_config(cfg))
    with pytest.raises(CheckpointError, match=r"checkpoint of round 1 \(step 1\) failed writing "
                                              r"file://.*/ck/ckpt/q00000001/state\.safetensors: OSError"):
        with sync:
            for step in range(6):
                inner_step(model, opt, 0, step)
        sync.close()
    sync.manager.shutdown()


def _two_checkpoints(tmp_path: Any) -> tuple[DiLoCoConfig, Any]:
    """Rounds 1 and 2 checkpointed (kept: keep_rounds=4); the path of round 2's directory."""
    cfg = _cfg(f"file://{tmp_path}/v", keep_rounds=4)
    m, state = _manager(cfg, 0)
    for q in (1, 2):
        _checkpoint(m, state, q)
    m.shutdown()
    return cfg, tmp_path / "v" / "ck" / "ckpt" / "q00000002"


def test_a_corrupted_state_is_refused_and_the_newest_that_verifies_heals(tmp_path, caplog):
    """64 bytes of 0xFF in the newest checkpoint's state: a restarted replica refuses it (a warning naming the
    file and what differs) and heals from round 1, the newest that verifies."""
    cfg, q2 = _two_checkpoints(tmp_path)
    state = q2 / "state.safetensors"
    data = state.read_bytes()
    state.write_bytes(data[:64] + b"\xff" * 64 + data[128:])
    with caplog.at_level("WARNING"):
        assert _resume(cfg) == ("resumed", 1, 1.0)
    assert any("refusing the DiLoCo checkpoint of round 2" in r.getMessage()
               and "ckpt/q00000002/state.safetensors: content differs from COMMITTED.json" in r.getMessage()
               for r in caplog.records), caplog.text


def test_an_invalid_marker_is_no_checkpoint_and_none_valid_is_an_error_not_theta0(tmp_path):
    from composer_mesh.mesh.objectstore.store import ShardError

    cfg, q2 = _two_checkpoints(tmp_path)
    (q2 / "COMMITTED.json").write_text("xx")
    assert _resume(cfg) == ("resumed", 1, 1.0)
    (q2.parent / "q00000001" / "state.safetensors").write_bytes(b"\xff" * 10)  # truncated, and q2 is no checkpoint
    with pytest.raises(ShardError, match=r"ckpt/q00000001/state\.safetensors: 10 bytes, COMMITTED\.json says \d+ "
                                         r"\(truncated or overwritten\); no older checkpoint to heal from"):
        _resume(cfg)
    (q2.parent / "q00000001" / "COMMITTED.json").write_text("{}")
    with pytest.raises(ShardError, match=r"ckpt/q00000002/COMMITTED\.json: not committed: the commit marker is not "
                                         "JSON"):
        _resume(cfg)  # markers there, none valid: never a fresh start from θ0
