"""lidar.formats on files written here: round trips, content sniffing, layout scoring, limits, quirks."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import laspy
import numpy as np
import pytest

from lidar.formats import (
    MAX_POINTS,
    PointCloudError,
    Scan,
    detect_sensor,
    point_limit,
    read_points,
    write_points,
)
from lidar.formats.pcd import lzf_decompress
from lidar.sensors import HDL32, HDL64, OS1_64, OS1_128, PRESETS, VLP16, Sensor
from lidar.sequence import read_sequence
from tests.helpers import BOMBS, HOSTILE, broken_zip, pcd_many_fields


def sweep(sensor: Sensor, seed: int = 0, keep: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """A plausible sweep along the sensor's rays (points, ring), in firing order (column by column)."""
    rng = np.random.default_rng(seed)
    dirs = sensor.ray_directions()
    ranges = rng.uniform(max(sensor.min_range, 3.0), 60.0, size=dirs.shape[:2])
    down = sensor.elevations < 0
    ground = sensor.mount_height / np.sin(-sensor.elevations[down])  # where each downward beam meets the road
    ranges[down] = np.minimum(ranges[down], ground[:, None])
    mask = rng.random(dirs.shape[:2]) < keep
    rows, cols = np.nonzero(mask.T)[::-1]  # column-major order, like a spinning sensor fires
    xyz = dirs[rows, cols] * ranges[rows, cols, None]
    inten = rng.uniform(0.0, 1.0, size=len(xyz))
    return np.concatenate([xyz, inten[:, None]], axis=1).astype(np.float32), rows.astype(np.int64)


@pytest.fixture(scope="module")
def cloud() -> tuple[np.ndarray, np.ndarray]:
    return sweep(HDL32.with_width(256), seed=1)


# 1. round trips ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fmt", "expected_format", "stores_ring", "atol"),
    [
        ("scan.bin", None, "kitti-bin", False, 0.0),
        ("scan.pcd.bin", None, "nuscenes-bin", True, 1e-6),
        ("scan.pcd", None, "pcd-binary", True, 0.0),
        ("scan.pcd", "pcd-ascii", "pcd-ascii", True, 0.0),
        ("scan.ply", None, "ply-binary", True, 0.0),
        ("scan.ply", "ply-ascii", "ply-ascii", True, 0.0),
        ("scan.npy", None, "npy", True, 0.0),
        ("scan.npz", None, "npz", True, 0.0),
        ("scan.las", None, "las", True, 1e-4),
        ("scan.laz", None, "laz", True, 1e-4),
    ],
)
def test_every_writer_round_trips_points_and_ring(tmp_path, cloud, name, fmt, expected_format, stores_ring, atol):
    points, ring = cloud
    path = write_points(tmp_path / name, points, fmt=fmt, ring=ring)
    scan = read_points(path)
    assert scan.format == expected_format
    assert scan.points.dtype == np.float32 and scan.points.shape == points.shape
    np.testing.assert_allclose(scan.points[:, :3], points[:, :3], atol=max(atol, 1e-6), rtol=0)
    np.testing.assert_allclose(scan.points[:, 3], points[:, 3], atol=max(atol, 2e-5), rtol=0)
    np.testing.assert_array_equal(scan.ring, ring)  # the rows of `cloud` number its beams from the top
    assert scan.ring_source == ("file" if stores_ring else "elevation clusters")
    assert scan.dropped_nonfinite == 0


def test_las_stores_intensity_as_16_bit_and_reads_it_back_in_unit_range(tmp_path, cloud):
    points, _ = cloud
    scan = read_points(write_points(tmp_path / "scan.las", points))
    assert scan.intensity_scale == 65535.0
    assert scan.points[:, 3].min() >= 0.0 and scan.points[:, 3].max() <= 1.0


def test_nuscenes_layout_stores_0_to_255_intensity_like_the_dataset(tmp_path, cloud):
    points, ring = cloud
    path = write_points(tmp_path / "scan.pcd.bin", points, ring=ring)
    raw = np.fromfile(path, dtype=np.float32).reshape(-1, 5)
    np.testing.assert_allclose(raw[:, 3], points[:, 3] * 255.0, rtol=1e-6)
    np.testing.assert_array_equal(raw[:, 4], ring)
    assert read_points(path).intensity_scale == 255.0


# 2. content beats extension --------------------------------------------------------------------------------


def test_numpy_file_named_bin_loads_as_npy_with_a_note(tmp_path, cloud):
    points, _ = cloud
    path = tmp_path / "really_numpy.bin"
    with path.open("wb") as f:
        np.save(f, points.astype(np.float64))
    scan = read_points(path)
    assert scan.format == "npy"
    np.testing.assert_allclose(scan.points, points, atol=1e-6)
    assert any("NPY" in n and ".bin" in n for n in scan.notes)


def test_pcd_with_a_wrong_extension_is_read_by_content(tmp_path, cloud):
    points, _ = cloud
    pcd = write_points(tmp_path / "a.pcd", points)
    renamed = pcd.rename(tmp_path / "a.bin")
    scan = read_points(renamed)
    assert scan.format == "pcd-binary"
    np.testing.assert_array_equal(scan.points, points)


