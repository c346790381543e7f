"""What both HTTP servers (`gpukillctl serve`, `gpukillctl exporter`) share before they listen: the one-line
error that says why a server does not start, with its exit status. (Their port options' type is
gpukillctl/client/ports.py's, which every command line shares.)

Here, not in gpukillctl/serve/server.py, so that the exporter does not import another front end.
"""

from __future__ import annotations

from ..client.exits import EXIT_FAILURE


class ServeError(Exception):
    """Why the server does not start: one line, with the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code
