"""What moved between registered sweeps: objects found in the newest sweep, each with the velocity that carried
it from the sweep before.

A forecast that moves observed sweeps to a new pose moves them with the world; a vehicle that drives moves
with itself. Left as measured, the newest copy of a lead vehicle stands where it was at the last sweep, and
the older sweeps' copies stand where it was before, nearer the car, where a z-buffer of the sweeps prefers
them. On the shared KITTI raw drive behind a vehicle in slow traffic that made the z-buffer of three sweeps
2.2x the newest sweep moved alone (squared Chamfer at 0.1 s).

The method (`moving_objects`), on world-frame points of K >= 2 sweeps:
1. Above the ground: points higher than `CLEARANCE_M` over the lowest point of their `GROUND_CELL_M` cell of
   all sweeps, within `REACH_M` of the newest sensor.
2. Objects: connected components of the newest sweep's above-ground points on a `VOXEL_M` grid, of object size
   (`MIN_POINTS` points or more, at most `MAX_EXTENT_M` across): walls and hedges are no object.
3. Motion: each object is aligned onto the sweep before it (points within `SEARCH_M`) by a translation in the
   ground plane (`align_translation`, nearest-point matches, trimmed). It moves when the translation explains
   the earlier copy much better than standing still (`GAIN`) and is at least `MIN_SHIFT_M`; with three sweeps
   or more, the sweep before that one must agree (`AGREE_M` after twice the time).
4. The earlier sweeps' copies of a moving object (their points within `COPY_M` of the object moved back to
   their time) are stale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage
from scipy.spatial import cKDTree

#: Ground cell (m) and how far above its lowest point (m) a point stands above the ground.
GROUND_CELL_M = 2.0
CLEARANCE_M = 0.3
#: Metres over the ground from which a point in a moving object's ground columns is part of it.
OFF_GROUND_M = 0.1
#: Objects are sought within this many metres of the newest sensor: farther, a sweep's points are too sparse
#: to align a car's copies.
REACH_M = 40.0
#: Grid (m) on which above-ground points connect into objects, and an object's size.
VOXEL_M = 0.4
MIN_POINTS = 40
MAX_EXTENT_M = 12.0
#: Metres around an object within which the sweep before holds its earlier copy: 30 m/s for 0.1 s.
SEARCH_M = 3.0
#: An object moves when its aligned copy's trimmed mean match distance is at most 1 / `GAIN` of the unmoved
#: one's and it shifted at least `MIN_SHIFT_M`.
GAIN = 2.0
MIN_SHIFT_M = 0.08
#: Metres within which the sweep two back must agree with the velocity (three sweeps or more).
AGREE_M = 0.25
#: Metres within which an earlier sweep's point is part of a moving object's earlier copy.
COPY_M = 0.3
#: Share of the nearest matches kept when aligning (the rest: what one copy saw and the other did not).
TRIM = 0.7
ALIGN_ITERATIONS = 12
#: Most points of an object aligned (evenly picked): a bus's thousands say no more than 300.
MAX_ALIGNED = 300


@dataclass
class MovingObjects:
    """Moving objects of the newest of K sweeps: per point of the stacked sweeps, the velocity (m/s, world
    frame; zero for what stands) and whether it is an earlier sweep's stale copy of a moving object."""

    #: (N, 3) velocity of each point of the newest sweep's moving objects; zero elsewhere.
    velocity: np.ndarray
    #: (N,) earlier sweeps' copies of a moving object.
    stale: np.ndarray
    #: (M, 3) each moving object's velocity (m/s), for reports.
    objects: np.ndarray


