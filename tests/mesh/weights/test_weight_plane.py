"""Weight plane on real Monarch proc meshes: a trainer proc and three generator procs, over every transport
this machine has (rdma over the TCP fallback, shm, endpoint; cuda_ipc where a GPU is present).

Content is a deterministic function of (tensor, version), so every check is bitwise and proves the
generator holds exactly one version (never a mix).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import monarch.actor
import pytest
import torch
from monarch.actor import ActorError, this_host

from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.mesh.weights.hostid import HostIdentity, this_host_identity
from composer_mesh.mesh.weights.plane import (
    ManifestMismatchError,
    StaleVersionError,
    TransportUnavailableError,
    WeightPublisher,
    WeightSubscriber,
    WeightTransferError,
)
from composer_mesh.mesh.weights.shm import PREFIX, SHM_DIR, segment_names
from mesh.weights.plane_actors import PlaneGenerator, PlaneTrainer, expected_tensor, model_spec

FAULTS: list[Any] = []

SPEC = model_spec()
N_GENERATORS = 3
# 1 MiB chunks: the ~2.2 MB model spans three chunks with tensors straddling the boundary.
BASE = {"bucket_mb": 1, "read_timeout_s": 60}
_names = (f"p{i}" for i in itertools.count())
GPU = pytest.mark.gpu  # tests/conftest.py skips these, with the reason, where CUDA is not available
SEQLOCK = ["rdma", "shm", pytest.param("cuda_ipc", marks=GPU)]  # transports with slots + seqlock headers
EVERY = [*SEQLOCK, "endpoint"]


def tcp_only() -> bool:
    """No ibverbs device on this host: Monarch's RDMA runs over its TCP fallback."""
    from monarch.rdma import get_rdma_backend

    return bool(get_rdma_backend() != "ibverbs")


def device_of(transport: str) -> str:
    return "cuda" if transport == "cuda_ipc" else "cpu"


def leftover_segments(pid: int) -> list[str]:
    prefix = f"{PREFIX}-{this_host_identity().tag()}-{pid}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def quiet() -> None:
    import warnings

    from monarch.rdma import RDMATcpFallbackWarning

    warnings.filterwarnings("ignore", category=RDMATcpFallbackWarning)


