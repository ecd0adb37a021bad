"""Ego drives: a route through the road graph for an action, sampled as 10 Hz sensor poses.

The ego keeps right, takes the requested turn at the next intersection (a smooth cubic from the incoming
lane to the outgoing one) and otherwise goes straight on. Speeds are town speeds, slower when turning.
"""

from __future__ import annotations

import numpy as np

from lidar.sim.roads import arc_lengths, point_at
from lidar.sim.styles import style_profile
from lidar.sim.world import World, check_seed
from lidar.vocabulary import ACTION_YAW_SIGN, ACTIONS, FRAME_RATE_HZ

DEFAULT_MOUNT_HEIGHT = 1.84
#: Heading change (degrees) of each action at a junction: the roads meet at right angles.
_TURN_DEG = {action: 90.0 * sign for action, sign in ACTION_YAW_SIGN.items()}


def _heading(v: np.ndarray) -> float:
    return float(np.arctan2(v[1], v[0]))


def _wrap(a: float) -> float:
    return float((a + np.pi) % (2 * np.pi) - np.pi)


def _exits(world: World, road: int, node: int) -> dict[str, tuple[int, float]]:
    """Roads leaving `node` other than the one we arrive on, keyed by the manoeuvre they need."""
    g = world.graph
    arriving = g.roads[road].directed(g.other(road, node))
    h_in = _heading(arriving[-1] - arriving[-2])
    out: dict[str, tuple[int, float]] = {}
    for ri in g.incident(node):
        if ri == road:
            continue
        leaving = g.roads[ri].directed(node)
        dh = np.rad2deg(_wrap(_heading(leaving[1] - leaving[0]) - h_in))
        for action, target in _TURN_DEG.items():
            if abs(dh - target) < 30.0:
                out[action] = (ri, dh)
    return out


def _bezier(p0: np.ndarray, t0: np.ndarray, p3: np.ndarray, t3: np.ndarray, n: int = 24) -> np.ndarray:
    """Cubic from p0 (heading t0) to p3 (heading t3): tangent-continuous, so the yaw has no jump at a turn."""
    k = 0.55 * float(np.linalg.norm(p3 - p0))
    p1, p2 = p0 + t0 * k, p3 - t3 * k
    u = np.linspace(0.0, 1.0, n)[:, None]
    return (1 - u) ** 3 * p0 + 3 * (1 - u) ** 2 * u * p1 + 3 * (1 - u) * u**2 * p2 + u**3 * p3


def _lane_between(world: World, road: int, from_node: int, lane: int) -> np.ndarray:
    """Lane polyline of `road` leaving `from_node`, trimmed to the intersection boxes at both ends."""
    g = world.graph
    line = g.roads[road].lane_line(from_node, lane)
    cum = arc_lengths(line)
    s0 = g.node_radius(from_node)
    s1 = cum[-1] - g.node_radius(g.other(road, from_node))
    n = max(2, int((s1 - s0) / 1.0) + 1)
    return point_at(line, np.linspace(s0, max(s1, s0 + 1.0), n), cum)[0]


def _route(
    world: World, road: int, from_node: int, action: str, min_length: float
) -> tuple[np.ndarray, float] | None:
    """Polyline from the start of a lane through the first junction (with `action`), extended straight on.

    Returns the route and the arc length at which the first junction is entered, or None when the
    junction ahead offers no such manoeuvre.
    """
    g = world.graph
    route_lane = -1 if action == "turn_right" else 0  # right turns from the outer lane, else the inner one
    pieces: list[np.ndarray] = []
    first_junction = None
    cur_road, cur_from, want = road, from_node, action
    for _ in range(8):
        r = g.roads[cur_road]
        piece = _lane_between(world, cur_road, cur_from, route_lane % r.lanes)
        pieces.append(piece)
        node = g.other(cur_road, cur_from)
        exits = _exits(world, cur_road, node)
        if want not in exits:
            if first_junction is None:
                return None
            want = "straight" if "straight" in exits else (next(iter(exits)) if exits else "")
            if not want:
                break
        length_so_far = float(arc_lengths(np.concatenate(pieces))[-1])
        if first_junction is None:
            first_junction = length_so_far
        elif length_so_far > min_length:
            break
        nxt, _ = exits[want]
        r2 = g.roads[nxt]
        entry = _lane_between(world, nxt, node, route_lane % r2.lanes)
        t0 = piece[-1] - piece[-2]
        t3 = entry[1] - entry[0]
        arc = _bezier(piece[-1], t0 / np.linalg.norm(t0), entry[0], t3 / np.linalg.norm(t3))
        pieces.append(arc[1:-1])
        cur_road, cur_from, want = nxt, node, "straight"
    line = np.concatenate(pieces)
    keep = np.concatenate([[True], np.linalg.norm(np.diff(line, axis=0), axis=1) > 1e-6])
    return line[keep], float(first_junction or 0.0)


