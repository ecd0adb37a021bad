"""The LiDAR sensor model: exact ray casting along the sensor's beams, then intensity, ray drop and noise.

Rays leave along `Sensor.ray_directions()` exactly, so each return lands in its own range-image pixel and
`project(unproject(image))` gives the image back. What makes a sweep look real happens after the cast:
- intensity = reflectivity x incidence term x range attenuation (with speckle);
- ray drop: no hit within range, CARLA-style drop of weak returns, grazing incidence, the ego's own body,
  a small random loss and the empty pixels real sweeps get when binned into the image;
- Gaussian range noise.
Device-specific numbers live in SENSOR_PROFILES, fitted with `python -m lidar.sim.realism`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lidar.range_image import RangeImage
from lidar.sensors import Sensor
from lidar.sim.hdmap import CURB_HEIGHT
from lidar.sim.primitives import cast, intersect_boxes
from lidar.sim.world import EGO_CLEARANCE, World, check_seed
from lidar.vocabulary import MAP_CLASS_INDEX, MAP_CLASSES

#: Diffuse near-infrared reflectivity of each ground layer (asphalt is dark, paint and grass are bright).
GROUND_REFLECTIVITY = np.zeros(256, dtype=np.float32)
for _name, _refl in {
    "road": 0.12,
    "lane_marking": 0.6,
    "crosswalk": 0.6,
    "intersection": 0.12,
    "parking": 0.13,
    "sidewalk": 0.28,
    "curb": 0.3,
    "terrain": 0.25,
    "vegetation": 0.4,
    "building": 0.3,
}.items():
    GROUND_REFLECTIVITY[MAP_CLASS_INDEX[_name]] = _refl


@dataclass(frozen=True)
class SensorModelConfig:
    """Knobs of the sensor model. `for_sensor` gives the profile tuned against real scans (docs/simulator.md, Realism).

    The return signal is physical: reflectivity x cos(incidence)^incidence_power x exp(-2 a r) x speckle.
    Devices report it on their own scale (KITTI's HDL-64E reflectance is strongly compressed, nuScenes'
    HDL-32E nearly linear), so intensity = clip((intensity_gain * signal) ** intensity_gamma, 0, 1).
    """

    #: Range noise standard deviation (m); Velodyne quotes about 2 cm.
    range_noise: float = 0.02
    #: Exponent on cos(incidence) (1 = Lambertian).
    incidence_power: float = 1.0
    #: Two-way atmospheric attenuation coefficient (1/m).
    attenuation: float = 0.002
    #: Log-normal speckle on the signal (sigma of its log): surface texture, dirt, wetness, paint wear.
    intensity_noise: float = 0.4
    #: Device scale: gain and compression exponent from signal to reported intensity.
    intensity_gain: float = 1.0
    intensity_gamma: float = 1.0
    #: Signal below this is reported as intensity 0 (the device's least count): KITTI reports 0 for 8 % of
    #: its returns, half of those beyond 40 m.
    intensity_floor: float = 0.0
    #: CARLA dropoff: random drop rate applied to every return (the device's own misses).
    drop_general: float = 0.02
    #: Pixels a real sweep leaves empty when its firings (irregular in azimuth) are binned into a range image
    #: 1024 columns wide; the share grows in proportion to the width (measured on nuScenes at 256-1024).
    binning_loss: float = 0.0
    #: CARLA dropoff: returns whose signal is below this may be dropped ...
    drop_intensity_limit: float = 0.01
    #: ... with this probability at zero signal, falling linearly to 0 at the limit.
    drop_zero_intensity: float = 0.6
    #: Rays meeting a surface at cos(incidence) below this are lost (grazing).
    grazing_cos: float = 0.02
    #: Ego vehicle in the sensor frame as (x0, x1, half_width, top below the sensor) boxes reaching down to
    #: the ground; the defaults are a car roof under a roof-mounted sensor.
    ego_boxes: tuple[tuple[float, float, float, float], ...] = ((-1.8, 0.8, 0.8, 0.45),)

    def __post_init__(self) -> None:
        for name in (
            "range_noise",
            "attenuation",
            "intensity_noise",
            "drop_intensity_limit",
            "grazing_cos",
            "intensity_gain",
            "intensity_gamma",
            "intensity_floor",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"SensorModelConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("drop_general", "drop_zero_intensity", "binning_loss"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SensorModelConfig.{name} is a probability, got {getattr(self, name)}")
        for box in self.ego_boxes:
            x0, x1, half_width, below = box
            if not (x0 < x1 and half_width > 0 and below > 0):
                raise ValueError(
                    f"SensorModelConfig.ego_boxes: {box} must be (x0 < x1, half_width > 0, top below the sensor > 0); "
                    "the sensor sits above its car, never inside it"
                )

    @classmethod
    def for_sensor(cls, sensor: Sensor) -> SensorModelConfig:
        """The tuned profile for a preset (by name), else the generic defaults."""
        return SENSOR_PROFILES.get(sensor.name, cls())


#: Profiles fitted to the real scans in shared/data/real_scans (see `python -m lidar.sim.realism`).
SENSOR_PROFILES: dict[str, SensorModelConfig] = {
    # KITTI reflectance is nearly flat in incidence and compressed, and weak (mostly far) returns read 0;
    # the roof rack hides the lowest beams over part of the sweep.
    "hdl64": SensorModelConfig(
        intensity_gain=1.05,
        intensity_gamma=0.52,
        incidence_power=0.2,
        attenuation=0.02,
        intensity_floor=0.031,
        drop_general=0.07,
        ego_boxes=((-1.2, 0.4, 0.9, 0.4),),
    ),
    # nuScenes intensity is close to linear in the return signal; the Zoe's roof shadows the low beams.
    "hdl32": SensorModelConfig(
        intensity_gain=0.69,
        intensity_gamma=1.0,
        incidence_power=0.5,
        drop_general=0.01,
        binning_loss=0.14,
        ego_boxes=((-2.0, 1.3, 0.75, 0.6),),
    ),
    # Ouster's calibrated reflectivity (fitted on the OS1-128 sample recording, whose rig hides no beams);
    # OS1-64 shares the family's scale.
    "os1-128": SensorModelConfig(intensity_gain=0.24, intensity_gamma=0.88, drop_general=0.02, ego_boxes=()),
    "os1-64": SensorModelConfig(intensity_gain=0.24, intensity_gamma=0.88, drop_general=0.02, ego_boxes=()),
}


@dataclass
class SimScan:
    """One simulated sweep. `points` are the returning pixels of `image` (row-major), in the sensor frame."""

    image: RangeImage
    points: np.ndarray  # (N, 4) float32 x, y, z, intensity
    labels: np.ndarray  # (N,) uint8, index into POINT_CLASSES
    label_image: np.ndarray  # (H, W) uint8, 0 where no return
    instance_image: np.ndarray  # (H, W) int32 actor id, -1 for scenery / ground / no return


def _rotation_yaw_tilt(pose: np.ndarray) -> tuple[float, float]:
    """Heading, and how far the sensor's up axis leans: the caster widens its angular windows by the lean."""
    yaw = float(np.arctan2(pose[1, 0], pose[0, 0]))
    tilt = float(np.arccos(np.clip(pose[2, 2], -1.0, 1.0)))
    return yaw, tilt


