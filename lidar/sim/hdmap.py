"""The HD map: vector layers, a class raster and a terrain height field, plus the ray casts against them.

The world model conditions on `range_view` (ground class and range, extruded footprints), so it is computed
exactly as the simulator finds the ground (same terrain, same raster) but without occlusion: it says what the
map holds under each ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from lidar.boxes import box_range_view
from lidar.rows import take_rows
from lidar.sensors import Sensor
from lidar.vocabulary import MAP_CLASS_INDEX, MAP_CLASSES, MapView

#: Classes that sit one curb height above the carriageway; the drivable surface is the low level.
RAISED_CLASSES: tuple[str, ...] = ("sidewalk", "curb", "terrain", "vegetation", "building")
CURB_HEIGHT = 0.15

#: Map layers whose rectangles are extruded into solids the model conditions on (`HDMap.range_view`).
FOOTPRINT_CLASSES: tuple[str, ...] = ("building", "vegetation", "barrier", "plant")
#: Height (m) of a green area's block: the map knows where trees and bushes grow, not how tall each is.
VEGETATION_HEIGHT = 2.0
#: How far (m) a footprint solid reaches below the terrain at its centre, so slopes leave no gap under it.
FOOTPRINT_FOOTING = 1.0


#: RGB colour per map class for BEV pictures (index-aligned with MAP_CLASSES).
MAP_COLORS = np.array(
    [
        (0, 0, 0),  # none
        (60, 60, 66),  # road
        (250, 250, 250),  # lane_marking
        (235, 210, 60),  # crosswalk
        (90, 80, 100),  # intersection
        (80, 90, 120),  # parking
        (170, 160, 150),  # sidewalk
        (220, 120, 60),  # curb
        (140, 120, 80),  # terrain
        (60, 140, 60),  # vegetation
        (150, 60, 60),  # building
    ],
    dtype=np.uint8,
)


@dataclass
class HDMap:
    """Vector layers (GeoJSON-like features per layer), a class raster and a terrain height field.

    `raster[iy, ix]` is the class of the cell whose lower-left corner is origin + (ix, iy) * resolution.
    `terrain[iy, ix]` is the height (m) at terrain_origin + (ix, iy) * terrain_resolution, bilinearly
    interpolated; the carriageway lies on it and every RAISED class one CURB_HEIGHT above.
    """

    layers: dict[str, list[dict[str, Any]]]
    raster: np.ndarray
    origin: tuple[float, float]
    resolution: float
    terrain: np.ndarray
    terrain_origin: tuple[float, float]
    terrain_resolution: float
    _raised_lut: np.ndarray = field(init=False, repr=False)
    _terrain_coef: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.raster.dtype != np.uint8 or self.raster.ndim != 2:
            raise ValueError(
                f"HDMap.raster must be a 2-D uint8 class raster, got {self.raster.dtype} {self.raster.shape}"
            )
        if self.raster.size and int(self.raster.max()) >= len(MAP_CLASSES):
            raise ValueError(
                f"HDMap.raster holds class {int(self.raster.max())}; expected < {len(MAP_CLASSES)}"
            )
        lut = np.zeros(256, dtype=np.float32)
        for name in RAISED_CLASSES:
            lut[MAP_CLASS_INDEX[name]] = CURB_HEIGHT
        self._raised_lut = lut
        t = self.terrain.astype(np.float64)
        h00, h01, h10, h11 = t[:-1, :-1], t[:-1, 1:], t[1:, :-1], t[1:, 1:]
        self._terrain_coef = np.stack([h00, h01 - h00, h10 - h00, h11 - h10 - h01 + h00], axis=-1).reshape(
            -1, 4
        )

    # ----------------------------------------------------------------------------------------- lookups
    @property
    def extent(self) -> tuple[float, float, float, float]:
        """(xmin, ymin, xmax, ymax) of the class raster in world metres."""
        ny, nx = self.raster.shape
        x0, y0 = self.origin
        return (x0, y0, x0 + nx * self.resolution, y0 + ny * self.resolution)

    def class_at(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Map class of world points (nearest cell); points off the raster read as terrain."""
        ny, nx = self.raster.shape
        ix = np.floor((np.asarray(x) - self.origin[0]) * (1.0 / self.resolution)).astype(np.int64)
        iy = np.floor((np.asarray(y) - self.origin[1]) * (1.0 / self.resolution)).astype(np.int64)
        out = np.take(self.raster, np.minimum(np.maximum(iy, 0), ny - 1) * nx + np.minimum(np.maximum(ix, 0), nx - 1))
        off = (ix < 0) | (ix >= nx) | (iy < 0) | (iy >= ny)
        if off.any():
            out[off] = MAP_CLASS_INDEX["terrain"]
        return out

    def terrain_height(
        self, x: np.ndarray, y: np.ndarray, with_gradient: bool = False
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Smooth terrain height (bilinear) at world points, optionally with its gradient (dz/dx, dz/dy).

        Each cell's bilinear patch h = a + b u + c v + d u v is precomputed, so a lookup is one row gather.
        """
        ty, tx = self.terrain.shape
        inv = 1.0 / self.terrain_resolution
        fx = np.minimum(
            np.maximum((np.asarray(x, dtype=np.float64) - self.terrain_origin[0]) * inv, 0.0), tx - 1.000001
        )
        fy = np.minimum(
            np.maximum((np.asarray(y, dtype=np.float64) - self.terrain_origin[1]) * inv, 0.0), ty - 1.000001
        )
        ix = fx.astype(np.int64)
        iy = fy.astype(np.int64)
        u = fx - ix
        v = fy - iy
        coef = take_rows(self._terrain_coef, iy * (tx - 1) + ix)
        a, b, c, d = coef[..., 0], coef[..., 1], coef[..., 2], coef[..., 3]
        h = a + b * u + (c + d * u) * v
        if not with_gradient:
            return h
        return h, (b + d * v) * inv, (c + d * u) * inv

    def ground_height(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Surface height including the curb step (sidewalks, verges and lots sit above the carriageway)."""
        return self.terrain_height(x, y) + self._raised_lut[self.class_at(x, y)]

    # ----------------------------------------------------------------------------------------- ray casts
    def intersect_terrain(
        self, origin: np.ndarray, dirs: np.ndarray, max_range: float, iterations: int = 4
    ) -> np.ndarray:
        """Ray parameter where each ray meets the smooth terrain; inf where it does not within range.

        Newton's method on f(t) = o_z + t d_z - h(o + t d), started from the flat plane through
        the terrain under the origin. The terrain is gentle, so a few steps converge; a ray that is still
        off the surface afterwards is treated as a miss rather than guessed.
        """
        o = np.asarray(origin, dtype=np.float64)
        d = np.asarray(dirs, dtype=np.float64).reshape(-1, 3)
        t = np.full(len(d), np.inf)
        down = d[:, 2] < -1e-4
        if not down.any():
            return t
        dd = take_rows(d, down)
        h0 = float(self.terrain_height(np.array([o[0]]), np.array([o[1]]))[0])
        tt = (h0 - o[2]) / dd[:, 2]
        tt = np.clip(tt, 0.0, 1.5 * max_range)
        for _ in range(iterations):
            px = o[0] + tt * dd[:, 0]
            py = o[1] + tt * dd[:, 1]
            h, gx, gy = self.terrain_height(px, py, with_gradient=True)
            f = o[2] + tt * dd[:, 2] - h
            fp = dd[:, 2] - gx * dd[:, 0] - gy * dd[:, 1]
            fp = np.minimum(fp, -1e-4)  # the ray must descend relative to the slope to meet it
            tt = np.clip(tt - f / fp, 0.0, 1.5 * max_range)
        px = o[0] + tt * dd[:, 0]
        py = o[1] + tt * dd[:, 1]
        resid = o[2] + tt * dd[:, 2] - self.terrain_height(px, py)
        ok = (np.abs(resid) < 0.02 + 0.002 * tt) & (tt > 0) & (tt <= max_range)
        t[np.flatnonzero(down)[ok]] = tt[ok]
        return t

    def range_view_classes(self, pose: np.ndarray, sensor: Sensor) -> np.ndarray:
        """(H, W) uint8: map class where each ray of `sensor` at `pose` meets the ground; 0 where it misses.

        Occlusion is ignored on purpose: this is the map the model conditions on, not what the sensor sees.
        """
        return self._ground_cast(pose, sensor)[1]

    def range_view(self, pose: np.ndarray, sensor: Sensor) -> MapView:
        """The map's geometry under every ray of `sensor` at `pose`: ground class and range, footprint ranges.

        Like `range_view_classes`, each layer is cast on its own (a wall does not hide the ground behind it);
        the model's prior takes the nearest of them.
        """
        ground, classes = self._ground_cast(pose, sensor)
        boxes = self.footprint_boxes
        # buildings and barriers are one layer to the model: built things a ray stops at
        built = box_range_view(np.concatenate([boxes["building"], boxes["barrier"]]), pose, sensor)
        ground_m = np.where(np.isfinite(ground) & (ground >= sensor.min_range), ground, 0.0)
        return MapView(
            classes=classes,
            ground=ground_m.astype(np.float32).reshape(sensor.shape),
            building=built.range,
            # green areas and the plants the map lists one by one: where vegetation stands
            vegetation=box_range_view(np.concatenate([boxes["vegetation"], boxes["plant"]]), pose, sensor).range,
        )

    def _ground_cast(self, pose: np.ndarray, sensor: Sensor) -> tuple[np.ndarray, np.ndarray]:
        """Ray parameter to the terrain (N,) (inf = miss) and the (H, W) class where each ray meets it."""
        pose = np.asarray(pose, dtype=np.float64)
        if pose.shape != (4, 4):
            raise ValueError(f"pose must be a 4x4 world_from_sensor matrix, got shape {pose.shape}")
        dirs = sensor.ray_table().reshape(-1, 3) @ pose[:3, :3].T
        t = self.intersect_terrain(pose[:3, 3], dirs, sensor.max_range, iterations=3)
        hit = np.isfinite(t)
        out = np.zeros(len(dirs), dtype=np.uint8)
        th = t[hit]
        out[hit] = self.class_at(pose[0, 3] + th * dirs[:, 0][hit], pose[1, 3] + th * dirs[:, 1][hit])
        # 2. raised classes sit a curb higher: meet that surface instead, where it is still raised there
        #    (at a grazing beam 15 cm of height is most of a metre of range)
        raised = np.flatnonzero(hit)[self._raised_lut[out[hit]] > 0]
        t_up = t[raised] - CURB_HEIGHT / np.maximum(-dirs[:, 2][raised], 1e-3)
        still = self._raised_lut[
            self.class_at(pose[0, 3] + t_up * dirs[:, 0][raised], pose[1, 3] + t_up * dirs[:, 1][raised])
        ] > 0
        t[raised[still & (t_up > 0)]] = t_up[still & (t_up > 0)]
        return t, out.reshape(sensor.shape)

    @cached_property
    def footprint_boxes(self) -> dict[str, np.ndarray]:
        """Each footprint layer's rectangles extruded into (B, 7) boxes standing on the terrain.

        Buildings, barriers and plants rise to their `height` property; a green area is a
        `VEGETATION_HEIGHT` block, a coarse stand-in for the low growth the map does not list one by one.
        """
        out = {}
        for name in FOOTPRINT_CLASSES:
            rows = []
            for feature in self.layers.get(name, []):
                ring = np.asarray(feature["geometry"]["coordinates"][0], dtype=np.float64)[:4]
                if ring.shape != (4, 2):
                    continue  # only the rectangles the layout writes are footprints
                height = float(feature.get("properties", {}).get("height", VEGETATION_HEIGHT))
                centre = ring.mean(axis=0)
                length = float(np.linalg.norm(ring[1] - ring[0]))
                width = float(np.linalg.norm(ring[2] - ring[1]))
                yaw = float(np.arctan2(ring[1, 1] - ring[0, 1], ring[1, 0] - ring[0, 0]))
                base = float(self.terrain_height(centre[:1], centre[1:])[0]) - FOOTPRINT_FOOTING
                rows.append((centre[0], centre[1], base + (height + FOOTPRINT_FOOTING) / 2, length, width,
                             height + FOOTPRINT_FOOTING, yaw))
            out[name] = np.asarray(rows, dtype=np.float64).reshape(-1, 7)
        return out

    # ----------------------------------------------------------------------------------------- rasters
    def bev_raster(
        self,
        resolution: float = 0.5,
        extent: float | None = None,
        center: tuple[float, float] | None = None,
        pose: np.ndarray | None = None,
    ) -> np.ndarray:
        """Class raster resampled to `resolution` (nearest), as an image: row 0 is the far/top edge.

        Without `pose`: world axes, +y up and +x right, covering `extent` metres either side of `center`
        (the whole map when extent is None). With `pose`: ego-centred, forward (+x) up and left (+y) to
        the left, the layout BEV models and viewers expect.
        """
        if resolution <= 0:
            raise ValueError(f"bev_raster: resolution must be > 0 m, got {resolution}")
        if pose is not None:
            pose = np.asarray(pose, dtype=np.float64)
            half = 50.0 if extent is None else float(extent)
            n = max(1, round(2 * half / resolution))
            c = (np.arange(n) + 0.5) * resolution - half
            fwd = -c[:, None] * np.ones((1, n))  # row 0 = +half forward
            left = -c[None, :] * np.ones((n, 1))  # column 0 = +half left
            yaw = np.arctan2(pose[1, 0], pose[0, 0])
            cs, sn = np.cos(yaw), np.sin(yaw)
            wx = pose[0, 3] + cs * fwd - sn * left
            wy = pose[1, 3] + sn * fwd + cs * left
            return self.class_at(wx, wy)
        xmin, ymin, xmax, ymax = self.extent
        if extent is None:
            cx, cy = (xmin + xmax) / 2, (ymin + ymax) / 2
            hx, hy = (xmax - xmin) / 2, (ymax - ymin) / 2
        else:
            cx, cy = center if center is not None else ((xmin + xmax) / 2, (ymin + ymax) / 2)
            hx = hy = float(extent)
        nx = max(1, round(2 * hx / resolution))
        ny = max(1, round(2 * hy / resolution))
        xs = cx - hx + (np.arange(nx) + 0.5) * resolution
        ys = cy + hy - (np.arange(ny) + 0.5) * resolution
        return self.class_at(xs[None, :] * np.ones((ny, 1)), ys[:, None] * np.ones((1, nx)))

    @staticmethod
    def colorize(classes: np.ndarray) -> np.ndarray:
        """(..., 3) uint8 RGB for a class raster, with MAP_COLORS."""
        return MAP_COLORS[np.clip(classes, 0, len(MAP_CLASSES) - 1)]

    # ----------------------------------------------------------------------------------------- export
    def to_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the map: arrays stay arrays, the vectors as a JSON string."""
        return {
            "map_raster": self.raster,
            "map_origin": np.asarray(self.origin, dtype=np.float64),
            "map_resolution": np.float64(self.resolution),
            "map_terrain": self.terrain.astype(np.float32),
            "map_terrain_origin": np.asarray(self.terrain_origin, dtype=np.float64),
            "map_terrain_resolution": np.float64(self.terrain_resolution),
            "map_vectors": np.array(json.dumps(self.layers)),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HDMap:
        """Rebuild from `to_dict()` or a dataset .npz, so training can re-cast the map from a jittered pose."""
        missing = [k for k in ("map_raster", "map_origin", "map_resolution", "map_terrain") if k not in data]
        if missing:
            raise ValueError(
                f"HDMap.from_dict: missing keys {missing}; expected the output of HDMap.to_dict()"
            )
        return cls(
            layers=json.loads(str(data["map_vectors"])) if "map_vectors" in data else {},
            raster=np.asarray(data["map_raster"], dtype=np.uint8),
            origin=tuple(float(v) for v in data["map_origin"]),
            resolution=float(data["map_resolution"]),
            terrain=np.asarray(data["map_terrain"], dtype=np.float32),
            terrain_origin=tuple(float(v) for v in data["map_terrain_origin"]),
            terrain_resolution=float(data["map_terrain_resolution"]),
        )
