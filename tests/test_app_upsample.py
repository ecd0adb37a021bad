"""The app's Upsample tab, its callback called in-process as Gradio calls it, on a tiny random release: a real
KITTI sweep made denser keeps every input point bit for bit, fills only the new beams and comes out on the
target's beams x columns; a factor past the server's rays is refused naming the largest that fits; the sweep
is read in the bounded worker, bad input is a message naming the field, a bug is logged, cancelled work
stops. The launched server and the browser are in test_app_server.py."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
from PIL import Image

import app
import lidar.formats
import lidar.formats.io
import lidar.recordings
from lidar.cancel import Cancelled, stop_when
from lidar.formats import read_points, sweep_geometry, write_points
from lidar.range_image import azimuth_columns
from lidar.recordings import open_container
from lidar.sensors import PRESETS
from tests.helpers import (
    HOSTILE_RECORDINGS,
    KITTI_SCAN,
    REAL_SCANS,
    SHIPPED_EXAMPLES,
    SHIPPED_RECORDINGS,
    app_serving,
    needs_real_scans,
    write_tiny_release,
)

EXAMPLES = app.EXAMPLE_SCANS_DIR
PANDASET = REAL_SCANS / "pandaset_bynow76_000000.bin"


@pytest.fixture(scope="module", autouse=True)
def loaded(tmp_path_factory: pytest.TempPathFactory):
    with app_serving(write_tiny_release(tmp_path_factory.mktemp("release") / "tiny")) as served:
        yield served


def upsampled(scan: Path | str | None, factor=2, target=app.BY_FACTOR, method="edge-aware", steps=4, seed=0,
              fmt="pcd") -> tuple[app.UpsampleOutputs, dict[str, bytes]]:
    """The tab's outputs and every file they name, read before the request folder goes."""
    gen = app.upsample_scan(None if scan is None else str(scan), factor, target, method, steps, seed, fmt)
    try:
        out = next(gen)
        files = {Path(p).name: Path(p).read_bytes() for p in (out.viewer, out.bev, out.range, *out.downloads)}
    finally:
        gen.close()
    return out, files


def vertices(ply: bytes) -> int:
    return int(ply.split(b"end_header\n")[0].decode().split("element vertex ")[1].split("\n")[0])


