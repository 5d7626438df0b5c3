"""Topology files: one YAML describes every mesh of a run and what runs on it.

This module owns the schema of the mesh part (`MeshSpec`, `SlurmOptions`) and the role part, and composes the
components' own config models (model, loss, weights, diloco, run) into one validated `Topology`.
Validation never imports Monarch; it imports the binding classes named in the file (to check their settings),
so binding modules keep heavy imports inside functions.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from composer_mesh.bindings import Binding, BindingError, import_object
from composer_mesh.mesh.spec import BACKENDS, Identifier, MeshSpec, SlurmJobName, SlurmOptions, StrictModel
from composer_mesh.roles import Role, resolve_binding

def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"



# ---------------------------------------------------------------------------------------------------------
# Roles: each role names a mesh and a binding; `settings` is validated with the binding class's `Settings`.
# Adding a role = one spec class (with its `binding_role`) + one field in `RolesSpec`.
# Adding a binding = one line in `composer_mesh.bindings.BUILTIN` (or an import path in the file).
# ---------------------------------------------------------------------------------------------------------

Channel = Literal["distill", "replay"]
CHANNELS: tuple[Channel, ...] = ("distill", "replay")
# A binding whose class lists this capability always needs a GPU (checked against the mesh's gpus_per_proc).
GPU_CAPABILITY = "gpu"


@functools.cache
def _resolve(role: Role, name: str) -> Binding:
    return resolve_binding(role, name)


def _resolve_or_explain(role: Role, name: str) -> Binding:
    """`resolve_binding` with every failure (including errors raised while importing) as a ValueError."""
    try:
        return _resolve(role, name)
    except BindingError as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # a binding module that fails to import for another reason
        raise ValueError(f"cannot load {role} binding {name!r}: {type(e).__name__}: {e}") from None


class _BoundSpec(StrictModel):
    """A part of a role bound to one implementation: `binding` + its validated `settings`."""

    binding_role: ClassVar[Role]

    @field_validator("binding", check_fields=False)
    @classmethod
    def _binding_resolves(cls, v: str) -> str:
        _resolve_or_explain(cls.binding_role, v)
        return v

    @field_validator("settings", mode="before", check_fields=False)
    @classmethod
    def _settings_typed(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, BaseModel):
            return v
        if v is None:
            v = {}
        name = info.data.get("binding")
        if name is None:  # the binding itself is wrong: that error is reported, settings cannot be checked
            return v
        return _resolve(cls.binding_role, name).parse_settings(v)

    @property
    def resolved(self) -> Binding:
        """The resolved binding (class, import path, capabilities)."""
        return _resolve(self.binding_role, self.binding)  # type: ignore[attr-defined]

    def build(self) -> Any:
        """Instantiate the binding class with the validated settings (what an actor does on its proc)."""
        return self.resolved.build(self.settings)  # type: ignore[attr-defined]


_BINDING_DOC = "Built-in binding name (see the table of built-ins) or an import path `package.module:Class`."
_SETTINGS_DOC = "Settings of the binding, validated with the binding class's `Settings` model."


class TrainerSpec(_BoundSpec):
    """The trainer: `replicas` DiLoCo replicas, each on `procs / replicas` procs of its mesh."""

    binding_role: ClassVar[Role] = "trainer"
    mesh: Identifier = Field(description="Mesh the trainer runs on (a key of `meshes`).")
    binding: str = Field("hf", validate_default=True, description=_BINDING_DOC)
    replicas: int = Field(
        1,
        ge=1,
        description="Trainer replicas. More than 1 needs a `diloco:` section (they synchronise through the "
        "object store); the mesh's procs are split evenly between replicas.",
    )
    settings: Any = Field(default_factory=dict, validate_default=True, description=_SETTINGS_DOC)


class GeneratorsSpec(_BoundSpec):
    """Generators: one generator actor per proc of the mesh."""

    binding_role: ClassVar[Role] = "generator"
    mesh: Identifier = Field(description="Mesh the generators run on; one generator per proc.")
    binding: str = Field("hf", validate_default=True, description=_BINDING_DOC)
    settings: Any = Field(default_factory=dict, validate_default=True, description=_SETTINGS_DOC)


class RewarderSpec(_BoundSpec):
    """Rewarders: one rewarder actor per proc of the mesh."""

    binding_role: ClassVar[Role] = "rewarder"
    mesh: Identifier = Field(description="Mesh the rewarders run on; one rewarder per proc.")
    binding: str = Field("python", validate_default=True, description=_BINDING_DOC)
    settings: Any = Field(default_factory=dict, validate_default=True, description=_SETTINGS_DOC)


class TeacherSpec(_BoundSpec):
    """One teacher of the teacher pool and the loss channels it feeds."""

    binding_role: ClassVar[Role] = "teacher"
    name: Identifier = Field(description="Teacher name, unique in the pool (used in metrics and logs).")
    binding: str = Field(description=_BINDING_DOC)
    channels: list[Channel] = Field(
        min_length=1,
        description="Loss channels this teacher feeds: `distill` (channel 2: per-token distributions over the "
        "student's tokens; binding capability `distill`) and/or `replay` (channel 3: full traces; capability "
        "`replay`).",
    )
    settings: Any = Field(default_factory=dict, validate_default=True, description=_SETTINGS_DOC)

    @field_validator("channels")
    @classmethod
    def _no_repeats(cls, v: list[Channel]) -> list[Channel]:
        if len(set(v)) != len(v):
            raise ValueError(f"channels must not repeat, got {v}")
        return v


class TeachersSpec(StrictModel):
    """The teacher pool: its members are spread round-robin over the procs of one mesh."""

    mesh: Identifier = Field(
        description="Mesh the teacher pool runs on; members go round-robin over its procs."
    )
    members: list[TeacherSpec] = Field(min_length=1, description="The teachers of the pool.")

    @field_validator("members")
    @classmethod
    def _unique_names(cls, v: list[TeacherSpec]) -> list[TeacherSpec]:
        seen: set[str] = set()
        for m in v:
            if m.name in seen:
                raise ValueError(f"teacher name {m.name!r} is used twice; names must be unique")
            seen.add(m.name)
        return v


class RolesSpec(StrictModel):
    """What runs where. Several roles may share a mesh (their actors share its procs)."""

    trainer: TrainerSpec = Field(description="The policy trainer.")
    generators: GeneratorsSpec = Field(description="Rollout generators (sample completions from the policy).")
    rewarder: RewarderSpec = Field(description="Reward functions / graders.")
    teachers: TeachersSpec | None = Field(
        None, description="Teacher pool for loss channels 2 and 3; omit when both channels are off."
    )

    def placements(self) -> list[tuple[str, str]]:
        """(role label, mesh name) for every role present, in file order."""
        out: list[tuple[str, str]] = []
        for name in type(self).model_fields:
            spec = getattr(self, name)
            if spec is not None:
                out.append((name, spec.mesh))
        return out


# ---------------------------------------------------------------------------------------------------------
# Sections owned by other components, typed by their models but imported only when a file is validated.
# ---------------------------------------------------------------------------------------------------------


class LazyModel:
    """Validate a section with a pydantic model named by import path, imported on first use."""

    def __init__(self, import_path: str) -> None:
        self.import_path = import_path

    @functools.cached_property
    def model(self) -> type[BaseModel]:
        cls = import_object(self.import_path)
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            raise TypeError(f"{self.import_path} is not a pydantic model")
        return cls

    def __call__(self, value: Any) -> BaseModel:
        if isinstance(value, BaseModel):
            return value
        return self.model.model_validate({} if value is None else value)

    def __repr__(self) -> str:
        return f"LazyModel({self.import_path!r})"


def _section(import_path: str) -> Any:
    return Annotated[Any, AfterValidator(LazyModel(import_path))]


SECTION_MODELS: dict[str, str] = {
    "model": "composer_mesh.models.config:ModelConfig",
    "loss": "composer_mesh.loss.config:LossConfig",
    "weights": "composer_mesh.mesh.weights:WeightPlaneConfig",
    "diloco": "composer_mesh.mesh.objectstore:DiLoCoConfig",
    "run": "composer_mesh.orchestration.loop:RunConfig",
}
ModelSection = _section(SECTION_MODELS["model"])
LossSection = _section(SECTION_MODELS["loss"])
WeightsSection = _section(SECTION_MODELS["weights"])
DiLoCoSection = _section(SECTION_MODELS["diloco"])
RunSection = _section(SECTION_MODELS["run"])


class Topology(StrictModel):
    """A validated topology file. Sections are instances of their owners' config models."""

    name: SlurmJobName = Field(description="Run name (used in Slurm job names and logs).")
    model: ModelSection = Field(
        default_factory=dict,
        validate_default=True,
        description="The policy model shared by trainer and generators (`ModelConfig`).",
    )
    meshes: dict[Identifier, MeshSpec] = Field(
        min_length=1, description="Mesh name → where it runs and how big it is."
    )
    roles: RolesSpec = Field(description="Role → mesh, binding and settings.")
    loss: LossSection = Field(
        default_factory=dict, validate_default=True, description="The three-channel loss (`LossConfig`)."
    )
    weights: WeightsSection = Field(
        default_factory=dict,
        validate_default=True,
        description="Trainer → generator weight plane (`WeightPlaneConfig`).",
    )
    diloco: DiLoCoSection | None = Field(
        None,
        description="DiLoCo across trainer replicas through an object store (`DiLoCoConfig`); needed exactly "
        "when `roles.trainer.replicas` > 1.",
    )
    run: RunSection = Field(
        default_factory=dict, validate_default=True, description="The built-in RL loop (`RunConfig`)."
    )

    _source: Path | None = PrivateAttr(None)

    @property
    def source(self) -> Path | None:
        """The file this topology was loaded from, if any."""
        return self._source

    @property
    def trainer(self) -> TrainerSpec:
        return self.roles.trainer

    @property
    def generators(self) -> GeneratorsSpec:
        return self.roles.generators

    @property
    def rewarder(self) -> RewarderSpec:
        return self.roles.rewarder

    @property
    def teachers(self) -> TeachersSpec | None:
        return self.roles.teachers

    def roles_on(self, mesh: str) -> list[str]:
        """Role labels placed on `mesh`."""
        return [role for role, m in self.roles.placements() if m == mesh]

    def summary(self) -> str:
        """One line: meshes by backend, procs and GPUs, and where each role runs."""
        backends = ", ".join(
            f"{sum(m.backend == b for m in self.meshes.values())} {b}"
            for b in BACKENDS
            if any(m.backend == b for m in self.meshes.values())
        )
        procs = sum(m.procs for m in self.meshes.values())
        gpus = sum(m.gpus_held for m in self.meshes.values())
        placed = ", ".join(f"{role} → {mesh}" for role, mesh in self.roles.placements())
        n = len(self.meshes)
        return (
            f"topology {self.name!r}: {_plural(n, 'mesh', 'meshes')} ({backends}), {_plural(procs, 'proc')}, "
            f"{_plural(gpus, 'GPU')}; {placed}"
        )

    def slurm_job_name(self, mesh: str) -> str:
        """The Slurm job name of a slurm mesh: its `job_name` option or `<topology>_<mesh>`."""
        spec = self.meshes[mesh]
        return (spec.slurm.job_name if spec.slurm and spec.slurm.job_name else None) or f"{self.name}_{mesh}"


