"""GPU usage accounting as people type and read it: the time forms of `--since`/`--until`, and a UsageReport
(gpukill/records/usage.py, GetUsage's reply) as a table.

Every front end that asks GetUsage goes through here (the CLI, the REST API's query parameters, MCP, gpukill's
--audit, top's totals line), so "24h" and "yesterday" mean the same everywhere, and so do the table's units:
GPU and SM time as systemd writes a timespan ("1h 2min 5s"), memory in GiB·h (GiB held for an hour), energy in
J/kJ/MJ (both gpukill/units.py's). A total nobody measured prints "–", never 0. Process text is escaped
(client/format.table).

Times are seconds since the epoch; a date without an offset is local time, as journalctl's --since reads it.
Imported by one-shot commands: nothing heavy at import time (datetime is loaded when a date is parsed).
"""

from __future__ import annotations

import re
import time

from gpukill.records.usage import UsageReport, UsageRow
from gpukill.text import UNKNOWN
from gpukill.units import format_duration, format_energy, format_size

from .format import table

MAX_WHEN_TEXT = 64  # characters: "2026-12-01T10:00:00.000000+01:00" needs 32
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}([ T]\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?)?(Z|[+-]\d{2}:?\d{2})?")
_EPOCH = re.compile(r"\d{1,12}(\.\d{1,9})?")
WORDS = ("now", "today", "yesterday", "tomorrow")
FORMS = (
    "a duration ago (30d, 24h, 90min, 1h30m) or a date (YYYY-MM-DD, 'YYYY-MM-DD HH:MM[:SS]', ISO 8601, "
    "today, yesterday, now)"
)
_BARE = re.compile(r"[0-9.]+")


def parse_when(text: str, now: float | None = None, *, epoch: bool = False) -> float:
    """An instant as seconds since the epoch: a duration is that long before now, a date is local time where it
    names no offset. epoch: a bare number is seconds since the epoch (the REST API's form); the CLI takes
    "@SECONDS" for that, as journalctl does. ValueError, one line, for anything else."""
    now = time.time() if now is None else now
    word = text.strip()
    if not word or len(word) > MAX_WHEN_TEXT:
        raise ValueError(f"{text[:MAX_WHEN_TEXT]!r} is not a time: give {FORMS}")
    number = word[1:] if word.startswith("@") else word if epoch else None
    if number is not None and _EPOCH.fullmatch(number):
        return float(number)
    if word.lower() in WORDS:
        if word.lower() == "now":
            return now
        from datetime import datetime, timedelta

        midnight = datetime.fromtimestamp(now).replace(hour=0, minute=0, second=0, microsecond=0)
        shift = {"today": 0, "yesterday": -1, "tomorrow": 1}[word.lower()]
        return (midnight + timedelta(days=shift)).timestamp()
    if not _BARE.fullmatch(word):  # a bare number is no span ago: "24" could be hours, a day, an epoch
        from gpukill.units import parse_duration

        try:
            span = parse_duration(word)
        except ValueError as e:
            if "longer than 100 years" in str(e):
                raise ValueError(f"{word!r} is more than a century ago") from None
        else:
            return max(0.0, now - span)
    if _DATE.fullmatch(word):
        from datetime import datetime

        try:
            seconds = datetime.fromisoformat(word.replace("Z", "+00:00")).timestamp()  # naive: local time
        except (ValueError, OverflowError, OSError) as e:
            raise ValueError(f"{word!r} is not a date: {e}") from None
        if seconds < 0:
            raise ValueError(f"{word!r} is before 1970")
        return seconds
    raise ValueError(f"{word!r} is not a time: give {FORMS}")


# -- the report as text ----------------------------------------------------------------------------------

KEY_HEADERS = {"user": "USER", "unit": "UNIT", "job": "SLURM JOB", "pod": "POD", "gpu": "GPU", "process": "PROCESS"}
NO_KEY = {"unit": "(no unit)", "job": "(not in a job)", "pod": "(not in a pod)"}


def gib_hours(byte_seconds: float) -> str:
    """Memory over time in GiB·h: 1 GiB held for an hour."""
    value = byte_seconds / (1 << 30) / 3600.0
    return f"{value:.2f} GiB·h" if value < 10 else f"{value:.1f} GiB·h" if value < 1000 else f"{value:.0f} GiB·h"


def peak(n: int) -> str:
    return format_size(n)


def _partly(text: str, known: float, total: float) -> str:
    """A total measured over only part of the time says over how much ("38min (60% known)")."""
    if text == UNKNOWN or total <= 0 or known >= total * 0.995:
        return text
    return f"{text} ({100.0 * known / total:.0f}% known)"


def row_label(by: str, row: UsageRow) -> str:
    """The group's name as the table shows it (escaped by the table)."""
    if row.hidden:
        return "(hidden)"
    if by == "process":
        return f"{row.pid} {row.comm or '?'} ({row.user})" if row.pid is not None else row.key
    if by == "gpu":
        return f"{row.device} {row.device_id}" if row.device is not None and row.device_id else row.key
    return row.key or NO_KEY.get(by, "-")


def usage_table(report: UsageReport) -> str:
    """One row per group: processes, GPU time, SM time, memory, peak, energy; then the range it covers."""
    from datetime import datetime

    def when(t: float) -> str:
        return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")

    span = f"{when(report.since)} to {when(report.until)}"
    if not report.rows:
        return f"No GPU use recorded from {span}."
    rows = []
    for r in report.rows:
        processes = f"{r.processes}" + (f" ({r.live} live)" if r.live else "")
        rows.append(
            [
                row_label(report.by, r),
                processes,
                format_duration(r.gpu_seconds),
                _partly(format_duration(r.sm_seconds), r.sm_known_seconds, r.gpu_seconds),
                gib_hours(r.memory_byte_seconds),
                peak(r.peak_memory),
                _partly(format_energy(r.energy_joules), r.energy_known_seconds, r.gpu_seconds),
            ]
        )
    lines = [
        table(
            [
                KEY_HEADERS.get(report.by, report.by.upper()),
                "PROCESSES",
                "GPU TIME",
                "SM TIME",
                "MEMORY",
                "PEAK",
                "ENERGY",
            ],
            rows,
        ),
        "",
    ]
    more = (
        f", the first {len(report.rows)} of {report.rows_total} groups" if report.rows_total > len(report.rows) else ""
    )
    lines.append(f"GPU use from {span}, by {report.by}{more}.")
    if report.rebuilding:
        lines.append("gpukilld is rebuilding its usage store from the journal: older records may be missing.")
    return "\n".join(lines)


def totals_line(report: UsageReport) -> str:
    """All rows together in one line (top's session totals): GPU time, memory, energy."""
    gpu = sum(r.gpu_seconds for r in report.rows)
    memory = sum(r.memory_byte_seconds for r in report.rows)
    joules = [r.energy_joules for r in report.rows if r.energy_joules is not None]
    return (
        f"GPU time {format_duration(gpu)}, memory {gib_hours(memory)}, energy "
        f"{format_energy(sum(joules) if joules else None)}"
    )
