"""How `composer-mesh run` turns signals and Slurm notices into a checkpointed stop (the loop's side is
tests/orchestration/test_resume.py, the real SIGTERM is tests/test_cli_resume.py, the real Slurm notices
tests/mesh/launch/test_launch_slurm.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from rich.console import Console
from waiting import eventually

from composer_mesh.app.runner import StopRequests
from composer_mesh.mesh.jobs import JobNotice


class RecordingLoop:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def request_stop(self, reason: str) -> None:
        self.reasons.append(reason)


async def test_first_signal_asks_for_a_checkpointed_stop_the_second_cancels():
    async def session() -> None:
        stops = StopRequests(Console(quiet=True))
        loop = RecordingLoop()
        stops.loop = loop  # type: ignore[assignment]
        stops.stop("SIGTERM", "SIGTERM received")
        assert loop.reasons == ["SIGTERM received"] and stops.cause == "SIGTERM"
        await asyncio.sleep(0)  # still running: the loop decides when to stop
        stops.stop("SIGINT", "SIGINT received")  # the second one: at once
        assert stops.cause == "SIGTERM"  # what stopped the run first
        await asyncio.sleep(10)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(session())


async def test_a_signal_before_the_loop_runs_cancels_at_once():
    async def session() -> None:
        stops = StopRequests(Console(quiet=True))
        stops.stop("SIGINT", "SIGINT received")
        assert stops.cause == "SIGINT"
        await asyncio.sleep(10)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(session())


async def test_a_slurm_notice_stops_the_run_with_its_message():
    notice = JobNotice("trainer", "42", "warning", "will reach its time limit in ~120 s (SIGUSR1 from --signal)")

    async def watch_jobs(poll_s: float = 5.0) -> JobNotice:
        await asyncio.sleep(0.01)
        return notice

    stops = StopRequests(Console(quiet=True))
    loop = RecordingLoop()
    stops.loop = loop  # type: ignore[assignment]
    mesh = SimpleNamespace(launched=SimpleNamespace(watch_jobs=watch_jobs))
    await asyncio.wait_for(stops.watch_jobs(mesh), 5)  # type: ignore[arg-type]
    assert stops.cause == "slurm"
    assert loop.reasons == ["Slurm job 42 of mesh 'trainer' will reach its time limit in ~120 s (SIGUSR1 from --signal)"]


class ReplacingLoop(RecordingLoop):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.replaced: list[str] = []
        self.recovery = self
        self.fail = fail

    async def replace_mesh(self, mesh: str, why: str) -> None:
        from composer_mesh.orchestration.recovery import RestartsExhausted

        if self.fail:
            raise RestartsExhausted(f"generators died again after 3 restart(s) (run.max_restarts=3): {why}")
        self.replaced.append(mesh)


def _watching(notices: list[JobNotice]) -> SimpleNamespace:
    async def watch_jobs(poll_s: float = 5.0) -> JobNotice:
        await asyncio.sleep(0.01)
        return notices.pop(0) if notices else await asyncio.Event().wait()  # type: ignore[func-returns-value]

    roles = {"gen": ["generators"], "train": ["trainer"]}
    return SimpleNamespace(launched=SimpleNamespace(watch_jobs=watch_jobs), roles_on=lambda m: roles[m])


async def test_an_ended_job_of_another_mesh_gets_a_new_job_and_the_run_goes_on():
    stops = StopRequests(Console(quiet=True))
    loop = ReplacingLoop()
    stops.loop = loop  # type: ignore[assignment]
    mesh = _watching([JobNotice("gen", "7", "ended", "stopped running (state NODE_FAIL)")])
    watcher = asyncio.create_task(stops.watch_jobs(mesh))  # type: ignore[arg-type]
    await eventually(lambda: loop.replaced, "the ended job's mesh replaced")
    assert loop.replaced == ["gen"] and loop.reasons == [] and stops.cause is None and not watcher.done()
    watcher.cancel()


@pytest.mark.parametrize("notice, fail, reason", [
    (JobNotice("train", "8", "ended", "stopped running (state NODE_FAIL)"), False, "Slurm job 8 of mesh 'train'"),
    (JobNotice("gen", "7", "ended", "stopped running (state NODE_FAIL)"), True, "generators died again"),
    (JobNotice("gen", "7", "preempted", "was preempted"), False, "Slurm job 7 of mesh 'gen' was preempted"),
])
async def test_the_trainers_job_a_preemption_or_too_many_replacements_stop_the_run(notice, fail, reason):
    stops = StopRequests(Console(quiet=True))
    loop = ReplacingLoop(fail=fail)
    stops.loop = loop  # type: ignore[assignment]
    await asyncio.wait_for(stops.watch_jobs(_watching([notice])), 5)  # type: ignore[arg-type]
    assert stops.cause == "slurm" and len(loop.reasons) == 1 and reason in loop.reasons[0] and not loop.replaced
