"""A trainer replica sharded with FSDP2 over 1, 2 and 4 real Monarch procs (gloo) equals one process.

Every rank gets the whole batch and trains its own rows (`sharding.py`); the ranks' gradients sum to the whole
batch's. In float64 (`precision: fp64`) the loss, every channel, the metrics and the weights after two AdamW
steps match one unsharded process to 1e-10, for every loss channel, both normalisations, dense and top-k
teachers, DPO (with reference and KL) and SimPO, micro-batches and packing, LoRA (sharded adapters; merged or
adapter weights out), activation checkpointing and CPU offload. A non-finite gradient in one rank's shard alone
stops or skips the step on every rank (the end of this file)."""

from __future__ import annotations

import itertools
import socket

import monarch.actor
import pytest
import torch
from actors.backends.trainer.shard_actors import NonFiniteRank, ShardedRank
from actors.backends.trainer.test_hf_trainer import MODEL, make_batch, make_trainer
from monarch.actor import this_host

from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
from composer_mesh.actors.backends.trainer.sharding import TorchRanks, rank_pieces, rank_rows
from composer_mesh.actors.backends.trainer.train_batch import TrainRows
from composer_mesh.loss.config import LossConfig

WORLDS = (1, 2, 4)
CASES = {
    "token-dense-dpo-kl-micro": (
        {"micro_batch_tokens": 8},
        {"alpha_sdpo": 1.0, "beta_replay": 1.0, "kl_beta": 0.01, "dpo_variant": "dpo"}, 0),
    "sequence-topk-simpo-packed-full-head": (
        {"micro_batch_tokens": 12, "packing": True, "lm_head": "full"},
        {"alpha_sdpo": 1.0, "beta_replay": 1.0, "normalization": "sequence", "dpo_variant": "simpo"}, 4),
    # LoRA: the adapters are sharded with the frozen base; the reference is the policy with its adapters off.
    "lora-merged-dpo-kl-micro": (
        {"micro_batch_tokens": 8, "lora": {"r": 4, "alpha": 8.0}},
        {"alpha_sdpo": 1.0, "beta_replay": 1.0, "kl_beta": 0.01, "dpo_variant": "dpo"}, 0),
    "lora-adapter-sync-sequence-packed": (
        {"micro_batch_tokens": 12, "packing": True, "lora": {"r": 4, "alpha": 8.0, "sync": "adapter"}},
        {"alpha_sdpo": 1.0, "beta_replay": 0.0, "normalization": "sequence"}, 4),
    "activation-checkpointing-cpu-offload-kept-gathers": (
        {"activation_checkpointing": True, "fsdp_cpu_offload": True, "fsdp_reshard_after_forward": False},
        {"alpha_sdpo": 1.0, "beta_replay": 0.0, "kl_beta": 0.01}, 0),
}
_names = itertools.count()


@pytest.fixture(scope="module")
def meshes():
    """One proc mesh per world size, kept for the module (a proc joins its process group once)."""
    faults: list[object] = []
    previous_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append  # a fault must fail a test, not exit the session
    procs = {world: this_host().spawn_procs(per_host={"procs": world}, name=f"shard{world}") for world in WORLDS}
    yield procs
    for mesh in procs.values():
        mesh.stop().get()
    monarch.actor.unhandled_fault_hook = previous_hook
    assert not faults, faults


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def batches(top_k: int):
    """Two batches (every channel's inputs), made by a float32 trainer as the sampler would."""
    trainer = make_trainer()
    return [make_batch(trainer, top_k=top_k), make_batch(trainer, top_k=top_k)]


def one_process(settings: dict, loss: dict, data) -> tuple[list, dict[str, torch.Tensor]]:
    trainer = HFTrainer(HFTrainerSettings(**settings))
    trainer.start(MODEL, LossConfig(**loss))
    steps = [trainer.train_step(b) for b in data]
    return steps, trainer.named_weights()


