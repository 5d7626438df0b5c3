"""The `composer-mesh` command line.

Each subcommand is one `Command` entry in `COMMANDS`: its arguments and its handler (which returns the exit
code). Adding a subcommand is one function pair and one entry. Handlers import what they need lazily so
`composer-mesh validate` stays fast.

Failures: handlers let exceptions rise; `main` hands them to `report_failure`, the one place that maps the
expected ones (`failure_of`) to a message and an exit code, with no traceback unless `--debug` is given.
An unexpected exception (a bug) always prints its traceback: a failed run may have taken hours, and
asking to run it again with `--debug` to see what went wrong would cost as much again.

Exit codes: the `EXIT_*` constants below, documented in docs/launch.md ("The command line: exit codes
and --debug").
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from composer_mesh.topology.overrides import Override

EXIT_OK = 0
EXIT_INVALID = 1  # a topology / price file that is missing, unreadable, not UTF-8, not YAML or not valid
EXIT_USAGE = 2  # bad command-line usage (argparse's own code)
EXIT_RUN_FAILED = 3  # launching failed, an actor or proc died, or a file of the run could not be written
EXIT_BUG = 70  # an unexpected exception (EX_SOFTWARE of sysexits.h); its traceback is printed
EXIT_PREEMPTED = 75  # a Slurm job of the run was warned of its end, preempted or timed out: the run stopped with a
# checkpoint (EX_TEMPFAIL: run it again with --resume)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_TERMINATED = 143  # SIGTERM during `run` (128 + SIGTERM): the run stops with a checkpoint, a second one at once
_STOP_EXIT = {"SIGINT": EXIT_INTERRUPTED, "SIGTERM": EXIT_TERMINATED, "slurm": EXIT_PREEMPTED,
              "failure": EXIT_RUN_FAILED}

_DEBUG_HINT = "(run with --debug for the traceback)"
_MESH_DEBUG_HINT = "(run with --debug for the traceback and Monarch's failure reports)"


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


def failure_of(exc: BaseException) -> tuple[int, str] | None:
    """The exit code and message of an expected failure, or None if `exc` is unexpected (a bug)."""
    import asyncio

    from composer_mesh.actors.teacher_errors import TeacherFailed
    from composer_mesh.errors import user_error_of
    from composer_mesh.mesh.launch import LaunchError, MeshFailureError
    from composer_mesh.orchestration.checkpoint import RunCheckpointError
    from composer_mesh.orchestration.reward_health import RewardsFailing
    from composer_mesh.topology.yaml_errors import TopologyError

    if isinstance(exc, TopologyError):  # every problem with its file:line:column
        return EXIT_INVALID, str(exc)
    user = user_error_of(exc)
    if user is not None:  # bad input (data, prompts, env vars, a checkpoint): its one line, before launch or in an actor
        error, remote = user
        return (EXIT_RUN_FAILED, f"composer-mesh: run failed: {error}") if remote else \
            (EXIT_INVALID, f"composer-mesh: {error}")
    if isinstance(exc, TeacherFailed):  # a teacher with `on_failure: stop` was unavailable
        return EXIT_RUN_FAILED, f"composer-mesh: run stopped: {exc}"
    if isinstance(exc, RewardsFailing):  # every rollout's reward failed in too many steps in a row
        return EXIT_RUN_FAILED, f"composer-mesh: run stopped: {exc}"
    if isinstance(exc, RunCheckpointError):  # a checkpoint that is missing, half-written, corrupted or foreign
        return EXIT_INVALID, f"composer-mesh: cannot resume: {exc}"
    if isinstance(exc, MeshFailureError):
        gist = str(exc).removesuffix(" (Monarch's full reports are in .failures)")
        return EXIT_RUN_FAILED, f"composer-mesh: run failed: {gist}\n{_MESH_DEBUG_HINT}"
    if isinstance(exc, LaunchError):
        return EXIT_RUN_FAILED, f"composer-mesh: launch failed: {exc}\n{_DEBUG_HINT}"
    if isinstance(exc, OSError) and exc.filename is not None:
        where = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
        return EXIT_RUN_FAILED, f"composer-mesh: run failed: {where}: {exc.strerror or exc}\n{_DEBUG_HINT}"
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "composer-mesh: interrupted"
    if isinstance(exc, asyncio.CancelledError):
        return EXIT_TERMINATED, "composer-mesh: stopped (the run was cancelled, e.g. by SIGTERM)"
    return None


def report_failure(exc: BaseException, debug: bool = False) -> int:
    """Print what went wrong (the traceback too with `debug`, or when `exc` is unexpected); the exit code."""
    known = failure_of(exc)
    if known is None:
        traceback.print_exception(exc, file=sys.stderr)
        print(
            f"composer-mesh: unexpected error ({type(exc).__name__}); if your code or setup did not cause it, "
            "it is a bug: please report it with the traceback above",
            file=sys.stderr,
        )
        return EXIT_BUG
    code, message = known
    notes = [n for n in getattr(exc, "__notes__", ()) if isinstance(n, str)]
    if not debug:
        print("\n".join([message, *notes]), file=sys.stderr)
        return code
    from composer_mesh.mesh.launch import MeshFailureError

    traceback.print_exception(exc, file=sys.stderr)
    for failure in exc.failures if isinstance(exc, MeshFailureError) else ():  # Monarch's report of each
        print(
            f"--- Monarch failure report: {failure.actor or '(procs)'} on mesh {failure.mesh!r} ---",
            file=sys.stderr,
        )
        print(failure.report.rstrip(), file=sys.stderr)
    return code


# ---- --set (validate, plan, run, eval) ---------------------------------------------------------------------


def _add_set_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set", action="append", type=_override, default=[], metavar="KEY=VALUE", dest="set",
        help="override a topology field, e.g. --set run.steps=20 --set model.warmstart=null (repeatable; the "
        "value is YAML: 3, true, null, [a, b], {x: 1}); validated like the file, errors name the --set key",
    )


def _override(text: str) -> Override:
    from composer_mesh.topology.overrides import Override, OverrideSyntaxError

    try:
        return Override.parse(text)
    except OverrideSyntaxError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---- validate ---------------------------------------------------------------------------------------------


def _python_path_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--python-path", action="append", default=[], metavar="DIR",
        help="a directory holding your own modules (reward functions, tasks, bindings): put first on sys.path and "
        "on every proc's PYTHONPATH (repeatable; the topology's python_path: does the same)",
    )


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="topology YAML file")
    _add_set_argument(p)
    _python_path_arg(p)
    p.add_argument(
        "--schema-only", action="store_true",
        help="check the file alone, not what it names (env vars, modules, data, tokenizer: what `run` checks "
        "before launch)",
    )


def _validate(args: argparse.Namespace) -> int:
    from composer_mesh.topology import load_topology

    topology = load_topology(args.file, args.set)
    checked: list[str] = []
    if not args.schema_only:  # what `run` checks before launch, so that `ok` means the run will start
        from composer_mesh.app.preflight import preflight

        checked = preflight(topology)
    print(f"ok: {args.file}: {topology.summary()}")
    for line in checked:
        print(f"  checked: {line}")
    return EXIT_OK


# ---- plan -------------------------------------------------------------------------------------------------


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="topology YAML file")
    _add_set_argument(p)
    _python_path_arg(p)
    p.add_argument(
        "--prices",
        metavar="PRICES.yaml",
        help="price table (per backend: gpu_hour and optional cpu_proc_hour; e.g. examples/prices.yaml) to "
        "estimate the cost per hour and per run",
    )
    p.add_argument(
        "--hours", type=_plan_hours, metavar="H",
        help="the run's expected length in hours, for the cost per run (default: each Slurm job's time limit, an "
        "upper bound)",
    )


def _plan(args: argparse.Namespace) -> int:
    from composer_mesh.topology import TopologyError, load_topology
    from composer_mesh.topology.plan import load_prices, make_plan, render_plan

    errors: list[TopologyError] = []
    topology = prices = None
    try:
        topology = load_topology(args.file, args.set)
    except TopologyError as e:
        errors.append(e)
    if args.prices is not None:
        try:
            prices = load_prices(args.prices)
        except TopologyError as e:
            errors.append(e)
    if errors:  # both files' errors, not only the first file's
        return max(report_failure(e, debug=args.debug) for e in errors)
    assert topology is not None
    render_plan(make_plan(topology, prices, hours=args.hours))
    return EXIT_OK


# ---- run --------------------------------------------------------------------------------------------------


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="topology YAML file")
    _add_set_argument(p)
    _python_path_arg(p)
    p.add_argument("--steps", type=_positive_int, help="override run.steps")
    p.add_argument("--run-dir", help="override run.run_dir (metrics.jsonl, plot.png, checkpoint/)")
    p.add_argument(
        "--resume", nargs="?", const=True, default=False, metavar="PATH",
        help="continue from the newest full checkpoint of the run (run.checkpoint_url, default <run_dir>/checkpoints), "
        "or from PATH: a checkpoint, a checkpoints directory or a run directory",
    )


def _positive(cast: Callable[[str], float], what: str) -> Callable[[str], float]:
    """An argparse type: `text` as a finite number > 0 (`what` names it in the error)."""

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


_positive_int = _positive(int, "a positive integer")
_plan_hours = _positive(float, "a positive number of hours")


def _run(args: argparse.Namespace) -> int:
    from composer_mesh.app.runner import main as run_main

    resume = f"resume with: composer-mesh run {args.file}{f' --run-dir {args.run_dir}' if args.run_dir else ''} --resume"
    resume += " and the same --set options" if args.set else ""  # not repeated: a value may be a secret
    try:
        summary, cause = run_main(args.file, steps=args.steps, run_dir=args.run_dir, resume=args.resume,
                                  overrides=args.set)
    except Exception as e:  # a failed run that left a checkpoint says how to continue, after its message
        checkpoint = getattr(e, "checkpoint", None)
        if checkpoint is not None:
            e.add_note(f"the last full checkpoint is {checkpoint}\n{resume}")
        raise
    if cause is None:
        return EXIT_OK
    print(f"composer-mesh: stopped ({summary.stopped}); the full checkpoint is {summary.checkpoint}\n{resume}",
          file=sys.stderr)
    return _STOP_EXIT.get(cause, EXIT_RUN_FAILED)


# ---- eval -------------------------------------------------------------------------------------------------


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="topology YAML file (its held-out set, sampling, rewards and meshes)")
    p.add_argument(
        "--checkpoint", metavar="PATH",
        help="what to score: a model directory (a run's final checkpoint/, any save_pretrained directory), or a "
        "full run checkpoint as --resume takes it (a step directory, a checkpoints directory or a run directory: "
        "its newest); default: the topology's initial policy",
    )
    p.add_argument("--output", metavar="FILE", help="append the JSON line to FILE instead of printing it on stdout")
    _add_set_argument(p)
    _python_path_arg(p)


def _eval(args: argparse.Namespace) -> int:
    from composer_mesh.app.evaluate import NothingToEvaluate
    from composer_mesh.app.evaluate import main as eval_main
    from composer_mesh.orchestration.checkpoint import RunCheckpointError

    try:
        eval_main(args.file, args.checkpoint, args.set, args.output)
    except RunCheckpointError as e:  # not "cannot resume", as failure_of says it for `run`
        print(f"composer-mesh: cannot evaluate --checkpoint {args.checkpoint}: {e}", file=sys.stderr)
        return EXIT_INVALID
    except NothingToEvaluate as e:
        print(f"composer-mesh: {args.file}: {e}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


COMMANDS: list[Command] = [
    Command(
        "validate",
        "check a topology file; print every error with its line, exit 1 if any",
        _validate_args,
        _validate,
    ),
    Command(
        "plan",
        "show what a topology trains and which roles run on which meshes (and the cost with --prices)",
        _plan_args,
        _plan,
    ),
    Command("run", "launch every mesh of a topology and run the built-in RL loop", _run_args, _run),
    Command("eval", "score a checkpoint (or the initial policy) on the held-out set, greedy and pass@k, without "
            "training", _eval_args, _eval),
]


_DEBUG_HELP = "on a failure, print the Python traceback (and Monarch's failure reports) instead of a message"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="composer-mesh",
        description="RL post-training of language models on Monarch actor meshes.",
        allow_abbrev=False,  # a misspelt flag is an error, not silently another flag
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, allow_abbrev=False)
        # Also after the subcommand; SUPPRESS keeps a `--debug` given before it.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
        cmd.add_arguments(p)
        p.set_defaults(handler=cmd.handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `composer-mesh` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    if getattr(args, "python_path", None):
        from composer_mesh.topology.load import add_python_path

        add_python_path(args.python_path)
    try:
        return int(args.handler(args))
    except SystemExit:
        raise
    except BaseException as exc:  # Ctrl-C and cancellation too: each gets its message and exit code
        return report_failure(exc, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