class LidarSimulator:
    """Simulates `sensor` sweeps in a World. Randomness comes only from `seed`, the scan time and the pose,
    so a sweep does not depend on which sweeps were simulated before it."""

    def __init__(self, sensor: Sensor, seed: int = 0, config: SensorModelConfig | None = None) -> None:
        self.sensor = sensor
        self.seed = check_seed(seed)
        self.config = config or SensorModelConfig.for_sensor(sensor)
        self._dirs = sensor.ray_table().reshape(-1, 3)
        self._ego_mask = self._ego_body_mask()

    def _ego_body_mask(self) -> np.ndarray:
        """Rays that hit the car the sensor is mounted on (they never come back as points)."""
        mask = np.zeros(len(self._dirs), dtype=bool)
        for x0, x1, half_w, below in self.config.ego_boxes:
            top, bottom = -below, -self.sensor.mount_height
            center = np.array([[(x0 + x1) / 2, 0.0, (top + bottom) / 2]])
            half = np.array([[(x1 - x0) / 2, half_w, (top - bottom) / 2]])
            t, _ = intersect_boxes(np.zeros(3), self._dirs, center, half, np.zeros(1))
            mask |= np.isfinite(t)
        return mask.reshape(self.sensor.shape)

    def _rng(self, time_s: float, pose: np.ndarray) -> np.random.Generator:
        """A generator keyed by (seed, time, position to the mm), so a sweep is reproducible on its own."""
        key = [
            self.seed,
            round(time_s * 1e6) & 0xFFFFFFFF,
            *(np.round(pose[:3, 3] * 1000).astype(np.int64) & 0xFFFFFFFF),
        ]
        return np.random.default_rng(np.random.SeedSequence([int(k) for k in key]))

    def scan(self, world: World, pose: np.ndarray, time_s: float = 0.0) -> SimScan:
        """Ray-cast one sweep from `pose` (4x4 world_from_sensor) with actors placed at `time_s`."""
        pose = np.asarray(pose, dtype=np.float64)
        if pose.shape != (4, 4) or not np.isfinite(pose).all():
            raise ValueError(f"pose must be a finite 4x4 world_from_sensor matrix, got shape {pose.shape}")
        if not np.isfinite(time_s):
            raise ValueError(f"time_s must be a finite number of seconds, got {time_s!r}")
        cfg = self.config
        sensor = self.sensor
        h, w = sensor.shape
        rng = self._rng(time_s, pose)
        origin = pose[:3, 3]
        dirs = self._dirs @ pose[:3, :3].T
        yaw, tilt = _rotation_yaw_tilt(pose)

        # 1. Solids near the sensor (culling grid + moving actors), minus traffic the ego would overlap.
        shapes = world.at_time(time_s).shapes_near(
            float(origin[0]), float(origin[1]), sensor.max_range + 5.0, clearance=EGO_CLEARANCE
        )
        t_obj, cos_obj, idx_obj = cast(
            shapes, origin, dirs, yaw, tilt + 0.01, sensor.elevations, w, sensor.max_range
        )

        # 2. Ground: carriageway level, then the curb step (raised sidewalks and verges).
        t_ground, cls_ground, cos_ground = self._ground(world, origin, dirs, sensor.max_range)

        # 3. Nearest surface wins; everything after works on the rays that hit something.
        use_obj = t_obj < t_ground
        t = np.where(use_obj, t_obj, t_ground)
        hit = np.flatnonzero(np.isfinite(t) & ~self._ego_mask.ravel())
        n = len(hit)
        obj = use_obj[hit]
        oi = np.maximum(idx_obj[hit], 0)
        gc = cls_ground[hit]
        cos = np.where(obj, cos_obj[hit], cos_ground[hit])
        if len(shapes):
            refl = np.where(obj, shapes.reflectivity[oi], GROUND_REFLECTIVITY[gc])
            labels = np.where(obj, len(MAP_CLASSES) + shapes.label[oi], gc)
            instance = np.where(obj, shapes.actor[oi], -1)
        else:
            refl, labels, instance = GROUND_REFLECTIVITY[gc], gc, np.full(n, -1)

        # 4. Range noise, intensity, and drop (weak returns, grazing incidence, random loss).
        r = t[hit] + rng.normal(0.0, cfg.range_noise, n)
        signal = refl * np.clip(cos, 0.0, 1.0) ** cfg.incidence_power * np.exp(-2.0 * cfg.attenuation * r)
        sig = cfg.intensity_noise
        signal = signal * np.exp(sig * rng.standard_normal(n) - 0.5 * sig * sig)
        inten = np.where(
            signal < cfg.intensity_floor,
            0.0,
            np.clip((cfg.intensity_gain * signal) ** cfg.intensity_gamma, 0.0, 1.0),
        )
        general = 1.0 - (1.0 - cfg.drop_general) * (1.0 - min(cfg.binning_loss * w / 1024.0, 0.9))
        p_drop = general + (1.0 - general) * cfg.drop_zero_intensity * np.clip(
            1.0 - signal / max(cfg.drop_intensity_limit, 1e-9), 0.0, 1.0
        )
        keep = (rng.random(n) >= p_drop) & (cos >= cfg.grazing_cos)
        keep &= (r >= sensor.min_range) & (r <= sensor.max_range)
        pix = hit[keep]

        range_img = np.zeros(h * w, np.float32)
        inten_img = np.zeros(h * w, np.float32)
        label_img = np.zeros(h * w, np.uint8)
        inst_img = np.full(h * w, -1, np.int32)
        range_img[pix] = r[keep]
        inten_img[pix] = inten[keep]
        label_img[pix] = labels[keep]
        inst_img[pix] = instance[keep]
        image = RangeImage(range_img.reshape(h, w), inten_img.reshape(h, w))
        label_img = label_img.reshape(h, w)
        inst_img = inst_img.reshape(h, w)
        mask = image.mask
        xyz = self._dirs.reshape(h, w, 3)[mask] * image.range[mask, None].astype(np.float64)
        points = np.concatenate([xyz, image.intensity[mask, None]], axis=1).astype(np.float32)
        return SimScan(
            image=image, points=points, labels=label_img[mask], label_image=label_img, instance_image=inst_img
        )

    @staticmethod
    def _ground(
        world: World, origin: np.ndarray, dirs: np.ndarray, max_range: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ground hit per ray: distance, map class and |cos incidence|; curb faces are found between levels.

        The road surface lies on the terrain and raised classes one CURB_HEIGHT above it. A ray first
        reaches the raised level at t_hi and the road level at t_lo; sampling the class raster between
        them finds where it enters a raised cell: on top (at t_hi) or through a curb face.
        """
        hdmap = world.hdmap
        t_lo = hdmap.intersect_terrain(origin, dirs, max_range * 1.05, iterations=3)
        hit = np.isfinite(t_lo)
        t = np.full(len(dirs), np.inf)
        cls = np.zeros(len(dirs), dtype=np.uint8)
        cos = np.abs(dirs[:, 2]).copy()
        idx = np.flatnonzero(hit)
        lo = t_lo[idx]
        d = dirs[idx]
        # The raised level is CURB_HEIGHT higher: first order from the ray's descent rate over the terrain.
        _, gx, gy = hdmap.terrain_height(
            origin[0] + lo * d[:, 0], origin[1] + lo * d[:, 1], with_gradient=True
        )
        descent = np.minimum(d[:, 2] - gx * d[:, 0] - gy * d[:, 1], -1e-4)
        hi = np.maximum(lo + CURB_HEIGHT / descent, 0.0)
        raised_lut = hdmap._raised_lut > 0
        steps = 5
        t_sel = lo.copy()
        step_sel = np.full(len(idx), steps, dtype=np.int64)
        todo = np.arange(len(idx))
        for k in range(steps):
            tk = hi[todo] + (lo[todo] - hi[todo]) * (k / (steps - 1))
            c = hdmap.class_at(origin[0] + tk * d[todo, 0], origin[1] + tk * d[todo, 1])
            new = raised_lut[c]
            t_sel[todo[new]] = tk[new]
            step_sel[todo[new]] = k
            todo = todo[~new]
            if not len(todo):
                break
        found = step_sel < steps
        px = origin[0] + t_sel * d[:, 0]
        py = origin[1] + t_sel * d[:, 1]
        c = hdmap.class_at(px, py)
        face = found & (step_sel > 0)
        c[face] = MAP_CLASS_INDEX["curb"]
        t[idx] = t_sel
        cls[idx] = c
        # A curb face is vertical: its incidence is set by the ray's horizontal component.
        cos[idx[face]] = np.hypot(d[face, 0], d[face, 1]) * 0.7
        return t, cls, cos
