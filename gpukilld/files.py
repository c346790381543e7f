"""Files the daemon keeps (Guard's state, the usage totals, the audit's settings): written whole or not at all.

A temporary file in the same directory, fsynced, renamed over the old one, then the directory fsynced: a crash
or a full disk leaves the old file or the new one, never half of one, and the rename survives a power cut.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any


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


def read_kept(path: str, max_bytes: int) -> tuple[dict[str, Any] | None, str | None]:
    """A kept file's JSON object: (None, None) when there is none; (None, why) when it cannot be read
    (unreadable, over max_bytes, not a JSON object), the file then moved aside as NAME.broken, for a post-mortem
    and out of the way of the next save: never started over silently."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"larger than {max_bytes >> 20} MiB")
        value = json.loads(data)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        return value, None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested past the stack
        with contextlib.suppress(OSError):
            os.replace(path, path + ".broken")
        return None, f"{path}: cannot be read ({e}); kept as {os.path.basename(path)}.broken"
