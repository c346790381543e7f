"""The audit trail: one journal entry per privileged request (allowed, denied or failed) and per device event.

Each event kind has its own MESSAGE_ID, documented in systemd/gpukill.catalog, so admins can filter with
`journalctl MESSAGE_ID=...` and read the catalog text with `journalctl -x`. Structured GPUKILL_* fields say
who asked for what. Without a journal socket (or without systemd-python) entries go to stderr as one line.
"""

from __future__ import annotations

import os
import sys
import syslog
import threading
from dataclasses import dataclass

JOURNAL_SOCKET = "/run/systemd/journal/socket"


@dataclass(frozen=True, slots=True)
class EventKind:
    name: str
    message_id: str
    priority: int


KILL = EventKind("kill", "3b0201a693984bba9c0d84728dcc3ded", syslog.LOG_NOTICE)
KILL_DENIED = EventKind("kill-denied", "71c9002c38ba461f9897f8820f7ae478", syslog.LOG_WARNING)
KILL_FAILED = EventKind("kill-failed", "5e959bda9ab14dfc9d459a9a202c5f80", syslog.LOG_WARNING)
RESET = EventKind("reset", "4c01e0345a784058b0e4013313e159de", syslog.LOG_NOTICE)
RESET_DENIED = EventKind("reset-denied", "7554fa061ba44f08bee3f42a49b17581", syslog.LOG_WARNING)
RESET_FAILED = EventKind("reset-failed", "10b89340a75f437880f4a156e1283296", syslog.LOG_ERR)
DEVICE_STATE = EventKind("device-state", "ede32fe6bbd54d1f984f08e124554019", syslog.LOG_WARNING)
DAEMON = EventKind("daemon", "e2a7c366d5844cac91f70e462072e14d", syslog.LOG_INFO)

# Guard Mode: every entry carries GPUKILL_RULE (the rule's name) where a rule is concerned.
GUARD_VIOLATION = EventKind("guard-violation", "cf5243f6102f4795829414419a215b48", syslog.LOG_WARNING)
GUARD_ACTION = EventKind("guard-action", "fbe65fec4222427794f7b607f1c2462f", syslog.LOG_NOTICE)
GUARD_DRY_RUN = EventKind("guard-dry-run", "10c71d16a90847f189d5d79d5ab7f684", syslog.LOG_NOTICE)
GUARD_POLICY = EventKind("guard-policy", "2a392ee210d443fcb4e17a08e3eb12ce", syslog.LOG_NOTICE)
GUARD_NOTIFY_FAILED = EventKind("guard-notify-failed", "8cbf9129bbea4b40a09c797f2c2f3595", syslog.LOG_WARNING)
GUARD_NOTICE = EventKind("guard-notice", "96738fcc40704013a2c74c51bcff18f8", syslog.LOG_WARNING)

ALL_KINDS = (KILL, KILL_DENIED, KILL_FAILED, RESET, RESET_DENIED, RESET_FAILED, DEVICE_STATE, DAEMON,
             GUARD_VIOLATION, GUARD_ACTION, GUARD_DRY_RUN, GUARD_POLICY, GUARD_NOTIFY_FAILED, GUARD_NOTICE)


class Audit:
    def __init__(self, identifier: str = "gpukilld") -> None:
        self.identifier = identifier
        self._send = None
        self._lock = threading.Lock()
        if os.path.exists(JOURNAL_SOCKET):
            try:
                from systemd import journal

                self._send = journal.send
            except ImportError:
                print("gpukilld: systemd-python is not installed; audit entries go to stderr", file=sys.stderr)

    @property
    def to_journal(self) -> bool:
        return self._send is not None

    def log(self, kind: EventKind, message: str, **fields: object) -> None:
        """Record one event. Field names are given without the GPUKILL_ prefix; None values are left out."""
        extra = {f"GPUKILL_{k.upper()}": str(v) for k, v in fields.items() if v is not None}
        extra.setdefault("GPUKILL_EVENT", kind.name)
        if self._send is not None:
            try:
                self._send(
                    MESSAGE=message,
                    MESSAGE_ID=kind.message_id,
                    PRIORITY=str(kind.priority),
                    SYSLOG_IDENTIFIER=self.identifier,
                    **extra,
                )
                return
            except OSError as e:  # journald restarting: the entry must not be lost silently
                print(f"gpukilld: journal unavailable ({e.strerror}); audit entry follows", file=sys.stderr)
        detail = " ".join(f"{k}={v}" for k, v in extra.items())
        with self._lock:
            print(f"<{kind.priority}>{message} [{detail}]", file=sys.stderr, flush=True)
