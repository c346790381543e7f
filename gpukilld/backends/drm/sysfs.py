"""Reading sysfs attributes: a missing or unreadable file is None, never 0 or an exception.

sysfs attributes come and go with drivers, firmware and kernel versions; every reader of the DRM backend treats
"not there" as "unknown" and moves on.
"""

from __future__ import annotations

import os


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def read_int(path: str, base: int = 10) -> int | None:
    text = read_text(path)
    if not text:
        return None
    try:
        return int(text.split()[0], base)
    except ValueError:
        return None


def read_hex(path: str) -> int | None:
    """PCI ids are written as 0x1002; int(..., 16) takes the prefix."""
    return read_int(path, 16)


def link_name(path: str) -> str | None:
    """The last component of a symlink's target: driver links point at .../drivers/NAME."""
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
