"""Print docs/topology.md, generated from the topology schema, the roles' built-in bindings and the shipped files.

    python scripts/render_topology_docs.py > docs/topology.md

tests/topology/test_topology_docs.py fails when the committed file is out of date. The examples are real
`composer-mesh` runs, so the docs show what users see.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from composer_mesh.cli import main as cli_main
from composer_mesh.mesh.spec import MESH_SPECS, MeshSpecBase, SlurmOptions, backend_of
from composer_mesh.roles import ROLE_TABLE, resolve_binding
from composer_mesh.topology import TopologyError, load_topology
from composer_mesh.topology.checks import CROSS_CHECKS, SECTIONS
from composer_mesh.topology.plan import BackendPrice, PriceTable
from composer_mesh.topology.schema import (
    GeneratorsSpec,
    RewarderSpec,
    RolesSpec,
    TeacherSpec,
    TeachersSpec,
    Topology,
    TrainerSpec,
)
from composer_mesh.topology.yaml_errors import field_type, model_of

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python scripts/render_topology_docs.py > docs/topology.md"

# The schema tables, in this order; the models nested in each get their table right after it.
# `MeshSpec` is a union on `backend`: one table per member.
SCHEMA: tuple[tuple[type[BaseModel], str], ...] = (
    (Topology, "top level"),
    *(
        (member, f"meshes.&lt;name&gt; with `backend: {backend_of(member)}` (`{member.__name__}`)")
        for member in MESH_SPECS
    ),
    (SlurmOptions, "meshes.&lt;name&gt;.slurm (`SlurmOptions`)"),
    (RolesSpec, "roles (`RolesSpec`)"),
    (TrainerSpec, "roles.trainer (`TrainerSpec`)"),
    (GeneratorsSpec, "roles.generators (`GeneratorsSpec`)"),
    (RewarderSpec, "roles.rewarder (`RewarderSpec`)"),
    (TeachersSpec, "roles.teachers (`TeachersSpec`)"),
    (TeacherSpec, "roles.teachers.members[] (`TeacherSpec`)"),
)
PRICES: tuple[tuple[type[BaseModel], str], ...] = (
    (PriceTable, "price table (`PriceTable`)"),
    (BackendPrice, "price table: per backend (`BackendPrice`)"),
)

# ---------------------------------------------------------------------------------------------------------
# Field tables
# ---------------------------------------------------------------------------------------------------------


def type_name(tp: Any) -> str:
    """A short readable name of an annotation for the reference tables."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " \\| ".join(f"`{a!r}`" for a in args)
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is tuple:
        return f"tuple of ({', '.join(type_name(a) for a in args)})"
    if origin is dict:
        return f"map {type_name(args[0])} → {type_name(args[1])}"
    if tp is Any or tp is BaseModel:  # BaseModel: a binding's settings, typed by the binding
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return f"`{tp.__name__}`"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def default_text(f: FieldInfo) -> str:
    """The default of a field as the tables show it."""
    if f.is_required():
        return "required"
    value = f.default_factory() if f.default_factory is not None else f.default  # type: ignore[call-arg]
    if isinstance(value, BaseModel):
        return "defaults"
    if isinstance(value, Path):
        return f"`{str(value)!r}`"
    if value == {}:
        return "`{}`"
    if value == []:
        return "`[]`"
    return f"`{value!r}`"


