"""Real torchft DiLoCo, replicas in separate OS processes, synchronising through file://, S3 (moto) and GCS
(gcp-storage-emulator behind the create-only proxy)."""

from __future__ import annotations

import time

import pytest
import torch

from composer_mesh.mesh.objectstore.diloco import split_fragments
from mesh.objectstore.procs import results, spawn, wait_all
from mesh.objectstore.reference import reference_diloco
from mesh.objectstore.worker import WorkerArgs, build_model

OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def _run_replicas(tmp_path, n: int, store: dict, **kw) -> list[dict]:
    out = str(tmp_path / "out")
    args = [WorkerArgs(run_id="mp", replicas=n, replica_id=r, out_dir=out, outer=OUTER, **store, **kw)
            for r in range(n)]
    procs = [spawn(a) for a in args]
    wait_all(procs, out, timeout=150)
    res = results(out)
    assert [r["replica"] for r in res] == list(range(n))
    return res


def _assert_identical(res: list[dict], key: str) -> None:
    first = res[0][key]
    for r in res[1:]:
        assert r[key].keys() == first.keys()
        for name, t in first.items():
            assert torch.equal(r[key][name], t), f"replica {r['replica']} differs from replica 0 in {key}/{name}"


def _check_against_reference(res: list[dict], n: int, sync_every: int, rounds: int) -> None:
    theta0 = res[0]["theta0"]
    for r in res[1:]:  # replicas built different random models; the store made them start equal
        for k, v in theta0.items():
            assert torch.equal(r["theta0"][k], v), f"replica {r['replica']} started from a different {k}"
    ref = reference_diloco(theta0, n, sync_every, rounds, inner_lr=0.05, **OUTER)
    for k, v in ref.items():
        got = res[0]["final"][k].double()
        assert torch.allclose(got, v, atol=2e-6, rtol=1e-5), f"{k}: max |Δ| {(got - v).abs().max():.3g}"
        assert not torch.allclose(got, res[0]["theta0"][k].double()), f"{k} never moved"


@pytest.mark.parametrize("n", [2, 3])
def test_file_replicas_identical_and_match_reference(tmp_path, n):
    store = {"store_uri": f"file://{tmp_path}/store"}
    res = _run_replicas(tmp_path, n, store, sync_every=2, target_outer_steps=3)
    _assert_identical(res, "final")
    _assert_identical(res, "global")
    for r in res:
        assert r["outer_step"] == 3
        assert all(rep["committed"] and rep["members"] == list(range(n)) for rep in r["reports"])
    _check_against_reference(res, n, sync_every=2, rounds=3)


@pytest.mark.s3
@pytest.mark.parametrize("n", [2, 3])
def test_s3_replicas_identical_and_match_reference(tmp_path, n, s3_store):
    res = _run_replicas(tmp_path, n, s3_store, sync_every=2, target_outer_steps=2, poll_interval_s=0.05)
    _assert_identical(res, "final")
    _assert_identical(res, "global")
    for r in res:
        assert all(rep["committed"] and rep["members"] == list(range(n)) for rep in r["reports"])
    _check_against_reference(res, n, sync_every=2, rounds=2)


@pytest.mark.gcs
def test_gs_replicas_identical_and_match_reference(tmp_path, gcs_store):
    res = _run_replicas(tmp_path, 2, gcs_store, sync_every=2, target_outer_steps=2, poll_interval_s=0.05)
    _assert_identical(res, "final")
    _assert_identical(res, "global")
    for r in res:
        assert all(rep["committed"] and rep["members"] == [0, 1] for rep in r["reports"])
    _check_against_reference(res, 2, sync_every=2, rounds=2)


