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

from checkpointing.config import VERIFY_MODES
from checkpointing.errors import CheckpointError
from checkpointing.generations import (
    delete_generation,
    generation_problems,
    list_generations,
    prune_plan,
    read_pointer,
)
from checkpointing.weights import checkpoints_dir_of


def _pointer_or_error(directory: Path) -> tuple[str | None, str | None]:
    try:
        return read_pointer(directory), None
    except CheckpointError as e:
        return None, str(e)


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
                "files": {
                    name: (directory / name).stat().st_size for name in g.files if (directory / name).exists()
                },
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
    print(f"{'':2}{'marker':<22}{'iteration':>11}{'files':>7}{'MB':>10}  status")
    for g in report["generations"]:
        flag = "->" if g["latest"] else ""
        status = "valid" if g["valid"] else "INVALID: " + "; ".join(g["problems"])
        if g["pinned"]:
            status += " (pinned)"
        if not g["has_manifest"] and g["valid"]:
            status += " (no manifest: seed layout)"
        megabytes = sum(g["files"].values()) / 1e6
        iteration = "?" if g["iteration"] is None else g["iteration"]
        print(f"{flag:<2}{g['marker']:<22}{iteration:>11}{len(g['files']):>7}{megabytes:>10.2f}  {status}")


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

    if not args.dir.is_dir():
        print(f"error: {args.dir} is not a directory", file=sys.stderr)
        return 2
    try:
        directory = checkpoints_dir_of(args.dir)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.command == "inspect":
        report = inspect(directory, args.verify)
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            _print_table(report)
        return 0

    if args.command == "verify":
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

    if args.keep < 1:
        print(f"error: --keep must be >= 1, got {args.keep}", file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    sys.exit(main())
