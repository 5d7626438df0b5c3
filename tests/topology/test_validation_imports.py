"""Validating a topology imports neither torch nor Monarch (nor transformers, vllm): built-in bindings are named by
import path and their settings come from import-cheap config modules (`actors/backends/<role>/config.py`).

Each file is validated in one fresh interpreter (this test process has imported torch long ago), and the heavy
modules are looked for in `sys.modules` after each file, so a failure names the file that pulled one in. Files
that do not validate here (a missing optional package, a model directory that does not exist, the deliberately
broken one) still count: validation ran on them up to its errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
HEAVY = ("torch", "monarch", "transformers", "vllm")
FILES = sorted((ROOT / "topologies").glob("*.yaml")) + sorted((HERE / "valid").glob("*.yaml"))

_PROBE = """
import json, sys
from composer_mesh.topology import TopologyError, load_topology
heavy, seen = %r, {}
for path in sys.argv[1:]:
    try:
        load_topology(path)
        outcome = "valid"
    except TopologyError as e:
        outcome = f"{len(e.errors)} error(s)"
    seen[path] = (outcome, [m for m in heavy if m in sys.modules])
print(json.dumps(seen))
"""


def _validate_in_fresh_interpreter(files: list[Path]) -> dict[str, tuple[str, list[str]]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    out = subprocess.run(
        [sys.executable, "-c", _PROBE % (HEAVY,), *map(str, files)],
        capture_output=True, text=True, check=True, env=env, cwd=ROOT, timeout=120,
    )
    return {k: tuple(v) for k, v in json.loads(out.stdout.splitlines()[-1]).items()}  # type: ignore[misc]


def test_validating_every_shipped_topology_imports_no_heavy_module() -> None:
    assert len(FILES) >= 10 and any(f.name == "local.yaml" for f in FILES)
    seen = _validate_in_fresh_interpreter(FILES)
    assert set(seen) == {str(f) for f in FILES}
    pulled = {Path(path).name: modules for path, (_, modules) in seen.items() if modules}
    assert pulled == {}, f"validation imported {pulled}"
    assert seen[str(ROOT / "topologies" / "local.yaml")][0] == "valid"  # not cheap by failing early


def test_the_probe_sees_a_heavy_import(tmp_path: Path) -> None:
    """The check can fail: a binding named by import path is imported to read its settings, and this one's
    module (the hf trainer's, named by path instead of by its built-in name) imports torch."""
    text = (HERE / "valid" / "minimal.yaml").read_text()
    assert "topology.fake_bindings:Trainer" in text
    heavy = tmp_path / "heavy.yaml"
    heavy.write_text(text.replace("topology.fake_bindings:Trainer",
                                  "composer_mesh.actors.backends.trainer.hf_trainer:HFTrainer"))
    outcome, modules = _validate_in_fresh_interpreter([heavy])[str(heavy)]
    assert outcome == "valid" and "torch" in modules
