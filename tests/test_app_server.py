"""The app launched for real (`python app.py --model … --port …` in a subprocess), driven over HTTP by
gradio_client as an API user would (the named endpoints, a bad upload followed by a good request, a load
test of 8 concurrent requests with the server's memory watched through psutil) and by a real browser:
Debian chromium through playwright clicks Generate, and Forecast on an example scan, and sees each tab's 3D
canvas and both previews appear.
All share one server, since starting one (importing torch and gradio) is most of the cost.

Never `playwright install`: the browser is Debian's chromium. The README screenshot is made with the same
code on the trained default model: `python -m tests.test_app_server docs/screenshot.png docs/app_forecast.png [--model DIR]`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

import app
from tests.test_app import (
    KITTI_SCAN,
    PROBING_SOURCES,
    PUBLIC_ENDPOINTS,
    SHIPPED_EXAMPLES,
    needs_real_scans,
    write_tiny_release,
)
from tests.test_formats import BOMBS

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--enable-unsafe-swiftshader", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
#: The 3D viewer's background in 8-bit RGB, as the browser draws it.
VIEWER_BACKDROP = np.rint(255 * np.array(app.VIEWER_BACKGROUND[:3]))
pytestmark = pytest.mark.multiprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    tmp: Path  # the server's $TMPDIR: per-request scratch dirs live here
    log: Path

    def rss_bytes(self) -> int:
        proc = psutil.Process(self.process.pid)
        return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))

    def scratch_dirs(self) -> list[Path]:
        return sorted(self.tmp.glob("lidarverse-request-*"))

    def peak_rss_bytes(self) -> int:
        """The server process's high-water mark of resident memory (VmHWM), as the kernel keeps it."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


@contextlib.contextmanager
def launch_app(model: Path, workdir: Path, timeout: float = 120.0) -> Iterator[Server]:
    """Start `python app.py` on a free port with its own temp and Gradio cache dirs, as a fresh clone would
    run it (no shared real scans); stop it afterwards."""
    port = free_port()
    tmp = workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    # OMP_NUM_THREADS=1: on a busy 2-core box a tiny model's convolutions run ~10x slower with a thread pool.
    # MALLOC_ARENA_MAX=2: glibc otherwise gives each of Gradio's worker threads its own heap arena, and RSS
    # creeps up by ~20-30 MiB per wave of requests from fragmentation alone, which would hide a real leak.
    env = {**os.environ, "TMPDIR": str(tmp), "GRADIO_TEMP_DIR": str(workdir / "gradio"), "OMP_NUM_THREADS": "1",
           "MALLOC_ARENA_MAX": "2", "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1", "LIDARVERSE_REAL_SCANS": str(workdir / "no_real_scans")}
    log = workdir / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "app.py"), "--model", str(model), "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"app.py exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"app.py did not serve {url} within {timeout} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield Server(url, proc, tmp, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("app_server")
    with launch_app(write_tiny_release(root / "release"), root) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Client:
    return Client(server.url, verbose=False)


WORLD_ARGS = (3, "urban", "Turn left", 3, 2, 0, 1.0)


def test_the_public_api_is_exactly_the_pinned_endpoints(client):
    api = client.view_api(return_format="dict", print_info=False)
    assert set(api["named_endpoints"]) == PUBLIC_ENDPOINTS and api["unnamed_endpoints"] == {}
    info = client.predict(api_name="/model_info")
    assert info["iteration"] == 7 and info["device"] == "cpu"


def test_a_visitor_can_neither_reload_the_model_nor_learn_the_server_files(client, server):
    for probe in PROBING_SOURCES:
        with pytest.raises(ValueError, match="reload_model") as refused:  # gradio_client: no such endpoint
            client.predict(probe, api_name="/reload_model")
        raw = httpx.post(f"{server.url}gradio_api/call/reload_model", json={"data": [probe]}, timeout=30)
        assert raw.status_code >= 400, raw.text  # Gradio answers an unknown api_name with an error status
        for text in (str(refused.value), raw.text):
            assert ".bashrc" not in text and "passwd" not in text, text
    info = json.dumps(client.predict(api_name="/model_info"))
    assert '"source": "release"' in info and '"resolved_path": "model.safetensors"' in info
    assert str(server.tmp.parent) not in info and "/tmp" not in info and str(REPO) not in info


