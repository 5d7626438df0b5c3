"""A DiLoCo replica's full state: two `hf` trainer replicas (real torchft DiLoCo, real file:// store, replicas as
threads) stopped at step k and resumed from their saved states end bitwise where an uninterrupted run ends."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
from composer_mesh.actors.backends.trainer.trainer_state import TrainerStateError
from composer_mesh.actors.messages import Prompt, RewardResult, Rollout, RolloutGroup, ScoredGroup, TrainBatch
from composer_mesh.loss.config import LossConfig
from composer_mesh.mesh.objectstore import DiLoCoConfig
from composer_mesh.mesh.objectstore.manager import ObjectStoreManager
from composer_mesh.mesh.objectstore.store import Store

MODEL_SEED = 3
LOSS = LossConfig(alpha_sdpo=0.0, beta_replay=0.0)  # GRPO: no teacher data needed
STEPS = 8  # inner steps of the whole run: 4 outer rounds at sync_every=2
EXTRA = 4  # steps the stopped run goes on for after its save: two more rounds (and GC) in the store


def config(store: Path, **kw) -> DiLoCoConfig:
    return DiLoCoConfig(**{"store_uri": f"file://{store}", "run_id": "resume", "replicas": 2, "sync_every": 2,
                           "poll_interval_s": 0.01, **kw})


def start(diloco: DiLoCoConfig | None, replica: int = 0) -> HFTrainer:
    from composer_mesh.models.config import ModelConfig

    t = HFTrainer(HFTrainerSettings(lr=1e-2))
    t.start(ModelConfig(source="tiny", seed=MODEL_SEED), LOSS, diloco=diloco, replica_id=replica)
    return t


def batch(trainer: HFTrainer, replica: int, step: int) -> TrainBatch:
    """Replica- and step-specific rollouts and rewards (replicas must disagree for the average to mean
    anything); the sampler log-probs are made up but fixed, so every run sees the very same batch."""
    g = torch.Generator().manual_seed(1000 * replica + step)
    tok = trainer.tokenizer
    groups = []
    for i, text in enumerate(["3+4=", "9+9="]):
        prompt_ids = tok.encode(text)
        rollouts, rewards = [], []
        for j in range(3):
            comp = torch.randint(3, len(tok), (2 + j,), generator=g).tolist()
            lp = (-3.0 - torch.rand(len(comp), generator=g)).tolist()
            rollouts.append(Rollout(f"p{i}", prompt_ids, comp, lp, weight_version=1))
            rewards.append(RewardResult(score=float((j + replica + step) % 3 == 0)))
        groups.append(ScoredGroup(RolloutGroup(Prompt(f"p{i}", text, prompt_ids), rollouts), rewards))
    return TrainBatch(groups=groups)


def train(trainers: list[HFTrainer], steps: range, after: Callable[[int, HFTrainer, int], None] | None = None) -> None:
    """Every replica takes `steps` in its own thread (rounds wait for both); `after(replica, trainer, step)`
    runs on a replica's thread after each of its steps."""
    errors: list[BaseException] = []

    def go(r: int, t: HFTrainer) -> None:
        try:
            for s in steps:
                t.train_step(batch(t, r, s))
                if after is not None:
                    after(r, t, s + 1)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r, t)) for r, t in enumerate(trainers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert not errors, errors


def state_of(t: HFTrainer) -> dict[str, torch.Tensor]:
    """Weights, AdamW state, and the DiLoCo global parameters and outer momentum."""
    out = {f"w/{k}": v.clone() for k, v in t.model.state_dict().items()}
    for i, s in t.optimizer.state_dict()["state"].items():
        out.update({f"o/{i}/{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    out.update({f"g/{k}": v for k, v in t.diloco.global_state().items()})
    return out


def rounds_in(store: Path, top: str) -> list[int]:
    d = store / "resume" / top
    return sorted(int(n.name[1:]) for n in d.iterdir() if n.name.startswith("q")) if d.exists() else []


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict[str, torch.Tensor]]:
    store = tmp_path_factory.mktemp("uninterrupted")
    trainers = [start(config(store), r) for r in range(2)]
    train(trainers, range(STEPS))
    states = [state_of(t) for t in trainers]
    assert all(t.diloco.outer_step == STEPS // 2 for t in trainers)
    for t in trainers:
        t.close()
    return states


@pytest.mark.parametrize("k", [2, 3], ids=["at-a-sync", "between-syncs"])
def test_replicas_resumed_from_their_states_end_bitwise_like_an_uninterrupted_run(tmp_path, k, uninterrupted):
    store = tmp_path / "store"
    urls = [str(tmp_path / f"state-r{r}") for r in range(2)]

    def save_at_k(r: int, t: HFTrainer, step: int) -> None:
        if step == k:
            t.save_state(urls[r], extra={"weight_version": step + 1})

    stopped = [start(config(store), r) for r in range(2)]
    train(stopped, range(k + EXTRA), after=save_at_k)  # saves at k, then goes on: the abandoned future
    for t in stopped:
        t.close()
    saved_round = k // 2
    assert rounds_in(store, "ckpt")[-1] == (k + EXTRA) // 2 > saved_round

    resumed = [start(config(store), r) for r in range(2)]  # new models, optimizers and DiLoCo on the same store
    assert resumed[0].diloco.round_id == (k + EXTRA) // 2  # the constructor healed from the abandoned future ...
    for r, t in enumerate(resumed):
        assert t.load_state(urls[r]) == {"weight_version": k + 1} and t.step == k
    assert resumed[0].diloco.round_id == resumed[1].diloco.round_id == saved_round  # ... the state rewinds it
    assert max(rounds_in(store, "ckpt") + rounds_in(store, "rounds"), default=0) <= saved_round
    train(resumed, range(k, STEPS))
    for r, t in enumerate(resumed):
        got, want = state_of(t), uninterrupted[r]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])][:3]
        assert t.step == STEPS and t.diloco.outer_step == STEPS // 2
        t.close()


