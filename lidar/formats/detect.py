"""`detect_sensor`: which LiDAR most likely produced a scan, from its beams and its elevation spread.

A ring column settles the beam count, and the highest beam's measured elevation picks among presets with
that count; a sensor no preset describes (e.g. an OS1-64 Gen1, +-16.6 deg) gets its beam table measured
from the file. Without rings the top of the elevation distribution decides: the highest beam nearly
always hits something, while the lowest is often hidden by the car or cropped to a camera's view.
"""

from __future__ import annotations

import logging

import numpy as np

from lidar.formats.scan import STANDARD_WIDTHS, PointCloudError, Scan
from lidar.range_image import azimuth_columns, beam_rows, point_elevations
from lidar.sensors import PRESETS, Sensor

logger = logging.getLogger(__name__)

#: The measured top beam must be this close (degrees) to a preset's top beam.
_TOP_TOLERANCE_DEG = 2.5
#: Presets whose top beams match within this much of the best are told apart by beam alignment.
_TIE_DEG = 1.0
#: A preset is ruled out when more than this fraction of far returns lies outside its beams.
_MAX_OUTSIDE = 0.08
#: The most beams any spinning LiDAR has (Ouster and Hesai top out at 128; leave room for 256-channel designs).
_MAX_BEAMS = 256
#: Returns nearer than this are skipped: the sensor's blind zone and, for some drivers, offsets from its origin.
_MIN_RANGE = 2.0


def azimuth_coverage_deg(points: np.ndarray) -> int:
    """Occupied 1-degree azimuth bins out of 360 around the file's origin (as the real-scan README counts).

    They are the occupied columns of a 360-wide range image, so a camera-cropped scan reads about 81.
    """
    return int(np.unique(azimuth_columns(points[:, :2], 360)).size)


def _width(points_per_beam: float) -> int:
    """The narrowest standard width that holds one column per return of a beam (5% slack for binning)."""
    return next((w for w in STANDARD_WIDTHS if w >= 0.95 * points_per_beam), STANDARD_WIDTHS[-1])


def _from_rings(scan: Scan, far: np.ndarray, elev: np.ndarray) -> Sensor | None:
    ring = scan.ring
    assert ring is not None
    height = int(ring.max()) + 1
    if not 2 <= height <= _MAX_BEAMS:
        logger.info("%s: ring index reaches %d; not a beam count this detector knows", scan.path, height - 1)
        return None
    counts = np.bincount(ring[ring >= 0], minlength=height)
    per_ring = [elev[far & (ring == k)] for k in range(height)]
    if any(len(e) < 5 for e in per_ring):
        logger.info("%s: %d rings, some with almost no returns; sensor not detected", scan.path, height)
        return None
    measured = np.array([np.median(e) for e in per_ring])
    top = float(measured.max())
    width = _width(float(counts.max()))
    candidates = [s for s in PRESETS.values() if s.height == height]
    if candidates:
        best = min(candidates, key=lambda s: abs(s.elevations_deg[0] - top))
        if abs(best.elevations_deg[0] - top) <= _TOP_TOLERANCE_DEG:
            return best.with_width(width)
    if np.unique(np.round(measured, 4)).size != height:
        return None
    return Sensor.from_angles(f"measured-{height}", np.round(measured, 4), width=width, min_range=0.5, max_range=120.0)


def detect_sensor(scan: Scan) -> Sensor | None:
    """The likely sensor (a preset at a fitting width, or a beam table measured from rings), None if unsure."""
    if not scan.sensor_frame:
        return None
    pts = scan.points
    far = np.linalg.norm(pts[:, :3], axis=1) > _MIN_RANGE
    if far.sum() < 100:
        return None
    elev = np.degrees(point_elevations(pts))
    if scan.ring is not None:
        return _from_rings(scan, far, elev)
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
    returns = pts[np.abs(pts[:, :3]).sum(axis=1) > 0]
    per_beam = len(returns) / sensor.height * 360.0 / max(azimuth_coverage_deg(returns), 1)
    return sensor.with_width(_width(per_beam))


#: A chosen sensor is refused when more than this fraction of far returns lies outside its beam fan
#: (measured on the shared real scans: 0-2% for the right preset, 17-38% for a wrong one).
_MAX_OUTSIDE_CHOSEN = 0.15


def check_sensor(scan: Scan, sensor: Sensor) -> None:
    """Refuse a user-chosen sensor that cannot have produced the scan, before it is projected.

    Projecting with the wrong beam table silently throws most points away (they fall outside the fan),
    so a forecast from it would start from an almost empty sweep; better to say so and name the fit.
    """
    if scan.ring is not None and scan.ring.size and int(scan.ring.max()) >= sensor.height:
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
