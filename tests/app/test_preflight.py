"""Setup mistakes are found before launch (`composer-mesh validate`, and `run` before any mesh starts): each is
exit 1 and one line naming the field or file and the fix, with no traceback. A valid topology still passes.

Validation runs in this process (seconds each); `test_run_stops_before_launch` runs `composer-mesh run` on a
few of the mistakes in one fresh interpreter and checks that Monarch was never imported (nothing launched).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_mesh.cli import EXIT_INVALID, EXIT_OK, main
from composer_mesh.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent.parent
# A bound on a check, not a speed claim: each takes ~1-3 s idle; what proves "before launch" is that Monarch was never
# imported. Generous for a loaded CI machine (timings live in benchmarks/).
CHECK_BOUND_S = 120

DATA_RUN = """\
name: datarun
model: {source: tiny, seed: 0MODEL}
meshes:
  trainer:    {backend: local, procs_per_host: 1}
  generators: {backend: local, procs_per_host: 1}
  rewarder:   {backend: local, procs_per_host: 1}
roles:
  trainer: {mesh: trainer, binding: hf}
  generators: {mesh: generators, binding: hf}
  rewarder:
    mesh: rewarder
    binding: python
    settings: {functions: [{path: "REWARD"}]}
loss: {alpha_sdpo: 0.0, beta_replay: 0.0}
run:
  steps: 2
  prompts_per_step: 2
  samples_per_prompt: 2
  eval_prompts: 0
  run_dir: RUN_DIR
  SOURCE
"""
REWARD = "composer_mesh.tasks.arithmetic:exact_match"
ROWS = [{"prompt": f"What is {i} plus one?", "answer": str(i + 1)} for i in range(12)]


def topology(tmp_path: Path, source: str = "data: {path: rows.jsonl}", model: str = "", reward: str = REWARD,
             top: str = "", name: str = "t.yaml") -> Path:
    """A data run (3 local meshes, no teachers) in `tmp_path`, with `rows.jsonl` (ROWS) beside it."""
    write_rows(tmp_path / "rows.jsonl", ROWS)
    text = DATA_RUN.replace("MODEL", model).replace("REWARD", reward).replace("SOURCE", source)
    path = tmp_path / name
    path.write_text(top + text.replace("RUN_DIR", str(tmp_path / "run")))
    return path


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def validate(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, float]:
    """`composer-mesh validate` here: exit code, stderr, seconds."""
    capsys.readouterr()
    start = time.monotonic()
    code = main(["validate", str(path), *extra])
    seconds = time.monotonic() - start
    return code, capsys.readouterr().err, seconds


def one_line(err: str) -> str:
    """The whole error output is one line (no traceback) after `composer-mesh: `; it is returned."""
    lines = [line for line in err.splitlines() if line.strip() and "left out: their prompt" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("composer-mesh: ") and "Traceback" not in err and "bug" not in err
    return lines[0]


# ------------------------------------------------------------------------------------------ data and prompts
def _missing(tmp: Path) -> None:
    (tmp / "rows.jsonl").unlink()


def _empty(tmp: Path) -> None:
    (tmp / "rows.jsonl").write_text("")


def _not_json(tmp: Path) -> None:
    (tmp / "rows.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1])[:-3] + "\n")


def _missing_field(tmp: Path) -> None:
    write_rows(tmp / "rows.jsonl", [*ROWS[:4], {"question": "What is 1 plus 1?", "answer": "2"}, *ROWS[4:]])


def _text_named_parquet(tmp: Path) -> None:
    (tmp / "rows.parquet").write_text((tmp / "rows.jsonl").read_text())


DATA_MISTAKES = {
    "missing": (_missing, "data: {path: rows.jsonl}", ["rows.jsonl: no such file or directory"]),
    "empty": (_empty, "data: {path: rows.jsonl}", ["rows.jsonl: no rows", "empty"]),
    "malformed_row": (_not_json, "data: {path: rows.jsonl}", ["rows.jsonl, row 2: not JSON"]),
    "missing_field": (_missing_field, "data: {path: rows.jsonl}", ["rows.jsonl, row 5, field 'prompt': missing",
                                                                    "question, answer"]),
    "text_named_parquet": (_text_named_parquet, "data: {path: rows.parquet}",
                           ["rows.parquet: not a Parquet file", "data.format"]),
}


@pytest.mark.parametrize("case", sorted(DATA_MISTAKES))
def test_data_mistakes_are_one_line_before_launch(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # run.data paths are relative to where the command runs
    mistake, source, expected = DATA_MISTAKES[case]
    path = topology(tmp_path, source)
    mistake(tmp_path)
    code, err, seconds = validate(path, capsys)
    line = one_line(err)
    assert code == EXIT_INVALID and all(e in line for e in expected), line
    assert seconds < CHECK_BOUND_S


def test_prompts_the_tokenizer_cannot_read_name_the_row_and_the_setting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's character tokenizer (set explicitly: a data run defaults to the byte one) reads only
    the task's characters: the first prompt it cannot encode is named with file and row, and the fix."""
    monkeypatch.chdir(tmp_path)
    path = topology(tmp_path, model=", tokenizer: char")
    code, err, _ = validate(path, capsys)
    line = one_line(err)
    assert code == EXIT_INVALID and "rows.jsonl, row " in line and "cannot represent 'What is" in line
    assert "model.tokenizer: byte" in line


