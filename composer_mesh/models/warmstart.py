"""Warm start: brief in-process SFT on a task's (prompt, target) pairs or whole demonstrated episodes, or on the
user's own data (`warmstart.data`: the data's train rows only), and greedy task accuracy.

Used by `composer_mesh.models.loading.materialize` (cached with the model) to make a teacher that already
knows the task and a weak-but-not-random student. Deterministic for a fixed config and thread count;
`materialize` runs it once per cache key, so every process uses the same result. It imports `tokenizer` and
`sampling`, never `loading` (which imports it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from composer_mesh.models.chat import prompt_token_ids
from composer_mesh.models.config import WarmStartConfig
from composer_mesh.models.sampling import chunks, sample
from composer_mesh.models.tokenizer import stop_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from composer_mesh.tasks import Task
    from composer_mesh.tasks.data import DataConfig

IGNORE = -100
# A (prompt, target) pair as token ids: the target is learnt, the prompt is only read.
Pair = tuple[list[int], list[int]]
# One SFT example: token ids and their labels (IGNORE where nothing is learnt); a sampler draws one with the warm
# start's RNG.
Example = tuple[list[int], list[int]]
ExampleSampler = Callable[[random.Random], Example]


def task_target(task: Task, answer: str) -> str:
    """The completion a perfect policy writes: `task.target(answer)` if the task has it, else answer + eos."""
    target = getattr(task, "target", None)
    if callable(target):
        return str(target(answer))
    return answer + (getattr(task, "eos", None) or "")


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def supervised(pair: Pair) -> Example:
    """A pair as one example: the prompt's ids read, the target's learnt."""
    prompt, target = pair
    return prompt + target, [IGNORE] * len(prompt) + target


def _assistant_turn(task: Any, tokenizer: PreTrainedTokenizerBase, end: int | None, messages: list[Any],
                    tools: list[dict[str, Any]], i: int) -> Pair:
    """Assistant turn `messages[i]` of a demonstration as (the conversation before it through the chat template
    with the tools, the turn's own ids up to and including the end-of-turn token): the ids a multi-turn episode
    feeds and samples (the template's bridge keeps earlier turns' ids)."""
    from composer_mesh.models.chat import chat_token_ids, render_chat

    prompt = chat_token_ids(tokenizer, messages[:i], tools=tools)
    full = _encode(tokenizer, render_chat(tokenizer, messages[: i + 1], tools, add_generation_prompt=False))
    if full[: len(prompt)] != prompt or end not in full[len(prompt):]:
        raise ValueError(f"warm start of task {task.name!r}: the chat template does not render an assistant turn "
                         "as a continuation of its conversation ending in an end-of-turn token")
    turn = full[len(prompt):]
    return prompt, turn[: turn.index(end) + 1]


def chat_turn_examples(task: Any, tokenizer: PreTrainedTokenizerBase, whole: bool = False) -> ExampleSampler:
    """Examples of a task that demonstrates episodes (`task.chat_demonstration(rng) -> (messages, tools)`), in the
    ids a played episode has (`_assistant_turn`). `whole` False (`warmstart.episodes: turn`): one assistant turn
    of a demonstration, drawn at random, learnt after its conversation. `whole`: the whole demonstration, every
    assistant turn learnt and the environment's turns only read; the shared conversation is computed once for all
    its turns, about half the compute for the same turns learnt."""
    from composer_mesh.models.chat import chat_end_token_id

    end = chat_end_token_id(tokenizer)

    def draw(rng: random.Random) -> Example:
        messages, tools = task.chat_demonstration(rng)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not whole:
            return supervised(_assistant_turn(task, tokenizer, end, messages, tools, turns[rng.randrange(len(turns))]))
        ids: list[int] = []
        labels: list[int] = []
        for i in turns:
            prompt, turn = _assistant_turn(task, tokenizer, end, messages, tools, i)
            if prompt[: len(ids)] != ids:
                raise ValueError(f"warm start of task {task.name!r} (episodes: whole): the chat template renders "
                                 "earlier turns of a conversation differently later on; use episodes: turn")
            labels += [IGNORE] * (len(prompt) - len(ids)) + turn
            ids = prompt + turn
        return ids, labels

    return draw


def task_examples(task: Task, tokenizer: PreTrainedTokenizerBase, episodes: str = "turn") -> ExampleSampler:
    """Examples sampled from the task's train split: its demonstrated episodes (`episodes`: 'turn' or 'whole',
    `chat_turn_examples`), for a task that has them, else one (prompt, perfect completion) pair each."""
    if callable(getattr(task, "chat_demonstration", None)):
        return chat_turn_examples(task, tokenizer, whole=episodes == "whole")

    def draw(rng: random.Random) -> Example:
        prompt, answer = task.sample(rng)
        return supervised((_encode(tokenizer, prompt), _encode(tokenizer, task_target(task, answer))))

    return draw


@dataclass(frozen=True)
class _RowPrompt:
    """A data row as `prompt_token_ids` reads a prompt (what generators encode, so the SFT sees the same ids)."""

    prompt_id: str
    text: str
    messages: list[dict[str, str]] | None


class WarmStartDataError(ValueError):
    """`warmstart.data` that cannot be trained on (no train rows, a row with no target)."""


def data_pairs(data: DataConfig, task: Task, tokenizer: PreTrainedTokenizerBase) -> list[Pair]:
    """Every train row of `data` as a pair: the held-out rows (`load_prompt_data`'s eval split, by a hash of the
    prompt) are never among them. The target is the row's answer column followed by the task's end marker."""
    from composer_mesh.tasks.data import load_prompt_data

    rows = load_prompt_data(data).train
    if not rows:
        raise WarmStartDataError("warmstart.data has no train rows (all of them are held out)")
    pairs = []
    for i, row in enumerate(rows):
        if row.answer is None or not row.answer.strip():
            raise WarmStartDataError(f"warmstart.data: {row.where}: no target (its {data.answer!r} column is empty); "
                                     "every warm-start row needs one")
        prompt = prompt_token_ids(tokenizer, _RowPrompt(f"row{i}", row.text, row.messages), checked=False)
        pairs.append((prompt, _encode(tokenizer, task_target(task, row.answer))))
    return pairs


def sft_batch(
    draw: ExampleSampler, tokenizer: PreTrainedTokenizerBase, rng: random.Random, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, labels (what is only read, and padding, masked with -100), right-padded."""
    rows = [draw(rng) for _ in range(batch_size)]
    width = max(len(ids) for ids, _ in rows)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    ids = torch.full((batch_size, width), pad, dtype=torch.long)
    labels = torch.full((batch_size, width), IGNORE, dtype=torch.long)
    attn = torch.zeros((batch_size, width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        attn[i, : len(x)] = 1
    return ids, attn, labels


def _lr_factor(step: int, total: int) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 10%."""
    warm = max(1, total // 10)
    if step < warm:
        return (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


def warm_start(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: WarmStartConfig,
               on_step: Callable[[int, float], None] | None = None) -> dict[str, Any]:
    """Train `model` in place (float32) on `cfg.task`; return loss and accuracy stats. `on_step(steps done,
    loss)` after every SFT step (the build's progress)."""
    from composer_mesh.tasks import get_task

    task = get_task(cfg.task)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _warm_start(model, tokenizer, task, cfg, on_step)
    finally:
        torch.set_num_threads(threads)


def _warm_start(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, cfg: WarmStartConfig,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    stats: dict[str, Any] = {"task": cfg.task, "steps": cfg.steps}
    if cfg.episodes == "whole" and (cfg.data is not None or not callable(getattr(task, "chat_demonstration", None))):
        raise ValueError(f"warmstart.episodes: whole needs a task that demonstrates episodes (chat_demonstration) and "
                         f"no warmstart.data; task {cfg.task!r}{' with data' if cfg.data is not None else ''} has none")
    if cfg.data is not None:  # the user's rows: the task only gives the end marker; accuracy is the task's
        examples = [supervised(p) for p in data_pairs(cfg.data, task, tokenizer)]
        stats["data_rows"] = len(examples)
        draw: ExampleSampler = lambda r: examples[r.randrange(len(examples))]  # noqa: E731
    else:
        draw = task_examples(task, tokenizer, cfg.episodes)
        if not callable(getattr(task, "chat_demonstration", None)):  # an episode task has no one-shot accuracy
            stats["accuracy_before"] = task_accuracy(model, tokenizer, task, n=64, seed=cfg.seed + 1)
    if cfg.steps == 0:
        if "accuracy_before" in stats:
            stats["accuracy_after"] = stats["accuracy_before"]
        return stats
    losses = _sft(model, tokenizer, draw, rng, cfg, on_step)
    stats["loss_first"] = round(losses[0], 4)
    stats["loss_last"] = round(losses[-1], 4)
    if cfg.data is not None or "accuracy_before" not in stats:
        return stats
    stats["accuracy_after"] = task_accuracy(model, tokenizer, task, n=64, seed=cfg.seed + 1)
    if "eval" in getattr(task, "splits", ()):  # problems the SFT never saw (the task's held-out split)
        stats["heldout_accuracy_after"] = task_accuracy(model, tokenizer, task, n=64, seed=cfg.seed + 1, split="eval")
    return stats


def _sft(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, draw: ExampleSampler, rng: random.Random,
         cfg: WarmStartConfig, on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """`cfg.steps` AdamW steps on batches of `draw`n examples; the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg.steps))
    model.train()
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        for _ in range(cfg.steps):
            ids, attn, labels = sft_batch(draw, tokenizer, rng, cfg.batch_size)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(len(losses), losses[-1])
    model.eval()
    opt.zero_grad(set_to_none=True)
    return losses


def task_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    *,
    n: int = 64,
    seed: int = 1234,
    max_new_tokens: int = 8,
    batch_size: int = 64,
    split: str = "train",
) -> float:
    """Mean task reward of greedy completions on `n` prompts of `split` sampled with `seed` (SFT batches are
    drawn from the train split: a task with splits keeps its eval problems out of warm starts)."""
    rng = random.Random(seed)
    items = [task.sample(rng) if split == "train" else task.sample(rng, split) for _ in range(n)]
    eos = getattr(task, "eos", None)
    stops = stop_token_ids(tokenizer, (eos,) if eos else ())
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    was_training = model.training
    model.eval()
    total = 0.0
    for batch in chunks(items, batch_size):
        outs = sample(
            model,
            [_encode(tokenizer, p) for p, _ in batch],
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            stop_ids=stops,
            pad_id=pad,
        )
        for (prompt, answer), out in zip(batch, outs):
            completion = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            total += float(task.reward(prompt, completion, answer))
    model.train(was_training)
    return total / max(1, n)
