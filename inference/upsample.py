"""Beam upsampling and completion: a sweep on a denser beam table, or with its missing rays filled, every
measured point kept exactly as it was.

A sweep brings its own geometry (`lidar.formats.sweep_geometry`: its measured beam table, its columns and each
point's beam). The target grid is that table with `factor - 1` beams put evenly between each two neighbouring
measured beams (same columns), or a given beam table (`sensor=`). Each measured beam lands on the target beam
nearest to it in elevation, and each point on its own beam's row there: by its ring, not by its elevation,
since an HDL-64E's upper lasers sit about 0.2 m above the optical centre and a return at 10 m reads 1.2 deg
higher than its beam, three rows of a 64-beam table. The rays to fill (`mask`) default to the target's new
beams; on the sweep's own table (a sweep with rays missing at random, a sector or a block of rows cut out)
to every silent ray.

What fills them (`method`):
- "edge-aware": between the nearest known rays above and below in the column, along the direction in which
  the two agree best (edge-based line averaging: a slanted edge is followed instead of cut across), and
  planar along that line: the inverse range of a plane seen along a vertical fan is `A cos(el) + B sin(el)`,
  so two returns on the road fix the road's range at every elevation between them, which a straight line in
  range does not (3 m off at 35 m between beams 1.6 deg apart).
- "learned": the edge-aware fill, corrected by a small network trained on sweeps with rings dropped
  (`inference.fill_network`): it sees the neighbourhood, so a depth edge the column cannot place is placed
  where the edge runs on in the columns around.
- "model": the world model re-simulates the sweep at its own pose on the target grid, conditioned on it
  as its cache (the measured rays on their own rows), and the fill rays take the network's sample.
- "linear" and "nearest": the baselines, linear in range between the known rays above and below, or the
  nearer of them.
A filled ray returns where the nearer of its known neighbours returns, for every method but "model", whose
return channel decides.

The result holds every input point first, bit for bit and in its order (those that share a target pixel too:
the grid holds one point per pixel, the measurement more), then one point per filled ray. A filled point
lies along its pixel's beam and column, moved by the offsets its neighbours' points show from theirs (the
laser's height above the optical centre near the car, the columns' uneven azimuth steps), so it sits where
that beam's return would.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inference.conditioning import CACHE_IMAGE, CACHE_MASK, decode_image, empty_condition, encode_image
from inference.fill_network import FILL_WEIGHTS_NAME, FillNetwork, learnt_from, refine
from inference.flow import FlowMatchSampler, guided_velocity
from inference.limits import LIBRARY_LIMITS, Limits
from inference.loader import Provenance
from inference.network import IMAGE_CHANNELS, WorldModel, to_encoded_image
from inference.rollout import Progress
from lidar.errors import InputError, shown
from lidar.formats import READ_SUFFIXES, Scan, SweepGeometry, sweep_geometry, write_points
from lidar.formats.detect import ROWS_FROM_PRESET
from lidar.formats.rings import MAX_BEAMS
from lidar.range_image import (
    RangeImage,
    azimuth_columns,
    column_neighbours,
    nearest_beam_rows,
    nearest_per_pixel,
    point_elevations,
    point_ranges,
)
from lidar.sensors import PRESETS, Sensor, get_sensor

logger = logging.getLogger(__name__)

#: New beams per measured gap when neither `factor` nor `sensor` is given: a 16-beam sensor made 61-beam.
DEFAULT_FACTOR = 4
#: Most beams per measured gap: a VLP-16 made as dense as a 128-beam sensor is 8.
MAX_FACTOR = 8
EDGE_AWARE, LEARNED, MODEL, LINEAR, NEAREST = "edge-aware", "learned", "model", "linear", "nearest"
METHODS = (EDGE_AWARE, LEARNED, MODEL, LINEAR, NEAREST)
#: The method name that leaves the choice to `default_method`, as no name does: a menu's first entry.
AUTO = "auto"
#: The fill when none is named and no fill network is at hand for the sweep (`default_method`).
DEFAULT_METHOD = EDGE_AWARE
#: Slopes the edge-aware fill tries: azimuth change per elevation change along the line through a filled ray
#: (1: a 45 deg edge in the range image), 0 the vertical.
SLOPES = np.linspace(-1.0, 1.0, 17)
#: Cost per unit of slope added to the disagreement (in log-range) of a direction: of directions that agree
#: about as well, the vertical wins.
SLOPE_PENALTY = 0.1
#: What `write_upsample` writes: the points file's stem and the record beside it, and the points file's formats
#: (any that `lidar.formats` reads and writes).
POINTS_STEM = "upsampled"
SWEEP_FORMATS = tuple(suffix.lstrip(".") for suffix in READ_SUFFIXES)
RECORD_NAME = "upsample.json"


@dataclass(frozen=True)
class UpsampleResult:
    """A sweep on its target beam table: every input point, then the filled rays."""

    #: (N + M, 4) float32 x, y, z, intensity in the sensor frame: the N input points as given, then M filled.
    points: np.ndarray
    #: (N + M,) int64 row of each point in `sensor` (0 = highest beam).
    rings: np.ndarray
    #: (N + M,) bool: which points were filled.
    filled: np.ndarray
    #: The target beam table and columns.
    sensor: Sensor
    #: The input on the target grid: the nearest input point's range and intensity per pixel (0 = none).
    given: RangeImage
    #: The result on the target grid: the input where it returns, the fill on the filled rays.
    image: RangeImage
    #: (H, W) the rays that were to be filled (`mask`): where the input is silent, the fill decides.
    mask: np.ndarray
    method: str
    #: Seconds: "geometry" (rings and grid), "fill", "total".
    timings: dict[str, float]

    @property
    def input_count(self) -> int:
        return int((~self.filled).sum())


@dataclass(frozen=True)
class _Grid:
    """The input on the target grid: each point's row and pixel, and per pixel its nearest point."""

    sensor: Sensor
    #: The sensor the input was measured on (its own beam table).
    measured: Sensor
    #: (N,) row of each input point in `sensor`, and its flat pixel (-1: at the origin, no ray).
    rows: np.ndarray
    pixels: np.ndarray
    #: (H, W) the nearest input point's range and intensity per pixel (0 = none), and its x, y, z (H, W, 3).
    given: RangeImage
    xyz: np.ndarray
    #: Target rows a measured beam lands on, and the elevation span (rad) filled between and around them.
    measured_rows: np.ndarray
    fan: tuple[float, float]


