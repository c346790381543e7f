"""A warning to the owner's terminals, as write(1) would put it, without ever waiting on a terminal.

The sessions come from logind (ListSessions, each of the owner's sessions' TTY property) where it answers on the
system bus, else from utmp (USER_PROCESS records, what SSH and console logins write where logind is absent:
containers, minimal hosts). Each tty is checked before a byte goes to it: a character device under /dev/pts
or /dev/tty*, owned by the owner's uid (never another user's terminal, whatever utmp claims: utmp is a file a
confused or hostile login program could fill), its group-write bit set (`mesg y`) unless the policy ignores mesg.
It is checked by lstat before it is opened (O_WRONLY|O_NOCTTY|O_NONBLOCK|O_NOFOLLOW) and by fstat after, and
gets one bounded write: what does not fit in the tty's buffer now
is dropped (EAGAIN), so a full or hung terminal costs nothing. At most MAX_TTYS terminals an owner are written. This
runs in the notifier's tty channel thread,
never on the daemon's main loop.
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import stat
import struct
from dataclasses import dataclass

UTMP = "/run/utmp"
# glibc's struct utmp on x86_64 and aarch64 (384 bytes): type, pid, line, id, user, host, exit, session, tv, addr.
_UTMP = struct.Struct("=h2xi32s4s32s256shhi2i4i20s")
USER_PROCESS = 7
MAX_RECORDS = 4096  # a bigger utmp is not a login table: read no further
MAX_MESSAGE = 2048  # bytes per terminal: a few lines, well under a pty's buffer
# Terminals written per warning: a person has a few; a user who registers thousands of ptys in utmp (utempter)
# costs the channel thread, and the journal, this many writes and lines, and only their own warnings wait.
MAX_TTYS = 16
# A utmp line names a terminal only as pts/N or ttyX: nothing else under /dev is ever opened (opening
# /dev/watchdog or a disk for writing has effects of its own, whatever is written after).
_LINE = re.compile(r"pts/[0-9]{1,9}|tty[A-Za-z0-9]{1,12}")


@dataclass(frozen=True, slots=True)
class Delivery:
    tty: str  # /dev/pts/N
    outcome: str  # written, partial, skipped, failed
    detail: str = ""


LOGIND = "org.freedesktop.login1"
LOGIND_TIMEOUT = 2.0  # seconds per call: logind answers in milliseconds; one that does not is skipped for utmp
MAX_SESSIONS = 4096


def _tty_path(line: str) -> str | None:
    """/dev/LINE for a tty name as utmp or logind gives it (pts/3, tty2, /dev/pts/3); None for anything else."""
    line = line.removeprefix("/dev/")
    return f"/dev/{line}" if _LINE.fullmatch(line) else None  # not an X display (:0), a pseudo-line, a disk


def logind_ttys(uid: int, bus: str = "SYSTEM") -> tuple[str, ...] | None:
    """The terminals of uid's logind sessions; None when logind does not answer (then utmp is read)."""
    from jeepney import DBusAddress, MessageType, Properties, new_method_call
    from jeepney.io.blocking import open_dbus_connection

    try:
        conn = open_dbus_connection(bus=bus)
    except (OSError, ValueError, KeyError):
        return None
    try:
        manager = DBusAddress("/org/freedesktop/login1", LOGIND, f"{LOGIND}.Manager")
        reply = conn.send_and_get_reply(new_method_call(manager, "ListSessions"), timeout=LOGIND_TIMEOUT)
        if reply.header.message_type != MessageType.method_return:
            return None
        found: dict[str, None] = {}
        for _sid, session_uid, _user, _seat, path in reply.body[0][:MAX_SESSIONS]:
            if session_uid != uid:
                continue
            session = DBusAddress(path, LOGIND, f"{LOGIND}.Session")
            got = conn.send_and_get_reply(Properties(session).get("TTY"), timeout=LOGIND_TIMEOUT)
            answered = got.header.message_type == MessageType.method_return and got.body[0][0] == "s"
            if answered and (tty := _tty_path(got.body[0][1])):
                found[tty] = None
        return tuple(found)
    except (OSError, TimeoutError, ValueError, IndexError, TypeError):
        return None
    finally:
        conn.close()


