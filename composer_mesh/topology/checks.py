"""Checks across the sections of a topology file, run on whatever parts of it are valid.

Each section is validated on its own (`parts_of`), so a file with errors in some sections still gets the
checks between the others: one run reports everything. Each check is one function of `CHECKS`, returning
(field loc, message) pairs; `CROSS_CHECKS` says the same in words for docs/topology.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, TypeAdapter

from composer_mesh.mesh.gpus import assign_gpus, format_gpus, shared_gpus
from composer_mesh.mesh.spec import MESH_SPECS, MeshSpec, MeshSpecBase
from composer_mesh.topology.schema import (
    BoundSpec,
    GeneratorsSpec,
    RewarderSpec,
    RolesSpec,
    TeachersSpec,
    Topology,
    TrainerSpec,
)
from composer_mesh.topology.yaml_errors import Loc, field_type

# A binding whose class lists this capability always needs a GPU (checked against the mesh's gpus_per_proc).
GPU_CAPABILITY = "gpu"
# A generator binding that applies LoRA adapters itself and takes adapter tensors from the weight plane.
ADAPTERS_CAPABILITY = "adapters"
# A trainer binding that trains one replica over several procs (FSDP2): `procs_per_replica > 1`.
SHARDED_CAPABILITY = "sharded"
# The binding capability each teacher channel needs (a hint is text: what a replay teacher writes).
CHANNEL_CAPABILITY = {"distill": "distill", "replay": "replay", "hint": "replay"}
# A generator binding that scores continuations given a prompt: the policy as its own teacher (run.rollout.hints).
SELF_TEACHER_CAPABILITY = "self_teacher"
# The sections owned by the components (validated on their own for the checks).
SECTIONS: tuple[str, ...] = ("model", "loss", "weights", "diloco", "run")

CROSS_CHECKS: tuple[str, ...] = (
    "every role's `mesh` is a key of `meshes`, and every mesh is used by some role",
    "a role that needs GPUs (its binding lists capability `gpu`, or its settings have `device: cuda...` or "
    "`gpus > 0`) is not on a mesh with `gpus_per_proc: 0`",
    "a teacher's channel `distill` / `replay` needs the binding capability of the same name "
    "(e.g. `openrouter` gives no per-token distributions, so it cannot feed `distill`); `hint` needs `replay`",
    "`roles.rewarder` is given exactly when `run.rollout.kind` is `single_turn`: a single completion is scored by "
    "the rewarder, a `multi_turn` episode by its environment (a rewarder there would never be asked); a `harness` "
    "run may have one, for the episodes whose agent reports no reward",
    "`loss.alpha_sdpo > 0` needs a teacher with channel `distill` (or `run.rollout.hints`); `loss.beta_replay > 0` "
    "needs a teacher with channel `replay` (both default to 1.0, so set them to 0 to run without teachers)",
    "`run.rollout.hints` needs `loss.alpha_sdpo > 0` and a generator binding with capability `self_teacher` "
    "(`hf`, `vllm`); `hints.source: teacher` names a teachers member with channel `hint` (capability `replay`)",
    "`diloco` is given exactly when `roles.trainer.replicas > 1`, and `diloco.replicas` equals it",
    "the trainer mesh has exactly `roles.trainer.replicas` × `procs_per_replica` procs (hosts × procs_per_host)",
    "`procs_per_replica > 1` needs a trainer binding with capability `sharded` (`hf`: FSDP2)",
    "`run.on_nonfinite: skip` has no `diloco` (a replica that skips a step would leave its rounds' cadence)",
    "a trainer with `settings.lora` has no `diloco`; `lora.sync: adapter` needs a generator binding with "
    "capability `adapters` (one that applies the same LoRA config and loads adapter tensors) and serves its rank "
    "`r` (`vllm`: 512 at most)",
    "Slurm meshes that may share a node (`exclusive: false`, same partition) use different `monarch_port`s",
    "`local` meshes never share a GPU: those without `gpu_offset` / `gpu_devices` take the lowest free GPUs "
    "in mesh order, and pinned ones must not overlap (roles that should share GPUs share one mesh)",
    "`model.warmstart.data` reading `run.data`'s source (same path or hub dataset and split) holds out the same "
    "rows: the same prompt/messages column and eval_* settings (its `answer` may differ: the warm-start target)",
    "binding names and import paths resolve to a class with a `Settings` model, and `settings` validate with it",
    "duplicate keys anywhere in the file are errors (YAML would silently keep the last one)",
)

Problem = tuple[Loc, str]
RoleSpec = TrainerSpec | GeneratorsSpec | RewarderSpec | TeachersSpec
_INVALID = object()  # a part that is present but does not validate


@dataclass
class Parts:
    """The valid parts of a possibly invalid file (a missing key means that part is invalid)."""

    mesh_names: list[str] = field(default_factory=list)
    meshes: dict[str, MeshSpecBase] = field(default_factory=dict)
    mesh_refs: dict[str, Loc] = field(default_factory=dict)  # raw `mesh:` values -> where they are
    # role -> its valid spec, section -> its valid model (None: absent; not there: invalid)
    roles: dict[str, RoleSpec | None] = field(default_factory=dict)
    sections: dict[str, BaseModel | None] = field(default_factory=dict)


def _valid(adapter: TypeAdapter[Any], raw: Any) -> Any:
    """`raw` validated, or `_INVALID`: any failure only means "this part is not valid" (the full validation
    reports why)."""
    try:
        return adapter.validate_python(raw)
    except Exception:
        return _INVALID


def _add_meshes(parts: Parts, meshes: Any) -> None:
    if not isinstance(meshes, dict):
        return
    parts.mesh_names = [str(k) for k in meshes]
    adapter = TypeAdapter(MeshSpec)
    for name, raw in meshes.items():
        spec = _valid(adapter, raw)
        if spec is not _INVALID:
            parts.meshes[str(name)] = spec


def _add_roles(parts: Parts, roles: Any) -> None:
    if not isinstance(roles, dict):
        return
    for role, raw in roles.items():
        if isinstance(raw, dict) and isinstance(raw.get("mesh"), str):
            parts.mesh_refs.setdefault(raw["mesh"], ("roles", role, "mesh"))
    for role in RolesSpec.model_fields:
        spec = _valid(TypeAdapter(field_type(RolesSpec, role)), roles.get(role))
        if spec is not _INVALID:
            parts.roles[role] = spec


def _add_sections(parts: Parts, data: dict[Any, Any]) -> None:
    for name in SECTIONS:
        if name not in data and Topology.model_fields[name].is_required():
            continue
        raw = data.get(name, None if name == "diloco" else {})
        value = _valid(TypeAdapter(field_type(Topology, name)), raw)
        if value is not _INVALID:
            parts.sections[name] = value


def parts_of(data: Any) -> Parts:
    """The parts of a file's data that validate on their own."""
    parts = Parts()
    if isinstance(data, dict):
        _add_meshes(parts, data.get("meshes"))
        _add_roles(parts, data.get("roles"))
        _add_sections(parts, data)
    return parts


