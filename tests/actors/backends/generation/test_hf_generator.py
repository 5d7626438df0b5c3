"""The `hf` generator binding on the tiny model: log-prob contract, seeding, stops, weight loading (between
requests, or between decode steps with in_flight_weight_updates)."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings
from composer_mesh.actors.messages import GenerationRequest, Prompt
from composer_mesh.models.config import ModelConfig

STUDENT = ModelConfig(warmstart={"steps": 30})  # same as tests/models: one cache build per session


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "composer_mesh_models")


@pytest.fixture(scope="module")
def gen(cache):
    g = HFGenerator(HFGeneratorSettings(cache_dir=cache, max_batch=5, name="g0"))
    g.start(STUDENT)
    return g


@pytest.fixture(scope="module")
def reference(cache):
    """An independent copy of the same weights for recomputation."""
    from composer_mesh.models.loading import load_pretrained

    return load_pretrained(STUDENT, cache)


def prompts(tok, n: int, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        text = f"{a}+{b}=" if i % 3 else f"{a}+{b}+{i % 10}="  # mixed lengths: exercises left padding
        out.append(Prompt(f"p{i}", text, tok.encode(text, add_special_tokens=False), str(a + b)))
    return out


def recompute_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    p = len(rollout.prompt_ids)
    rows = logits[p - 1 : p - 1 + len(rollout.completion_ids)]
    logp = torch.log_softmax(rows / temperature if temperature > 0 else rows, dim=-1)
    return logp.gather(-1, torch.tensor(rollout.completion_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_are_those_of_the_sampling_distribution(gen, reference, temperature):
    model, tok = reference
    req = GenerationRequest(prompts(tok, 6), samples_per_prompt=3, max_new_tokens=5, temperature=temperature, seed=11)
    groups = gen.generate(req, weight_version=4)
    assert [g.prompt.prompt_id for g in groups] == [p.prompt_id for p in req.prompts]
    for g in groups:
        assert len(g.rollouts) == 3 and g.weight_version == 4
        for r in g.rollouts:
            assert r.prompt_ids == g.prompt.token_ids and r.generator == "g0" and r.weight_version == 4
            assert torch.allclose(torch.tensor(r.logprobs), recompute_logprobs(model, r, temperature), atol=1e-5)
            assert r.text == tok.decode(r.completion_ids, skip_special_tokens=True)


def test_stops_at_task_eos_or_length(gen):
    tok = gen.tokenizer
    semicolon = tok.encode(";", add_special_tokens=False)[0]
    assert set(gen.stop_ids) == {tok.eos_token_id, semicolon}
    groups = gen.generate(GenerationRequest(prompts(tok, 8), samples_per_prompt=4, max_new_tokens=3, seed=0), 0)
    reasons = set()
    for r in (r for g in groups for r in g.rollouts):
        reasons.add(r.finish_reason)
        stops = [i for i, t in enumerate(r.completion_ids) if t in gen.stop_ids]
        if r.finish_reason == "stop":
            assert stops == [len(r.completion_ids) - 1]
        else:
            assert stops == [] and len(r.completion_ids) == 3
    assert "stop" in reasons  # the warm-started student ends with ';'


def test_seeded_sampling_is_reproducible(gen):
    tok = gen.tokenizer
    req = GenerationRequest(prompts(tok, 5), samples_per_prompt=4, max_new_tokens=6, temperature=1.0, seed=5)

    def ids(groups):
        return [r.completion_ids for g in groups for r in g.rollouts]

    a, b = ids(gen.generate(req, 0)), ids(gen.generate(req, 0))
    assert a == b
    req.seed = 6
    assert ids(gen.generate(req, 0)) != a
    # Without a request seed calls differ from each other (settings.seed + call index).
    req.seed = None
    assert ids(gen.generate(req, 0)) != ids(gen.generate(req, 0))


def test_prompt_text_is_encoded_when_ids_are_missing_and_bad_ids_are_named(gen):
    tok = gen.tokenizer
    [g] = gen.generate(GenerationRequest([Prompt("t", "2+2=", [])], samples_per_prompt=1, seed=0), 0)
    assert g.rollouts[0].prompt_ids == tok.encode("2+2=", add_special_tokens=False)
    with pytest.raises(ValueError, match=r"prompt 'bad' has token ids \[999\] outside"):
        gen.generate(GenerationRequest([Prompt("bad", "", [1, 999])]), 0)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        gen.generate(GenerationRequest(prompts(tok, 1), samples_per_prompt=0), 0)


def test_weight_specs_are_the_trainer_weights(gen, reference):
    from composer_mesh.models.loading import named_weights

    model, _ = reference
    specs = gen.weight_specs()
    assert specs == {k: (tuple(v.shape), v.dtype) for k, v in named_weights(model).items()}
    assert set(specs) == set(model.state_dict())  # untied tiny model: every state-dict entry
    assert "lm_head.weight" in specs and "model.embed_tokens.weight" in specs


def test_load_weights_then_generate_uses_new_weights(cache):
    from composer_mesh.models.tiny import build_tiny

    g = HFGenerator(HFGeneratorSettings(cache_dir=cache))
    g.start(STUDENT)
    req = GenerationRequest(prompts(g.tokenizer, 6), samples_per_prompt=2, max_new_tokens=4, temperature=0.0)
    before = [r.completion_ids for grp in g.generate(req, 0) for r in grp.rollouts]
    other, _ = build_tiny(ModelConfig(seed=123))  # untrained, different seed
    new = {k: v.clone() for k, v in other.state_dict().items()}

    bad = dict(new)
    bad.pop("lm_head.weight")
    with pytest.raises(ValueError, match=r"missing names \['lm_head.weight'\]"):
        g.load_weights(bad)
    bad = {**new, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"'model.norm.weight' is \(3,\)"):
        g.load_weights(bad)
    with pytest.raises(ValueError, match="unknown names"):
        g.load_weights({**new, "extra.weight": torch.zeros(1)})

    g.load_weights(new)
    for name, p in g.model.state_dict().items():
        assert torch.equal(p, new[name]), name
    after = g.generate(req, 1)
    assert [r.completion_ids for grp in after for r in grp.rollouts] != before
    assert all(r.weight_version == 1 for grp in after for r in grp.rollouts)
    # Log-probs now follow the new weights.
    r = after[0].rollouts[0]
    assert torch.allclose(torch.tensor(r.logprobs), recompute_logprobs(other, r, 0.0), atol=1e-5)


def test_settings_are_validated_and_the_binding_resolves():
    from composer_mesh.roles import resolve_binding

    with pytest.raises(ValidationError, match="device 'gpu' is not one of"):
        HFGeneratorSettings(device="gpu")
    with pytest.raises(ValidationError, match="max_batch"):
        HFGeneratorSettings(max_batch=0)
    with pytest.raises(ValidationError, match="batch_size"):
        HFGeneratorSettings.model_validate({"batch_size": 3})
    b = resolve_binding("generators", "hf")
    assert b.cls is HFGenerator and b.settings_model is HFGeneratorSettings
    for name, field in HFGeneratorSettings.model_fields.items():
        assert field.description, name


def test_generate_before_start_is_a_clear_error():
    with pytest.raises(RuntimeError, match="call start"):
        HFGenerator().generate(GenerationRequest([]), 0)


def test_tied_embeddings_are_one_weight(cache, tmp_path):
    """A local checkpoint with a tied head: the head is not a separate weight, and loading updates it."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    from composer_mesh.models.loading import load_tokenizer, materialize

    base = materialize(ModelConfig(), cache)
    cfg = AutoConfig.from_pretrained(str(base), local_files_only=True)
    cfg.tie_word_embeddings = True
    Qwen2ForCausalLM(cfg).save_pretrained(str(tmp_path))
    load_tokenizer(ModelConfig()).save_pretrained(str(tmp_path))
    g = HFGenerator(HFGeneratorSettings(cache_dir=cache))
    g.start(ModelConfig(source=str(tmp_path)))
    specs = g.weight_specs()
    assert "model.embed_tokens.weight" in specs and "lm_head.weight" not in specs
    gen = torch.Generator().manual_seed(0)
    new = {k: torch.randn(shape, generator=gen, dtype=dtype) for k, (shape, dtype) in specs.items()}
    g.load_weights(new)
    assert torch.equal(g.model.get_output_embeddings().weight, new["model.embed_tokens.weight"])


