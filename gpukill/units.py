"""Sizes and durations as admins write them, one grammar each for every front end: 8GiB, 8GB, 512MiB, 4096B;
90s, 5min, 1h30m, 2d 4h.

Every CLI option, policy key, D-Bus text argument, REST/MCP field and dashboard form that takes a size or a
duration goes through parse_size and parse_duration, so the same text means the same everywhere. A bare number
is seconds as a duration (as systemd reads it) but no size: "8" would be 8 bytes to one reader and 8 GB to
another, so it is refused with the units a size takes. Where a typed integer says bytes (a D-Bus 't', a
simulated device's file) or a compatible front end documents its own unit (gpu-kill's GB flags), the caller
says what a bare number stands for (bare=).

Every input is bounded: sizes at most MAX_SIZE bytes (1 EiB), durations at most 100 years, texts of at most
MAX_SIZE_TEXT / MAX_DURATION_TEXT characters, arithmetic exact for sizes (no float to overflow into inf, no
int(inf)). Anything else is ValueError with a one-line reason.
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
# A limit under 1 MiB stops every GPU process (a CUDA context alone holds hundreds of MiB): it is taken only
# when its unit says it is small on purpose (B, K, KB, KiB), never from "0.5M" or a typed byte count.
MIN_LIMIT = 1 << 20
SIZE_FORMS = "8GiB, 8GB, 512MiB, 4096B"
DURATION_FORMS = "90s, 5min, 1h30m, 2d 4h"
MAX_DURATION_TEXT = 64  # characters: "1h 30min" needs 8
MAX_ANY_DURATION = 100 * 365.25 * 86400  # no duration anywhere is longer (runtime included)

_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGTPE]?)(i?)(B?)", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
# One part of a duration, matched at a given position: parts are consumed left to right, never searched for
# (findall would retry from every position of a long run of digits: quadratic). Longer unit names first, so
# "ms" is not read as "m" then "s"; a unit is a whole word ("5mx" is no duration).
_DURATION_PART = re.compile(
    r"\s*([0-9]+(?:\.[0-9]+)?)\s*(milliseconds?|msecs?|ms|seconds?|secs?|s|minutes?|mins?|m|hours?|hrs?|h"
    r"|days?|d|weeks?|w)(?![a-z])\s*",
    re.IGNORECASE,
)
_DURATION_UNITS = {"m": 60.0, "s": 1.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_BARE_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def _unit_seconds(unit: str) -> float:
    u = unit.lower()
    if u.startswith(("ms", "msec", "milli")):
        return 0.001
    return _DURATION_UNITS[u[0]]


def parse_size(value: object, *, bare: int | None = None, limit: bool = False) -> int:
    """Bytes from a string with a unit, SI (8GB) or IEC (8GiB; 8G is 8GiB), 0 to MAX_SIZE. bare: what a bare
    number stands for (1 where the type says bytes, GiB for gpu-kill's GB); None refuses it, int or numeric
    string, naming the units. limit: the size is a limit, and under MIN_LIMIT only when its unit says it is
    small on purpose (B or K). ValueError otherwise (negative, too large, a float, inf or nan, a bool, …)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {short(value)}")
        if bare is None:
            raise ValueError(f"a bare number is not a size: {short(value)} (write a unit: {SIZE_FORMS})")
        if value > MAX_SIZE // bare:
            raise ValueError(f"size {short(value)} is larger than the maximum, 1 EiB (2^60 bytes)")
        size = value * bare
        if limit and 0 < size < MIN_LIMIT:
            raise _small(short(value))
        return size
    if not isinstance(value, str):
        raise ValueError(f"not a size: {short(value)} (write a unit: {SIZE_FORMS})")
    text = value.strip()
    if len(text) > MAX_SIZE_TEXT:
        raise ValueError(f"not a size: {text[:20]!r}… is longer than {MAX_SIZE_TEXT} characters")
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (write a unit: {SIZE_FORMS})")
    number, prefix, binary, b = m.groups()
    if not (prefix or binary or b):  # a bare number
        if bare is None:
            raise ValueError(f"a bare number is not a size: {text!r} (write a unit: {SIZE_FORMS})")
        size = int(Fraction(number) * bare)
    else:
        base = 1024 if (binary or (prefix and not b)) else 1000
        size = int(Fraction(number) * base ** _POWERS[prefix.upper()])  # exact: "1.5GiB" is 1610612736
    if size > MAX_SIZE:
        raise ValueError(f"size {text!r} is larger than the maximum, 1 EiB (2^60 bytes)")
    small_on_purpose = (prefix or binary or b) and prefix.upper() in ("", "K")
    if limit and 0 < size < MIN_LIMIT and not small_on_purpose:
        raise _small(repr(text))
    return size


def _small(shown_value: str) -> ValueError:
    return ValueError(
        f"a limit of {shown_value} is under 1 MiB, likely a mistake (every GPU process holds "
        "more); write it in B or KiB (e.g. 4096B, 512KiB) if it is meant"
    )


def exact_size(n: int) -> str:
    """A size as parse_size reads it back to the same bytes: the largest IEC unit that divides it ("8GiB"),
    else bytes ("1000000000B")."""
    for unit, power in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << power) == 0:
            return f"{n >> power}{unit}"
    return f"{n}B"


def parse_duration(value: object) -> float:
    """Seconds from a number or a string as systemd admins write time spans: a bare number is seconds; else
    one or more NUMBER UNIT, spaces optional, case ignored ("90min", "1h30m", "1h 30min", "2d 4h", "500ms"),
    units ms, s/sec/second(s), m/min/minute(s), h/hr/hour(s), d/day(s), w/week(s). ValueError otherwise
    (negative, not finite, longer than MAX_ANY_DURATION, or a string longer than MAX_DURATION_TEXT)."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a duration must not be negative: {short(value)}")
        if value > MAX_ANY_DURATION:
            raise ValueError(f"a duration of {short(value)} seconds is longer than 100 years")
        seconds = float(value)
    elif isinstance(value, float):
        seconds = value
    elif isinstance(value, str):
        text = value.strip()
        if len(text) > MAX_DURATION_TEXT:
            raise ValueError(f"not a duration: {text[:20]!r}… is longer than {MAX_DURATION_TEXT} characters")
        if _BARE_SECONDS.fullmatch(text):
            seconds = float(text)
        else:
            seconds, pos = 0.0, 0
            while pos < len(text):
                m = _DURATION_PART.match(text, pos)
                if m is None:
                    break
                seconds += float(m.group(1)) * _unit_seconds(m.group(2))
                pos = m.end()
            if not text or pos != len(text):
                raise ValueError(
                    f"not a duration: {short(value)} (write e.g. {DURATION_FORMS}; units ms, s, min, h, d, w)"
                )
    else:
        raise ValueError(f"not a duration: {short(value)} (write e.g. {DURATION_FORMS})")
    if math.isnan(seconds):
        raise ValueError("not a duration: not a number (nan)")
    if seconds < 0:
        raise ValueError(f"a duration must not be negative: {short(value)}")
    if seconds > MAX_ANY_DURATION:  # inf included
        raise ValueError(f"a duration of {seconds:g} seconds is longer than 100 years")
    return seconds + 0.0  # -0.0 is 0


def short(value: object, limit: int = 40) -> str:
    """A value for a message: a huge int by its number of digits (str() refuses more than 4300 of them), else
    its repr cut to `limit` characters."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a number of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
