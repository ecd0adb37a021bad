"""The request bounds: one module, the app's stricter than the library's, the library's within a config's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import inference
from inference.limits import APP_LIMITS, CONFIG_MAX_GUIDANCE, CONFIG_MAX_STEPS, LIBRARY_LIMITS
from lidar.errors import InputError


def test_the_app_is_no_looser_than_the_library_and_the_library_no_looser_than_a_config():
    for field in dataclasses.fields(LIBRARY_LIMITS):
        assert getattr(APP_LIMITS, field.name) <= getattr(LIBRARY_LIMITS, field.name), field.name
    assert APP_LIMITS.max_guidance < LIBRARY_LIMITS.max_guidance
    assert LIBRARY_LIMITS.max_steps <= CONFIG_MAX_STEPS and LIBRARY_LIMITS.max_guidance <= CONFIG_MAX_GUIDANCE
    assert (LIBRARY_LIMITS.max_frames, LIBRARY_LIMITS.max_steps) == (inference.MAX_FRAMES, inference.MAX_STEPS)


def test_checks_return_plain_numbers_and_name_the_bounds():
    assert APP_LIMITS.check_steps(np.int64(4)) == 4 and type(APP_LIMITS.check_steps(np.int64(4))) is int
    assert APP_LIMITS.check_guidance(2) == 2.0 and APP_LIMITS.check_frames(32) == 32
    with pytest.raises(InputError, match=r"guidance must be a number in \[0, 10.0\]"):
        APP_LIMITS.check_guidance(15.0)
    assert LIBRARY_LIMITS.check_guidance(15.0) == 15.0
    for bad in (float("nan"), "1", -0.5):
        with pytest.raises(InputError, match="guidance"):
            LIBRARY_LIMITS.check_guidance(bad)
    for bad in (0, 51, True, 2.0):
        with pytest.raises(InputError, match=r"steps must be an integer in \[1, 50\]"):
            LIBRARY_LIMITS.check_steps(bad)
    with pytest.raises(InputError, match=r"len\(poses\) must be an integer in \[1, 32\], got 33"):
        LIBRARY_LIMITS.check_frames(33, "len(poses)")
