"""The world model's denoiser: a small range-image UNet (R2DM-style) that predicts a flow velocity.

The range image wraps around in azimuth, so every convolution pads the width circularly (a roll of the
input by a multiple of the total width stride rolls the output by the same amount) and pads the height
with zeros: beams above the top one and below the bottom one do not exist. Downsampling halves mostly the
width, because a 32-beam image is already short; the map, cache and beam/azimuth coordinates come in as
extra input channels (see `inference.conditioning`), so the network itself knows nothing about geometry.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inference.conditioning import CACHE_IMAGE, condition_channels
from lidar.sensors import HDL32, Sensor
from lidar.sim.hdmap import MAP_CLASSES

#: Channels of the generated image x: encoded log-range (`lidar.range_image.encode_range`), intensity*2-1.
IMAGE_CHANNELS = 2


@dataclass
class WorldModelConfig:
    """Everything needed to rebuild a `WorldModel` from a release's `config.json` alone."""

    #: The model sensor (`Sensor.to_dict()`); H, W and the range limits come from here, never from constants.
    sensor: dict[str, Any] = field(default_factory=lambda: HDL32.with_width(512).to_dict())
    #: Map layers one-hot encoded in the condition, class 0 included (`lidar.sim.MAP_CLASSES`).
    num_map_classes: int = len(MAP_CLASSES)
    #: Channels of the first level; level i has base_channels * channel_mults[i].
    base_channels: int = 16
    channel_mults: tuple[int, ...] = (1, 2, 4, 8)
    #: (height, width) stride into each level after the first; the sensor shape must divide by their product.
    strides: tuple[tuple[int, int], ...] = ((1, 2), (2, 2), (2, 2))
    #: Residual blocks per level (encoder and decoder alike).
    blocks: int = 1
    #: Self-attention at the bottleneck gives every pixel the whole sweep (cheap at 1/64 of the pixels).
    bottleneck_attention: bool = True
    #: GroupNorm groups (must divide every level's channels).
    norm_groups: int = 8
    #: Training-time probability that the map is dropped (free generation, the CFG unconditional branch).
    p_drop_map: float = 0.15
    #: Training-time probability that the cache is emptied (the first frame of a rollout).
    p_drop_cache: float = 0.1
    #: What the network outputs: "x0" (the clean image; copying the cache is then an identity map, and
    #: few-step Euler becomes x_next = (t_next/t) x_t + (1 - t_next/t) x0) or "velocity" (noise - x0).
    prediction: str = "x0"
    #: x0 models only: predict a correction to the cache seen from the new pose (condition channels 0-1,
    #: already in the image encoding) instead of the image itself. With the zero-initialised head a fresh
    #: model is exactly the cache-only baseline and training spends itself on holes and the map.
    cache_residual: bool = False
    #: Default sampling steps and classifier-free guidance scale for rollout.
    default_steps: int = 4
    default_guidance: float = 1.0

    def __post_init__(self) -> None:
        self.channel_mults = tuple(int(m) for m in self.channel_mults)
        self.strides = tuple(tuple(int(v) for v in s) for s in self.strides)  # type: ignore[misc]
        sensor = self.sensor_obj  # validates the sensor dict
        if self.num_map_classes < 1:
            raise ValueError(f"WorldModelConfig.num_map_classes must be >= 1, got {self.num_map_classes}")
        if self.base_channels < 1 or not self.channel_mults or any(m < 1 for m in self.channel_mults):
            raise ValueError(
                f"WorldModelConfig: base_channels and channel_mults must be positive, got "
                f"base_channels={self.base_channels}, channel_mults={self.channel_mults}"
            )
        if len(self.strides) != len(self.channel_mults) - 1:
            raise ValueError(
                f"WorldModelConfig.strides needs one (h, w) stride per level after the first "
                f"({len(self.channel_mults) - 1}), got {len(self.strides)}: {self.strides}"
            )
        sh = math.prod(s[0] for s in self.strides)
        sw = math.prod(s[1] for s in self.strides)
        if any(len(s) != 2 or s[0] not in (1, 2) or s[1] not in (1, 2) for s in self.strides):
            raise ValueError(f"WorldModelConfig.strides must be (h, w) pairs of 1 or 2, got {self.strides}")
        if sensor.height % sh or sensor.width % sw:
            raise ValueError(
                f"WorldModelConfig: sensor image {sensor.shape} is not divisible by the total stride ({sh}, {sw}) "
                f"of strides={self.strides}"
            )
        bad = [c for c in self.level_channels if c % self.norm_groups]
        if bad:
            raise ValueError(
                f"WorldModelConfig.norm_groups={self.norm_groups} does not divide level channels {bad}"
            )
        if self.blocks < 1:
            raise ValueError(f"WorldModelConfig.blocks must be >= 1, got {self.blocks}")
        for name in ("p_drop_map", "p_drop_cache"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"WorldModelConfig.{name} must be in [0, 1), got {p}")
        if self.prediction not in ("x0", "velocity"):
            raise ValueError(
                f"WorldModelConfig.prediction must be 'x0' or 'velocity', got {self.prediction!r}"
            )
        if self.cache_residual and self.prediction != "x0":
            raise ValueError(
                "WorldModelConfig.cache_residual needs prediction='x0' (it corrects the cached image)"
            )
        if self.default_steps < 1:
            raise ValueError(f"WorldModelConfig.default_steps must be >= 1, got {self.default_steps}")
        if self.default_guidance < 0:
            raise ValueError(f"WorldModelConfig.default_guidance must be >= 0, got {self.default_guidance}")

    @property
    def sensor_obj(self) -> Sensor:
        return Sensor.from_dict(self.sensor)

    @property
    def level_channels(self) -> list[int]:
        return [self.base_channels * m for m in self.channel_mults]

    @property
    def cond_channels(self) -> int:
        return condition_channels(self.num_map_classes)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["channel_mults"] = list(self.channel_mults)
        out["strides"] = [list(s) for s in self.strides]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorldModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown WorldModelConfig fields {sorted(unknown)}; expected a subset of {sorted(known)}"
            )
        return cls(**data)


