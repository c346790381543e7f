"""Sizes as admins write them: 8589934592, 8GiB, 8GB, 512M.

Sizes come from policy files, TestPolicies callers and device files, so every input is bounded: at most
MAX_SIZE bytes (1 EiB), strings of at most MAX_SIZE_TEXT characters, arithmetic exact (no float to overflow
into inf, no int(inf)). Anything else is ValueError with a one-line reason.
"""

from __future__ import annotations

import re
from fractions import Fraction

# 1 EiB = 2^60 bytes: a million times the memory of any GPU or host, yet a size that every consumer holds
# exactly (a signed or unsigned 64-bit integer on the bus and in C, a double in JSON) with room to add a
# few together. 2^63 would be the type's own limit; it buys nothing real and leaves no room for sums.
MAX_SIZE = 1 << 60
MAX_SIZE_TEXT = 64  # characters: "1.5 GiB" needs 7; a bounded text keeps every match and conversion cheap

_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGTPE]?)(i?)(B?)", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}


def parse_size(value: object) -> int:
    """Bytes from an int or a string with an optional SI (GB) or IEC (GiB) suffix, 0 to MAX_SIZE; ValueError
    otherwise (negative, too large, a float, inf or nan, a bool, anything else)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {short(value)}")
        if value > MAX_SIZE:
            raise ValueError(f"size {short(value)} is larger than the maximum, 1 EiB (2^60 bytes)")
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a size: {short(value)} (use bytes, or a suffix such as 8GiB or 8GB)")
    text = value.strip()
    if len(text) > MAX_SIZE_TEXT:
        raise ValueError(f"not a size: {text[:20]!r}… is longer than {MAX_SIZE_TEXT} characters")
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use bytes, or a suffix such as 8GiB or 8GB)")
    number, prefix, binary, b = m.groups()
    base = 1024 if (binary or (prefix and not b)) else 1000
    size = int(Fraction(number) * base ** _POWERS[prefix.upper()])  # exact: "1.5GiB" is 1610612736
    if size > MAX_SIZE:
        raise ValueError(f"size {text!r} is larger than the maximum, 1 EiB (2^60 bytes)")
    return size


def short(value: object, limit: int = 40) -> str:
    """A value for a message: a huge int by its number of digits (str() refuses more than 4300 of them), else
    its repr cut to `limit` characters."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a number of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def format_size(n: float) -> str:
    """1.5 GiB. Sizes are at most 1 EiB (MAX_SIZE); a larger sum still prints in EiB, never overflows."""
    if isinstance(n, int) and n.bit_length() > 1000:  # beyond any float: n / 1024 would be OverflowError
        return f"{short(n)} B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def format_duration(seconds: float) -> str:
    """A duration as a policy writes it: whole hours or minutes in h or m, anything else in seconds."""
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 3600:g}h" if seconds % 3600 == 0 else f"{seconds / 60:g}m"
    return f"{seconds:g}s"