# ---------------------------------------------------------------------------------------------------------
# Errors with file positions
# ---------------------------------------------------------------------------------------------------------

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class TopologyIssue:
    """One problem in a file: dotted field path, 1-based line and column (None when unknown), message."""

    path: str
    line: int | None
    column: int | None
    message: str

    def format(self, source: str | None = None) -> str:
        where = f"{source}:" if source else ""
        if self.line is not None:
            where += f"{self.line}:{self.column}:"
        return f"{where} {self.path or '(file)'}: {self.message}".lstrip()


class TopologyError(ValueError):
    """A topology (or price table) file is invalid; `.errors` lists every problem found."""

    def __init__(self, errors: list[TopologyIssue], source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        n = len(self.errors)
        head = f"{self.source or 'topology'}: {n} error{'s' if n != 1 else ''}"
        return "\n".join([head, *("  " + e.format(self.source) for e in self.errors)])


def _path_str(parts: Sequence[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


class _Doc:
    """A parsed YAML file: the plain data plus the node tree, to turn a field path into a line and column."""

    def __init__(self, text: str) -> None:
        self.issues: list[TopologyIssue] = []
        self.root: yaml.Node | None = None
        self.data: Any = None
        loader = yaml.SafeLoader(text)
        try:
            self.root = loader.get_single_node()
            if self.root is not None:
                self._find_duplicates(self.root, ())
                self.data = loader.construct_document(self.root)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            msg = " ".join(filter(None, [e.context, e.problem]))
            self.issues.append(
                TopologyIssue(
                    "",
                    mark.line + 1 if mark else None,
                    mark.column + 1 if mark else None,
                    f"YAML syntax error: {msg}",
                )
            )
        except yaml.YAMLError as e:
            self.issues.append(TopologyIssue("", None, None, f"YAML error: {e}"))
        finally:
            loader.dispose()

    def _find_duplicates(self, node: yaml.Node, parts: tuple[str | int, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, yaml.Node] = {}
            for key, value in node.value:
                k = str(key.value) if isinstance(key, yaml.ScalarNode) else repr(key.value)
                if k in seen:
                    first = seen[k].start_mark.line + 1
                    self.issues.append(
                        TopologyIssue(
                            _path_str((*parts, k)),
                            key.start_mark.line + 1,
                            key.start_mark.column + 1,
                            f"duplicate key {k!r} (first given on line {first})",
                        )
                    )
                else:
                    seen[k] = key
                self._find_duplicates(value, (*parts, k))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._find_duplicates(item, (*parts, i))

    @staticmethod
    def _child(node: yaml.Node | None, el: str | int) -> tuple[yaml.Node, yaml.Node] | None:
        """(key node or item node, value node) of `el` under `node`, or None."""
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and str(key.value) == str(el):
                    return key, value
        elif isinstance(node, yaml.SequenceNode) and isinstance(el, int) and 0 <= el < len(node.value):
            return node.value[el], node.value[el]
        return None

    def locate(self, loc: Loc, *, key: bool = False) -> tuple[str, int | None, int | None]:
        """Field path, line and column of a pydantic `loc`.

        Elements that are not in the file are pydantic's union tags (dropped) or a missing/defaulted field
        (kept in the path, located at its nearest parent). `key=True` points at the key rather than its value.
        """
        node = self.root
        parts: list[str | int] = []
        mark = node.start_mark if node is not None else None
        last_key: yaml.Node | None = None
        for i, el in enumerate(loc):
            if el == "[key]":
                if last_key is not None:
                    mark = last_key.start_mark
                continue
            found = self._child(node, el)
            if found is None:
                rest = loc[i + 1 :]
                if any(self._child(node, r) is not None for r in rest):
                    continue  # a union tag such as 'function-after[...]'
                parts.extend(r for r in loc[i:] if r != "[key]")
                break
            key_node, value = found
            parts.append(str(el) if isinstance(node, yaml.MappingNode) else el)
            last_key = key_node
            is_last = i == len(loc) - 1
            scalar = isinstance(value, yaml.ScalarNode)
            mark = key_node.start_mark if (key and is_last) or not scalar else value.start_mark
            node = value
        if mark is None:
            return _path_str(parts), None, None
        return _path_str(parts), mark.line + 1, mark.column + 1


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_of(tp: Any) -> type[BaseModel] | None:
    """The pydantic model behind an annotation (through Optional and lazily imported sections), if any."""
    if get_origin(tp) is Annotated:
        for meta in get_args(tp)[1:]:
            if isinstance(meta, AfterValidator) and isinstance(meta.func, LazyModel):
                return _lazy_model(meta.func)
        return _model_of(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType):
        models = [m for m in map(_model_of, get_args(tp)) if m is not None]
        return models[0] if len(models) == 1 else None
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _lazy_model(lazy: LazyModel) -> type[BaseModel] | None:
    try:
        return lazy.model
    except Exception:
        return None


def _field_type(model: type[BaseModel], name: str) -> Any:
    field = model.model_fields[name]
    return Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation


def _model_at(root: type[BaseModel], loc: Loc, data: Any) -> type[BaseModel] | None:
    """The model that validates the mapping at `loc` (to list its allowed keys), if it can be found."""
    tp: Any = root
    raw = data
    for el in loc:
        if el == "[key]":
            continue
        model = _model_of(tp)
        if model is not None:
            if el not in model.model_fields:
                return None
            if el == "settings" and issubclass(model, _BoundSpec):
                name = raw.get("binding") if isinstance(raw, dict) else None
                name = name or model.model_fields["binding"].default
                try:
                    tp = _resolve(model.binding_role, name).settings_model
                except Exception:
                    return None
            else:
                tp = _field_type(model, str(el))
        else:
            while get_origin(tp) is Annotated or get_origin(tp) in (Union, types.UnionType):
                args = [a for a in get_args(tp) if a is not type(None)]
                tp = args[0]
            if get_origin(tp) in (list, dict):
                tp = get_args(tp)[-1]
            else:
                return None
        raw = (
            raw.get(el)
            if isinstance(raw, dict)
            else (raw[el] if isinstance(raw, list) and isinstance(el, int) and el < len(raw) else None)
        )
    return _model_of(tp)


def _describe(err: dict[str, Any], root: type[BaseModel], data: Any) -> str:
    """A message for one pydantic error that says what is wrong and what is allowed."""
    kind, msg, loc = err["type"], err["msg"], tuple(err["loc"])
    if kind == "extra_forbidden":
        model = _model_at(root, loc[:-1], data)
        if model is None:
            return f"unknown key {str(loc[-1])!r}"
        close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown key {str(loc[-1])!r}{hint}; allowed keys: {', '.join(model.model_fields)}"
    if kind == "missing":
        model = _model_at(root, loc[:-1], data)
        field_info = model.model_fields.get(str(loc[-1])) if model is not None else None
        if field_info is not None and get_origin(field_info.annotation) is Literal:
            choices = ", ".join(repr(a) for a in get_args(field_info.annotation))
            return f"required key is missing (one of {choices})"
        return "required key is missing"
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    value = err.get("input")
    if isinstance(value, (int, float, bool)) or value is None or _echoable_choice(kind, value):
        return f"{msg} (got {_short(value)})"
    return msg  # other strings are not echoed: a pasted secret must never appear in an error (line:col points at it)


def _echoable_choice(kind: str, value: Any) -> bool:
    """A short string given for a closed set (a typo like 'kubernetes' for a backend) is safe and useful to echo."""
    return kind in ("literal_error", "enum") and isinstance(value, str) and len(value) <= 24


def _issues_from(
    e: ValidationError, doc: _Doc, root: type[BaseModel], prefix: Loc = ()
) -> list[TopologyIssue]:
    out = []
    for err in e.errors(include_url=False):
        loc = (*prefix, *err["loc"])
        path, line, col = doc.locate(loc, key=err["type"] == "extra_forbidden")
        out.append(TopologyIssue(path, line, col, _describe({**err, "loc": loc}, root, doc.data)))
    return out


def _finish(issues: list[TopologyIssue], source: str | None) -> None:
    unique = list(dict.fromkeys(issues))
    if unique:
        unique.sort(key=lambda i: (i.line is None, i.line or 0, i.column or 0))
        raise TopologyError(unique, source)


M = TypeVar("M", bound=BaseModel)


def _parse(text: str, source: str | None) -> _Doc:
    doc = _Doc(text)
    if doc.root is None and not doc.issues:
        doc.issues.append(TopologyIssue("", 1, 1, "the file is empty"))
    if doc.root is None or (doc.issues and doc.data is None):
        _finish(doc.issues, source)  # nothing to validate
    return doc


def parse_yaml_model(text: str, model: type[M], source: str | None = None) -> M:
    """Validate YAML text with a pydantic model; errors carry field paths and line/column positions."""
    doc = _parse(text, source)
    try:
        result = model.model_validate(doc.data)
    except ValidationError as e:
        doc.issues.extend(_issues_from(e, doc, model))
    except Exception as e:
        doc.issues.append(TopologyIssue("", None, None, f"validation failed: {type(e).__name__}: {e}"))
    _finish(doc.issues, source)
    return result


def _read_text(path: str | os.PathLike[str]) -> str:
    """The file's text; an unreadable file is a TopologyError naming it."""
    try:
        return Path(path).read_text()
    except OSError as e:
        raise TopologyError(
            [TopologyIssue("", None, None, f"cannot read file: {e.strerror or e}")], str(path)
        ) from None


def load_yaml_model(path: str | os.PathLike[str], model: type[M]) -> M:
    """`parse_yaml_model` on a file; an unreadable file is a TopologyError too."""
    text = _read_text(path)
    return parse_yaml_model(text, model, str(path))


# ---------------------------------------------------------------------------------------------------------
# Checks across sections. They run on whatever parts of the file are valid, so one run reports everything.
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Parts:
    """The valid parts of a possibly invalid file (a missing key means that part is invalid)."""

    mesh_names: list[str] = field(default_factory=list)
    meshes: dict[str, MeshSpec] = field(default_factory=dict)
    mesh_refs: dict[str, Loc] = field(default_factory=dict)  # raw `mesh:` values -> where they are
    roles: dict[str, Any] = field(default_factory=dict)  # role label -> valid spec (None = absent)
    sections: dict[str, Any] = field(default_factory=dict)  # section -> valid model (None = absent)


def _try(fn: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, fn()
    except Exception:  # any failure only means "this part is not valid"; the full validation reports why
        return False, None


def _parts_of(data: Any) -> _Parts:
    parts = _Parts()
    if not isinstance(data, dict):
        return parts
    meshes = data.get("meshes")
    if isinstance(meshes, dict):
        parts.mesh_names = [str(k) for k in meshes]
        for name, raw in meshes.items():
            ok, spec = _try(lambda raw=raw: MeshSpec.model_validate(raw))
            if ok:
                parts.meshes[str(name)] = spec
    roles = data.get("roles")
    if isinstance(roles, dict):
        for label, raw in roles.items():
            if isinstance(raw, dict) and isinstance(raw.get("mesh"), str):
                parts.mesh_refs.setdefault(raw["mesh"], ("roles", label, "mesh"))
        for label in RolesSpec.model_fields:
            adapter = TypeAdapter(_field_type(RolesSpec, label))
            ok, spec = _try(lambda label=label, adapter=adapter: adapter.validate_python(roles.get(label)))
            if ok:
                parts.roles[label] = spec
    for name in SECTION_MODELS:
        if name not in data and Topology.model_fields[name].is_required():
            continue
        adapter = TypeAdapter(_field_type(Topology, name))
        raw = data.get(name, None if name == "diloco" else {})
        ok, value = _try(lambda raw=raw, adapter=adapter: adapter.validate_python(raw))
        if ok:
            parts.sections[name] = value
    return parts


def _gpu_need(spec: _BoundSpec) -> str | None:
    """Why a bound role needs GPUs, or None: a `gpu` capability, `settings.device: cuda...` or `settings.gpus > 0`."""
    try:
        binding = spec.resolved
    except Exception:
        return None
    if GPU_CAPABILITY in binding.capabilities:
        return f"binding {spec.binding!r} needs a GPU"  # type: ignore[attr-defined]
    settings = spec.settings  # type: ignore[attr-defined]
    device = getattr(settings, "device", None)
    if isinstance(device, str) and device.startswith("cuda"):
        return f"settings.device is {device!r}"
    gpus = getattr(settings, "gpus", None)
    if isinstance(gpus, int) and gpus > 0:
        return f"settings.gpus is {gpus}"
    return None


def _cross_check(parts: _Parts) -> list[tuple[Loc, str]]:
    """Problems between sections: (field loc, message)."""
    out: list[tuple[Loc, str]] = []
    names = parts.mesh_names
    known = ", ".join(names) or "(none)"

    # Every role's mesh exists; every mesh is used.
    for mesh, loc in parts.mesh_refs.items():
        if names and mesh not in names:
            out.append((loc, f"unknown mesh {mesh!r}; meshes are: {known}"))
    if parts.mesh_refs or parts.roles:
        for name in names:
            if name not in parts.mesh_refs:
                out.append(
                    (
                        ("meshes", name),
                        f"mesh {name!r} is not used by any role (remove it or place a role on it)",
                    )
                )

    # GPU roles need GPU meshes.
    bound: list[tuple[Loc, _BoundSpec, str]] = []
    for label, spec in parts.roles.items():
        if isinstance(spec, _BoundSpec):
            bound.append((("roles", label, "mesh"), spec, spec.mesh))  # type: ignore[attr-defined]
        elif isinstance(spec, TeachersSpec):
            for i, member in enumerate(spec.members):
                bound.append((("roles", label, "members", i, "binding"), member, spec.mesh))
    for loc, spec, mesh in bound:
        need = _gpu_need(spec)
        mesh_spec = parts.meshes.get(mesh)
        if need and mesh_spec is not None and mesh_spec.gpus_per_proc == 0:
            out.append((loc, f"needs GPUs ({need}) but mesh {mesh!r} is CPU-only (gpus_per_proc: 0)"))

    # Teacher channels need the matching binding capability; loss channels need a teacher feeding them.
    teachers = parts.roles.get("teachers", "invalid")
    if isinstance(teachers, TeachersSpec):
        for i, member in enumerate(teachers.members):
            caps = member.resolved.capabilities
            for j, channel in enumerate(member.channels):
                if channel not in caps:
                    out.append(
                        (
                            ("roles", "teachers", "members", i, "channels", j),
                            f"teacher {member.name!r} (binding {member.binding!r}) cannot feed channel {channel!r}: "
                            f"its capabilities are {sorted(caps) or 'none'}, and {channel!r} needs capability {channel!r}",
                        )
                    )
    loss = parts.sections.get("loss")
    if loss is not None and teachers != "invalid":
        feeding = {c for m in (teachers.members if teachers else []) for c in m.channels}
        for weight, channel in (("alpha_sdpo", "distill"), ("beta_replay", "replay")):
            value = getattr(loss, weight, 0) or 0
            if value > 0 and channel not in feeding:
                out.append(
                    (
                        ("loss", weight),
                        f"loss.{weight} = {value} but no teacher has channel {channel!r}; set loss.{weight}: 0 "
                        f"or add a teacher with channels: [{channel}]",
                    )
                )

    # Slurm meshes that may share a node (not exclusive, same partition) need different worker ports.
    ports: dict[tuple[str | None, int], str] = {}
    for name, spec in parts.meshes.items():
        if spec.backend != "slurm" or spec.slurm is None or spec.slurm.exclusive:
            continue
        slot = (spec.slurm.partition, spec.slurm.monarch_port)
        if slot in ports:
            out.append(
                (
                    ("meshes", name, "slurm", "monarch_port"),
                    f"meshes {ports[slot]!r} and {name!r} may share a node (exclusive: false, same partition) and "
                    f"would both bind port {slot[1]}; give one of them another slurm.monarch_port",
                )
            )
        else:
            ports[slot] = name

    # Trainer replicas: DiLoCo exactly when replicas > 1, and the mesh must hold them.
    trainer = parts.roles.get("trainer")
    if isinstance(trainer, TrainerSpec):
        if "diloco" in parts.sections:
            diloco = parts.sections["diloco"]
            if diloco is not None and trainer.replicas == 1:
                out.append(
                    (
                        ("diloco",),
                        "diloco is configured but roles.trainer.replicas is 1; "
                        "set replicas > 1 or remove the diloco section",
                    )
                )
            if diloco is None and trainer.replicas > 1:
                out.append(
                    (
                        ("roles", "trainer", "replicas"),
                        f"replicas = {trainer.replicas} needs a diloco "
                        "section (replicas synchronise through the object store)",
                    )
                )
            dr = getattr(diloco, "replicas", None)
            if diloco is not None and trainer.replicas > 1 and dr is not None and dr != trainer.replicas:
                out.append(
                    (
                        ("diloco", "replicas"),
                        f"diloco.replicas = {dr} but roles.trainer.replicas = "
                        f"{trainer.replicas}; they must match",
                    )
                )
        mesh = parts.meshes.get(trainer.mesh)
        if mesh is not None and (trainer.replicas > mesh.procs or mesh.procs % trainer.replicas):
            out.append(
                (
                    ("roles", "trainer", "replicas"),
                    f"replicas = {trainer.replicas} cannot be split evenly "
                    f"over the {mesh.procs} procs of mesh {trainer.mesh!r} (hosts × procs_per_host)",
                )
            )
    return out


def parse_topology(text: str, source: str | None = None) -> Topology:
    """Validate topology YAML text; raises TopologyError listing every problem with its line and column."""
    doc = _parse(text, source)
    topology: Topology | None = None
    try:
        topology = Topology.model_validate(doc.data)
    except ValidationError as e:
        doc.issues.extend(_issues_from(e, doc, Topology))
    except Exception as e:  # a component validator that raised something other than ValueError
        doc.issues.append(TopologyIssue("", None, None, f"validation failed: {type(e).__name__}: {e}"))
    for loc, message in _cross_check(_parts_of(doc.data)):
        path, line, col = doc.locate(loc)
        doc.issues.append(TopologyIssue(path, line, col, message))
    _finish(doc.issues, source)
    assert topology is not None
    return topology


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Load and validate a topology file. Raises TopologyError (all problems, with lines) if it is invalid."""
    text = _read_text(path)
    topology = parse_topology(text, str(path))
    topology._source = Path(path)
    return topology


# ---------------------------------------------------------------------------------------------------------
# Generated reference: `python -m composer_mesh.topology --docs > docs/topology.md`
# ---------------------------------------------------------------------------------------------------------

CROSS_CHECKS: tuple[str, ...] = (
    "every role's `mesh` is a key of `meshes`, and every mesh is used by some role",
    "a role that needs GPUs (its binding lists capability `gpu`, or its settings have `device: cuda...` or "
    "`gpus > 0`) is not on a mesh with `gpus_per_proc: 0`",
    "a teacher's channel `distill` / `replay` needs the binding capability of the same name "
    "(e.g. `openrouter` gives no per-token distributions, so it cannot feed `distill`)",
    "`loss.alpha_sdpo > 0` needs a teacher with channel `distill`; `loss.beta_replay > 0` needs a teacher with "
    "channel `replay` (both default to 1.0, so set them to 0 to run without teachers)",
    "`diloco` is given exactly when `roles.trainer.replicas > 1`, and `diloco.replicas` equals it",
    "the trainer mesh's procs (hosts × procs_per_host) split evenly into `roles.trainer.replicas`",
    "Slurm meshes that may share a node (`exclusive: false`, same partition) use different `monarch_port`s",
    "binding names and import paths resolve to a class with a `Settings` model, and `settings` validate with it",
    "duplicate keys anywhere in the file are errors (YAML would silently keep the last one)",
)

_ROOT = Path(__file__).resolve().parents[2]


def _type_name(tp: Any) -> str:
    """A short readable name of an annotation for the reference tables."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        for meta in args[1:]:
            if isinstance(meta, AfterValidator) and isinstance(meta.func, LazyModel):
                return f"`{meta.func.import_path.rsplit(':', 1)[-1]}`"
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(f"`{a!r}`" for a in args)
    if origin in (Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is tuple:
        return f"tuple of ({', '.join(_type_name(a) for a in args)})"
    if origin is dict:
        return f"map {_type_name(args[0])} → {_type_name(args[1])}"
    if tp is Any:
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return f"`{tp.__name__}`"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _default(f: Any) -> str:
    if f.is_required():
        return "required"
    value = f.default_factory() if f.default_factory is not None else f.default
    if isinstance(value, BaseModel):
        return "defaults"
    if isinstance(value, Path):
        return f"`{str(value)!r}`"
    return f"`{value!r}`" if value not in ({}, []) else ("`{}`" if value == {} else "`[]`")


def _models_in(tp: Any) -> list[type[BaseModel]]:
    model = _model_of(tp)
    if model is not None:
        return [model]
    return [m for a in get_args(tp) for m in _models_in(a)]


def _field_table(model: type[BaseModel], seen: set[type[BaseModel]] | None = None, title: str = "") -> str:
    """Markdown table of a model's fields, followed by tables of the models nested in it."""
    seen = seen if seen is not None else set()
    seen.add(model)
    doc = (model.__doc__ or "").strip()
    rows = [f"#### {title or model.__name__}", ""]
    if doc and doc != (BaseModel.__doc__ or "").strip():
        rows += [doc.splitlines()[0], ""]
    rows += ["| key | type | default | description |", "|---|---|---|---|"]
    nested: list[type[BaseModel]] = []
    for name, f in model.model_fields.items():
        tp = _field_type(model, name)
        desc = (f.description or "").replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")
        rows.append(f"| `{name}` | {_type_name(tp)} | {_default(f)} | {desc} |")
        nested += [m for m in _models_in(tp) if m not in seen and m not in nested]
    out = "\n".join(rows) + "\n"
    for m in nested:
        if m not in seen:
            out += "\n" + _field_table(m, seen)
    return out


def _run_cli(argv: list[str]) -> str:
    """Output of `composer-mesh ...` as a user sees it (stdout + stderr), for the docs."""
    import contextlib
    import io

    from composer_mesh.cli import main as cli_main

    buf = io.StringIO()
    # The same plain 140-column output wherever the docs are generated (no colours forced by CI settings).
    fixed = {"COLUMNS": "140", "NO_COLOR": "1", "FORCE_COLOR": None, "TTY_COMPATIBLE": None, "TERM": "dumb"}
    saved = {k: os.environ.get(k) for k in fixed}
    try:
        for k, v in fixed.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            cli_main(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def render_docs() -> str:
    """The whole of docs/topology.md, generated from the schema, the bindings and the shipped files."""
    from composer_mesh.bindings import BUILTIN

    cwd = os.getcwd()
    os.chdir(_ROOT)  # relative paths in the examples
    try:
        broken = _run_cli(["validate", "topologies/broken.yaml"])
        plan = _run_cli(["plan", "topologies/mixed.yaml", "--prices", "topologies/prices.example.yaml"])
        shipped = []
        for path in sorted(Path("topologies").glob("*.yaml")):
            if path.name.startswith("prices"):
                continue
            try:
                shipped.append(f"| `{path}` | {load_topology(path).summary()} |")
            except TopologyError as e:
                shipped.append(f"| `{path}` | invalid on purpose: {len(e.errors)} errors (below) |")
    finally:
        os.chdir(cwd)

    local = (_ROOT / "topologies" / "local.yaml").read_text().rstrip()
    from composer_mesh.topology.plan import BackendPrice, PriceTable

    ours: list[tuple[type[BaseModel], str]] = [
        (Topology, "top level"),
        (MeshSpec, "meshes.&lt;name&gt; (`MeshSpec`)"),
        (SlurmOptions, "meshes.&lt;name&gt;.slurm (`SlurmOptions`)"),
        (RolesSpec, "roles (`RolesSpec`)"),
        (TrainerSpec, "roles.trainer (`TrainerSpec`)"),
        (GeneratorsSpec, "roles.generators (`GeneratorsSpec`)"),
        (RewarderSpec, "roles.rewarder (`RewarderSpec`)"),
        (TeachersSpec, "roles.teachers (`TeachersSpec`)"),
        (TeacherSpec, "roles.teachers.members[] (`TeacherSpec`)"),
    ]
    owned = [(LazyModel(path).model, f"{name} (`{path}`)") for name, path in SECTION_MODELS.items()]
    # Every model gets one table: listed ones in this order, nested ones right after their parent.
    seen: set[type[BaseModel]] = {m for m, _ in ours + owned} | {PriceTable, BackendPrice}
    schema = "\n".join(_field_table(m, seen, title) for m, title in ours)
    sections = "\n".join(_field_table(m, seen, title) for m, title in owned)
    prices = (
        _field_table(PriceTable, seen, "price table (`PriceTable`)")
        + "\n"
        + _field_table(BackendPrice, seen, "price table: per backend (`BackendPrice`)")
    )
    bindings = ["| role | name | class | capabilities |", "|---|---|---|---|"]
    binding_tables = []
    for role, names in BUILTIN.items():
        for name, path in names.items():
            try:
                b = _resolve(role, name)
            except Exception as e:
                bindings.append(f"| {role} | `{name}` | `{path}` (not importable: {type(e).__name__}) | |")
                continue
            caps = ", ".join(f"`{c}`" for c in sorted(b.capabilities)) or "—"
            bindings.append(f"| {role} | `{name}` | `{path}` | {caps} |")
            binding_tables.append(_field_table(b.settings_model, seen, f"{role} `{name}`: settings"))

    checks = "\n".join(f"- {c}" for c in CROSS_CHECKS)
    return f"""# Topology files

<!-- Generated by `python -m composer_mesh.topology --docs > docs/topology.md`; do not edit by hand.
     tests/topology/test_topology_docs.py fails when this file is out of date. -->

A topology file is one YAML that describes a whole run: the **meshes** (where procs run and how many:
this host, Monarch's local process job, or one Slurm job per mesh) and the **roles** placed on them
(trainer, generators, rewarder, teachers), each bound to an implementation with typed settings, plus the
**model**, **loss**, **weights**, **diloco** and **run** sections, typed by the components that own them.

```
composer-mesh validate FILE                       # exit 0 and a summary, or every error with line:column, exit 1
composer-mesh plan FILE [--prices PRICES.yaml]     # what runs where, GPUs, and the cost per hour
```

From Python: `load_topology(path) -> Topology` raises `TopologyError`, whose `.errors` is a list of
`TopologyIssue(path, line, column, message)`; `Topology` has the typed sections (`t.model`, `t.loss`,
`t.weights`, `t.diloco`, `t.run`), `t.meshes[name]` (`MeshSpec`), and the roles (`t.trainer`,
`t.generators`, `t.rewarder`, `t.teachers`), whose `settings` are instances of the binding's `Settings`
model and whose `resolved` is the binding (class, import path, capabilities).

Placement: the trainer's replicas split the trainer mesh's procs evenly; there is one generator per proc
and one rewarder per proc of their meshes; teachers go round-robin over the procs of the teacher mesh.
Several roles may share a mesh. A `slurm` mesh is one Slurm job (`MeshSpec.slurm_job_kwargs` gives the
`monarch.job.SlurmJob` arguments); `local` meshes run on this host (hosts must be 1); `process` meshes use
Monarch's `ProcessJob` (one local worker process per host).

## The CPU default: `topologies/local.yaml`

```yaml
{local}
```

## Shipped topologies

| file | summary |
|---|---|
{chr(10).join(shipped)}

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
$ composer-mesh plan topologies/mixed.yaml --prices topologies/prices.example.yaml
{plan}
```

Cost per hour of a mesh = GPUs held × `gpu_hour` + procs × `cpu_proc_hour`, where GPUs held = hosts × GPUs
per node (a Slurm `gpus_per_node` larger than the procs use is paid for too).

## Reference: the schema

{schema}
## Reference: built-in bindings

A role's `binding` is one of these names or an import path `package.module:Class` to a class with a
`Settings` pydantic model and a `capabilities` set (see `composer_mesh/bindings.py`).

{chr(10).join(bindings)}

{chr(10).join(binding_tables)}
## Reference: sections owned by the components

{sections}
## Reference: price table

{prices}"""


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m composer_mesh.topology --docs`: print docs/topology.md."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m composer_mesh.topology", allow_abbrev=False)
    parser.add_argument("--docs", action="store_true", help="print the generated docs/topology.md")
    args = parser.parse_args(argv)
    if not args.docs:
        parser.print_help()
        return 2
    sys.stdout.write(render_docs())
    return 0


if __name__ == "__main__":
    from composer_mesh.topology import main as _main  # the importable module's classes, not __main__'s

    raise SystemExit(_main())
