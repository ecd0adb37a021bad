"""The learned fill: its network and features, the "learned" upsampling method, a release or a Hub repo that
ships one, and its self-supervised training (resumable, installed into a release)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from inference import load_pipeline
from inference.fill_network import (
    FEATURES,
    FILL_WEIGHTS_NAME,
    FillNetwork,
    FillNetworkConfig,
    fill_features,
    fill_network_bytes,
    load_fill_network,
    sensor_family,
)
from inference.upsample import AUTO, EDGE_AWARE, LEARNED, upsample
from lidar.errors import InputError
from lidar.formats import Scan, write_points
from tests.helpers import ring_sweep, tiny_model, write_hub_cache, write_release
from training.train_fill import CHECKPOINT_NAME, FillTrainConfig, install, main, train

ELEVATIONS = np.linspace(8.0, -24.0, 16)


def sweep(seed: int = 0) -> Scan:
    points, ring = ring_sweep(ELEVATIONS, 256, seed=seed)
    return Scan(points=points, ring=ring, ring_source="file")


def perturbed(seed: int = 1) -> FillNetwork:
    """A fill network whose head is not zero: it changes the fill."""
    network = FillNetwork(FillNetworkConfig(channels=8))
    torch.manual_seed(seed)
    with torch.no_grad():
        network.head.weight.normal_(0.0, 0.5)
        network.head.bias.fill_(0.1)
    return network.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_untrained_fill_network_is_the_edge_aware_fill_exactly(dtype):
    """In bfloat16 too: only the network's correction takes its dtype, the fill's ranges stay float32 (rounded
    to bfloat16 they would move by up to 0.4 %)."""
    scan = sweep()
    edge = upsample(None, scan, 4, method=EDGE_AWARE)
    untrained = FillNetwork(FillNetworkConfig(channels=8)).to(dtype).eval()
    learned = upsample(None, scan, 4, method=LEARNED, fill_network=untrained)
    np.testing.assert_allclose(learned.image.range, edge.image.range, rtol=1e-5)
    np.testing.assert_array_equal(learned.image.mask, edge.image.mask)


def test_the_learned_fill_keeps_every_input_point_and_the_edge_aware_returns():
    scan = sweep()
    edge = upsample(None, scan, 4, method=EDGE_AWARE)
    learned = upsample(None, scan, 4, method=LEARNED, fill_network=perturbed())
    n = len(scan.points)
    np.testing.assert_array_equal(learned.points[:n], scan.points)
    assert not learned.filled[:n].any() and learned.filled[n:].all()
    np.testing.assert_array_equal(learned.image.mask, edge.image.mask)  # the return rule is the edge-aware one
    changed = learned.mask & edge.image.mask & ~learned.given.mask
    assert changed.any() and not np.allclose(learned.image.range[changed], edge.image.range[changed])
    np.testing.assert_array_equal(learned.image.range[learned.given.mask], edge.image.range[learned.given.mask])


def test_features_are_angles_and_neighbours_not_row_indices():
    scan = sweep()
    res = upsample(None, scan, 4, method=EDGE_AWARE)
    todo = res.mask & ~res.given.mask
    f = fill_features(res.given, res.image, todo, res.sensor)
    assert f.shape == (len(FEATURES), *res.sensor.shape) and f.dtype == np.float32 and np.isfinite(f).all()
    elevation = f[FEATURES.index("elevation")][:, 0] * 30.0
    np.testing.assert_allclose(elevation, np.degrees(res.sensor.elevations), atol=1e-4)
    # a filled ray between two kept beams sees the gaps to them, the kept ones sum to the measured spacing
    gaps = (f[FEATURES.index("gap above")] + f[FEATURES.index("gap below")]) * 2.0
    spacing = abs(ELEVATIONS[0] - ELEVATIONS[1])
    np.testing.assert_allclose(gaps[1:4][todo[1:4]], spacing, atol=1e-3)
    assert (f[FEATURES.index("to fill")] == todo).all()


def test_learned_without_a_network_is_one_clear_error():
    with pytest.raises(InputError, match="needs a fill network"):
        upsample(None, sweep(), 4, method=LEARNED)


def test_a_release_that_ships_a_fill_network_loads_it_and_upsamples_with_it(tmp_path):
    release = write_release(tmp_path / "release", tiny_model(seed=2))
    bare = load_pipeline(release, device="cpu")
    assert bare.fill_network is None and bare.provenance.fill is None
    with pytest.raises(InputError, match="needs a fill network"):
        bare.upsample(sweep(), 4, method=LEARNED)
    network = perturbed()
    (release / FILL_WEIGHTS_NAME).write_bytes(fill_network_bytes(network))
    pipe = load_pipeline(release, device="cpu", dtype="float32")
    assert pipe.provenance.fill == str(release / FILL_WEIGHTS_NAME)
    direct = upsample(None, sweep(), 4, method=LEARNED, fill_network=network)
    np.testing.assert_array_equal(pipe.upsample(sweep(), 4, method=LEARNED).image.range, direct.image.range)
    # in the world model's dtype: a bfloat16 pipeline's fill network is bfloat16, and its fill the same rays
    half = load_pipeline(release, device="cpu", dtype="bfloat16")
    assert next(half.fill_network.parameters()).dtype == torch.bfloat16
    filled = half.upsample(sweep(), 4, method=LEARNED)
    np.testing.assert_array_equal(filled.image.mask, direct.image.mask)
    assert filled.image.range.dtype == np.float32


def test_a_hub_repo_with_a_fill_network_brings_it_from_the_same_commit(tmp_path, monkeypatch):
    release = write_release(tmp_path / "release", tiny_model(seed=2))
    (release / FILL_WEIGHTS_NAME).write_bytes(fill_network_bytes(perturbed()))
    cache = tmp_path / "hub"
    write_hub_cache(cache, "lab/with-fill", release, files=("config.json", "model.safetensors", FILL_WEIGHTS_NAME))
    write_hub_cache(cache, "lab/without-fill", release)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with_fill = load_pipeline("lab/with-fill", device="cpu", cache_dir=cache)
    assert with_fill.fill_network is not None and with_fill.provenance.fill.endswith(FILL_WEIGHTS_NAME)
    assert load_pipeline("lab/without-fill", device="cpu", cache_dir=cache).fill_network is None


def test_a_file_that_is_not_a_fill_network_is_refused(tmp_path):
    release = write_release(tmp_path / "release", tiny_model(seed=2))
    with pytest.raises(ValueError, match="is not a LidarVerse fill network"):
        load_fill_network(release / "model.safetensors")
    (tmp_path / "torn.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match="is not a LidarVerse fill network"):
        load_fill_network(tmp_path / "torn.safetensors")
    wide = tmp_path / "wide.safetensors"  # a file naming a network past the bound is refused before it is built
    wide.write_bytes(fill_network_bytes(perturbed(), {"fill_network": json.dumps({"channels": 1024})}))
    with pytest.raises(ValueError, match=r"channels must be a multiple of 8 in \[8, 128\], got 1024"):
        load_fill_network(wide)
    odd = tmp_path / "odd.safetensors"  # the grids it names are preset names
    odd.write_bytes(fill_network_bytes(perturbed(), {"trained_sensors": json.dumps(["hdl64", "x" * 300])}))
    with pytest.raises(ValueError, match="trained_sensors must be a list of preset names"):
        load_fill_network(odd)


def test_a_fill_network_file_keeps_the_sensors_it_learnt_from(tmp_path):
    network = perturbed()
    (tmp_path / "unsaid.safetensors").write_bytes(fill_network_bytes(network))
    assert load_fill_network(tmp_path / "unsaid.safetensors").sensors is None
    for sensors in (("hdl64", "os1-128"), ()):  # none: learnt from no sensor's sweeps, not "not said"
        network.sensors = sensors
        (tmp_path / "said.safetensors").write_bytes(fill_network_bytes(network))
        assert load_fill_network(tmp_path / "said.safetensors").sensors == sensors


@pytest.fixture(scope="module")
def train_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fill_sweeps")
    for seed in (0, 1):
        points, ring = ring_sweep(ELEVATIONS, 256, seed=seed)
        write_points(folder / f"{seed:06d}.pcd", points, ring=ring)
    return folder


def tiny_train(folder, **overrides) -> FillTrainConfig:
    fields = {"real": (str(folder),), "sim": (), "sim_share": 0.0, "every": (4,), "steps": 6, "batch": 2, "crop": 64,
              "channels": 8, "save_every": 3, "threads": 1}
    return FillTrainConfig(**{**fields, **overrides})


def test_training_lowers_the_error_of_the_fill_on_its_sweeps(train_data, tmp_path):
    from training.train_fill import build_pools, loss_of

    cfg = tiny_train(train_data, steps=40, save_every=40, lr=3e-3)
    items = build_pools(cfg)["real"]

    def error(network: FillNetwork) -> float:
        with torch.no_grad():
            return float(np.mean([loss_of(network, *(torch.from_numpy(a)[None] for a in (i.features, i.truth, i.scored)))
                                  for i in items]))

    before = error(FillNetwork(FillNetworkConfig(channels=8)))
    after = error(load_fill_network(train(cfg, tmp_path / "job")))
    assert after < 0.9 * before, (before, after)


def test_a_checkpoint_half_way_resumes_to_the_same_weights(train_data, tmp_path):
    cfg = tiny_train(train_data)
    whole = load_fill_network(train(cfg, tmp_path / "whole"))
    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        _train_until(cfg, stopped, stop_at=4)
    assert torch.load(stopped / CHECKPOINT_NAME, weights_only=True)["step"] == 3
    resumed = load_fill_network(train(cfg, stopped))
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    from training.evaluate_upsample import load_sweep
    from training.train_fill import camera_view

    taken = load_sweep(sorted(train_data.glob("*.pcd"))[0])  # each sweep as it is and cut to a camera's view
    families = tuple(sorted({sensor_family(taken.geometry.sensor), sensor_family(camera_view(taken).geometry.sensor)}))
    assert whole.sensors == resumed.sensors == families, "the file names the families of the sensors it learnt from"
    assert load_fill_network(train(cfg, stopped)).sensors == families, "a finished job rerun keeps them"


def _train_until(cfg: FillTrainConfig, job, stop_at: int) -> None:
    """`train`, interrupted as a kill would at step `stop_at` (after the optimiser step, before any save)."""
    calls = {"n": 0}
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == stop_at:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step
    try:
        train(cfg, job)
    finally:
        torch.optim.AdamW.step = original


def test_a_job_dir_refuses_another_config_and_install_puts_the_network_in_a_release(train_data, tmp_path, capsys):
    job = tmp_path / "job"
    weights = train(tiny_train(train_data, steps=2), job)
    with pytest.raises(InputError, match="another config"):
        train(tiny_train(train_data, steps=3), job)
    release = write_release(tmp_path / "release", tiny_model(seed=2))
    install(weights, release)
    assert load_pipeline(release, device="cpu").fill_network is not None
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({**tiny_train(train_data, steps=2).__dict__, "real": [str(train_data)]}))
    assert main(["--job-dir", str(tmp_path / "cli"), "--config", str(config), "--into", str(tmp_path / "nowhere")]) == 2
    assert "is not a release folder" in capsys.readouterr().err
    config.write_text(json.dumps({"stepz": 3}))
    assert main(["--job-dir", str(tmp_path / "bad"), "--config", str(config)]) == 2
    assert "unknown fields ['stepz']" in capsys.readouterr().err


def test_the_command_fills_auto_with_the_learned_method_where_the_release_ships_one_for_such_sweeps(tmp_path, capsys):
    from inference.__main__ import main as cli

    release = write_release(tmp_path / "release", tiny_model(seed=2))
    points, ring = ring_sweep(ELEVATIONS, 256)
    scan_file = write_points(tmp_path / "sweep.pcd", points, ring=ring)

    def record(out: str) -> dict:
        assert cli(["upsample", "--model", str(release), "--scan", str(scan_file), "--out", str(tmp_path / out),
                    "--quiet"]) == 0
        return json.loads((tmp_path / out / "upsample.json").read_text())

    assert record("bare")["method"] == EDGE_AWARE
    assert cli(["upsample", "--model", str(release), "--scan", str(scan_file), "--out", str(tmp_path / "refused"),
                "--method", LEARNED]) == 2
    assert "needs a fill network" in capsys.readouterr().err
    network = perturbed()
    (release / FILL_WEIGHTS_NAME).write_bytes(fill_network_bytes(network))
    shipped = record("shipped")
    assert shipped["method"] == LEARNED and shipped["request"]["method"] == AUTO, "the fill used, and what was asked"
    network.sensors = tuple(name for name in ("hdl64", "vlp16") if name != sensor_family(upsample(None, sweep(), 1).sensor))
    (release / FILL_WEIGHTS_NAME).write_bytes(fill_network_bytes(network))
    assert record("other_sensors")["method"] == EDGE_AWARE, "a network that learnt from other sensors' sweeps"


def test_a_camera_view_keeps_the_points_ahead_on_the_beams_it_still_holds():
    from training.evaluate_upsample import sweep_of
    from training.train_fill import CAMERA_DOWN, CAMERA_DROP_M, CAMERA_HALF_WIDTH, camera_view

    whole = sweep_of(sweep(), "whole")
    cut = camera_view(whole)
    p = cut.scan.points
    assert 0 < len(p) < len(whole.scan.points) / 3
    assert (p[:, 0] > 0).all() and (np.abs(p[:, 1]) < CAMERA_HALF_WIDTH * p[:, 0]).all()
    assert (p[:, 2] >= -CAMERA_DOWN * p[:, 0] - CAMERA_DROP_M).all()
    assert cut.geometry.sensor.height < whole.geometry.sensor.height, "the beams below the view are gone"
    assert cut.name == "whole (camera view at 0 deg)"


def test_a_camera_view_at_a_heading_keeps_the_points_that_way_and_matches_the_view_ahead_turned():
    from training.evaluate_upsample import sweep_of
    from training.train_fill import CAMERA_HALF_WIDTH, camera_view

    scan = sweep()
    whole = sweep_of(scan, "whole")
    left = camera_view(whole, 90.0).scan.points
    assert len(left) and (left[:, 1] > 0).all() and (np.abs(left[:, 0]) < CAMERA_HALF_WIDTH * left[:, 1]).all()
    # the same scene turned a quarter to the right holds those points ahead: the same cut, point for point
    turned = scan.points.copy()
    turned[:, 0], turned[:, 1] = scan.points[:, 1], -scan.points[:, 0]
    ahead = camera_view(sweep_of(Scan(points=turned, ring=scan.ring, ring_source="file"), "turned")).scan.points
    assert len(ahead) == len(left)
    np.testing.assert_allclose(ahead[:, 2], left[:, 2])


def test_a_scaled_item_is_the_item_of_the_scene_made_larger():
    """Scaling a crop's planes is what filling the scene `scale` times larger would give the network."""
    from training.evaluate_upsample import sweep_of
    from training.train_fill import ring_drops, scaled

    scan = sweep()
    big = Scan(points=np.column_stack([scan.points[:, :3] * 1.5, scan.points[:, 3]]), ring=scan.ring, ring_source="file")
    small_item, big_item = (ring_drops(sweep_of(s, "s"), (4,))[0] for s in (scan, big))
    ranges = [k for k, name in enumerate(FEATURES) if name != "known intensity"]  # a tie for a pixel may flip
    np.testing.assert_allclose(scaled(small_item.features, 1.5)[ranges], big_item.features[ranges], atol=2e-4)
    assert (scaled(small_item.features, 1.5)[ranges] != small_item.features[ranges]).any()
    np.testing.assert_allclose(small_item.truth * 1.5, big_item.truth, rtol=1e-5)


