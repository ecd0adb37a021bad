"""lidar.registration: KITTI seq-00 sweeps register with the car's forward motion; unrelated sweeps are refused."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from lidar.formats import read_points
from lidar.real_scans import real_scans_dir
from lidar.registration import RegisterConfig, RegistrationError, register_sweeps

REAL_SCANS = real_scans_dir()
KITTI_SEQ00 = [f"kitti_patchworkpp_{i:06d}.bin" for i in (0, 2, 4)]
#: KITTI records at 10 Hz; frames 0, 2, 4 are 0.2 s apart.
SECONDS_APART = 0.2
UNRELATED = [
    "ouster_oustersdk_OS-1-128_v2.3.0_1024x10_lb_n3.bin",
    "nuscenes_lidaraisolution_ff9eff4389a740848f9a56ad749a4ae8.bin",
    "kitti_pointpillars_000134.bin",
]

pytestmark = pytest.mark.skipif(not REAL_SCANS.is_dir(), reason=f"shared real scans not found at {REAL_SCANS}")


@pytest.fixture(scope="module")
def kitti() -> list:
    return [read_points(REAL_SCANS / name) for name in KITTI_SEQ00]


def test_kitti_sweeps_register_with_forward_motion_of_tens_of_centimetres_per_tenth_of_a_second(kitti) -> None:
    reg = register_sweeps(kitti, names=KITTI_SEQ00)
    assert reg.poses.shape == (3, 4, 4) and reg.poses.dtype == np.float64
    np.testing.assert_array_equal(reg.poses[0], np.eye(4))
    steps = np.diff(reg.poses[:, :3, 3], axis=0)
    per_tenth = steps[:, 0] * 0.1 / SECONDS_APART
    assert ((per_tenth > 0.3) & (per_tenth < 1.5)).all(), per_tenth  # a car at 11-54 km/h, as in seq 00
    assert (np.abs(steps[:, 1:]) < 0.2).all(), steps  # straight ahead on a flat road
    yaw = np.degrees(np.arctan2(reg.poses[:, 1, 0], reg.poses[:, 0, 0]))
    assert (np.abs(yaw) < 3).all(), yaw
    assert (reg.fitness[1:] > 0.7).all() and (reg.rmse[1:] < 0.4).all(), (reg.fitness, reg.rmse)
    assert len(reg.summary()) == 3


def test_registration_starts_from_the_given_initial_pose(kitti) -> None:
    start = np.eye(4)
    start[:3, 3] = (10.0, -5.0, 1.7)
    reg = register_sweeps(kitti[:2], initial_pose=start)
    np.testing.assert_array_equal(reg.poses[0], start)
    assert 10.6 < reg.poses[1, 0, 3] < 13.0


@pytest.mark.parametrize("other", UNRELATED)
def test_a_sweep_from_another_place_is_refused_naming_the_file(kitti, other) -> None:
    names = [*KITTI_SEQ00[:2], other]
    with pytest.raises(RegistrationError, match=rf"sweep 2 \({other}\).*fitness 0\.\d+.*below 0\.5"):
        register_sweeps([*kitti[:2], read_points(REAL_SCANS / other)], names=names)


def test_an_empty_sweep_is_refused() -> None:
    with pytest.raises(RegistrationError, match="sweep 0 has only 0 points left for registration"):
        register_sweeps([np.zeros((0, 4), np.float32)])


def test_bad_inputs_name_what_was_expected() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        register_sweeps([])
    with pytest.raises(ValueError, match=r"\(N, 3\+\) points"):
        register_sweeps([np.zeros((5, 2))])
    with pytest.raises(ValueError, match="initial_pose: pose 0 is not a finite rigid"):
        register_sweeps([np.zeros((5, 3))], initial_pose=np.ones((4, 4)))
    with pytest.raises(ValueError, match=r"RegisterConfig\.min_fitness"):
        RegisterConfig(min_fitness=2.0)


def test_a_recording_registers_one_sweep_in_memory_at_a_time(tmp_path, monkeypatch) -> None:
    import lidar.registration as registration
    from lidar.sequence import Recording

    files = []
    for i, name in enumerate(KITTI_SEQ00):
        files.append(tmp_path / f"{i:06d}.bin")
        files[-1].write_bytes((REAL_SCANS / name).read_bytes())
    rec = Recording(files, None, None)
    events: list[str] = []

    class Logged(registration.KissICP):
        def register_frame(self, *args, **kwargs):
            events.append("register")
            return super().register_frame(*args, **kwargs)

    class Watched(Sequence):
        def __len__(self) -> int:
            return len(rec)

        def __getitem__(self, index: int):
            events.append(f"read {index}")
            return rec[index]

    monkeypatch.setattr(registration, "KissICP", Logged)
    streamed = register_sweeps(Watched(), names=rec.names)
    # each sweep is read only once the one before it is registered, so one is held at a time
    assert events == [e for i in range(len(rec)) for e in (f"read {i}", "register")]
    listed = register_sweeps([read_points(f) for f in files])
    np.testing.assert_allclose(streamed.poses, listed.poses, atol=1e-9)
    np.testing.assert_allclose(register_sweeps(rec).poses, listed.poses, atol=1e-9)
    for bad in (slice(0, 2), True):
        with pytest.raises(TypeError, match="sweep number"):
            rec[bad]
    with pytest.raises(TypeError, match="cannot be searched"):
        rec[0] in rec  # noqa: B015
