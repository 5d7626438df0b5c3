"""The house rules of docs/architecture.md, checked on the code as it is.

- layers import downward only and no circles at any depth (import-linter; every import counts, function-local
  and TYPE_CHECKING ones included): the contracts live in pyproject.toml;
- `composer_mesh/mesh/` names no role, actor or binding module, not even in a string;
- no library function is longer than 80 lines, except the short allow-list below;
- no class is longer than 300 lines or has more than 25 methods, except the commented allow-list below;
- the topology modules stay under 700 lines each;
- every import line the README, docs/ and examples/ show runs.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "composer_mesh"

# Library functions allowed past 80 lines, each with the reason. Keep this list short.
LONG_FUNCTION_ALLOW_LIST: dict[str, str] = {}
MAX_FUNCTION_LINES = 80
# Classes allowed past the class-size rule, each with the reason. A class that grows past it has usually
# taken on a second job: split it (one component, one job) rather than adding it here.
LARGE_CLASS_ALLOW_LIST: dict[str, str] = {
}
MAX_CLASS_LINES = 300
MAX_CLASS_METHODS = 25
MAX_TOPOLOGY_MODULE_LINES = 700


def test_import_contracts_hold() -> None:
    """`lint-imports` with the contracts in pyproject.toml (layers, no circles, pure loss, cheap configs)."""
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.exists(), f"import-linter is not installed next to {sys.executable} (the test extra has it)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "broken" not in out.stdout.lower().replace("0 broken", "")


def test_mesh_layer_names_no_role_or_actor() -> None:
    """Strings count too: a role table or an actor path in mesh/ would tie the lowest layer to the roles."""
    forbidden = re.compile(
        r"composer_mesh\.(actors|roles|app|orchestration|topology|models)\b"
        r"|\b(TrainerActor|GeneratorActor|RewarderActor|TeacherPoolActor)\b"
        r"|[\"'](trainer|generators|rewarder|teachers)[\"']"
    )
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((PACKAGE / "mesh").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert hits == []


def _functions() -> list[tuple[str, int]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [node.name]
                up = parents.get(node)
                while up is not None:
                    if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.append(up.name)
                    up = parents.get(up)
                where = f"{path.relative_to(ROOT)}:{'.'.join(reversed(names))}"
                out.append((where, node.end_lineno - node.lineno + 1))  # type: ignore[operator]
    return out


def test_no_library_function_over_80_lines() -> None:
    functions = _functions()
    assert len(functions) > 300, "the scan found too few functions: is the package where it used to be?"
    too_long = {where: n for where, n in functions if n > MAX_FUNCTION_LINES}
    assert {w: n for w, n in too_long.items() if w not in LONG_FUNCTION_ALLOW_LIST} == {}
    stale = set(LONG_FUNCTION_ALLOW_LIST) - set(too_long)
    assert stale == set(), "allow-listed functions that are short now (or gone): drop them from the list"


def _classes() -> dict[str, tuple[int, int]]:
    """Every library class as `path:Name` -> (lines, methods defined in its body)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                out[f"{path.relative_to(ROOT)}:{node.name}"] = (node.end_lineno - node.lineno + 1, methods)  # type: ignore[operator]
    return out


def test_no_class_over_300_lines_or_25_methods() -> None:
    classes = _classes()
    assert len(classes) > 100, "the scan found too few classes: is the package where it used to be?"
    large = {w: size for w, size in classes.items() if size[0] > MAX_CLASS_LINES or size[1] > MAX_CLASS_METHODS}
    assert {w: s for w, s in large.items() if w not in LARGE_CLASS_ALLOW_LIST} == {}, "(lines, methods)"
    stale = set(LARGE_CLASS_ALLOW_LIST) - set(large)
    assert stale == set(), "allow-listed classes that are small now (or gone): drop them from the list"


def test_topology_modules_stay_small() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "topology").glob("*.py")}
    assert sizes and max(sizes.values()) <= MAX_TOPOLOGY_MODULE_LINES, sizes


def _shown_import_lines() -> list[tuple[str, str]]:
    """(where, statement) of every `import composer_mesh...` / `from composer_mesh... import ...` shown to users."""
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]
    pattern = re.compile(r"^\s*(from composer_mesh[\w.]* import \(?[^#\n]*|import composer_mesh[\w.]*)")
    out = []
    for path in sources:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            m = pattern.match(line)
            if not m:
                continue
            stmt = m.group(1).strip()
            if stmt.endswith("("):  # a parenthesised import list: take lines up to the closing parenthesis
                body = [stmt]
                for more in lines[n + 1 :]:
                    body.append(more.split("#")[0].strip())
                    if ")" in more:
                        break
                stmt = " ".join(body)
            out.append((f"{path.relative_to(ROOT)}:{n + 1}", stmt))
    return out


def test_docs_and_examples_import_lines_run() -> None:
    """Each import line a user can copy from the README, docs/ or examples/ works, in a fresh interpreter."""
    lines = _shown_import_lines()
    assert any(where.startswith("examples/") for where, _ in lines)
    assert any(where.startswith("README") for where, _ in lines), "the README shows the import surface"
    program = "\n".join(
        f"try:\n    {stmt}\nexcept Exception as e:\n    failed.append({where!r} + ': ' + {stmt!r} + ' -> ' + repr(e))"
        for where, stmt in lines
    )
    code = f"failed = []\n{program}\nprint('\\n'.join(failed))\nraise SystemExit(1 if failed else 0)\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("name", ["launch", "load_topology", "RLLoop", "RunConfig", "MeshFailureError"])
def test_api_surface_has_what_scripts_use(name: str) -> None:
    import composer_mesh.api as api

    assert name in api.__all__ and getattr(api, name) is not None