# ---------------------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------------------


def check_meshes_used(parts: Parts) -> Iterator[Problem]:
    """Every role's mesh exists; every mesh is used."""
    names = parts.mesh_names
    known = ", ".join(names) or "(none)"
    for mesh, loc in parts.mesh_refs.items():
        if names and mesh not in names:
            yield loc, f"unknown mesh {mesh!r}; meshes are: {known}"
    if parts.mesh_refs or parts.roles:
        for name in names:
            if name not in parts.mesh_refs:
                yield (
                    ("meshes", name),
                    f"mesh {name!r} is not used by any role (remove it or place a role on it)",
                )


def gpu_need(spec: BoundSpec) -> str | None:
    """Why a bound role needs GPUs, or None: a `gpu` capability, `settings.device: cuda...` or `settings.gpus > 0`."""
    try:
        binding = spec.resolved
    except Exception:
        return None
    if GPU_CAPABILITY in binding.capabilities:
        return f"binding {spec.binding!r} needs a GPU"
    device = getattr(spec.settings, "device", None)
    if isinstance(device, str) and device.startswith("cuda"):
        return f"settings.device is {device!r}"
    gpus = getattr(spec.settings, "gpus", None)
    if isinstance(gpus, int) and gpus > 0:
        return f"settings.gpus is {gpus}"
    return None


def _bound_specs(parts: Parts) -> Iterator[tuple[Loc, BoundSpec, str]]:
    """(where to report, bound spec, its mesh) of every role and every teacher of the pool."""
    for role, spec in parts.roles.items():
        if isinstance(spec, TeachersSpec):
            for i, member in enumerate(spec.members):
                yield ("roles", role, "members", i, "binding"), member, spec.mesh
        elif spec is not None:
            yield ("roles", role, "mesh"), spec, spec.mesh


