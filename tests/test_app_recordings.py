"""The app's scene tabs on recording uploads: a bag (its topic chosen), a Velodyne pcap, an Ouster pcap with its
metadata json, nuScenes .pcd.bin sweeps with their tables (a log chosen) and Argoverse 2 feathers, each read
through the bounded worker within the upload limits; the .rrd and .mcap among the downloads, and hostile
containers refused as one visitor error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
from rerun.chunk import RrdReader

import app
from lidar.export4d import Sweep, Track, write_bag
from lidar.formats import read_points
from lidar.recordings import open_container
from lidar.sequence import open_recording
from tests.helpers import HOSTILE_RECORDINGS, app_serving, write_tiny_release

RECORDINGS = Path(__file__).resolve().parents[2] / "shared" / "data" / "recordings"
HDL32_PCAP = RECORDINGS / "velodyne_hdl32_pcap" / "hdl32_example.pcap"
OUSTER = RECORDINGS / "ouster_os1_128_pcap"
OUSTER_PCAP, OUSTER_JSON = OUSTER / "OS-1-128_v2.3.0_1024x10_lb_n3.pcap", OUSTER / "OS-1-128_v2.3.0_1024x10.json"
AV2_LOG = RECORDINGS / "argoverse2_sweeps" / "7fab2350-7eaf-3b7e-a39d-6937a4c1bede"
#: A real nuScenes LIDAR_TOP sweep (HDL-32E, with its rings), shipped with the app.
NUSCENES_SWEEP = Path(__file__).resolve().parents[1] / "examples" / "scans" / \
    "nuscenes_ff9eff4389a740848f9a56ad749a4ae8_keyframe.pcd"
needs_recordings = pytest.mark.skipif(not OUSTER_PCAP.is_file() or not AV2_LOG.is_dir(),
                                      reason="shared recordings not found")


@pytest.fixture(scope="module", autouse=True)
def loaded(tmp_path_factory: pytest.TempPathFactory):
    with app_serving(write_tiny_release(tmp_path_factory.mktemp("release") / "tiny")) as served:
        yield served


def two_topic_bag(path: Path) -> Path:
    rng = np.random.default_rng(0)
    sweeps = []
    for i in range(2):
        points = np.concatenate([rng.uniform(-30, 30, (3000, 2)), rng.uniform(-1.7, 3, (3000, 1)),
                                 rng.uniform(0, 1, (3000, 1))], axis=1).astype(np.float32)
        pose = np.eye(4)
        pose[0, 3] = 0.5 * i
        sweeps.append(Sweep(points, 1_700_000_000_000_000_000 + 100_000_000 * i, pose, rng.integers(0, 16, 3000)))
    return write_bag(path, [Track("a", list(sweeps), topic="/points"), Track("b", list(sweeps), topic="/points_raw")])


def final_outputs(gen) -> app.Outputs:
    """The last outputs of a callback (its request folder is gone by then: names only)."""
    return list(gen)[-1]


def test_a_bag_upload_forecasts_with_its_topic_and_offers_the_views(tmp_path):
    bag = two_topic_bag(tmp_path / "drive.mcap")
    with pytest.raises(gr.Error, match=r"2 sensor_msgs/msg/PointCloud2 topics \(\S*points, \S*points_raw\); choose one"):
        final_outputs(app.forecast_from_scans([str(bag)], "Straight", 1, 1, 0))
    out = final_outputs(app.forecast_from_scans([str(bag)], "Straight", 2, 1, 0, "/points_raw"))
    names = [Path(p).name for p in out.downloads]
    assert "result.rrd" in names and "result.mcap" in names
    assert out.stats["poses"] == "file"  # the bag's /tf poses, not a registration


@pytest.mark.skipif(not HDL32_PCAP.is_file(), reason="shared recordings not found")
def test_a_velodyne_pcap_upload_forecasts(tmp_path):
    gen = app.forecast_from_scans([str(HDL32_PCAP)], "Straight", 1, 1, 0)
    first = next(gen)
    assert len(first.prefix) == 5 and first.prefix[0][0] == "velodyne_000000"
    gen.close()


def test_a_recording_goes_alone_and_a_topic_is_a_name(tmp_path):
    bag = two_topic_bag(tmp_path / "drive.mcap")
    with pytest.raises(gr.Error, match="one recording"):
        final_outputs(app.forecast_from_scans([str(bag), str(bag)], "Straight", 1, 1, 0))
    with pytest.raises(gr.Error, match="Topic must be a ROS topic name"):
        final_outputs(app.forecast_from_scans([str(bag)], "Straight", 1, 1, 0, "/x" * 200))


@pytest.mark.parametrize(("name", "data", "message"), HOSTILE_RECORDINGS)
def test_hostile_recording_uploads_are_one_visitor_error(tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(gr.Error, match=message):
        final_outputs(app.forecast_from_scans([str(path)], "Straight", 1, 1, 0))


def test_views_of_a_generated_world_are_downloads():
    gen = app.generate_world(3, "urban", "Straight", 2, 1, 0, 1.0)
    out = next(gen)  # the files live until the callback resumes
    rrd = next(Path(p) for p in out.downloads if Path(p).name == "result.rrd")
    paths = {chunk.entity_path for chunk in RrdReader(rrd).stream().to_chunks()}
    assert "/world/generated/lidar/points" in paths and "/world/generated/boxes" not in paths  # boxes: CLI only
    assert len(open_container(rrd.with_name("result.mcap"))) == 2
    gen.close()


def upload_copies(paths: list[Path], into: Path) -> list[str]:
    """Each file as Gradio hands an upload over: a copy in a folder of its own, under its own name."""
    out = []
    for i, path in enumerate(paths):
        (into / str(i)).mkdir(parents=True)
        out.append(str(shutil.copy(path, into / str(i) / path.name)))
    return out


def prefix_of(gen) -> list[list]:
    """The registered prefix a scene callback shows first; the rollout is not run."""
    first = next(gen)
    gen.close()
    return first.prefix


@needs_recordings
def test_an_ouster_pcap_uploaded_with_its_metadata_json_forecasts_on_its_128_beams(tmp_path):
    uploads = upload_copies([OUSTER_PCAP, OUSTER_JSON], tmp_path)
    out = final_outputs(app.forecast_from_scans(uploads, "Straight", 1, 1, 0))
    assert out.stats["inputs"] == ["ouster_000000", "ouster_000001", "ouster_000002"]
    assert out.stats["beams x columns"].startswith("128 x ")
    with pytest.raises(gr.Error, match=r"OS-1-128_v2\.3\.0_1024x10_lb_n3\.pcap: no Velodyne data packets .* no Ouster "
                                       r"metadata json beside it"):
        prefix_of(app.forecast_from_scans(uploads[:1], "Straight", 1, 1, 0))


@needs_recordings
def test_argoverse2_feathers_uploaded_loose_are_one_posed_log(tmp_path):
    files = [*sorted((AV2_LOG / "sensors" / "lidar").glob("*.feather")), AV2_LOG / "city_SE3_egovehicle.feather",
             AV2_LOG / "calibration" / "egovehicle_SE3_sensor.feather"]
    uploads = upload_copies(files, tmp_path)
    prefix = prefix_of(app.forecast_from_scans(uploads, "Straight", 1, 1, 0))
    assert [row[0] for row in prefix] == ["315966265259836000.feather", "315966265360032000.feather"]
    log = open_recording(AV2_LOG)  # the same log read in place: its own poses, not a registration's
    assert prefix[1][1:4] == np.round(log.poses[1][:3, 3], 2).tolist() and prefix[1][5] is None
    with pytest.raises(gr.Error, match=r"no calibration/egovehicle_SE3_sensor\.feather"):
        prefix_of(app.forecast_from_scans(uploads[:3], "Straight", 1, 1, 0))


def write_nuscenes_upload(folder: Path, logs: tuple[str, ...] = ("n008-2018-08-01-15-16-36-0400",)) -> list[Path]:
    """A real nuScenes sweep as two LIDAR_TOP .pcd.bin files per log (x y z intensity ring, 50 ms and 1 m
    apart), with the ego_pose, sensor and calibrated_sensor tables that pose them."""
    scan = read_points(NUSCENES_SWEEP)
    data = np.concatenate([scan.points[:, :3], 255 * scan.points[:, 3:4], scan.ring[:, None]], axis=1).astype("<f4")
    folder.mkdir(parents=True)
    files, rows = [], []
    for k, log in enumerate(logs):
        for i in range(2):
            us = 1533151603547590 + 1_000_000 * k + 50_000 * i
            data.tofile(folder / f"{log}__LIDAR_TOP__{us}.pcd.bin")
            files.append(folder / f"{log}__LIDAR_TOP__{us}.pcd.bin")
            rows.append({"token": f"e{k}{i}", "timestamp": us, "translation": [float(i), 0.0, 0.0],
                         "rotation": [1.0, 0.0, 0.0, 0.0]})
    tables = {"ego_pose.json": rows,
              "sensor.json": [{"token": "s1", "channel": "LIDAR_TOP", "modality": "lidar"}],
              "calibrated_sensor.json": [{"token": "c1", "sensor_token": "s1", "translation": [0.943, 0.0, 1.841],
                                          "rotation": [1.0, 0.0, 0.0, 0.0], "camera_intrinsic": []}]}
    for name, table in tables.items():
        (folder / name).write_text(json.dumps(table))
        files.append(folder / name)
    return files


def test_nuscenes_sweeps_uploaded_with_their_tables_are_posed_and_a_log_is_chosen(tmp_path):
    uploads = upload_copies(write_nuscenes_upload(tmp_path / "one"), tmp_path / "up1")
    prefix = prefix_of(app.forecast_from_scans(uploads, "Straight", 1, 1, 0))
    assert [row[0] for row in prefix] == ["n008-2018-08-01-15-16-36-0400__LIDAR_TOP__1533151603547590.pcd.bin",
                                          "n008-2018-08-01-15-16-36-0400__LIDAR_TOP__1533151603597590.pcd.bin"]
    assert prefix[1][1:4] == [1.0, 0.0, 0.0] and prefix[1][5] is None  # the tables' pose, no registration
    two = upload_copies(write_nuscenes_upload(tmp_path / "two", ("n008-a", "n015-b")), tmp_path / "up2")
    with pytest.raises(gr.Error, match=r"sweeps of 2 logs \(n008-a, n015-b\); choose one"):
        prefix_of(app.forecast_from_scans(two, "Straight", 1, 1, 0))
    chosen = prefix_of(app.resimulate(two, 1.0, 0.0, 0.0, 1, 1, 0, "n015-b"))
    assert [row[0][:6] for row in chosen] == ["n015-b", "n015-b"]


def test_a_json_goes_only_with_a_recording_it_describes(tmp_path):
    sweeps = upload_copies(write_nuscenes_upload(tmp_path / "one"), tmp_path / "up")
    poses = str(shutil.copy(tmp_path / "one" / "ego_pose.json", tmp_path / "poses.json"))
    with pytest.raises(gr.Error, match=r"'poses\.json': a \.json goes with an Ouster \.pcap"):
        prefix_of(app.forecast_from_scans([*sweeps[:2], poses], "Straight", 1, 1, 0))
    renamed = Path(shutil.copy(sweeps[0], tmp_path / "sweep.bin"))
    with pytest.raises(gr.Error, match=r"'sweep\.bin' is not named as a nuScenes sweep"):
        prefix_of(app.forecast_from_scans([str(renamed), *sweeps[1:]], "Straight", 1, 1, 0))
    with pytest.raises(gr.Error, match="Two uploads are named"):
        prefix_of(app.forecast_from_scans([sweeps[0], sweeps[0], *sweeps[2:]], "Straight", 1, 1, 0))
