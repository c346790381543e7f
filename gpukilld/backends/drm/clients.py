"""The kernel's own list of DRM clients: debugfs dri/<minor>/clients, one row per open DRM file of a device.

drm_debugfs.c drm_clients_info prints a header and one row per struct drm_file (card and render node alike):

                 command  tgid dev master a   uid      magic                   name
                    Xorg  1234   0   y    y     0          0                <unset>

The command is the task's comm, right-aligned in 20 columns: it may be empty or hold spaces, so a row is read
from the right, by the header's columns (newer kernels add "name"; older ones lack it; a kernel that adds more
columns still parses as long as "tgid" is among them). "tgid" is the process that opened the file or last used
it: a DRM fd inherited by a child or passed over a unix socket appears under another tgid, which is why the
scanner keeps a periodic walk of every fd table besides this list (scan.SAFETY_NET_PERIOD).

The text is not all the kernel's: a comm is whatever its process set (PR_SET_NAME; a newline splits its row).
So a file that is too long, has too long a line, or any row that does not parse is not trusted at all: the
caller falls back to the walk for that sample, and a process cannot hide its row by mangling it.
"""

from __future__ import annotations

import os

# The list of a device with this many bytes (about 25,000 clients) is not a real one: walk instead.
MAX_BYTES = 2 << 20
MAX_LINE = 512  # a real row is about 90 characters (20 of comm, 32 of client name)
FLAGS = frozenset("yn")
# Each list's last text and what it parsed to, by path: a list changes only when a DRM file is opened or
# closed, and the same bytes parse the same (a real list is at most a few KiB; MAX_BYTES bounds each entry).
_LAST: dict[str, tuple[bytes, dict[int, int] | None]] = {}
_LAST_MAX = 64


def parse_clients(text: str) -> dict[int, int] | None:
    """The tgids listed, each with the number of rows (open DRM files) naming it (0, printed for a client
    whose process is gone, left out); None if the text is not a clients file we understand, in full."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines or any(len(line) > MAX_LINE for line in lines):
        return None
    columns = lines[0].split()
    if not columns or columns[0] != "command" or "tgid" not in columns:
        return None
    fixed = len(columns) - 1  # the columns after the command, which hold no spaces
    tgid_at = columns.index("tgid") - len(columns)  # counted from the right
    checks = [(i - len(columns), name) for i, name in enumerate(columns) if name in ("dev", "master", "a", "magic")]
    tgids: dict[int, int] = {}
    for line in lines[1:]:
        fields = line.split()
        if len(fields) < fixed:
            return None
        tgid = fields[tgid_at]
        if not tgid.isdigit() or not all(
            fields[at] in FLAGS if name in ("master", "a") else fields[at].isdigit() for at, name in checks
        ):
            return None
        if tgid != "0":
            number = int(tgid)
            tgids[number] = tgids.get(number, 0) + 1
    return tgids


def read_clients(debugfs_root: str, card_minor: int, pci_address: str | None) -> dict[int, int] | None:
    """The tgids of one device's clients with their number of rows, or None where its list cannot be read or trusted (no
    debugfs, not
    root, a kernel without the file, a malformed or oversized file)."""
    paths = [f"{debugfs_root}/dri/{card_minor}/clients"]
    if pci_address:
        paths.append(f"{debugfs_root}/dri/{pci_address}/clients")  # newer kernels name the directory by device
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            chunks, size = [], 0
            while size <= MAX_BYTES:
                chunk = os.read(fd, 1 << 16)  # a seq_file hands out a page or so per read
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except OSError:
            return None
        finally:
            os.close(fd)
        if size > MAX_BYTES:
            return None
        raw = b"".join(chunks)
        last = _LAST.get(path)
        if last is not None and last[0] == raw:
            return last[1]  # the caller only reads it
        rows = parse_clients(raw.decode("utf-8", "replace"))
        if len(_LAST) >= _LAST_MAX:
            _LAST.clear()
        _LAST[path] = (raw, rows)
        return rows
    return None
