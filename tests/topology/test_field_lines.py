"""Every field's error on that field's own line: a bad value written into one field of a valid topology.

The two files of `fields/` cover every section on the real bindings (`single_turn.yaml`: every role, LoRA, a
Slurm mesh, hosted and local teachers; `episodes.yaml`: DiLoCo and a multi-turn run with hints), and the
`run:` blocks below swap in each environment kind and the harness rollout. Each case names a field by its
path, the bad value, and a fragment of the message; the test writes the value in place of the field's (or
adds the key above the first key of its mapping), validates, and expects an issue with exactly that path on
exactly the line the value was written on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from composer_mesh.topology import TopologyError, parse_topology

FIELDS = Path(__file__).parent / "fields"


@dataclass(frozen=True)
class Added:
    """A case's value for a key the base does not have: the key is added, above the first key of its mapping."""

    value: Any = 1


UNKNOWN = Added()  # a key no section has

RUNS = {
    "openenv": """\
  rollout:
    kind: multi_turn
  environment:
    kind: openenv
    url: "http://127.0.0.1:8765"
    episodes: true
    connect_timeout_s: 5
    server:
      command: ["{python}", "-m", "server"]
      ready_timeout_s: 30
""",
    "coding": """\
  rollout:
    kind: multi_turn
    max_turns: 4
  environment:
    kind: coding
    max_turns: 4
    sandbox:
      mode: bwrap
      wall_s: 10
      concurrency: 2
""",
    "verifiers": """\
  rollout:
    kind: multi_turn
  environment:
    kind: verifiers
    taskset: composer_mesh.envs.addition_taskset
    limit: 8
""",
    "harness": """\
  rollout:
    kind: harness
    harness:
      host: 127.0.0.1
      port: 0
      model_name: policy
""",
    "reasoning_gym": """\
  environment:
    kind: reasoning_gym
    dataset: leg_counting
    size: 100
    config:
      min_animals: 1
""",
}


def base(name: str) -> str:
    """The text of a valid topology: a file of `fields/`, or one with the `run:` block of `RUNS[name]`."""
    if name in ("single_turn", "episodes"):
        return (FIELDS / f"{name}.yaml").read_text()
    if name in ("reasoning_gym", "harness"):
        text = (FIELDS / "single_turn.yaml").read_text()
    else:  # without hints, nothing feeds channel 2
        text = (FIELDS / "episodes.yaml").read_text().replace("alpha_sdpo: 0.5", "alpha_sdpo: 0")
    return text[: text.index("\nrun:\n")] + "\nrun:\n" + RUNS[name]


def _node(root: yaml.Node, path: tuple[str | int, ...]) -> tuple[yaml.Node, yaml.Node]:
    """(key or item node, value node) at `path`."""
    key: yaml.Node = root
    node = root
    for el in path:
        if isinstance(el, int):
            key = node = node.value[el]
            continue
        key, node = next((k, v) for k, v in node.value if k.value == el)
    return key, node


