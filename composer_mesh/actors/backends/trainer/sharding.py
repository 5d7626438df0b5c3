"""One trainer replica over several procs: FSDP2 (`torch.distributed.fsdp.fully_shard`), SPMD.

Every rank of a replica receives the replica's whole `TrainBatch` and decides for itself, with no communication,
which rows are its own (`rank_pieces`: rows dealt out by tokens, then cut into micro-batches), so every rank also
knows every other rank's share. That makes the collectives line up: FSDP2 all-gathers a layer's parameters in
each forward and reduce-scatters its gradients in each backward, so every rank must run the same number of
forwards and backwards. A rank with fewer micro-batches than the busiest one runs `idle_pass`es (the same
forwards on one token, a zero loss), and each micro-batch runs the same forwards whatever it holds
(`train_batch.build_piece(uniform=True)`).

Exactness: each rank's pieces are divided by the WHOLE batch's counts (`LossAccumulator`), so the ranks'
gradients SUM to the whole batch's gradient. FSDP2 averages gradients over ranks by default; the sharded model
sets the divide factor to 1 (a sum). Metrics, the total and adaptive TAID are merged over ranks
(`loss/ranks.py`), so every rank reports the whole batch.

The process group is one per replica (a DiLoCo replica must fail alone), rendezvoused over TCP at its rank 0's
address: `monarch.spmd.setup_torch_elastic_env_async` sets one world over a whole proc mesh, which would tie the
replicas of a trainer mesh together. Gloo on the CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from composer_mesh.actors.backends.trainer.config import HFTrainerSettings
from composer_mesh.actors.backends.trainer.train_batch import Piece, StudentPass, TrainRows, needs_reference
from composer_mesh.actors.backends.trainer.trainer_state import TrainerSnapshot


@dataclass(frozen=True)
class ShardGroup:
    """Where this proc sits in its replica: rank `rank` of `world`, meeting the others at `address`
    ("host:port" of the replica's rank 0)."""

    rank: int
    world: int
    address: str
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"ShardGroup: rank {self.rank} is not in 0..{self.world - 1}")
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"ShardGroup: address {self.address!r} is not host:port")


def join(group: ShardGroup, device: torch.device) -> torch.distributed.device_mesh.DeviceMesh:
    """Join the replica's process group (this proc's default group) and return its 1-D device mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{group.address}", rank=group.rank,
                                world_size=group.world, timeout=datetime.timedelta(seconds=group.timeout_s))
    elif (dist.get_rank(), dist.get_world_size()) != (group.rank, group.world):
        raise RuntimeError(f"this proc is already rank {dist.get_rank()} of {dist.get_world_size()}, not "
                           f"{group.rank} of {group.world}")
    return init_device_mesh(device.type, (group.world,), mesh_dim_names=("shard",))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP wraps one by one: transformers names them in `_no_split_modules` (its decoder layer)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (`_no_split_modules`): cannot shard it "
                         "layer by layer")
    return layers


def shard_model(model: torch.nn.Module, mesh: torch.distributed.device_mesh.DeviceMesh, *,
                bf16_mixed: bool = False, cpu_offload: bool = False, reshard_after_forward: bool = True) -> None:
    """`fully_shard` each decoder layer, then the root (embeddings, final norm, head); gradients are summed
    over ranks, not averaged (see the module doc). `bf16_mixed`: parameters all-gathered and computed in bf16,
    gradients reduced in float32, the sharded master weights stay float32."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_mixed else (
        MixedPrecisionPolicy())
    # Pinned host memory needs an accelerator; a CPU trainer's "offload" keeps its shards where they are anyway.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward)
    # The root (embeddings, final norm, head) stays gathered from its forward to its backward: the chunked head
    # (`lm_head: chunked`) reads the head's weight after the forward, in the loss.
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=False)
    for module in model.modules():  # each FSDP module holds its own group's factor
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM(1.0)


def shard_trainer(model: torch.nn.Module, reference: torch.nn.Module | None, group: ShardGroup,
                  settings: HFTrainerSettings) -> TorchRanks:
    """Join the replica's process group and shard the policy and the reference (the hf trainer's settings);
    the ranks the trainer's loss merges over."""
    device = torch.device(settings.device)
    mesh = join(group, device)
    options = dict(bf16_mixed=settings.precision == "bf16-mixed", cpu_offload=settings.fsdp_cpu_offload,
                   reshard_after_forward=settings.fsdp_reshard_after_forward)
    shard_model(model, mesh, **options)
    if reference is not None and reference is not model:  # with LoRA the reference is the policy, adapters off
        shard_model(reference, mesh, **options)
    return TorchRanks(device)


