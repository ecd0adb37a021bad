"""The app's callbacks, called in-process as Gradio calls them, on a tiny randomly initialised release.

What a visitor gets (viewer PLY, animations, per-frame viewer, stats, downloads that read back), and what
a visitor who sends nonsense gets: a `gr.Error` naming the field and what was expected, never a traceback.
The launched server, the browser and the load test live in test_app_server.py and test_app_browser.py.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import io
import itertools
import json
import logging
import re
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace

import gradio as gr
import numpy as np
import pytest
from PIL import Image
from starlette.datastructures import Headers

import app
import app_policy
from inference.limits import APP_LIMITS
from inference.loader import MODEL_ENV
from lidar.cancel import Cancelled, stop_when
from lidar.formats import read_points, write_points
from lidar.recordings import open_container
from lidar.sensors import PRESETS, Sensor
from tests.helpers import (
    APP_SENSOR,
    KITTI_SCAN,
    PROBING_SOURCES,
    PUBLIC_ENDPOINTS,
    REAL_SCANS,
    SHIPPED_EXAMPLES,
    app_serving,
    needs_real_scans,
    write_tiny_release,
)


@pytest.fixture(scope="module")
def tiny_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_release(tmp_path_factory.mktemp("release") / "tiny")


@pytest.fixture(scope="module", autouse=True)
def loaded(tiny_release: Path):
    with app_serving(tiny_release) as served:
        yield served


def first_yield(gen):
    """Run a generation callback up to its outputs; the caller closes it (which removes the scratch dir)."""
    return next(gen)


def first_async(agen):
    """The first output of a callback as Gradio runs it (the worker's async generator), then close it."""

    async def first():
        try:
            return await anext(agen)
        finally:
            await agen.aclose()

    return asyncio.run(first())


# ----------------------------------------------------------------------------------------------------------
# World generation


@pytest.fixture(scope="module")
def world_outputs():
    gen = app.generate_world(3, "urban", "Turn left", 3, 2, 0, 1.0)
    out = first_yield(gen)
    files = {name: Path(p).read_bytes() for name, p in (("ply", out.viewer), ("bev", out.bev_animation),
                                                        ("range", out.range_animation))}
    files.update({Path(p).name: Path(p).read_bytes() for p in out.downloads})
    scratch = Path(out.viewer).parent
    gen.close()
    return out, files, scratch


def test_generate_world_returns_a_viewer_ply_animations_stats_and_downloads(world_outputs):
    out, files, _ = world_outputs
    stats, downloads, frame_pngs = out.stats, out.downloads, out.frame_pngs
    header = files["ply"].split(b"end_header\n")[0].decode()
    assert header.startswith("ply\nformat binary_little_endian 1.0\n")
    assert "property uchar red" in header and "element face" not in header
    n_vertices = int(header.split("element vertex ")[1].split("\n")[0])
    assert n_vertices == stats["world points"] > 0
    for key in ("bev", "range"):
        gif = Image.open(io.BytesIO(files[key]))
        assert gif.format == "GIF" and gif.n_frames == 3
    assert stats["frames"] == 3 and stats["device"] == "cpu"
    assert stats["seconds per frame"] > 0 and 3 * stats["seconds per frame"] <= stats["seconds"] * 1.01
    assert stats["frames/s"] > 0 and stats["points per frame"] > 0
    assert sorted(Path(p).name for p in downloads) == ["frames_kitti.zip", "result.mcap", "result.rrd", "world.las",
                                                         "world.pcd", "world.ply"]
    assert len(frame_pngs) == 3


def test_downloads_read_back_as_the_generated_world(world_outputs, tmp_path):
    out, files, _ = world_outputs
    stats = out.stats
    with zipfile.ZipFile(io.BytesIO(files["frames_kitti.zip"])) as zf:
        names = sorted(zf.namelist())
        frame_names = [f"frame_{i:03d}.bin" for i in range(3)]
        assert names == sorted(f"frames_kitti/{n}" for n in [*frame_names, "poses.json", "world.bin"])
        poses = json.loads(zf.read("frames_kitti/poses.json"))
        frame_points = [np.frombuffer(zf.read(f"frames_kitti/{n}"), np.float32).reshape(-1, 4) for n in frame_names]
        world_bin = np.frombuffer(zf.read("frames_kitti/world.bin"), np.float32).reshape(-1, 4)
    assert [f["file"] for f in poses["frames"]] == frame_names
    assert [f["points"] for f in poses["frames"]] == [len(p) for p in frame_points]
    assert poses["request"] == {"map_seed": 3, "style": "urban", "action": "turn_left", "frames": 3, "steps": 2,
                                "seed": 0, "guidance": 1.0, "sensor": app.MODEL_SENSOR}
    assert len(world_bin) == stats["world points"]
    mats = np.array([f["pose"] for f in poses["frames"]])
    assert mats.shape == (3, 4, 4) and np.allclose(mats[:, 3], [0, 0, 0, 1])
    assert np.linalg.norm(mats[-1, :3, 3] - mats[0, :3, 3]) > 0.1, "the car should have moved"
    assert Sensor.from_dict(poses["sensor"]) == APP_SENSOR
    for pts in frame_points:
        assert len(pts) > 0 and np.isfinite(pts).all() and (pts[:, 3] >= 0).all() and (pts[:, 3] <= 1).all()
    for ext in (".ply", ".pcd", ".las"):
        path = tmp_path / f"world{ext}"
        path.write_bytes(files[f"world{ext}"])
        assert read_points(path).points.shape == (stats["world points"], 4)


def test_the_scratch_dir_is_removed_once_the_outputs_are_handed_over(world_outputs):
    _, _, scratch = world_outputs
    assert scratch.name.startswith("lidarverse-request-")
    assert not scratch.exists()


def test_frame_viewer_spans_the_frames_and_shows_each_one(world_outputs):
    frame_pngs = world_outputs[0].frame_pngs
    slider, bev0, rng0 = app.reset_frame_viewer(frame_pngs)
    assert slider.maximum == 2 and slider.value == 0
    bev2, rng2 = app.show_frame(2, frame_pngs)
    assert bev0.size == bev2.size and rng0.size == rng2.size
    assert rng0.size[0] == APP_SENSOR.width
    assert not np.array_equal(np.asarray(rng0), np.asarray(rng2)), "frames 0 and 2 should differ"
    assert app.show_frame(99, frame_pngs)[1].tobytes() == rng2.tobytes(), "out-of-range index clamps"
    assert app.show_frame(0, None) == (None, None)


def _ply_vertices(path: str | Path) -> int:
    header = Path(path).read_bytes().split(b"end_header\n")[0].decode()
    return int(header.split("element vertex ")[1].split("\n")[0])


def test_an_hdl64_at_2048_columns_generates_at_its_density_and_the_view_alone_is_thinned(monkeypatch, tmp_path):
    """Frames of 100k+ points: the 3D view gets at most its budget, the downloads every point of every frame."""
    monkeypatch.setattr(app, "VIEWER_MAX_POINTS", 50_000)
    gen = app.generate_world(3, "urban", "Straight", 2, 1, 0, 1.0, "hdl64 (64 x 2048)")
    out = first_yield(gen)
    stats = out.stats
    assert stats["frames' sensor"] == "hdl64" and stats["beams x columns"] == "64 x 2048"
    assert Image.open(out.range_animation).size[0] == 2048
    assert _ply_vertices(out.viewer) == stats["points in the 3D view"] == 50_000 < stats["world points"]
    downloads = {Path(p).name: Path(p) for p in out.downloads}
    with zipfile.ZipFile(downloads["frames_kitti.zip"]) as zf:
        poses = json.loads(zf.read("frames_kitti/poses.json"))
        frames = [np.frombuffer(zf.read(f"frames_kitti/{f['file']}"), np.float32).reshape(-1, 4) for f in poses["frames"]]
    assert [len(f) for f in frames] == [f["points"] for f in poses["frames"]]
    assert min(len(f) for f in frames) > 100_000 and np.mean([len(f) for f in frames]) == stats["points per frame"]
    assert Sensor.from_dict(poses["sensor"]).shape == (64, 2048) and poses["request"]["sensor"] == "hdl64 (64 x 2048)"
    assert read_points(downloads["world.ply"]).num_points == stats["world points"]
    bag = open_container(downloads["result.mcap"])
    assert [bag[i].num_points for i in range(len(bag))] == [len(f) for f in frames]
    gen.close()


def test_the_sensor_choices_are_every_preset_within_the_apps_rays_per_frame(monkeypatch):
    assert {grid.name for grid in app.GENERATION_SENSORS.values()} == set(PRESETS)
    assert all(g.height * g.width <= APP_LIMITS.max_rays for g in app.GENERATION_SENSORS.values())
    assert app.GENERATION_SENSORS["hdl64 (64 x 2048)"].elevations_deg == PRESETS["hdl64"].elevations_deg
    stats = first_yield(app.generate_world(3, "urban", "Straight", 1, 1, 0, 1.0, app.MODEL_SENSOR)).stats
    assert stats["beams x columns"] == f"{APP_SENSOR.height} x {APP_SENSOR.width}"
    with pytest.raises(gr.Error, match=re.escape("Sensor must be one of 'model default', 'hdl64 (64 x 1024)'")):
        first_yield(app.generate_world(3, "urban", "Straight", 1, 1, 0, 1.0, "hdl64 (64 x 4096)"))
    # a server allowing fewer rays draws a dense sensor at fewer columns, beams kept
    monkeypatch.setattr(app, "APP_LIMITS", replace(APP_LIMITS, max_rays=64 * 1000))
    stats = first_yield(app.generate_world(3, "urban", "Straight", 1, 1, 0, 1.0, "hdl64 (64 x 2048)")).stats
    assert stats["beams x columns"] == "64 x 1000"


def test_the_same_seed_gives_the_same_world():
    def world_bytes(seed: int) -> bytes:
        gen = app.generate_world(5, "suburban", "Straight", 1, 1, seed, 1.0)
        out = first_yield(gen)
        data = next(Path(p) for p in out.downloads if p.endswith("world.ply")).read_bytes()
        gen.close()
        return data

    assert world_bytes(1) == world_bytes(1)
    assert world_bytes(1) != world_bytes(2)


def test_map_preview_shows_the_map_and_the_planned_path():
    straight = np.asarray(app.preview_map(3, "urban", "Straight", 20, 0))
    left = np.asarray(app.preview_map(3, "urban", "Turn left", 20, 0))
    other_map = np.asarray(app.preview_map(4, "highway", "Straight", 20, 0))
    assert straight.shape == (400, 400, 3) and straight.std() > 0
    path_pixels = (np.abs(straight.astype(int) - app.PATH_COLOUR).sum(axis=-1) == 0).sum()
    assert path_pixels > 100, "the planned drive should be drawn"
    assert not np.array_equal(straight, left) and not np.array_equal(straight, other_map)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"frames": 33}, "Frames must be a whole number from 1 to 32"),
        ({"frames": 0}, "Frames must be a whole number from 1 to 32"),
        ({"frames": 2.5}, "Frames must be a whole number"),
        ({"frames": float("nan")}, "Frames must be a whole number"),
        ({"frames": "many"}, "Frames must be a whole number"),
        ({"steps": 51}, "Sampling steps must be a whole number from 1 to 50"),
        ({"seed": -1}, "Seed must be a whole number"),
        ({"map_seed": None}, "Map seed must be a whole number"),
        ({"guidance": float("inf")}, "Guidance must be a number from 0.0 to 10.0"),
        ({"action": "fly"}, "Action must be one of 'Straight', 'Turn left', 'Turn right'; got 'fly'"),
        ({"style": "moon"}, "Style must be one of 'urban', 'suburban', 'highway'; got 'moon'"),
    ],
)
def test_out_of_range_inputs_are_refused_with_a_clear_message(args, expected):
    call = {"map_seed": 3, "style": "urban", "action": "Straight", "frames": 2, "steps": 2, "seed": 0, "guidance": 1.0}
    call.update(args)
    with pytest.raises(gr.Error, match=re.escape(expected)):
        first_yield(app.generate_world(**call))


