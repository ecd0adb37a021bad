"""Pictures and viewer files of LiDAR sweeps: range-image PNGs, BEV PNGs, Model3D PLYs, animations, and
labelled panels of pictures to compare by eye.

Everything here is pure numpy + Pillow (no matplotlib): the colour map is the Turbo polynomial, so the CLI,
the Gradio app and the evaluation reports draw the same colours on any machine, offline.
Frames follow docs/design.md: x forward, y left, z up, metres.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from lidar.range_image import RangeImage, encode_range

logger = logging.getLogger(__name__)

ColorBy = Literal["height", "range", "intensity"]
BevColorBy = Literal["height", "density", "intensity"]

# Turbo (Mikhailov, Google AI Blog 2019) as its published degree-5 polynomial fit; rows are the
# coefficients of x^0..x^5 for red, green and blue. Perceptually ordered, readable on black. The LUT
# starts at x = 0.05: Turbo's bottom few percent is near-black and would read as "no return".
_TURBO_COEFFS = np.array(
    [
        [0.13572138, 4.61539260, -42.66032258, 132.13108234, -152.94239396, 59.28637943],
        [0.09140261, 2.19418839, 4.84296658, -14.18503333, 4.27729857, 2.82956604],
        [0.10667330, 12.64194608, -60.58204836, 110.36276771, -89.90310912, 27.34824973],
    ]
)
_TURBO_LUT = np.clip(
    np.stack(
        [np.polynomial.polynomial.polyval(np.linspace(0.05, 1.0, 256), c) for c in _TURBO_COEFFS], axis=1
    )
    * 255.0
    + 0.5,
    0,
    255,
).astype(np.uint8)

# Model3D reads exactly this vertex layout (see the brief's Gradio notes).
PLY_VERTEX_DTYPE = np.dtype(
    [("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")]
)
_PLY_HEADER = (
    "ply\nformat binary_little_endian 1.0\nelement vertex {n}\n"
    "property float x\nproperty float y\nproperty float z\n"
    "property uchar red\nproperty uchar green\nproperty uchar blue\nend_header\n"
)

_NICE_LENGTHS_M = (1, 2, 5, 10, 20, 25, 50, 100, 200, 500)


def turbo(values: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] (clipped; NaN -> 0) to (..., 3) uint8 Turbo colours via a 256-entry LUT."""
    v = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0)
    return _TURBO_LUT[np.clip(np.rint(v * 255.0), 0, 255).astype(np.intp)]


def _as_points(points: np.ndarray, min_columns: int = 3) -> np.ndarray:
    """Validate an (N, 3+) cloud and drop non-finite rows, so one NaN cannot blank a whole picture."""
    pts = np.asarray(points)
    if pts.ndim != 2 or pts.shape[1] < min_columns:
        raise ValueError(
            f"points must be an (N, {min_columns}+) array (x, y, z[, intensity]), got shape {pts.shape}"
        )
    pts = pts.astype(np.float32, copy=False)
    finite = np.isfinite(pts[:, :min_columns]).all(axis=1)
    return pts if finite.all() else pts[finite]


def _value_range(values: np.ndarray, value_range: tuple[float, float] | None) -> tuple[float, float]:
    """The colour scale's ends; without an explicit range, the 1st-99th percentiles so outliers don't wash it out."""
    if value_range is not None:
        lo, hi = float(value_range[0]), float(value_range[1])
    elif values.size:
        lo, hi = (float(v) for v in np.percentile(values, [1.0, 99.0]))
    else:
        lo, hi = 0.0, 1.0
    return lo, max(hi, lo + 1e-6)


def _normalise(values: np.ndarray, value_range: tuple[float, float] | None) -> np.ndarray:
    lo, hi = _value_range(values, value_range)
    return np.clip((values - lo) / (hi - lo), 0.0, 1.0)


