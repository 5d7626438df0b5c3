"""The held-out numbers are honest: the addition task's eval problems are never trained on, by the RL run's prompt
stream nor by the SFT warm starts of the policy and the teacher."""

from __future__ import annotations

import random

import pytest

from composer_mesh.models.warmstart import sft_batch, task_examples
from composer_mesh.tasks.arithmetic import AdditionTask


def test_addition_train_and_eval_problems_are_disjoint_and_cover_their_splits():
    task = AdditionTask()
    rng = random.Random(0)
    train = {task.sample(rng)[0] for _ in range(5000)}
    evals = {task.sample(rng, "eval")[0] for _ in range(2000)}
    assert not train & evals
    assert len(train) == 80 and len(evals) == 20  # every problem of each split is drawn
    assert {str(a + b) for a, b in task.pairs["eval"]} <= {str(a + b) for a, b in task.pairs["train"]}
    with pytest.raises(ValueError, match="splits"):
        task.sample(rng, "test")


def test_warm_start_batches_hold_no_eval_problem():
    """The SFT batches (policy and teacher warm starts) decode to train-split problems only."""
    from composer_mesh.models.tokenizer import build_tokenizer

    task = AdditionTask()
    tokenizer = build_tokenizer(task.alphabet)
    held_out = {f"{a}+{b}=" for a, b in task.pairs["eval"]}
    rng = random.Random(1)
    seen = set()
    for _ in range(40):
        ids, attn, _ = sft_batch(task_examples(task, tokenizer), tokenizer, rng, batch_size=32)
        for row, mask in zip(ids.tolist(), attn.tolist()):
            text = tokenizer.decode([t for t, m in zip(row, mask) if m], skip_special_tokens=True)
            seen.add(text.split("=", 1)[0] + "=")
    assert len(seen) == 80 and not seen & held_out
