"""`ROLE_TABLE`'s built-in bindings: what validation reads from the table (settings model, capabilities) is what
the class it names carries, and the class satisfies its role's protocol."""

from __future__ import annotations

import pytest

from composer_mesh.actors.backends.generation.base import GeneratorBackend
from composer_mesh.actors.backends.rewards.base import RewardBackend
from composer_mesh.actors.backends.teachers.base import TeacherBackend
from composer_mesh.actors.backends.trainer.base import TrainerBackend
from composer_mesh.bindings import import_object
from composer_mesh.roles import ROLE_TABLE, resolve_binding

BUILTINS = [(role, name) for role, entry in ROLE_TABLE.items() for name in entry.bindings]
PROTOCOL = {"trainer": TrainerBackend, "generators": GeneratorBackend, "rewarder": RewardBackend,
            "teachers": TeacherBackend}


@pytest.mark.parametrize(("role", "name"), BUILTINS)
def test_builtin_table_entry_is_what_its_class_carries(role: str, name: str) -> None:
    entry = ROLE_TABLE[role].bindings[name]  # type: ignore[index]
    cls = import_object(entry.import_path)
    assert cls.Settings is entry.settings
    assert frozenset(cls.capabilities) == entry.capabilities
    resolved = resolve_binding(role, name)  # type: ignore[arg-type]
    assert (resolved.cls, resolved.settings_model, resolved.capabilities) == (cls, cls.Settings, cls.capabilities)
    protocol = PROTOCOL[role]
    members = {m for m in vars(protocol) if not m.startswith("_")} | set(protocol.__annotations__)
    missing = sorted(m for m in members if not hasattr(cls, m))
    assert missing == [], f"{cls.__name__} lacks {missing} of {protocol.__name__}"
