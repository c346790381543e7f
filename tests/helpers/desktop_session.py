"""A user's desktop session for the notification agent's tests: a private session bus run as that user, and a
real notification server on it, python-dbusmock's `notification_daemon` template, which records every Notify.

dbusmock runs with Debian's python3 and its python3-dbusmock (which brings python3-dbus and python3-gi):
dbus-python does not build in a venv without libdbus and glib headers, while the Debian packages install
cleanly on bookworm (`make deps` installs python3-dbusmock). The tests read the server's calls through
dbusmock's own GetCalls method, with dbus-fast, as root.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from .testbed import PYTHON, SYSTEM_PYTHON, Testbed, User, _kill_group
from .waiting import wait_until

SERVER = "org.freedesktop.Notifications"
SERVER_PATH = "/org/freedesktop/Notifications"
MOCK_IFACE = "org.freedesktop.DBus.Mock"

SESSION_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <!-- a session bus as the user's, which root (the test) may also connect to, to read the server's calls -->
  <policy context="default">
    <allow user="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


def dbusmock_missing() -> str | None:
    """Why the notification server cannot run here, or None."""
    r = subprocess.run([SYSTEM_PYTHON, "-c", "import dbusmock.templates.notification_daemon"], capture_output=True)
    return None if r.returncode == 0 else "python3-dbusmock (Debian) is missing: `make deps` installs it"


@dataclass(frozen=True)
class Notify:
    """One Notify call the server received."""

    replaces_id: int
    icon: str
    summary: str
    body: str
    urgency: int


class DesktopSession:
    def __init__(self, bed: Testbed, user: User) -> None:
        self.bed = bed
        self.user = user
        self.dir = bed.workdir / f"session-{user.name}"
        self.dir.mkdir(exist_ok=True)
        os.chown(self.dir, user.uid, user.gid)
        self.address = f"unix:path={self.dir / 'bus'}"
        self.server: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return self.bed.env(DBUS_SESSION_BUS_ADDRESS=self.address)

    def start_bus(self) -> None:
        conf = self.dir / "session.conf"
        conf.write_text(SESSION_CONFIG.format(socket=self.dir / "bus"))
        self.bed._spawn(
            ["dbus-daemon", f"--config-file={conf}", "--nofork", "--nopidfile"],
            "session-bus.log",
            cwd="/",
            **self.user.popen_kwargs(),
        )
        wait_until(lambda: (self.dir / "bus").exists(), 10, "the session bus did not create its socket")

    def start_server(self) -> None:
        """The notification server, as the session's user; returns once it owns its name."""
        self.server = self.bed._spawn(
            [SYSTEM_PYTHON, "-m", "dbusmock", "--template", "notification_daemon"],
            "notification-server.log",
            env=self.env(),
            cwd="/",
            **self.user.popen_kwargs(),
        )
        wait_until(lambda: self.has_owner(SERVER), 15, "the notification server did not take its name")

    def stop_server(self) -> None:
        if self.server is not None:
            _kill_group(self.server)
            self.bed.procs.remove(self.server)
            self.server = None
        wait_until(lambda: not self.has_owner(SERVER), 10, "the notification server still owns its name")

    def start_agent(self, *args: str) -> subprocess.Popen:
        """`gpukillctl notify-agent ARGS` as the session's user, its stderr in notify-agent.log."""
        return self.bed._spawn(
            [PYTHON, "-m", "gpukillctl", "notify-agent", *args],
            "notify-agent.log",
            env=self.env(),
            cwd="/",
            **self.user.popen_kwargs(),
        )

    def agent_log(self) -> str:
        path: Path = self.bed.workdir / "notify-agent.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- reading the session bus ---------------------------------------------------------------------

    def _call(self, dest: str, path: str, iface: str, member: str, signature: str = "", body: list | None = None):
        async def call():
            bus = await MessageBus(bus_address=self.address).connect()
            try:
                reply = await asyncio.wait_for(
                    bus.call(
                        Message(
                            destination=dest,
                            path=path,
                            interface=iface,
                            member=member,
                            signature=signature,
                            body=body or [],
                        )
                    ),
                    10,
                )
            finally:
                bus.disconnect()
            if reply.message_type == MessageType.ERROR:
                raise RuntimeError(f"{member}: {reply.error_name} {reply.body}")
            return reply.body

        return asyncio.run(call())

    def has_owner(self, name: str) -> bool:
        return bool(
            self._call(
                "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "NameHasOwner", "s", [name]
            )[0]
        )

    def notifications(self) -> list[Notify]:
        """Every Notify the running server received, in order."""
        (calls,) = self._call(SERVER, SERVER_PATH, MOCK_IFACE, "GetCalls")
        out = []
        for _, method, args in calls:
            if method != "Notify":
                continue
            _app, replaces, icon, summary, body, _actions, hints, _timeout = (a.value for a in args)
            urgency = hints.get("urgency")
            out.append(Notify(replaces, icon, summary, body, urgency.value if urgency is not None else -1))
        return out
