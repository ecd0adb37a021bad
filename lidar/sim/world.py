"""A procedural driving world: HD map, road graph, actors and the static scenery, with a culling grid.

`make_world(seed, style)` is a pure function of its arguments. The static solids are bucketed into a
uniform grid once, so a scan only looks at the cells within sensor range.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np

from lidar.sim.actors import Actor, ActorTable, populate
from lidar.sim.hdmap import HDMap
from lidar.sim.layout import build_layout
from lidar.sim.primitives import Shapes
from lidar.sim.roads import RoadGraph, generate_road_graph
from lidar.sim.styles import STYLES
from lidar.vocabulary import BOXED_CLASSES, OBJECT_CLASS_INDEX

logger = logging.getLogger(__name__)

GRID_CELL = 24.0


#: Moving actors within this margin (m) of the sensor position are left out of its scan (`World.shapes_near`)
#: and of its layout (`World.boxes` with `ego_pose`).
EGO_CLEARANCE = 2.5


@dataclass
class CullingGrid:
    """Static solids bucketed by the grid cells their footprint disc touches (CSR layout)."""

    origin: np.ndarray
    shape: tuple[int, int]
    offsets: np.ndarray  # (cells + 1,)
    items: np.ndarray  # solid indices, grouped by cell
    cell: float = GRID_CELL

    @classmethod
    def build(cls, shapes: Shapes, cell: float = GRID_CELL) -> CullingGrid:
        """Bucket once per world, so each scan's `query` costs only the cells within range."""
        if len(shapes) == 0:
            return cls(np.zeros(2), (1, 1), np.zeros(2, np.int64), np.zeros(0, np.int64), cell)
        rad = shapes.footprint_radius()
        lo = (shapes.center[:, :2] - rad[:, None]).min(axis=0) - cell
        ix0 = np.floor((shapes.center[:, 0] - rad - lo[0]) / cell).astype(np.int64)
        ix1 = np.floor((shapes.center[:, 0] + rad - lo[0]) / cell).astype(np.int64)
        iy0 = np.floor((shapes.center[:, 1] - rad - lo[1]) / cell).astype(np.int64)
        iy1 = np.floor((shapes.center[:, 1] + rad - lo[1]) / cell).astype(np.int64)
        nx, ny = int(ix1.max()) + 2, int(iy1.max()) + 2
        cells, items = [], []
        for i in range(len(shapes)):  # once per world; big solids span a few cells
            xs = np.arange(ix0[i], ix1[i] + 1)
            ys = np.arange(iy0[i], iy1[i] + 1)
            c = (ys[:, None] * nx + xs[None, :]).ravel()
            cells.append(c)
            items.append(np.full(len(c), i))
        cells_a = np.concatenate(cells)
        items_a = np.concatenate(items)
        order = np.argsort(cells_a, kind="stable")
        counts = np.bincount(cells_a, minlength=nx * ny)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        return cls(lo, (ny, nx), offsets, items_a[order], cell)

    def query(self, x: float, y: float, radius: float) -> np.ndarray:
        """Indices of solids in cells overlapping the disc (sorted, unique)."""
        ny, nx = self.shape
        cell = self.cell
        ix0 = max(int(np.floor((x - radius - self.origin[0]) / cell)), 0)
        ix1 = min(int(np.floor((x + radius - self.origin[0]) / cell)), nx - 1)
        iy0 = max(int(np.floor((y - radius - self.origin[1]) / cell)), 0)
        iy1 = min(int(np.floor((y + radius - self.origin[1]) / cell)), ny - 1)
        if ix1 < ix0 or iy1 < iy0:
            return np.zeros(0, np.int64)
        xs = np.arange(ix0, ix1 + 1)
        ys = np.arange(iy0, iy1 + 1)
        cx = self.origin[0] + (xs + 0.5) * cell
        cy = self.origin[1] + (ys + 0.5) * cell
        near = (np.abs(cx[None, :] - x) - cell / 2).clip(0) ** 2 + (np.abs(cy[:, None] - y) - cell / 2).clip(
            0
        ) ** 2
        ids = (ys[:, None] * nx + xs[None, :])[near <= radius * radius]
        starts, ends = self.offsets[ids], self.offsets[ids + 1]
        if not len(ids) or int((ends - starts).sum()) == 0:
            return np.zeros(0, np.int64)
        lens = ends - starts
        idx = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
        return np.unique(self.items[idx])


