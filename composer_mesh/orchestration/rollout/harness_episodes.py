"""The episodes a harness run has handed to agents: each one's conversation as served, token for token.

Why the endpoint keeps the conversation rather than re-render what the agent sends: the trainer must train on
the exact ids the policy sampled. So the first request of an episode is rendered by the generator's chat
template (`Prompt.messages`, `tools`), and every later request must be the conversation served so far (the
agent's messages, then each assistant message exactly as the endpoint answered it) plus new tool or user
messages; only those new messages are rendered, as the bridge onto the previous turn's exact ids
(`Prompt(token_ids=..., bridge_messages=...)`), and each served turn is added to the episode's `EpisodeTokens`.
A request that rewrote the conversation (an agent that summarises its history, cuts a long tool result, or drops
turns) is not an extension: it starts a new segment of the same episode, its messages rendered fresh by the chat
template like an opening, so the episode trains as several samples, each a prefix chain with the exact ids and
log-probs served (docs/agentic.md, "Rewritten conversations"). What cannot be a segment is still refused: an
unknown or ended episode, other tools than the episode's, a request that adds nothing to what was served.

Limits end an episode as the episode driver's do (`run.rollout.max_turns`, `max_context`): the request past one
is refused and the episode keeps its status; the agent still reports its end.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from composer_mesh.actors.messages import Prompt, RewardResult, Rollout
from composer_mesh.orchestration.rollout.chat_wire import (
    ChatRequest,
    Message,
    ServedTurn,
    WireError,
    served_message,
    template_messages,
)
from composer_mesh.orchestration.rollout.episode import TURN_SEED_STRIDE, EpisodeTokens, bridge_bound
from composer_mesh.orchestration.rollout.turns import TurnQueue
from composer_mesh.tasks.episode import EpisodeStatus

log = logging.getLogger("composer_mesh.harness")


@dataclass(frozen=True)
class HarnessTask:
    """One episode for an agent to play: where to send its requests (`base_url`, `api_key`, the `headers` that
    name the episode) and the task (the prompt's opening messages and tools, its reference answer and extra
    fields, the episode's seed)."""

    episode_id: str
    prompt_id: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    seed: int
    base_url: str
    api_key: str
    answer: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        """What each request of this episode carries (`openai` client: `extra_headers=task.headers`)."""
        return {"X-Episode-Id": self.episode_id}

    def wire(self) -> dict[str, Any]:
        """The task as `GET /v1/episodes/next` answers it (without the api key: the caller has it)."""
        return {k: v for k, v in asdict(self).items() if k != "api_key"}


@dataclass(frozen=True)
class TurnLimits:
    """What ends an endpoint episode besides its agent: policy turns, the context, the per-turn token cap."""

    max_turns: int
    max_new_tokens: int
    max_context: int | None


class HarnessEpisode:
    """One episode in progress: the conversation served so far (canonical messages and exact ids) and its end."""

    def __init__(self, episode_id: str, prompt: Prompt, seed: int, step: int, queue: TurnQueue,
                 limits: TurnLimits) -> None:
        self.id, self.prompt, self.seed, self.step = episode_id, prompt, seed, step
        self.queue, self.limits = queue, limits
        self.tokens = EpisodeTokens()
        self.history: list[Message] = []  # every message of the conversation, the served answers included
        self.tools: list[dict[str, Any]] | None = None
        self.call_names: dict[str, str] = {}
        self.status: EpisodeStatus = "done"
        self.lock = asyncio.Lock()
        self.ended: asyncio.Future[RewardResult | None] = asyncio.get_running_loop().create_future()

    async def serve(self, request: ChatRequest) -> ServedTurn:
        """Sample the next policy turn of this conversation and record it (one request of an episode at a time)."""
        async with self.lock:
            if self.ended.done():
                raise WireError(f"episode {self.id} has ended", "metadata", 409)
            prompt = self.extend(request)
            cap = min(request.max_tokens or self.limits.max_new_tokens, self.limits.max_new_tokens)
            turn = len(self.tokens.policy_turns())
            sampled = await self.queue.sample(prompt, self.seed + turn * TURN_SEED_STRIDE, self.step, cap)
            self.tokens.add(sampled)
            message = served_message(sampled.text, f"call_{self.id}_{turn}")
            self.history = [*request.messages, message]
            self.call_names.update({c["id"]: c["name"] for c in message.get("tool_calls", [])})
            return ServedTurn(message, list(sampled.completion_ids), list(sampled.logprobs),
                              len(sampled.prompt_ids), truncated=len(sampled.completion_ids) >= cap,
                              prompt_ids=list(sampled.prompt_ids))

    def extend(self, request: ChatRequest) -> Prompt:
        """The next turn's prompt: the exact ids so far bridged by the request's new messages, or the request's
        messages rendered fresh by the template (the opening, or a rewritten conversation: a new segment).
        Refuses a request that cannot be a turn of this episode, or that a limit ends."""
        if not self.history:
            self.tools = request.tools
            return self._fresh(request.messages)
        if request.tools != self.tools:
            raise WireError(f"tools: episode {self.id} was served with other tools; keep them for the episode",
                            "tools")
        new = self._new_messages(request)
        self._check_limits(request.messages if new is None else new, fresh=new is None)
        if new is None:
            self.tokens.rewrite()
            return self._fresh(request.messages)
        bridge = template_messages(new, self.call_names)
        return Prompt(self.prompt.prompt_id, "", token_ids=self.tokens.conversation(), bridge_messages=bridge,
                      answer=self.prompt.answer, extra=self.prompt.extra,
                      prefix_lengths=self.tokens.prompt_lengths())

    def _fresh(self, messages: list[Message]) -> Prompt:
        return Prompt(self.prompt.prompt_id, "", messages=template_messages(messages, self.call_names),
                      tools=self.tools, answer=self.prompt.answer, extra=self.prompt.extra)

    def _new_messages(self, request: ChatRequest) -> list[Message] | None:
        """What the request adds to the conversation as served (tool, user and system messages after it); None:
        it is not an extension (it rewrote, dropped or added to earlier messages, or added an assistant message
        the endpoint did not serve), and starts a new segment."""
        served = len(self.history)
        if request.messages == self.history:
            raise WireError(f"messages: episode {self.id}'s conversation has {served} messages and the request adds "
                            "none after them", "messages")
        new = request.messages[served:]
        if request.messages[:served] != self.history or any(m["role"] == "assistant" for m in new):
            return None
        return new

    def _check_limits(self, new: list[Message], fresh: bool) -> None:
        if len(self.tokens.policy_turns()) >= self.limits.max_turns:
            self.status = "truncated_turns"
            raise WireError(f"episode {self.id} played run.rollout.max_turns ({self.limits.max_turns}) turns; "
                            "report its end", "messages")
        so_far = 0 if fresh else len(self.tokens.conversation())
        need = so_far + bridge_bound(new) + self.limits.max_new_tokens
        if self.limits.max_context is not None and need > self.limits.max_context:
            self.status = "truncated_context"
            raise WireError(f"episode {self.id}: the next turn would not fit run.rollout.max_context "
                            f"({self.limits.max_context} tokens); report its end", "messages")

    def end(self, result: RewardResult | None, status: EpisodeStatus | None = None) -> None:
        """The episode is over: its reward (None: the rewarder scores it), and its status if not `done`."""
        if status is not None and self.status == "done":
            self.status = status
        if not self.ended.done():
            self.ended.set_result(result)

    def rollouts(self) -> list[Rollout]:
        """What the trainer takes: per segment, the served turns and the bridges between them, text = the
        segment's last answer (an episode never rewritten is one)."""
        status = self.status if self.tokens.segments else "error_environment"
        return self.tokens.rollouts(self.prompt, status, self.id, text=lambda texts: texts[-1])


def reward_of(body: Any, needs_reward: bool) -> RewardResult | None:
    """The reward an agent reported (`{"reward": number | null}`); null only when a rewarder can score it."""
    reward = body.get("reward") if isinstance(body, dict) else None
    if reward is None:
        if needs_reward:
            raise WireError("reward: a number is required (the run has no rewarder to score the episode)", "reward")
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise WireError(f"reward: a number or null is expected (got {reward!r})", "reward")
    return RewardResult(float(reward))


class EpisodeRegistry:
    """The episodes open to agents, by id (`chat_server.EpisodeEndpoint`), and the tasks waiting for an outside
    agent (`GET /v1/episodes/next`)."""

    def __init__(self, needs_reward: bool) -> None:
        self.needs_reward = needs_reward
        self.episodes: dict[str, HarnessEpisode] = {}
        self.waiting: asyncio.Queue[HarnessTask] = asyncio.Queue()

    def open(self, episode: HarnessEpisode) -> None:
        self.episodes[episode.id] = episode

    def close(self, episode_id: str) -> None:
        self.episodes.pop(episode_id, None)

    def find(self, episode_id: str) -> HarnessEpisode:
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise WireError(f"episode {episode_id!r} is not open (unknown, or already trained on)", "metadata", 404)
        return episode

    async def chat(self, episode_id: str, request: ChatRequest) -> ServedTurn:
        return await self.find(episode_id).serve(request)

    async def next_task(self, wait_s: float) -> dict[str, Any] | None:
        try:
            return (await asyncio.wait_for(self.waiting.get(), wait_s)).wire()
        except TimeoutError:
            return None

    def end(self, episode_id: str, body: Any) -> None:
        episode = self.find(episode_id)
        if episode.ended.done():
            raise WireError(f"episode {episode_id} has ended already", "metadata", 409)
        episode.end(reward_of(body, self.needs_reward))
