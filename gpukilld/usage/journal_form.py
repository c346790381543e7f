"""A UsageRecord as a journal entry (MESSAGE_ID 98e32adeb63e433194c9884c760b9489, journal.USAGE) and back.

The journal entries are the record of GPU usage: the store beside them (usage.sqlite) is rebuilt from them
when it is missing (gpukilld/usage/journal_read.py reads `journalctl -o json`, this module turns each entry
back into a record). So what fields_of writes, record_from_journal reads, and nothing else: an entry it cannot
read whole is not half-read. The catalog text is in systemd/gpukill.catalog.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gpukill.records.usage import ENDED_DAEMON_DOWN, ENDED_EXITED, ENDED_LEFT, UsageRecord
from gpukill.text import shown
from gpukill.units import format_duration, format_energy, format_size

from .. import journal

PREFIX = "GPUKILL_"
MAX_TEXT = 4096  # any string field read back: comm is 15 bytes, user names, units and ids are short
_ENDED = (ENDED_EXITED, ENDED_LEFT, ENDED_DAEMON_DOWN)
_U32, _U64 = 1 << 32, 1 << 64


def _seconds(v: float) -> str:
    return f"{v:.3f}"


def fields_of(rec: UsageRecord) -> dict[str, object]:
    """Audit.log's keyword fields for the record (Audit.log prefixes GPUKILL_; None values are left out)."""
    return {
        "TARGET_PID": rec.pid,
        "TARGET_START_TIME": rec.start_time,
        "TARGET_UID": rec.uid,
        "TARGET_USER": rec.user,
        "TARGET_COMM": rec.comm,
        "UNIT": rec.unit,
        "SLURM_JOB": rec.slurm_job,
        "POD_UID": rec.pod_uid,
        "CONTAINER_ID": rec.container_id,
        "DEVICE": rec.device_id,
        "DEVICE_INDEX": rec.device,
        "FIRST_SEEN": _seconds(rec.first_seen),
        "LAST_SEEN": _seconds(rec.last_seen),
        "GPU_SECONDS": _seconds(rec.gpu_seconds),
        "SM_SECONDS": None if rec.sm_seconds is None else _seconds(rec.sm_seconds),
        "SM_KNOWN_SECONDS": _seconds(rec.sm_known_seconds),
        "MEMORY_BYTE_SECONDS": _seconds(rec.memory_byte_seconds),
        "PEAK_MEMORY": rec.peak_memory,
        "ENERGY_JOULES": None if rec.energy_joules is None else _seconds(rec.energy_joules),
        "ENERGY_KNOWN_SECONDS": _seconds(rec.energy_known_seconds),
        "PROCESSES": rec.processes,
        "ENDED": rec.ended,
        "JOB_FROM_ENVIRON": "1" if rec.job_from_environ else None,
    }


def message_of(rec: UsageRecord) -> str:
    """The entry's MESSAGE, in systemd's style: "PID 4242 (python3, user alice) on GPU 0: consumed 1h 2min GPU
    time (38min at full SM), 6.1 GiB·h memory, peak 4.0 GiB, 212 kJ." Process text is escaped."""
    user = shown(rec.user)
    who = (
        f"{rec.processes} processes of user {user}"
        if rec.processes > 1 or rec.pid == 0
        else f"PID {rec.pid} ({shown(rec.comm)}, user {user})"
    )
    text = f"{who} on GPU {rec.device}: consumed {format_duration(rec.gpu_seconds)} GPU time"
    if rec.sm_seconds is not None:
        text += f" ({format_duration(rec.sm_seconds)} at full SM)"
    text += f", {rec.memory_byte_seconds / (1 << 30) / 3600:.3g} GiB·h memory, peak {format_size(rec.peak_memory)}"
    if rec.energy_joules is not None:
        text += f", {format_energy(rec.energy_joules)}"
    return text + "."


def _text(entry: Mapping[str, object], name: str, required: bool = True) -> str | None:
    v = entry.get(PREFIX + name)
    if v is None:
        if required:
            raise ValueError(name)
        return None
    if not isinstance(v, str) or len(v) > MAX_TEXT:  # journalctl gives a list for a repeated or binary field
        raise ValueError(name)
    return v


def _int(entry: Mapping[str, object], name: str, limit: int) -> int:
    v = _text(entry, name)
    assert v is not None
    if not (v.isascii() and v.isdigit() and len(v) <= 20) or int(v) >= limit:
        raise ValueError(name)
    return int(v)


def _num(entry: Mapping[str, object], name: str, required: bool = True) -> float | None:
    v = _text(entry, name, required)
    if v is None:
        return None
    if len(v) > 64:
        raise ValueError(name)
    n = float(v)  # ValueError for anything but a number
    if not math.isfinite(n) or n < 0:
        raise ValueError(name)
    return n


def record_from_journal(entry: Mapping[str, object]) -> UsageRecord | None:
    """The record of one `journalctl -o json` entry of ours (fields named with the GPUKILL_ prefix); None for
    anything malformed or out of bounds: a missing or repeated field, text over 4,096 characters, a number not
    finite or below 0, an unknown ended."""
    if entry.get("MESSAGE_ID", journal.USAGE.message_id) != journal.USAGE.message_id:
        return None
    if entry.get("_UID", "0") != "0":  # written by a user through logger or sd_journal_send: not ours
        return None
    try:
        ended = _text(entry, "ENDED")
        jfe = _text(entry, "JOB_FROM_ENVIRON", required=False)
        if ended not in _ENDED or jfe not in (None, "1"):
            return None
        first, last = _num(entry, "FIRST_SEEN"), _num(entry, "LAST_SEEN")
        assert first is not None and last is not None
        device_id = _text(entry, "DEVICE")
        if last < first or not device_id:
            return None
        processes = _int(entry, "PROCESSES", _U32)
        if processes < 1:
            return None
        # the ignores below: a required number is never None (_num raises ValueError where it is missing)
        return UsageRecord(
            pid=_int(entry, "TARGET_PID", _U32),
            start_time=_int(entry, "TARGET_START_TIME", _U64),
            uid=_int(entry, "TARGET_UID", _U32),
            user=_text(entry, "TARGET_USER") or "",
            comm=_text(entry, "TARGET_COMM", required=False) or "",
            unit=_text(entry, "UNIT", False),
            slurm_job=_text(entry, "SLURM_JOB", False),
            pod_uid=_text(entry, "POD_UID", False),
            container_id=_text(entry, "CONTAINER_ID", False),
            device=_int(entry, "DEVICE_INDEX", _U32),
            device_id=device_id,
            first_seen=first,
            last_seen=last,
            gpu_seconds=_num(entry, "GPU_SECONDS"),  # type: ignore[arg-type]
            sm_seconds=_num(entry, "SM_SECONDS", False),
            sm_known_seconds=_num(entry, "SM_KNOWN_SECONDS"),  # type: ignore[arg-type]
            memory_byte_seconds=_num(entry, "MEMORY_BYTE_SECONDS"),  # type: ignore[arg-type]
            peak_memory=_int(entry, "PEAK_MEMORY", _U64),
            energy_joules=_num(entry, "ENERGY_JOULES", False),
            energy_known_seconds=_num(entry, "ENERGY_KNOWN_SECONDS"),  # type: ignore[arg-type]
            processes=processes,
            ended=ended,
            job_from_environ=jfe == "1",
        )
    except (ValueError, OverflowError):
        return None
