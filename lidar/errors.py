"""The one user-error type of LidarVerse: what a command line or the app shows as the user's mistake.

A file that is not a LiDAR sweep, a pose file that is not poses, a model source that does not resolve, an
argument out of range: each is an `InputError`, raised with a message that names the input, what was wrong
and what was expected, and shown as it is (one `error:` line, exit status 2; a `gr.Error` in the app).
Any other exception is a bug: the command lines let it end in a traceback (exit 1) and the app logs it and
tells the visitor only that it failed on the server.

It subclasses `ValueError` so callers that caught `ValueError` for bad input keep working. It lives in
`lidar`, which `inference` already imports, so both packages raise the same type.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input from the user; the message is safe and meant to be shown as it is."""
