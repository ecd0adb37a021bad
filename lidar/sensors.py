"""LiDAR sensors as data: beam elevations, azimuth bins, range limits and mounting height.

A sensor never carries behaviour beyond derived geometry, so a model's `config.json` can hold one
verbatim and a user can describe a new device from its datasheet with `Sensor.from_angles`.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from lidar.errors import shown


@dataclass(frozen=True)
class Sensor:
    """A spinning LiDAR. Row 0 of its range image is the highest beam (see docs/design.md)."""

    name: str
    #: Beam elevations in degrees, highest first.
    elevations_deg: tuple[float, ...]
    #: Azimuth bins per revolution (range-image width).
    width: int = 1024
    #: Returns closer than this (metres) are dropped; they are the sensor's blind zone.
    min_range: float = 1.0
    #: Returns farther than this (metres) are never reported.
    max_range: float = 100.0
    #: Height of the optical centre above the ground (metres).
    mount_height: float = 1.8

    def __post_init__(self) -> None:
        elev = tuple(float(e) for e in self.elevations_deg)
        object.__setattr__(self, "elevations_deg", elev)
        if len(elev) < 1:
            raise ValueError(f"Sensor {self.name!r}: elevations_deg is empty; expected at least one beam angle")
        if any(not np.isfinite(e) or abs(e) >= 90.0 for e in elev):
            raise ValueError(f"Sensor {self.name!r}: beam elevations must be finite and within (-90, 90) degrees, got {elev}")
        if any(b >= a for a, b in itertools.pairwise(elev)):
            raise ValueError(
                f"Sensor {self.name!r}: elevations_deg must be strictly decreasing (row 0 is the highest beam); "
                "use Sensor.from_angles to sort an unordered list"
            )
        if int(self.width) != self.width or self.width < 8:
            raise ValueError(f"Sensor {self.name!r}: width must be an integer >= 8, got {self.width!r}")
        if not (0.0 <= self.min_range < self.max_range):
            raise ValueError(
                f"Sensor {self.name!r}: expected 0 <= min_range < max_range, got min_range={self.min_range}, "
                f"max_range={self.max_range}"
            )
        if not (0.0 <= self.mount_height < 10.0):
            raise ValueError(f"Sensor {self.name!r}: mount_height must be in [0, 10) m, got {self.mount_height}")

    @classmethod
    def from_angles(cls, name: str, angles_deg: list[float] | np.ndarray, **kwargs: Any) -> Sensor:
        """Build a custom sensor from beam angles in any order (datasheets list them by firing order)."""
        angles = sorted({float(a) for a in np.asarray(angles_deg, dtype=np.float64).ravel()}, reverse=True)
        return cls(name=name, elevations_deg=tuple(angles), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sensor:
        """Rebuild from a `config.json` entry; unknown keys are refused so a typo never falls back to a default."""
        known = {"name", "elevations_deg", "width", "min_range", "max_range", "mount_height"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown sensor fields {sorted(unknown)}; expected a subset of {sorted(known)}")
        missing = {"name", "elevations_deg"} - set(data)
        if missing:
            raise ValueError(f"sensor fields {sorted(missing)} are missing; expected at least name and elevations_deg")
        return cls(**{**data, "elevations_deg": tuple(data["elevations_deg"])})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (elevations as a list), the form a model's `config.json` stores."""
        out = asdict(self)
        out["elevations_deg"] = list(self.elevations_deg)
        return out

    def with_width(self, width: int) -> Sensor:
        """The same beams at another azimuth resolution (models often run narrower than the device)."""
        return replace(self, width=int(width))

    @property
    def height(self) -> int:
        return len(self.elevations_deg)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.height, self.width)

    @property
    def elevations(self) -> np.ndarray:
        """Beam elevations in radians, (H,), highest first."""
        return np.deg2rad(np.asarray(self.elevations_deg, dtype=np.float64))

    @property
    def azimuths(self) -> np.ndarray:
        """Azimuth of each column centre in radians, (W,): +pi at column 0, 0 at the centre, decreasing."""
        u = np.arange(self.width, dtype=np.float64) + 0.5
        return np.pi * (1.0 - 2.0 * u / self.width)

    def ray_directions(self) -> np.ndarray:
        """Unit ray directions in the sensor frame, (H, W, 3) float64, one per range-image pixel (a copy of
        `ray_table`, the caller's to change)."""
        return self.ray_table().copy()

    def ray_table(self) -> np.ndarray:
        """`ray_directions`, read-only and computed once per sensor: every frame's unprojection and ray casts
        read it, and building it anew cost 2-5 ms at 64 x 2048 each time."""
        return _ray_table(self)