def user_ttys(uid: int, utmp: str = UTMP) -> tuple[str, ...]:
    """The /dev paths of uid's login sessions in utmp (records naming uid's user), each at most once; the owner
    check is done on writing. Other users' records are not looked at: however many a user registers, they
    neither take the place of uid's terminals under MAX_TTYS nor cost uid's warnings a write."""
    try:
        name = pwd.getpwuid(uid).pw_name.encode()
    except KeyError:
        return ()
    try:
        with open(utmp, "rb") as f:
            data = f.read(_UTMP.size * MAX_RECORDS)
    except OSError:
        return ()
    seen: dict[str, None] = {}
    for offset in range(0, len(data) - _UTMP.size + 1, _UTMP.size):
        fields = _UTMP.unpack_from(data, offset)
        if fields[0] != USER_PROCESS or fields[4].split(b"\0", 1)[0] != name:
            continue
        tty = _tty_path(fields[2].split(b"\0", 1)[0].decode("ascii", "replace"))
        if tty is not None:  # a line naming anything but /dev/ttyX or /dev/pts/N is skipped
            seen[tty] = None
    return tuple(seen)


def _refusal(st: os.stat_result, path: str, uid: int, respect_mesg: bool) -> str:
    if not stat.S_ISCHR(st.st_mode):
        return f"{path} is not a character device"
    if not (path.startswith("/dev/pts/") or path.startswith("/dev/tty")):
        return f"{path} is not a terminal"
    if st.st_uid != uid:
        return f"{path} belongs to uid {st.st_uid}, not {uid}"
    if respect_mesg and not st.st_mode & stat.S_IWGRP:
        return f"{path} has mesg n"
    return ""


def write_tty(path: str, uid: int, text: str, respect_mesg: bool = True) -> Delivery:
    """One non-blocking write of text (already escaped by the caller) to path, if it is uid's terminal."""
    try:
        # Checked before opening too: even an open of another user's terminal is not ours to make.
        why = _refusal(os.lstat(path), path, uid, respect_mesg)
        if why:
            return Delivery(path, "skipped", why)
        fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return Delivery(path, "failed", os.strerror(e.errno or 0))
    try:
        why = _refusal(os.fstat(fd), path, uid, respect_mesg)  # fstat: the file opened, not a renamed one
        if why:
            return Delivery(path, "skipped", why)
        data = text.replace("\n", "\r\n").encode("utf-8", "replace")[:MAX_MESSAGE]
        try:
            n = os.write(fd, data)
        except BlockingIOError:
            return Delivery(path, "failed", "the terminal's buffer is full; message dropped")
        except OSError as e:
            if e.errno in (errno.EIO, errno.ENXIO):
                return Delivery(path, "failed", "the terminal is hung up")
            return Delivery(path, "failed", os.strerror(e.errno or 0))
        return Delivery(
            path,
            "written" if n == len(data) else "partial",
            "" if n == len(data) else f"{n} of {len(data)} bytes fitted; the rest dropped",
        )
    finally:
        os.close(fd)


def warn_user(
    uid: int, text: str, respect_mesg: bool = True, utmp: str = UTMP, logind_bus: str | None = "SYSTEM"
) -> tuple[Delivery, ...]:
    """logind_bus: where to ask logind (None: never; utmp only)."""
    ttys = logind_ttys(uid, logind_bus) if logind_bus is not None else None
    if ttys is None:
        ttys = user_ttys(uid, utmp)
    written = tuple(write_tty(tty, uid, text, respect_mesg) for tty in ttys[:MAX_TTYS])
    if len(ttys) > MAX_TTYS:
        written += (
            Delivery(
                f"{len(ttys) - MAX_TTYS} more terminals",
                "skipped",
                f"at most {MAX_TTYS} terminals are written per warning",
            ),
        )
    return written
