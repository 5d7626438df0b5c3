"""Topology files: one YAML describes every mesh of a run and what runs on it (see docs/topology.md).

    from composer_mesh.topology import load_topology

    topology = load_topology("topologies/local.yaml")   # raises TopologyError with every problem, located
    configs = topology.role_configs()                    # what each role's actors are built with

Modules: `schema` (the `Topology` model and the role specs), `yaml_errors` (YAML with line/column errors),
`checks` (checks across sections), `load` (reading files), `plan` (what runs where, and its cost).
"""

from __future__ import annotations

from composer_mesh.mesh.spec import LocalMeshSpec, MeshSpec, ProcessMeshSpec, SlurmMeshSpec, SlurmOptions
from composer_mesh.topology.load import load_topology, parse_topology
from composer_mesh.topology.schema import (
    BoundSpec,
    GeneratorsSpec,
    RewarderSpec,
    RolesSpec,
    TeacherSpec,
    TeachersSpec,
    Topology,
    TrainerSpec,
)
from composer_mesh.topology.yaml_errors import TopologyError, TopologyIssue

__all__ = [
    "BoundSpec",
    "GeneratorsSpec",
    "LocalMeshSpec",
    "MeshSpec",
    "ProcessMeshSpec",
    "RewarderSpec",
    "RolesSpec",
    "SlurmMeshSpec",
    "SlurmOptions",
    "TeacherSpec",
    "TeachersSpec",
    "Topology",
    "TopologyError",
    "TopologyIssue",
    "TrainerSpec",
    "load_topology",
    "parse_topology",
]
