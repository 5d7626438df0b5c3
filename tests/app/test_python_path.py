"""`python_path:` reaches every proc of a run: the directories a topology lists (relative to its file) are on
`sys.path` in the controller and, through PYTHONPATH in each proc's bootstrap environment, in every actor's
proc, so your own modules import on both sides. A real launch of probe actors on local meshes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from composer_mesh.app.launch import launch
from composer_mesh.roles import ROLES
from tests.mesh.launch.probe_actors import ProbeActor

PROBE = "tests.mesh.launch.probe_actors:ProbeBinding"
TOPOLOGY = f"""\
name: probe_python_path
python_path: [mine]
loss: {{alpha_sdpo: 0.0}}
meshes:
  learner: {{backend: local}}
  rollout: {{backend: local, env: {{PYTHONPATH: /from/the/mesh}}}}
roles:
  trainer: {{mesh: learner, binding: "{PROBE}"}}
  generators: {{mesh: rollout, binding: "{PROBE}"}}
  rewarder: {{mesh: learner, binding: "{PROBE}"}}
  teachers:
    mesh: learner
    members: [{{name: t0, binding: "{PROBE}", channels: [replay]}}]
"""


async def test_python_path_is_on_every_procs_sys_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    mine = tmp_path / "mine"
    mine.mkdir()
    path = tmp_path / "t.yaml"
    path.write_text(TOPOLOGY)
    async with launch(path, actors=dict.fromkeys(ROLES, ProbeActor)) as mesh:
        trainer = list((await mesh.trainer.where.call()).values())
        generators = list((await mesh.generators.where.call()).values())
    assert sys.path[0] == str(mine)
    assert trainer and all(str(mine) in w["sys_path"] for w in trainer)
    # a mesh's own PYTHONPATH comes first, the controller's (with python_path) after it
    assert generators and all(w["sys_path"].index("/from/the/mesh") < w["sys_path"].index(str(mine))
                              for w in generators)
