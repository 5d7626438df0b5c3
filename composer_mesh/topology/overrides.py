"""`--set a.b.c=value`: changes to a topology given on the command line, applied to the loaded YAML document
before it is validated, so an override is checked exactly like the same value written in the file.

Why on the document rather than on the validated `Topology`: a `Topology` is a tree of typed sections (some
typed only after validation, such as a role's `settings`), so patching it would need a validator per field;
the document is plain data, and validating it once covers every field, the checks across sections included.

A problem with an overridden value is reported at its `--set` key (`--set run.stepz: unknown key 'stepz'`),
never at the line of the file it replaced. The value itself is never echoed (it may be a secret).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import yaml

from composer_mesh.topology.yaml_errors import Loc, TopologyIssue, YamlDoc


class OverrideSyntaxError(ValueError):
    """A `--set` argument that is not `a.b.c=value` with a YAML value (a usage error)."""


@dataclass(frozen=True)
class Override:
    """Set the field at dotted `key` (list items by their index: `meshes.gpu.hosts`, `x.items.0.name`) to
    `value` (plain data, as YAML would load it)."""

    key: str
    value: Any

    @classmethod
    def parse(cls, text: str) -> Override:
        """`a.b.c=value`, the value read as a YAML scalar or flow value (`3`, `true`, `null`, `[a, b]`, `{x: 1}`);
        an empty value is null."""
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OverrideSyntaxError("expected KEY=VALUE (e.g. run.steps=10): no '=' or no key in the argument")
        if any(not part for part in key.split(".")):
            raise OverrideSyntaxError(f"{key}: a dotted field path has no empty parts (e.g. run.steps)")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:  # the value is not echoed: it may be a secret
            problem = getattr(e, "problem", None) or type(e).__name__
            raise OverrideSyntaxError(f"{key}: the value is not a YAML value ({problem}); quote it for a string") from None
        return cls(key, value)

    @property
    def label(self) -> str:
        return f"--set {self.key}"


def _step(node: Any, part: str, override: Override, walked: list[str | int]) -> tuple[Any, str | int]:
    """The container key of `part` in `node` (an int index in a list); raises ValueError when `node` is a value."""
    if isinstance(node, dict):
        return node, part
    if isinstance(node, list):
        if not part.isdigit() or int(part) >= len(node):
            raise ValueError(f"{_path_of(tuple(walked)) or '(file)'} is a list of {len(node)} item(s): "
                             f"{part!r} is not an index of it")
        return node, int(part)
    what = "null" if node is None else f"a {type(node).__name__} value"
    raise ValueError(f"{_path_of(tuple(walked))} is not a mapping (it holds {what}): cannot set a field inside it")


def _apply_one(data: dict[str, Any], override: Override) -> Loc:
    """Set the override's value in `data`, creating the mappings on its path that the file does not have; the
    loc it set (list indices as ints). ValueError when the path goes through a value."""
    node: Any = data
    walked: list[str | int] = []
    parts = override.key.split(".")
    for i, part in enumerate(parts):
        container, el = _step(node, part, override, walked)
        walked.append(el)
        if i == len(parts) - 1:
            container[el] = copy.deepcopy(override.value)  # later overrides edit the document, not the value
            break
        if isinstance(container, dict) and container.get(el) is None:
            container[el] = {}
        node = container[el]
    return tuple(walked)


def _path_of(loc: Loc) -> str:
    out = ""
    for el in loc:
        out += f"[{el}]" if isinstance(el, int) else (f".{el}" if out else str(el))
    return out


def apply_overrides(doc: YamlDoc, overrides: Sequence[Override]) -> dict[str, Override]:
    """Apply `overrides` in order to `doc.data`; problems go to `doc.issues` at their `--set` key. Returns the
    field path (as issues name it) of each override applied, for `relocate`."""
    applied: dict[str, Override] = {}
    if overrides and not isinstance(doc.data, dict):
        doc.issues.append(TopologyIssue(overrides[0].label, None, None, "the file is not a mapping of sections"))
        return applied
    for override in overrides:
        try:
            loc = _apply_one(doc.data, override)
        except ValueError as e:
            doc.issues.append(TopologyIssue(override.label, None, None, str(e)))
            continue
        applied[_path_of(loc)] = override
    return applied


def relocate(issues: list[TopologyIssue], applied: dict[str, Override]) -> list[TopologyIssue]:
    """Issues at or under an overridden field, named by its `--set` key (no file line: the file's value was
    replaced); the others as they are. The last override of a path wins, as it did when applied."""
    out = []
    for issue in issues:
        hit = next((p for p in sorted(applied, key=len, reverse=True)
                    if issue.path == p or issue.path.startswith((f"{p}.", f"{p}["))), None)
        if hit is None:
            out.append(issue)
            continue
        label = applied[hit].label if issue.path == hit else f"{applied[hit].label}: {issue.path}"
        out.append(replace(issue, path=label, line=None, column=None))
    return out