def check_gpu_meshes(parts: Parts) -> Iterator[Problem]:
    """Roles that need GPUs are not on CPU-only meshes."""
    for loc, spec, mesh in _bound_specs(parts):
        need = gpu_need(spec)
        mesh_spec = parts.meshes.get(mesh)
        if need and mesh_spec is not None and mesh_spec.gpus_per_proc == 0:
            yield loc, f"needs GPUs ({need}) but mesh {mesh!r} is CPU-only (gpus_per_proc: 0)"


def check_teacher_channels(parts: Parts) -> Iterator[Problem]:
    """A teacher's channels need the binding capability of the same name."""
    teachers = parts.roles.get("teachers")
    if not isinstance(teachers, TeachersSpec):
        return
    for i, member in enumerate(teachers.members):
        caps = member.resolved.capabilities
        for j, channel in enumerate(member.channels):
            need = CHANNEL_CAPABILITY[channel]
            if need not in caps:
                yield (
                    ("roles", "teachers", "members", i, "channels", j),
                    f"teacher {member.name!r} (binding {member.binding!r}) cannot feed channel {channel!r}: "
                    f"its capabilities are {sorted(caps) or 'none'}, and {channel!r} needs capability {need!r}",
                )


def _hints_source(parts: Parts) -> str | None:
    """`run.rollout.hints.source`; None when the run section is invalid (reported already: unknown here)."""
    if "run" not in parts.sections:
        return None
    run = parts.sections["run"]
    return getattr(getattr(getattr(run, "rollout", None), "hints", None), "source", "none")


def check_loss_channels_fed(parts: Parts) -> Iterator[Problem]:
    """A loss channel with weight > 0 needs a teacher feeding it (channel 2: or targeted feedback's hints)."""
    loss = parts.sections.get("loss")
    if loss is None or "teachers" not in parts.roles:  # an invalid pool: that is reported, nothing to check
        return
    teachers = parts.roles["teachers"]
    members = teachers.members if isinstance(teachers, TeachersSpec) else []  # None: no pool
    feeding = {c for m in members for c in m.channels}
    if _hints_source(parts) != "none":
        feeding.add("distill")  # the policy conditioned on a hint is channel 2's teacher (None: it may be)
    for weight, channel in (("alpha_sdpo", "distill"), ("beta_replay", "replay")):
        value = getattr(loss, weight, 0) or 0
        if value > 0 and channel not in feeding:
            yield (
                ("loss", weight),
                f"loss.{weight} = {value} but no teacher has channel {channel!r}; set loss.{weight}: 0 "
                f"or add a teacher with channels: [{channel}]",
            )


def check_hints(parts: Parts) -> Iterator[Problem]:
    """Targeted feedback feeds channel 2 from the generators: they must score continuations, and the loss must
    weight channel 2."""
    if _hints_source(parts) in ("none", None):
        return
    loss, generators = parts.sections.get("loss"), parts.roles.get("generators")
    if loss is not None and not (getattr(loss, "alpha_sdpo", 0) or 0) > 0:
        yield (("run", "rollout", "hints", "source"), "run.rollout.hints feeds channel 2, which loss.alpha_sdpo = 0 "
               "switches off: set loss.alpha_sdpo > 0 or hints.source: none")
    yield from _hint_teacher(parts)
    if isinstance(generators, GeneratorsSpec) and SELF_TEACHER_CAPABILITY not in generators.resolved.capabilities:
        caps = generators.resolved.capabilities
        yield (("run", "rollout", "hints", "source"), f"run.rollout.hints needs generators that score "
               f"continuations (capability {SELF_TEACHER_CAPABILITY!r}), and binding {generators.binding!r} has "
               f"{sorted(caps) or 'none'}: use the hf or vllm generator")


def _hint_teacher(parts: Parts) -> Iterator[Problem]:
    """`hints.source: teacher` names a pool member with channel `hint`."""
    run, teachers = parts.sections.get("run"), parts.roles.get("teachers")
    name = getattr(getattr(getattr(run, "rollout", None), "hints", None), "teacher", None)
    if name is None or "teachers" not in parts.roles:  # not the teacher source, or an invalid pool (reported)
        return
    members = {m.name: m for m in teachers.members} if isinstance(teachers, TeachersSpec) else {}
    if "hint" not in getattr(members.get(name), "channels", []):
        writers = sorted(n for n, m in members.items() if "hint" in m.channels) or "none"
        yield (("run", "rollout", "hints", "teacher"), f"run.rollout.hints.teacher {name!r} is not a teachers member "
               f"with channels [hint] (members with it: {writers})")


