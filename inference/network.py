"""The world model's denoiser: a small range-image UNet (R2DM-style) anchored to a geometric prior.

The range image wraps around in azimuth, so every convolution pads the width circularly (a roll of the
input by a multiple of the total width stride rolls the output by the same amount) and pads the height
with zeros: beams above the top one and below the bottom one do not exist. Downsampling halves mostly the
width, because a 32-beam image is already short; the cache, map, layout and beam/azimuth coordinates come
in as extra input channels (see `inference.conditioning`).

The network only corrects what the known geometry gets wrong (docs/design.md). Its clean-image estimate is

    range     = prior range + a log-range residual        (zero-initialised head: a fresh net is the prior)
    intensity = cached intensity (or a typical value) + a residual
    return    = a logit, biased towards the prior's returns, trained with BCE

so "where is a return" and "how far is it" are separate questions: a no-return is never averaged with a
far return. The flow (`inference.flow`) runs on the 3-channel image (range, intensity, return as +-1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inference.conditioning import (
    CACHE_INTENSITY,
    CACHE_MASK,
    MAP_START,
    SNAP_TOLERANCE,
    ConditionLayout,
    condition_channels,
    fill_gaps,
    prior_image,
)
from inference.flow import MAX_NOISE_SCALE
from inference.limits import CONFIG_MAX_GUIDANCE, CONFIG_MAX_STEPS
from lidar.range_image import encode_range
from lidar.sensors import HDL32, Sensor
from lidar.vocabulary import MAP_CLASSES

#: Channels of the flow image x: encoded log-range, intensity*2-1, return (+1) or ray drop (-1).
IMAGE_CHANNELS = 3
RANGE, INTENSITY, RETURN = 0, 1, 2
#: The network's extra output channel with `keep_gate`: the logit that the return lies at the prior's range.
KEEP = 3
#: Residual bases where the prior knows nothing: flat ground under the sensor for a downward beam
#: (`flat_ground_range`), else an encoded range of about 20 m; an intensity of about 0.2.
RANGE_FILL = 0.3
INTENSITY_FILL = -0.6
#: Logit bias of a fresh model: returns where the prior returns with p = sigmoid(3) = 0.95.
RETURN_PRIOR_LOGIT = 3.0
#: Bounds checked before a network is built, so a hostile or mistyped config.json cannot exhaust memory.
MAX_LEVEL_CHANNELS = 1024
MAX_LEVELS = 6
MAX_BLOCKS = 8
MAX_SENSOR_SHAPE = (256, 8192)
#: Narrowest image the network takes: the total width stride of the shipped architecture.
MIN_WIDTH = 8
#: Largest `prior_snap`: 0.2 in log-range is about half the range, beyond any "small correction".
MAX_PRIOR_SNAP = 0.2


#: WorldModelConfig fields that decide what the weights mean; the rest are training and sampling defaults.
ARCHITECTURE_FIELDS = ("sensor", "num_map_classes", "base_channels", "channel_mults", "strides", "blocks",
                       "bottleneck_attention", "norm_groups", "keep_gate", "gap_fill")
#: What a config that leaves a field out means by it, for the fields whose default has changed: the default
#: it was written under. The defaults became the release's architecture (v9) after configs had been written
#: against the first ones (attention on, no keep gate, no gap fill, maps and layouts dropped 15 % of the time),
#: and the default sampler steps went from 4 to 2 after every release before it had been written with 4;
#: `to_dict` writes every field, so only a config older than a field, or written by hand, leaves one out.
OMITTED_FIELDS_MEAN: dict[str, Any] = {
    "bottleneck_attention": True,
    "keep_gate": False,
    "gap_fill": False,
    "p_drop_map": 0.15,
    "p_drop_layout": 0.15,
    "default_steps": 4,
}


@dataclass
class WorldModelConfig:
    """Everything needed to rebuild a `WorldModel` from a release's `config.json` alone.

    The defaults are the shipped architecture (weights/default); `from_dict` reads a config that leaves a
    field out as it was meant when written (`OMITTED_FIELDS_MEAN`).
    """

    #: The model sensor (`Sensor.to_dict()`); H, W and the range limits come from here, never from constants.
    sensor: dict[str, Any] = field(default_factory=lambda: HDL32.with_width(512).to_dict())
    #: Map layers one-hot encoded in the condition, class 0 included (`lidar.vocabulary.MAP_CLASSES`).
    num_map_classes: int = len(MAP_CLASSES)
    #: Channels of the first level; level i has base_channels * channel_mults[i].
    base_channels: int = 16
    channel_mults: tuple[int, ...] = (1, 2, 4, 8)
    #: (height, width) stride into each level after the first; the sensor shape must divide by their product.
    strides: tuple[tuple[int, int], ...] = ((1, 2), (2, 2), (2, 2))
    #: Residual blocks per level (encoder and decoder alike).
    blocks: int = 1
    #: Self-attention at the bottleneck gives every pixel the whole sweep (cheap at 1/64 of the pixels).
    #: Off in the release (v9): it cost 4-7 % of a sampler step on one CPU thread (the model card).
    bottleneck_attention: bool = False
    #: GroupNorm groups (must divide every level's channels).
    norm_groups: int = 8
    #: A fourth output, the logit that a return lies within `prior_snap` of the prior's range (BCE-trained; the
    #: map tolerance `SNAP_TOLERANCE` when snapping is off).
    #: Sampling then keeps the prior wherever the gate says so (`WorldModel.predict_x0`): a decision by the
    #: likelier outcome, where a sampled range wanders off the prior whenever the prior is merely uncertain.
    keep_gate: bool = True
    #: Where the prior has no return but a neighbour within `conditioning.GAP_REACH` does, the residual base is
    #: that neighbour's range (`conditioning.fill_gaps`) instead of flat ground: a hole in a cached wall (a dark
    #: or glass patch, a dropped ray) starts at the wall, not 80 m behind it. A small conv net cannot make the
    #: residual jump that a one-pixel hole needs, and drew such holes at about twice the wall's range.
    gap_fill: bool = True
    #: Training-time probability that the map is dropped (free generation, the CFG unconditional branch).
    p_drop_map: float = 0.4
    #: Training-time probability that the cache is emptied (the first frame of a rollout).
    p_drop_cache: float = 0.1
    #: Training-time probability that the actor layout is dropped (real-data forecasting has none).
    p_drop_layout: float = 0.3
    #: Default sampling steps and classifier-free guidance scale for rollout. 2 steps, measured on the v10
    #: release (64 held-out drives, the KITTI pairs and KITTI 00): 0.93-1.02x the squared Chamfer of 4 steps,
    #: every bar as at 4, at 1.5-1.8x the frames/s (docs/benchmarks.md, "Sampler steps against Chamfer").
    default_steps: int = 2
    default_guidance: float = 1.0
    #: Default sampling temperature (`FlowMatchSampler.noise_scale`). 0.6, measured on the v4 release (6 held-out
    #: drives and the KITTI pairs): 10-13 % lower Chamfer than 1.0 for forecast, generation and real data alike.
    default_noise_scale: float = 0.6
    #: Encoded-range gap within which a sampled range takes the prior's exact value (`WorldModel.snap_to_prior`;
    #: 0 = raw samples). By default the tolerance within which a cached return confirms the map (`prior_image`).
    prior_snap: float = SNAP_TOLERANCE

    def __post_init__(self) -> None:
        self._check_architecture()
        for name in ("p_drop_map", "p_drop_cache", "p_drop_layout"):
            p = getattr(self, name)
            if not isinstance(p, int | float) or not 0.0 <= p < 1.0:
                raise ValueError(f"WorldModelConfig.{name} must be in [0, 1), got {p!r}")
        if not isinstance(self.default_steps, int) or not 1 <= self.default_steps <= CONFIG_MAX_STEPS:
            raise ValueError(f"WorldModelConfig.default_steps must be an integer in [1, {CONFIG_MAX_STEPS}], "
                             f"got {self.default_steps!r}")
        if not isinstance(self.default_guidance, int | float) or not 0 <= self.default_guidance <= CONFIG_MAX_GUIDANCE:
            raise ValueError(f"WorldModelConfig.default_guidance must be in [0, {CONFIG_MAX_GUIDANCE:g}], "
                             f"got {self.default_guidance!r}")
        if not isinstance(self.default_noise_scale, int | float) or not 0 < self.default_noise_scale <= MAX_NOISE_SCALE:
            raise ValueError(f"WorldModelConfig.default_noise_scale must be in (0, {MAX_NOISE_SCALE}], "
                             f"got {self.default_noise_scale!r}")
        if not isinstance(self.prior_snap, int | float) or not 0 <= self.prior_snap <= MAX_PRIOR_SNAP:
            raise ValueError(f"WorldModelConfig.prior_snap must be in [0, {MAX_PRIOR_SNAP}] (encoded range), "
                             f"got {self.prior_snap!r}")

    def _check_architecture(self) -> None:
        """Shapes and sizes, each error naming its field; bounded before anything is allocated."""
        sensor = self.sensor_obj  # validates the sensor dict
        if sensor.height > MAX_SENSOR_SHAPE[0] or sensor.width > MAX_SENSOR_SHAPE[1]:
            raise ValueError(
                f"WorldModelConfig.sensor: image {sensor.shape} exceeds the supported {MAX_SENSOR_SHAPE} (beams, width)"
            )
        _check_int(self.num_map_classes, "num_map_classes", 1, 256)
        _check_int(self.base_channels, "base_channels", 1, MAX_LEVEL_CHANNELS)
        _check_int(self.blocks, "blocks", 1, MAX_BLOCKS)
        _check_int(self.norm_groups, "norm_groups", 1, MAX_LEVEL_CHANNELS)
        for name in ("bottleneck_attention", "keep_gate", "gap_fill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"WorldModelConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.channel_mults, list | tuple) or not 1 <= len(self.channel_mults) <= MAX_LEVELS:
            raise ValueError(
                f"WorldModelConfig.channel_mults must list 1 to {MAX_LEVELS} level multipliers, got {self.channel_mults!r}"
            )
        for m in self.channel_mults:
            _check_int(m, "channel_mults", 1, MAX_LEVEL_CHANNELS)
        self.channel_mults = tuple(int(m) for m in self.channel_mults)
        too_wide = [c for c in self.level_channels if c > MAX_LEVEL_CHANNELS]
        if too_wide:
            raise ValueError(
                f"WorldModelConfig.channel_mults: level channels {too_wide} exceed {MAX_LEVEL_CHANNELS} "
                f"(base_channels={self.base_channels})"
            )
        strides = self.strides
        if (
            not isinstance(strides, list | tuple)
            or len(strides) != len(self.channel_mults) - 1
            or any(not isinstance(s, list | tuple) or len(s) != 2 or any(v not in (1, 2) for v in s) for s in strides)
        ):
            raise ValueError(
                f"WorldModelConfig.strides needs one (h, w) pair of 1 or 2 per level after the first "
                f"({len(self.channel_mults) - 1} pairs), got {strides!r}"
            )
        self.strides = tuple((int(s[0]), int(s[1])) for s in strides)  # type: ignore[misc]
        sh = math.prod(s[0] for s in self.strides)
        sw = math.prod(s[1] for s in self.strides)
        if sensor.height % sh or sensor.width % sw:
            raise ValueError(
                f"WorldModelConfig.strides: sensor image {sensor.shape} is not divisible by the total stride "
                f"({sh}, {sw}) of strides={self.strides}"
            )
        bad = [c for c in self.level_channels if c % self.norm_groups]
        if bad:
            raise ValueError(
                f"WorldModelConfig.norm_groups={self.norm_groups} does not divide level channels {bad}"
            )

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
        """The config a dict (a config.json, a checkpoint's record) describes; a field it leaves out means
        what it meant when the dict was written (`OMITTED_FIELDS_MEAN`), else the default."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown WorldModelConfig fields {sorted(unknown)}; expected a subset of {sorted(known)}"
            )
        return cls(**{**OMITTED_FIELDS_MEAN, **data})