def test_progress_is_reported_per_frame_and_step():
    calls: list[tuple[float, str]] = []

    def progress(fraction, desc=None, **_):
        calls.append((fraction, desc))

    gen = app.generate_world(3, "urban", "Straight", 3, 2, 0, 1.0, progress=progress)
    first_yield(gen)
    gen.close()
    descs = [d for _, d in calls]
    assert calls[0][0] == 0.0 and calls[-1][0] == pytest.approx(1.0)
    assert all(b >= a for (a, _), (b, _) in itertools.pairwise(calls)), "progress never goes back"
    assert "Generating: frame 1/3, step 1/2" in descs and "Generating: frame 3/3, step 2/2" in descs


def test_an_unexpected_failure_is_reported_without_internals_and_logged(monkeypatch, caplog):
    def explode(**_):
        raise RuntimeError("CUDA error at /srv/secret/kernel.cu:42")

    monkeypatch.setattr(app.PIPELINE, "generate_world", explode)
    with pytest.raises(gr.Error) as info:
        first_yield(app.generate_world(3, "urban", "Straight", 1, 1, 0, 1.0))
    assert "failed on the server (RuntimeError)" in str(info.value) and "/srv/secret" not in str(info.value)
    assert "CUDA error at /srv/secret/kernel.cu:42" in caplog.text, "the server log keeps the details"