def default_method(fill_network: FillNetwork | None, new_beams: bool, measured: Sensor) -> str:
    """The fill a call that names none gets: the learned one for new beams where its network is at hand (it is
    trained on rings dropped; on rays missing at random the edge-aware fill scores better) and learnt from
    sweeps of the `measured` sensor's family (`learnt_from`); else edge-aware."""
    if fill_network is not None and new_beams and learnt_from(fill_network, measured):
        return LEARNED
    return DEFAULT_METHOD


def upsample(
    model: WorldModel | None,
    points: Scan | np.ndarray,
    factor: int | None = None,
    *,
    sensor: Sensor | str | None = None,
    mask: np.ndarray | None = None,
    method: str | None = None,
    steps: int | None = None,
    seed: int = 0,
    limits: Limits = LIBRARY_LIMITS,
    callback: Callable[[Progress], None] | None = None,
    fill_network: FillNetwork | None = None,
) -> UpsampleResult:
    """`points` (a `Scan` or (N, 3+) sensor-frame points) on a denser beam table: `factor` beams per measured
    gap (default `DEFAULT_FACTOR`; 1 keeps the sweep's own table, to complete it), or the beam table of
    `sensor` (a `Sensor` as given, or a preset name, whose beams are taken at the sweep's own columns).

    `mask` (H, W) bool on the target grid names the rays to fill (default: the new beams, or on the sweep's
    own table every silent ray); a ray the input returns on keeps its point whatever the mask says. `model`,
    `steps` and `seed` serve `method="model"` only, `fill_network` `method="learned"`, the default for new beams
    of a sweep from a sensor like those it learnt from (`default_method`; `AUTO` is the same as none). Bad
    input raises `InputError`, before any compute.
    """
    start = time.perf_counter()
    method = None if method == AUTO else method
    if method is not None:
        _check_method(method, model, fill_network)
    xyzi, scan = _input_points(points)
    grid = _grid(xyzi, scan, factor, sensor, limits)
    fill = _fill_mask(grid, mask)
    if method is None:
        method = default_method(fill_network, grid.sensor.height > len(grid.measured_rows), grid.measured)
    geometry_s = time.perf_counter() - start
    if method == MODEL:
        image = _model_fill(model, grid, fill, steps, seed, callback)  # type: ignore[arg-type]
    elif method == LEARNED:
        base = interpolate(grid.given, fill, grid.sensor, EDGE_AWARE, grid.fan)
        image = refine(fill_network, grid.given, base, fill & ~grid.given.mask, grid.sensor)  # type: ignore[arg-type]
    else:
        image = interpolate(grid.given, fill, grid.sensor, method, grid.fan)
    filled = fill & image.mask
    added = _filled_points(grid, image, filled)
    result = _result(xyzi, grid, image, fill, filled, added, method)
    total = time.perf_counter() - start
    timings = {"geometry": geometry_s, "fill": total - geometry_s, "total": total}
    logger.info("upsample: %d points -> %d on %dx%d (%s) in %.2f s", len(xyzi), len(result.points),
                *grid.sensor.shape, method, total)
    return replace(result, timings=timings)


