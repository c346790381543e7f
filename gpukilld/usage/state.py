"""The accountant's running totals across a daemon restart: /var/lib/gpukill/usage-state.json.

A record that is still open when gpukilld stops (an upgrade, a crash, a restart a user provoked) must neither
lose what it had nor be counted twice. So the accountant's open records are written here every SAVE_EVERY
seconds while any is open, whenever records close (before their journal entries are written: the file never
holds a record whose entry is already in the journal) and at stop; and read back at start
(Accountant.load, gpukilld/usage/account.py, decides what each entry becomes).

Each entry is one open record's totals as of an instant (`at`, the start of its current segment), with the
rates its last sample gave; "held": those rates held up to the latest sample (`until`, with its wall clock
`until_wall`), so its totals then are those plus the rates times the time between. The gap from `until` to the
first sample of the next daemon is counted at the same rates (Accountant.load, within MAX_GAP). Instants are
the saving daemon's CLOCK_MONOTONIC, with `offset` = CLOCK_BOOTTIME - CLOCK_MONOTONIC at the save: CLOCK_BOOTTIME
counts from the boot whatever the daemon does (a suspend included), so the next daemon puts them on its own
clock. Written so, an entry does not change while its record's sample values do not: saves reuse the entries
already encoded (Accountant.dump_json). With the boot id (/proc/sys/kernel/random/boot_id):
processes and their start times are one boot's.

Written atomically as gpukilld/guard/state.py writes Guard's (a temporary file, fsync, rename, fsync of the
directory), 0600: it names users and their processes. The file is root's, but what is read is still bounded,
as gpukilld/guard/clocks.py bounds the clocks: at most MAX_STATE_BYTES, at most MAX_ENTRIES entries, each
checked for its shape; anything else is dropped with one line of warning, never an error that keeps the daemon
from starting.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from gpukill.records.usage import UsageRecord

from ..files import read_kept, replace_file

STATE_FILE = "usage-state.json"
FORMAT = 1
MAX_ENTRIES = 200_000  # open records: one per GPU process per GPU; a host has thousands at most
MAX_STATE_BYTES = 256 << 20  # entries are ~500 bytes: a file past this is not one we wrote
MAX_TEXT = 4096  # a user name, comm, unit, job, pod or container id: all far shorter
SLACK = 1.0  # seconds an instant may lie ahead of the clock read at load (the clocks are read apart)


def boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def boottime_offset() -> float:
    """CLOCK_BOOTTIME minus CLOCK_MONOTONIC now: the time this boot spent suspended."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) - time.monotonic()


@dataclass(frozen=True, slots=True)
class SavedRecord:
    """One open record as saved: its totals as of `at` (ended ""), and the rates of its last sample."""

    record: UsageRecord
    at: float  # the saver's CLOCK_MONOTONIC, seconds: the instant the totals (and last_seen) are of
    held: bool  # the rates held from `at` to the state's `until`
    sm_rate: float | None  # utilization, 0 to 1; None: unknown
    memory_rate: float  # bytes
    power_rate: float | None  # watts: its share of the device's power; None: unknown


# What an entry holds, and how each value is checked: "u32"/"u64" an int in range, "text" a str (≤ MAX_TEXT),
# "opt" a str or null, "num" a finite float ≥ 0, "optnum" that or null, "bool".
_RECORD_FIELDS = (
    ("pid", "u32"),
    ("start_time", "u64"),
    ("uid", "u32"),
    ("user", "text"),
    ("comm", "text"),
    ("unit", "opt"),
    ("slurm_job", "opt"),
    ("pod_uid", "opt"),
    ("container_id", "opt"),
    ("device", "u32"),
    ("device_id", "text"),
    ("first_seen", "num"),
    ("last_seen", "num"),
    ("gpu_seconds", "num"),
    ("sm_seconds", "optnum"),
    ("sm_known_seconds", "num"),
    ("memory_byte_seconds", "num"),
    ("peak_memory", "u64"),
    ("energy_joules", "optnum"),
    ("energy_known_seconds", "num"),
    ("job_from_environ", "bool"),
)
_RATE_FIELDS = (
    ("at", "num"),
    ("held", "bool"),
    ("sm_rate", "optnum"),
    ("memory_rate", "num"),
    ("power_rate", "optnum"),
)


