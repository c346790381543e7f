"""Files the daemon keeps (Guard's state, the usage totals, the audit's settings): written whole or not at all.

A temporary file in the same directory, fsynced, renamed over the old one, then the directory fsynced: a crash
or a full disk leaves the old file or the new one, never half of one, and the rename survives a power cut.
Writes that fail over and over (a full disk) are reported once per run of failures, by WriteWatch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import journal

log = logging.getLogger(__name__)


def fsync_dir(directory: str) -> None:
    """Make a rename or unlink in the directory durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str, data: bytes | str, mode: int = 0o600, *, sync_dir: bool = True) -> None:
    """Write `data` (text as UTF-8) as `path`, atomically, with `mode` whatever the umask; raises OSError (the
    caller says what it keeps instead). The directory must exist. sync_dir=False leaves the directory's fsync to
    a caller that replaces several files in it and syncs it once (fsync_dir)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)  # O_EXCL: never a link
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
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


class WriteWatch:
    """One kept file's writes as the journal hears of them. The daemon tries a write again at its next save
    (each sample, for some files), so a full disk would otherwise make an entry per sample. A failure is one
    entry (journal.WRITE_FAILED: what, where, why, and what holds meanwhile) when none was written for this file
    in the last REPORT_EVERY seconds, or since the last success; the first success after an entry is one entry
    (journal.WRITE_RECOVERED) with the attempts that failed. A disk that flaps between full and not (a file
    removed on failure frees the space its next write takes) makes at most one pair per REPORT_EVERY. Used
    from one thread at a time (the file's writer)."""

    REPORT_EVERY = 300.0

    def __init__(
        self, audit: journal.Audit | None, path: str, what: str, kept: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.audit = audit
        self.path = path
        self.what = what  # "Guard's state": the file's part in the daemon
        self.kept = kept  # what holds meanwhile, a sentence
        self.failures = 0  # failed attempts since the last entry
        self._clock = clock
        self._reported = False  # a failure entry was written and no success since
        self._last: float | None = None  # when the last failure entry was written

    def failed(self, error: BaseException) -> None:
        self.failures += 1
        now = self._clock()
        if self._reported or (self._last is not None and now - self._last < self.REPORT_EVERY):
            return
        self._reported, self._last, self.failures = True, now, 0
        why = (error.strerror if isinstance(error, OSError) else None) or str(error) or type(error).__name__
        message = f"cannot write {self.path} ({self.what}): {why}; {self.kept}"
        if self.audit is None:
            log.error("%s", message)
            return
        self.audit.log(journal.WRITE_FAILED, message, file=self.path, what=self.what, error=why, kept=self.kept)

    def written(self) -> None:
        if not self._reported:
            return
        failures, self.failures, self._reported = self.failures + 1, 0, False  # the one reported counts too
        message = f"{self.path} ({self.what}) written again after {failures} failed attempt(s)"
        if self.audit is None:
            log.warning("%s", message)
            return
        self.audit.log(journal.WRITE_RECOVERED, message, file=self.path, what=self.what, failures=failures)
