"""`composer-mesh plan`: what a topology would train, what would run where, and what it would cost.

The plan is plain data (`Plan`, `MeshPlan`) so tests and scripts can read it; `render_plan` prints it stacked,
one labelled line per fact (a table of six columns cut every cell at 80 columns or in a pipe). A price table is
a small YAML validated like a topology (errors carry line and column; examples/prices.yaml is one):

    currency: USD
    slurm: {gpu_hour: 2.50, cpu_proc_hour: 0.02}
    process: {gpu_hour: 0, cpu_proc_hour: 0.01}

Cost per hour of a mesh = GPUs billed × gpu_hour + procs × cpu_proc_hour, where GPUs billed are
hosts × GPUs per node (a Slurm `gpus_per_node` override counts, since the job holds them).

Cost per run: how long a run takes is not knowable before it runs, so the plan says which bound it used:
`--hours H` (e.g. from a short run's pace: steps ÷ steps per hour) costs every mesh for H hours; without it, a
mesh whose job has a time limit (Slurm `time_limit`) is costed up to that limit, an upper bound; a priced mesh
with neither leaves the run's cost unknown, and the plan says to give `--hours`.

Local meshes show which of this host's GPUs they get (`composer_mesh.mesh.gpus.assign_gpus`, the launch's
own answer). When some local mesh uses GPUs, the plan compares that with the host's GPU count where it can
be had without initialising CUDA (`host_gpu_count`); an unknown count is reported, not an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, create_model
from rich.console import Console
from rich.table import Table

from composer_mesh.mesh.gpus import assign_gpus, format_gpus, host_gpu_count
from composer_mesh.mesh.spec import BACKENDS, MeshSpecBase
from composer_mesh.topology.schema import TeachersSpec, Topology
from composer_mesh.topology.yaml_errors import load_yaml_model


class BackendPrice(BaseModel):
    """Hourly prices on one backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_hour: float = Field(ge=0, description="Price of one GPU for one hour.")
    cpu_proc_hour: float = Field(
        0.0, ge=0, description="Price of one proc (CPU share) for one hour; default 0."
    )


class _Prices(BaseModel):
    """Hourly prices per backend; a backend left out is shown as unpriced."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    currency: str = Field("USD", min_length=1, description="Currency label shown in the plan.")

    def for_backend(self, backend: str) -> BackendPrice | None:
        return getattr(self, backend, None)


# One optional `BackendPrice` per backend (`mesh.spec.BACKENDS`): a new backend is priced without a new field here.
PriceTable: type[_Prices] = create_model(
    "PriceTable",
    __base__=_Prices,
    __doc__=_Prices.__doc__,
    **{
        backend: (BackendPrice | None, Field(None, description=f"Prices for backend `{backend}`."))
        for backend in BACKENDS
    },
)


def load_prices(path: str | os.PathLike[str]) -> _Prices:
    """Load and validate a price table; raises `TopologyError` with lines and columns."""
    return load_yaml_model(path, PriceTable)


@dataclass(frozen=True)
class MeshPlan:
    """One row of the plan."""

    name: str
    backend: str
    hosts: int
    procs_per_host: int
    gpus_per_proc: int
    gpus: int  # GPUs held by the mesh (billed): hosts × GPUs per node
    gpus_used: int  # GPUs its procs use: procs × gpus_per_proc
    job: str  # how it is launched, e.g. the Slurm job options
    roles: tuple[str, ...]
    cost_per_hour: float | None  # None: no price for this backend (or no price table)
    gpu_devices: tuple[int, ...] | None = None  # a local mesh's host GPUs; None: not a local mesh
    limit_hours: float | None = None  # its job's time limit in hours; None: no limit

    @property
    def procs(self) -> int:
        return self.hosts * self.procs_per_host


@dataclass(frozen=True)
class Plan:
    name: str
    meshes: tuple[MeshPlan, ...]
    currency: str | None  # None: no price table given
    host_gpus: int | None = None  # GPUs this host exposes; None: unknown, or no local mesh uses GPUs
    host_gpus_source: str = ""  # where host_gpus came from, or why it is unknown ("" when not asked)
    training: tuple[tuple[str, str], ...] = ()  # (label, value): model, loss, steps, prompts, rollout, sandbox
    hours: float | None = None  # `--hours`: the run's expected length

    @property
    def local_gpus(self) -> tuple[int, ...]:
        """This host's GPUs that the local meshes use, sorted."""
        return tuple(sorted({g for m in self.meshes for g in m.gpu_devices or ()}))

    @property
    def missing_gpus(self) -> tuple[int, ...]:
        """Local meshes' GPU indices the host does not have (none when its count is unknown)."""
        if self.host_gpus is None:
            return ()
        return tuple(g for g in self.local_gpus if g >= self.host_gpus)

    @property
    def total_cost_per_hour(self) -> float | None:
        """Sum over priced meshes, or None without a price table."""
        if self.currency is None:
            return None
        return sum(m.cost_per_hour or 0.0 for m in self.meshes)

    def mesh_hours(self, mesh: MeshPlan) -> float | None:
        """The hours `mesh` is costed for per run: `--hours`, else its job's time limit, else None."""
        return self.hours if self.hours is not None else mesh.limit_hours

    def mesh_cost_per_run(self, mesh: MeshPlan) -> float | None:
        """One run's cost of `mesh` (an upper bound without `--hours`); None when unknown or unpriced."""
        if mesh.cost_per_hour is None:
            return None
        if mesh.cost_per_hour == 0:
            return 0.0
        hours = self.mesh_hours(mesh)
        return None if hours is None else mesh.cost_per_hour * hours

    @property
    def total_cost_per_run(self) -> float | None:
        """One run's cost over the priced meshes; None without prices or when a priced mesh's hours are unknown."""
        if self.currency is None:
            return None
        costs = [self.mesh_cost_per_run(m) for m in self.meshes if m.cost_per_hour is not None]
        return None if any(c is None for c in costs) else sum(c for c in costs if c is not None)

    @property
    def unpriced(self) -> tuple[str, ...]:
        """Meshes whose backend has no price (left out of the total)."""
        if self.currency is None:
            return ()
        return tuple(m.name for m in self.meshes if m.cost_per_hour is None)