def _color_values(
    points: np.ndarray, by: ColorBy, value_range: tuple[float, float] | None
) -> tuple[np.ndarray, tuple[float, float]]:
    """The scalar each point is coloured by, and the (lo, hi) that maps to the ends of the colour map."""
    pts = np.asarray(points)
    if pts.ndim != 2 or pts.shape[1] < 3:
        raise ValueError(f"points must be an (N, 3+) array, got shape {pts.shape}")
    if by == "height":
        values = pts[:, 2].astype(np.float64)
    elif by == "range":
        values = np.linalg.norm(pts[:, :3].astype(np.float64), axis=1)
    elif by == "intensity":
        if pts.shape[1] < 4:
            raise ValueError(f"colouring by intensity needs (N, 4) points, got shape {pts.shape}")
        values = pts[:, 3].astype(np.float64)
        value_range = value_range or (0.0, 1.0)
    else:
        raise ValueError(f"unknown colour mode {by!r}; expected 'height', 'range' or 'intensity'")
    return values, _value_range(values, value_range)


def colorize(
    points: np.ndarray, by: ColorBy = "height", value_range: tuple[float, float] | None = None
) -> np.ndarray:
    """(N, 3) uint8 Turbo colours of each point by height (z), range (xyz norm) or intensity (column 3).

    `value_range` pins the colour scale (e.g. across the frames of an animation); by default height and
    range use robust percentiles of this cloud, intensity uses [0, 1].
    """
    values, (lo, hi) = _color_values(points, by, value_range)
    return turbo((values - lo) / (hi - lo))