def test_rollouts_do_not_depend_on_max_batch(gen, cache):
    """Row r of a request samples with seed `request.seed + r` from its own stream, so batching them 5 at a
    time (the module's generator) or all together gives the same rollouts."""
    wide = HFGenerator(HFGeneratorSettings(cache_dir=cache, max_batch=64, name="g0"))
    wide.start(STUDENT)
    req = GenerationRequest(prompts(gen.tokenizer, 7), samples_per_prompt=3, max_new_tokens=6, temperature=1.0,
                            seed=21)
    narrow_out = [(r.completion_ids, r.finish_reason) for g in gen.generate(req, 0) for r in g.rollouts]
    assert narrow_out == [(r.completion_ids, r.finish_reason) for g in wide.generate(req, 0) for r in g.rollouts]
    assert len({tuple(ids) for ids, _ in narrow_out}) > 3  # and the rows do differ from each other


def test_a_weight_load_waits_for_the_request_in_flight(cache, monkeypatch):
    """Weights change only between requests: every token of a request comes from the version it is stamped with."""
    import threading

    import composer_mesh.models.sampling as sampling
    from composer_mesh.models.tiny import build_tiny

    g = HFGenerator(HFGeneratorSettings(cache_dir=cache, max_batch=2))
    g.start(STUDENT)
    req = GenerationRequest(prompts(g.tokenizer, 3), samples_per_prompt=2, max_new_tokens=4, temperature=0.0)
    before = [r.completion_ids for grp in g.generate(req, 0) for r in grp.rollouts]
    new = {k: v.clone() for k, v in build_tiny(ModelConfig(seed=123))[0].state_dict().items()}
    loader = threading.Thread(target=g.load_weights, args=(new,))
    real_sample, calls = sampling.sample, []

    def sample_then_load(*args, **kwargs):
        calls.append(len(calls))
        if len(calls) == 1:  # the first of three batches: start a load, which must wait for the whole request
            loader.start()
            loader.join(timeout=0.5)
            assert loader.is_alive()
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(sampling, "sample", sample_then_load)
    during = g.generate(req, 0)
    loader.join(timeout=30)
    assert len(calls) == 3 and not loader.is_alive()
    assert [r.completion_ids for grp in during for r in grp.rollouts] == before
    assert all(torch.equal(p, new[n]) for n, p in g.model.state_dict().items())