def test_a_fresh_clone_offers_the_shipped_example_scans_and_one_forecasts(client):
    datasets = [c["props"]["samples"] for c in client.config["components"] if c.get("type") == "dataset"]
    scans = [[row[0] for row in samples] for samples in datasets if isinstance(samples[0][0], str)]
    assert scans == [list(SHIPPED_EXAMPLES)], "the server was started with no real scans"
    *_, stats, downloads = client.predict(handle_file(str(REPO / "examples" / "scans" / SHIPPED_EXAMPLES[1])),
                                          "auto-detect", "Straight", 1, 1, 0, api_name="/forecast_from_scan")
    assert stats["input sensor"] == "hdl32" and stats["frames"] == 1 and len(downloads) == 4


@pytest.mark.parametrize(("kind", "message"), [
    ("npz", r"bomb\.npz: the \.npz archive would decode to 268 MB, over the 200 MB limit"),
    ("pcd", r"bomb\.pcd: corrupt PCD binary_compressed data: LZF stream decodes past the 16000 bytes"),
    ("laz", r"bomb\.laz: the LAS point records .* would decode to 268 MB, over the 200 MB limit"),
    ("ply", r"bomb\.ply: PLY ASCII vertex element is not 4,000,000 rows of 3 numbers"),
])
def test_an_upload_bomb_is_refused_with_a_clear_message_and_the_server_keeps_serving(client, server, tmp_path,
                                                                                      kind, message):
    bomb = BOMBS[kind](tmp_path / f"bomb.{kind}")
    peak = server.peak_rss_bytes()
    with pytest.raises(AppError, match=rf"Cannot read the scan: {message}"):
        client.predict(handle_file(str(bomb)), "auto-detect", "Straight", 2, 1, 0, api_name="/forecast_from_scan")
    assert server.peak_rss_bytes() - peak < 100 * 2**20, "the bomb raised the server's memory high-water mark"
    assert client.predict(api_name="/model_info")["iteration"] == 7 and server.process.poll() is None


def test_generate_world_over_http_downloads_readable_files(client, server):
    viewer, *_, stats, downloads = client.predict(*WORLD_ARGS, api_name="/generate_world")
    assert Path(viewer).read_bytes().startswith(b"ply\nformat binary_little_endian 1.0\n")
    assert stats["frames"] == 3 and stats["world points"] > 0
    frames_zip = next(Path(p) for p in downloads if p.endswith("frames_kitti.zip"))
    with zipfile.ZipFile(frames_zip) as zf:
        names = zf.namelist()
        assert len([n for n in names if n.startswith("frames_kitti/frame_")]) == 3 and "frames_kitti/poses.json" in names
    assert server.scratch_dirs() == [], "per-request scratch dirs must be removed after the request"


@needs_real_scans
def test_a_bad_upload_gets_a_clear_error_and_the_next_good_request_works(client, tmp_path):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\x01garbage" * 3)
    with pytest.raises(AppError, match=r"garbage\.bin"):
        client.predict(handle_file(str(garbage)), "auto-detect", "Straight", 2, 2, 0, api_name="/forecast_from_scan")
    empty = tmp_path / "empty.pcd"
    empty.write_bytes(b"")
    with pytest.raises(AppError, match="is empty"):
        client.predict(handle_file(str(empty)), "auto-detect", "Straight", 2, 2, 0, api_name="/forecast_from_scan")
    with pytest.raises(AppError, match=r"greater than maximum value 32|Frames must be"):
        client.predict(3, "urban", "Straight", 99, 2, 0, 1.0, api_name="/generate_world")

    *_, stats, downloads = client.predict(
        handle_file(str(KITTI_SCAN)), "auto-detect", "Straight", 2, 2, 0, api_name="/forecast_from_scan"
    )
    assert stats["input points"] == 124_668 and stats["frames"] == 2
    assert sorted(Path(p).suffix for p in downloads) == [".las", ".pcd", ".ply", ".zip"]