def test_the_learned_fill_is_the_default_for_new_beams_of_sensors_it_learnt_from_and_edge_aware_elsewhere():
    network = perturbed()
    own = sensor_family(upsample(None, sweep(), 1).sensor)  # the sweep's own beam table: the sensor it was taken on
    assert upsample(None, sweep(), 4, fill_network=network).method == LEARNED, "sensors not said: every sensor"
    network.sensors = (own,)
    for factor, target in ((2, None), (4, None), (None, "hdl64"), (None, "os1-128")):  # whatever grid it goes to
        assert upsample(None, sweep(), factor, sensor=target, fill_network=network).method == LEARNED, (factor, target)
    assert upsample(None, sweep(), 4, method=AUTO, fill_network=network).method == LEARNED, "auto: as unnamed"
    network.sensors = tuple(name for name in ("hdl64", "vlp16") if name != own)
    assert upsample(None, sweep(), 4, fill_network=network).method == EDGE_AWARE, "another sensor's sweep"
    assert upsample(None, sweep(), 4, method=LEARNED, fill_network=network).method == LEARNED, "named: as asked"
    network.sensors = None
    assert upsample(None, sweep(), 1, fill_network=network).method == EDGE_AWARE, "trained on rings, not rays"
    assert upsample(None, sweep(), 4).method == EDGE_AWARE
    assert upsample(None, sweep(), 1, method=LEARNED, fill_network=network).method == LEARNED, "named: as asked"