def _ok(kind: str, v: Any) -> bool:
    if kind in ("u32", "u64"):
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << (32 if kind == "u32" else 64))
    if kind == "text":
        return isinstance(v, str) and len(v) <= MAX_TEXT
    if kind == "opt":
        return v is None or (isinstance(v, str) and len(v) <= MAX_TEXT)
    if kind == "num":
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    if kind == "optnum":
        return v is None or _ok("num", v)
    return isinstance(v, bool)


def entry_of(saved: SavedRecord) -> dict[str, Any]:
    rec = saved.record
    out: dict[str, Any] = {name: getattr(rec, name) for name, _ in _RECORD_FIELDS}
    out.update(
        at=saved.at, held=saved.held, sm_rate=saved.sm_rate, memory_rate=saved.memory_rate, power_rate=saved.power_rate
    )
    return out


def parse_entry(raw: Any) -> SavedRecord | None:
    """One saved entry, or None when anything in it is of the wrong shape or out of bounds."""
    if not isinstance(raw, dict):
        return None
    for name, kind in _RECORD_FIELDS + _RATE_FIELDS:
        if not _ok(kind, raw.get(name)):
            return None
    if not raw["device_id"] or raw["last_seen"] < raw["first_seen"]:
        return None
    rec = UsageRecord(**{name: raw[name] for name, _ in _RECORD_FIELDS})
    sm_rate, power_rate = raw["sm_rate"], raw["power_rate"]
    if sm_rate is not None and sm_rate > 1:
        return None
    return SavedRecord(
        rec,
        float(raw["at"]),
        raw["held"],
        None if sm_rate is None else float(sm_rate),
        float(raw["memory_rate"]),
        None if power_rate is None else float(power_rate),
    )


def header(boot: str, offset: float, until: float, until_wall: float) -> dict[str, Any]:
    """The state's fields but its records: this boot, CLOCK_BOOTTIME - CLOCK_MONOTONIC, the latest sample."""
    return {
        "format": FORMAT,
        "boot_id": boot,
        "saved_at": boottime(),
        "offset": offset,
        "until": until,
        "until_wall": until_wall,
    }


def encode_records(entries: list[dict[str, Any]] | dict[str, Any]) -> bytes:
    """Entries (or one) as JSON, compact."""
    return json.dumps(entries, separators=(",", ":")).encode()


def encode(head: dict[str, Any], records: bytes) -> bytes:
    """The file's bytes: the header's fields and the records already encoded."""
    return json.dumps(head, separators=(",", ":")).encode()[:-1] + b',"records":' + records + b"}"


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a state file held: its entries (checked), how many were dropped, whether it is this boot's, and
    the header's instants."""

    entries: list[SavedRecord]
    dropped: int
    this_boot: bool
    boot_id: str  # the saved boot id (cut to 40 characters), for the log
    offset: float
    until: float
    until_wall: float


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def parse_state(data: Any, boot: str) -> Parsed | None:
    """The entries of a state object (json.loads of the file), or None when it is not one this daemon wrote."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("records"), list):
        return None
    if not all(_finite(data.get(k)) and data[k] >= 0 for k in ("until", "until_wall")) or not _finite(
        data.get("offset")
    ):
        return None
    saved_boot = data.get("boot_id")
    shown = saved_boot[:40] if isinstance(saved_boot, str) else "none"
    raw = data["records"]
    entries = [e for e in (parse_entry(r) for r in raw[:MAX_ENTRIES]) if e is not None]
    return Parsed(
        entries,
        len(raw) - len(entries),
        bool(boot) and saved_boot == boot,
        shown,
        float(data["offset"]),
        float(data["until"]),
        float(data["until_wall"]),
    )


def state_path(directory: str) -> str:
    return os.path.join(directory, STATE_FILE)


def read_state(directory: str) -> tuple[Any, str | None]:
    """The saved JSON (None when there is none or it cannot be read), and a line saying why it could not be."""
    data, why = read_kept(state_path(directory), MAX_STATE_BYTES)
    if why is not None:
        return None, f"{why}: the running totals of the processes open at the last stop are lost"
    return data, None


def write_state(directory: str, data: dict[str, Any] | bytes) -> None:
    """Write atomically, 0600 (the state, or its bytes from Accountant.dump_json); raises OSError (the caller
    logs it: the daemon keeps running)."""
    os.makedirs(directory, mode=0o755, exist_ok=True)
    payload = data if isinstance(data, bytes) else json.dumps(data, separators=(",", ":")).encode()
    replace_file(state_path(directory), payload)
