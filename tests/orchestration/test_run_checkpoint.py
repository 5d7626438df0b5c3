"""Run checkpoints without actors: the controller state round trip, commit and retention, refusals, resume of
the metrics file and of the scheduler."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from composer_mesh.actors.messages import (
    Prompt,
    RewardResult,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TeacherTrace,
)
from composer_mesh.actors.messages import TokenDistribution as Dist
from composer_mesh.orchestration.checkpoint import (
    COMMITTED,
    CheckpointPolicy,
    CheckpointStore,
    ControllerState,
    RunCheckpointError,
    check_fingerprint,
    decode,
    differences,
    encode,
    find_checkpoint,
    read_checkpoint,
    restore_rng,
)
from composer_mesh.orchestration.metrics import MetricsWriter, StepRecord
from composer_mesh.orchestration.schedule import GroupResult
from tests.orchestration.test_schedule import make, pending_chunk, results, stream


def group_result(index: int) -> GroupResult:
    prompt = Prompt(f"p{index}", "1+2=", [5, 6], answer="3")
    rollouts = [Rollout(f"p{index}", [5, 6], [7, 8], [-0.25, -1.5e-9], 3, text="3", generator="g0",
                        token_versions=[3, 4]) for _ in range(2)]
    dists = [Dist("t", topk_ids=torch.tensor([[1, 2], [3, 4]]), topk_logprobs=torch.tensor([[-0.1, -2.3], [-0.7, -0.7]])),
             Dist("t", logits=torch.randn(2, 9, dtype=torch.float64))]
    trace = TeacherTrace("t", f"p{index}", "3", [7], reward=1.0)
    scored = ScoredGroup(RolloutGroup(prompt, rollouts), [RewardResult(1.0, components={"exact": 1.0}),
                                                           RewardResult(0.0, ok=False, error="timeout")])
    return GroupResult(index, scored, dists, [trace])


def assert_same(a: object, b: object) -> None:
    """Dataclass trees equal, tensors bitwise."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b)
        for name in a.__dataclass_fields__:
            assert_same(getattr(a, name), getattr(b, name))
    else:
        assert a == b, (a, b)


def test_group_results_round_trip_through_json_and_tensors():
    original = [group_result(0), group_result(1)]
    tensors: dict[str, torch.Tensor] = {}
    text = json.dumps(encode(original, tensors))
    assert len(tensors) == 6  # 2 groups x (top-k ids + log-probs + dense logits)
    assert_same(original, decode(json.loads(text), tensors))


def test_decode_refuses_unknown_types_and_missing_tensors():
    with pytest.raises(ValueError, match=r"unknown type .os\.system."):
        decode({"__type__": "os.system", "x": 1}, {})
    with pytest.raises(ValueError, match="tensor 't7' is missing"):
        decode({"__tensor__": "t7"}, {})
    with pytest.raises(TypeError, match="cannot checkpoint a set"):
        encode({"a": {1, 2}}, {})


def controller_state(step: int, fingerprint: dict | None = None) -> ControllerState:
    _, draw = stream()
    sched = make(draw, max_policy_lag=1)
    rng = random.Random(3)
    rng.random()
    return ControllerState(step=step, weight_version=step + 1, first_version=1, prompts_count=8,
                           prompts_rng=rng.getstate(), schedule=sched.state(trained=0),
                           counters={"eval_before": 0.25, "traces_scored": 3, "teacher_usage": {}, "dropped_batches": 0,
                                     "dropped_rollouts": 0},
                           fingerprint=fingerprint or {"model": {"hidden_size": 64}}, replicas=1)


def test_only_committed_checkpoints_are_picked_and_old_ones_are_pruned(tmp_path: Path):
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    assert store.latest() is None
    for step in (2, 4, 6):
        store.write_controller(controller_state(step))
        store.commit(step, keep=2)
    store.write_controller(controller_state(8))  # written, never committed (killed before the marker)
    assert store.committed() == [4, 6]  # step 2 is beyond keep=2
    assert store.latest() == store.step_url(6)
    assert find_checkpoint(str(tmp_path / "checkpoints")) == store.step_url(6)
    assert find_checkpoint(str(tmp_path)) == store.step_url(6)  # a run dir holding checkpoints/
    (tmp_path / "checkpoints").rename(tmp_path / "elsewhere")
    with pytest.raises(RunCheckpointError, match="holds no committed checkpoint"):
        find_checkpoint(str(tmp_path))
    with pytest.raises(RunCheckpointError, match="no such checkpoint or run directory"):
        find_checkpoint(str(tmp_path / "missing"))


def test_a_half_written_checkpoint_is_refused_by_name(tmp_path: Path):
    store = CheckpointStore(str(tmp_path))
    store.write_controller(controller_state(3))
    with pytest.raises(RunCheckpointError, match="not committed"):
        find_checkpoint(store.step_url(3))
    with pytest.raises(RunCheckpointError, match=r"COMMITTED\.json is missing"):
        read_checkpoint(store.step_url(3))
    store.commit(3, keep=1)
    state = read_checkpoint(find_checkpoint(store.step_url(3)))
    assert state.step == 3 and state.counters["eval_before"] == 0.25
    restored = random.Random()
    restore_rng(restored, state.prompts_rng)
    expected = random.Random(3)
    expected.random()
    assert restored.random() == expected.random()


