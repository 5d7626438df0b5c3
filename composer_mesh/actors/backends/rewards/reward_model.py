"""Binding `reward_model` for the rewarder role: a transformers sequence-classification model scoring
(prompt, completion) pairs, as TRL's GRPOTrainer takes one among its `reward_funcs`: the text is prompt +
completion (a chat prompt: the messages plus the completion as the assistant's turn, through the model's chat
template when it has one), tokenized without added special tokens, right-padded, and the score is
`logits[:, 0]`. Pairs are scored `batch_size` at a time, on the rewarder's proc (`device`: CPU or a GPU).

Its failures are data like every rewarder's: a batch whose forward raises (out of memory, a text the tokenizer
cannot take) scores 0.0 with `ok=False` and the error, and the run's reward-failure stop counts it.
"""

from __future__ import annotations

import math
import threading
from typing import Any, ClassVar

import torch
from pydantic import BaseModel

from composer_mesh.actors.backends.rewards.config import REWARD_MODEL_CAPABILITIES, RewardModelSettings
from composer_mesh.actors.messages import Prompt, RewardResult, Rollout

LABEL = "reward_model"  # its key in `RewardResult.components`


class RewardModelRewarder:
    """Loads the model and its tokenizer once (in `__init__`, on the rewarder's proc); `score_batch` scores
    every pair of a request in forward passes of `batch_size` pairs."""

    Settings: ClassVar[type[BaseModel]] = RewardModelSettings
    capabilities: ClassVar[frozenset[str]] = REWARD_MODEL_CAPABILITIES

    def __init__(self, settings: RewardModelSettings) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(settings.path)
        if self.tokenizer.pad_token is None:  # right-padding needs one; the model finds each text's last token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(settings.path).to(settings.device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self._lock = threading.Lock()  # one forward at a time: requests may come from several threads
        self.calls = 0
        self.failures = 0

    def score(self, prompt: Prompt, rollout: Rollout) -> RewardResult:
        return self.score_batch([(prompt, rollout)])[0]

    def score_batch(self, items: list[tuple[Prompt, Rollout]]) -> list[RewardResult]:
        results: list[RewardResult] = []
        size = self.settings.batch_size
        for start in range(0, len(items), size):
            results.extend(self._scored(items[start:start + size]))
        with self._lock:
            self.calls += len(results)
            self.failures += sum(not r.ok for r in results)
        return results

    def texts(self, items: list[tuple[Prompt, Rollout]]) -> list[str]:
        """What the model reads for each pair (TRL's: prompt + completion, or the chat with the completion)."""
        out = []
        for prompt, rollout in items:
            if prompt.messages and getattr(self.tokenizer, "chat_template", None):
                chat = [*prompt.messages, {"role": "assistant", "content": rollout.text}]
                out.append(self.tokenizer.apply_chat_template(chat, tokenize=False))
            else:
                out.append(prompt.text + rollout.text)
        return out

    def _scored(self, items: list[tuple[Prompt, Rollout]]) -> list[RewardResult]:
        try:
            scores = self.logits(self.texts(items))[:, 0].tolist()
        except Exception as e:  # a failure is data: the batch's rollouts fail, the rewarder lives on
            error = f"reward model {self.settings.path!r} failed: {type(e).__name__}: {e}"[:300]
            return [RewardResult(score=0.0, ok=False, error=error) for _ in items]
        return [RewardResult(score=s, components={LABEL: s}) if math.isfinite(s)
                else RewardResult(score=0.0, ok=False, error=f"reward model {self.settings.path!r} scored {s}")
                for s in scores]

    def logits(self, texts: list[str]) -> Any:
        """The model's logits for `texts`, [len(texts), num_labels], as float32 on the CPU."""
        kwargs: dict[str, Any] = {"truncation": True, "max_length": self.settings.max_length} \
            if self.settings.max_length else {}
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                               add_special_tokens=False, **kwargs)
        with self._lock, torch.inference_mode():
            out = self.model(**{k: v.to(self.settings.device) for k, v in batch.items()})
        return out.logits.float().cpu()

    def close(self) -> None:
        """Free the model (its GPU memory) when the actor stops."""
        self.model = None
        if self.settings.device.startswith("cuda"):
            torch.cuda.empty_cache()
