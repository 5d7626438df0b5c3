"""Targeted feedback: a hint at an episode's mistake makes the current policy its own channel-2 teacher.

Composer 2.5's recipe (docs/agentic.md "Targeted feedback"): where an episode went wrong (a tool error, a failing
test, a wrong answer), a short hint is inserted into the conversation at that point; the policy conditioned on it
knows better, so its distributions over the student's OWN following tokens are a teacher, and channel 2 distils
toward them on those tokens only. Nothing is sampled again: the teacher scores the tokens the student played.

Where the hint goes: before the policy turn that made the mistake (the turn whose environment answer carried the
feedback), so the teacher re-scores the mistaken turn itself and every later policy token. Turn 0's hint is one
more message after the opening conversation (rendered through the chat template with the tools); a later turn's
is appended to the environment messages bridged in before it, onto the exact ids of the conversation so far, as
a turn's prompt is built (token in, token out). The teacher's rows cover `completion_ids[offset:]`, with `offset`
the hinted turn's first token (`TokenDistribution.offset`); environment tokens among them are never distilled.

The teacher is the generators' policy with their current weights (`ports.Generators.distributions`), no copy on
the trainer; its rows follow channel 2's dense/top-k rule (`run.teacher_top_k`). An episode with a hint takes its
channel-2 targets from it; episodes without one keep the teachers' (if any).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from composer_mesh.actors.messages import Prompt, SelfTeacherRequest, TeacherRequest, TokenDistribution
from composer_mesh.actors.teacher_topk import TopK
from composer_mesh.bindings import import_object
from composer_mesh.errors import UserInputError
from composer_mesh.orchestration.config import HintsConfig
from composer_mesh.orchestration.ports import Generators, Teachers
from composer_mesh.orchestration.rollout.episode import Episode, EpisodeStep
from composer_mesh.orchestration.schedule import StepTimes
from composer_mesh.orchestration.scoring import merge_signals


@dataclass(frozen=True)
class Hint:
    """A hint inserted before policy turn `turn` (0-based, the turn that made the mistake)."""

    turn: int
    text: str


HintRule = Callable[[Prompt, list[EpisodeStep]], Any]  # -> Hint | None, or an awaitable of it


class BadHint(UserInputError, ValueError):
    """A hint rule returned something that is not a hint of the episode it was given."""


def feedback_rule(template: str) -> HintRule:
    """The environment's own feedback on the first turn it saw a mistake in, through `template`."""

    def rule(prompt: Prompt, steps: list[EpisodeStep]) -> Hint | None:
        for k, step in enumerate(steps):
            if step.feedback:
                return Hint(k, template.format(feedback=step.feedback))
        return None

    return rule


def rule_of(config: HintsConfig) -> HintRule | None:
    """The hint rule `config` names (None: no targeted feedback, or a teacher writes the hints)."""
    if config.source == "environment":
        return feedback_rule(config.template)
    if config.source == "rule":
        assert config.rule is not None
        fn = import_object(config.rule)
        if not callable(fn):
            raise BadHint(f"run.rollout.hints.rule {config.rule!r} is not a function")
        return fn  # type: ignore[no-any-return]
    return None


@dataclass(frozen=True)
class Hinted:
    """What the self-teacher scores for one episode: the conversation up to the hinted turn with the hint in it,
    and the student's tokens from that turn on (`offset` is where they start in its completion)."""

    prompt: Prompt
    continuation: list[int]
    offset: int
    policy_tokens: int  # of the continuation: what channel 2 distils
    sampled: list[float]  # the sampler's log-probs of the hinted (mistaken) turn: the continuation's first tokens


def hinted(prompt: Prompt, episode: Episode, hint: Hint, role: str) -> Hinted:
    """`episode` with `hint` inserted before its policy turn `hint.turn` (raises `BadHint` for a turn it lacks)."""
    r = episode.rollout
    assert r.turns is not None
    positions = [i for i, t in enumerate(r.turns) if t.policy]
    if isinstance(hint.turn, bool) or not isinstance(hint.turn, int) or not 0 <= hint.turn < min(
            len(positions), len(episode.steps)):
        raise BadHint(f"episode {r.prompt_id!r}: a hint for policy turn {hint.turn!r}, but the episode has "
                      f"{len(episode.steps)} answered policy turns")
    if not isinstance(hint.text, str) or not hint.text.strip():
        raise BadHint(f"episode {r.prompt_id!r}: the hint for turn {hint.turn} has no text")
    at = positions[hint.turn]
    turn, step = r.turns[at], episode.steps[hint.turn]
    message = {"role": role, "content": hint.text}
    if hint.turn == 0:
        conditioned = Prompt(prompt.prompt_id, prompt.text, messages=[*step.before, message], tools=step.tools,
                             extra=prompt.extra)
    else:
        bridge = r.turns[at - 1]  # the environment's span before the turn: rebuilt with the hint in it
        conditioned = Prompt(prompt.prompt_id, "", token_ids=[*r.prompt_ids, *r.completion_ids[:bridge.start]],
                             bridge_messages=[*step.before, message], extra=prompt.extra)
    return Hinted(conditioned, r.completion_ids[turn.start:], turn.start, sum(r.loss_mask()[turn.start:]),
                  list(r.logprobs[turn.start:turn.end]))


