"""Range images: the (C, H, W) view every LidarVerse component shares.

Layout (docs/design.md): row 0 is the highest beam, column u = floor(0.5 * (1 - atan2(y, x) / pi) * W), so
straight ahead is the centre column and azimuth wraps around. Range 0 means no return.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lidar.rows import take_rows
from lidar.sensors import Sensor


@dataclass
class RangeImage:
    """A projected sweep. `range` is metres with 0 for no return; `intensity` is in [0, 1]."""

    range: np.ndarray
    intensity: np.ndarray

    def __post_init__(self) -> None:
        if self.range.shape != self.intensity.shape or self.range.ndim != 2:
            raise ValueError(
                f"range and intensity must be matching (H, W) arrays, got {self.range.shape} and {self.intensity.shape}"
            )

    @property
    def mask(self) -> np.ndarray:
        return self.range > 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.range.shape  # type: ignore[return-value]

    def stack(self) -> np.ndarray:
        """(3, H, W) float32: range, intensity, mask."""
        return np.stack([self.range, self.intensity, self.mask.astype(np.float32)]).astype(np.float32)


def azimuth_columns(points_xy: np.ndarray, width: int) -> np.ndarray:
    """Column index of each point by the docs/design.md formula, wrapped into [0, width)."""
    az = np.arctan2(points_xy[:, 1], points_xy[:, 0])
    u = np.floor(0.5 * (1.0 - az / np.pi) * width).astype(np.int64)
    return np.mod(u, width)


def point_ranges(points: np.ndarray) -> np.ndarray:
    """Distance of each point (N, 3+) from its origin; einsum, since `np.linalg.norm` on a column slice is
    four times slower and this runs on every cached point of every frame."""
    xyz = points[:, :3]
    return np.sqrt(np.einsum("ij,ij->i", xyz, xyz))


def off_origin(points: np.ndarray) -> np.ndarray:
    """(N,) bool: the points (N, 3+) not at the sensor's origin, where readers leave a placeholder for a ray
    without a return (it has no azimuth). Summed column by column: a sum along a 3-wide row is five times
    slower on a column slice."""
    return (np.abs(points[:, 0]) + np.abs(points[:, 1]) + np.abs(points[:, 2])) > 0


def point_elevations(points: np.ndarray) -> np.ndarray:
    """Elevation of each point (N, 3+) above its origin's horizon, radians: the angle a beam table lists."""
    return np.arctan2(points[:, 2], np.hypot(points[:, 0], points[:, 1]))


#: Elevation percentiles that bound a sweep's vertical field of view: robust to a few stray returns.
FOV_PERCENTILES = (0.1, 99.9)


def elevation_span(points: np.ndarray) -> tuple[float, float]:
    """(lowest, highest) elevation (rad) of a sweep's (N, 3+) points in its sensor frame: the vertical field of
    view of the sensor that recorded it, wherever its beams lie."""
    low, high = np.percentile(point_elevations(np.asarray(points)), FOV_PERCENTILES)
    return float(low), float(high)


def beam_rows(points: np.ndarray, sensor: Sensor) -> np.ndarray:
    """Nearest beam row per point from its elevation; -1 where it lies outside the sensor's beams.

    A point more than one beam spacing above the top beam or below the bottom one does not belong to any
    beam (e.g. a scan that is not in the sensor frame), so it is rejected instead of clamped.
    """
    elev = point_elevations(points)
    beams = sensor.elevations[::-1]  # ascending for searchsorted
    if len(beams) == 1:
        rows = np.zeros(len(points), dtype=np.int64)
        tol = np.deg2rad(1.0)
        rows[np.abs(elev - beams[0]) > tol] = -1
        return rows
    rows = _nearest_beams(elev, sensor)
    spacing = np.diff(beams)
    top_tol, bottom_tol = spacing[-1], spacing[0]
    outside = (elev > beams[-1] + top_tol) | (elev < beams[0] - bottom_tol)
    rows[outside] = -1
    return rows


def _nearest_beams(elevations: np.ndarray, sensor: Sensor) -> np.ndarray:
    """Row (0 = highest beam) of the beam nearest each elevation (rad), of two tied the lower; never -1."""
    beams = sensor.elevations[::-1]  # ascending for searchsorted
    asc = np.searchsorted(0.5 * (beams[1:] + beams[:-1]), elevations)
    return (len(beams) - 1 - asc).astype(np.int64)


