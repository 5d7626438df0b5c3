"""Two trainer replicas (real TrainerActor, real torchft DiLoCo) train through the built-in loop and sync
through a file:// object store; after each outer sync they hold bitwise identical weights."""

from __future__ import annotations

import json
from pathlib import Path

from composer_mesh.app.launch import launch
from composer_mesh.app.runner import apply_overrides
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.topology import load_topology

TOPOLOGY = Path(__file__).with_name("diloco_run.yaml")


async def test_two_replicas_sync_through_the_store(tmp_path):
    topo = apply_overrides(load_topology(TOPOLOGY), None, tmp_path / "run")
    diloco = topo.diloco.model_copy(update={"store_uri": f"file://{tmp_path / 'store'}"})
    topo = topo.model_copy(update={"diloco": diloco})
    async with launch(topo) as mesh:
        loop = RLLoop(mesh, topo.run, topo.loss)
        assert len(loop.trainers) == 2
        summary = await loop.run()
        digests = [await t.weights_digest.call_one() for t in loop.trainers.handles]
    assert summary.steps == 4
    # 4 inner steps with sync_every=2: two outer rounds, and after the last one both replicas hold the global weights.
    assert digests[0] == digests[1]
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    outer = [r["metrics"]["diloco/outer_step"] for r in steps if "event" not in r]
    assert outer == [0.0, 1.0, 1.0, 2.0]
    assert any((tmp_path / "store").rglob("*.safetensors"))  # shards really went through the store