def mistake_shift(d: TokenDistribution, h: Hinted) -> float | None:
    """How much the hint moved the mistaken turn: the hinted policy's mean log-prob of the student's own tokens of
    that turn minus the sampler's (nats per token). Above 0: the hint endorses the mistake, and channel 2 would
    teach it. Below 0 says only that the hinted policy is less sure of those tokens, not that it knows the right
    ones: a teacher that spreads its mass is below 0 too (the calculator ablation's warm start was at -0.28 while
    its hinted policy gave the student's wrong digit more than the student did: docs/benchmarks.md). Top-k rows
    bound a token outside the k by the row's lowest listed log-prob. None: the turn has no tokens. The sampler's
    log-probs are at the run's temperature, so the two compare at temperature 1 only."""
    n = len(h.sampled)
    if n == 0:
        return None
    tokens = torch.tensor(h.continuation[:n])
    if d.logits is not None:
        teacher = torch.log_softmax(d.logits[:n].float(), dim=-1).gather(1, tokens[:, None])[:, 0]
    else:
        assert d.topk_ids is not None and d.topk_logprobs is not None
        ids, lps = d.topk_ids[:n], d.topk_logprobs[:n].float()
        found = ids == tokens[:, None]
        teacher = torch.where(found.any(1), (lps * found).sum(1), lps.min(1).values)
    return float((teacher - torch.tensor(h.sampled)).mean())


def transcript(steps: list[EpisodeStep], upto: int, limit: int) -> str:
    """The episode's conversation through policy turn `upto`, as plain text, then the environment's feedback on
    it: what a hint-writing teacher reads (its last `limit` characters: the mistake is at the end)."""
    lines = []
    for step in steps[: upto + 1]:
        lines += [f"{m.get('role', '?')}: {m.get('content', '')}" for m in step.before]
        lines.append(f"assistant: {step.text}")
    lines.append(f"feedback: {steps[upto].feedback}")
    return "\n".join(lines)[-limit:]


class HintWriter:
    """`hints.source: teacher`: the named teacher reads each episode through its first turn with feedback and
    writes the hint for that turn (one teacher request per chunk; a teacher that is unavailable with `on_failure:
    skip` writes none, and those episodes get no hint)."""

    def __init__(self, config: HintsConfig, teachers: Teachers) -> None:
        assert config.teacher is not None
        self.config, self.teachers = config, teachers
        self.find = feedback_rule("{feedback}")
        self.unwritten = 0

    def ask(self, prompt_id: str, steps: list[EpisodeStep], turn: int) -> Prompt:
        """The writer's prompt for a hint at `turn`: the instruction, then the transcript (a unique id per episode,
        so each written hint finds its episode)."""
        transcript_text = transcript(steps, turn, self.config.transcript_chars)
        return Prompt(prompt_id, "", messages=[{"role": "system", "content": self.config.instruction},
                                               {"role": "user", "content": transcript_text}])

    async def hints(self, prompts: list[Prompt], steps: list[list[EpisodeStep]], seed: int) -> list[Hint | None]:
        """One hint or None per episode (`steps` empty: an episode that takes none)."""
        found = [self.find(p, s) if s else None for p, s in zip(prompts, steps)]
        asks = [(i, h.turn) for i, h in enumerate(found) if h is not None]
        out: list[Hint | None] = [None] * len(prompts)
        if not asks:
            return out
        request = TeacherRequest(prompts=[self.ask(f"{prompts[i].prompt_id}#hint{i}", steps[i], k) for i, k in asks],
                                 max_new_tokens=self.config.max_tokens, seed=seed, teachers=[self.config.teacher])
        written = {t.prompt_id: t.text.strip() for t in merge_signals(await self.teachers.signals(request), 0).traces}
        for (i, k), p in zip(asks, request.prompts):
            text = written.get(p.prompt_id, "")
            out[i] = Hint(k, text) if text else None
            self.unwritten += not text
        return out


