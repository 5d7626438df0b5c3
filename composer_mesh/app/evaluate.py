"""`composer-mesh eval`: score a policy on the run's held-out set (greedy reward and pass@k), without training.

The numbers are the run's own: the same `Evaluator` the loop uses (`orchestration/evaluation.py`) on the same
held-out prompts, seeds, sampling settings and reward functions, so `eval` of a run's checkpoint reproduces the
`eval` event that run wrote at that step (metrics.jsonl).

What is scored (`EvalTarget.of`): the topology's initial policy (no `--checkpoint`); a model directory written
by `save_pretrained` (a run's final `checkpoint/`, or any): the generators load it as `model.source`; or a full
run checkpoint (what `run --resume` accepts: a step directory, a checkpoints directory or a run directory, the
newest committed one): the trainer binding reads its state (the one reader of that format, LoRA and DiLoCo
states included) and publishes its weights to the generators.

Only what that needs is launched: the generators and the rewarder (a multi-turn run has none: its environment
scores the episodes), plus the trainer for a run checkpoint; never the teachers (evaluation asks them nothing).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from composer_mesh.app.launch import role_placements, run_config
from composer_mesh.app.preflight import check_models
from composer_mesh.mesh.launch import launch_meshes
from composer_mesh.orchestration.checkpoint import (
    RunCheckpointError,
    check_fingerprint,
    find_checkpoint,
    read_checkpoint,
)
from composer_mesh.orchestration.evaluation import EvalConfig, Evaluation, Evaluator
from composer_mesh.orchestration.mesh_ports import MeshRoles
from composer_mesh.orchestration.prompts import prompt_source
from composer_mesh.orchestration.replicas import replica_handles, setup_args
from composer_mesh.orchestration.resume import last_line
from composer_mesh.orchestration.rollout.base import RolloutServices
from composer_mesh.orchestration.rollout.choose import rollout_factory
from composer_mesh.orchestration.scoring import Scoring, ScoringConfig
from composer_mesh.roles import RoleMesh
from composer_mesh.topology import Topology, load_topology
from composer_mesh.topology.overrides import Override


class NothingToEvaluate(ValueError):
    """`run.eval_prompts` is 0: the held-out set is empty."""


@dataclass(frozen=True)
class EvalTarget:
    """What `--checkpoint PATH` names: `kind` is "initial" (no path), "model" (a save_pretrained directory) or
    "run" (a committed run checkpoint at `url`, of step `step`)."""

    kind: str
    path: str | None = None
    url: str | None = None
    step: int | None = None

    @classmethod
    def of(cls, path: str | None) -> EvalTarget:
        """Decided before anything is launched; a path that is neither is a RunCheckpointError naming it."""
        if path is None:
            return cls("initial")
        if (Path(path) / "config.json").is_file():
            return cls("model", path=str(Path(path).resolve()), step=_trained_steps(Path(path)))
        url = find_checkpoint(path)
        return cls("run", path=path, url=url, step=read_checkpoint(url).step)

    def overrides(self) -> list[Override]:
        """A model directory is the policy: its weights as they are (no warm start on top), its own tokenizer."""
        if self.kind != "model":
            return []
        return [Override("model.source", self.path), Override("model.warmstart", None),
                Override("model.tokenizer", "char")]


def _trained_steps(directory: Path) -> int | None:
    """The optimizer step a run's final `checkpoint/` was saved at (its trainer_state.json), if it says."""
    try:
        step = json.loads((directory / "trainer_state.json").read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


@dataclass(frozen=True)
class EvalReport:
    """One evaluation, as the JSON line `eval` writes."""

    topology: str
    checkpoint: str | None
    kind: str
    step: int | None
    prompts: int
    greedy: float
    pass_at_k: float | None
    k: int
    weight_version: int

    def json_line(self) -> str:
        def clean(v: Any) -> Any:
            return None if isinstance(v, float) and math.isnan(v) else v

        return json.dumps({k: clean(v) for k, v in asdict(self).items()})


def eval_roles(target: EvalTarget, topology: Topology) -> list[str]:
    """The roles an evaluation launches: the generators, the rewarder when the topology has one (a multi-turn
    run's environment scores its episodes), the trainer when it must load a run checkpoint's state."""
    rewarder = ["rewarder"] if topology.rewarder is not None else []
    return ["generators", *rewarder, *(["trainer"] if target.kind == "run" else [])]


@asynccontextmanager
async def launch_roles(topology: Topology, roles: Sequence[str]) -> AsyncIterator[RoleMesh]:
    """Only `roles` of the topology, on only the meshes they use (a teachers' GPU mesh is not started)."""
    placements = [p for p in role_placements(topology) if p.name in roles]
    meshes = {name: spec for name, spec in topology.meshes.items() if any(p.mesh == name for p in placements)}
    async with launch_meshes(meshes, placements, run_name=topology.name) as launched:
        yield RoleMesh(launched, topology.name, topology.roles.trainer.procs_per_replica)


async def _load_run_weights(mesh: RoleMesh, roles: MeshRoles, url: str) -> None:
    """The trainer replicas load the checkpoint's state (as on resume) and the generators pull replica 0's."""
    trainers = replica_handles(mesh.procs("trainer"), mesh.procs_per_replica)  # a sharded replica as one handle
    args = await asyncio.gather(*(setup_args(t) for t in trainers))
    await asyncio.gather(*(t.setup.call_one(*a) for t, a in zip(trainers, args, strict=True)))
    try:
        manifests = await asyncio.gather(*(t.load_state.call_one(f"{url}/trainer/r{i}") for i, t in enumerate(trainers)))
    except Exception as e:  # the replica's refusal arrives wrapped in Monarch's ActorError
        raise RunCheckpointError(f"a trainer replica could not load its state: {last_line(e)}") from e
    await roles.generators.load_weights(manifests[0])


async def evaluate_target(topology: Topology, target: EvalTarget) -> Evaluation:
    """Launch what `target` needs, set it up, evaluate `run.eval_prompts` held-out prompts once."""
    prompts = prompt_source(topology.run)
    try:
        async with launch_roles(topology, eval_roles(target, topology)) as mesh:
            roles = MeshRoles(mesh, 0, lambda meshes: None)
            await roles.generators.setup()
            if target.url is not None:
                await _load_run_weights(mesh, roles, target.url)
            scoring = Scoring(ScoringConfig.of(topology.run, topology.loss), roles.rewarder, None)
            services = RolloutServices(roles.generators, scoring, asyncio.ensure_future, lambda reason: None)
            driver = rollout_factory(run_config(topology), prompts)(services)
            evaluator = Evaluator(EvalConfig.of(topology.run), driver.evaluate, prompts.eval_prompts, lambda: 0,
                                  asyncio.ensure_future)
            return await evaluator.evaluate(topology.run.eval_prompts, topology.run.seed)
    finally:
        prompts.close()


def _print_table(report: EvalReport, console: Console) -> None:
    what = {"initial": "initial policy", "model": f"model {report.checkpoint}",
            "run": f"run checkpoint {report.checkpoint}"}[report.kind]
    what += f" (step {report.step})" if report.step is not None else ""
    table = Table(title=f"held-out eval of {what}", show_header=False)
    table.add_row("held-out prompts", str(report.prompts))
    table.add_row("greedy reward (mean)", "-" if math.isnan(report.greedy) else f"{report.greedy:.3f}")
    table.add_row(f"pass@{report.k} (any of {report.k} samples scores 1)",
                  "-" if report.pass_at_k is None else f"{report.pass_at_k:.3f}")
    table.add_row("weight version", str(report.weight_version))
    console.print(table)


def main(path: str, checkpoint: str | None, overrides: Sequence[Override] = (), output: str | None = None) -> EvalReport:
    """`composer-mesh eval`: a table on stderr and one JSON line on stdout (or appended to `output`)."""
    target = EvalTarget.of(checkpoint)
    topology = load_topology(path, [*overrides, *target.overrides()])
    if topology.run.eval_prompts == 0:
        raise NothingToEvaluate("run.eval_prompts is 0: no held-out prompt to score (--set run.eval_prompts=N)")
    if target.url is not None:  # the checkpoint must be of this topology's model (the rest may differ: lr, eval size)
        saved = read_checkpoint(target.url).fingerprint
        check_fingerprint(target.url, {"model": saved.get("model")}, {"model": topology.training_fingerprint()["model"]})
    check_models(topology)
    result = asyncio.run(evaluate_target(topology, target))
    report = EvalReport(topology=path, checkpoint=target.url or target.path, kind=target.kind, step=target.step,
                        prompts=result.prompts, greedy=result.greedy, pass_at_k=result.pass_at_k,
                        k=result.k, weight_version=result.weight_version)
    _print_table(report, Console(stderr=True))
    if output is None:
        print(report.json_line(), flush=True)
    else:
        with open(output, "a", encoding="utf-8") as f:
            f.write(report.json_line() + "\n")
    return report
