"""Rectified flow: the path and its velocity, the loss, the Euler sampler and classifier-free guidance."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from inference.flow import (
    FlowMatchSampler,
    flow_matching_loss,
    guided_velocity,
    interpolate,
    prediction_type,
    to_velocity,
    velocity_target,
)


class Oracle(nn.Module):
    """The exact velocity field for a single data point x0: v(x_t, t) = (x_t - x0) / t."""

    def __init__(self, x0: torch.Tensor) -> None:
        super().__init__()
        self.x0 = x0

    def forward(self, x_t, t, cond):
        return (x_t - self.x0) / t.view(-1, 1, 1, 1).clamp_min(1e-6)


class X0Oracle(nn.Module):
    """An x0-predicting network (as `WorldModelConfig.prediction = "x0"`) that knows the answer."""

    def __init__(self, x0: torch.Tensor) -> None:
        super().__init__()
        self.x0 = x0
        self.config = SimpleNamespace(prediction="x0")

    def forward(self, x_t, t, cond):
        return self.x0.expand_as(x_t)


def test_path_runs_from_data_at_t0_to_noise_at_t1_with_constant_velocity():
    x0, noise = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    torch.testing.assert_close(interpolate(x0, noise, torch.zeros(2)), x0)
    torch.testing.assert_close(interpolate(x0, noise, torch.ones(2)), noise)
    t, dt = torch.tensor([0.3, 0.6]), 1e-3
    finite_diff = (interpolate(x0, noise, t + dt) - interpolate(x0, noise, t)) / dt
    torch.testing.assert_close(finite_diff, velocity_target(x0, noise), atol=1e-2, rtol=1e-2)


def test_loss_is_zero_for_the_oracle_velocity_and_positive_otherwise():
    x0 = torch.randn(1, 2, 4, 8)
    gen = torch.Generator().manual_seed(0)
    assert flow_matching_loss(Oracle(x0), x0, None, gen).item() < 1e-8
    zero = flow_matching_loss(lambda x_t, t, c: torch.zeros_like(x_t), x0, None, gen)
    assert zero.item() > 0.5  # E|noise - x0|^2 = 2 per element


def test_loss_is_deterministic_per_generator_seed():
    model = nn.Conv2d(2, 2, 1)
    x0 = torch.randn(4, 2, 4, 8)
    fwd = lambda x_t, t, c: model(x_t) * t.view(-1, 1, 1, 1)  # noqa: E731
    a = flow_matching_loss(fwd, x0, None, torch.Generator().manual_seed(7))
    b = flow_matching_loss(fwd, x0, None, torch.Generator().manual_seed(7))
    c = flow_matching_loss(fwd, x0, None, torch.Generator().manual_seed(8))
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


def test_guidance_extrapolates_from_the_unconditional_towards_the_conditional_velocity():
    model = lambda x_t, t, c: c[:, :2] + 0 * x_t  # noqa: E731  (velocity = first two cond channels)
    x = torch.zeros(1, 2, 4, 8)
    cond, uncond = torch.full((1, 3, 4, 8), 2.0), torch.full((1, 3, 4, 8), 0.5)
    t = torch.tensor(0.5)
    assert torch.equal(guided_velocity(model, x, t, cond, uncond, 1.0), cond[:, :2])
    torch.testing.assert_close(guided_velocity(model, x, t, cond, uncond, 3.0), torch.full((1, 2, 4, 8), 5.0))
    torch.testing.assert_close(guided_velocity(model, x, t, cond, uncond, 0.0), uncond[:, :2])


@pytest.mark.parametrize("steps", [1, 4])
def test_an_x0_predicting_model_samples_and_trains_through_the_same_functions(steps):
    x0 = torch.randn(1, 2, 4, 8)
    model = X0Oracle(x0)
    assert prediction_type(model) == "x0" and prediction_type(Oracle(x0)) == "velocity"
    assert flow_matching_loss(model, x0, None, torch.Generator().manual_seed(0)).item() < 1e-10
    sampler = FlowMatchSampler()
    sampler.set_timesteps(steps)
    x = sampler.init_noise(x0.shape, torch.Generator().manual_seed(1))
    for t in sampler.timesteps:
        x = sampler.step(guided_velocity(model, x, t, None), t, x).prev_sample
    torch.testing.assert_close(x, x0, atol=1e-5, rtol=1e-5)


def test_x0_and_velocity_outputs_imply_the_same_velocity():
    x0, noise = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    t = torch.tensor([0.9, 0.3])
    x_t = interpolate(x0, noise, t)
    torch.testing.assert_close(
        to_velocity(x0, x_t, t, "x0"), velocity_target(x0, noise), atol=1e-5, rtol=1e-5
    )
    v = velocity_target(x0, noise)
    assert to_velocity(v, x_t, t, "velocity") is v


def test_l1_loss_is_the_mean_absolute_error_of_the_same_prediction():
    x0 = torch.randn(2, 2, 4, 8)
    model = lambda x_t, t, c: torch.zeros_like(x_t)  # noqa: E731  (a velocity model predicting 0)
    l1 = flow_matching_loss(model, x0, None, torch.Generator().manual_seed(0), norm="l1")
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(x0.shape, generator=gen)
    assert l1.item() == pytest.approx((noise - x0).abs().mean().item(), rel=1e-6)
    with pytest.raises(ValueError, match="norm"):
        flow_matching_loss(model, x0, None, gen, norm="huber")
