"""What the world model sees besides the noisy image: one (C, H, W) condition in the new sensor's range view.

Training and rollout build it with the same `build_condition` (a rollout in its two halves, `views_condition`
and `with_cache`), so the two can never drift apart. Ranges are in the network's log-range encoding
(`lidar.range_image.encode_range`), -1 where a layer has nothing. The channels, in order (K map classes, J boxed
actor classes):

    cache     range, intensity*2-1, mask         the z-buffered cache of everything generated or observed,
                                                  each point a voxel-wide patch along its row
    map       ground range, building range,       the HD map ray-cast from the pose: the ground surface and
              vegetation range, class one-hot      the extruded footprints (`HDMap.range_view`; "building"
              (K), present flag                    holds buildings and barriers), the ground class under
                                                  each ray
    layout    box range, class one-hot (J),       the actors' 3-D boxes at the frame's time, ray-cast
              present flag
    coords    beam elevation, sin/cos azimuth     where each pixel looks

Any of cache, map and layout may be absent (first frame, free generation, real-data forecasting): a dropped
block holds -1 ranges and zero flags, exactly what `drop_map` / `build_condition(..., None, ...)` give.

`prior_image` turns a condition into the deterministic sweep the network corrects (docs/design.md): the cache
where it returns, else the nearest of the map's ground and built footprints (buildings, walls, fences),
with a layout box in front of either winning; where a cached return lies on the map's surface, the map's
exact range replaces it. Green areas are condition only, not prior: the map knows where trees grow, not
where their trunks stand.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy.spatial.transform import Rotation

from inference.cache import VOXEL_SIZE
from lidar.boxes import box_range_view
from lidar.range_image import RangeImage, decode_range, encode_range, project
from lidar.sensors import RAY_TABLES_KEPT, Sensor
from lidar.vocabulary import BOXED_CLASSES, MAP_CLASSES, OBJECT_CLASSES, MapView, transform_points

#: Boxed actor classes one-hot encoded in the layout block, in `lidar.vocabulary.BOXED_CLASSES` order.
LAYOUT_CLASSES: tuple[str, ...] = BOXED_CLASSES

CACHE_RANGE, CACHE_INTENSITY, CACHE_MASK = 0, 1, 2
#: The cache's range and intensity channels, in the same encoding as the generated image (`encode_image`).
CACHE_IMAGE = slice(0, 2)
MAP_START = 3
GROUND_RANGE, BUILDING_RANGE, VEGETATION_RANGE = 3, 4, 5
MAP_RANGE_CHANNELS = 3
#: Encoded-range gap (about 10 % of the range) within which a cached return confirms the map's surface.
SNAP_TOLERANCE = 0.05
#: Surface patch (m) a cached point stands for when it is z-buffered into a new view: the cache's voxel.
#: Without it, ground behind a near wall shows through the wall's gaps.
CACHE_FOOTPRINT = VOXEL_SIZE
#: Beam elevation, sin and cos of azimuth at the end of the condition.
COORD_CHANNELS = 3
#: How far (columns, rows) a gap in the prior looks for a neighbour's range (`fill_gaps`).
GAP_REACH = (2, 1)


@dataclass(frozen=True)
class ConditionLayout:
    """Channel positions for a model with `num_map_classes` map classes (the only size that varies)."""

    num_map_classes: int = len(MAP_CLASSES)

    @property
    def map_block(self) -> slice:
        """Ground/building/vegetation ranges, class one-hot and present flag (what `drop_map` clears)."""
        return slice(MAP_START, self.layout_start)

    @property
    def map_classes(self) -> slice:
        return slice(MAP_START + MAP_RANGE_CHANNELS, self.layout_start - 1)

    @property
    def layout_start(self) -> int:
        return MAP_START + MAP_RANGE_CHANNELS + self.num_map_classes + 1

    @property
    def box_range(self) -> int:
        return self.layout_start

    @property
    def coords_start(self) -> int:
        return self.layout_start + 1 + len(LAYOUT_CLASSES) + 1

    @property
    def channels(self) -> int:
        return self.coords_start + COORD_CHANNELS

    def range_channels(self) -> tuple[int, ...]:
        """Channels that hold an encoded range (-1 = nothing there) rather than a 0/1 flag."""
        return (CACHE_RANGE, GROUND_RANGE, BUILDING_RANGE, VEGETATION_RANGE, self.box_range)


def condition_channels(num_map_classes: int = len(MAP_CLASSES)) -> int:
    return ConditionLayout(num_map_classes).channels


@dataclass
class LayoutView:
    """Actor boxes seen from one pose: range to the nearest box (m, 0 = none) and its LAYOUT_CLASSES index."""

    range: np.ndarray  # (H, W) float32
    classes: np.ndarray  # (H, W) int64, -1 where no box


def layout_view(boxes: np.ndarray, box_class: np.ndarray, pose: np.ndarray, sensor: Sensor) -> LayoutView:
    """Ray-cast (B, 7) world boxes with their `OBJECT_CLASSES` indices into the sensor's range view."""
    box_class = np.asarray(box_class).reshape(-1)
    if len(box_class) != len(boxes):
        raise ValueError(f"layout: {len(boxes)} boxes but {len(box_class)} box classes; expected one per box")
    view = box_range_view(boxes, pose, sensor)
    lookup = np.full(len(OBJECT_CLASSES), -1, dtype=np.int64)
    for j, name in enumerate(LAYOUT_CLASSES):
        lookup[OBJECT_CLASSES.index(name)] = j
    if len(box_class) and (box_class.min() < 0 or box_class.max() >= len(OBJECT_CLASSES)):
        raise ValueError(f"layout: box classes must index OBJECT_CLASSES [0, {len(OBJECT_CLASSES)}), got "
                         f"[{box_class.min()}, {box_class.max()}]")
    cls_of_box = lookup[box_class.astype(np.int64)] if len(box_class) else np.zeros(0, np.int64)
    classes = np.where(view.index >= 0, cls_of_box[np.maximum(view.index, 0)] if len(cls_of_box) else -1, -1)
    return LayoutView(view.range, classes.astype(np.int64))


