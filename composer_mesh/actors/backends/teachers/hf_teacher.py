"""The `hf` teacher binding: a local transformers model as teacher (channel 2 distributions, channel 3 traces).

Channel 2 needs the teacher's distribution over the *student's* tokens, so it is only offered when the
teacher's tokenizer is the student's (same vocabulary and EOS); otherwise `distributions` (and
`check_distill`) raise an error naming the teacher, and the teacher can still serve channel 3 (`replay`),
whose traces are re-tokenised into the student's vocabulary from their text.

Alignment (the trainer's): for a rollout `prompt + completion`, row t of the distribution is the
teacher's output at position `len(prompt) - 1 + t`, i.e. the distribution that scores completion token t.
Dense rows are raw float32 logits over the student's model vocabulary; top-k rows are the k most likely
ids with their log-probs (log_softmax over the whole vocabulary). Rollouts are scored in forwards of at
most `max_batch` rows and `score_batch_tokens` padded tokens; each rollout's rows are reduced on the device
(top-k) or copied to the CPU (dense) while its batch's logits are alive, and nothing else of them is kept.
Compute runs in a worker thread so the actor's event loop stays responsive; one computation runs at a time.
Out of memory raises `TeacherUnavailable` (the pool applies the member's `on_failure`); other errors propagate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel

from composer_mesh.actors.backends.local_model import context_of, stop_ids_for, to_distribution
from composer_mesh.actors.backends.teachers.config import HF_TEACHER_CAPABILITIES, HFTeacherSettings
from composer_mesh.actors.backends.teachers.local_teacher import LocalTeacher
from composer_mesh.actors.messages import Rollout, TokenDistribution

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class HFTeacher(LocalTeacher):
    """A local transformers teacher. Capabilities: "distill" (shared tokenizer only) and "replay"."""

    Settings: ClassVar[type[BaseModel]] = HFTeacherSettings
    capabilities: ClassVar[frozenset[str]] = HF_TEACHER_CAPABILITIES
    binding: ClassVar[str] = "hf"
    settings: HFTeacherSettings

    def __init__(self, settings: HFTeacherSettings | None = None) -> None:
        super().__init__(settings or HFTeacherSettings())
        self.model: PreTrainedModel | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None

    def start(self, student_model: Any, name: str) -> None:
        """Load the teacher and the student's tokenizer; decide whether channel 2 is possible."""
        from composer_mesh.models.loading import load_pretrained

        self.name = name
        if self.settings.torch_threads is not None:
            torch.set_num_threads(self.settings.torch_threads)
        self.model, self.tokenizer = load_pretrained(self.settings.model, self.settings.cache_dir, self.settings.device)
        self.model.requires_grad_(False)
        self._vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self._context = context_of(self.model.config)
        self.stop_ids = stop_ids_for(
            self.tokenizer, self.settings.model, self.settings.stop_at_task_eos, self.model.generation_config
        )
        pad = self.tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else self.stop_ids[0])
        self.bind_student(student_model)

    def _require_started(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        if self.model is None or self.tokenizer is None:
            raise RuntimeError("HFTeacher: call start(student_model, name) first")
        return self.model, self.tokenizer

    def _compute_distributions(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        from composer_mesh.models.sampling import teacher_forced_map, token_budget_chunks

        model, _ = self._require_started()
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
        out: list[TokenDistribution] = []
        for rows in token_budget_chunks(lengths, self.settings.score_batch_tokens, self.settings.max_batch):
            batch = [rollouts[i] for i in rows]
            out += teacher_forced_map(
                model, [r.prompt_ids for r in batch], [r.completion_ids for r in batch], pad_id=self._pad_id,
                fn=lambda logits: self._to_distribution(logits, top_k),
            )
        return out

    def _to_distribution(self, logits: torch.Tensor, top_k: int) -> TokenDistribution:
        return to_distribution(self.name, self._to_student_vocab(logits), top_k)

    def _sample_traces(self, ids: list[list[int]], max_new_tokens: int, seed: int,
                       seeds: list[int] | None = None) -> list[list[int]]:
        from composer_mesh.models.sampling import sample

        model, _ = self._require_started()
        temp = self.settings.trace_temperature
        gen = torch.Generator(device=self.settings.device).manual_seed(seed)
        samples = []
        step = self.settings.max_batch
        for start in range(0, len(ids), step):
            samples += sample(
                model, ids[start : start + step], max_new_tokens=max_new_tokens, temperature=temp,
                stop_ids=self.stop_ids, pad_id=self._pad_id, generator=gen if temp > 0 else None,
                seeds=None if seeds is None or temp == 0 else seeds[start : start + step],
            )
        return [list(s.token_ids) for s in samples]
