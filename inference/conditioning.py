"""What the world model sees besides the noisy image: one (C, H, W) condition in the new sensor's range view.

Training and rollout build it with the same `build_condition`, so the two can never drift apart. Its
channels, in order (C = 3 + K + 1 + 3 for K map classes):

    0       cache range     `encode_range` of the z-buffered cache, -1 where the cache has no point
    1       cache intensity intensity * 2 - 1, -1 where the cache has no point
    2       cache mask      1 where the cache has a point
    3..3+K  map one-hot     `HDMap.range_view_classes` (class 0 = the ray meets no ground); all 0 if dropped
    3+K     map present     1 everywhere when a map is given, 0 when dropped
    4+K     beam elevation  elevation in radians * 2 / pi
    5+K     sin(azimuth)
    6+K     cos(azimuth)

An empty cache is the first frame of a rollout; a dropped map is free generation and the unconditional
branch of classifier-free guidance.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.spatial.transform import Rotation

from inference.cache import transform_points
from lidar.range_image import RangeImage, decode_range, encode_range, project
from lidar.sensors import Sensor
from lidar.sim.hdmap import MAP_CLASSES

#: Channels of the cache block at the start of the condition.
CACHE_CHANNELS = 3
#: The cache's range and intensity channels, in the same encoding as the generated image (`encode_image`).
CACHE_IMAGE = slice(0, 2)
#: Beam elevation, sin and cos of azimuth at the end of the condition.
COORD_CHANNELS = 3


def condition_channels(num_map_classes: int = len(MAP_CLASSES)) -> int:
    return CACHE_CHANNELS + num_map_classes + 1 + COORD_CHANNELS


def map_slice(num_map_classes: int = len(MAP_CLASSES)) -> slice:
    """The map one-hot and map-present channels (what `drop_map` zeroes)."""
    return slice(CACHE_CHANNELS, CACHE_CHANNELS + num_map_classes + 1)


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
    height, width = sensor.shape
    elev = np.broadcast_to((sensor.elevations * (2.0 / np.pi))[:, None], (height, width))
    az = np.broadcast_to(sensor.azimuths[None, :], (height, width))
    return np.stack([elev, np.sin(az), np.cos(az)]).astype(np.float32)


def build_condition(
    cache_points_world: np.ndarray | None,
    pose: np.ndarray,
    map_classes: np.ndarray | None,
    sensor: Sensor,
    num_map_classes: int = len(MAP_CLASSES),
) -> torch.Tensor:
    """The (C, H, W) float32 condition for a sweep taken at `pose` (world_from_sensor).

    `cache_points_world` (N, 4) or None (empty cache); `map_classes` (H, W) ints from
    `HDMap.range_view_classes(pose, sensor)` or None (map dropped).
    """
    height, width = sensor.shape
    pose = np.asarray(pose, dtype=np.float64)
    if pose.shape != (4, 4):
        raise ValueError(
            f"build_condition: pose must be a 4x4 world_from_sensor matrix, got shape {pose.shape}"
        )
    cond = np.zeros((condition_channels(num_map_classes), height, width), dtype=np.float32)

    # 1. the cache, moved into the new sensor frame and z-buffered
    cache_pts = np.zeros((0, 4), np.float32) if cache_points_world is None else np.asarray(cache_points_world)
    if cache_pts.ndim != 2 or cache_pts.shape[1] != 4:
        raise ValueError(
            f"build_condition: cache points must be (N, 4) x,y,z,intensity, got {cache_pts.shape}"
        )
    image = project(transform_points(cache_pts, np.linalg.inv(pose)), sensor)
    cond[CACHE_IMAGE] = encode_image(image, sensor)
    cond[2] = image.mask

    # 2. the HD map ray-cast from the new pose, one-hot, plus the map-present flag
    if map_classes is not None:
        classes = np.asarray(map_classes)
        if classes.shape != (height, width):
            raise ValueError(f"build_condition: map_classes must be ({height}, {width}), got {classes.shape}")
        if classes.size and (classes.min() < 0 or classes.max() >= num_map_classes):
            raise ValueError(
                f"build_condition: map classes must be in [0, {num_map_classes}), got "
                f"[{classes.min()}, {classes.max()}]"
            )
        rows, cols = np.indices((height, width))
        cond[CACHE_CHANNELS + classes.astype(np.int64), rows, cols] = 1.0
        cond[CACHE_CHANNELS + num_map_classes] = 1.0

    # 3. where each pixel looks
    cond[-COORD_CHANNELS:] = coordinate_channels(sensor)
    return torch.from_numpy(cond)


def drop_map(cond: torch.Tensor, num_map_classes: int = len(MAP_CLASSES)) -> torch.Tensor:
    """The same condition with the map dropped (channel dim -3), as `build_condition(..., None, ...)` gives."""
    out = cond.clone()
    out[..., map_slice(num_map_classes), :, :] = 0.0
    return out


def augment_cache_points(
    points_world: np.ndarray,
    pose: np.ndarray,
    rng: np.random.Generator,
    dropout: float = 0.2,
    range_noise: float = 0.05,
    jitter_translation: float = 0.1,
    jitter_rotation_deg: float = 0.5,
) -> np.ndarray:
    """Corrupt a ground-truth cache the way a model's own rollout would, so training matches inference.

    Seen from `pose`: drop a fraction of points, move each along its ray by N(0, range_noise) metres, and
    displace the whole cache by a small random rigid motion (a pose error). All randomness comes from `rng`.
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
