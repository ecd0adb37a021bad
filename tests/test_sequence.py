"""lidar.sequence: folders, zips and file lists of sweeps in frame order, KITTI and LidarVerse poses, bounds."""

from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import lidar.sequence as sequence
from lidar.errors import InputError
from lidar.formats import PointCloudError, point_limit, write_points
from lidar.sequence import NOMINAL_KITTI_TR, kitti_velodyne_poses, read_poses, read_sequence
from lidar.vocabulary import check_poses
from tests.helpers import directory_only_zip, patched_zip, sweep_points


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
        write_points(folder / f"{frame:06d}.bin", sweep_points(frame))
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
        write_points(tmp_path / f"frame_{i:03d}.bin", sweep_points(i))
    write_points(tmp_path / "world.bin", sweep_points(9))
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


# ----------------------------------------------------------------------------------------------------------
# Hostile archives and pose files: refused fast, by size or shape, with a message and no internals


def test_a_million_entry_zip_is_refused_from_its_end_record_before_zipfile_reads_it(tmp_path: Path) -> None:
    assert len(zipfile.ZipFile(directory_only_zip(tmp_path / "small.zip", 70_000)).infolist()) == 70_000  # real
    bomb = directory_only_zip(tmp_path / "many.zip", 1_048_575)
    assert bomb.stat().st_size > 48_000_000
    start = time.perf_counter()
    with pytest.raises(PointCloudError, match=r"many\.zip: 65,535 or more entries; a sequence zip may hold at most 200"):
        read_sequence(bomb)
    assert time.perf_counter() - start < 0.5, "the directory was parsed before the entry count was checked"


@pytest.mark.parametrize(("kind", "message"), [
    ("encrypted", "it is encrypted; expected an unencrypted zip"),
    ("method", "its compression method is not supported; expected stored or deflated entries"),
    ("corrupt", r"its data is corrupt \(a bad checksum or deflate stream\)"),
])
def test_an_encrypted_unknown_or_corrupt_member_is_refused_with_a_message(tmp_path: Path, kind: str, message: str):
    member = sweep_points(0).astype(np.float32).tobytes()
    archive = patched_zip(tmp_path / f"{kind}.zip", member, flag=1 if kind == "encrypted" else 0,
                           method=99 if kind == "method" else None, corrupt=kind == "corrupt")
    with pytest.raises(PointCloudError, match=rf"^{kind}\.zip: cannot unpack 000000\.bin: {message}$"):
        read_sequence(archive)


def test_pose_and_calibration_members_are_capped_before_parsing(tmp_path: Path, kitti_folder: Path) -> None:
    archive = tmp_path / "big_poses.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(kitti_folder / "000000.bin", "000000.bin")
        zf.writestr("poses.txt", ("1 0 0 0 0 1 0 0 0 0 1 0\n" * 200_000).encode())  # 4.8 MB, a 20 KB member
    assert archive.stat().st_size < 400_000
    with pytest.raises(PointCloudError, match=r"poses\.txt inflates past the limit \(a poses or calibration file <= "):
        read_sequence(archive)
    (kitti_folder / "calib.txt").write_text("Tr: " + "1 " * 600_000)
    with pytest.raises(PointCloudError, match=r"calib\.txt: over 1,048,576 bytes, too large for a calib\.txt"):
        read_sequence(kitti_folder)
    (kitti_folder / "calib.txt").unlink()
    big = kitti_folder / "poses.json"
    big.write_text("[" + " " * (sequence.MAX_TEXT_BYTES + 10) + "]")
    with pytest.raises(PointCloudError, match=r"poses\.json: over 1,048,576 bytes, too large for a poses\.json"):
        read_sequence(kitti_folder)


def test_a_fifo_poses_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "poses.txt"
    os.mkfifo(fifo)
    with pytest.raises(PointCloudError, match=r"no such poses file \(or not a regular file\)"):
        read_poses(fifo, ["000000.bin"])