# ----------------------------------------------------------------------------------------------------------
# Forecast from a scan


@needs_real_scans
def test_forecast_continues_a_real_kitti_scan():
    gen = app.forecast_from_scan(str(KITTI_SCAN), app.AUTO_SENSOR, "Straight", 2, 2, 0)
    out = first_yield(gen)
    stats, frame_pngs, bev = out.stats, out.frame_pngs, out.bev_animation
    header = Path(out.viewer).read_bytes().split(b"end_header\n")[0].decode()
    n_vertices = int(header.split("element vertex ")[1].split("\n")[0])
    assert stats["input"] == KITTI_SCAN.name and stats["input points"] == 124_668
    # the viewer shows the observed scan (grey) plus the continued world
    assert n_vertices == min(stats["input points"] + stats["world points"], app.VIEWER_MAX_POINTS)
    assert stats["frames"] == 2 and len(frame_pngs) == 2 and Image.open(bev).n_frames == 2
    assert stats["input sensor"] == "hdl64-measured"  # its own beam table, measured from its rings
    beams, columns = map(int, stats["beams x columns"].split(" x "))  # and the frames come out on it
    assert beams == 64 and 1900 <= columns <= 2100 and Image.open(out.range_animation).size[0] == columns
    gen.close()


@needs_real_scans
def test_an_uploaded_sweeps_sensor_is_measured_once(monkeypatch):
    import inference.pipeline as pipeline_module

    measured = []

    def counted(detect):
        return lambda scan: measured.append(1) or detect(scan)

    monkeypatch.setattr(app, "detect_sensor", counted(app.detect_sensor))
    monkeypatch.setattr(pipeline_module, "detect_sensor", counted(pipeline_module.detect_sensor))
    stats = _forecast(KITTI_SCAN).stats
    assert stats["input sensor"] == "hdl64-measured" and stats["beams x columns"].startswith("64 x ")
    assert len(measured) == 1, f"the sweep's geometry was measured {len(measured)} times"


def _forecast(path: Path | str | None, sensor: str = app.AUTO_SENSOR):
    return first_yield(app.forecast_from_scan(None if path is None else str(path), sensor, "Straight", 2, 2, 0))


def test_a_missing_upload_says_what_to_upload():
    with pytest.raises(gr.Error, match="No scan uploaded"):
        _forecast(None)


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(gr.Error, match=r"'empty.bin' is empty \(0 bytes\)"):
        _forecast(path)


def test_a_garbage_file_is_refused_with_the_reader_message(tmp_path):
    path = tmp_path / "garbage.pcd"
    path.write_bytes(b"this is not a point cloud\n" * 10)
    with pytest.raises(gr.Error, match=r"garbage\.pcd"):
        _forecast(path)


def test_nan_points_are_refused(tmp_path):
    path = tmp_path / "nan.npy"
    np.save(path, np.full((500, 4), np.nan, dtype=np.float32))
    with pytest.raises(gr.Error, match="no finite points"):
        _forecast(path)


def test_an_unsupported_extension_is_refused(tmp_path):
    path = tmp_path / "scan.txt"
    path.write_text("1 2 3 4\n")
    with pytest.raises(gr.Error, match=r"unsupported extension; expected one of \.bin, \.pcd"):
        _forecast(path)


def test_an_upload_over_the_size_limit_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.bin"
    with path.open("wb") as f:
        f.truncate(app.MAX_UPLOAD_MB * 1024 * 1024 + 16)
    with pytest.raises(gr.Error, match="uploads are limited to 50 MB"):
        _forecast(path)


def test_an_upload_over_the_app_point_limit_is_refused_from_its_header(tmp_path):
    path = tmp_path / "dense.npy"
    np.save(path, np.zeros((app.MAX_UPLOAD_POINTS + 1, 4), np.float32))
    with pytest.raises(gr.Error, match=r"dense\.npy: 1,000,001 points is over the 1,000,000-point limit"):
        _forecast(path)


def test_an_unknown_sensor_name_is_refused(tmp_path):
    path = tmp_path / "scan.bin"
    write_points(path, np.zeros((10, 4), np.float32) + 5)
    with pytest.raises(gr.Error, match="Sensor must be one of 'auto-detect'"):
        _forecast(path, sensor="hdl-1000")


