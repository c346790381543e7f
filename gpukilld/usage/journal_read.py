"""The usage records of the journal, read back with journalctl to rebuild the store (gpukilld/usage/store.py).

Only entries with our MESSAGE_ID and _UID=0 are asked for: journald sets _UID itself, so an entry a user forges
with logger or sd_journal_send (which can set MESSAGE_ID and GPUKILL_* fields) has the user's _UID and is never
read as a record. Each line journalctl writes is bounded before it is parsed (an entry of ours is ~1.5 KiB; a
field too long makes journal_form refuse the record anyway), and record_from_journal drops anything malformed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
from collections.abc import Iterator

from gpukill.records.usage import UsageRecord

from .. import journal
from .journal_form import fields_of, record_from_journal

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024  # bytes of one entry's JSON: ours are ~1.5 KiB, with every text field at its bound ~40 KiB
_CHUNK = 64 * 1024
# What journalctl is asked to print: the record's fields and the two record_from_journal checks, not the message
# and the trusted fields it does not read (a third of the bytes to parse)
_FIELDS = (
    "MESSAGE_ID",
    "_UID",
    *(
        journal.field_name(name)
        for name in fields_of(
            UsageRecord(
                pid=0,
                start_time=0,
                uid=0,
                user="",
                device=0,
                device_id="",
                first_seen=0.0,
                last_seen=0.0,
                sm_seconds=0.0,
                energy_joules=0.0,
                job_from_environ=True,
            )
        )
    ),
)


def _lines(stream) -> Iterator[bytes | None]:
    """The stream's lines, None in place of one longer than MAX_LINE (its rest is skipped)."""
    while True:
        line = stream.readline(MAX_LINE + 1)
        if not line:
            return
        if len(line) > MAX_LINE and not line.endswith(b"\n"):
            while (rest := stream.readline(_CHUNK)) and not rest.endswith(b"\n"):
                pass
            yield None
            continue
        yield line


def read_usage_entries(journalctl: str = "journalctl") -> Iterator[UsageRecord]:
    """Every usage record in the journal, oldest first; what is malformed is skipped (and counted in the log)."""
    argv = [
        journalctl,
        "-o",
        "json",
        "--no-pager",
        "--output-fields=" + ",".join(_FIELDS),
        f"MESSAGE_ID={journal.USAGE.message_id}",
        "_UID=0",
    ]
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    except OSError as e:
        log.warning("usage store: cannot read the journal (%s): %s", journalctl, e)
        return
    skipped = 0
    try:
        assert proc.stdout is not None
        for line in _lines(proc.stdout):
            try:
                entry = json.loads(line) if line is not None else None
            except ValueError:
                entry = None
            record = record_from_journal(entry) if isinstance(entry, dict) else None
            if record is None:
                skipped += 1
                continue
            yield record
    finally:
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()
        if skipped:
            log.warning("usage store: %d journal entries with the usage MESSAGE_ID were not records", skipped)
