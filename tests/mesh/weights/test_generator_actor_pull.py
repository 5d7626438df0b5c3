"""The real GeneratorActor (hf binding, tiny model, own Monarch proc) keeps generating while it pulls weights.

`tests/mesh/weights/test_weight_plane.py` shows pulls overlapping requests on stand-in actors (`plane_actors.py`);
here the request is a real `generate` on the real actor, fed by a real `WeightPublisher` in the controller
(the trainer's side). A long request is started, a new version is published and pulled with
`update_weights` while it runs, and:

- the pull returns before the request does (generation is not blocked by the pull);
- with `in_flight_weight_updates` off, the request's rollouts are all the old version; on, the new version
  is applied between decode steps: rollouts mix both versions and each is stamped with its oldest token's;
- afterwards `version` reports the new version, the active weights are the published ones (digest), and
  the next request is stamped with it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from generator_procs import generators_config, one_proc

FAULTS: list[Any] = []
_names = (f"gen_pull{i}" for i in itertools.count())


def _generator_config(in_flight: bool) -> Any:
    """The generators' role config of a small topology, as the launcher would hand it to the actor."""
    settings = f"max_batch: 256, stop_at_task_eos: false, torch_threads: 1, in_flight_weight_updates: {str(in_flight).lower()}"
    config = generators_config("generator-pull-test", f"{{mesh: generators, binding: hf, settings: {{{settings}}}}}")
    assert config.binding.settings.in_flight_weight_updates is in_flight
    return config


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    with one_proc("gen_pull", FAULTS) as pm:
        yield pm


def _request(n_prompts: int, samples: int, max_new_tokens: int, seed: int, temperature: float = 1.0) -> Any:
    from composer_mesh.actors.messages import GenerationRequest, Prompt

    texts = [f"{i % 10}+{(3 * i) % 10}=" for i in range(n_prompts)]
    return GenerationRequest(
        [Prompt(f"p{i}", t, []) for i, t in enumerate(texts)],
        samples_per_prompt=samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
    )


def _rows(groups: list[Any]) -> list[Any]:
    return [r for g in groups for r in g.rollouts]


@pytest.mark.parametrize("in_flight", [False, True], ids=["between_requests", "in_flight"])
async def test_generate_is_not_blocked_by_a_pull_on_the_real_actor(procs: Any, in_flight: bool) -> None:
    from composer_mesh.actors.digest import weights_digest
    from composer_mesh.actors.generator import GeneratorActor
    from composer_mesh.mesh.weights.plane import WeightPublisher
    from composer_mesh.models.config import ModelConfig
    from composer_mesh.models.tiny import build_tiny

    config = _generator_config(in_flight)
    actor = procs.spawn(next(_names), GeneratorActor, config)
    await actor.setup.call_one()
    assert await actor.version.call_one() == 0
    new = {k: v.detach().clone() for k, v in build_tiny(ModelConfig(seed=123))[0].state_dict().items()}
    publisher = WeightPublisher(new, config.weights)  # the trainer's side, in the controller
    try:
        # 256 rows in one batch, 100 tokens each: greedy, because the untrained model's greedy continuations
        # never stop here (sampled, most rows stop within 20 tokens and leave the batch: the request would end
        # in ~0.3 s, before the pull): ~1-2 s on a CPU.
        finished: dict[str, float] = {}

        async def timed(name: str, call: Any) -> Any:
            out = await call
            finished[name] = time.monotonic()
            return out

        started = time.monotonic()
        request = _request(16, 16, 100, seed=0, temperature=0.0)
        generating = asyncio.ensure_future(timed("generate", actor.generate.call_one(request)))
        deadline = time.monotonic() + 60
        while (await actor.stats.call_one())["requests"] < 1:  # the request has started (version 0 swapped in)
            assert not generating.done() and time.monotonic() < deadline
            await asyncio.sleep(0.005)
        # `requests` counts a request as it starts, just before its prefill: with in-flight updates, wait until
        # its first decode step asks for weights, so the prefill ran on version 0 (a fixed pause let a loaded
        # machine's pull overtake it: CI saw an in-flight request whose every token was version 1)
        while in_flight and (await actor.stats.call_one())["forwards"] < 2:
            assert not generating.done() and time.monotonic() < deadline
            await asyncio.sleep(0.005)
        manifest = publisher.publish(new)
        synced = await timed("pull", actor.update_weights.call_one(manifest))
        assert synced.version == manifest.version == 1 and synced.num_params == len(new)
        assert not generating.done(), "the pull waited for the request in flight"
        rows = _rows(await generating)
        assert finished["pull"] < finished["generate"]
        print(f"pull returned after {finished['pull'] - started:.2f} s, generate after {finished['generate'] - started:.2f} s")
        assert len(rows) == 256 and max(len(r.completion_ids) for r in rows) == 100

        if not in_flight:
            assert all(r.weight_version == 0 and r.token_versions is None for r in rows)
        else:
            for r in rows:
                assert r.token_versions is not None and len(r.token_versions) == len(r.completion_ids)
                assert r.token_versions == sorted(r.token_versions) and set(r.token_versions) <= {0, 1}
                assert r.weight_version == min(r.token_versions) == 0  # the prefill ran on version 0
            mixed = [r for r in rows if set(r.token_versions) == {0, 1}]
            assert mixed, "no rollout decoded across the swap"
            print(f"in-flight swap: {len(mixed)}/{len(rows)} rollouts mix versions 0 and 1, first new token at "
                  f"{min(r.token_versions.index(1) for r in mixed)}")

        assert await actor.version.call_one() == 1
        assert await actor.weights_digest.call_one() == (1, weights_digest(new))
        after = _rows(await actor.generate.call_one(_request(3, 2, 4, seed=1)))
        assert after and all(r.weight_version == 1 for r in after)
        assert all(r.token_versions == ([1] * len(r.completion_ids) if in_flight else None) for r in after)
    finally:
        publisher.close()
    assert FAULTS == []


def test_new_weights_differ(procs: Any) -> None:
    """Guard for the digest check above: the published weights are not the actor's initial ones."""
    from composer_mesh.models.config import ModelConfig
    from composer_mesh.models.tiny import build_tiny

    a = build_tiny(ModelConfig(seed=4))[0].state_dict()
    b = build_tiny(ModelConfig(seed=123))[0].state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)