def test_a_beam_table_no_preset_describes_is_measured_and_a_cloud_without_beams_asks_for_a_sensor(tmp_path):
    # a 20-beam sensor (+5 to -15 deg) that no preset describes, seen from inside a 15 m cylinder
    odd = Sensor.from_angles("odd20", np.linspace(5.0, -15.0, 20), width=360)
    dirs = odd.ray_directions().reshape(-1, 3)
    ranges = 15.0 / np.hypot(dirs[:, 0], dirs[:, 1])
    pts = np.concatenate([dirs * ranges[:, None], np.full((len(dirs), 1), 0.5)], axis=1).astype(np.float32)
    path = tmp_path / "odd20.npy"
    np.save(path, pts)
    stats = _forecast(path).stats
    assert stats["frames"] == 2 and stats["input sensor"].endswith("-measured")
    assert stats["beams x columns"] == "20 x 360"  # its own beams and columns
    stats = _forecast(path, sensor="vlp16").stats
    assert stats["input sensor"] == "vlp16" and stats["frames"] == 2
    # directions spread evenly over the field of view: no beams to measure, no preset that fits
    rng = np.random.default_rng(0)
    elevation, azimuth = np.radians(rng.uniform(-15.0, 5.0, 8000)), rng.uniform(-np.pi, np.pi, 8000)
    cloud = np.stack([np.cos(elevation) * np.cos(azimuth), np.cos(elevation) * np.sin(azimuth), np.sin(elevation)], 1)
    cloud = np.concatenate([cloud * 15.0, np.full((len(cloud), 1), 0.5)], axis=1).astype(np.float32)
    np.save(tmp_path / "spread.npy", cloud)
    with pytest.raises(gr.Error, match=re.escape("Could not tell which sensor recorded 'spread.npy'; choose it under 'Sensor'")):
        _forecast(tmp_path / "spread.npy")


# ----------------------------------------------------------------------------------------------------------
# A visitor's input in messages and in the server log

#: What a visitor may send as a text value over the API (a choice, a file name, a header).
HUGE = "x" * 5_000_000
#: Longest message or log line a 5 MB value may turn into: the quoted start and a note of its length.
SHORT = 600


def test_a_5_mb_action_string_is_neither_echoed_nor_logged_at_length(tmp_path, caplog):
    scan = tmp_path / "scan.bin"
    write_points(scan, np.zeros((10, 4), np.float32) + 5)
    calls = {
        "generate": lambda: first_yield(app.generate_world(3, "urban", HUGE, 1, 1, 0, 1.0)),
        "map preview": lambda: app.preview_map(3, "urban", HUGE, 1, 0),
        "forecast": lambda: first_yield(app.forecast_from_scan(str(scan), app.AUTO_SENSOR, HUGE, 1, 1, 0)),
        "sweeps": lambda: first_yield(app.forecast_from_scans([str(scan), str(scan)], HUGE, 1, 1, 0)),
        "sensor": lambda: first_yield(app.forecast_from_scan(str(scan), HUGE, "Straight", 1, 1, 0)),
        "style": lambda: first_yield(app.generate_world(3, HUGE, "Straight", 1, 1, 0, 1.0)),
    }
    with caplog.at_level(logging.DEBUG):
        for what, call in calls.items():
            with pytest.raises(gr.Error) as info:
                call()
            message = str(info.value)
            assert len(message) < SHORT and "5,000,000 characters" in message, (what, message[:200])
    assert max((len(r.getMessage()) for r in caplog.records), default=0) < SHORT


def test_what_the_server_logs_of_a_client_is_capped(caplog):
    """A refusal is logged with the client's address and the path it asked for, both the visitor's to
    write (the address behind a proxy is the X-Forwarded-For entry the proxy appended as it came)."""
    limits = _limits([], proxy_hops=1)
    with caplog.at_level(logging.WARNING, logger="app"):
        status, body = asyncio.run(_through(limits, f"/gradio_api/call/{HUGE[:100_000]}", "10.0.0.1",
                                            {"X-Forwarded-For": HUGE[:100_000]}))
    assert status == 404 and len(body["detail"]) < SHORT
    assert "refused" in caplog.text and max(len(r.getMessage()) for r in caplog.records) < SHORT


# ----------------------------------------------------------------------------------------------------------
# Model tab


def test_model_info_names_the_source_by_its_label_and_shows_no_server_path(tiny_release):
    info = app.model_info()
    assert info["source"] == "tiny" and info["resolved_path"] == "model.safetensors"
    assert info["iteration"] == 7 and info["weights"] == "ema"
    assert info["parameters"] == sum(p.numel() for p in app.PIPELINE.model.parameters())
    assert info["device"] == "cpu"
    text = json.dumps(info)  # what /model_info returns must be plain JSON
    assert str(tiny_release.parent) not in text and "/tmp" not in text


def test_public_text_cuts_server_paths_but_keeps_hub_ids_and_urls():
    text = f"folder /root holds ['.bashrc'] and {app_policy.APP_DIR}/weights/default; see org/name and https://hf.co/a/b"
    assert app.public_text(text) == (
        "folder root holds ['.bashrc'] and weights/default; see org/name and https://hf.co/a/b"
    )


def api_endpoints(demo: gr.Blocks) -> set[str]:
    """What a client can call: named endpoints (unnamed ones must not exist at all)."""
    api = demo.get_api_info()
    assert api["unnamed_endpoints"] == {}
    return set(api["named_endpoints"])


def test_by_default_the_model_cannot_be_switched(monkeypatch):
    monkeypatch.setattr(app, "SWITCH", None)
    assert api_endpoints(app.build_demo()) == PUBLIC_ENDPOINTS
    with pytest.raises(gr.Error, match="Model switching is off on this server"):
        app.reload_model("weights/default")


