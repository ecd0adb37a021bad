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
    (-1 for scenery), `porosity` the chance a ray passes through (foliage, fences).
    """

    kind: np.ndarray  # (M,) int8
    center: np.ndarray  # (M, 3) float64
    size: np.ndarray  # (M, 3) float64
    yaw: np.ndarray  # (M,) float64
    reflectivity: np.ndarray  # (M,) float32
    label: np.ndarray  # (M,) int16
    actor: np.ndarray  # (M,) int32
    porosity: np.ndarray  # (M,) float32

    @classmethod
    def empty(cls) -> Shapes:
        return cls(np.zeros(0, np.int8), np.zeros((0, 3)), np.zeros((0, 3)), np.zeros(0), np.zeros(0, np.float32),
                   np.zeros(0, np.int16), np.zeros(0, np.int32), np.zeros(0, np.float32))

    @classmethod
    def from_rows(cls, rows: list[tuple]) -> Shapes:
        """Build from (kind, center3, size3, yaw, reflectivity, label, actor, porosity) tuples."""
        if not rows:
            return cls.empty()
        k, c, s, y, r, lab, a, p = zip(*rows, strict=True)
        return cls(np.array(k, np.int8), np.array(c, np.float64).reshape(-1, 3), np.array(s, np.float64).reshape(-1, 3),
                   np.array(y, np.float64), np.array(r, np.float32), np.array(lab, np.int16), np.array(a, np.int32),
                   np.array(p, np.float32))

    def __len__(self) -> int:
        return len(self.kind)

    def take(self, idx: np.ndarray) -> Shapes:
        return Shapes(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    @staticmethod
    def concat(parts: list[Shapes]) -> Shapes:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Shapes.empty()
        return Shapes(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Shapes)})

    def placed(self, x: float, y: float, z: float, yaw: float) -> Shapes:
        """These solids (given in an actor frame) moved to a pose on the ground."""
        c, s = np.cos(yaw), np.sin(yaw)
        cen = self.center.copy()
        cen[:, 0] = x + c * self.center[:, 0] - s * self.center[:, 1]
        cen[:, 1] = y + s * self.center[:, 0] + c * self.center[:, 1]
        cen[:, 2] = z + self.center[:, 2]
        return Shapes(self.kind, cen, self.size, self.yaw + yaw, self.reflectivity, self.label, self.actor,
                      self.porosity)

    def footprint_radius(self) -> np.ndarray:
        """Horizontal radius of a disc containing each solid's footprint."""
        return np.hypot(self.size[:, 0], self.size[:, 1])


def _to_local(origin: np.ndarray, dirs: np.ndarray, center: np.ndarray, yaw: np.ndarray):
    c, s = np.cos(yaw), np.sin(yaw)
    rel = origin[None, :] - center
    ol = np.stack([c * rel[:, 0] + s * rel[:, 1], -s * rel[:, 0] + c * rel[:, 1], rel[:, 2]], axis=1)
    dl = np.stack([c * dirs[:, 0] + s * dirs[:, 1], -s * dirs[:, 0] + c * dirs[:, 1], dirs[:, 2]], axis=1)
    return ol, dl


def intersect_boxes(origin, dirs, center, half, yaw) -> tuple[np.ndarray, np.ndarray]:
    """Slab test per (ray, box) pair: entry distance (inf on a miss) and |cos| of the incidence angle."""
    ol, dl = _to_local(origin, dirs, center, yaw)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = 1.0 / np.where(np.abs(dl) < _EPS, _EPS, dl)
        t1 = (-half - ol) * inv
        t2 = (half - ol) * inv
    tnear = np.minimum(t1, t2)
    tfar = np.maximum(t1, t2)
    axis = np.argmax(tnear, axis=1)
    t_in = tnear[np.arange(len(tnear)), axis]
    t_out = tfar.min(axis=1)
    hit = (t_out >= t_in) & (t_in > 0)
    cos = np.abs(dl[np.arange(len(dl)), axis])
    return np.where(hit, t_in, np.inf), cos


