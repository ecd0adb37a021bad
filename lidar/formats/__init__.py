"""Point-cloud files in and out: KITTI/nuScenes `.bin`, `.pcd`, `.ply`, `.npy`/`.npz`, `.las`/`.laz`.

`read_points` returns a `Scan` whose points follow docs/design.md (float32 x, y, z, intensity in [0, 1]);
`write_points` picks the format from the extension; `sweep_geometry` measures the device that took a sweep
(beam table, columns, each point's row) and `detect_sensor` returns that device.
"""

from lidar.formats.detect import (
    SweepGeometry,
    azimuth_coverage_deg,
    check_sensor,
    detect_sensor,
    sweep_geometry,
)
from lidar.formats.io import READ_SUFFIXES, WRITERS, read_points, write_points
from lidar.formats.scan import MAX_FILE_BYTES, MAX_POINTS, PointCloudError, Scan, point_limit

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_POINTS",
    "READ_SUFFIXES",
    "WRITERS",
    "PointCloudError",
    "Scan",
    "SweepGeometry",
    "azimuth_coverage_deg",
    "check_sensor",
    "detect_sensor",
    "point_limit",
    "read_points",
    "sweep_geometry",
    "write_points",
]
