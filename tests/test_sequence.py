"""lidar.sequence: folders, zips and file lists of sweeps in frame order, KITTI and LidarVerse poses, bounds."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

import lidar.sequence as sequence
from lidar.formats import PointCloudError, write_points
from lidar.sequence import NOMINAL_KITTI_TR, kitti_velodyne_poses, read_poses, read_sequence


def _sweep(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    az = rng.uniform(-np.pi, np.pi, 2000)
    r = rng.uniform(5, 30, 2000)
    return np.stack([r * np.cos(az), r * np.sin(az), rng.uniform(-1.7, 2.0, 2000), rng.uniform(0, 1, 2000)], 1)


def _yaw_pose(x: float, yaw_deg: float) -> np.ndarray:
    c, s = np.cos(np.radians(yaw_deg)), np.sin(np.radians(yaw_deg))
    pose = np.eye(4)
    pose[:2, :2] = [[c, -s], [s, c]]
    pose[0, 3] = x
    return pose


@pytest.fixture
def kitti_folder(tmp_path: Path) -> Path:
    """000004.bin, 000000.bin, 000002.bin (written out of order) and a poses.txt of five camera poses."""
    folder = tmp_path / "seq"
    folder.mkdir()
    for frame in (4, 0, 2):
        write_points(folder / f"{frame:06d}.bin", _sweep(frame))
    velo = np.stack([_yaw_pose(0.8 * i, 2.0 * i) for i in range(5)])
    cam = NOMINAL_KITTI_TR @ velo @ np.linalg.inv(NOMINAL_KITTI_TR)
    (folder / "poses.txt").write_text("\n".join(" ".join(f"{v:.9e}" for v in p[:3].ravel()) for p in cam) + "\n")
    (folder / "README.md").write_text("not a sweep")
    return folder


def test_a_kitti_folder_is_read_in_frame_order_with_poses_of_its_frame_numbers(kitti_folder: Path) -> None:
    seq = read_sequence(kitti_folder)
    assert seq.names == ["000000.bin", "000002.bin", "000004.bin"]
    assert seq.poses is not None
    np.testing.assert_allclose(seq.poses[:, 0, 3], [0.0, 1.6, 3.2], atol=1e-6)  # lines 0, 2, 4; +x forward
    np.testing.assert_allclose(seq.poses[2], _yaw_pose(3.2, 8.0), atol=1e-6)


def test_kitti_calib_tr_is_used_when_it_sits_beside_poses_txt(kitti_folder: Path) -> None:
    tr = NOMINAL_KITTI_TR.copy()
    tr[:3, 3] = (-0.01, -0.05, -0.29)  # the lever arm of KITTI 00-02
    velo = np.stack([_yaw_pose(0.8 * i, 10.0 * i) for i in range(5)])
    cam = tr @ velo @ np.linalg.inv(tr)
    (kitti_folder / "poses.txt").write_text("\n".join(" ".join(map(str, p[:3].ravel())) for p in cam))
    (kitti_folder / "calib.txt").write_text("P0: " + " ".join(["0"] * 12) + "\nTr: " + " ".join(map(str, tr[:3].ravel())))
    np.testing.assert_allclose(read_sequence(kitti_folder).poses, velo[[0, 2, 4]], atol=1e-9)
    np.testing.assert_allclose(kitti_velodyne_poses(cam, tr), velo, atol=1e-9)


def test_a_zip_is_flattened_by_base_name_so_no_member_escapes(tmp_path: Path, kitti_folder: Path) -> None:
    archive = tmp_path / "upload.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.write(kitti_folder / "000000.bin", "../../000000.bin")
        zf.write(kitti_folder / "000002.bin", "/abs/000002.bin")
        zf.write(kitti_folder / "000004.bin", "drive/velodyne/000004.bin")
        zf.writestr("__MACOSX/._000000.bin", b"junk")
        zf.writestr("notes.txt", b"ignored")
    seq = read_sequence(archive)
    assert seq.names == ["000000.bin", "000002.bin", "000004.bin"] and seq.poses is None
    assert not list(tmp_path.glob("000000.bin")) and not Path("/abs/000002.bin").exists()


def test_a_zip_with_two_members_of_one_name_is_refused(tmp_path: Path, kitti_folder: Path) -> None:
    archive = tmp_path / "dup.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.write(kitti_folder / "000000.bin", "a/000000.bin")
        zf.write(kitti_folder / "000002.bin", "b/000000.bin")
    with pytest.raises(PointCloudError, match=r"two entries are named '000000\.bin'"):
        read_sequence(archive)


def test_sizes_are_bounded_before_reading(tmp_path: Path, kitti_folder: Path, monkeypatch) -> None:
    monkeypatch.setattr(sequence, "MAX_SWEEPS", 2)
    with pytest.raises(PointCloudError, match="3 sweeps; a sequence may hold at most 2"):
        read_sequence(kitti_folder)
    monkeypatch.setattr(sequence, "MAX_SWEEPS", 50)
    monkeypatch.setattr(sequence, "MAX_SEQUENCE_BYTES", 50_000)
    with pytest.raises(PointCloudError, match="add up to over"):
        read_sequence(kitti_folder)
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("000000.bin", bytes(60_000))
    with pytest.raises(PointCloudError, match="inflates past the limit"):
        read_sequence(bomb)
    monkeypatch.setattr(sequence, "MAX_ZIP_MEMBERS", 3)
    many = tmp_path / "many.zip"
    with zipfile.ZipFile(many, "w") as zf:
        for i in range(4):
            zf.writestr(f"{i}.txt", b"")
    with pytest.raises(PointCloudError, match="4 entries; a sequence zip may hold at most 3"):
        read_sequence(many)


def test_poses_json_from_our_own_rollouts_is_matched_by_file_name(tmp_path: Path) -> None:
    poses = [_yaw_pose(i, 0.0) for i in range(3)]
    meta = {
        "prefix": [{"file": "000000.bin", "pose": poses[0].tolist()}],
        "frames": [{"index": i, "file": f"frame_{i:03d}.bin", "pose": poses[i].tolist()} for i in (1, 2)],
    }
    path = tmp_path / "poses.json"
    path.write_text(json.dumps(meta))
    got = read_poses(path, ["frame_002.bin", "000000.bin"])
    np.testing.assert_allclose(got, [poses[2], poses[0]])
    with pytest.raises(PointCloudError, match=r"no pose for x\.bin"):
        read_poses(path, ["x.bin"])


def test_a_rollout_folder_reads_its_frames_not_its_world(tmp_path: Path) -> None:
    for i in range(2):
        write_points(tmp_path / f"frame_{i:03d}.bin", _sweep(i))
    write_points(tmp_path / "world.bin", _sweep(9))
    frames = [{"index": i, "file": f"frame_{i:03d}.bin", "pose": _yaw_pose(i, 0).tolist()} for i in range(2)]
    (tmp_path / "poses.json").write_text(json.dumps({"frames": frames, "world": "world.bin"}))
    seq = read_sequence(tmp_path)
    assert seq.names == ["frame_000.bin", "frame_001.bin"]
    np.testing.assert_allclose(seq.poses[1, 0, 3], 1.0)


def test_bad_poses_files_name_what_was_expected(tmp_path: Path) -> None:
    bad = tmp_path / "poses.txt"
    bad.write_text("1 2 3\n")
    with pytest.raises(PointCloudError, match="expected 12"):
        read_poses(bad, ["000000.bin"])
    bad.write_text(" ".join(["2"] * 12))
    with pytest.raises(ValueError, match="pose 0 is not a finite rigid transform"):
        read_poses(bad, ["000000.bin"])
    bad.write_text("[[1, 2]]")
    with pytest.raises(ValueError, match=r"expected \(N, 4, 4\)"):
        read_poses(bad, ["000000.bin"])
    with pytest.raises(PointCloudError, match="no such poses file"):
        read_poses(tmp_path / "missing.txt", ["a.bin"])


def test_a_bad_member_is_named_inside_its_zip_not_by_a_scratch_path(tmp_path: Path) -> None:
    archive = tmp_path / "upload.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("drive/000000.bin", b"\x01\x02\x03")
    with pytest.raises(PointCloudError, match=r"^upload\.zip:000000\.bin: ") as err:
        read_sequence(archive)
    assert "lidarverse_zip_" not in str(err.value)
