"""A sweep's own geometry: its measured beam table and columns (`detect_sensor`) and each point's row.

Where the scan has rings (a file's ring field, or recovered by `lidar.formats.rings` from the scan order or
the elevations) the sensor is measured: one beam per ring at the median elevation of its far returns, the
rings ordered by elevation (row 0 the highest), and as many columns as the rings' azimuth step fits in a
turn. The closest preset, by beam count and vertical field of view, lends its range limits and mount
height and its name. Without rings the nearest preset is matched on the top of the elevation distribution:
the highest beam nearly always hits something, while the lowest is often hidden by the car or cropped to a
camera's view.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from lidar.formats.rings import (
    COLUMN_RANGE,
    MAX_BEAMS,
    MIN_RANGE_M,
    RING_FROM_FILE,
    RING_FROM_ORGANISED,
    ring_elevations,
)
from lidar.formats.scan import STANDARD_WIDTHS, PointCloudError, Scan
from lidar.range_image import azimuth_columns, beam_rows, off_origin, point_elevations
from lidar.sensors import PRESETS, Sensor

logger = logging.getLogger(__name__)

#: The measured top beam must be this close (degrees) to a preset's top beam.
_TOP_TOLERANCE_DEG = 2.5
#: Presets whose top beams match within this much of the best are told apart by beam alignment.
_TIE_DEG = 1.0
#: A preset is ruled out when more than this fraction of far returns lies outside its beams.
_MAX_OUTSIDE = 0.08
#: Returns nearer than this are skipped: the sensor's blind zone and, for some drivers, offsets from its origin.
_MIN_RANGE = MIN_RANGE_M
#: A ring with fewer returns than this is not measured; its points get no row.
_MIN_RING_POINTS = 5
#: A measured width this close (relative) to a standard one is that one: the device's mode, not jitter.
_SNAP_WIDTH = 0.005
#: Consecutive azimuths of a ring closer than this (rad) are one firing's two returns, not two columns.
_SAME_FIRING = 1e-5
#: How far (degrees) a measured beam may lie outside a preset's fan before the preset stops being close.
_FOV_SLACK_DEG = 1.0
#: Where rows came from when the scan has no ring: the nearest beam of a matched preset.
ROWS_FROM_PRESET = "preset"


@dataclass(frozen=True)
class SweepGeometry:
    """The geometry a sweep was taken in: the sensor measured from it, and each point's row in that sensor.

    `project(scan.points, geometry.sensor, ring=geometry.rows)` puts every point on its own beam's row.
    """

    #: The measured sensor (name "<closest preset>-measured"), or a matched preset when `source` is "preset".
    sensor: Sensor
    #: (N,) int64 row of each point in `sensor` (0 = highest beam), -1 where it has none.
    rows: np.ndarray
    #: How the rows were found: `Scan.ring_source` ("file", "organised", "scan order", "elevation clusters"),
    #: or "preset" (nearest beam of the matched preset, for a scan without rings).
    source: str


def azimuth_coverage_deg(points: np.ndarray) -> int:
    """Occupied 1-degree azimuth bins out of 360 around the file's origin (as the real-scan README counts).

    They are the occupied columns of a 360-wide range image, so a camera-cropped scan reads about 81.
    """
    return int(np.unique(azimuth_columns(points[:, :2], 360)).size)


def _width(points_per_beam: float) -> int:
    """The narrowest standard width that holds one column per return of a beam (5% slack for binning)."""
    return next((w for w in STANDARD_WIDTHS if w >= 0.95 * points_per_beam), STANDARD_WIDTHS[-1])


def measured_width(points: np.ndarray, rows: np.ndarray) -> int:
    """Columns per revolution: a full turn over the median azimuth step between neighbouring returns of a ring.

    Missing returns only lengthen some steps, so the median of the steps short of a gap is one firing's
    step wherever most of a ring returns; a width within 0.5 % of a standard one is taken as that one.
    """
    valid = (rows >= 0) & off_origin(points)
    # in float64: float32 arctan2 differs by an ulp between numpy's SIMD paths, enough to round a width near half a column either way
    az = np.arctan2(points[:, 1][valid].astype(np.float64), points[:, 0][valid].astype(np.float64))
    ring = rows[valid]
    order = np.argsort(ring * 8.0 + az, kind="stable")  # by ring, then azimuth (az + pi < 8)
    az, ring = az[order], ring[order]
    step = np.diff(az)
    step = step[(ring[1:] == ring[:-1]) & (step > _SAME_FIRING)]
    if step.size == 0:
        return STANDARD_WIDTHS[0]
    typical = np.median(step)
    typical = np.median(step[step < 1.5 * typical])  # without the gaps of missing returns, which bias it up
    width = float(np.clip(2.0 * np.pi / typical, *COLUMN_RANGE))
    standard = min(STANDARD_WIDTHS, key=lambda w: abs(w - width))
    return standard if abs(standard - width) <= _SNAP_WIDTH * standard else round(width)


def closest_preset(elevations_deg: np.ndarray) -> Sensor:
    """The preset most like a measured beam table (highest first): beam count and vertical fan, in ratio, and
    how far the table pokes outside the preset's fan (a 64-beam +-16.6 deg unit is no HDL-64E)."""
    top, bottom = float(elevations_deg[0]), float(elevations_deg[-1])
    fov = max(top - bottom, 0.1)

    def distance(sensor: Sensor) -> float:
        s_top, s_bottom = sensor.elevations_deg[0], sensor.elevations_deg[-1]
        outside = max(top - s_top - _FOV_SLACK_DEG, 0.0) + max(s_bottom - bottom - _FOV_SLACK_DEG, 0.0)
        return abs(np.log(len(elevations_deg) / sensor.height)) + abs(np.log(fov / (s_top - s_bottom))) + outside

    return min(PRESETS.values(), key=distance)