def encode_image(image: RangeImage, sensor: Sensor) -> np.ndarray:
    """(2, H, W) float32 network image: encoded log-range and intensity*2-1 (both -1 where no return)."""
    mask = image.mask
    rng = encode_range(image.range, sensor.max_range)
    inten = np.where(mask, np.clip(image.intensity, 0.0, 1.0) * 2.0 - 1.0, -1.0)
    return np.stack([rng, inten]).astype(np.float32)


def decode_image(x: np.ndarray | torch.Tensor, sensor: Sensor) -> RangeImage:
    """Inverse of `encode_image`; pixels decoding below the sensor's min range are ray drops."""
    arr = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)
    if arr.shape != (2, *sensor.shape):
        raise ValueError(
            f"decode_image expects a (2, {sensor.height}, {sensor.width}) image, got {arr.shape}"
        )
    rng = decode_range(arr[0], sensor.max_range, sensor.min_range)
    inten = np.where(rng > 0, np.clip((arr[1] + 1.0) * 0.5, 0.0, 1.0), 0.0).astype(np.float32)
    return RangeImage(rng, inten)


def coordinate_channels(sensor: Sensor) -> np.ndarray:
    """(3, H, W) beam elevation and azimuth sin/cos: tells a translation-free conv where each pixel looks."""
    return _coordinates(sensor).copy()


@lru_cache(maxsize=RAY_TABLES_KEPT)
def _coordinates(sensor: Sensor) -> np.ndarray:
    """`coordinate_channels`, read-only and computed once per sensor: every frame's condition holds them."""
    height, width = sensor.shape
    elev = np.broadcast_to((sensor.elevations * (2.0 / np.pi))[:, None], (height, width))
    az = np.broadcast_to(sensor.azimuths[None, :], (height, width))
    out = np.stack([elev, np.sin(az), np.cos(az)]).astype(np.float32)
    out.setflags(write=False)
    return out


def empty_condition(sensor: Sensor, num_map_classes: int = len(MAP_CLASSES)) -> np.ndarray:
    """The condition with nothing known: no cache, map or layout; only where each pixel looks."""
    lay = ConditionLayout(num_map_classes)
    cond = np.zeros((lay.channels, *sensor.shape), dtype=np.float32)
    cond[list(lay.range_channels())] = -1.0
    cond[CACHE_INTENSITY] = -1.0
    cond[lay.coords_start :] = _coordinates(sensor)
    return cond


def build_condition(
    cache_points_world: np.ndarray | None,
    pose: np.ndarray,
    map_view: MapView | None,
    layout: LayoutView | None,
    sensor: Sensor,
    num_map_classes: int = len(MAP_CLASSES),
) -> torch.Tensor:
    """The (C, H, W) float32 condition for a sweep taken at `pose` (world_from_sensor).

    `cache_points_world` (N, 4) or None (empty cache); `map_view` from `HDMap.range_view(pose, sensor)` or
    None (map dropped); `layout` from `layout_view` or None (layout dropped).
    """
    pose = _checked_pose(pose)
    cached = None if cache_points_world is None else cache_view(cache_points_world, pose, sensor)
    return with_cache(views_condition(map_view, layout, sensor, num_map_classes), cached, sensor)


