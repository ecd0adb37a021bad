"""Rendering produces pictures and viewer files that say what the sweep is, in the project's frames."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from lidar import render
from lidar.range_image import RangeImage, project
from lidar.sensors import HDL32


def _parse_ply(data: bytes) -> tuple[list[str], np.ndarray]:
    """Read the header line by line and the body as packed records, as a strict PLY reader would."""
    end = data.index(b"end_header\n") + len(b"end_header\n")
    header = data[:end].decode("ascii").split("\n")[:-1]
    n = int(next(line for line in header if line.startswith("element vertex")).split()[-1])
    dtype = np.dtype([("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("r", "u1"), ("g", "u1"), ("b", "u1")])
    body = data[end:]
    assert len(body) == n * dtype.itemsize, "body length must match the vertex count exactly"
    return header, np.frombuffer(body, dtype=dtype)


def _ring_scene(n: int = 4000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    az = rng.uniform(-np.pi, np.pi, n)
    r = rng.uniform(5.0, 40.0, n)
    z = rng.uniform(-1.8, 2.0, n)
    return np.stack([r * np.cos(az), r * np.sin(az), z, rng.uniform(0, 1, n)], axis=1).astype(np.float32)


def test_range_image_png_is_scaled_vertically_and_black_where_no_return():
    rng = np.zeros((4, 16), dtype=np.float32)
    rng[1, 3] = 2.0
    rng[2, 10] = 60.0
    png = render.range_image_png(RangeImage(rng, np.zeros_like(rng)), max_range=80.0, scale=3)
    assert png.mode == "RGB" and png.size == (16, 12)
    arr = np.asarray(png)
    assert (arr[3:6, 3] > 0).any(axis=1).all() and (arr[6:9, 10] > 0).any(axis=1).all()
    assert np.array_equal(arr[3:6, 3], np.repeat(arr[3:4, 3], 3, axis=0)), "rows are repeated, not blended"
    assert not np.array_equal(arr[3, 3], arr[6, 10]), "near and far returns get different colours"
    assert arr[3, 3, 0] > arr[3, 3, 2] and arr[6, 10, 2] > arr[6, 10, 0], "near is red, far is blue"
    hit = np.zeros((12, 16), dtype=bool)
    hit[3:6, 3] = hit[6:9, 10] = True
    assert (arr[~hit] == 0).all(), "every no-return pixel is pure black"


def test_range_image_png_of_a_projected_scan_matches_the_sensor_shape():
    image = project(_ring_scene(), HDL32.with_width(256))
    png = render.range_image_png(image)
    assert png.size == (256, 32 * 4)
    black = (np.asarray(png)[::4] == 0).all(axis=2)
    assert np.array_equal(black, ~image.mask)


def test_range_image_png_rejects_bad_arguments():
    with pytest.raises(ValueError, match="scale"):
        render.range_image_png(np.ones((2, 8)), scale=0)
    with pytest.raises(ValueError, match=r"\(H, W\)"):
        render.range_image_png(np.ones(8))


def test_bev_points_forward_up_and_left_left():
    # A blob 20 m ahead and another 20 m to the left, nothing else.
    ahead = np.array([[20.0, 0.0, 0.0, 0.5]] * 5, dtype=np.float32)
    left = np.array([[0.0, 20.0, 1.0, 0.5]] * 5, dtype=np.float32)
    img = render.bev_image(np.concatenate([ahead, left]), extent=40.0, resolution=0.5, scale_bar=False)
    assert img.size == (160, 160)
    arr = np.asarray(img)
    lit = np.argwhere(arr.any(axis=2))
    assert len(lit) == 2
    # x = 20 -> row (40 - 20) / 0.5 = 40, centre column 80; y = 20 -> column 40, centre row 80.
    assert {tuple(p) for p in lit} == {(40, 80), (80, 40)}


def test_bev_height_colours_follow_the_highest_point_in_a_pixel():
    low_then_high = np.array([[10.0, 0.1, -1.0], [10.0, 0.1, 3.0], [-10.0, 0.1, -1.0]], dtype=np.float32)
    img = render.bev_image(
        low_then_high, extent=20.0, resolution=1.0, scale_bar=False, value_range=(-1.0, 3.0)
    )
    arr = np.asarray(img)
    assert np.array_equal(arr[10, 19], render.turbo(np.array(1.0))), "x=10 pixel shows its top (z=3)"
    assert np.array_equal(arr[30, 19], render.turbo(np.array(0.0)))


def test_bev_density_brightens_with_count_and_overlay_draws_bar_and_ego():
    pts = np.concatenate([np.tile([[10.0, 10.0, 0.0]], (50, 1)), [[-10.0, -10.0, 0.0]]]).astype(np.float32)
    plain = np.asarray(
        render.bev_image(pts, extent=25.0, resolution=0.25, color_by="density", scale_bar=False)
    )
    assert not np.array_equal(plain[60, 60], plain[140, 140]), "50 points vs 1 point differ in colour"
    lit_plain = plain.any(axis=2).sum()
    assert lit_plain == 2
    overlay = np.asarray(render.bev_image(pts, extent=25.0, resolution=0.25, color_by="density"))
    white = (overlay == 255).all(axis=2)
    assert white[95:105, 95:105].any(), "ego marker at the centre"
    assert white[180:, :60].sum() > 30, "scale bar and its label bottom-left"


@pytest.mark.parametrize(("extent", "resolution", "bar_m"), [(25.0, 0.25, 10), (50.0, 0.125, 20), (40.0, 0.5, 10)])
def test_bev_scale_bar_is_as_long_as_its_metres(extent, resolution, bar_m):
    """The bar spans a round length near a fifth of the view, drawn at the picture's own metres per pixel."""
    img = np.asarray(render.bev_image(np.zeros((1, 3), np.float32), extent=extent, resolution=resolution))
    size = img.shape[0]
    white = (img[size - size // 8 :] == 255).all(axis=2)  # bottom eighth: the bar, clear of the ego marker
    padded = np.pad(white, ((0, 0), (1, 1))).astype(np.int8)
    edges = np.diff(padded, axis=1)
    longest = max((np.flatnonzero(e == -1) - np.flatnonzero(e == 1)).max(initial=0) for e in edges)
    assert abs(longest - bar_m / resolution) <= 2, f"bar of {longest} px; {bar_m} m is {bar_m / resolution:g} px"


def test_bev_intensity_and_bad_inputs():
    pts = np.array([[5.0, 0.0, 0.0, 0.0], [5.0, 0.0, 0.0, 1.0]], dtype=np.float32)
    arr = np.asarray(
        render.bev_image(pts, extent=10.0, resolution=1.0, color_by="intensity", scale_bar=False)
    )
    assert np.array_equal(arr[5, 10], render.turbo(np.array(0.5))), "mean intensity of the pixel"
    with pytest.raises(ValueError, match="color_by"):
        render.bev_image(pts, color_by="rainbow")
    with pytest.raises(ValueError, match=r"\(N, 3\+\)"):
        render.bev_image(np.zeros((5, 2)))
    with pytest.raises(ValueError, match="too large"):
        render.bev_image(pts, extent=1000.0, resolution=0.01)


def test_colorize_maps_the_value_range_to_the_ends_of_turbo():
    pts = np.array([[0, 0, -2.0, 0.0], [0, 0, 0.0, 0.5], [0, 0, 2.0, 1.0]], dtype=np.float32)
    rgb = render.colorize(pts, by="height", value_range=(-2.0, 2.0))
    assert rgb.dtype == np.uint8 and rgb.shape == (3, 3)
    assert np.array_equal(rgb[0], render.turbo(np.array(0.0))) and np.array_equal(
        rgb[2], render.turbo(np.array(1.0))
    )
    assert np.array_equal(render.colorize(pts, by="intensity"), rgb)
    assert render.colorize(pts, by="range").shape == (3, 3)
    with pytest.raises(ValueError, match="intensity"):
        render.colorize(pts[:, :3], by="intensity")


def test_turbo_runs_blue_to_red_and_never_looks_like_no_return():
    lo, mid, hi = render.turbo(np.array([0.0, 0.5, 1.0])).astype(int)
    assert lo[2] > lo[0] and hi[0] > hi[2] and mid[1] > 200
    assert render.turbo(np.linspace(0, 1, 256)).max(axis=1).min() >= 100, "no colour is near-black"


def test_ply_bytes_parse_back_with_y_up_axes_and_colours():
    pts = np.array([[1.0, 2.0, 3.0, 0.1], [-4.0, 5.5, -6.0, 0.9]], dtype=np.float32)
    colors = np.array([[255, 0, 0], [0, 128, 255]], dtype=np.uint8)
    data = render.ply_bytes(pts, colors)
    assert b"\r" not in data[: data.index(b"end_header")], "LF line endings only"
    header, rec = _parse_ply(data)
    assert header == [
        "ply",
        "format binary_little_endian 1.0",
        "element vertex 2",
        "property float x",
        "property float y",
        "property float z",
        "property uchar red",
        "property uchar green",
        "property uchar blue",
        "end_header",
    ]
    np.testing.assert_array_equal(rec["x"], [1.0, -4.0])
    np.testing.assert_array_equal(rec["y"], [3.0, -6.0])  # z-up -> y-up
    np.testing.assert_array_equal(rec["z"], [-2.0, -5.5])  # y -> -z
    np.testing.assert_array_equal(np.stack([rec["r"], rec["g"], rec["b"]], axis=1), colors)


def test_ply_defaults_to_height_colours_and_subsamples_deterministically(tmp_path):
    pts = _ring_scene(1000)
    _, full = _parse_ply(render.ply_bytes(pts))
    expected = render.colorize(pts)
    np.testing.assert_array_equal(np.stack([full["r"], full["g"], full["b"]], axis=1), expected)
    a = render.ply_bytes(pts, max_points=100)
    assert a == render.ply_bytes(pts, max_points=100), "same input, same bytes"
    _, sub = _parse_ply(a)
    assert len(sub) == 100
    assert set(map(tuple, np.stack([sub["x"], -sub["z"], sub["y"]], 1).tolist())) <= set(
        map(tuple, pts[:, :3].tolist())
    ), "a subset of the original points"
    path = render.write_ply_for_viewer(tmp_path / "out" / "cloud.ply", pts)
    assert path.read_bytes() == render.ply_bytes(pts)


def test_ply_drops_non_finite_points_and_rejects_mismatched_colours():
    pts = np.array([[1, 2, 3], [np.nan, 0, 0], [4, 5, 6]], dtype=np.float32)
    _, rec = _parse_ply(render.ply_bytes(pts))
    assert len(rec) == 2
    with pytest.raises(ValueError, match="colors"):
        render.ply_bytes(pts, np.zeros((2, 3), dtype=np.uint8))


@pytest.mark.parametrize("suffix", [".gif", ".png"])
def test_save_animation_keeps_every_distinct_frame_and_loops(tmp_path, suffix):
    frames = [Image.new("RGB", (32, 16), (40 * i, 255 - 40 * i, 0)) for i in range(5)]
    path = render.save_animation(frames, tmp_path / f"seq{suffix}", fps=5)
    with Image.open(path) as im:
        assert im.format == ("GIF" if suffix == ".gif" else "PNG")
        assert im.n_frames == 5 and im.is_animated
        assert im.info.get("loop") == 0
        assert im.info.get("duration") == 200


def test_save_animation_rejects_unknown_extension_and_empty_input(tmp_path):
    frame = Image.new("RGB", (8, 8))
    with pytest.raises(ValueError, match=r"\.gif"):
        render.save_animation([frame], tmp_path / "seq.mp4")
    with pytest.raises(ValueError, match="empty"):
        render.save_animation([], tmp_path / "seq.gif")


def test_labelled_panels_sit_under_their_labels_side_by_side_or_stacked():
    red, blue = Image.new("RGB", (40, 30), (255, 0, 0)), Image.new("RGB", (60, 20), (0, 0, 255))
    row = np.asarray(render.labelled([("before", red), ("after", blue)], label_height=16))
    assert row.shape == (16 + 30, 100, 3)
    assert (row[16:, 2:40] == (255, 0, 0)).all() and (row[16:36, 42:] == (0, 0, 255)).all()
    assert (row[36:, 42:] == 0).all(), "black below the lower picture"
    assert (row[:, 40] == 255).all(), "a white line between the panels"
    assert row[:16, :40].any() and row[:16, 40:].any(), "each label is drawn"
    column = np.asarray(render.labelled([("before", red), ("after", blue)], across=False, label_height=16))
    assert column.shape == (16 + 30 + 16 + 20, 60, 3)
    assert (column[16:46, :40] == (255, 0, 0)).all() and (column[62:, :] == (0, 0, 255)).all()
    assert (column[16:46, 40:] == 0).all() and column[46:62].any()
    with pytest.raises(ValueError, match="at least one"):
        render.labelled([])
