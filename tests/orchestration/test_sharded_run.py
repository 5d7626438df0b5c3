"""A run whose trainer replica is sharded over two procs (FSDP2, gloo; `tiny_sharded_run.yaml`) on real meshes:
it trains, the generators hold the trainer's exact weights after every sync, the final model is a plain HF
directory, at lag 0 a stopped and resumed run is bitwise the uninterrupted one (each rank saves and restores
its own shards), and a rank killed with SIGKILL fails the run (no
hang) with the trainer named. Multi-turn episodes train on it as on one proc:
the same first-step loss as a one-proc run (single completions: test_sharded_trainer.py, to 1e-10)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from orchestration.test_resume import HERE, assert_bitwise, records, run_session, stop_and_resume, topology
from safetensors.torch import load_file

from composer_mesh.app.launch import launch, run_config
from composer_mesh.app.runner import apply_overrides, checkpoint_policy
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.topology import Topology, load_topology

pytestmark = pytest.mark.slow  # short runs on up to seven procs each, ~5 minutes in all


def rank_state(run_dir: Path, steps: int, rank: int) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"step-{steps:08d}" / "trainer" / "r0" / f"rank{rank}" / "state.safetensors"
    return load_file(path)


async def test_sharded_run_trains_syncs_and_resumes_bitwise_at_lag_0(tmp_path):
    kw = {"steps": 4, "max_policy_lag": 0, "eval_prompts": 0}
    topo = topology("tiny_sharded_run.yaml", tmp_path / "whole", **kw)
    async with launch(topo) as mesh:  # the uninterrupted run, checked from inside
        summary = await RLLoop(mesh, run_config(topo), topo.loss, checkpoints=checkpoint_policy(topo)).run()
        assert summary.steps == 4
        trainer = await mesh.trainer.weights_digest.call()  # every rank gathers the same full weights
        generators = await mesh.generators.weights_digest.call()
        assert len(set(trainer.values())) == 1 and set(generators.values()) == set(trainer.values())
    whole = records(tmp_path / "whole")
    assert [r["step"] for r in whole] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in whole)
    assert set(whole[0]["channels"]) >= {"grpo", "sdpo"}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "checkpoint")  # rank 0 wrote it, gathered
    assert sum(p.numel() for p in model.parameters()) > 0

    await stop_and_resume(topology("tiny_sharded_run.yaml", tmp_path / "cut", **kw), stop_after=1)
    for rank in (0, 1):
        assert_bitwise(rank_state(tmp_path / "whole", 4, rank), rank_state(tmp_path / "cut", 4, rank))
    keys = ("step", "weight_version", "reward", "loss", "channels", "rollouts", "prompts")
    cut = records(tmp_path / "cut")
    assert [{k: r[k] for k in keys} for r in whole] == [{k: r[k] for k in keys} for r in cut]



async def test_a_killed_rank_fails_the_run_with_the_trainer_named(tmp_path):
    """kill -9 of rank 1 mid-run: the run fails with the trainer named (no hang in a collective: the survivor's
    gloo sees its peer gone), after writing its checkpoints. (Resuming a sharded run from a checkpoint is the
    bitwise test above; with DiLoCo, a dead rank's replica is replaced instead: test_replica_faults.py.)"""
    import asyncio
    import os
    import signal

    from composer_mesh.mesh.launch import MeshFailureError

    topo = topology("tiny_sharded_run.yaml", tmp_path / "run", steps=6, max_policy_lag=0, eval_prompts=0,
                    checkpoint_every=2)
    # Monarch reports the death as the signal, or (when its proc agent's answer times out first) as "the process
    # likely crashed": either names the trainer's mesh
    with pytest.raises(MeshFailureError, match=r"'trainer' on mesh 'trainer'.*(Killed|process likely crashed)"):
        async with launch(topo) as mesh:
            where = await mesh.trainer.process.call()
            victim = sorted(int(w["pid"]) for w in where.values())[1]

            def progress(record) -> None:
                if record.step == 3:
                    os.kill(victim, signal.SIGKILL)

            loop = RLLoop(mesh, topo.run, topo.loss, progress=progress, checkpoints=checkpoint_policy(topo))
            await asyncio.wait_for(loop.run(), timeout=240)
    steps = [r["step"] for r in records(tmp_path / "run")]
    assert 3 <= steps[-1] < 6
    assert (tmp_path / "run" / "checkpoints" / "step-00000002" / "COMMITTED.json").exists()


def sharded_agentic(run_dir: Path, **run: object) -> Topology:
    """tests/orchestration/tiny_agentic.yaml with its trainer replica sharded over two procs."""
    text = (HERE / "tiny_agentic.yaml").read_text()
    for old, new in (("trainer:    {backend: local}", "trainer:    {backend: local, procs_per_host: 2}"),
                     ("trainer: {mesh: trainer, binding: hf,", "trainer: {mesh: trainer, binding: hf, procs_per_replica: 2,")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    topo = apply_overrides(load_topology(path), None, run_dir)
    topo = topo.model_copy(update={"run": topo.run.model_copy(update=run)})
    topo._source = path
    return topo


async def test_a_sharded_trainer_trains_on_multi_turn_episodes_as_one_proc_does(tmp_path):
    """Episodes of several turns (policy and environment spans, one loss mask) on a replica of two ranks: the
    first step's loss and channels are the one-proc trainer's on the same episodes (lag 0, same seeds)."""
    kw = {"steps": 1, "max_policy_lag": 0}
    await run_session(sharded_agentic(tmp_path / "sharded", **kw))
    await run_session(topology("tiny_agentic.yaml", tmp_path / "plain", **kw))
    sharded, plain = records(tmp_path / "sharded"), records(tmp_path / "plain")
    assert sharded[0]["metrics"]["episode/policy_turns"] > sharded[0]["rollouts"]  # episodes of several turns
    assert sharded[0]["reward"] == plain[0]["reward"] and sharded[0]["rollouts"] == plain[0]["rollouts"]
    assert sharded[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-5, abs=1e-6)
    assert sharded[0]["channels"] == pytest.approx(plain[0]["channels"], rel=1e-5, abs=1e-6)