def views_condition(
    map_view: MapView | None, layout: LayoutView | None, sensor: Sensor, num_map_classes: int = len(MAP_CLASSES)
) -> np.ndarray:
    """The (C, H, W) float32 condition with its cache block empty: what a pose's map and layout views give.

    It depends on the views alone, so a rollout draws it beside the network sampling the frame before and only
    the cache, which that frame feeds, waits for the frame's end (`with_cache`).
    """
    lay = ConditionLayout(num_map_classes)
    cond = empty_condition(sensor, num_map_classes)
    # 1. the HD map's geometry and classes under each ray
    if map_view is not None:
        _fill_map(cond, map_view, sensor, lay)
    # 2. the actor layout
    if layout is not None:
        _check_shape(layout.range, sensor, "layout.range")
        cond[lay.box_range] = _encode_or_empty(layout.range, sensor)
        rows, cols = np.nonzero(layout.classes >= 0)
        cond[lay.box_range + 1 + layout.classes[rows, cols], rows, cols] = 1.0
        cond[lay.coords_start - 1] = 1.0
    return cond


def with_cache(cond: np.ndarray, cached: RangeImage | None, sensor: Sensor) -> torch.Tensor:
    """`cond` (a `views_condition`, filled in place) with the cache's view from the frame's pose (`cache_view`)
    in its block; None leaves the cache empty."""
    if cached is not None:
        _check_shape(cached.range, sensor, "the cache's view")
        cond[CACHE_IMAGE] = encode_image(cached, sensor)
        cond[CACHE_MASK] = cached.mask
    return torch.from_numpy(cond)


def cache_view(points_world: np.ndarray, pose: np.ndarray, sensor: Sensor) -> RangeImage:
    """World-frame cache points (N, 4) z-buffered from the sensor at `pose` (world_from_sensor), each a voxel-wide
    patch along its row (`CACHE_FOOTPRINT`): how the condition, and a generated frame held to what was measured,
    see a cache. It needs the cache alone, not the frame's views, so a rollout works it out while they are drawn."""
    pose = _checked_pose(pose)
    points = np.asarray(points_world)
    if points.ndim != 2 or points.shape[1] != 4:
        raise ValueError(f"condition: cache points must be (N, 4) x,y,z,intensity, got {points.shape}")
    return project(transform_points(points, np.linalg.inv(pose)), sensor, footprint=CACHE_FOOTPRINT)


def _checked_pose(pose: np.ndarray) -> np.ndarray:
    pose = np.asarray(pose, dtype=np.float64)
    if pose.shape != (4, 4):
        raise ValueError(
            f"condition: pose must be a 4x4 world_from_sensor matrix, got shape {pose.shape}"
        )
    return pose


def _fill_map(cond: np.ndarray, view: MapView, sensor: Sensor, lay: ConditionLayout) -> None:
    classes = np.asarray(view.classes)
    _check_shape(classes, sensor, "map_view.classes")
    if classes.size and (classes.min() < 0 or classes.max() >= lay.num_map_classes):
        raise ValueError(
            f"condition: map classes must be in [0, {lay.num_map_classes}), got "
            f"[{classes.min()}, {classes.max()}]"
        )
    for channel, (name, ranges) in zip(
        (GROUND_RANGE, BUILDING_RANGE, VEGETATION_RANGE),
        (("ground", view.ground), ("building", view.building), ("vegetation", view.vegetation)),
        strict=True,
    ):
        _check_shape(ranges, sensor, f"map_view.{name}")
        cond[channel] = _encode_or_empty(ranges, sensor)
    rows, cols = np.indices(sensor.shape)
    cond[lay.map_classes.start + classes.astype(np.int64), rows, cols] = 1.0
    cond[lay.layout_start - 1] = 1.0


def _check_shape(array: np.ndarray, sensor: Sensor, name: str) -> None:
    if np.shape(array) != sensor.shape:
        raise ValueError(f"condition: {name} must be {sensor.shape}, got {np.shape(array)}")


def _encode_or_empty(range_m: np.ndarray, sensor: Sensor) -> np.ndarray:
    """Encoded range where the layer is hit, -1 elsewhere (`encode_range` already maps 0 m to -1)."""
    return encode_range(np.asarray(range_m, dtype=np.float32), sensor.max_range)


def drop_map(cond: torch.Tensor, num_map_classes: int = len(MAP_CLASSES)) -> torch.Tensor:
    """The same condition with the map dropped (channel dim -3), as `build_condition(..., None, ...)` gives."""
    out = cond.clone()
    lay = ConditionLayout(num_map_classes)
    out[..., lay.map_block, :, :] = 0.0
    out[..., MAP_START : MAP_START + MAP_RANGE_CHANNELS, :, :] = -1.0
    return out


