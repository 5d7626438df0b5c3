"""`ObjectStoreDiLoCo`: the class a trainer replica hosts to run real torchft DiLoCo over an object store.

Usage (one per trainer replica, each in its own process or proc mesh):

    sync = ObjectStoreDiLoCo(model, inner_optimizer, config, replica_id)   # model now holds the agreed θ
    with sync:                                   # installs DiLoCo's hooks on inner_optimizer
        for batch in batches:
            loss = compute_loss(model, batch)
            loss.backward()
            inner_optimizer.step()               # every sync_every steps this also syncs via the store
            inner_optimizer.zero_grad()
    sync.close()

Construction validates the config against the model's tensors, then loads the starting state from the store:
the latest checkpoint if the run is in progress (a restarted replica resumes identical to the others), else
one θ0 agreed by all replicas (the first replica's initial weights win), so replicas never start apart.

A replica's own full state (to resume a stopped run bitwise, with the trainer's model and inner optimizer) is
`replica_state()` / `load_replica_state()`: global parameters and outer optimizers, round, outer and local step.
Loading rewinds the store to the saved round (`ObjectStoreManager.rewind`).

A replica sharded with FSDP2 over N procs (`shard=(k, N)`) runs one of these per rank: rank k syncs only its own
shards, with rank k of every other replica, under its own prefix of the store (`shard-k-of-N/`), so each rank moves
about 1/N of the model per round. DiLoCo is elementwise (pseudo-gradient, average, outer Nesterov SGD), so N
such groups compute exactly what one group over whole tensors would. DiLoCo sees each shard as a plain tensor
(`local_views`): the same storage as FSDP2's shard, which FSDP2 and AdamW only ever update in place.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.optim import SGD, Optimizer
from torchft.local_sgd import DiLoCo

from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.mesh.objectstore.manager import ObjectStoreManager, RoundReport, StateDict
from composer_mesh.mesh.objectstore.store import Store

log = logging.getLogger(__name__)

_SHAPE = ("replicas", "sync_every", "fragments", "fragment_sync_delay")


class DiLoCoStateError(ValueError):
    """A replica's DiLoCo state that cannot be saved now (a sync in flight) or loaded here (another shape)."""


class _Fragment(nn.Module):
    """A view of some of a model's parameters (the same Parameter objects), for streaming DiLoCo."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"), p)


def split_fragments(model: nn.Module, n: int) -> list[nn.Module]:
    """Split the model's parameters, in order, into `n` contiguous groups of about equal size."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if n == 1:
        return [model]
    if len(named) < n:
        raise ValueError(f"diloco.fragments={n} but the model has only {len(named)} trainable tensors")
    total = sum(p.numel() for _, p in named)
    groups: list[list[tuple[str, nn.Parameter]]] = [[]]
    acc = 0
    for i, (name, p) in enumerate(named):
        still_to_open = n - len(groups)
        if groups[-1] and still_to_open > 0 and (acc >= total * len(groups) / n or len(named) - i == still_to_open):
            groups.append([])
        groups[-1].append((name, p))
        acc += p.numel()
    return [_Fragment(g) for g in groups]