def test_streaming_two_fragments_with_delay(tmp_path):
    store = {"store_uri": f"file://{tmp_path}/store"}
    res = _run_replicas(tmp_path, 2, store, sync_every=4, fragments=2, fragment_sync_delay=1,
                        target_outer_steps=4)
    _assert_identical(res, "global")  # global params and both fragments' outer momentum
    g = res[0]["global"]
    assert any(k.startswith("f0/momentum/") for k in g) and any(k.startswith("f1/momentum/") for k in g)
    # Rounds alternate between the fragments (torchft: fragment = committed step % fragments), so each round
    # reduces exactly the elements of its fragment: f0, f1, f0, f1.
    sizes = [sum(p.numel() for p in f.parameters()) for f in split_fragments(build_model(0), 2)]
    assert len(set(sizes)) == 2, f"fragments of equal size {sizes} would not tell the order apart"
    for r in res:
        assert r["outer_step"] == 4  # each fragment synced twice
        assert all(rep["committed"] for rep in r["reports"]), r["reports"]
        assert [rep["numel"] for rep in r["reports"]] == [sizes[i % 2] for i in range(4)], r["reports"]
    # the fragment synced last is identical in the model itself; the other carries local progress
    last_synced = [k.split("/", 2)[2] for k in g if k.startswith("f1/param/")]
    for name in last_synced:
        model_name = name.replace("__", ".")
        assert torch.equal(res[0]["final"][model_name], res[1]["final"][model_name])
        assert torch.equal(res[0]["final"][model_name], g[f"f1/param/{name}"])


def _decided_without(rounds_dir, replica: int) -> bool:
    import json

    for rec in rounds_dir.glob("q*/members/e0.json"):
        try:
            if replica not in json.loads(rec.read_text())["members"]:
                return True
        except (OSError, ValueError, KeyError):
            continue
    return False


@pytest.mark.slow
def test_replica_killed_mid_round_rejoins_identical(tmp_path):
    store_root = tmp_path / "store"
    out = str(tmp_path / "out")
    n = 3
    common = dict(run_id="kill", replicas=n, out_dir=out, outer=OUTER, store_uri=f"file://{store_root}",
                  sync_every=2, target_outer_steps=4, require_full_final_round=True, quorum_deadline_s=3.0,
                  step_sleep_s=0.05)
    procs = [spawn(WorkerArgs(replica_id=r, **common)) for r in range(n)]
    victim = procs[2]
    marker = store_root / "kill" / "rounds" / "q00000002" / "arrived" / "r002.json"
    end = time.monotonic() + 90
    while not marker.exists():
        assert time.monotonic() < end, "replica 2 never reached round 2"
        assert victim.is_alive(), "replica 2 exited early"
        time.sleep(0.01)
    victim.kill()  # SIGKILL, mid-round: shards published, reduction under way
    victim.join()
    # Restart only once the survivors have decided a round without it (they wait out the deadline first).
    end = time.monotonic() + 90
    while not _decided_without(store_root / "kill" / "rounds", 2):
        assert time.monotonic() < end, "the survivors never decided a round without replica 2"
        time.sleep(0.05)
    restarted = spawn(WorkerArgs(replica_id=2, **common))
    wait_all([procs[0], procs[1], restarted], out, timeout=150)
    res = results(out)
    assert [r["replica"] for r in res] == [0, 1, 2], "the killed replica must not have written results"
    survivors, rejoined = res[:2], res[2]
    # survivors committed at least one round without replica 2, within the deadline
    without = [rep for rep in survivors[0]["reports"] if rep["committed"] and 2 not in rep["members"]]
    assert without, f"no round committed without replica 2: {survivors[0]['reports']}"
    assert all(rep["committed"] for s in survivors for rep in s["reports"])
    # the restarted replica resumed from the store and finished identical to the others
    assert rejoined["start_mode"] == "resumed" and rejoined["start_step"] >= 2
    assert rejoined["round_id"] == survivors[0]["round_id"] == survivors[1]["round_id"]
    assert rejoined["reports"][-1]["members"] == [0, 1, 2]
    assert any(rep["contributed"] and 2 in rep["members"] for rep in rejoined["reports"])
    _assert_identical(res, "final")
    _assert_identical(res, "global")