def _beam_table(medians: np.ndarray) -> np.ndarray:
    """Measured elevations (highest first) rounded to 1e-4 deg and kept strictly decreasing, as `Sensor` needs
    (two rings whose medians tie sit 1e-4 deg apart)."""
    table = np.round(medians, 4)
    for k in range(1, len(table)):
        table[k] = min(table[k], table[k - 1] - 1e-4)
    return table


def _measured(scan: Scan) -> SweepGeometry | None:
    """The sensor measured from the scan's rings, or None when they cannot be beams of one sensor."""
    ring = np.asarray(scan.ring, dtype=np.int64)
    labels, dense = np.unique(np.where(ring >= 0, ring, -1), return_inverse=True)
    dense = np.where(labels[dense] >= 0, dense - int((labels < 0).any()), -1)
    labels = labels[labels >= 0]
    if not 2 <= len(labels) <= MAX_BEAMS:
        logger.info("%s: %d distinct ring values; not the beams of one sensor", scan.path, len(labels))
        return None
    xyz = scan.points[:, :3].astype(np.float64)
    counts = np.bincount(dense[dense >= 0], minlength=len(labels))
    medians = ring_elevations(xyz, dense, len(labels))
    measured = np.flatnonzero((counts >= _MIN_RING_POINTS) & np.isfinite(medians))
    if len(measured) < 2:
        return None
    order = measured[np.argsort(-medians[measured], kind="stable")]
    row_of = np.full(len(labels), -1, dtype=np.int64)
    row_of[order] = np.arange(len(order))
    rows = np.where(dense >= 0, row_of[np.maximum(dense, 0)], -1)
    table = _beam_table(medians[order])
    preset = closest_preset(table)
    sensor = Sensor(
        name=f"{preset.name}-measured",
        elevations_deg=tuple(table),
        width=measured_width(scan.points, rows),
        min_range=preset.min_range,
        max_range=preset.max_range,
        mount_height=preset.mount_height,
    )
    return SweepGeometry(sensor, rows, scan.ring_source or RING_FROM_FILE)


