"""`composer-mesh run` shows how weights reach the generators, end to end on real local meshes
(tests/orchestration/slim_run.yaml): forced onto `rdma` on this machine (no ibverbs device) the run trains, every
step's record carries `weights/transport/generator0` = 1 (`rdma_tcp`), metrics.jsonl has the
`weight_transports` event, one WARNING line says so and the summary has a "weight transport" row; with
`weights.require: rdma` the run stops at start, before any step, with one line. The pieces are tested fast in
tests/orchestration/test_weight_transports.py; this is the wiring through the loop, the recorder and the CLI."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from composer_mesh import cli

SLIM = Path(__file__).parents[1] / "orchestration" / "slim_run.yaml"


def _tcp_only() -> bool:
    from monarch.rdma import get_rdma_backend

    return bool(get_rdma_backend() != "ibverbs")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a real run of one step: 40-70 s on the shared 2-core machine
def test_a_tcp_fallback_run_says_so_in_metrics_log_and_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    if not _tcp_only():
        pytest.skip("this host has ibverbs: no fallback to report")  # not in CI: its machines have none
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="composer_mesh.weights"):
        code = cli.main(["run", str(SLIM), "--run-dir", str(run_dir), "--steps", "1", "--set",
                         "weights.transport=rdma"])
    assert code == cli.EXIT_OK
    written = rows(run_dir)
    [event] = [r for r in written if r.get("event") == "weight_transports"]
    assert event["generators"]["generator0"]["transport"] == "rdma_tcp"
    [step] = [r for r in written if "event" not in r]
    assert step["metrics"]["weights/transport/generator0"] == 1.0
    assert step["metrics"]["weights/transport_fallbacks"] == 1.0
    warnings = [r.getMessage() for r in caplog.records if r.name == "composer_mesh.weights"]
    assert len(warnings) == 1 and "generator0: rdma_tcp (" in warnings[0], warnings
    out = capsys.readouterr().out
    assert "weight transport" in out and "rdma_tcp" in out


@pytest.mark.slow  # launches every mesh and builds the models before the refusal: 25-50 s
def test_require_stops_the_run_before_any_step_with_one_line(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    if not _tcp_only():
        pytest.skip("this host has ibverbs: rdma is what there is")  # not in CI: its machines have none
    run_dir = tmp_path / "run"
    code = cli.main(["run", str(SLIM), "--run-dir", str(run_dir), "--set", "weights.transport=rdma",
                     "--set", "weights.require=rdma"])
    assert code == cli.EXIT_RUN_FAILED
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "composer-mesh: run failed: generator0 would receive weights over rdma_tcp (set by the transport setting; "
        "RDMA over Monarch's TCP fallback: no ibverbs device on this host or the publisher's host), which "
        "weights.require ['rdma'] does not allow"], err
    assert not [r for r in rows(run_dir) if "event" not in r]
