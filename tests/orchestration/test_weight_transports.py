"""Each generator's weight transport is visible, and `weights.require` refuses the rest, on real parts: the real
`GeneratorActor` (hf binding, tiny model) in its own Monarch proc pulls from a real `WeightPublisher` in the
controller (the trainer's side, `transport: auto`: shared memory and RDMA served), and the controller reports its
answers through a real `MetricsWriter`.

This machine has no ibverbs device, so a generator forced onto `rdma` moves weights over Monarch's TCP fallback:
that must show as transport `rdma_tcp`, one WARNING line, the metric and the event, and a `require` of real RDMA
must stop the pull with one line naming the generator, the transport and why. (On a machine with ibverbs the same
tests expect `rdma` and no fallback.)
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from generator_procs import generators_config, one_proc

from composer_mesh.orchestration import weight_transports

FAULTS: list[Any] = []
_names = (f"gen_transport{i}" for i in itertools.count())


def _generator_config(weights: str) -> Any:
    """The generators' role config of a small topology with `weights: {weights}`, as the launcher hands it over."""
    return generators_config("weight-transport-test", "{mesh: generators, binding: hf, settings: {torch_threads: 1}}",
                             weights)


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    with one_proc("gen_transport", FAULTS) as pm:
        yield pm
    assert FAULTS == []


@pytest.fixture(scope="module")
def publisher(procs: Any) -> Iterator[Any]:
    """The trainer's side in the controller: the tiny model's weights, served over shm and rdma (`auto`)."""
    from composer_mesh.mesh.weights.config import WeightPlaneConfig
    from composer_mesh.mesh.weights.plane import WeightPublisher
    from composer_mesh.models.config import ModelConfig
    from composer_mesh.models.tiny import build_tiny

    weights = {k: v.detach().clone() for k, v in build_tiny(ModelConfig(seed=123))[0].state_dict().items()}
    pub = WeightPublisher(weights, WeightPlaneConfig())
    pub.publish(weights)
    yield pub
    pub.close()


def _tcp_only() -> bool:
    from monarch.rdma import get_rdma_backend

    return bool(get_rdma_backend() != "ibverbs")


async def _generator(procs: Any, weights: str) -> Any:
    from composer_mesh.actors.generator import GeneratorActor

    actor = procs.spawn(next(_names), GeneratorActor, _generator_config(weights))
    await actor.setup.call_one()
    return actor


async def test_a_forced_rdma_generator_reports_the_tcp_fallback_once_and_as_a_metric(
        procs: Any, publisher: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from composer_mesh.orchestration.metrics import MetricsWriter

    actor = await _generator(procs, "{transport: rdma}")
    answer = await actor.update_weights.call_one(publisher.manifest())
    assert answer.version == 1 and answer.generator == "generator0"
    if _tcp_only():
        assert answer.transport == "rdma_tcp" and answer.fallback
        assert answer.reason == ("set by the transport setting; RDMA over Monarch's TCP fallback: no ibverbs device "
                                 "on this host or the publisher's host")
    else:
        assert answer.transport == "rdma" and not answer.fallback

    links = {answer.generator: answer}
    writer = MetricsWriter(tmp_path)
    with caplog.at_level(logging.WARNING, logger="composer_mesh.weights"):
        weight_transports.announce(links, writer)
    writer.close()
    # Monarch's log filter prefixes "[actor=...] " to records logged in an actor context
    warnings = [re.sub(r"^(\[actor=[^]]*\] )*", "", r.getMessage()) for r in caplog.records
                if r.levelno == logging.WARNING]
    event = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert event == {"event": "weight_transports", "generators": {"generator0": {
        "transport": answer.transport, "reason": answer.reason, "fallback": answer.fallback}}}
    metrics = weight_transports.transport_metrics(links)
    if _tcp_only():
        assert warnings == [f"weights arrive over a fallback transport: generator0: rdma_tcp ({answer.reason}). "
                            "Set weights.require (e.g. [cuda_ipc, shm, rdma]) to make this an error"]
        assert metrics == {"weights/transport/generator0": 1.0, "weights/transport_fallbacks": 1.0}
    else:
        assert warnings == [] and metrics == {"weights/transport/generator0": 2.0, "weights/transport_fallbacks": 0.0}


async def test_require_of_real_rdma_stops_the_pull_with_one_line(procs: Any, publisher: Any) -> None:
    from monarch.actor import ActorError

    from composer_mesh.cli import EXIT_RUN_FAILED, failure_of
    from composer_mesh.mesh.weights.errors import TransportRequiredError

    actor = await _generator(procs, "{transport: rdma, require: rdma}")
    if not _tcp_only():  # ibverbs here: what is required is what there is
        assert (await actor.update_weights.call_one(publisher.manifest())).transport == "rdma"
        return
    with pytest.raises(ActorError) as info:
        await actor.update_weights.call_one(publisher.manifest())
    assert isinstance(info.value.exception, TransportRequiredError)
    code, message = failure_of(info.value) or (None, "")
    assert code == EXIT_RUN_FAILED and message == (
        "composer-mesh: run failed: generator0 would receive weights over rdma_tcp (set by the transport setting; "
        "RDMA over Monarch's TCP fallback: no ibverbs device on this host or the publisher's host), which "
        "weights.require ['rdma'] does not allow")
    assert await actor.version.call_one() == 0, "a refused transport must not deliver weights"


async def test_require_of_what_this_host_has_passes_without_a_warning(
        procs: Any, publisher: Any, caplog: pytest.LogCaptureFixture) -> None:
    actor = await _generator(procs, "{require: [cuda_ipc, shm, rdma]}")
    answer = await actor.update_weights.call_one(publisher.manifest())
    assert (answer.version, answer.transport, answer.fallback) == (1, "shm", False)
    assert answer.reason == "auto: on the publisher's host"
    assert await actor.version.call_one() == 1
    links = {answer.generator: answer}
    assert weight_transports.fallback_warning(links) is None
    assert weight_transports.transport_lines(links) == ["generator0: shm (auto: on the publisher's host)"]
    assert weight_transports.transport_metrics(links) == {"weights/transport/generator0": 3.0,
                                                          "weights/transport_fallbacks": 0.0}
