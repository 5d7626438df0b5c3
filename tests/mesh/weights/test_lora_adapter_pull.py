"""LoRA adapter-only sync (`trainer.settings.lora.sync: adapter`) through the real weight plane to real
GeneratorActors (hf binding, tiny model, their own Monarch proc).

Two `hf` trainers in the controller train the same adapters (same LoRA seed, same batches): one publishes the
adapters alone (`sync: adapter`), the other the merged weights (`sync: merged`), each through its own
`TrainerService` (the trainer actor's publish path). The generators' role configs come from the topology: the
`adapter` one carries the trainer's `lora`, derived. After one pull:

- the adapter generator received the adapter tensors and nothing else (count and bytes; a fraction of what
  the merged sync moves) and holds exactly the trainer's adapters: the digests compare adapters with adapters;
- both generators sample the merged policy: the same greedy answers and seeded samples, log-probs to 1e-5;
- before any sync both are the base policy (the generator's initial adapters are the trainer's: lora_B zero).

In process (no Monarch): an adapter generator's logits on a fixed prompt are those of a plain model holding
the merged weights, and full weights offered to it are refused by name.
"""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from generator_procs import one_proc

pytest.importorskip("peft")

FAULTS: list[Any] = []
_names = (f"lora_pull{i}" for i in itertools.count())
TOL = 1e-5  # base + B A (two matmuls) vs the merged matrix: float32 rounding only


def topology(sync: str, transport: str = "auto") -> Any:
    """A small topology whose trainer trains LoRA adapters and publishes them as `sync` says."""
    from composer_mesh.topology import parse_topology

    text = textwrap.dedent(
        f"""
        name: lora-pull-test
        model: {{source: tiny, task: addition, seed: 3}}
        meshes:
          trainer: {{backend: local}}
          generators: {{backend: local}}
          rewarder: {{backend: local}}
        roles:
          trainer:
            mesh: trainer
            binding: hf
            settings: {{lr: 0.05, lora: {{r: 4, alpha: 8, sync: {sync}}}}}
          generators:
            mesh: generators
            binding: hf
            settings: {{stop_at_task_eos: false, torch_threads: 1}}
          rewarder:
            mesh: rewarder
            binding: python
            settings: {{functions: [{{path: "composer_mesh.tasks.arithmetic:exact_match"}}]}}
        loss: {{alpha_sdpo: 0.0, beta_replay: 0.0}}
        weights: {{transport: {transport}, bucket_mb: 1}}
        """
    )
    return parse_topology(text, source="<test>")


@pytest.fixture(scope="module")
def trainers() -> dict[str, Any]:
    """sync -> a started `hf` trainer (the topology's binding and settings) after two identical steps."""
    from tests.actors.backends.trainer.test_hf_trainer import make_batch

    out = {}
    for sync in ("adapter", "merged"):
        cfg = topology(sync).role_configs()["trainer"]
        trainer = cfg.binding.build()
        trainer.start(cfg.model, cfg.loss, temperature=cfg.temperature)
        torch.manual_seed(0)
        for _ in range(2):  # lora_B starts at zero: the second step moves lora_A too
            trainer.train_step(make_batch(trainer, with_teacher=False))
        out[sync] = trainer
    assert out["adapter"].weight_kind == "adapter" and out["merged"].weight_kind == "full"
    a, m = (t.named_weights() for t in (out["adapter"], out["merged"]))
    from composer_mesh.models.lora import adapter_weights

    theirs = adapter_weights(out["merged"].model)
    assert a.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in a.items())  # same adapters
    assert any(v.abs().max() > 0 for k, v in a.items() if ".lora_B." in k)  # trained: not the identity
    assert not a.keys() & m.keys()  # adapter names vs the plain model's names
    return out


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    with one_proc("lora_pull", FAULTS) as pm:
        yield pm


def _requests() -> list[Any]:
    """Greedy answers and seeded samples (4 per prompt) on fixed prompts."""
    from composer_mesh.actors.messages import GenerationRequest, Prompt

    prompts = [Prompt(f"q{i}", t, []) for i, t in enumerate(["1+2=", "3+4=", "7+9=", "12+5="])]
    return [
        GenerationRequest(prompts, samples_per_prompt=1, max_new_tokens=4, temperature=0.0, seed=0),
        GenerationRequest(prompts, samples_per_prompt=4, max_new_tokens=4, temperature=1.0, seed=7),
    ]


async def _sample(actor: Any) -> tuple[list[list[int]], list[list[float]]]:
    ids, lps = [], []
    for request in _requests():
        for g in await actor.generate.call_one(request):
            ids += [r.completion_ids for r in g.rollouts]
            lps += [r.logprobs for r in g.rollouts]
    return ids, lps