class TorchRanks:
    """`loss.ranks.Ranks` over the default process group (tensors travel on `device`: NCCL needs CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.world = dist.get_world_size()

    def gather(self, t: Tensor) -> list[Tensor]:
        """Every rank's `t` in rank order (lengths along dim 0 may differ): two all_gathers, the lengths and then
        the values padded to the longest, whatever `t` packs (the loss merge packs a whole step's into one)."""
        sizes = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([t.shape[0]], dtype=torch.long, device=self.device))
        counts = [int(s) for s in sizes]
        padded = torch.zeros((max(counts), *t.shape[1:]), dtype=t.dtype, device=self.device)
        padded[: t.shape[0]] = t.to(self.device)
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded)
        return [g[:n].to(t.device) for g, n in zip(gathered, counts, strict=True)]

    def cat(self, t: Tensor) -> Tensor:
        """Every rank's `t` concatenated in rank order along dim 0."""
        return torch.cat(self.gather(t))


def check_same_round(ranks: TorchRanks, replica: int, round_id: int) -> None:
    """After a sharded DiLoCo replica's ranks healed each its own shards from the store (a stand-in rejoining):
    they must stand at the same round, or the replica would train on shards of different rounds."""
    from composer_mesh.mesh.objectstore.diloco import DiLoCoStateError

    rounds = [int(r) for r in ranks.cat(torch.tensor([round_id])).tolist()]
    if len(set(rounds)) > 1:
        raise DiLoCoStateError(
            f"DiLoCo replica {replica}: its ranks' shards are checkpointed up to different rounds {rounds} (the "
            "checkpoint writer died between its ranks' writes), so it cannot rejoin consistently: stop the run and "
            "resume it from its last checkpoint")


def rank_rows(data: TrainRows, world: int) -> list[list[int]]:
    """The batch's rows dealt out to `world` ranks by tokens (each row with its replay traces), longest first to
    the rank holding the fewest tokens so far; each rank's rows in batch order. The same on every rank."""
    cost = [len(r.prompt_ids) + len(r.completion_ids) for r in data.rollouts]
    for trace, row in data.pairs:
        cost[row] += len(data.rollouts[row].prompt_ids) + len(trace.completion_ids)
    load, out = [0] * world, [[] for _ in range(world)]  # type: tuple[list[int], list[list[int]]]
    for row in sorted(range(len(cost)), key=lambda i: (-cost[i], i)):
        rank = min(range(world), key=lambda k: (load[k], k))
        load[rank] += cost[row]
        out[rank].append(row)
    return [sorted(rows) for rows in out]


def rank_pieces(data: TrainRows, world: int, rank: int, budget_tokens: int | None, packed: bool) -> list[Piece | None]:
    """This rank's micro-batches, padded with None (an `idle_pass`) to the busiest rank's count."""
    every = [data.micro_batches(budget_tokens, packed, rows) if rows else [] for rows in rank_rows(data, world)]
    mine: list[Piece | None] = list(every[rank])
    return mine + [None] * (max(map(len, every)) - len(mine))


def idle_pass(data: TrainRows, run: StudentPass) -> None:
    """The forwards and the backward a micro-batch runs, on one token and with a zero loss: this rank's part in
    the collectives of a micro-batch it does not have (gradients unchanged)."""
    row = data.rollouts[0]
    prompts, completions = [row.prompt_ids[:1]], [row.completion_ids[:1] or [0]]
    student, _ = run.forward(run.model, prompts, completions)
    if needs_reference(data, run):
        run.reference_logprobs(prompts, completions)
    tensor = student if isinstance(student, Tensor) else student.hidden.sum() + student.weight.sum()
    (tensor.sum() * 0.0).backward()