def test_diloco_and_plain_states_do_not_cross(tmp_path):
    one = config(tmp_path / "store", replicas=1)
    replica = start(one)
    replica.save_state(str(tmp_path / "diloco"))
    plain = start(None)
    plain.save_state(str(tmp_path / "plain"))
    with pytest.raises(TrainerStateError, match="saved by a trainer with DiLoCo replica 0 of 1, this trainer has no "
                                                "DiLoCo"):
        plain.load_state(str(tmp_path / "diloco"))
    with pytest.raises(TrainerStateError, match="saved by a trainer with no DiLoCo, this trainer has DiLoCo replica 0"):
        replica.load_state(str(tmp_path / "plain"))
    replica.close()


@pytest.mark.parametrize(("live", "problem"), [
    ({"replicas": 2}, "another DiLoCo shape: replicas: saved 1, live 2"),
    ({"sync_every": 4}, "another DiLoCo shape: sync_every: saved 2, live 4"),
])
def test_a_state_for_another_diloco_shape_is_refused_before_anything_is_loaded(tmp_path, live, problem):
    saver = start(config(tmp_path / "a", replicas=1))
    train([saver], range(1))
    saver.save_state(str(tmp_path / "s"))
    saver.close()
    other = start(config(tmp_path / "b", **{"replicas": 1, **live}))
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(TrainerStateError, match=problem):
        other.load_state(str(tmp_path / "s"))
    assert all(torch.equal(v, before[k]) for k, v in other.model.state_dict().items()) and other.step == 0
    other.close()


def test_another_replicas_state_is_refused(tmp_path):
    replicas = [start(config(tmp_path / "store"), r) for r in range(2)]
    replicas[0].save_state(str(tmp_path / "s"))
    with pytest.raises(TrainerStateError, match="the state is DiLoCo replica 0's, this is replica 1"):
        replicas[1].load_state(str(tmp_path / "s"))
    for t in replicas:
        t.close()


def test_no_snapshot_while_a_fragment_sync_is_in_flight(tmp_path):
    """Streaming DiLoCo, 2 fragments, sync_every 4, delay 1: a round is prepared after local step 1 and applied
    after local step 2, so the state can be taken after even steps only."""
    cfg = config(tmp_path / "store", replicas=1, sync_every=4, fragments=2, fragment_sync_delay=1)
    assert [cfg.checkpointable(k) for k in range(6)] == [True, False, True, False, True, False]
    assert all(config(tmp_path, fragments=2).checkpointable(k) for k in range(6))  # delay 0: every step
    t = start(cfg)
    for step in range(1, 5):
        train([t], range(step - 1, step))
        if cfg.checkpointable(step):
            t.snapshot_state()
        else:
            with pytest.raises(TrainerStateError, match=r"fragment \d's sync \(round \d\) is in flight: .* inner step k "
                                                        r"with k % 2 < 1 \(DiLoCoConfig.checkpointable\)"):
                t.snapshot_state()
    t.close()


def test_rewind_deletes_newer_rounds_and_checkpoints_idempotently(tmp_path):
    cfg = config(tmp_path / "store")
    store = Store.from_config(cfg)
    for q in range(1, 5):
        store.put_json(f"rounds/q{q:08d}/members/e0.json", {"q": q})
        store.put_json(f"ckpt/q{q:08d}/COMMITTED.json", {"quorum_id": q, "step": q, "run_id": "resume"})
    store.put_json("ckpt/init/COMMITTED.json", {"key": "ckpt/init/r000.safetensors"})
    managers = [ObjectStoreManager(cfg, r) for r in range(2)]
    for m in managers:  # every replica rewinds; the second finds nothing left to delete
        m.rewind(2, 2)
        assert (m.quorum_id, m.current_step(), m.needs_heal) == (2, 2, False)
        m.shutdown()
    assert store.list("rounds") == ["q00000001", "q00000002"]
    assert store.list("ckpt") == ["init", "q00000001", "q00000002"]
