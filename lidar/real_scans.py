"""Where the real LiDAR scans live, the shared ones and those the repository ships: the tests, the app's
examples, the realism report and the upsampling pictures read them."""

from __future__ import annotations

import os
from pathlib import Path


def real_scans_dir() -> Path:
    """`$LIDARVERSE_REAL_SCANS`, else `shared/data/real_scans` beside the repository.

    The scans are not part of the repository (their licences differ), so a bare clone may lack them; the
    environment variable lets CI or a user point at a copy elsewhere.
    """
    env = os.environ.get("LIDARVERSE_REAL_SCANS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data" / "real_scans"


def example_scans_dir() -> Path:
    """`examples/scans` of the repository: a few real sweeps whose licences allow shipping them, so a bare
    clone has real data to show (their provenance is in its README)."""
    return Path(__file__).resolve().parents[1] / "examples" / "scans"