def moving_objects(points: np.ndarray, sweep: np.ndarray, times: np.ndarray, sensor: np.ndarray) -> MovingObjects:
    """`MovingObjects` of world-frame `points` (N, 3+) measured by sweeps `sweep` (N,) (indices into `times`,
    seconds, increasing; the last is the newest), the newest sweep's sensor at `sensor` (3,)."""
    points = np.asarray(points)[:, :3].astype(np.float64)
    sweep = np.asarray(sweep)
    times = np.asarray(times, dtype=np.float64)
    newest = len(times) - 1
    velocity = np.zeros((len(points), 3))
    stale = np.zeros(len(points), dtype=bool)
    found: list[np.ndarray] = []
    if newest < 1:
        return MovingObjects(velocity.astype(np.float32), stale, np.zeros((0, 3)))
    near = np.linalg.norm(points[:, :2] - sensor[:2], axis=1) <= REACH_M + SEARCH_M
    height = height_over_ground(points, near)
    above = near & (height > CLEARANCE_M)
    lifted = np.flatnonzero(above)
    earlier = [lifted[sweep[lifted] == j] for j in range(newest)]
    trees = [cKDTree(points[index, :2]) if len(index) else None for index in earlier]
    off_ground = np.flatnonzero(near & (height > OFF_GROUND_M))
    low = off_ground[(sweep[off_ground] == newest) & ~above[off_ground]]
    off_ground = off_ground[sweep[off_ground] < newest]  # where the older copies are sought
    older_xy, older_sweep = points[off_ground, :2], sweep[off_ground]
    for members in objects_of(points, lifted[sweep[lifted] == newest], sensor):
        shift = _motion(points, members, earlier, trees, times)
        if shift is None:
            continue
        found.append(shift)
        members = _whole(points, members, low)
        velocity[members, :2] = shift
        for j in range(newest):
            back = points[members, :2] - shift * (times[newest] - times[j])
            box = ((older_sweep == j) & (older_xy >= back.min(axis=0) - COPY_M).all(axis=1)
                   & (older_xy <= back.max(axis=0) + COPY_M).all(axis=1))
            index = off_ground[box]
            if len(index):
                distance, _ = cKDTree(back).query(points[index, :2], distance_upper_bound=COPY_M)
                stale[index[np.isfinite(distance)]] = True
    objects = np.pad(np.reshape(found, (-1, 2)), ((0, 0), (0, 1)))
    return MovingObjects(velocity.astype(np.float32), stale, objects)


def height_over_ground(points: np.ndarray, where: np.ndarray) -> np.ndarray:
    """(N,) metres of `where` points over the lowest of `where` in their ground cell; 0 elsewhere."""
    out = np.zeros(len(points))
    index = np.flatnonzero(where)
    if not len(index):
        return out
    keys, inverse = np.unique(_cells(points[index], GROUND_CELL_M), return_inverse=True)
    lowest = np.full(len(keys), np.inf)
    np.minimum.at(lowest, inverse, points[index, 2])
    out[index] = points[index, 2] - lowest[inverse]
    return out


def _whole(points: np.ndarray, members: np.ndarray, low: np.ndarray) -> np.ndarray:
    """An object's `members` and the `low` points (its sweep's, just off the ground) in the ground columns
    of its voxels: a car's bumper and sills stand lower than `CLEARANCE_M`."""
    keys = np.unique(_cells(points[members], VOXEL_M))
    return np.union1d(members, low[np.isin(_cells(points[low], VOXEL_M), keys)])


def _cells(points: np.ndarray, size: float) -> np.ndarray:
    """(N,) one integer per ground cell of `size` metres that each point stands in: rows of 2**31 cells (a
    cell index stays far inside that for any drive)."""
    cells = np.floor(points[:, :2] / size).astype(np.int64)
    return cells[:, 0] * 2**31 + cells[:, 1]


def objects_of(points: np.ndarray, index: np.ndarray, sensor: np.ndarray) -> list[np.ndarray]:
    """Object-sized connected components (on the `VOXEL_M` grid) of `points[index]` within `REACH_M` of the
    sensor: index arrays into `points`."""
    index = index[np.linalg.norm(points[index, :2] - sensor[:2], axis=1) <= REACH_M]
    if len(index) < MIN_POINTS:
        return []
    voxels = np.floor(points[index] / VOXEL_M).astype(np.int64)
    low = voxels.min(axis=0)
    grid = np.zeros(tuple(voxels.max(axis=0) - low + 1), dtype=bool)
    grid[tuple((voxels - low).T)] = True
    labels, count = ndimage.label(grid, structure=np.ones((3, 3, 3)))
    point_label = labels[tuple((voxels - low).T)]
    order = np.argsort(point_label, kind="stable")
    bounds = np.searchsorted(point_label[order], np.arange(1, count + 2))
    out = []
    for k in range(count):
        members = index[order[bounds[k]: bounds[k + 1]]]
        if len(members) < MIN_POINTS:
            continue
        extent = points[members, :2].max(axis=0) - points[members, :2].min(axis=0)
        if extent.max() <= MAX_EXTENT_M:
            out.append(members)
    return out