def test_the_shipped_fill_network_beats_the_edge_aware_fill_on_a_real_kitti_sweep():
    """The release's network on a shared KITTI scan from a drive it was not trained on (a detection frame cut to
    the camera's view, 46 rings), 16 of its rings kept."""
    from inference.loader import DEFAULT_MODEL
    from lidar.real_scans import real_scans_dir
    from training.evaluate_upsample import BAR_SETTING, SETTINGS, load_sweep, scores

    unseen = real_scans_dir() / "kitti_pointpillars_000002.bin"
    if not unseen.is_file() or not (DEFAULT_MODEL / FILL_WEIGHTS_NAME).is_file():
        pytest.skip("needs the shared KITTI scans and a release with a fill network")
    pipe = load_pipeline(DEFAULT_MODEL, device="cpu")
    truth = load_sweep(unseen)
    setting = next(s for s in SETTINGS if s.name == BAR_SETTING)
    fill = setting.mask(truth.truth, np.random.default_rng(0))
    given = truth.given(fill)
    mae = {m: scores(pipe.upsample(given, sensor=truth.geometry.sensor, mask=fill, method=m), truth)["mae"]
           for m in (EDGE_AWARE, LEARNED)}
    assert mae[LEARNED] < 0.97 * mae[EDGE_AWARE], mae


