"""Values that can only fail after launch are refused by `composer-mesh validate` (and by `run` before any mesh
starts), one line each naming the field: more streaming-DiLoCo fragments than the policy has tensors, a LoRA
rank above what the generator binding serves, LoRA target modules the policy does not have, a sandbox
interpreter that cannot run here. The largest value that
works still passes, so each bound is the real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_mesh.cli import EXIT_INVALID, EXIT_OK, main
from composer_mesh.models.compat import parameter_tensors
from composer_mesh.models.loading import load_tokenizer
from composer_mesh.topology import TopologyError, load_topology, parse_topology

ROOT = Path(__file__).resolve().parents[2]


def validate(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`composer-mesh validate` here: the exit code and everything it printed."""
    capsys.readouterr()
    code = main(["validate", str(path)])
    out = capsys.readouterr()
    return code, out.err + out.out


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def edited(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """A copy of topologies/`name` in `tmp_path` with `old` (which must be there) replaced by `new`."""
    text = (ROOT / "topologies" / name).read_text()
    assert old in text, f"{name} no longer has {old!r}"
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return path


def diloco_run(tmp_path: Path, fragments: int) -> Path:
    """topologies/local_diloco.yaml with `fragments` fragments (sync_every a multiple of them)."""
    return edited(tmp_path, "local_diloco.yaml", "  sync_every: 20\n",
                  f"  sync_every: {2 * fragments}\n  fragments: {fragments}\n")


def test_more_fragments_than_the_policy_has_tensors_is_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    model = load_topology(ROOT / "topologies" / "local_diloco.yaml").model
    tensors = parameter_tensors(model, len(load_tokenizer(model)))
    # a Qwen2 layer: q/k/v weights and biases, o, gate, up, down, two norms; plus embeddings, final norm, head
    assert tensors == 12 * model.num_layers + 3
    code, err = validate(diloco_run(tmp_path, tensors + 1), capsys)
    assert code == EXIT_INVALID
    assert f"diloco.fragments={tensors + 1} but the policy has only {tensors} parameter tensors" in one_line(err)
    code, err = validate(diloco_run(tmp_path, tensors), capsys)
    assert code == EXIT_OK, err


LORA = """\
name: t
meshes:
  cpu: {backend: local}
roles:
  trainer:
    settings: {lora: {r: RANK, sync: adapter}}
    mesh: cpu
  generators: {mesh: cpu, binding: vllm}
  rewarder: {mesh: cpu, binding: "topology.fake_bindings:Rewarder"}
loss: {alpha_sdpo: 0, beta_replay: 0}
"""


def test_a_lora_rank_above_what_vllm_serves_is_refused_on_its_line() -> None:
    """vLLM's largest `max_lora_rank` is 512: 512 validates, 513 is refused on `lora.r`'s line (the vllm binding
    declares it as `max_adapter_rank`; without that the engine refused it in the generator after launch)."""
    topo = parse_topology(LORA.replace("RANK", "512"), "lora.yaml")
    assert topo.roles.trainer.settings.lora.r == 512  # type: ignore[union-attr]
    with pytest.raises(TopologyError) as info:
        parse_topology(LORA.replace("RANK", "513"), "lora.yaml")
    [issue] = info.value.errors
    assert (issue.path, issue.line) == ("roles.trainer.settings.lora.r", 6)
    assert "generator binding 'vllm' serves adapters of rank 512 at most" in issue.message
    merged = LORA.replace("RANK", "513").replace("sync: adapter", "sync: merged")
    parse_topology(merged, "lora.yaml")  # merged weights: any rank


@pytest.mark.parametrize(("targets", "expected"), [
    ("[q_proj, qproj]", "roles.trainer.settings.lora.target_modules: 'qproj' names no module of Qwen2ForCausalLM"),
    ("[lm_head]", "'lm_head' matches 'lm_head', the model's LM head"),
])
def test_lora_targets_the_policy_does_not_have_are_refused(targets: str, expected: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Matched against a meta-device skeleton of the policy before launch (it was refused only when the trainer
    built the model); names that exist validate."""
    trainer = "settings: {lr: 0.003, lr_decay_steps: 240}"
    path = edited(tmp_path, "local.yaml", trainer, f"settings: {{lr: 0.003, lora: {{target_modules: {targets}}}}}")
    code, err = validate(path, capsys)
    assert code == EXIT_INVALID and expected in one_line(err)
    path = edited(tmp_path, "local.yaml", trainer, "settings: {lr: 0.003, lora: {target_modules: [q_proj]}}")
    code, err = validate(path, capsys)
    assert code == EXIT_OK, err


def coding_run(tmp_path: Path, sandbox: str) -> Path:
    return edited(tmp_path, "coding.yaml", "sandbox: {mode: bwrap, wall_s: 10, cpu_s: 5, concurrency: 2}",
                  f"sandbox: {sandbox}")


@pytest.mark.parametrize(("sandbox", "expected"), [
    ("{mode: bwrap, python: /opt/nowhere/bin/python3}",
     "run.environment.sandbox.python: /opt/nowhere/bin/python3 is not visible in a bwrap sandbox"),
    ("{mode: bwrap, python: /usr/bin/no-such-python}", "bubblewrap cannot run here"),
    ("{mode: rlimits, python: /opt/nowhere/bin/python3}",
     "the rlimits sandbox cannot run /opt/nowhere/bin/python3"),
])
def test_a_sandbox_interpreter_that_cannot_run_here_is_refused(sandbox: str, expected: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The coding environment runs in the controller's process, on this host: its sandbox is run once before
    launch (`python -c pass` inside it), so an interpreter it cannot start is one line at validate."""
    code, err = validate(coding_run(tmp_path, sandbox), capsys)
    assert code == EXIT_INVALID and expected in one_line(err)
    code, out = validate(coding_run(tmp_path, "{mode: bwrap, python: /usr/bin/python3}"), capsys)
    assert code == EXIT_OK and "checked: sandbox: bwrap runs /usr/bin/python3 here" in out, out
