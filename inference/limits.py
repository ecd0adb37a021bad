"""How much one generation request may ask for: frames, sampler steps, classifier-free guidance, rays, seeds.

One home for the bounds that the library, a public app, the command line and a release's config each apply.
The library's `LIBRARY_LIMITS` keep a call from queueing minutes of accelerator time, and the command line
refuses its arguments by them before anything is read or allocated (`--frames 1000000000000` would ask for
116 TiB of poses); an app serving strangers applies the stricter `APP_LIMITS` before it calls the library
(which checks its own again); a model's config may state defaults up to `CONFIG_MAX_STEPS` /
`CONFIG_MAX_GUIDANCE`, looser because training and evaluation scripts call the rollout directly. A refusal
quotes the value it got capped (`lidar.errors.shown`), so a 5 MB argument is not echoed back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from lidar.errors import InputError, shown


@dataclass(frozen=True)
class Limits:
    """Upper bounds on one request; the lower bounds are fixed (1 frame, 1 step, guidance 0)."""

    #: Longest rollout one call may ask for.
    max_frames: int
    #: Most sampler steps per frame; the model is trained for few-step sampling (`default_steps`, 2 shipped).
    max_steps: int
    #: Largest classifier-free guidance scale (1 = no guidance; beyond about 20 samples saturate).
    max_guidance: float
    #: Most rays (beams x columns) of the grid a frame is drawn on: a 128-beam sensor at 4,096 columns. The
    #: network's cost grows with the pixels, so this bounds a frame's time and memory.
    max_rays: int = 128 * 4096
    #: Largest sampling or world seed (the lower bound is 0): what torch's generator takes, 64 bits.
    max_seed: int = 2**64 - 1

    def check_frames(self, frames: Any, name: str = "frames") -> int:
        """`frames` as an int, or an InputError naming `name` and the bounds."""
        if isinstance(frames, bool) or not isinstance(frames, int | np.integer) or not 1 <= frames <= self.max_frames:
            raise InputError(f"{name} must be an integer in [1, {self.max_frames}], got {shown(frames)}")
        return int(frames)

    def check_steps(self, steps: Any, name: str = "steps") -> int:
        """`steps` as an int, or an InputError naming `name` and the bounds."""
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or not 1 <= steps <= self.max_steps:
            raise InputError(f"{name} must be an integer in [1, {self.max_steps}], got {shown(steps)}")
        return int(steps)

    def check_rays(self, height: int, width: int, name: str = "sensor") -> None:
        """An InputError naming `name` when a grid of `height` beams by `width` columns exceeds `max_rays`."""
        if height * width > self.max_rays:
            raise InputError(
                f"{name} has {height} x {width} = {height * width:,} rays; expected at most {self.max_rays:,} "
                f"(for example {self.max_rays // 2048} beams x 2048 columns)"
            )

    def check_guidance(self, guidance: Any, name: str = "guidance") -> float:
        """`guidance` as a float, or an InputError naming `name` and the bounds."""
        if (
            not isinstance(guidance, int | float)
            or not math.isfinite(guidance)
            or not 0.0 <= guidance <= self.max_guidance
        ):
            raise InputError(
                f"{name} must be a number in [0, {self.max_guidance}] (1 = no guidance), got {shown(guidance)}"
            )
        return float(guidance)

    def check_seed(self, seed: Any, name: str = "seed") -> int:
        """`seed` as an int, or an InputError naming `name` and the bounds."""
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed <= self.max_seed:
            raise InputError(f"{name} must be an integer in [0, {self.max_seed}], got {shown(seed)}")
        return int(seed)


#: What `LidarVersePipeline` accepts from any caller.
LIBRARY_LIMITS = Limits(max_frames=32, max_steps=50, max_guidance=20.0)
#: What a public app accepts from its visitors: guidance past 10 only saturates samples, and a visitor's
#: request should not; seeds fit the 32-bit number fields of its page.
APP_LIMITS = Limits(max_frames=32, max_steps=50, max_guidance=10.0, max_rays=128 * 2048, max_seed=2**31 - 1)
#: The largest default sampler steps and guidance a model's config may state (`WorldModelConfig`).
CONFIG_MAX_STEPS = 1000
CONFIG_MAX_GUIDANCE = 100.0