def _role_labels(topology: Topology, mesh: str) -> tuple[str, ...]:
    out: list[str] = []
    roles = topology.roles
    for label in type(roles).model_fields:
        spec = getattr(roles, label)
        if spec is None or spec.mesh != mesh:
            continue
        if isinstance(spec, TeachersSpec):
            out.extend(f"teacher {m.name} ({m.binding}: {'+'.join(m.channels)})" for m in spec.members)
        else:
            replicas, per = getattr(spec, "replicas", 1), getattr(spec, "procs_per_replica", 1)
            extra = f", {replicas} replicas" if replicas > 1 else ""
            extra += f" of {per} ranks each" if per > 1 and replicas > 1 else f", 1 replica of {per} ranks" if per > 1 else ""
            out.append(f"{label} ({spec.binding}{extra})")
    return tuple(out)


def _model(topology: Topology) -> str:
    model = topology.model
    name = (f"built-in tiny Qwen2 ({model.tokenizer} tokenizer, {model.num_layers} layers × {model.hidden_size})"
            if model.source == "tiny" else model.source)
    if model.warmstart is not None:
        name += f"; warm start: {model.warmstart.steps} SFT steps on {model.warmstart.task}"
    return name


def _loss(topology: Topology) -> str:
    """The loss's channels that are on, with their weights (a channel at weight 0 is left out)."""
    loss = topology.loss
    parts = ["GRPO"]
    if loss.alpha_sdpo:
        parts.append(f"{loss.alpha_sdpo:g} × SDPO distillation")
    if loss.beta_replay:
        parts.append(f"{loss.beta_replay:g} × teacher-trace replay")
    text = " + ".join(parts)
    return text + (f"; KL to the reference {loss.kl_beta:g}" if loss.kl_beta else "")


def _prompts(topology: Topology) -> str:
    run = topology.run
    if run.environment is not None:
        source = f"environment {run.environment.kind}"
    elif run.data is not None:
        source = f"data {run.data.path or run.data.hub}"
    else:
        source = f"task {run.task}"
    if not run.eval_prompts:
        return f"{source}; no held-out evaluation"
    when = f"before, every {run.eval_every} steps and after" if run.eval_every else "before and after"
    return f"{source}; {run.eval_prompts} held-out prompts evaluated {when} training"


def _rollout(topology: Topology) -> str:
    """A multi_turn run's episode shape: its limits per episode and in flight."""
    r = topology.run.rollout
    limits = [f"≤ {r.max_turns} policy turns", f"{r.step_timeout_s:g} s per environment step"]
    if r.max_context is not None:
        limits.append(f"≤ {r.max_context:,} tokens per episode")
    if r.episode_timeout_s is not None:
        limits.append(f"{r.episode_timeout_s:g} s per episode")
    return f"multi_turn episodes: {', '.join(limits)}; ≤ {r.max_episodes} in flight"