#: Sensors whose ray table is kept (`Sensor.ray_table`): a forecast's measured one, the model's, the two halves
#: of beams a rollout draws its first frame's map views on, and a few more.
RAY_TABLES_KEPT = 8


@lru_cache(maxsize=RAY_TABLES_KEPT)
def _ray_table(sensor: Sensor) -> np.ndarray:
    el = sensor.elevations[:, None]
    az = sensor.azimuths[None, :]
    cos_el = np.cos(el)
    table = np.stack(np.broadcast_arrays(cos_el * np.cos(az), cos_el * np.sin(az), np.sin(el)), axis=-1).astype(
        np.float64)
    table.setflags(write=False)
    return table


def _linspace_deg(top: float, bottom: float, n: int) -> tuple[float, ...]:
    return tuple(float(round(v, 4)) for v in np.linspace(top, bottom, n))


HDL64 = Sensor(
    name="hdl64",
    elevations_deg=_linspace_deg(2.0, -8.33, 32) + _linspace_deg(-8.83, -24.9, 32),
    width=1024,
    min_range=1.0,
    max_range=120.0,
    mount_height=1.73,
)
"""Velodyne HDL-64E S2 as mounted on the KITTI car (KITTI's odometry and object benchmarks).

Sources: Velodyne HDL-64E S2 datasheet (26.9 deg vertical FOV, +2.0 to -24.9 deg, 120 m range; an upper
block of 32 lasers at ~1/3 deg spacing down to about -8.33 deg, a lower block of 32 at ~1/2 deg from
-8.83 deg) and Geiger et al., "Vision meets Robotics: The KITTI Dataset", IJRR 2013 (sensor 1.73 m above
the ground). Beams are evenly spaced within each block, not one unit's calibration.
"""

HDL32 = Sensor(
    name="hdl32",
    elevations_deg=_linspace_deg(10.67, -30.67, 32),
    width=1024,
    min_range=1.0,
    max_range=100.0,
    mount_height=1.84,
)
"""Velodyne HDL-32E (nuScenes' LIDAR_TOP; the default model's sensor).

Sources: Velodyne HDL-32E datasheet (+10.67 to -30.67 deg in 1.33 deg steps, 100 m range) and Caesar et
al., "nuScenes: A multimodal dataset for autonomous driving", CVPR 2020 (roof mount about 1.84 m up).
"""

VLP16 = Sensor(
    name="vlp16",
    elevations_deg=_linspace_deg(15.0, -15.0, 16),
    width=1024,
    min_range=0.5,
    max_range=100.0,
    mount_height=1.6,
)
"""Velodyne VLP-16 (Puck), the common low-cost 16-beam unit.

Source: Velodyne VLP-16 datasheet (16 channels, +15 to -15 deg in 2 deg steps, 100 m range). The mount
height is a typical car roof, not a datasheet value.
"""

OS1_64 = Sensor(
    name="os1-64",
    elevations_deg=_linspace_deg(22.5, -22.5, 64),
    width=1024,
    min_range=0.8,
    max_range=120.0,
    mount_height=1.8,
)
"""Ouster OS1-64 (Gen 2, uniform beams).

Source: Ouster OS1 Gen 2 datasheet (45 deg vertical FOV, +22.5 to -22.5 deg, uniform beam spacing, 120 m
range at 80% reflectivity; the 1024x10 mode gives 1024 columns). Gen 1 units span only +-16.6 deg;
`detect_sensor` measures such a beam table from the file's rings instead.
"""

OS1_128 = Sensor(
    name="os1-128",
    elevations_deg=_linspace_deg(22.5, -22.5, 128),
    width=1024,
    min_range=0.8,
    max_range=120.0,
    mount_height=1.8,
)
"""Ouster OS1-128 (Gen 2, uniform beams).

Source: Ouster OS1 Gen 2 datasheet, as `OS1_64` with 128 uniform beams over +22.5 to -22.5 deg.
"""

PRESETS: dict[str, Sensor] = {s.name: s for s in (HDL64, HDL32, VLP16, OS1_64, OS1_128)}

_ALIASES = {
    "kitti": "hdl64",
    "hdl-64e": "hdl64",
    "hdl64e": "hdl64",
    "nuscenes": "hdl32",
    "hdl-32e": "hdl32",
    "hdl32e": "hdl32",
    "vlp-16": "vlp16",
    "puck": "vlp16",
    "os1_64": "os1-64",
    "os164": "os1-64",
    "os1_128": "os1-128",
    "os1128": "os1-128",
}


def get_sensor(name: str) -> Sensor:
    """Look a preset up by name or common alias, case-insensitively."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown sensor {shown(name)}; expected one of {sorted(PRESETS)} (or aliases {sorted(_ALIASES)})")
    return PRESETS[key]
