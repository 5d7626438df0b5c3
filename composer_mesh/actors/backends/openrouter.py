"""The `openrouter` teacher binding: channel-3 traces from hosted models via OpenRouter.

Capabilities: {"replay"} only. Channel 2 ("distill") needs a teacher distribution over the STUDENT's token
ids at every student position; OpenRouter returns token strings from the teacher's own tokenizer (and at
most 20 alternatives), so there is no faithful mapping. `distributions()` therefore raises, and the topology
validator rejects `channels: [distill]` for this binding from `capabilities`. Traces are re-tokenised with
the student's tokenizer (`TeacherTrace.completion_ids` are student ids).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Protocol, runtime_checkable

from composer_mesh.actors.backends.openrouter_client import (
    ChatResult,
    OpenRouterClient,
    OpenRouterConfigError,
    OpenRouterError,
    OpenRouterSettings,
)
from composer_mesh.actors.messages import Prompt, Rollout, TeacherTrace, TokenDistribution

log = logging.getLogger("composer_mesh.openrouter")

__all__ = ["OpenRouterTeacher", "StudentTokenizer", "TeacherCapabilityError", "load_student_tokenizer"]


class TeacherCapabilityError(NotImplementedError):
    """A teacher was asked for a signal its binding cannot supply."""


@runtime_checkable
class StudentTokenizer(Protocol):
    """The part of a (HF-style) tokenizer used to re-tokenise teacher text into student ids."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def load_student_tokenizer(student_model: Any) -> StudentTokenizer:
    """The student's tokenizer from its ModelConfig; a tokenizer object passes through unchanged.

    The only place this binding touches `composer_mesh.models` (imported lazily, so validation and the
    client tests need no model code).
    """
    if isinstance(student_model, StudentTokenizer):
        return student_model
    if student_model is None:
        raise OpenRouterConfigError(
            "the openrouter teacher needs the student's model config (for its tokenizer) to re-tokenise traces"
        )
    from composer_mesh.models import load_tokenizer  # type: ignore[attr-defined]

    return load_tokenizer(student_model)  # type: ignore[no-any-return]


class OpenRouterTeacher:
    """Teacher binding over `OpenRouterClient`: async, batched, bounded by `max_concurrency`."""

    Settings: ClassVar[type[OpenRouterSettings]] = OpenRouterSettings
    capabilities: ClassVar[frozenset[str]] = frozenset({"replay"})

    def __init__(self, settings: OpenRouterSettings, **client_kwargs: Any) -> None:
        """`client_kwargs` (transport, sleep, rng) are for tests; the key is read in `start`."""
        self.settings = settings
        self.name = "openrouter"
        self._client_kwargs = client_kwargs
        self._client: OpenRouterClient | None = None
        self._tokenizer: StudentTokenizer | None = None

    def __repr__(self) -> str:
        return f"OpenRouterTeacher(name={self.name!r}, models={self.settings.models!r}, started={self._client is not None})"

    def __getstate__(self) -> dict[str, Any]:
        # Never pickle the client (credentials, live sockets) or the tokenizer; `start` rebuilds them.
        state = dict(self.__dict__)
        state["_client"] = None
        state["_tokenizer"] = None
        state["_client_kwargs"] = {}
        return state

    def start(self, student_model: Any, name: str) -> None:
        """Read the key (fails fast, naming the env var) and load the student's tokenizer."""
        self.name = name
        self._client = OpenRouterClient(self.settings, **self._client_kwargs)
        self._tokenizer = load_student_tokenizer(student_model)

    async def distributions(self, rollouts: list[Rollout], top_k: int) -> list[TokenDistribution]:
        raise TeacherCapabilityError(
            f"teacher {self.name!r} (binding openrouter) cannot give channel-2 distributions: OpenRouter returns "
            "token strings from the teacher's own tokenizer, not log-probs over the student's token ids. Use "
            "`channels: [replay]` for this teacher, or an hf/vllm teacher that shares the student's tokenizer "
            "for `distill`."
        )

    async def traces(self, prompts: list[Prompt], max_new_tokens: int) -> list[TeacherTrace]:
        """One trace per prompt, in order. Raises the first failure after every request has finished."""
        client, tokenizer = self._require_started()
        cap = self.settings.max_tokens
        max_tokens = min(max_new_tokens, cap) if cap is not None else max_new_tokens
        results = await client.complete_many([p.text for p in prompts], max_tokens=max_tokens)
        failed = [(p, r) for p, r in zip(prompts, results) if isinstance(r, OpenRouterError)]
        if failed:
            prompt, err = failed[0]
            raise type(err)(
                f"teacher {self.name!r}: {len(failed)}/{len(prompts)} requests failed; first "
                f"(prompt {prompt.prompt_id!r}): {err}",
                status=err.status,
                retryable=err.retryable,
            )
        out: list[TeacherTrace] = []
        for p, r in zip(prompts, results):
            assert isinstance(r, ChatResult)
            out.append(self._to_trace(p, r, tokenizer, max_new_tokens))
        return out

    def usage(self) -> dict[str, float]:
        return self._client.usage() if self._client is not None else {}

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def _require_started(self) -> tuple[OpenRouterClient, StudentTokenizer]:
        if self._client is None or self._tokenizer is None:
            raise RuntimeError(f"teacher {self.name!r}: call start(student_model, name) before traces()")
        return self._client, self._tokenizer

    def _to_trace(self, prompt: Prompt, r: ChatResult, tok: StudentTokenizer, max_new_tokens: int) -> TeacherTrace:
        """Student-vocabulary ids for the teacher text, cut to the student's `max_new_tokens` budget.

        The teacher counts tokens in its own vocabulary, so its text can be longer in student tokens; when
        cut, `text` is the decoded cut so that text and ids always describe the same completion.
        """
        ids = list(tok.encode(r.text, add_special_tokens=False))
        text = r.text
        if len(ids) > max_new_tokens:
            ids = ids[:max_new_tokens]
            text = tok.decode(ids)
        return TeacherTrace(teacher=self.name, prompt_id=prompt.prompt_id, text=text, completion_ids=ids)
