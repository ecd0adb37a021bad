"""LidarVerse inference: the world model, its sampler and rollout, and `load_pipeline` to use them.

    from inference import load_pipeline
    pipe = load_pipeline()                      # $LIDARVERSE_MODEL, else weights/default
    out = pipe.generate_world(map=3, action="turn_left", frames=8, steps=4, seed=0)

The public names load lazily (PEP 562), so `import inference.network` in a training process does not pull
in the simulator, the file formats and huggingface_hub.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_pipeline": "inference.pipeline",
    "LidarVersePipeline": "inference.pipeline",
    "MAX_FRAMES": "inference.pipeline",
    "MAX_STEPS": "inference.pipeline",
    "action_poses": "inference.pipeline",
    "write_rollout": "inference.pipeline",
    "load_model": "inference.loader",
    "resolve_source": "inference.loader",
    "select_device": "inference.loader",
    "ModelSourceError": "inference.loader",
    "Provenance": "inference.loader",
    "Frame": "inference.rollout",
    "Progress": "inference.rollout",
    "RolloutResult": "inference.rollout",
    "UpsampleResult": "inference.upsample",
    "upsample": "inference.upsample",
    "ACTIONS": "lidar.vocabulary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'inference' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
