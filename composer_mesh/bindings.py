"""How a name in a topology becomes a class: built-in names and import paths, resolved the same way.

A binding is a plain Python class (no Monarch) with two class attributes:

    Settings: type[pydantic.BaseModel]   # its typed settings, validated with the topology
    capabilities: frozenset[str]         # what it can supply, checked across sections (e.g. teachers)

This module is generic: it knows no role. `composer_mesh.roles` owns the table of built-in names per role, each a
`BuiltinBinding`: the class by import path, its `Settings` and capabilities from an import-cheap config module,
so that validating a topology that names only built-ins imports no binding module (nor torch). A binding named
by import path is imported when the topology is validated, to read its `Settings` and `capabilities`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from composer_mesh.errors import UserInputError


class BindingError(UserInputError, ValueError):
    """A binding name or import path that cannot be resolved to a usable class."""


def import_object(path: str) -> Any:
    """Import `package.module:attr` (or `package.module.attr`); errors name the path and what failed."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise BindingError(f"import path {path!r} must look like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name is not None and \
            (module_name == e.name or module_name.startswith(e.name + "."))
        hint = ("; if it is your own module, add its directory with --python-path DIR or the topology's "
                "python_path: [DIR]") if missing else ""
        raise BindingError(f"cannot import module {module_name!r} of {path!r}: {e}{hint}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise BindingError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None


@dataclass(frozen=True)
class BuiltinBinding:
    """A built-in binding as its role's table names it: the class by import path (imported only where it is
    built), its `Settings` model and its capabilities (both from the binding's config module, which the class
    uses too)."""

    import_path: str  # "package.module:Class"
    settings: type[BaseModel]
    capabilities: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Binding:
    """A resolved binding: what validation needs (its settings model and capabilities) and where its class is.
    `kind` says what it is for (a role name) in error messages."""

    kind: str
    name: str  # as written in the topology
    import_path: str
    settings_model: type[BaseModel]
    capabilities: frozenset[str]

    @property
    def cls(self) -> type:
        """The binding class, imported on use (validation never needs it)."""
        return import_object(self.import_path)  # type: ignore[no-any-return]

    def parse_settings(self, raw: dict[str, Any] | None) -> BaseModel:
        return self.settings_model.model_validate(raw or {})

    def build(self, settings: BaseModel | dict[str, Any] | None) -> Any:
        """An instance of the binding with `settings` (validated first when given as a mapping)."""
        if not isinstance(settings, BaseModel):
            settings = self.parse_settings(settings)
        return self.cls(settings)


@dataclass(frozen=True)
class BoundBinding:
    """A binding with its validated settings, as an actor receives it: built on the actor's proc with `build()`.

    It carries the import path, not the class, so only the proc that builds it imports the binding module.
    """

    name: str  # as written in the topology (for messages)
    import_path: str
    settings: BaseModel

    def build(self) -> Any:
        return import_object(self.import_path)(self.settings)


def resolve_binding(kind: str, name: str, builtins: Mapping[str, BuiltinBinding]) -> Binding:
    """Resolve a built-in name (a key of `builtins`: nothing is imported) or an import path (its module is
    imported) to a binding with a `Settings` model."""
    if name in builtins:
        b = builtins[name]
        return Binding(kind, name, b.import_path, b.settings, frozenset(b.capabilities))
    if ":" not in name and "." not in name:
        raise BindingError(
            f"unknown {kind} binding {name!r}; built-ins are {', '.join(sorted(builtins))}, "
            "or give an import path 'package.module:Class'"
        )
    cls = import_object(name)
    if not isinstance(cls, type):
        raise BindingError(f"{kind} binding {name!r} is not a class")
    settings = getattr(cls, "Settings", None)
    if not (isinstance(settings, type) and issubclass(settings, BaseModel)):
        raise BindingError(f"{kind} binding {name!r} has no `Settings` pydantic model class attribute")
    return Binding(kind, name, name, settings, frozenset(getattr(cls, "capabilities", frozenset())))
