"""The non-finite check on a trainer replica sharded with FSDP2 over two real Monarch procs (gloo).

On a sharded replica a non-finite gradient can live in one rank's shard only, and the ranks must still take
one decision: a rank that stepped its optimizer while the other raised or skipped would leave the replica's
shards inconsistent, and a rank that went on to the next step would wait in a collective for a peer that
stopped. The gradient norm the check reads is a collective (`hf_trainer.total_grad_norm`), so both ranks see
the poisoned shard. Rank 1's shard of one gradient is made infinite after FSDP2's reduce-scatter
(`shard_actors.poison_one_gradient_shard`), so the loss stays finite and the gradient is the one quantity at
fault; every wait is bounded (the call's timeout, and a one-minute process-group timeout in the actor).
"""

from __future__ import annotations

import itertools

import monarch.actor
import pytest
import torch
from actors.backends.trainer.shard_actors import NonFiniteRank
from actors.backends.trainer.test_hf_trainer import MODEL
from actors.backends.trainer.test_sharded_trainer import batches, free_address, one_process
from monarch.actor import this_host

WORLD = 2
CALL_TIMEOUT_S = 240.0  # a replica whose ranks decided differently fails here (or at the group's 60 s), never hangs
# The default tier's sharded case (micro-batches: the poisoned shard is accumulated over several backwards),
# in float64 so that the step after a skip can be compared with one process to 1e-10.
SETTINGS = {"lr": 1e-2, "precision": "fp64", "micro_batch_tokens": 8}
LOSS = {"alpha_sdpo": 1.0, "beta_replay": 1.0, "kl_beta": 0.01, "dpo_variant": "dpo"}
_names = itertools.count()


@pytest.fixture(scope="module")
def mesh():
    """Two procs, kept for the module (a proc joins its process group once)."""
    faults: list[object] = []
    previous_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append  # a fault must fail a test, not exit the session
    procs = this_host().spawn_procs(per_host={"procs": WORLD}, name="nonfinite")
    yield procs
    procs.stop().get()
    monarch.actor.unhandled_fault_hook = previous_hook
    assert not faults, faults


def train(mesh, settings: dict, data: list, poisoned_steps: list[int], on_nonfinite: str) -> list[dict]:
    """Both ranks' results (rank order), rank 1 poisoned at `poisoned_steps`."""
    ranks = mesh.spawn(f"nonfinite{next(_names)}", NonFiniteRank)
    results = ranks.train.call(free_address(), WORLD, settings, LOSS, MODEL, data, poisoned_steps, 1,
                               on_nonfinite).get(timeout=CALL_TIMEOUT_S)
    return sorted((out for _, out in results.items()), key=lambda out: out["rank"])


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Without clipping, `total_grad_norm` takes the other branch (`get_total_norm`): both branches are collectives.
def test_a_gradient_nonfinite_in_one_ranks_shard_stops_both_ranks_before_any_update(mesh):
    """`stop`: step 2's gradient is infinite in rank 1's shard only; both ranks raise NonFiniteError naming step
    2 and the gradient (the loss is finite; rank 0's own gradient shards are finite), and neither rank's shards
    or AdamW state moved."""
    data = batches(0)
    ranks = train(mesh, {**SETTINGS, "grad_clip": None}, data, [2], "stop")
    for out in ranks:
        first, second = out["steps"]
        assert "raised" not in first and not same(first["before"], first["after"])  # step 1 trained
        assert second["raised"].startswith("trainer step 2: non-finite gradient (total norm inf); the update was "
                                           "not applied"), (out["rank"], second["raised"])
        assert same(second["before"], second["after"]), out["rank"]
        assert any(k.startswith("o/") for k in second["after"])  # AdamW state exists (step 1) and is unchanged
    # The inf lives in rank 1's shard only: rank 0 raised on a gradient it does not hold.
    assert [out["steps"][1]["own_grads_finite"] for out in ranks] == [True, False]


def test_skip_on_a_poisoned_shard_skips_on_both_ranks_and_the_next_step_trains_as_one_process(mesh):
    """`skip`: step 2 (rank 1's gradient shard infinite) is skipped on both ranks, counted in
    `faults/nonfinite_skipped`, each rank's shards and AdamW state bitwise unchanged; step 3 trains on both ranks,
    and the final weights equal one process that trained steps 1 and 3 only (float64, 1e-10)."""
    first, second = batches(0)
    data = [first, second, second]
    want_steps, want_weights = one_process(SETTINGS, LOSS, [first, second])
    ranks = train(mesh, SETTINGS, data, [2], "skip")
    for out in ranks:
        trained, skipped, after = out["steps"]
        assert [s["metrics"]["faults/nonfinite_skipped"] for s in out["steps"]] == [0.0, 1.0, 0.0], out["rank"]
        assert skipped["step"] == 2 and torch.isfinite(torch.tensor(skipped["loss"]))  # the gradient, not the loss
        assert same(skipped["before"], skipped["after"]), out["rank"]
        assert any(k.startswith("o/") for k in skipped["after"])
        assert not same(after["before"], after["after"]), out["rank"]
        for got, want in ((trained, want_steps[0]), (after, want_steps[1])):
            assert got["loss"] == pytest.approx(want.loss, abs=1e-10), out["rank"]
    weights = ranks[0]["weights"]
    assert weights.keys() == want_weights.keys()
    assert max(float((weights[n] - want_weights[n]).abs().max()) for n in want_weights) < 1e-10