def check_rewarder_role(parts: Parts) -> Iterator[Problem]:
    """`roles.rewarder` exactly when the run scores single completions (`run.rollout.kind: single_turn`).

    A `multi_turn` run that names a rewarder is refused, not warned about and skipped: its episodes are scored
    by `run.environment` alone, so a reward function there would silently never run, and a user who wrote one
    (a shaping term, a grader of the final answer) would train on another reward than the one they read in the
    file. The refusal says so and names the line; removing the role (and its mesh) is the whole fix."""
    run = parts.sections.get("run")
    kind = getattr(getattr(run, "rollout", None), "kind", None)
    if kind is None or "rewarder" not in parts.roles:  # an invalid run or rewarder section: reported already
        return
    rewarder = parts.roles["rewarder"]
    if kind == "single_turn" and rewarder is None:
        yield (("roles",), "a single_turn run (run.rollout.kind) needs roles.rewarder to score its completions; "
               "only multi_turn runs, scored by run.environment, leave it out")
    elif kind == "multi_turn" and rewarder is not None:
        yield (("roles", "rewarder"), "a multi_turn run never asks a rewarder (run.environment scores its "
               f"episodes): remove roles.rewarder (and mesh {rewarder.mesh!r} if no other role uses it)")


def check_backend_meshes(parts: Parts) -> Iterator[Problem]:
    """Each backend's own checks across its meshes (`MeshSpec.check_meshes`, e.g. Slurm's worker ports)."""
    for member in MESH_SPECS:
        yield from member.check_meshes(parts.meshes)


def check_local_gpus(parts: Parts) -> Iterator[Problem]:
    """Local meshes pinned to the same GPUs (the unpinned ones are placed around them and never clash)."""
    for earlier, later, common in shared_gpus(assign_gpus(parts.meshes)):
        want = parts.meshes[later].host_gpus()
        key = (want.pinned_by if want is not None else None) or "gpu_offset"
        yield (
            ("meshes", later, key),
            f"meshes {earlier!r} and {later!r} would share {format_gpus(common)} of this host; give them "
            "disjoint gpu_devices / gpu_offset (roles that should share GPUs can share one mesh)",
        )


def check_diloco_replicas(parts: Parts) -> Iterator[Problem]:
    """DiLoCo exactly when the trainer has replicas, with the same number of them."""
    trainer = parts.roles.get("trainer")
    if not isinstance(trainer, TrainerSpec) or "diloco" not in parts.sections:
        return
    diloco = parts.sections["diloco"]
    if diloco is not None and trainer.replicas == 1:
        yield (
            ("diloco",),
            "diloco is configured but roles.trainer.replicas is 1; set replicas > 1 or remove the diloco section",
        )
    if diloco is None and trainer.replicas > 1:
        yield (
            ("roles", "trainer", "replicas"),
            f"replicas = {trainer.replicas} needs a diloco section (replicas synchronise through the object store)",
        )
    dr = getattr(diloco, "replicas", None)
    if diloco is not None and trainer.replicas > 1 and dr is not None and dr != trainer.replicas:
        yield (
            ("diloco", "replicas"),
            f"diloco.replicas = {dr} but roles.trainer.replicas = {trainer.replicas}; they must match",
        )


def check_replicas_fit_mesh(parts: Parts) -> Iterator[Problem]:
    """The trainer mesh holds exactly `replicas` × `procs_per_replica` procs."""
    trainer = parts.roles.get("trainer")
    if not isinstance(trainer, TrainerSpec):
        return
    mesh = parts.meshes.get(trainer.mesh)
    if mesh is not None and mesh.procs != trainer.replicas * trainer.procs_per_replica:
        yield (
            ("roles", "trainer", "replicas"),
            f"replicas = {trainer.replicas} × procs_per_replica = {trainer.procs_per_replica} needs "
            f"{trainer.replicas * trainer.procs_per_replica} procs, mesh {trainer.mesh!r} has {mesh.procs} "
            "(hosts × procs_per_host)",
        )


def check_sharded_trainer(parts: Parts) -> Iterator[Problem]:
    """A replica of several procs needs a binding that shards (capability `sharded`)."""
    trainer = parts.roles.get("trainer")
    if not isinstance(trainer, TrainerSpec) or trainer.procs_per_replica == 1:
        return
    where = ("roles", "trainer", "procs_per_replica")
    caps = trainer.resolved.capabilities
    if SHARDED_CAPABILITY not in caps:
        yield (where, f"procs_per_replica = {trainer.procs_per_replica}: trainer binding {trainer.binding!r} trains a "
                      f"replica on one proc (its capabilities are {sorted(caps) or 'none'}, a sharded replica needs "
                      f"{SHARDED_CAPABILITY!r}); use 1, or the hf binding")