def test_a_prompt_longer_than_the_context_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = topology(tmp_path, model=", max_position_embeddings: 16")  # 19-byte prompts + run.max_new_tokens 4
    code, err, _ = validate(path, capsys)
    line = one_line(err)
    assert code == EXIT_INVALID and "rows.jsonl, row " in line and "more than the policy's context of 16" in line
    assert "raise model.max_position_embeddings" in line


def test_a_data_run_on_the_tiny_model_reads_any_text_by_default(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `model.tokenizer`, a run.data run gets the byte tokenizer and validates (every row encoded);
    the main job (a task run) keeps the character tokenizer and its dump (cache keys, fingerprints)."""
    monkeypatch.chdir(tmp_path)
    path = topology(tmp_path)
    assert load_topology(path).model.tokenizer == "byte"
    code = main(["validate", str(path)])
    out = capsys.readouterr().out
    assert code == EXIT_OK and "run.data: 11 train row(s), 1 eval row(s), all well-formed; 12 prompt(s) encoded" in out
    teacher = "  teachers: {mesh: rewarder, members: [{name: t, binding: hf, channels: [distill]}]}\n"
    path.write_text(path.read_text().replace("loss: {alpha_sdpo: 0.0, beta_replay: 0.0}",
                                             teacher + "loss: {alpha_sdpo: 1.0, beta_replay: 0.0}"))
    assert load_topology(path).roles.teachers.members[0].settings.model.tokenizer == "byte"  # the policy's
    local = load_topology(ROOT / "topologies" / "local.yaml")
    assert local.model.tokenizer == "char" and "tokenizer" not in local.model.model_dump()


def test_a_valid_topology_passes_with_what_was_checked(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", str(ROOT / "topologies" / "local.yaml")])
    out = capsys.readouterr().out
    assert code == EXIT_OK and out.splitlines()[0].startswith("ok: ")
    assert "run.task 'addition': resolves" in out and "encoded by the policy's tokenizer" in out


# ------------------------------------------------------------------------------------------ tasks, datasets
@pytest.mark.parametrize(("model", "source", "field"), [
    (", task: multiplication", "task: addition", "model.task: unknown task 'multiplication'"),
    ("", "task: no_such_task", "run.task: unknown task 'no_such_task'"),
])
def test_unknown_tasks_are_named(model: str, source: str, field: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, err, _ = validate(topology(tmp_path, source, model=model), capsys)
    assert code == EXIT_INVALID and field in one_line(err)


def test_an_unknown_reasoning_gym_dataset_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("reasoning_gym")
    source = "environment: {kind: reasoning_gym, dataset: no_such_dataset, eval_size: 4}"
    code, err, _ = validate(topology(tmp_path, source, reward="composer_mesh.envs.reasoning_gym:score"), capsys)
    line = one_line(err)
    assert code == EXIT_INVALID and "run.environment: reasoning-gym cannot create dataset 'no_such_dataset'" in line


# ------------------------------------------------------------------------------------------ env vars, modules
TEACHER = """\
  teachers:
    mesh: rewarder
    members:
      - name: remote
        binding: openrouter
        channels: [replay]
        settings: {models: [openai/gpt-4o-mini], api_key_env: COMPOSER_MESH_TEST_KEY}
"""


def test_a_missing_api_key_is_named_never_its_value(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("httpx")
    path = topology(tmp_path, "task: addition")
    text = path.read_text().replace("loss: {alpha_sdpo: 0.0, beta_replay: 0.0}", "loss: {alpha_sdpo: 0.0}")
    path.write_text(text.replace("loss:", TEACHER + "loss:", 1).replace("\nloss:", "\nloss:"))
    monkeypatch.setenv("COMPOSER_MESH_TEST_KEY", "   ")  # set but blank: as good as missing
    code, err, _ = validate(path, capsys)
    line = one_line(err)
    assert code == EXIT_INVALID
    assert "roles.teachers.members[0].settings.api_key_env names the environment variable COMPOSER_MESH_TEST_KEY" in line
    monkeypatch.setenv("COMPOSER_MESH_TEST_KEY", "sk-or-secret-value")
    code, err, _ = validate(path, capsys)
    assert code == EXIT_OK and "secret" not in err
    monkeypatch.delenv("COMPOSER_MESH_TEST_KEY")  # given to the procs by a mesh's env: that is enough
    mesh = "rewarder:   {backend: local, procs_per_host: 1"
    path.write_text(path.read_text().replace(mesh, mesh + ", env: {COMPOSER_MESH_TEST_KEY: sk-or-in-yaml}"))
    assert validate(path, capsys)[0] == EXIT_OK


def test_your_own_module_imports_with_python_path(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward function in the user's own directory: a one-line error naming the field and both fixes
    without it; `--python-path DIR` or the topology's `python_path:` (relative to the file) make it import, and
    PYTHONPATH carries it to the procs."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "my_rewards_pf.py").write_text("def score(prompt, completion, answer):\n    return 1.0\n")
    path = topology(tmp_path, "task: addition", reward="my_rewards_pf:score")
    code, err, _ = validate(path, capsys)  # reward functions import with the file: an error at its line
    assert code == EXIT_INVALID and "Traceback" not in err
    line = err.splitlines()[-1]
    assert "t.yaml:13:" in line and "roles.rewarder.settings.functions[0].path" in line
    assert "cannot import module 'my_rewards_pf'" in line and "--python-path DIR" in line and "python_path:" in line

    code, _, _ = validate(path, capsys, "--python-path", str(mine))
    assert code == EXIT_OK and str(mine) in sys.path and str(mine) in os.environ["PYTHONPATH"].split(os.pathsep)

    sys.modules.pop("my_rewards_pf", None)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(mine)])
    listed = topology(tmp_path, "task: addition", reward="my_rewards_pf:score", top="python_path: [mine]\n",
                      name="listed.yaml")
    code, _, _ = validate(listed, capsys)
    assert code == EXIT_OK and sys.path[0] == str(mine)


def test_a_python_path_entry_that_is_no_directory_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    path = topology(tmp_path, "task: addition", top="python_path: [nowhere]\n")
    code, err, _ = validate(path, capsys)
    assert code == EXIT_INVALID and f"python_path[0]: {tmp_path / 'nowhere'} is not a directory" in one_line(err)


def test_procs_get_the_controllers_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """What launch puts in each proc's bootstrap environment: the mesh's own PYTHONPATH, then the controller's."""
    from composer_mesh.mesh.launch import forwarded_python_path

    monkeypatch.setenv("PYTHONPATH", "/a:/b")
    assert forwarded_python_path(None) == {"PYTHONPATH": "/a:/b"}
    assert forwarded_python_path("/mesh") == {"PYTHONPATH": os.pathsep.join(["/mesh", "/a:/b"])}
    monkeypatch.delenv("PYTHONPATH")
    assert forwarded_python_path(None) == {}


# ------------------------------------------------------------------------------------------ run, resume
_RUN_PROBE = """
import contextlib, io, json, sys, time
from composer_mesh.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err, start = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    out.append([code, err.getvalue(), time.monotonic() - start])
out.append("monarch" in sys.modules)
print(json.dumps(out))
"""


def checkpoint(tmp_path: Path, topology_path: Path, state: str) -> Path:
    """A committed run checkpoint for `topology_path`, its trainer replica's state `state`: 'ok' (a real
    one), 'missing' or 'truncated'."""
    import torch

    from composer_mesh.actors.backends.trainer.trainer_state import save_trainer_state
    from composer_mesh.orchestration.checkpoint import CheckpointStore
    from tests.orchestration.test_run_checkpoint import controller_state

    store = CheckpointStore(str(tmp_path / f"ckpt_{state}"))
    store.write_controller(controller_state(1, load_topology(topology_path).training_fingerprint()))
    if state != "missing":
        model = torch.nn.Linear(4, 2)
        save_trainer_state(store.trainer_url(1, 0), model, torch.optim.AdamW(model.parameters()), 1, None)
    if state == "truncated":
        tensors = Path(store.trainer_url(1, 0)) / "state.safetensors"
        tensors.write_bytes(tensors.read_bytes()[:-16])
    store.commit(1, keep=1)
    return Path(store.step_url(1))


def test_resume_from_an_unreadable_trainer_state_stops_before_launch(tmp_path: Path) -> None:
    from composer_mesh.app.preflight import preflight
    from composer_mesh.app.runner import resume_point
    from composer_mesh.orchestration.checkpoint import RunCheckpointError

    path = topology(tmp_path, "task: addition")
    topo = load_topology(path)
    good = resume_point(topo, str(checkpoint(tmp_path, path, "ok")))
    assert any(line.startswith("resume: ") for line in preflight(topo, good))
    for state, expected in (("missing", "no COMPLETE marker"), ("truncated", "truncated or overwritten")):
        point = resume_point(topo, str(checkpoint(tmp_path, path, state)))
        with pytest.raises(RunCheckpointError, match=f"trainer replica 0's state: .*{expected}"):
            preflight(topo, point)


def test_run_stops_before_launch(tmp_path: Path) -> None:
    """`composer-mesh run` on a missing data file, an unreadable prompt, a missing API key and a checkpoint
    whose trainer state is half-written: exit 1 and one line each, in seconds, and Monarch never imported."""
    (tmp_path / "missing").mkdir()
    no_data = topology(tmp_path / "missing", "data: {path: nowhere.jsonl}")
    char = topology(tmp_path, model=", tokenizer: char", name="char.yaml")
    key = topology(tmp_path, "task: addition", name="key.yaml")
    key.write_text(key.read_text().replace("loss: {alpha_sdpo: 0.0, beta_replay: 0.0}", TEACHER + "loss: {alpha_sdpo: 0.0}"))
    resume = topology(tmp_path, "task: addition", name="resume.yaml")
    half = checkpoint(tmp_path, resume, "missing")
    runs = [["run", str(no_data)], ["run", str(char)], ["run", str(key)], ["run", str(resume), "--resume", str(half)]]
    env = {k: v for k, v in os.environ.items() if k != "COMPOSER_MESH_TEST_KEY"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _RUN_PROBE, json.dumps(runs)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300, check=True)
    *results, monarch_imported = json.loads(done.stdout.splitlines()[-1])
    expected = ["nowhere.jsonl: no such file or directory", "cannot represent 'What is",
                "names the environment variable COMPOSER_MESH_TEST_KEY",
                "cannot resume: trainer replica 0's state"]
    for (code, err, seconds), want in zip(results, expected):
        assert code == EXIT_INVALID and want in one_line(err) and seconds < CHECK_BOUND_S, err
    assert monarch_imported is False