def test_simulated_drives_are_a_pool_of_their_own_read_as_sweep_files_are(train_data, tmp_path):
    from lidar.sensors import VLP16
    from lidar.sim.dataset import write_dataset
    from training.train_fill import batch, build_pools

    root = tmp_path / "sim"
    write_dataset(root, VLP16.with_width(128), sequences=1, frames=2, seed=3)
    cfg = tiny_train(train_data, sim=(str(root),), sim_share=1.0, sim_frames=(0, 1), camera_view=False)
    pools = build_pools(cfg)
    assert len(pools["sim"]) == 2 * 4 and len(pools["real"]) == 2 * 4  # 2 frames or sweeps x 4 offsets of every 4th
    assert {item.truth.shape for item in pools["sim"]} == {(16, 128)}, "the simulated sensor's own grid"
    x, truth, scored = batch(pools, cfg, np.random.default_rng(0))
    assert x.shape == (cfg.batch, len(FEATURES), 16, cfg.crop) and scored.any()
    assert (truth[scored] > 0).all(), "only rays the truth returns on are scored"
    with pytest.raises(InputError, match="draws from a pool with no data"):
        tiny_train(train_data, sim_share=0.5)


def test_ray_drops_add_completion_items_drawn_like_the_evaluations(train_data) -> None:
    from training.evaluate_upsample import load_sweep, sweep_files
    from training.train_fill import build_pools, ray_drops

    cfg = tiny_train(train_data, drops=(0.5, 0.9), camera_view=False)
    pools = build_pools(cfg)
    assert len(pools["real"]) == 2 * (4 + 2)  # 2 sweeps x (4 ring offsets + 2 ray drops)
    sweep = load_sweep(next(iter(sweep_files(cfg.real)[0])))
    half, most = ray_drops(sweep, (0.5, 0.9), np.random.default_rng(0))
    share = [item.scored.sum() / sweep.truth.mask.sum() for item in (half, most)]
    assert 0.4 < share[0] < 0.5 < 0.8 < share[1] < 0.9  # scored: dropped rays the fill and the truth return on
    # rays, not rings: every ring that returns has rays to fill, where a ring drop leaves the kept rings whole
    assert half.scored.any(axis=1)[sweep.truth.mask.any(axis=1)].all()
    with pytest.raises(InputError, match="drops must be shares"):
        tiny_train(train_data, drops=(1.0,))


def test_range_scale_and_camera_headings_are_bounded(train_data) -> None:
    for bad, match in (({"range_scale": (0.1, 1.0)}, "range_scale"), ({"range_scale": (1.5, 1.2)}, "range_scale"),
                       ({"range_scale": (1.0,)}, "range_scale"), ({"camera_headings": (720.0,)}, "camera_headings")):
        with pytest.raises(InputError, match=match):
            tiny_train(train_data, **bad)
    assert tiny_train(train_data, range_scale=[0.8, 1.25], camera_headings=[0, 90]).range_scale == (0.8, 1.25)
