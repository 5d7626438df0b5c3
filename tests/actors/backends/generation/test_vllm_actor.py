"""The `vllm` generator inside the real GeneratorActor on its own Monarch proc, fed by the real weight plane.

The controller publishes new weights with a `WeightPublisher` (RDMA, TCP fallback here); the actor pulls
them, swaps them in before its next request, and its rollouts then match a transformers forward pass under
the new weights. One engine (in the actor's proc) for the module.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from generator_procs import small_topology
from services import require_module

from composer_mesh.mesh import runtime  # noqa: F401  (Monarch env defaults before monarch is imported)

pytestmark = pytest.mark.vllm

TOL = 1e-4
FAULTS: list[Any] = []


def _topology(cache: str) -> Any:
    generators = f'{{mesh: generators, binding: vllm, settings: {{max_model_len: 64, cache_dir: "{cache}"}}}}'
    return small_topology("vllm-actor-test", generators, weights="{transport: rdma, read_timeout_s: 120}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_module("vllm")
    import monarch.actor
    from monarch.actor import this_host

    from composer_mesh.actors.generator import GeneratorActor

    previous_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = FAULTS.append  # a fault fails the test instead of exiting pytest
    cache = str(tmp_path_factory.mktemp("model_cache"))
    topo = _topology(cache)
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="vllm_gen")
    actor = procs.spawn("vllm_generator", GeneratorActor, topo.role_configs()["generators"])
    yield topo, cache, actor
    procs.stop().get()
    monarch.actor.unhandled_fault_hook = previous_hook


def _request(tok):
    from composer_mesh.actors.messages import GenerationRequest, Prompt

    texts = ["3+4=", "9+8=", "1+0="]
    prompts = [Prompt(f"p{i}", t, tok.encode(t, add_special_tokens=False)) for i, t in enumerate(texts)]
    return GenerationRequest(prompts, samples_per_prompt=3, max_new_tokens=6, temperature=1.0, seed=0)


def _max_diff(model, groups) -> float:
    from composer_mesh.models.sampling import teacher_forced_logits

    rollouts = [r for g in groups for r in g.rollouts]
    ref = teacher_forced_logits(model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id=0)
    return max(
        float((torch.tensor(r.logprobs) - lg.log_softmax(-1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]).abs().max())
        for r, lg in zip(rollouts, ref)
    )


async def test_vllm_generator_actor_generates_and_takes_weight_pushes(setup):
    from composer_mesh.mesh.weights.plane import WeightPublisher
    from composer_mesh.models.loading import load_pretrained

    topo, cache, actor = setup
    name = await actor.setup.call_one()
    assert name == "generator0"
    model, tok = load_pretrained(topo.model, cache)  # the same materialized checkpoint as the actor's
    req = _request(tok)

    groups = await actor.generate.call_one(req)
    assert [len(g.rollouts) for g in groups] == [3, 3, 3]
    assert {r.weight_version for g in groups for r in g.rollouts} == {0}
    assert {r.generator for g in groups for r in g.rollouts} == {"generator0"}
    diff0 = _max_diff(model, groups)
    print(f"actor, initial weights: max |diff| = {diff0:.2e}")
    assert diff0 < TOL

    rng = torch.Generator().manual_seed(2)
    new = {k: (v + 0.3 * torch.randn(v.shape, generator=rng)).contiguous() for k, v in model.state_dict().items()}
    publisher = WeightPublisher(new, topo.weights)
    try:
        manifest = publisher.publish(new)
        synced = await actor.update_weights.call_one(manifest)
        assert synced.version == manifest.version
        model.load_state_dict(new)
        groups = await actor.generate.call_one(req)
        assert {r.weight_version for g in groups for r in g.rollouts} == {manifest.version}
        diff1 = _max_diff(model, groups)
        print(f"actor, after a weight-plane push: max |diff| = {diff1:.2e}")
        assert diff1 < TOL
    finally:
        publisher.close()
    assert FAULTS == []
