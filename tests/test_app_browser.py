"""The page in a real browser: Debian chromium driven by playwright clicks Generate on the launched app
and sees the 3D canvas and both previews appear. Never downloads a browser build (`playwright install`).

Set LIDARVERSE_SCREENSHOT=path.png to keep the screenshot (docs/screenshot.png is made this way with the
trained default model: `LIDARVERSE_SCREENSHOT_MODEL=weights/default`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.test_app import write_tiny_release
from tests.test_app_server import launch_app

CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--enable-unsafe-swiftshader", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"Debian chromium is not installed at {CHROMIUM}"),
]


def test_generate_in_the_browser_shows_the_3d_world_and_the_previews(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    model = os.environ.get("LIDARVERSE_SCREENSHOT_MODEL") or write_tiny_release(tmp_path / "release")
    with launch_app(Path(model), tmp_path) as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1700})
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(server.url)
            page.wait_for_selector("#map-preview img", timeout=60_000)
            page.click("#generate")
            page.wait_for_selector("#world-viewer canvas", state="visible", timeout=180_000)
            for preview in ("#world-bev img", "#world-range img"):
                img = page.wait_for_selector(preview, state="visible", timeout=60_000)
                page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=img, timeout=30_000)
            canvas = page.query_selector("#world-viewer canvas").bounding_box()
            assert canvas["width"] > 200 and canvas["height"] > 200
            stats = page.inner_text("#world-stats")
            assert '"frames"' in stats and '"world points"' in stats
            page.wait_for_timeout(1500)  # let the viewer draw the point cloud before the picture
            shot = tmp_path / "app.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            assert errors == [], f"JavaScript errors on the page: {errors}"
        finally:
            browser.close()
    if os.environ.get("LIDARVERSE_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["LIDARVERSE_SCREENSHOT"])
