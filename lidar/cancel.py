"""Cooperative cancellation: long work checks, at points where stopping is safe, whether it should stop.

A server cannot kill a thread, so a visitor who cancels or disconnects would otherwise leave their decode,
registration or rollout running to the end, holding the CPU or GPU and memory meanwhile. The app runs
each request with a `stop_when(event)` scope; the readers check between decode chunks and sweeps, the
registration between sweeps and the app's progress callback after each sampler step. Outside a scope
(the command lines, tests, training) `checkpoint()` costs one context-variable lookup and never raises.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar

_STOP: ContextVar[threading.Event | None] = ContextVar("lidarverse_stop", default=None)


class Cancelled(BaseException):
    """The request was cancelled. A `BaseException`, like `KeyboardInterrupt`: it must pass through the
    `except Exception` handlers that turn a reader's or a library's failure into an error message."""


def checkpoint() -> None:
    """Raise `Cancelled` when the current scope's event is set; a no-op outside a scope."""
    stop = _STOP.get()
    if stop is not None and stop.is_set():
        raise Cancelled


@contextlib.contextmanager
def stop_when(event: threading.Event) -> Iterator[None]:
    """Make `checkpoint()` in this context (thread or task) raise once `event` is set."""
    token = _STOP.set(event)
    try:
        yield
    finally:
        _STOP.reset(token)
