"""One registry for the implementations a topology can bind a role to.

A binding is a plain Python class (no Monarch) with two class attributes:

    Settings: type[pydantic.BaseModel]   # its typed settings, validated with the topology
    capabilities: frozenset[str]         # what it can supply, checked across sections (e.g. teachers)

Built-in bindings are short names (`hf`, `vllm`, `openrouter`, ...); anything else is an import path
`package.module:Class`. Both resolve through `resolve_binding`. Adding a built-in is one line in `BUILTIN`.
Binding modules keep heavy imports (transformers, vllm) inside functions so validation stays cheap.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

Role = Literal["trainer", "generator", "rewarder", "teacher"]
ROLES: tuple[Role, ...] = ("trainer", "generator", "rewarder", "teacher")

# Teacher capabilities: "distill" = per-token distributions over the student's tokens (channel 2, needs the
# student's tokenizer); "replay" = full traces (channel 3).
BUILTIN: dict[Role, dict[str, str]] = {
    "trainer": {"hf": "composer_mesh.actors.backends.hf_trainer:HFTrainer"},
    "generator": {
        "hf": "composer_mesh.actors.backends.hf_generator:HFGenerator",
        "vllm": "composer_mesh.actors.backends.vllm_generator:VLLMGenerator",
    },
    "rewarder": {"python": "composer_mesh.actors.backends.rewards:PythonRewarder"},
    "teacher": {
        "hf": "composer_mesh.actors.backends.hf_teacher:HFTeacher",
        "vllm": "composer_mesh.actors.backends.vllm_teacher:VLLMTeacher",
        "openrouter": "composer_mesh.actors.backends.openrouter:OpenRouterTeacher",
    },
}


class BindingError(ValueError):
    """A binding name or import path that cannot be resolved to a usable class."""


@dataclass(frozen=True)
class Binding:
    role: Role
    name: str  # as written in the topology
    import_path: str
    cls: type

    @property
    def settings_model(self) -> type[BaseModel]:
        return self.cls.Settings  # type: ignore[attr-defined, no-any-return]

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset(getattr(self.cls, "capabilities", frozenset()))

    def parse_settings(self, raw: dict[str, Any] | None) -> BaseModel:
        return self.settings_model.model_validate(raw or {})

    def build(self, settings: BaseModel | dict[str, Any] | None) -> Any:
        if not isinstance(settings, BaseModel):
            settings = self.parse_settings(settings)
        return self.cls(settings)


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
        raise BindingError(f"cannot import module {module_name!r} of {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise BindingError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None


def resolve_binding(role: Role, name: str) -> Binding:
    """Resolve a built-in name or an import path to a binding class that has `Settings`."""
    if role not in BUILTIN:
        raise BindingError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    builtin = BUILTIN[role]
    if name in builtin:
        path = builtin[name]
    elif ":" in name or "." in name:
        path = name
    else:
        raise BindingError(
            f"unknown {role} binding {name!r}; built-ins are {', '.join(sorted(builtin))}, "
            "or give an import path 'package.module:Class'"
        )
    cls = import_object(path)
    if not isinstance(cls, type):
        raise BindingError(f"{role} binding {path!r} is not a class")
    settings = getattr(cls, "Settings", None)
    if not (isinstance(settings, type) and issubclass(settings, BaseModel)):
        raise BindingError(f"{role} binding {path!r} has no `Settings` pydantic model class attribute")
    return Binding(role=role, name=name, import_path=path, cls=cls)
