"""Checks of a topology's models before anything is launched: read from the model directories (config and
tokenizer files, no weights), so a run with models that cannot work together stops in seconds with every
problem named, not after minutes of spawning meshes and building models."""

from __future__ import annotations

from composer_mesh.errors import UserInputError
from composer_mesh.models.config import ModelConfig
from composer_mesh.topology.schema import Topology


class ModelPreflightError(UserInputError, ValueError):
    """Models of a topology that cannot work together (every problem, one per line)."""


def check_models(topology: Topology) -> None:
    """The policy (trainer and generators load `model`) and every local teacher model: tokenizer ids within the
    head, `run.max_new_tokens` within the context; a `distill` teacher has the policy's tokenizer. Raises
    ModelPreflightError listing every problem."""
    from composer_mesh.models.compat import model_problems, tokenizer_mismatch
    from composer_mesh.models.loading import load_tokenizer

    max_new = topology.run.max_new_tokens
    policy = load_tokenizer(topology.model)
    problems = model_problems(topology.model, policy, max_new, "model (the policy)")
    problems += fragment_problems(topology, len(policy)) + lora_problems(topology, len(policy))
    for member in topology.teachers.members if topology.teachers is not None else []:
        model = getattr(member.settings, "model", None)
        if not isinstance(model, ModelConfig):  # a remote teacher (OpenRouter): nothing local to read
            continue
        who = f"teacher {member.name!r}"
        tokenizer = load_tokenizer(model)
        problems += model_problems(model, tokenizer, max_new, who)
        mismatch = tokenizer_mismatch(tokenizer, policy) if "distill" in member.channels else None
        if mismatch is not None:
            problems.append(f"{who} feeds channel 2 (distill) but its tokenizer is not the policy's ({mismatch}; "
                            f"teacher {model.source!r}, policy {topology.model.source!r}): give it channels: "
                            "[replay] only, or a model with the policy's tokenizer")
    if len(problems) == 1:
        raise ModelPreflightError(f"the topology's models cannot work together: {problems[0]}")
    if problems:
        raise ModelPreflightError("the topology's models cannot work together:\n  " + "\n  ".join(problems))


def fragment_problems(topology: Topology, vocab_size: int) -> list[str]:
    """Streaming DiLoCo splits the policy's parameter tensors into `diloco.fragments` groups: it needs at least
    as many tensors as fragments (else every trainer replica would refuse it after launch)."""
    from composer_mesh.models.compat import parameter_tensors

    fragments = topology.diloco.fragments if topology.diloco is not None else 1
    if fragments == 1:
        return []
    tensors = parameter_tensors(topology.model, vocab_size)
    if tensors >= fragments:
        return []
    return [f"diloco.fragments={fragments} but the policy has only {tensors} parameter tensors to split (model.source "
            f"{topology.model.source!r}); use at most {tensors} fragments"]


def lora_problems(topology: Topology, vocab_size: int) -> list[str]:
    """The trainer's `lora.target_modules` against the policy's modules (a meta-device skeleton): a name that
    matches no module, or the head or embeddings, is refused here rather than when the trainer starts."""
    lora = getattr(topology.roles.trainer.settings, "lora", None)
    if lora is None or lora.target_modules == "all-linear":
        return []
    from composer_mesh.models.compat import skeleton
    from composer_mesh.models.lora import check_targets

    try:
        check_targets(skeleton(topology.model, vocab_size), lora)
    except ValueError as e:
        return [f"roles.trainer.settings.{e}"]
    return []