def models_in(tp: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation refers to (through lists, maps and unions)."""
    model = model_of(tp)
    if model is not None:
        return [model]
    return [m for a in get_args(tp) for m in models_in(a)]


def _row(model: type[BaseModel], name: str, f: FieldInfo) -> str:
    desc = (f.description or "").replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")
    return f"| `{name}` | {type_name(field_type(model, name))} | {default_text(f)} | {desc} |"


def field_table(model: type[BaseModel], seen: set[type[BaseModel]], title: str = "") -> str:
    """Markdown table of a model's fields, followed by tables of the models nested in it (not yet `seen`)."""
    seen.add(model)
    doc = (model.__doc__ or "").strip()
    rows = [f"#### {title or model.__name__}", ""]
    if doc and doc != (BaseModel.__doc__ or "").strip():
        rows += [doc.splitlines()[0], ""]
    rows += ["| key | type | default | description |", "|---|---|---|---|"]
    nested: list[type[BaseModel]] = []
    for name, f in model.model_fields.items():
        rows.append(_row(model, name, f))
        tp = field_type(model, name)
        nested += [m for m in models_in(tp) if m not in seen and m not in nested]
    out = "\n".join(rows) + "\n"
    for m in nested:
        if m not in seen:
            out += "\n" + field_table(m, seen)
    return out


def section_models() -> list[tuple[type[BaseModel], str]]:
    """The sections owned by the components, titled with the import path of their model."""
    out = []
    for name in SECTIONS:
        model = model_of(field_type(Topology, name))
        assert model is not None, name
        out.append((model, f"{name} (`{model.__module__}:{model.__qualname__}`)"))
    return out


def binding_reference(seen: set[type[BaseModel]]) -> tuple[str, str]:
    """The table of built-in bindings per role, and the settings table of each."""
    rows = ["| role | name | class | capabilities |", "|---|---|---|---|"]
    tables = []
    for role, entry in ROLE_TABLE.items():
        for name in entry.bindings:
            b = resolve_binding(role, name)
            caps = ", ".join(f"`{c}`" for c in sorted(b.capabilities)) or "—"
            rows.append(f"| {role} | `{name}` | `{b.import_path}` | {caps} |")
            tables.append(field_table(b.settings_model, seen, f"{role} `{name}`: settings"))
    return "\n".join(rows), "\n".join(tables)


# ---------------------------------------------------------------------------------------------------------
# Examples: real runs of the command line on the shipped files
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _plain_terminal() -> Iterator[None]:
    """The same plain 140-column output wherever the docs are generated (no colours forced by CI settings)."""
    fixed = {"COLUMNS": "140", "NO_COLOR": "1", "FORCE_COLOR": None, "TTY_COMPATIBLE": None, "TERM": "dumb"}
    saved = {k: os.environ.get(k) for k in fixed}

    def apply(values: dict[str, str | None]) -> None:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    apply(fixed)
    try:
        yield
    finally:
        apply(saved)


def run_cli(argv: list[str]) -> str:
    """Output of `composer-mesh ...` as a user sees it (stdout + stderr)."""
    buf = io.StringIO()
    with _plain_terminal(), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        cli_main(argv)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def shipped_rows() -> list[str]:
    """One table row per shipped topology (relative to the repository root): its summary or its errors. Each is
    validated as its header says to run it: from a directory holding `models/small-llama`, the model
    `python -m composer_mesh.models.small` builds (topologies/hf_model.yaml reads it)."""
    import tempfile

    from composer_mesh.models.small import build_small_model_dir

    rows = []
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as work:
        build_small_model_dir(Path(work) / "models" / "small-llama")
        os.chdir(work)
        try:
            for path in sorted(Path(here, "topologies").glob("*.yaml")):
                if path.name.startswith("prices"):
                    continue
                shown = path.relative_to(here)
                try:
                    rows.append(f"| `{shown}` | {load_topology(path).summary()} |")
                except TopologyError as e:
                    rows.append(f"| `{shown}` | invalid on purpose: {len(e.errors)} errors (below) |")
        finally:
            os.chdir(here)
    return rows


def examples() -> dict[str, str]:
    """The parts of the page that run the command line, from the repository root (relative paths)."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return {
            "broken": run_cli(["validate", "topologies/broken.yaml"]),
            "plan": run_cli(["plan", "topologies/mixed.yaml", "--prices", "examples/prices.yaml"]),
            "shipped": "\n".join(shipped_rows()),
            "local": (ROOT / "topologies" / "local.yaml").read_text().rstrip(),
        }
    finally:
        os.chdir(cwd)


# ---------------------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------------------


def render_docs() -> str:
    """The whole of docs/topology.md."""
    parts = examples()
    # Every model gets one table: listed ones in their order, nested ones right after their parent.
    sections = section_models()
    seen: set[type[BaseModel]] = {m for m, _ in (*SCHEMA, *sections, *PRICES)} | {MeshSpecBase}
    parts["schema"] = "\n".join(field_table(m, seen, title) for m, title in SCHEMA)
    parts["sections"] = "\n".join(field_table(m, seen, title) for m, title in sections)
    parts["prices"] = "\n".join(field_table(m, seen, title) for m, title in PRICES)
    parts["bindings"], parts["binding_tables"] = binding_reference(seen)
    parts["checks"] = "\n".join(f"- {c}" for c in CROSS_CHECKS)
    return TEMPLATE.format(command=COMMAND, **parts)


TEMPLATE = """\
# Topology files

<!-- Generated by `{command}`; do not edit by hand.
     tests/topology/test_topology_docs.py fails when this file is out of date. -->

A topology file is one YAML that describes a whole run: the **meshes** (where procs run and how many:
this host, Monarch's local process job, or one Slurm job per mesh) and the **roles** placed on them
(trainer, generators, rewarder, teachers), each bound to an implementation with typed settings, plus the
**model**, **loss**, **weights**, **diloco** and **run** sections, typed by the components that own them.

```
composer-mesh validate FILE                       # exit 0 and a summary, or every error with line:column, exit 1
composer-mesh plan FILE [--prices PRICES.yaml] [--hours H]  # what trains, what runs where, the cost per hour and per run
```

From Python: `load_topology(path) -> Topology` raises `TopologyError`, whose `.errors` is a list of
`TopologyIssue(path, line, column, message)`; `Topology` has the typed sections (`t.model`, `t.loss`,
`t.weights`, `t.diloco`, `t.run`), `t.meshes[name]` (a `MeshSpec`: `LocalMeshSpec`, `ProcessMeshSpec` or
`SlurmMeshSpec`, picked by its `backend`), and the roles (`t.trainer`, `t.generators`, `t.rewarder`,
`t.teachers`; the rewarder and the teachers may be None), whose `settings` are instances of the binding's
`Settings` model, whose `resolved` is the binding (class, import path, capabilities) and whose `bound()` is
the binding with its settings as an actor receives it. `t.role_configs()` gives what each role's actors are
built with (`composer_mesh.actors.configs`): exactly the sections that role needs.

Placement: the trainer's replicas split the trainer mesh's procs evenly; there is one generator per proc
and one rewarder per proc of their meshes; teachers go round-robin over the procs of the teacher mesh.
Several roles may share a mesh. A single-turn run needs a rewarder; a multi-turn episode run
(`run.rollout.kind: multi_turn`) has none, since its environment scores the episodes. A `slurm` mesh is one
Slurm job (`SlurmMeshSpec.slurm_job_kwargs` gives the `monarch.job.SlurmJob` arguments); `local` meshes
run on this host (hosts must be 1); `process` meshes use Monarch's `ProcessJob` (one local worker process per
host).

## The CPU default: `topologies/local.yaml`

```yaml
{local}
```

## Shipped topologies

| file | summary |
|---|---|
{shipped}

## Checks across sections

Besides each field's own type and range (unknown keys are errors everywhere), `validate` checks:

{checks}

All errors are collected in one run: the sections are checked independently, and the checks across
sections run on whichever parts are valid.

## Example: errors

`topologies/broken.yaml` is broken on purpose:

```text
$ composer-mesh validate topologies/broken.yaml
{broken}
```

## Example: plan with prices

```text
$ composer-mesh plan topologies/mixed.yaml --prices examples/prices.yaml
{plan}
```

Cost per hour of a mesh = GPUs held × `gpu_hour` + procs × `cpu_proc_hour`, where GPUs held = hosts × GPUs
per node (a Slurm `gpus_per_node` larger than the procs use is paid for too).

Cost per run: a run's length is not known before it runs, so `plan` says which bound it used. `--hours H`
costs every mesh for H hours (take H from a short run: steps ÷ steps per hour); without it, each Slurm mesh is
costed up to its job's `time_limit` (an upper bound: a job that ends sooner costs less), and a priced mesh
without a time limit (`local`, `process`, a Slurm job without one) leaves the cost per run unknown until
`--hours` is given. The price file is [examples/prices.yaml](../examples/prices.yaml).

## Reference: the schema

{schema}
## Reference: built-in bindings

A role's `binding` is one of these names (the role's built-ins in `composer_mesh/roles.py`, `ROLE_TABLE`)
or an import path `package.module:Class` to a class with a `Settings` pydantic model and a `capabilities`
set (see `composer_mesh/bindings.py`). Teachers are the members of the pool. Validating a file that names
only built-ins imports no binding module (their settings are in import-cheap `config.py` modules of
`composer_mesh/actors/backends/<role>/`, so neither torch nor Monarch is imported); a binding named by import
path is imported when the file is validated, to read its `Settings` and `capabilities`.

{bindings}

{binding_tables}
## Reference: sections owned by the components

{sections}
## Reference: price table

{prices}"""


def main() -> int:
    sys.stdout.write(render_docs())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