def plan_drive(
    world: World,
    action: str,
    frames: int,
    seed: int = 0,
    speed: float | None = None,
    mount_height: float = DEFAULT_MOUNT_HEIGHT,
) -> np.ndarray:
    """(frames, 4, 4) float64 world_from_sensor poses at 10 Hz for `action` in `world`.

    A turn happens at the next intersection ahead of the start; the start is placed so the turn falls
    inside the drive when the drive is long enough. `speed` in m/s overrides the sampled one (7-12 m/s
    straight, 18-28 m/s on highways, 5-8 m/s for turns). A drive longer than the route ends standing at its
    end. The sensor rides `mount_height` above the ground, pitched and rolled with it.
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}; expected one of {ACTIONS}")
    if int(frames) != frames or frames < 1:
        raise ValueError(f"frames must be a positive integer, got {frames!r}")
    if speed is not None and not 0.0 <= speed <= 40.0:
        raise ValueError(f"speed must be in [0, 40] m/s, got {speed}")
    rng = np.random.default_rng(np.random.SeedSequence([check_seed(seed), world.seed, ACTIONS.index(action)]))
    v = (
        float(speed)
        if speed is not None
        else float(rng.uniform(5.0, 8.0) if action != "straight" else rng.uniform(7.0, 12.0))
    )
    fast = style_profile(world.style).straight_speed
    if fast is not None and speed is None and action == "straight":
        v = float(rng.uniform(*fast))
    travel = v * (frames - 1) / FRAME_RATE_HZ
    g = world.graph
    # 1. Try directed roads in a seeded order until one offers the manoeuvre and enough room.
    candidates = [(ri, n) for ri, r in enumerate(g.roads) for n in (r.a, r.b)]
    order = rng.permutation(len(candidates))
    best = None
    for k in order:
        ri, from_node = candidates[k]
        res = _route(world, ri, from_node, action, min_length=travel + 80.0)
        if res is None:
            continue
        line, junction = res
        # Start before the junction: turns land in the first half of the drive, straights anywhere.
        frac = rng.uniform(0.15, 0.45) if action != "straight" else rng.uniform(0.0, 1.0)
        lead = (
            min(junction, max(frac * travel, 0.0))
            if action != "straight"
            else frac * max(junction - 5.0, 0.0)
        )
        start = max(junction - lead, 0.0)
        if arc_lengths(line)[-1] - start >= travel:
            best = (line, start)
            break
        if best is None or arc_lengths(line)[-1] - start > arc_lengths(best[0])[-1] - best[1]:
            best = (line, start)
    if best is None:
        raise ValueError(f"world seed={world.seed} style={world.style!r} has no junction allowing {action!r}")
    line, start = best
    cum = arc_lengths(line)
    s = np.minimum(start + v * np.arange(frames) / FRAME_RATE_HZ, cum[-1])
    pos, tan = point_at(line, s, cum)
    # Smooth headings over +-1.5 m so polyline kinks do not jitter the yaw.
    _, tan_a = point_at(line, s - 1.5, cum)
    _, tan_b = point_at(line, s + 1.5, cum)
    fwd2 = tan_a + tan_b + tan
    fwd2 /= np.linalg.norm(fwd2, axis=1, keepdims=True)
    return _poses(world, pos, fwd2, mount_height)


def _poses(world: World, pos: np.ndarray, fwd2: np.ndarray, mount_height: float) -> np.ndarray:
    """Sensor poses over ground points: the car pitches and rolls with the terrain, so the sensor does too."""
    hdmap = world.hdmap
    _, gx, gy = hdmap.terrain_height(pos[:, 0], pos[:, 1], with_gradient=True)
    z = hdmap.ground_height(pos[:, 0], pos[:, 1])
    normal = np.stack([-gx, -gy, np.ones_like(gx)], axis=1)
    normal /= np.linalg.norm(normal, axis=1, keepdims=True)
    fwd = np.concatenate([fwd2, np.zeros((len(fwd2), 1))], axis=1)
    fwd -= normal * np.einsum("ij,ij->i", fwd, normal)[:, None]
    fwd /= np.linalg.norm(fwd, axis=1, keepdims=True)
    left = np.cross(normal, fwd)
    poses = np.tile(np.eye(4), (len(pos), 1, 1))
    poses[:, :3, 0] = fwd
    poses[:, :3, 1] = left
    poses[:, :3, 2] = normal
    poses[:, :3, 3] = np.stack([pos[:, 0], pos[:, 1], z], axis=1) + normal * mount_height
    return poses
