"""The range-image UNet: shapes, config round trip and validation, and azimuth wrap-around."""

import pytest
import torch

from inference.network import IMAGE_CHANNELS, WorldModel, WorldModelConfig
from lidar.sensors import HDL32, VLP16


def tiny_config(**overrides) -> WorldModelConfig:
    kw = dict(
        sensor=VLP16.with_width(64).to_dict(),
        base_channels=8,
        channel_mults=(1, 2, 2),
        strides=((1, 2), (2, 2)),
    )
    kw.update(overrides)
    return WorldModelConfig(**kw)


def test_default_config_is_the_32x512_model_sensor_and_small_enough_for_cpu_training():
    config = WorldModelConfig()
    assert config.sensor_obj.shape == (32, 512)
    assert config.sensor_obj.elevations_deg == HDL32.elevations_deg
    params = WorldModel(config).num_parameters()
    assert 1_000_000 <= params <= 3_000_000


def test_forward_maps_noisy_image_and_condition_to_a_velocity_of_the_image_shape():
    config = tiny_config()
    model = WorldModel(config)
    h, w = config.sensor_obj.shape
    x = torch.randn(3, IMAGE_CHANNELS, h, w)
    out = model(x, torch.rand(3), torch.randn(3, config.cond_channels, h, w))
    assert out.shape == x.shape
    assert torch.isfinite(out).all()


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
            torch.randn(1, 2, h, w), torch.rand(1), torch.randn(1, config.cond_channels + 1, h, w)
        )


def test_rolling_input_in_azimuth_rolls_the_output_by_the_same_amount():
    config = tiny_config()
    torch.manual_seed(0)
    model = WorldModel(config).eval()
    for p in model.parameters():  # zero-initialised output convs would make the test trivially pass
        torch.nn.init.normal_(p, std=0.1)
    h, w = config.sensor_obj.shape
    x, cond, t = torch.randn(1, 2, h, w), torch.randn(1, config.cond_channels, h, w), torch.rand(1)
    shift = 4 * 3  # a multiple of the total width stride (4)
    with torch.no_grad():
        out = model(x, t, cond)
        rolled = model(x.roll(shift, dims=-1), t, cond.roll(shift, dims=-1))
    assert out.abs().mean() > 1e-3
    torch.testing.assert_close(rolled, out.roll(shift, dims=-1), atol=1e-4, rtol=1e-4)


def test_a_fresh_cache_residual_model_predicts_exactly_the_cached_image():
    config = tiny_config(cache_residual=True)
    model = WorldModel(config)
    h, w = config.sensor_obj.shape
    cond = torch.randn(2, config.cond_channels, h, w)
    out = model(torch.randn(2, IMAGE_CHANNELS, h, w), torch.rand(2), cond)
    torch.testing.assert_close(out, cond[:, :2])
    with pytest.raises(ValueError, match="cache_residual"):
        tiny_config(cache_residual=True, prediction="velocity")


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
        ({"prediction": "epsilon"}, "prediction"),
    ],
)
def test_bad_config_fields_are_named_in_the_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_unknown_config_fields_are_rejected_by_name():
    with pytest.raises(ValueError, match="bogus"):
        WorldModelConfig.from_dict({**tiny_config().to_dict(), "bogus": 1})
