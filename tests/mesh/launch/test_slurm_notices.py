"""Slurm job notices without Slurm daemons: the `warning_s` option, squeue states of both JSON layouts,
the watcher's polling rules, the `slurm_worker` wrapper, and `watch_jobs` on a launch with no Slurm mesh.

The real-daemon versions (a warning delivered by Slurm, a cancelled and a timed-out job) are in
test_launch_slurm.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from waiting import wait_until

from composer_mesh.actors.configs import RoleConfig
from composer_mesh.mesh.jobs import slurm_compat as slurm
from composer_mesh.mesh.jobs.base import JobNotice
from composer_mesh.mesh.jobs.slurm_compat import JobWatch, job_end_notice, select_squeue_job, warning_notice
from composer_mesh.mesh.launch import ActorPlacement, launch_meshes
from composer_mesh.mesh.slurm_worker import notice_path
from composer_mesh.mesh.spec import SlurmOptions, mesh_spec, slurm_time_seconds
from tests.mesh.launch.probe_actors import ProbeActor
from tests.mesh.launch.proc_utils import alive
from tests.mesh.launch.slurm_utils import ignores_usr1

# --- the option -------------------------------------------------------------------------------------


def test_slurm_time_limits_in_seconds() -> None:
    forms = {"90": 5400, "5:30": 330, "01:00:00": 3600, "2-0": 172800, "1-02:03": 93780, "1-00:00:05": 86405}
    assert {t: slurm_time_seconds(t) for t in forms} == forms
    assert slurm_time_seconds("UNLIMITED") is None and slurm_time_seconds(None) is None


def test_warning_s_defaults_to_120_and_becomes_sbatch_signal() -> None:
    assert SlurmOptions().warning_s == 120
    assert slurm.warning_args(120) == ("--signal=USR1@120",)
    assert slurm.warning_args(None) == ()
    assert SlurmOptions(time_limit="1", warning_s=30).warning_s == 30
    assert SlurmOptions(warning_s=None, extra_args=["--signal=B:USR2@60"]).warning_s is None


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"time_limit": "00:02:00"}, r"warning_s=120 is not below time_limit '00:02:00' \(120 s\)"),
        ({"extra_args": ["--signal=USR2@60"]}, "extra_args has a --signal option"),
        ({"warning_s": 0}, "greater than or equal to 1"),
        ({"warning_s": 70000}, "less than or equal to 65535"),
    ],
)
def test_warning_s_is_validated(options: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        SlurmOptions(**options)


def test_worker_python_runs_the_wrapper_shell_quoted() -> None:
    cmd = slurm.worker_python("/shared/my logs")
    assert cmd.endswith("-m composer_mesh.mesh.slurm_worker --notice-dir '/shared/my logs'")
    assert cmd.startswith(sys.executable)


# --- squeue states: Slurm 22.05 (openapi v0.0.38, as captured here) and >= 23.11 --------------------

END = 1795446733
SQUEUE_2205 = {  # trimmed `squeue --json` of Debian 12's Slurm 22.05.8 (it lists every job)
    "meta": {"plugin": {"type": "openapi/v0.0.38"}, "Slurm": {"release": "22.05.8"}},
    "jobs": [
        {"job_id": 1, "job_state": "RUNNING", "state_reason": "None", "end_time": END, "job_resources": {}},
        {"job_id": 2, "job_state": "TIMEOUT", "state_reason": "TimeLimit", "end_time": END, "job_resources": {}},
        {"job_id": 3, "job_state": "CANCELLED", "state_reason": "None", "end_time": END, "job_resources": {}},
        {"job_id": 4, "job_state": "COMPLETING", "state_reason": "None", "end_time": END, "job_resources": {}},
        {"job_id": 5, "job_state": "PREEMPTED", "state_reason": "None", "end_time": END, "job_resources": {}},
    ],
}


def _set(n: int) -> dict[str, Any]:
    return {"set": True, "infinite": False, "number": n}


SQUEUE_2411 = {  # Slurm >= 23.11 (openapi v0.0.40+): state flag lists, times as {set, infinite, number}
    "jobs": [
        {"job_id": 11, "job_state": ["RUNNING"], "state_reason": "None", "end_time": _set(END)},
        {"job_id": 12, "job_state": ["TIMEOUT", "COMPLETING"], "state_reason": "TimeLimit", "end_time": _set(END)},
        {"job_id": 13, "job_state": ["CANCELLED"], "state_reason": "None", "end_time": _set(END)},
        {"job_id": 14, "job_state": ["PREEMPTED"], "state_reason": "None", "end_time": _set(END)},
        {"job_id": 15, "job_state": ["PENDING", "REQUEUED"], "state_reason": "BeginTime", "end_time": _set(0)},
        {"job_id": 16, "job_state": ["RUNNING"], "end_time": {"set": False, "infinite": True, "number": 0}},
    ]
}


def _kind(data: dict[str, Any], job_id: str) -> str | None:
    notice = job_end_notice("gpu", job_id, select_squeue_job(data, job_id))
    return None if notice is None else notice.kind


def test_squeue_states_of_both_layouts_become_notices() -> None:
    kinds_2205 = {j: _kind(SQUEUE_2205, j) for j in ("1", "2", "3", "4", "5", "6")}
    assert kinds_2205 == {"1": None, "2": "timeout", "3": "ended", "4": "ended", "5": "preempted", "6": "ended"}
    kinds_2411 = {j: _kind(SQUEUE_2411, j) for j in ("11", "12", "13", "14", "15", "16")}
    assert kinds_2411 == {"11": None, "12": "timeout", "13": "ended", "14": "preempted", "15": "ended", "16": None}
    timeout = job_end_notice("gpu", "2", select_squeue_job(SQUEUE_2205, "2"))
    assert timeout is not None
    assert timeout.message() == "Slurm job 2 of mesh 'gpu' reached its time limit (state TIMEOUT, reason TimeLimit)"
    requeued = job_end_notice("gpu", "15", select_squeue_job(SQUEUE_2411, "15"))
    assert requeued is not None and requeued.detail == "stopped running (state PENDING+REQUEUED, reason BeginTime)"


def test_warning_notice_says_how_long_is_left_in_both_layouts() -> None:
    now = time.time()
    for job in ({"end_time": int(now) + 95}, {"end_time": _set(int(now) + 95)}):
        notice = warning_notice("gpu", "7", job, 120)
        assert notice.message() in {
            f"Slurm job 7 of mesh 'gpu' will reach its time limit in ~{s} s (SIGUSR1 from --signal)" for s in (94, 95)
        }
    unlimited = warning_notice("gpu", "7", {"end_time": {"set": False, "infinite": True, "number": 0}}, None)
    assert unlimited.detail == "got Slurm's warning signal (SIGUSR1 e.g. from scancel --signal)"


# --- the watcher's rules -----------------------------------------------------------------------------


def _fake_squeue(monkeypatch: pytest.MonkeyPatch, states: dict[str, list[Any]]) -> None:
    """`query_job` answering from `states` (job id -> successive answers; an exception is raised)."""

    def query(job_id: str) -> dict[str, Any] | None:
        answer = states[job_id].pop(0) if len(states[job_id]) > 1 else states[job_id][0]
        if isinstance(answer, Exception):
            raise answer
        return None if answer is None else {"job_state": [answer], "end_time": 0}

    monkeypatch.setattr(slurm, "query_job", query)


async def test_watch_returns_each_warning_once_and_waits_out_completing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    error = slurm.SlurmQueryError("slurmctld down")
    _fake_squeue(monkeypatch, {"1": [error, "RUNNING"], "2": ["RUNNING", "COMPLETING", "CANCELLED"]})
    watch = JobWatch({"a": "1", "b": "2"}, str(tmp_path), {"a": 120, "b": None}, warned=set())
    Path(notice_path(str(tmp_path), "1")).write_text("{}")
    completing: dict[str, float] = {}
    assert watch.poll(completing) is None  # squeue failed for 1 (not an end), 2 runs
    notice = await watch.next_notice(poll_s=0.01)
    assert (notice.mesh, notice.kind) == ("a", "warning") and watch.warned == {"1"}
    assert watch.poll(completing) is None  # 2 is COMPLETING: its final state is not known yet
    assert completing.keys() == {"2"}
    notice = await watch.next_notice(poll_s=0.01)
    assert (notice.mesh, notice.kind, notice.detail) == ("b", "ended", "stopped running (state CANCELLED)")


async def test_completing_for_too_long_is_an_end(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_squeue(monkeypatch, {"1": ["COMPLETING"]})
    watch = JobWatch({"a": "1"}, str(tmp_path), {"a": 120}, warned=set())
    notice = watch.poll({"1": time.monotonic() - slurm.COMPLETING_GRACE_S})
    assert notice == JobNotice("a", "1", "ended", "stopped running (state COMPLETING)")


async def test_watch_is_cancelled_at_once_while_squeue_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asked, answer = threading.Event(), threading.Event()

    def squeue(job_id: str) -> None:  # a slurmctld that answers only once the test is over
        asked.set()
        answer.wait(120)

    monkeypatch.setattr(slurm, "query_job", squeue)
    task = asyncio.create_task(JobWatch({"a": "1"}, str(tmp_path), {}, set()).next_notice(poll_s=0.01))
    try:
        assert await asyncio.to_thread(asked.wait, 60), "the watch never ran squeue"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):  # a watch that waited for squeue would time out here
            await asyncio.wait_for(task, 30)
    finally:
        answer.set()


def test_submit_removes_a_stale_warning_of_the_same_job_id(tmp_path: Path) -> None:
    class Job:
        _slurm_job_id = "42"

        def apply(self) -> None:
            pass

    stale = Path(notice_path(str(tmp_path), "42"))
    stale.write_text("{}")  # left by an earlier job 42 of a cluster whose state was wiped
    job = Job()
    try:
        slurm.submit({"gpu": job}, str(tmp_path))
    finally:
        slurm.unregister_atexit(job)
    assert not stale.exists()


# --- the wrapper Slurm runs: python -m composer_mesh.mesh.slurm_worker --notice-dir DIR -c CODE ---------

SPAWNS_A_CHILD = (
    "import os, subprocess, sys, time; "
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print(os.getpid(), p.pid, sys.argv[1:], flush=True); time.sleep(60)"
)


def _wrapper(tmp_path: Path, code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "composer_mesh.mesh.slurm_worker", "--notice-dir", str(tmp_path), "-c", code, *args],
        env={**os.environ, "SLURM_JOB_ID": "77", "SLURM_NODEID": "0"},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, like a job step's processes
    )


def test_wrapper_records_the_warning_and_its_tree_survives_it(tmp_path: Path) -> None:
    proc = _wrapper(tmp_path, SPAWNS_A_CHILD, "x")
    try:
        assert proc.stdout is not None
        worker, grandchild, argv = proc.stdout.readline().split(maxsplit=2)
        assert argv.strip() == "['x']"  # CODE's arguments pass through, as with python -c
        assert ignores_usr1(int(worker)) and ignores_usr1(int(grandchild)) and not ignores_usr1(proc.pid)
        os.killpg(proc.pid, signal.SIGUSR1)  # slurmstepd signals every process of the step
        path = Path(notice_path(str(tmp_path), "77"))
        wait_until(path.exists, "the SIGUSR1 notice file")
        record = json.loads(path.read_text())
        assert (record["signal"], record["node_id"]) == ("SIGUSR1", "0")
        assert proc.poll() is None and alive(int(worker)) and alive(int(grandchild))
        os.killpg(proc.pid, signal.SIGTERM)  # scancel
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_wrapper_exits_with_the_workers_status(tmp_path: Path) -> None:
    proc = _wrapper(tmp_path, "import sys; sys.exit(3)")
    assert proc.wait(30) == 3
    assert not Path(notice_path(str(tmp_path), "77")).exists()


# --- a launch without Slurm meshes -------------------------------------------------------------------


async def test_watch_jobs_without_slurm_meshes_waits_until_cancelled() -> None:
    placements = [ActorPlacement("probe", "cpu", ProbeActor, (RoleConfig(role="trainer", mesh="cpu"),))]
    async with launch_meshes({"cpu": mesh_spec(backend="local")}, placements, run_name="nowatch") as launched:
        watch = asyncio.create_task(launched.watch_jobs(poll_s=0.01))
        await asyncio.sleep(0.5)
        assert not watch.done()
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(watch, 30)
        assert (await launched.actors["probe"].where.call_one())["mesh"] == "cpu"