class GatheredWeights(Mapping[str, Tensor]):
    """`models.loading.named_weights` of a sharded model as full tensors (in `dtype`, when given and floating),
    each gathered from its shards when it is read (`DTensor.full_tensor`). The weight plane reads them one at a
    time (it is a `mesh.weights.plane.ShapedWeights`: shapes without reading), so publishing holds one whole
    tensor at a time besides the plane's slot, never the whole model unsharded. Reading is a collective: every
    rank must read the same tensors in the same order (iterate it whole, or `dict()` it).

    With `sources` (`models.lora.merge_sources`: name -> (source tensor, LoRA layer or None)), the tensors are a
    LoRA model's merged weights under the plain model's names: a LoRA layer's weight is gathered with its A and B
    and the delta added (`models.lora.delta_from`)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None,
                 sources: dict[str, tuple[str, Any]] | None = None) -> None:
        from composer_mesh.models.loading import named_weights

        self._tensors = named_weights(model)  # this rank's shards (DTensors) and plain tensors: nothing gathered
        self._dtype = dtype
        self._sources = sources if sources is not None else {name: (name, None) for name in self._tensors}

    def _out_dtype(self, t: Tensor) -> torch.dtype:
        return self._dtype if self._dtype is not None and t.is_floating_point() else t.dtype

    def _gather(self, name: str) -> Tensor:
        from torch.distributed.tensor import DTensor

        t = self._tensors[name]
        return t.full_tensor() if isinstance(t, DTensor) else t

    def __getitem__(self, name: str) -> Tensor:
        source, layer = self._sources[name]
        full = self._gather(source)
        if layer is not None:
            from composer_mesh.models.lora import adapter_pair, delta_from

            a, b = (self._gather(n) for n in adapter_pair(source))
            full = full + delta_from(layer, a, b).to(full.dtype)
        return full.to(self._out_dtype(full))

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(self._tensors[src].shape), self._out_dtype(self._tensors[src]))
                for name, (src, _) in self._sources.items()}

    @property
    def device(self) -> torch.device:
        return next(iter(self._tensors.values())).device


def gathered_weights(model: torch.nn.Module, dtype: torch.dtype | None, lora: bool,
                     kind: str = "full") -> GatheredWeights:
    """A sharded replica's weights, each gathered when read: the model's (`kind` 'full'), with `lora` its merged
    weights ('full'), or its adapters alone ('adapter')."""
    if not lora:
        return GatheredWeights(model, dtype)
    from composer_mesh.models.lora import adapter_weights, merge_sources

    if kind == "adapter":
        return GatheredWeights(model, dtype, {name: (name, None) for name in adapter_weights(model)})
    return GatheredWeights(model, dtype, merge_sources(model))


def reshard_snapshot(snapshots: list[TrainerSnapshot], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     group: ShardGroup | None) -> TrainerSnapshot:
    """A trainer state saved by `len(snapshots)` ranks (one snapshot each, in rank order; one for an unsharded
    state) as this rank's of `group` (None: one unsharded proc). FSDP2 shards dim 0 in `torch.chunk` order, so a
    sharded tensor is its ranks' parts concatenated; a tensor whose part already has the full shape (a buffer,
    AdamW's step) is taken from rank 0. The JSON part (step, RNGs, loss state) is rank 0's. Every rank reads
    every part: the whole state passes through each rank's memory once."""
    import copy

    live = model.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def full_shape(key: str) -> tuple[int, ...] | None:
        kind, _, rest = key.partition("/")
        if kind == "model" and rest in live:
            return tuple(live[rest].shape)
        if kind == "optim":
            return tuple(params[int(rest.split("/", 1)[0])].shape)
        return None

    tensors = {}
    for key, first in snapshots[0].tensors.items():
        shape = full_shape(key)
        if shape is None or first.dim() == 0:
            tensors[key] = first
            continue
        full = first if tuple(first.shape) == shape else torch.cat([s.tensors[key] for s in snapshots])
        if tuple(full.shape) != shape:
            raise ValueError(f"trainer state: {key}'s {len(snapshots)} parts make {tuple(full.shape)}, the model has "
                             f"{shape}")
        tensors[key] = full if group is None else _my_chunk(full, group)
    meta = copy.deepcopy(snapshots[0].meta)
    meta["extra_json"].pop("shard", None)
    if group is not None:
        meta["extra_json"]["shard"] = {"rank": group.rank, "world": group.world}
    return TrainerSnapshot(tensors, meta)


def _my_chunk(full: Tensor, group: ShardGroup) -> Tensor:
    """This rank's rows of `full` as FSDP2 shards dim 0 (`torch.chunk`: ceil(n / world) rows each, the last ranks
    fewer or none)."""
    size = -(-full.shape[0] // group.world)
    return full[group.rank * size:(group.rank + 1) * size].clone()