def _training(topology: Topology) -> tuple[tuple[str, str], ...]:
    """What the run trains, for the plan's head: model, loss, steps and batch shape, prompts; for episodes, their
    shape; for an environment that runs code, which sandbox isolates it (`SandboxConfig.describe`)."""
    run = topology.run
    episodes = run.rollout.kind == "multi_turn"
    rollouts = run.steps * run.prompts_per_step * run.samples_per_prompt
    steps = (f"{run.steps:,} × {run.prompts_per_step} prompts × {run.samples_per_prompt} samples = {rollouts:,} "
             f"{'episodes' if episodes else 'rollouts'}; ≤ {run.max_new_tokens} new tokens "
             f"{'per turn' if episodes else 'each'}; policy lag ≤ {run.max_policy_lag}")
    rows = [("model", _model(topology)), ("loss", _loss(topology)), ("steps", steps), ("prompts", _prompts(topology))]
    if episodes:
        rows.append(("rollout", _rollout(topology)))
    sandbox = getattr(run.environment, "sandbox", None)
    if sandbox is not None:
        rows.append(("sandbox", sandbox.describe()))
    memory = _trainer_memory(topology)
    if memory is not None:
        rows.append(("trainer memory", memory))
    return tuple(rows)


GPU_BYTES = 80 * 10**9  # what the memory estimate is held against: an 80 GB GPU (A100/H100)


def _trainer_memory(topology: Topology) -> str | None:
    """One trainer rank's memory estimated from the model config (`memory.py`), with a warning when a GPU
    trainer's rank would not fit an 80 GB GPU; None for a binding without the hf trainer's settings or a model
    whose config is not available offline."""
    from composer_mesh.topology.memory import model_shapes, rank_memory

    trainer, loss = topology.roles.trainer, topology.loss
    settings = trainer.settings
    shapes = model_shapes(topology.model) if hasattr(settings, "precision") else None
    if shapes is None:
        return None
    reference = bool(getattr(settings, "reference_model", False)) and settings.lora is None and (
        loss.kl_beta > 0 or (loss.beta_replay > 0 and loss.dpo_variant == "dpo"))
    memory = rank_memory(shapes, settings, trainer.procs_per_replica, reference, settings.micro_batch_tokens)
    text = memory.describe()
    if settings.micro_batch_tokens is None:
        text += "; activations not estimated (set micro_batch_tokens)"
    gpu = topology.meshes[trainer.mesh].gpus_per_proc > 0
    if gpu and memory.total > GPU_BYTES:
        text += (" — warning: more than an 80 GB GPU holds; shard the replica over more procs "
                 "(roles.trainer.procs_per_replica), or set activation_checkpointing / a smaller micro_batch_tokens")
    return text


def _cost(spec: MeshSpecBase, gpus: int, prices: _Prices | None) -> float | None:
    price = prices.for_backend(spec.backend) if prices else None
    if price is None:
        return None
    return gpus * price.gpu_hour + spec.procs * price.cpu_proc_hour


def make_plan(
    topology: Topology, prices: _Prices | None = None, host_gpus: tuple[int | None, str] | None = None,
    hours: float | None = None,
) -> Plan:
    """What trains, what runs where (meshes in file order), with the cost per hour and per run when prices are
    given (`hours`: the run's expected length; without it, the jobs' time limits bound it).

    host_gpus: (count, source) of this host's GPUs; default `host_gpu_count()`, asked only when some local
    mesh uses GPUs (so plans of Slurm-only topologies do not depend on the machine that draws them).
    """
    assignment = assign_gpus(topology.meshes)
    if host_gpus is None:
        host_gpus = host_gpu_count() if any(assignment.values()) else (None, "")
    rows = []
    for name, spec in topology.meshes.items():
        gpus = spec.gpus_held
        rows.append(
            MeshPlan(
                name=name,
                backend=spec.backend,
                hosts=spec.hosts,
                procs_per_host=spec.procs_per_host,
                gpus_per_proc=spec.gpus_per_proc,
                gpus=gpus,
                gpus_used=spec.gpus,
                job=spec.launch_summary(topology.name, name),
                roles=_role_labels(topology, name),
                cost_per_hour=_cost(spec, gpus, prices),
                gpu_devices=tuple(assignment[name]) if name in assignment else None,
                limit_hours=None if (limit := spec.time_limit_s()) is None else limit / 3600,
            )
        )
    return Plan(
        name=topology.name,
        meshes=tuple(rows),
        currency=prices.currency if prices else None,
        host_gpus=host_gpus[0],
        host_gpus_source=host_gpus[1],
        training=_training(topology),
        hours=hours,
    )