def nearest_beam_rows(points: np.ndarray, sensor: Sensor) -> np.ndarray:
    """Row of each point's (N, 3+) nearest beam by elevation, never -1: a point beyond the outer beams takes
    the outer beam's row (`beam_rows` rejects it instead)."""
    return _nearest_beams(point_elevations(points), sensor)


def beam_offsets(points: np.ndarray, sensor: Sensor) -> np.ndarray:
    """How far each point (N, 3+) lies from its nearest beam's elevation, in that beam's own spacing (the mean of
    its gaps to the beams above and below): 0 on the beam, 0.5 midway to the next; beyond the outer beams it
    grows on."""
    elev = point_elevations(points)
    beams = sensor.elevations
    if len(beams) < 2:
        return np.zeros(len(points))
    spacing = np.abs(np.diff(beams))
    local = np.r_[spacing[0], 0.5 * (spacing[1:] + spacing[:-1]), spacing[-1]]
    rows = _nearest_beams(elev, sensor)
    return np.abs(elev - beams[rows]) / local[rows]


def rows_from_ring(points: np.ndarray, ring: np.ndarray, sensor: Sensor) -> np.ndarray:
    """Rows from a file's ring/beam column, oriented so row 0 is the highest beam.

    Datasets disagree on whether ring 0 is the top (Ouster) or the bottom beam (some Velodyne drivers),
    so the order is read off the data: if mean elevation rises with the ring index, the index is flipped.
    """
    ring = np.asarray(ring).astype(np.int64)
    if ring.size == 0:
        return ring
    valid = (ring >= 0) & (ring < sensor.height)
    elev = point_elevations(points)
    if valid.sum() > 2 and np.unique(ring[valid]).size > 1:
        corr = np.corrcoef(ring[valid].astype(np.float64), elev[valid])[0, 1]
        if np.isfinite(corr) and corr > 0:
            ring = sensor.height - 1 - ring
    return np.where(valid, ring, -1)


#: Widest splat (columns either side of a point's own): a nearer point's patch is clipped to this.
MAX_SPLAT = 4


