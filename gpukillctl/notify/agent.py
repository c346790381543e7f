"""gpukillctl notify-agent: gpukilld's signals as desktop notifications, for the user of this session.

Runs in the user's session (the user unit gpukill-notify.service, or the XDG autostart entry where there is no
systemd user session) until the session ends. Three parts, each in its module: the system bus side follows
gpukilld through GpukillClient.events() (a restart or D-Bus activation of gpukilld is followed there; the
system bus itself going away is followed here, by connecting again); events.Narrator decides what
concerns the user and words it; gate.Gate turns bursts into summaries; desktop.Desktop shows the result
through org.freedesktop.Notifications and waits for a server that is absent or restarting.

Nothing here is privileged: every signal is broadcast on the system bus. `--all` (everyone's events) is
limited to the admin group as a matter of courtesy, as `list` shows other users' processes only to admins.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import grp
import os
import signal
import sys
import time

from ..client.dbus import ClientError, GpukillClient
from ..client.exits import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from .desktop import Desktop, SessionError, session_bus_address
from .events import Audience, Narrator
from .gate import Gate

PROG = "gpukillctl notify-agent"
ADMIN_GROUP = "gpukill"  # the group polkit/49-gpukill-admins.rules makes administrators
RECONNECT_FIRST, RECONNECT_MAX = 1.0, 30.0  # seconds between tries to reach the system bus again


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "notify-agent",
        help="show gpukilld's events about your GPU processes as desktop notifications",
        description="Run in a desktop session (the user unit gpukill-notify.service or the XDG autostart entry "
        "gpukill-notify.desktop start it): follows gpukilld on the system bus and shows the kills of "
        "your GPU processes, Guard warnings with the time left, and Guard notices for you through "
        "org.freedesktop.Notifications. Bursts become one summary. Runs until the session ends; "
        "gpukilld or the notification server restarting is followed. See gpukillctl(1).",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="show every user's events and device events too (members of the admin group only)",
    )
    p.add_argument(
        "--admin-group",
        metavar="GROUP",
        default=ADMIN_GROUP,
        help=f"the group whose members may use --all (default: {ADMIN_GROUP})",
    )
    p.set_defaults(offline=cmd_notify_agent)


def in_group(name: str) -> bool:
    try:
        group = grp.getgrnam(name)
    except KeyError:
        return False
    return os.getuid() == 0 or group.gr_gid in os.getgroups() or group.gr_gid == os.getgid()


def say(message: str) -> None:
    """One line for the journal (the user unit's stderr) or the terminal."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def cmd_notify_agent(args: argparse.Namespace) -> int:
    if args.all and not in_group(args.admin_group):
        say(f"--all is for members of the group {args.admin_group!r}")
        return EXIT_USAGE
    try:
        return asyncio.run(Agent(Audience(os.getuid(), args.all)).run())
    except SessionError as e:
        say(str(e))
        return EXIT_UNAVAILABLE


class Agent:
    def __init__(self, audience: Audience) -> None:
        self.narrator = Narrator(audience)
        self.gate = Gate()
        self.events: asyncio.Queue = asyncio.Queue()

    async def run(self) -> int:
        desktop = Desktop(session_bus_address())
        await desktop.connect()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, stop.set)
        tasks = [
            asyncio.ensure_future(c) for c in (self.follow_system(), self.narrate(desktop), desktop.run(), stop.wait())
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[2] in done:
                say("the session bus is gone: the session ended")
            for t in done:
                if not t.cancelled() and (error := t.exception()) is not None:
                    raise error
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)
            desktop.close()
        return EXIT_OK

    async def follow_system(self) -> None:
        """gpukilld's signals into self.events, for ever: when the system bus goes, connect again."""
        wait = RECONNECT_FIRST
        reported = False
        while True:
            try:
                client = await GpukillClient.connect()
            except ClientError as e:
                if not reported:
                    say(f"{e}; trying again")
                    reported = True
                await asyncio.sleep(wait)
                wait = min(wait * 2, RECONNECT_MAX)
                continue
            if reported:
                say("connected to the system bus")
            reported, wait = False, RECONNECT_FIRST
            try:
                async for event in client.events():
                    self.events.put_nowait(event)
            except ClientError as e:
                say(f"{e}; connecting again")
            finally:
                client.close()
            say("lost the system bus; connecting again")
            reported = True
            await asyncio.sleep(RECONNECT_FIRST)

    async def narrate(self, desktop: Desktop) -> None:
        """Events and time in, notifications out, through the gate."""
        while True:
            now = time.monotonic()
            due = [t for t in (self.narrator.next_due(), self.gate.due()) if t is not None]
            timeout = max(0.0, min(due) - now) if due else None
            toasts = []
            try:
                event = await asyncio.wait_for(self.events.get(), timeout)
                toasts = self.narrator.on_event(event, time.monotonic(), time.time())
            except TimeoutError:
                pass
            now = time.monotonic()
            toasts += self.narrator.tick(now)
            for toast in toasts:
                for shown in self.gate.admit(toast, now):
                    desktop.post(shown)
            for shown in self.gate.flush(now):
                desktop.post(shown)
