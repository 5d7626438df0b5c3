"""DiLoCo between sharded replicas: two replicas of two FSDP2 ranks each (four real Monarch procs, gloo, a real
file:// store, real torchft DiLoCo) train like two one-proc replicas in float64.

Rank k of a replica syncs only its own shards, with rank k of the other replica, under `shard-k-of-2/` in the
store; DiLoCo is elementwise, so the weights after every round equal the one-proc replicas' to 1e-10, while each
rank moves about half of what a one-proc replica moves per round. A sharded replica's state saved mid-run
resumes bitwise, and does not resume on another number of ranks."""

from __future__ import annotations

import pytest
import torch
from actors.backends.trainer.shard_actors import DiLoCoShardedRank
from actors.backends.trainer.test_sharded_trainer import free_address
from mesh.objectstore.test_trainer_state_diloco import batch, train
from monarch.actor import this_host

from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
from composer_mesh.actors.backends.trainer.trainer_state import TrainerStateError
from composer_mesh.loss.config import LossConfig
from composer_mesh.mesh.objectstore import DiLoCoConfig
from composer_mesh.models.config import ModelConfig

pytestmark = pytest.mark.slow

MODEL = ModelConfig(source="tiny", seed=3)
LOSS = {"alpha_sdpo": 0.0, "beta_replay": 0.0}  # GRPO: no teacher data needed
SETTINGS = {"lr": 1e-2, "precision": "fp64"}
STEPS = 4  # streaming DiLoCo, 2 fragments, sync_every 2: one fragment's round after every step


def config(store, run_id: str) -> DiLoCoConfig:
    return DiLoCoConfig(store_uri=f"file://{store}", run_id=run_id, replicas=2, sync_every=2, fragments=2,
                        poll_interval_s=0.01)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Two one-proc replicas (threads of this process) and the batches they trained: replica r's step s."""
    store = tmp_path_factory.mktemp("reference")
    trainers = []
    for r in range(2):
        t = HFTrainer(HFTrainerSettings(**SETTINGS))
        t.start(MODEL, LossConfig(**LOSS), diloco=config(store, "reference"), replica_id=r)
        trainers.append(t)
    batches = [[batch(trainers[r], r, s) for s in range(STEPS)] for r in range(2)]
    train(trainers, range(STEPS))
    out = {"batches": batches, "weights": [t.named_weights() for t in trainers],
           "numel": trainers[0].diloco.last_report.numel, "bytes_read": trainers[0].diloco.last_report.bytes_read}
    assert all(t.diloco.outer_step == STEPS for t in trainers)
    for t in trainers:
        t.close()
    return out


@pytest.fixture(scope="module")
def ranks():
    procs = this_host().spawn_procs(per_host={"procs": 4}, name="sharded_diloco")
    yield procs.spawn("diloco_rank", DiLoCoShardedRank)
    procs.stop().get()


def run(ranks, store, run_id: str, batches, **kw) -> list[dict]:
    results = ranks.train.call([free_address(), free_address()], 2, SETTINGS, LOSS, MODEL, config(store, run_id),
                               batches, **kw).get()
    return sorted((out for _, out in results.items()), key=lambda o: (o["replica"], o["rank"]))


def weights_of(outs: list[dict], replica: int) -> dict[str, torch.Tensor]:
    return next(o["weights"] for o in outs if o["replica"] == replica and o["rank"] == 0)


def test_two_sharded_replicas_equal_two_one_proc_replicas(ranks, reference, tmp_path):
    outs = run(ranks, tmp_path, "sharded", reference["batches"])
    assert [(o["replica"], o["rank"]) for o in outs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(o["outer_step"] == STEPS and o["members"] == [0, 1] for o in outs)
    for r in range(2):
        got, want = weights_of(outs, r), reference["weights"][r]
        assert got.keys() == want.keys()
        assert max(float((got[n] - want[n]).abs().max()) for n in want) < 1e-10, r
    # A round moves each rank's own shards: the ranks' parts make the whole fragment, each about half of it.
    by_replica = [[o for o in outs if o["replica"] == r] for r in range(2)]
    for both in by_replica:
        assert sum(o["numel"] for o in both) == reference["numel"]
        assert all(o["bytes_read"] < 0.6 * reference["bytes_read"] for o in both), (
            [o["bytes_read"] for o in both], reference["bytes_read"])
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == ["shard-0-of-2", "shard-1-of-2"]


def test_a_sharded_diloco_state_resumes_bitwise_and_only_on_as_many_ranks(ranks, reference, tmp_path):
    batches = reference["batches"]
    whole = run(ranks, tmp_path / "whole", "resume", batches)
    url = str(tmp_path / "state")
    run(ranks, tmp_path / "stopped", "resume", [b[:2] for b in batches], save_at=1, url=url)  # saved after step 1
    resumed = run(ranks, tmp_path / "stopped", "resume", [b[1:] for b in batches], url=url)
    for r in range(2):
        got, want = weights_of(resumed, r), weights_of(whole, r)
        assert all(torch.equal(got[n], want[n]) for n in want), r
    assert [o["losses"] for o in resumed] == [o["losses"][1:] for o in whole]
    alone = HFTrainer(HFTrainerSettings(**SETTINGS))
    alone.start(MODEL, LossConfig(**LOSS), diloco=config(tmp_path / "other", "other"), replica_id=0)
    with pytest.raises(TrainerStateError, match=r"saved by 2 proc.*cannot resume on one proc"):
        alone.load_state(f"{url}/replica0")
    alone.close()