class RingConv(nn.Conv2d):
    """3x3 (or 1x1) conv: circular padding in width (azimuth wraps), zeros in height (no beams beyond)."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: tuple[int, int] = (1, 1)) -> None:
        super().__init__(cin, cout, kernel, stride=stride, padding=(kernel // 2, 0))
        self.wrap = kernel // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wrap:
            x = F.pad(x, (self.wrap, self.wrap, 0, 0), mode="circular")
        return super().forward(x)


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, with the time embedding as a FiLM scale/shift between (ADM-style)."""

    def __init__(self, cin: int, cout: int, temb: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = RingConv(cin, cout)
        self.film = nn.Linear(temb, 2 * cout)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.conv2 = RingConv(cout, cout)
        nn.init.zeros_(self.conv2.weight)  # each block starts as the identity
        nn.init.zeros_(self.conv2.bias)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.film(temb)[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        h = self.conv2(F.silu(h))
        return self.skip(x) + h


class Attention(nn.Module):
    """Multi-head self-attention over all pixels; no positional bias, so it commutes with azimuth rolls."""

    def __init__(self, channels: int, groups: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.out = nn.Conv2d(channels, channels, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.qkv(self.norm(x)).reshape(b, 3, self.heads, c // self.heads, h * w)
        # (3, B, heads, pixels, dim), contiguous: CPU attention is 2x slower on transposed views
        q, k, v = qkv.permute(1, 0, 2, 4, 3).contiguous().unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(a.transpose(-1, -2).reshape(b, c, h, w))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of t in [0, 1] (scaled by 1000 so the frequencies match DDPM practice)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1)


class WorldModel(nn.Module):
    """Denoises the next sweep's range image given the noisy image and the condition.

    The output is the clean image or the flow velocity, per `config.prediction`; `inference.flow` turns
    either into a velocity for the sampler and picks the matching loss.
    """

    def __init__(self, config: WorldModelConfig) -> None:
        super().__init__()
        self.config = config
        chans = config.level_channels
        temb = 4 * config.base_channels
        groups = config.norm_groups
        self.time_mlp = nn.Sequential(
            nn.Linear(config.base_channels, temb), nn.SiLU(), nn.Linear(temb, temb), nn.SiLU()
        )
        self.stem = RingConv(IMAGE_CHANNELS + config.cond_channels, chans[0])

        self.down = nn.ModuleList()
        self.enc = nn.ModuleList()
        c = chans[0]
        for level, cout in enumerate(chans):
            if level > 0:
                self.down.append(RingConv(c, c, stride=config.strides[level - 1]))
            blocks = nn.ModuleList()
            for _ in range(config.blocks):
                blocks.append(ResBlock(c, cout, temb, groups))
                c = cout
            self.enc.append(blocks)

        self.mid = ResBlock(c, c, temb, groups)
        self.mid_attn = Attention(c, groups) if config.bottleneck_attention else nn.Identity()

        self.dec = nn.ModuleList()
        self.up = nn.ModuleList()
        for level in reversed(range(len(chans))):
            blocks = nn.ModuleList()
            for _ in range(config.blocks):
                blocks.append(ResBlock(c, chans[level], temb, groups))
                c = chans[level]
            self.dec.append(blocks)
            if level > 0:
                # Mix at the coarse resolution, then repeat pixels: a conv after upsampling costs 4x more.
                self.up.append(RingConv(c, chans[level - 1]))
                c = chans[level - 1]
        self.head = nn.Sequential(nn.GroupNorm(groups, c), nn.SiLU(), RingConv(c, IMAGE_CHANNELS))
        if config.cache_residual:
            nn.init.zeros_(self.head[-1].weight)
            nn.init.zeros_(self.head[-1].bias)

    @property
    def sensor(self) -> Sensor:
        return self.config.sensor_obj

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """x_t (B, 2, H, W), t (B,) in [0, 1], cond (B, C, H, W) -> x0 or velocity (B, 2, H, W)."""
        b, _, h, w = x_t.shape
        expected = (IMAGE_CHANNELS, *self.config.sensor_obj.shape)
        if tuple(x_t.shape[1:]) != expected or tuple(cond.shape) != (b, self.config.cond_channels, h, w):
            raise ValueError(
                f"WorldModel expects x_t (B, {expected[0]}, {expected[1]}, {expected[2]}) and cond "
                f"(B, {self.config.cond_channels}, H, W); got x_t {tuple(x_t.shape)}, cond {tuple(cond.shape)}"
            )
        temb = self.time_mlp(timestep_embedding(t.expand(b), self.config.base_channels).to(x_t.dtype))
        hx = self.stem(torch.cat([x_t, cond.to(x_t.dtype)], dim=1))
        skips = []
        for level, blocks in enumerate(self.enc):
            if level > 0:
                hx = self.down[level - 1](hx)
            for block in blocks:
                hx = block(hx, temb)
                skips.append(hx)
        hx = self.mid_attn(self.mid(hx, temb))
        for i, blocks in enumerate(self.dec):
            for block in blocks:
                hx = block(hx + skips.pop(), temb)
            if i < len(self.up):
                skip_shape = skips[-1].shape[-2:]
                hx = F.interpolate(self.up[i](hx), size=skip_shape, mode="nearest")
        out = self.head(hx)
        if self.config.cache_residual:
            out = out + cond[:, CACHE_IMAGE].to(out.dtype)
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
