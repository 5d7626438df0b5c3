"""The benchmarks run end to end at CI size (their numbers are read by people, never asserted here).

The heavy ones are the `bench` tier: outside the default test run (it must stay under 20 minutes on 2 cores),
run by `.ci/run` right after it (`pytest -m bench`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_quick(script: str, out: Path, timeout: float, *args: str) -> tuple[str, dict[str, Any]]:
    """Run `benchmarks/<script> --quick ... --json out` offline; (its stdout, the JSON it wrote)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.bench
@pytest.mark.slow  # ~50 s on 2 cores: seven fresh processes that each import torch and transformers
def test_bench_trainer_quick_writes_both_implementations(tmp_path: Path) -> None:
    stdout, result = run_quick("bench_trainer.py", tmp_path / "bench_trainer.json", 240, "--device", "cpu")
    assert "ours/bare tok/s" in stdout and "KiB/token" in stdout
    assert result["hardware"] and result["versions"] and result["params"] > 0
    sweep = result["sweep"]
    for impl in ("bare", "ours"):
        rows = [r for r in sweep if r["impl"] == impl]
        assert len(rows) >= 2, f"no sweep rows for {impl}: {sweep}"
        assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows), rows
    assert all(r["micro_batches"] >= 1 for r in sweep)
    table = [r for r in result["micro_batch_table"] if r["impl"] == "ours"]
    budgets = [r["micro_batch_tokens"] for r in table]
    assert None in budgets and len(set(budgets)) >= 3  # the whole batch and at least two budgets
    for row in table:
        assert row["status"] == "ok" and row["peak_bytes_per_token"] > 0, row
        assert row["micro_batches"] >= 1


@pytest.mark.bench
@pytest.mark.slow  # ~40 s: proc meshes of 1 and 2 procs, each building the sharded trainer
def test_bench_trainer_ranks_shards_parameters_and_adamw(tmp_path: Path) -> None:
    stdout, result = run_quick("bench_trainer.py", tmp_path / "ranks.json", 300, "--ranks", "1", "2")
    assert "one replica sharded over N procs" in stdout and "goal ≤ 1/N + 10%" in stdout
    rows = {r["ranks"]: r for r in result["ranks"]}
    assert set(rows) == {1, 2} and all(r["tokens_per_s"] > 0 and r["step_s"] > 0 for r in rows.values())
    assert len(rows[2]["per_rank"]) == 2 and rows[2]["comm_s"] > 0  # two ranks, their collectives timed
    assert rows[1]["held_vs_one"] == 1.0 and rows[2]["held_vs_one"] <= 0.5 + 0.10
    for row in rows.values():  # weights published after a step: gathered one tensor at a time
        assert row["publish_s"] > 0 and 0 < row["publish_peak_bytes"] < row["model_bytes"]


@pytest.mark.bench
@pytest.mark.slow  # ~40 s on 2 cores: the HF implementations, then a vLLM engine in a child when vllm imports
def test_bench_generate_quick_writes_every_implementation(tmp_path: Path) -> None:
    stdout, result = run_quick("bench_generate.py", tmp_path / "bench_generate.json", 300, "--device", "cpu")
    assert "ours/generate" in stdout and "hardware:" in stdout
    assert result["hardware"] and result["versions"] and result["params"] > 0
    rows = result["rows"]
    batches = result["settings"]["batches"]
    for impl in ("ours", "generate"):
        got = {r["batch"]: r for r in rows if r["impl"] == impl}
        assert sorted(got) == sorted(batches), rows
        for b, r in got.items():  # every implementation made exactly batch x new tokens
            assert r["status"] == "ok" and r["tokens_per_s"] > 0, r
            assert r["new_tokens"] == b * result["settings"]["new"], r
    vllm = [r for r in rows if r["impl"] == "vllm"]
    assert sorted(r["batch"] for r in vllm) == sorted(batches)  # a rate, or why there is none
    assert all(r["tokens_per_s"] > 0 if r["status"] == "ok" else r["status"] for r in vllm)


