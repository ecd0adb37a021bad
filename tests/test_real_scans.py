"""Every shared real scan loads (or is refused with a reason), has its geometry measured and projects with it.

Point counts and azimuth coverage come from the data README's table, so the test checks the loader
against numbers measured independently of this code. The kept-fraction bounds sit a few points under the
values in the table of docs/formats.md ("Reading and writing sweeps"). The measured geometry of every scan
in the shared real_scans/ and real_seq/ folders and in examples/ is checked against the sensor the data
READMEs name: its beam count, its columns per turn and its beams within that sensor's fan.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from lidar.formats import azimuth_coverage_deg, detect_sensor, read_points, sweep_geometry
from lidar.formats.rings import cluster_elevations
from lidar.range_image import point_ranges, project
from lidar.real_scans import real_scans_dir
from lidar.recordings import CONTAINER_SUFFIXES, open_container
from lidar.sensors import get_sensor

REAL_SCANS = real_scans_dir()
REAL_SEQ = REAL_SCANS.parent / "real_seq"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "scans"
#: file stem prefix -> (detected sensor or None, intensity divisor, file's max intensity per the data README,
#: lower bound on the kept fraction)
EXPECTED = {
    "kitti_patchworkpp": ("hdl64-measured", 1.0, 0.99, 0.78),
    "kitti_mmdet3d": ("hdl64-measured", 1.0, 0.99, 0.75),
    "kitti_pointpillars": ("hdl64-measured", 1.0, 0.99, 0.75),
    "nuscenes_lidaraisolution": ("hdl32-measured", 255.0, 240.0, 0.70),
    "ouster_oustersdk": ("os1-128-measured", 255.0, 255.0, 0.99),
    "ouster_secondpytorch": ("os1-64-measured", 65535.0, 12551.0, 0.99),
    "pandaset_bynow76": (None, 255.0, 255.0, None),
}

#: A missing or empty folder has no scans to test; scans without their README fail the README tests, as they should.
HAVE_SCANS = REAL_SCANS.is_dir() and any(REAL_SCANS.iterdir())
pytestmark = pytest.mark.skipif(not HAVE_SCANS, reason=f"shared real scans not found at {REAL_SCANS}")


def readme_table() -> dict[str, tuple[int, int]]:
    """file name -> (points, azimuth bins) from the data README; the keyframe count where sweeps are stacked."""
    rows = {}
    for line in (REAL_SCANS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].endswith(".bin"):
            keyframe = re.search(r"keyframe[^:]*:\s*([\d,]+)", cells[7])
            points = (keyframe.group(1) if keyframe else cells[7].split()[0]).replace(",", "")
            rows[cells[0]] = (int(points), int(cells[8].split()[0]))
    return rows


def expected_for(name: str) -> tuple[str | None, float, float, float | None]:
    return next(v for prefix, v in EXPECTED.items() if name.startswith(prefix))


FILES = sorted(p.name for p in REAL_SCANS.glob("*") if p.name != "README.md") if HAVE_SCANS else []


def test_readme_table_lists_every_shared_file():
    assert sorted(readme_table()) == FILES
    assert len(FILES) == 11


@pytest.mark.parametrize("name", FILES)
def test_real_scan_loads_with_readme_counts_and_unit_intensity(name):
    points, azimuth_bins = readme_table()[name]
    _, scale, max_intensity, _ = expected_for(name)
    scan = read_points(REAL_SCANS / name)
    assert scan.num_points == points
    assert scan.points.dtype == np.float32 and scan.points.shape == (points, 4)
    assert np.isfinite(scan.points).all() and scan.dropped_nonfinite == 0
    assert scan.intensity_scale == scale
    assert scan.points[:, 3].min() >= 0.0 and scan.points[:, 3].max() <= 1.0
    assert scan.points[:, 3].max() * scale == pytest.approx(max_intensity, rel=1e-5)
    assert abs(azimuth_coverage_deg(scan.points) - azimuth_bins) <= 1


@pytest.mark.parametrize("name", FILES)
def test_real_scan_projects_with_its_detected_sensor(name):
    sensor_name, _, _, min_kept = expected_for(name)
    scan = read_points(REAL_SCANS / name)
    sensor = detect_sensor(scan)
    if sensor_name is None:
        assert sensor is None
        assert not scan.sensor_frame
        assert any("not in the sensor frame" in note for note in scan.notes)
        return
    assert sensor is not None and sensor.name == sensor_name
    image = project(scan.points, sensor, ring=scan.ring)
    kept = image.mask.sum() / scan.num_points
    assert kept >= min_kept, f"{name}: {sensor.name} x {sensor.width} keeps only {kept:.3f}"


def test_numpy_file_named_bin_is_an_organised_ouster_scan():
    scan = read_points(REAL_SCANS / "ouster_secondpytorch-pr262_000000.bin")
    assert scan.format == "npy"
    np.testing.assert_array_equal(scan.ring, np.arange(65536) % 64)
    sensor = detect_sensor(scan)
    assert sensor is not None
    assert sensor.elevations_deg[0] == pytest.approx(16.6, abs=0.1)  # OS1-64 Gen1: +-16.6 deg, no preset
    assert sensor.elevations_deg[-1] == pytest.approx(-16.6, abs=0.1)


def test_float16_nuscenes_dump_keeps_only_its_keyframe_sweep():
    scan = read_points(REAL_SCANS / "nuscenes_lidaraisolution_ff9eff4389a740848f9a56ad749a4ae8.bin")
    assert scan.format == "float16x5-bin"
    assert any("10 sweeps stacked" in note and "271,156" in note for note in scan.notes)


def test_ouster_beam_column_is_read_as_the_ring():
    scan = read_points(REAL_SCANS / "ouster_oustersdk_OS-1-128_v2.3.0_1024x10_lb_n3.bin")
    assert scan.format == "nuscenes-bin"
    assert scan.ring is not None and np.unique(scan.ring).size == 128


def test_check_sensor_refuses_a_sensor_whose_beams_miss_the_scan() -> None:
    from lidar.formats import PointCloudError, check_sensor
    from lidar.sensors import HDL64, OS1_128, VLP16, get_sensor

    path = REAL_SCANS / "kitti_patchworkpp_000000.bin"
    if not path.exists():
        pytest.skip(f"shared real scans not found at {REAL_SCANS}")
    scan = read_points(path)
    check_sensor(scan, HDL64)
    with pytest.raises(PointCloudError, match="outside the beams of sensor 'vlp16'"):
        check_sensor(scan, VLP16)
    nuscenes = read_points(REAL_SCANS / "nuscenes_lidaraisolution_ff9eff4389a740848f9a56ad749a4ae8.bin")
    check_sensor(nuscenes, get_sensor("hdl32"))
    with pytest.raises(PointCloudError, match="choose a sensor whose beams cover the scan"):
        check_sensor(nuscenes, HDL64)
    ouster = read_points(REAL_SCANS / "ouster_oustersdk_OS-1-128_v2.3.0_1024x10_lb_n3.bin")
    with pytest.raises(PointCloudError, match="ring index reaches 127"):
        check_sensor(ouster, HDL64)
    check_sensor(ouster, OS1_128)


def test_real_scans_dir_follows_the_environment_variable(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LIDARVERSE_REAL_SCANS", str(tmp_path))
    assert real_scans_dir() == tmp_path
    monkeypatch.delenv("LIDARVERSE_REAL_SCANS")
    assert real_scans_dir() == Path(__file__).resolve().parents[2] / "shared" / "data" / "real_scans"


# the measured geometry of every shared sweep -----------------------------------------------------------------

#: file name prefix -> (preset the READMEs name, how its rings are found, beams, columns per turn (range),
#: least share of the points on a pixel of their own among those within the sensor's range limits).
#: KITTI's points step 0.18 deg with a 0.09 deg step every seventh, so a fixed grid of ~2,010 columns puts
#: 9 % of them on a neighbour's pixel; 4,096 columns would hold 99.4 %.
GEOMETRY = {
    "kitti_patchworkpp": ("hdl64", "scan order", (64, 64), (1990, 2030), 0.90),
    "kitti_mmdet3d": ("hdl64", "scan order", (40, 64), (1990, 2030), 0.90),  # cropped to the camera's view
    "kitti_pointpillars": ("hdl64", "scan order", (40, 64), (1990, 2030), 0.90),
    "kitti00_": ("hdl64", "scan order", (64, 64), (1990, 2030), 0.90),
    "kitti_raw_ttc_": ("hdl64", "scan order", (64, 64), (1990, 2030), 0.90),
    "nuscenes": ("hdl32", "organised", (32, 32), (1070, 1110), 0.95),
    "ouster_oustersdk": ("os1-128", "file", (128, 128), (1024, 1024), 0.99),
    "ouster_secondpytorch": ("os1-64", "organised", (64, 64), (1024, 1024), 0.99),
    "velodyne_vlp16": ("vlp16", "file", (16, 16), (1800, 1800), 0.95),  # the laser ids of its pcap's packets
}


def _sweeps() -> list[tuple[str, Path]]:
    """(test id, path) of every shared sweep and example (a shipped recording stands for its first sweep); a
    folder that is absent adds nothing."""
    found = [(p.name, p) for p in sorted(REAL_SCANS.glob("*.bin"))]
    found += [(f"kitti00_{p.name}", p) for p in sorted((REAL_SEQ / "kitti00" / "velodyne").glob("*.bin"))]
    raw = REAL_SEQ / "kitti_raw_ttc" / "velodyne_points" / "data"
    found += [(f"kitti_raw_ttc_{p.name}", p) for p in sorted(raw.glob("*.bin"))]
    return found + [(f"example_{p.name}", p) for p in sorted(EXAMPLES.glob("*")) if p.name != "README.md"]


SWEEPS = _sweeps()


@pytest.mark.parametrize(("name", "path"), SWEEPS, ids=[n for n, _ in SWEEPS])
def test_each_real_sweep_has_its_beam_table_and_columns_measured(name, path):
    scan = open_container(path)[0] if path.suffix in CONTAINER_SUFFIXES else read_points(path)  # a recording's first
    geometry = sweep_geometry(scan)
    key = name.removeprefix("example_")
    if key.startswith("pandaset"):  # the ego frame: elevations are no beam angles
        assert geometry is None and scan.ring is None
        return
    preset_name, source, beams, columns, own_pixel = next(v for k, v in GEOMETRY.items() if key.startswith(k))
    assert geometry is not None and geometry.source == source == scan.ring_source
    sensor, preset = geometry.sensor, get_sensor(preset_name)
    assert sensor.name == f"{preset_name}-measured"
    assert beams[0] <= sensor.height <= beams[1] and columns[0] <= sensor.width <= columns[1]
    assert preset.elevations_deg[0] + 1.0 >= sensor.elevations_deg[0]
    assert sensor.elevations_deg[-1] >= preset.elevations_deg[-1] - 1.0
    assert (sensor.max_range, sensor.mount_height) == (preset.max_range, preset.mount_height)
    assert (geometry.rows >= 0).all() and geometry.rows.max() == sensor.height - 1
    rng = point_ranges(scan.points)
    in_range = ((rng >= sensor.min_range) & (rng <= sensor.max_range)).sum()
    kept = project(scan.points, sensor, ring=geometry.rows).mask.sum()
    assert kept / in_range >= own_pixel, f"{name}: {kept / in_range:.3f} of the points on a pixel of their own"


@pytest.mark.skipif(not (REAL_SEQ / "kitti00").is_dir(), reason=f"shared sequences not found at {REAL_SEQ}")
def test_kitti_rings_begin_straight_ahead_not_at_the_azimuth_wrap():
    """KITTI cuts each beam's revolution straight ahead, where the cameras fire: cut at the +-180 deg wrap
    instead, the sweep falls into 65 pieces, each but the first and last holding half of two beams."""
    scan = read_points(REAL_SEQ / "kitti00" / "velodyne" / "000000.bin")
    assert scan.ring_source == "scan order" and np.unique(scan.ring).size == 64
    az = np.degrees(np.arctan2(scan.points[:, 1], scan.points[:, 0]))
    assert int((np.diff(az) < -180.0).sum() - (np.diff(az) > 180.0).sum()) + 1 == 65  # net wraps: near returns jitter
    starts = np.flatnonzero(np.diff(scan.ring)) + 1
    assert len(starts) == 63
    assert (az[starts - 1] < 0.5).all() and (az[starts] > -0.5).all()  # each boundary passes straight ahead
    elev = np.degrees(np.arctan2(scan.points[:, 2], np.hypot(scan.points[:, 0], scan.points[:, 1])))
    # the elevation steps by a beam where a ring begins and barely moves along a ring
    assert np.median(np.abs(elev[starts] - elev[starts - 1])) > 5 * np.median(np.abs(np.diff(elev)))


def test_a_shuffled_ouster_sweep_clusters_into_its_128_beams():
    scan = read_points(REAL_SCANS / "ouster_oustersdk_OS-1-128_v2.3.0_1024x10_lb_n3.bin")
    rows = sweep_geometry(scan).rows
    shuffle = np.random.default_rng(0).permutation(scan.num_points)
    rings = cluster_elevations(scan.points[shuffle, :3])
    assert rings is not None and rings.count == 128
    assert np.mean(rings.ring == rows[shuffle]) > 0.999


def test_a_shuffled_kitti_sweep_clusters_its_upper_block_exactly():
    """From the lasers' height above the optical centre the upper block's beams are sharp; the lower block's
    elevations drift with azimuth by more than their 0.5 deg spacing, which only the scan order resolves."""
    scan = read_points(REAL_SCANS / "kitti_patchworkpp_000000.bin")
    rows = sweep_geometry(scan).rows
    shuffle = np.random.default_rng(0).permutation(scan.num_points)
    rings = cluster_elevations(scan.points[shuffle, :3])
    assert rings is not None and "+0.20 m above the origin" in rings.note
    upper = rows[shuffle] < 24
    assert np.mean(rings.ring[upper] == rows[shuffle][upper]) > 0.99