def _matched_preset(scan: Scan) -> Sensor | None:
    """The preset whose beams the scan's elevations fit, at a width for its returns per beam; None if none fits."""
    pts = scan.points
    far = np.linalg.norm(pts[:, :3], axis=1) > _MIN_RANGE
    if far.sum() < 100:
        return None
    elev = np.degrees(point_elevations(pts))
    top = float(np.percentile(elev[far], 99.8))
    fits = []
    for sensor in PRESETS.values():
        rows = beam_rows(pts[far], sensor)
        inside = rows >= 0
        gap = abs(sensor.elevations_deg[0] - top)
        if 1.0 - inside.mean() <= _MAX_OUTSIDE and gap <= _TOP_TOLERANCE_DEG:
            # how far returns sit from the nearest beam, in beam spacings: tells OS1-64 from OS1-128
            spacing = (sensor.elevations_deg[0] - sensor.elevations_deg[-1]) / max(sensor.height - 1, 1)
            offset = np.abs(elev[far][inside] - np.asarray(sensor.elevations_deg)[rows[inside]]) / spacing
            fits.append((gap, float(np.median(offset)), sensor))
    if not fits:
        return None
    best_gap = min(f[0] for f in fits)
    _, _, sensor = min((f for f in fits if f[0] <= best_gap + _TIE_DEG), key=lambda f: f[1])
    returns = pts[off_origin(pts)]
    per_beam = len(returns) / sensor.height * 360.0 / max(azimuth_coverage_deg(returns), 1)
    return sensor.with_width(_width(per_beam))


def sweep_geometry(scan: Scan) -> SweepGeometry | None:
    """The sensor a sweep was taken with, measured from its rings, and every point's row in it.

    Without rings (none in the file and none recoverable) the nearest preset's beams give the rows. None when
    the scan is not in its sensor's frame (its elevations are no beam angles) or nothing fits. Measured once
    per `Scan` (`Scan.measured`; the rows read-only): a scan's points and rings are not changed after reading.
    """
    if not scan.measured:
        geometry = _sweep_geometry(scan)
        if geometry is not None:
            geometry.rows.flags.writeable = False
        scan.measured = (geometry,)
    return scan.measured[0]


def _sweep_geometry(scan: Scan) -> SweepGeometry | None:
    if not scan.sensor_frame:
        return None
    if scan.ring is not None:
        geometry = _measured(scan)
        if geometry is not None:
            return geometry
    sensor = _matched_preset(scan)
    if sensor is None:
        return None
    return SweepGeometry(sensor, beam_rows(scan.points, sensor), ROWS_FROM_PRESET)


def detect_sensor(scan: Scan) -> Sensor | None:
    """The sensor that took the scan: its measured beam table and width (`sweep_geometry`), None if unsure."""
    geometry = sweep_geometry(scan)
    return None if geometry is None else geometry.sensor


#: A chosen sensor is refused when more than this fraction of far returns lies outside its beam fan
#: (measured on the shared real scans: 0-2% for the right preset, 17-38% for a wrong one).
_MAX_OUTSIDE_CHOSEN = 0.15


def check_sensor(scan: Scan, sensor: Sensor) -> None:
    """Refuse a user-chosen sensor that cannot have produced the scan, before it is projected.

    Projecting with the wrong beam table silently throws most points away (they fall outside the fan),
    so a forecast from it would start from an almost empty sweep; better to say so and name the fit. A ring
    the file numbers (or an organised dump's pixel order) must fit the sensor's beams; a ring recovered from
    the points is a measurement the user's choice may overrule.
    """
    file_ring = scan.ring is not None and (scan.ring_source or RING_FROM_FILE) in (RING_FROM_FILE, RING_FROM_ORGANISED)
    if file_ring and scan.ring.size and int(scan.ring.max()) >= sensor.height:
        raise PointCloudError(
            f"{scan.path}: ring index reaches {int(scan.ring.max())}, but sensor {sensor.name!r} has only "
            f"{sensor.height} beams; expected a sensor with at least {int(scan.ring.max()) + 1} beams"
        )
    pts = scan.points
    far = pts[np.linalg.norm(pts[:, :3], axis=1) > _MIN_RANGE]
    if len(far) == 0:
        raise PointCloudError(f"{scan.path}: no returns beyond {_MIN_RANGE} m; expected a LiDAR sweep")
    outside = float((beam_rows(far, sensor) < 0).mean())
    if outside > _MAX_OUTSIDE_CHOSEN:
        elev = np.degrees(point_elevations(far))
        raise PointCloudError(
            f"{scan.path}: {outside:.0%} of returns lie outside the beams of sensor {sensor.name!r} "
            f"({sensor.elevations_deg[-1]:+.1f} to {sensor.elevations_deg[0]:+.1f} deg; the scan spans "
            f"{np.percentile(elev, 1):+.1f} to {np.percentile(elev, 99):+.1f} deg); expected at most "
            f"{_MAX_OUTSIDE_CHOSEN:.0%} — choose a sensor whose beams cover the scan"
        )
