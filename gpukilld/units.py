"""Sizes as admins write them: 8589934592, 8GiB, 8GB, 512M."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_size(value: object) -> int:
    """Bytes from an int or a string with an optional SI (GB) or IEC (GiB) suffix; ValueError if neither."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    if not isinstance(value, str) or not (m := _SIZE.match(value)):
        raise ValueError(f"not a size: {value!r} (use bytes, or a suffix such as 8GiB or 8GB)")
    number, prefix, binary = m.groups()
    base = 1024 if (binary or (prefix and not value.strip().upper().endswith("B"))) else 1000
    return int(float(number) * base ** _POWERS[prefix.upper()])
