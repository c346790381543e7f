"""The audit trail: one journal entry per privileged request (allowed, denied or failed) and per device event.

Each event kind has its own MESSAGE_ID, documented in systemd/gpukill.catalog, so admins can filter with
`journalctl MESSAGE_ID=...` and read the catalog text with `journalctl -x`. Structured GPUKILL_* fields say
who asked for what.

Entries are written with journald's native protocol (https://systemd.io/JOURNAL_NATIVE_PROTOCOL/), spoken
here rather than through systemd-python so that every install, `pip install .` included, has the fields and
MESSAGE_IDs: an optional binding silently turned the audit trail into bare stderr lines. Without a journal
socket (or when a send fails) an entry goes to stderr as one escaped line.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import sys
import syslog
import threading
from dataclasses import dataclass

from gpukill.text import shown

JOURNAL_SOCKET = "/run/systemd/journal/socket"

# libsystemd's size (the kernel doubles it), so that entries queue here rather than block at once. A datagram
# over the buffer, or over what the kernel allocates at once (4 MiB on Linux 6), fails with EMSGSIZE or
# ENOBUFS: that entry goes by memfd instead.
SNDBUF_SIZE = 8 * 1024 * 1024
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)  # Linux's number; Python does not export the name

# sd_journal_send blocks while journald's queue is full; so do we, but at most this long. An entry must not
# be dropped because journald is briefly busy, and the daemon must not hang on a stalled journald either:
# it serves the bus from the same loop and WatchdogSec=30 would restart it over and over. After a timeout
# the entry goes to stderr and later sends do not wait (MSG_DONTWAIT) until one gets through again.
SEND_TIMEOUT = 5.0

_FIELD_NAME_MAX = 64  # journald ignores longer names


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
# A kill's checkpoint step (gpukill/checkpoint.py), one entry per step and process: GPUKILL_CHECKPOINT is "sent",
# "saved" (exited within the wait), "still-running" (SIGTERM follows), "malformed" or "would-send" (a dry run);
# GPUKILL_SIGNAL, GPUKILL_WAIT, GPUKILL_WAITED, GPUKILL_SOURCE, GPUKILL_TARGET_*, GPUKILL_INITIATOR, GPUKILL_RULE.
CHECKPOINT = EventKind("checkpoint", "1f8644802e5947d2b2097cb3f9b9fa28", syslog.LOG_NOTICE)

# Guard Mode: every entry carries GPUKILL_RULE (the rule's name) where a rule is concerned.
GUARD_VIOLATION = EventKind("guard-violation", "cf5243f6102f4795829414419a215b48", syslog.LOG_WARNING)
GUARD_ACTION = EventKind("guard-action", "fbe65fec4222427794f7b607f1c2462f", syslog.LOG_NOTICE)
GUARD_DRY_RUN = EventKind("guard-dry-run", "10c71d16a90847f189d5d79d5ab7f684", syslog.LOG_NOTICE)
GUARD_POLICY = EventKind("guard-policy", "2a392ee210d443fcb4e17a08e3eb12ce", syslog.LOG_NOTICE)
GUARD_NOTIFY_FAILED = EventKind("guard-notify-failed", "8cbf9129bbea4b40a09c797f2c2f3595", syslog.LOG_WARNING)
GUARD_NOTICE = EventKind("guard-notice", "96738fcc40704013a2c74c51bcff18f8", syslog.LOG_WARNING)
# A warning of a kill rule's `warn:` schedule sent to its notify targets (GPUKILL_REMAINING: seconds left).
GUARD_WARNING = EventKind("guard-warning", "d5df35b8c04443b084bf229937149750", syslog.LOG_WARNING)
# An owner's request for more time before a kill rule's kill (Postpone), granted, granted in part or refused:
# GPUKILL_RULE, GPUKILL_TARGET_PID, GPUKILL_TARGET_START_TIME, GPUKILL_CALLER_UID, GPUKILL_ASKED and
# GPUKILL_GRANTED (seconds), GPUKILL_DEADLINE (seconds since the epoch), GPUKILL_POSTPONE_REASON (the caller's
# text, bounded).
GUARD_POSTPONE = EventKind("guard-postpone", "2118e4eff5d5458e8990b54efa3d9bf7", syslog.LOG_NOTICE)
# A requeue or cancel rule's act on a Slurm job, through Slurm's own commands: GPUKILL_SLURM_JOB, GPUKILL_RESULT
# ("requeued", "job-cancelled"), GPUKILL_SLURM_MESSAGE (what Slurm said), GPUKILL_TARGET_PIDS, GPUKILL_RULE.
GUARD_SLURM = EventKind("guard-slurm", "2d8d077fea2a49819ce4d701cc8ca928", syslog.LOG_NOTICE)
# The same act not done: refused before Slurm was asked (not requeueable, another user's job), Slurm failed or is
# absent, or the process belongs to no Slurm job and is left running (GPUKILL_RESULT, GPUKILL_ERROR).
GUARD_SLURM_REFUSED = EventKind("guard-slurm-refused", "2090ee9e97784f7f9aba2c79755f1c6b", syslog.LOG_WARNING)
# A managed user, group or GPU policy (a file in guard.d) set, removed or imported, or a change refused:
# GPUKILL_OPERATION, GPUKILL_POLICY_KIND, GPUKILL_POLICY_TARGET, GPUKILL_FILE, GPUKILL_CALLER_UID.
GUARD_MANAGED_POLICY = EventKind("guard-managed-policy", "783a2a0d13b04cf29e6839828e63aeca", syslog.LOG_NOTICE)
# The rogue-activity audit's settings changed (SetAuditSettings, ImportAuditSettings), or a change refused:
# GPUKILL_OPERATION, GPUKILL_KEYS, GPUKILL_FILE, GPUKILL_SETTINGS (the new [audit] text), GPUKILL_CALLER_UID.
AUDIT_SETTINGS = EventKind("audit-settings", "33e4adac4eb74fbf8dbfac9f87af110b", syslog.LOG_NOTICE)

# GPU usage accounting: one entry per process per GPU when it ends or leaves that GPU (gpukilld/usage/), its
# totals in the fields of gpukilld/usage/journal_form.py; the store (usage.sqlite) is rebuilt from these.
# LOG_DEBUG, not LOG_INFO: journald's rate limit keeps one budget per unit for NOTICE and INFO together (and
# others for ERR, WARNING, DEBUG), and how many usage entries there are is up to the users (a process ending is
# one): 1,200 short GPU processes used up the budget that kills are audited from, and journald dropped the next
# kill's entry (tests/test_hostile.py). In DEBUG's own budget a churn can only cost usage entries.
USAGE = EventKind("usage", "98e32adeb63e433194c9884c760b9489", syslog.LOG_DEBUG)

# A file the daemon keeps (Guard's state, the usage totals, the usage store) could not be written: the first
# failure of a run of them, GPUKILL_FILE and GPUKILL_ERROR (gpukilld/files.py's WriteWatch); and the first write
# that succeeds after them, with GPUKILL_FAILURES.
WRITE_FAILED = EventKind("write-failed", "0434aa3a59cf40b8b8f40bb844f194ed", syslog.LOG_ERR)
WRITE_RECOVERED = EventKind("write-recovered", "795a05cbe3b448f19e23a47e60cfab12", syslog.LOG_NOTICE)

# Suspend and resume (gpukilld/acts/suspend.py): a workload suspended, resumed, or a suspended process killed
# or found gone (GPUKILL_ACTION: suspend, resume, kill, gone; GPUKILL_RESULT), one entry per process; a refusal
# or a step that failed (what was undone, a process left stuck with GPUKILL_REMEDY); polkit's denial.
SUSPEND = EventKind("suspend", "bf3798ae26d648a58ae29a69e6419ed3", syslog.LOG_NOTICE)
SUSPEND_FAILED = EventKind("suspend-failed", "6a6c455765c147a6993283c00d570aaa", syslog.LOG_WARNING)
SUSPEND_DENIED = EventKind("suspend-denied", "0b3f15ec2b4b40d4a62486c15586033e", syslog.LOG_WARNING)

ALL_KINDS = (
    KILL,
    KILL_DENIED,
    KILL_FAILED,
    RESET,
    RESET_DENIED,
    RESET_FAILED,
    DEVICE_STATE,
    DAEMON,
    CHECKPOINT,
    GUARD_VIOLATION,
    GUARD_ACTION,
    GUARD_DRY_RUN,
    GUARD_POLICY,
    GUARD_NOTIFY_FAILED,
    GUARD_NOTICE,
    GUARD_MANAGED_POLICY,
    GUARD_POSTPONE,
    GUARD_SLURM,
    GUARD_SLURM_REFUSED,
    AUDIT_SETTINGS,
    USAGE,
    WRITE_FAILED,
    WRITE_RECOVERED,
    SUSPEND,
    SUSPEND_FAILED,
    SUSPEND_DENIED,
)


def field_name(key: str) -> str:
    """GPUKILL_KEY as journald accepts it: A-Z, 0-9 and _, at most 64 characters. journald silently drops
    any other name, so an odd one (a dash, a non-ASCII letter) is made legal rather than lost."""
    name = "".join(c if "A" <= c <= "Z" or "0" <= c <= "9" else "_" for c in f"GPUKILL_{key}".upper())
    return name[:_FIELD_NAME_MAX]


def encode(fields: list[tuple[str, str]]) -> bytes:
    """One entry in the native format. A value with a newline must use the length-prefixed binary form, or
    its second line would be read as a field of its own: a forged one, when a process chose the text."""
    out = bytearray()
    for name, value in fields:
        data = value.encode("utf-8", "backslashreplace")  # a lone surrogate must not make the entry fail
        if b"\n" in data:
            out += b"%s\n%s%s\n" % (name.encode("ascii"), struct.pack("<Q", len(data)), data)
        else:
            out += b"%s=%s\n" % (name.encode("ascii"), data)
    return bytes(out)


def _stderr_value(value: str) -> str:
    # shown() keeps the line whole (no newline, no escape sequence); quoting keeps a value such as
    # "x GPUKILL_RESULT=allowed" from reading as a field of its own, and no raw quote is left inside to end
    # the quoted text early (a backslash escape could be undone by a backslash of the process's own).
    text = shown(value)
    if text and not any(c in text for c in ' "]'):
        return text
    return '"' + text.replace('"', "\\x22") + '"'


class Audit:
    def __init__(self, identifier: str = "gpukilld") -> None:
        self.identifier = identifier
        self._lock = threading.Lock()  # one stderr line at a time; datagrams are atomic by themselves
        self._sock: socket.socket | None = None
        self._stalled = False
        if os.path.exists(JOURNAL_SOCKET):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            try:  # FORCE passes net.core.wmem_max, with CAP_NET_ADMIN only; the unit does not grant it
                sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, SNDBUF_SIZE)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_SIZE)
            seconds = int(SEND_TIMEOUT)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", seconds, int((SEND_TIMEOUT - seconds) * 1e6))
            )  # a timeval
            self._sock = sock

    @property
    def to_journal(self) -> bool:
        return self._sock is not None

    def log(self, kind: EventKind, message: str, **fields: object) -> None:
        """Record one event. Field names are given without the GPUKILL_ prefix; None values are left out.
        Never raises: an entry the journal refuses goes to stderr."""
        extra = {field_name(k): str(v) for k, v in fields.items() if v is not None}
        extra.setdefault("GPUKILL_EVENT", kind.name)
        if self._sock is not None:
            caller = sys._getframe(1)  # the code that audits, not this function: what CODE_* is for
            entry = [
                ("MESSAGE", message),
                ("MESSAGE_ID", kind.message_id),
                ("PRIORITY", str(kind.priority)),
                ("SYSLOG_IDENTIFIER", self.identifier),
                ("CODE_FILE", caller.f_code.co_filename),
                ("CODE_LINE", str(caller.f_lineno)),
                ("CODE_FUNC", caller.f_code.co_qualname),
                *extra.items(),
            ]
            try:
                self._send(encode(entry))
                return
            except OSError as e:  # journald gone, restarting or stalled: the entry must not be lost silently
                why = f"not in the journal: {e.strerror or e}"
        else:
            why = ""
        detail = " ".join(f"{k}={_stderr_value(v)}" for k, v in extra.items())
        suffix = f" ({why})" if why else ""
        with self._lock:
            print(f"<{kind.priority}>{shown(message)} [{detail}]{suffix}", file=sys.stderr, flush=True)

    def _send(self, payload: bytes) -> None:
        assert self._sock is not None
        flags = socket.MSG_DONTWAIT if self._stalled else 0
        try:
            try:
                self._sock.sendto(payload, flags, JOURNAL_SOCKET)  # by name: journald may have restarted
            except OSError as e:
                if e.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                    raise
                self._send_memfd(self._sock, payload, flags)
        except OSError as e:
            self._stalled = e.errno == errno.EAGAIN
            raise
        self._stalled = False

    def _send_memfd(self, sock: socket.socket, payload: bytes, flags: int) -> None:
        """Too large for a datagram: the documented fallback passes the entry in a memfd, sealed so that
        journald can trust what it reads (it refuses unsealed ones from senders other than root)."""
        fd = os.memfd_create("gpukilld-audit", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            fcntl.fcntl(
                fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            )
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))]
            sock.sendmsg([], rights, flags, JOURNAL_SOCKET)  # empty payload: the fd is the entry
        finally:
            os.close(fd)
