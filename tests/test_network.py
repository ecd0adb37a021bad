"""The range-image UNet: shapes, config round trip and validation, azimuth wrap-around, and the prior anchor."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from inference.conditioning import (
    COORD_CHANNELS,
    MAP_START,
    LayoutView,
    build_condition,
    coordinate_channels,
    decode_image,
    empty_condition,
    prior_image,
)
from inference.network import (
    ARCHITECTURE_FIELDS,
    IMAGE_CHANNELS,
    KEEP,
    MAX_LEVEL_CHANNELS,
    MAX_SENSOR_SHAPE,
    RANGE,
    RETURN,
    WorldModel,
    WorldModelConfig,
    flat_ground_range,
    to_encoded_image,
)
from lidar.range_image import decode_range
from lidar.sensors import HDL32, VLP16
from lidar.vocabulary import MapView


def tiny_config(**overrides) -> WorldModelConfig:
    """A small model with attention and without the keep gate and gap fill (the first architecture, which these
    tests were written for); a test of the gate or the gap fill switches it on."""
    kw = dict(
        sensor=VLP16.with_width(64).to_dict(),
        base_channels=8,
        channel_mults=(1, 2, 2),
        strides=((1, 2), (2, 2)),
        bottleneck_attention=True,
        keep_gate=False,
        gap_fill=False,
    )
    kw.update(overrides)
    return WorldModelConfig(**kw)


def test_default_config_is_the_32x512_model_sensor_and_small_enough_for_cpu_training():
    config = WorldModelConfig()
    assert config.sensor_obj.shape == (32, 512)
    assert config.sensor_obj.elevations_deg == HDL32.elevations_deg
    params = WorldModel(config).num_parameters()
    assert 1_000_000 <= params <= 3_000_000


def test_forward_maps_noisy_image_and_condition_to_range_intensity_and_return_logit_of_the_image_shape():
    config = tiny_config()
    model = WorldModel(config)
    h, w = config.sensor_obj.shape
    x = torch.randn(3, IMAGE_CHANNELS, h, w)
    cond = torch.randn(3, config.cond_channels, h, w)
    seen = (x.clone(), cond.clone())
    out = model(x, torch.rand(3), cond)
    assert out.shape == x.shape
    assert torch.isfinite(out).all()
    # the blocks work in place on their own intermediates, never on what they were given
    assert torch.equal(x, seen[0]) and torch.equal(cond, seen[1])


def test_the_in_place_blocks_train_like_the_textbook_block():
    """Autograd keeps what the in-place ResBlock overwrites: its gradients are those of the plain formula."""
    from inference.network import ResBlock

    torch.manual_seed(0)
    block = ResBlock(8, 16, 32, 4)
    torch.nn.init.normal_(block.conv2.weight, std=0.1)
    x, temb = torch.randn(2, 8, 4, 16, requires_grad=True), torch.randn(2, 32)

    def plain(x: torch.Tensor) -> torch.Tensor:
        h = block.conv1(torch.nn.functional.silu(block.norm1(x)))
        scale, shift = block.film(temb)[:, :, None, None].chunk(2, dim=1)
        h = block.conv2(torch.nn.functional.silu(block.norm2(h) * (1 + scale) + shift))
        return block.skip(x) + h

    grads = []
    for forward in (block, plain):
        out = forward(x, temb) if forward is block else forward(x)
        weights = [x, *block.parameters()]
        grads.append(torch.autograd.grad(out.square().sum(), weights))
    for ours, reference in zip(*grads, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))


def test_a_bfloat16_model_runs_without_autocast_as_the_gpu_pipeline_loads_it():
    config = tiny_config()
    model = WorldModel(config).to(torch.bfloat16)
    h, w = config.sensor_obj.shape
    x = torch.randn(2, IMAGE_CHANNELS, h, w, dtype=torch.bfloat16)
    out = model(x, torch.rand(2), torch.randn(2, config.cond_channels, h, w))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape


def test_forward_rejects_a_condition_with_the_wrong_channel_count():
    config = tiny_config()
    h, w = config.sensor_obj.shape
    with pytest.raises(ValueError, match="cond"):
        WorldModel(config)(
            torch.randn(1, IMAGE_CHANNELS, h, w), torch.rand(1), torch.randn(1, config.cond_channels + 1, h, w)
        )
    with pytest.raises(ValueError, match="x_t"):  # the v1 two-channel image is refused by name
        WorldModel(config)(torch.randn(1, 2, h, w), torch.rand(1), torch.randn(1, config.cond_channels, h, w))


def test_a_prepared_condition_gives_the_same_output_as_the_whole_stem_on_every_step():
    """The sampler reuses `prepare(cond)` across steps: the split stem must be the full conv, exactly."""
    config = tiny_config()
    torch.manual_seed(0)
    model = WorldModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))  # a trained-looking net: the head is not zero
    h, w = config.sensor_obj.shape
    cond = torch.randn(2, config.cond_channels, h, w)
    cond[:, -COORD_CHANNELS:] = torch.from_numpy(coordinate_channels(config.sensor_obj))  # a full ring
    prepared = model.prepare(cond)
    assert prepared.circular
    base_range, _, returns = model.base_image(cond)
    prior = torch.stack([base_range, returns.float()], dim=1)
    for _ in range(2):
        x = torch.randn(2, IMAGE_CHANNELS, h, w)
        whole = model.stem(torch.cat([x, cond, prior], dim=1))
        torch.testing.assert_close(model.stem.partial(x, 0, bias=False) + prepared.stem, whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="same batch"):
        model(torch.randn(1, IMAGE_CHANNELS, h, w), torch.rand(1), prepared)


def test_the_views_stem_worked_out_first_and_the_cache_and_prior_share_added_later_is_the_whole_stem():
    """A rollout computes the stem's response to a frame's views before the cache is known; with the cache's and
    the prior's share added in `prepare`, the stem is the full conv's, and so is every forward pass."""
    config = tiny_config()
    torch.manual_seed(1)
    model = WorldModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    h, w = config.sensor_obj.shape
    cond = torch.randn(2, config.cond_channels, h, w)
    cond[:, -COORD_CHANNELS:] = torch.from_numpy(coordinate_channels(config.sensor_obj))
    whole = model.prepare(cond)
    views_only = cond.clone()
    views_only[:, :MAP_START] = torch.randn(2, MAP_START, h, w)  # the views' stem does not read the cache block
    split = model.prepare(cond, views_stem=model.views_stem(views_only))
    torch.testing.assert_close(split.stem, whole.stem, atol=1e-5, rtol=1e-5)
    assert split.circular == whole.circular and torch.equal(split.exact_range, whole.exact_range)
    x, t = torch.randn(2, IMAGE_CHANNELS, h, w), torch.rand(2)
    torch.testing.assert_close(model(x, t, split), model(x, t, whole), atol=1e-4, rtol=1e-4)
    # given as a call (a first frame's, still being worked out in another thread), it is called once
    asked: list[str] = []
    late = model.prepare(cond, views_stem=lambda: asked.append("stem") or model.views_stem(views_only))
    assert asked == ["stem"] and torch.equal(late.stem, split.stem)
    with pytest.raises(ValueError, match="views_stem must be the stem's response"):
        model.prepare(cond, views_stem=model.views_stem(cond[:1]))


def test_rolling_input_in_azimuth_rolls_the_output_by_the_same_amount():
    config = tiny_config()
    torch.manual_seed(0)
    model = WorldModel(config).eval()
    for p in model.parameters():  # zero-initialised output convs would make the test trivially pass
        torch.nn.init.normal_(p, std=0.1)
    h, w = config.sensor_obj.shape
    x, cond, t = torch.randn(1, IMAGE_CHANNELS, h, w), torch.randn(1, config.cond_channels, h, w), torch.rand(1)
    cond[:, -COORD_CHANNELS:] = torch.from_numpy(coordinate_channels(config.sensor_obj))  # a full ring
    shift = 4 * 3  # a multiple of the total width stride (4)
    with torch.no_grad():
        out = model(x, t, cond)
        rolled = model(x.roll(shift, dims=-1), t, cond.roll(shift, dims=-1))
    assert out.abs().mean() > 1e-3
    torch.testing.assert_close(rolled, out.roll(shift, dims=-1), atol=1e-4, rtol=1e-4)


def test_one_network_draws_any_beam_table_and_an_azimuth_crop_pads_its_edges_with_zeros():
    """The network reads each pixel's elevation and azimuth from the condition: the model sensor's grid is only
    a default. A full ring wraps around; a crop of one (training cuts them) does not, so what lies beyond one
    edge never reaches the other."""
    config = tiny_config()
    torch.manual_seed(0)
    model = WorldModel(config).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    other = VLP16.with_width(96)
    cond = torch.from_numpy(empty_condition(other, config.num_map_classes))[None]
    prepared = model.prepare(cond)
    assert prepared.circular
    with torch.no_grad():
        out = model(torch.randn(1, IMAGE_CHANNELS, *other.shape), torch.rand(1), prepared)
    assert out.shape[-2:] == other.shape
    # the flat-ground base follows the condition's beams, not the model sensor's
    expected = flat_ground_range(replace(other, mount_height=config.sensor_obj.mount_height,
                                         max_range=config.sensor_obj.max_range))
    torch.testing.assert_close(prepared.base_range[0], expected, atol=1e-5, rtol=0)
    crop = cond[..., 10:42]
    assert not model.prepare(crop).circular
    x = torch.randn(1, model.stem.in_channels, *crop.shape[-2:])
    far_edge = x.clone()
    far_edge[..., -1] += 5.0  # the last column changes: on a ring, column 0 feels it
    with torch.no_grad():
        assert torch.equal(model.stem(far_edge, circular=False)[..., 0], model.stem(x, circular=False)[..., 0])
        assert not torch.allclose(model.stem(far_edge)[..., 0], model.stem(x)[..., 0])


def tiny_condition(config: WorldModelConfig, seed: int = 0) -> torch.Tensor:
    """A (1, C, H, W) condition with a partial cache, a map with ground and buildings and a layout box."""
    sensor = config.sensor_obj
    rng = np.random.default_rng(seed)
    r = rng.uniform(3.0, 60.0, sensor.shape)
    keep = (rng.random(sensor.shape) < 0.4).reshape(-1)
    pts = np.concatenate([(sensor.ray_directions() * r[..., None]).reshape(-1, 3), rng.random((r.size, 1))], 1)
    ground = np.where(np.asarray(sensor.elevations)[:, None] < 0, rng.uniform(4, 50, sensor.shape), 0.0)
    building = np.where(rng.random(sensor.shape) < 0.3, rng.uniform(5, 80, sensor.shape), 0.0)
    view = MapView(np.ones(sensor.shape, np.uint8), ground.astype(np.float32), building.astype(np.float32),
                   np.zeros(sensor.shape, np.float32))
    box = np.zeros(sensor.shape, np.float32)
    box[4:10, 20:30] = 7.0
    layout = LayoutView(box, np.where(box > 0, 0, -1).astype(np.int64))
    cond = build_condition(pts[keep].astype(np.float32), np.eye(4), view, layout, sensor, config.num_map_classes)
    return cond[None]


@pytest.mark.parametrize("t", [1.0, 0.5, 0.01])
def test_an_untrained_model_reproduces_the_prior_at_any_time(t):
    config = tiny_config()
    torch.manual_seed(0)
    model = WorldModel(config).eval()
    sensor = config.sensor_obj
    cond = tiny_condition(config)
    prior, returns = prior_image(cond)
    assert 0.2 < returns.float().mean() < 1.0, "the test needs pixels with and without a prior"
    with torch.no_grad():
        x0 = model.predict_x0(torch.randn(1, IMAGE_CHANNELS, *sensor.shape), torch.tensor([t]), cond)
    image = decode_image(to_encoded_image(x0[0]), sensor)
    np.testing.assert_array_equal(image.mask, returns[0].numpy())
    expected = decode_range(prior[0].numpy(), sensor.max_range, sensor.min_range)
    np.testing.assert_allclose(image.range[image.mask], expected[image.mask], rtol=1e-5)
    assert (x0[0, RETURN][returns[0]] > 0).all() and (x0[0, RETURN][~returns[0]] < 0).all()


def test_the_residual_head_starts_at_zero_and_the_prior_is_an_explicit_input():
    config = tiny_config()
    model = WorldModel(config)
    head = model.head[-1]
    assert torch.count_nonzero(head.weight) == 0 and torch.count_nonzero(head.bias) == 0
    assert model.stem.in_channels == IMAGE_CHANNELS + config.cond_channels + 2
    # a trained head moves the estimate off the prior
    with torch.no_grad():
        torch.nn.init.normal_(head.weight, std=0.1)
    cond = tiny_condition(config)
    x = torch.randn(1, IMAGE_CHANNELS, *config.sensor_obj.shape)
    with torch.no_grad():
        out = model(x, torch.rand(1), cond)
    base_range = model.base_image(cond)[0]
    assert (out[:, 0] - base_range).abs().mean() > 1e-3


def test_the_flow_target_keeps_returns_and_puts_the_base_under_ray_drops():
    config = tiny_config()
    model = WorldModel(config)
    cond = tiny_condition(config, seed=1)
    rng = np.random.default_rng(2)
    h, w = config.sensor_obj.shape
    image = torch.from_numpy(rng.uniform(-0.9, 0.9, (1, 2, h, w)).astype(np.float32))
    drops = torch.from_numpy(rng.random((1, h, w)) < 0.3)
    image[:, 0][drops] = -1.0
    image[:, 1][drops] = -1.0
    target = model.flow_target(image, cond)
    base_range, base_intensity, _ = model.base_image(cond)
    assert target.shape == (1, IMAGE_CHANNELS, h, w)
    assert torch.equal(target[:, 2], torch.where(drops, -1.0, 1.0))
    assert torch.equal(target[:, 0][~drops], image[:, 0][~drops])
    assert torch.equal(target[:, 0][drops], base_range[drops])
    assert torch.equal(target[:, 1][drops], base_intensity[drops])
    assert torch.equal(to_encoded_image(target), image)  # back to the encode_image layout


def test_a_sampled_range_within_prior_snap_of_the_prior_takes_the_prior_and_a_larger_correction_stays():
    config = tiny_config()
    model = WorldModel(config)
    h, w = config.sensor_obj.shape
    cond = tiny_condition(config)
    prepared = model.prepare(cond)
    base, returns = prepared.base_range[0], prepared.returns[0]
    assert returns.any() and not returns.all()
    x = torch.randn(1, IMAGE_CHANNELS, h, w)
    sign = torch.where(torch.rand(h, w) < 0.5, -1.0, 1.0)
    offsets = sign * torch.where(torch.rand(h, w) < 0.5, 0.5, 2.0) * config.prior_snap
    x[0, 0] = base + offsets
    snapped = model.snap_to_prior(x, prepared)
    kept = returns & (offsets.abs() < config.prior_snap)
    assert torch.equal(snapped[0, 0][kept], base[kept])
    assert torch.equal(snapped[0, 0][~kept], x[0, 0][~kept]), "a large correction, or no prior, is left alone"
    assert torch.equal(snapped[:, 1:], x[:, 1:]), "intensity and return are the sample's"
    # guidance stacks the map-dropped twin behind the condition: the sample snaps to the first
    from inference.conditioning import drop_map

    twin = model.prepare(torch.cat([cond, drop_map(cond, config.num_map_classes)]))
    assert not torch.equal(twin.exact_range[1], base)
    assert torch.equal(model.snap_to_prior(x, twin), snapped)
    off = WorldModel(tiny_config(prior_snap=0.0))
    assert torch.equal(off.snap_to_prior(x, off.prepare(cond)), x)
    # a bfloat16 model (the GPU pipeline) snaps to the float32 prior, not to its rounded copy
    half = WorldModel(config).to(torch.bfloat16)
    assert torch.equal(half.snap_to_prior(x, half.prepare(cond))[0, 0][kept], base[kept])


def _set_head_bias(model: WorldModel, **bias: float) -> None:
    """A head that outputs constants: channel name (range, intensity, ret, keep) -> its bias."""
    head = model.head[-1]
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        for name, value in bias.items():
            head.bias[{"range": RANGE, "intensity": 1, "ret": RETURN, "keep": KEEP}[name]] = value


@pytest.mark.parametrize("keep_logit", [4.0, -4.0])
def test_the_keep_gate_takes_the_prior_where_it_returns_and_the_gate_says_keep(keep_logit):
    config = tiny_config(keep_gate=True)
    model = WorldModel(config).eval()
    assert model.head[-1].out_channels == IMAGE_CHANNELS + 1
    cond = tiny_condition(config)
    prepared = model.prepare(cond)
    base, returns = prepared.base_range[0], prepared.returns[0]
    assert returns.any() and not returns.all()
    _set_head_bias(model, range=0.3, keep=keep_logit)  # a residual far beyond the snap tolerance
    x = torch.randn(1, IMAGE_CHANNELS, *config.sensor_obj.shape)
    with torch.no_grad():
        out = model(x, torch.tensor([0.5]), prepared)
        x0 = model.predict_x0(x, torch.tensor([0.5]), prepared)
    assert out.shape[1] == IMAGE_CHANNELS + 1 and torch.allclose(out[0, KEEP], torch.full_like(base, keep_logit))
    kept = returns if keep_logit > 0 else torch.zeros_like(returns)
    assert torch.equal(x0[0, RANGE][kept], base[kept])
    torch.testing.assert_close(x0[0, RANGE][~kept], base[~kept] + 0.3)
    assert x0.shape[1] == IMAGE_CHANNELS, "the sampler integrates the 3-channel flow image"


def test_the_keep_label_is_within_the_snap_tolerance_and_counts_where_prior_and_target_return():
    config = tiny_config(keep_gate=True)
    model = WorldModel(config)
    cond = tiny_condition(config)
    base, _, returns = model.base_image(cond)
    h, w = config.sensor_obj.shape
    target_returns = torch.rand(1, h, w) < 0.7
    offsets = torch.where(torch.rand(1, h, w) < 0.5, 0.5, 2.0) * config.prior_snap
    x0 = torch.stack([base + offsets, torch.zeros_like(base), torch.where(target_returns, 1.0, -1.0)], dim=1)
    label, counted = model.keep_target(x0, cond)
    assert torch.equal(label.bool(), offsets < config.prior_snap)
    assert torch.equal(counted, returns & target_returns)


def test_a_gated_model_adds_the_gates_cross_entropy_to_the_loss():
    from inference.flow import flow_matching_loss

    config = tiny_config(keep_gate=True)
    torch.manual_seed(0)
    gated = WorldModel(config)
    plain = WorldModel(tiny_config())
    state = gated.state_dict()
    plain.load_state_dict({k: (v[:IMAGE_CHANNELS] if k.startswith("head.2") else v) for k, v in state.items()})
    cond = tiny_condition(config)
    h, w = config.sensor_obj.shape
    image = torch.rand(1, 2, h, w) * 1.8 - 0.9
    losses = [flow_matching_loss(m, image, cond, torch.Generator().manual_seed(3)) for m in (gated, plain)]
    # a fresh gate says 50:50 everywhere: its cross-entropy is ln 2 on every counted pixel
    torch.testing.assert_close(losses[0] - losses[1], torch.tensor(np.log(2.0), dtype=torch.float32))


def test_a_config_written_before_prior_snap_existed_snaps_at_the_map_tolerance():
    from inference.conditioning import SNAP_TOLERANCE

    old = {k: v for k, v in tiny_config().to_dict().items() if k != "prior_snap"}
    assert WorldModelConfig.from_dict(old).prior_snap == SNAP_TOLERANCE


REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "training" / "configs"
#: Lineage steps before the shipped architecture (training/configs/README.md): attention on, no gate or gap fill.
EARLIER_STEPS = ("v4.json", "v6.json", "v6_fov_crop.json", "v8.json")


@pytest.mark.parametrize("path", ["weights/default/config.json", *sorted(
    str(p.relative_to(REPO)) for p in CONFIGS.glob("*.json") if p.name not in EARLIER_STEPS)])
def test_the_defaults_are_the_shipped_model_and_every_training_config_describes_it(path):
    model = json.loads((REPO / path).read_text())["model"]
    assert WorldModelConfig.from_dict(model) == WorldModelConfig()


@pytest.mark.parametrize("name", EARLIER_STEPS)
def test_an_earlier_lineage_step_differs_from_the_shipped_model_only_where_init_from_can_carry_weights(name):
    from training.train import TRANSFERABLE_FIELDS

    config = WorldModelConfig.from_dict(json.loads((CONFIGS / name).read_text())["model"])
    shipped = WorldModelConfig()
    differ = {field for field in ARCHITECTURE_FIELDS if getattr(config, field) != getattr(shipped, field)}
    assert differ and differ <= set(TRANSFERABLE_FIELDS)


def test_a_config_that_leaves_out_a_field_whose_default_changed_keeps_the_meaning_it_was_written_with():
    from inference.network import OMITTED_FIELDS_MEAN

    old = {k: v for k, v in tiny_config().to_dict().items() if k not in OMITTED_FIELDS_MEAN}
    config = WorldModelConfig.from_dict(old)
    assert (config.bottleneck_attention, config.keep_gate, config.gap_fill) == (True, False, False)
    assert (config.p_drop_map, config.p_drop_layout) == (0.15, 0.15)
    assert config.default_steps == 4  # every release before the default became 2 was written with 4
    assert {name: getattr(WorldModelConfig(), name) for name in OMITTED_FIELDS_MEAN} != OMITTED_FIELDS_MEAN
    assert WorldModelConfig.from_dict(tiny_config().to_dict()) == tiny_config()  # written fields win


def test_config_round_trips_through_a_dict_and_rebuilds_the_same_architecture():
    config = tiny_config(num_map_classes=5)
    again = WorldModelConfig.from_dict(config.to_dict())
    assert again == config
    a, b = WorldModel(config), WorldModel(again)
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strides": ((1, 2),)}, "strides"),
        ({"strides": ((1, 2), (3, 2))}, "strides"),
        ({"sensor": VLP16.with_width(66).to_dict()}, "divisible"),
        ({"norm_groups": 3}, "norm_groups"),
        ({"p_drop_map": 1.0}, "p_drop_map"),
        ({"num_map_classes": 0}, "num_map_classes"),
        ({"strides": ((1, 2), (2, 2), (2, 2))}, "strides"),
        ({"strides": ((1, 2), (2, 2, 1))}, "strides"),
        ({"strides": 2}, "strides"),
        ({"p_drop_layout": 1.0}, "p_drop_layout"),
        ({"p_drop_cache": -0.1}, "p_drop_cache"),
        ({"blocks": 0}, "blocks"),
        ({"default_steps": 0}, "default_steps"),
        ({"default_noise_scale": 0.0}, "default_noise_scale"),
        ({"default_noise_scale": 3.0}, "default_noise_scale"),
        ({"prior_snap": -0.01}, "prior_snap"),
        ({"prior_snap": 0.5}, "prior_snap"),
        ({"keep_gate": "yes"}, "keep_gate"),
        ({"bottleneck_attention": 1}, "bottleneck_attention"),
    ],
)
def test_bad_config_fields_are_named_in_the_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_unknown_config_fields_are_rejected_by_name():
    with pytest.raises(ValueError, match="bogus"):
        WorldModelConfig.from_dict({**tiny_config().to_dict(), "bogus": 1})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"base_channels": 1_000_000}, "base_channels"),
        ({"channel_mults": (1, 2, 100_000)}, "channel_mults"),
        ({"base_channels": 64, "channel_mults": (1, 64, 64)}, "channel_mults"),  # each number fine, the product not
        ({"channel_mults": (1,) * 50, "strides": ((1, 1),) * 49}, "channel_mults"),
        ({"blocks": 10_000}, "blocks"),
        ({"sensor": VLP16.with_width(MAX_SENSOR_SHAPE[1] * 2).to_dict()}, "sensor"),
    ],
)
def test_an_oversized_architecture_is_refused_by_field_before_anything_is_allocated(overrides, message, monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("a network was built from a config that should have been refused")

    monkeypatch.setattr(WorldModel, "__init__", no_allocation)
    with pytest.raises(ValueError, match=rf"WorldModelConfig\.{message}"):
        tiny_config(**overrides)
    with pytest.raises(ValueError, match=message):
        WorldModelConfig.from_dict({**tiny_config().to_dict(), **overrides})


def test_the_widest_allowed_level_is_accepted():
    config = tiny_config(base_channels=8, channel_mults=(1, 2, MAX_LEVEL_CHANNELS // 8))
    assert max(config.level_channels) == MAX_LEVEL_CHANNELS


def test_removed_v1_fields_are_refused_by_name():
    for name, value in (("prediction", "x0"), ("cache_residual", True)):
        with pytest.raises(ValueError, match=name):
            WorldModelConfig.from_dict({**tiny_config().to_dict(), name: value})


def test_where_nothing_is_known_the_range_base_is_flat_ground_under_a_downward_beam() -> None:
    from inference.conditioning import empty_condition
    from inference.network import RANGE_FILL

    config = WorldModelConfig()
    sensor = config.sensor_obj
    model = WorldModel(config)
    base_range, _, returns = model.base_image(torch.from_numpy(empty_condition(sensor))[None])
    assert not returns.any()
    metres = decode_range(base_range[0].numpy(), sensor.max_range, sensor.min_range)
    lowest = sensor.height - 1
    expected = sensor.mount_height / np.sin(-sensor.elevations[lowest])
    np.testing.assert_allclose(metres[lowest], expected, rtol=1e-4)
    upward = int(np.flatnonzero(sensor.elevations > 0)[0])
    assert torch.allclose(base_range[0, upward], torch.tensor(RANGE_FILL))
    assert "range_fill" not in model.state_dict()  # derived from the sensor: old releases load unchanged
