"""The road graph: intersections (nodes) joined by straight or gently curved roads with lanes.

Roads are laid on a rectilinear grid of uneven block sizes so intersections meet at right angles (a
turn is a clean +-90 degrees); a curve is a smooth bump in the middle of a road whose ends stay aligned with
the grid, and dropping interior roads turns 4-way crossings into T junctions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from lidar.sim.styles import StyleProfile, style_profile

#: Straight stretch kept at each end of a curved road so junctions stay square.
CURVE_MARGIN = 25.0
PARKING_WIDTH = 2.3
SHOULDER_WIDTH = 2.5
SAMPLE_SPACING = 2.0


# --------------------------------------------------------------------------------------------- polylines
def arc_lengths(line: np.ndarray) -> np.ndarray:
    """Cumulative length at each vertex of an (N, 2) polyline, starting at 0."""
    seg = np.linalg.norm(np.diff(line, axis=0), axis=1)
    return np.concatenate([[0.0], np.cumsum(seg)])


def point_at(line: np.ndarray, s: np.ndarray, cum: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Positions (M, 2) and unit tangents (M, 2) at arc lengths `s` (clamped to the polyline)."""
    cum = arc_lengths(line) if cum is None else cum
    s = np.minimum(np.maximum(np.asarray(s, dtype=np.float64), 0.0), cum[-1])
    i = np.minimum(np.maximum(np.searchsorted(cum, s, side="right") - 1, 0), len(line) - 2)
    seg = line[i + 1] - line[i]
    seg_len = np.maximum(cum[i + 1] - cum[i], 1e-9)
    a = (s - cum[i]) / seg_len
    pos = line[i] + seg * a[..., None]
    tan = seg / seg_len[..., None]
    return pos, tan


def offset_line(line: np.ndarray, offset: float) -> np.ndarray:
    """The polyline shifted `offset` metres to its left (negative: right), using vertex normals."""
    d = np.empty_like(line)
    d[1:-1] = line[2:] - line[:-2]
    d[0] = line[1] - line[0]
    d[-1] = line[-1] - line[-2]
    d /= np.maximum(np.hypot(d[:, 0], d[:, 1]), 1e-9)[:, None]
    normal = np.stack([-d[:, 1], d[:, 0]], axis=1)
    return line + offset * normal


def sub_line(line: np.ndarray, s0: float, s1: float, spacing: float = 1.0) -> np.ndarray:
    """The part of a polyline between arc lengths s0 < s1, resampled every `spacing` metres."""
    n = max(2, int(np.ceil((s1 - s0) / spacing)) + 1)
    pos, _ = point_at(line, np.linspace(s0, s1, n))
    return pos


# --------------------------------------------------------------------------------------------- graph
@dataclass
class Road:
    """One road between two intersections. `centre` runs from node `a` to node `b`."""

    a: int
    b: int
    centre: np.ndarray
    lanes: int
    lane_width: float
    sidewalk: float
    parking: bool
    kind: str
    cum: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.cum = arc_lengths(self.centre)

    @property
    def length(self) -> float:
        return float(self.cum[-1])

    @property
    def carriageway(self) -> float:
        """Half-width of the driving lanes alone (m)."""
        return self.lanes * self.lane_width

    @property
    def half_width(self) -> float:
        """Half-width from the centre line to the curb (m): lanes, parking strip or shoulder."""
        extra = PARKING_WIDTH if self.parking else (SHOULDER_WIDTH if self.kind == "highway" else 0.3)
        return self.carriageway + extra

    def directed(self, from_node: int) -> np.ndarray:
        """The centre line oriented away from `from_node`."""
        if from_node == self.a:
            return self.centre
        if from_node == self.b:
            return self.centre[::-1].copy()
        raise ValueError(f"road {self.a}-{self.b} does not touch node {from_node}")

    def lane_line(self, from_node: int, lane: int) -> np.ndarray:
        """Centre of lane `lane` (0 = next to the centre line) for traffic leaving `from_node` (drive right)."""
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane must be in [0, {self.lanes}), got {lane}")
        return offset_line(self.directed(from_node), -(lane + 0.5) * self.lane_width)


@dataclass
class RoadGraph:
    nodes: np.ndarray  # (N, 2) intersection centres
    roads: list[Road]
    style: str

    def incident(self, node: int) -> list[int]:
        return [i for i, r in enumerate(self.roads) if node in (r.a, r.b)]

    def degree(self, node: int) -> int:
        return len(self.incident(node))

    def node_radius(self, node: int) -> float:
        """Half-size of the intersection box at `node`: the widest incoming road plus a margin."""
        inc = self.incident(node)
        if not inc:
            return 0.0
        return max(self.roads[i].half_width for i in inc) + 1.0

    def other(self, road: int, node: int) -> int:
        r = self.roads[road]
        return r.b if node == r.a else r.a

    def interior(self, road: Road, margin: float) -> tuple[float, float]:
        """Arc lengths (s0, s1) along `road.centre` of its stretch `margin` metres clear of the intersection
        boxes at both ends: where strips, markings and roadside things may go without entering a junction.
        s1 < s0 when the road is too short to have one."""
        return self.node_radius(road.a) + margin, road.length - self.node_radius(road.b) - margin