@pytest.mark.bench
@pytest.mark.slow  # ~30 s on 2 cores: two blocks of fresh proc meshes
def test_bench_weight_sync_quick_runs_every_cpu_transport(tmp_path: Path) -> None:
    """Every CPU transport side by side; only that each method moved the version to every generator."""
    stdout, result = run_quick("bench_weight_sync.py", tmp_path / "bench_weight_sync.json", 300)
    assert "Weight sync (cpu weights)" in stdout
    assert result["device"] == "cpu" and result["hardware"]
    assert [r["generators"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert set(row["mb_per_s"]) == {"rdma", "shm", "endpoint", "state_dict"}
        assert all(math.isfinite(v) and v > 0 for v in row["mb_per_s"].values()), row


@pytest.mark.bench
@pytest.mark.slow  # ~60 s on 2 cores: a TRL GRPOTrainer child and two composer-mesh runs of 6 steps
def test_bench_vs_trl_quick_runs_trl_and_composer_mesh(tmp_path: Path) -> None:
    """TRL and composer-mesh (lag 0 and 1) train the same 6 steps; only that each side ran and the tables print."""
    stdout, result = run_quick("bench_vs_trl.py", tmp_path / "bench_vs_trl.json", 600, "--out", str(tmp_path / "out"))
    assert "samples/s median" in stdout and "reward by part" in stdout and "goals" in stdout
    assert result["hardware"] and result["versions"] and result["params"] > 0
    runs = {r["config"]: r for r in result["runs"]}
    assert sorted(runs) == ["cm-lag0", "cm-lag1", "trl-t1"], result["runs"]
    for run in runs.values():
        assert run["status"] == "ok", run
        assert len(run["rewards"]) == 6 and run["rollouts_trained"] == 6 * 32, run
    assert runs["trl-t1"]["completions_per_optimizer_step"] == 32  # one optimizer step per 4 x 8 completions
    assert (tmp_path / "out" / "results.json").is_file()


@pytest.mark.bench
@pytest.mark.slow  # ~40-110 s on 2 cores: two composer-mesh runs of 4 steps (1 and 2 stand-in generators)
def test_bench_generator_scaling_quick_runs_1_and_2_generators(tmp_path: Path) -> None:
    """One run per generator count with the fixed-latency stand-in; only that each ran and the table prints."""
    stdout, result = run_quick("bench_generator_scaling.py", tmp_path / "bench_generator_scaling.json", 600,
                               "--out", str(tmp_path / "out"))
    assert "generator scaling" in stdout and "samples/s" in stdout and "hardware:" in stdout
    assert result["hardware"] and result["versions"]
    assert [r["generators"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["status"] == "ok" and row["samples_per_s"] > 0 and row["rollouts"] == 4 * 8 * 4, row
    assert (tmp_path / "out" / "results.json").is_file()


def test_bench_checkpoint_quick_measures_every_mode(tmp_path: Path) -> None:
    stdout, result = run_quick("bench_checkpoint.py", tmp_path / "bench_checkpoint.json", 300)
    assert "| no checkpoint |" in stdout and "x no checkpoint" in stdout
    modes = result["modes"]
    assert len(modes) == 4 and all(m["step_s"] > 0 for m in modes.values())
    assert result["state_gib"] > 0 and result["copy_s"] > 0 and result["write_s"] > 0



@pytest.mark.bench
def test_bench_lora_quick_measures_full_and_lora_side_by_side(tmp_path: Path) -> None:
    stdout, result = run_quick("bench_lora.py", tmp_path / "bench_lora.json", 300)
    assert "| full fine-tuning |" in stdout and "x trainable" in stdout and "peft" in stdout
    modes = result["modes"]
    full, merged, adapter = modes["full fine-tuning"], modes["LoRA r=16, sync merged"], modes["LoRA r=16, sync adapter"]
    assert all(m["step_s"] > 0 for m in modes.values())
    assert merged["trainable"] < full["trainable"] and merged["state_mib"] < full["state_mib"]
    assert merged["publish_mib"] == full["publish_mib"] and adapter["publish_mib"] < merged["publish_mib"]


@pytest.mark.bench
@pytest.mark.slow  # ~40-60 s on 2 cores: one run of the main job (seed 0, 20 steps)
def test_bench_local_seeds_quick_reports_held_out_numbers(tmp_path: Path) -> None:
    stdout, result = run_quick("bench_local_seeds.py", tmp_path / "bench_local_seeds.json", 400,
                               "--out", str(tmp_path / "out"))
    assert "greedy before: median" in stdout and "wall s: median" in stdout
    assert result["hardware"] and result["steps"] == 20 and [r["seed"] for r in result["rows"]] == [0]
    row = result["rows"][0]
    assert row["status"] == "ok" and row["wall_s"] > 0, row
    assert [(e["when"], e["step"]) for e in row["evals"]] == [("before", 0), ("after", 20)]
    assert all(0 <= e["greedy"] <= 1 and 0 <= e["pass_at_k"] <= 1 and e["k"] == 4 for e in row["evals"])
    assert result["summary"]["greedy_after"] == [row["evals"][-1]["greedy"]]
    assert yaml_seed(tmp_path / "out" / "seed0.yaml") == (0, 0)


def yaml_seed(path: Path) -> tuple[int, int]:
    """(model.seed, run.seed) of a topology copy the benchmark wrote."""
    import yaml

    data = yaml.safe_load(path.read_text())
    return data["model"]["seed"], data["run"]["seed"]


def test_scripted_generator_forces_the_turns_trl_is_forced_to_with_the_models_log_probs(tmp_path: Path) -> None:
    """Same turns on both sides: composer-mesh's ScriptedGenerator (its own KV-cache decode loop) emits, for the
    opening conversation and for one after a tool result, exactly the tokens TRL's `model.generate` emits under
    `scripted_processor`; its log-probs are the model's own (teacher-forced log_softmax(logits / T)), so every
    token went through the model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_agentic as bench

    from composer_mesh.actors.messages import GenerationRequest, Prompt
    from composer_mesh.envs.calculator import CALCULATOR
    from composer_mesh.models.sampling import teacher_forced_logits

    model_dir = bench.build_model_dir(tmp_path / "model")["dir"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ours = bench.ScriptedGenerator(bench.ScriptedGeneratorSettings(tool_calls=2))
    ours.start({"source": model_dir})
    opening = [{"role": "system", "content": bench.SYSTEM}, {"role": "user", "content": "47*83"}]
    opening_prompt = Prompt("p", "", messages=opening, tools=[CALCULATOR.schema])
    first = ours.generate(GenerationRequest([opening_prompt], samples_per_prompt=2, max_new_tokens=96),
                          weight_version=3)[0].rollouts
    call = first[0]
    assert call.text == bench.tool_call_text("47*83") and call.completion_ids[-1] == tokenizer.convert_tokens_to_ids(
        bench.IM_END) and call.finish_reason == "stop" and call.weight_version == 3
    after = Prompt("p", "", token_ids=call.prompt_ids + call.completion_ids,
                   bridge_messages=[{"role": "tool", "name": "calculator", "content": "3901"}])
    second = ours.generate(GenerationRequest([after], samples_per_prompt=1, max_new_tokens=96, seeds=[7]),
                           weight_version=4)[0].rollouts[0]
    assert second.text == bench.tool_call_text("47*83")  # 1 result of 2: call again
    for rollout in (call, second):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        trl_ids = bench.scripted_processor(tokenizer, torch.tensor([rollout.prompt_ids]), 2)
        out = model.generate(input_ids=torch.tensor([rollout.prompt_ids]), do_sample=True, max_new_tokens=96,
                             logits_processor=LogitsProcessorList([trl_ids]), pad_token_id=tokenizer.pad_token_id)
        assert out[0, len(rollout.prompt_ids):].tolist() == rollout.completion_ids  # TRL's side, token for token
        logits = teacher_forced_logits(model, [rollout.prompt_ids], [rollout.completion_ids], pad_id=0)[0]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(rollout.completion_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(rollout.logprobs), expected, atol=1e-4)
        assert max(rollout.logprobs) < -1.0  # a random model: forced tokens are unlikely, never log-prob 0
    assert first[0].completion_ids == first[1].completion_ids and first[0].logprobs == first[1].logprobs


@pytest.mark.bench
@pytest.mark.slow  # ~2-3 min on 2 cores: a TRL child (warm-up + 3 latencies x 2 steps) and three composer-mesh runs
def test_bench_agentic_quick_measures_both_sides_per_latency(tmp_path: Path) -> None:
    """TRL's GRPOTrainer and composer-mesh's multi-turn driver play the scripted calculator episodes at every
    latency, the same tool calls and turns per episode on both sides; the tables and goals print."""
    stdout, result = run_quick("bench_agentic.py", tmp_path / "bench_agentic.json", 900, "--out", str(tmp_path / "out"),
                               "--sides", "trl", "ours")  # the endpoint side has its own test below
    assert "TRL episodes/s" in stdout and "ours / TRL" in stdout and "goals" in stdout and "hardware:" in stdout
    assert "composer-mesh, where the time went" in stdout
    assert result["hardware"] and result["versions"] and result["params"] > 0
    trl = {r["latency_s"]: r for r in result["rows"] if r["side"] == "trl"}
    assert sorted(trl) == [0.0, 0.1, 1.0], result["rows"]
    for latency, row in trl.items():
        assert row["status"] == "ok" and row["episodes"] == 2 * 2 * 2, row
        assert row["tool_calls_per_episode"] == 1.0 and row["reward_mean"] == 1.0, row  # every episode called once
        assert row["tool_s"] >= latency * row["tool_calls"] and 0 < row["trainer_idle_fraction"] < 1, row
    # TRL runs a batch's tool calls one after another: 4 calls x 1 s per step dominate at 1 s
    assert trl[1.0]["episodes_per_s"] < trl[0.0]["episodes_per_s"]
    assert trl[1.0]["tool_s"] >= 4 * 2 * 1.0 and trl[1.0]["trainer_idle_fraction"] > trl[0.0]["trainer_idle_fraction"]
    ours = {r["latency_s"]: r for r in result["rows"] if r["side"] == "ours"}
    assert sorted(ours) == [0.0, 0.1, 1.0], result["rows"]
    for row in ours.values():
        assert row["status"] == "ok" and row["steps"] == 3 and row["episodes"] == 12, row
        assert row["steady_episodes_per_s"] > 0 and 0 <= row["steady_trainer_idle_fraction"] < 1, row
        assert (row["tool_calls_per_episode"], row["turns_per_episode"], row["done_fraction"]) == (1.0, 2.0, 1.0), row
        assert row["reward_mean"] == 1.0 and row["policy_lag_max"] <= 3 and 0 <= row["trainer_idle_fraction"] < 1, row
        assert row["episodes_per_s"] > 0 and (Path(row["run_dir"]) / "topology.yaml").is_file(), row
    # the episodes of a step wait on their tools together: 3 steps of 4 episodes at 1 s take far less than the
    # 12 x 1 s TRL waits, whatever the machine's load
    assert ours[1.0]["wall_s"] < 12 * 1.0, ours[1.0]
    assert len(result["goals"]) == 4 and all(not g["got"].startswith("not measured") for g in result["goals"])
    assert (tmp_path / "out" / "results.json").is_file()


@pytest.mark.bench
@pytest.mark.slow  # ~2 min on a busy 2-core VM: two composer-mesh runs of 3 steps
def test_bench_agentic_quick_measures_an_openai_agent_through_the_endpoint_beside_the_built_in_driver(
        tmp_path: Path) -> None:
    """The endpoint side: `endpoint_agent` (the official `openai` client) plays the same scripted calculator
    episodes through the harness endpoint as the built-in driver plays against the environment; both rows and
    the >= 0.8x goal print (the goal's verdict is the full benchmark's, on an idle machine)."""
    stdout, result = run_quick("bench_agentic.py", tmp_path / "bench_agentic.json", 900, "--out", str(tmp_path / "out"),
                               "--sides", "ours", "endpoint", "--latencies", "0.1")
    assert "composer-mesh through the harness endpoint" in stdout and "endpoint (openai-client agent)" in stdout
    rows = {r["side"]: r for r in result["rows"]}
    assert sorted(rows) == ["endpoint", "ours"], result["rows"]
    for row in rows.values():
        assert row["status"] == "ok" and row["steps"] == 3 and row["episodes"] == 12, row
        assert (row["turns_per_episode"], row["done_fraction"], row["reward_mean"]) == (2.0, 1.0, 1.0), row
        assert row["steady_episodes_per_s"] > 0, row
    goal = next(g for g in result["goals"] if g["goal"].startswith("endpoint"))
    assert goal["got"].startswith("min ") and goal["got"].endswith("x"), goal


@pytest.mark.bench
@pytest.mark.slow  # ~1 min: a 30-step warm start, then two composer-mesh runs of 2 steps
def test_bench_agentic_ablation_quick_compares_grpo_with_and_without_targeted_feedback(tmp_path: Path) -> None:
    """`--ablation`: the calculator task without its teacher, GRPO alone and GRPO + targeted feedback at the same
    seed; held-out success before and after for each, hints given only in the hints arm, the table prints."""
    stdout, result = run_quick("bench_agentic.py", tmp_path / "ablation.json", 900, "--out", str(tmp_path / "out"),
                               "--ablation")
    assert "held-out success with and without targeted feedback" in stdout and "mean change" in stdout
    rows = {r["arm"]: r for r in result["ablation"]}
    assert sorted(rows) == ["grpo", "grpo+hints"], result["ablation"]
    for row in rows.values():
        assert row["status"] == "ok" and row["steps"] == 2 and row["seed"] == 0, row
        assert 0 <= row["held_out_before"] <= 1 and 0 <= row["held_out_after"] <= 1, row
    assert rows["grpo"]["held_out_before"] == rows["grpo+hints"]["held_out_before"]  # same seed, same warm start
    assert rows["grpo"]["hinted_fraction"] == 0 and rows["grpo+hints"]["hinted_fraction"] > 0
    assert rows["grpo+hints"]["hint_tokens"] > 0
    # the probe of the warm start: the student's and the hinted teacher's probabilities at the first wrong digit
    probe = result["probe"]
    assert "is the hinted warm start a better teacher" in stdout and probe["wrong_answers"] > 0, probe
    assert all(0 <= probe[k] <= 1 for k in ("student_right", "teacher_right", "student_wrong", "teacher_wrong"))
