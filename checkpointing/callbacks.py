"""The seed's checkpoint hooks: the trainer's own state (data position, counters) rides in the marker."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class CallBackGroup:
    """Calls each hook on every member that defines it, in order.

    Subclass it and override hooks, or pass objects that define any subset of the hook names.
    `on_save_checkpoint` may add entries to the marker's state dict (keep them tensors and plain
    containers so the marker still loads weights-only); `on_load_checkpoint` receives that dict back.
    `on_save_checkpoint_success` runs after the generation is published, on the writer thread when
    saving asynchronously.
    """

    def __init__(self, callbacks: Iterable[Any] = ()) -> None:
        self._callbacks = list(callbacks)

    def _dispatch(self, hook: str, *args: Any, **kwargs: Any) -> None:
        for callback in self._callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args, **kwargs)

    def on_save_checkpoint_start(self, model: Any, iteration: int) -> None:
        self._dispatch("on_save_checkpoint_start", model, iteration)

    def on_save_checkpoint(self, model: Any, state_dict: dict[str, Any]) -> None:
        self._dispatch("on_save_checkpoint", model, state_dict=state_dict)

    def on_save_checkpoint_end(self, model: Any, iteration: int) -> None:
        self._dispatch("on_save_checkpoint_end", model=model, iteration=iteration)

    def on_save_checkpoint_success(self, iteration: int) -> None:
        self._dispatch("on_save_checkpoint_success", iteration=iteration)

    def on_load_checkpoint_start(self, model: Any) -> None:
        self._dispatch("on_load_checkpoint_start", model)

    def on_load_checkpoint(self, model: Any, state_dict: dict[str, Any]) -> None:
        self._dispatch("on_load_checkpoint", model, state_dict=state_dict)

    def on_load_checkpoint_end(self, model: Any) -> None:
        self._dispatch("on_load_checkpoint_end", model)