@pytest.mark.parametrize(("text", "message"), [
    pytest.param("[" * 500_000, "JSON nested too deeply; expected a poses file", id="nesting-bomb"),
    ("[" + "9" * 5000 + "]", "JSON holds an integer too long to read; expected a poses file"),
    ('[{"x": 1}]', r"each pose must be a 4x4 list of numbers"),
    ('{"frames": [{"file": "000000.bin", "pose": {"x": 1}}]}', r"each pose must be a 4x4 list of numbers"),
    ('{"frames": 3}', r"expected a LidarVerse poses.json with frames\[\*\].file/pose"),
    ("[[[1, 0, 0, 1e308], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]]",
     r"pose 0 lies 1e\+308 m from the origin; expected poses within 100 km"),
])
def test_hostile_json_poses_are_refused_with_a_message_free_of_python_internals(tmp_path: Path, text: str,
                                                                                message: str) -> None:
    path = tmp_path / "poses.json"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as err:  # PointCloudError for the file, InputError for a pose
        read_poses(path, ["000000.bin"])
    assert "recursion" not in str(err.value) and "4300" not in str(err.value) and "sys.set" not in str(err.value)


def test_poses_past_100_km_are_refused_even_as_numbers(tmp_path: Path) -> None:
    far = _yaw_pose(150_000.0, 0.0)
    with pytest.raises(InputError, match=r"pose 1 lies 1\.5e\+05 m from the origin"):
        check_poses(np.stack([np.eye(4), far]), "poses")
    near = _yaw_pose(99_000.0, 30.0)
    assert check_poses(near[None], "poses").shape == (1, 4, 4)


def test_a_json_list_of_poses_in_a_folder_or_zip_poses_its_sweeps(tmp_path: Path, kitti_folder: Path) -> None:
    (kitti_folder / "poses.txt").unlink()
    poses = np.stack([_yaw_pose(1.5 * i, 5.0 * i) for i in range(3)])
    (kitti_folder / "poses.json").write_text(json.dumps(poses.tolist()))
    np.testing.assert_allclose(read_sequence(kitti_folder).poses, poses)
    archive = tmp_path / "listed.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(kitti_folder.iterdir()):
            zf.write(path, path.name)
    np.testing.assert_allclose(read_sequence(archive).poses, poses)


def _kitti_odometry(folder: Path, frames: int = 4) -> np.ndarray:
    """A sequence in the KITTI odometry layout (velodyne/, poses.txt, calib.txt, times.txt); its Velodyne poses."""
    (folder / "velodyne").mkdir(parents=True)
    for frame in range(frames):
        write_points(folder / "velodyne" / f"{frame:06d}.bin", sweep_points(frame))
    tr = NOMINAL_KITTI_TR.copy()
    tr[:3, 3] = (-0.01, -0.05, -0.29)
    velo = np.stack([_yaw_pose(0.9 * i, 1.5 * i) for i in range(frames)])
    cam = tr @ velo @ np.linalg.inv(tr)
    (folder / "poses.txt").write_text("\n".join(" ".join(f"{v:.12e}" for v in p[:3].ravel()) for p in cam) + "\n")
    (folder / "calib.txt").write_text("P0: " + " ".join(["0"] * 12) + "\nTr: " + " ".join(f"{v:.12e}" for v in tr[:3].ravel()) + "\n")
    (folder / "times.txt").write_text("".join(f"{0.1037 * i:.6e}\n" for i in range(frames)))
    return velo


def test_a_recording_in_the_kitti_odometry_layout_opens_with_calibrated_poses_and_times(tmp_path: Path) -> None:
    velo = _kitti_odometry(tmp_path / "00")
    rec = sequence.open_recording(tmp_path / "00")
    assert rec.names == [f"{i:06d}.bin" for i in range(4)] and len(rec) == 4
    np.testing.assert_allclose(rec.poses, velo, atol=1e-9)  # Tr's lever arm undone exactly
    np.testing.assert_allclose(rec.times, 0.1037 * np.arange(4), atol=1e-9)
    np.testing.assert_allclose(rec.sweep(2).points, sweep_points(2).astype(np.float32))
    # read_sequence (the app's bounded reader) takes the same layout
    np.testing.assert_allclose(read_sequence(tmp_path / "00").poses, velo, atol=1e-9)