# The first case runs in the default tier; the others (and the resume and bf16 tests) in the slow tier, which
# keeps the README's test command under its 20 minutes on 2 cores.
@pytest.mark.parametrize("case", [c if i == 0 else pytest.param(c, marks=pytest.mark.slow) for i, c in enumerate(CASES)])
def test_sharded_replica_equals_one_process(meshes, case):
    extra, loss, top_k = CASES[case]
    settings = {"lr": 1e-2, "precision": "fp64", **extra}
    data = batches(top_k)
    want_steps, want_weights = one_process(settings, loss, data)
    # LoRA on one rank adds nothing to the cases above (the adapter-sync case differs from the merged one only in
    # what is gathered: 2 ranks); the default tier's case runs 2 and 4 ranks (the slow tier's cases run FSDP2 over
    # one proc too): the README's test command stays under its 20 minutes and all of CI under 60.
    default_tier = case == next(iter(CASES))
    worlds = (2,) if case == "lora-adapter-sync-sequence-packed" else (2, 4) if default_tier or "lora" in extra else WORLDS
    for world in worlds:
        ranks = meshes[world].spawn(f"rank{next(_names)}", ShardedRank)
        results = ranks.train.call(free_address(), world, settings, loss, MODEL, data).get()
        outputs = [out for _, out in results.items()]
        for steps, _ in outputs:  # every rank reports the whole batch
            for got, want in zip(steps, want_steps, strict=True):
                assert got["loss"] == pytest.approx(want.loss, abs=1e-10), (world, got["loss"], want.loss)
                assert got["channels"].keys() == want.channels.keys()
                for name, value in want.channels.items():
                    assert got["channels"][name] == pytest.approx(value, abs=1e-10), (world, name)
                for name in ("grad_norm", "grpo/ratio_mean", "sdpo/tokens", "replay/pairs", "replay/accuracy"):
                    if name in want.metrics:
                        assert got["metrics"][name] == pytest.approx(want.metrics[name], abs=1e-9), (world, name)
                assert got["metrics"]["micro_batches"] >= 1
        weights = outputs[0][1]
        assert weights.keys() == want_weights.keys()
        worst = max(float((weights[n].double() - want_weights[n].double()).abs().max()) for n in want_weights)
        assert worst < 1e-10, (world, worst)
        changed = max(float((want_weights[n] - w).abs().max()) for n, w in one_process(settings, loss, [])[1].items())
        assert changed > 1e-4  # the steps moved the weights: equality is not two untouched models


def test_rows_are_dealt_by_tokens_and_every_rank_runs_as_many_micro_batches():
    data = TrainRows.of(batches(0)[0], LossConfig(beta_replay=1.0, alpha_sdpo=1.0))
    for world in (2, 3, 4):
        split = rank_rows(data, world)
        assert sorted(r for rows in split for r in rows) == list(range(len(data.rollouts)))  # each row once
        pieces = [rank_pieces(data, world, rank, 8, False) for rank in range(world)]
        assert len({len(p) for p in pieces}) == 1  # padded with idle passes to the busiest rank
        held = [r for rank in pieces for p in rank if p is not None for r in p.rows]
        assert sorted(held) == list(range(len(data.rollouts)))
        pairs = [x for rank in pieces for p in rank if p is not None for x in p.pairs]
        assert sorted(pairs) == list(range(len(data.pairs)))  # each replay pair with its rejected row


@pytest.mark.slow  # the plane's side alone: tests/mesh/weights/test_shaped_weights.py (default tier)
async def test_rank_0_publishes_gathering_one_tensor_at_a_time(meshes):
    """The trainer service publishes a sharded replica's weights through the weight plane (shm) gathering one
    tensor at a time: no rank ever holds two whole tensors of the gather at once (never the whole model), and a
    real subscriber pulls exactly one process's weights after the same step."""
    from actors.backends.trainer.shard_actors import PublishingRank

    from composer_mesh.mesh.weights.config import WeightPlaneConfig
    from composer_mesh.mesh.weights.plane import WeightSubscriber

    settings, loss = {"lr": 1e-2, "precision": "fp64"}, {"alpha_sdpo": 0.0, "beta_replay": 0.0}
    data = batches(0)[:1]
    _, want = one_process(settings, loss, data)
    ranks = meshes[2].spawn(f"rank{next(_names)}", PublishingRank)
    results = [out for _, out in (await ranks.train_and_publish.call(free_address(), 2, settings, loss, MODEL,
                                                                       data[0])).items()]
    try:
        assert [r["peak"] for r in results] == [{"gathered": 1, "read": 1}] * 2
        assert [r["version"] for r in results] == [2, 2]  # the initial policy was version 1
        manifests = [r["manifest"] for r in results]
        assert manifests[1] is None and manifests[0].version == 2  # rank 0 publishes, rank 1 only gathers
        subscriber = WeightSubscriber(WeightPlaneConfig(transport="shm"), expected=want)
        await subscriber.pull(manifests[0])
        got = {name: torch.full_like(t, float("nan")) for name, t in want.items()}
        assert subscriber.apply_to(got) == 2
        subscriber.close()
    finally:
        await ranks.close.call()
    assert got.keys() == want.keys()
    assert max(float((got[n].double() - want[n].double()).abs().max()) for n in want) < 1e-6


