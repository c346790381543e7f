"""What both HTTP servers (`gpukillctl serve`, `gpukillctl exporter`) share before they listen: the --port
argument's type and the one-line error that says why a server does not start, with its exit status.

Here, not in gpukillctl/serve/server.py where they were written first, so that the exporter does not import
another front end.
"""

from __future__ import annotations

import argparse

from ..client.exits import EXIT_FAILURE


class ServeError(Exception):
    """Why the server does not start: one line, with the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


def port_number(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"port out of range: {value}")
    return value