@pytest.mark.parametrize(("name", "expected"), [
    ("notes.txt", r"notes\.txt: \.txt files are not read here; expected a sweep file \(\.bin, \.pcd"),
    ("fake.pcd", r"fake\.pcd: not a \.pcd file: it does not start with '# \.PCD', 'VERSION' or 'FIELDS'"),
    ("fake.laz", r"fake\.laz: not a \.laz file: it does not start with 'LASF'"),
    ("drive.pcap", r"drive\.pcap: a \.pcap file is a recording, not one sweep; open it as a recording"),
])
def test_a_file_whose_content_names_no_format_is_refused_saying_what_it_lacks(tmp_path, name, expected):
    path = tmp_path / name
    path.write_text("hello world\n")
    with pytest.raises(PointCloudError, match=expected):
        read_points(path)


# 3. raw .bin layouts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "columns", "expected"),
    [("<f4", 4, "kitti-bin"), ("<f2", 4, "float16-bin"), ("<f8", 4, "float64-bin"), ("<f2", 5, "float16x5-bin")],
)
def test_raw_bin_layout_is_found_from_plausible_values(tmp_path, cloud, dtype, columns, expected):
    points, ring = cloud
    data = np.concatenate([points, ring[:, None].astype(np.float32)], axis=1)[:, :columns]
    path = tmp_path / "scan.bin"
    path.write_bytes(data.astype(dtype).tobytes())
    scan = read_points(path)
    assert scan.format == expected
    np.testing.assert_allclose(scan.points[:, :3], points[:, :3], rtol=2e-3, atol=0.05)
    if columns == 5:
        np.testing.assert_array_equal(scan.ring, ring)