def local_views(fragments: list[nn.Module]) -> list[nn.Module]:
    """The fragments with every FSDP2-sharded parameter (a DTensor) replaced by a plain Parameter over its local
    shard's storage, so DiLoCo, the outer SGD and the store only see this rank's part. The fragments are split on
    the full model first (`split_fragments` counts whole tensors), so fragment i is the same parameters on every
    rank."""
    from torch.distributed.tensor import DTensor

    def view(p: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(p.to_local(), requires_grad=p.requires_grad) if isinstance(p, DTensor) else p

    with torch.no_grad():
        return [_Fragment([(name, view(p)) for name, p in f.named_parameters()]) for f in fragments]


def _fragment_state(i: int, fragment: nn.Module, tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> StateDict:
    """Fragment i's saved state (`ObjectStoreDiLoCo.replica_state`) as its registered load fn takes it, checked
    against the live fragment's parameter names and shapes (a copy would broadcast a wrong shape silently)."""
    live = dict(fragment.named_parameters())
    saved = {n: tensors[f"f{i}/global/{n}"] for n in info["params"] if f"f{i}/global/{n}" in tensors}
    bad = [n for n in live if n not in saved or saved[n].shape != live[n].shape]
    if info["params"] != list(live) or bad:
        raise DiLoCoStateError(f"fragment {i}: the saved global parameters do not fit this model (saved "
                               f"{len(info['params'])}, live {len(live)}; missing or of another shape: {bad[:3]})")
    outer: dict[int, dict[str, Any]] = {}
    prefix = f"f{i}/outer/"
    for key, value in tensors.items():
        if key.startswith(prefix):
            index, name = key[len(prefix):].split("/", 1)
            outer.setdefault(int(index), {})[name] = value
    for key, value in info["outer_state"].items():
        index, name = key.split("/", 1)
        outer.setdefault(int(index), {})[name] = value
    return {"original_parameters": saved, "outer_optimizer": {"state": outer, "param_groups": info["outer_param_groups"]}}


class ObjectStoreDiLoCo:
    """torchft DiLoCo (unmodified) + `ObjectStoreManager`, set up the way that does not silently diverge.

    One outer SGD (Nesterov, lr/momentum from config) per fragment; bucket cap checked against the model's
    largest tensor; identical start from the store; a checkpoint after every committed round.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: Optimizer,
        config: DiLoCoConfig,
        replica_id: int,
        *,
        store: Store | None = None,
        fragments: list[nn.Module] | None = None,
        backup_device: torch.device | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        config.check_against([(n, tuple(p.shape), p.element_size()) for n, p in model.named_parameters()])
        self.config = config
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.fragments = fragments if fragments is not None else split_fragments(model, config.fragments)
        if shard is not None:  # rank k of a sharded replica: its own shards, its own prefix of the store
            k, n = shard
            if not 0 <= k < n:
                raise ValueError(f"shard {shard}: rank {k} is not in 0..{n - 1}")
            self.fragments = local_views(self.fragments)
            store = store or Store.from_config(config, under=f"shard-{k}-of-{n}")
        if len(self.fragments) != config.fragments:
            raise ValueError(f"got {len(self.fragments)} fragments but diloco.fragments={config.fragments}")
        oc = config.outer_optimizer
        self.outer_optimizers: list[Optimizer] = [
            SGD(f.parameters(), lr=oc.lr, momentum=oc.momentum, nesterov=oc.nesterov) for f in self.fragments
        ]
        self.manager = ObjectStoreManager(config, replica_id, store)
        self.manager.on_heal = self._load_globals_into_model
        self._diloco = DiLoCo(
            self.manager,  # type: ignore[arg-type]  # duck-typed Manager
            self.fragments,
            inner_optimizer,
            self.outer_optimizers,
            sync_every=config.sync_every,
            backup_device=backup_device,
            pin_memory=False,
            use_bucketization=config.bucket_cap_mb is not None,
            bucket_cap_mb=config.bucket_cap_mb,  # type: ignore[arg-type]  # torchft multiplies, float is fine
            fragment_sync_delay=config.fragment_sync_delay,
            fragment_update_alpha=config.fragment_update_alpha,
        )
        self.start_mode = self.manager.bootstrap()
        self._hook: Any = None
        log.info("DiLoCo replica %d %s at round %d (step %d)", replica_id, self.start_mode,
                 self.manager.quorum_id, self.manager.current_step())

    # --------------------------------------------------------------- context
    def __enter__(self) -> ObjectStoreDiLoCo:
        self._diloco.__enter__()
        # Registered after DiLoCo's hooks, so it runs after them in the same optimizer.step():
        # it starts a prepared round's I/O (overlap when fragment_sync_delay > 0) and checkpoints after a commit.
        self._hook = self.inner_optimizer.register_step_post_hook(self._after_inner_step)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._diloco.__exit__(exc_type, exc, tb)

    def _after_inner_step(self, *_: Any) -> None:
        self.manager.flush()
        self.manager.maybe_checkpoint()

    def _load_globals_into_model(self, state: dict[str, StateDict]) -> None:
        """After loading a checkpoint: the model's parameters become the global parameters."""
        with torch.no_grad():
            for i, frag in enumerate(self.fragments):
                params = state[f"StreamingDiLoCoFragment_{i}"]["original_parameters"]
                for name, p in frag.named_parameters():
                    p.data.copy_(params[name])

    # --------------------------------------------------------------- info
    @property
    def round_id(self) -> int:
        """Quorum id of the last round started (0 before the first)."""
        return self.manager.quorum_id

    @property
    def outer_step(self) -> int:
        """Committed outer steps (fragment syncs) so far, identical on every replica."""
        return self.manager.current_step()

    @property
    def reports(self) -> list[RoundReport]:
        return self.manager.reports

    @property
    def last_report(self) -> RoundReport | None:
        return self.manager.reports[-1] if self.manager.reports else None

    @property
    def inner_steps(self) -> int:
        """Inner steps behind this replica's state. Every replica opens a round each sync_every/fragments inner
        steps (quorum ids count them, failed rounds too), so the round id and DiLoCo's local step say it."""
        per = self.config.sync_every // self.config.fragments
        rounds_closed = self.manager.quorum_id - (1 if self.manager.round_open else 0)
        return rounds_closed * per + self._diloco._local_step

    def rejoin(self, round_id: int, wait_s: float) -> int:
        """Take the place of a dead replica at the end of round `round_id` (the last round the survivors closed
        before the first step it must train): wait up to `wait_s` for that round's checkpoint, heal from it, and
        return `inner_steps` (the controller replays this replica's batches after that step).

        When the round's checkpoint never comes (its writer was the dead replica), the newest one is used: the
        replayed steps then meet that round as a late non-member and read its result. A newer checkpoint means
        the survivors closed a round without this replica (it was replaced too slowly): DiLoCoStateError."""
        deadline = time.monotonic() + wait_s
        latest = self.manager.checkpoints.read_latest()
        while (latest is None or latest["quorum_id"] < round_id) and time.monotonic() < deadline:
            time.sleep(self.config.poll_interval_s)
            latest = self.manager.checkpoints.read_latest()
        if latest is not None and latest["quorum_id"] > round_id:
            raise DiLoCoStateError(f"DiLoCo replica {self.manager.replica_id} cannot rejoin at round {round_id}: "
                                   f"the survivors closed round {latest['quorum_id']} without it (raise "
                                   f"diloco.quorum_deadline_s={self.config.quorum_deadline_s:g} above the time a "
                                   "replacement takes)")
        if latest is not None and latest["quorum_id"] != self.manager.quorum_id:
            self.manager.heal(latest)
        if self._diloco._local_step != 0 or self.manager.round_open:
            raise DiLoCoStateError("rejoin() must come right after construction, before any inner step")
        log.warning("DiLoCo replica %d rejoined at round %d (inner step %d)", self.manager.replica_id,
                    self.manager.quorum_id, self.inner_steps)
        return self.inner_steps

    def global_state(self) -> dict[str, torch.Tensor]:
        """Copies of the global parameters and outer-optimizer buffers, keyed "fragment/kind/name".

        Identical on every replica after each commit (the model's own parameters differ whenever a streaming
        fragment carries local progress).
        """
        out: dict[str, torch.Tensor] = {}
        states = self.manager.collect_state()
        for i, (frag, opt) in enumerate(zip(self.fragments, self.outer_optimizers)):
            state = states[f"StreamingDiLoCoFragment_{i}"]
            for name, t in state["original_parameters"].items():
                out[f"f{i}/param/{name}"] = t.detach().clone()
            for idx, (name, _) in enumerate(frag.named_parameters()):
                buf = opt.state_dict()["state"].get(idx, {}).get("momentum_buffer")
                if buf is not None:
                    out[f"f{i}/momentum/{name}"] = buf.detach().clone()
        return out

    # --------------------------------------------------------------- a replica's full state (resume)
    def replica_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What this replica needs, besides its model and inner optimizer, to continue bitwise: per fragment the
        global parameters (`f{i}/global/<name>`) and the outer optimizer's state tensors (`f{i}/outer/<index>/<key>`),
        and as JSON the outer param groups, the round and committed outer step, DiLoCo's local step and the
        shape (replica id, replicas, sync_every, fragments, delay) a resumed replica must have.

        The tensors are the live ones, not copies: copy them before training goes on (`capture_trainer_state`
        does). Raises DiLoCoStateError while a fragment's sync is in flight (`DiLoCoConfig.checkpointable`)."""
        if self.manager.round_open:
            raise DiLoCoStateError(self._in_flight())
        states = self.manager.collect_state()
        tensors: dict[str, torch.Tensor] = {}
        fragments: list[dict[str, Any]] = []
        for i in range(len(self.fragments)):
            state = states[f"StreamingDiLoCoFragment_{i}"]
            for name, t in state["original_parameters"].items():
                tensors[f"f{i}/global/{name}"] = t
            outer = state["outer_optimizer"]
            scalars: dict[str, Any] = {}
            for index, entry in outer["state"].items():
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"f{i}/outer/{index}/{key}"] = value
                    else:
                        scalars[f"{index}/{key}"] = value
            fragments.append({"params": list(state["original_parameters"]), "outer_param_groups": outer["param_groups"],
                              "outer_state": scalars})
        meta = {
            "replica_id": self.manager.replica_id, **{k: getattr(self.config, k) for k in _SHAPE},
            "run_id": self.config.run_id, "quorum_id": self.manager.quorum_id, "step": self.manager.current_step(),
            "local_step": self._diloco._local_step, "needs_heal": self.manager.needs_heal, "fragment_state": fragments,
        }
        return tensors, meta

    def _in_flight(self) -> str:
        c = self.config
        per = c.sync_every // c.fragments
        return (f"DiLoCo replica {self.manager.replica_id}: fragment {self.outer_step % c.fragments}'s sync (round "
                f"{self.round_id}) is in flight: prepared after local step {per - c.fragment_sync_delay}, applied "
                f"after local step {per} (now {self._diloco._local_step}); its state can be saved only after an "
                f"inner step k with k % {per} < {per - c.fragment_sync_delay} (DiLoCoConfig.checkpointable)")

    def check_replica_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, StateDict]:
        """Refuse (DiLoCoStateError, saved vs live) a state of another replica or DiLoCo shape, or one whose
        tensors do not fit this replica's fragments; returns it as the registered load fns take it."""
        if self.manager.round_open:
            raise DiLoCoStateError(self._in_flight())
        me = self.manager.replica_id
        if meta["replica_id"] != me:
            raise DiLoCoStateError(f"the state is DiLoCo replica {meta['replica_id']}'s, this is replica {me}")
        differ = [f"{k}: saved {meta[k]}, live {getattr(self.config, k)}" for k in _SHAPE
                  if meta[k] != getattr(self.config, k)]
        if differ:
            raise DiLoCoStateError(f"the state is for another DiLoCo shape: {'; '.join(differ)}")
        if not self.config.checkpointable(int(meta["local_step"])):
            raise DiLoCoStateError(f"the state was saved at local step {meta['local_step']}, with a sync in flight")
        return {f"StreamingDiLoCoFragment_{i}": _fragment_state(i, frag, tensors, meta["fragment_state"][i])
                for i, frag in enumerate(self.fragments)}

    def load_replica_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Continue from `replica_state`'s state: global parameters and outer optimizers, the round, the outer and
        local steps; the store is rewound to the saved round (`ObjectStoreManager.rewind`). The model's own
        (local) parameters are not touched: they come with the trainer's state."""
        states = self.check_replica_state(tensors, meta)
        self.manager.restore_state(states)
        self.manager.rewind(int(meta["quorum_id"]), int(meta["step"]), bool(meta["needs_heal"]))
        self._diloco._local_step = int(meta["local_step"])

    def close(self) -> None:
        """Finish pending checkpoint writes and stop the I/O threads."""
        if self._hook is not None:
            self.__exit__(None, None, None)
        self.manager.maybe_checkpoint()
        self.manager.shutdown(wait=True)