@needs_real_scans
def test_forecast_from_scans_registers_kitti_sweeps_and_lists_the_prefix_in_poses_json(client, server):
    sweeps = [handle_file(str(KITTI_SCAN.with_name(f"kitti_patchworkpp_{i:06d}.bin"))) for i in (0, 2, 4)]
    *_, stats, downloads, prefix = client.predict(sweeps, "Straight", 2, 1, 0, api_name="/forecast_from_scans")
    assert stats["poses"] == "registered" and stats["frames"] == 2
    assert [row[0] for row in prefix["data"]] == [f"kitti_patchworkpp_{i:06d}.bin" for i in (0, 2, 4)]
    assert 1.0 < prefix["data"][1][1] < 2.0 and prefix["data"][2][5] > 0.7  # x of sweep 2 (m), fitness
    with zipfile.ZipFile(next(p for p in downloads if p.endswith(".zip"))) as zf:
        meta = json.loads(zf.read("frames_kitti/poses.json"))
    assert len(meta["prefix"]) == 3 and meta["frames"][0]["pose"][0][3] > meta["prefix"][2]["pose"][0][3]
    assert server.scratch_dirs() == []


@needs_real_scans
def test_resimulate_renders_a_zipped_scene_from_a_shifted_path_and_refuses_unrelated_sweeps(client, tmp_path):
    archive = tmp_path / "drive.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for i in (0, 2, 4):
            zf.write(KITTI_SCAN.with_name(f"kitti_patchworkpp_{i:06d}.bin"), f"velodyne/{i:06d}.bin")
    *_, stats, _, prefix = client.predict([handle_file(str(archive))], 2.0, 0.0, 5.0, 3, 1, 0,
                                          api_name="/resimulate")
    assert stats["frames"] == 3 and stats["shift (forward, left) m"] == [0.0, 2.0] and len(prefix["data"]) == 3
    unrelated = [handle_file(str(KITTI_SCAN)), handle_file(str(KITTI_SCAN.with_name("kitti_mmdet3d_000008.bin")))]
    with pytest.raises(AppError, match=r"kitti_mmdet3d_000008\.bin\) does not register") as err:
        client.predict(unrelated, "Straight", 2, 1, 0, api_name="/forecast_from_scans")
    assert "/" not in str(err.value).split("register these sweeps:")[-1].split("expected")[0]  # no server paths


def test_an_upload_over_50_mb_is_refused_by_the_server_itself(server, tmp_path):
    """The limit holds against clients that skip gradio_client's own check (it reads max_file_size too)."""
    big = tmp_path / "big.bin"
    with big.open("wb") as f:
        f.truncate(50 * 1024 * 1024 + 16)
    with big.open("rb") as f:
        response = httpx.post(f"{server.url}gradio_api/upload", files={"files": ("big.bin", f)}, timeout=120)
    assert response.status_code == 413 and "52428800 bytes" in response.text
    with pytest.raises(ValueError, match="exceeds the maximum file size of 52428800 bytes"):
        Client(server.url, verbose=False).predict(
            handle_file(str(big)), "auto-detect", "Straight", 2, 1, 0, api_name="/forecast_from_scan"
        )


