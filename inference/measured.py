"""What was measured, seen from a new pose: the rays a forecast or a re-simulation keeps as the sensor gave them.

The network sees the observation through the cache (one point per 0.2 m voxel, each spread over a voxel's
width along its row) and corrects a prior built from it; on real recordings, which come without a map, that
rewrote the measured ranges by about 4 % each, so a forecast lost to the observed sweeps merely moved to the
new pose on every ray they both saw. The rollout therefore finishes every frame by writing the
measurement back: on each ray where a measured point is the nearest return of all observed sweeps moved to
the pose, the frame takes that point, where it was measured, with its range and intensity. The network's work
is what the observation lacks: holes, disoccluded and far ground, rows outside the observing sensor's field
of view.

Which measured point: the nearest of all observed sweeps on the ray, as in a z-buffer of them moved to the
pose, except from a pose much nearer one sweep than any other (`own_sweep`: a re-simulation at an observed
pose, a forecast 0.1 s ahead), where that sweep's point wins the rays it returns on. The observing vehicle's
own returns (`ego_body`: what stayed put in the sensor frame while the sensor moved) are no part of the world:
they travel with the sensor to every pose.

One exception, where the measurement is the worse estimate: where the HD map confirms the surface (the
measured range lies within `SNAP_TOLERANCE` of the map's ground or building range), the map's exact range,
which the prior already holds, is better than a measured point re-projected off its own ray (by up to a
beam spacing on the ground). And where the layout puts an actor's box in front of a measured point, the
actor has moved there since: the box, which the prior also holds, wins.

What the sensor measured as empty is kept too. A ray with no measured return between measured returns of
its own row (within `MISS_REACH_DEG` of azimuth) is a miss the sensor saw: glass, dark paint, a surface beyond
range, all still there from a nearby pose (within `MISS_BASELINE_M`). There the frame returns nothing,
unless the map puts a surface under the ray. The network, trained on a simulator whose drops are random per
ray, filled such rays: on KITTI 00 at 0.1 s those fills made the forecast's squared Chamfer 1.14-1.24x the
moved sweep's, 1.02-1.03x without them. The observing sensor's own shadow (`sensor_shadow`: steep rays on
which no observed sweep ever returned, the car's body seen from its roof) moves with the sensor and hides
everything behind it: there the frame returns nothing at all.

Without a map or a layout, what the network adds is settled against the measurement (`settle_additions`): a
lone return with no neighbour goes, and a return drawn behind a bordering measured surface continues that
surface. With them the additions rest on the map's surfaces and the actors' boxes: settled anyway, the
simulated forecast's Chamfer went from 0.25x to 0.45x cache-only's (12 drives), the wall behind a pole
becoming the pole.

Measured on the shared KITTI 00 frames and left out: hiding measured points that show through the gaps of a
nearer measured surface (a wall's points spread apart from the new pose) made the per-ray error worse, since
real fences, foliage and windows let the truth see through them too; the newest sweep alone, at every
horizon, lost to a z-buffer of all observed sweeps on the common rays from 0.3 s on; snapping added ground
onto the measured ground's height made the mean nearest-neighbour Chamfer worse (the added ground's error is
where its rings fall, not its height); the network's return probability is saturated (0.97-1.0 on 90 % of
added rays), so a threshold on it removes nothing.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from scipy.ndimage import binary_erosion, minimum_filter
from scipy.spatial import cKDTree

from inference.conditioning import GAP_REACH, SNAP_TOLERANCE, LayoutView
from inference.network import RETURN
from lidar.motion import moving_objects
from lidar.range_image import (
    RangeImage,
    azimuth_columns,
    beam_offsets,
    beam_rows,
    elevation_span,
    encode_range,
    grid_winners,
    nearest_per_pixel,
    off_origin,
    point_ranges,
    project,
)
from lidar.ray_grid import COLUMNS as RAY_COLUMNS
from lidar.ray_grid import ROWS, field_of_view, in_field_of_view, nearest_per_ray, ray_cells
from lidar.rows import put_rows, take_rows
from lidar.sensors import Sensor
from lidar.vocabulary import MapView, transform_points

#: Rays below this elevation (deg) meet the ground within about 10 m of a car's roof: silent ones are the
#: car's body (`sensor_shadow`).
SHADOW_ELEVATION_DEG = -10.0
#: Radians a float32 point's elevation may sit above its beam's.
ELEVATION_ROUNDING = 1e-4
#: Farthest (m) a pose may lie from an observing sensor for a silent ray between measured returns to count as
#: a miss there: the moved sweeps thin out with the distance, and on KITTI 00 at 8.6 m (1.0 s) most such rays
#: were only gaps between their re-projected points (the truth returned on them), at 4.3 m (0.5 s) few were.
MISS_BASELINE_M = 5.0
#: Metres within which a pose is at the place a sweep was taken, and sees every point of it (`beside_grid`);
#: within `ALONE_REACH_M` when no sweep was taken elsewhere.
SAME_PLACE_M = 0.01
ALONE_REACH_M = 1.5
#: Metres within which a pose sees with the eyes of the nearest sweep: its rays are that sweep's, and the other
#: sweeps keep no point beside the grid (`beside_grid`). On the shared KITTI raw drive creeping at 0.18 m a
#: frame, the older sweeps' points on the fine rays the newest left silent were 40 % of a 0.1 s forecast's
#: points, with 9x the newest's squared error per point: a pose that near is silent where that sweep was.
SAME_EYES_M = 0.5
#: Metres from the sweep beyond which a pose no longer sees the points that sweep measured behind a nearer one
#: on its fine ray (`_unhidden`), and the gap (metres plus a share of the nearer range) beyond which a point
#: lies behind it. Two firings of one ring on the same surface share a 0.2 deg cell within centimetres; a
#: point a surface hides from the new pose lies metres behind it.
HIDDEN_FROM_M = 0.3
HIDDEN_GAP_M, HIDDEN_GAP_SHARE = 0.2, 0.05
#: Azimuth (deg) either side of a ray within which a measured return of its row makes the ray's own silence
#: a measured miss: the gap fill's reach on the 512-column grid the rule was first measured on, held in
#: degrees so that a finer grid (a KITTI sweep's 2,008 columns) reaches as far (`miss_reach`).
MISS_REACH_DEG = GAP_REACH[0] * 360.0 / 512
#: A pose at most this fraction as far from one observing sensor as from any other sees with that sweep's eyes:
#: the sweep wins every ray it returns on, the others only fill its silent rays (`measured_view`).
OWN_SWEEP_RATIO = 0.6
#: The observing vehicle's own returns (`ego_body`): points within this many metres of their sensor, above the
#: ground (`EGO_CLEARANCE_M`), that another sweep, taken at least `EGO_TRAVEL_M` away, measured within
#: `EGO_TOLERANCE_M` of the same sensor-frame place. Within 3 m a roof sensor sees its car's roof, mirrors and
#: boot; its lowest beams meet the ground farther.
EGO_RANGE_M = 3.0
EGO_TRAVEL_M = 0.3
EGO_TOLERANCE_M = 0.05
#: Other sweeps (the nearest in time taken elsewhere) a sweep's points are checked against.
EGO_WITNESSES = 2
#: The ground is the sweep's `GROUND_PERCENTILE`-th percentile height; a body stands `EGO_CLEARANCE_M` above it.
GROUND_PERCENTILE = 5.0
EGO_CLEARANCE_M = 0.3
#: An added return needs a neighbouring ray's return within this many metres, plus this share of its range,
#: to stand (`settle_additions`).
LONE_RADIUS_M = 0.5
LONE_SLOPE = 0.05
#: An added return farther than a bordering measured one by more than 1 / this lies behind that measured
#: surface (`settle_additions`).
BEHIND_RATIO = 0.9
#: An added return farther than `FAR_ADDITION_M` and behind a kept measured surface within `FAR_BEHIND_REACH`
#: (rows, columns) of cells of the fine ray grid (`lidar.ray_grid`: 0.2 and 2 deg either side) goes
#: (`settle_additions`).
FAR_ADDITION_M = 20.0
FAR_BEHIND_REACH = (1, 10)
#: Near an observing sensor (within `NEAR_ONLY_M`), an added return stands only on the ground (within
#: `NEAR_GROUND_TOLERANCE_M` of the measured ground's height) within `NEAR_GROUND_M` of the sensor
#: (`settle_additions`).
NEAR_ONLY_M = 1.0
NEAR_GROUND_M = 10.0
NEAR_GROUND_TOLERANCE_M = 0.6
#: An addition on an observing sweep's ray that returned farther than it (by this many metres, plus this share
#: of its range), or returned nothing within its reach, stood where that sensor saw through (`sight_through`); an older
#: sweep's point on a ray the newest returned farther on is gone by the forecast's frames (`seen_past`).
SIGHT_TOLERANCE_M = 0.3
SIGHT_SLOPE = 0.05


#: A measured point lies on one of the frames' beams within this share of the beam spacing (`beam_offsets`).
ON_BEAM_SHARE = 0.25
#: The observed sweeps sit on their beams when this percentile of their points (every `ON_BEAM_STRIDE`-th, at
#: their own poses) lies on the frames' beams: simulated sweeps and fixed beam tables do, a KITTI HDL-64E
#: sweep does not (its points scatter about their rings, half of them more than half a spacing).
ON_BEAM_PERCENTILE = 90.0
ON_BEAM_STRIDE = 8


def measured_points(scans: list[np.ndarray], poses: np.ndarray) -> np.ndarray:
    """(N, 4) world-frame points of observed sensor-frame scans (N, 3+) at their poses; no intensity reads 0
    (unknown)."""
    out = []
    for points, pose in zip(scans, np.asarray(poses, dtype=np.float64), strict=True):
        pts = np.asarray(points, dtype=np.float32)
        if pts.shape[1] == 3:
            pts = np.concatenate([pts, np.zeros((len(pts), 1), np.float32)], axis=1)
        out.append(transform_points(pts[:, :4], pose))
    return np.concatenate(out) if out else np.zeros((0, 4), np.float32)


@dataclass
class MeasuredView:
    """The measurement kept on the rays of one pose: its ranges as a range image (0 where nothing is kept) and
    each kept ray's measured point where it was measured (sensor frame), not moved onto the ray's centre."""

    image: RangeImage
    #: (H * W, 4) x, y, z, intensity of each pixel's kept point; rows of unkept pixels are zero.
    points: np.ndarray
    #: (H, W) rays measured empty: no measured return, one within `MISS_REACH_DEG` of the same row seen
    #: from within `MISS_BASELINE_M` of an observing sensor, and no map surface under them; or the observing
    #: sensor's own shadow, which hides even what was measured and what the map holds.
    misses: np.ndarray
    #: (H, W) kept rays that meet the observing car itself (`Observation.body`): no part of the world.
    body: np.ndarray
    #: (M, 4) measured points kept beside the grid (`beside_grid`), sensor frame: rays of their own that share a
    #: kept pixel with its point.
    beside: np.ndarray
    #: Metres from the pose to the nearest observing sensor.
    baseline: float
    #: The observation and the pose it is seen from (`sight_through`).
    observed: Observation | None = None
    pose: np.ndarray | None = None

    @property
    def mask(self) -> np.ndarray:
        return self.image.mask

    @functools.cached_property
    def bordering(self) -> np.ndarray:
        """(H, W) the nearest measured range of the world (not the car's body) within `GAP_REACH` of each ray,
        inf where none: an addition farther than it lies behind that surface (`settle_additions`)."""
        world = self.mask & ~self.body  # the car's own body borders everything near it, and hides nothing
        nearest = np.full(self.mask.shape, np.inf, dtype=np.float32)
        for other in _neighbours(np.where(world, self.image.range, np.inf), np.inf, GAP_REACH):
            nearest = np.minimum(nearest, other)
        return nearest

    @functools.cached_property
    def _kept_rays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each kept measured point's fine ray cell (`lidar.ray_grid`) and range, and whether it is of the world
        (not the car's body): the pixels' points, then those beside the grid."""
        kept = np.concatenate([take_rows(self.points, self.mask.reshape(-1)), self.beside])
        world = np.concatenate([~self.body[self.mask], np.ones(len(self.beside), dtype=bool)])
        return ray_cells(kept), point_ranges(kept), world

    @functools.cached_property
    def kept_cells(self) -> np.ndarray:
        """(ROWS * COLUMNS,) bool: the fine ray cells the kept measured points lie in, those beside the grid too."""
        out = np.zeros(ROWS * RAY_COLUMNS, dtype=bool)
        out[self._kept_rays[0]] = True
        return out

    @functools.cached_property
    def ground_height(self) -> float | None:
        """The measured ground's height in the sensor frame (the low tail of the kept world points' heights);
        None where nothing of the world is kept."""
        world = (self.mask & ~self.body).reshape(-1)
        return float(np.percentile(self.points[:, 2][world], GROUND_PERCENTILE)) if world.any() else None

    @functools.cached_property
    def surfaces(self) -> tuple[int, np.ndarray]:
        """The kept world points' nearest range per fine ray cell (`lidar.ray_grid`), the least within
        `FAR_BEHIND_REACH` of each cell: (the first grid row held, (rows, columns) ranges, inf where none), over
        the rows those points span and the reach beyond."""
        cells, ranges, world = self._kept_rays
        winners, won = nearest_per_pixel(cells[world], ranges[world], ROWS * RAY_COLUMNS)
        rows, cols = np.divmod(won, RAY_COLUMNS)
        reach_rows, reach_cols = FAR_BEHIND_REACH
        low = max(int(rows.min(initial=0)) - reach_rows, 0)
        high = min(int(rows.max(initial=0)) + reach_rows, ROWS - 1)
        nearest = np.full((high - low + 1, RAY_COLUMNS), np.inf, dtype=np.float32)
        nearest[rows - low, cols] = ranges[world][winners]
        return low, minimum_filter(nearest, size=(2 * reach_rows + 1, 2 * reach_cols + 1), mode=("constant", "wrap"),
                                   cval=np.inf)

    def ready_to_settle(self) -> MeasuredView:
        """This view with what `settle_additions` asks of it worked out: a frame's measured view is drawn while
        the network samples, its settling waits for the sample."""
        _ = self.bordering, self.kept_cells, self.ground_height
        if self.baseline > NEAR_ONLY_M:  # nearer, only the near ground stands, and `far_behind` has nothing to ask
            _ = self.surfaces
        return self


def sensor_shadow(scans: list[np.ndarray], sensor: Sensor, masks: list[np.ndarray] | None = None,
                  spans: list[tuple[float, float]] | None = None) -> np.ndarray:
    """(H, W) rays steeper than `SHADOW_ELEVATION_DEG`, inside the observing sensor's field of view, on which
    no observed sweep (N, 3+ points in its own sensor frame) returned, nor on its row within
    `MISS_REACH_DEG`: what the car's own body hides from a roof sensor, which travels with the sensor to every
    pose.

    Such rays meet the ground within about 10 m, where a sensor always returns; an isolated silent ray there is
    a dropped return, so a shadow must be wider than a row miss. `masks`: each scan's `project(points,
    sensor).mask`, and `spans`, its `elevation_span`, when the caller has them already.
    """
    seen = np.zeros(sensor.shape, dtype=bool)
    lowest = np.inf
    for i, points in enumerate(scans):
        seen |= project(np.asarray(points), sensor).mask if masks is None else masks[i]
        lowest = min(lowest, (elevation_span(points) if spans is None else spans[i])[0])
    rows = (sensor.elevations < np.radians(SHADOW_ELEVATION_DEG)) & (sensor.elevations >= lowest - ELEVATION_ROUNDING)
    return rows[:, None] & ~seen & ~row_misses(np.flatnonzero(seen), sensor)


def shadow_interior(shadow: np.ndarray) -> np.ndarray:
    """(H, W) the rays of a shadow (`sensor_shadow`) whose rays above and below are in it too (beyond the top
    and bottom rows is no shadow): the rays it hides a measured point on. Its upper and lower edge are
    uncertain by a ray: a real sweep's points scatter about their rings, and a point measured just above the
    shadow lands on its edge from a pose a little way on. Hiding the points on those edges too cost the shared
    KITTI raw drive, creeping at 0.18 m a frame, 1 % at 0.1 s (1.012x the better baseline with one sweep,
    1.002x without) and KITTI 00 0.6 % (docs/evaluation.md)."""
    return binary_erosion(shadow, structure=np.ones((3, 1), dtype=bool), border_value=0)


@dataclass
class Observation:
    """What observed sweeps measured, for the frames a forecast or a re-simulation renders from them."""

    #: (N, 4) points of every observed sweep in the frame of `origin` (the newest sweep's sensor): near that
    #: frame's origin float32 keeps them to the sensor's precision, and moving them to a pose is a float32
    #: product, a quarter of the float64 one on the 370 k points of three KITTI sweeps.
    points: np.ndarray
    #: (K, 4, 4) world_from_sensor of each sweep.
    poses: np.ndarray
    #: (H, W) the observing sensor's own shadow (`sensor_shadow`).
    shadow: np.ndarray
    #: (N,) which sweep (index into `poses`) measured each point.
    sweep: np.ndarray
    #: (M, 4) the observing vehicle's own returns in the sensor frame (`ego_body` of the newest sweep): they
    #: travel with the sensor to every pose.
    body: np.ndarray
    #: (K, H, W) each sweep's nearest range per ray of `sensor`, in its own sensor frame (0: silent), for what
    #: the sweeps saw through (`sight_through`).
    sight: np.ndarray
    #: The frames' sensor.
    sensor: Sensor
    #: (low, high) elevations (rad) the observing sensor sees (`lidar.ray_grid.field_of_view`, every sweep's):
    #: seen from another pose, a measured point outside them is on no ray the sensor has there.
    field_of_view: tuple[float, float]
    #: (N, 3) m/s in the frame of `points`: the newest sweep's moving objects (`lidar.motion`), zero elsewhere;
    #: None when nothing moves or the observation is not forecast.
    velocity: np.ndarray | None = None
    #: Seconds of the newest sweep, on the clock of the frames' times.
    time: float = 0.0
    #: The sweeps' own returns lie on the frames' beams (`on_beams`).
    on_beams: bool = False
    #: (N,) bool: the older sweeps' points the newest sweep saw past (`seen_past`); None when the observation
    #: is not forecast.
    passed: np.ndarray | None = None

    @functools.cached_property
    def current(self) -> Observation:
        """The observation less what the newest sweep saw past: what a forecast keeps near it (`measured_view`)."""
        if self.passed is None or not self.passed.any():
            return self
        keep = ~self.passed
        velocity = None if self.velocity is None else self.velocity[keep]
        return replace(self, points=self.points[keep], sweep=self.sweep[keep], velocity=velocity, passed=None)

    @property
    def positions(self) -> np.ndarray:
        """(K, 3) world positions of the sensor at each sweep."""
        return self.poses[:, :3, 3]

    @property
    def origin(self) -> np.ndarray:
        """(4, 4) world_from_points: the newest sweep's pose."""
        return self.poses[-1] if len(self.poses) else np.eye(4)

    def seen_from(self, pose: np.ndarray, time: float | None = None) -> np.ndarray:
        """`points` in the sensor frame of a world_from_sensor `pose`, at `time` s: moving objects carried on at
        their velocity from the newest sweep's time."""
        into = (np.linalg.inv(pose) @ self.origin).astype(np.float32)
        out = self.points.copy()
        where = self.points[:, :3]
        if self.velocity is not None and time is not None:
            where = where + self.velocity * np.float32(time - self.time)
        out[:, :3] = where @ into[:3, :3].T + into[:3, 3]
        return out


def ego_body(scans: list[np.ndarray], poses: np.ndarray) -> list[np.ndarray]:
    """(N,) bool per sensor-frame scan: the observing vehicle's own returns, those that stayed in place in the
    sensor frame while the sensor moved (see `EGO_RANGE_M`), and so are not where the world was. One sweep, or
    sweeps from one place, cannot tell them from the world: nothing is marked then.

    Moved with the world they would trail behind the sensor, a metre or more above the road, at every new
    pose (on KITTI 00, 30-40 points per sweep within 3 m); the truth has them on the car. A surface that
    looks the same from every pose along the drive (the road, a wall alongside) is also where it was in the
    world, and stays. Whatever kept pace beside the car within 3 m rides along as well (on KITTI 00 from sweep
    11, a road user 2.5 m to its right): the constant-velocity guess for a forecast, a wrong one for a
    re-simulation shifted sideways.
    """
    poses = np.asarray(poses, dtype=np.float64)
    scans = [np.asarray(points) for points in scans]
    witnesses = [_witnesses(poses, i) for i in range(len(scans))]
    masks = [np.zeros(len(points), dtype=bool) for points in scans]
    if not any(witnesses):
        return masks
    near = [_above_ground_nearby(points) for points in scans]
    sensor_trees = [cKDTree(points[mask, :3]) for points, mask in zip(scans, near, strict=True)]
    for i, points in enumerate(scans):
        body = masks[i]
        candidates = np.flatnonzero(near[i])
        if not len(candidates):
            continue
        local = points[candidates, :3]
        for j in witnesses[i]:
            if not near[j].any():
                continue
            stayed, _ = sensor_trees[j].query(local, distance_upper_bound=2 * EGO_TOLERANCE_M)
            # what sweep j measured of the world around sweep i's sensor, in sweep i's frame
            into_i = np.linalg.inv(poses[i]) @ poses[j]
            centre = np.linalg.inv(into_i)[:3, 3]
            around = np.linalg.norm(scans[j][:, :3] - centre, axis=1) <= EGO_RANGE_M + EGO_TOLERANCE_M
            seen = cKDTree(transform_points(scans[j][around, :3], into_i)[:, :3])
            world, _ = seen.query(local, distance_upper_bound=2 * EGO_TOLERANCE_M)
            body[candidates[(stayed <= EGO_TOLERANCE_M) & (world > EGO_TOLERANCE_M)]] = True
    return masks


def _witnesses(poses: np.ndarray, i: int) -> list[int]:
    """The `EGO_WITNESSES` sweeps nearest in time to sweep i that were taken elsewhere (`EGO_TRAVEL_M` away):
    two, so 50 sweeps cost 100 checks."""
    elsewhere = [j for j in sorted(range(len(poses)), key=lambda j: abs(j - i))
                 if j != i and np.linalg.norm(poses[i, :3, 3] - poses[j, :3, 3]) >= EGO_TRAVEL_M]
    return elsewhere[:EGO_WITNESSES]


def _above_ground_nearby(points: np.ndarray) -> np.ndarray:
    """(N,) bool: points within `EGO_RANGE_M` of the sensor and `EGO_CLEARANCE_M` above the sweep's ground (the
    low tail of its heights)."""
    if len(points) == 0:
        return np.zeros(0, dtype=bool)
    ground = np.percentile(points[:, 2], GROUND_PERCENTILE)
    return (np.linalg.norm(points[:, :3], axis=1) < EGO_RANGE_M) & (points[:, 2] > ground + EGO_CLEARANCE_M)


def without_ego_body(scans: list[np.ndarray], bodies: list[np.ndarray]) -> list[np.ndarray]:
    """The scans with the observing vehicle's own returns (`ego_body` masks) left out: what they measured of
    the world."""
    return [take_rows(np.asarray(points), ~body) for points, body in zip(scans, bodies, strict=True)]


def observation(scans: list[np.ndarray], poses: np.ndarray, sensor: Sensor,
                bodies: list[np.ndarray] | None = None, times: np.ndarray | None = None) -> Observation:
    """The `Observation` of sensor-frame scans (N, 3+) at their world_from_sensor poses; `bodies`, their
    `ego_body` masks, when the caller has them already. With the sweeps' `times` (s, increasing; a forecast),
    what moved between them (`lidar.motion.moving_objects`) moves on in the frames, and the older sweeps'
    copies of it are left out: they show where it was. What the newest sweep saw past is marked (`seen_past`)."""
    poses = np.asarray(poses, dtype=np.float64)
    bodies = ego_body(scans, poses) if bodies is None else bodies
    world = without_ego_body(scans, bodies)
    sweep = np.repeat(np.arange(len(scans), dtype=np.int32), [len(points) for points in world])
    body = measured_points(scans[-1:], np.eye(4)[None])[bodies[-1]] if scans else np.zeros((0, 4), np.float32)
    origin = poses[-1] if len(poses) else np.eye(4)
    points = measured_points(world, np.linalg.inv(origin) @ poses)
    seen = [project(np.asarray(scan), sensor).range for scan in scans]  # each sweep's nearest range per ray
    velocity, time = None, 0.0
    if times is not None and len(scans) > 1:
        time = float(times[-1])
        moving = moving_objects(points, sweep, times, np.zeros(3))
        if len(moving.objects):
            points, sweep, velocity = points[~moving.stale], sweep[~moving.stale], moving.velocity[~moving.stale]
        passed = seen_past(points, sweep, seen[-1], sensor)
    else:
        passed = None
    sight = np.stack(seen) if scans else np.zeros((0, *sensor.shape), np.float32)
    spans = [elevation_span(np.asarray(scan)) for scan in scans]
    span = (min(low for low, _ in spans), max(high for _, high in spans)) if spans else (-np.pi / 2, np.pi / 2)
    return Observation(points, poses, sensor_shadow(scans, sensor, [r > 0 for r in seen], spans), sweep, body,
                       sight, sensor, field_of_view(span), velocity, time, on_beams(scans, sensor), passed)


def seen_past(points: np.ndarray, sweep: np.ndarray, newest: np.ndarray, sensor: Sensor) -> np.ndarray:
    """(N,) bool: the older sweeps' `points` (in the newest sweep's frame; `sweep` says whose) on a ray of
    `sensor` on which the newest sweep (`newest`, its nearest range per ray, 0 where silent) returned beyond
    them (`_seen_beyond`).

    A forecast's frames follow the newest sweep, the latest word on what stands where: its ray passed the place
    an older sweep measured, so what stood there has gone (a lead vehicle pulling away, one that the motion of
    what moves does not hold as an object) or lets rays through, and the z-buffer of the sweeps moved to a pose
    would still give it the ray. A ray the newest left silent says nothing here: real sweeps drop returns
    on dark paint and glass (docs/evaluation.md has the figures of both)."""
    older = np.flatnonzero(sweep < sweep.max(initial=0))
    inside, seen, rng = _sight_at(newest, points[older], sensor)
    out = np.zeros(len(points), dtype=bool)
    out[older] = inside & _seen_beyond(seen, rng)
    return out


def _sight_at(sight: np.ndarray, local: np.ndarray, sensor: Sensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For points in a sweep's own frame (`local`): whether a ray of `sensor` holds them, that sweep's nearest
    range on their ray (`sight`, (H, W), 0 where silent or outside), and their own range."""
    rows, rng = beam_rows(local, sensor), point_ranges(local)
    inside = rows >= 0
    seen = np.where(inside, sight[np.maximum(rows, 0), azimuth_columns(local[:, :2], sensor.width)], 0.0)
    return inside, seen, rng


def _seen_beyond(seen: np.ndarray, rng: np.ndarray) -> np.ndarray:
    """Whether a ray's return at `seen` (m) lies beyond a point at `rng` (m) by more than `SIGHT_TOLERANCE_M`
    plus `SIGHT_SLOPE` of its range: the ray passed where the point stands."""
    return seen > rng + np.maximum(SIGHT_TOLERANCE_M, SIGHT_SLOPE * rng)


def on_beams(scans: list[np.ndarray], sensor: Sensor) -> bool:
    """Whether sensor-frame sweeps lie on `sensor`'s beams (`ON_BEAM_PERCENTILE` of their points within
    `ON_BEAM_SHARE` of a beam): then a point seen off every beam from another pose is on no ray the sensor has
    there."""
    sample = [np.asarray(scan)[::ON_BEAM_STRIDE, :3] for scan in scans]
    sample = [points[off_origin(points)] for points in sample]
    if not sum(len(points) for points in sample):
        return False
    offsets = beam_offsets(np.concatenate(sample), sensor)
    return bool(np.percentile(offsets, ON_BEAM_PERCENTILE) <= ON_BEAM_SHARE)


def _nearest_sweep(observed: Observation, pose: np.ndarray) -> tuple[np.ndarray, int]:
    """Each observing sensor's distance to `pose`, and the nearest sweep (of sweeps from one place, the newest)."""
    gaps = np.linalg.norm(observed.positions - pose[:3, 3], axis=1)
    return gaps, int(np.lexsort((-np.arange(len(gaps)), gaps))[0])


def own_sweep(observed: Observation, pose: np.ndarray) -> int | None:
    """The sweep whose eyes a sensor at `pose` sees with, if any: the nearest observing sensor's, when the pose
    is at most `OWN_SWEEP_RATIO` times as far from it as from any sweep taken elsewhere (`EGO_TRAVEL_M` or
    more away); of sweeps taken from one place, the newest.

    Re-projected from afar, a sweep's points sit off the new rays, and where sweeps overlap the nearest-wins
    z-buffer picks the shortest of their noisy ranges; from (nearly) its own pose a sweep's points lie on the
    rays. On KITTI 00 with three sweeps, the newest alone at 0.1 s (0.5x as far as the next) had 0.90x the
    z-buffer's per-ray error against the truth; at 0.3 s (0.75x) it had 1.03x, the older sweeps seeing what
    it could not. At zero shift a re-simulation gives that sweep back exactly.

    Not settled: on two simulated HDL-64E drives (exact poses, flat ground, thin poles) the per-ray error at
    0.1 s fell too (0.97x) but the squared Chamfer rose, 0.97x -> 1.24x and 1.01x -> 0.98x the better
    baseline. A model pixel holds 2-3 beams of a 64-beam sensor, and the nearest of all sweeps' beams there
    is what the truth's own nearest beam sees of a thin pole; requiring the other sweep's nearer point to be
    unconfirmed by the own sweep, or within a few percent of its range, lost the gain on KITTI without
    closing that gap.
    """
    if len(observed.positions) < 2:
        return None
    gaps, first = _nearest_sweep(observed, pose)
    # the others: sweeps taken elsewhere (a car standing still takes all of its sweeps from one place)
    elsewhere = np.linalg.norm(observed.positions - observed.positions[first], axis=1) >= EGO_TRAVEL_M
    if not elsewhere.any():
        return first
    return first if gaps[first] <= OWN_SWEEP_RATIO * gaps[elsewhere].min() else None


def _winners(local: np.ndarray, observed: Observation, pose: np.ndarray, sensor: Sensor) -> tuple[np.ndarray, np.ndarray]:
    """`grid_winners` of the observation's points at `pose` (`local`): the nearest per ray, but the
    `own_sweep`'s point on every ray it returns on, and no older point on a ray it measured empty between its
    returns (`row_misses`): what moved since the older sweep (a lead vehicle pulling away in slow traffic
    leaves its older, nearer copy above and beside the newer one) is stale there. On KITTI 00 with 3 sweeps
    that took 0.1 s from 0.997x to 0.983x the better baseline. Within `SAME_EYES_M` of the own sweep no older
    point is kept on any ray the own sweep left silent: the pose sees with that sweep's eyes (`beside_grid`
    keeps none of the others' points there either). On the shared KITTI raw drive creeping at 0.18 m a frame,
    three sweeps observed, the older points there had 2.7x the newest's squared distance to the truth, and
    without them the 0.1 s forecast went from 1.017x to 0.975x the better baseline."""
    index, pixels = grid_winners(local, sensor)
    own = own_sweep(observed, pose)
    if own is None:
        return index, pixels
    mine = np.flatnonzero(observed.sweep == own)
    own_index, own_pixels = grid_winners(take_rows(local, mine), sensor)
    winner = np.full(sensor.height * sensor.width, -1)
    winner[pixels] = index
    onto = winner[own_pixels] < len(observed.points)  # the car's own body (after the world points) keeps its rays
    winner[own_pixels[onto]] = mine[own_index[onto]]
    # what the own sweep measured empty between its returns is empty: an older sweep's point there is stale
    won, world = winner[pixels], winner[pixels] < len(observed.points)
    stale = row_misses(own_pixels, sensor).reshape(-1)[pixels] & world
    if _nearest_sweep(observed, pose)[0][own] <= SAME_EYES_M:  # that near, silent where the own sweep was
        stale |= world & (observed.sweep[np.where(world, won, 0)] != own)
    return won[~stale], pixels[~stale]


def measured_view(observed: Observation, pose: np.ndarray, sensor: Sensor, map_view: MapView | None = None,
                  boxes: LayoutView | None = None, time: float | None = None) -> MeasuredView:
    """What a sensor at `pose` keeps of the observation, every observed sweep together: the nearest measured
    point per ray, as in a z-buffer of the sweeps moved to the pose, or the `own_sweep`'s point on the rays it
    returns on; and the rays measured empty.

    An actor's box (`boxes`, the layout at the frame's time) in front of a measured point hides it, and a
    silent ray it covers is no miss: the actor has moved there since. On 12 simulated drives with their
    layout, keeping what a box hides made the forecast's Chamfer 0.254x cache-only's, 0.236x without.

    Near the observation (within `MISS_BASELINE_M` of an observing sensor) a forecast keeps nothing the newest
    sweep saw past (`Observation.current`): its rays run close to the newest's, which passed there.
    """
    baseline = float(np.linalg.norm(observed.positions - pose[:3, 3], axis=1).min())
    if baseline <= MISS_BASELINE_M:
        observed = observed.current
    local = np.concatenate([observed.seen_from(pose, time), observed.body])  # the vehicle's own body travels with the sensor
    index, pixels = _winners(local, observed, pose, sensor)
    misses = row_misses(pixels, sensor) if baseline <= MISS_BASELINE_M else np.zeros(sensor.shape, dtype=bool)
    # the sensor's own body hides whatever lies behind it, but a measured point on the shadow's edge stays
    visible = ~shadow_interior(observed.shadow).reshape(-1)[pixels]
    index, pixels = index[visible], pixels[visible]
    ranges = point_ranges(take_rows(local, index))
    if map_view is not None:
        misses &= (map_view.ground <= 0) & (map_view.building <= 0)
        # where the map confirms the surface, its exact range (in the prior) is better
        encoded = encode_range(ranges, sensor.max_range)
        on_map = np.zeros(len(pixels), dtype=bool)
        for surface in (map_view.ground, map_view.building):
            mapped = encode_range(surface.reshape(-1)[pixels], sensor.max_range)
            on_map |= (mapped > -1.0) & (np.abs(encoded - mapped) < SNAP_TOLERANCE)
        index, pixels, ranges = index[~on_map], pixels[~on_map], ranges[~on_map]
    if boxes is not None:
        misses &= boxes.range <= 0
        box = encode_range(boxes.range.reshape(-1)[pixels], sensor.max_range)
        hidden = (box > -1.0) & (box < encode_range(ranges, sensor.max_range) - SNAP_TOLERANCE)
        index, pixels, ranges = index[~hidden], pixels[~hidden], ranges[~hidden]
    misses |= observed.shadow
    misses.reshape(-1)[pixels] = False
    size = sensor.height * sensor.width
    points = np.zeros((size, 4), dtype=np.float32)
    put_rows(points, pixels, take_rows(local, index))
    range_ = np.zeros(size, dtype=np.float32)
    range_[pixels] = ranges
    body = np.zeros(size, dtype=bool)
    body[pixels] = index >= len(observed.points)
    intensity = np.clip(points[:, 3], 0.0, 1.0)
    kept = np.zeros(size, dtype=bool)
    kept[pixels[index < len(observed.points)]] = True
    beside = beside_grid(local[: len(observed.points)], observed, pose, sensor, kept, index, boxes)
    return MeasuredView(RangeImage(range_.reshape(sensor.shape), intensity.reshape(sensor.shape)), points, misses,
                        body.reshape(sensor.shape), beside, baseline, observed, pose)


def beside_grid(local: np.ndarray, observed: Observation, pose: np.ndarray, sensor: Sensor, kept: np.ndarray,
                winners: np.ndarray, boxes: LayoutView | None = None) -> np.ndarray:
    """(M, 4) measured points (`local`: the observation's world points at `pose`) that keep a ray of their own
    inside a kept pixel (`kept`, flat (H * W,), won by `winners`): the frame's grid holds one point per pixel,
    the measurement more.

    A pixel is a sensor's beam by its column, and a sweep's points are not all on it: 8 % of a KITTI sweep's
    points share a pixel of its own 64 x 2,010 grid (two laser blocks firing at nearly one azimuth, near points
    on a neighbouring beam's elevation). Dropped, a re-simulation at the sweep's own pose loses them and a 0.1 s
    forecast returns 0.88x the truth's points. Which are rays of their own:
    - from the place a sweep was taken (within `SAME_PLACE_M`), every point of that sweep, those beyond the
      grid's beams and ranges too: what it measured is what a sensor there sees. From anywhere else a point
      beyond the grid's beams stays only within the observing sensor's own fan (`Observation.field_of_view`):
      KITTI's near returns lie above its top beam, but the ground a sweep saw 8-10 m ahead lies 30-90 deg
      below the horizon from a pose a second on, on no ray of the sensor. Where no sweep was taken
      elsewhere, from within `ALONE_REACH_M` of it too: nothing else measured those rays, and a 0.2 deg cell holds two firings of one KITTI ring 0.18 deg apart,
      so its z-buffer drops a sixth of the sweep (a one-sweep 0.1 s forecast on KITTI 00 returned 0.90x the
      truth's points with it, 0.97x without, at 0.98x -> 1.00x the better baseline's Chamfer; with 3 sweeps,
      keeping every point of the newest cost 1.00x -> 1.01x, so there the z-buffer stays); from beyond
      `HIDDEN_FROM_M`, less the points a nearer one of the sweep hides on their fine ray (`_unhidden`);
    - elsewhere, the nearest point per cell of the fine ray grid (`lidar.ray_grid`, the angular resolution of
      the densest sensor), the `own_sweep`'s on every cell it returns on, as the z-buffer of `measured_view`.
      Where the sweeps sit on the frames' beams (`Observation.on_beams`), only those on a beam of the pose: a
      point between its beams is on no ray the sensor has there, and a coarse fan (a VLP-16's 2 deg) would
      keep the old pose's rings between the new one's. A KITTI sweep's points scatter about their rings, and
      the next sweep's do too, so there they all stay (docs/evaluation.md has the figures).
    An actor's box in front of a point hides it, as it hides a pixel's point.
    """
    if not len(local) or not kept.any():
        return np.zeros((0, 4), dtype=np.float32)
    rng = point_ranges(local)
    rows = beam_rows(local, sensor)
    inside = (rows >= 0) & np.isfinite(rng) & (rng >= sensor.min_range) & (rng <= sensor.max_range)
    pixel = np.where(inside, rows * sensor.width + azimuth_columns(local[:, :2], sensor.width), 0)
    candidate = inside & kept[pixel]
    unplaced = ~inside  # no pixel of the grid holds them: beyond its beams or its ranges
    candidate[winners[winners < len(local)]] = False
    gaps, here = _nearest_sweep(observed, pose)
    if gaps[here] > SAME_PLACE_M:  # from elsewhere, only what the observing sensor's fan sees from the pose
        unplaced &= in_field_of_view(local, observed.field_of_view)
    alone = bool((np.linalg.norm(observed.positions - observed.positions[here], axis=1) < EGO_TRAVEL_M).all())
    if gaps[here] <= (ALONE_REACH_M if alone else SAME_EYES_M):
        chosen = np.flatnonzero((candidate | unplaced) & (observed.sweep == here))
        if gaps[here] > HIDDEN_FROM_M:
            chosen = _unhidden(local, rng, chosen, np.flatnonzero(observed.sweep == here))
    else:
        placed = inside & kept[pixel]
        chosen = _fine_winners(local, rng, placed | unplaced, observed, own_sweep(observed, pose))
        chosen = chosen[(candidate | unplaced)[chosen]]
        if observed.on_beams:
            chosen = chosen[beam_offsets(take_rows(local, chosen), sensor) <= ON_BEAM_SHARE]
    if boxes is not None and len(chosen):
        box = encode_range(boxes.range.reshape(-1)[pixel[chosen]], sensor.max_range)
        chosen = chosen[~((box > -1.0) & (box < encode_range(rng[chosen], sensor.max_range) - SNAP_TOLERANCE))]
    return take_rows(local, chosen)


def _unhidden(local: np.ndarray, rng: np.ndarray, chosen: np.ndarray, sweep: np.ndarray) -> np.ndarray:
    """The `chosen` points not behind the nearest of their `sweep`'s points on their fine ray cell by more than
    `HIDDEN_GAP_M` plus `HIDDEN_GAP_SHARE` of its range: from a pose that moved, a surface the sweep saw in
    front of them hides them (the truth does not return there), while the sweep's other firings on that
    surface stay. On the shared KITTI raw drive creeping behind traffic, the whole sweep moved 0.3 s ahead had
    1.09x the squared Chamfer of the same sweep less such points."""
    if not len(chosen):
        return chosen
    front = nearest_per_ray(take_rows(local, sweep)).range_at(ray_cells(take_rows(local, chosen)))
    front = np.where(front > 0, front, np.inf)
    return chosen[rng[chosen] <= front + HIDDEN_GAP_M + HIDDEN_GAP_SHARE * front]


def _fine_winners(local: np.ndarray, rng: np.ndarray, eligible: np.ndarray, observed: Observation,
                  own: int | None) -> np.ndarray:
    """Indices of the nearest `eligible` point per fine ray cell, the `own` sweep's on every cell it returns on."""
    index = np.flatnonzero(eligible)
    cells = ray_cells(take_rows(local, index))
    winners, won = nearest_per_pixel(cells, rng[index], ROWS * RAY_COLUMNS)
    if own is None:
        return index[winners]
    mine = observed.sweep[index] == own
    own_winners, own_cells = nearest_per_pixel(cells[mine], rng[index][mine], ROWS * RAY_COLUMNS)
    taken = np.isin(won, own_cells, assume_unique=True)
    return np.concatenate([index[mine][own_winners], index[winners[~taken]]])


def miss_reach(sensor: Sensor) -> int:
    """Columns of `sensor`'s grid within `MISS_REACH_DEG` of a ray, at least one."""
    return max(1, round(MISS_REACH_DEG * sensor.width / 360.0))


def row_misses(pixels: np.ndarray, sensor: Sensor) -> np.ndarray:
    """(H, W) pixels without a measured return that have one within `miss_reach` columns of their row."""
    seen = np.zeros(sensor.height * sensor.width, dtype=bool)
    seen[pixels] = True
    seen = seen.reshape(sensor.shape)
    near = np.zeros_like(seen)
    for d in range(1, miss_reach(sensor) + 1):
        near |= np.roll(seen, d, axis=1) | np.roll(seen, -d, axis=1)  # azimuth wraps
    return near & ~seen


def measured_points_of(image: RangeImage, points: np.ndarray, measured: MeasuredView) -> np.ndarray:
    """The frame's points (`unproject(image)`, one per returning pixel in row-major order) with every kept
    ray's point put back where it was measured."""
    pixels = np.flatnonzero(image.mask)
    kept = measured.mask.reshape(-1)[pixels]
    out = points.copy()
    put_rows(out, kept, take_rows(measured.points, pixels[kept]))
    return out


def _neighbours(values: np.ndarray, outside: float, reach: tuple[int, int] = (1, 1)) -> Iterator[np.ndarray]:
    """Each neighbouring ray's `values` (H, W, ...) within `reach` (columns, rows), aligned with the ray: rows
    end at the field of view (`outside` beyond), columns wrap in azimuth."""
    height = values.shape[0]
    pad = ((reach[1], reach[1]),) + ((0, 0),) * (values.ndim - 1)
    padded = np.pad(values, pad, constant_values=outside)
    for dr in range(-reach[1], reach[1] + 1):
        for dc in range(-reach[0], reach[0] + 1):
            if dr or dc:
                yield np.roll(padded, -dc, axis=1)[reach[1] + dr : reach[1] + dr + height]


def _without(image: RangeImage, points: np.ndarray, drop: np.ndarray) -> tuple[RangeImage, np.ndarray]:
    keep = ~drop[image.mask]
    return RangeImage(np.where(drop, 0.0, image.range).astype(np.float32),
                      np.where(drop, 0.0, image.intensity).astype(np.float32)), take_rows(points, keep)


def settle_additions(image: RangeImage, points: np.ndarray, measured: MeasuredView) -> tuple[RangeImage, np.ndarray]:
    """The frame (`image` and its points, one per returning pixel in row-major order) with what the network
    added next to the measurement settled against it; for frames without a map or a layout, on which the
    additions rest on nothing but the observation (`rollout`).

    1. A lone addition goes: a return none of whose 8 neighbouring rays returns within `LONE_RADIUS_M` (plus
       `LONE_SLOPE` of its range, the rays' own spread) of its point stands where nothing was seen (a speckle
       in the sky, a streak through a gap).
    2. An addition behind a measured surface that borders it (farther than a measured range within `GAP_REACH`
       of it divided by `BEHIND_RATIO`) takes that surface's range: a surface seen from a new angle spreads its
       points apart, and the rays between them meet it, not the ground the network drew behind it (through
       parked cars).
    3. Within `NEAR_ONLY_M` of an observing sensor an addition off the ground near the car goes: from there
       the pose sees with nearly that sweep's eyes, and the observation explains the frame but for the holes
       around the car (the observing sensors' blind discs moved, the gaps between re-projected rings), which
       the network fills with ground well; a guessed surface costs the squared Chamfer the square of its
       error. A metre or more from every observing sensor the truth sees past what was measured, and the
       network fills it.
    4. An addition on a ray of the fine grid (`lidar.ray_grid`) that a measured point returns on goes: a pixel
       is taller than a fine ray, and an addition drawn in front of its neighbour's measured point there is
       the worse range.
    5. An addition where an observing sweep saw through goes (`sight_through`): its ray there returned
       beyond it, or nothing within the sensor's reach.
    6. An addition beyond `FAR_ADDITION_M` behind a kept measured surface near its ray (within
       `FAR_BEHIND_REACH` of the fine grid: 0.2 deg up or down, 2 deg either side) goes (`far_behind`): a
       surface measured from elsewhere comes back sparse, and the network draws the far ground through the
       gaps between its points, radial streaks beyond a street's walls. Nearer than 20 m, the ground behind a
       parked car the new pose may see round stays.

    docs/evaluation.md has what each rule was measured to do on the shared real drives.
    """
    # Each rule asks only about the additions, and the frame loses its dropped rays once, at the end: a rule
    # about a point does not depend on which other additions go.
    mask = image.mask
    added = np.flatnonzero(mask & ~measured.mask)
    # 1. lone additions
    xyz = np.full((*mask.shape, 3), np.nan, dtype=np.float32)
    put_rows(xyz.reshape(-1, 3), mask.reshape(-1), points[:, :3])
    reach = LONE_RADIUS_M + LONE_SLOPE * image.range
    drop = np.zeros(mask.size, dtype=bool)
    drop[added] = _lone(xyz, reach, added)
    added = added[~drop[added]]
    # 2. additions behind a bordering measured surface continue it, along their own rays
    order = np.cumsum(mask.reshape(-1)) - 1  # each returning pixel's row in `points`
    nearest = measured.bordering.reshape(-1)
    ranges = image.range.reshape(-1)
    behind = added[nearest[added] < BEHIND_RATIO * ranges[added]]
    if len(behind):
        ranges = ranges.copy()
        ranges[behind] = nearest[behind]
        points = points.copy()
        points[order[behind], :3] *= (ranges[behind] / image.range.reshape(-1)[behind])[:, None]
        image = RangeImage(ranges.reshape(mask.shape).astype(np.float32), image.intensity)
    # 3-6, asked of the additions' points (rule 2's where it moved them)
    own = take_rows(points, order[added])
    gone = on_measured_rays(own, measured) | sight_through(own, measured)
    if measured.baseline <= NEAR_ONLY_M:  # the near ground lies within NEAR_GROUND_M, short of FAR_ADDITION_M
        gone |= ~near_ground(ranges[added], own, measured)
    else:
        gone |= far_behind(own, measured)
    drop[added[gone]] = True
    return _without(image, points, drop.reshape(mask.shape))


def sight_through(points: np.ndarray, measured: MeasuredView) -> np.ndarray:
    """(N,) bool: the frame's sensor-frame `points` on a ray of an observing sweep (`Observation.sight`) that
    returned beyond them (by more than `SIGHT_TOLERANCE_M`, plus `SIGHT_SLOPE` of their range), or returned
    nothing within the sensor's reach (`max_range`): the sweep saw through where they stand. A silent ray clears
    its whole reach, far additions too: a sensor that saw nothing there (the sky over open ground) has no
    surface within its reach on that ray, and a pose a few metres on has none either (docs/evaluation.md, a
    real HDL-32E drive)."""
    out = np.zeros(len(points), dtype=bool)
    observed = measured.observed
    if observed is None or not len(points):
        return out
    sensor = observed.sensor
    for sight, sweep_pose in zip(observed.sight, observed.poses, strict=True):
        local = transform_points(points[:, :4].astype(np.float32), np.linalg.inv(sweep_pose) @ measured.pose)
        inside, seen, rng = _sight_at(sight, local, sensor)
        out |= inside & (_seen_beyond(seen, rng) | ((seen <= 0) & (rng <= sensor.max_range)))
    return out


def _lone(xyz: np.ndarray, reach: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """(len(pixels),) bool: which rays at the flat `pixels` of a (H, W, 3) point image (NaN where none) have no
    neighbouring ray (of 8: rows end at the field of view, columns wrap in azimuth) with a point within `reach`
    (H, W) of their own. Asked of the additions only, about a tenth of a frame's rays."""
    height, width = reach.shape
    flat = xyz.reshape(-1, 3)
    rows, cols = np.divmod(pixels, width)
    own, limit = take_rows(flat, pixels), reach.reshape(-1)[pixels]
    neighboured = np.zeros(len(pixels), dtype=bool)
    for dr in (-1, 0, 1):
        for dc in (-1, 0, 1):
            if dr or dc:
                row = rows + dr
                inside = np.flatnonzero((row >= 0) & (row < height))
                other = take_rows(flat, row[inside] * width + (cols[inside] + dc) % width)
                with np.errstate(invalid="ignore"):
                    neighboured[inside] |= np.linalg.norm(other - take_rows(own, inside), axis=-1) <= limit[inside]
    return ~neighboured


def on_measured_rays(points: np.ndarray, measured: MeasuredView) -> np.ndarray:
    """(N,) bool: the sensor-frame `points` (the frame's additions) that lie in a cell of the fine ray grid
    (`lidar.ray_grid`) that a kept measured point lies in: a neighbouring pixel's measurement."""
    return measured.kept_cells[ray_cells(points)] if len(points) else np.zeros(0, dtype=bool)


def far_behind(points: np.ndarray, measured: MeasuredView) -> np.ndarray:
    """(N,) bool: the sensor-frame `points` (the frame's additions) farther than `FAR_ADDITION_M` and behind a
    kept measured surface near their ray (`MeasuredView.surfaces`) by more than 1 / `BEHIND_RATIO`."""
    rng = point_ranges(points)
    out = rng > FAR_ADDITION_M
    if out.any():
        low, nearest = measured.surfaces
        rows, cols = np.divmod(ray_cells(points[out]), RAY_COLUMNS)
        band = (rows >= low) & (rows < low + len(nearest))
        surface = np.full(len(rows), np.inf, dtype=np.float32)
        surface[band] = nearest[rows[band] - low, cols[band]]
        out[out] = surface < BEHIND_RATIO * rng[out]
    return out


def near_ground(ranges: np.ndarray, points: np.ndarray, measured: MeasuredView) -> np.ndarray:
    """(N,) bool: the sensor-frame `points` (at `ranges`) within `NEAR_GROUND_M` of the sensor and
    `NEAR_GROUND_TOLERANCE_M` of the measured ground's height (the low tail of the kept points' heights)."""
    ground = measured.ground_height
    if ground is None:
        return np.zeros(len(points), dtype=bool)
    return (ranges <= NEAR_GROUND_M) & (np.abs(points[:, 2] - ground) <= NEAR_GROUND_TOLERANCE_M)


def keep_measured(x: torch.Tensor, measured: MeasuredView, sensor: Sensor) -> torch.Tensor:
    """A sampled (B, 3, H, W) flow image (range, intensity, return) with every kept ray set to the measurement
    and every measured miss to no return."""
    keep = torch.from_numpy(measured.mask).to(x.device)
    values = torch.from_numpy(np.stack([
        encode_range(measured.image.range, sensor.max_range),
        measured.image.intensity * 2.0 - 1.0,
        np.ones(sensor.shape, dtype=np.float32),
    ])).to(device=x.device, dtype=x.dtype)
    out = torch.where(keep, values, x)
    misses = torch.from_numpy(measured.misses).to(x.device)
    out[:, RETURN] = torch.where(misses, torch.full_like(out[:, RETURN], -1.0), out[:, RETURN])
    return out