def test_kitti_file_whose_size_also_fits_five_columns_is_still_kitti(tmp_path, cloud):
    points, _ = cloud
    points = points[: len(points) // 5 * 5]  # N*16 divisible by 20 as well
    path = tmp_path / "scan.bin"
    path.write_bytes(points.astype("<f4").tobytes())
    assert path.stat().st_size % 20 == 0
    assert read_points(path).format == "kitti-bin"


def test_nuscenes_file_whose_size_also_fits_four_columns_is_still_nuscenes(tmp_path, cloud):
    points, ring = cloud
    n = len(points) // 4 * 4  # N*20 divisible by 16 as well
    path = write_points(tmp_path / "scan.pcd.bin", points[:n], ring=ring[:n])
    assert path.stat().st_size % 16 == 0
    scan = read_points(path)
    assert scan.format == "nuscenes-bin"
    np.testing.assert_array_equal(scan.ring, ring[:n])


def test_shuffled_kitti_file_still_loads_when_only_one_layout_is_plausible(tmp_path, cloud):
    points, _ = cloud
    shuffled = points[np.random.default_rng(2).permutation(len(points))]
    scan = read_points(write_points(tmp_path / "shuffled.bin", shuffled))
    assert scan.format == "kitti-bin"
    np.testing.assert_array_equal(scan.points, shuffled)


def test_stacked_sweeps_keep_only_the_keyframe(tmp_path, cloud):
    points, _ = cloud
    dt = np.repeat(np.array([0.0, 0.05, 0.1], dtype=np.float32), len(points) // 3 + 1)[: len(points)]
    path = tmp_path / "sweeps.bin"
    path.write_bytes(np.concatenate([points[:, :3], points[:, 3:] * 255, dt[:, None]], axis=1).astype("<f2").tobytes())
    scan = read_points(path)
    assert scan.num_points == int((dt == 0).sum())
    assert any("3 sweeps stacked" in n for n in scan.notes)


def test_size_that_fits_no_layout_names_the_file_and_every_layout(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(np.zeros(401, dtype="<f4").tobytes())  # 1604 bytes: no row size divides it
    with pytest.raises(PointCloudError) as err:
        read_points(path)
    message = str(err.value)
    assert "odd.bin" in message and "1,604 bytes" in message
    for layout in ("4 x float32", "5 x float32", "4 x float16", "5 x float16", "4 x float64", "5 x float64"):
        assert layout in message


def test_random_bytes_are_refused_as_implausible(tmp_path):
    path = tmp_path / "noise.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size=16_000, dtype=np.uint8).tobytes())
    with pytest.raises(PointCloudError, match=r"noise\.bin.*plausible rows"):
        read_points(path)


# 4. limits and bad values -----------------------------------------------------------------------------------


def test_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.bin"
    path.touch()
    with pytest.raises(PointCloudError, match=r"empty\.bin.*empty"):
        read_points(path)


def test_file_over_200_mb_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.bin"
    with path.open("wb") as f:
        f.truncate(200_000_016)  # sparse: no disk used
    with pytest.raises(PointCloudError, match=r"huge\.bin.*200 MB"):
        read_points(path)


def test_bin_over_5_million_points_is_refused(tmp_path):
    path = tmp_path / "many.bin"
    with path.open("wb") as f:
        f.truncate((MAX_POINTS + 1) * 16)
    with pytest.raises(PointCloudError, match=r"many\.bin.*5,000,001 points.*5,000,000"):
        read_points(path)


@pytest.mark.parametrize(
    ("name", "header"),
    [
        ("big.pcd", "VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nCOUNT 1 1 1\nWIDTH 6000000\nHEIGHT 1\nPOINTS 6000000\nDATA binary\n"),
        ("big.ply", "ply\nformat binary_little_endian 1.0\nelement vertex 6000000\nproperty float x\nproperty float y\nproperty float z\nend_header\n"),
    ],
)
def test_header_announcing_too_many_points_is_refused_without_reading_the_body(tmp_path, name, header):
    path = tmp_path / name
    path.write_bytes(header.encode() + b"\0" * 64)
    with pytest.raises(PointCloudError, match="6,000,000 points"):
        read_points(path)


def test_npy_and_las_announcing_too_many_points_are_refused_from_the_header(tmp_path, cloud):
    npy = tmp_path / "big.npy"
    with npy.open("wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (6_000_000, 4)})
        f.write(b"\0" * 64)
    with pytest.raises(PointCloudError, match=r"big\.npy.*6,000,000 points"):
        read_points(npy)
    blob = bytearray(write_points(tmp_path / "a.las", cloud[0]).read_bytes())
    struct.pack_into("<I", blob, 107, 6_000_000)  # legacy point count
    struct.pack_into("<Q", blob, 247, 6_000_000)  # LAS 1.4 64-bit point count
    (tmp_path / "big.las").write_bytes(bytes(blob))
    with pytest.raises(PointCloudError, match=r"big\.las.*6,000,000 points"):
        read_points(tmp_path / "big.las")


@pytest.mark.parametrize("name", ["a.bin", "a.pcd.bin", "a.pcd", "a.ply", "a.npy", "a.npz", "a.las", "a.laz"])
def test_truncated_or_corrupted_files_raise_only_point_cloud_errors(tmp_path, cloud, name):
    points, ring = cloud
    blob = write_points(tmp_path / name, points, ring=ring).read_bytes()
    rng = np.random.default_rng(9)
    target = tmp_path / f"broken_{name}"
    for trial in range(16):
        if trial < 8:
            data = blob[: int(rng.integers(1, len(blob)))]
        else:
            corrupt = bytearray(blob)
            for i in rng.integers(0, min(len(blob), 400), size=5):
                corrupt[i] = int(rng.integers(0, 256))
            data = bytes(corrupt)
        target.write_bytes(data)
        try:
            read_points(target)
        except PointCloudError as err:
            assert str(target) in str(err)


def test_las_header_with_an_absurd_vlr_count_is_refused_quickly(tmp_path, cloud):
    points, _ = cloud
    blob = bytearray(write_points(tmp_path / "a.las", points).read_bytes())
    blob[103] = 0xFF  # top byte of the VLR count: ~4 billion records, which laspy would try to walk
    (tmp_path / "b.las").write_bytes(bytes(blob))
    with pytest.raises(PointCloudError, match=r"b\.las.*VLRs cannot fit"):
        read_points(tmp_path / "b.las")


def test_nan_and_inf_points_are_dropped_and_counted(tmp_path, cloud):
    points, _ = cloud
    bad = points.copy()
    bad[[3, 10, 11], 0] = np.nan
    bad[20, 2] = np.inf
    bad[30, 3] = -np.inf
    scan = read_points(write_points_raw(tmp_path / "nan.bin", bad))
    assert scan.dropped_nonfinite == 5
    assert scan.num_points == len(points) - 5
    assert np.isfinite(scan.points).all()
    assert any("5 points with NaN/inf" in n for n in scan.notes)


@pytest.mark.parametrize("far", [1e30, 3e38, -2000.0])
def test_points_past_a_kilometre_are_refused_with_the_distance(tmp_path, cloud, far):
    points, _ = cloud
    bad = points.copy()
    bad[7, 1] = far
    expected = re.escape(f"far.bin: 1 points lie farther than 1000 m from the sensor (up to {abs(far):.3g} m)")
    with pytest.raises(PointCloudError, match=expected):
        read_points(write_points_raw(tmp_path / "far.bin", bad))


def test_a_cloud_wider_than_las_integers_reach_is_refused_not_overflowed(tmp_path, cloud):
    points, _ = cloud
    wide = points.copy()
    wide[0, 0] = 3e5  # 300 km from the others: past 2**31 steps of 0.1 mm
    with pytest.raises(PointCloudError, match=r"wide\.las: the points span 3e\+05 m on one axis; LAS holds at most 215 km"):
        write_points(tmp_path / "wide.las", wide)
    assert read_points(write_points(tmp_path / "ok.las", points)).num_points == len(points)


def test_an_unwritable_destination_is_a_point_cloud_error(tmp_path, cloud):
    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(PointCloudError, match=r"file/out\.ply: cannot write"):
        write_points(tmp_path / "file" / "out.ply", cloud[0])


def write_points_raw(path: Path, data: np.ndarray) -> Path:
    """Bytes as a foreign tool would write them (write_points refuses NaN)."""
    path.write_bytes(data.astype("<f4").tobytes())
    return path


@pytest.mark.parametrize(("top", "scale"), [(0.8, 1.0), (200.0, 255.0), (12551.0, 65535.0), (1e6, 1e6)])
def test_intensity_scale_is_detected_and_mapped_to_unit_range(tmp_path, cloud, top, scale):
    points, _ = cloud
    data = points.copy()
    data[:, 3] = np.linspace(0.0, top, len(points))
    scan = read_points(write_points_raw(tmp_path / "i.bin", data))
    assert scan.intensity_scale == pytest.approx(scale)
    assert scan.points[:, 3].max() == pytest.approx(top / scale, rel=1e-5)
    assert scan.points[:, 3].min() == 0.0


def test_write_refuses_bad_shapes_unknown_extensions_and_ringless_nuscenes(tmp_path, cloud):
    points, _ = cloud
    with pytest.raises(PointCloudError, match=r"shape \(5, 3\).*expected a non-empty \(N, 4\)"):
        write_points(tmp_path / "a.bin", np.zeros((5, 3)))
    with pytest.raises(PointCloudError, match=r"\.xyz.*expected one of"):
        write_points(tmp_path / "a.xyz", points)
    with pytest.raises(PointCloudError, match="needs a ring"):
        write_points(tmp_path / "a.pcd.bin", points)


# 5. PCD, PLY, NPZ details -------------------------------------------------------------------------------------


def test_lzf_decoder_handles_literals_and_overlapping_back_references():
    # literal "abc" (ctrl 2), then a 9-byte copy from 3 back (ctrl 7<<5, extra length 0, offset byte 2)
    assert lzf_decompress(b"\x02abc\xe0\x00\x02", 12) == b"abcabcabcabc"
    # short copy: length 3 (ctrl 1<<5), offset 1 back -> repeats the last byte
    assert lzf_decompress(b"\x01xy\x20\x00", 5) == b"xyyyy"
    with pytest.raises(ValueError, match="header says"):
        lzf_decompress(b"\x02abc", 4)


def test_lzf_is_decoded_in_c_so_a_stream_of_one_byte_literals_costs_milliseconds(tmp_path):
    """The hostile case for a per-token decoder: 8 MB of output as 8 million 1-byte literal runs (16 MB). The
    pure-Python loop this replaced spent ~5 s here (a minute for the 200 MB a header may declare)."""
    raw = np.random.default_rng(0).integers(0, 256, 8_000_000, dtype=np.uint8).tobytes()
    stream = np.zeros((len(raw), 2), np.uint8)
    stream[:, 1] = np.frombuffer(raw, np.uint8)
    start = time.perf_counter()
    assert lzf_decompress(stream.tobytes(), len(raw)) == raw
    assert time.perf_counter() - start < 1.0
    with pytest.raises(ValueError, match="decodes past the 7999999 bytes"):
        lzf_decompress(stream.tobytes(), len(raw) - 1)


def test_a_point_limit_refuses_larger_clouds_from_the_header_inside_its_block_only(tmp_path):
    header = ("VERSION 0.7\nFIELDS x y z intensity\nSIZE 4 4 4 4\nTYPE F F F F\nCOUNT 1 1 1 1\n"
              "WIDTH 2000000\nHEIGHT 1\nPOINTS 2000000\nDATA binary_compressed\n")
    path = tmp_path / "dense.pcd"
    path.write_bytes(header.encode() + struct.pack("<II", 2, 32_000_000) + b"\x00\x00")  # would decode to 32 MB
    with point_limit(1_000_000), pytest.raises(PointCloudError, match="2,000,000 points is over the 1,000,000-point limit"):
        read_points(path)
    with pytest.raises(PointCloudError, match="LZF stream decoded to 1 bytes"):  # past the header: the default limit
        read_points(path)
    np.save(tmp_path / "dense.npy", np.zeros((1_200_000, 4), np.float32))
    with point_limit(1_000_000), pytest.raises(PointCloudError, match="1,200,000 points is over the 1,000,000-point"):
        read_points(tmp_path / "dense.npy")


def lzf_compress(data: bytes) -> bytes:
    """Minimal LZF encoder for the test: greedy back-references to offsets 1..64, else literals."""
    out, literal, i = bytearray(), bytearray(), 0

    def flush() -> None:
        for k in range(0, len(literal), 32):
            chunk = literal[k : k + 32]
            out.append(len(chunk) - 1)
            out.extend(chunk)
        literal.clear()

    while i < len(data):
        best_len, best_off = 0, 0
        for off in range(1, min(i, 64) + 1):
            n = 0
            while i + n < len(data) and n < 264 and data[i + n] == data[i + n - off]:
                n += 1
            if n > best_len:
                best_len, best_off = n, off
        if best_len >= 3:
            flush()
            length, distance = best_len - 2, best_off - 1
            if length < 7:
                out.append((length << 5) | (distance >> 8))
            else:
                out += bytes([(7 << 5) | (distance >> 8), length - 7])
            out.append(distance & 0xFF)
            i += best_len
        else:
            literal.append(data[i])
            i += 1
    flush()
    return bytes(out)


def test_pcd_binary_compressed_is_decoded(tmp_path):
    points, ring = sweep(VLP16.with_width(64), seed=3)
    points[:, 3] = 0.5  # a constant column compresses into long back-references
    fields = [points[:, k].astype("<f4").tobytes() for k in range(4)] + [ring.astype("<u2").tobytes()]
    raw = b"".join(fields)
    packed = lzf_compress(raw)
    assert len(packed) < len(raw)
    header = (
        "# .PCD v0.7\nVERSION 0.7\nFIELDS x y z intensity ring\nSIZE 4 4 4 4 2\nTYPE F F F F U\nCOUNT 1 1 1 1 1\n"
        f"WIDTH {len(points)}\nHEIGHT 1\nVIEWPOINT 0 0 0 1 0 0 0\nPOINTS {len(points)}\nDATA binary_compressed\n"
    )
    path = tmp_path / "c.pcd"
    path.write_bytes(header.encode() + struct.pack("<II", len(packed), len(raw)) + packed)
    scan = read_points(path)
    assert scan.format == "pcd-binary_compressed"
    np.testing.assert_array_equal(scan.points, points)
    np.testing.assert_array_equal(scan.ring, ring)


def test_pcd_with_reflectance_field_and_padding_reads_intensity(tmp_path):
    header = (
        "VERSION 0.7\nFIELDS x y z _ reflectance\nSIZE 4 4 4 1 4\nTYPE F F F U F\nCOUNT 1 1 1 4 1\n"
        "WIDTH 2\nHEIGHT 1\nPOINTS 2\nDATA ascii\n"
    )
    path = tmp_path / "r.pcd"
    path.write_text(header + "1 2 3 0 0 0 0 128\n4 5 6 0 0 0 0 255\n")
    scan = read_points(path)
    np.testing.assert_allclose(scan.points, [[1, 2, 3, 128 / 255], [4, 5, 6, 1.0]], rtol=1e-6)
    assert scan.intensity_scale == 255.0


def test_pcd_without_fields_line_is_refused(tmp_path):
    path = tmp_path / "bad.pcd"
    path.write_text("VERSION 0.7\nSIZE 4 4 4\nTYPE F F F\nPOINTS 1\nDATA ascii\n1 2 3\n")
    with pytest.raises(PointCloudError, match=r"bad\.pcd.*lacks FIELDS"):
        read_points(path)


def test_pcd_whose_header_lines_disagree_says_how_many_entries_each_has(tmp_path):
    path = tmp_path / "short.pcd"
    path.write_text("VERSION 0.7\nFIELDS x y z\nSIZE 4 4\nTYPE F F F\nPOINTS 1\nDATA ascii\n1 2 3\n")
    with pytest.raises(PointCloudError, match=r"short\.pcd.*list 3, 2, 3 and 3 entries; expected one entry per field"):
        read_points(path)


def test_ply_big_endian_with_a_face_element_after_the_vertices(tmp_path):
    pts = np.array([[1.0, 2.0, 3.0, 10.0], [4.0, 5.0, 6.0, 20.0], [7.0, 8.0, 9.0, 30.0]], dtype=">f4")
    header = (
        "ply\nformat binary_big_endian 1.0\ncomment from a mesh tool\nelement vertex 3\nproperty float x\n"
        "property float y\nproperty float z\nproperty float intensity\nelement face 1\n"
        "property list uchar int vertex_indices\nend_header\n"
    )
    path = tmp_path / "mesh.ply"
    path.write_bytes(header.encode() + pts.tobytes() + b"\x03" + np.array([0, 1, 2], ">i4").tobytes())
    scan = read_points(path)
    np.testing.assert_allclose(scan.points[:, :3], pts[:, :3])
    np.testing.assert_allclose(scan.points[:, 3], pts[:, 3] / 255.0)


def test_ply_without_vertices_is_refused(tmp_path):
    path = tmp_path / "faces.ply"
    path.write_text("ply\nformat ascii 1.0\nelement face 0\nproperty list uchar int vertex_indices\nend_header\n")
    with pytest.raises(PointCloudError, match=r"faces\.ply.*no 'vertex' element"):
        read_points(path)


def test_npz_with_named_columns_and_npy_without_intensity(tmp_path, cloud):
    points, _ = cloud
    np.savez(tmp_path / "cols.npz", x=points[:, 0], y=points[:, 1], z=points[:, 2], intensity=points[:, 3] * 255)
    scan = read_points(tmp_path / "cols.npz")
    np.testing.assert_allclose(scan.points, points, atol=1e-6)
    np.save(tmp_path / "xyz.npy", points[:, :3])
    scan = read_points(tmp_path / "xyz.npy")
    assert (scan.points[:, 3] == 0).all() and any("no intensity" in n for n in scan.notes)


def test_npz_ring_of_the_wrong_length_is_refused(tmp_path, cloud):
    points, ring = cloud
    np.savez(tmp_path / "short.npz", points=points, ring=ring[:-3])
    with pytest.raises(PointCloudError, match=r"short\.npz.*ring column has .* expected one per point"):
        read_points(tmp_path / "short.npz")


def test_npz_listing_many_members_is_refused_from_its_tail_before_the_directory_is_read(tmp_path):
    import time
    import zipfile

    path = tmp_path / "members.npz"
    with zipfile.ZipFile(path, "w") as archive:
        for i in range(20_000):
            archive.writestr(f"a{i}.npy", b"")
    start = time.perf_counter()
    with pytest.raises(PointCloudError, match=r"members\.npz.*20000 members.*at most 64"):
        read_points(path)
    assert time.perf_counter() - start < 0.05  # zipfile alone takes ~0.1 s to list 20,000 entries


def test_npz_without_points_is_refused(tmp_path):
    np.savez(tmp_path / "other.npz", a=np.zeros(3), b=np.ones(3))
    with pytest.raises(PointCloudError, match=r"other\.npz.*expected 'points'"):
        read_points(tmp_path / "other.npz")


# 6. organised scans and sensor detection ----------------------------------------------------------------------


@pytest.mark.parametrize("order", ["column-major", "row-major"])
def test_organised_dump_gets_its_ring_from_the_point_order(tmp_path, order):
    sensor = OS1_64.with_width(512)
    dirs = sensor.ray_directions()
    ranges = np.random.default_rng(4).uniform(2.0, 40.0, size=sensor.shape)
    grid = dirs * ranges[..., None]
    xyz = grid.transpose(1, 0, 2).reshape(-1, 3) if order == "column-major" else grid.reshape(-1, 3)
    expected = np.tile(np.arange(64), 512) if order == "column-major" else np.repeat(np.arange(64), 512)
    np.save(tmp_path / "org.npy", np.concatenate([xyz, np.full((len(xyz), 1), 300.0)], axis=1))
    scan = read_points(tmp_path / "org.npy")
    np.testing.assert_array_equal(scan.ring, expected)
    assert any(order in n for n in scan.notes)


def test_shuffled_cloud_is_not_mistaken_for_an_organised_one(tmp_path):
    sensor = OS1_64.with_width(512)
    xyz = (sensor.ray_directions() * 10.0).reshape(-1, 3)
    shuffle = np.random.default_rng(5).permutation(len(xyz))
    np.save(tmp_path / "shuffled.npy", xyz[shuffle])
    scan = read_points(tmp_path / "shuffled.npy")
    assert scan.ring_source == "elevation clusters"
    assert not any("organised" in n for n in scan.notes)
    np.testing.assert_array_equal(scan.ring, np.repeat(np.arange(64), 512)[shuffle])


@pytest.mark.parametrize("preset", [HDL64, HDL32, VLP16, OS1_64, OS1_128])
def test_detect_sensor_finds_each_preset_without_a_ring(tmp_path, preset):
    points, _ = sweep(preset, seed=6, keep=0.95)
    scan = read_points(write_points(tmp_path / "s.bin", points))
    sensor = detect_sensor(scan)
    assert sensor is not None and sensor.name == f"{preset.name}-measured"
    np.testing.assert_allclose(sensor.elevations_deg, preset.elevations_deg, atol=1e-3)
    assert sensor.width == preset.width
    assert (sensor.min_range, sensor.max_range, sensor.mount_height) == (
        preset.min_range, preset.max_range, preset.mount_height)


def test_detect_sensor_measures_beams_no_preset_has():
    custom = Sensor.from_angles("gen1", np.linspace(16.6, -16.6, 64), width=1024)
    points, ring = sweep(custom, seed=7)
    sensor = detect_sensor(Scan(points=points, ring=ring))
    assert sensor is not None and sensor.name == "os1-64-measured" and sensor.height == 64
    np.testing.assert_allclose(sensor.elevations_deg, custom.elevations_deg, atol=1e-3)
    assert sensor.name not in PRESETS


def test_scan_with_its_origin_on_the_ground_is_flagged_and_gets_no_sensor(tmp_path):
    points, _ = sweep(HDL64, seed=8)
    points[:, 2] += HDL64.mount_height  # move the origin from the sensor down to the road
    scan = read_points(write_points(tmp_path / "ego.bin", points))
    assert not scan.sensor_frame
    assert any("not in the sensor frame" in n for n in scan.notes)
    assert detect_sensor(scan) is None


# 7. decompression bombs: refused from their headers, before anything is inflated ---------------------------


#: Reads each file in a fresh interpreter: (seconds, peak RSS growth in bytes, error message or None). The
#: peak is the kernel's VmHWM, reset before each file (`ru_maxrss` would start at pytest's own peak: it
#: survives the exec).
_MEASURE = """
import json, sys, time
from pathlib import Path
from lidar.formats import read_points

def peak():
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024

out = {}
for path in sys.argv[1:]:
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from the current RSS
    before = peak()
    start = time.perf_counter()
    try:
        read_points(path)
        error = None
    except ValueError as err:
        error = str(err)
    out[path] = [time.perf_counter() - start, peak() - before, error]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bomb_reads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[float, int, str | None]]:
    """Each bomb read once in one subprocess, so its peak memory is measured apart from pytest's."""
    folder = tmp_path_factory.mktemp("bombs")
    paths = {kind: str(make(folder / f"bomb.{kind}")) for kind, make in BOMBS.items()}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *paths.values()], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300, check=True)
    measured = json.loads(proc.stdout)
    return {kind: tuple(measured[path]) for kind, path in paths.items()}


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("npz", r"bomb\.npz: the \.npz archive would decode to 268 MB, over the 200 MB limit"),
        ("pcd", r"LZF stream decodes past the 16000 bytes the header says"),
        ("laz", r"LAS point records \(4,000,000 of 67 bytes\) would decode to 268 MB, over the 200 MB limit"),
        ("ply", r"PLY ASCII vertex element is not 4,000,000 rows of 3 numbers"),
    ],
)
def test_a_decompression_bomb_is_refused_fast_and_small(bomb_reads, kind, message):
    seconds, grown, error = bomb_reads[kind]
    print(f"\n{kind} bomb: refused in {seconds * 1e3:.1f} ms, peak RSS +{grown / 2**20:.1f} MiB")
    assert error is not None, f"the {kind} bomb was accepted"
    assert re.search(message, error), error
    assert seconds < 1.0, f"the {kind} bomb took {seconds:.2f} s to refuse"
    assert grown < 100 * 2**20, f"the {kind} bomb grew the reader's memory by {grown / 2**20:.0f} MiB"