def _motion(points: np.ndarray, members: np.ndarray, earlier: list[np.ndarray], trees: list[cKDTree | None],
            times: np.ndarray) -> np.ndarray | None:
    """The ground-plane velocity (2,) m/s of the newest sweep's object `members`, or None where it stands or
    its copies disagree."""
    newest = len(times) - 1
    previous = newest - 1
    if trees[previous] is None:
        return None
    mine = points[members[:: max(1, len(members) // MAX_ALIGNED)], :2]
    shift, moved, still = align_translation(mine, trees[previous])
    if not MIN_SHIFT_M <= np.linalg.norm(shift) <= SEARCH_M or moved * GAIN > still:
        return None
    velocity = -shift / (times[newest] - times[previous])
    if newest >= 2 and trees[newest - 2] is not None:
        back = mine - velocity * (times[newest] - times[newest - 2])
        distance, _ = trees[newest - 2].query(back, distance_upper_bound=1.0)
        if _trimmed_mean(distance) > AGREE_M:
            return None
    return velocity


def align_translation(source: np.ndarray, target: cKDTree) -> tuple[np.ndarray, float, float]:
    """The 2D translation that carries `source` (N, 2) onto the points of `target` (a tree of (M, 2)), by
    trimmed nearest-point matches (within `SEARCH_M`); with the trimmed mean match distance after and before
    it."""
    distance, _ = target.query(source, distance_upper_bound=SEARCH_M)
    still = _trimmed_mean(distance)
    if still * GAIN < MIN_SHIFT_M:  # where it stands it fits too well for a shift to explain it better
        return np.zeros(2), still, still
    # from standing still, and from the centroid of what the target holds around the source (a fast object)
    low, high = source.min(axis=0) - SEARCH_M, source.max(axis=0) + SEARCH_M
    around = target.data[target.query_ball_point((low + high) / 2, float(np.linalg.norm(high - low)) / 2)]
    starts = [np.zeros(2)] + ([around.mean(axis=0) - source.mean(axis=0)] if len(around) else [])
    shift, moved = min((_refine(source, target, start) for start in starts), key=lambda fit: fit[1])
    return shift, moved, still


def _refine(source: np.ndarray, target: cKDTree, shift: np.ndarray) -> tuple[np.ndarray, float]:
    """Trimmed nearest-point iterations from `shift`: the translation and its trimmed mean match distance."""
    for _ in range(ALIGN_ITERATIONS):
        distance, nearest = target.query(source + shift, distance_upper_bound=SEARCH_M)
        found = np.isfinite(distance)
        if found.sum() < MIN_POINTS // 2:
            break
        keep = found & (distance <= _nearest_share(distance).max())
        step = (target.data[nearest[keep]] - (source[keep] + shift)).mean(axis=0)
        shift = shift + step
        if np.linalg.norm(step) < 1e-3:
            break
    return shift, _trimmed_mean(target.query(source + shift, distance_upper_bound=SEARCH_M)[0])


def _nearest_share(distance: np.ndarray) -> np.ndarray:
    """The `TRIM` share of the smallest finite `distance` values (the matches both copies saw)."""
    finite = distance[np.isfinite(distance)]
    kept = max(1, int(len(finite) * TRIM))
    return np.partition(finite, kept - 1)[:kept] if len(finite) else finite


def _trimmed_mean(distance: np.ndarray) -> float:
    share = _nearest_share(distance)
    return float(share.mean()) if len(share) else float("inf")
