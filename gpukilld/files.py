"""Files the daemon keeps (Guard's state, the usage totals, the audit's settings): written whole or not at all.

A temporary file in the same directory, fsynced, renamed over the old one, then the directory fsynced: a crash
or a full disk leaves the old file or the new one, never half of one, and the rename survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def fsync_dir(directory: str) -> None:
    """Make a rename or unlink in the directory durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write `data` as `path`, atomically, with `mode` whatever the umask; raises OSError (the caller says what
    it keeps instead). The directory must exist."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)  # created 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode != 0o600:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
