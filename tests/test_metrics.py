"""Metrics give the numbers LiDARGen / R2DM define, checked against hand values, scipy and explicit loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.spatial.distance import jensenshannon

from lidar import metrics
from lidar.range_image import RangeImage
from lidar.real_scans import real_scans_dir

REAL_SCANS = real_scans_dir()
def _scene(seed: int, n: int = 3000, shift: float = 0.0) -> np.ndarray:
    """A street-ish cloud: ground ring plus two walls, optionally slid forward by `shift` metres."""
    rng = np.random.default_rng(seed)
    az = rng.uniform(-np.pi, np.pi, n)
    r = rng.uniform(4.0, 60.0, n)
    ground = np.stack([r * np.cos(az), r * np.sin(az), np.full(n, -1.8)], axis=1)
    x = rng.uniform(-50, 50, n)
    walls = np.stack([x, np.where(rng.random(n) < 0.5, 8.3, -8.3), rng.uniform(-1.8, 3.0, n)], axis=1)
    pts = np.concatenate([ground, walls])
    pts[:, 0] += shift
    return pts.astype(np.float32)


def test_bev_histogram_bins_by_hand_and_keeps_only_3_to_70_m_by_xyz_norm():
    pts = np.array(
        [
            [10.0, 0.0, 0.0],  # kept: x-bin floor(90 / 1.6) = 56, y-bin 50
            [69.9, 0.0, 0.0],  # kept: x-bin 93
            [-10.0, -20.0, 5.0],  # range 22.9, kept: x-bin 43, y-bin 37
            [2.0, 0.0, 0.0],  # too near
            [0.0, 0.0, 3.0],  # exactly 3 m: dropped (strict)
            [70.0, 0.0, 0.0],  # exactly 70 m: dropped (strict)
            [2.9, 0.0, 69.9],  # xy within 3 m but xyz norm ~70 m: range is 3D, kept
            [np.nan, 1.0, 1.0],
        ]
    )
    hist = metrics.bev_histogram(pts)
    assert hist.shape == (100, 100) and hist.dtype == np.float64
    assert hist.sum() == 4
    assert hist[56, 50] == 1 and hist[93, 50] == 1 and hist[43, 37] == 1 and hist[51, 50] == 1


def test_bev_histogram_matches_r2dm_torch_histogramdd():
    torch = pytest.importorskip("torch")
    pts = _scene(1)
    # R2DM metrics/bev.py point_cloud_to_histogram, re-typed here as the reference. (Walls sit off bin
    # edges: R2DM's float32 torch edges and LiDARGen's float64 numpy edges can disagree exactly on one.)
    pc = torch.from_numpy(pts)
    depth = pc.norm(p=2, dim=1)
    mask = (depth > 3.0) & (depth < 70.0)
    ref = torch.histogramdd(pc[mask, 0:2], bins=100, range=[-80.0, 80.0, -80.0, 80.0]).hist
    np.testing.assert_array_equal(metrics.bev_histogram(pts), ref.numpy())


def test_histogram_jsd_is_scipys_natural_log_distance():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 20, size=(3, 7, 7)).astype(float)
    b = rng.integers(0, 20, size=(5, 7, 7)).astype(float)
    expected = jensenshannon(a.sum(0).ravel() / a.sum(), b.sum(0).ravel() / b.sum())
    assert metrics.histogram_jsd(a, b) == pytest.approx(expected, rel=1e-12)
    # By hand: p = [1, 0], q = [1/2, 1/2], m = [3/4, 1/4].
    js = 0.5 * (math.log(4 / 3) + 0.5 * math.log(2 / 3) + 0.5 * math.log(2))
    assert metrics.histogram_jsd(np.array([[2.0, 0.0]]), np.array([[1.0, 1.0]])) == pytest.approx(
        math.sqrt(js)
    )
    # Disjoint support: the maximum, sqrt(ln 2).
    assert metrics.histogram_jsd(np.array([[1.0, 0.0]]), np.array([[0.0, 3.0]])) == pytest.approx(
        math.sqrt(math.log(2))
    )


def test_histogram_jsd_compares_set_sums_not_scans():
    a = np.array([[1.0, 0.0], [0.0, 1.0]])
    b = np.array([[5.0, 5.0]])
    assert metrics.histogram_jsd(a, b) == 0.0


def test_histogram_mmd_equals_an_explicit_double_loop():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 5, size=(3, 4, 4)).astype(float) + 0.1
    b = rng.integers(0, 5, size=(4, 4, 4)).astype(float)
    b[:, 0, 0] += 1.0
    sigma = 0.5

    def kernel(x, y):
        x, y = x.ravel() / x.sum(), y.ravel() / y.sum()
        return math.exp(-float(np.sum((x - y) ** 2)) / (2 * sigma * sigma))

    def disc(s1, s2):
        return sum(kernel(x, y) for x in s1 for y in s2) / (len(s1) * len(s2))

    expected = disc(a, a) + disc(b, b) - 2 * disc(a, b)
    assert expected > 1e-4
    assert metrics.histogram_mmd(a, b) == pytest.approx(expected, rel=1e-10)


def test_bev_mmd_by_hand_for_two_one_point_scans():
    # Each scan's pmf is a one-hot in a different bin: ||p - q||^2 = 2 -> MMD = 2 - 2 exp(-2 / (2 * 0.25)).
    a = [np.array([[10.0, 0.0, 0.0]])]
    b = [np.array([[-10.0, 0.0, 0.0]])]
    assert metrics.bev_mmd(a, b) == pytest.approx(2.0 - 2.0 * math.exp(-4.0))
    assert metrics.bev_jsd(a, b) == pytest.approx(math.sqrt(math.log(2)))


def test_identical_sets_score_zero_and_a_shifted_world_does_not():
    same = [_scene(s) for s in range(3)]
    assert metrics.bev_jsd(same, same) == 0.0
    assert metrics.bev_mmd(same, same) == pytest.approx(0.0, abs=1e-15)
    near = metrics.bev_jsd(same, [_scene(s, shift=2.0) for s in range(3)])
    far = metrics.bev_jsd(same, [_scene(s, shift=12.0) for s in range(3)])
    assert 0.0 < near < far <= math.sqrt(math.log(2))
    assert metrics.bev_mmd(same, [_scene(s, shift=12.0) for s in range(3)]) > 0.0


def test_bev_metrics_refuse_empty_sets_single_arrays_and_empty_windows():
    with pytest.raises(ValueError, match="empty"):
        metrics.bev_jsd([], [_scene(0)])
    with pytest.raises(ValueError, match="wrap a single scan"):
        metrics.bev_mmd(_scene(0), [_scene(0)])
    with pytest.raises(ValueError, match="no points inside the histogram window"):
        metrics.bev_mmd([np.array([[1.0, 0.0, 0.0]])], [_scene(0)])


def test_chamfer_distance_by_hand_brute_force_and_identity():
    a = np.array([[0.0, 0.0, 0.0, 0.3]])
    b = np.array([[3.0, 4.0, 0.0], [0.0, 0.0, 1.0]])
    # a->b: 1; b->a: mean(5, 1) = 3; CD = (1 + 3) / 2 = 2 metres (not squared).
    assert metrics.chamfer_distance(a, b) == pytest.approx(2.0)

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(200, 3)), rng.normal(size=(150, 3)) + 0.5
    d = np.linalg.norm(x[:, None] - y[None], axis=2)
    assert metrics.chamfer_distance(x, y) == pytest.approx(
        0.5 * (d.min(1).mean() + d.min(0).mean()), rel=1e-12
    )
    assert metrics.chamfer_distance(x, x) == 0.0
    with pytest.raises(ValueError, match="non-empty"):
        metrics.chamfer_distance(np.zeros((0, 3)), y)
    with pytest.raises(ValueError, match="non-finite"):
        metrics.chamfer_distance(np.array([[np.nan, 0, 0]]), y)


def _kitti_bin(name: str) -> np.ndarray:
    path = REAL_SCANS / name
    if not path.exists():
        pytest.skip(f"shared real scan {path} is absent (expected the shared data folder next to the repo)")
    return np.fromfile(path, dtype=np.float32).reshape(-1, 4)


def test_real_kitti_frames_score_closer_to_each_other_than_to_another_dataset():
    k0, k2, k4 = (_kitti_bin(f"kitti_patchworkpp_00000{i}.bin") for i in (0, 2, 4))
    panda = _kitti_bin("pandaset_bynow76_000000.bin")  # ego/ground frame, another sensor and city
    same_drive = metrics.bev_jsd([k0], [k2])
    other = metrics.bev_jsd([k0], [panda])
    assert 0.0 < same_drive < other
    assert metrics.bev_mmd([k0], [k2]) < metrics.bev_mmd([k0], [panda])
    # Frames 0.2 s apart disagree less than frames 0.4 s apart.
    assert 0.0 < metrics.chamfer_distance(k0, k2) < metrics.chamfer_distance(k0, k4) < 1.0


def test_forecast_chamfer_by_hand_is_squared_halved_and_cropped():
    pred = np.array([[0.0, 0.0, 0.0], [69.0, 0.0, 0.0], [71.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    gt = np.array([[0.0, 0.0, 1.0], [70.0, -70.0, -4.5], [0.0, 80.0, 0.0]])
    # Crop keeps pred (0,0,0), (69,0,0) and gt (0,0,1), (70,-70,-4.5) (bounds inclusive).
    # pred->gt: 1 and |(69,0,0)-(0,0,1)|^2 = 4762; gt->pred: 1 and |(1,-70,-4.5)|^2 = 4921.25.
    expected = 0.5 * ((1.0 + 4762.0) / 2 + (1.0 + 4921.25) / 2)
    assert metrics.forecast_chamfer(pred, gt) == pytest.approx(expected)
    assert metrics.forecast_chamfer(gt, gt) == 0.0
    # Against the plain-metre form: one point 3 m off is 3 m there and (9 + 9) / 2 m^2 here.
    assert metrics.chamfer_distance(pred[:1], gt[:1] * 3) == pytest.approx(3.0)
    assert metrics.forecast_chamfer(pred[:1], gt[:1] * 3) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="crop"):
        metrics.forecast_chamfer(pred[2:], gt)


def test_in_crop_is_an_inclusive_box_in_the_sensor_frame():
    pts = np.array([[70.0, 70.0, 4.5], [-70.0, 0.0, -4.5], [70.01, 0.0, 0.0], [0.0, -70.01, 0.0], [0, 0, 4.6]])
    np.testing.assert_array_equal(metrics.in_crop(pts), [True, True, False, False, False])
    np.testing.assert_array_equal(metrics.in_crop(pts, half_xy=100.0, half_z=5.0), [True] * 5)


def test_per_ray_errors_identical_images_are_perfect_and_a_known_shift_gives_known_errors():
    gt = np.array([[10.0, 20.0, 0.0, 5.0], [0.0, 40.0, 8.0, 0.0]])
    same = metrics.per_ray_errors(gt, gt)
    assert same == {"l1_mean": 0.0, "l1_median": 0.0, "absrel": 0.0, "coverage": 1.0, "iou": 1.0}
    # Every returning ray 0.5 m too far: L1 0.5, AbsRel mean(0.5 / r).
    shifted = metrics.per_ray_errors(np.where(gt > 0, gt + 0.5, 0.0), RangeImage(gt, np.zeros_like(gt)))
    assert shifted["l1_mean"] == pytest.approx(0.5) and shifted["l1_median"] == pytest.approx(0.5)
    assert shifted["absrel"] == pytest.approx(np.mean(0.5 / np.array([10, 20, 5, 40, 8])))
    assert shifted["iou"] == 1.0


def test_per_ray_errors_count_holes_in_coverage_and_iou_not_in_depth():
    gt = np.array([[10.0, 20.0, 0.0, 5.0]])
    pred = np.array([[11.0, 0.0, 7.0, 2.0]])  # ray 1 a hole, ray 2 spurious
    errs = metrics.per_ray_errors(pred, gt)
    assert errs["l1_mean"] == pytest.approx(2.0) and errs["l1_median"] == pytest.approx(2.0)
    assert errs["absrel"] == pytest.approx((0.1 + 0.6) / 2)
    assert errs["coverage"] == pytest.approx(2 / 3) and errs["iou"] == pytest.approx(2 / 4)
    nothing = metrics.per_ray_errors(np.zeros_like(gt), gt)
    assert math.isnan(nothing["l1_median"]) and nothing["coverage"] == 0.0 and nothing["iou"] == 0.0
    with pytest.raises(ValueError, match="no returns"):
        metrics.per_ray_errors(gt, np.zeros_like(gt))
    with pytest.raises(ValueError, match="one sensor grid"):
        metrics.per_ray_errors(gt[:, :2], gt)
    with pytest.raises(ValueError, match="non-finite"):
        metrics.per_ray_errors(np.full_like(gt, np.nan), gt)
