"""Recording containers read end to end: bags the tests write with rosbags from real KITTI sweeps (ROS 1
.bag, ROS 2 .db3 and .mcap), the shared Velodyne, Ouster and Argoverse 2 captures, a nuScenes layout the
tests write, `python -m lidar convert` from a pcap to MCAP and back, and forecasts from each container.

Expected values come from outside the code under test: the sweeps and poses put into the bags, the data
README (revolutions, frames), the sensors' data sheets (beam elevations), ouster-sdk 1.0.1's decoding of the
same Ouster capture (point counts, first-column stamps, centroid) and the AV2 feather tables read here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rosbags.rosbag1 import Writer as Writer1
from rosbags.rosbag2 import StoragePlugin
from rosbags.rosbag2 import Writer as Writer2
from rosbags.typesys import Stores, get_types_from_msg, get_typestore
from scipy.spatial.transform import Rotation

from lidar import cli, sandbox
from lidar.errors import InputError
from lidar.formats import azimuth_coverage_deg
from lidar.range_image import beam_rows, point_elevations
from lidar.recordings import is_container, open_container
from lidar.sensors import HDL64
from lidar.sequence import open_recording, read_sequence

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
RECORDINGS = DATA / "recordings"
KITTI = DATA / "real_seq" / "kitti00"
HDL32_PCAP = RECORDINGS / "velodyne_hdl32_pcap" / "hdl32_example.pcap"
VLP16_PCAP = RECORDINGS / "velodyne_vlp16_pcap" / "velodyne_vlp16.pcap"
OUSTER_PCAP = RECORDINGS / "ouster_os1_128_pcap" / "OS-1-128_v2.3.0_1024x10_lb_n3.pcap"
AV2_LOG = RECORDINGS / "argoverse2_sweeps" / "7fab2350-7eaf-3b7e-a39d-6937a4c1bede"
needs_recordings = pytest.mark.skipif(not RECORDINGS.is_dir(), reason=f"shared recordings not found at {RECORDINGS}")
needs_kitti = pytest.mark.skipif(not KITTI.is_dir(), reason=f"shared KITTI sequence not found at {KITTI}")
#: The first sweep's clock (ns): a real-looking epoch stamp, so the ns digits must survive every container.
EPOCH_NS = 1_317_384_506_123_456_789
SWEEPS = 3


# --- bags written here with rosbags, from real KITTI sweeps ------------------------------------------------


@pytest.fixture(scope="module")
def kitti() -> dict:
    """The first sweeps of KITTI 00 with a ring each (the nearest HDL-64E beam; returns outside the beams go)."""
    rec = open_recording(KITTI)
    points = [rec[i].points for i in range(SWEEPS)]
    rows = [beam_rows(p, HDL64) for p in points]
    return {"points": [p[r >= 0] for p, r in zip(points, rows, strict=True)], "rings": [r[r >= 0] for r in rows],
            "poses": rec.poses[:SWEEPS], "stamps": [EPOCH_NS + round(t * 1e9) for t in rec.times[:SWEEPS]]}


def _store(ros1: bool):
    store = get_typestore(Stores.ROS1_NOETIC if ros1 else Stores.ROS2_HUMBLE)
    if ros1:
        store.register(get_types_from_msg("geometry_msgs/TransformStamped[] transforms", "tf2_msgs/msg/TFMessage"))
    return store


def _header(store, stamp: int, frame: str, ros1: bool):
    t = store.types["builtin_interfaces/msg/Time"](sec=stamp // 10**9, nanosec=stamp % 10**9)
    cls = store.types["std_msgs/msg/Header"]
    return cls(seq=0, stamp=t, frame_id=frame) if ros1 else cls(stamp=t, frame_id=frame)


def _cloud(store, points: np.ndarray, ring: np.ndarray, stamp: int, frame: str, ros1: bool):
    """A PointCloud2 as a Velodyne driver sends it: x y z intensity (float32), ring (uint16), 2 bytes padding."""
    table = np.zeros(len(points), dtype=np.dtype({"names": ["x", "y", "z", "intensity", "ring"],
                                                   "formats": ["<f4"] * 4 + ["<u2"], "offsets": [0, 4, 8, 12, 16],
                                                   "itemsize": 20}))
    for k, name in enumerate(("x", "y", "z", "intensity")):
        table[name] = points[:, k]
    table["ring"] = ring
    field = store.types["sensor_msgs/msg/PointField"]
    fields = [field(name=n, offset=o, datatype=7, count=1) for n, o in zip(("x", "y", "z", "intensity"), (0, 4, 8, 12), strict=True)]
    fields.append(field(name="ring", offset=16, datatype=4, count=1))
    return store.types["sensor_msgs/msg/PointCloud2"](
        header=_header(store, stamp, frame, ros1), height=1, width=len(table), fields=fields, is_bigendian=False,
        point_step=20, row_step=20 * len(table), data=table.view(np.uint8), is_dense=True)


def _transform(store, pose: np.ndarray, stamp: int, parent: str, child: str, ros1: bool):
    x, y, z, w = Rotation.from_matrix(pose[:3, :3]).as_quat()
    t = store.types
    return t["geometry_msgs/msg/TransformStamped"](
        header=_header(store, stamp, parent, ros1), child_frame_id=child,
        transform=t["geometry_msgs/msg/Transform"](translation=t["geometry_msgs/msg/Vector3"](x=pose[0, 3], y=pose[1, 3],
                                                                                            z=pose[2, 3]),
                                                   rotation=t["geometry_msgs/msg/Quaternion"](x=x, y=y, z=z, w=w)))


def _odometry(store, pose: np.ndarray, stamp: int, ros1: bool):
    x, y, z, w = Rotation.from_matrix(pose[:3, :3]).as_quat()
    t = store.types
    point = t["geometry_msgs/msg/Point"](x=pose[0, 3], y=pose[1, 3], z=pose[2, 3])
    covariance = np.zeros(36)
    return t["nav_msgs/msg/Odometry"](
        header=_header(store, stamp, "odom", ros1), child_frame_id="base_link",
        pose=t["geometry_msgs/msg/PoseWithCovariance"](pose=t["geometry_msgs/msg/Pose"](
            position=point, orientation=t["geometry_msgs/msg/Quaternion"](x=x, y=y, z=z, w=w)), covariance=covariance),
        twist=t["geometry_msgs/msg/TwistWithCovariance"](twist=t["geometry_msgs/msg/Twist"](
            linear=t["geometry_msgs/msg/Vector3"](x=0.0, y=0.0, z=0.0),
            angular=t["geometry_msgs/msg/Vector3"](x=0.0, y=0.0, z=0.0)), covariance=covariance))


#: base_link -> velodyne as a /tf_static transform in the odometry bags.
BASE_FROM_VELO = np.array([[1.0, 0, 0, 0.8], [0, 1, 0, 0], [0, 0, 1, 1.7], [0, 0, 0, 1]])


def write_bag(path: Path, kitti: dict, poses: str = "tf", extra_cloud_topic: str | None = None) -> Path:
    """A bag of the KITTI sweeps on /points (frame velodyne) with poses on /tf (map -> velodyne) or as
    nav_msgs/Odometry (odom -> base_link, plus a static base_link -> velodyne)."""
    ros1 = path.suffix == ".bag"
    store = _store(ros1)
    serialize = store.serialize_ros1 if ros1 else store.serialize_cdr
    if ros1:
        writer, target = Writer1(path), None
    else:
        plugin = StoragePlugin.MCAP if path.suffix == ".mcap" else StoragePlugin.SQLITE3
        writer, target = Writer2(path.with_suffix(""), version=9, storage_plugin=plugin), path
    with writer:
        clouds = writer.add_connection("/points", "sensor_msgs/msg/PointCloud2", typestore=store)
        extra = extra_cloud_topic and writer.add_connection(extra_cloud_topic, "sensor_msgs/msg/PointCloud2",
                                                            typestore=store)
        tf = writer.add_connection("/tf", "tf2_msgs/msg/TFMessage", typestore=store)
        if poses == "odometry":
            odom = writer.add_connection("/odom", "nav_msgs/msg/Odometry", typestore=store)
            static = writer.add_connection("/tf_static", "tf2_msgs/msg/TFMessage", typestore=store)
            msg = store.types["tf2_msgs/msg/TFMessage"](
                transforms=[_transform(store, BASE_FROM_VELO, kitti["stamps"][0], "base_link", "velodyne", ros1)])
            writer.write(static, kitti["stamps"][0], serialize(msg, "tf2_msgs/msg/TFMessage"))
        for points, ring, pose, stamp in zip(kitti["points"], kitti["rings"], kitti["poses"], kitti["stamps"], strict=True):
            cloud = serialize(_cloud(store, points, ring, stamp, "velodyne", ros1), "sensor_msgs/msg/PointCloud2")
            writer.write(clouds, stamp + 5_000_000, cloud)  # logged 5 ms after the sensor stamped it
            if extra:
                writer.write(extra, stamp, cloud)
            if poses == "tf":
                msg = store.types["tf2_msgs/msg/TFMessage"](
                    transforms=[_transform(store, pose, stamp, "map", "velodyne", ros1)])
                writer.write(tf, stamp, serialize(msg, "tf2_msgs/msg/TFMessage"))
            elif poses == "odometry":
                base = pose @ np.linalg.inv(BASE_FROM_VELO)
                writer.write(odom, stamp, serialize(_odometry(store, base, stamp, ros1), "nav_msgs/msg/Odometry"))
    if target is not None:  # the bare storage file, as a lab hands it over
        next(path.with_suffix("").glob(f"*{path.suffix}")).rename(target)
    return path


def rebased(poses: np.ndarray) -> np.ndarray:
    return np.linalg.inv(poses[0]) @ poses


@needs_kitti
@pytest.mark.parametrize("suffix", [".bag", ".db3", ".mcap"])
def test_bag_keeps_points_rings_stamps_and_tf_poses(tmp_path, kitti, suffix):
    rec = open_recording(write_bag(tmp_path / f"drive{suffix}", kitti))
    assert len(rec) == SWEEPS and rec.topic == "/points"
    assert rec.stamps_ns.tolist() == kitti["stamps"]  # the header stamps, to the ns (not the log times)
    np.testing.assert_allclose(rec.times, (np.array(kitti["stamps"]) - kitti["stamps"][0]) / 1e9)
    np.testing.assert_allclose(rec.poses, rebased(kitti["poses"]), atol=1e-6)
    for i in range(SWEEPS):
        scan = rec[i]
        np.testing.assert_array_equal(scan.points, kitti["points"][i])
        np.testing.assert_array_equal(scan.ring, kitti["rings"][i])


@needs_kitti
@pytest.mark.parametrize("suffix", [".bag", ".mcap"])
def test_bag_poses_from_odometry_and_a_static_transform(tmp_path, kitti, suffix):
    rec = open_recording(write_bag(tmp_path / f"odom{suffix}", kitti, poses="odometry"))
    np.testing.assert_allclose(rec.poses, rebased(kitti["poses"]), atol=1e-6)


@needs_kitti
def test_bag_without_poses_is_registered_and_topics_are_chosen(tmp_path, kitti):
    path = write_bag(tmp_path / "two.mcap", kitti, poses="none", extra_cloud_topic="/points_raw")
    with pytest.raises(InputError, match=r"2 sensor_msgs/msg/PointCloud2 topics \(/points, /points_raw\); choose one"):
        open_recording(path)
    rec = open_recording(path, topic="/points_raw")
    assert rec.poses is None and len(rec) == SWEEPS
    with pytest.raises(InputError, match=r"/tf carries tf2_msgs/msg/TFMessage; expected sensor_msgs/msg/PointCloud2"):
        open_recording(path, topic="/tf")
    with pytest.raises(InputError, match=r"no topic '/lidar'; it holds /points \(sensor_msgs/msg/PointCloud2\)"):
        open_recording(path, topic="/lidar")


# --- the shared captures ------------------------------------------------------------------------------------


def elevation_span(scan) -> tuple[float, float]:
    elev = np.degrees(point_elevations(scan.points))
    return float(np.percentile(elev, 0.1)), float(np.percentile(elev, 99.9))


@needs_recordings
def test_hdl32_pcap_holds_its_five_revolutions():
    rec = open_container(HDL32_PCAP)
    assert rec.kind == "velodyne-pcap" and len(rec) == 5  # the data README: about 5 revolutions in 0.48 s
    assert np.all(np.diff(rec.stamps_ns) > 0.07e9) and np.all(np.diff(rec.stamps_ns) < 0.1e9)
    for i in range(len(rec)):
        scan = rec[i]
        assert azimuth_coverage_deg(scan.points) >= 359
        assert np.unique(scan.ring).tolist() == list(range(32))
        low, high = elevation_span(scan)  # HDL-32E: -30.67 to +10.67 deg
        assert -31.5 < low < -29.5 and 9.5 < high < 11.5
        assert 40_000 < scan.num_points < 48_000 and scan.intensity_scale == 255.0


@needs_recordings
def test_vlp16_pcap_decodes_as_sixteen_beams():
    rec = open_container(VLP16_PCAP)
    assert len(rec) == 1  # about one revolution
    scan = rec[0]
    assert np.unique(scan.ring).size == 16 and azimuth_coverage_deg(scan.points) >= 359
    low, high = elevation_span(scan)  # VLP-16: -15 to +15 deg in 2 deg steps
    assert -15.5 < low < -14.5 and 14.5 < high < 15.5
    assert any("decoded as a VLP-16" in note for note in scan.notes)


@needs_recordings
def test_ouster_pcap_matches_ouster_sdk():
    rec = open_container(OUSTER_PCAP)  # the metadata json beside it is found by its name
    # ouster-sdk 1.0.1 (open_source + XYZLut, returns with range > 0) on the same capture:
    assert rec.stamps_ns.tolist() == [991587364520, 991687315250, 991787323080]
    counts = [rec[i].num_points for i in range(len(rec))]
    assert counts == [107647, 107357, 107532]
    first = rec[0]
    np.testing.assert_allclose(first.points[:, :3].astype(np.float64).mean(axis=0), [0.1415, 1.9064, 0.6001], atol=1e-3)
    assert np.unique(first.ring).size == 128 and first.intensity_scale == 255.0


@needs_recordings
def test_argoverse2_log_in_the_up_lidar_frame_with_city_poses():
    import pyarrow.feather as feather

    rec = open_recording(AV2_LOG)
    lidar = sorted((AV2_LOG / "sensors" / "lidar").glob("*.feather"))
    assert rec.names == [p.name for p in lidar] and rec.stamps_ns.tolist() == [int(p.stem) for p in lidar]
    calib = feather.read_table(AV2_LOG / "calibration" / "egovehicle_SE3_sensor.feather").to_pandas()
    up = calib[calib.sensor_name == "up_lidar"].iloc[0]
    ego_from_up = np.eye(4)
    ego_from_up[:3, :3] = Rotation.from_quat([up.qx, up.qy, up.qz, up.qw]).as_matrix()
    ego_from_up[:3, 3] = [up.tx_m, up.ty_m, up.tz_m]
    city = feather.read_table(AV2_LOG / "city_SE3_egovehicle.feather").to_pandas().set_index("timestamp_ns")
    world = []
    for stamp in rec.stamps_ns:
        row = city.loc[int(stamp)]
        pose = np.eye(4)
        pose[:3, :3] = Rotation.from_quat([row.qx, row.qy, row.qz, row.qw]).as_matrix()
        pose[:3, 3] = [row.tx_m, row.ty_m, row.tz_m]
        world.append(pose @ ego_from_up)
    np.testing.assert_allclose(rec.poses, rebased(np.stack(world)), atol=1e-6)
    table = feather.read_table(lidar[0]).to_pandas()
    scan = rec[0]
    back = scan.points[:, :3].astype(np.float64) @ ego_from_up[:3, :3].T + ego_from_up[:3, 3]
    np.testing.assert_allclose(back, table[["x", "y", "z"]].to_numpy(), atol=1e-4)
    assert scan.ring.tolist() == table.laser_number.tolist() and scan.ring.max() == 63


# --- nuScenes, in a layout written here ---------------------------------------------------------------------


def write_nuscenes(root: Path, kitti: dict, logs: tuple[str, ...] = ("n008-2018-08-01-15-16-36-0400",)) -> dict:
    """samples/ and sweeps/ LIDAR_TOP files (x y z intensity ring as float32) with ego_pose.json,
    sensor.json and calibrated_sensor.json in v1.0-mini/; returns the ego poses and the calibration."""
    ego_from_lidar = np.eye(4)
    ego_from_lidar[:3, :3] = Rotation.from_euler("z", -90, degrees=True).as_matrix()  # nuScenes' LIDAR_TOP faces right
    ego_from_lidar[:3, 3] = [0.943, 0.0, 1.841]
    tables = root / "v1.0-mini"
    tables.mkdir(parents=True)
    poses, stamps = [], []
    for k, log in enumerate(logs):
        for i, (points, ring, pose) in enumerate(zip(kitti["points"], kitti["rings"], kitti["poses"], strict=True)):
            us = 1533151603547590 + 1_000_000 * k + 50_000 * i
            folder = root / ("samples" if i % 2 == 0 else "sweeps") / "LIDAR_TOP"
            folder.mkdir(parents=True, exist_ok=True)
            data = np.concatenate([points, ring[:, None].astype(np.float32)], axis=1).astype("<f4")
            data.tofile(folder / f"{log}__LIDAR_TOP__{us}.pcd.bin")
            poses.append(pose @ np.linalg.inv(ego_from_lidar))
            stamps.append(us)
    rows = [{"token": f"e{i}", "timestamp": us, "translation": p[:3, 3].tolist(),
             "rotation": np.roll(Rotation.from_matrix(p[:3, :3]).as_quat(), 1).tolist()}
            for i, (us, p) in enumerate(zip(stamps, poses, strict=True))]
    (tables / "ego_pose.json").write_text(json.dumps(rows))
    (tables / "sensor.json").write_text(json.dumps([{"token": "s1", "channel": "LIDAR_TOP", "modality": "lidar"},
                                                    {"token": "s2", "channel": "CAM_FRONT", "modality": "camera"}]))
    (tables / "calibrated_sensor.json").write_text(json.dumps([
        {"token": "c1", "sensor_token": "s1", "translation": ego_from_lidar[:3, 3].tolist(),
         "rotation": np.roll(Rotation.from_matrix(ego_from_lidar[:3, :3]).as_quat(), 1).tolist(), "camera_intrinsic": []},
        {"token": "c2", "sensor_token": "s2", "translation": [1.7, 0.0, 1.5], "rotation": [1, 0, 0, 0],
         "camera_intrinsic": [[1266, 0, 816], [0, 1266, 491], [0, 0, 1]]}]))
    return {"ego": np.stack(poses), "ego_from_lidar": ego_from_lidar}


@needs_kitti
def test_nuscenes_sweeps_posed_by_ego_pose_and_calibration(tmp_path, kitti):
    written = write_nuscenes(tmp_path, kitti)
    rec = open_recording(tmp_path)
    assert rec.kind == "nuscenes" and len(rec) == SWEEPS  # samples and sweeps together, in time order
    assert rec.names[0].endswith("__LIDAR_TOP__1533151603547590.pcd.bin")
    np.testing.assert_allclose(rec.times, [0.0, 0.05, 0.1])
    np.testing.assert_allclose(rec.poses, rebased(written["ego"] @ written["ego_from_lidar"]), atol=1e-6)
    np.testing.assert_allclose(rec.poses, rebased(kitti["poses"]), atol=1e-6)
    np.testing.assert_array_equal(rec[1].ring, kitti["rings"][1])


@needs_kitti
def test_nuscenes_root_of_several_logs_needs_one_chosen(tmp_path, kitti):
    write_nuscenes(tmp_path, kitti, logs=("n008-a", "n015-b"))
    with pytest.raises(InputError, match=r"sweeps of 2 logs \(n008-a, n015-b\); choose one"):
        open_recording(tmp_path)
    assert len(open_recording(tmp_path, topic="n015-b")) == SWEEPS


# --- convert: a pcap to MCAP and back -----------------------------------------------------------------------


def run_lidar(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lidar", *argv], cwd=REPO, capture_output=True, text=True, timeout=300)


@needs_recordings
def test_convert_pcap_to_mcap_and_back(tmp_path):
    mcap = tmp_path / "hdl32.mcap"
    done = run_lidar("convert", str(HDL32_PCAP), str(mcap))
    assert done.returncode == 0, done.stderr
    assert "5 sweeps" in done.stdout
    source, copy = open_container(HDL32_PCAP), open_container(mcap)
    assert copy.kind == "mcap" and copy.stamps_ns.tolist() == source.stamps_ns.tolist()
    for i in range(len(source)):
        np.testing.assert_array_equal(copy[i].points, source[i].points)
        np.testing.assert_array_equal(copy[i].ring, source[i].ring)
    back = tmp_path / "again.bag"  # and on, from the MCAP to a ROS 1 bag of its last two sweeps
    done = run_lidar("convert", str(mcap), str(back), "--sweeps=-2:")
    assert done.returncode == 0, done.stderr
    again = open_container(back)
    assert again.stamps_ns.tolist() == source.stamps_ns[-2:].tolist()
    for i in range(2):  # the points and rings of sweeps 3 and 4, after two conversions
        np.testing.assert_array_equal(again[i].points, source[3 + i].points)
        np.testing.assert_array_equal(again[i].ring, source[3 + i].ring)
    info = run_lidar("info", str(back), "--json")
    assert json.loads(info.stdout)["sweeps"] == 2 and json.loads(info.stdout)["first_sweep"]["rings"] == 32


def test_convert_refuses_a_bag_suffix_it_cannot_write(tmp_path):
    done = run_lidar("convert", str(tmp_path / "missing.pcap"), str(tmp_path / "out.mcap"))
    assert done.returncode == 2 and done.stderr.startswith("lidar: error:")


# --- upload-sized sequences -----------------------------------------------------------------------------------


@needs_kitti
def test_read_sequence_caps_a_container_by_its_index(tmp_path, kitti, monkeypatch):
    path = write_bag(tmp_path / "drive.mcap", kitti)
    seq = read_sequence(path)
    assert len(seq.scans) == SWEEPS and seq.poses is not None
    np.testing.assert_allclose(seq.times, (np.array(kitti["stamps"]) - kitti["stamps"][0]) / 1e9)
    monkeypatch.setattr("lidar.sequence.MAX_SWEEPS", 2)
    with pytest.raises(InputError, match=r"3 sweeps on /points; a recording may hold at most 2 here"):
        read_sequence(path)


# --- forecasts from every container, with the shipped model -------------------------------------------------


def forecast(prefix: Path, out: Path, *extra: str) -> None:
    """`python -m inference forecast` on `prefix`, in this process; the container is read in workers."""
    from inference.__main__ import main

    assert main(["forecast", "--prefix", str(prefix), *extra, "--frames", "2", "--out", str(out), "--quiet"]) == 0


def check_views(out: Path, observed: int, frames: int = 2) -> None:
    """result.rrd holds every observed and generated sweep; result.mcap keeps the observed sweeps' points,
    rings and times and the generated frames after them."""
    from rerun.chunk import RrdReader

    rows: dict[str, int] = {}
    for chunk in RrdReader(out / "result.rrd").stream().to_chunks():
        rows[chunk.entity_path] = rows.get(chunk.entity_path, 0) + chunk.num_rows
    assert rows["/world/observed/lidar/points"] == observed and rows["/world/generated/lidar/points"] == frames
    meta = json.loads((out / "poses.json").read_text())
    seen = open_container(out / "result.mcap", topic="/observed/points")
    made = open_container(out / "result.mcap", topic="/generated/points")
    assert len(seen) == observed and len(made) == frames
    np.testing.assert_allclose(made.poses, rebased(np.array([f["pose"] for f in meta["frames"]])), atol=1e-5)
    beams = len(meta["sensor"]["elevations_deg"])
    for frame in made.sweeps(range(frames)):  # each generated point with its ring on the frames' grid
        assert frame.ring is not None and len(frame.ring) == frame.num_points and frame.ring.min() >= 0
        assert frame.ring.max() < beams and len(np.unique(frame.ring)) > beams // 2
    gap = (made.stamps_ns[0] - seen.stamps_ns[-1]) / 1e9
    assert gap == pytest.approx(0.1)


@needs_kitti
@pytest.mark.parametrize("suffix", [".bag", ".db3", ".mcap"])
def test_forecast_from_a_bag(tmp_path, kitti, suffix, monkeypatch):
    path = write_bag(tmp_path / f"recording{suffix}", kitti, extra_cloud_topic="/points_raw")
    readers_only_in_workers(monkeypatch)
    forecast(path, tmp_path / "out", "--topic", "/points")
    check_views(tmp_path / "out", SWEEPS)
    seen = open_container(tmp_path / "out" / "result.mcap", topic="/observed/points")
    for i in range(SWEEPS):
        np.testing.assert_array_equal(seen[i].points, kitti["points"][i])
        np.testing.assert_array_equal(seen[i].ring, kitti["rings"][i])
    np.testing.assert_allclose(seen.times, (np.array(kitti["stamps"]) - kitti["stamps"][0]) / 1e9, atol=1e-9)
    meta = json.loads((tmp_path / "out" / "poses.json").read_text())
    assert meta["request"]["poses"] == "file"  # from /tf, not registered


@needs_kitti
def test_resimulate_from_a_bag_writes_both_tracks_in_its_views(tmp_path, kitti, monkeypatch):
    from rerun.chunk import RrdReader

    from inference.__main__ import main

    path = write_bag(tmp_path / "recording.mcap", kitti, extra_cloud_topic="/points_raw")
    readers_only_in_workers(monkeypatch)
    out = tmp_path / "out"
    assert main(["resimulate", "--scan", str(path), "--topic", "/points", "--shift", "0", "1", "--frames", "2",
                 "--out", str(out), "--quiet"]) == 0
    rows: dict[str, int] = {}
    for chunk in RrdReader(out / "result.rrd").stream().to_chunks():
        rows[chunk.entity_path] = rows.get(chunk.entity_path, 0) + chunk.num_rows
    assert rows["/world/observed/lidar/points"] == SWEEPS and rows["/world/generated/lidar/points"] == 2
    seen = open_container(out / "result.mcap", topic="/observed/points")
    made = open_container(out / "result.mcap", topic="/generated/points")
    np.testing.assert_array_equal(seen[2].points, kitti["points"][2])
    assert len(made) == 2 and made.stamps_ns.tolist() == [seen.stamps_ns[0], seen.stamps_ns[-1]]  # the same span


@needs_kitti
def test_forecast_from_a_nuscenes_root(tmp_path, kitti, monkeypatch):
    write_nuscenes(tmp_path / "nuscenes", kitti)
    readers_only_in_workers(monkeypatch)
    forecast(tmp_path / "nuscenes", tmp_path / "out")
    check_views(tmp_path / "out", SWEEPS)


@needs_recordings
@pytest.mark.parametrize("source", [HDL32_PCAP, VLP16_PCAP, OUSTER_PCAP, AV2_LOG],
                         ids=["hdl32", "vlp16", "ouster", "argoverse2"])
def test_forecast_from_a_shared_capture(tmp_path, source, monkeypatch):
    readers_only_in_workers(monkeypatch)
    forecast(source, tmp_path / "out")
    check_views(tmp_path / "out", len(open_container(source)))


@needs_kitti
def test_forecast_names_a_bags_topics_when_none_is_chosen(tmp_path, kitti, capsys):
    from inference.__main__ import main

    path = write_bag(tmp_path / "two.mcap", kitti, extra_cloud_topic="/points_raw")
    assert main(["forecast", "--prefix", str(path), "--frames", "2", "--out", str(tmp_path / "out"), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "(/points, /points_raw); choose one" in lines[0]


# --- every container through the bounded workers, as the command lines read it ------------------------------


def readers_only_in_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make opening a container in this process fail: what passes read it in a worker."""
    def in_the_caller(*args, **kwargs):
        raise AssertionError("a container was opened in the caller's process, not in a worker")

    monkeypatch.setattr("lidar.recordings.open_container", in_the_caller)