def range_image_png(
    image: RangeImage | np.ndarray, max_range: float | None = None, scale: int = 4
) -> Image.Image:
    """An RGB picture of a range image, Turbo by log-range (near = red, far = blue), black where no return.

    Log-range matches what the network sees (`encode_range`) and keeps near structure readable.
    `scale` repeats each row so a 32-beam x 1024 image is not a sliver; columns are kept 1:1.
    """
    rng = image.range if isinstance(image, RangeImage) else np.asarray(image)
    if rng.ndim != 2:
        raise ValueError(f"expected a RangeImage or an (H, W) range array, got shape {rng.shape}")
    if int(scale) != scale or scale < 1:
        raise ValueError(f"scale must be a positive integer, got {scale!r}")
    rng = np.nan_to_num(rng.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    mask = rng > 0
    if max_range is None:
        max_range = float(rng.max()) if mask.any() else 1.0
    if max_range <= 0:
        raise ValueError(f"max_range must be positive, got {max_range}")
    v = 0.5 * (encode_range(rng, max_range) + 1.0)  # log-range in [0, 1]
    rgb = turbo(1.0 - v)
    rgb[~mask] = 0
    rgb = np.repeat(rgb, int(scale), axis=0)
    return Image.fromarray(np.ascontiguousarray(rgb), mode="RGB")


def _bev_pixels(xy: np.ndarray, extent: float, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat pixel index of each point inside the view, x forward = up, y left = left; plus the keep mask."""
    res = 2.0 * extent / size
    row = np.floor((extent - xy[:, 0]) / res).astype(np.int64)
    col = np.floor((extent - xy[:, 1]) / res).astype(np.int64)
    keep = (row >= 0) & (row < size) & (col >= 0) & (col < size)
    return row[keep] * size + col[keep], keep


def _draw_overlay(img: Image.Image, extent: float) -> None:
    """Ego marker (triangle pointing forward = up) at the centre and a labelled scale bar bottom-left."""
    size = img.width
    draw = ImageDraw.Draw(img)
    c = size / 2.0
    s = max(4.0, size / 80.0)
    draw.polygon([(c, c - 1.6 * s), (c - s, c + s), (c + s, c + s)], fill=(255, 255, 255), outline=(0, 0, 0))

    px_per_m = size / (2.0 * extent)
    target = 0.2 * 2.0 * extent  # about a fifth of the view
    length_m = max((n for n in _NICE_LENGTHS_M if n <= target), default=_NICE_LENGTHS_M[0])
    bar_px = length_m * px_per_m
    margin = max(8, size // 40)
    y = size - margin
    font = ImageFont.load_default(size=max(10, size // 40))
    label = f"{length_m} m"
    draw.line([(margin, y), (margin + bar_px, y)], fill=(255, 255, 255), width=max(2, size // 300))
    for x in (margin, margin + bar_px):
        draw.line([(x, y - size // 120 - 2), (x, y)], fill=(255, 255, 255), width=max(1, size // 400))
    draw.text((margin, y - size // 120 - 4), label, fill=(255, 255, 255), font=font, anchor="ld")


def bev_image(
    points: np.ndarray,
    extent: float = 50.0,
    resolution: float = 0.125,
    color_by: BevColorBy = "height",
    scale_bar: bool = True,
    value_range: tuple[float, float] | None = None,
) -> Image.Image:
    """A square top-down RGB picture of [-extent, extent]^2 m around the sensor (x forward points up).

    Each pixel shows its highest point's height, its point count (log scale, "density") or its mean
    intensity, in Turbo; empty pixels are black. `resolution` is metres per pixel. `value_range` pins the
    height/intensity colour scale, e.g. to keep an animation's colours steady.
    """
    if not (extent > 0 and resolution > 0):
        raise ValueError(
            f"extent and resolution must be positive, got extent={extent}, resolution={resolution}"
        )
    if color_by not in ("height", "density", "intensity"):
        raise ValueError(f"unknown color_by {color_by!r}; expected 'height', 'density' or 'intensity'")
    size = math.ceil(2.0 * extent / resolution - 1e-9)
    if size > 4096:
        raise ValueError(f"BEV of {size}x{size} px is too large; raise resolution (m/px) or lower extent")
    pts = _as_points(points, 4 if color_by == "intensity" else 3)
    pix, keep = _bev_pixels(pts[:, :2], extent, size)
    rgb = np.zeros((size * size, 3), dtype=np.uint8)
    if pix.size:
        if color_by == "height":
            z = pts[keep, 2].astype(np.float64)
            order = np.lexsort((z, pix))  # by pixel, highest point last
            last = np.ones(order.size, dtype=bool)
            last[:-1] = pix[order][1:] != pix[order][:-1]
            top = order[last]
            rgb[pix[top]] = turbo(_normalise(z[top], value_range))
        elif color_by == "density":
            counts = np.bincount(pix, minlength=size * size)
            hit = counts > 0
            v = np.log1p(counts[hit]) / np.log1p(counts.max())
            rgb[hit] = turbo(0.15 + 0.85 * v)
        else:  # intensity
            counts = np.bincount(pix, minlength=size * size)
            sums = np.bincount(pix, weights=pts[keep, 3].astype(np.float64), minlength=size * size)
            hit = counts > 0
            rgb[hit] = turbo(_normalise(sums[hit] / counts[hit], value_range or (0.0, 1.0)))
    img = Image.fromarray(rgb.reshape(size, size, 3), mode="RGB")
    if scale_bar:
        _draw_overlay(img, extent)
    return img


def _subsample_indices(n: int, max_points: int, seed: int) -> np.ndarray:
    """Deterministic subset (sorted, so scan order survives) when a cloud exceeds what a viewer can take."""
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1, got {max_points}")
    if n <= max_points:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=max_points, replace=False))


def ply_bytes(
    points: np.ndarray, colors: np.ndarray | None = None, max_points: int = 500_000, seed: int = 0
) -> bytes:
    """A vertex-only binary little-endian PLY that Gradio's Model3D draws as a coloured point cloud.

    Model3D's viewer is y-up, so LiDAR's z-up (x, y, z) is written as (x, z, -y). Colours default to
    height; `colors` is (N, 3) uint8 (or floats in [0, 1]). Above `max_points` a seeded subset is kept.
    """
    pts = np.asarray(points)
    if pts.ndim != 2 or pts.shape[1] < 3:
        raise ValueError(f"points must be an (N, 3+) array (x, y, z[, intensity]), got shape {pts.shape}")
    if colors is not None:
        colors = np.asarray(colors)
        if colors.shape != (len(pts), 3):
            raise ValueError(f"colors must be (N, 3) matching {len(pts)} points, got shape {colors.shape}")
        if colors.dtype.kind == "f":
            colors = np.clip(np.rint(colors * 255.0), 0, 255)
        colors = colors.astype(np.uint8)
    finite = np.isfinite(pts[:, :3]).all(axis=1)
    if not finite.all():
        pts, colors = pts[finite], (colors[finite] if colors is not None else None)
    idx = _subsample_indices(len(pts), max_points, seed)
    pts = pts[idx]
    rgb = colorize(pts) if colors is None else colors[idx]
    rec = np.empty(len(pts), dtype=PLY_VERTEX_DTYPE)
    rec["x"] = pts[:, 0]
    rec["y"] = pts[:, 2]
    rec["z"] = -pts[:, 1]
    rec["red"], rec["green"], rec["blue"] = rgb[:, 0], rgb[:, 1], rgb[:, 2]
    return _PLY_HEADER.format(n=len(rec)).encode("ascii") + rec.tobytes()


def write_ply_for_viewer(
    path: str | Path, points: np.ndarray, colors: np.ndarray | None = None, max_points: int = 500_000
) -> Path:
    """Write `ply_bytes(points, colors)` to `path` (creating parent folders) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = ply_bytes(points, colors, max_points=max_points)
    path.write_bytes(data)
    logger.info("wrote viewer PLY %s (%d bytes)", path, len(data))
    return path


def save_animation(images: list[Image.Image], path: str | Path, fps: float = 10.0) -> Path:
    """Save frames as a looping animated GIF (.gif) or APNG (.png/.apng), chosen by the extension.

    Pillow folds consecutive identical frames into one longer frame, so the file may hold fewer frames
    than `images` when the sequence has repeats.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".gif", ".png", ".apng"):
        raise ValueError(f"cannot tell the animation format from {path.name!r}; expected .gif, .png or .apng")
    if not images:
        raise ValueError("save_animation needs at least one frame, got an empty list")
    if not fps > 0:
        raise ValueError(f"fps must be positive, got {fps}")
    frames = [im.convert("RGB") for im in images]
    if any(f.size != frames[0].size for f in frames):
        raise ValueError(f"all frames must share one size; got {sorted({f.size for f in frames})}")
    path.parent.mkdir(parents=True, exist_ok=True)
    duration = round(1000.0 / fps)
    fmt = "GIF" if suffix == ".gif" else "PNG"
    frames[0].save(path, format=fmt, save_all=True, append_images=frames[1:], duration=duration, loop=0)
    logger.info("wrote %d-frame %s animation %s", len(frames), fmt, path)
    return path


def labelled(panels: Sequence[tuple[str, Image.Image]], *, across: bool = True, label_height: int = 20) -> Image.Image:
    """Pictures to compare by eye, each under its label: side by side with a white line between them (BEVs,
    `across`), or one above the other (range images, wide and low). The canvas is black where a picture is
    smaller than its neighbours."""
    if not panels:
        raise ValueError("labelled needs at least one (label, picture) panel, got none")
    if label_height < 1:
        raise ValueError(f"label_height must be a positive number of pixels, got {label_height}")
    images = [image.convert("RGB") for _, image in panels]
    if across:
        size = (sum(im.width for im in images), max(im.height for im in images) + label_height)
        corners = [(sum(im.width for im in images[:k]), 0) for k in range(len(images))]
    else:
        size = (max(im.width for im in images), sum(im.height + label_height for im in images))
        corners = [(0, sum(im.height + label_height for im in images[:k])) for k in range(len(images))]
    canvas = Image.new("RGB", size, (0, 0, 0))
    draw, font = ImageDraw.Draw(canvas), ImageFont.load_default(size=max(label_height * 2 // 3, 1))
    for (label, _), image, (x, y) in zip(panels, images, corners, strict=True):
        draw.text((x + 6, y + label_height // 2), label, fill=(255, 255, 255), font=font, anchor="lm")
        canvas.paste(image, (x, y + label_height))
        if across and x:
            draw.line([(x, 0), (x, canvas.height)], fill=(255, 255, 255), width=2)
    return canvas