def _check_method(method: str, model: WorldModel | None, fill_network: FillNetwork | None) -> None:
    if method not in METHODS:
        raise InputError(f"method must be one of {', '.join((AUTO, *METHODS))}, got {shown(method)}")
    if method == MODEL and model is None:
        raise InputError("method 'model' needs a world model; load a pipeline and call its upsample")
    if method == LEARNED and fill_network is None:
        raise InputError(f"method '{LEARNED}' needs a fill network; load a release that ships one "
                         f"({FILL_WEIGHTS_NAME}) and call its pipeline's upsample, or pass fill_network=")


# ---------------------------------------------------------------------------------------------- the grid


def _input_points(points: Scan | np.ndarray) -> tuple[np.ndarray, Scan]:
    """(N, 4) float32 points as given (no intensity reads 0) and the Scan their geometry is measured from: a
    file's, or for an array the rings a reader recovers for a file without a ring field (`Scan.from_points`)."""
    if isinstance(points, RangeImage):
        raise InputError("points must be a lidar.formats.Scan or (N, 3+) points, got a RangeImage; "
                         "a range image has lost its rings, pass the points instead")
    if not isinstance(points, Scan):
        arr = np.asarray(points)
        if arr.ndim != 2 or arr.shape[1] < 3 or len(arr) == 0 or not np.issubdtype(arr.dtype, np.number):
            raise InputError(f"points must be a non-empty (N, 3+) array x, y, z[, intensity], got shape {arr.shape}")
        arr = arr[:, :4].astype(np.float32)
        bad = int((~np.isfinite(arr)).any(axis=1).sum())
        if bad:
            raise InputError(f"points hold {bad:,} rows with NaN or inf; expected finite points (drop them first)")
        if arr.shape[1] == 3:
            arr = np.concatenate([arr, np.zeros((len(arr), 1), np.float32)], axis=1)
        points = Scan.from_points(arr)
    if not points.sensor_frame:
        raise InputError(f"points ({points.path or 'an array'}) are not in the sensor frame (the origin is not at "
                         "the LiDAR); expected a sweep in its sensor frame")
    return np.asarray(points.points, dtype=np.float32), points


def target_sensor(measured: Sensor, factor: int) -> Sensor:
    """`measured` with `factor - 1` beams evenly between each two neighbouring beams, at its columns."""
    elevations = np.asarray(measured.elevations_deg)
    between = [np.linspace(a, b, factor, endpoint=False) for a, b in itertools.pairwise(elevations)]
    table = np.concatenate([*between, elevations[-1:]])
    name = measured.name if factor == 1 else f"{measured.name}-x{factor}"
    return replace(measured, name=name, elevations_deg=tuple(table))


def check_factor(factor: object, name: str = "factor") -> int:
    """`factor` as an int, or an InputError naming `name` and the bounds (`MAX_FACTOR`)."""
    if isinstance(factor, bool) or not isinstance(factor, int | np.integer) or not 1 <= factor <= MAX_FACTOR:
        raise InputError(f"{name} must be an integer in [1, {MAX_FACTOR}] (beams per measured gap), got {shown(factor)}")
    return int(factor)