def grid_winners(
    points: np.ndarray, sensor: Sensor, ring: np.ndarray | None = None, footprint: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the points that win a pixel of the z-buffer (the nearest per pixel) and those pixels (flat).

    `project` keeps only their range along the pixel's centre ray; a caller that needs the winners' exact
    coordinates (a sweep thinned to a sensor's density without moving its points) takes them from here.
    With `footprint` > 0 a point may win several pixels (see `project`), so an index can repeat.
    """
    pts = np.asarray(points, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] < 3:
        raise ValueError(f"points must be an (N, 3+) array, got shape {pts.shape}")
    if ring is not None and np.shape(ring) != (len(pts),):
        raise ValueError(f"ring has shape {np.shape(ring)} for {len(pts)} points; expected one beam index per point")
    if not footprint >= 0:
        raise ValueError(f"footprint must be >= 0 metres, got {footprint}")
    rng = point_ranges(pts)
    rows = rows_from_ring(pts, ring, sensor) if ring is not None else beam_rows(pts, sensor)
    keep = np.flatnonzero((rows >= 0) & (rng >= sensor.min_range) & (rng <= sensor.max_range) & np.isfinite(rng))
    index, rows, cols = keep, rows[keep], azimuth_columns(take_rows(pts, keep), sensor.width)
    if footprint > 0:
        index, rows, cols = _splat(index, rows, cols, rng[keep], sensor, footprint)
    winners, pixels = nearest_per_pixel(rows * sensor.width + cols, rng[index], sensor.height * sensor.width)
    return index[winners], pixels


def nearest_per_pixel(pix: np.ndarray, distance: np.ndarray, n_pixels: int) -> tuple[np.ndarray, np.ndarray]:
    """The z-buffer: for each pixel any candidate falls on, the position of its nearest candidate (ties go to
    the earlier one), with those pixels in increasing order.

    Two scatter-minimums instead of a sort: this runs on every cached point and every (ray, box) pair of
    every frame. The scatter spans only the pixels between the lowest and the highest candidate: a sweep's
    fan covers a sixth of the fine ray grid's rows (`lidar.ray_grid`), and filling the whole 1.6 M-cell grid
    twice cost more than the scatter itself.
    """
    if not len(pix):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    low = int(pix.min())
    span = min(int(pix.max()) - low + 1, n_pixels - low)
    local = pix - low
    nearest = np.full(span, np.inf)
    np.minimum.at(nearest, local, distance)
    tied = np.flatnonzero(distance == nearest[local])
    first = np.full(span, len(pix))
    np.minimum.at(first, local[tied], tied)
    pixels = np.flatnonzero(first < len(pix))
    return first[pixels], pixels + low


def _splat(
    index: np.ndarray, rows: np.ndarray, cols: np.ndarray, rng: np.ndarray, sensor: Sensor, footprint: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each point repeated over the columns its `footprint`-wide patch spans at its range (azimuth wraps).

    Only along its row: the neighbouring columns of a beam meet the ground, or a wall, at about the same
    range, but the beam above meets the ground farther away, so spreading a point upwards would raise it.
    """
    half = np.minimum(footprint / (2.0 * rng * (2.0 * np.pi / sensor.width)), MAX_SPLAT).astype(np.int64)
    wide = np.flatnonzero(half > 0)  # only near points span more than their own pixel
    out = [(index, rows, cols)]
    for step in range(1, int(half.max(initial=0)) + 1):
        near = wide[half[wide] >= step]
        for sign in (-1, 1):
            out.append((index[near], rows[near], (cols[near] + sign * step) % sensor.width))
    return tuple(np.concatenate(parts) for parts in zip(*out, strict=True))


def project(
    points: np.ndarray, sensor: Sensor, ring: np.ndarray | None = None, footprint: float = 0.0
) -> RangeImage:
    """Z-buffer points (N, 3+) in the sensor frame into a range image; the nearest return wins a pixel.

    Column 3, if present, is intensity in [0, 1]. `ring` gives each point's beam index when the file has
    one; otherwise the nearest beam elevation decides. Points outside [min_range, max_range] are dropped.
    `footprint` (m) is the size of the surface patch each point stands for (a cache voxel): a point then
    covers every column of its row that its patch spans at its range. Bare points let the background show
    through the gaps of a near surface seen from a new pose; patches hide it, as the surface would.
    """
    pts = np.asarray(points, dtype=np.float64)
    index, pix = grid_winners(pts, sensor, ring, footprint)
    height, width = sensor.shape
    range_img = np.zeros(height * width, dtype=np.float32)
    inten_img = np.zeros(height * width, dtype=np.float32)
    range_img[pix] = point_ranges(take_rows(pts, index))
    if pts.shape[1] > 3:
        inten_img[pix] = np.clip(pts[:, 3][index], 0.0, 1.0)
    return RangeImage(range_img.reshape(height, width), inten_img.reshape(height, width))


def unproject(image: RangeImage, sensor: Sensor) -> np.ndarray:
    """Points (N, 4) float32 (x, y, z, intensity) for every returning pixel, along its beam and column centre."""
    if image.shape != sensor.shape:
        raise ValueError(f"range image is {image.shape} but sensor {sensor.name!r} is {sensor.shape}")
    mask = image.mask
    dirs = take_rows(sensor.ray_table().reshape(-1, 3), mask.reshape(-1))
    xyz = dirs * image.range[mask][:, None].astype(np.float64)
    return np.concatenate([xyz, image.intensity[mask][:, None]], axis=1).astype(np.float32)


def column_neighbours(known: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(H, W) row of the nearest known ray above each ray in its column (-1: none) and below it (H: none)."""
    height = known.shape[0]
    rows = np.arange(height)[:, None]
    above = np.maximum.accumulate(np.where(known, rows, -1), axis=0)
    below = np.minimum.accumulate(np.where(known, rows, height)[::-1], axis=0)[::-1]
    above = np.concatenate([np.full((1, known.shape[1]), -1), above[:-1]])
    below = np.concatenate([below[1:], np.full((1, known.shape[1]), height)])
    return above, below


def encode_range(range_m: np.ndarray, max_range: float) -> np.ndarray:
    """Metres -> log-range in [-1, 1] as the network sees it; 0 m (no return) maps to exactly -1."""
    r = np.clip(np.asarray(range_m, dtype=np.float32), 0.0, max_range)
    return (2.0 * np.log1p(r) / np.log1p(max_range) - 1.0).astype(np.float32)


def decode_range(encoded: np.ndarray, max_range: float, min_range: float) -> np.ndarray:
    """Inverse of `encode_range`; anything decoding below `min_range` is a ray drop (0 m)."""
    e = np.clip(np.asarray(encoded, dtype=np.float32), -1.0, 1.0)
    r = np.expm1((e + 1.0) * 0.5 * np.log1p(max_range)).astype(np.float32)
    return np.where(r >= min_range, r, 0.0).astype(np.float32)