def test_every_steps_slider_starts_at_the_served_models_default_within_the_servers_limit(monkeypatch):
    served = app.PIPELINE
    for default, shown in ((3, 3), (app.MAX_STEPS + 7, app.MAX_STEPS)):
        monkeypatch.setattr(app, "PIPELINE", SimpleNamespace(config=replace(served.config, default_steps=default), sensor=served.sensor,
                                                           fill_network=None))
        sliders = [block for block in app.build_demo().blocks.values()
                   if isinstance(block, gr.Slider) and block.label == "Sampling steps"]
        assert len(sliders) == 4 and {slider.value for slider in sliders} == {shown}  # 3 rollout tabs, upsample


@pytest.fixture
def switch(monkeypatch, tmp_path, tiny_release) -> Iterator[app.ModelSwitch]:
    """Switching on among the tiny release and another one; the tiny one is served again afterwards."""
    other = write_tiny_release(tmp_path / "other", seed=1)
    allowed = app.ModelSwitch.of([str(tiny_release), str(other)])
    monkeypatch.setattr(app, "SWITCH", allowed)
    yield allowed
    app.load_model(str(tiny_release))


def test_with_switching_on_only_the_offered_sources_load(switch, tmp_path):
    assert list(switch.sources) == ["tiny", "other"]  # labels: no server paths in the dropdown
    assert api_endpoints(app.build_demo()) == PUBLIC_ENDPOINTS | {"/reload_model"}
    info, status = app.reload_model("other")
    assert info["source"] == "other" and "Loaded **other**" in status
    for probe in (*PROBING_SOURCES, str(tmp_path)):
        with pytest.raises(gr.Error) as refused:
            app.reload_model(probe)
        message = str(refused.value)
        assert "is not a model this server offers; choose one of: tiny, other" in message
        assert ".bashrc" not in message and "passwd" not in message and str(tmp_path) not in message
    assert app.model_info()["source"] == "other", "a refused source keeps the served model"


def test_a_source_that_fails_to_load_tells_the_visitor_nothing_of_the_server(switch, tmp_path, caplog):
    secret = tmp_path / "not-a-model"
    secret.mkdir()
    (secret / "secret.txt").write_text("x")
    allow_any = app.ModelSwitch.of(list(switch.sources.values()), allow_any=True)
    app.SWITCH = allow_any  # the fixture's monkeypatch restores it
    with pytest.raises(gr.Error) as failed:
        app.reload_model(str(secret))
    assert failed.value.message == "Could not load 'not-a-model'; the details are in the server log."
    assert "secret.txt" in caplog.text and str(secret) in caplog.text, "the server log keeps the details"
    assert app.model_info()["source"] == "tiny"


def test_sources_are_offered_once_each_with_distinct_labels(tmp_path, monkeypatch):
    monkeypatch.chdir(app_policy.APP_DIR)
    same = [str(app_policy.APP_DIR / "weights" / "default"), "weights/default"]  # the default, and --model weights/default
    switch = app.ModelSwitch.of([*same, str(tmp_path / "a" / "release"), str(tmp_path / "b" / "release"), "org/name"])
    assert list(switch.sources) == ["weights/default", "release", "release (2)", "org/name"]
    assert switch.source_for("release (2)") == str(tmp_path / "b" / "release")


def test_the_switch_policy_is_none_an_allow_list_or_any_source(monkeypatch, tiny_release):
    monkeypatch.delenv(MODEL_ENV, raising=False)
    assert app_policy.switch_policy(str(tiny_release), ["org/name"], False, False) is None
    listed = app_policy.switch_policy(str(tiny_release), ["org/name"], True, False)
    assert list(listed.sources) == ["weights/default", "tiny", "org/name"] and not listed.allow_any
    with pytest.raises(app_policy.SourceNotOffered, match="'org/other' is not a model this server offers"):
        listed.source_for("org/other")
    anything = app_policy.switch_policy(None, [], False, True)  # --allow-any-source alone implies switching
    assert list(anything.sources) == ["weights/default"] and anything.source_for("org/other") == "org/other"
    assert anything.source_for("weights/default") == str(app_policy.APP_DIR / "weights" / "default")


