"""GetUsage's query: the a{sv} a caller sends, checked and bounded into a UsageQuery before the store sees it.

Every key is optional; an unknown key, a value of the wrong type or out of its bounds is InvalidArgs in one
line naming the key. Times are seconds since the epoch (clients turn "30d" or a date into them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dbus_fast import Variant

from gpukill.errors import InvalidArgs
from gpukill.records.usage import USAGE_BY

DEFAULT_RANGE = 86400.0  # since defaults to a day before until
MAX_TIME = 2.0**40  # seconds since the epoch (year ~36,800): anything later is a mistake, not a range
MAX_TEXT = 4096  # a filter's text: as long as any text a record holds (journal_form bounds them alike)
MAX_LIMIT = 1000  # rows of one reply: 1000 rows of bounded keys fit one bus message many times over
KEYS = ("since", "until", "by", "user", "name", "unit", "job", "pod", "device", "limit")
_TIME_TYPES = "dtxui"


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """What to sum: records overlapping [since, until], grouped by `by`, the filters combined with AND."""

    since: float
    until: float
    by: str = "user"
    user: str | int | None = None  # a uid (int), or a name or uid as text
    name: str | None = None  # contained in the process name (comm)
    unit: str | None = None
    job: str | None = None  # Slurm job id
    pod: str | None = None  # pod UID
    device: str | int | None = None  # a global index (int), or an index, UUID (or PCI id, resolved by the bus)
    limit: int = MAX_LIMIT


def _value(raw: dict[str, Variant], key: str, kinds: str) -> Any:
    v = raw[key]
    if not isinstance(v, Variant) or v.signature not in tuple(kinds):
        sig = v.signature if isinstance(v, Variant) else type(v).__name__
        raise InvalidArgs(f"usage query {key!r} has type {sig[:32]!r}, expected one of {list(kinds)}")
    return v.value


def _time(raw: dict[str, Variant], key: str) -> float | None:
    if key not in raw:
        return None
    value = float(_value(raw, key, _TIME_TYPES))
    if not math.isfinite(value) or not 0 <= value <= MAX_TIME:
        raise InvalidArgs(
            f"usage query {key!r} must be seconds since the epoch from 0 to {MAX_TIME:.0f}, not {value!r}"[:200]
        )
    return value


def _text(raw: dict[str, Variant], key: str) -> str | None:
    if key not in raw:
        return None
    text = _value(raw, key, "s")
    if len(text) > MAX_TEXT:
        raise InvalidArgs(f"usage query {key!r} is {len(text)} characters long; at most {MAX_TEXT}")
    return text


def parse_query(raw: dict[str, Variant], now: float) -> UsageQuery:
    """The query of a GetUsage call; InvalidArgs (one line) for anything wrong in it."""
    if len(raw) > len(KEYS):
        raise InvalidArgs(f"usage query has {len(raw)} keys; there are {len(KEYS)} ({', '.join(KEYS)})")
    for key in raw:
        if key not in KEYS:
            raise InvalidArgs(f"unknown usage query key {str(key)[:64]!r} (known: {', '.join(KEYS)})")
    until = _time(raw, "until")
    if until is None:
        until = now
    since = _time(raw, "since")
    if since is None:
        since = max(0.0, until - DEFAULT_RANGE)
    if not since < until:
        raise InvalidArgs(f"usage query 'since' ({since:.3f}) must be before 'until' ({until:.3f})")
    by = _text(raw, "by")
    if by is None:
        by = "user"
    elif by not in USAGE_BY:
        raise InvalidArgs(f"usage query 'by' must be one of {', '.join(USAGE_BY)}, not {by[:64]!r}")
    user: str | int | None = None
    if "user" in raw:
        user = _value(raw, "user", "su")
        if isinstance(user, str) and len(user) > MAX_TEXT:
            raise InvalidArgs(f"usage query 'user' is {len(user)} characters long; at most {MAX_TEXT}")
    device: str | int | None = None
    if "device" in raw:
        device = _value(raw, "device", "su")
        if isinstance(device, str):
            if len(device) > MAX_TEXT:
                raise InvalidArgs(f"usage query 'device' is {len(device)} characters long; at most {MAX_TEXT}")
            device = device.strip()
    limit = MAX_LIMIT
    if "limit" in raw:
        limit = _value(raw, "limit", "uqy")
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidArgs(f"usage query 'limit' must be from 1 to {MAX_LIMIT}, not {limit}")
    return UsageQuery(
        since=since,
        until=until,
        by=by,
        user=user,
        name=_text(raw, "name"),
        unit=_text(raw, "unit"),
        job=_text(raw, "job"),
        pod=_text(raw, "pod"),
        device=device,
        limit=limit,
    )