def _check_int(value: Any, name: str, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"WorldModelConfig.{name} must be an integer in [{lo}, {hi}], got {value!r}")


class RingConv(nn.Conv2d):
    """3x3 (or 1x1) conv: circular padding in width (azimuth wraps), zeros in height (no beams beyond)."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: tuple[int, int] = (1, 1)) -> None:
        super().__init__(cin, cout, kernel, stride=stride, padding=(kernel // 2, 0))
        self.wrap = kernel // 2

    def forward(self, x: torch.Tensor, circular: bool = True) -> torch.Tensor:
        return super().forward(self._wrap(x, circular))

    def partial(self, x: torch.Tensor, first: int | list[int], bias: bool, circular: bool = True) -> torch.Tensor:
        """The response to input channels `first`, `first` + 1, ... only (x holds just those), or to the listed
        input channels.

        A conv is linear, so the responses to a split of its input channels sum to the whole: a part that
        does not change between calls can be computed once, and a part known early computed early.
        """
        weight = self.weight[:, first] if isinstance(first, list) else self.weight[:, first : first + x.shape[1]]
        return F.conv2d(self._wrap(x, circular), weight, self.bias if bias else None, self.stride, self.padding)

    def _wrap(self, x: torch.Tensor, circular: bool) -> torch.Tensor:
        """Pad the width: around the ring for a full sweep; with zeros for an azimuth crop, whose edges have no
        neighbours in the image (training cuts crops from full rings)."""
        if not self.wrap:
            return x
        return F.pad(x, (self.wrap, self.wrap, 0, 0), mode="circular" if circular else "constant")


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

    def forward(self, x: torch.Tensor, temb: torch.Tensor, circular: bool = True) -> torch.Tensor:
        # in place where a fresh tensor is overwritten (autograd keeps what it needs): fewer allocations, 5 %
        # less time a step when another job shares the CPU, no measurable change on an idle one
        h = self.conv1(F.silu(self.norm1(x), inplace=True), circular)
        scale, shift = self.film(temb)[:, :, None, None].chunk(2, dim=1)
        h = torch.addcmul(shift, self.norm2(h), 1 + scale)
        h = self.conv2(F.silu(h, inplace=True), circular)
        return h.add_(self.skip(x))


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
        return self.out(a.transpose(-1, -2).reshape(b, c, h, w)).add_(x)


@dataclass(frozen=True)
class PreparedCondition:
    """What a forward pass computes from the condition alone, once per sweep instead of once per step.

    A sampler calls the network `steps` times on one condition; the prior, the residual bases and the
    stem's response to the condition channels are the same each time.
    """

    base_range: torch.Tensor
    base_intensity: torch.Tensor
    returns: torch.Tensor
    #: The stem's response to the condition and prior channels, bias included.
    stem: torch.Tensor
    #: `base_range` in float32, whatever the model's dtype: what `WorldModel.snap_to_prior` keeps.
    exact_range: torch.Tensor
    #: The condition covers the whole revolution (`full_ring`): convolutions wrap around in azimuth.
    circular: bool = True


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of t in [0, 1] (scaled by 1000 so the frequencies match DDPM practice)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1)


class WorldModel(nn.Module):
    """Denoises the next sweep's range image given the noisy image and the condition.

    `forward` gives the raw estimate (range, intensity, return logit) the loss needs; `predict_x0` turns the
    logit into the +-1 return channel the sampler integrates.
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
        # the prior (range, returns) is derived from the condition but given explicitly: it is what to copy
        self.stem = RingConv(IMAGE_CHANNELS + config.cond_channels + 2, chans[0])

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
        outputs = IMAGE_CHANNELS + int(config.keep_gate)
        self.head = nn.Sequential(nn.GroupNorm(groups, c), nn.SiLU(inplace=True), RingConv(c, outputs))
        nn.init.zeros_(self.head[-1].weight)  # a fresh model reproduces the prior
        nn.init.zeros_(self.head[-1].bias)

    @property
    def sensor(self) -> Sensor:
        return self.config.sensor_obj

    def base_image(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the residuals are added to: (B, H, W) range and intensity bases and the prior's returns."""
        prior, returns = prior_image(cond, self.config.num_map_classes)
        sensor = self.sensor
        # each row's elevation (the channel is constant along a row): the beams of whatever sensor this is
        elevation = cond[:, ConditionLayout(self.config.num_map_classes).coords_start, :, 0] * (math.pi / 2.0)
        rows = flat_ground_fill(elevation.detach().cpu().double().numpy(), sensor.mount_height, sensor.max_range)
        base = torch.from_numpy(rows).to(device=prior.device, dtype=prior.dtype)[:, :, None].expand_as(prior)
        if self.config.gap_fill:
            filled, found = fill_gaps(prior, returns)
            base = torch.where(found, filled, base)
        base_range = torch.where(returns, prior, base)
        cached = cond[:, CACHE_MASK] > 0.5
        base_intensity = torch.where(cached, cond[:, CACHE_INTENSITY], torch.full_like(prior, INTENSITY_FILL))
        return base_range, base_intensity, returns

    def prepare(self, cond: torch.Tensor,
                views_stem: torch.Tensor | Callable[[], torch.Tensor] | None = None) -> PreparedCondition:
        """The condition-only part of `forward` for a (B, C, H, W) condition, to reuse across sampler steps.

        `views_stem`, the condition's `views_stem` worked out elsewhere, leaves only the cache's and the prior's
        share of the stem to compute here: a rollout draws the rest while the frame before samples. Given as a
        call, it is waited for once that share is computed, as a first frame's still being worked out beside it.
        """
        self._check_condition(cond)
        dtype = self.stem.weight.dtype
        # the prior from the float32 condition: rounded to bfloat16 a range 50 m away moves by 0.2 m, and a
        # sample snapped to it would show that step on every wall
        exact_range, base_intensity, returns = self.base_image(cond.float())
        cond, base_range = cond.to(dtype), exact_range.to(dtype)
        prior = torch.stack([base_range, returns.to(dtype)], dim=1)
        circular = full_ring(cond, self.config.num_map_classes)
        if views_stem is None:
            stem = self.stem.partial(torch.cat([cond, prior], dim=1), IMAGE_CHANNELS, bias=True, circular=circular)
        else:
            first_prior = IMAGE_CHANNELS + cond.shape[1]
            cache_and_prior = torch.cat([cond[:, :MAP_START], prior], dim=1)
            columns = [*range(IMAGE_CHANNELS, IMAGE_CHANNELS + MAP_START), first_prior, first_prior + 1]
            stem = self.stem.partial(cache_and_prior, columns, bias=False, circular=circular)
            views_stem = views_stem() if callable(views_stem) else views_stem
            if views_stem.shape != stem.shape:
                raise ValueError(f"WorldModel.prepare: views_stem must be the stem's response to this condition, "
                                 f"({cond.shape[0]}, {self.stem.out_channels}, H, W); got {tuple(views_stem.shape)}")
            stem += views_stem
        return PreparedCondition(base_range, base_intensity.to(dtype), returns, stem, exact_range, circular)

    def views_stem(self, cond: torch.Tensor) -> torch.Tensor:
        """The stem's response to a (B, C, H, W) condition's channels after its cache block (the map, the layout,
        the ray directions), bias included: all of the stem that does not wait for the cache, most of its cost."""
        self._check_condition(cond)
        views = cond[:, MAP_START:].to(self.stem.weight.dtype)
        circular = full_ring(cond, self.config.num_map_classes)
        return self.stem.partial(views, IMAGE_CHANNELS + MAP_START, bias=True, circular=circular)

    def _check_condition(self, cond: torch.Tensor) -> None:
        channels = self.config.cond_channels
        if cond.dim() != 4 or cond.shape[1] != channels or cond.shape[2] < 1 or cond.shape[3] < MIN_WIDTH:
            raise ValueError(
                f"WorldModel expects cond (B, {channels}, H, W) with W >= {MIN_WIDTH}, got {tuple(cond.shape)}"
            )

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor | PreparedCondition) -> torch.Tensor:
        """x_t (B, 3, H, W), t (B,) in [0, 1], cond (B, C, H, W) or its `prepare`d form -> (B, 3, H, W)
        range, intensity and return logit, and the keep logit as a fourth channel with `keep_gate`."""
        prepared = cond if isinstance(cond, PreparedCondition) else self.prepare(cond)
        b = x_t.shape[0]
        expected = (IMAGE_CHANNELS, *prepared.base_range.shape[-2:])
        if tuple(x_t.shape[1:]) != expected or prepared.stem.shape[0] != b:
            raise ValueError(
                f"WorldModel expects x_t (B, {expected[0]}, {expected[1]}, {expected[2]}) and a condition of the "
                f"same batch; got x_t {tuple(x_t.shape)} and a condition of batch {prepared.stem.shape[0]}"
            )
        base_range, base_intensity, returns = prepared.base_range, prepared.base_intensity, prepared.returns
        ring = prepared.circular
        temb = self.time_mlp(timestep_embedding(t.expand(b), self.config.base_channels).to(x_t.dtype))
        hx = self.stem.partial(x_t, 0, bias=False, circular=ring) + prepared.stem
        skips = []
        for level, blocks in enumerate(self.enc):
            if level > 0:
                hx = self.down[level - 1](hx, ring)
            for block in blocks:
                hx = block(hx, temb, ring)
                skips.append(hx)
        hx = self.mid_attn(self.mid(hx, temb, ring))
        for i, blocks in enumerate(self.dec):
            for block in blocks:
                hx = block(hx + skips.pop(), temb, ring)
            if i < len(self.up):
                skip_shape = skips[-1].shape[-2:]
                hx = F.interpolate(self.up[i](hx, ring), size=skip_shape, mode="nearest")
        out = self.head[1](self.head[0](hx))
        out = self.head[2](out, ring)
        bias = RETURN_PRIOR_LOGIT * (2.0 * returns.to(out.dtype) - 1.0)
        return torch.cat(
            [(base_range + out[:, RANGE]).unsqueeze(1), (base_intensity + out[:, INTENSITY]).unsqueeze(1),
             (bias + out[:, RETURN]).unsqueeze(1), out[:, KEEP:]], dim=1
        )

    def predict_x0(self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor | PreparedCondition) -> torch.Tensor:
        """The clean flow image the sampler steps towards: the return channel as its expectation 2p - 1, and
        with `keep_gate` the prior's range wherever the prior returns and the gate's logit is positive.

        Each condition of a guided batch keeps its own prior; guidance other than 1 then extrapolates between
        the two estimates, as it does for every channel, so the gate holds exactly only at guidance 1 (the
        default). The kept range is in the model's dtype; `snap_to_prior` makes it the float32 prior.
        """
        prepared = cond if isinstance(cond, PreparedCondition) else self.prepare(cond)
        out = self(x_t, t, prepared)
        range_ = out[:, RANGE]
        if self.config.keep_gate:
            range_ = torch.where(prepared.returns & (out[:, KEEP] > 0), prepared.base_range, range_)
        return torch.stack([range_, out[:, INTENSITY], torch.tanh(0.5 * out[:, RETURN])], dim=1)

    def keep_target(self, x0: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate's BCE label and where it counts, for a (B, 3, H, W) `flow_target`: label 1 where the target
        lies within the snap tolerance of the prior; counted where both return (elsewhere the return channel
        decides, and there is no range to keep)."""
        base_range, _, returns = self.base_image(cond.to(x0.dtype))
        tolerance = self.config.prior_snap if self.config.prior_snap > 0 else SNAP_TOLERANCE
        label = (x0[:, RANGE] - base_range).abs() < tolerance
        return label.to(x0.dtype), returns & (x0[:, RETURN] > 0)

    def snap_to_prior(self, x: torch.Tensor, prepared: PreparedCondition) -> torch.Tensor:
        """A sampled (B, 3, H, W) flow image with each range within `config.prior_snap` of the prior's replaced
        by the prior's exact range (the first B conditions of `prepared`; guidance stacks a twin behind them).

        The residual head is precise to about 0.02 in log-range (4 % of a range, a metre at 25 m); sampled as
        they are, its small corrections jitter every wall and road the map or a measured sweep places. The
        default tolerance, 0.05 (about 12 % of a range), is the one within which a cached return confirms the
        map, and it measured better than raw samples on every Chamfer (forecast, generation, KITTI). The
        price: without a layout, a car that moved less than that since it was cached stays where it was, and
        a cached point's own re-projection error (up to a beam spacing on the ground) is kept, not corrected.
        Larger corrections (a car that moved far, a wall behind one) stay as sampled.
        """
        if self.config.prior_snap <= 0:
            return x
        b = x.shape[0]
        base, returns = prepared.exact_range[:b].to(x.dtype), prepared.returns[:b]
        close = returns & ((x[:, RANGE] - base).abs() < self.config.prior_snap)
        return torch.cat([torch.where(close, base, x[:, RANGE]).unsqueeze(1), x[:, RANGE + 1 :]], dim=1)

    def flow_target(self, image: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) flow image of a (B, 2, H, W) `encode_image` batch.

        A ray drop has no range or intensity to learn; there the image holds the bases, so noise is added
        to something the network would have predicted anyway, and the loss ignores it.
        """
        base_range, base_intensity, _ = self.base_image(cond.to(image.dtype))
        returns = image[:, RANGE] > -1.0 + 1e-6
        return torch.stack(
            [
                torch.where(returns, image[:, RANGE], base_range),
                torch.where(returns, image[:, INTENSITY], base_intensity),
                returns.to(image.dtype) * 2.0 - 1.0,
            ],
            dim=1,
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def flat_ground_fill(elevation: np.ndarray, mount_height: float, max_range: float) -> np.ndarray:
    """Encoded range at which a ray of `elevation` (rad, any shape) meets flat ground `mount_height` below the
    sensor; RANGE_FILL for a ray that meets none within `max_range`.

    Where nothing is known the ground is still most likely there: with a constant base, the residual at a
    blind pixel would be large while at its cached neighbour it is zero, and a small conv net blurs the two
    (without a map it drew cached ground rings 30-45 % short). The network reads it off the condition's own
    elevation channel, so one network serves any beam table; the mount height is the model sensor's, in
    training and sampling alike, so a sensor mounted elsewhere only shifts a base the residual corrects.
    """
    down = -np.sin(np.asarray(elevation, dtype=np.float64))
    ground = np.where(down > 1e-3, mount_height / np.maximum(down, 1e-3), np.inf)
    ground = np.where(ground <= max_range, ground, np.nan)
    return np.where(np.isfinite(ground), encode_range(np.nan_to_num(ground), max_range), RANGE_FILL).astype(np.float32)


def flat_ground_range(sensor: Sensor) -> torch.Tensor:
    """(H, W) `flat_ground_fill` of every pixel of a sensor's range image."""
    rows = flat_ground_fill(sensor.elevations, sensor.mount_height, sensor.max_range)
    return torch.from_numpy(np.repeat(rows[:, None], sensor.width, axis=1))


def full_ring(cond: torch.Tensor, num_map_classes: int = len(MAP_CLASSES)) -> bool:
    """Whether a (B, C, H, W) condition covers the whole revolution, read off its azimuth channels: the step
    from its last column back to its first is one column's, as on a ring; an azimuth crop (training cuts them
    from full rings) has a wide gap there instead. Every condition of a batch shares one geometry."""
    start = ConditionLayout(num_map_classes).coords_start
    sin, cos = cond[0, start + 1, 0].double(), cond[0, start + 2, 0].double()
    azimuth = torch.atan2(sin, cos)
    if azimuth.numel() < 2:
        return True
    step = torch.remainder(azimuth[0] - azimuth[1], 2 * math.pi)
    wrap = torch.remainder(azimuth[-1] - azimuth[0], 2 * math.pi)
    return bool(torch.abs(wrap - step) < 0.01 * step)


def to_encoded_image(x: torch.Tensor) -> torch.Tensor:
    """(..., 3, H, W) flow image -> (..., 2, H, W) `encode_image` layout: -1 range and intensity at ray drops."""
    drop = x[..., RETURN, :, :] <= 0.0
    fill = torch.full_like(x[..., RANGE, :, :], -1.0)
    return torch.stack(
        [torch.where(drop, fill, x[..., RANGE, :, :]), torch.where(drop, fill, x[..., INTENSITY, :, :])], dim=-3
    )
