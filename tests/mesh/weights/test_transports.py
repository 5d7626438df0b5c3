"""Same-host transports without proc meshes: what a publisher serves, forced transports that cannot work,
shared-memory cleanup, and what a CUDA IPC handle carries (plain data only). GPU tests skip on CPU."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from composer_mesh.mesh.weights import shm
from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.mesh.weights.cuda_ipc import CudaIpcHandle, handle_from_reduction
from composer_mesh.mesh.weights.hostid import this_host_identity
from composer_mesh.mesh.weights.plane import TransportUnavailableError, WeightPublisher, WeightSubscriber
from composer_mesh.mesh.weights.transports import publisher_offers


def _params(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(64, 33, generator=g).to(device),
        "b": torch.randn(7, generator=g).bfloat16().to(device),
        "ids": torch.arange(5).to(device),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(
        torch.equal(a[n].cpu().reshape(-1).view(torch.uint8), b[n].cpu().reshape(-1).view(torch.uint8))
        for n in b
    )


def test_publisher_offers_by_setting_and_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert publisher_offers("auto", cpu) == ("shm", "rdma")
    assert publisher_offers("auto", cuda) == ("cuda_ipc", "rdma")
    assert publisher_offers("shm", cpu) == ("shm",) and publisher_offers("rdma", cuda) == ("rdma",)
    with pytest.raises(
        TransportUnavailableError, match="'cuda_ipc' needs the weights on a CUDA GPU; they are on cpu"
    ):
        publisher_offers("cuda_ipc", cpu)
    with pytest.raises(
        TransportUnavailableError, match="'shm' needs the weights in CPU memory; they are on cuda:0"
    ):
        publisher_offers("shm", cuda)


def test_forced_cuda_ipc_with_cpu_weights_fails_at_publisher_creation() -> None:
    with pytest.raises(TransportUnavailableError, match="'cuda_ipc' needs the weights on a CUDA GPU"):
        WeightPublisher(_params(), WeightPlaneConfig(transport="cuda_ipc"))


async def test_shm_in_process_exact_and_forced_transport_not_served() -> None:
    params = _params()
    pub = WeightPublisher(params, WeightPlaneConfig(transport="shm"))
    assert pub.offers == ("shm",)
    m = pub.publish(params)
    assert m.handles == () and m.header is None  # nothing registered with Monarch
    sub = WeightSubscriber(WeightPlaneConfig(transport="shm"), expected=params)
    pulled = await sub.pull(m)
    assert pulled.transport == "shm" and _same(pulled.tensors, params)
    with pytest.raises(TransportUnavailableError, match=r"'rdma' is not served by publisher .*\['shm'\]"):
        await WeightSubscriber(WeightPlaneConfig(transport="rdma")).pull(m)
    sub.close()
    pub.close()
    assert shm.segment_names(pub.id) == []


def test_no_usable_dev_shm_auto_serves_rdma_forced_shm_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path / "missing"))
    with pytest.raises(
        TransportUnavailableError, match=r"transport 'shm': no shared memory: .*missing is not usable"
    ):
        WeightPublisher(_params(), WeightPlaneConfig(transport="shm"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pub = WeightPublisher(_params(), WeightPlaneConfig())
    assert pub.offers == ("rdma",)
    assert any("serving rdma only" in str(w.message) for w in caught)
    pub.close()


def test_sweep_removes_segments_of_dead_procs_on_this_host_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    tag = this_host_identity().tag()
    names = {
        "dead": f"{shm.PREFIX}-{tag}-{dead_pid}-aaaa",
        "alive": f"{shm.PREFIX}-{tag}-{os.getppid()}-bbbb",
        "other_host": f"{shm.PREFIX}-00000000-{dead_pid}-cccc",
        "unrelated": "some-other-file",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    assert shm.sweep_stale() == [names["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if k != "dead")


def _fake_reduction(**over: object) -> tuple[object, ...]:
    args = {
        "tensor_cls": torch.Tensor,
        "size": torch.Size([4096]),
        "stride": (1,),
        "offset": 0,
        "storage_cls": torch.storage.TypedStorage,
        "dtype": torch.uint8,
        "device": 0,
        "handle": b"\x01" * 64,
        "ssize": 2 << 20,
        "soff": 512,
        "grad": False,
        "rc": b"/torch_123_456",
        "rco": 3,
        "ev": b"\x02" * 64,
        "sync": True,
    }
    args.update(over)
    return tuple(args.values())


def test_cuda_ipc_handle_is_plain_data_and_only_plain_reductions_are_taken() -> None:
    h = handle_from_reduction(_fake_reduction(), "GPU-1234")
    assert (h.nbytes, h.storage_offset_bytes, h.device_uuid) == (4096, 512, "GPU-1234")
    found: list[str] = []

    class Recorder(pickle.Unpickler):  # records every class/callable the pickle would load
        def find_class(self, module: str, name: str) -> object:
            found.append(f"{module}.{name}")
            return super().find_class(module, name)

    assert Recorder(io.BytesIO(pickle.dumps(h))).load() == h
    assert found == ["composer_mesh.mesh.weights.cuda_ipc.CudaIpcHandle"]  # no torch class, dtype or callable
    assert all(
        isinstance(getattr(h, f), (bytes, int, str, bool, type(None)))
        for f in CudaIpcHandle.__dataclass_fields__
    )
    with pytest.raises(TypeError, match="plain uint8 tensor"):
        handle_from_reduction(_fake_reduction(tensor_cls=torch.nn.Parameter), "GPU-1234")
    with pytest.raises(TypeError, match="plain uint8 tensor"):
        handle_from_reduction(_fake_reduction(dtype=torch.float32), "GPU-1234")
    with pytest.raises(TypeError, match="handle is a str"):
        handle_from_reduction(_fake_reduction(handle="not bytes"), "GPU-1234")


@pytest.mark.gpu
async def test_cuda_ipc_in_process_and_forced_shm_with_cuda_weights() -> None:
    params = _params("cuda")
    with pytest.raises(TransportUnavailableError, match="'shm' needs the weights in CPU memory"):
        WeightPublisher(params, WeightPlaneConfig(transport="shm"))
    pub = WeightPublisher(params, WeightPlaneConfig(transport="cuda_ipc"))
    m = pub.publish(params)
    assert (
        m.device_uuid is not None
        and len(m.ipc) == m.num_slots
        and m.shm is not None
        and m.shm.slot_offsets == ()
    )
    for device in ("cuda", "cpu"):
        sub = WeightSubscriber(WeightPlaneConfig(transport="cuda_ipc"), expected=params, device=device)
        pulled = await sub.pull(pub.publish(params))
        assert pulled.transport == "cuda_ipc" and _same(pulled.tensors, params)
        sub.close()
    pub.close()
    assert shm.segment_names(pub.id) == []


SLIM = Path(__file__).parents[2] / "orchestration" / "slim_run.yaml"


@pytest.mark.parametrize(("weights", "line", "error"), [
    ("  require: ibverbs\n", "28:12", "weights.require: 'ibverbs' is not a transport; use one or a list of "
     "['cuda_ipc', 'shm', 'rdma', 'rdma_tcp'] or 'endpoint'"),
    ("  require: [shm, tcp]\n", "28:18", "weights.require[1]: Input should be 'cuda_ipc', 'shm', 'rdma', "
     "'rdma_tcp' or 'endpoint' (got 'tcp')"),
    ("  transport: shm\n  require: [rdma, rdma_tcp]\n", "29:3", "weights.require: ['rdma', 'rdma_tcp'] can never "
     "be met with transport 'shm', which uses one of ['shm']"),
])
def test_validate_refuses_a_require_that_cannot_be_met(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        weights: str, line: str, error: str) -> None:
    from composer_mesh import cli

    path = tmp_path / "run.yaml"
    path.write_text(SLIM.read_text() + "weights:\n" + weights)
    assert cli.main(["validate", str(path)]) == cli.EXIT_INVALID
    assert f"  {path}:{line}: {error}" in capsys.readouterr().err.splitlines()
    path.write_text(SLIM.read_text() + "weights:\n  require: [cuda_ipc, shm, rdma]\n")
    assert cli.main(["validate", str(path)]) == cli.EXIT_OK
