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
from lidar.sim.roads import PARKING_WIDTH, Road, RoadGraph, offset_line, point_at, sub_line
from lidar.sim.styles import StyleProfile, style_profile
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
    """Paint roads, markings, crosswalks, sidewalks, buildings and green areas; add terrain.

    The numbered steps paint in the order of the layers' precedence and draw from `rng` in a fixed order, so
    a world is a pure function of its seed; reordering them changes every world.
    """
    profile = style_profile(style)
    build = _LayoutBuilder(rng, graph)
    build.ground()  # 1
    for r in graph.roads:  # 2
        build.strips_and_markings(r)
        if r.kind != "highway":
            build.crosswalks(r)
    build.frontage_buildings(profile)  # 3
    build.back_lot_buildings(profile.back_lot_buildings, profile.heights)  # 4
    build.green_areas(profile.green_areas)  # 5
    origin = build.paint.origin
    hdmap = HDMap(
        layers=build.layers,
        raster=build.paint.raster(),
        origin=origin,
        resolution=RASTER_RESOLUTION,
        terrain=_terrain(rng, build.extent, profile.terrain_std),
        terrain_origin=origin,
        terrain_resolution=TERRAIN_RESOLUTION,
    )
    logger.debug(
        "layout %s: raster %s, %d buildings, %d green areas", style, hdmap.raster.shape, len(build.buildings),
        len(build.green),
    )
    return Layout(
        hdmap=hdmap, graph=graph, buildings=build.buildings, green=build.green, crossings=build.crossings
    )


