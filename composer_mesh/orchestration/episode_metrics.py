"""A step's episode metrics: how episodes ended, how long they were, what their environment counted.

Why in the step record: a policy that learns to break tool calls on purpose, or an environment whose server
keeps failing, shows up first as a change in these numbers (statuses, tool errors per episode), not in the
reward. Counters come from each episode's `RewardResult.components` (what its environment's `StepResult.info`
summed, e.g. `tool_calls`, `tool_errors`, the coding environment's behaviour counters), means are per episode.
Beside them two rates over the step's episodes, which the run plot's behaviour panel draws: tool errors per call,
and unreadable calls per call attempted (a policy whose reward rises while these climb is gaming its tools). A
step of single completions has none.
"""

from __future__ import annotations

from collections import Counter

from composer_mesh.actors.messages import ScoredGroup, TeacherTrace
from composer_mesh.tasks.episode import EPISODE_STATUSES


def episode_metrics(groups: list[ScoredGroup]) -> dict[str, float]:
    """`episode/*` means over the step's episodes (turns, the environment's counters, `segments`: training samples
    per episode) and the fraction ending with each status ({} for no episode). An episode of several segments
    (a rewritten conversation) is counted once: its segments share its status and reward."""
    rows = [(r, rw) for g in groups for r, rw in zip(g.group.rollouts, g.rewards) if r.turns is not None]
    pairs = [(r, rw) for r, rw in rows if r.opens_episode]
    if not pairs:
        return {}
    n = len(pairs)
    statuses = Counter(r.status for r, _ in pairs)
    counters: Counter[str] = Counter()
    for _, rw in pairs:
        counters.update(rw.components)
    out = {  # token sums are the trainer's (`episode/policy_tokens`, `episode/env_tokens`)
        **{f"episode/status_{s}": statuses[s] / n for s in EPISODE_STATUSES},
        "episode/segments": len(rows) / n,
        **{f"episode/{k}": v / n for k, v in sorted(counters.items())},
        **error_rates(counters),
    }
    return out


def error_rates(counters: Counter[str]) -> dict[str, float]:
    """`episode/tool_error_rate` (tool errors / tool calls) and `episode/parse_error_rate` (unreadable calls /
    calls attempted, read or not), summed over the step's episodes; each left out where it would divide by 0."""
    calls, errors, unread = counters["tool_calls"], counters["tool_errors"], counters["parse_errors"]
    out = {}
    if calls > 0:
        out["episode/tool_error_rate"] = errors / calls
    if calls + unread > 0:
        out["episode/parse_error_rate"] = unread / (calls + unread)
    return out


def teacher_episode_metrics(traces: list[TeacherTrace]) -> dict[str, float]:
    """Per replay teacher, what its episodes in the step cost (from each trace's summed `usage`): `episodes`,
    `cost_usd` (the step's sum, as the provider reports it; 0 for a local teacher), `cost_per_episode_usd`, and
    `tokens_per_episode` / `completion_tokens_per_episode` (in the teacher's own tokens). Why per step: a hosted
    teacher is paid per token, and its cost per episode is what decides whether its episodes are worth it."""
    by_teacher: dict[str, list[TeacherTrace]] = {}
    for t in traces:
        if t.turns is not None:  # an episode, not a single-turn trace
            by_teacher.setdefault(t.teacher, []).append(t)
    out: dict[str, float] = {}
    for name, played in sorted(by_teacher.items()):
        n = len(played)
        cost = sum(t.usage.get("cost", 0.0) for t in played)
        completion = sum(t.usage.get("completion_tokens", 0.0) for t in played)
        tokens = completion + sum(t.usage.get("prompt_tokens", 0.0) for t in played)
        out.update({f"teacher_episodes/episodes/{name}": float(n), f"teacher_episodes/cost_usd/{name}": cost,
                    f"teacher_episodes/cost_per_episode_usd/{name}": cost / n,
                    f"teacher_episodes/tokens_per_episode/{name}": tokens / n,
                    f"teacher_episodes/completion_tokens_per_episode/{name}": completion / n})
    return out
