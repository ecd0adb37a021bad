"""Rectified flow: the one definition of the noising path, shared by the training loss and the sampler.

Orientation (used everywhere): t = 0 is data, t = 1 is pure Gaussian noise, and the path is straight,

    x_t = (1 - t) * x0 + t * noise,        v = dx_t/dt = noise - x0,

so the clean image is x0 = x_t - t * v, and sampling integrates from t = 1 down to t = 0. Straight paths are
what make a handful of Euler steps usable (Liu et al. 2022; SD3). The network predicts x0 (anchored to its
prior, see `inference.network`); the sampler works with the velocity it implies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


def interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The point at time t (B,) on the straight path from data x0 to noise."""
    tt = t.to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    return (1.0 - tt) * x0 + tt * noise


#: Smallest t an x0 prediction is divided by (the sampler never goes below 1 / steps).
T_MIN = 1e-3
#: Largest sampling temperature (initial-noise scale) accepted; 1 is the distribution the flow was trained on.
MAX_NOISE_SCALE = 2.0
#: Weight of the range term against intensity and return: log-range errors are small numbers that matter.
RANGE_WEIGHT = 4.0


class X0Model(Protocol):
    def predict_x0(self, x_t: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor: ...


def to_velocity(x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The velocity implied by a clean-image estimate at (x_t, t)."""
    tt = t.to(x_t.dtype).view(-1, *([1] * (x_t.dim() - 1))).clamp_min(T_MIN)
    return (x_t - x0) / tt


def sample_training_t(batch: int, generator: torch.Generator, schedule: str = "uniform") -> torch.Tensor:
    """Training times on `generator.device`.

    Uniform is the default because a 4-step sampler evaluates the net at t = 1, 0.75, 0.5, 0.25, and
    logit-normal (SD3, good for many steps) almost never trains near t = 1, where the first step decides
    the whole sweep.
    """
    if schedule == "logit_normal":
        return torch.sigmoid(torch.randn(batch, generator=generator, device=generator.device))
    if schedule == "uniform":
        return torch.rand(batch, generator=generator, device=generator.device)
    raise ValueError(f"unknown t schedule {schedule!r}; expected 'logit_normal' or 'uniform'")


def flow_matching_loss(
    model: nn.Module,
    image: torch.Tensor,
    cond: torch.Tensor,
    generator: torch.Generator,
    schedule: str = "uniform",
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """The world model's loss at random times; noise and t from `generator`.

    `image` is a (B, 2, H, W) `encode_image` batch. Range and intensity are L1 (the per-pixel median, so a
    sweep stays crisp) and only where the target returns; whether it returns is a BCE on the return logit.
    A ray drop is never averaged with a far return, the blur an image-space loss learns. A model with a keep
    gate (a fourth output) adds its BCE where the prior and the target both return (`keep_target`).
    `seen` (B, H, W) 0/1 leaves out the pixels the target's sensor never covered (a recording from a sensor
    with a narrower field of view than the model's): there its missing returns are not ray drops.
    """
    x0 = model.flow_target(image, cond)
    noise = torch.randn(x0.shape, generator=generator, device=generator.device, dtype=x0.dtype).to(x0.device)
    t = sample_training_t(x0.shape[0], generator, schedule).to(x0.device)
    out = model(interpolate(x0, noise, t), t, cond).float()
    x0 = x0.float()
    seen = torch.ones_like(x0[:, 2]) if seen is None else seen.to(x0.device, x0.dtype)
    returns = x0[:, 2] > 0
    weight = returns.float() * seen / (returns.float() * seen).sum().clamp_min(1)
    range_l1 = ((out[:, 0] - x0[:, 0]).abs() * weight).sum()
    intensity_l1 = ((out[:, 1] - x0[:, 1]).abs() * weight).sum()
    bce = F.binary_cross_entropy_with_logits(out[:, 2], returns.float(), weight=seen, reduction="sum")
    loss = RANGE_WEIGHT * range_l1 + intensity_l1 + bce / seen.sum().clamp_min(1)
    if out.shape[1] > x0.shape[1]:  # an output beyond the flow image's channels: the keep gate's logit
        label, counted = model.keep_target(x0, cond)
        counted = counted * seen
        gate = F.binary_cross_entropy_with_logits(out[:, x0.shape[1]], label, reduction="none")
        loss = loss + (gate * counted).sum() / counted.sum().clamp_min(1)
    return loss


def guided_velocity(model: X0Model, x_t: torch.Tensor, t: torch.Tensor, cond: Any, guidance: float = 1.0) -> torch.Tensor:
    """Classifier-free guidance: v_uncond + guidance * (v_cond - v_uncond), in one batched forward.

    `cond` is the condition of x_t's batch (B); with guidance other than 1 it is that condition followed by
    the unconditional one (`conditioning.drop_map`) along the batch (2B), in whatever form the model takes
    (a tensor, or a model's prepared condition reused across steps). At guidance 1.0 the unconditional
    pass would cancel out, so it is not asked for.
    """
    b = x_t.shape[0]
    t = t.to(x_t.device).reshape(-1).expand(b)
    if guidance == 1.0:
        return to_velocity(model.predict_x0(x_t, t, cond), x_t, t)
    x2, t2 = torch.cat([x_t, x_t]), torch.cat([t, t])
    v_cond, v_uncond = to_velocity(model.predict_x0(x2, t2, cond), x2, t2).chunk(2)
    return v_uncond + guidance * (v_cond - v_uncond)


@dataclass
class SamplerOutput:
    """One Euler step: the sample at the next (lower) time and the clean image predicted on the way."""

    prev_sample: torch.Tensor
    pred_original_sample: torch.Tensor


class FlowMatchSampler:
    """Euler integration of the rectified-flow ODE from t = 1 to t = 0 (diffusers-style set_timesteps/step).

    The ODE is deterministic, so all randomness is the initial noise (`init_noise` with a torch.Generator).
    `shift` > 1 spends more of the steps at high noise (SD3's time shift); 1.0 keeps them uniform.
    `noise_scale` < 1 starts from tempered noise (a flow's sampling temperature, as in Glow): samples come
    nearer the likeliest sweep and vary less between seeds.
    """

    def __init__(self, shift: float = 1.0, noise_scale: float = 1.0) -> None:
        if shift <= 0:
            raise ValueError(f"FlowMatchSampler shift must be > 0, got {shift}")
        if not 0 < noise_scale <= MAX_NOISE_SCALE:
            raise ValueError(f"FlowMatchSampler noise_scale must be in (0, {MAX_NOISE_SCALE}], got {noise_scale}")
        self.shift = float(shift)
        self.noise_scale = float(noise_scale)
        self.sigmas = torch.empty(0)
        self.timesteps = torch.empty(0)

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        """Times t_0 = 1 > t_1 > ... > t_{n-1}; the last step lands on t = 0."""
        if int(num_inference_steps) < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        s = torch.linspace(1.0, 0.0, int(num_inference_steps) + 1, dtype=torch.float64)
        s = self.shift * s / (1.0 + (self.shift - 1.0) * s)
        self.sigmas = s.to(device=device, dtype=torch.float32)
        self.timesteps = self.sigmas[:-1]

    @property
    def num_inference_steps(self) -> int:
        return len(self.timesteps)

    def init_noise(
        self,
        shape: tuple[int, ...],
        generator: torch.Generator,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """x at t = 1, drawn on the generator's device so a seed gives the same noise whatever `device` is."""
        noise = self.noise_scale * torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
        return noise.to(device=device or generator.device, dtype=dtype)

    def step(
        self, model_output: torch.Tensor, timestep: float | torch.Tensor, sample: torch.Tensor
    ) -> SamplerOutput:
        if not len(self.timesteps):
            raise RuntimeError("FlowMatchSampler.step called before set_timesteps(n)")
        t_value = float(timestep)
        index = int(torch.argmin((self.timesteps.cpu() - t_value).abs()))
        if abs(float(self.timesteps[index]) - t_value) > 1e-6:
            raise ValueError(
                f"timestep {t_value} is not one of the sampler's timesteps {self.timesteps.tolist()}"
            )
        t, t_next = float(self.sigmas[index]), float(self.sigmas[index + 1])
        v = model_output.to(sample.dtype)
        return SamplerOutput(prev_sample=sample + (t_next - t) * v, pred_original_sample=sample - t * v)
