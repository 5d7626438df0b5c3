"""`LookupTask`, the lookup MCP environment as a warm-start task: its demonstrations are perfect episodes of the
server's own problems (the chain of `lookup` calls the table answers, then `submit` of its number), in the
tool-call format the session parses, and the warm start can cut them into turns with the byte tokenizer's chat
template. (That the server lists `LOOKUP_TOOLS` and shows `lookup_prompt` is checked against a real server in
test_openenv_session.py.)"""

from __future__ import annotations

import random

from composer_mesh.envs.openenv_session import LOOKUP_HOPS, LOOKUP_TOOLS, LookupTask, lookup_problem
from composer_mesh.envs.tools import parse_tool_calls
from composer_mesh.models.tokenizer import build_byte_tokenizer
from composer_mesh.models.warmstart import IGNORE, chat_turn_examples
from composer_mesh.tasks import get_task


def test_a_demonstration_follows_the_servers_chain_and_submits_its_number() -> None:
    task = get_task("composer_mesh.envs.openenv_session:LookupTask")
    rng, again = random.Random(5), random.Random(5)
    messages, tools = task.chat_demonstration(rng)  # type: ignore[attr-defined]
    seed = again.randrange(10**9)  # the demonstration's problem: the train draw of that seed
    start, table, answer = lookup_problem(seed, "train", LOOKUP_HOPS)
    assert tools == list(LOOKUP_TOOLS) and messages[0]["role"] == "user" and repr(start) in messages[0]["content"]
    calls = [parse_tool_calls(m["content"]) for m in messages if m["role"] == "assistant"]
    assert all(not c.errors and len(c.calls) == 1 for c in calls)
    keys = [c.calls[0].arguments["key"] for c in calls[:-1]]
    assert keys[0] == start and [table[k] for k in keys[:-1]] == keys[1:] and table[keys[-1]] == answer
    assert (calls[-1].calls[0].name, calls[-1].calls[0].arguments) == ("submit", {"answer": answer})
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert results == [table[k] for k in keys]


def test_the_warm_start_cuts_demonstrations_into_template_turns() -> None:
    tokenizer = build_byte_tokenizer()
    draw = chat_turn_examples(LookupTask(), tokenizer)
    rng = random.Random(0)
    for _ in range(8):
        ids, labels = draw(rng)
        n = labels.count(IGNORE)
        text = tokenizer.decode(ids[n:])
        assert labels[:n] == [IGNORE] * n and labels[n:] == ids[n:]
        assert text.startswith('<tool_call>{"name": "') and text.endswith("<|im_end|>")
        assert "tools: lookup(key), submit(answer)" in tokenizer.decode(ids[:n])


def test_a_whole_episode_warm_start_learns_every_tool_call_of_a_demonstration() -> None:
    """Each example is one demonstration: its learnt spans are exactly its assistant turns (each a tool call ended
    by the end-of-turn token), the tools' results between them are only read."""
    tokenizer = build_byte_tokenizer()
    draw = chat_turn_examples(LookupTask(), tokenizer, whole=True)
    rng = random.Random(0)
    for _ in range(8):
        ids, labels = draw(rng)
        learnt = [i for i, label in enumerate(labels) if label != IGNORE]
        assert [ids[i] for i in learnt] == [labels[i] for i in learnt]
        starts = [i for i in learnt if labels[i - 1] == IGNORE]
        ends = [i + 1 for i in learnt if i + 1 == len(labels) or labels[i + 1] == IGNORE]
        turns = [tokenizer.decode(ids[a:b]) for a, b in zip(starts, ends, strict=True)]
        assert len(turns) >= 2
        assert all(t.startswith('<tool_call>{"name": "') and t.endswith("<|im_end|>") for t in turns)
        assert "tools: lookup(key), submit(answer)" in tokenizer.decode(ids[: learnt[0]])


def test_samples_are_prompts_and_answers_of_their_split() -> None:
    task = LookupTask()
    prompt, answer = task.sample(random.Random(1), "eval")
    assert prompt.startswith("Look up '") and answer.isdigit() and task.reward(prompt, f" {answer} ", answer) == 1.0
    assert task.reward(prompt, "no", answer) == 0.0
