"""Things in the world: vehicles, people, street furniture, trees, walls and buildings.

Each actor is a handful of analytic solids in its own frame (x forward, z up from the ground), so a car
reads as a car to a 32-beam sensor (a body box under an ellipsoid cabin) while staying cheap to ray-cast.
Moving actors follow a lane or sidewalk polyline at constant speed and stop before its end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from lidar.sim.hdmap import HDMap
from lidar.sim.layout import Footprint, Layout, closed_ring, map_feature
from lidar.sim.primitives import BOX, CYLINDER, ELLIPSOID, Shapes
from lidar.sim.roads import PARKING_WIDTH, Road, arc_lengths, offset_line, point_at, sub_line
from lidar.sim.styles import StyleProfile, style_profile
from lidar.vocabulary import OBJECT_CLASS_INDEX, OBJECT_CLASSES

logger = logging.getLogger(__name__)

#: Scenery the HD map lists as footprints (layer "barrier"): what a planner must not drive through.
BARRIER_CLASSES = ("wall", "fence")
#: Share of a facade that is glass: rays pass through windows and return from the rooms behind them.
WINDOW_FRACTION = 0.2
#: Size (m) of a window, the grain of a facade's holes (`primitives.Shapes.grain`).
WINDOW_SIZE = 1.5
#: Grain (m) of the holes in foliage and fence mesh.
FINE_GRAIN = 0.1
#: How deep (m) the rooms behind a window reach before what fills them (curtains, furniture, inner walls)
#: stops the ray, and how bright that is. Without it a window ray crossed the whole building.
ROOM_DEPTH = 1.5
INTERIOR_REFLECTIVITY = 0.1
#: Scenery the HD map lists one by one in its "plant" layer (trees by their crowns, hedges, bushes):
#: a city's tree inventory, which a model needs to draw a street's trees where they stand.
PLANT_CLASSES = ("tree", "bush")


@dataclass
class Actor:
    """A boxed object. Static actors have a fixed (x, y, yaw); moving ones follow `path` at `speed`."""

    id: int
    cls: str
    size: tuple[float, float, float]  # length, width, height (m)
    parts: Shapes  # solids in the actor frame
    x: float = 0.0
    y: float = 0.0
    yaw: float = 0.0
    path: np.ndarray | None = None
    s0: float = 0.0
    speed: float = 0.0
    s_stop: float = 0.0

    @property
    def moving(self) -> bool:
        return self.path is not None and self.speed > 0


class ActorTable:
    """All actors as arrays, so poses and solids at any time come out of a few vectorised operations.

    Moving actors' paths are concatenated into one polyline with a gap between paths; each actor's arc
    length is offset into it, so one searchsorted places every actor at once.
    """

    def __init__(self, actors: list[Actor], hdmap: HDMap) -> None:
        self.hdmap = hdmap
        self.ids = np.array([a.id for a in actors], np.int32)
        self.cls = np.array([OBJECT_CLASS_INDEX[a.cls] for a in actors], np.int16)
        self.size = np.array([a.size for a in actors], np.float64).reshape(-1, 3)
        self.moving = np.array([a.moving for a in actors], bool)
        self.x = np.array([a.x for a in actors], np.float64)
        self.y = np.array([a.y for a in actors], np.float64)
        self.yaw = np.array([a.yaw for a in actors], np.float64)
        self.z = hdmap.ground_height(self.x, self.y) if len(actors) else np.zeros(0)
        movers = [a for a in actors if a.moving]
        self.mov_index = np.flatnonzero(self.moving)
        self.s0 = np.array([a.s0 for a in movers], np.float64)
        self.speed = np.array([a.speed for a in movers], np.float64)
        self.s_stop = np.array([a.s_stop for a in movers], np.float64)
        lines, cums, base, start, end = [], [], [], [], []
        offset, count = 0.0, 0
        for a in movers:
            assert a.path is not None
            cum = arc_lengths(a.path)
            lines.append(a.path)
            cums.append(cum + offset)
            base.append(offset)
            start.append(count)
            end.append(count + len(cum) - 1)
            offset += cum[-1] + 10.0
            count += len(cum)
        self.path_pts = np.concatenate(lines) if lines else np.zeros((0, 2))
        self.path_cum = np.concatenate(cums) if cums else np.zeros(0)
        self.base = np.array(base, np.float64)
        self.seg_lo = np.array(start, np.int64)
        self.seg_hi = np.array(end, np.int64) - 1
        self.length = np.array([c[-1] - b for c, b in zip(cums, base, strict=True)], np.float64)
        parts = [a.parts for a in movers]
        self.parts = Shapes.concat(parts)
        self.part_owner = np.repeat(np.arange(len(movers)), [len(p) for p in parts]).astype(np.int64)

    def moving_poses(self, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(x, y, ground z, yaw) of every moving actor at time t."""
        if not len(self.s0):
            z = np.zeros(0)
            return z, z, z, z
        s = np.clip(np.minimum(self.s0 + self.speed * t, self.s_stop), 0.0, self.length)
        g = s + self.base
        i = np.clip(np.searchsorted(self.path_cum, g, side="right") - 1, self.seg_lo, self.seg_hi)
        p0, p1 = self.path_pts[i], self.path_pts[i + 1]
        seg = np.maximum(self.path_cum[i + 1] - self.path_cum[i], 1e-9)
        a = ((g - self.path_cum[i]) / seg)[:, None]
        pos = p0 + (p1 - p0) * a
        d = p1 - p0
        z = self.hdmap.ground_height(pos[:, 0], pos[:, 1])
        return pos[:, 0], pos[:, 1], z, np.arctan2(d[:, 1], d[:, 0])

    def poses(self, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(x, y, ground z, yaw) of every actor at time t (static ones never move)."""
        x, y, z, yaw = self.x.copy(), self.y.copy(), self.z.copy(), self.yaw.copy()
        mx, my, mz, myaw = self.moving_poses(t)
        x[self.mov_index], y[self.mov_index], z[self.mov_index], yaw[self.mov_index] = mx, my, mz, myaw
        return x, y, z, yaw

    def moving_shapes(self, t: float, keep: np.ndarray | None = None) -> Shapes:
        """Solids of the moving actors at time t; `keep` (per moving actor) selects which."""
        x, y, z, yaw = self.moving_poses(t)
        sel = np.arange(len(self.part_owner)) if keep is None else np.flatnonzero(keep[self.part_owner])
        own = self.part_owner[sel]
        return self.parts.take(sel).placed(x[own], y[own], z[own], yaw[own])


def _row(kind, center, size, yaw, refl, cls, actor, porosity=0.0, grain=FINE_GRAIN) -> tuple:
    return (kind, center, size, yaw, refl, OBJECT_CLASS_INDEX[cls], actor, porosity, grain)


# ------------------------------------------------------------------------------------------ templates
def vehicle(rng: np.random.Generator, cls: str, actor: int) -> tuple[Shapes, tuple[float, float, float]]:
    """A rounded vehicle body: boxes for the chassis and cargo, ellipsoids for cabin and bonnet."""
    paint = float(rng.choice([0.06, 0.12, 0.25, 0.45, 0.6]) * rng.uniform(0.8, 1.2))
    if cls == "car":
        length, width, height = rng.uniform(3.9, 4.9), rng.uniform(1.7, 1.9), rng.uniform(1.4, 1.6)
        rows = [
            _row(BOX, (0, 0, 0.62), (length / 2, width / 2, 0.37), 0.0, paint, cls, actor),
            _row(
                ELLIPSOID,
                (-0.08 * length, 0, 0.95),
                (0.33 * length, 0.47 * width, height - 0.95),
                0.0,
                paint * 0.8,
                cls,
                actor,
            ),
        ]
    elif cls == "van":
        length, width, height = rng.uniform(4.8, 5.6), rng.uniform(1.9, 2.05), rng.uniform(1.9, 2.4)
        body = length - 0.9
        rows = [
            _row(
                BOX,
                (-0.45, 0, (0.3 + height) / 2),
                (body / 2, width / 2, (height - 0.3) / 2),
                0.0,
                paint,
                cls,
                actor,
            ),
            _row(ELLIPSOID, (length / 2 - 1.0, 0, 0.85), (1.0, width / 2, 0.55), 0.0, paint, cls, actor),
        ]
    elif cls == "truck":
        length, width, height = rng.uniform(7.0, 10.0), rng.uniform(2.4, 2.55), rng.uniform(3.2, 3.8)
        cab = 2.2
        rows = [
            _row(BOX, (length / 2 - cab / 2, 0, 1.75), (cab / 2, width / 2, 1.3), 0.0, paint, cls, actor),
            _row(
                BOX,
                (-cab / 2 - 0.15, 0, (0.6 + height) / 2),
                ((length - cab - 0.3) / 2, width / 2, (height - 0.6) / 2),
                0.0,
                float(rng.uniform(0.2, 0.6)),
                cls,
                actor,
            ),
        ]
    else:
        raise ValueError(f"unknown vehicle class {cls!r}; expected car, van or truck")
    return Shapes.from_rows(rows), (float(length), float(width), float(height))


def person(
    rng: np.random.Generator, actor: int, cyclist: bool = False
) -> tuple[Shapes, tuple[float, float, float]]:
    """A pedestrian (body cylinder + head) or a cyclist (bike frame box + rider)."""
    h = rng.uniform(1.55, 1.9)
    refl = float(rng.uniform(0.15, 0.45))
    if not cyclist:
        rows = [
            _row(
                CYLINDER, (0, 0, (h - 0.24) / 2), (0.22, 0.22, (h - 0.24) / 2), 0.0, refl, "pedestrian", actor
            ),
            _row(ELLIPSOID, (0, 0, h - 0.12), (0.1, 0.1, 0.12), 0.0, refl, "pedestrian", actor),
        ]
        return Shapes.from_rows(rows), (0.5, 0.5, float(h))
    top = h + 0.2
    rows = [
        _row(BOX, (0, 0, 0.5), (0.85, 0.06, 0.45), 0.0, 0.3, "cyclist", actor),
        _row(
            CYLINDER,
            (0, 0, (0.9 + top - 0.24) / 2),
            (0.2, 0.2, (top - 0.24 - 0.9) / 2),
            0.0,
            refl,
            "cyclist",
            actor,
        ),
        _row(ELLIPSOID, (0, 0, top - 0.12), (0.1, 0.1, 0.12), 0.0, refl, "cyclist", actor),
    ]
    return Shapes.from_rows(rows), (1.8, 0.6, float(top))


# ------------------------------------------------------------------------------------------ population
@dataclass
class Population:
    actors: list[Actor]
    scenery: Shapes  # static solids of scenery and of static actors, in world coordinates


def populate(rng: np.random.Generator, layout: Layout, style: str) -> Population:
    """Place parked and driving vehicles, people, poles, signs, trees, walls, fences and buildings.

    The numbered steps draw from one random stream in a fixed order, so a world is a pure function of its seed;
    reordering them or adding a draw changes every world (bump `dataset.SIMULATOR_VERSION`).
    """
    place = _Placer(rng, layout, style_profile(style))
    for r in layout.graph.roads:
        s_lo, s_hi = layout.graph.interior(r, 6.0)
        if s_hi - s_lo < 8.0:
            continue
        inner = sub_line(r.centre, s_lo, s_hi)
        if r.parking:
            place.parked_vehicles(r, inner)  # 1
        place.traffic(r)  # 2
        place.cyclist(r)  # 3
        if r.sidewalk > 0:
            place.sidewalk_life(r, s_lo, s_hi)  # 4
        if r.kind == "highway":
            place.highway_furniture(r, inner)  # 5
    place.junction_signs()  # 6
    if place.profile.traffic_lights:
        place.traffic_lights()  # 7
    place.crossing_pedestrians()  # 8
    building_rows = place.buildings()  # 9
    place.green_areas()
    return place.population(building_rows, style)


class _Placer:
    """The steps of `populate`, each adding to one list of actors and one of scenery rows (relative to the
    ground under them) with one random stream."""

    def __init__(self, rng: np.random.Generator, layout: Layout, profile: StyleProfile) -> None:
        self.rng, self.layout, self.profile = rng, layout, profile
        self.hdmap, self.graph = layout.hdmap, layout.graph
        self.radius = [self.graph.node_radius(n) for n in range(len(self.graph.nodes))]
        self.actors: list[Actor] = []
        self.static_rows: list[tuple] = []

    def add_static_actor(self, shapes: Shapes, size, cls: str, x: float, y: float, yaw: float) -> None:
        self.actors.append(Actor(id=len(self.actors), cls=cls, size=size, parts=shapes, x=x, y=y, yaw=yaw))

    def add_mover(self, cls: str, shapes: Shapes, size, path: np.ndarray, s0: float, speed: float,
                  s_stop: float) -> None:
        self.actors.append(Actor(id=len(self.actors), cls=cls, size=size, parts=shapes, path=path, s0=s0,
                                 speed=speed, s_stop=s_stop))

    def vehicle_class(self) -> str:
        return str(self.rng.choice(["car", "van", "truck"], p=list(self.profile.vehicle_mix)))

    # 1. Parked vehicles along the curb.
    def parked_vehicles(self, r: Road, inner: np.ndarray) -> None:
        rng = self.rng
        for side in (-1.0, 1.0):
            lane = offset_line(inner, side * (r.half_width - PARKING_WIDTH / 2))
            if side > 0:
                lane = lane[::-1].copy()
            cum = arc_lengths(lane)
            s = rng.uniform(0, 4)
            while s < cum[-1] - 3:
                cls = str(rng.choice(["car", "van"], p=[0.85, 0.15]))
                shapes, size = vehicle(rng, cls, len(self.actors))
                if rng.random() < 0.75 * self.profile.density + 0.2:
                    pos, tan = point_at(lane, np.array([s + size[0] / 2]), cum)
                    yaw = float(np.arctan2(tan[0, 1], tan[0, 0]))
                    self.add_static_actor(shapes, size, cls, float(pos[0, 0]), float(pos[0, 1]), yaw)
                s += size[0] + rng.uniform(0.8, 3.0)

    # 2. Traffic: one speed per lane so cars never run into each other; they queue at the end.
    def traffic(self, r: Road) -> None:
        rng, radius = self.rng, self.radius
        for from_node in (r.a, r.b):
            for lane_i in range(r.lanes):
                line = r.lane_line(from_node, lane_i)
                cum = arc_lengths(line)
                s_start = radius[from_node] + 2.0
                s_end = cum[-1] - radius[r.b if from_node == r.a else r.a] - 2.0
                speed = float(rng.uniform(6.0, 13.0) if r.kind == "street" else rng.uniform(20.0, 30.0))
                n = rng.poisson(self.profile.density * (s_end - s_start) / 35.0)
                starts = np.sort(rng.uniform(s_start, s_end, size=n))[::-1]
                last = np.inf
                queued = 0
                for s0 in starts:
                    cls = self.vehicle_class()
                    shapes, size = vehicle(rng, cls, len(self.actors))
                    if last - s0 < size[0] + 6.0:
                        continue
                    stop = s_end - size[0] / 2 - queued * 7.0 - 8.0 * (queued > 0)
                    self.add_mover(cls, shapes, size, line, float(s0), speed, float(max(stop, s0)))
                    last = s0
                    queued += 1

    # 3. Cyclists near the right edge of the outer lane.
    def cyclist(self, r: Road) -> None:
        rng = self.rng
        if r.kind == "street" and rng.random() < 0.35 * self.profile.density:
            from_node = int(rng.choice([r.a, r.b]))
            line = offset_line(r.directed(from_node), -(r.carriageway - 0.6))
            cum = arc_lengths(line)
            shapes, size = person(rng, len(self.actors), cyclist=True)
            s0 = float(rng.uniform(self.radius[from_node], cum[-1] / 2))
            speed = float(rng.uniform(3.0, 6.0))
            self.add_mover("cyclist", shapes, size, line, s0, speed, float(cum[-1] - 15.0))

    # 4. Sidewalk life: pedestrians, street lights, trees, hedges.
    def sidewalk_life(self, r: Road, s_lo: float, s_hi: float) -> None:
        for side in (-1.0, 1.0):
            self.pedestrians(r, side, s_lo, s_hi)
            self.street_lights(r, side, s_lo, s_hi)
            if self.profile.street_trees:
                self.trees_and_hedges(r, side, s_lo, s_hi)

    def pedestrians(self, r: Road, side: float, s_lo: float, s_hi: float) -> None:
        rng = self.rng
        walk = offset_line(r.centre, side * (r.half_width + r.sidewalk * 0.6))
        cum = arc_lengths(walk)
        for _ in range(rng.poisson(self.profile.density * 3.0 * r.length / 100.0)):
            shapes, size = person(rng, len(self.actors))
            s0 = float(rng.uniform(s_lo, s_hi))
            if rng.random() < 0.6:
                path = walk if rng.random() < 0.5 else walk[::-1].copy()
                self.add_mover("pedestrian", shapes, size, path, s0, float(rng.uniform(0.9, 1.6)),
                               float(cum[-1] - s_lo))
            else:
                pos, _ = point_at(walk, np.array([s0]), cum)
                yaw = float(rng.uniform(-np.pi, np.pi))
                self.add_static_actor(shapes, size, "pedestrian", float(pos[0, 0]), float(pos[0, 1]), yaw)

    def street_lights(self, r: Road, side: float, s_lo: float, s_hi: float) -> None:
        rows = self.static_rows
        edge = offset_line(r.centre, side * (r.half_width + 0.5))
        ecum = arc_lengths(edge)
        for s in np.arange(s_lo, s_hi, self.rng.uniform(25.0, 35.0)):
            pos, tan = point_at(edge, np.array([s]), ecum)
            x, y = float(pos[0, 0]), float(pos[0, 1])
            z = 0.0  # heights of scenery rows are relative to the ground under them (added at the end)
            h = float(self.rng.uniform(6.5, 9.0))
            rows.append(_row(CYLINDER, (x, y, z + h / 2), (0.12, 0.12, h / 2), 0.0, 0.3, "pole", -1))
            inward = -side * np.array([-tan[0, 1], tan[0, 0]])
            arm = np.array([x, y]) + inward * 0.9
            yaw = float(np.arctan2(inward[1], inward[0]))
            rows.append(_row(BOX, (arm[0], arm[1], z + h - 0.15), (0.9, 0.08, 0.08), yaw, 0.35, "pole", -1))

    def trees_and_hedges(self, r: Road, side: float, s_lo: float, s_hi: float) -> None:
        rng = self.rng
        tree_line = offset_line(r.centre, side * (r.half_width + r.sidewalk - 0.7))
        tcum = arc_lengths(tree_line)
        if rng.random() < 0.85:
            for s in np.arange(s_lo + rng.uniform(0, 8), s_hi, rng.uniform(7.0, 14.0)):
                pos, _ = point_at(tree_line, np.array([s]), tcum)
                self.static_rows += _tree(rng, float(pos[0, 0]), float(pos[0, 1]))
        # Hedges behind the sidewalk, in pieces: the low clutter that lines real streets.
        if rng.random() < self.profile.hedge_p:
            back = offset_line(r.centre, side * (r.half_width + r.sidewalk + 0.6))
            a = s_lo + rng.uniform(0, 10)
            while a < s_hi - 4:
                b = min(a + rng.uniform(4, 20), s_hi)
                height, thickness = float(rng.uniform(0.7, 1.6)), float(rng.uniform(0.6, 1.0))
                hedge = sub_line(back, a, b)
                self.static_rows += _wall_along(hedge, height, thickness, "bush", 0.4, 0.3, segment=6.0)
                a = b + rng.uniform(2, 12)

    # 5. Highway furniture: a median barrier and noise walls, broken at junctions.
    def highway_furniture(self, r: Road, inner: np.ndarray) -> None:
        rng = self.rng
        for off, hgt, thick in (
            (0.0, 0.9, 0.5),
            (r.half_width + 1.0, float(rng.uniform(2.5, 4.0)), 0.3),
            (-(r.half_width + 1.0), float(rng.uniform(2.5, 4.0)), 0.3),
        ):
            if off != 0.0 and rng.random() < 0.4:
                continue
            self.static_rows += _wall_along(offset_line(inner, off), hgt, thick, "wall", 0.3, 0.0)

    def junction_approaches(self, p_keep: float) -> Iterator[tuple[int, Road]]:
        """(node, road) of each road into a junction of 3 or more, kept with probability `p_keep` and if long
        enough. Lazily: each road's draw comes after the caller's draws for the one before, as the stream was
        laid out when these steps were one loop."""
        graph, radius = self.graph, self.radius
        for n in range(len(graph.nodes)):
            if graph.degree(n) < 3:
                continue
            for ri in graph.incident(n):
                r = graph.roads[ri]
                if self.rng.random() > p_keep or r.length < 2 * radius[n] + 10:
                    continue
                yield n, r

    # 6. Signs at junction approaches.
    def junction_signs(self) -> None:
        rows = self.static_rows
        for n, r in self.junction_approaches(p_keep=0.5):
            pos, tan = point_at(r.directed(n), np.array([self.radius[n] + 3.0]))
            normal = np.array([-tan[0, 1], tan[0, 0]])
            p = pos[0] - normal * (r.half_width + 0.4)
            z = 0.0
            h = float(self.rng.uniform(2.2, 2.8))
            yaw = float(np.arctan2(tan[0, 1], tan[0, 0]))
            rows.append(_row(CYLINDER, (p[0], p[1], z + h / 2), (0.04, 0.04, h / 2), 0.0, 0.3, "sign", -1))
            rows.append(_row(BOX, (p[0], p[1], z + h + 0.3), (0.03, 0.35, 0.35), yaw, 0.95, "sign", -1))

    # 7. Traffic-light masts on the curb of junction approaches, their arm over the lanes.
    def traffic_lights(self) -> None:
        rows = self.static_rows
        for n, r in self.junction_approaches(p_keep=0.6):
            pos, tan = point_at(r.directed(n), np.array([self.radius[n] + 1.0]))
            inward = -np.array([-tan[0, 1], tan[0, 0]])  # from the left curb of the leaving lanes inwards
            base = pos[0] - inward * (r.half_width + 0.5)
            arm = min(r.carriageway, 6.0)
            mid = base + inward * (arm / 2 + 0.5)
            tip = base + inward * (arm + 0.3)
            yaw = float(np.arctan2(inward[1], inward[0]))
            rows.append(_row(CYLINDER, (base[0], base[1], 2.9), (0.12, 0.12, 2.9), 0.0, 0.3, "pole", -1))
            rows.append(_row(BOX, (mid[0], mid[1], 5.5), (arm / 2 + 0.5, 0.08, 0.08), yaw, 0.3, "pole", -1))
            rows.append(_row(BOX, (tip[0], tip[1], 4.9), (0.15, 0.2, 0.5), yaw, 0.5, "sign", -1))

    # 8. People on the crosswalks, crossing.
    def crossing_pedestrians(self) -> None:
        rng = self.rng
        for line in self.layout.crossings:
            if rng.random() < 0.3 * self.profile.density:
                shapes, size = person(rng, len(self.actors))
                path = line if rng.random() < 0.5 else line[::-1].copy()
                length = float(np.linalg.norm(path[1] - path[0]))
                self.add_mover("pedestrian", shapes, size, path, float(rng.uniform(0.0, length)),
                               float(rng.uniform(1.0, 1.5)), length)

    # 9. Buildings (with garden fences), then green areas with trees and bushes.
    def buildings(self) -> list[tuple]:
        """The buildings' rows, already in world heights (their base is the lowest ground under a corner)."""
        rng, buildings = self.rng, self.layout.buildings
        rows: list[tuple] = []
        if not buildings:
            return rows
        corners = np.stack([b.corners() for b in buildings])
        bases = self.hdmap.ground_height(corners[..., 0], corners[..., 1]).min(axis=1) - 0.5
        for b, base in zip(buildings, bases, strict=True):
            h = b.height + 0.5
            refl = float(rng.uniform(0.15, 0.45))
            half = (b.half_length, b.half_width, h / 2)
            centre = (b.cx, b.cy, base + h / 2)
            rows.append(_row(BOX, centre, half, b.yaw, refl, "facade", -1, WINDOW_FRACTION, WINDOW_SIZE))
            rows.append(_interior(b, base, h))
            fence_p = self.profile.garden_fence_p
            if fence_p > 0 and rng.random() < fence_p:  # no draw where a style has no fences
                self.static_rows += _fence_around(rng, b)
        return rows

    def green_areas(self) -> None:
        rng = self.rng
        for g in self.layout.green:
            n_trees = int(g.half_length * g.half_width * 4 / 60.0 * rng.uniform(0.5, 1.2))
            for _ in range(n_trees):
                u, v = rng.uniform(-0.85, 0.85, size=2)
                c, s = np.cos(g.yaw), np.sin(g.yaw)
                x = g.cx + c * u * g.half_length - s * v * g.half_width
                y = g.cy + s * u * g.half_length + c * v * g.half_width
                if rng.random() < 0.6:
                    self.static_rows += _tree(rng, float(x), float(y))
                else:
                    rxy = float(rng.uniform(0.6, 1.6))
                    rz = float(rng.uniform(0.5, 1.2))
                    size = (rxy, rxy * rng.uniform(0.7, 1.0), rz)
                    yaw = float(rng.uniform(0, np.pi))
                    bush = _row(ELLIPSOID, (x, y, rz * 0.8), size, yaw, 0.4, "bush", -1, 0.3)
                    self.static_rows.append(bush)

    def population(self, building_rows: list[tuple], style: str) -> Population:
        """Everything placed, in world coordinates, with the map's barrier and plant layers added.

        Scenery rows are relative to the ground under their centre; one batched lookup places them all.
        Static actors are baked into the scenery too; moving actors are placed per frame.
        """
        hdmap, actors = self.hdmap, self.actors
        rel = Shapes.from_rows(self.static_rows)
        hdmap.layers["barrier"] = footprint_features(rel, BARRIER_CLASSES, (BOX,))
        hdmap.layers["plant"] = footprint_features(rel, PLANT_CLASSES, (BOX, ELLIPSOID))
        rel.center[:, 2] += hdmap.ground_height(rel.center[:, 0], rel.center[:, 1])
        still = [a for a in actors if not a.moving]
        xs, ys = np.array([a.x for a in still]), np.array([a.y for a in still])
        zs = hdmap.ground_height(xs, ys) if still else []
        static_parts = [a.parts.placed(a.x, a.y, float(z), a.yaw) for a, z in zip(still, zs, strict=True)]
        scenery = Shapes.concat([rel, Shapes.from_rows(building_rows), *static_parts])
        logger.debug(
            "populated %s: %d actors (%d moving), %d static solids",
            style,
            len(actors),
            sum(a.moving for a in actors),
            len(scenery),
        )
        return Population(actors=actors, scenery=scenery)


def _tree(rng: np.random.Generator, x: float, y: float) -> list[tuple]:
    z = 0.0
    trunk_h = float(rng.uniform(1.8, 3.5))
    r = float(rng.uniform(0.12, 0.3))
    rxy = float(rng.uniform(1.5, 3.8))
    rz = float(rng.uniform(1.5, 3.5))
    return [
        _row(CYLINDER, (x, y, z + trunk_h / 2 + 0.3), (r, r, trunk_h / 2 + 0.3), 0.0, 0.25, "tree", -1),
        _row(
            ELLIPSOID,
            (x, y, z + trunk_h + rz * 0.85),
            (rxy, rxy * rng.uniform(0.8, 1.0), rz),
            float(rng.uniform(0, np.pi)),
            0.45,
            "tree",
            -1,
            0.35,
        ),
    ]


def _wall_along(
    line: np.ndarray,
    height: float,
    thickness: float,
    cls: str,
    refl: float,
    porosity: float,
    segment: float = 12.0,
) -> list[tuple]:
    """Straight box segments approximating a wall or fence along a (possibly curved) line."""
    rows = []
    cum = arc_lengths(line)
    for s in np.arange(0.0, cum[-1] - 1.0, segment):
        e = min(s + segment, cum[-1])
        p, _ = point_at(line, np.array([s, e]), cum)
        mid = p.mean(axis=0)
        d = p[1] - p[0]
        z = -0.2
        rows.append(
            _row(
                BOX,
                (mid[0], mid[1], z + (height + 0.2) / 2),
                (np.linalg.norm(d) / 2 + 0.05, thickness / 2, (height + 0.2) / 2),
                float(np.arctan2(d[1], d[0])),
                refl,
                cls,
                -1,
                porosity,
            )
        )
    return rows


def footprint_features(rel: Shapes, classes: tuple[str, ...], kinds: tuple[int, ...]) -> list[dict]:
    """The solids of `rel` (rows relative to the ground) of these classes and kinds as map footprints.

    HD maps list road barriers and walls, because a planner must know them, and cities list their trees;
    the world model needs both: without walls it draws the ground a ray would meet behind a noise wall,
    without trees it cannot know where a street's crowns stand. Each footprint is the solid's (x, y)
    rectangle with its top as the height; a tree's trunk is left out, since its crown's footprint covers it.
    """
    labels = [OBJECT_CLASS_INDEX[name] for name in classes]
    features = []
    for i in np.flatnonzero(np.isin(rel.kind, kinds) & np.isin(rel.label, labels)):
        fp = Footprint(*rel.center[i, :2], *rel.size[i, :2], float(rel.yaw[i]))
        features.append(map_feature("Polygon", closed_ring(fp.corners()), **{
            "class": OBJECT_CLASSES[rel.label[i]], "height": round(float(rel.center[i, 2] + rel.size[i, 2]), 2)}))
    return features


def _interior(b: Footprint, base: float, height: float) -> tuple:
    """What a ray through a window meets: the building's core, ROOM_DEPTH behind the facade.

    The facade box lets a window ray through whole, so without the core it crossed the building and
    returned from whatever stood behind it. The rooms are shallow because most rays meet a facade at a
    grazing angle, and a grazing ray must still meet the core before it leaves through a side wall.
    """
    core = (max(b.half_length - ROOM_DEPTH, 0.5), max(b.half_width - ROOM_DEPTH, 0.5), height / 2)
    return _row(BOX, (b.cx, b.cy, base + height / 2), core, b.yaw, INTERIOR_REFLECTIVITY, "facade", -1)


def _fence_around(rng: np.random.Generator, b: Footprint) -> list[tuple]:
    grow = Footprint(b.cx, b.cy, b.half_length + rng.uniform(2, 5), b.half_width + rng.uniform(2, 5), b.yaw)
    ring = grow.corners()
    height = float(rng.uniform(1.1, 1.8))
    rows = []
    for i in (1, 2, 3):  # leave the street-facing side open
        seg = np.stack([ring[i], ring[(i + 1) % 4]])
        rows += _wall_along(seg, height, 0.05, "fence", 0.25, 0.5, segment=50.0)
    return rows