def test_allow_source_without_the_switch_is_refused_and_the_env_var_turns_it_on(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv(app.SWITCH_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        app.main(["--allow-source", "org/name", "--port", "1"])
    assert exit_info.value.code == 2 and "--allow-source needs --allow-model-switch" in capsys.readouterr().err
    monkeypatch.setenv(app.SWITCH_ENV, "1")  # past the flag check: fails later, loading the model
    with pytest.raises(SystemExit):
        app.main(["--allow-source", "org/name", "--model", str(tmp_path / "absent"), "--port", "1"])
    assert "cannot load the model" in capsys.readouterr().err


@pytest.fixture
def fresh_clone(monkeypatch, tmp_path) -> Iterator[None]:
    """The app as a fresh clone sees it: no shared real scans anywhere."""
    empty = tmp_path / "no_real_scans"
    empty.mkdir()
    monkeypatch.setattr(app, "REAL_SCANS_DIR", empty)
    app.example_scans.cache_clear()
    yield
    app.example_scans.cache_clear()


def test_a_fresh_clone_offers_the_shipped_examples_and_each_one_forecasts(fresh_clone):
    examples = app.example_scans()
    assert tuple(p.name for p in examples) == SHIPPED_EXAMPLES
    assert sum(p.stat().st_size for p in examples) < 8_000_000
    for path in examples:
        gen = app.forecast_from_scan(str(path), app.AUTO_SENSOR, "Straight", 1, 1, 0)
        stats = first_yield(gen).stats
        gen.close()
        assert stats["frames"] == 1 and stats["input sensor"].removesuffix("-measured") in ("hdl64", "hdl32", "os1-128"), path.name


@needs_real_scans
def test_every_real_scan_offered_as_an_example_can_be_forecast():
    examples = app.example_scans()
    names = [p.name for p in examples]
    assert KITTI_SCAN.name in names and len(names) == len(set(names))
    assert not any(name.startswith("pandaset") for name in names)
    for path in examples:
        gen = app.forecast_from_scan(str(path), app.AUTO_SENSOR, "Turn right", 1, 1, 0)
        stats = first_yield(gen).stats
        gen.close()
        assert stats["frames"] == 1 and stats["input sensor"], path.name


@needs_real_scans
def test_a_scan_outside_its_sensor_frame_is_refused_with_the_reason():
    with pytest.raises(gr.Error, match=r"pandaset_bynow76_000000\.bin.*sensor frame"):
        _forecast(REAL_SCANS / "pandaset_bynow76_000000.bin")


@needs_real_scans
def test_a_sensor_that_cannot_have_recorded_the_scan_is_refused():
    # KITTI's HDL-64E looks down to -24.9 deg; a VLP-16 sees only +-15 deg
    with pytest.raises(gr.Error, match=r"kitti_patchworkpp_000000\.bin: .* outside the beams of sensor 'vlp16'"):
        _forecast(KITTI_SCAN, sensor="vlp16")


# ----------------------------------------------------------------------------------------------------------
# Launch: ZeroGPU and the command line


class FakeSpaces:
    """Stands in for the `spaces` package, which only exists on a ZeroGPU Space: records what it wraps, how
    often a GPU was asked for, and whether one is held now."""

    def __init__(self) -> None:
        self.wrapped: list[str] = []
        self.calls = 0
        self.holding = False

    def GPU(self, duration: int):  # the real decorator's name
        assert duration > 0

        def decorate(fn):
            self.wrapped.append(fn.__name__)

            @functools.wraps(fn)
            def on_gpu(*args, **kwargs):
                self.calls += 1
                self.holding = True
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.holding = False

            return on_gpu

        return decorate


@pytest.fixture
def on_zerogpu(monkeypatch) -> tuple[ModuleType, FakeSpaces]:
    """app.py imported afresh as a ZeroGPU Space imports it (`spaces` importable), serving the tiny model."""
    fake = FakeSpaces()
    monkeypatch.setitem(sys.modules, "spaces", fake)
    spec = importlib.util.spec_from_file_location("app_on_zerogpu", app.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    module.PIPELINE = app.PIPELINE
    return module, fake


def _spy(monkeypatch, module: ModuleType, name: str, seen: list[tuple[str, bool]], fake: FakeSpaces) -> None:
    """Record each call of `module.name` and whether a GPU was held during it."""
    original = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append((name, fake.holding))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


def test_on_zerogpu_only_the_rollout_holds_the_gpu(on_zerogpu, monkeypatch):
    zero, fake = on_zerogpu
    assert fake.wrapped == ["roll_out"], "one function asks for the GPU, wrapped once at import"
    with pytest.raises(gr.Error, match="Frames must be"):
        first_yield(zero.generate_world(3, "urban", "Straight", 99, 1, 0, 1.0))
    assert fake.calls == 0, "a bad input is refused before a GPU is asked for"

    seen: list[tuple[str, bool]] = []
    for name in ("_read_scan", "_observed_scene", "_present", "roll_out"):
        _spy(monkeypatch, zero, name, seen, fake)
    scan = str(app.EXAMPLE_SCANS_DIR / SHIPPED_EXAMPLES[0])
    for gen in (zero.forecast_from_scan(scan, app.AUTO_SENSOR, "Straight", 1, 1, 0),
                zero.forecast_from_scans([scan], "Straight", 1, 1, 0)):
        outputs = list(gen)
        assert outputs[-1].stats["frames"] == 1
    assert seen == [("_read_scan", False), ("roll_out", False), ("_present", False),
                    ("_observed_scene", False), ("roll_out", False), ("_present", False)]
    assert fake.calls == 2, "reading, registering and writing the results ran without a GPU"

    stop = threading.Event()
    stop.set()
    job = zero.RolloutJob("generate_world", {"map": 3, "frames": 1, "steps": 1}, "Generating")
    with stop_when(stop), pytest.raises(Cancelled):
        zero._generate(job, lambda *_, **__: None, "Cannot generate this world")
    assert fake.calls == 2, "a request cancelled while it was prepared never asks for a GPU"


def test_on_zerogpu_the_endpoints_run_on_the_worker_and_return_outputs_by_component(on_zerogpu):
    zero, fake = on_zerogpu
    fns = {block_fn.api_name: block_fn for block_fn in zero.demo.fns.values()}
    world = fns["generate_world"]
    assert inspect.unwrap(world.fn) is zero.generate_world and fns["model_info"].fn is zero.model_info
    assert world.concurrency_limit == app.GENERATION_CONCURRENCY
    outputs = first_async(world.fn(3, "urban", "Straight", 1, 1, 0, 1.0))
    assert Path(outputs[world.outputs[0]]).name == "world_viewer.ply" and fake.calls == 1
    assert set(outputs) == set(world.outputs), "every output of a finished rollout is set"


def test_without_zerogpu_the_rollout_runs_as_it_is(monkeypatch):
    assert app.spaces is None and not hasattr(app.roll_out, "__wrapped__")
    fns = {block_fn.api_name: block_fn for block_fn in app.build_demo().fns.values()}
    for name in ("generate_world", "forecast_from_scan", "forecast_from_scans", "resimulate"):
        assert inspect.unwrap(fns[name].fn) is getattr(app, name)


def test_the_api_outputs_follow_the_named_outputs_and_the_prefix_comes_first():
    fns = {block_fn.api_name: block_fn for block_fn in app.build_demo().fns.values()}
    kinds = ["Model3D", "Image", "Image", "JSON", "File", "State"]
    assert [type(c).__name__ for c in fns["generate_world"].outputs] == kinds
    for name in ("forecast_from_scans", "resimulate"):
        assert [type(c).__name__ for c in fns[name].outputs] == [*kinds, "Dataframe"]
    scan = str(app.EXAMPLE_SCANS_DIR / SHIPPED_EXAMPLES[0])
    gen = app.forecast_from_scans([scan], "Straight", 1, 1, 0)
    first = next(gen)
    assert first.prefix[0][0] == SHIPPED_EXAMPLES[0] and first.stats is None and first.viewer is None
    assert next(gen).prefix == first.prefix
    gen.close()


def test_a_bad_model_source_on_the_command_line_exits_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        app.main(["--model", str(tmp_path / "no-such-model"), "--port", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("app.py: error: cannot load the model:") and "no-such-model" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("argv", "expected"), [
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--port", "http"], "argument --port: invalid int value: 'http'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_an_argument_error_is_one_error_line_and_exit_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        app.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("app.py: error: ") and expected in err


def test_the_dtype_reaches_the_loader_and_a_bad_one_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setattr(app, "DTYPE", None)  # restored after the test, whatever main sets
    with pytest.raises(SystemExit) as exit_info:
        app.main(["--dtype", "int8", "--port", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("app.py: error: cannot load the model:") and "unsupported dtype 'int8'" in err


def test_a_bug_while_loading_is_raised_as_it_is_not_called_bad_input(monkeypatch):
    def broken(*_, **__):
        raise RuntimeError("a bug in the loader")

    monkeypatch.setattr(app, "load_pipeline", broken)
    with pytest.raises(RuntimeError, match="a bug in the loader"):  # python app.py: traceback, exit 1
        app.main(["--port", "1"])


# ----------------------------------------------------------------------------------------------------------
# The worker: cancelled work stops at its next step, one generation at a time, errors are typed


def _count_sampler_steps() -> tuple[list[float], object]:
    """A progress tracker that records each update the rollout makes (one per sampler step)."""
    calls: list[float] = []

    def progress(fraction, desc=None, **_):
        calls.append(fraction)

    return calls, progress


async def _wait_until(condition, timeout: float = 10.0) -> float:
    start = time.perf_counter()
    while not condition():
        assert time.perf_counter() - start < timeout, "timed out"
        await asyncio.sleep(0.01)
    return time.perf_counter() - start


def test_a_cancelled_generation_stops_at_its_next_sampler_step_and_frees_the_worker():
    calls, progress = _count_sampler_steps()

    async def scenario() -> tuple[int, int, float]:
        run = app._worker(app.generate_world)(3, "urban", "Straight", 32, 50, 0, 10.0, progress=progress)
        task = asyncio.ensure_future(anext(run))
        await _wait_until(lambda: len(calls) >= 5)
        task.cancel()  # what Gradio does for /cancel
        with pytest.raises(asyncio.CancelledError):
            await task
        at_cancel = len(calls)
        freed = await _wait_until(lambda: not app._GENERATION.locked())
        await asyncio.sleep(0.3)
        return at_cancel, len(calls), freed

    at_cancel, total, freed = asyncio.run(scenario())
    assert total - at_cancel <= 1, "the rollout went on after its request was cancelled"
    assert total < 100 and freed < 2.0, (total, freed)  # of 1,600 sampler steps


def test_a_generation_whose_client_left_stops_and_says_so(monkeypatch):
    calls, progress = _count_sampler_steps()
    monkeypatch.setattr(app, "_client_gone", lambda: lambda: len(calls) >= 5)

    async def scenario() -> None:
        with pytest.raises(gr.Error, match="The request was cancelled"):
            await anext(app._worker(app.generate_world)(3, "urban", "Straight", 32, 50, 0, 10.0, progress=progress))
        await _wait_until(lambda: not app._GENERATION.locked())

    asyncio.run(scenario())
    assert len(calls) < 100


def test_a_client_that_leaves_while_its_results_are_written_stops_them_there(monkeypatch):
    """The last part of a request (pictures, animations, downloads) checks between frames and files too."""
    pictures: list[int] = []
    scratch: list[Path] = []
    bev_image, viewer_file = app.render.bev_image, app._viewer_file

    def slow_picture(*args, **kwargs):
        pictures.append(1)
        time.sleep(0.3)  # longer than the worker's poll for a client that left
        return bev_image(*args, **kwargs)

    def viewer(out, *args):
        scratch.append(out)
        return viewer_file(out, *args)

    monkeypatch.setattr(app.render, "bev_image", slow_picture)
    monkeypatch.setattr(app, "_viewer_file", viewer)
    monkeypatch.setattr(app, "_client_gone", lambda: lambda: len(pictures) >= 1)

    async def scenario() -> None:
        with pytest.raises(gr.Error, match="The request was cancelled"):
            await anext(app._worker(app.generate_world)(3, "urban", "Straight", 8, 1, 0, 1.0))
        await _wait_until(lambda: not app._GENERATION.locked())

    asyncio.run(scenario())
    assert 1 <= len(pictures) <= 3, "writing went on after the client left"
    assert scratch and not scratch[0].exists(), "the request's scratch folder is removed"


def test_one_generation_runs_at_a_time_even_when_a_cancelled_one_is_still_stopping(monkeypatch):
    """Gradio frees its slot as soon as a request is cancelled; the worker's lock must hold until the
    cancelled rollout has actually stopped, so the next one never runs beside it."""
    active, most = [0], [0]
    original = app.PIPELINE.generate_world

    def counted(**kwargs):
        active[0] += 1
        most[0] = max(most[0], active[0])
        try:
            return original(**kwargs)
        finally:
            active[0] -= 1

    monkeypatch.setattr(app.PIPELINE, "generate_world", counted)
    calls, progress = _count_sampler_steps()

    async def scenario() -> tuple:
        slow = asyncio.ensure_future(anext(app._worker(app.generate_world)(3, "urban", "Straight", 32, 50, 0, 10.0,
                                                                           progress=progress)))
        await _wait_until(lambda: len(calls) >= 3)
        slow.cancel()
        quick = app._worker(app.generate_world)(3, "urban", "Straight", 1, 1, 0, 1.0)
        outputs = await anext(quick)
        await quick.aclose()
        return outputs

    outputs = asyncio.run(scenario())
    assert outputs.stats["frames"] == 1 and most[0] == 1


def test_a_value_error_that_is_not_an_input_error_is_an_internal_error(monkeypatch, caplog):
    def singular(**_):
        raise np.linalg.LinAlgError("Singular matrix")

    monkeypatch.setattr(app.PIPELINE, "generate_world", singular)
    with pytest.raises(gr.Error) as info:
        first_yield(app.generate_world(3, "urban", "Straight", 1, 1, 0, 1.0))
    assert "failed on the server (LinAlgError)" in str(info.value) and "Singular" not in str(info.value)
    assert "Singular matrix" in caplog.text


def test_the_downloaded_poses_json_names_the_model_by_its_label_not_its_path(world_outputs, tiny_release):
    _, files, _ = world_outputs
    with zipfile.ZipFile(io.BytesIO(files["frames_kitti.zip"])) as zf:
        text = zf.read("frames_kitti/poses.json").decode()
    model = json.loads(text)["model"]
    assert model["source"] == "tiny" and model["resolved_path"] == "model.safetensors"
    assert str(tiny_release) not in text and "/tmp" not in text and str(app_policy.APP_DIR) not in text


def test_private_callbacks_have_no_name_a_client_could_call():
    demo = app.build_demo()
    named = {fn.api_name for fn in demo.fns.values() if fn.api_name is not None}
    assert {f"/{name}" for name in named} == PUBLIC_ENDPOINTS
    private = [fn for fn in demo.fns.values() if fn.api_name is None]
    assert {fn.fn.__name__ for fn in private if fn.fn} >= {"preview_map", "random_seed", "show_frame",
                                                           "reset_frame_viewer", "load_example"}


# ----------------------------------------------------------------------------------------------------------
# Per-client limits (the middleware alone; test_app_server drives it through the launched server)


class _FakeQueue:
    """Gradio's pending events, each from a peer address and an X-Forwarded-For header ("peer|forwarded")."""

    def __init__(self, hosts: list[str]) -> None:
        self.event_ids_to_events = {}
        for i, host in enumerate(hosts):
            peer, _, forwarded = host.partition("|")
            request = SimpleNamespace(client=SimpleNamespace(host=peer), headers=Headers({"x-forwarded-for": forwarded}))
            self.event_ids_to_events[str(i)] = SimpleNamespace(request=request)


async def _through(limits: app.ClientLimits, path: str, client: str, headers: dict[str, str] | None = None):
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "client": (client, 1234), "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    await limits(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body) if body else None


def _limits(hosts: list[str], proxy_hops: int = 0) -> app.ClientLimits:
    async def gradio(scope, receive, send):  # stands in for Gradio's routes: 200 for everything
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    fns = {0: SimpleNamespace(api_name="generate_world", api_visibility="public"),
           1: SimpleNamespace(api_name=None, api_visibility="private")}
    return app.ClientLimits(gradio, SimpleNamespace(_queue=_FakeQueue(hosts), fns=fns), proxy_hops)


def test_a_client_holding_its_share_of_the_queue_is_refused_and_others_are_not():
    limits = _limits(["10.0.0.1"] * app.MAX_QUEUED_PER_CLIENT + ["10.0.0.2"])
    for path in ("/gradio_api/queue/join", "/gradio_api/call/generate_world"):
        status, body = asyncio.run(_through(limits, path, "10.0.0.1"))
        assert status == 429 and f"at most {app.MAX_QUEUED_PER_CLIENT} per visitor" in body["detail"]
        assert asyncio.run(_through(limits, path, "10.0.0.2"))[0] == 200
    assert asyncio.run(_through(limits, "/gradio_api/info", "10.0.0.1"))[0] == 200, "other routes pass"
    status, body = asyncio.run(_through(limits, "/gradio_api/call/preview_map", "10.0.0.2"))
    assert status == 404 and "No endpoint named 'preview_map'" in body["detail"]


def test_uploads_are_budgeted_per_client_and_in_total(monkeypatch):
    monkeypatch.setattr(app, "UPLOAD_BYTES_PER_CLIENT", 1000)
    monkeypatch.setattr(app, "UPLOAD_BYTES_TOTAL", 1500)
    limits = _limits([])
    upload = "/gradio_api/upload"
    assert asyncio.run(_through(limits, upload, "a", {"Content-Length": "600"}))[0] == 200
    status, body = asyncio.run(_through(limits, upload, "a", {"Content-Length": "600"}))
    assert status == 429 and "at most 0 MB per visitor" in body["detail"]
    assert asyncio.run(_through(limits, upload, "b", {"Content-Length": "800"}))[0] == 200
    assert asyncio.run(_through(limits, upload, "c", {"Content-Length": "200"}))[0] == 507, "over the total"
    assert asyncio.run(_through(limits, upload, "c", {}))[0] == 411
    monkeypatch.setattr(app, "UPLOAD_WINDOW_S", 0)  # once the cache cleaner has run, the budget is back
    assert asyncio.run(_through(limits, upload, "a", {"Content-Length": "600"}))[0] == 200


def test_behind_a_proxy_the_client_is_the_address_the_proxy_saw_not_what_the_client_wrote(monkeypatch, capsys):
    limits = _limits(["10.0.0.9|1.1.1.1, 10.0.0.5"] * app.MAX_QUEUED_PER_CLIENT, proxy_hops=1)
    assert limits.client_of("spoofed, 10.0.0.5", "10.0.0.9") == "10.0.0.5"
    assert limits.client_of("", "10.0.0.9") == "10.0.0.9"
    join = "/gradio_api/queue/join"  # a fresh X-Forwarded-For prefix does not make a fresh client
    assert asyncio.run(_through(limits, join, "10.0.0.9", {"X-Forwarded-For": "2.2.2.2, 10.0.0.5"}))[0] == 429
    assert asyncio.run(_through(limits, join, "10.0.0.9", {"X-Forwarded-For": "10.0.0.6"}))[0] == 200
    monkeypatch.setenv(app.PROXY_HOPS_ENV, "one")
    with pytest.raises(SystemExit) as exit_info:
        app.main(["--port", "1"])
    assert exit_info.value.code == 2 and "$LIDARVERSE_PROXY_HOPS must be a whole number" in capsys.readouterr().err
