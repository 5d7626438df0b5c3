"""The checkpoint a run resumes from, checked before launch beyond its controller state (which `resume_point`
reads, checking its bytes): every trainer replica's state is there, committed, and byte for byte what its
marker lists (size and sha256 of every file, streamed), for as many replicas as this run has.

Why: the replicas load their states inside the trainer actors, after every mesh started and every model was
built; a state that cannot be read would otherwise stop the run there, where docs/launch.md promises exit 1
before launch, and a state whose bytes changed would load without complaint and train on garbage. A refusal
offers the newest checkpoint of the same run that does verify, as the `--resume PATH` to give.
"""

from __future__ import annotations

from composer_mesh.actors.backends.trainer.trainer_state import TrainerStateError, check_trainer_state
from composer_mesh.orchestration.checkpoint import (
    CheckpointStore,
    RunCheckpointError,
    read_checkpoint,
    verify_checkpoint,
)
from composer_mesh.orchestration.resume import ResumePoint
from composer_mesh.topology.schema import Topology


def check_resume(topology: Topology, resume: ResumePoint) -> None:
    """RunCheckpointError naming the checkpoint and the replica whose trainer state is missing, unreadable or
    changed since its commit (and the checkpoint to resume from instead), or a replica count other than this
    run's."""
    replicas = topology.trainer.replicas
    if resume.state.replicas != replicas:
        raise RunCheckpointError(f"{resume.url} holds {resume.state.replicas} trainer replica(s), this run has "
                                 f"{replicas} (roles.trainer.replicas): resume with the topology it was written under")
    try:
        check_trainer_states(resume.url, replicas)
    except RunCheckpointError as e:
        raise RunCheckpointError(f"{e}{instead(resume.url)}") from None


def check_trainer_states(url: str, replicas: int) -> None:
    """Every trainer replica's state of the checkpoint at `url`, each file against its marker."""
    for replica in range(replicas):
        try:
            check_trainer_state(f"{url}/trainer/r{replica}")
        except TrainerStateError as e:
            raise RunCheckpointError(f"trainer replica {replica}'s state: {e}") from None


def verifies(url: str) -> bool:
    """Whether every file of the checkpoint at `url` (controller and trainer parts) matches its marker."""
    try:
        verify_checkpoint(url)
        check_trainer_states(url, read_checkpoint(url).replicas)
    except RunCheckpointError:
        return False
    return True


def instead(url: str) -> str:
    """What to say after a refusal of the checkpoint at `url`: the newest other committed checkpoint beside it
    that verifies, as the `--resume` to give (checked newest first, so the usual case costs one checkpoint)."""
    root, _, name = url.rpartition("/")
    store = CheckpointStore(root)
    others = [step for step in reversed(store.committed()) if store.step_url(step) != url]
    for step in others:
        if verifies(store.step_url(step)):
            return f"; the newest checkpoint that verifies is {store.step_url(step)}: resume with --resume " \
                   f"{store.step_url(step)}"
    return f"; no other checkpoint beside {name} verifies" if others else f"; there is no other checkpoint beside {name}"
