"""Turn a road graph into an HD map: paint the class raster, lay out buildings, green areas and terrain.

Painting order is the precedence of the layers (later wins): terrain, vegetation, sidewalks, curbs, road,
intersections, parking strips, markings, crosswalks, buildings. Buildings and green areas are placed only
where the raster is still free, so nothing built ever overlaps a road.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw
from scipy import ndimage

from lidar.sim.hdmap import HDMap
from lidar.sim.roads import PARKING_WIDTH, RoadGraph, offset_line, point_at, sub_line
from lidar.sim.styles import style_profile
from lidar.vocabulary import MAP_CLASS_INDEX

logger = logging.getLogger(__name__)

RASTER_RESOLUTION = 0.2
TERRAIN_RESOLUTION = 8.0
#: Free land around the road network, so a sensor near the edge still sees a full map to max range.
MAP_MARGIN = 110.0

_FREE = (MAP_CLASS_INDEX["terrain"], MAP_CLASS_INDEX["vegetation"])


@dataclass
class Footprint:
    """A yawed rectangle on the ground: a building (with height) or a green area."""

    cx: float
    cy: float
    half_length: float
    half_width: float
    yaw: float
    height: float = 0.0

    def corners(self) -> np.ndarray:
        c, s = np.cos(self.yaw), np.sin(self.yaw)
        local = np.array([[1, 1], [-1, 1], [-1, -1], [1, -1]], dtype=np.float64) * [
            self.half_length,
            self.half_width,
        ]
        return local @ np.array([[c, s], [-s, c]]) + [self.cx, self.cy]


@dataclass
class Layout:
    hdmap: HDMap
    graph: RoadGraph
    buildings: list[Footprint]
    green: list[Footprint]
    #: Crosswalks as 2-point lines from one sidewalk to the other (where people cross).
    crossings: list[np.ndarray]


class _Painter:
    """PIL drawing in world metres onto the class raster."""

    def __init__(self, origin: tuple[float, float], shape: tuple[int, int], resolution: float) -> None:
        self.origin = origin
        self.res = resolution
        self.image = Image.new("L", (shape[1], shape[0]), MAP_CLASS_INDEX["terrain"])
        self.draw = ImageDraw.Draw(self.image)

    def px(self, pts: np.ndarray) -> list[tuple[float, float]]:
        p = (np.asarray(pts, dtype=np.float64) - self.origin) / self.res
        return [(float(x), float(y)) for x, y in p]

    def line(self, pts: np.ndarray, width_m: float, cls: str) -> None:
        w = max(1, round(width_m / self.res))
        self.draw.line(self.px(pts), fill=MAP_CLASS_INDEX[cls], width=w, joint="curve")

    def polygon(self, pts: np.ndarray, cls: str) -> None:
        self.draw.polygon(self.px(pts), fill=MAP_CLASS_INDEX[cls])

    def classes_at(self, pts: np.ndarray) -> np.ndarray:
        """Classes under world points, read from a crop so checks stay cheap while painting continues."""
        p = np.floor((np.asarray(pts, dtype=np.float64) - self.origin) / self.res).astype(np.int64)
        w, h = self.image.size
        inside = (p[:, 0] >= 0) & (p[:, 0] < w) & (p[:, 1] >= 0) & (p[:, 1] < h)
        out = np.zeros(len(p), dtype=np.uint8)  # off the raster counts as "none": not free land
        if inside.any():
            q = p[inside]
            x0, y0 = q.min(axis=0)
            x1, y1 = q.max(axis=0) + 1
            crop = np.asarray(self.image.crop((int(x0), int(y0), int(x1), int(y1))), dtype=np.uint8)
            out[inside] = crop[q[:, 1] - y0, q[:, 0] - x0]
        return out

    def raster(self) -> np.ndarray:
        return np.asarray(self.image, dtype=np.uint8).copy()


def _square(c: np.ndarray, half: float) -> np.ndarray:
    return c + np.array([[-half, -half], [half, -half], [half, half], [-half, half]])


def map_feature(geom_type: str, coords: np.ndarray | list, **props: Any) -> dict:
    return {
        "geometry": {"type": geom_type, "coordinates": np.round(np.asarray(coords), 3).tolist()},
        "properties": props,
    }


def closed_ring(pts: np.ndarray) -> list:
    """GeoJSON polygon coordinates: one closed ring."""
    return [[*pts.tolist(), pts[0].tolist()]]


def _terrain(rng: np.random.Generator, extent: tuple[float, float, float, float], std: float) -> np.ndarray:
    """Heights on the terrain grid: smoothed noise (cubic zoom keeps slopes gentle) plus a slight tilt."""
    xmin, ymin, xmax, ymax = extent
    nx = int(np.ceil((xmax - xmin) / TERRAIN_RESOLUTION)) + 1
    ny = int(np.ceil((ymax - ymin) / TERRAIN_RESOLUTION)) + 1
    coarse = rng.normal(0.0, std, size=(ny // 8 + 3, nx // 8 + 3))
    fine = ndimage.zoom(coarse, 8.0, order=3, mode="nearest")[:ny, :nx]
    slope = rng.normal(0.0, 0.004, size=2)  # a gentle overall tilt, < 1 %
    yy, xx = np.mgrid[0:ny, 0:nx] * TERRAIN_RESOLUTION
    return (fine + slope[0] * xx + slope[1] * yy).astype(np.float32)


def _points_in(fp: Footprint, step: float = 1.0, pad: float = 0.0) -> np.ndarray:
    hl, hw = fp.half_length + pad, fp.half_width + pad
    u = np.arange(-hl, hl + 1e-6, step)
    v = np.arange(-hw, hw + 1e-6, step)
    uu, vv = np.meshgrid(u, v)
    c, s = np.cos(fp.yaw), np.sin(fp.yaw)
    return np.stack([fp.cx + c * uu - s * vv, fp.cy + s * uu + c * vv], axis=-1).reshape(-1, 2)


def build_layout(rng: np.random.Generator, graph: RoadGraph, style: str) -> Layout:
    """Paint roads, markings, crosswalks, sidewalks, buildings and green areas; add terrain."""
    profile = style_profile(style)
    nodes = graph.nodes
    lo = nodes.min(axis=0) - MAP_MARGIN
    hi = nodes.max(axis=0) + MAP_MARGIN
    shape = (
        int(np.ceil((hi[1] - lo[1]) / RASTER_RESOLUTION)),
        int(np.ceil((hi[0] - lo[0]) / RASTER_RESOLUTION)),
    )
    origin = (float(lo[0]), float(lo[1]))
    paint = _Painter(origin, shape, RASTER_RESOLUTION)
    layers: dict[str, list[dict]] = {
        k: []
        for k in (
            "road",
            "lane_marking",
            "crosswalk",
            "intersection",
            "parking",
            "sidewalk",
            "building",
            "vegetation",
        )
    }
    radius = [graph.node_radius(n) for n in range(len(nodes))]
    crossings: list[np.ndarray] = []

    # 1. Sidewalks (with corner squares), curbs, carriageway, intersections.
    for n in range(len(nodes)):
        inc = graph.incident(n)
        if len(inc) >= 2:
            sw = max(graph.roads[i].sidewalk for i in inc)
            if sw > 0:
                paint.polygon(_square(nodes[n], radius[n] - 1.0 + sw), "sidewalk")
    for r in graph.roads:
        if r.sidewalk > 0:
            paint.line(r.centre, 2 * (r.half_width + r.sidewalk), "sidewalk")
            layers["sidewalk"].append(
                map_feature(
                    "LineString",
                    offset_line(r.centre, r.half_width + r.sidewalk / 2),
                    width=round(r.sidewalk, 2),
                )
            )
            layers["sidewalk"].append(
                map_feature(
                    "LineString",
                    offset_line(r.centre, -r.half_width - r.sidewalk / 2),
                    width=round(r.sidewalk, 2),
                )
            )
    for r in graph.roads:
        paint.line(r.centre, 2 * (r.half_width + 0.3), "curb")
    for n in range(len(nodes)):
        if graph.degree(n) >= 2:
            paint.polygon(_square(nodes[n], radius[n] - 1.0 + 0.3), "curb")
    for i, r in enumerate(graph.roads):
        paint.line(r.centre, 2 * r.half_width, "road")
        layers["road"].append(
            map_feature(
                "LineString",
                r.centre,
                id=i,
                a=r.a,
                b=r.b,
                lanes=r.lanes,
                lane_width=r.lane_width,
                half_width=round(r.half_width, 2),
                kind=r.kind,
            )
        )
    for n in range(len(nodes)):
        if graph.degree(n) >= 2:
            sq = _square(nodes[n], radius[n] - 1.0)
            paint.polygon(sq, "road")
        if graph.degree(n) >= 3:
            sq = _square(nodes[n], radius[n])
            paint.polygon(sq, "intersection")
            layers["intersection"].append(map_feature("Polygon", closed_ring(sq), node=n, degree=graph.degree(n)))

    # 2. Parking strips, markings and crosswalks, all kept clear of the intersection boxes.
    for r in graph.roads:
        s0, s1 = radius[r.a] + 5.0, r.length - radius[r.b] - 5.0
        if s1 - s0 < 5.0:
            continue
        inner = sub_line(r.centre, s0, s1)
        if r.parking:
            for side in (-1.0, 1.0):
                strip = offset_line(inner, side * (r.half_width - PARKING_WIDTH / 2))
                paint.line(strip, PARKING_WIDTH, "parking")
                layers["parking"].append(map_feature("LineString", strip, width=PARKING_WIDTH))
        dash, gap = (3.0, 9.0) if r.kind == "highway" else (3.0, 6.0)
        marks = [(0.0, "centre", "solid" if r.lanes > 1 or r.kind == "highway" else "dashed")]
        marks += [(side * k * r.lane_width, "lane", "dashed") for k in range(1, r.lanes) for side in (-1, 1)]
        if r.kind == "highway" or r.parking:
            marks += [(side * r.carriageway, "edge", "solid") for side in (-1, 1)]
        for off, kind, pattern in marks:
            line = offset_line(inner, off)
            layers["lane_marking"].append(map_feature("LineString", line, type=kind, pattern=pattern))
            if pattern == "solid":
                paint.line(line, 0.15, "lane_marking")
                continue
            starts = np.arange(0.0, (s1 - s0) - dash, dash + gap)
            ends, _ = point_at(line, starts + dash)
            for p0, p1 in zip(point_at(line, starts)[0], ends, strict=True):  # dashes are short: straight
                paint.line(np.stack([p0, p1]), 0.15, "lane_marking")
        if r.kind == "highway":
            continue
        for end, node in ((0, r.a), (1, r.b)):
            if graph.degree(node) < 3 or rng.random() > 0.75:
                continue
            d0 = radius[node] + 0.5
            s_a, s_b = (d0, d0 + 3.0) if end == 0 else (r.length - d0 - 3.0, r.length - d0)
            band = sub_line(r.centre, s_a, s_b, spacing=0.5)
            for off in np.arange(-r.half_width + 0.5, r.half_width - 0.25, 1.0):
                paint.line(offset_line(band, off), 0.5, "crosswalk")
            outline = np.concatenate(
                [offset_line(band, r.half_width), offset_line(band, -r.half_width)[::-1]]
            )
            layers["crosswalk"].append(map_feature("Polygon", closed_ring(outline)))
            mid = band[len(band) // 2]
            tangent = band[-1] - band[0]
            across = np.array([-tangent[1], tangent[0]]) / max(float(np.linalg.norm(tangent)), 1e-9)
            reach = r.half_width + r.sidewalk / 2
            crossings.append(np.stack([mid + across * reach, mid - across * reach]))

    # 3. Buildings along the frontage of every road, where the raster is still free land.
    buildings: list[Footprint] = []
    setback, frontage, depth = profile.setback, profile.frontage, profile.depth
    gaps, heights = profile.gaps, profile.heights
    for r in graph.roads:
        for side in (-1.0, 1.0):
            s = radius[r.a] + 2.0 + rng.uniform(0, 6)
            while s < r.length - radius[r.b] - 2.0:
                w = rng.uniform(*frontage)
                dpt = rng.uniform(*depth)
                pos, tan = point_at(r.centre, np.array([s + w / 2]), r.cum)
                normal = np.array([-tan[0, 1], tan[0, 0]]) * side
                off = r.half_width + r.sidewalk + rng.uniform(*setback) + dpt / 2
                c = pos[0] + normal * off
                fp = Footprint(
                    float(c[0]),
                    float(c[1]),
                    w / 2,
                    dpt / 2,
                    float(np.arctan2(tan[0, 1], tan[0, 0])),
                    float(rng.uniform(*heights)),
                )
                cls = paint.classes_at(_points_in(fp, pad=0.6))
                if np.isin(cls, _FREE).all():
                    buildings.append(fp)
                    paint.polygon(fp.corners(), "building")
                    layers["building"].append(
                        map_feature("Polygon", closed_ring(fp.corners()), height=round(fp.height, 2))
                    )
                s += w + rng.uniform(*gaps)

    # 4. Back-lot buildings on free land away from the streets: the skyline a street view ends in.
    xmin, ymin = origin
    xmax, ymax = xmin + shape[1] * RASTER_RESOLUTION, ymin + shape[0] * RASTER_RESOLUTION
    n_back = profile.back_lot_buildings
    placed = 0
    for _ in range(n_back * 4):
        if placed >= n_back:
            break
        fp = Footprint(
            float(rng.uniform(xmin, xmax)),
            float(rng.uniform(ymin, ymax)),
            float(rng.uniform(6, 20)),
            float(rng.uniform(6, 15)),
            float(rng.choice([0.0, np.pi / 2]) + rng.normal(0, 0.05)),
            float(rng.uniform(heights[0], heights[1] * 1.3)),
        )
        if np.isin(paint.classes_at(_points_in(fp, step=1.5, pad=3.0)), _FREE).all():
            buildings.append(fp)
            paint.polygon(fp.corners(), "building")
            layers["building"].append(map_feature("Polygon", closed_ring(fp.corners()), height=round(fp.height, 2)))
            placed += 1

    # 5. Green areas on the remaining free land.
    green: list[Footprint] = []
    n_green = profile.green_areas
    for _ in range(n_green * 3):
        if len(green) >= n_green:
            break
        fp = Footprint(
            float(rng.uniform(xmin, xmax)),
            float(rng.uniform(ymin, ymax)),
            float(rng.uniform(6, 25)),
            float(rng.uniform(5, 18)),
            float(rng.uniform(0, np.pi)),
        )
        cls = paint.classes_at(_points_in(fp, step=2.0, pad=1.0))
        if (cls == MAP_CLASS_INDEX["terrain"]).all():
            green.append(fp)
            paint.polygon(fp.corners(), "vegetation")
            layers["vegetation"].append(map_feature("Polygon", closed_ring(fp.corners())))

    terrain = _terrain(rng, (xmin, ymin, xmax, ymax), profile.terrain_std)
    hdmap = HDMap(
        layers=layers,
        raster=paint.raster(),
        origin=origin,
        resolution=RASTER_RESOLUTION,
        terrain=terrain,
        terrain_origin=origin,
        terrain_resolution=TERRAIN_RESOLUTION,
    )
    logger.debug(
        "layout %s: raster %s, %d buildings, %d green areas", style, shape, len(buildings), len(green)
    )
    return Layout(hdmap=hdmap, graph=graph, buildings=buildings, green=green, crossings=crossings)
