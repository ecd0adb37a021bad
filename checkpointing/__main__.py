"""Command line: look at, check and prune a checkpoints directory without writing Python.

    python -m checkpointing inspect DIR [--json] [--verify size|sha256|none]
    python -m checkpointing verify DIR [--verify sha256|size|none]   # exit 0 iff the pointer's generation is valid
    python -m checkpointing prune DIR --keep N [--yes]                # dry run unless --yes

DIR is a job directory or its checkpoints/ directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from checkpointing import layout
from checkpointing.config import VERIFY_MODES
from checkpointing.errors import CheckpointError
from checkpointing.generations import (
    delete_generation,
    generation_problems,
    list_generations,
    prune_plan,
    read_pointer,
)
from checkpointing.trust import member_problem
from checkpointing.weights import checkpoints_dir_of


def _pointer_or_error(directory: Path) -> tuple[str | None, str | None]:
    try:
        return read_pointer(directory), None
    except CheckpointError as e:
        return None, str(e)


def _member_size(directory: Path, name: str) -> int | None:
    """A listed file's size, only for a regular file inside the folder (a link out is never followed)."""
    if member_problem(directory, name) is not None:
        return None
    return (directory / name).stat().st_size


def inspect(directory: Path, verify: str) -> dict:
    """Every generation with its files, sizes, validity and whether the pointer names it."""
    pointer, pointer_error = _pointer_or_error(directory)
    generations = []
    for g in list_generations(directory):
        problems = generation_problems(directory, g, verify)
        generations.append(
            {
                "marker": g.marker,
                "iteration": g.iteration,
                "latest": g.marker == pointer,
                "valid": not problems,
                "problems": problems,
                "pinned": g.pinned,
                "has_manifest": g.manifest is not None,
                "layout": g.manifest.state_layout if g.manifest is not None else layout.FULL,
                "files": {name: size for name in g.files if (size := _member_size(directory, name)) is not None},
            }
        )
    return {
        "directory": str(directory),
        "pointer": pointer,
        "pointer_error": pointer_error,
        "verify": verify,
        "generations": generations,
    }


def _print_table(report: dict) -> None:
    print(f"{report['directory']}  (verify={report['verify']})")
    if report["pointer_error"]:
        print(f"POINTER INVALID: {report['pointer_error']}")
    elif report["pointer"] is None:
        print("no latest_checkpoint.txt")
    print(f"{'':2}{'marker':<22}{'iteration':>11}{'layout':>9}{'files':>7}{'MB':>10}  status")
    for g in report["generations"]:
        flag = "->" if g["latest"] else ""
        status = "valid" if g["valid"] else "INVALID: " + "; ".join(g["problems"])
        if g["pinned"]:
            status += " (pinned)"
        if not g["has_manifest"] and g["valid"]:
            status += " (no manifest: seed layout)"
        megabytes = sum(g["files"].values()) / 1e6
        iteration = "?" if g["iteration"] is None else g["iteration"]
        print(
            f"{flag:<2}{g['marker']:<22}{iteration:>11}{g['layout']:>9}{len(g['files']):>7}{megabytes:>10.2f}  {status}"
        )


def _inspect_command(directory: Path, args: argparse.Namespace) -> int:
    report = inspect(directory, args.verify)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_table(report)
    return 0


def _verify_command(directory: Path, args: argparse.Namespace) -> int:
    pointer, pointer_error = _pointer_or_error(directory)
    if pointer_error or pointer is None:
        print(f"INVALID: {pointer_error or f'no latest_checkpoint.txt in {directory}'}")
        return 1
    generation = next((g for g in list_generations(directory) if g.marker == pointer), None)
    problems = (
        [f"{pointer} does not exist"]
        if generation is None
        else generation_problems(directory, generation, args.verify)
    )
    if problems:
        print(f"INVALID: {pointer}: " + "; ".join(problems))
        return 1
    print(f"OK: {pointer} (iteration {generation.iteration}) verified with {args.verify}")
    return 0


def _prune_command(directory: Path, args: argparse.Namespace) -> int:
    """Deletes only when every record it decides on is readable: a bad pointer or a malformed manifest
    is reported (exit 2) and nothing is deleted, since either could make a kept generation look prunable."""
    if args.keep < 1:
        raise CheckpointError(f"--keep must be >= 1, got {args.keep}")
    read_pointer(directory)  # raises for a bad pointer
    unreadable = [g.manifest_error for g in list_generations(directory) if g.manifest_error]
    if unreadable:
        raise CheckpointError(f"{unreadable[0]}; nothing was pruned (fix or remove that generation by hand)")
    plan = prune_plan(directory, args.keep, verify=args.verify)
    for generation in plan:
        if args.yes:
            delete_generation(directory, generation)
        print(
            f"{'deleted' if args.yes else 'would delete'} {generation.marker} ({len(generation.files)} files)"
        )
    if not plan:
        print("nothing to prune")
    elif not args.yes:
        print("dry run: pass --yes to delete")
    return 0


_COMMANDS = {"inspect": _inspect_command, "verify": _verify_command, "prune": _prune_command}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpointing", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="list generations, sizes and validity")
    p_inspect.add_argument("dir", type=Path)
    p_inspect.add_argument("--json", action="store_true", help="machine-readable output")
    p_inspect.add_argument("--verify", choices=VERIFY_MODES, default="size")
    p_verify = sub.add_parser("verify", help="exit 0 only if the pointer's generation is valid")
    p_verify.add_argument("dir", type=Path)
    p_verify.add_argument("--verify", choices=VERIFY_MODES, default="sha256")
    p_prune = sub.add_parser("prune", help="delete old generations (dry run unless --yes)")
    p_prune.add_argument("dir", type=Path)
    p_prune.add_argument("--keep", type=int, required=True, help="numbered generations to keep (>= 1)")
    p_prune.add_argument("--yes", action="store_true", help="really delete")
    p_prune.add_argument(
        "--verify", choices=VERIFY_MODES, default="sha256", help="what counts as a valid generation"
    )
    args = parser.parse_args(argv)
    try:
        if not args.dir.is_dir():
            raise CheckpointError(f"{args.dir} is not a directory")
        directory = checkpoints_dir_of(args.dir)
        return _COMMANDS[args.command](directory, args)
    except (CheckpointError, OSError) as e:  # bad input: one line, exit 2; a bug keeps its traceback
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
