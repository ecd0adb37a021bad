"""The app's forecast tab on recording uploads: a bag (its topic chosen) or a Velodyne pcap forecast within the
upload limits, the .rrd and .mcap among the downloads, and hostile containers refused as one visitor error."""

from __future__ import annotations

import struct
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
import torch
from rerun.chunk import RrdReader

import app
from lidar.export4d import Sweep, Track, write_bag
from lidar.recordings import open_container
from tests.helpers import write_tiny_release

HDL32_PCAP = Path(__file__).resolve().parents[2] / "shared" / "data" / "recordings" / "velodyne_hdl32_pcap" / \
    "hdl32_example.pcap"


@pytest.fixture(scope="module", autouse=True)
def loaded(tmp_path_factory: pytest.TempPathFactory):
    previous, threads = app.PIPELINE, torch.get_num_threads()
    torch.set_num_threads(1)
    yield app.load_model(str(write_tiny_release(tmp_path_factory.mktemp("release") / "tiny")))
    app.PIPELINE = previous
    torch.set_num_threads(threads)


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


@pytest.mark.parametrize(("name", "data", "message"), [
    ("bomb.bag", b"#ROSBAG V2.0\n" + struct.pack("<I", 1 << 20), r"bomb.bag"),
    ("noise.mcap", b"\x89MCAP0\r\n" + b"\xff" * 64, r"noise.mcap: a record claims"),
    ("dns.pcap", struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1) + struct.pack("<IIII", 1, 0, 20, 20)
     + bytes(20), r"dns.pcap: no Velodyne data packets"),
])
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
