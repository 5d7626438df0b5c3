"""Controller script for the two-node Slurm test: run `slurm_two_nodes.yaml` and write what it saw as JSON.

A fresh interpreter because Monarch's client picks its listening address once per process, at its first use:
a pytest process that already ran another Monarch test listens on localhost, which the Slurm nodes' namespaces
cannot reach, and `COMPOSER_MESH_CONTROLLER_HOST` set afterwards would not move it.

Usage: python two_nodes_main.py RUN_DIR SLURM_LOG_DIR OUT_JSON
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from composer_mesh.app.launch import launch, run_config
from composer_mesh.app.runner import apply_overrides, checkpoint_policy
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.topology import load_topology

HERE = Path(__file__).parent


async def main(run_dir: Path, log_dir: Path, out: Path) -> None:
    path = HERE / "slurm_two_nodes.yaml"
    topo = apply_overrides(load_topology(path), None, run_dir)
    topo._source = path
    seen: dict[str, Any] = {}
    async with launch(topo, log_dir=log_dir) as mesh:
        job_id = mesh.launched.slurm_job_ids["trainer"]
        squeue = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True)
        seen["job_nodes"] = squeue.stdout.strip()
        ranks = list((await mesh.trainer.process.call()).values())
        # Same machine and pid namespace: /proc shows which network namespace each rank is in.
        seen["ranks"] = [{**w, "netns": os.readlink(f"/proc/{w['pid']}/ns/net")} for w in ranks]
        seen["controller_netns"] = os.readlink("/proc/self/ns/net")
        summary = await RLLoop(mesh, run_config(topo), topo.loss, checkpoints=checkpoint_policy(topo)).run()
        seen["steps"] = summary.steps
        seen["trainer_digests"] = sorted((await mesh.trainer.weights_digest.call()).values())
        seen["generator_digests"] = sorted((await mesh.generators.weights_digest.call()).values())
    out.write_text(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