def _target(measured: Sensor, factor: int | None, sensor: Sensor | str | None, limits: Limits) -> Sensor:
    """The target beam table (see `upsample`), checked against `limits` and the writers' ring field. A factor or a
    preset that does not fit is refused naming what does (`_what_fits`)."""
    if factor is not None and sensor is not None:
        raise InputError(f"pass factor or sensor, not both (got factor={shown(factor)} and a sensor)")
    if isinstance(sensor, Sensor):
        if sensor.height > MAX_BEAMS:
            raise InputError(f"sensor {sensor.name} has {sensor.height} beams; expected at most {MAX_BEAMS}")
        limits.check_rays(sensor.height, sensor.width, f"target sensor {sensor.name}")
        return sensor
    if isinstance(sensor, str):
        asked = f"sensor {sensor}"
        try:
            sensor = get_sensor(sensor).with_width(measured.width)
        except ValueError as exc:
            raise InputError(str(exc)) from None
    elif sensor is None:
        factor = check_factor(DEFAULT_FACTOR if factor is None else factor)
        asked, sensor = f"factor {factor}", target_sensor(measured, factor)
    else:
        raise InputError(f"sensor must be a lidar.sensors.Sensor or a preset name, got {type(sensor).__name__}")
    if not _fits(sensor, limits):
        rays = sensor.height * sensor.width
        over = [f"{MAX_BEAMS} beams"] * (sensor.height > MAX_BEAMS) + [f"{limits.max_rays:,} rays"] * (rays > limits.max_rays)
        raise InputError(f"{asked} puts {sensor.height} x {sensor.width} = {rays:,} rays on this {measured.height} x "
                         f"{measured.width} sweep; expected at most {' and '.join(over)}: {_what_fits(measured, limits)}")
    return sensor


def _fits(sensor: Sensor, limits: Limits) -> bool:
    return sensor.height <= MAX_BEAMS and sensor.height * sensor.width <= limits.max_rays


def largest_factor(measured: Sensor, limits: Limits = LIBRARY_LIMITS) -> int:
    """The largest factor whose target of a sweep on `measured` fits `limits` and the ring field (0: none, not
    even the sweep's own table)."""
    return max((f for f in range(1, MAX_FACTOR + 1) if _fits(target_sensor(measured, f), limits)), default=0)


def _what_fits(measured: Sensor, limits: Limits) -> str:
    """What a refusal offers instead: the largest factor and the presets (at the sweep's columns) that fit."""
    best = largest_factor(measured, limits)
    if best == 0:
        return "not even the sweep's own table (factor 1) fits"
    presets = [name for name, preset in PRESETS.items() if _fits(preset.with_width(measured.width), limits)]
    named = f", or the preset{'s' * (len(presets) > 1)} {', '.join(presets)}" if presets else ""
    return f"at most factor {best} fits it{named}"


def upsample_target(points: Scan | np.ndarray, factor: int | None = None, *, sensor: Sensor | str | None = None,
                    limits: Limits = LIBRARY_LIMITS) -> Sensor:
    """The beam table and columns `upsample` puts `points` on for these arguments, checked as it checks them:
    for a caller that refuses or sizes a request before it runs it (an app on ZeroGPU measures the sweep
    before the GPU part). Passed back as `sensor=`, it gives the grid `factor` or the preset name would."""
    _, scan = _input_points(points)
    return _target(_measured(scan).sensor, factor, sensor, limits)


def _measured(scan: Scan) -> SweepGeometry:
    """The sweep's own geometry, or the refusal of a cloud whose beams cannot be recovered."""
    geometry = sweep_geometry(scan)
    if geometry is None or geometry.source == ROWS_FROM_PRESET:
        raise InputError(
            f"points{f' ({scan.path})' if scan.path else ''}: no beams (rings) can be recovered from them (no ring "
            "field, not stored ring by ring, no clusters of elevation); expected a spinning LiDAR sweep in its "
            "sensor frame")
    return geometry