class SelfTeacher:
    """Hints for finished episodes and the current policy's distributions under them, asked of the generators
    in turn (one request per chunk)."""

    def __init__(self, config: HintsConfig, generators: Generators, top_k: TopK,
                 teachers: Teachers | None = None) -> None:
        self.config, self.generators, self.top_k = config, generators, top_k
        self.rule = rule_of(config)
        self.writer = None
        if config.source == "teacher":
            if teachers is None:
                raise BadHint(f"run.rollout.hints.teacher {config.teacher!r} writes hints, but the run has no teachers")
            self.writer = HintWriter(config, teachers)
        assert self.rule is not None or self.writer is not None, "SelfTeacher needs a hint source"
        self._next = 0
        self.episodes = self.hinted = self.tokens = self.too_long = 0
        self.shift_sum, self.shifts = 0.0, 0

    async def hint(self, prompt: Prompt, episode: Episode) -> Hint | None:
        """The rule's hint for a played episode (none for one whose environment failed: it trains with reward 0)."""
        if not playable(episode) or self.rule is None:
            return None
        out = self.rule(prompt, list(episode.steps))
        if inspect.isawaitable(out):
            out = await out
        if out is not None and not isinstance(out, Hint):
            raise BadHint(f"the hint rule returned {type(out).__name__} for episode {prompt.prompt_id!r}; return a "
                          "composer_mesh.orchestration.rollout.hints.Hint(turn, text) or None")
        return out

    async def hints(self, prompts: list[Prompt], episodes: list[Episode], seed: int) -> list[Hint | None]:
        """One hint or None per episode, from the rule or the hint-writing teacher."""
        if self.writer is not None:
            return await self.writer.hints(prompts, [e.steps if playable(e) else [] for e in episodes], seed)
        return [await self.hint(p, e) for p, e in zip(prompts, episodes)]

    async def distributions(self, prompts: list[Prompt], episodes: list[Episode],
                            times: StepTimes | None = None, seed: int = 0) -> list[TokenDistribution | None]:
        """One entry per episode: the hint-conditioned policy's rows over its tokens from the hinted turn on
        (`offset` set), None for an episode without a hint. `seed`: the hint writer's sampling seed."""
        made: list[tuple[int, Hinted]] = []
        t0 = time.perf_counter()  # a hint-writing teacher's seconds count as teacher time too
        for i, (p, e, h) in enumerate(zip(prompts, episodes, await self.hints(prompts, episodes, seed))):
            if h is not None:
                made.append((i, hinted(p, e, h, self.config.role)))
        self.episodes += len(episodes)
        out: list[TokenDistribution | None] = [None] * len(episodes)
        if not made:
            return out
        request = SelfTeacherRequest([m.prompt for _, m in made], [m.continuation for _, m in made], self.top_k)
        index, self._next = self._next % len(self.generators), self._next + 1
        _, dists = await self.generators.distributions(index, request)
        if times is not None:
            times.teacher_s += time.perf_counter() - t0
        for (i, m), d in zip(made, dists, strict=True):
            if d is None:  # the hint made the episode longer than the model's context
                self.too_long += 1
                continue
            self._measure(d, m)
            out[i] = replace(d, teacher="self", offset=m.offset)
            self.hinted += 1
            self.tokens += m.policy_tokens
        return out

    def _measure(self, d: TokenDistribution, m: Hinted) -> None:
        shift = mistake_shift(d, m)
        if shift is not None:
            self.shift_sum, self.shifts = self.shift_sum + shift, self.shifts + 1

    def counters(self) -> dict[str, float]:
        """Run-wide: episodes looked at, episodes given a hint, the policy tokens distilled toward the hinted
        policy, hints left out because the hinted episode did not fit the model's context, the mean
        `mistake_shift` over the hints scored (`hints/*` in each step's record); with a hint-writing teacher, the
        hints it did not write."""
        out = {"hints/episodes": float(self.episodes), "hints/hinted": float(self.hinted),
               "hints/tokens": float(self.tokens), "hints/too_long": float(self.too_long),
               "hints/mistake_shift": self.shift_sum / self.shifts if self.shifts else 0.0}
        return out | ({} if self.writer is None else {"hints/unwritten": float(self.writer.unwritten)})


def playable(episode: Episode) -> bool:
    """Whether an episode can take a hint: it has turns and steps, its environment did not fail, and its
    conversation was never rewritten (an episode of several segments is no one prefix chain to insert it into)."""
    return (episode.rollout.turns is not None and episode.rollout.status != "error_environment"
            and bool(episode.steps) and not episode.earlier)


def overlay(base: list[TokenDistribution | None], hints: list[TokenDistribution | None]) -> list[
        TokenDistribution | None]:
    """Channel 2's targets per rollout: the hint-conditioned policy's where an episode has a hint, else `base`."""
    return [h if h is not None else b for b, h in zip(base, hints, strict=True)]

