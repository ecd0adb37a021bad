"""What reading uploads in a bounded worker process costs an ordinary upload (`lidar.sandbox`).

The app reads, unzips and registers every upload in a worker process; the server keeps spare workers
started, so a read pays the hand-over (a task folder, a pipe, the arrays written and loaded as .npy), not an
interpreter's start. Timed in the same run, alternating, for the shipped example scans and (when the shared
real scans are there) three KITTI sweeps registered:
- the read in the server's process (`lidar.formats.read_points`, or `read_sequence` + `register_sweeps`);
- the same read in a spare worker under the server's limits, as the app does it;
- the same read in a worker started for it (what a command line pays: no spares);
- the whole app request (`app.forecast_from_scan` / `forecast_from_scans` with the tab's defaults: read,
  check, forecast, pictures and downloads) with its read in a worker.
The added latency is the spare worker's read less the in-process one; its share of the request is the
figure the app's budget (at most 10 %) is about.

    python -m bench.worker_bench [--model SRC] [--frames 6] [--steps 4] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import app
from lidar import sandbox
from lidar.formats import point_limit, read_points
from lidar.real_scans import real_scans_dir
from lidar.registration import register_sweeps
from lidar.sequence import read_sequence

#: Seconds between timed reads, so the spare started in place of the last one has finished its imports (a
#: server's visitors come seconds apart: one generation runs at a time).
SPARE_WARM_S = 1.5


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def request(paths: list[Path], frames: int, steps: int) -> Callable[[], None]:
    """The app's request for `paths`, run to its last output (the scratch folder goes when it closes)."""
    if len(paths) == 1:
        return lambda: list(app.forecast_from_scan(str(paths[0]), app.AUTO_SENSOR, "Straight", frames, steps, 0))
    return lambda: list(app.forecast_from_scans([str(p) for p in paths], "Straight", frames, steps, 0))


def reads(paths: list[Path]) -> tuple[Callable[[], object], Callable[[], object]]:
    """The upload's read in this process and in a worker, as the app reads it."""
    if len(paths) == 1:
        return lambda: read_points(paths[0]), lambda: sandbox.read_points(paths[0])

    def here() -> None:
        seq = read_sequence(paths)
        register_sweeps(seq.scans, names=seq.names)

    return here, lambda: sandbox.read_sequence(paths, register=None)


def uploads() -> dict[str, list[Path]]:
    shipped = sorted(app.EXAMPLE_SCANS_DIR.glob("*.bin")) + sorted(app.EXAMPLE_SCANS_DIR.glob("*.pcd"))
    cases = {path.name.split("_")[0] + path.suffix: [path] for path in shipped}
    kitti = [real_scans_dir() / f"kitti_patchworkpp_{i:06d}.bin" for i in (0, 2, 4)]
    if all(p.is_file() for p in kitti):
        cases["3 KITTI sweeps, registered"] = kitti
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model source for app.load_model (default: weights/default)")
    parser.add_argument("--frames", type=int, default=6, help="the forecast tab's default")
    parser.add_argument("--steps", type=int, default=4, help="the forecast tab's default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    app.load_model(args.model)
    cases = uploads()
    with point_limit(app.MAX_UPLOAD_POINTS):
        for paths in cases.values():  # warm-up: imports, caches, the first forecast
            request(paths, 1, 1)()
        times: dict[str, dict[str, list[float]]] = {name: {} for name in cases}
        for _ in range(args.repeats):
            for name, paths in cases.items():
                here, there = reads(paths)
                row = times[name]
                row.setdefault("here", []).append(timed(here))
                sandbox.configure(sandbox.SERVER_LIMITS, spares=0)
                row.setdefault("cold", []).append(timed(there))
                sandbox.configure(sandbox.SERVER_LIMITS, spares=app.WORKER_SPARES)
                time.sleep(SPARE_WARM_S)
                row.setdefault("spare", []).append(timed(there))
                time.sleep(SPARE_WARM_S)
                row.setdefault("request", []).append(timed(request(paths, args.frames, args.steps)))
    sandbox.pool().close()
    print(f"{app.SOURCE_LABEL}, {args.frames} frames x {args.steps} steps per request, {args.threads} thread(s), "
          f"median of {args.repeats} alternating runs\n")
    print("| upload | read in the server s | in a spare worker s | in a fresh worker s | added s | "
          "whole request s | added ÷ request |")
    print("|---|---|---|---|---|---|---|")
    for name, row in times.items():
        med = {key: statistics.median(values) for key, values in row.items()}
        added = med["spare"] - med["here"]
        print(f"| {name} | {med['here']:.3f} | {med['spare']:.3f} | {med['cold']:.3f} | {added:+.3f} | "
              f"{med['request']:.2f} | {100 * added / med['request']:.1f} % |")


if __name__ == "__main__":
    main()