def _grid(xyzi: np.ndarray, scan: Scan, factor: int | None, sensor: Sensor | str | None, limits: Limits) -> _Grid:
    geometry = _measured(scan)
    target = _target(geometry.sensor, factor, sensor, limits)
    measured = geometry.sensor.elevations
    landing = np.abs(target.elevations[None, :] - measured[:, None]).argmin(axis=1)
    # a point on no measured beam (a ring too sparse to measure) goes to the target's beam nearest it
    rows = np.where(geometry.rows >= 0, landing[np.maximum(geometry.rows, 0)], nearest_beam_rows(xyzi, target))
    rng = point_ranges(xyzi)
    ray = rng > 0
    cols = azimuth_columns(xyzi[:, :2], target.width)
    pixels = np.where(ray, rows * target.width + cols, -1)
    winners, won = nearest_per_pixel(pixels[ray], rng[ray], target.height * target.width)
    index = np.flatnonzero(ray)[winners]
    size = target.height * target.width
    range_, intensity, xyz = np.zeros(size, np.float32), np.zeros(size, np.float32), np.zeros((size, 3), np.float32)
    range_[won], intensity[won], xyz[won] = rng[index], np.clip(xyzi[index, 3], 0.0, 1.0), xyzi[index, :3]
    given = RangeImage(range_.reshape(target.shape), intensity.reshape(target.shape))
    top, bottom = measured[0] + (measured[0] - measured[1]), measured[-1] - (measured[-2] - measured[-1])
    return _Grid(target, geometry.sensor, rows, pixels, given, xyz.reshape(*target.shape, 3), np.unique(landing),
                 (bottom, top))


def _fill_mask(grid: _Grid, mask: np.ndarray | None) -> np.ndarray:
    """(H, W) the rays to fill: `mask` checked, else the new beams inside the measured fan, else (no new beam)
    every silent ray."""
    shape = grid.sensor.shape
    if mask is not None:
        arr = np.asarray(mask)
        if arr.shape != shape or arr.dtype != bool:
            raise InputError(f"mask must be an ({shape[0]}, {shape[1]}) bool array on the target grid "
                             f"({grid.sensor.name}), got {arr.dtype} of shape {arr.shape}")
        return arr.copy()
    new = np.ones(shape[0], dtype=bool)
    new[grid.measured_rows] = False
    elevations = grid.sensor.elevations
    new &= (elevations >= grid.fan[0] - 1e-9) & (elevations <= grid.fan[1] + 1e-9)
    if new.any():
        return np.broadcast_to(new[:, None], shape).copy()
    return ~grid.given.mask


# ---------------------------------------------------------------------------------------------- the fills