#: Each container as (how it is made, the topic chosen): bags written here (two PointCloud2 topics, one
#: chosen), a nuScenes root written here, and the shared captures.
CONTAINERS = {
    "ros1-bag": ("two.bag", "/points_raw"), "db3": ("two.db3", "/points"), "mcap": ("two.mcap", "/points_raw"),
    "nuscenes": ("nuscenes", None), "hdl32": (HDL32_PCAP, None), "vlp16": (VLP16_PCAP, None),
    "ouster": (OUSTER_PCAP, None), "argoverse2": (AV2_LOG, None),
}


@pytest.fixture(params=list(CONTAINERS))
def container(request, tmp_path, kitti) -> tuple[Path, str | None]:
    made, topic = CONTAINERS[request.param]
    if isinstance(made, Path):
        if not RECORDINGS.is_dir():
            pytest.skip(f"shared recordings not found at {RECORDINGS}")
        return made, topic
    if made == "nuscenes":
        write_nuscenes(tmp_path / made, kitti)
        return tmp_path / made, topic
    return write_bag(tmp_path / made, kitti, extra_cloud_topic="/points_raw"), topic


def assert_same_sweeps(got, expected, indices) -> None:
    for i, scan in zip(indices, got, strict=True):
        np.testing.assert_array_equal(scan.points, expected[i].points)
        np.testing.assert_array_equal(scan.ring, expected[i].ring)