def prior_image(cond: torch.Tensor, num_map_classes: int = len(MAP_CLASSES)) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, W) encoded prior range and (B, H, W) bool "the prior returns" for a (B, C, H, W) condition.

    Encoded ranges are monotone in metres, so "nearest" is a min over the encoded values that exist.
    """
    lay = ConditionLayout(num_map_classes)
    big = torch.tensor(2.0, dtype=cond.dtype, device=cond.device)

    def known(channel: int) -> torch.Tensor:
        value = cond[:, channel]
        return torch.where(value > -1.0 + 1e-6, value, big)

    mapped = torch.minimum(known(GROUND_RANGE), known(BUILDING_RANGE))
    cached = cond[:, CACHE_MASK] > 0.5
    # a cached point re-projected from another pose is off by up to a beam's spacing (most of a metre on
    # the ground at 10 m); where it confirms the map's surface, the map's exact range is the better guess
    confirmed = cached & ((cond[:, CACHE_RANGE] - mapped).abs() < SNAP_TOLERANCE)
    geometry = torch.where(cached & ~confirmed, cond[:, CACHE_RANGE], mapped)
    geometry = torch.where(geometry > -1.0 + 1e-6, geometry, big)
    prior = torch.minimum(geometry, known(lay.box_range))
    returns = prior < big
    return torch.where(returns, prior, torch.full_like(prior, -1.0)), returns


def fill_gaps(
    range_: torch.Tensor, valid: torch.Tensor, reach: tuple[int, int] = GAP_REACH
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, W) ranges where every invalid pixel takes the nearest valid range of its row within reach[0]
    columns (azimuth wraps), else of its column within reach[1] rows; and (B, H, W) where that found one.

    Of two sides at the same distance the nearer range wins, as it would in a z-buffer. Only valid pixels
    are read, so a fill never spreads from another fill.
    """
    big = torch.full_like(range_, 2.0)  # beyond every encoded range
    known = torch.where(valid, range_, big)
    out = known
    for d in range(1, reach[0] + 1):
        out = torch.where(out < 2.0, out, torch.minimum(known.roll(d, -1), known.roll(-d, -1)))
    for d in range(1, reach[1] + 1):
        above = torch.cat([big[..., :d, :], known[..., :-d, :]], dim=-2)
        below = torch.cat([known[..., d:, :], big[..., -d:, :]], dim=-2)
        out = torch.where(out < 2.0, out, torch.minimum(above, below))
    return out, out < 2.0


def augment_cache_points(
    points_world: np.ndarray,
    pose: np.ndarray,
    rng: np.random.Generator,
    dropout: float,
    range_noise: float,
    jitter_translation: float,
    jitter_rotation_deg: float,
) -> np.ndarray:
    """Corrupt a ground-truth cache the way a model's own rollout would, so training matches inference.

    Seen from `pose`: drop a fraction of points, move each along its ray by N(0, range_noise) metres, and
    displace the whole cache by a small random rigid motion (a pose error). All randomness comes from `rng`.
    The amounts are `training.config.AugmentConfig`'s, which keeps their defaults.
    """
    pts = np.asarray(points_world, dtype=np.float32)
    if pts.ndim != 2 or pts.shape[1] != 4:
        raise ValueError(f"augment_cache_points: expected (N, 4) world points, got {pts.shape}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"augment_cache_points: dropout must be in [0, 1), got {dropout}")
    pose = np.asarray(pose, dtype=np.float64)
    local = transform_points(pts[rng.random(len(pts)) >= dropout], np.linalg.inv(pose))
    dist = np.linalg.norm(local[:, :3], axis=1, keepdims=True)
    scale = 1.0 + rng.normal(0.0, range_noise, size=(len(local), 1)) / np.maximum(dist, 1e-6)
    local[:, :3] *= scale.astype(np.float32)
    jitter = np.eye(4)
    jitter[:3, :3] = Rotation.from_euler(
        "xyz", rng.normal(0.0, jitter_rotation_deg, size=3), degrees=True
    ).as_matrix()
    jitter[:3, 3] = rng.normal(0.0, jitter_translation, size=3)
    return transform_points(local, pose @ jitter)


def augment_layout(
    boxes: np.ndarray, box_class: np.ndarray, rng: np.random.Generator, missing: float, center_noise: float
) -> tuple[np.ndarray, np.ndarray]:
    """A layout as a detector or planner would hand it over: some actors missing, the rest a little off.

    Stale layouts (an earlier frame's boxes) are chosen by the caller, which knows the frames.
    """
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 7)
    keep = rng.random(len(boxes)) >= missing
    out = boxes[keep].copy()
    out[:, :2] += rng.normal(0.0, center_noise, size=(len(out), 2))
    return out, np.asarray(box_class).reshape(-1)[keep]
