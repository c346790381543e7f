"""`gpukillctl monitor [--json] [--count N]`: gpukilld's signals as they happen, one line each, until
interrupted.

The lines come from the client library's events() (only gpukilld's own signals; a restart is followed). Human
lines escape everything a process chose (names, subjects, notices); `--json` lines keep the exact text. Each
line is flushed as it is written. Ctrl-C (or SIGTERM) ends it quietly with status 0, and so does the reader of
a pipe going away (`gpukillctl monitor | head -1` ends when head does, not at the next signal).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import stat
import sys
import time
from typing import Any

from gpukill.records.base import to_plain
from gpukill.records.signals import (
    NO_UID,
    SIGNAL_OF,
    DeviceReset,
    DeviceStateChanged,
    GuardActionTaken,
    Notification,
    PolicyViolated,
    ProcessKilled,
    ProcessResumed,
    ProcessSuspended,
    ReclaimPending,
    SnapshotChanged,
)
from gpukill.text import shown
from gpukill.units import format_duration

from ..client.dbus import GpukillClient
from ..client.exits import EXIT_OK, EXIT_UNAVAILABLE

MONITOR_FORMAT = 1  # the "format" of every JSON line: a key that changes meaning comes with a new number
ENVELOPE_KEYS = ("format", "time", "interface", "signal")  # before the signal's own arguments


def register(sub: argparse._SubParsersAction) -> None:
    monitor = sub.add_parser("monitor", help="print gpukilld's signals as they happen, until interrupted")
    monitor.add_argument("--json", action="store_true", help="one JSON object per line (stable keys, format 1)")
    monitor.add_argument("--count", type=_count, metavar="N", help="stop after N signals")


def _count(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of signals: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--count must be at least 1, not {value}")
    return value


# -- the lines ---------------------------------------------------------------------------------------------


def json_line(record: Any, received: float) -> str:
    """The envelope, then the signal's arguments by their names in the interface XML (details nested)."""
    interface, member = SIGNAL_OF[type(record)]
    envelope = dict(zip(ENVELOPE_KEYS, (MONITOR_FORMAT, round(received, 3), interface, member), strict=True))
    return json.dumps({**envelope, **to_plain(record)})


def human_line(record: Any, received: float) -> str:
    """When, which signal, and what it says, on one line with everything from the daemon escaped."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(received))
    return shown(f"{stamp} {SIGNAL_OF[type(record)][1]} {describe(record)}")


def _dry(dry_run: bool) -> str:
    return " (dry run)" if dry_run else ""


def reclaim_text(reclaim: Any) -> str:
    from gpukill.outcome import reclaim_text as words  # here: only a kill's line needs it

    return words(reclaim)


def describe(record: Any) -> str:
    """The essential fields of a signal, in words."""
    match record:
        case ProcessKilled():
            on = ", ".join(record.devices) or "no GPU"
            by = f"user uid {record.caller_uid}" if record.initiator == "user" else record.initiator
            answer = "" if record.reclaim.verdict == "unwatched" else f"; {reclaim_text(record.reclaim)}"
            return f"PID {record.pid} ({record.comm}, uid {record.uid}) on {on}: {record.outcome}{answer}; by {by}"
        case DeviceReset():
            result = "reset" if record.success else "reset failed"
            killed = f"; killed first: {', '.join(map(str, record.killed))}" if record.killed else ""
            return f"GPU {record.index} ({record.id}) {result}: {record.message}{killed}"
        case ProcessSuspended() | ProcessResumed():
            p = record.process
            act = "suspended" if isinstance(record, ProcessSuspended) else "resumed"
            state = "" if p.state in ("suspended", "running") else f": {p.state} ({p.error}); {p.remedy}"
            on = ",".join(map(str, p.devices)) or "no GPU"
            return f"PID {p.pid} ({p.comm}, uid {p.uid}) on GPU {on} {act}{state}; by uid {record.caller_uid}"
        case DeviceStateChanged():
            return f"GPU {record.index} ({record.id}) is {record.state}" + (
                f": {record.reason}" if record.reason else ""
            )
        case PolicyViolated():
            d = record.details
            grace = f"; grace {format_duration(d.grace)}" if d.grace else ""
            return f"rule {record.rule}: {record.subject}: {record.action}{_dry(record.dry_run)}: {d.reason}{grace}"
        case GuardActionTaken():
            pid = f" PID {record.pid}" if record.pid else ""
            return f"rule {record.rule}: {record.subject}: {record.action}{pid}: {record.outcome}{_dry(record.dry_run)}"
        case Notification():
            to = "no one user" if record.uid == NO_UID else f"uid {record.uid}"
            return f"rule {record.rule} to {to}: {record.summary}"  # the body is in --json
        case ReclaimPending():
            until = time.strftime("%H:%M:%S", time.localtime(record.deadline))
            unit = f", {record.unit}" if record.unit else ""
            return f"rule {record.rule}: PID {record.pid} (uid {record.uid}{unit}) is stopped at {until}"
    raise TypeError(f"not a signal record: {type(record).__name__}")


# -- the command -------------------------------------------------------------------------------------------


async def cmd_monitor(client: GpukillClient, args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    ended_quietly: list[str] = []  # why we stopped on purpose: a signal, or the reader of stdout went away

    def stop(why: str) -> None:
        if not ended_quietly:
            ended_quietly.append(why)
            task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop, signal.Signals(signum).name)
    watching_stdout = _watch_reader(loop, lambda: stop("stdout closed"))
    waiting_said: list[bool] = []

    def waiting() -> None:  # once: a daemon restarting now and then is no news each time
        if not waiting_said:
            waiting_said.append(True)
            print("gpukillctl: gpukilld is not running; waiting for it", file=sys.stderr, flush=True)

    try:
        written = 0
        async with contextlib.aclosing(client.events(on_absent=waiting)) as events:
            async for record in events:
                if isinstance(record, SnapshotChanged):
                    continue  # "list again", up to once a sample on a busy host: for observers, not for people
                received = time.time()
                line = json_line(record, received) if args.json else human_line(record, received)
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
                written += 1
                if args.count is not None and written >= args.count:
                    return EXIT_OK
        print("gpukillctl: the system bus connection closed", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except asyncio.CancelledError:
        if not ended_quietly:
            raise
        return EXIT_OK
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_OK
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        if watching_stdout:
            loop.remove_reader(sys.stdout.fileno())
        if ended_quietly == ["stdout closed"]:
            _discard_stdout()


def _watch_reader(loop: asyncio.AbstractEventLoop, gone: Any) -> bool:
    """Call gone() once the reader of stdout, a pipe, goes away. The kernel reports that as an error on our end
    at once (EPOLLERR), so `monitor | head -1` ends when head does rather than at the next signal's write. A
    terminal or a file has no such reader; a socket is left alone too, as its peer may close its own sending
    side and still read (that would look the same): those end at the next write (BrokenPipeError)."""
    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False

        def reader_gone() -> None:
            loop.remove_reader(fd)  # the error stays: it would wake us again and again
            gone()

        loop.add_reader(fd, reader_gone)  # our end never becomes readable: only the error wakes this
    except (OSError, ValueError):
        return False
    return True


def _discard_stdout() -> None:
    """Nothing more can be written: point stdout at /dev/null, so that the flush at exit does not fail again
    and print a traceback of its own."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