def test_torch_ranks_gather_is_two_all_gathers_whatever_it_packs(monkeypatch):
    """The loss merge's one exchange: the lengths, then the values padded to the longest, unpadded per rank."""
    import torch.distributed as dist

    peer, sent = torch.arange(5, dtype=torch.float64), []

    def all_gather(out, t):  # rank 0 of 2; rank 1 sends 5 values
        sent.append(t.clone())
        out[0].copy_(t)
        out[1].copy_(torch.tensor([5]) if len(sent) == 1 else torch.nn.functional.pad(peer, (0, len(t) - 5)))

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    ranks = TorchRanks(torch.device("cpu"))
    got = ranks.gather(torch.tensor([7.0, 8.0], dtype=torch.float64))
    assert len(sent) == 2 and [g.tolist() for g in got] == [[7.0, 8.0], peer.tolist()]
    assert got[0].dtype == torch.float64


@pytest.mark.slow
@pytest.mark.parametrize("case", ["token-dense-dpo-kl-micro", "lora-merged-dpo-kl-micro"])
def test_a_state_saved_by_two_ranks_resumes_on_one_and_on_four(meshes, tmp_path, case):
    """Resharding: two ranks train step 1 and save (one file per rank); four ranks, and one unsharded process,
    load it and train step 2. Both equal one process that trained both steps without stopping (float64). With
    LoRA the state holds the adapters (and their AdamW moments) only. The final model the two ranks write after
    step 1 is one process's (`assert_checkpoint_is_one_process`)."""
    extra, loss, top_k = CASES[case]
    settings = {"lr": 1e-2, "precision": "fp64", **extra}
    first, second = batches(top_k)
    _, want = one_process(settings, loss, [first, second])
    saved = str(tmp_path / "state")
    meshes[2].spawn(f"rank{next(_names)}", ShardedRank).train.call(
        free_address(), 2, settings, loss, MODEL, [first], save=saved, checkpoint=str(tmp_path / "two")).get()
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["rank0", "rank1"]
    assert_checkpoint_is_one_process(settings, loss, first, tmp_path)
    results = meshes[4].spawn(f"rank{next(_names)}", ShardedRank).train.call(
        free_address(), 4, settings, loss, MODEL, [second], load=saved).get()
    four = next(weights for _, (_, weights) in results.items() if weights)  # rank 0 returns them
    alone = HFTrainer(HFTrainerSettings(**settings))
    alone.start(MODEL, LossConfig(**loss))
    alone.load_state(saved)
    alone.train_step(second)
    for weights in (four, alone.named_weights()):
        assert max(float((weights[n] - want[n]).abs().max()) for n in want) < 1e-10


@pytest.mark.slow
def test_bf16_mixed_shards_train_with_float32_master_weights(meshes):
    """`precision: bf16-mixed` on a sharded replica is FSDP2's MixedPrecisionPolicy (bf16 gathers and compute,
    float32 reduction and master shards): two ranks train, the loss stays near one fp32 process's (bf16 compute
    is not exact), and the weights gathered for the generators are the float32 masters, not bf16 copies left
    gathered by a forward."""
    loss = {"alpha_sdpo": 1.0, "beta_replay": 1.0, "kl_beta": 0.01, "dpo_variant": "dpo"}
    data = batches(0)
    want_steps, _ = one_process({"lr": 1e-2}, loss, data)
    results = meshes[2].spawn(f"rank{next(_names)}", ShardedRank).train.call(
        free_address(), 2, {"lr": 1e-2, "precision": "bf16-mixed"}, loss, MODEL, data).get()
    steps, weights = next((s, w) for _, (s, w) in results.items() if w)
    for got, want in zip(steps, want_steps, strict=True):
        assert got["loss"] == pytest.approx(want.loss, rel=0.05, abs=0.05)
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}


def assert_checkpoint_is_one_process(settings: dict, loss: dict, batch, tmp_path) -> None:
    """The final model two ranks wrote at `tmp_path/two` after `batch` is the one one process writes: a plain
    transformers directory (LoRA: of the merged weights, and the adapter in peft's format beside it), the same
    tensors to 1e-10 (float64)."""
    from safetensors.torch import load_file

    alone = HFTrainer(HFTrainerSettings(**settings))
    alone.start(MODEL, LossConfig(**loss))
    alone.train_step(batch)
    alone.save_checkpoint(tmp_path / "one", weight_version=2)
    parts = ["model.safetensors"] + (["adapter/adapter_model.safetensors"] if "lora" in settings else [])
    for part in parts:
        want, got = load_file(tmp_path / "one" / part), load_file(tmp_path / "two" / part)
        assert got.keys() == want.keys() and want, part
        assert max(float((got[n] - want[n]).abs().max()) for n in want) < 1e-10, part

