"""The stable import surface for scripts and notebooks: what `examples/` and the README import.

    from composer_mesh.api import launch, load_topology, RLLoop, GenerationRequest

Everything here keeps its name across releases; deeper module paths may move. Importing this module
imports torch (the messages carry tensors) but not Monarch until a topology is launched.
"""

from __future__ import annotations

from composer_mesh.actors.messages import (
    GenerationRequest,
    Prompt,
    RewardResult,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TeacherRequest,
    TeacherSignals,
    TeacherTrace,
    TokenDistribution,
    TrainBatch,
    TrainMetrics,
)
from composer_mesh.actors.teacher_errors import TeacherFailed, TeacherUnavailable
from composer_mesh.app.launch import launch
from composer_mesh.app.preflight import PreflightError, preflight
from composer_mesh.app.runner import (
    apply_overrides,
    checkpoint_policy,
    print_summary,
    resume_point,
    run_topology,
)
from composer_mesh.errors import UserInputError
from composer_mesh.loss.config import LossConfig
from composer_mesh.mesh.launch import LaunchError, MeshFailureError
from composer_mesh.orchestration.checkpoint import CheckpointPolicy, RunCheckpointError
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.orchestration.metrics import RunSummary, StepRecord
from composer_mesh.orchestration.pipeline import LagGate
from composer_mesh.orchestration.prompts import DataPrompts, PromptSource, TaskPrompts, prompt_source
from composer_mesh.orchestration.resume import ResumePoint
from composer_mesh.orchestration.schedule import Chunk, GroupResult, StepScheduler, row_seed
from composer_mesh.orchestration.scoring import merge_signals
from composer_mesh.roles import ROLES, Role, RoleMesh
from composer_mesh.topology import Topology, TopologyError, load_topology
from composer_mesh.topology.overrides import Override

__all__ = [
    "ROLES",
    "CheckpointPolicy",
    "Chunk",
    "DataPrompts",
    "GenerationRequest",
    "GroupResult",
    "LagGate",
    "LaunchError",
    "LossConfig",
    "MeshFailureError",
    "Override",
    "PreflightError",
    "Prompt",
    "PromptSource",
    "RLLoop",
    "ResumePoint",
    "RewardResult",
    "Role",
    "RoleMesh",
    "Rollout",
    "RolloutGroup",
    "RunCheckpointError",
    "RunConfig",
    "RunSummary",
    "ScoredGroup",
    "StepRecord",
    "StepScheduler",
    "TaskPrompts",
    "TeacherFailed",
    "TeacherRequest",
    "TeacherSignals",
    "TeacherTrace",
    "TeacherUnavailable",
    "TokenDistribution",
    "Topology",
    "TopologyError",
    "TrainBatch",
    "TrainMetrics",
    "UserInputError",
    "apply_overrides",
    "checkpoint_policy",
    "launch",
    "load_topology",
    "merge_signals",
    "preflight",
    "print_summary",
    "prompt_source",
    "resume_point",
    "row_seed",
    "run_topology",
]