@needs_kitti
def test_each_container_is_read_in_workers_as_in_process_by_info_and_convert(container, tmp_path, monkeypatch,
                                                                             capsys):
    """sandbox.open_recording gives the index open_recording gives here, and decodes the same sweeps (in
    batches of two); `python -m lidar info` and `convert` read it so, and the converted MCAP keeps every
    sweep's points, rings, stamps and poses."""
    source, topic = container
    here = open_recording(source, topic=topic)
    readers_only_in_workers(monkeypatch)
    monkeypatch.setattr(sandbox, "SWEEPS_PER_TASK", 2)
    there = sandbox.open_recording(source, topic=topic)
    assert isinstance(there, sandbox.WorkerContainer)
    assert (there.kind, there.topic, there.names, there.files) == (here.kind, here.topic, here.names, here.files)
    assert there.stamps_ns.tolist() == here.stamps_ns.tolist()
    np.testing.assert_array_equal(there.times, here.times)
    assert (there.poses is None) == (here.poses is None)
    if here.poses is not None:
        np.testing.assert_array_equal(there.poses, here.poses)
    assert_same_sweeps([there[-1]], here, [len(here) - 1])
    chosen = ["--topic", topic] if topic else []
    assert cli.main(["info", str(source), "--json", *chosen]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["sweeps"] == len(here) and info["first_sweep"]["points"] == here[0].num_points
    assert info["first_stamp_ns"] == int(here.stamps_ns[0]) and info["poses"] == (here.poses is not None)
    copy = tmp_path / "copy.mcap"
    assert cli.main(["convert", str(source), str(copy), *chosen]) == 0
    rec = open_container(copy)  # read here, with the container reader the test module holds
    assert rec.stamps_ns.tolist() == here.stamps_ns.tolist() and rec.topic == f"/{(here.topic or 'points').lstrip('/')}"
    assert_same_sweeps(rec.sweeps(range(len(rec))), here, range(len(here)))
    if here.poses is not None:
        np.testing.assert_allclose(rec.poses, here.poses, atol=1e-6)


@needs_kitti
def test_the_command_line_names_a_bags_topics_through_the_worker(tmp_path, kitti, monkeypatch, capsys):
    path = write_bag(tmp_path / "two.mcap", kitti, poses="none", extra_cloud_topic="/points_raw")
    with pytest.raises(InputError) as in_process:
        open_recording(path)
    readers_only_in_workers(monkeypatch)
    with pytest.raises(InputError) as in_worker:
        sandbox.open_recording(path)
    assert str(in_worker.value) == str(in_process.value)
    for argv in (["info", str(path)], ["convert", str(path), str(tmp_path / "out.mcap")],
                 ["info", str(path), "--topic", "/tf"]):
        assert cli.main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lidar: error: ") and "two.mcap" in lines[0]
    assert not (tmp_path / "out.mcap").exists()


# --- paths the file system refuses ------------------------------------------------------------------------------


LONG_NAME = "x" * 300  # a file name may have 255 bytes (ENAMETOOLONG past them)


@pytest.mark.parametrize("name", [f"{LONG_NAME}.bag", f"{LONG_NAME}.bin", f"{LONG_NAME}/drive.mcap"],
                         ids=["container", "sweep", "folder"])
def test_a_path_too_long_is_an_input_error_naming_it(tmp_path, name):
    path = tmp_path / name
    for read in (is_container, open_container, open_recording, read_sequence, sandbox.open_recording):
        with pytest.raises(InputError, match=r"cannot be read \(File name too long\)") as refused:
            read(path)
        message = str(refused.value)  # the path's start and end, around a note of its length
        assert message.startswith(str(path)[:50]) and f"{str(path)[-20:]}: cannot be read" in message
        assert len(message) < 300


def test_the_command_lines_end_a_path_too_long_in_one_error_line(tmp_path):
    path = tmp_path / f"{LONG_NAME}.pcap"
    for argv in (["info", str(path)], ["convert", str(path), str(tmp_path / "out.mcap")]):
        done = run_lidar(*argv)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("lidar: error: ")
        assert "cannot be read (File name too long)" in lines[0]


@needs_recordings
def test_a_container_gone_after_it_was_indexed_is_an_input_error(tmp_path):
    copy = tmp_path / "gone.pcap"
    copy.write_bytes(HDL32_PCAP.read_bytes())
    rec = open_container(copy)
    copy.unlink()
    with pytest.raises(InputError, match=r"gone.pcap: cannot be read \(No such file or directory\)"):
        rec[0]
