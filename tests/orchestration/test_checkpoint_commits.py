"""Checkpoint commits replayed with fake trainers on a local store: a checkpoint is committed only once every
trainer part is reported written and the step's record is written, and commits happen in step order."""

from __future__ import annotations

import asyncio
from pathlib import Path

from orchestration.fakes import FakeTrainers, FakeWriter
from waiting import eventually

from composer_mesh.orchestration.background import Background
from composer_mesh.orchestration.checkpoint import (
    COMMITTED,
    CheckpointStore,
    ControllerState,
    read_checkpoint,
)
from composer_mesh.orchestration.commits import CheckpointCommits
from composer_mesh.orchestration.schedule import SchedulerState


def state(step: int) -> ControllerState:
    return ControllerState(step=step, weight_version=step + 1, first_version=1, prompts_count=0, prompts_rng=None,
                           schedule=SchedulerState(step, 0, step, 0, 0, []), counters={"eval_before": 0.5},
                           fingerprint={}, replicas=2)


def committed(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob(f"*/{COMMITTED}"))


async def _settle() -> None:
    """Time for a commit that must not happen to show (a commit that must happen is waited for instead)."""
    for _ in range(20):  # the commit task writes in threads: give it a few turns
        await asyncio.sleep(0.02)


async def test_a_checkpoint_commits_only_after_the_trainers_parts_and_the_record(tmp_path: Path) -> None:
    trainers, background, writer = FakeTrainers(replicas=2), Background(), FakeWriter()
    background.open()
    commits = CheckpointCommits(CheckpointStore(str(tmp_path)), keep=2, trainers=trainers, background=background)
    commits.take(state(1), writer)  # type: ignore[arg-type]
    assert trainers.log == [("save", 1)] and len(trainers.saved) == 2
    await _settle()
    assert committed(tmp_path) == [] and commits.last is None  # the controller's part alone
    commits.wrote([trainers.saved[0]])
    commits.recorded(1)
    await _settle()
    assert committed(tmp_path) == []  # replica 1's part is not reported yet
    commits.wrote([trainers.saved[1]])
    await eventually(lambda: commits.last is not None, "step 1 committed")
    assert committed(tmp_path) == ["step-00000001"]
    assert commits.last is not None and commits.last.endswith("step-00000001")
    assert trainers.reported_urls == trainers.saved
    assert writer.events == [("checkpoint", {"step": 1, "url": commits.last, "weight_version": 2})]
    assert read_checkpoint(commits.last).counters == {"eval_before": 0.5}
    await background.close()


async def test_commits_happen_in_step_order(tmp_path: Path) -> None:
    trainers, background, writer = FakeTrainers(replicas=1), Background(), FakeWriter()
    background.open()
    commits = CheckpointCommits(CheckpointStore(str(tmp_path)), keep=5, trainers=trainers, background=background)
    commits.recorded(3)  # steps 2 and 3 are recorded before their checkpoints are taken
    commits.take(state(2), writer)  # type: ignore[arg-type]
    commits.take(state(3), writer)  # type: ignore[arg-type]
    url3 = trainers.saved[1]
    commits.wrote([url3])  # step 3 is complete first ...
    await _settle()
    assert committed(tmp_path) == []  # ... but waits for step 2
    await asyncio.wait_for(commits.finish(), 60)  # flush_states reports step 2's part: both commit, in order
    assert committed(tmp_path) == ["step-00000002", "step-00000003"]
    assert [e[1]["step"] for e in writer.events] == [2, 3] and commits.pending == {}
    await background.close()


async def test_a_resumed_run_reports_its_checkpoint_until_it_commits_one(tmp_path: Path) -> None:
    commits = CheckpointCommits(CheckpointStore(str(tmp_path)), keep=2, trainers=FakeTrainers(), background=Background())
    commits.resumed(4, "file:///ckpt/step-00000004")
    assert commits.last == "file:///ckpt/step-00000004" and commits.recorded_through == 4


async def test_salvage_commits_the_checkpoints_before_a_refused_step_and_not_its_own(tmp_path: Path) -> None:
    """Step 3 was refused by a live trainer while the checkpoints of steps 2 and 3 were being written: `salvage`
    commits step 2 (its state was copied before step 3 ran) and leaves step 3's uncommitted (it would claim a step
    that was not trained). Without it both were abandoned and the run pointed at an older checkpoint."""
    trainers, background, writer = FakeTrainers(replicas=1), Background(), FakeWriter()
    background.open()
    commits = CheckpointCommits(CheckpointStore(str(tmp_path)), keep=5, trainers=trainers, background=background)
    commits.take(state(2), writer)  # type: ignore[arg-type]
    commits.take(state(3), writer)  # type: ignore[arg-type]
    commits.recorded(2)  # the pipeline records the steps before the refused one
    await asyncio.wait_for(commits.salvage(3), 5)  # flush_states reports both parts; only step 2 commits
    await _settle()
    assert committed(tmp_path) == ["step-00000002"]
    assert commits.last is not None and commits.last.endswith("step-00000002") and list(commits.pending) == [3]
    await background.close()
    assert committed(tmp_path) == ["step-00000002"]
