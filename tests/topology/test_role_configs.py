"""`Topology.role_configs()` hands each role exactly its sections, its mesh and its bound binding."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

from composer_mesh.actors.configs import (
    GeneratorConfig,
    RewarderConfig,
    TeacherMemberConfig,
    TeachersConfig,
    TrainerConfig,
)
from composer_mesh.bindings import BoundBinding
from composer_mesh.roles import ROLES
from composer_mesh.topology import load_topology, parse_topology

from .fake_bindings import LocalTeacher, Rewarder, TeacherSettings

VALID = Path(__file__).parent / "valid"


def test_every_role_gets_its_own_sections() -> None:
    t = load_topology(VALID / "fake_mixed.yaml")
    configs = t.role_configs()
    assert list(configs) == list(ROLES)
    assert all(c.role == role for role, c in configs.items())
    assert {role: c.mesh for role, c in configs.items()} == dict(t.roles.placements())

    trainer = configs["trainer"]
    assert type(trainer) is TrainerConfig
    assert trainer.binding == BoundBinding(
        name="topology.fake_bindings:Trainer",
        import_path="topology.fake_bindings:Trainer",
        settings=t.trainer.settings,
    )
    assert trainer.replicas == 2 and trainer.temperature == t.run.temperature
    assert (trainer.model, trainer.loss, trainer.weights, trainer.diloco) == (
        t.model,
        t.loss,
        t.weights,
        t.diloco,
    )

    generators = configs["generators"]
    assert type(generators) is GeneratorConfig
    assert (generators.model, generators.weights) == (t.model, t.weights)
    assert generators.binding.settings.max_batch == 16  # type: ignore[attr-defined]

    rewarder = configs["rewarder"]
    assert type(rewarder) is RewarderConfig
    assert {f.name for f in dataclasses.fields(rewarder)} == {"role", "mesh", "binding"}
    assert isinstance(rewarder.binding.build(), Rewarder)


def test_teachers_keep_their_channels_and_bound_settings() -> None:
    t = load_topology(VALID / "fake_mixed.yaml")
    teachers = t.role_configs()["teachers"]
    assert type(teachers) is TeachersConfig and teachers.student == t.model
    local_t, api_t = teachers.members
    assert local_t == TeacherMemberConfig(
        name="local_t",
        channels=("distill", "replay"),
        binding=BoundBinding(
            name="topology.fake_bindings:LocalTeacher",
            import_path="topology.fake_bindings:LocalTeacher",
            settings=TeacherSettings(),
        ),
    )
    assert api_t.channels == ("replay",) and api_t.binding.settings == TeacherSettings(temperature=0.5)
    built = local_t.binding.build()
    assert isinstance(built, LocalTeacher) and built.settings is local_t.binding.settings
    assert pickle.loads(pickle.dumps(teachers)) == teachers  # Monarch pickles configs to the procs


def test_a_run_without_teachers_has_no_teachers_config() -> None:
    t = load_topology(VALID / "minimal.yaml")
    configs = t.role_configs()
    assert list(configs) == ["trainer", "generators", "rewarder"]
    trainer = configs["trainer"]
    assert isinstance(trainer, TrainerConfig) and trainer.diloco is None and trainer.replicas == 1


def test_builtin_binding_names_are_bound_by_import_path() -> None:
    """A built-in name is handed over as its import path: only the proc that builds it imports it."""
    text = (VALID / "minimal.yaml").read_text()
    text = text.replace(
        'rewarder: {mesh: cpu, binding: "topology.fake_bindings:Rewarder"}',
        'rewarder: {mesh: cpu, binding: python, settings: {functions: [{path: "composer_mesh.tasks.arithmetic:exact_match"}]}}',
    )
    rewarder = parse_topology(text).role_configs()["rewarder"]
    assert isinstance(rewarder, RewarderConfig)
    assert rewarder.binding.name == "python"
    assert rewarder.binding.import_path == "composer_mesh.actors.backends.rewards.rewards:PythonRewarder"


def test_slurm_job_names() -> None:
    t = load_topology(VALID / "fake_mixed.yaml")
    assert t.job_name("gen") == "gen_pool" and t.job_name("train") == "fake_mixed_train"