def test_a_recording_with_a_json_list_of_poses_or_none_opens(tmp_path: Path) -> None:
    for frame in range(3):
        write_points(tmp_path / f"frame_{frame:03d}.bin", sweep_points(frame))
    assert sequence.open_recording(tmp_path).poses is None  # bare sweeps: the caller registers them
    poses = np.stack([_yaw_pose(i, 3.0 * i) for i in range(3)])
    (tmp_path / "poses.json").write_text(json.dumps(poses.tolist()))
    rec = sequence.open_recording(tmp_path)
    np.testing.assert_allclose(rec.poses, poses)
    assert rec.times is None
    (tmp_path / "times.txt").write_text("0.0\nabc\n")
    with pytest.raises(InputError, match=r"times\.txt"):
        sequence.open_recording(tmp_path)


def test_an_empty_recording_folder_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no sweep files"):
        sequence.open_recording(tmp_path)


@pytest.mark.skipif(not (Path(__file__).resolve().parents[2] / "shared/data/real_seq/kitti00").is_dir(),
                    reason="the shared KITTI 00 frames are not beside the checkout")
def test_the_shared_kitti00_frames_open_with_the_ground_truth_poses() -> None:
    rec = sequence.open_recording(Path(__file__).resolve().parents[2] / "shared/data/real_seq/kitti00")
    assert len(rec) == 16 and rec.poses is not None and rec.times is not None
    steps = np.linalg.norm(np.diff(rec.poses[:, :3, 3], axis=0), axis=1)
    np.testing.assert_allclose(steps, 0.86, atol=0.03)  # the README: a steady 0.86 m per frame by the file
    assert np.abs(rec.poses[:, 2, 3]).max() < 0.5  # Velodyne frame: z up, the road stays level


def test_a_sequence_holds_at_most_four_full_clouds_of_points(tmp_path: Path) -> None:
    """50 sweeps each declaring a full cloud in a few KB (LZF back-references) cost the app 19 s and 2 GB."""
    for i in range(6):
        write_points(tmp_path / f"{i:06d}.bin", sweep_points(i))  # 2,000 points each
    with point_limit(2500), pytest.raises(PointCloudError, match=r"000005\.bin: the first 6 sweeps hold 12,000 points; "
                                                                   r"a sequence may hold at most 10,000"):
        read_sequence(tmp_path)
    assert len(read_sequence(tmp_path).scans) == 6  # the default limit: 4 x 5 M points


def test_a_kitti_raw_drive_opens_with_its_clock_times_and_no_poses(tmp_path: Path) -> None:
    drive = tmp_path / "2011_09_26_drive_0005_sync"
    data = drive / "velodyne_points" / "data"
    data.mkdir(parents=True)
    for frame in (2, 0, 1):
        write_points(data / f"{frame:010d}.bin", sweep_points(frame))
    clock = ["2011-09-26 13:02:25.964389445", "2011-09-26 13:02:26.068074710", "2011-09-26 13:02:26.171721110"]
    (drive / "velodyne_points" / "timestamps.txt").write_text("\n".join(clock) + "\n")
    rec = sequence.open_recording(drive)
    assert rec.names == [f"{i:010d}.bin" for i in range(3)] and rec.poses is None  # registered by the caller
    np.testing.assert_allclose(rec.times, [0.0, 0.103685265, 0.207331665], atol=1e-9)
    np.testing.assert_array_equal(rec[1].points, sweep_points(1).astype(np.float32))
    (drive / "velodyne_points" / "timestamps.txt").write_text("\n".join(clock[:2]) + "\n")
    with pytest.raises(InputError, match="2 clock times, but the sweeps need frame 2"):
        sequence.open_recording(drive)
    (drive / "velodyne_points" / "timestamps.txt").write_text("yesterday\n" * 3)
    with pytest.raises(InputError, match=r"timestamps\.txt"):
        sequence.open_recording(drive)
