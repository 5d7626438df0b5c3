"""Warm-start progress beside the model cache (`models.build_progress`), and the controller's status line of it
(`app.build_status`): a first run says what its actors are building instead of nothing for minutes."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from composer_mesh.app.build_status import show_builds
from composer_mesh.models.build_progress import (
    STALE_S,
    BuildProgress,
    builds_in_progress,
    describe,
    progress_path,
)
from composer_mesh.models.config import ModelConfig
from composer_mesh.models.loading import materialize


def test_the_builder_writes_throttled_records_and_removes_them_when_done(tmp_path):
    path = progress_path(tmp_path, "tiny-abc")
    progress = BuildProgress(path, "tiny-abc", steps=100, every_s=3600.0)
    progress(1, 2.5)
    progress(2, 2.4)  # within every_s of the last write: not written
    assert json.loads(path.read_text())["step"] == 1
    progress(100, 0.3)  # the last step is always written
    record = json.loads(path.read_text())
    assert (record["model"], record["step"], record["steps"], record["loss"]) == ("tiny-abc", 100, 100, 0.3)
    assert [p.name for p in tmp_path.iterdir()] == [".tiny-abc.progress.json"]  # no temporary file left
    progress.close()
    assert not path.exists()
    progress.close()  # twice is fine (the builder's finally)


def test_only_fresh_well_formed_records_are_read(tmp_path):
    now = time.time()
    BuildProgress(progress_path(tmp_path, "tiny-b"), "tiny-b", 1200)(360, 1.0)
    BuildProgress(progress_path(tmp_path, "tiny-a"), "tiny-a", 1200)(1199, 1.0)
    progress_path(tmp_path, "tiny-dead").write_text(json.dumps(
        {"model": "tiny-dead", "step": 5, "steps": 10, "updated": now - STALE_S - 1}))  # its builder died
    progress_path(tmp_path, "tiny-torn").write_text('{"model": "tiny-torn", "st')
    progress_path(tmp_path, "tiny-typed").write_text(json.dumps(
        {"model": "tiny-typed", "step": "5", "steps": 10, "updated": now}))
    builds = builds_in_progress([tmp_path, tmp_path, tmp_path / "missing"])
    assert [b["model"] for b in builds] == ["tiny-a", "tiny-b"]
    assert describe(builds) == "warm-starting tiny-a 90% of 1200 steps, tiny-b 30% of 1200 steps"
    assert describe([]) == ""


def test_materialize_reports_a_warm_start_while_it_trains_and_cleans_up(tmp_path):
    config = ModelConfig(seed=7, warmstart={"steps": 60})  # a key no other test builds
    seen: list[dict] = []
    builder = threading.Thread(target=materialize, args=(config, tmp_path))
    builder.start()
    while builder.is_alive():
        seen += builds_in_progress([tmp_path])
        time.sleep(0.005)
    builder.join()
    assert seen, "no progress record was seen while the model was warm-started"
    assert {b["steps"] for b in seen} == {60} and all(1 <= b["step"] <= 60 for b in seen)
    assert seen[0]["model"].startswith("tiny-") and (tmp_path / seen[0]["model"]).is_dir()
    assert builds_in_progress([tmp_path]) == [] and not list(tmp_path.glob(".*.progress.json"))


def test_the_status_line_follows_the_builds_in_tenths(tmp_path: Path):
    statuses: list[str] = []
    progress = BuildProgress(progress_path(tmp_path, "tiny-x"), "tiny-x", 100, every_s=0.0)

    async def scenario() -> None:
        task = asyncio.create_task(show_builds(statuses.append, [tmp_path], every_s=0.01))
        for step in (1, 5, 12, 19, 20):
            progress(step, 1.0)
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert statuses == [f"setting up actors: warm-starting tiny-x {p}% of 100 steps…" for p in (0, 10, 20)]