def _money(value: float, currency: str) -> str:
    return f"{value:,.2f} {currency}"


def _print_host_gpus(plan: Plan, console: Console) -> None:
    """The local meshes' GPUs against what this host has: a warning when it has too few."""
    used = plan.local_gpus
    if not used:
        return
    use = f"meshes use {format_gpus(used)} of this host"
    source, missing = plan.host_gpus_source, plan.missing_gpus
    if plan.host_gpus is None:
        console.print(f"Local {use}; its GPU count is unknown ({source}), not checked")
    elif missing:
        console.print(
            f"[bold red]warning:[/] local {use}, but it has only {plan.host_gpus} ({source}); "
            f"missing: {format_gpus(missing)}",
            highlight=False,
        )
    else:
        console.print(f"Local {use}; it has {plan.host_gpus} ({source})")


def _hours(hours: float) -> str:
    return f"{hours:g} h"


def _mesh_rows(plan: Plan, m: MeshPlan) -> list[tuple[str, str]]:
    """The labelled lines of one mesh."""
    gpus = "CPU only" if m.gpus == 0 else f"{m.gpus} ({m.gpus_per_proc}/proc)"
    if m.gpus != m.gpus_used:
        gpus = f"{m.gpus} held, {m.gpus_used} used ({m.gpus_per_proc}/proc)"
    if m.gpu_devices:
        gpus += f": this host's {format_gpus(m.gpu_devices)}"
    rows = [("procs", f"{m.hosts} × {m.procs_per_host} = {m.procs} (hosts × procs per host)"), ("GPUs", gpus),
            ("roles", "; ".join(m.roles) or "-"), ("launch", m.job)]
    if plan.currency is not None:
        if m.cost_per_hour is None:
            cost = f"no price for backend {m.backend}"
        else:
            cost = f"{m.cost_per_hour:,.2f} {plan.currency}/hour"
            per_run, hours = plan.mesh_cost_per_run(m), plan.mesh_hours(m)
            if per_run is not None and m.cost_per_hour:
                bound = "" if plan.hours is not None else "at most "
                cost += f", {bound}{per_run:,.2f} per run ({_hours(hours or 0)})"
        rows.append(("cost", cost))
    return rows


def _cost_lines(plan: Plan) -> list[str]:
    """The total per hour and per run, saying which bound the run's length came from."""
    assert plan.currency is not None and plan.total_cost_per_hour is not None
    line = f"Estimated cost: {_money(plan.total_cost_per_hour, plan.currency)} per hour"
    if plan.unpriced:
        line += f" (not counted, no price for their backend: {', '.join(plan.unpriced)})"
    per_run = plan.total_cost_per_run
    if plan.hours is not None:
        run = f"Estimated cost per run: {_money(per_run or 0.0, plan.currency)} for {_hours(plan.hours)} (--hours)"
    elif per_run is not None:
        run = (f"Estimated cost per run: at most {_money(per_run, plan.currency)} (each priced job billed up to its time "
               "limit; give --hours H for an estimate)")
    else:
        open_ended = [m.name for m in plan.meshes if m.cost_per_hour and m.limit_hours is None]
        run = (f"Estimated cost per run: unknown, no time limit bounds {', '.join(open_ended)}: give --hours H (e.g. steps ÷ "
               "the steps per hour of a short run)")
    return [line, run]


def render_plan(plan: Plan, console: Console | None = None) -> None:
    """Print the plan stacked: what trains, then each mesh, then the totals (and costs when priced). Every
    line is a label and a value that wraps under itself, so nothing is cut at 80 columns or in a pipe."""
    console = console or Console()
    console.print(f"[bold]Plan for topology {plan.name!r}[/]", highlight=False)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    for label, value in plan.training:
        grid.add_row(f"  {label}", value)
    for m in plan.meshes:
        grid.add_row("", "")
        grid.add_row(f"mesh {m.name}", f"[bold]{m.backend}[/]")
        for label, value in _mesh_rows(plan, m):
            grid.add_row(f"  {label}", value)
    console.print(grid, highlight=False)
    total_gpus = sum(m.gpus for m in plan.meshes)
    total_procs = sum(m.procs for m in plan.meshes)
    console.print()
    console.print(f"{len(plan.meshes)} meshes, {total_procs} procs, {total_gpus} GPUs held", highlight=False)
    _print_host_gpus(plan, console)
    if plan.currency is not None:
        for line in _cost_lines(plan):
            console.print(line, highlight=False)
