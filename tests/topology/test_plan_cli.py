"""`plan` output for a mixed topology (with and without prices) and the `composer-mesh` CLI exit codes."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from composer_mesh.cli import COMMANDS, main
from composer_mesh.topology import TopologyError, load_topology
from composer_mesh.topology.plan import PriceTable, load_prices, make_plan, render_plan

HERE = Path(__file__).parent
VALID = HERE / "valid"
ROOT = HERE.parent.parent
MIXED = VALID / "fake_mixed.yaml"
PRICES = VALID / "prices.yaml"
LOCAL_GPUS = VALID / "local_gpus.yaml"
EXAMPLE_PRICES = ROOT / "examples" / "prices.yaml"


def rendered(plan) -> str:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    render_plan(plan, Console(file=buf, width=250, color_system=None))
    return buf.getvalue()


def test_plan_of_mixed_topology_with_prices() -> None:
    plan = make_plan(load_topology(MIXED), load_prices(PRICES))
    rows = {m.name: m for m in plan.meshes}
    assert list(rows) == ["train", "gen", "teach", "cpu"]
    train, gen, teach, cpu = rows["train"], rows["gen"], rows["teach"], rows["cpu"]
    assert (train.backend, train.hosts, train.procs_per_host, train.gpus) == ("slurm", 2, 1, 8)
    assert train.roles == ("trainer (topology.fake_bindings:Trainer, 2 replicas)",)
    assert "partition=gpu" in train.job and "time=04:00:00" in train.job and "fake_mixed_train" in train.job
    assert (gen.gpus, gen.gpus_used) == (8, 4)  # gpus_per_node: 8 holds the whole node
    assert "gen_pool" in gen.job and "shared nodes" in gen.job
    assert teach.roles == (
        "teacher local_t (topology.fake_bindings:LocalTeacher: distill+replay)",
        "teacher api_t (topology.fake_bindings:APITeacher: replay)",
    )
    assert (cpu.backend, cpu.gpus, cpu.roles) == ("local", 0, ("rewarder (topology.fake_bindings:Rewarder)",))
    # slurm: 2.5/GPU-hour + 0.1/proc-hour; process: 0.05/proc-hour; local: not priced
    assert train.cost_per_hour == pytest.approx(8 * 2.5 + 2 * 0.1)
    assert gen.cost_per_hour == pytest.approx(8 * 2.5 + 4 * 0.1)
    assert teach.cost_per_hour == pytest.approx(2 * 0.05)
    assert cpu.cost_per_hour is None
    assert plan.total_cost_per_hour == pytest.approx(40.7)
    assert plan.unpriced == ("cpu",)

    text = rendered(plan)
    for fragment in (
        "train",
        "slurm",
        "2 × 1 = 2",
        "8 (4/proc)",
        "8 held, 4 used (1/proc)",
        "process",
        "2 × 1 = 2",
        "CPU only",
        "teacher api_t",
        "USD/hour",
        "20.20",
        "20.40",
        "0.10",
        "no price",
        "Estimated cost: 40.70 USD per hour",
        "no price for their backend: cpu",
        "4 meshes, 9 procs, 16 GPUs held",
    ):
        assert fragment in text, fragment


def test_plan_without_prices_has_no_cost_column() -> None:
    plan = make_plan(load_topology(MIXED))
    assert plan.total_cost_per_hour is None and all(m.cost_per_hour is None for m in plan.meshes)
    text = rendered(plan)
    assert "USD" not in text and "Estimated cost" not in text
    assert "fake_mixed" in text


def test_price_table_is_validated_with_lines(tmp_path: Path) -> None:
    bad = tmp_path / "prices.yaml"
    bad.write_text("currency: EUR\nslurm: {gpu_hour: -1}\nlocal: {cpu_proc_hour: 1}\nazure: {gpu_hour: 1}\n")
    with pytest.raises(TopologyError) as info:
        load_prices(bad)
    got = {(e.path, e.line) for e in info.value.errors}
    assert got == {("slurm.gpu_hour", 2), ("local.gpu_hour", 3), ("azure", 4)}
    assert "allowed keys: currency, local, process, slurm" in str(info.value)
    assert PriceTable().for_backend("slurm") is None


def test_plan_shows_the_gpus_of_each_local_mesh() -> None:
    plan = make_plan(load_topology(LOCAL_GPUS), host_gpus=(8, "nvidia-smi -L"))
    rows = {m.name: m.gpu_devices for m in plan.meshes}
    assert rows == {"learner": (0, 1), "judge": (2,), "rollout": (4, 3), "cpu": ()}
    assert (plan.local_gpus, plan.missing_gpus) == ((0, 1, 2, 3, 4), ())
    text = rendered(plan)
    for fragment in (
        "GPUs 0-1",
        "GPU 2",
        "GPUs 3-4",
        "CPU only",
        "Local meshes use GPUs 0-4 of this host; it has 8 (nvidia-smi -L)",
    ):
        assert fragment in text, fragment
    assert "warning" not in text
    # Non-local meshes have no host GPUs of their own here (Slurm allocates), and no GPU line is printed.
    mixed = make_plan(load_topology(MIXED))
    assert {m.name: m.gpu_devices for m in mixed.meshes} == {
        "train": None,
        "gen": None,
        "teach": None,
        "cpu": (),
    }
    assert (mixed.host_gpus, mixed.host_gpus_source) == (None, "")
    assert "Local meshes" not in rendered(mixed)


def test_plan_flags_a_host_with_too_few_gpus() -> None:
    plan = make_plan(load_topology(LOCAL_GPUS), host_gpus=(3, "CUDA_VISIBLE_DEVICES"))
    assert plan.missing_gpus == (3, 4)
    text = rendered(plan)
    assert (
        "warning: local meshes use GPUs 0-4 of this host, but it has only 3 (CUDA_VISIBLE_DEVICES); "
        "missing: GPUs 3-4" in text
    )


def test_plan_counts_host_gpus_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    plan = make_plan(load_topology(LOCAL_GPUS))
    assert (plan.host_gpus, plan.host_gpus_source, plan.missing_gpus) == (
        2,
        "CUDA_VISIBLE_DEVICES",
        (2, 3, 4),
    )
    assert main(["plan", str(LOCAL_GPUS)]) == 0  # a warning, not an error: the run may go elsewhere
    assert "missing: GPUs 2-4" in capsys.readouterr().out
    # No CUDA_VISIBLE_DEVICES and no nvidia-smi (this CPU machine): unknown, and said so.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", "")
    plan = make_plan(load_topology(LOCAL_GPUS))
    assert plan.host_gpus is None and plan.missing_gpus == ()
    assert (
        "its GPU count is unknown (CUDA_VISIBLE_DEVICES is unset and nvidia-smi is not on PATH)"
        in rendered(plan)
    )


# ---- CLI ---------------------------------------------------------------------------------------------------


def test_validate_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(MIXED)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {MIXED}: topology 'fake_mixed': 4 meshes")


def test_validate_prints_all_errors_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    broken = HERE / "broken" / "beta_default_without_teachers.yaml"
    assert main(["validate", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "2 errors" in err
    assert f"{broken}:10:" in err and "loss.alpha_sdpo" in err and "loss.beta_replay" in err


def test_plan_cli_with_prices(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["plan", str(MIXED), "--prices", str(PRICES)]) == 0
    out = capsys.readouterr().out
    assert "Estimated cost: 40.70 USD per hour" in out and "gen_pool" in out


def test_plan_cli_reports_errors_of_both_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prices = tmp_path / "p.yaml"
    prices.write_text("slurm: {gpu_hour: cheap}\n")
    broken = HERE / "broken" / "unknown_mesh.yaml"
    assert main(["plan", str(broken), "--prices", str(prices)]) == 1
    err = capsys.readouterr().err
    assert "roles.generators.mesh" in err and f"{prices}:1:" in err and "slurm.gpu_hour" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["validate"], "the following arguments are required: file"),
        (["plan", "x.yaml", "--price", "p.yaml"], "unrecognized arguments"),
    ],
)
def test_bad_usage_exits_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_file_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read file" in capsys.readouterr().err


def test_commands_are_a_registry() -> None:
    assert [c.name for c in COMMANDS][:2] == ["validate", "plan"]


def test_console_script_exit_code() -> None:
    """The installed `composer-mesh` entry point (as a user runs it) exits 1 and prints the errors.

    One subprocess only (it imports torch through the sections' modules); the 0 path is covered by main().
    """
    exe = Path(sys.executable).parent / "composer-mesh"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "composer_mesh.cli"]
    # Extend, never replace, the caller's PYTHONPATH (it may carry what the entry point needs).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH")]))}
    bad = subprocess.run(
        [*cmd, "validate", str(HERE / "broken" / "bad_backend.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 1, bad.stderr
    assert "meshes.cpu.backend" in bad.stderr and "'local', 'process' or 'slurm'" in bad.stderr


# ---- readable at 80 columns, what trains, cost per run -----------------------------------------------------


def rendered_at(plan, width: int = 80) -> str:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    render_plan(plan, Console(file=buf, width=width, color_system=None))
    return buf.getvalue()


def test_plan_at_80_columns_cuts_nothing_and_says_what_trains() -> None:
    text = rendered_at(make_plan(load_topology(ROOT / "topologies" / "slurm_gpu.yaml"), load_prices(EXAMPLE_PRICES)))
    assert "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= 80
    flat = " ".join(text.split())  # values wrap under their label: join the lines back
    for fragment in (
        "model built-in tiny Qwen2 (char tokenizer, 4 layers × 256)",
        "loss GRPO + 0.5 × SDPO distillation + 0.1 × teacher-trace replay",
        "steps 1,000 × 64 prompts × 8 samples = 512,000 rollouts",
        "launch Slurm: job gpu_run_trainers, partition=gpu, time=04:00:00, account=rl, qos=normal, mem=512G",
        "roles trainer (hf, 2 replicas of 8 ranks each)",
        "cost 40.32 USD/hour, at most 161.28 per run (4 h)",
        "Estimated cost: 83.24 USD per hour",
        "Estimated cost per run: at most 332.96 USD (each priced job billed up to its time limit",
    ):
        assert fragment in flat, fragment


def test_cost_per_run_from_hours_or_time_limits_or_unknown() -> None:
    topology, prices = load_topology(MIXED), load_prices(PRICES)
    bounded = make_plan(topology, prices)
    train, gen, teach, _ = bounded.meshes
    assert (train.limit_hours, gen.limit_hours, teach.limit_hours) == (4.0, None, None)
    assert bounded.mesh_cost_per_run(train) == pytest.approx(20.2 * 4)
    assert bounded.total_cost_per_run is None  # gen (Slurm, no time limit) and teach (process) are open-ended
    flat = " ".join(rendered_at(bounded).split())
    assert "Estimated cost per run: unknown, no time limit bounds gen, teach: give --hours H" in flat
    hours = make_plan(topology, prices, hours=2.5)
    assert hours.total_cost_per_run == pytest.approx(40.7 * 2.5)
    flat = " ".join(rendered_at(hours).split())
    assert "Estimated cost per run: 101.75 USD for 2.5 h (--hours)" in flat
    assert "cost 20.20 USD/hour, 50.50 per run (2.5 h)" in flat


def test_plan_cli_takes_hours(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(MIXED), "--prices", str(PRICES), "--hours", "2"]) == 0
    assert "81.40 USD for 2 h (--hours)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["plan", str(MIXED), "--hours", "-1"])
    assert "expected a positive number of hours, got -1" in capsys.readouterr().err


def test_the_example_price_file_is_outside_topologies() -> None:
    """topologies/ holds topologies only (`validate topologies/*.yaml` checks each); prices live in examples/."""
    import yaml

    assert load_prices(EXAMPLE_PRICES).for_backend("slurm") is not None
    for path in sorted((ROOT / "topologies").glob("*.yaml")):
        assert "meshes" in yaml.safe_load(path.read_text()), f"{path} is not a topology"


def test_plan_of_a_coding_run_says_its_sandbox_and_episode_shape(tmp_path: Path) -> None:
    path = tmp_path / "coding.yaml"
    rewarder = '  rewarder: {mesh: cpu, binding: "topology.fake_bindings:Rewarder"}\n'
    path.write_text((VALID / "minimal.yaml").read_text().replace(rewarder, "") + """
run:
  steps: 3
  max_new_tokens: 64
  environment: {kind: coding, max_turns: 4, sandbox: {mode: rlimits, wall_s: 5, concurrency: 2}}
  rollout: {kind: multi_turn, max_turns: 4, max_context: 4096}
""")
    flat = " ".join(rendered_at(make_plan(load_topology(path))).split())
    assert "prompts environment coding;" in flat
    assert "steps 3 × 8 prompts × 4 samples = 96 episodes; ≤ 64 new tokens per turn;" in flat
    assert ("rollout multi_turn episodes: ≤ 4 policy turns, 60 s per environment step, ≤ 4,096 tokens per "
            "episode; ≤ 256 in flight") in flat
    assert "sandbox rlimits only (NOT isolated: network and host files reachable); rlimits cpu 10s" in flat
    assert "wall 5s; 2 at once" in flat
    path.write_text(path.read_text().replace("mode: rlimits, ", ""))  # the default mode: bubblewrap
    assert dict(make_plan(load_topology(path)).training)["sandbox"].startswith("bubblewrap: no network")


def test_plan_of_a_single_turn_run_has_no_rollout_or_sandbox_line() -> None:
    labels = [label for label, _ in make_plan(load_topology(VALID / "minimal.yaml")).training]
    assert labels == ["model", "loss", "steps", "prompts"]
