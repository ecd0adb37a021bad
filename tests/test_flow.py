"""Rectified flow: the path and its velocity, the loss, the Euler sampler and classifier-free guidance."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference.flow import (
    RANGE_WEIGHT,
    FlowMatchSampler,
    flow_matching_loss,
    guided_velocity,
    interpolate,
    to_velocity,
)
from tests.helpers import tiny_vlp16_model


class Oracle(nn.Module):
    """The exact velocity field for a single data point x0: v(x_t, t) = (x_t - x0) / t."""

    def __init__(self, x0: torch.Tensor) -> None:
        super().__init__()
        self.x0 = x0

    def forward(self, x_t, t, cond):
        return (x_t - self.x0) / t.view(-1, 1, 1, 1).clamp_min(1e-6)


class X0Oracle(nn.Module):
    """A model that knows the clean image: `predict_x0` is what the sampler and guidance call."""

    def __init__(self, x0: torch.Tensor) -> None:
        super().__init__()
        self.x0 = x0

    def predict_x0(self, x_t, t, cond):
        return self.x0.expand_as(x_t)


class FixedOutput(nn.Module):
    """A stub world model: a given flow target and a given raw output (range, intensity, return logit)."""

    def __init__(self, target: torch.Tensor, output: torch.Tensor) -> None:
        super().__init__()
        self.target, self.output = target, output

    def flow_target(self, image, cond):
        return self.target

    def forward(self, x_t, t, cond):
        return self.output.clone()


def flow_target_with_drops(seed: int = 0, shape=(2, 3, 4, 8)) -> torch.Tensor:
    """A flow target: encoded ranges and intensities, return +1 / ray drop -1 (about a third drops)."""
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.rand(shape, generator=gen) * 1.8 - 0.9
    x0[:, 2] = torch.where(torch.rand(shape[0], *shape[2:], generator=gen) < 0.35, -1.0, 1.0)
    return x0


def perfect_output(x0: torch.Tensor, logit: float = 60.0) -> torch.Tensor:
    """Range and intensity exactly the target, and a return logit sure of the right answer."""
    return torch.stack([x0[:, 0], x0[:, 1], logit * x0[:, 2]], dim=1)


def test_path_runs_from_data_at_t0_to_noise_at_t1_with_constant_velocity():
    x0, noise = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    torch.testing.assert_close(interpolate(x0, noise, torch.zeros(2)), x0)
    torch.testing.assert_close(interpolate(x0, noise, torch.ones(2)), noise)
    t, dt = torch.tensor([0.3, 0.6]), 1e-3
    finite_diff = (interpolate(x0, noise, t + dt) - interpolate(x0, noise, t)) / dt
    torch.testing.assert_close(finite_diff, noise - x0, atol=1e-2, rtol=1e-2)


def test_loss_is_zero_where_the_model_outputs_exactly_the_target():
    x0 = flow_target_with_drops()
    gen = torch.Generator().manual_seed(0)
    assert flow_matching_loss(FixedOutput(x0, perfect_output(x0)), x0[:, :2], None, gen).item() < 1e-12


def test_the_range_term_is_the_weighted_l1_over_returning_pixels_only():
    x0 = flow_target_with_drops(1)
    returns = x0[:, 2] > 0
    out = perfect_output(x0)
    b, y, x = torch.nonzero(returns)[0]
    out[b, 0, y, x] += 0.25
    loss = flow_matching_loss(FixedOutput(x0, out), x0[:, :2], None, torch.Generator().manual_seed(0))
    assert loss.item() == pytest.approx(RANGE_WEIGHT * 0.25 / returns.sum().item(), rel=1e-5)
    out[b, 1, y, x] += 0.5  # intensity: weight 1
    loss = flow_matching_loss(FixedOutput(x0, out), x0[:, :2], None, torch.Generator().manual_seed(0))
    assert loss.item() == pytest.approx((RANGE_WEIGHT * 0.25 + 0.5) / returns.sum().item(), rel=1e-5)


def test_the_loss_ignores_range_and_intensity_where_the_target_is_a_ray_drop():
    x0 = flow_target_with_drops(2)
    out = perfect_output(x0)
    out[:, :2] += 0.3  # every range and intensity is off
    drops = (x0[:, 2] < 0).unsqueeze(1).expand(-1, 2, -1, -1)
    moved = x0.clone()
    moved[:, :2][drops] = torch.rand(int(drops.sum()), generator=torch.Generator().manual_seed(5)) * 2 - 1
    loss = lambda target: flow_matching_loss(  # noqa: E731
        FixedOutput(target, out), target[:, :2], None, torch.Generator().manual_seed(3)
    ).item()
    assert loss(moved) == loss(x0)
    hit = x0.clone()
    hit[:, 0][x0[:, 2] > 0] += 0.1  # the same change where the target returns does count
    assert loss(hit) != loss(x0)


def test_the_bce_term_reacts_to_return_mistakes():
    x0 = flow_target_with_drops(3)
    out = perfect_output(x0, logit=60.0)
    drop = torch.nonzero(x0[:, 2] < 0)[0]
    ret = torch.nonzero(x0[:, 2] > 0)[0]
    out[drop[0], 2, drop[1], drop[2]] = 60.0  # a spurious return
    loss = flow_matching_loss(FixedOutput(x0, out), x0[:, :2], None, torch.Generator().manual_seed(0))
    assert loss.item() == pytest.approx(60.0 / x0[:, 2].numel(), rel=1e-4)
    out[ret[0], 2, ret[1], ret[2]] = -60.0  # and a missed one
    loss = flow_matching_loss(FixedOutput(x0, out), x0[:, :2], None, torch.Generator().manual_seed(0))
    assert loss.item() == pytest.approx(120.0 / x0[:, 2].numel(), rel=1e-4)
    unsure = perfect_output(x0, logit=0.0)  # p = 1/2 everywhere: log 2 per pixel
    loss = flow_matching_loss(FixedOutput(x0, unsure), x0[:, :2], None, torch.Generator().manual_seed(0))
    assert loss.item() == pytest.approx(F.softplus(torch.tensor(0.0)).item(), rel=1e-5)


def test_loss_of_a_world_model_is_deterministic_per_generator_seed_and_trains_its_head():
    model = tiny_vlp16_model()
    fresh = model.head[-1]
    h, w = model.sensor.shape
    gen = torch.Generator().manual_seed(1)
    image = torch.rand(4, 2, h, w, generator=gen) * 1.8 - 0.9
    image[:, :, :4] = -1.0  # the top beams see nothing
    cond = torch.randn(4, model.config.cond_channels, h, w, generator=gen)
    a = flow_matching_loss(model, image, cond, torch.Generator().manual_seed(7))
    b = flow_matching_loss(model, image, cond, torch.Generator().manual_seed(7))
    c = flow_matching_loss(model, image, cond, torch.Generator().manual_seed(8))
    # a fresh model ignores x_t (its head is zero), so its loss cannot depend on the noise; its head still learns
    assert a.item() == b.item() == c.item()
    a.backward()
    assert fresh.weight.grad.abs().sum() > 0
    with torch.no_grad():
        torch.nn.init.normal_(fresh.weight, std=0.05)
    a = flow_matching_loss(model, image, cond, torch.Generator().manual_seed(7))
    b = flow_matching_loss(model, image, cond, torch.Generator().manual_seed(7))
    c = flow_matching_loss(model, image, cond, torch.Generator().manual_seed(8))
    assert a.item() == b.item() != c.item()


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_euler_sampling_with_the_oracle_lands_exactly_on_the_data(steps):
    x0 = torch.randn(1, 2, 4, 8)
    model, sampler = Oracle(x0), FlowMatchSampler()
    sampler.set_timesteps(steps)
    assert sampler.timesteps[0] == 1.0 and len(sampler.timesteps) == steps
    x = sampler.init_noise(x0.shape, torch.Generator().manual_seed(0))
    for t in sampler.timesteps:
        out = sampler.step(model(x, t.view(1), None), t, x)
        torch.testing.assert_close(out.pred_original_sample, x0, atol=1e-5, rtol=1e-5)
        x = out.prev_sample
    torch.testing.assert_close(x, x0, atol=1e-5, rtol=1e-5)


def test_shifted_schedule_spends_more_steps_at_high_noise_and_still_ends_at_zero():
    plain, shifted = FlowMatchSampler(), FlowMatchSampler(shift=3.0)
    plain.set_timesteps(4)
    shifted.set_timesteps(4)
    assert shifted.sigmas[-1] == 0.0 and shifted.sigmas[0] == 1.0
    assert (shifted.timesteps[1:] > plain.timesteps[1:]).all()


def test_sampler_noise_is_deterministic_per_seed():
    sampler = FlowMatchSampler()
    a = sampler.init_noise((1, 2, 4, 8), torch.Generator().manual_seed(3))
    b = sampler.init_noise((1, 2, 4, 8), torch.Generator().manual_seed(3))
    c = sampler.init_noise((1, 2, 4, 8), torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_tempered_sampler_scales_the_same_noise_and_refuses_a_temperature_out_of_range():
    plain = FlowMatchSampler().init_noise((1, 2, 4, 8), torch.Generator().manual_seed(3))
    tempered = FlowMatchSampler(noise_scale=0.6).init_noise((1, 2, 4, 8), torch.Generator().manual_seed(3))
    torch.testing.assert_close(tempered, 0.6 * plain)
    for bad in (0.0, -1.0, 2.5):
        with pytest.raises(ValueError, match="noise_scale"):
            FlowMatchSampler(noise_scale=bad)


def test_step_rejects_misuse_with_clear_errors():
    sampler = FlowMatchSampler()
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="set_timesteps"):
        sampler.step(x, 1.0, x)
    sampler.set_timesteps(4)
    with pytest.raises(ValueError, match="not one of"):
        sampler.step(x, 0.33, x)
    with pytest.raises(ValueError, match="num_inference_steps"):
        sampler.set_timesteps(0)


class CondX0:
    """predict_x0 = the first three condition channels."""

    def predict_x0(self, x_t, t, cond):
        return cond[:, :3] + 0 * x_t


def test_guidance_extrapolates_from_the_unconditional_towards_the_conditional_velocity():
    model = CondX0()
    x = torch.zeros(1, 3, 4, 8)
    cond, uncond = torch.full((1, 5, 4, 8), 2.0), torch.full((1, 5, 4, 8), 0.5)
    t = torch.tensor(0.5)
    # v = (x_t - x0) / t = -2 x0 here
    both = torch.cat([cond, uncond])
    torch.testing.assert_close(guided_velocity(model, x, t, cond, 1.0), torch.full((1, 3, 4, 8), -4.0))
    torch.testing.assert_close(guided_velocity(model, x, t, both, 3.0), torch.full((1, 3, 4, 8), -10.0))
    torch.testing.assert_close(guided_velocity(model, x, t, both, 0.0), torch.full((1, 3, 4, 8), -1.0))


@pytest.mark.parametrize("steps", [1, 4])
def test_an_x0_predicting_model_samples_onto_its_prediction(steps):
    x0 = torch.randn(1, 3, 4, 8)
    model = X0Oracle(x0)
    sampler = FlowMatchSampler()
    sampler.set_timesteps(steps)
    x = sampler.init_noise(x0.shape, torch.Generator().manual_seed(1))
    for t in sampler.timesteps:
        x = sampler.step(guided_velocity(model, x, t, None), t, x).prev_sample
    torch.testing.assert_close(x, x0, atol=1e-5, rtol=1e-5)


def test_an_x0_estimate_implies_the_path_velocity():
    x0, noise = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    t = torch.tensor([0.9, 0.3])
    x_t = interpolate(x0, noise, t)
    torch.testing.assert_close(to_velocity(x0, x_t, t), noise - x0, atol=1e-5, rtol=1e-5)
