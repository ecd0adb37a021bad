"""The 4D views: a Rerun recording read back with rerun-sdk, ROS bags read back with rosbags (through
`lidar.recordings`), and the views every rollout of the command line writes."""

from __future__ import annotations

import numpy as np
import pytest
from rerun.chunk import RrdReader
from scipy.spatial.transform import Rotation

from lidar.errors import InputError
from lidar.export4d import COLOUR_RANGE_M, Sweep, Track, range_colours, write_bag, write_rrd
from lidar.recordings import open_container


def sweeps(count: int = 3, seed: int = 0, start_ns: int = 1_700_000_000_123_456_789, rings: bool = True) -> list[Sweep]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        points = np.concatenate([rng.uniform(-40, 40, (500 + i, 3)), rng.uniform(0, 1, (500 + i, 1))], axis=1)
        pose = np.eye(4)
        pose[:3, :3] = Rotation.from_euler("z", 3.0 * i, degrees=True).as_matrix()
        pose[:3, 3] = [0.9 * i, 0.1 * i, 0.0]
        out.append(Sweep(points.astype(np.float32), start_ns + 100_000_000 * i, pose,
                         rng.integers(0, 32, len(points)) if rings else None))
    return out


def rrd_rows(path) -> dict[str, list]:
    """entity path -> the record batches logged there, in file order."""
    found: dict[str, list] = {}
    for chunk in RrdReader(path).stream().to_chunks():
        found.setdefault(chunk.entity_path, []).append(chunk.to_record_batch())
    return found


def column(batches: list, suffix: str) -> list:
    values = []
    for batch in batches:
        name = next(n for n in batch.schema.names if n.endswith(suffix))
        values += batch.column(name).to_pylist()
    return values


def test_rrd_holds_each_sweep_at_its_time_and_pose(tmp_path):
    observed, generated = sweeps(2, seed=1), sweeps(3, seed=2, start_ns=1_700_000_000_323_456_789)
    boxes = np.array([[5.0, 2.0, 0.8, 4.5, 1.9, 1.6, 0.3]])
    generated[1].boxes, generated[1].box_class = boxes, np.array([2])
    write_rrd(tmp_path / "r.rrd", [Track("observed", observed), Track("generated", generated)])
    rows = rrd_rows(tmp_path / "r.rrd")
    positions = column(rows["/world/generated/lidar/points"], "Points3D:positions")
    assert len(positions) == 3
    for logged, sweep in zip(positions, generated, strict=True):
        np.testing.assert_allclose(np.array(logged), sweep.points[:, :3], atol=1e-5)
    translations = column(rows["/world/observed/lidar"], "Transform3D:translation")
    np.testing.assert_allclose(np.array(translations).reshape(-1, 3), [s.pose[:3, 3] for s in observed])
    times = [t for batch in rows["/world/generated/lidar/points"] for t in batch.column("time").to_pylist()]
    assert [t.value for t in times] == [s.stamp_ns for s in generated]  # ns timestamps, exact
    path = np.array(column(rows["/world/generated/path"], "LineStrips3D:strips")).reshape(-1, 3)
    np.testing.assert_allclose(path, [s.pose[:3, 3] for s in generated])
    centers = column(rows["/world/generated/boxes"], "Boxes3D:centers")
    np.testing.assert_allclose(np.array(centers).reshape(-1, 3), boxes[:, :3])


def test_rrd_colours_by_range_and_intensity():
    points = np.array([[0.0, 0.0, 0.0, 1.0], [COLOUR_RANGE_M, 0.0, 0.0, 0.0]], dtype=np.float32)
    by_range, by_intensity = range_colours(points), range_colours(points, "intensity")
    assert by_range.dtype == np.uint8 and by_range.shape == (2, 3)
    np.testing.assert_array_equal(by_range, by_intensity[::-1])  # the two orders are the turbo ends swapped
    with pytest.raises(InputError, match="colour_by"):
        range_colours(points, "height")


@pytest.mark.parametrize("suffix", [".mcap", ".db3", ".bag"])
def test_bag_round_trips_points_rings_stamps_and_poses(tmp_path, suffix):
    written = sweeps(3)
    path = write_bag(tmp_path / f"out{suffix}", [Track("points", iter(written), topic="/velodyne_points")])
    rec = open_container(path)
    assert rec.topic == "/velodyne_points" and rec.stamps_ns.tolist() == [s.stamp_ns for s in written]
    for i, sweep in enumerate(written):
        np.testing.assert_array_equal(rec[i].points, sweep.points)
        np.testing.assert_array_equal(rec[i].ring, sweep.ring)
    poses = np.stack([s.pose for s in written])
    np.testing.assert_allclose(rec.poses, np.linalg.inv(poses[0]) @ poses, atol=1e-9)


def test_bag_without_poses_or_rings(tmp_path):
    written = sweeps(2, rings=False)
    for sweep in written:
        sweep.pose = None
    rec = open_container(write_bag(tmp_path / "bare.mcap", [Track("points", written)]))
    assert rec.poses is None and rec[0].ring is None
    np.testing.assert_array_equal(rec[1].points, written[1].points)


def test_bag_suffix_is_checked(tmp_path):
    with pytest.raises(InputError, match=r"out.zip: cannot write a bag as .zip; expected .mcap, .db3, .bag"):
        write_bag(tmp_path / "out.zip", [Track("points", sweeps(1))])


def test_generate_writes_views_with_the_world_boxes(tmp_path):
    from inference.__main__ import main

    out = tmp_path / "gen"
    assert main(["generate", "--map-seed", "3", "--frames", "2", "--out", str(out), "--quiet"]) == 0
    rows = rrd_rows(out / "result.rrd")
    assert sum(b.num_rows for b in rows["/world/generated/lidar/points"]) == 2
    assert "/world/generated/boxes" in rows and "/world/observed/lidar/points" not in rows
    made = open_container(out / "result.mcap")
    assert len(made) == 2 and (made.stamps_ns[1] - made.stamps_ns[0]) == 100_000_000
