"""Through the topology launcher: two trainer replicas (separate procs of the trainer mesh) sync via the store."""

from __future__ import annotations

import pytest

from composer_mesh.app.launch import launch
from composer_mesh.topology import load_topology
from mesh.objectstore.mesh_actor import DiLoCoTrainerProbe

TOPOLOGY = """
name: diloco_launch
loss: {{alpha_sdpo: 0.0, beta_replay: 0.0}}
meshes:
  learner: {{backend: local, procs_per_host: 2}}
  solo: {{backend: local}}
roles:
  trainer: {{mesh: learner, binding: "tests.mesh.launch.probe_actors:ProbeBinding", replicas: 2}}
  generators: {{mesh: solo, binding: "tests.mesh.launch.probe_actors:ProbeBinding"}}
  rewarder: {{mesh: solo, binding: "tests.mesh.launch.probe_actors:ProbeBinding"}}
diloco: {{store_uri: "file://{store}", run_id: launch-test, replicas: 2, sync_every: 2, quorum_deadline_s: 30}}
"""


@pytest.mark.slow
async def test_two_trainer_replicas_sync_through_the_store(tmp_path):
    from tests.mesh.launch.probe_actors import ProbeActor

    path = tmp_path / "topology.yaml"
    path.write_text(TOPOLOGY.format(store=tmp_path / "store"))
    topo = load_topology(path)
    assert topo.diloco is not None and topo.trainer.replicas == 2
    actors = {"trainer": DiLoCoTrainerProbe, "generators": ProbeActor, "rewarder": ProbeActor}
    async with launch(topo, actors=actors) as mesh:
        results = sorted((await mesh.trainer.train.call(3)).values(), key=lambda r: r["replica"])
        mesh.check()
    assert [r["replica"] for r in results] == [0, 1]
    assert results[0]["pid"] != results[1]["pid"]
    assert all(r["outer_step"] == 3 and all(r["committed"]) for r in results)
    assert all(m == [0, 1] for r in results for m in r["members"])
    assert results[0]["digest"] == results[1]["digest"]
