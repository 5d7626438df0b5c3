"""Token in, token out on real generators: a 3-turn tool episode played by hand on the tiny byte-tokenizer model
(turn 1 from messages + tools, later turns from the exact ids so far + the environment's bridge), checked to
keep every earlier id and to give the trainer exactly the sampler's log-probs on every policy token; and
per-prompt seeds (`GenerationRequest.seeds`) that keep a prompt's tokens whatever else is in the batch."""

from __future__ import annotations

import pytest
import torch
from services import require_module

from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings
from composer_mesh.actors.backends.trainer.train_batch import completion_logprobs
from composer_mesh.actors.messages import GenerationRequest, Prompt, Rollout, Turn
from composer_mesh.models.chat import chat_end_token_id
from composer_mesh.models.config import ModelConfig

BYTE = ModelConfig(tokenizer="byte", max_position_embeddings=320, seed=5)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
OPENINGS = [[{"role": "user", "content": "What is 2+3? Use the calculator."}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12*7?"}]]
# What the environment says after each policy turn (per episode): a tool result, then a user turn.
BRIDGES = [[{"role": "tool", "name": "calculator", "content": "5"}], [{"role": "user", "content": "Thanks. Once more?"}]]
TEMPERATURE = 0.8
LIMITS = [12, 10, 12]  # max_new_tokens of turns 1-3


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "composer_mesh_models")


@pytest.fixture(scope="module")
def reference(cache):
    """The trainer's copy of the weights, with a sharper head (log-probs far from uniform, so that matching
    them means something) whose `<|im_end|>` row points along the mean final hidden state, so that some turns
    end with the end token (about 1 step in 7) and others are cut by max_new_tokens. The generators are
    loaded with these weights."""
    from composer_mesh.models.loading import load_pretrained

    model, tokenizer = load_pretrained(BYTE, cache)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
        probe = torch.randint(0, 256, (4, 60), generator=torch.Generator().manual_seed(0))
        hidden = model.model(input_ids=probe).last_hidden_state.flatten(0, 1)
        mean, top = hidden.mean(0), model.lm_head(hidden).max(-1).values.mean()
        model.lm_head.weight[chat_end_token_id(tokenizer)] = mean / mean.norm() ** 2 * top * 1.6
    return model


def sharpened(reference) -> dict[str, torch.Tensor]:
    from composer_mesh.models.loading import named_weights

    return {n: t.detach().clone() for n, t in named_weights(reference).items()}


@pytest.fixture(scope="module")
def hf_gen(cache, reference):
    g = HFGenerator(HFGeneratorSettings(cache_dir=cache, max_batch=3))
    g.start(BYTE)
    g.load_weights(sharpened(reference))
    return g


def play(gen, max_new_tokens: list[int]) -> list[list[Rollout]]:
    """Two episodes side by side (one request per turn, each episode with its own seed), three turns each;
    turn i samples at most max_new_tokens[i]. Returns each episode's rollout per turn."""
    episodes: list[list[Rollout]] = [[] for _ in OPENINGS]
    prompts = [Prompt(f"e{i}", "", messages=m, tools=TOOLS) for i, m in enumerate(OPENINGS)]
    for turn, limit in enumerate(max_new_tokens):
        req = GenerationRequest(prompts, samples_per_prompt=1, max_new_tokens=limit, temperature=TEMPERATURE,
                                seeds=[100 * turn + 1, 100 * turn + 2])
        for e, group in enumerate(gen.generate(req, weight_version=0)):
            episodes[e].append(group.rollouts[0])
        if turn + 1 < len(max_new_tokens):
            prompts = [Prompt(f"e{e}", "", token_ids=r[-1].prompt_ids + r[-1].completion_ids, tools=TOOLS,
                              bridge_messages=BRIDGES[turn]) for e, r in enumerate(episodes)]
    return episodes


def as_episode(turns: list[Rollout], end_id: int) -> Rollout:
    """The turns as one episode: prompt = turn 1's prompt; completion = every later id, policy spans carrying
    the sampler's log-probs and the environment's (bridges, end tokens added to cut turns) log-prob 0."""
    prompt = turns[0].prompt_ids
    ids, logprobs, spans = [], [], []
    for k, r in enumerate(turns):
        if k:  # what the environment added between turn k-1 and turn k
            so_far = prompt + ids
            assert r.prompt_ids[: len(so_far)] == so_far  # the exact earlier ids: nothing re-tokenized
            added = r.prompt_ids[len(so_far) :]
            assert (added[0] == end_id) != (so_far[-1] == end_id)  # a cut turn (only) is closed by the end token
            spans.append(Turn(len(ids), len(ids) + len(added), policy=False))
            ids, logprobs = ids + added, logprobs + [0.0] * len(added)
        spans.append(Turn(len(ids), len(ids) + len(r.completion_ids), policy=True, weight_version=0))
        ids, logprobs = ids + r.completion_ids, logprobs + r.logprobs
    return Rollout(turns[0].prompt_id, prompt, ids, logprobs, weight_version=0, turns=spans)


def assert_trainer_sees_the_sampler(model, episodes: list[list[Rollout]], end_id: int, atol: float) -> None:
    rollouts = [as_episode(turns, end_id) for turns in episodes]
    sampled = [lp for turns in episodes for r in turns for lp in r.logprobs]
    assert min(sampled) < -6.0  # not a near-uniform model (that is -5.56): the check means something
    reasons = {r.finish_reason for turns in episodes for r in turns}
    assert reasons == {"stop", "length"}  # turns that ended with the end token and turns cut (it is added)
    with torch.no_grad():
        logps, mask = completion_logprobs(model, [r.prompt_ids for r in rollouts],
                                          [r.completion_ids for r in rollouts], TEMPERATURE)
    for b, r in enumerate(rollouts):
        policy = torch.tensor(r.loss_mask(), dtype=torch.bool)
        assert int(policy.sum()) == sum(len(t.completion_ids) for t in episodes[b])
        assert mask[b, : len(r.completion_ids)].all()
        ours = logps[b, : len(r.completion_ids)][policy].double()
        assert torch.allclose(ours, torch.tensor(r.logprobs).double()[policy], atol=atol, rtol=0), b


def test_hf_three_turn_episode_is_token_in_token_out(hf_gen, reference):
    end_id = chat_end_token_id(hf_gen.tokenizer)
    episodes = play(hf_gen, LIMITS)
    assert_trainer_sees_the_sampler(reference, episodes, end_id, atol=1e-5)
    assert episodes == play(hf_gen, LIMITS)  # each turn's seed makes the episode reproducible


def assert_seed_keeps_a_prompts_tokens_whatever_the_batch(gen) -> None:
    target = Prompt("t", "", messages=OPENINGS[0], tools=TOOLS)
    others = [Prompt(f"o{i}", "", messages=[{"role": "user", "content": "x" * (7 * i + 1)}]) for i in range(4)]

    def sample(prompts: list[Prompt], seeds: list[int]) -> dict[str, list[int]]:
        req = GenerationRequest(prompts, samples_per_prompt=1, max_new_tokens=12, temperature=1.0, seeds=seeds)
        return {g.prompt.prompt_id: g.rollouts[0].completion_ids for g in gen.generate(req, 0)}

    alone = sample([target], [42])["t"]
    # (hf's max_batch is 3: the target is in the first batch, then in the second, with different neighbours)
    assert sample([others[0], target, others[1]], [7, 42, 8])["t"] == alone
    assert sample([*others, target], [1, 2, 3, 4, 42])["t"] == alone
    assert sample([target], [43])["t"] != alone  # the seed is what decides


def test_hf_seed_keeps_a_prompts_tokens_whatever_the_batch(hf_gen):
    assert_seed_keeps_a_prompts_tokens_whatever_the_batch(hf_gen)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_three_turn_episode_and_seeds(cache, reference):
    require_module("vllm")
    from composer_mesh.actors.backends.generation.vllm_generator import VLLMGenerator

    gen = VLLMGenerator(VLLMGenerator.Settings(max_model_len=320, cache_dir=cache))
    try:
        gen.start(BYTE)
        gen.load_weights(sharpened(reference))
        end_id = chat_end_token_id(gen.engine.tokenizer)
        episodes = play(gen, LIMITS)
        assert_trainer_sees_the_sampler(reference, episodes, end_id, atol=1e-4)  # fp32 vLLM vs transformers
        assert episodes == play(gen, LIMITS)
        assert_seed_keeps_a_prompts_tokens_whatever_the_batch(gen)
    finally:
        gen.close()