def bits(points: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(points, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def kitti_x2(tmp_path_factory: pytest.TempPathFactory):
    """A shared real KITTI sweep (64 x 2,011) upsampled by 2 (127 x 2,011, within the server's rays)."""
    if not KITTI_SCAN.is_file():
        pytest.skip(f"shared real scans not found at {REAL_SCANS}")
    out, files = upsampled(KITTI_SCAN)
    folder = tmp_path_factory.mktemp("kitti_x2")
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return out, folder


@needs_real_scans
def test_a_kitti_sweep_upsampled_keeps_every_input_point_unchanged_and_first(kitti_x2):
    out, folder = kitti_x2
    given = read_points(KITTI_SCAN).points
    result = read_points(folder / "upsampled.pcd")
    record = json.loads((folder / "upsample.json").read_text())
    assert record["file"] == "upsampled.pcd" and record["input_points"] == len(given) == 124_668
    assert np.array_equal(bits(result.points[: len(given)]), bits(given)), "every input point, bit for bit, in order"
    assert len(result.points) == record["points"] == out.stats["points"] == len(given) + out.stats["filled points"]
    assert out.stats["input points"] == len(given) and out.stats["filled points"] > 100_000
    assert record["request"] == {"input": KITTI_SCAN.name, "factor": 2, "method": "edge-aware"}
    assert record["model"]["source"] == app.SOURCE_LABEL == "tiny", "the model by its label"
    assert "/tmp" not in (folder / "upsample.json").read_text(), "no server path in the download"


@needs_real_scans
def test_the_result_lies_on_the_targets_beams_and_columns_and_fills_only_the_new_beams(kitti_x2):
    out, folder = kitti_x2
    measured = sweep_geometry(read_points(KITTI_SCAN)).sensor
    record = json.loads((folder / "upsample.json").read_text())
    beams, columns = 2 * (measured.height - 1) + 1, measured.width
    assert (beams, columns) == (127, 2012) and out.stats["beams x columns"] == "127 x 2012"
    assert len(record["sensor"]["elevations_deg"]) == beams and record["sensor"]["width"] == columns
    assert out.stats["target sensor"] == "hdl64-measured-x2"
    rings = read_points(folder / "upsampled.pcd").ring
    given, filled = rings[: record["input_points"]], rings[record["input_points"]:]
    assert (given % 2 == 0).all() and given.max() == beams - 1, "each measured beam on its own row of the target"
    assert (filled % 2 == 1).all(), "the fill is on the new beams only"
    assert np.bincount(filled).max() <= columns and len(filled) <= (beams - measured.height) * columns, \
        "at most one filled point per ray of the target"


@needs_real_scans
def test_the_pictures_show_before_and_after_and_the_3d_view_is_thinned_not_the_download(kitti_x2, monkeypatch):
    out, folder = kitti_x2
    bev, ranges = Image.open(folder / "upsample_bev.png"), Image.open(folder / "upsample_range.png")
    assert bev.size == (2 * 500, 500 + 20), "before | after, 100 m square each at 0.2 m"
    assert ranges.size == (2012, 2 * (127 + 20)), "before above after, one row per beam of the target"
    picture = np.asarray(ranges)
    before, after = picture[20:147], picture[167:]
    assert after.any(axis=2).mean() > 1.5 * before.any(axis=2).mean(), "the new beams are lit after, not before"
    assert vertices((folder / "world_viewer.ply").read_bytes()) == out.stats["points in the 3D view"] == out.stats["points"]
    assert sorted(p.name for p in folder.iterdir() if p.name in {Path(d).name for d in out.downloads}) == \
        ["result.mcap", "result.rrd", "upsample.json", "upsampled.pcd"]

    monkeypatch.setattr(app, "VIEWER_MAX_POINTS", 50_000)
    thin, files = upsampled(KITTI_SCAN)
    assert vertices(files["world_viewer.ply"]) == thin.stats["points in the 3D view"] == 50_000
    assert json.loads(files["upsample.json"])["points"] == thin.stats["points"] == out.stats["points"], "the download keeps all"


@needs_real_scans
def test_a_factor_past_the_servers_rays_is_refused_naming_the_largest_that_fits():
    with pytest.raises(gr.Error) as refused:
        upsampled(KITTI_SCAN, factor=4)
    assert refused.value.message == (
        f"Cannot upsample '{KITTI_SCAN.name}': factor 4 puts 253 x 2012 = 509,036 rays on this 64 x 2012 sweep; "
        f"expected at most {app.APP_LIMITS.max_rays:,} rays: at most factor 2 fits it, or the presets "
        f"{', '.join(PRESETS)}")
    assert str(REAL_SCANS) not in str(refused.value)


def test_the_ouster_example_at_factor_1_fills_the_silent_rays_of_its_own_table(tmp_path):
    out, files = upsampled(EXAMPLES / SHIPPED_EXAMPLES[2], factor=1, method="linear", fmt="ply")
    assert out.stats["target sensor"] == "os1-128-measured" and out.stats["beams x columns"] == "128 x 1024"
    ply = tmp_path / "upsampled.ply"
    ply.write_bytes(files["upsampled.ply"])
    result = read_points(ply)
    given = read_points(EXAMPLES / SHIPPED_EXAMPLES[2]).points
    assert np.array_equal(bits(result.points[: len(given)]), bits(given))
    rays = np.unique(result.ring[: len(given)] * 1024 + azimuth_columns(given[:, :2], 1024))
    assert 0 < out.stats["filled points"] <= 128 * 1024 - len(rays), "only the rays the sweep left silent"
    assert "upsampled.ply" in files and json.loads(files["upsample.json"])["method"] == "linear"
    with pytest.raises(gr.Error, match=r"factor 3 puts 382 x 1024 .* at most factor 2 fits it"):
        upsampled(EXAMPLES / SHIPPED_EXAMPLES[2], factor=3)


def test_a_preset_target_takes_its_beams_at_the_sweeps_columns():
    out, files = upsampled(EXAMPLES / SHIPPED_EXAMPLES[1], factor=7, target="hdl64", method="nearest", fmt="npz")
    assert out.stats["target sensor"] == "hdl64" and out.stats["beams x columns"] == "64 x 1094"
    assert json.loads(files["upsample.json"])["request"] == {"input": SHIPPED_EXAMPLES[1], "sensor": "hdl64",
                                                            "method": "nearest"}, "the factor is not the request's"


def test_only_the_models_fill_asks_for_the_rollouts_gpu_part(monkeypatch):
    jobs = []
    roll_out = app.roll_out
    monkeypatch.setattr(app, "roll_out", lambda job, progress: jobs.append(job) or roll_out(job, progress))
    scan = EXAMPLES / SHIPPED_EXAMPLES[1]
    upsampled(scan, method="edge-aware")
    assert jobs == [], "interpolation is CPU work"
    out, files = upsampled(scan, method="model", steps=2, seed=3)
    assert [(job.method, job.kwargs["steps"], job.kwargs["seed"]) for job in jobs] == [("upsample", 2, 3)]
    assert jobs[0].kwargs["sensor"].name == "hdl32-measured-x2", "the target worked out before the GPU part"
    record = json.loads(files["upsample.json"])
    assert record["method"] == "model" and record["request"]["steps"] == 2 and out.stats["method"] == "model"


def test_the_learned_fill_runs_where_the_model_ships_one_and_is_refused_by_name_where_not(monkeypatch):
    from inference.fill_network import FillNetwork, FillNetworkConfig

    scan = EXAMPLES / SHIPPED_EXAMPLES[1]
    with pytest.raises(gr.Error, match="Method 'learned' needs a fill network, and the loaded model ships none"):
        upsampled(scan, method="learned")
    assert upsampled(scan, method="auto")[0].stats["method"] == "edge-aware", "auto, with no network"
    network = FillNetwork(FillNetworkConfig(channels=8)).eval()  # untrained: the edge-aware fill exactly
    monkeypatch.setattr(app.PIPELINE, "fill_network", network)
    learned, files = upsampled(scan, method="learned")
    edge, _ = upsampled(scan, method="edge-aware")
    assert learned.stats["method"] == "learned" and json.loads(files["upsample.json"])["method"] == "learned"
    assert learned.stats["filled points"] == edge.stats["filled points"] > 0
    auto, files = upsampled(scan, method="auto")
    assert auto.stats["method"] == "learned", "a network that does not say its sensors fills every sweep by default"
    assert json.loads(files["upsample.json"])["request"]["method"] == "auto"
    network.sensors = ("hdl64",)  # the release's: trained on KITTI HDL-64E sweeps; this example is an HDL-32E's
    assert upsampled(scan, method="auto")[0].stats["method"] == "edge-aware"
    assert upsampled(scan, target="hdl64", method="auto")[0].stats["method"] == "edge-aware", "the sweep's sensor"
    kitti = EXAMPLES / "kitti_patchworkpp_000000.bin"
    assert upsampled(kitti, method="auto")[0].stats["method"] == "learned"


def test_the_sweep_is_read_in_the_bounded_worker_not_the_server(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("a visitor's sweep was parsed in the server's process")

    for module in (lidar.formats, lidar.formats.io, app):
        monkeypatch.setattr(module, "read_points", refuse)
    out, _ = upsampled(EXAMPLES / SHIPPED_EXAMPLES[1])
    assert out.stats["beams x columns"] == "63 x 1094"


OUSTER_PCAP = REAL_SCANS.parent / "recordings" / "ouster_os1_128_pcap" / "OS-1-128_v2.3.0_1024x10_lb_n3.pcap"


def test_the_shipped_vlp16_capture_is_upsampled_from_its_first_sweep_read_in_the_bounded_worker(tmp_path, monkeypatch):
    capture = EXAMPLES / SHIPPED_RECORDINGS[0]
    assert app.upsample_examples()[0] == capture, "the sparse sensor is the tab's first example"
    first = open_container(capture)[0]
    monkeypatch.setattr(lidar.recordings, "open_container", lambda *_, **__: pytest.fail("read in the server"))
    out, files = upsampled(capture, factor=4)
    (tmp_path / "upsampled.pcd").write_bytes(files["upsampled.pcd"])
    written = read_points(tmp_path / "upsampled.pcd")
    assert out.stats["input points"] == len(first.points) == 18_013
    assert out.stats["beams x columns"] == "61 x 1800", "16 measured beams, three new ones in each gap"
    assert np.array_equal(bits(written.points[: len(first.points)]), bits(first.points))
    assert json.loads(files["upsample.json"])["request"]["input"] == capture.name


@pytest.mark.skipif(not OUSTER_PCAP.is_file(), reason="shared recordings not found")
def test_an_ouster_capture_without_its_metadata_json_is_one_visitor_error(tmp_path):
    lone = tmp_path / OUSTER_PCAP.name  # the json has no place in this one-file tab
    lone.write_bytes(OUSTER_PCAP.read_bytes())
    with pytest.raises(gr.Error, match="no Ouster metadata json") as refused:
        upsampled(lone)
    assert str(tmp_path) not in refused.value.message
    assert "python -m inference upsample --scan FILE --topic T" in refused.value.message, "where the json can go"


@pytest.mark.parametrize(("name", "data", "message"), HOSTILE_RECORDINGS)
def test_a_hostile_recording_upload_is_one_visitor_error(tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(gr.Error, match=message) as refused:
        upsampled(path)
    assert str(tmp_path) not in refused.value.message and len(refused.value.message) < 600


@pytest.mark.parametrize(("args", "message"), [
    (dict(scan=None), "No scan uploaded"),
    (dict(factor=0), "Factor must be a whole number from 1 to 8; got 0"),
    (dict(factor=9), "Factor must be a whole number from 1 to 8; got 9"),
    (dict(factor="two"), "Factor must be a whole number from 1 to 8; got 'two'"),
    (dict(target="hdl999"), "Target beams must be one of 'by factor', 'hdl64'"),
    (dict(method="bicubic"), "Method must be one of 'auto', 'edge-aware', 'learned', 'model', 'linear', 'nearest'; got 'bicubic'"),
    (dict(steps=0), "Sampling steps must be a whole number from 1 to 50"),
    (dict(seed=-1), "Seed must be a whole number from 0 to"),
    (dict(fmt="xyz"), "Download format must be one of 'bin', 'pcd'"),
    (dict(target="x" * 5_000_000), r"Target beams must be one of .*\(5,000,000 characters\)"),
])
def test_bad_input_is_a_message_naming_the_field(args, message):
    args = {"scan": EXAMPLES / SHIPPED_EXAMPLES[1], **args}
    with pytest.raises(gr.Error, match=message) as refused:
        upsampled(**args)
    assert len(refused.value.message) < 600


def test_a_cloud_without_beams_or_outside_its_sensors_frame_is_refused_by_name(tmp_path):
    rng = np.random.default_rng(0)  # directions spread evenly over the field of view: no beams to measure
    elevation, azimuth = np.radians(rng.uniform(-15.0, 5.0, 8000)), rng.uniform(-np.pi, np.pi, 8000)
    cloud = np.stack([np.cos(elevation) * np.cos(azimuth), np.cos(elevation) * np.sin(azimuth), np.sin(elevation)], 1)
    np.save(tmp_path / "spread.npy", (cloud * 15.0).astype(np.float32))
    with pytest.raises(gr.Error, match=r"Cannot upsample 'spread.npy': points \(spread.npy\): no beams") as err:
        upsampled(tmp_path / "spread.npy")
    assert str(tmp_path) not in str(err.value)
    points = read_points(EXAMPLES / SHIPPED_EXAMPLES[1]).points
    ego = tmp_path / "ego.bin"
    write_points(ego, points + np.array([0, 0, 1.8, 0], np.float32))  # the origin 1.8 m under the LiDAR
    with pytest.raises(gr.Error, match=r"'ego.bin' is not in the sensor frame.*Upsampling needs a sweep whose origin"):
        upsampled(ego)


def test_a_bug_is_logged_with_its_traceback_and_reported_without_internals(monkeypatch, caplog):
    def explode(*_, **__):
        raise RuntimeError("segfault at /srv/secret/upsample.c:7")

    monkeypatch.setattr(app.PIPELINE, "upsample", explode)
    with caplog.at_level(logging.ERROR, logger="app"), pytest.raises(gr.Error) as info:
        upsampled(EXAMPLES / SHIPPED_EXAMPLES[1])
    assert "failed on the server (RuntimeError)" in str(info.value) and "/srv/secret" not in str(info.value)
    assert "/srv/secret/upsample.c:7" in caplog.text and "Traceback" in caplog.text


def test_cancelled_work_stops_before_its_files_are_written(monkeypatch, tmp_path):
    stop = threading.Event()
    upsample = app.PIPELINE.upsample

    def then_cancel(*args, **kwargs):
        result = upsample(*args, **kwargs)
        stop.set()  # the visitor cancels while the fill runs
        return result

    written = []
    monkeypatch.setattr(app.PIPELINE, "upsample", then_cancel)
    monkeypatch.setattr(app, "_viewer_file", lambda *args: written.append("viewer"))
    monkeypatch.setattr(app.tempfile, "tempdir", str(tmp_path))
    with stop_when(stop), pytest.raises(Cancelled):
        upsampled(EXAMPLES / SHIPPED_EXAMPLES[1])
    assert stop.is_set() and written == [], "nothing written after the cancel"
    assert list(tmp_path.iterdir()) == [], "no scratch folder left"


def test_the_endpoint_runs_on_the_worker_and_returns_its_outputs_by_component():
    fns = {fn.api_name: fn for fn in app.build_demo().fns.values()}
    event = fns["upsample"]
    assert [type(c).__name__ for c in event.outputs] == ["Model3D", "Image", "Image", "JSON", "File"]
    assert event.concurrency_id == "model" and event.concurrency_limit == app.GENERATION_CONCURRENCY

    async def first():
        outputs = event.fn(str(EXAMPLES / SHIPPED_EXAMPLES[1]), 2, app.BY_FACTOR, "edge-aware", 4, 0, "pcd")
        try:
            return await anext(outputs)
        finally:
            await outputs.aclose()

    outputs = asyncio.run(first())
    assert set(outputs) == set(event.outputs), "every output is set"
    assert Path(outputs[event.outputs[0]]).name == "world_viewer.ply"