@pytest.fixture(scope="module")
def meshes() -> Iterator[tuple[Any, Any]]:
    # Installed here, not at import: a hook set during collection would collect other modules' faults.
    previous_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = FAULTS.append  # a fault must fail a test, not exit the session
    FAULTS.clear()
    trainer_procs = this_host().spawn_procs(per_host={"procs": 1}, name="wp_trainer", bootstrap=quiet)
    gen_procs = this_host().spawn_procs(per_host={"procs": N_GENERATORS}, name="wp_gens", bootstrap=quiet)
    trainer_procs.initialized.get()
    gen_procs.initialized.get()
    probe = trainer_procs.spawn("wp_probe", PlaneTrainer, SPEC, BASE)  # auto on CPU: holds a shm segment
    trainer_pid = probe.info.call_one().get()["pid"]
    assert leftover_segments(trainer_pid) != []
    yield trainer_procs, gen_procs
    trainer_procs.stop().get()
    gen_procs.stop().get()
    monarch.actor.unhandled_fault_hook = previous_hook
    # Publishers never closed by the tests are unlinked when their proc exits (atexit).
    deadline = time.monotonic() + 15
    while leftover_segments(trainer_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftover_segments(trainer_pid) == [], "shared-memory segments leaked by the trainer proc"


def spawn(meshes: tuple[Any, Any], **config: Any) -> tuple[Any, Any]:
    cfg = {**BASE, **config}
    device = device_of(cfg.get("transport", "auto"))
    trainer_procs, gen_procs = meshes
    trainer = trainer_procs.spawn(next(_names), PlaneTrainer, SPEC, cfg, device)
    gens = gen_procs.spawn(next(_names), PlaneGenerator, SPEC, cfg, device)
    return trainer, gens


def one(gens: Any) -> Any:
    return gens.slice(procs=0)


@pytest.mark.parametrize("transport", EVERY)
async def test_mixed_dtypes_exact_on_every_generator_after_each_sync(
    meshes: tuple[Any, Any], transport: str
) -> None:
    trainer, gens = spawn(meshes, transport=transport)
    for expected_version in (1, 2, 3):
        manifest = await trainer.publish.call_one()
        assert manifest.version == expected_version
        assert manifest.num_tensors == len(SPEC) and len(manifest.chunks) >= 2
        results = list((await gens.sync.call(manifest)).values())  # 3 generators pull concurrently
        assert len(results) == N_GENERATORS
        for r in results:
            assert r["version"] == expected_version and r["transport"] == transport
            assert r["bad_staged"] == [] and r["bad_model"] == []
            # what moves the bytes: rdma is Monarch's TCP fallback on a host without ibverbs, and says so
            over_tcp = transport == "rdma" and tcp_only()
            assert (r["used"], r["fallback"]) == ("rdma_tcp" if over_tcp else transport, over_tcp)
            assert ("no ibverbs device" in r["reason"]) == over_tcp
    assert FAULTS == []


@pytest.mark.parametrize("transport", EVERY)
async def test_update_published_while_generators_read_and_generate(
    meshes: tuple[Any, Any], transport: str
) -> None:
    trainer, gens = spawn(meshes, transport=transport)
    manifest = await trainer.publish.call_one()
    await gens.sync.call(manifest)
    # Trainer publishes 40 versions back to back while every generator serves requests and keeps pulling.
    published, served = await asyncio.gather(
        trainer.publish_many.call_one(40, 0.005),
        gens.serve_while_syncing.call(manifest, 25, 0.01),
    )
    assert published == list(range(2, 42))
    for out in served.values():
        pulls, requests = out["pulls"], out["requests"]
        assert pulls and requests
        assert all(bad == [] for _, _, _, bad in pulls), "a pull returned a mix of versions"
        assert all(bad == [] for _, _, _, bad in requests), "the model changed under a request"
        versions = [v for v, _, _, _ in pulls]
        assert versions == sorted(versions) and versions[-1] > 1, versions
        served_versions = [v for v, _, _, _ in requests]
        assert served_versions == sorted(served_versions) and served_versions[-1] > 1
        # No draining: some pull ran while a request was in flight.
        assert any(p0 < r1 and r0 < p1 for _, p0, p1, _ in pulls for _, r0, r1, _ in requests)
    final = await trainer.publish.call_one()
    assert all(r["bad_model"] == [] and r["version"] == 42 for r in (await gens.sync.call(final)).values())


@pytest.mark.parametrize("transport", SEQLOCK)
async def test_read_overlapping_a_publish_into_its_slot_retries_to_a_consistent_version(
    meshes: tuple[Any, Any], transport: str
) -> None:
    trainer, gens = spawn(meshes, transport=transport)
    m1 = await trainer.publish.call_one()  # slot 1
    await trainer.publish.call_one()  # v2 -> slot 0
    assert await trainer.begin_slow_publish.call_one() == 3  # v3 half written into slot 1 (m1's slot)
    torn = await one(gens).pull_with.call_one(m1, {})
    assert torn["version"] == 2 and torn["retries"] >= 1 and torn["bad_staged"] == []
    assert torn["transport"] == transport
    with pytest.raises(ActorError) as err:
        await one(gens).pull_with.call_one(m1, {"allow_newer": False})
    assert isinstance(err.value.exception, StaleVersionError)
    m3 = await trainer.finish_slow_publish.call_one()
    r = await one(gens).sync.call_one(m3)
    assert r["version"] == 3 and r["retries"] == 0 and r["bad_model"] == []


@pytest.mark.parametrize("transport", SEQLOCK)
async def test_single_buffer_read_waits_for_the_writer(meshes: tuple[Any, Any], transport: str) -> None:
    trainer, gens = spawn(meshes, transport=transport, double_buffer=False, max_retries=8)
    m1 = await trainer.publish.call_one()
    assert await trainer.begin_slow_publish.call_one() == 2  # the only slot is half written
    await one(gens).start_pull.call_one(m1)
    deadline = time.monotonic() + 60  # bounds a hang: the first read is torn within milliseconds when idle
    while await one(gens).torn_reads.call_one() < 1:  # the pull met the half-written slot (not a fixed sleep)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await trainer.finish_slow_publish.call_one()  # while the pull retries (its backoff allows ~5 s)
    r = await one(gens).pulled.call_one()
    assert r["version"] == 2 and r["retries"] >= 1 and r["bad_staged"] == []


async def test_endpoint_transport_same_interface(meshes: tuple[Any, Any]) -> None:
    trainer, gens = spawn(meshes, transport="endpoint")
    manifest = await trainer.publish.call_one()
    assert manifest.transport == "endpoint" and manifest.handles == ()
    for r in (await gens.sync.call(manifest)).values():
        assert r["version"] == 1 and r["bad_staged"] == [] and r["bad_model"] == []
    await trainer.publish.call_one()  # v2 in slot 0
    assert await trainer.begin_slow_publish.call_one() == 3
    r = await one(gens).sync.call_one(manifest)  # serves the newest stable version, never the torn one
    assert r["version"] == 2 and r["bad_model"] == []
    await trainer.finish_slow_publish.call_one()


async def test_bad_manifests_and_params_name_the_tensor(meshes: tuple[Any, Any]) -> None:
    trainer, gens = spawn(meshes)
    manifest = await trainer.publish.call_one()
    reshaped = dict(SPEC)
    reshaped["layers.2.mlp.up.weight"] = ((5, 5), "float32")
    msg = await one(gens).expect_other_spec.call_one(manifest, reshaped)
    assert msg.startswith("ManifestMismatchError") and "'layers.2.mlp.up.weight'" in msg and "(5, 5)" in msg
    retyped = dict(SPEC)
    retyped["pos.weight"] = (SPEC["pos.weight"][0], "float32")
    msg = await one(gens).expect_other_spec.call_one(manifest, retyped)
    assert "'pos.weight'" in msg and "bfloat16" in msg
    renamed = {("renamed" if n == "step" else n): v for n, v in SPEC.items()}
    msg = await one(gens).expect_other_spec.call_one(manifest, renamed)
    assert "missing ['renamed']" in msg and "unexpected ['step']" in msg
    msg = await trainer.bad_publish.call_one()
    assert "'embed.weight'" in msg and "(3, 3)" in msg


# ----- same-host transports: the auto rule, forced transports that cannot work, cleanup


async def test_auto_picks_shm_for_procs_on_this_host_and_close_unlinks(meshes: tuple[Any, Any]) -> None:
    trainer, gens = spawn(meshes)  # transport: auto on both sides, CPU weights
    info = await trainer.info.call_one()
    assert info["offers"] == ("shm", "rdma") and len(info["segments"]) == 1
    manifest = await trainer.publish.call_one()
    assert manifest.transport == "auto" and manifest.host == this_host_identity()
    for r in (await gens.sync.call(manifest)).values():
        assert r["transport"] == "shm" and r["reason"] == "auto: on the publisher's host"
        assert r["version"] == 1 and r["bad_staged"] == [] and r["bad_model"] == []
    assert await trainer.close.call_one() == []  # close() unlinked the segment
    assert info["segments"][0] not in os.listdir(SHM_DIR)
    with pytest.raises(ActorError) as err:  # a mapped subscriber sees the closed headers, not stale data
        await one(gens).sync.call_one(manifest)
    assert isinstance(err.value.exception, WeightTransferError) and "is closed" in str(err.value.exception)


async def test_other_host_identity_forced_shm_errors_with_the_reason_auto_falls_back(
    meshes: tuple[Any, Any],
) -> None:
    elsewhere = HostIdentity("gpu-node-17", "0123456789abcdef")
    trainer, gens = spawn(meshes, transport="shm")
    moved = dataclasses.replace(await trainer.publish.call_one(), host=elsewhere)
    with pytest.raises(ActorError) as err:
        await one(gens).pull_with.call_one(moved, {})
    exc = err.value.exception
    assert isinstance(exc, TransportUnavailableError)
    assert "transport 'shm' needs the publisher on this host" in str(exc)
    assert "publisher on host gpu-node-17 (boot 01234567)" in str(exc) and this_host_identity().hostname in str(exc)
    trainer, gens = spawn(meshes)  # auto: the same situation falls back to rdma, still exact
    moved = dataclasses.replace(await trainer.publish.call_one(), host=elsewhere)
    r = await one(gens).pull_with.call_one(moved, {})
    assert r["transport"] == "rdma" and "not shm: publisher on host gpu-node-17" in r["reason"]
    assert r["version"] == 1 and r["bad_staged"] == []
    # another host is no fallback for rdma itself; only the TCP fallback under it is
    assert (r["used"], r["fallback"]) == (("rdma_tcp", True) if tcp_only() else ("rdma", False))


async def test_unopenable_segment_private_dev_shm_auto_falls_back_forced_errors(meshes: tuple[Any, Any]) -> None:
    trainer, gens = spawn(meshes)
    m = await trainer.publish.call_one()
    assert m.shm is not None
    hidden = dataclasses.replace(m, shm=dataclasses.replace(m.shm, name=m.shm.name + "-not-here"))
    r = await one(gens).pull_with.call_one(hidden, {})
    assert r["transport"] == "rdma" and "cannot open shared-memory segment" in r["reason"]
    assert r["bad_staged"] == []
    assert r["fallback"] is True  # on the publisher's host, shm should have worked: a fallback even over ibverbs
    with pytest.raises(ActorError) as err:
        await one(gens).pull_with.call_one(hidden, {"transport": "shm"})
    assert "transport 'shm' cannot work here: cannot open shared-memory segment" in str(err.value.exception)
    namesake = dataclasses.replace(m, shm=dataclasses.replace(m.shm, token=b"\0" * 16))
    r = await one(gens).pull_with.call_one(namesake, {})
    assert r["transport"] == "rdma" and "token differs" in r["reason"]


# ----- in-process (controller context, no proc meshes): API edges


def _params() -> dict[str, torch.Tensor]:
    return {n: expected_tensor(n, s, d, 7) for n, (s, d) in list(SPEC.items())[:8]}


async def test_in_process_round_trip_and_apply_rules() -> None:
    params = _params()
    cfg = WeightPlaneConfig(**BASE)
    pub = WeightPublisher(params, cfg)
    sub = WeightSubscriber(cfg, expected=params)
    dest = {n: torch.empty_like(t) for n, t in params.items()}
    assert sub.maybe_apply(dest) is None  # nothing staged yet
    m = pub.publish(params)
    pulled = await sub.pull(m)
    assert pulled.version == 1 and pulled.nbytes == m.total_bytes
    assert sub.maybe_apply(dest) == 1 and sub.maybe_apply(dest) is None
    assert all(
        torch.equal(dest[n].view(-1).view(torch.uint8), params[n].view(-1).view(torch.uint8)) for n in params
    )
    with pytest.raises(ManifestMismatchError, match="'step'"):
        sub.apply_to({**dest, "step": torch.zeros(2, dtype=torch.int64)})
    pub.close()


def test_pull_blocking_for_sync_actors() -> None:
    params = _params()
    for transport in ("rdma", "shm", "endpoint"):
        cfg = WeightPlaneConfig(transport=transport)
        pub = WeightPublisher(params, cfg)
        pub.publish(params)
        pulled = WeightSubscriber(cfg, expected=params).pull_blocking(pub.publish(params))
        assert pulled.version == 2 and pulled.transport == transport
        assert all(
            torch.equal(pulled.tensors[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
            for n, t in params.items()
        )
        pub.close()
        assert segment_names(pub.id) == []


async def test_read_failure_names_chunk_tensors_and_size() -> None:
    params = _params()
    cfg = WeightPlaneConfig(read_timeout_s=10)
    pub = WeightPublisher(params, cfg)
    m = pub.publish(params)
    pub.close()  # drops the registered buffers: the next read fails
    with pytest.raises(WeightTransferError) as err:
        await asyncio.wait_for(WeightSubscriber(cfg).pull(m), 30)
    msg = str(err.value)
    assert "v1 slot 1 chunk 0" in msg and "MiB" in msg and "embed.weight" in msg and "timeout 10s" in msg


def test_config_rejects_unknown_fields_and_values() -> None:
    with pytest.raises(ValueError, match="transport"):
        WeightPlaneConfig(transport="nccl")
    with pytest.raises(ValueError, match="extra"):
        WeightPlaneConfig(timeout=3)
    with pytest.raises(ValueError, match="bucket_mb"):
        WeightPlaneConfig(bucket_mb=0)
    assert WeightPlaneConfig().transport == "auto"
    assert WeightPlaneConfig(transport="cuda_ipc").transport == "cuda_ipc"