def test_npz_member_whose_header_promises_more_than_it_stores_is_refused(tmp_path):
    path = tmp_path / "forged.npz"
    with zipfile.ZipFile(path, "w") as zf, zf.open("points.npy", "w") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": (1000, 1_000_000)})
        f.write(bytes(64))
    with pytest.raises(PointCloudError, match=r"forged\.npz: \.npy header of member 'points\.npy' promises"):
        read_points(path)


def test_pcd_size_word_that_disagrees_with_the_header_is_refused(tmp_path):
    header = "VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nCOUNT 1 1 1\nWIDTH 10\nHEIGHT 1\nPOINTS 10\nDATA binary_compressed\n"
    path = tmp_path / "words.pcd"
    path.write_bytes(header.encode() + struct.pack("<II", 3, 2**31) + b"\x00\x00\x00")
    with pytest.raises(PointCloudError, match=r"size word says 2,147,483,648 bytes but the header declares 10 points of 12 bytes"):
        read_points(path)


def test_pcd_with_huge_per_field_counts_is_refused_before_parsing(tmp_path):
    header = "VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nCOUNT 1 1 100000000\nPOINTS 2\nDATA ascii\n"
    path = tmp_path / "wide.pcd"
    path.write_bytes(header.encode() + b"1 2 3\n" * 2)
    with pytest.raises(PointCloudError, match=r"wide\.pcd: the PCD body .* would decode to 800 MB, over the 200 MB limit"):
        read_points(path)