# ---- the non-finite check (`run.on_nonfinite`) on a sharded replica -------------------------------------------
# A non-finite gradient can live in one rank's shard only, and the ranks must still take one decision: a rank
# that stepped its optimizer while the other raised or skipped would leave the replica's shards inconsistent,
# and a rank that went on to the next step would wait in a collective for a peer that stopped. The gradient norm
# the check reads is a collective (`hf_trainer.total_grad_norm`), so both ranks see the poisoned shard. Rank 1's
# shard of one gradient is made infinite after FSDP2's reduce-scatter (`shard_actors.poison_one_gradient_shard`),
# so the loss stays finite and the gradient is the one quantity at fault. Every wait is bounded: the call's
# timeout, and (in a proc whose process group this test creates) a one-minute group timeout.
NONFINITE_TIMEOUT_S = 240.0
# The default tier's case (micro-batches: the poisoned shard is accumulated over several backwards), in float64
# so that the step after a skip can be compared with one process to 1e-10.
NONFINITE_SETTINGS = {"lr": 1e-2, "precision": "fp64", "micro_batch_tokens": 8}
NONFINITE_LOSS = CASES["token-dense-dpo-kl-micro"][1]


def train_poisoned(mesh, settings: dict, data: list, poisoned_steps: list[int], on_nonfinite: str) -> list[dict]:
    """Both ranks' results (rank order), rank 1 poisoned at `poisoned_steps`."""
    ranks = mesh.spawn(f"rank{next(_names)}", NonFiniteRank)
    results = ranks.train.call(free_address(), 2, settings, NONFINITE_LOSS, MODEL, data, poisoned_steps, 1,
                               on_nonfinite).get(timeout=NONFINITE_TIMEOUT_S)
    return sorted((out for _, out in results.items()), key=lambda out: out["rank"])


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Without clipping, `total_grad_norm` takes the other branch (`get_total_norm`): both branches are collectives.
def test_a_gradient_nonfinite_in_one_ranks_shard_stops_both_ranks_before_any_update(meshes):
    """`stop`: step 2's gradient is infinite in rank 1's shard only; both ranks raise NonFiniteError naming step
    2 and the gradient (the loss is finite; rank 0's own gradient shards are finite), and neither rank's shards
    or AdamW state moved."""
    data = batches(0)
    ranks = train_poisoned(meshes[2], {**NONFINITE_SETTINGS, "grad_clip": None}, data, [2], "stop")
    for out in ranks:
        first, second = out["steps"]
        assert "raised" not in first and not same_state(first["before"], first["after"])  # step 1 trained
        assert second["raised"].startswith("trainer step 2: non-finite gradient (total norm inf); the update was "
                                           "not applied"), (out["rank"], second["raised"])
        assert same_state(second["before"], second["after"]), out["rank"]
        assert any(k.startswith("o/") for k in second["after"])  # AdamW state exists (step 1) and is unchanged
    # The inf lives in rank 1's shard only: rank 0 raised on a gradient it does not hold.
    assert [out["steps"][1]["own_grads_finite"] for out in ranks] == [True, False]


def test_skip_on_a_poisoned_shard_skips_on_both_ranks_and_the_next_step_trains_as_one_process(meshes):
    """`skip`: step 2 (rank 1's gradient shard infinite) is skipped on both ranks, counted in
    `faults/nonfinite_skipped`, each rank's shards and AdamW state bitwise unchanged; step 3 trains on both ranks,
    and the final weights equal one process that trained steps 1 and 3 only (float64, 1e-10)."""
    first, second = batches(0)
    data = [first, second, second]
    want_steps, want_weights = one_process(NONFINITE_SETTINGS, NONFINITE_LOSS, [first, second])
    ranks = train_poisoned(meshes[2], NONFINITE_SETTINGS, data, [2], "skip")
    for out in ranks:
        trained, skipped, after = out["steps"]
        assert [s["metrics"]["faults/nonfinite_skipped"] for s in out["steps"]] == [0.0, 1.0, 0.0], out["rank"]
        assert skipped["step"] == 2 and torch.isfinite(torch.tensor(skipped["loss"]))  # the gradient, not the loss
        assert same_state(skipped["before"], skipped["after"]), out["rank"]
        assert any(k.startswith("o/") for k in skipped["after"])
        assert not same_state(after["before"], after["after"]), out["rank"]
        for got, want in ((trained, want_steps[0]), (after, want_steps[1])):
            assert got["loss"] == pytest.approx(want.loss, abs=1e-10), out["rank"]
    weights = ranks[0]["weights"]
    assert weights.keys() == want_weights.keys()
    assert max(float((weights[n] - want_weights[n]).abs().max()) for n in want_weights) < 1e-10