class _LayoutBuilder:
    """The steps of `build_layout`: each paints onto one class raster and adds to the vector layers."""

    def __init__(self, rng: np.random.Generator, graph: RoadGraph) -> None:
        self.rng, self.graph = rng, graph
        lo = graph.nodes.min(axis=0) - MAP_MARGIN
        hi = graph.nodes.max(axis=0) + MAP_MARGIN
        shape = (
            int(np.ceil((hi[1] - lo[1]) / RASTER_RESOLUTION)),
            int(np.ceil((hi[0] - lo[0]) / RASTER_RESOLUTION)),
        )
        origin = (float(lo[0]), float(lo[1]))
        self.paint = _Painter(origin, shape, RASTER_RESOLUTION)
        #: (xmin, ymin, xmax, ymax) of the raster, where back lots, green areas and terrain go.
        xmax, ymax = origin[0] + shape[1] * RASTER_RESOLUTION, origin[1] + shape[0] * RASTER_RESOLUTION
        self.extent = (*origin, xmax, ymax)
        self.layers: dict[str, list[dict]] = {
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
        self.radius = [graph.node_radius(n) for n in range(len(graph.nodes))]
        self.crossings: list[np.ndarray] = []
        self.buildings: list[Footprint] = []
        self.green: list[Footprint] = []

    # 1. Sidewalks (with corner squares), curbs, carriageway, intersections.
    def ground(self) -> None:
        graph, radius, paint, layers = self.graph, self.radius, self.paint, self.layers
        nodes = graph.nodes
        for n in range(len(nodes)):
            inc = graph.incident(n)
            if len(inc) >= 2:
                sw = max(graph.roads[i].sidewalk for i in inc)
                if sw > 0:
                    paint.polygon(_square(nodes[n], radius[n] - 1.0 + sw), "sidewalk")
        for r in graph.roads:
            if r.sidewalk > 0:
                paint.line(r.centre, 2 * (r.half_width + r.sidewalk), "sidewalk")
                for side in (1.0, -1.0):
                    walk = offset_line(r.centre, side * (r.half_width + r.sidewalk / 2))
                    layers["sidewalk"].append(map_feature("LineString", walk, width=round(r.sidewalk, 2)))
        for r in graph.roads:
            paint.line(r.centre, 2 * (r.half_width + 0.3), "curb")
        for n in range(len(nodes)):
            if graph.degree(n) >= 2:
                paint.polygon(_square(nodes[n], radius[n] - 1.0 + 0.3), "curb")
        for i, r in enumerate(graph.roads):
            paint.line(r.centre, 2 * r.half_width, "road")
            layers["road"].append(
                map_feature("LineString", r.centre, id=i, a=r.a, b=r.b, lanes=r.lanes,
                            lane_width=r.lane_width, half_width=round(r.half_width, 2), kind=r.kind)
            )
        for n in range(len(nodes)):
            if graph.degree(n) >= 2:
                paint.polygon(_square(nodes[n], radius[n] - 1.0), "road")
            if graph.degree(n) >= 3:
                sq = _square(nodes[n], radius[n])
                paint.polygon(sq, "intersection")
                feature = map_feature("Polygon", closed_ring(sq), node=n, degree=graph.degree(n))
                layers["intersection"].append(feature)

    # 2. Parking strips, markings and crosswalks, all kept clear of the intersection boxes.
    def strips_and_markings(self, r: Road) -> None:
        s0, s1 = self.graph.interior(r, 5.0)
        if s1 - s0 < 5.0:
            return
        paint, layers = self.paint, self.layers
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

    def crosswalks(self, r: Road) -> None:
        """Zebra bands across a street's ends at junctions (three in four), and the line people cross on."""
        s0, s1 = self.graph.interior(r, 5.0)
        if s1 - s0 < 5.0:
            return
        for end, node in ((0, r.a), (1, r.b)):
            if self.graph.degree(node) < 3 or self.rng.random() > 0.75:
                continue
            d0 = self.radius[node] + 0.5
            s_a, s_b = (d0, d0 + 3.0) if end == 0 else (r.length - d0 - 3.0, r.length - d0)
            band = sub_line(r.centre, s_a, s_b, spacing=0.5)
            for off in np.arange(-r.half_width + 0.5, r.half_width - 0.25, 1.0):
                self.paint.line(offset_line(band, off), 0.5, "crosswalk")
            left, right = offset_line(band, r.half_width), offset_line(band, -r.half_width)
            outline = np.concatenate([left, right[::-1]])
            self.layers["crosswalk"].append(map_feature("Polygon", closed_ring(outline)))
            mid = band[len(band) // 2]
            tangent = band[-1] - band[0]
            across = np.array([-tangent[1], tangent[0]]) / max(float(np.linalg.norm(tangent)), 1e-9)
            reach = r.half_width + r.sidewalk / 2
            self.crossings.append(np.stack([mid + across * reach, mid - across * reach]))

    def add_building(self, fp: Footprint) -> None:
        self.buildings.append(fp)
        self.paint.polygon(fp.corners(), "building")
        feature = map_feature("Polygon", closed_ring(fp.corners()), height=round(fp.height, 2))
        self.layers["building"].append(feature)

    # 3. Buildings along the frontage of every road, where the raster is still free land.
    def frontage_buildings(self, p: StyleProfile) -> None:
        rng = self.rng
        for r in self.graph.roads:
            s_start, s_end = self.graph.interior(r, 2.0)
            for side in (-1.0, 1.0):
                s = s_start + rng.uniform(0, 6)
                while s < s_end:
                    w = rng.uniform(*p.frontage)
                    dpt = rng.uniform(*p.depth)
                    pos, tan = point_at(r.centre, np.array([s + w / 2]), r.cum)
                    normal = np.array([-tan[0, 1], tan[0, 0]]) * side
                    off = r.half_width + r.sidewalk + rng.uniform(*p.setback) + dpt / 2
                    c = pos[0] + normal * off
                    yaw = float(np.arctan2(tan[0, 1], tan[0, 0]))
                    height = float(rng.uniform(*p.heights))
                    fp = Footprint(float(c[0]), float(c[1]), w / 2, dpt / 2, yaw, height)
                    if np.isin(self.paint.classes_at(_points_in(fp, pad=0.6)), _FREE).all():
                        self.add_building(fp)
                    s += w + rng.uniform(*p.gaps)

    # 4. Back-lot buildings on free land away from the streets: the skyline a street view ends in.
    def back_lot_buildings(self, count: int, heights: tuple[float, float]) -> None:
        rng = self.rng
        xmin, ymin, xmax, ymax = self.extent
        placed = 0
        for _ in range(count * 4):
            if placed >= count:
                break
            fp = Footprint(
                float(rng.uniform(xmin, xmax)),
                float(rng.uniform(ymin, ymax)),
                float(rng.uniform(6, 20)),
                float(rng.uniform(6, 15)),
                float(rng.choice([0.0, np.pi / 2]) + rng.normal(0, 0.05)),
                float(rng.uniform(heights[0], heights[1] * 1.3)),
            )
            if np.isin(self.paint.classes_at(_points_in(fp, step=1.5, pad=3.0)), _FREE).all():
                self.add_building(fp)
                placed += 1

    # 5. Green areas on the remaining free land.
    def green_areas(self, count: int) -> None:
        rng = self.rng
        xmin, ymin, xmax, ymax = self.extent
        for _ in range(count * 3):
            if len(self.green) >= count:
                break
            fp = Footprint(
                float(rng.uniform(xmin, xmax)),
                float(rng.uniform(ymin, ymax)),
                float(rng.uniform(6, 25)),
                float(rng.uniform(5, 18)),
                float(rng.uniform(0, np.pi)),
            )
            if (self.paint.classes_at(_points_in(fp, step=2.0, pad=1.0)) == MAP_CLASS_INDEX["terrain"]).all():
                self.green.append(fp)
                self.paint.polygon(fp.corners(), "vegetation")
                self.layers["vegetation"].append(map_feature("Polygon", closed_ring(fp.corners())))