def intersect_cylinders(origin, dirs, center, size) -> tuple[np.ndarray, np.ndarray]:
    """Vertical capped cylinders: side wall or top cap, whichever the ray meets first from outside."""
    r = size[:, 0]
    ox = origin[0] - center[:, 0]
    oy = origin[1] - center[:, 1]
    oz = origin[2] - center[:, 2]
    dx, dy, dz = dirs[:, 0], dirs[:, 1], dirs[:, 2]
    a = np.maximum(dx * dx + dy * dy, _EPS)
    b = ox * dx + oy * dy
    c = ox * ox + oy * oy - r * r
    disc = b * b - a * c
    with np.errstate(invalid="ignore"):
        t_side = (-b - np.sqrt(disc)) / a
    z_side = oz + t_side * dz
    side_ok = (disc >= 0) & (t_side > 0) & (np.abs(z_side) <= size[:, 2])
    ts = np.where(side_ok, t_side, 0.0)
    cos_side = np.abs((ox + ts * dx) * dx + (oy + ts * dy) * dy) / np.maximum(r, _EPS)
    t_side = np.where(side_ok, t_side, np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_cap = (np.sign(oz) * size[:, 2] - oz) / np.where(np.abs(dz) < _EPS, _EPS, dz)
    cx = ox + t_cap * dx
    cy = oy + t_cap * dy
    cap_ok = (np.abs(oz) > size[:, 2]) & (t_cap > 0) & (cx * cx + cy * cy <= r * r)
    t_cap = np.where(cap_ok, t_cap, np.inf)
    use_cap = t_cap < t_side
    return np.where(use_cap, t_cap, t_side), np.where(use_cap, np.abs(dz), cos_side)


def intersect_ellipsoids(origin, dirs, center, radii, yaw) -> tuple[np.ndarray, np.ndarray]:
    """Ray vs yawed ellipsoid by scaling to the unit sphere; the normal comes from the gradient."""
    ol, dl = _to_local(origin, dirs, center, yaw)
    os_ = ol / radii
    ds = dl / radii
    a = np.einsum("ij,ij->i", ds, ds)
    b = np.einsum("ij,ij->i", os_, ds)
    c = np.einsum("ij,ij->i", os_, os_) - 1.0
    disc = b * b - a * c
    with np.errstate(invalid="ignore"):
        t = (-b - np.sqrt(disc)) / a
    hit = (disc >= 0) & (t > 0) & (c > 0)
    p = ol + t[:, None] * dl
    n = p / (radii * radii)
    n /= np.maximum(np.linalg.norm(n, axis=1, keepdims=True), _EPS)
    cos = np.abs(np.einsum("ij,ij->i", n, dl))
    return np.where(hit, t, np.inf), np.nan_to_num(cos)


def angular_windows(shapes: Shapes, origin: np.ndarray, yaw0: float, tilt: float, elevations: np.ndarray,
                    width: int, max_range: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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
    u_lo = np.ceil(0.5 * (1.0 - a_hi / np.pi) * width - 0.5).astype(np.int64)
    u_hi = np.floor(0.5 * (1.0 - a_lo / np.pi) * width - 0.5).astype(np.int64)
    nu = np.clip(u_hi - u_lo + 1, 0, width)
    nr = np.where(dmin > max_range, 0, nr)
    return r0.astype(np.int64), nr.astype(np.int64), np.mod(u_lo, width), nu.astype(np.int64)


def cast(shapes: Shapes, origin: np.ndarray, dirs_world: np.ndarray, yaw0: float, tilt: float,
         elevations: np.ndarray, width: int, max_range: float, rng: np.random.Generator | None = None):
    """Nearest hit per ray among `shapes`. Returns (t, cos_incidence, shape_index) per ray, inf/-1 on a miss.

    `dirs_world` is (H*W, 3) in range-image order. Porous solids let a ray through with their porosity
    (drawn from `rng`), which is how foliage and fences thin out instead of blocking like walls.
    """
    n_rays = len(dirs_world)
    best_t = np.full(n_rays, np.inf)
    best_cos = np.zeros(n_rays)
    best_idx = np.full(n_rays, -1, dtype=np.int64)
    if len(shapes) == 0:
        return best_t, best_cos, best_idx
    r0, nr, u0, nu = angular_windows(shapes, origin, yaw0, tilt, elevations, width, max_range)
    counts = nr * nu
    total = int(counts.sum())
    if total == 0:
        return best_t, best_cos, best_idx
    prim = np.repeat(np.arange(len(shapes)), counts)
    start = np.repeat(np.cumsum(counts) - counts, counts)
    k = np.arange(total) - start
    nu_p = nu[prim]
    row = r0[prim] + k // nu_p
    col = (u0[prim] + k % nu_p) % width
    ray = row * width + col
    t = np.full(total, np.inf)
    cos = np.zeros(total)
    kinds = shapes.kind[prim]
    for kind in (BOX, CYLINDER, ELLIPSOID):
        sel = np.flatnonzero(kinds == kind)
        if not len(sel):
            continue
        p = prim[sel]
        d = dirs_world[ray[sel]]
        if kind == BOX:
            tt, cc = intersect_boxes(origin, d, shapes.center[p], shapes.size[p], shapes.yaw[p])
        elif kind == CYLINDER:
            tt, cc = intersect_cylinders(origin, d, shapes.center[p], shapes.size[p])
        else:
            tt, cc = intersect_ellipsoids(origin, d, shapes.center[p], shapes.size[p], shapes.yaw[p])
        t[sel] = tt
        cos[sel] = cc
    hit = np.isfinite(t)
    if rng is not None:
        por = shapes.porosity[prim]
        porous = hit & (por > 0)
        if porous.any():
            hit[porous] &= rng.random(int(porous.sum())) >= por[porous]
    if not hit.any():
        return best_t, best_cos, best_idx
    ray, t, cos, prim = ray[hit], t[hit], cos[hit], prim[hit]
    np.minimum.at(best_t, ray, t)
    win = t <= best_t[ray]
    best_cos[ray[win]] = cos[win]
    best_idx[ray[win]] = prim[win]
    return best_t, best_cos, best_idx