def _curved_centre(p0: np.ndarray, p1: np.ndarray, amp: float) -> np.ndarray:
    """Samples along p0->p1 with a sin^2 lateral bump between the straight end margins."""
    length = float(np.linalg.norm(p1 - p0))
    n = max(2, int(np.ceil(length / SAMPLE_SPACING)) + 1)
    s = np.linspace(0.0, length, n)
    d = (p1 - p0) / length
    normal = np.array([-d[1], d[0]])
    inner = length - 2 * CURVE_MARGIN
    off = np.zeros_like(s)
    if amp != 0.0 and inner > 40.0:
        amp = float(np.clip(amp, -0.15 * inner, 0.15 * inner))  # keep bends gentle on short blocks
        u = np.clip((s - CURVE_MARGIN) / inner, 0.0, 1.0)
        off = amp * np.sin(np.pi * u) ** 2
    return p0 + s[:, None] * d + off[:, None] * normal


def _connected(n_nodes: int, edges: list[tuple[int, int]]) -> bool:
    adj: list[list[int]] = [[] for _ in range(n_nodes)]
    for a, b in edges:
        adj[a].append(b)
        adj[b].append(a)
    seen = {0}
    queue = deque([0])
    while queue:
        for nb in adj[queue.popleft()]:
            if nb not in seen:
                seen.add(nb)
                queue.append(nb)
    return len(seen) == n_nodes


def generate_road_graph(rng: np.random.Generator, style: str) -> RoadGraph:
    """A road network for `style`: a street grid, or a trunk road with side roads (`StyleProfile.network`)."""
    p = style_profile(style)
    if p.network == "trunk":
        return _highway_graph(rng, p, style)
    nx = int(rng.integers(p.nodes[0], p.nodes[1] + 1))
    ny = int(rng.integers(p.nodes[0], p.nodes[1] + 1))
    xs = np.concatenate([[0.0], np.cumsum(rng.uniform(*p.spacing, size=nx - 1))])
    ys = np.concatenate([[0.0], np.cumsum(rng.uniform(*p.spacing, size=ny - 1))])
    xs -= xs.mean()
    ys -= ys.mean()
    nodes = np.array([(x, y) for y in ys for x in xs], dtype=np.float64)

    def nid(i: int, j: int) -> int:
        return j * nx + i

    edges = [(nid(i, j), nid(i + 1, j)) for j in range(ny) for i in range(nx - 1)]
    edges += [(nid(i, j), nid(i, j + 1)) for j in range(ny - 1) for i in range(nx)]
    # 1. Drop some interior roads to create T junctions, keeping every node at degree >= 2 and the graph whole.
    boundary = {nid(i, j) for i in range(nx) for j in range(ny) if i in (0, nx - 1) or j in (0, ny - 1)}
    order = rng.permutation(len(edges))
    keep = list(edges)
    for k in order:
        e = edges[k]
        if rng.random() >= p.remove_p or (e[0] in boundary and e[1] in boundary):
            continue
        trial = [x for x in keep if x != e]
        deg = np.bincount(np.array(trial).ravel(), minlength=len(nodes))
        if deg[e[0]] >= 2 and deg[e[1]] >= 2 and _connected(len(nodes), trial):
            keep = trial
    # 2. Build roads: a main avenue class gets more lanes, some roads bend.
    roads = []
    for a, b in keep:
        lanes = int(rng.integers(p.lanes[0], p.lanes[1] + 1))
        amp = 0.0
        if rng.random() < p.curve_p:
            amp = float(rng.uniform(*p.curve_amp) * rng.choice([-1.0, 1.0]))
        roads.append(
            Road(
                a=a,
                b=b,
                centre=_curved_centre(nodes[a], nodes[b], amp),
                lanes=lanes,
                lane_width=p.lane_width,
                sidewalk=float(rng.uniform(*p.sidewalk)),
                parking=bool(rng.random() < p.parking),
                kind="street",
            )
        )
    return RoadGraph(nodes=nodes, roads=roads, style=style)


def _highway_graph(rng: np.random.Generator, p: StyleProfile, style: str) -> RoadGraph:
    """A trunk road through `p.nodes` junctions, with one or two local side streets at each interior one."""
    n = int(rng.integers(p.nodes[0], p.nodes[1] + 1))
    xs = np.concatenate([[0.0], np.cumsum(rng.uniform(*p.spacing, size=n - 1))])
    xs -= xs.mean()
    nodes = [(x, 0.0) for x in xs]
    roads = []
    for i in range(n - 1):
        amp = (
            float(rng.uniform(*p.curve_amp) * rng.choice([-1.0, 1.0]))
            if rng.random() < p.curve_p
            else 0.0
        )
        roads.append(
            Road(
                a=i,
                b=i + 1,
                centre=_curved_centre(np.array(nodes[i]), np.array(nodes[i + 1]), amp),
                lanes=p.lanes[0],
                lane_width=p.lane_width,
                sidewalk=0.0,
                parking=False,
                kind="highway",
            )
        )
    # Side roads (ramps to local streets) at interior junctions: one side gives a T, both a 4-way.
    for i in range(1, n - 1):
        sides = [-1.0, 1.0] if rng.random() < 0.3 else [float(rng.choice([-1.0, 1.0]))]
        for side in sides:
            nodes.append((xs[i], side * float(rng.uniform(90.0, 130.0))))
            k = len(nodes) - 1
            roads.append(
                Road(
                    a=i,
                    b=k,
                    centre=_curved_centre(np.array(nodes[i]), np.array(nodes[k]), 0.0),
                    lanes=1,
                    lane_width=3.5,
                    sidewalk=1.5,
                    parking=False,
                    kind="street",
                )
            )
    return RoadGraph(nodes=np.array(nodes, dtype=np.float64), roads=roads, style=style)
