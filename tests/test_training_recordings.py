"""Training on recorded sequences (no map, no layout, rows the recording's sensor never covered left out of the
loss) and on caches aged by a forecast's horizon."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from inference.flow import flow_matching_loss
from lidar.formats import write_points
from lidar.sensors import HDL64
from lidar.sim import make_world, plan_drive
from lidar.sim.sequence import simulate_sequence
from tests.helpers import TRAIN_SENSOR, tiny_train_config
from training.config import AugmentConfig, TrainConfig
from training.data import Drive, WorldModelSamples, load_recordings

REPO = Path(__file__).resolve().parents[1]
KITTI00 = REPO.parent / "shared" / "data" / "real_seq" / "kitti00"


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six HDL-64E sweeps of a simulated street, sweeps alone with a poses.json (a JSON list of 4x4 poses)."""
    folder = tmp_path_factory.mktemp("rec")
    world = make_world(8, "urban")
    poses = plan_drive(world, "straight", 6, seed=0, mount_height=HDL64.mount_height)
    for i, frame in enumerate(simulate_sequence(world, poses, HDL64, seed=0).frames):
        write_points(folder / f"{i:06d}.bin", frame.points)
    (folder / "poses.json").write_text(json.dumps(poses.tolist()))
    return folder


def test_a_recording_trains_without_map_or_layout_and_only_on_the_rows_its_sensor_saw(recording: Path) -> None:
    cfg = TrainConfig.from_dict(tiny_train_config("", recordings=[str(recording)]))
    drives = load_recordings(cfg.recordings, TRAIN_SENSOR)
    assert len(drives) == 1 and len(drives[0]) == 6 and drives[0].hdmap is None
    seen = drives[0].rows
    elevations = np.degrees(TRAIN_SENSOR.elevations)
    # an HDL-64E looks from +2 to -24.9 deg: the HDL-32E model's rows above +2.7 and below -25.3 are unseen
    np.testing.assert_array_equal(seen, (elevations < 2.7) & (elevations > -25.4))
    samples = WorldModelSamples([], cfg, drives)
    lay = samples.model_cfg
    for it in range(6):
        item = samples[(it, 0, 0)]
        cond = item["cond"].numpy()
        assert (cond[3:6] == -1.0).all() and (cond[6 : 6 + lay.num_map_classes + 1] == 0.0).all()  # no map
        np.testing.assert_array_equal(item["seen"].numpy()[:, 0], seen.astype(np.float32))
        assert (item["x"][0].numpy()[~seen] == -1.0).all()  # nothing recorded there, and it will not be learnt


def test_the_loss_ignores_what_the_target_sensor_never_saw() -> None:
    from tests.helpers import tiny_vlp16_model

    model = tiny_vlp16_model()
    h, w = model.config.sensor_obj.shape
    image = torch.rand(2, 2, h, w) * 2 - 1
    cond = torch.zeros(2, model.config.cond_channels, h, w) - 1
    seen = torch.ones(2, h, w)
    seen[:, :3] = 0
    other = image.clone()
    other[:, :, :3] = -1.0  # anything on the unseen rows: returns or not
    losses = [flow_matching_loss(model, im, cond, torch.Generator().manual_seed(1), seen=seen) for im in (image, other)]
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-6)
    plain = flow_matching_loss(model, image, cond, torch.Generator().manual_seed(1))
    assert plain.item() != pytest.approx(losses[0].item(), rel=1e-3)


def _marker_drive(frames: int) -> Drive:
    """One return per frame, at range 10 + t m straight ahead, all poses at the origin: a cached point's range
    says which frame it came from."""
    h, w = TRAIN_SENSOR.shape
    rng = np.zeros((frames, h, w), np.float32)
    row = int(np.argmin(np.abs(TRAIN_SENSOR.elevations)))
    rng[:, row, w // 2] = 10.0 + np.arange(frames)
    return Drive(TRAIN_SENSOR, rng, np.zeros_like(rng), np.tile(np.eye(4), (frames, 1, 1)), None, None, None, None,
                 np.ones(h, bool))


@pytest.mark.parametrize("gap", [0.0, 0.9])
def test_a_forecast_gap_ages_the_cache_by_up_to_a_second(gap: float) -> None:
    augment = AugmentConfig(dropout=0.0, range_noise=0.0, jitter_translation=0.0, jitter_rotation_deg=0.0,
                            forecast_gap=gap)
    cfg = TrainConfig.from_dict({**tiny_train_config("", recordings=["unused"], cache_frames=1), "augment": augment})
    samples = WorldModelSamples([], cfg, [_marker_drive(20)])
    ages = []
    for key in range(300):
        rng = np.random.default_rng([0, key])
        cached = samples.cache_before(samples.drives[0], 15, rng)
        ages.append(15 - int(round(float(np.linalg.norm(cached[0, :3]))) - 10))
    if gap == 0.0:
        assert set(ages) == {1}  # the frame before the target, as a rollout's cache ends
    else:
        assert set(ages) == set(range(1, 11)) and 0.05 < np.mean(np.array(ages) == 1) < 0.3


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["simulated recording", "kitti00"])
def test_a_job_fine_tunes_on_recorded_sequences_alone(source: str, recording: Path, tmp_path: Path) -> None:
    folder = KITTI00 if source == "kitti00" else recording
    if not folder.is_dir():
        pytest.skip("the shared KITTI 00 frames are not beside the checkout")
    config = tmp_path / "rec.json"
    config.write_text(json.dumps(tiny_train_config("", recordings=[str(folder)], max_iters=3, save_iter=3,
                                                 warmup_iters=1)))
    with socket.socket() as free:  # a port of its own: another job may hold the default one
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASTER_PORT": str(port)}
    run = subprocess.run([sys.executable, "-m", "training.train", "--config", str(config), "--job-dir",
                          str(tmp_path / "job")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    log = (tmp_path / "job" / "train.log").read_text()
    assert f"loaded the recording {folder}" in log and "iter 3 loss" in log