# 8. hostile headers: what a reader allocates is bounded from the header, before anything is expanded -----


@pytest.fixture(scope="module")
def hostile_reads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[float, int, str | None]]:
    """Each hostile file read once in one subprocess (a LAZ decoder that aborts would take pytest with it)."""
    folder = tmp_path_factory.mktemp("hostile")
    paths = {name: str(make(folder / name)) for name, make in HOSTILE.items()}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *paths.values()], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300, check=True)
    measured = json.loads(proc.stdout)
    return {name: tuple(measured[path]) for name, path in paths.items()}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("chunks.laz", r"chunks\.laz: the LAZ chunk table lists 4,294,967,295 chunks; 50,000 points need 1 to 1$"),
        ("subarray.npz", r"subarray\.npz: 6,400,000 points is over the 5,000,000-point limit"),
        ("subarray.pcd", r"subarray\.pcd: 6,400,000 points is over the 5,000,000-point limit"),
        ("properties.ply", r"ending with 'end_header' within its first 65,536 bytes"),
        ("fields.pcd", r"fields\.pcd: PCD header has no DATA line in its first 65,536 bytes"),
    ],
)
def test_a_header_promising_a_huge_allocation_is_refused_in_milliseconds(hostile_reads, name, message):
    seconds, grown, error = hostile_reads[name]
    print(f"\n{name}: refused in {seconds * 1e3:.1f} ms, peak RSS +{grown / 2**20:.1f} MiB")
    assert error is not None and re.search(message, error), error
    assert len(error) < 300
    assert seconds < 0.1, f"{name} took {seconds:.2f} s to refuse"
    assert grown < 20 * 2**20, f"{name} grew the reader's memory by {grown / 2**20:.0f} MiB"