def _assert_same_policy(a: tuple[list[list[int]], list[list[float]]], b: tuple[list[list[int]], list[list[float]]]) -> None:
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        assert x == pytest.approx(y, abs=TOL)


@pytest.mark.parametrize("transport", ["shm", "rdma"])
async def test_the_plane_carries_only_the_adapters_and_generators_sample_the_merged_policy(
    procs: Any, trainers: dict[str, Any], transport: str
) -> None:
    import warnings

    from monarch.rdma import RDMATcpFallbackWarning

    from composer_mesh.actors.digest import weights_digest
    from composer_mesh.actors.generator import GeneratorActor
    from composer_mesh.actors.trainer import TrainerService

    warnings.filterwarnings("ignore", category=RDMATcpFallbackWarning)
    configs = {sync: topology(sync, transport).role_configs()["generators"] for sync in trainers}
    assert configs["adapter"].adapter == trainers["adapter"].settings.lora  # derived from the trainer's lora
    assert configs["merged"].adapter is None
    gens = {sync: procs.spawn(next(_names), GeneratorActor, cfg) for sync, cfg in configs.items()}
    for g in gens.values():
        await g.setup.call_one()
    base = {sync: await _sample(g) for sync, g in gens.items()}
    _assert_same_policy(base["adapter"], base["merged"])  # version 0: identity adapters, the base policy

    services = {sync: TrainerService(trainers[sync], configs[sync].weights) for sync in trainers}
    try:
        synced, manifests = {}, {}
        for sync, svc in services.items():
            manifests[sync] = manifest = svc.publish()
            synced[sync] = await gens[sync].update_weights.call_one(manifest)
            assert synced[sync].version == manifest.version == 1
            published = trainers[sync].named_weights()
            assert [s.name for s in manifest.tensors] == list(published)
            assert synced[sync].num_params == len(published)
            assert synced[sync].num_bytes == manifest.total_bytes == sum(t.nbytes for t in published.values())
            # Like with like: the trainer's digest endpoint hashes what it publishes, the generator's its targets.
            assert await gens[sync].weights_digest.call_one() == (1, weights_digest(published))
        adapter, merged = synced["adapter"], synced["merged"]
        assert all(".lora_A." in s.name or ".lora_B." in s.name for s in manifests["adapter"].tensors)
        assert adapter.num_bytes * 5 < merged.num_bytes
        print(f"{transport}: adapter sync {adapter.num_params} tensors {adapter.num_bytes} B, merged sync "
              f"{merged.num_params} tensors {merged.num_bytes} B ({adapter.num_bytes / merged.num_bytes:.1%})")

        after = {sync: await _sample(g) for sync, g in gens.items()}
        _assert_same_policy(after["adapter"], after["merged"])  # both sample the merged policy
        assert any(a != pytest.approx(b, abs=1e-3) for a, b in zip(after["adapter"][1], base["adapter"][1]))
    finally:
        for svc in services.values():
            if svc.publisher is not None:
                svc.publisher.close()
    assert not FAULTS


def test_an_adapter_generator_starts_with_the_trainers_adapters_and_gives_the_merged_logits(
    trainers: dict[str, Any],
) -> None:
    from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings
    from composer_mesh.models.lora import adapter_specs, adapter_weights

    cfg = topology("adapter").role_configs()["generators"]
    gen = HFGenerator(HFGeneratorSettings())
    gen.start(cfg.model, adapter=cfg.adapter)
    fresh = topology("adapter").role_configs()["trainer"]
    initial = fresh.binding.build()
    initial.start(fresh.model, fresh.loss, temperature=fresh.temperature)
    # The same LoRA seed: before any sync the generator's adapters are the trainer's initial ones, bitwise.
    assert gen.weight_specs() == adapter_specs(initial.model) == adapter_specs(trainers["adapter"].model)
    mine = gen.named_weights()
    assert all(torch.equal(t, mine[n]) for n, t in adapter_weights(initial.model).items())

    gen.load_weights(trainers["adapter"].named_weights())
    plain = HFGenerator(HFGeneratorSettings())
    plain.start(cfg.model)
    plain.load_weights(trainers["merged"].named_weights())
    ids = torch.tensor([gen.tokenizer.encode("3+4=7;9+9=")])
    with torch.no_grad():
        ours, theirs = gen.model(ids).logits, plain.model(ids).logits
        base = initial.model(ids).logits  # identity adapters: the base policy
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    assert (ours - base).abs().max() > 1e-2  # the adapters matter
    with pytest.raises(ValueError, match=r"hf generator load_weights: unknown names .*missing names .*lora_A"):
        gen.load_weights(trainers["merged"].named_weights())  # full weights offered to an adapter generator
