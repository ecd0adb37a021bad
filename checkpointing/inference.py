"""FSDPInferenceCheckpointer: the seed's inference-mode checkpointer, which only ever loads weights.

It accepts a weights file (`.safetensors` or a weights-only `.pt`), a checkpoint marker, a
checkpoints directory or a job directory; the latter two resolve to the newest valid generation. A sharded
generation loads in this one process, with no process group: DCP reshards its part's shards
into the model, and the optimizer's shards are never read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from checkpointing.weights import load_weights_file, resolve_weights

logger = logging.getLogger(__name__)


class FSDPInferenceCheckpointer:
    """Drop-in for FSDPCheckpointer when only weights are wanted; save/load are no-ops as in the seed."""

    def __init__(self, ckpt_path: str | Path, strict_resume: bool = True) -> None:
        self.ckpt_path = Path(ckpt_path)
        self.strict_resume = strict_resume

    def load_model_during_init(self, model: nn.Module, is_ema: bool = False, ema_id: int = 0) -> None:
        """Load weights into `model`; strict mode raises listing missing/unexpected keys and shape mismatches."""
        del ema_id  # replicas hold copies of the same EMA
        resolved = resolve_weights(self.ckpt_path, prefer_ema=is_ema)
        if is_ema and resolved.kind == "file":
            logger.warning(
                "%s is a single weights file; it holds no separate EMA weights to load", self.ckpt_path
            )
            return
        load_weights_file(model, resolved.path, strict=self.strict_resume)
        logger.info("loaded %s weights from %s", resolved.kind, resolved.path)

    def load_optim_scheduler_during_init(self, *args: Any, **kwargs: Any) -> None:
        """Inference never restores optimizer state; kept so trainer code runs unchanged."""

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Inference never saves; kept so trainer code runs unchanged."""

    def load(self, *args: Any, **kwargs: Any) -> int:
        """Inference has no training state: the iteration is 0, as in the seed."""
        return 0