def test_las_extra_dimensions_are_named_but_only_a_sweeps_are_scaled(hostile_reads):
    """300,000 points with 180 scaled extra-byte dimensions: the raw records take 63 MB; scaling every
    dimension would add 432 MB of float64."""
    seconds, grown, error = hostile_reads["extra.laz"]
    print(f"\nextra.laz: read in {seconds * 1e3:.0f} ms, peak RSS +{grown / 2**20:.0f} MiB")
    assert error is None
    assert grown < 160 * 2**20, f"reading grew the reader's memory by {grown / 2**20:.0f} MiB"


def test_extra_dimensions_are_listed_as_columns_and_a_ring_among_them_is_used(tmp_path):
    header = laspy.LasHeader(point_format=6, version="1.4")
    for name in ("amplitude", "laser_id", "deviation"):
        header.add_extra_dim(laspy.ExtraBytesParams(name=name, type=np.uint8))
    points, _ = sweep(VLP16.with_width(128), seed=3)
    las = laspy.LasData(header)
    las.x, las.y, las.z = (points[:, k].astype(np.float64) for k in range(3))
    las.laser_id = np.arange(len(points)) % 16
    las.write(tmp_path / "extra.laz")
    scan = read_points(tmp_path / "extra.laz")
    assert scan.columns == ("x", "y", "z", "intensity", "amplitude", "laser_id", "deviation")
    np.testing.assert_array_equal(scan.ring, np.arange(len(points)) % 16)