def _dotted(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def write_bad(text: str, path: tuple[str | int, ...], value: Any) -> tuple[str, int]:
    """`text` with `value` at `path` (`path`'s last key added when `value` is `Added`), and its 1-based line."""
    root = yaml.compose(text)
    if isinstance(value, Added):
        _, mapping = _node(root, path[:-1])
        first = mapping.value[0][0].start_mark
        line_start = first.index - first.column
        added = " " * first.column + f"{path[-1]}: {json.dumps(value.value)}\n"
        return text[:line_start] + added + text[line_start:], first.line + 1
    key, node = _node(root, path)
    flow = json.dumps(value)
    return text[: node.start_mark.index] + flow + text[node.end_mark.index :], key.start_mark.line + 1


# (base, field path, bad value, fragment of the message)
CASES: list[tuple[str, tuple[str | int, ...], Any, str]] = [
    # Topology, RolesSpec, the specs of each role, the teacher pool and a member (a list item)
    ("single_turn", ("name",), "has space", "name"),
    ("single_turn", ("python_path", 0), 5, "valid string (got 5)"),
    ("single_turn", ("roles", "bogus"), UNKNOWN, "unknown key 'bogus'"),
    ("episodes", ("roles", "trainer", "replicas"), 0, "greater than or equal to 1 (got 0)"),
    ("single_turn", ("roles", "generators", "binding"), "nope", "nope"),
    ("single_turn", ("roles", "rewarder", "mesh"), "nowhere", "unknown mesh"),
    ("single_turn", ("roles", "teachers", "members", 1, "on_failure"), "later", "'skip' or 'stop'"),
    ("single_turn", ("roles", "teachers", "members", 0, "channels", 1), "teach", "'distill', 'replay' or 'hint'"),
    ("single_turn", ("roles", "teachers", "mesh"), 3, "valid string (got 3)"),
    # a binding's settings (a nested settings dict), their nested models and a list item in them
    ("single_turn", ("roles", "trainer", "settings", "lr"), -1, "greater than 0 (got -1)"),
    ("single_turn", ("roles", "trainer", "settings", "lorra"), UNKNOWN, "did you mean 'lora'"),
    ("single_turn", ("roles", "trainer", "settings", "lora", "dropout"), 1.5, "less than 1 (got 1.5)"),
    ("single_turn", ("roles", "trainer", "settings", "lora", "target_modules", 1), 7, "got 7"),
    ("single_turn", ("roles", "trainer", "settings", "betas", 1), 1.5, "less than 1 (got 1.5)"),
    ("single_turn", ("roles", "generators", "settings", "gpu_memory_utilization"), 2, "less than or equal to 1"),
    ("single_turn", ("roles", "rewarder", "settings", "functions", 0, "weight"), "heavy", "number (got a string)"),
    ("single_turn", ("roles", "rewarder", "settings", "shell", 0, "timeout_s"), 0, "greater than 0 (got 0)"),
    ("single_turn", ("roles", "teachers", "members", 0, "settings", "max_batch"), 0, "greater than or equal to 1"),
    ("single_turn", ("roles", "teachers", "members", 0, "settings", "model", "hidden_size"), 4, "greater than or equal to 8"),
    ("single_turn", ("roles", "teachers", "members", 1, "settings", "max_concurrency"), 0, "greater than or equal to 1"),
    ("single_turn", ("roles", "teachers", "members", 1, "settings", "models", 0), " ", "model slugs"),
    # meshes: each backend's member of the union, the Slurm options, a dict value
    ("single_turn", ("meshes", "cpu", "backend"), "kubernetes", "'local', 'process' or 'slurm' (got 'kubernetes')"),
    ("single_turn", ("meshes", "workers", "hosts"), 0, "greater than or equal to 1 (got 0)"),
    ("single_turn", ("meshes", "cpu", "procs_per_host"), "two", "valid integer"),
    ("single_turn", ("meshes", "gpu", "gpus_per_proc"), -1, "got -1"),
    ("single_turn", ("meshes", "gpu", "env", "NCCL_DEBUG"), 5, "valid string (got 5)"),
    ("single_turn", ("meshes", "gpu", "slurm", "time_limit"), "forever", "not a valid Slurm time limit"),
    ("single_turn", ("meshes", "gpu", "slurm", "partitions"), UNKNOWN, "did you mean 'partition'"),
    # model (ModelConfig, WarmStartConfig), loss, weights
    ("single_turn", ("model", "num_heads"), 3, "must divide model.hidden_size"),
    ("single_turn", ("model", "num_kv_heads"), 3, "must divide model.num_heads"),
    ("single_turn", ("model", "warmstart", "batch_size"), 0, "greater than or equal to 1 (got 0)"),
    ("single_turn", ("loss", "eps_low"), 1.5, "eps_low must be < 1"),
    ("single_turn", ("loss", "sdpo_wrapper"), "taid", "needs a schedule"),
    ("single_turn", ("loss", "alpha"), UNKNOWN, "unknown key 'alpha'"),
    ("single_turn", ("loss", "dppo_mask_high"), Added(1.5), "must be in [0, 1], got 1.5"),
    ("single_turn", ("weights", "bucket_mb"), 0, "greater than or equal to 1"),
    ("single_turn", ("weights", "transport"), "pigeon", "got 'pigeon'"),
    # run: RunConfig, a plain union (int >= 0 or 'auto'), a list item, TrackersConfig, ProgressConfig
    ("single_turn", ("run", "steps"), 0, "greater than or equal to 1 (got 0)"),
    ("single_turn", ("run", "samples_per_prompt"), 1, "greater than or equal to 2 (got 1)"),
    ("single_turn", ("run", "teacher_top_k"), -1, "greater than or equal to 0, or 'auto' (got -1)"),
    ("single_turn", ("run", "loggers", 0), "csv", "got 'csv'"),
    ("single_turn", ("run", "trackers", "name"), "", "at least 1 character"),
    ("single_turn", ("run", "progress", "every_steps"), 0, "greater than or equal to 1 (got 0)"),
    ("single_turn", ("run", "trackers", "wandb_project"), Added("elsewhere"), "does not name 'wandb'"),
    ("single_turn", ("run", "task"), "  ", "task must name"),
    # DiLoCo and its outer optimizer; the rollout, its hints; an environment kind (a union discriminator)
    ("episodes", ("diloco", "sync_every"), 0, "greater than or equal to 1 (got 0)"),
    ("episodes", ("diloco", "outer_optimizer", "momentum"), 1.0, "less than 1 (got 1.0)"),
    ("episodes", ("diloco", "replicas"), 3, "replicas"),
    ("episodes", ("run", "rollout", "max_turns"), 0, "greater than or equal to 1 (got 0)"),
    ("episodes", ("run", "rollout", "kind"), "sideways", "got 'sideways'"),
    ("episodes", ("run", "rollout", "hints", "source"), "rule", "exactly when source is rule"),
    ("episodes", ("run", "rollout", "hints", "template"), "no placeholder", "placeholder"),
    ("episodes", ("run", "environment", "kind"), "bogus", "'calculator' or 'coding' (got 'bogus')"),
    ("episodes", ("run", "environment", "min_digits"), 0, "greater than or equal to 1 (got 0)"),
    ("episodes", ("run", "environment", "max_digits"), 1, "min_digits 2 > max_digits 1"),
    ("episodes", ("run", "environment", "eval_size"), 10**6, "more than half"),
    ("episodes", ("run", "environment", "digits"), UNKNOWN, "did you mean 'min_digits'"),
    ("openenv", ("run", "environment", "url"), "ftp://x", "url must be"),
    ("openenv", ("run", "environment", "connect_timeout_s"), 0, "greater than 0 (got 0)"),
    ("openenv", ("run", "environment", "server", "ready_timeout_s"), -1, "greater than 0 (got -1)"),
    ("openenv", ("run", "environment", "server", "command", 0), 3, "valid string (got 3)"),
    ("openenv", ("run", "environment", "episodes"), False, "plays none"),
    ("openenv", ("run", "environment", "reset"), Added({"seed": 1}), "sets ['seed']"),
    ("coding", ("run", "environment", "sandbox", "wall_s"), 0, "got 0"),
    ("coding", ("run", "environment", "sandbox", "mode"), "docker", "got 'docker'"),
    ("coding", ("run", "environment", "max_turns"), 9, "more than run.rollout.max_turns"),
    ("verifiers", ("run", "environment", "limit"), 0, "greater than or equal to 1 (got 0)"),
    ("verifiers", ("run", "environment", "taskset"), "", "at least 1 character"),
    ("harness", ("run", "rollout", "harness", "port"), 70000, "less than or equal to 65535 (got 70000)"),
    ("harness", ("run", "rollout", "harness", "host"), "0.0.0.0", "token_env is required"),
    ("reasoning_gym", ("run", "environment", "size"), 0, "greater than or equal to 1 (got 0)"),
    ("reasoning_gym", ("run", "environment", "config", "seed"), Added(3), "not inside run.environment.config"),
    ("single_turn", ("roles", "teachers", "members", 1, "name"), "local", "used twice"),
    ("episodes", ("diloco", "fragment_sync_delay"), Added(10), "must be <"),
]


def _case_id(case: tuple[str, tuple[str | int, ...], Any, str]) -> str:
    return f"{case[0]}:{_dotted(case[1])}"


@pytest.mark.parametrize("name", ["single_turn", "episodes", *RUNS])
def test_each_base_is_valid(name: str) -> None:
    parse_topology(base(name), f"{name}.yaml")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_a_bad_value_is_reported_on_its_own_line(case: tuple[str, tuple[str | int, ...], Any, str]) -> None:
    name, path, value, fragment = case
    text, line = write_bad(base(name), path, value)
    with pytest.raises(TopologyError) as info:
        parse_topology(text, f"{name}.yaml")
    field = _dotted(path)
    at_field = [i for i in info.value.errors if i.path == field]
    assert at_field, f"no issue at {field}; got:\n{info.value}"
    assert any(i.line == line and fragment in i.message for i in at_field), (
        f"expected {field} at line {line} with {fragment!r}; got:\n{info.value}\n--- file:\n{text}"
    )


def test_every_config_class_is_sampled() -> None:
    """The cases above reach each section's model; a new section without a case fails here."""
    sections = {c[1][0] for c in CASES}
    from composer_mesh.topology.schema import Topology

    assert set(Topology.model_fields) <= sections
