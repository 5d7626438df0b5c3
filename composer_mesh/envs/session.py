"""The session protocol every multi-turn environment speaks: `reset` -> first observation, `step(action)` ->
observation, reward, done; `close`.

Why a protocol of its own (and not `Environment`): an `Environment` is a stream of prompts scored after the
fact; an episode is a conversation whose next observation depends on what the policy did. The rollout driver
(`orchestration/rollout/multi_turn.py`) holds one session per episode, feeds it the text of each policy turn and
appends what it answers, as token ids, to the episode. Everything an episode needs to be played again the same
way is in how the session was made: the task row and the seed (`EpisodeEnvironment.session`), which is how a
resumed run restarts an episode that was in flight.

Observations are chat messages (`{"role": "tool" | "user", "content": ...}`, a tool result may carry `name`
and `tool_call_id`): the generator's tokenizer renders them with the model's chat template as the bridge to the
next assistant turn (`models.chat.bridge_token_ids`), so the controller never tokenizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from composer_mesh.tasks.episode import EpisodeStatus

Message = dict[str, Any]


@dataclass
class Observation:
    """What a session shows the policy at the start: the opening conversation and the tools it may call."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)  # JSON schemas, as transformers' get_json_schema


@dataclass
class StepResult:
    """The environment's answer to one policy turn.

    `messages`: what it adds to the conversation (tool results, a user turn; empty when it ends the episode
    with nothing to say). `reward`: this turn's reward (None: none); an episode's reward is the sum of its turns'.
    `done`: the episode is over, with `status` saying how. `info`: counters for the metrics (e.g.
    `{"tool_calls": 2, "tool_errors": 1}`), numbers only. `feedback`: what went wrong with this turn, in words,
    when the environment saw a mistake (a tool error, a failing visible test, a wrong answer); None: nothing it
    could name. It is what a hint source may turn into targeted feedback (`orchestration/rollout/hints.py`); it
    is never shown to the policy unless it is also in `messages`.

    `rewrite`: the conversation from the next turn on, replacing everything before it, the opening included (a
    summary in place of earlier turns, a long tool result cut short); `messages` follow it. None: the conversation
    goes on as it was. Why a field of its own: a rewritten conversation is no longer a prefix of the ids the policy
    sampled, so the next turn cannot be bridged onto them; it is rendered fresh by the chat template (these
    messages, with the opening's tools) and starts a new segment of the episode: one more training sample, a
    prefix chain of its own with exact log-probs, sharing the episode's reward (docs/agentic.md, "Rewritten
    conversations")."""

    messages: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    status: EpisodeStatus = "done"
    info: dict[str, float] = field(default_factory=dict)
    feedback: str | None = None
    rewrite: list[Message] | None = None


class EpisodePrompt(Protocol):
    """What a session reads of the prompt it plays (`actors.messages.Prompt` has it): the task row."""

    prompt_id: str
    text: str
    answer: str | None
    messages: list[Message] | None
    extra: dict[str, Any]


class EnvSession(Protocol):
    """One episode of an environment. Methods may be called from one asyncio task at a time only; a session
    that fails raises (the driver ends the episode with status `error_environment`), a bad action from the
    policy (a malformed or unknown tool call) is an observation, never an exception."""

    async def reset(self) -> Observation:
        """Start the episode: its first observation."""
        ...

    async def step(self, action: str) -> StepResult:
        """The policy's turn (its decoded text), acted on."""
        ...

    async def close(self) -> None:
        """Release what the episode holds (a sandbox work dir, a server session); idempotent."""
        ...


class EpisodeEnvironment(Protocol):
    """An environment whose prompts are played as episodes: the run's prompt source gives its rows as `Prompt`s
    (train stream and a disjoint held-out set, as every `Environment`), and each prompt is played in a session."""

    name: str

    def session(self, prompt: EpisodePrompt, seed: int) -> EnvSession:
        """A new episode of `prompt`'s task; `seed` fixes whatever the environment draws, so the same prompt and
        seed play the same episode for the same actions."""
        ...