def test_a_header_of_many_fields_without_x_y_z_gets_a_short_message(tmp_path):
    path = pcd_many_fields(tmp_path / "wide.pcd", fields=250)
    with pytest.raises(PointCloudError, match=r"no x/y/z field among \['f0', 'f1', .*, and 238 more\]") as err:
        read_points(path)
    assert len(str(err.value)) < 400
    with pytest.raises(PointCloudError, match=r"declares 300 fields; expected at most 256"):
        read_points(pcd_many_fields(tmp_path / "wider.pcd", fields=300))


def test_a_field_whose_sub_arrays_fit_the_limit_reads_as_that_many_points(tmp_path):
    """COUNT 4 on x, y and z: four points a row, as many as the file holds."""
    header = "VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nCOUNT 4 4 4\nWIDTH 300\nHEIGHT 1\nPOINTS 300\nDATA binary\n"
    rng = np.random.default_rng(0)
    values = rng.uniform(3.0, 30.0, size=(300, 12)).astype("<f4")
    path = tmp_path / "packed.pcd"
    path.write_bytes(header.encode() + values.tobytes())
    scan = read_points(path)
    assert scan.num_points == 1200
    np.testing.assert_array_equal(scan.points[:4, 0], values[0, :4])
    wrong = header.replace("COUNT 4 4 4", "COUNT 4 4 3").replace("SIZE 4 4 4", "SIZE 4 4 4")
    path.write_bytes(wrong.encode() + values[:, :11].tobytes())
    with pytest.raises(PointCloudError, match=r"field 'x' holds 1,200 values but 'z': 900; expected one value"):
        read_points(path)


