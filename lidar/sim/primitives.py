"""Analytic solids and vectorised ray intersection: yawed boxes, vertical cylinders, yawed ellipsoids.

All rays of a sweep share one origin, so culling is angular: each solid covers a small window of beam
rows and azimuth columns, and only (ray, solid) pairs inside that window are intersected. The cost then
grows with what the sensor sees, not with how many solids the world holds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

BOX, CYLINDER, ELLIPSOID = 0, 1, 2
_EPS = 1e-9


@dataclass
class Shapes:
    """A flat table of solids. `size` is half extents (box), (r, r, half height) (cylinder) or radii.

    `center` z is the middle of the solid. `label` is an object class index, `actor` the owning actor id
    (-1 for scenery), `porosity` the share of its surface a ray passes through (foliage, fences, windows)
    and `grain` (m) the size of those holes (`cast`).
    """

    kind: np.ndarray  # (M,) int8
    center: np.ndarray  # (M, 3) float64
    size: np.ndarray  # (M, 3) float64
    yaw: np.ndarray  # (M,) float64
    reflectivity: np.ndarray  # (M,) float32
    label: np.ndarray  # (M,) int16
    actor: np.ndarray  # (M,) int32
    porosity: np.ndarray  # (M,) float32
    grain: np.ndarray  # (M,) float32

    @classmethod
    def empty(cls) -> Shapes:
        return cls(
            np.zeros(0, np.int8),
            np.zeros((0, 3)),
            np.zeros((0, 3)),
            np.zeros(0),
            np.zeros(0, np.float32),
            np.zeros(0, np.int16),
            np.zeros(0, np.int32),
            np.zeros(0, np.float32),
            np.zeros(0, np.float32),
        )

    @classmethod
    def from_rows(cls, rows: list[tuple]) -> Shapes:
        """Build from (kind, center3, size3, yaw, reflectivity, label, actor, porosity, grain) tuples."""
        if not rows:
            return cls.empty()
        k, c, s, y, r, lab, a, p, g = zip(*rows, strict=True)
        return cls(
            np.array(k, np.int8),
            np.array(c, np.float64).reshape(-1, 3),
            np.array(s, np.float64).reshape(-1, 3),
            np.array(y, np.float64),
            np.array(r, np.float32),
            np.array(lab, np.int16),
            np.array(a, np.int32),
            np.array(p, np.float32),
            np.array(g, np.float32),
        )

    def __len__(self) -> int:
        return len(self.kind)

    def take(self, idx: np.ndarray) -> Shapes:
        """The solids at `idx`, copied: culling hands a scan its own table to place and cast."""
        return Shapes(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    @staticmethod
    def concat(parts: list[Shapes]) -> Shapes:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Shapes.empty()
        return Shapes(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Shapes)})

    def placed(
        self, x: float | np.ndarray, y: float | np.ndarray, z: float | np.ndarray, yaw: float | np.ndarray
    ) -> Shapes:
        """These solids (given in an actor frame) moved to a pose on the ground.

        Scalars place all solids at one pose (a static actor); arrays with one entry per solid place each
        at its own actor's pose, so every moving actor of a frame is placed in one call.
        """
        c, s = np.cos(yaw), np.sin(yaw)
        cen = self.center.copy()
        cen[:, 0] = x + c * self.center[:, 0] - s * self.center[:, 1]
        cen[:, 1] = y + s * self.center[:, 0] + c * self.center[:, 1]
        cen[:, 2] = z + self.center[:, 2]
        return Shapes(
            self.kind,
            cen,
            self.size,
            self.yaw + yaw,
            self.reflectivity,
            self.label,
            self.actor,
            self.porosity,
            self.grain,
        )

    def footprint_radius(self) -> np.ndarray:
        """Horizontal radius of a disc containing each solid's footprint."""
        return np.hypot(self.size[:, 0], self.size[:, 1])


