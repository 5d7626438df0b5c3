"""`composer-mesh plan`: what a topology would run where, and what it would cost per hour.

The plan is plain data (`Plan`, `MeshPlan`) so tests and scripts can read it; `render_plan` draws the rich table.
A price table is a small YAML validated like a topology (errors carry line and column):

    currency: USD
    slurm: {gpu_hour: 2.50, cpu_proc_hour: 0.02}
    process: {gpu_hour: 0, cpu_proc_hour: 0.01}

Cost per hour of a mesh = GPUs billed × gpu_hour + procs × cpu_proc_hour, where GPUs billed are
hosts × GPUs per node (a Slurm `gpus_per_node` override counts, since the job holds them).

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
            extra = f", {spec.replicas} replicas" if getattr(spec, "replicas", 1) > 1 else ""
            out.append(f"{label} ({spec.binding}{extra})")
    return tuple(out)


def _cost(spec: MeshSpecBase, gpus: int, prices: _Prices | None) -> float | None:
    price = prices.for_backend(spec.backend) if prices else None
    if price is None:
        return None
    return gpus * price.gpu_hour + spec.procs * price.cpu_proc_hour


def make_plan(
    topology: Topology, prices: _Prices | None = None, host_gpus: tuple[int | None, str] | None = None
) -> Plan:
    """What runs where (meshes in file order) with the hourly cost when prices are given.

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
            )
        )
    return Plan(
        name=topology.name,
        meshes=tuple(rows),
        currency=prices.currency if prices else None,
        host_gpus=host_gpus[0],
        host_gpus_source=host_gpus[1],
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


def render_plan(plan: Plan, console: Console | None = None) -> None:
    """Print the plan as a table (plus the total cost per hour when priced)."""
    console = console or Console()
    table = Table(title=f"Plan for topology {plan.name!r}", show_lines=True)
    table.add_column("mesh", style="bold")
    table.add_column("backend")
    table.add_column("hosts × procs", justify="right")
    table.add_column("GPUs", justify="right")
    table.add_column("roles")
    table.add_column("launch")
    priced = plan.currency is not None
    if priced:
        table.add_column(f"{plan.currency}/hour", justify="right")
    for m in plan.meshes:
        gpus = "CPU only" if m.gpus == 0 else f"{m.gpus} ({m.gpus_per_proc}/proc)"
        if m.gpus != m.gpus_used:
            gpus = f"{m.gpus} held, {m.gpus_used} used ({m.gpus_per_proc}/proc)"
        if m.gpu_devices:
            gpus += f"\n{format_gpus(m.gpu_devices)}"
        row = [
            m.name,
            m.backend,
            f"{m.hosts} × {m.procs_per_host} = {m.procs}",
            gpus,
            "\n".join(m.roles),
            m.job,
        ]
        if priced:
            row.append("no price" if m.cost_per_hour is None else f"{m.cost_per_hour:,.2f}")
        table.add_row(*row)
    console.print(table)
    total_gpus = sum(m.gpus for m in plan.meshes)
    total_procs = sum(m.procs for m in plan.meshes)
    console.print(f"{len(plan.meshes)} meshes, {total_procs} procs, {total_gpus} GPUs held")
    _print_host_gpus(plan, console)
    if priced:
        assert plan.currency is not None and plan.total_cost_per_hour is not None
        line = f"Estimated cost: {_money(plan.total_cost_per_hour, plan.currency)} per hour"
        if plan.unpriced:
            line += f" (not counted, no price for their backend: {', '.join(plan.unpriced)})"
        console.print(line)
