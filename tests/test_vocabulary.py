"""The shared vocabulary: the model core stands without the simulator, and the simulator's names are the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

import lidar.sim
from lidar import vocabulary
from lidar.vocabulary import ACTION_LABELS, ACTION_YAW_SIGN, ACTIONS, transform_points

REPO = Path(__file__).resolve().parent.parent
#: The modules that make up the world model; conditioning on a real map must not need the procedural generator.
MODEL_CORE = (
    "inference.network",
    "inference.flow",
    "inference.conditioning",
    "inference.cache",
    "inference.rollout",
    "inference.measured",
)

_BLOCKED_IMPORT = """
import importlib.abc
import sys


class NoSimulator(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lidar.sim" or name.startswith("lidar.sim."):
            raise ImportError(f"the model core imported {name}")
        return None


sys.meta_path.insert(0, NoSimulator())
for module in sys.argv[1:]:
    __import__(module)
print("ok")
"""


def test_the_model_core_imports_nothing_from_the_simulator():
    # A fresh interpreter, so nothing another test imported hides a dependency; the finder refuses lidar.sim
    # however it is reached (directly or through another module).
    result = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT, *MODEL_CORE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_simulator_exports_the_vocabularys_own_objects():
    for name in ("ACTIONS", "MAP_CLASSES", "OBJECT_CLASSES", "POINT_CLASSES"):
        assert getattr(lidar.sim, name) is getattr(vocabulary, name), name
    assert vocabulary.POINT_CLASSES == vocabulary.MAP_CLASSES + vocabulary.OBJECT_CLASSES
    assert set(vocabulary.BOXED_CLASSES) <= set(vocabulary.OBJECT_CLASSES)


def test_every_action_has_one_yaw_sign_and_one_label():
    assert tuple(ACTION_YAW_SIGN) == ACTIONS == tuple(ACTION_LABELS)
    assert ACTION_YAW_SIGN == {"straight": 0.0, "turn_left": 1.0, "turn_right": -1.0}


def test_transform_points_moves_xyz_and_keeps_intensity():
    pose = np.eye(4)
    pose[:2, :2] = [[0.0, -1.0], [1.0, 0.0]]  # a quarter turn to the left
    pose[:3, 3] = [10.0, 0.0, 1.8]
    out = transform_points(np.array([[1.0, 0.0, 0.0, 0.7]], dtype=np.float32), pose)
    np.testing.assert_allclose(out, [[10.0, 1.0, 1.8, 0.7]], atol=1e-6)
    assert out.dtype == np.float32
