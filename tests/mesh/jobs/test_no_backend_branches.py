"""No code outside `composer_mesh/mesh/jobs/` and the `MeshSpec` union members branches on a mesh's backend.

A backend is one module of `mesh/jobs/` and one member of `mesh.spec.MeshSpec`; everything else asks the member
(`host_gpus()`, `job_name()`, `launch_summary()`, `check_meshes()`) or the job (`Job` protocol). This scans the
package's syntax trees for the ways a branch is written: comparing a `backend` (`==`, `!=`, `in`, `is`), comparing
anything with a backend's name, `match` on one, `isinstance` / `issubclass` / `type(...) is` with a member class,
`hasattr` / `getattr` of a field only some members have, and indexing a table by `.backend` or a backend's name.
"""

from __future__ import annotations

import ast
from pathlib import Path

from composer_mesh.mesh.spec import BACKENDS, MESH_SPECS, MeshSpecBase

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "composer_mesh"
JOBS = PACKAGE / "mesh" / "jobs"
SPEC = PACKAGE / "mesh" / "spec.py"

MEMBERS = {m.__name__ for m in MESH_SPECS}
# Fields only some members have: asking whether a spec has one is asking which backend it is.
MEMBER_FIELDS = {f for m in MESH_SPECS for f in m.model_fields} - set(MeshSpecBase.model_fields)
BRANCH_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _is_backend(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "backend") or (
        isinstance(node, ast.Attribute) and node.attr == "backend"
    )


def _names_backend(node: ast.AST) -> bool:
    """A backend's name, or a literal collection holding one."""
    if isinstance(node, ast.Constant):
        return node.value in BACKENDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_backend(e) for e in node.elts)
    return False


def _names_member(node: ast.AST) -> bool:
    """A member class, or a tuple of classes holding one."""
    if isinstance(node, (ast.Name, ast.Attribute)):
        return (node.id if isinstance(node, ast.Name) else node.attr) in MEMBERS
    if isinstance(node, ast.Tuple):
        return any(_names_member(e) for e in node.elts)
    return False


def _branch(node: ast.AST) -> str | None:
    """What kind of backend branch `node` is, or None."""
    if isinstance(node, ast.Compare) and any(isinstance(op, BRANCH_OPS) for op in node.ops):
        sides = [node.left, *node.comparators]
        if any(_is_backend(s) for s in sides):
            return "compares a backend"
        if any(_names_backend(s) for s in sides):
            return "compares with a backend's name"
        if any(isinstance(s, ast.Call) and getattr(s.func, "id", "") == "type" for s in sides) and any(
            _names_member(s) for s in sides
        ):
            return "compares a type with a MeshSpec member"
    if isinstance(node, ast.Match) and (_is_backend(node.subject) or any(
        _names_backend(p.pattern.value) if isinstance(p.pattern, ast.MatchValue) else
        isinstance(p.pattern, ast.MatchClass) and _names_member(p.pattern.cls) for p in node.cases
    )):
        return "matches on a backend"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
        if node.func.id in ("isinstance", "issubclass") and _names_member(node.args[1]):
            return f"{node.func.id} with a MeshSpec member"
        if node.func.id in ("hasattr", "getattr") and isinstance(node.args[1], ast.Constant) and (
            node.args[1].value in MEMBER_FIELDS
        ):
            return f"{node.func.id} of a field only some backends have"
    if isinstance(node, ast.Subscript) and (_is_backend(node.slice) or _names_backend(node.slice)):
        return "indexes a table by backend"
    return None


def backend_branches(source: str, allowed_classes: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, what) of every backend branch in `source`, except inside the classes named `allowed_classes`."""
    tree = ast.parse(source)
    allowed = {
        id(inner)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef) and cls.name in allowed_classes
        for inner in ast.walk(cls)
    }
    return sorted(
        (node.lineno, what)
        for node in ast.walk(tree)
        if id(node) not in allowed and (what := _branch(node)) is not None
    )


def test_no_backend_branch_outside_the_jobs_package_and_the_spec_members() -> None:
    hits = []
    scanned = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        if JOBS in path.parents:
            continue
        scanned += 1
        allowed = frozenset(MEMBERS) if path == SPEC else frozenset()
        hits += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in backend_branches(path.read_text(), allowed)]
    assert scanned > 100, "the scan found too few modules: is the package where it used to be?"
    assert hits == [], "backend branches outside composer_mesh/mesh/jobs/ (ask the MeshSpec member or the Job):\n" + (
        "\n".join(hits)
    )


def test_the_scan_finds_every_kind_of_branch() -> None:
    source = '''
if spec.backend == "slurm": pass
if backend in ("local", "process"): pass
if spec.backend != other: pass
if kind == "slurm": pass
match spec.backend:
    case "local": pass
match spec:
    case SlurmMeshSpec(): pass
if isinstance(spec, (LocalMeshSpec, ProcessMeshSpec)): pass
if type(spec) is SlurmMeshSpec: pass
if hasattr(spec, "gpu_offset"): pass
options = getattr(spec, "slurm", None)
job = {"local": a, "slurm": b}[spec.backend]
if by_backend["slurm"]: pass

class SlurmMeshSpec:
    def check(self, other):
        return isinstance(other, SlurmMeshSpec)
'''
    found = backend_branches(source, frozenset({"SlurmMeshSpec"}))
    assert [line for line, _ in found] == [2, 3, 4, 5, 6, 8, 10, 11, 12, 13, 14, 15]
    assert backend_branches("counts = Counter(m.backend for m in meshes)\nname = spec.job_name(run, mesh)\n") == []
