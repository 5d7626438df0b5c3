"""Helpers shared by the bindings that run a local copy of a model: the `hf` and `vllm` generators and teachers.

They live here, not in one binding's module or room, so the bindings agree on one definition of the model
config they accept, the prompt ids they feed, the tokens they stop on, and the checks of requests and weight
pushes. The settings they share are `config.py`'s (import-cheap, read when a topology is validated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from composer_mesh.errors import UserInputError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from composer_mesh.actors.messages import GenerationRequest, Prompt, TokenDistribution
    from composer_mesh.models.config import ModelConfig


def as_model_config(model: Any) -> ModelConfig:
    from composer_mesh.models.config import ModelConfig

    return model if isinstance(model, ModelConfig) else ModelConfig.model_validate(model)


class PromptTooLongError(UserInputError, ValueError):
    """A prompt that leaves no room for `run.max_new_tokens` in the model's context: the data or the setting
    is the user's to change."""


def prompt_ids(
    prompt: Prompt, tokenizer: PreTrainedTokenizerBase, vocab_size: int, who: str,
    max_new_tokens: int = 0, context: int | None = None,
) -> list[int]:
    """The prompt's token ids, checked against the model's vocabulary and, with `context` (the model's
    longest sequence), that `max_new_tokens` more fit. When it has none, they come from
    `models.chat.prompt_token_ids` (messages and tools through the chat template, else the text), so every
    binding feeds the same prompt the same ids. A later turn of an episode (`bridge_messages`) is its
    `token_ids` as given (the conversation so far), the chat end-of-turn token if the last turn did not end
    with it, then the environment messages' bridge (`models.chat.next_turn_token_ids`)."""
    from composer_mesh.models.chat import (
        NoChatTemplateError,
        TemplateBridgeError,
        TemplateToolsError,
        next_turn_token_ids,
        prompt_token_ids,
    )

    try:
        if prompt.bridge_messages is not None:
            if not prompt.token_ids:
                raise ValueError(f"{who}: prompt {prompt.prompt_id!r} has bridge_messages but no token_ids "
                                 "(the conversation so far, which they continue)")
            ids = next_turn_token_ids(tokenizer, prompt.token_ids, prompt.bridge_messages, tools=prompt.tools)
        else:
            ids = list(prompt.token_ids) or prompt_token_ids(tokenizer, prompt)
    except (NoChatTemplateError, TemplateBridgeError, TemplateToolsError) as e:
        raise type(e)(f"{who}: {e}") from None
    if not ids:
        raise ValueError(f"{who}: prompt {prompt.prompt_id!r} has no tokens (empty token_ids and text)")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(
            f"{who}: prompt {prompt.prompt_id!r} has token ids {bad[:5]} outside the model's vocabulary [0, {vocab_size})"
        )
    if context is not None and len(ids) + max_new_tokens > context:
        raise PromptTooLongError(f"{who}: prompt {prompt.prompt_id!r} is {len(ids)} tokens; with max_new_tokens="
                                 f"{max_new_tokens} that is more than the model's context of {context} tokens "
                                 "(shorten the prompt or run.max_new_tokens)")
    return ids


def context_of(hf_config: Any) -> int | None:
    """A transformers config's longest sequence (`max_position_embeddings`); None when it does not say."""
    value = getattr(hf_config, "max_position_embeddings", None)
    return int(value) if value else None


def task_stop_texts(model_config: ModelConfig) -> tuple[str, ...]:
    """The end marker of the model's task (e.g. ';'), if the task has one."""
    from composer_mesh.tasks import get_task

    eos = getattr(get_task(model_config.task), "eos", None)
    return (eos,) if eos else ()


def stop_ids_for(
    tokenizer: Any, model_config: Any, stop_at_task_eos: bool, generation_config: Any = None
) -> list[int]:
    """What every binding stops on (`models.chat.model_stop_ids`): EOS, the task's end marker when it is a
    single token and `stop_at_task_eos`, the model's generation-config EOS ids and its chat template's
    end-of-turn token. Without `stop_at_task_eos` the task's marker is not a stop even when the generation
    config lists it (the tiny model's does)."""
    from composer_mesh.models.chat import model_stop_ids

    task = task_stop_texts(model_config)
    return model_stop_ids(
        tokenizer, generation_config, extra_texts=task if stop_at_task_eos else (), skip_texts=() if stop_at_task_eos else task
    )


def check_generation_request(request: GenerationRequest) -> None:
    """Raise on a request no generator can serve (the fields' allowed ranges)."""
    if request.samples_per_prompt < 1:
        raise ValueError(f"GenerationRequest.samples_per_prompt must be >= 1, got {request.samples_per_prompt}")
    if request.max_new_tokens < 1:
        raise ValueError(f"GenerationRequest.max_new_tokens must be >= 1, got {request.max_new_tokens}")
    if request.temperature < 0:
        raise ValueError(f"GenerationRequest.temperature must be >= 0, got {request.temperature}")
    if request.seeds is not None:
        if request.samples_per_prompt != 1:
            raise ValueError("GenerationRequest.seeds (one seed per prompt) needs samples_per_prompt == 1, got "
                             f"{request.samples_per_prompt}")
        if len(request.seeds) != len(request.prompts):
            raise ValueError(f"GenerationRequest.seeds has {len(request.seeds)} seeds for {len(request.prompts)} prompts")


def check_weights(
    named: dict[str, torch.Tensor], specs: dict[str, tuple[tuple[int, ...], torch.dtype]], who: str
) -> None:
    """Raise unless `named` has exactly the names of `specs`, each with its shape and dtype (`who` prefixes errors)."""
    unknown = sorted(set(named) - set(specs))
    missing = sorted(set(specs) - set(named))
    if unknown or missing:
        raise ValueError(
            f"{who} load_weights: unknown names {unknown[:5]} ({len(unknown)}), "
            f"missing names {missing[:5]} ({len(missing)})"
        )
    for name, t in named.items():
        shape, dtype = specs[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{who} load_weights: {name!r} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")


def to_distribution(name: str, logits: torch.Tensor, top_k: int) -> TokenDistribution:
    """One sequence's float32 logit rows [T, V] (on the model's device, maybe a view of its batch) -> a CPU
    `TokenDistribution`: dense (`top_k` 0, a copy: a view would keep the whole batch's logits alive) or the top-k
    log-probs, taken on the device so only [T, k] crosses to the CPU."""
    import torch

    from composer_mesh.actors.messages import TokenDistribution

    if top_k == 0:
        return TokenDistribution(teacher=name, logits=logits.to("cpu", copy=True))
    logp = torch.log_softmax(logits, dim=-1)
    vals, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    return TokenDistribution(teacher=name, topk_ids=ids.to("cpu", torch.long), topk_logprobs=vals.cpu())


def fitting_prompt_ids(prompts: list[Prompt], continuations: list[list[int]], tokenizer: PreTrainedTokenizerBase,
                       vocab_size: int, who: str, context: int | None) -> list[list[int] | None]:
    """Each prompt's ids (`prompt_ids`), None for one whose continuation would not fit the model's context with
    it: a self-teacher request scores what fits and says which did not, instead of failing them all (a hint
    makes an episode that fitted longer)."""
    out: list[list[int] | None] = []
    for p, c in zip(prompts, continuations):
        try:
            out.append(prompt_ids(p, tokenizer, vocab_size, who, len(c), context))
        except PromptTooLongError:
            out.append(None)
    return out
