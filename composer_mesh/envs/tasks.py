"""Environments as `Task`s (composer_mesh.tasks): what a warm start of the tiny byte-tokenizer model trains on.

Import-light: generators and teachers import a model's task for its end marker only, so reasoning-gym (seconds
to import) is imported when a task first samples, not here.
"""

from __future__ import annotations

import functools
import random
import string
from typing import TYPE_CHECKING

from composer_mesh.envs.config import ReasoningGymConfig
from composer_mesh.models.tokenizer import IM_END, build_byte_tokenizer
from composer_mesh.tasks.data import DataRow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from composer_mesh.envs.reasoning_gym import ReasoningGymEnvironment


def answer_target(answer: str) -> str:
    """The completion a perfect policy writes for the byte tokenizer's chat: the answer in tags, end of turn."""
    return f"<answer>{answer}</answer>{IM_END}"


class ReasoningGymTask:
    """A reasoning-gym environment as a `Task` (composer_mesh.tasks), to warm-start the tiny byte-tokenizer model
    (`model.warmstart.task`) and to be its `model.task` (stop marker `<|im_end|>`).

    Warm starts encode prompt text, so a prompt is the environment's chat messages rendered with the byte
    tokenizer's chat template: the same token ids the generators get for the chat prompt. The "train" split
    draws train entries and skips eval questions, as the environment's stream does; "eval" draws the eval set.
    It must be built with the `run.environment` it warm-starts for (same settings and seed)."""

    splits = ("train", "eval")
    alphabet = string.printable  # unused by the byte tokenizer this task is meant for
    eos = IM_END

    def __init__(self, cfg: ReasoningGymConfig, seed: int = 0) -> None:
        self.cfg, self.seed = cfg, cfg.seed if cfg.seed is not None else seed
        self.name = f"reasoning_gym:{cfg.dataset}"
        self._rows: dict[str, DataRow] = {}  # prompt text -> its row, for `reward`

    @functools.cached_property
    def environment(self) -> ReasoningGymEnvironment:
        from composer_mesh.envs.reasoning_gym import ReasoningGymEnvironment

        return ReasoningGymEnvironment(self.cfg, self.seed)

    @functools.cached_property
    def _tokenizer(self) -> PreTrainedTokenizerFast:
        return build_byte_tokenizer()

    def sample(self, rng: random.Random, split: str = "train") -> tuple[str, str]:
        env = self.environment
        if split == "eval":
            row = rng.choice(env.eval)
        else:
            for _ in range(100 * (1 + len(env.eval))):
                index = rng.randrange(self.cfg.size)
                entry = env.entry(self.seed, self.cfg.size, index)
                if not env.is_eval_question(str(entry["question"])):
                    break
            else:
                raise ValueError(f"{self.name}: no train entry found outside the eval set")
            row = env.row(entry, self.seed, self.cfg.size, index)
        text = str(self._tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=False))
        self._rows[text] = row
        return text, row.answer or ""

    def target(self, answer: str) -> str:
        return answer_target(answer)

    def reward(self, prompt: str, completion: str, answer: str | None) -> float:
        row = self._rows.get(prompt)
        if row is None:
            raise ValueError(f"{self.name}: reward() of a prompt this task did not sample")
        from composer_mesh.envs.reasoning_gym import score

        return score(row.text, completion, answer, row.extra)


# The environment of topologies/reasoning_gym.yaml (its `model.task` and warm starts), small enough for the tiny
# model on a CPU: sums of two numbers from 0 to 10 ("Calculate 3 + 7." -> "10"; 121 distinct questions, 16 held
# out), no system message.
TINY_ADDITION = ReasoningGymConfig(
    kind="reasoning_gym",
    dataset="basic_arithmetic",
    config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
            "allow_parentheses": False, "allow_negation": False},
    size=1000,
    eval_size=16,
    seed=0,
    system_prompt=None,
)
tiny_addition = ReasoningGymTask(TINY_ADDITION)
