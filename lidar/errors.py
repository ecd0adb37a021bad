"""The one user-error type of LidarVerse: what a command line or the app shows as the user's mistake.

A file that is not a LiDAR sweep, a pose file that is not poses, a model source that does not resolve, an
argument out of range: each is an `InputError`, raised with a message that names the input, what was wrong
and what was expected, and shown as it is (one `error:` line, exit status 2; a `gr.Error` in the app).
Any other exception is a bug: the command lines let it end in a traceback (exit 1) and the app logs it and
tells the visitor only that it failed on the server.

It subclasses `ValueError` so callers that caught `ValueError` for bad input keep working. It lives in
`lidar`, which `inference` already imports, so both packages raise the same type.

Messages quote what a visitor sent (a file name, a header's field list, an action string), and a visitor
controls its length: `shown` caps one quoted value and `InputError` caps its whole message, so a 5 MB
argument or a header of 200,000 field names never becomes a 5 MB message, log line or HTTP response.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Most characters of one quoted visitor value (a name, an argument) a message shows.
MAX_SHOWN_CHARS = 120
#: Most names of a visitor's list (fields, keys, properties) a message shows.
MAX_SHOWN_NAMES = 12
#: Most characters of a whole `InputError` message: its start (the input and what was wrong) and its end
#: (what was expected) are kept, the middle is cut.
MAX_MESSAGE_CHARS = 1000


def capped(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text`, or its first and last parts around a note of its length, `limit` characters in all."""
    if len(text) <= limit:
        return text
    note = f" … ({len(text):,} characters, cut) … "
    tail = limit // 4
    head = limit - tail - len(note)
    return f"{text[:head]}{note}{text[-tail:]}"


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """`repr(value)` for a message, cut to about `limit` characters with the length it had.

    A string or bytes is sliced before `repr`, so quoting a 5 MB argument costs nothing; any other
    object's `repr` is cut after the fact.
    """
    if isinstance(value, str | bytes) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value):,} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def shown_names(names: Iterable[object], limit: int = MAX_SHOWN_NAMES) -> str:
    """A visitor's list of names for a message: the first `limit`, each quoted by `shown`, then how many more."""
    names = list(names)
    listed = ", ".join(shown(str(name), MAX_SHOWN_CHARS // 2) for name in names[:limit])
    more = len(names) - limit
    return f"[{listed}{f', and {more:,} more' if more > 0 else ''}]"


def native_panic(err: BaseException) -> bool:
    """Whether `err` is a Rust panic surfaced by a pyo3 extension (lazrs, the LAZ decoder).

    pyo3 raises `pyo3_runtime.PanicException`, a `BaseException` so that `except Exception` does not swallow
    a bug; a panic on a corrupt file's bytes is that file's fault, so the readers turn it into an
    `InputError`. Each extension defines its own class, so it is recognised by module and name.
    """
    kind = type(err)
    return kind.__name__ == "PanicException" and kind.__module__ == "pyo3_runtime"


class InputError(ValueError):
    """Bad input from the user; the message is safe and meant to be shown as it is, and at most
    `MAX_MESSAGE_CHARS` long."""

    def __init__(self, message: object = "") -> None:
        super().__init__(capped(str(message)))