def check_lora(parts: Parts) -> Iterator[Problem]:
    """LoRA trains without DiLoCo, and adapter-only sync needs generators that apply adapters of its rank."""
    trainer = parts.roles.get("trainer")
    lora = getattr(trainer.settings, "lora", None) if isinstance(trainer, TrainerSpec) else None
    if lora is None:
        return
    if parts.sections.get("diloco") is not None:
        yield (
            ("roles", "trainer", "settings", "lora"),
            "lora cannot be combined with diloco (DiLoCo would synchronise and checkpoint the whole frozen model, "
            "not the adapters); remove one of them",
        )
    generators = parts.roles.get("generators")
    if getattr(lora, "sync", None) == "adapter" and isinstance(generators, GeneratorsSpec):
        yield from _adapter_generators(lora, generators)


def _adapter_generators(lora: Any, generators: GeneratorsSpec) -> Iterator[Problem]:
    """`lora.sync: adapter`: the generator binding applies adapters (capability `adapters`) of rank `lora.r`
    (a binding's settings model may declare `max_adapter_rank`: vLLM serves 512 at most)."""
    caps = generators.resolved.capabilities
    if ADAPTERS_CAPABILITY not in caps:
        yield (
            ("roles", "trainer", "settings", "lora", "sync"),
            f"lora.sync: adapter publishes only the adapter tensors, but generator binding "
            f"{generators.binding!r} cannot apply adapters (its capabilities are {sorted(caps) or 'none'}, it "
            f"needs {ADAPTERS_CAPABILITY!r}); use lora.sync: merged",
        )
        return
    limit = getattr(generators.resolved.settings_model, "max_adapter_rank", None)
    if limit is not None and lora.r > limit:
        yield (
            ("roles", "trainer", "settings", "lora", "r"),
            f"lora.r = {lora.r} with lora.sync: adapter, but generator binding {generators.binding!r} serves "
            f"adapters of rank {limit} at most; use r <= {limit}, or lora.sync: merged",
        )


def check_on_nonfinite(parts: Parts) -> Iterator[Problem]:
    """Skipping a non-finite step cannot work with DiLoCo: the replica's inner steps would fall out of the
    others' rounds."""
    if getattr(parts.sections.get("run"), "on_nonfinite", None) == "skip" and parts.sections.get("diloco") is not None:
        yield (("run", "on_nonfinite"), "run.on_nonfinite: skip cannot be combined with diloco (a replica that "
                                        "skips a step would leave its rounds' cadence); use stop")


# What chooses a data set's held-out rows (`tasks/data.py`: a hash of each prompt over the rows read).
_HELD_OUT_FIELDS = ("path", "hub", "hub_config", "format", "split", "prompt", "messages", "eval_path", "eval_split",
                    "eval_fraction", "eval_size")


def check_warmstart_held_out(parts: Parts) -> Iterator[Problem]:
    """A warm start on `run.data`'s own source must not train on the run's held-out rows: it holds out the same."""
    run, model = parts.sections.get("run"), parts.sections.get("model")
    data = getattr(run, "data", None)
    warm = getattr(getattr(model, "warmstart", None), "data", None)
    if data is None or warm is None or (data.path, data.hub, data.split) != (warm.path, warm.hub, warm.split):
        return
    for name in _HELD_OUT_FIELDS:
        if getattr(warm, name) != getattr(data, name):
            yield (("model", "warmstart", "data", name),
                   f"model.warmstart.data reads run.data's rows but its {name} differs from run.data's: it would "
                   "hold out other rows, and the warm start could train on the run's held-out prompts; give it "
                   f"run.data's {name}")


CHECKS: tuple[Callable[[Parts], Iterator[Problem]], ...] = (
    check_meshes_used,
    check_gpu_meshes,
    check_teacher_channels,
    check_loss_channels_fed,
    check_hints,
    check_rewarder_role,
    check_backend_meshes,
    check_local_gpus,
    check_diloco_replicas,
    check_replicas_fit_mesh,
    check_sharded_trainer,
    check_lora,
    check_on_nonfinite,
    check_warmstart_held_out,
)


def cross_check(data: Any) -> list[Problem]:
    """Problems between the sections of a file's data: (field loc, message), in the order of `CHECKS`."""
    parts = parts_of(data)
    return [problem for check in CHECKS for problem in check(parts)]