@dataclass
class World:
    """Everything a scan needs. `time` is the moment the moving actors are shown at (see `at_time`)."""

    seed: int
    style: str
    hdmap: HDMap
    graph: RoadGraph
    actors: list[Actor]
    scenery: Shapes
    time: float = 0.0
    grid: CullingGrid = field(default=None, repr=False)  # type: ignore[assignment]

    table: ActorTable = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.grid is None:
            self.grid = CullingGrid.build(self.scenery)
        if self.table is None:
            self.table = ActorTable(self.actors, self.hdmap)

    def at_time(self, t_seconds: float) -> World:
        """The same world with its moving actors where they are `t_seconds` after the start."""
        return replace(self, time=float(t_seconds))

    def shapes_near(self, x: float, y: float, radius: float, clearance: float = 0.0) -> Shapes:
        """Static solids in the culling cells within `radius`, plus moving actors placed at `self.time`.

        A moving actor whose footprint, grown by `clearance`, covers (x, y) is left out: traffic is not
        planned around the ego, and a sensor inside a truck would see nothing else.
        """
        static = self.scenery.take(self.grid.query(x, y, radius))
        moving = self.table.moving_poses(self.time)
        mx, my = moving[0], moving[1]
        keep = ((mx - x) ** 2 + (my - y) ** 2 <= (radius + 10.0) ** 2) & ~self._covering(moving, x, y, clearance)
        return Shapes.concat([static, self.table.moving_shapes(self.time, keep)])

    def _covering(self, moving: tuple[np.ndarray, ...], x: float, y: float, clearance: float) -> np.ndarray:
        """(moving actors,) bool: footprint grown by `clearance` covers (x, y), the actors at `moving_poses`
        (never if clearance <= 0)."""
        tab = self.table
        mx, my, _, myaw = moving
        if clearance <= 0 or not len(mx):
            return np.zeros(len(mx), dtype=bool)
        c, s = np.cos(myaw), np.sin(myaw)
        u = c * (x - mx) + s * (y - my)
        v = -s * (x - mx) + c * (y - my)
        size = tab.size[tab.mov_index]
        return (np.abs(u) <= size[:, 0] / 2 + clearance) & (np.abs(v) <= size[:, 1] / 2 + clearance)

    def boxes(
        self, t_seconds: float | None = None, ego_pose: np.ndarray | None = None, clearance: float = EGO_CLEARANCE
    ) -> dict[str, np.ndarray]:
        """3-D boxes of vehicles, pedestrians and cyclists in world coordinates at time t.

        `boxes` rows are (cx, cy, cz, length, width, height, yaw); `box_class` indexes OBJECT_CLASSES. With
        `ego_pose` (world_from_sensor) the moving actors a scan from there leaves out (`shapes_near` with the
        same `clearance`) are left out too: a layout must not show an actor the sweep does not have.
        """
        t = self.time if t_seconds is None else float(t_seconds)
        tab = self.table
        boxed = np.isin(tab.cls, [OBJECT_CLASS_INDEX[c] for c in BOXED_CLASSES])
        x, y, z, yaw = tab.poses(t)
        if ego_pose is not None:
            ego = np.asarray(ego_pose, dtype=np.float64)
            moving = tuple(a[tab.mov_index] for a in (x, y, z, yaw))
            boxed[tab.mov_index[self._covering(moving, float(ego[0, 3]), float(ego[1, 3]), clearance)]] = False
        size = tab.size[boxed]
        rows = np.column_stack([x[boxed], y[boxed], z[boxed] + size[:, 2] / 2, size, yaw[boxed]])
        return {
            "boxes": rows.astype(np.float32).reshape(-1, 7),
            "box_class": tab.cls[boxed].astype(np.int16),
            "box_id": tab.ids[boxed].astype(np.int32),
        }


def check_seed(seed: int, name: str = "seed") -> int:
    """`seed` as an int (whole floats such as a UI's 3.0 are fine), or a ValueError naming it: numpy's own
    complaint about a negative seed does not say which seed was bad."""
    try:
        ok = not isinstance(seed, bool) and int(seed) == seed and seed >= 0
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a non-negative integer, got {seed!r}")
    return int(seed)


def make_world(seed: int, style: str = "urban") -> World:
    """A new world, identical for the same (seed, style). Styles: urban, suburban, highway."""
    if style not in STYLES:
        raise ValueError(f"unknown world style {style!r}; expected one of {STYLES}")
    seed = check_seed(seed)
    t0 = time.perf_counter()
    # Independent streams per stage, so changing how actors are placed never moves the roads.
    road_ss, layout_ss, actor_ss = np.random.SeedSequence([int(seed), STYLES.index(style)]).spawn(3)
    graph = generate_road_graph(np.random.default_rng(road_ss), style)
    layout = build_layout(np.random.default_rng(layout_ss), graph, style)
    pop = populate(np.random.default_rng(actor_ss), layout, style)
    world = World(
        seed=seed, style=style, hdmap=layout.hdmap, graph=graph, actors=pop.actors, scenery=pop.scenery
    )
    logger.info(
        "make_world(seed=%d, style=%s): %d actors, %d solids in %.2f s",
        seed,
        style,
        len(pop.actors),
        len(pop.scenery),
        time.perf_counter() - t0,
    )
    return world
