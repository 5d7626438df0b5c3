"""The checkpoint a run resumes from, checked before launch beyond its controller state (which `resume_point`
reads): every trainer replica's state is there, committed and readable, for as many replicas as this run has.

Why: the replicas load their states inside the trainer actors, after every mesh started and every model was
built; a state that cannot be read would otherwise stop the run there, where docs/launch.md promises exit 1
before launch.
"""

from __future__ import annotations

from composer_mesh.actors.backends.trainer.trainer_state import TrainerStateError, check_trainer_state
from composer_mesh.orchestration.checkpoint import RunCheckpointError
from composer_mesh.orchestration.resume import ResumePoint
from composer_mesh.topology.schema import Topology


def check_resume(topology: Topology, resume: ResumePoint) -> None:
    """RunCheckpointError naming the checkpoint and the replica whose trainer state is missing or unreadable,
    or a replica count other than this run's."""
    replicas = topology.trainer.replicas
    if resume.state.replicas != replicas:
        raise RunCheckpointError(f"{resume.url} holds {resume.state.replicas} trainer replica(s), this run has "
                                 f"{replicas} (roles.trainer.replicas): resume with the topology it was written under")
    for replica in range(replicas):
        try:
            check_trainer_state(f"{resume.url}/trainer/r{replica}")
        except TrainerStateError as e:
            raise RunCheckpointError(f"trainer replica {replica}'s state: {e}: resume from an earlier checkpoint "
                                     "(give its step directory to --resume)") from None
