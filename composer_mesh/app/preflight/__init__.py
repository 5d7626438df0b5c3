"""Everything knowable about a run before anything is launched, checked in seconds: `composer-mesh validate`
runs it after the schema, `composer-mesh run` before the first mesh starts.

- `setup.py`: environment variables the topology names (API keys, storage credentials), `python_path:`
  directories, import paths and task names;
- `models.py`: the models' tokenizers, heads and context, read from their files (no weights);
- `prompts.py`: the prompt source (`run.task`, every row of `run.data`, the `run.environment` dataset) and the
  policy's tokenizer reading a sample of the prompts;
- `sandbox.py`: the coding environment's sandbox runs here (bubblewrap, its paths, its interpreter);
- `rewards.py`: each reward function called once on a sample prompt (in a worker, with its timeout);
- `resume.py`: the checkpoint to resume from, every trainer replica's state included.

Why: each of these otherwise fails after the meshes launched (20-30 s), inside an actor, as a remote traceback
that reads like a bug. Here each is a `UserInputError` (one line per problem, naming the field or file and the
fix) and the command line exits 1.
"""

from __future__ import annotations

from composer_mesh.app.preflight.errors import PreflightError
from composer_mesh.app.preflight.models import ModelPreflightError, check_models
from composer_mesh.app.preflight.prompts import check_prompts
from composer_mesh.app.preflight.resume import check_resume
from composer_mesh.app.preflight.rewards import RewardPreflightError, check_rewards
from composer_mesh.app.preflight.sandbox import check_sandbox
from composer_mesh.app.preflight.setup import setup_problems
from composer_mesh.orchestration.resume import ResumePoint
from composer_mesh.topology.schema import Topology

__all__ = [
    "ModelPreflightError", "PreflightError", "RewardPreflightError", "check_models", "check_rewards", "preflight",
]


def preflight(topology: Topology, resume: ResumePoint | None = None) -> list[str]:
    """Check `topology` (and the checkpoint `resume` continues from) for everything a launch would find; raise
    the first failing stage's `UserInputError` (PreflightError listing every setup problem, ModelPreflightError,
    DataError, ...) or RunCheckpointError. Returns one line per stage passed, for `validate` to print."""
    passed = []
    if resume is not None:
        check_resume(topology, resume)
        passed.append(f"resume: {resume.url} (controller and trainer states readable)")
    problems = setup_problems(topology)
    if len(problems) == 1:
        raise PreflightError(problems[0])
    if problems:
        raise PreflightError(f"{len(problems)} problems found before launch:\n  " + "\n  ".join(problems))
    passed.append("environment variables, python_path, import paths and tasks resolve")
    check_models(topology)
    passed.append("models: tokenizers, heads and context fit together")
    checked, sample = check_prompts(topology)
    passed.append(checked)
    if (sandbox := check_sandbox(topology)) is not None:
        passed.append(sandbox)
    check_rewards(topology, sample)
    passed.append("reward functions: each called once on a sample prompt" if topology.rewarder is not None
                  else "reward functions: none (no rewarder: run.environment scores the episodes)")
    return passed
