"""Observed scenes: forecast and re-simulate from registered real sweeps, through Python and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from inference import load_pipeline
from inference.__main__ import main
from inference.network import WorldModel
from inference.observed import MAX_OFFSET_M, check_inside, observe, shifted_path
from lidar.metrics import chamfer_distance
from lidar.range_image import project, unproject
from lidar.real_scans import real_scans_dir
from lidar.sensors import Sensor
from tests.helpers import tiny_config, tiny_model, write_release

REPO = Path(__file__).resolve().parents[1]
REAL_SCANS = real_scans_dir()
KITTI = [REAL_SCANS / f"kitti_patchworkpp_{i:06d}.bin" for i in (0, 2, 4)]
UNRELATED = REAL_SCANS / "kitti_mmdet3d_000008.bin"

needs_scans = pytest.mark.skipif(not REAL_SCANS.is_dir(), reason=f"shared real scans not found at {REAL_SCANS}")


def _pose(x: float, y: float, yaw_deg: float) -> np.ndarray:
    c, s = np.cos(np.radians(yaw_deg)), np.sin(np.radians(yaw_deg))
    return np.array([[c, -s, 0, x], [s, c, 0, y], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=np.float64)


def test_a_shifted_path_moves_each_pose_in_its_own_frame() -> None:
    poses = np.stack([_pose(0, 0, 90), _pose(0, 2, 90)])
    np.testing.assert_array_equal(shifted_path(poses), poses)
    moved = shifted_path(poses, (1.0, 0.5), 10.0)
    np.testing.assert_allclose(moved[:, :2, 3], [[-0.5, 1.0], [-0.5, 3.0]], atol=1e-12)  # forward = world +y
    np.testing.assert_allclose(moved[0, :3, :3], _pose(0, 0, 100)[:3, :3], atol=1e-12)
    five = shifted_path(poses, frames=5)
    np.testing.assert_allclose(five[:, 1, 3], [0, 0.5, 1, 1.5, 2])
    with pytest.raises(ValueError, match="frames must be an integer >= 1"):
        shifted_path(poses, frames=0)


def test_a_path_outside_the_observed_area_is_refused() -> None:
    observed = np.stack([_pose(0, 0, 0), _pose(2, 0, 0)])
    check_inside(shifted_path(observed, (0.0, MAX_OFFSET_M - 0.1)), observed)
    with pytest.raises(ValueError, match=r"target pose 0 lies 12\.0 m from the nearest observed sweep"):
        check_inside(shifted_path(observed, (-12.0, 0.0)), observed)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release(tmp_path_factory.mktemp("release"), tiny_model(seed=4))


@pytest.fixture(scope="module")
def kitti_scene():
    if not REAL_SCANS.is_dir():
        pytest.skip(f"shared real scans not found at {REAL_SCANS}")
    return observe(KITTI)


@needs_scans
def test_several_sweeps_without_poses_are_registered(kitti_scene) -> None:
    assert kitti_scene.pose_source == "registered" and kitti_scene.names == [p.name for p in KITTI]
    records = kitti_scene.prefix_records()
    assert [r["file"] for r in records] == kitti_scene.names and records[2]["fitness"] > 0.7
    assert 2.0 < records[2]["pose"][0][3] < 4.0  # 0.4 s of driving at 18-36 km/h
    world = kitti_scene.world_points()
    assert world.shape == (sum(s.num_points for s in kitti_scene.scans), 4) and world.dtype == np.float32


@needs_scans
def test_resimulation_at_zero_shift_reproduces_the_observed_sweep_within_its_resampling_noise(
    kitti_scene, tmp_path
) -> None:
    """A prior-only model (zero-initialised output, docs/design.md: it reproduces the prior) on the shipped sensor.

    The floor is the Chamfer distance between a raw sweep and its own resampling on the model's beams and
    columns: no frame on that grid can be closer. The re-rendered frame is drawn from the cache of all three
    registered sweeps (registration residual ~0.25 m, the cache's voxels), so it may sit above the floor by
    half of it; measured: 0.23-0.25 m against a floor of 0.19 m. Each frame must also be nearer its own
    sweep than the neighbouring sweep 1.5 m away, so the pose, not only the scene, is right.
    """
    sensor = json.loads((REPO / "weights" / "default" / "config.json").read_text())["sensor"]
    model = WorldModel(tiny_config(sensor=sensor))
    pipe = load_pipeline(write_release(tmp_path, model))
    out = pipe.resimulate(kitti_scene.scans, kitti_scene.poses, shifted_path(kitti_scene.poses), steps=1)
    resampled = [unproject(project(scan.points, pipe.sensor), pipe.sensor) for scan in kitti_scene.scans]
    for i, (frame, scan) in enumerate(zip(out.frames, kitti_scene.scans, strict=True)):
        floor = chamfer_distance(resampled[i], scan.points)
        assert chamfer_distance(frame.points, scan.points) < 1.5 * floor, (i, floor)
        neighbour = resampled[i - 1] if i else resampled[1]
        assert chamfer_distance(frame.points, resampled[i]) < chamfer_distance(frame.points, neighbour)


@needs_scans
def test_cli_forecast_registers_several_sweeps_and_lists_the_prefix(release, tmp_path, capsys) -> None:
    out = tmp_path / "fc"
    argv = ["forecast", "--model", str(release), "--prefix", *map(str, KITTI), "--frames", "2", "--steps", "1"]
    assert main([*argv, "--out", str(out), "--quiet"]) == 0
    meta = json.loads((out / "poses.json").read_text())
    assert [p["file"] for p in meta["prefix"]] == [p.name for p in KITTI]
    assert meta["request"]["poses"] == "registered" and meta["prefix"][1]["fitness"] > 0.7
    last = np.asarray(meta["prefix"][-1]["pose"])
    assert np.asarray(meta["frames"][0]["pose"])[0, 3] > last[0, 3]  # the forecast drives on from the last sweep
    # the written poses.json is itself a poses file for the same sweeps
    again = tmp_path / "again"
    assert main([*argv, "--poses", str(out / "poses.json"), "--out", str(again), "--quiet"]) == 0
    assert json.loads((again / "poses.json").read_text())["prefix"][2]["pose"] == meta["prefix"][2]["pose"]


@needs_scans
def test_cli_resimulate_writes_the_shifted_path(release, tmp_path) -> None:
    out = tmp_path / "rs"
    argv = ["resimulate", "--model", str(release), "--scan", *map(str, KITTI), "--shift", "0", "2", "--yaw", "5"]
    assert main([*argv, "--frames", "4", "--steps", "1", "--out", str(out), "--quiet"]) == 0
    meta = json.loads((out / "poses.json").read_text())
    poses = np.asarray([f["pose"] for f in meta["frames"]])
    assert len(poses) == 4 and np.allclose(poses[:, 1, 3], 2.0, atol=0.2)  # 2 m to the left of the path
    assert meta["request"]["shift"] == [0.0, 2.0] and len(meta["prefix"]) == 3
    sensor = Sensor.from_dict(meta["sensor"])  # the frames' grid: the newest sweep's own, not the model's
    assert sensor.name == "hdl64-measured" and sensor.height == 64 and 1990 <= sensor.width <= 2030


@needs_scans
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["forecast", "--prefix", *map(str, KITTI[:2]), str(UNRELATED)], "does not register onto the sweeps before it"),
        (["resimulate", "--scan", *map(str, KITTI), "--shift", "25", "0"], "outside the observed area"),
        (["resimulate", "--scan", str(KITTI[0]), "{tmp}/garbage.bin"], "garbage.bin"),
        (["forecast", "--prefix", str(KITTI[0]), "--poses", "{tmp}/garbage.bin"], "not a KITTI poses.txt"),
    ],
)
def test_cli_bad_observations_are_one_error_line_and_exit_2(release, tmp_path, capsys, args, message) -> None:
    (tmp_path / "garbage.bin").write_bytes(b"\x01\x02\x03")
    argv = [a.format(tmp=tmp_path) for a in args] + ["--model", str(release), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()  # registration progress may come first
    assert [line for line in err if line.startswith("error: ")] == err[-1:] and message in err[-1], err
