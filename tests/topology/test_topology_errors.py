"""Broken topology files: each names the field and the line of every problem.

Every file in `broken/` states what it must produce in its first lines:
    # expect: <field path> line <n>: <message substring>
and the test asserts that exactly such an issue (path, line and message) is reported. The files use the
test bindings of `fake_bindings.py` so they do not depend on the real backends.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from composer_mesh.topology import TopologyError, TopologyIssue, load_topology, parse_topology

BROKEN = Path(__file__).parent / "broken"
EXPECT = re.compile(r"^# expect: (\S+) line (\d+): (.+)$")
FILES = sorted(BROKEN.glob("*.yaml"))


def expectations(path: Path) -> list[tuple[str, int, str]]:
    out = []
    for line in path.read_text().splitlines():
        m = EXPECT.match(line)
        if not m:
            break
        field = "" if m[1] == "(file)" else m[1]
        out.append((field, int(m[2]), m[3]))
    return out


def test_at_least_twenty_distinct_broken_files() -> None:
    assert len(FILES) >= 20
    firsts = {(path, fragment) for path, _, fragment in (expectations(f)[0] for f in FILES)}
    assert len(firsts) == len(FILES), "two broken files expect the same error"


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_broken_file_names_field_and_line(path: Path) -> None:
    expected = expectations(path)
    assert expected, f"{path.name} has no '# expect:' header"
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    issues = info.value.errors
    for field, line, fragment in expected:
        matching = [i for i in issues if i.path == field and i.line == line and fragment in i.message]
        assert matching, (
            f"{path.name}: no issue {field!r} at line {line} containing {fragment!r}; got:\n{info.value}"
        )
        assert all(i.column is not None and i.column >= 1 for i in matching)
    # the readable form names the file, the line and the field
    text = str(info.value)
    assert str(path) in text
    field, line, _ = expected[0]
    assert f"{path}:{line}:" in text
    assert (field or "(file)") in text


def test_all_errors_are_collected_in_one_run() -> None:
    """Schema errors in several sections and cross-section errors come back together, sorted by line."""
    text = """\
name: t
meshes:
  cpu: {backend: local, hosts: 3}
  gpu: {backend: slurm, gpus_per_proc: 1, slurm: {mem: lots}}
roles:
  trainer: {mesh: cpu, binding: "topology.fake_bindings:Trainer", replicas: 2}
  generators: {mesh: nowhere, binding: "topology.fake_bindings:Generator", settings: {max_batch: 0}}
  rewarder: {mesh: gpu, binding: nope}
  teachers:
    mesh: cpu
    members:
      - {name: a, binding: "topology.fake_bindings:APITeacher", channels: [distill]}
loss: {alpha_sdpo: 1, beta_replay: 0, bogus: 1}
run: {steps: -1}
"""
    with pytest.raises(TopologyError) as info:
        parse_topology(text, "inline.yaml")
    got = {(i.path, i.line) for i in info.value.errors}
    assert {
        ("meshes.cpu.hosts", 3),
        ("meshes.gpu.slurm.mem", 4),
        ("roles.trainer.replicas", 6),  # needs diloco
        ("roles.generators.mesh", 7),  # unknown mesh
        ("roles.generators.settings.max_batch", 7),
        ("roles.rewarder.binding", 8),
        ("roles.teachers.members[0].channels[0]", 12),  # API teacher cannot distill
        ("loss.bogus", 13),
        ("run.steps", 14),
    } <= got
    lines = [i.line for i in info.value.errors]
    assert lines == sorted(lines)


def test_columns_point_at_the_value_or_the_key() -> None:
    text = "name: t\nmeshes:\n  cpu: {backend: local, procs_per_host: -1, colour: red}\n"
    with pytest.raises(TopologyError) as info:
        parse_topology(text)
    by_path = {i.path: i for i in info.value.errors}
    procs = by_path["meshes.cpu.procs_per_host"]
    assert (procs.line, procs.column) == (3, text.splitlines()[2].index("-1") + 1)
    extra = by_path["meshes.cpu.colour"]  # an unknown key points at the key itself
    assert (extra.line, extra.column) == (3, text.splitlines()[2].index("colour") + 1)
    assert (
        "allowed keys: backend, hosts, procs_per_host, gpus_per_proc, env, spare, gpu_offset, gpu_devices"
        in extra.message  # a local mesh's keys: its member of the MeshSpec union has no `slurm`
    )


def test_duplicate_keys_are_reported_anywhere() -> None:
    text = "name: t\nname: u\nmeshes:\n  cpu: {backend: local, backend: process}\n"
    with pytest.raises(TopologyError) as info:
        parse_topology(text)
    dups = [(i.path, i.line) for i in info.value.errors if "duplicate key" in i.message]
    assert dups == [("name", 2), ("meshes.cpu.backend", 4)]


def test_missing_file_is_a_topology_error(tmp_path: Path) -> None:
    with pytest.raises(TopologyError) as info:
        load_topology(tmp_path / "nope.yaml")
    assert info.value.errors[0].line is None
    assert "cannot read file" in str(info.value)


def test_issue_format() -> None:
    issue = TopologyIssue("roles.trainer.mesh", 7, 3, "unknown mesh 'x'")
    assert issue.format("f.yaml") == "f.yaml:7:3: roles.trainer.mesh: unknown mesh 'x'"
    assert TopologyIssue("", None, None, "boom").format() == "(file): boom"


def test_a_crashing_component_validator_is_reported_not_raised() -> None:
    text = """\
name: t
meshes:
  cpu: {backend: local}
roles:
  trainer: {mesh: cpu, binding: "topology.fake_bindings:Trainer"}
  generators: {mesh: cpu, binding: "topology.fake_bindings:Generator"}
  rewarder: {mesh: cpu, binding: "topology.fake_bindings:CrashingRewarder", settings: {value: 13}}
  teachers: {mesh: nowhere, members: [{name: a, binding: "topology.fake_bindings:LocalTeacher", channels: [replay]}]}
loss: {alpha_sdpo: 0, beta_replay: 0}
"""
    with pytest.raises(TopologyError) as info:
        parse_topology(text)
    messages = [(e.path, e.message) for e in info.value.errors]
    assert ("", "validation failed: OSError: unlucky settings validator") in messages
    assert any(path == "roles.teachers.mesh" for path, _ in messages)  # the other checks still ran