def test_a_laz_chunk_table_that_disagrees_with_the_file_is_refused(tmp_path):
    points, _ = sweep(VLP16.with_width(128), seed=4)
    path = write_points(tmp_path / "scan.laz", points)
    blob = bytearray(path.read_bytes())
    point_offset = struct.unpack_from("<I", blob, 96)[0]
    table = struct.unpack_from("<q", blob, point_offset)[0]
    struct.pack_into("<q", blob, point_offset, len(blob) + 100)  # the offset past the file's end
    struct.pack_into("<q", blob, len(blob) - 8, 0)
    path.write_bytes(bytes(blob))
    with pytest.raises(PointCloudError, match=r"scan\.laz: the LAZ chunk table offset points outside the file"):
        read_points(path)
    struct.pack_into("<q", blob, point_offset, table)
    struct.pack_into("<I", blob, table + 4, 0)
    path.write_bytes(bytes(blob))
    with pytest.raises(PointCloudError, match=rf"lists 0 chunks; {len(points):,} points need 1 to 1$"):
        read_points(path)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("long-name", r"long-name\.zip: a member's name 'a+'… \(300 characters\) is longer than 255 bytes"),
        ("not-utf8", r"not-utf8\.zip: not a readable zip \(corrupt directory\)"),
        ("lzma-properties", r"lzma-properties\.zip: cannot unpack 000000\.bin: its data is corrupt \(a bad checksum or LZMA stream\)"),
        ("bzip2-stream", r"bzip2-stream\.zip: cannot unpack 000000\.bin: its data is corrupt \(a bad checksum or bzip2 stream\)"),
        ("lzma-dictionary", r"lzma-dictionary\.zip: the LZMA member '000000\.bin' asks for a 4,294,967,295-byte dictionary"),
    ],
)
def test_a_broken_zip_is_an_input_error_naming_it(tmp_path, kind, message):
    path = broken_zip(tmp_path / f"{kind}.zip", kind)
    with pytest.raises(PointCloudError, match=message) as err:
        read_sequence(path)
    assert len(str(err.value)) < 300
    npz = path.with_suffix(".npz")  # the same bytes as an archive of arrays
    npz.write_bytes(path.read_bytes())
    with pytest.raises(PointCloudError, match=re.escape(str(npz))):
        read_points(npz)