# -- in-flight weight updates, through the GeneratorService (the actor's plain object) ---------------------
SWAP_AT = 2  # the pull completes just before the forward that produces token 2 of the first batch


def _service(cache: str, in_flight: bool):
    from composer_mesh.actors.generator import GeneratorService
    from composer_mesh.mesh.weights.config import WeightPlaneConfig

    settings = HFGeneratorSettings(cache_dir=cache, max_batch=4, stop_at_task_eos=False,
                                   in_flight_weight_updates=in_flight)
    svc = GeneratorService(HFGenerator(settings), WeightPlaneConfig(transport="shm"), name="g")
    svc.start(STUDENT)
    return svc


@pytest.fixture
def publishers():
    """Weight publishers made by a test, closed (shared memory unlinked) after it."""
    made: list = []
    yield made
    for p in made:
        p.close()


def _pull_mid_request(svc, monkeypatch, publishers) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Publish other weights (shm, in this process); while the service's first batch is being sampled, a real
    `svc.update(manifest)` runs on another thread and completes: just before decode step SWAP_AT when the
    sampler gets a `refresh`, else before the batch starts. Returns the new weights and the pulled version."""
    import asyncio
    import threading

    import composer_mesh.models.sampling as sampling
    from composer_mesh.mesh.weights.plane import WeightPublisher
    from composer_mesh.models.tiny import build_tiny

    new = {k: v.clone() for k, v in build_tiny(ModelConfig(seed=123))[0].state_dict().items()}
    publisher = WeightPublisher(new, svc.weights_config)
    publishers.append(publisher)
    manifest = publisher.publish(new)
    pulled: list[int] = []

    def pull() -> None:
        thread = threading.Thread(target=lambda: pulled.append(asyncio.run(svc.update(manifest)).version))
        thread.start()
        thread.join(timeout=60)
        assert pulled == [manifest.version]

    real_sample = sampling.sample

    def sample_with_a_pull(*args, refresh=None, **kwargs):
        if pulled:
            return real_sample(*args, refresh=refresh, **kwargs)
        if refresh is None:
            pull()
            return real_sample(*args, **kwargs)
        calls = []

        def refresh_after_pull() -> int:
            if len(calls) == SWAP_AT:
                pull()
            calls.append(1)
            return refresh()

        return real_sample(*args, refresh=refresh_after_pull, **kwargs)

    monkeypatch.setattr(sampling, "sample", sample_with_a_pull)
    return new, pulled


def _rows(groups):
    return [r for g in groups for r in g.rollouts]


def test_in_flight_update_lands_between_decode_steps(cache, monkeypatch, publishers):
    """On: a pull that completes mid-request is loaded at the next decode step. The first batch's rows carry
    [v0]*SWAP_AT + [v1]*..., later batches v1 only; every rollout's weight_version is its oldest token's, and
    the tokens before the swap are those of the same request without a pull."""
    svc = _service(cache, in_flight=True)
    assert svc.in_flight_updates and svc.backend.in_flight_updates
    req = GenerationRequest(prompts(svc.backend.tokenizer, 6), samples_per_prompt=2, max_new_tokens=6,
                            temperature=1.0, seed=3)
    reference = _rows(svc.generate(req))  # no pull: every token version 0
    assert all(r.token_versions == [0] * len(r.completion_ids) and r.weight_version == 0 for r in reference)
    new, pulled = _pull_mid_request(svc, monkeypatch, publishers)
    rows = _rows(svc.generate(req))
    v1 = pulled[0]
    assert v1 == 1 and svc.version == v1 and svc._pending is None
    assert all(torch.equal(p, new[n]) for n, p in svc.backend.model.state_dict().items())
    assert len(rows) == 12 and all(r.generator == "g" for r in rows)
    for i, (r, ref) in enumerate(zip(rows, reference)):
        n = len(r.completion_ids)
        assert r.weight_version == min(r.token_versions)
        if i < 4:  # the first batch (max_batch 4): swapped between decode steps
            assert r.token_versions == ([0] * SWAP_AT + [v1] * n)[:n], i
            assert r.completion_ids[:SWAP_AT] == ref.completion_ids[:SWAP_AT], i
            assert r.weight_version == 0
        else:  # later batches start on the new weights
            assert r.token_versions == [v1] * n and r.weight_version == v1, i
    mixed = [r for r in rows if set(r.token_versions) == {0, v1}]
    assert mixed, "no rollout decoded across the swap"
    assert [g.weight_version for g in svc.generate(req)] == [v1] * 6


def test_without_in_flight_the_pull_waits_for_the_next_request(cache, monkeypatch, publishers):
    """Off (the default): the same mid-request pull changes nothing in the request in flight (one version, no
    token_versions, the reference tokens); the next request is stamped with the new version."""
    svc = _service(cache, in_flight=False)
    assert not svc.in_flight_updates and not svc.backend.in_flight_updates
    req = GenerationRequest(prompts(svc.backend.tokenizer, 6), samples_per_prompt=2, max_new_tokens=6,
                            temperature=1.0, seed=3)
    reference = _rows(svc.generate(req))
    new, pulled = _pull_mid_request(svc, monkeypatch, publishers)
    rows = _rows(svc.generate(req))
    assert pulled == [1] and svc.version == 0 and svc._pending is not None
    assert [(r.completion_ids, r.logprobs) for r in rows] == [(r.completion_ids, r.logprobs) for r in reference]
    assert all(r.weight_version == 0 and r.token_versions is None for r in rows)
    after = _rows(svc.generate(req))
    assert svc.version == 1 and all(r.weight_version == 1 and r.token_versions is None for r in after)
    assert all(torch.equal(p, new[n]) for n, p in svc.backend.model.state_dict().items())


def test_an_episodes_next_turn_hits_the_prefix_cache_and_a_weight_load_empties_it(cache, reference):
    """The next turn (last prompt + its tokens + a reply, with the last prompt's length) reuses the stored prompt;
    after load_weights it is prefilled whole by the new weights: a stale hit would score it with the old weights'
    keys."""
    from composer_mesh.models.tiny import build_tiny

    g = HFGenerator(HFGeneratorSettings(cache_dir=cache, name="pc"))
    g.start(STUDENT)
    assert g.settings.prefix_cache_mb == 256 and g.stats()["prefix_hits"] == 0
    tok = g.tokenizer
    first = GenerationRequest(prompts(tok, 2), samples_per_prompt=1, max_new_tokens=4, temperature=1.0, seeds=[1, 2])
    turn1 = [grp.rollouts[0] for grp in g.generate(first, 0)]

    def next_turn(version_note: str) -> GenerationRequest:
        reply = tok.encode(f" ok{version_note}:", add_special_tokens=False)
        return GenerationRequest([Prompt(f"n{i}", "", r.prompt_ids + r.completion_ids + reply, "",
                                         prefix_lengths=[len(r.prompt_ids)]) for i, r in enumerate(turn1)], samples_per_prompt=1, max_new_tokens=4,
                                 temperature=1.0, seeds=[3, 4])

    turn2 = [grp.rollouts[0] for grp in g.generate(next_turn("a"), 0)]
    assert g.stats()["prefix_hits"] == 2
    assert g.stats()["prefix_reused_tokens"] == sum(len(r.prompt_ids) for r in turn1)
    model, _ = reference
    for r in turn2:
        assert torch.allclose(torch.tensor(r.logprobs), recompute_logprobs(model, r, 1.0), atol=1e-5)

    other, _ = build_tiny(ModelConfig(seed=123))
    g.load_weights({k: v.clone() for k, v in other.state_dict().items()})
    assert len(g.prefix_cache) == 0
    hits = g.stats()["prefix_hits"]
    for r in (grp.rollouts[0] for grp in g.generate(next_turn("b"), 1)):
        assert torch.allclose(torch.tensor(r.logprobs), recompute_logprobs(other.eval(), r, 1.0), atol=1e-5)
    assert g.stats()["prefix_hits"] == hits  # nothing left from the old weights to hit
    off = HFGenerator(HFGeneratorSettings(cache_dir=cache, prefix_cache_mb=0))
    assert off.prefix_cache is None and off.stats() == {}
