"""The `composer-mesh` command line.

Each subcommand is one `Command` entry in `COMMANDS`: its arguments and its handler (which returns the exit
code). Adding a subcommand is one function pair and one entry. Handlers import what they need lazily so
`composer-mesh validate` stays fast.

Exit codes: 0 ok, 1 invalid input (the errors are printed), 2 bad command-line usage (argparse).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


def _print_error(err: Exception) -> int:
    print(str(err), file=sys.stderr)
    return 1


# ---- validate ---------------------------------------------------------------------------------------------


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="topology YAML file")


def _validate(args: argparse.Namespace) -> int:
    from composer_mesh.topology import TopologyError, load_topology

    try:
        topology = load_topology(args.file)
    except TopologyError as e:
        return _print_error(e)
    print(f"ok: {args.file}: {topology.summary()}")
    return 0


# ---- plan -------------------------------------------------------------------------------------------------


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="topology YAML file")
    p.add_argument(
        "--prices",
        metavar="PRICES.yaml",
        help="price table (per backend: gpu_hour and optional cpu_proc_hour) to estimate the cost per hour",
    )


def _plan(args: argparse.Namespace) -> int:
    from composer_mesh.topology import TopologyError, load_topology
    from composer_mesh.topology.plan import load_prices, make_plan, render_plan

    errors: list[TopologyError] = []
    topology = prices = None
    try:
        topology = load_topology(args.file)
    except TopologyError as e:
        errors.append(e)
    if args.prices is not None:
        try:
            prices = load_prices(args.prices)
        except TopologyError as e:
            errors.append(e)
    if errors:
        for e in errors:
            _print_error(e)
        return 1
    assert topology is not None
    render_plan(make_plan(topology, prices))
    return 0


# ---- run --------------------------------------------------------------------------------------------------


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="topology YAML file")
    p.add_argument("--steps", type=_positive_int, help="override run.steps")
    p.add_argument("--run-dir", help="override run.run_dir (metrics.jsonl, plot.png, checkpoint/)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _run(args: argparse.Namespace) -> int:
    from composer_mesh.topology import TopologyError

    try:
        from composer_mesh.app.runner import main as run_main

        return run_main(args.file, steps=args.steps, run_dir=args.run_dir)
    except TopologyError as e:
        return _print_error(e)


COMMANDS: list[Command] = [
    Command(
        "validate",
        "check a topology file; print every error with its line, exit 1 if any",
        _validate_args,
        _validate,
    ),
    Command(
        "plan",
        "show which roles run on which meshes (and the cost per hour with --prices)",
        _plan_args,
        _plan,
    ),
    Command("run", "launch every mesh of a topology and run the built-in RL loop", _run_args, _run),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="composer-mesh",
        description="RL post-training of language models on Monarch actor meshes.",
        allow_abbrev=False,  # a misspelt flag is an error, not silently another flag
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, allow_abbrev=False)
        cmd.add_arguments(p)
        p.set_defaults(handler=cmd.handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `composer-mesh` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
