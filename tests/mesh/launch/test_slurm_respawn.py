"""A Slurm mesh whose job ended (a dead node, a cancelled job: `scancel` here) gets a new Slurm job from
`LaunchedMeshes.respawn`: the actors placed on it answer from the new job, the old job is gone, and no job of
the launch outlives it. Its workers listen on a new port (`slurm.replacement_port`: Monarch 0.7 cannot attach to
a new worker at an address its messages once expired at)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from composer_mesh.actors.configs import RoleConfig
from composer_mesh.mesh.launch import ActorPlacement, LaunchedMeshes, launch_meshes
from composer_mesh.mesh.spec import SlurmOptions, mesh_spec
from tests.mesh.launch.probe_actors import ProbeActor
from tests.mesh.launch.test_launch_slurm import (
    _squeue,
    _wait_job_gone,
    slurm_cluster,  # noqa: F401  (the module's cluster fixture)
)

pytestmark = pytest.mark.slurm

# A port no other test of the tier uses: Monarch 0.7's client cannot reach a worker again at an address whose
# messages expired earlier in the process (the replacements take the next ports up).
PORT = 22260
MESHES = {
    "gpu": mesh_spec(
        backend="slurm",
        slurm=SlurmOptions(start_timeout=120, exclusive=False, monarch_port=PORT, time_limit="00:10:00"),
    )
}
POLL_S = 2.0  # watch_jobs' polling in part 2: long enough for respawn to submit between two polls
PROBE_ON_GPU = [ActorPlacement("probe", "gpu", ProbeActor, (RoleConfig(role="trainer", mesh="gpu"),))]


async def _probe(launched: LaunchedMeshes) -> dict[str, Any]:
    result: dict[str, Any] = await asyncio.wait_for(launched.actors["probe"].where.call_one(), 60)
    return result


async def _pending(task: asyncio.Task[Any], seconds: float) -> bool:
    await asyncio.sleep(seconds)
    return not task.done()


async def _replaced(launched: LaunchedMeshes, old: str) -> tuple[str, dict[str, Any]]:
    """Respawn the mesh whose job `old` ended: a new job, and the probe answering from it."""
    assert await launched.respawn("gpu") == (["probe"], False)
    new = launched.slurm_job_ids["gpu"]
    assert new != old and _squeue(new).split()[0] == "R"
    where = await _probe(launched)
    assert where["slurm_job_id"] == new
    assert _wait_job_gone(old) == "", "the ended job is still listed"
    return new, where


def _jobs_named(part: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if part in line]


async def test_a_slurm_mesh_whose_job_ended_is_respawned_on_a_new_job(
    slurm_cluster: None, tmp_path: Path  # noqa: F811
) -> None:
    start = time.monotonic()
    async with launch_meshes(MESHES, PROBE_ON_GPU, run_name="respawn", log_dir=tmp_path) as launched:
        first = launched.slurm_job_ids["gpu"]
        assert (await _probe(launched))["slurm_job_id"] == first

        # 1. watch_jobs sees the job end (the mesh is marked ended), then respawn submits a new job.
        watch = asyncio.create_task(launched.watch_jobs(poll_s=0.2))
        subprocess.run(["scancel", first], check=True)
        notice = await asyncio.wait_for(watch, 30)
        assert (notice.kind, notice.job_id) == ("ended", first)
        second, where = await _replaced(launched, first)
        assert where["rank"] == {"hosts": 0, "procs": 0}
        script = subprocess.run(["scontrol", "write", "batch_script", second, "-"], capture_output=True, text=True,
                                check=True).stdout
        assert f"tcp://{{socket.gethostname()}}:{PORT + 1}" in script  # its worker on the next port
        assert "#SBATCH --signal=USR1@120" in script.splitlines()  # the mesh's job options, as at launch

        # 2. Respawn before any notice (as after a call failed with the proc's death; Monarch 0.7 reports that
        #    only ~60 s after the job's end): respawn asks squeue itself. A watch running across the replacement
        #    follows the mesh to its new job instead of reporting the replaced one.
        watch = asyncio.create_task(launched.watch_jobs(poll_s=POLL_S))
        await asyncio.sleep(0.5)  # its first poll: job `second` runs
        subprocess.run(["scancel", second], check=True)
        third, _ = await _replaced(launched, second)  # submits within ~0.2 s, before the watch polls again
        assert await _pending(watch, POLL_S + 0.5), f"the watch reported the replaced job: {watch.result()}"
        watch.cancel()
        assert launched.respawns == {"gpu": 2}
        assert not launched.failures  # the ended jobs' proc deaths were recovered, not failures
    assert _wait_job_gone(third) == "", "the replacement job outlived the launch"
    assert _jobs_named("respawn_gpu") == [], "a job of the launch is still listed"
    assert time.monotonic() - start < 60
