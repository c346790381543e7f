"""Sizes as admins write them: 8589934592, 8GiB, 8GB, 512M.

Sizes come from policy files, TestPolicies callers and device files, so every input is bounded: at most
MAX_SIZE bytes (1 EiB), strings of at most MAX_SIZE_TEXT characters, arithmetic exact (no float to overflow
into inf, no int(inf)). Anything else is ValueError with a one-line reason.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from .text import UNKNOWN

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


# systemd's timespan units, largest first: a duration prints as systemctl and journalctl print theirs.
_SPAN_UNITS = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))


def format_duration(seconds: float | None) -> str:
    """A duration as systemd writes a timespan: "2h 26min 9s", "3min 30s", "45s", "1.5s", "500ms".

    At most three units, the largest and the two below it, parts that are 0 left out ("1h 5s"); rounded to
    the smallest of them (a minute from a day on, a second from ten seconds on, a tenth below ten seconds, a
    millisecond below one). None, nan and inf are UNKNOWN; a negative duration (a deadline already past)
    prints as 0s."""
    if seconds is None or seconds != seconds or seconds in (float("inf"), float("-inf")):
        return UNKNOWN
    seconds = max(float(seconds), 0.0)
    if seconds < 0.9995:
        ms = _half_up(seconds * 1000)
        return f"{ms}ms" if ms else "0s"
    if seconds < 9.95:
        return f"{_half_up(seconds * 10) / 10:g}s"
    step = 60 if seconds >= 86400 - 0.5 else 1
    left = _half_up(seconds / step) * step
    parts: list[str] = []
    first = None
    for i, (unit, size) in enumerate(_SPAN_UNITS):
        if first is None and left < size:
            continue
        first = i if first is None else first
        if i > first + 2:
            break
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return " ".join(parts)


def _half_up(x: float) -> int:
    """x rounded to a whole number, halves up, as JavaScript's Math.round: the page prints the same text."""
    return math.floor(x + 0.5)


def format_energy(joules: float | None) -> str:
    """Energy in joules, as the exporter counts it (gpukill_energy_joules): "850 J", "212 kJ", "1.5 MJ", "3.6
    GJ", three significant digits. None, nan and inf are UNKNOWN: a GPU without a power sensor measured
    nothing, which is not 0 J."""
    if joules is None or joules != joules or joules in (float("inf"), float("-inf")):
        return UNKNOWN
    value = max(float(joules), 0.0)
    for unit, size in (("GJ", 1e9), ("MJ", 1e6), ("kJ", 1e3)):
        if value >= size * 0.9995:  # 999.6 J rounds to 1 kJ, never to "1000 J"
            return f"{_three(value / size)} {unit}"
    return f"{_three(value)} J"


def _three(x: float) -> str:
    """Three significant digits without an exponent: 0.5, 8.25, 212, 1000 (the largest unit's overflow)."""
    if x >= 99.95:
        return f"{x:.0f}"
    return f"{x:.1f}" if x >= 9.995 else f"{x:.2f}".rstrip("0").rstrip(".")