def plane_weights(el_a: np.ndarray, el_b: np.ndarray, el: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The weights of `planar_range`'s two inverse ranges, which depend on the elevations alone (rad): in one
    vertical fan a plane's inverse range is A cos(el) + B sin(el), so through returns at `el_a` and `el_b` it
    is 1/r_a sin(el_b - el) / sin(el_b - el_a) + 1/r_b sin(el - el_a) / sin(el_b - el_a) at `el`."""
    with np.errstate(divide="ignore", invalid="ignore"):
        det = np.sin(el_b - el_a)
        return np.sin(el_b - el) / det, np.sin(el - el_a) / det


def planar_range(r_a: np.ndarray, r_b: np.ndarray, weights: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Range on the plane through returns `r_a` and `r_b` (m) at the elevation `weights` (`plane_weights`) are
    for; 0 where the plane is not in front of the sensor."""
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = weights[0] / r_a + weights[1] / r_b
        return np.where(np.isfinite(inv) & (inv > 0), 1.0 / inv, 0.0)


def row_neighbours(known: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(H, W) column of the nearest known ray left and right of each ray in its row (azimuth wraps), and their
    distances in columns (inf: the row has no known ray)."""
    width = known.shape[1]
    left, right = (n.T[:, width : 2 * width] for n in column_neighbours(np.tile(known, 3).T))
    cols = np.arange(width, 2 * width)[None, :]
    none = ~known.any(axis=1, keepdims=True)
    return (left % width, right % width, np.where(none, np.inf, cols - left), np.where(none, np.inf, right - cols))


def interpolate(given: RangeImage, fill: np.ndarray, sensor: Sensor, method: str = EDGE_AWARE,
                fan: tuple[float, float] | None = None) -> RangeImage:
    """`given` with its silent `fill` rays filled from the known rays (the rest) above and below them in their
    columns: "nearest", "linear" or "edge-aware" (module docstring). A ray returns where the nearer of its two
    known neighbours returns (the only one, where it has one, if it lies within the elevation span `fan`).
    "edge-aware" fills a ray with no known ray in its column (a cut-out sector) along its row instead, linear in
    range between the nearest known rays either side: the road keeps its range around the sensor."""
    if method not in (EDGE_AWARE, LINEAR, NEAREST):
        raise ValueError(f"interpolate: method must be {EDGE_AWARE}, {LINEAR} or {NEAREST}, got {method!r}")
    todo = fill & ~given.mask
    rows, cols = np.nonzero(todo)
    values, source = _along_columns(given, todo, sensor, method, fan, rows, cols)
    if method == EDGE_AWARE:
        lone = ~(~todo).any(axis=0)[cols]
        values[lone], source[lone] = _along_rows(given, todo, rows[lone], cols[lone])
    range_ = given.range.copy()
    intensity = given.intensity.copy()
    range_[rows, cols] = values
    intensity[rows, cols] = np.where(values > 0, given.intensity.reshape(-1)[source], 0.0)
    return RangeImage(range_.astype(np.float32), intensity.astype(np.float32))


def _along_columns(given: RangeImage, todo: np.ndarray, sensor: Sensor, method: str, fan: tuple[float, float] | None,
                   rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each filled ray's range from the known rays above and below it, and the flat pixel of the nearer one
    (its intensity)."""
    above, below = column_neighbours(~todo)
    a, b = above[rows, cols], below[rows, cols]
    height = sensor.height
    el = sensor.elevations
    has_a, has_b = a >= 0, b < height
    gap_a = np.where(has_a, el[np.maximum(a, 0)] - el[rows], np.inf)
    gap_b = np.where(has_b, el[rows] - el[np.minimum(b, height - 1)], np.inf)
    inside = (has_a & has_b) if fan is None else ((has_a & has_b) | ((el[rows] >= fan[0]) & (el[rows] <= fan[1])))
    near = np.clip(np.where(gap_a <= gap_b, a, b), 0, height - 1)
    r_near = np.where(inside & (has_a | has_b), given.range[near, cols], 0.0)
    values = r_near.astype(np.float64)
    if method != NEAREST:
        both = has_a & has_b
        ra = np.where(both, given.range[np.maximum(a, 0), cols], 0.0).astype(np.float64)
        rb = np.where(both, given.range[np.minimum(b, height - 1), cols], 0.0).astype(np.float64)
        t = np.where(both, gap_a / np.where(both, gap_a + gap_b, 1.0), 0.0)
        pair = both & (ra > 0) & (rb > 0) & (r_near > 0)
        if method == LINEAR:
            values = np.where(pair, (1.0 - t) * ra + t * rb, values)
        else:
            values = np.where(pair, _edge_aware(given, sensor, rows, cols, a, b, pair), values)
    return values, near * sensor.width + cols


def _along_rows(given: RangeImage, todo: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each filled ray's range from the nearest known rays left and right of it in its row, linear in range
    where both return, else the nearer one's; and the flat pixel of the nearer one."""
    left, right, d_left, d_right = (n[rows, cols] for n in row_neighbours(~todo))
    width = given.shape[1]
    seen = np.isfinite(d_left)
    near = np.where(d_left <= d_right, left, right)
    r_left, r_right = given.range[rows, left].astype(np.float64), given.range[rows, right].astype(np.float64)
    r_near = np.where(seen, given.range[rows, near], 0.0).astype(np.float64)
    with np.errstate(invalid="ignore"):
        t = d_left / (d_left + d_right)
    values = np.where(seen & (r_left > 0) & (r_right > 0) & (r_near > 0), (1.0 - t) * r_left + t * r_right, r_near)
    return values, rows * width + near


def _edge_aware(given: RangeImage, sensor: Sensor, rows: np.ndarray, cols: np.ndarray, a: np.ndarray, b: np.ndarray,
                pair: np.ndarray) -> np.ndarray:
    """Planar range of each filled ray (`rows`, `cols`, between known rows `a` above and `b` below, where `pair`)
    along the line through it whose two known ends agree best in log-range (`SLOPES`, `SLOPE_PENALTY`)."""
    el, width = sensor.elevations, sensor.width
    r, c, a, b = rows[pair], cols[pair], a[pair], b[pair]
    column = 2.0 * np.pi / width
    up, down = (el[a] - el[r]) / column, (el[r] - el[b]) / column  # columns per unit of slope
    weights = plane_weights(el[a], el[b], el[r])
    best_cost = np.full(len(r), np.inf)
    best = np.zeros(len(r))
    for slope in SLOPES:
        r_a = given.range[a, (c + np.rint(slope * up).astype(np.int64)) % width].astype(np.float64)
        r_b = given.range[b, (c - np.rint(slope * down).astype(np.int64)) % width].astype(np.float64)
        value = planar_range(r_a, r_b, weights)
        valid = (r_a > 0) & (r_b > 0) & (value > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            cost = np.abs(np.log(r_a) - np.log(r_b)) + SLOPE_PENALTY * abs(slope)
        better = valid & (cost < best_cost)
        best_cost[better], best[better] = cost[better], value[better]
    out = np.zeros(len(rows))
    out[pair] = best
    return out


def sample_grid(model: WorldModel, given: RangeImage, sensor: Sensor, steps: int, seed: int,
                callback: Callable[[Progress], None] | None = None) -> RangeImage:
    """The world model's sweep at the sensor's own pose on `sensor`'s grid, conditioned on `given` as its cache
    (nothing else known): the rollout's sampling (`inference.rollout.rollout`, one frame without a map), on a
    condition whose cache holds each measured point on its own beam's row rather than its elevation's."""
    cond = empty_condition(sensor, model.config.num_map_classes)
    cond[CACHE_IMAGE] = encode_image(given, sensor)
    cond[CACHE_MASK] = given.mask
    param = next(model.parameters())
    sampler = FlowMatchSampler(noise_scale=model.config.default_noise_scale)
    sampler.set_timesteps(steps, device=param.device)
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        prepared = model.prepare(torch.from_numpy(cond)[None].to(param.device))
        x = sampler.init_noise((1, IMAGE_CHANNELS, *sensor.shape), generator, device=param.device)
        for i, t in enumerate(sampler.timesteps):
            v = guided_velocity(model, x.to(param.dtype), t, prepared, 1.0).float()
            x = sampler.step(v, t, x).prev_sample
            if callback is not None:
                callback(Progress(0, 1, i + 1, steps))
        x = model.snap_to_prior(x, prepared)
    return decode_image(to_encoded_image(x[0]), sensor)


def _model_fill(model: WorldModel, grid: _Grid, fill: np.ndarray, steps: int | None, seed: int,
                callback: Callable[[Progress], None] | None) -> RangeImage:
    """The input with its silent `fill` rays taken from the world model's sample (`sample_grid`), drawn at the
    model's range encoding."""
    steps = LIBRARY_LIMITS.check_steps(model.config.default_steps if steps is None else steps)
    LIBRARY_LIMITS.check_seed(seed)
    if grid.sensor.min_range >= model.sensor.max_range:
        raise InputError(f"target sensor {grid.sensor.name}: min_range {grid.sensor.min_range} m is beyond the "
                         f"model's range encoding ({model.sensor.max_range} m); expected a min_range below it")
    sensor = replace(grid.sensor, max_range=model.sensor.max_range)
    sampled = sample_grid(model, grid.given, sensor, steps, seed, callback)
    todo = fill & ~grid.given.mask
    return RangeImage(np.where(todo, sampled.range, grid.given.range).astype(np.float32),
                      np.where(todo, sampled.intensity, grid.given.intensity).astype(np.float32))


# ---------------------------------------------------------------------------------------------- the result


def _filled_points(grid: _Grid, image: RangeImage, filled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(M, 4) points of the filled rays and their rows: along each pixel's beam and column, moved by the
    offsets of the nearest input points above and below in its column (interpolated by elevation). The
    elevation offset is carried as a height (a laser's offset from the optical centre, whose angle shrinks
    with the range), the azimuth offset as an angle (the column's own firing)."""
    sensor = grid.sensor
    el, az = sensor.elevations, sensor.azimuths
    seen = grid.given.mask
    rows_all, cols_all = np.nonzero(seen)
    xyz = grid.xyz[seen].astype(np.float64)
    height_offset = np.zeros(sensor.shape)
    azimuth_offset = np.zeros(sensor.shape)
    height_offset[seen] = (point_elevations(xyz) - el[rows_all]) * grid.given.range[seen]
    azimuth_offset[seen] = np.angle(np.exp(1j * (np.arctan2(xyz[:, 1], xyz[:, 0]) - az[cols_all])))
    above, below = column_neighbours(seen)
    rows, cols = np.nonzero(filled)
    a, b = above[rows, cols], below[rows, cols]
    has_a, has_b = a >= 0, b < sensor.height
    a, b = np.maximum(a, 0), np.minimum(b, sensor.height - 1)
    gap_a = np.where(has_a, el[a] - el[rows], 0.0)
    gap_b = np.where(has_b, el[rows] - el[b], 0.0)
    w_b = np.where(has_a & has_b, gap_a / np.maximum(gap_a + gap_b, 1e-12), has_b.astype(np.float64))
    w_a = np.where(has_a, 1.0 - w_b, 0.0)
    rng = image.range[rows, cols].astype(np.float64)
    lift = w_a * height_offset[a, cols] + w_b * height_offset[b, cols]
    turn = w_a * azimuth_offset[a, cols] + w_b * azimuth_offset[b, cols]
    elevation, azimuth = el[rows] + lift / rng, az[cols] + turn
    out = np.empty((len(rows), 4), dtype=np.float32)
    out[:, 0] = rng * np.cos(elevation) * np.cos(azimuth)
    out[:, 1] = rng * np.cos(elevation) * np.sin(azimuth)
    out[:, 2] = rng * np.sin(elevation)
    out[:, 3] = image.intensity[rows, cols]
    return out, rows.astype(np.int64)


def _result(xyzi: np.ndarray, grid: _Grid, image: RangeImage, fill: np.ndarray, filled: np.ndarray,
            added: tuple[np.ndarray, np.ndarray], method: str) -> UpsampleResult:
    points, rows = added
    return UpsampleResult(
        points=np.concatenate([xyzi, points]),
        rings=np.concatenate([grid.rows.astype(np.int64), rows]),
        filled=np.concatenate([np.zeros(len(xyzi), dtype=bool), np.ones(len(points), dtype=bool)]),
        sensor=grid.sensor,
        given=grid.given,
        image=image,
        mask=fill,
        method=method,
        timings={},
    )


# ---------------------------------------------------------------------------------------------- writing


def write_upsample(folder: str | Path, result: UpsampleResult, fmt: str = "bin", *, provenance: Provenance | None = None,
                   request: dict[str, Any] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write `upsampled.<fmt>` (every point, the input's first, with their rings where the format has a place
    for them) and `upsample.json` (the target sensor, the counts, the request, the model); returns the record.

    A folder that already holds a result is refused unless `overwrite`, which first removes the points file
    its record names.
    """
    folder = Path(folder)
    record_path = folder / RECORD_NAME
    if record_path.exists():
        if not overwrite:
            raise InputError(f"{folder} already holds an upsampled sweep ({RECORD_NAME}); choose another folder "
                             "or overwrite it")
        _remove_previous(folder)
    start = time.perf_counter()
    name = f"{POINTS_STEM}.{fmt}"
    write_points(folder / name, result.points, ring=result.rings)
    record = {
        "convention": "sensor frame (x forward, y left, z up, metres); the first input_points points are the input's, "
        "bit for bit and in its order, then one per filled ray",
        "file": name,
        "points": len(result.points),
        "input_points": result.input_count,
        "filled_points": len(result.points) - result.input_count,
        "method": result.method,
        "sensor": result.sensor.to_dict(),
        "request": request or {},
        "model": provenance.to_dict() if provenance is not None else None,
        "timings": {**result.timings, "write": time.perf_counter() - start},
    }
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def _remove_previous(folder: Path) -> None:
    """Delete the points file an earlier `write_upsample` named in its record (and nothing else)."""
    try:
        name = json.loads((folder / RECORD_NAME).read_text())["file"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InputError(f"{folder / RECORD_NAME} is not a record written by write_upsample ({exc}); remove it") from None
    if isinstance(name, str) and Path(name).name == name:
        (folder / name).unlink(missing_ok=True)