@dataclass
class _Local:
    """Per-solid quantities that do not depend on the ray: yaw rotation and the origin in the solid frame."""

    c: np.ndarray
    s: np.ndarray
    ox: np.ndarray
    oy: np.ndarray
    oz: np.ndarray

    @classmethod
    def of(cls, origin: np.ndarray, center: np.ndarray, yaw: np.ndarray) -> _Local:
        c, s = np.cos(yaw), np.sin(yaw)
        rx, ry, rz = origin[0] - center[:, 0], origin[1] - center[:, 1], origin[2] - center[:, 2]
        return cls(c, s, c * rx + s * ry, -s * rx + c * ry, rz)


#: Odd 64-bit multipliers of the spatial hash (Teschner et al. 2003 primes, then Fibonacci hashing).
_HASH_PRIMES = np.array([73856093, 19349663, 83492791], dtype=np.uint64)
_HASH_MIX = np.uint64(0x9E3779B97F4A7C15)


def _through_hole(local: np.ndarray, shapes: Shapes, prim: np.ndarray) -> np.ndarray:
    """Whether each hit point (3, N), in its solid's frame, lies in one of the solid's holes.

    A hole is a place, not a dice roll: the solid's surface is cut into cells of its `grain` and a hash of
    the cell (salted by where the solid stands) decides, so a porosity of 0.2 makes a fifth of the cells
    holes. A window then stays a window from every pose and in every frame; drawn anew per ray, a fifth of
    every facade flickered between wall and room, and a model trained on it learnt that any surface may
    vanish in the next sweep.
    """
    cells = np.floor(local / shapes.grain[prim]).astype(np.int64).astype(np.uint64)
    key = np.bitwise_xor.reduce(cells * _HASH_PRIMES[:, None], axis=0)
    where = np.round(shapes.center[prim, :2] * 100).astype(np.int64).astype(np.uint64)
    key ^= where[:, 0] * _HASH_PRIMES[1] + where[:, 1] * _HASH_PRIMES[2]
    uniform = ((key * _HASH_MIX) >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    return uniform < shapes.porosity[prim]


def _safe(v: np.ndarray) -> np.ndarray:
    return np.where(np.abs(v) < _EPS, _EPS, v)


def _box_kernel(
    ox: np.ndarray,
    oy: np.ndarray,
    oz: np.ndarray,
    lx: np.ndarray,
    ly: np.ndarray,
    lz: np.ndarray,
    hx: np.ndarray,
    hy: np.ndarray,
    hz: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Slab test in the box frame, one array element per (ray, box) pair."""
    ix, iy, iz = 1.0 / _safe(lx), 1.0 / _safe(ly), 1.0 / _safe(lz)
    ax, bx = (-hx - ox) * ix, (hx - ox) * ix
    ay, by = (-hy - oy) * iy, (hy - oy) * iy
    az, bz = (-hz - oz) * iz, (hz - oz) * iz
    nx, ny, nz = np.minimum(ax, bx), np.minimum(ay, by), np.minimum(az, bz)
    t_in = np.maximum(np.maximum(nx, ny), nz)
    t_out = np.minimum(np.minimum(np.maximum(ax, bx), np.maximum(ay, by)), np.maximum(az, bz))
    hit = (t_out >= t_in) & (t_in > 0)
    # The entry face is the slab entered last; its normal is that axis.
    cos = np.where((nx >= ny) & (nx >= nz), np.abs(lx), np.where(ny >= nz, np.abs(ly), np.abs(lz)))
    return np.where(hit, t_in, np.inf), cos


def _cylinder_kernel(
    ox: np.ndarray,
    oy: np.ndarray,
    oz: np.ndarray,
    dx: np.ndarray,
    dy: np.ndarray,
    dz: np.ndarray,
    r: np.ndarray,
    hz: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Vertical capped cylinder: side wall or top/bottom cap, whichever the ray meets first from outside."""
    a = np.maximum(dx * dx + dy * dy, _EPS)
    b = ox * dx + oy * dy
    disc = b * b - a * (ox * ox + oy * oy - r * r)
    ts = (-b - np.sqrt(np.maximum(disc, 0.0))) / a
    side = (disc >= 0) & (ts > 0) & (np.abs(oz + ts * dz) <= hz)
    tc = (np.sign(oz) * hz - oz) / _safe(dz)
    cx, cy = ox + tc * dx, oy + tc * dy
    cap = (np.abs(oz) > hz) & (tc > 0) & (cx * cx + cy * cy <= r * r)
    cos_side = np.abs((ox + ts * dx) * dx + (oy + ts * dy) * dy) / np.maximum(r, _EPS)
    ts = np.where(side, ts, np.inf)
    use_cap = cap & (tc < ts)
    return np.where(use_cap, tc, ts), np.where(use_cap, np.abs(dz), np.where(side, cos_side, 0.0))


def _ellipsoid_kernel(
    ox: np.ndarray,
    oy: np.ndarray,
    oz: np.ndarray,
    lx: np.ndarray,
    ly: np.ndarray,
    lz: np.ndarray,
    irx: np.ndarray,
    iry: np.ndarray,
    irz: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Ray vs ellipsoid (inverse radii given) by scaling to the unit sphere; normal from the gradient."""
    sx, sy, sz = ox * irx, oy * iry, oz * irz
    dx, dy, dz = lx * irx, ly * iry, lz * irz
    a = dx * dx + dy * dy + dz * dz
    b = sx * dx + sy * dy + sz * dz
    c = sx * sx + sy * sy + sz * sz - 1.0
    disc = b * b - a * c
    t = (-b - np.sqrt(np.maximum(disc, 0.0))) / a
    hit = (disc >= 0) & (t > 0) & (c > 0)
    nx = (ox + t * lx) * irx * irx
    ny = (oy + t * ly) * iry * iry
    nz = (oz + t * lz) * irz * irz
    cos = np.abs(nx * lx + ny * ly + nz * lz) / np.maximum(np.sqrt(nx * nx + ny * ny + nz * nz), _EPS)
    return np.where(hit, t, np.inf), cos


def _rotate(c: np.ndarray, s: np.ndarray, dx: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """World (dx, dy) into a solid's frame, given its cos/sin yaw."""
    return c * dx + s * dy, -s * dx + c * dy


def intersect_boxes(
    origin: np.ndarray, dirs: np.ndarray, center: np.ndarray, half: np.ndarray, yaw: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per (ray, box) pair: entry distance (inf on a miss) and |cos| of the incidence angle."""
    loc = _Local.of(np.asarray(origin, np.float64), center, yaw)
    lx, ly = _rotate(loc.c, loc.s, dirs[:, 0], dirs[:, 1])
    return _box_kernel(loc.ox, loc.oy, loc.oz, lx, ly, dirs[:, 2], half[:, 0], half[:, 1], half[:, 2])


def intersect_cylinders(
    origin: np.ndarray, dirs: np.ndarray, center: np.ndarray, size: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per (ray, vertical cylinder) pair; size is (radius, radius, half height)."""
    loc = _Local.of(np.asarray(origin, np.float64), center, np.zeros(len(center)))
    return _cylinder_kernel(
        loc.ox, loc.oy, loc.oz, dirs[:, 0], dirs[:, 1], dirs[:, 2], size[:, 0], size[:, 2]
    )


def intersect_ellipsoids(
    origin: np.ndarray, dirs: np.ndarray, center: np.ndarray, radii: np.ndarray, yaw: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per (ray, yawed ellipsoid) pair."""
    loc = _Local.of(np.asarray(origin, np.float64), center, yaw)
    lx, ly = _rotate(loc.c, loc.s, dirs[:, 0], dirs[:, 1])
    inv = 1.0 / radii
    return _ellipsoid_kernel(loc.ox, loc.oy, loc.oz, lx, ly, dirs[:, 2], inv[:, 0], inv[:, 1], inv[:, 2])


def angular_windows(
    shapes: Shapes,
    origin: np.ndarray,
    yaw0: float,
    tilt: float,
    elevations: np.ndarray,
    width: int,
    max_range: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Beam-row and column window (r0, nr, u0, nu) each solid can cover, seen from `origin`.

    Bounds are conservative. The footprint is the yawed rectangle of half extents size[:2] (it contains
    the disc of a cylinder or the ellipse of an ellipsoid): its corners give the azimuth span, its
    nearest and farthest points the elevation span, and `tilt` (sensor pitch/roll) widens both.
    """
    c, s = np.cos(shapes.yaw), np.sin(shapes.yaw)
    dx = shapes.center[:, 0] - origin[0]
    dy = shapes.center[:, 1] - origin[1]
    hx, hy = shapes.size[:, 0], shapes.size[:, 1]
    # Sensor in the footprint frame: nearest and farthest horizontal distances to the rectangle.
    u = -(c * dx + s * dy)
    v = -(-s * dx + c * dy)
    dmin = np.hypot(np.maximum(np.abs(u) - hx, 0.0), np.maximum(np.abs(v) - hy, 0.0))
    dmax = np.hypot(np.abs(u) + hx, np.abs(v) + hy)
    inside = (np.abs(u) <= hx + 0.05) & (np.abs(v) <= hy + 0.05)
    zlo = shapes.center[:, 2] - shapes.size[:, 2] - origin[2]
    zhi = shapes.center[:, 2] + shapes.size[:, 2] - origin[2]
    near = np.maximum(dmin, 1e-3)
    el_hi = np.where(zhi > 0, np.arctan2(zhi, near), np.arctan2(zhi, dmax)) + tilt
    el_lo = np.where(zlo < 0, np.arctan2(zlo, near), np.arctan2(zlo, dmax)) - tilt
    # Rows: elevations are strictly decreasing; keep beams with el_lo <= el <= el_hi.
    asc = elevations[::-1]
    h = len(elevations)
    r0 = h - np.searchsorted(asc, el_hi, side="right")
    nr = np.maximum(h - np.searchsorted(asc, el_lo, side="left") - r0, 0)
    # Columns: azimuths of the four corners relative to the centre direction (the span is < pi outside).
    az_c = np.arctan2(dy, dx)
    sx = np.array([1.0, -1.0, -1.0, 1.0])
    sy = np.array([1.0, 1.0, -1.0, -1.0])
    cx = dx[:, None] + c[:, None] * hx[:, None] * sx - s[:, None] * hy[:, None] * sy
    cy = dy[:, None] + s[:, None] * hx[:, None] * sx + c[:, None] * hy[:, None] * sy
    rel = np.mod(np.arctan2(cy, cx) - az_c[:, None] + np.pi, 2 * np.pi) - np.pi
    slack = tilt + np.pi / width  # one column of slack for the column-centre sampling
    a_hi = np.where(inside, np.pi, rel.max(axis=1) + slack) + az_c - yaw0
    a_lo = np.where(inside, -np.pi, rel.min(axis=1) - slack) + az_c - yaw0
    # Column u's ray leaves at Sensor.azimuths[u] = pi * (1 - (2u + 1) / W) (the docs/design.md column formula at
    # column centres); solving that for u gives the first and last column whose ray lies in [a_lo, a_hi].
    # It is the inverse of the sensor's table, computed for every solid at once rather than searched.
    u_lo = np.ceil(0.5 * (1.0 - a_hi / np.pi) * width - 0.5).astype(np.int64)
    u_hi = np.floor(0.5 * (1.0 - a_lo / np.pi) * width - 0.5).astype(np.int64)
    nu = np.clip(u_hi - u_lo + 1, 0, width)
    nr = np.where(dmin > max_range, 0, nr)
    return r0.astype(np.int64), nr.astype(np.int64), np.mod(u_lo, width), nu.astype(np.int64)


def cast(
    shapes: Shapes,
    origin: np.ndarray,
    dirs_world: np.ndarray,
    yaw0: float,
    tilt: float,
    elevations: np.ndarray,
    width: int,
    max_range: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nearest hit per ray among `shapes`. Returns (t, cos_incidence, shape_index) per ray, inf/-1 on a miss.

    `dirs_world` is (H*W, 3) in range-image order. Pairs are generated solid by solid, so per-solid values
    reach their pairs by `np.repeat` rather than a gather. Porous solids let a ray through where it meets
    one of their holes (`_through_hole`): foliage, fences and windows thin out instead of blocking like walls.
    """
    n_rays = len(dirs_world)
    best_t = np.full(n_rays, np.inf)
    best_cos = np.zeros(n_rays)
    best_idx = np.full(n_rays, -1, dtype=np.int64)
    if len(shapes) == 0:
        return best_t, best_cos, best_idx
    r0, nr, u0, nu = angular_windows(shapes, origin, yaw0, tilt, elevations, width, max_range)
    counts = nr * nu
    loc = _Local.of(np.asarray(origin, np.float64), shapes.center, shapes.yaw)
    dxw, dyw, dzw = (np.ascontiguousarray(dirs_world[:, i]) for i in range(3))
    rays, ts, coss, prims = [], [], [], []
    for kind in (BOX, CYLINDER, ELLIPSOID):
        idx = np.flatnonzero((shapes.kind == kind) & (counts > 0))
        if not len(idx):
            continue
        cnt = counts[idx]
        total = int(cnt.sum())

        def rep(v: np.ndarray, idx=idx, cnt=cnt) -> np.ndarray:
            return np.repeat(v[idx], cnt)

        k = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        nu_p = rep(nu)
        ray = (rep(r0) + k // nu_p) * width + (rep(u0) + k % nu_p) % width
        dx, dy, dz = dxw[ray], dyw[ray], dzw[ray]
        ox, oy, oz = rep(loc.ox), rep(loc.oy), rep(loc.oz)
        lx, ly = _rotate(rep(loc.c), rep(loc.s), dx, dy)  # solid frame (a cylinder's yaw is harmless)
        if kind == CYLINDER:
            t, cos = _cylinder_kernel(ox, oy, oz, lx, ly, dz, rep(shapes.size[:, 0]), rep(shapes.size[:, 2]))
        elif kind == BOX:
            t, cos = _box_kernel(
                ox, oy, oz, lx, ly, dz, rep(shapes.size[:, 0]), rep(shapes.size[:, 1]), rep(shapes.size[:, 2])
            )
        else:
            inv = 1.0 / shapes.size
            t, cos = _ellipsoid_kernel(ox, oy, oz, lx, ly, dz, rep(inv[:, 0]), rep(inv[:, 1]), rep(inv[:, 2]))
        hit = np.isfinite(t)
        prim = rep(np.arange(len(shapes)))
        porous = np.flatnonzero(hit & (shapes.porosity[prim] > 0))
        if len(porous):
            tp = t[porous]
            local = np.stack([ox[porous] + tp * lx[porous], oy[porous] + tp * ly[porous], oz[porous] + tp * dz[porous]])
            hit[porous] = ~_through_hole(local, shapes, prim[porous])
        rays.append(ray[hit])
        ts.append(t[hit])
        coss.append(cos[hit])
        prims.append(prim[hit])
    if not rays:
        return best_t, best_cos, best_idx
    ray, t, cos, prim = (np.concatenate(v) for v in (rays, ts, coss, prims))
    if not len(ray):
        return best_t, best_cos, best_idx
    np.minimum.at(best_t, ray, t)
    win = t <= best_t[ray]
    best_cos[ray[win]] = cos[win]
    best_idx[ray[win]] = prim[win]
    return best_t, best_cos, best_idx
