"""The `openrouter` teacher binding: channel-3 traces from hosted models via OpenRouter.

Capabilities: {"replay"} only. Channel 2 ("distill") needs a teacher distribution over the STUDENT's token
ids at every student position; OpenRouter returns token strings from the teacher's own tokenizer (and at
most 20 alternatives), so there is no faithful mapping. `distributions()` therefore raises, and the topology
validator rejects `channels: [distill]` for this binding from `capabilities`. Traces are re-tokenised with
the student's tokenizer (`TeacherTrace.completion_ids` are student ids). A batch that fails for a reason
outside our code (the client's `OpenRouterError`s after their retries, or no usable trace) raises
`TeacherUnavailable`, so the pool applies the member's `on_failure`; anything else is a bug and propagates.

Episodes (a request with per-prompt `seeds`: the pool passes them only for a teacher's episode turns) are played
at the message level: each prompt is the conversation so far as chat messages, sent with its `tools`; the
answer is a turn (`TeacherTrace.message`: content and `tool_calls`) and, for training, the conversation and the
turn rendered by the student's chat template (`models.chat.turn_token_ids`). Every trace carries what its
request cost (`TeacherTrace.usage`: OpenRouter's token counts and `cost`).
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Protocol, runtime_checkable

from composer_mesh.actors.backends.teachers.config import OPENROUTER_CAPABILITIES, OpenRouterSettings
from composer_mesh.actors.backends.teachers.openrouter_client import OpenRouterClient
from composer_mesh.actors.backends.teachers.openrouter_wire import (
    ChatResult,
    OpenRouterConfigError,
    OpenRouterError,
)
from composer_mesh.actors.messages import Prompt, Rollout, TeacherTrace, TokenDistribution
from composer_mesh.actors.teacher_errors import TeacherUnavailable
from composer_mesh.actors.teacher_topk import TopK
from composer_mesh.models.chat import TurnRenderError, turn_token_ids

log = logging.getLogger("composer_mesh.openrouter")

__all__ = [
    "OpenRouterTeacher",
    "StudentTokenizer",
    "TeacherCapabilityError",
    "TeacherTraceError",
    "load_student_tokenizer",
]


class TeacherCapabilityError(NotImplementedError):
    """A teacher was asked for a signal its binding cannot supply."""


class TeacherTraceError(TeacherUnavailable, ValueError):
    """Teacher completions came back but none can be used as a trace in the student's vocabulary.

    An expected failure (`TeacherUnavailable`): what a hosted model writes is outside our control."""


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
    from composer_mesh.models.loading import load_tokenizer

    return load_tokenizer(student_model)  # type: ignore[return-value]


class OpenRouterTeacher:
    """Teacher binding over `OpenRouterClient`: async, batched, bounded by `max_concurrency`."""

    Settings: ClassVar[type[OpenRouterSettings]] = OpenRouterSettings
    capabilities: ClassVar[frozenset[str]] = OPENROUTER_CAPABILITIES

    def __init__(self, settings: OpenRouterSettings, **client_kwargs: Any) -> None:
        """`client_kwargs` (transport, sleep, rng) are for tests; the key is read in `start`."""
        self.settings = settings
        self.name = "openrouter"
        self._client_kwargs = client_kwargs
        self._client: OpenRouterClient | None = None
        self._tokenizer: StudentTokenizer | None = None
        self._untokenizable = 0
        self._misrendered = 0  # episode turns the student's chat template could not render as a continuation

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

    async def distributions(self, rollouts: list[Rollout], top_k: TopK) -> list[TokenDistribution]:
        raise TeacherCapabilityError(
            f"teacher {self.name!r} (binding openrouter) cannot give channel-2 distributions: OpenRouter returns "
            "token strings from the teacher's own tokenizer, not log-probs over the student's token ids. Use "
            "`channels: [replay]` for this teacher, or an hf/vllm teacher that shares the student's tokenizer "
            "for `distill`."
        )

    async def traces(self, prompts: list[Prompt], max_new_tokens: int, seed: int | None = None,
                     seeds: list[int] | None = None) -> list[TeacherTrace]:
        """One trace per prompt, in order, once every request has finished. `seed` and `seeds` are not sent: a
        hosted model's sampling is not reproducible anyway (providers treat a seed as best effort, when at all).
        `seeds` given: the prompts are episode turns, answered at the message level (`_turn_trace`).

        Failed prompts are left out when `partial_traces` (already-paid traces are kept; the pool's traces
        are a flat list, not aligned with prompts); otherwise, or when every request failed, raises
        `TeacherUnavailable` from the first failure (an `OpenRouterError`: HTTP error, rate limit or timeout
        after the retries, malformed response), naming its prompt and how many failed.
        """
        client, tokenizer = self._require_started()
        cap = self.settings.max_tokens
        max_tokens = min(max_new_tokens, cap) if cap is not None else max_new_tokens
        # Chat prompts go as their messages (the hosted model applies its own template), text prompts as text.
        turns = seeds is not None
        if turns and any(p.messages is None for p in prompts):
            raise ValueError(f"teacher {self.name!r}: an episode turn sent without its conversation as messages")
        asks = [p.text if p.messages is None else p.messages for p in prompts]
        results = await client.complete_many(asks, max_tokens=max_tokens,
                                             tools=[p.tools for p in prompts] if turns else None)
        failed = [(p, r) for p, r in zip(prompts, results) if isinstance(r, OpenRouterError)]
        if failed and (not self.settings.partial_traces or len(failed) == len(prompts)):
            prompt, err = failed[0]
            # The client's errors are already redacted and carry no httpx exception (which holds the headers).
            raise TeacherUnavailable(
                f"teacher {self.name!r} (binding openrouter): {len(failed)}/{len(prompts)} requests failed; first "
                f"(prompt {prompt.prompt_id!r}): {type(err).__name__}: {err}"
            ) from err
        for p, r in failed:
            log.warning("teacher %s: no trace for prompt %s: %s", self.name, p.prompt_id, r)
        out: list[TeacherTrace] = []
        lossy: list[tuple[str, str]] = []
        for p, r in zip(prompts, results):
            if not isinstance(r, ChatResult):
                continue
            trace = self._turn_trace(p, r, tokenizer) if turns else self._to_trace(p, r, tokenizer, max_new_tokens)
            if trace is None:
                lossy.append((p.prompt_id, r.text))
            else:
                out.append(trace)
        if lossy:
            self._untokenizable += len(lossy)
            pid, text = lossy[0]
            what = (
                f"teacher {self.name!r}: {len(lossy)}/{len(prompts)} teacher completions cannot be written in the "
                f"student's vocabulary (the student tokenizer does not round-trip them; first, prompt {pid!r}: "
                f"{text[:80]!r})"
            )
            if not out:
                raise TeacherTraceError(what + "; no usable traces. Ask the teacher for text in the student's alphabet")
            log.warning("%s; dropped", what)
        return out

    def usage(self) -> dict[str, float]:
        """The client's counters (requests, retries, failed_requests, tokens, cost, missing_logprobs) plus
        `untokenizable_traces` (completions dropped because the student's vocabulary cannot represent them)."""
        out = self._client.usage() if self._client is not None else {}
        out["untokenizable_traces"] = float(self._untokenizable)
        out["misrendered_turns"] = float(self._misrendered)
        return out

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def _require_started(self) -> tuple[OpenRouterClient, StudentTokenizer]:
        if self._client is None or self._tokenizer is None:
            raise RuntimeError(f"teacher {self.name!r}: call start(student_model, name) before traces()")
        return self._client, self._tokenizer

    def _to_trace(
        self, prompt: Prompt, r: ChatResult, tok: StudentTokenizer, max_new_tokens: int
    ) -> TeacherTrace | None:
        """Student-vocabulary ids for the teacher text, cut to the student's `max_new_tokens` budget.

        None when the student's tokenizer cannot represent the text (its ids do not decode back to it, e.g.
        a character-level tokenizer and characters outside its alphabet): a silently shortened trace would
        teach the student something the teacher never said. The teacher counts tokens in its own vocabulary,
        so its text can be longer in student tokens; when cut, `text` is the decoded cut so that text and ids
        always describe the same completion.
        """
        ids = list(tok.encode(r.text, add_special_tokens=False))
        if tok.decode(ids) != r.text:
            return None
        text = r.text
        if len(ids) > max_new_tokens:
            ids = ids[:max_new_tokens]
            text = tok.decode(ids)
        return TeacherTrace(teacher=self.name, prompt_id=prompt.prompt_id, text=text, completion_ids=ids,
                            usage=dict(r.usage))

    def _turn_trace(self, prompt: Prompt, r: ChatResult, tok: StudentTokenizer) -> TeacherTrace:
        """An episode turn: the reply as a chat message, and the conversation and the reply in the student's tokens
        (rendered by its chat template, tool-call arguments as objects, as templates expect them). A template
        that cannot render the turn as a continuation gives no ids (warned about once; the episode is dropped)."""
        message: dict[str, Any] = {"role": "assistant", "content": r.text}
        if r.tool_calls:
            message["tool_calls"] = r.tool_calls
        try:
            ids, turn = turn_token_ids(tok, [student_message(m) for m in prompt.messages or []],  # type: ignore[arg-type]
                                       student_message(message), prompt.tools)
        except TurnRenderError as e:
            if not self._misrendered:
                log.warning("teacher %s: the student's chat template cannot write its episode turns (%s); those "
                            "episodes are not trained on", self.name, e)
            self._misrendered += 1
            ids, turn = [], []
        return TeacherTrace(self.name, prompt.prompt_id, r.text, turn, prompt_ids=ids, message=message,
                            usage=dict(r.usage))


def student_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the student's chat template renders it: tool-call arguments as objects (chat templates
    write an object as JSON; a string, as OpenAI sends them, would be written quoted by some). Arguments that are
    not a JSON object stay the string they are."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            arguments = None
        if isinstance(arguments, dict):
            fn["arguments"] = arguments
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}