@pytest.mark.parametrize("damage, match", [
    (lambda d: (d / "controller.json").write_text("{not json"), "unreadable controller state"),
    (lambda d: (d / "controller.json").write_text(json.dumps({"format": 99})), "format 99, expected 1"),
    (lambda d: (d / "controller.safetensors").write_bytes(b"\x00" * 20), "unreadable controller state"),
    (lambda d: (d / "controller.json").write_text(json.dumps({"format": 1, "step": 1})), "malformed controller state"),
])
def test_corrupted_checkpoints_are_refused(tmp_path: Path, damage, match):
    """Damage after the commit: the file differs from its marker, named. Bad contents committed as they are
    (a writer's bug, another version): what is wrong with them, named."""
    store = CheckpointStore(str(tmp_path))
    store.write_controller(controller_state(5))
    store.commit(5, keep=1)
    damage(tmp_path / "step-00000005")
    with pytest.raises(RunCheckpointError, match=rf"^{tmp_path}/step-00000005/controller\.\w+: (\d+ bytes, "
                                                 r"COMMITTED\.json says \d+|content differs from COMMITTED\.json)"):
        read_checkpoint(store.step_url(5))
    part = store.series.at(5)  # the damaged files committed as they are
    part.reopen()
    part.note("controller.safetensors")
    part.note("controller.json")
    part.commit({"format": 1, "step": 5, "time": 0.0})
    with pytest.raises(RunCheckpointError, match=match):
        read_checkpoint(store.step_url(5))


def test_a_foreign_topology_is_refused_naming_each_field():
    saved = {"model": {"hidden_size": 64, "num_layers": 2}, "run": {"prompts_per_step": 8}, "loss": {"alpha_sdpo": 1.0}}
    now = {"model": {"hidden_size": 128, "num_layers": 2}, "run": {"prompts_per_step": 4}, "loss": {}}
    assert differences(saved, saved) == []
    with pytest.raises(RunCheckpointError) as e:
        check_fingerprint("ckpt", saved, now)
    text = str(e.value)
    assert "model.hidden_size: 64 in the checkpoint, now 128" in text
    assert "run.prompts_per_step: 8 in the checkpoint, now 4" in text
    assert "loss.alpha_sdpo: 1.0 in the checkpoint, now absent" in text
    assert "num_layers" not in text
    # a setting newer than the checkpoint: refused when set, accepted when left unset (None)
    assert differences({"run": {}}, {"run": {"data": None}}) == []
    assert differences({"run": {}}, {"run": {"data": {"path": "x.jsonl"}}}) == [
        "run.data: not in the checkpoint, now {'path': 'x.jsonl'}"]


def test_policy_checkpoints_every_n_steps_at_the_end_and_only_where_the_trainer_can():
    every = CheckpointPolicy(url="x", every=3)
    assert [s for s in range(1, 11) if every.due(s, 10)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if CheckpointPolicy(url="x").due(s, 10)] == [10]
    odd = CheckpointPolicy(url="x", every=2, checkpointable=lambda s: s % 4 == 0)
    assert [s for s in range(1, 11) if odd.due(s, 10)] == [4, 8]


def record(step: int) -> StepRecord:
    return StepRecord(step=step, weight_version=step + 1, reward=0.5, loss=0.1, channels={}, policy_lag=0,
                      weight_sync_s=0.0, step_s=0.1, dropped_batches=0, prompts=[f"p{step}"])


def test_a_resumed_metrics_file_keeps_the_steps_up_to_the_checkpoint(tmp_path: Path):
    first = MetricsWriter(tmp_path)
    first.write_event("eval", when="before", reward=0.1)
    for step in range(1, 6):
        first.write(record(step))
    first.write_event("checkpoint", step=5)
    first._f.write('{"step": 6, "cut short')  # killed mid-line
    first.close()
    resumed = MetricsWriter(tmp_path, resume_step=3)
    assert [r.step for r in resumed.records] == [1, 2, 3] and resumed.records[2].prompts == ["p3"]
    resumed.write(record(4))
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("step", line.get("event")) for line in lines] == ["eval", 1, 2, 3, 4]


async def test_scheduler_state_requeues_chunks_still_generating():
    drawn, draw = stream()
    s = make(draw, max_policy_lag=1, generators=2, groups_per_step=4)
    first = await pending_chunk(s)
    second = await pending_chunk(s)
    assert first is not None and second is not None and first.step == second.step == 1
    await s.finish(first, results(first))  # second is still generating when the checkpoint is taken
    state = s.state(trained=0)
    assert next(c.first for c in state.plans[0].pending) == second.first and len(state.plans[0].kept) == 2

    _, draw2 = stream()
    resumed = make(draw2, max_policy_lag=1, generators=2, groups_per_step=4)
    resumed.restore(state)
    again = await pending_chunk(resumed)
    assert again is not None and again.first == second.first and again.prompts == second.prompts
    await resumed.finish(again, results(again))
    groups, _ = await resumed.take(1)
    assert [g.index for g in groups] == [0, 1, 2, 3]
    assert resumed.drawn == s.drawn == len(drawn)


def test_a_checkpoint_needs_its_committed_marker_last(tmp_path: Path):
    store = CheckpointStore(str(tmp_path))
    store.write_controller(controller_state(1))
    assert not (tmp_path / "step-00000001" / COMMITTED).exists()
    store.commit(1, keep=1)
    assert (tmp_path / "step-00000001" / COMMITTED).exists()