def test_eight_concurrent_requests_all_complete_with_bounded_memory(server):
    """8 clients at once (queue max size 16, one generation at a time): every request completes, and the
    server's RSS after a second wave is within a small margin of the first (no per-request leak)."""
    peak = [server.rss_bytes()]
    baseline = peak[0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            with contextlib.suppress(psutil.Error):
                peak[0] = max(peak[0], server.rss_bytes())

    def one_request(seed: int) -> dict:
        client = Client(server.url, verbose=False, download_files=False)  # stats only; no file downloads
        return client.predict(3, "urban", "Straight", 3, 1, seed, 1.0, api_name="/generate_world")[3]

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    waves = []
    try:
        for _ in range(2):
            start = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                stats = list(pool.map(one_request, range(8)))
            waves.append((time.perf_counter() - start, server.rss_bytes()))
            assert [s["frames"] for s in stats] == [3] * 8
            assert len({s["world points"] for s in stats}) > 1, "different seeds should give different worlds"
    finally:
        done.set()
        watcher.join()
    print(f"\nload test: baseline RSS {baseline / 2**20:.0f} MiB, peak {peak[0] / 2**20:.0f} MiB, "
          f"after wave 1 {waves[0][1] / 2**20:.0f} MiB ({waves[0][0]:.1f} s), "
          f"after wave 2 {waves[1][1] / 2**20:.0f} MiB ({waves[1][0]:.1f} s)")
    assert peak[0] - baseline < 1024 * 2**20, "8 small requests should not need a GiB"
    assert waves[1][1] - waves[0][1] < 40 * 2**20, "memory grew between identical waves: a per-request leak"
    assert server.scratch_dirs() == []
    assert server.process.poll() is None


def _open_generate(page) -> None:
    page.wait_for_selector("#map-preview img", timeout=60_000)
    page.click("#generate")


def _open_forecast(page) -> None:
    """The Forecast tab, its first shipped example scan loaded into the upload, then Forecast."""
    example = SHIPPED_EXAMPLES[0]
    page.get_by_role("tab", name="Forecast from a scan").click()
    page.get_by_role("button", name=example, exact=True).click()
    # the upload shows the file's stem and suffix on separate lines
    page.wait_for_function("stem => document.querySelector('#scan-file').innerText.includes(stem)",
                           arg=Path(example).stem, timeout=60_000)
    page.click("#forecast")


def run_in_browser(url: str, screenshot: Path, tab: str = "world") -> dict[str, float]:
    """Open the page in chromium, start a rollout in `tab` ("world": Generate; "forecast": an example scan),
    wait for its 3D canvas and both previews, screenshot.

    Returns the canvas size, how many of its pixels the point cloud lit (from a screenshot of the element,
    since a WebGL canvas cannot be read back) and the seconds from the click to the previews being shown.
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1700})
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(url)
            start = time.perf_counter()
            {"world": _open_generate, "forecast": _open_forecast}[tab](page)
            page.wait_for_selector(f"#{tab}-viewer canvas", state="visible", timeout=300_000)
            for preview in (f"#{tab}-bev img", f"#{tab}-range img"):
                img = page.wait_for_selector(preview, state="visible", timeout=60_000)
                page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=img, timeout=30_000)
            seconds = time.perf_counter() - start
            stats = page.inner_text(f"#{tab}-stats")
            assert '"frames"' in stats and '"world points"' in stats, stats
            canvas = page.query_selector(f"#{tab}-viewer canvas")
            box = canvas.bounding_box()
            deadline = time.monotonic() + 60
            while True:  # the viewer fetches and draws the PLY after the canvas appears
                pixels = np.asarray(Image.open(io.BytesIO(canvas.screenshot())).convert("RGB")).astype(int)
                scene = pixels[60:-10, 10:-10]  # below the label and buttons drawn over the canvas
                off_backdrop = np.abs(scene - VIEWER_BACKDROP).sum(axis=-1) > 60
                # before the viewer draws, the canvas is blank white: every pixel is "off the backdrop", so
                # points count only once the backdrop itself covers most of the canvas
                lit = int(off_backdrop.sum()) if off_backdrop.mean() < 0.5 else 0
                if lit > 500 or time.monotonic() > deadline:
                    break
                page.wait_for_timeout(500)
            page.wait_for_timeout(500)
            page.screenshot(path=str(screenshot), full_page=True)
            assert errors == [], f"JavaScript errors on the page: {errors}"
        finally:
            browser.close()
    return {"width": box["width"], "height": box["height"], "lit_pixels": lit, "seconds": seconds}


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"Debian chromium is not installed ({CHROMIUM} not found)")
@pytest.mark.parametrize("tab", ["world", "forecast"])
def test_a_rollout_in_the_browser_shows_the_3d_world_and_the_previews(server, tmp_path, tab):
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    shot = tmp_path / "app.png"
    seen = run_in_browser(server.url, shot, tab)
    assert seen["width"] > 200 and seen["height"] > 200
    assert seen["lit_pixels"] > 500, "the 3D viewer shows no point cloud"
    assert shot.stat().st_size > 10_000


if __name__ == "__main__":  # the README screenshots, on the trained model
    import argparse

    parser = argparse.ArgumentParser(description="screenshots of the app's World generation and Forecast tabs")
    parser.add_argument("world_png", type=Path)
    parser.add_argument("forecast_png", type=Path, nargs="?")
    parser.add_argument("--model", type=Path, default=REPO / "weights" / "default")
    args = parser.parse_args()
    with launch_app(args.model, Path(tempfile.mkdtemp())) as srv:
        for tab, shot in (("world", args.world_png), ("forecast", args.forecast_png)):
            if shot is not None:
                print(tab, run_in_browser(srv.url, shot.resolve(), tab))
