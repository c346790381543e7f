"""The desktop end of the notification agent: org.freedesktop.Notifications on the session bus.

What it takes care of, so that the agent never crashes or loses a notification for the server's sake:
- a server that is absent (not started yet, or D-Bus-activatable and failing) is waited for: what is posted
  meanwhile stays queued (bounded; a newer text of the same notification replaces the queued one) and is
  shown once a server owns the name;
- a server that restarts forgets its notifications, so their ids are forgotten with the old owner and the
  next update of one opens it again instead of replacing an id the new server never gave;
- escaping, as the Desktop Notifications spec asks: the summary is plain text, the body may carry markup
  where the server says so (capability "body-markup"), so there <, > and & are escaped as &lt; &gt; &amp;;
  so they are too where the server's capabilities are unknown (GetCapabilities failed or did not answer):
  only a server that answered without "body-markup" gets the body as it is (a process named `<a href=...>`
  must not become a link because a server was slow); everywhere control characters are escaped with
  gpukill.text.shown (a process chooses its own name).

One agent per session: the connection owns AGENT_NAME, so an XDG autostart entry and the user unit started
together do not show everything twice.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import html
import os

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.constants import NameFlag, RequestNameReply

from gpukill.text import shown

from .events import Toast

SERVER = "org.freedesktop.Notifications"
SERVER_PATH = "/org/freedesktop/Notifications"
AGENT_NAME = "org.gpukill1.NotifyAgent"
APP_NAME = "gpukill"
DBUS = ("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus")
MAX_QUEUED = 100  # notifications kept while no server is there; the oldest go first
RETRY = 30.0  # seconds between tries while no server owns the name (one may be D-Bus activatable)
CALL_TIMEOUT = 10.0
# Errors that say no server is there (rather than that this notification was refused): wait and send it again.
UNAVAILABLE = (
    "org.freedesktop.DBus.Error.ServiceUnknown",
    "org.freedesktop.DBus.Error.NameHasNoOwner",
    "org.freedesktop.DBus.Error.NoReply",
    "org.freedesktop.DBus.Error.Disconnected",
    "org.freedesktop.DBus.Error.Spawn",
    "org.freedesktop.DBus.Error.TimedOut",
)
ICONS = {0: "dialog-information", 1: "dialog-information", 2: "dialog-warning"}


class SessionError(Exception):
    """No session bus, or another agent already runs in this session."""


def session_bus_address() -> str:
    """DBUS_SESSION_BUS_ADDRESS, else the user bus of a systemd user session ($XDG_RUNTIME_DIR/bus)."""
    address = os.environ.get("DBUS_SESSION_BUS_ADDRESS")
    if address:
        return address
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.exists(os.path.join(runtime, "bus")):
        return f"unix:path={os.path.join(runtime, 'bus')}"
    raise SessionError("no session bus: DBUS_SESSION_BUS_ADDRESS is not set and $XDG_RUNTIME_DIR/bus is absent")


def plain(text: str) -> str:
    """Text for the summary: one line, control characters escaped."""
    return shown(text)


def body_text(text: str, markup: bool) -> str:
    """Text for the body: each line's control characters escaped, and <, >, & where the server reads markup."""
    lines = "\n".join(shown(line) for line in text.split("\n"))
    return html.escape(lines, quote=False) if markup else lines


class Desktop:
    def __init__(self, address: str) -> None:
        self.address = address
        self.bus: MessageBus | None = None
        self.owner: str | None = None
        self.markup = True  # until a server says it reads no markup, the body is escaped as if it did
        self.caps_of: str | None = None  # the server whose capabilities `markup` reflects
        self.ids: dict[str, int] = {}  # key -> the id the current server gave its notification
        self.queue: collections.OrderedDict[object, Toast] = collections.OrderedDict()
        self.wake = asyncio.Event()
        self.owner_seen = asyncio.Event()
        self._serial = 0

    async def connect(self) -> None:
        try:
            self.bus = await MessageBus(bus_address=self.address).connect()
        except Exception as e:
            raise SessionError(f"cannot connect to the session bus: {e}") from None
        reply = await self.bus.request_name(AGENT_NAME, NameFlag.DO_NOT_QUEUE)
        if reply not in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
            raise SessionError("another notify agent already runs in this session")
        self.bus.add_message_handler(self._on_message)
        await self._bus_call(
            "AddMatch",
            "s",
            [
                f"type='signal',sender='{DBUS[0]}',path='{DBUS[1]}',"
                f"interface='{DBUS[2]}',member='NameOwnerChanged',arg0='{SERVER}'"
            ],
        )
        owner = await self._bus_call("GetNameOwner", "s", [SERVER])
        self._new_owner(owner[0] if owner else None)

    def close(self) -> None:
        if self.bus is not None:
            self.bus.disconnect()

    async def _bus_call(self, member: str, signature: str, body: list) -> list | None:
        assert self.bus is not None
        reply = await self.bus.call(
            Message(destination=DBUS[0], path=DBUS[1], interface=DBUS[2], member=member, signature=signature, body=body)
        )
        return None if reply is None or reply.message_type == MessageType.ERROR else reply.body

    def _on_message(self, msg: Message) -> None:
        if (
            msg.message_type is MessageType.SIGNAL
            and msg.sender == DBUS[0]
            and msg.member == "NameOwnerChanged"
            and msg.body
            and msg.body[0] == SERVER
        ):
            self._new_owner(msg.body[2] or None)

    def _new_owner(self, owner: str | None) -> None:
        if owner != self.owner:
            self.ids.clear()  # the new server never gave these ids
            self.owner = owner
        if owner:
            self.owner_seen.set()
            self.wake.set()

    # -- posting ----------------------------------------------------------------------------------------

    def post(self, toast: Toast) -> None:
        """Queue a notification; a queued one of the same key is replaced (only the newest text matters)."""
        self._serial += 1
        slot: object = toast.key or self._serial
        self.queue.pop(slot, None)
        self.queue[slot] = toast
        while len(self.queue) > MAX_QUEUED:
            self.queue.popitem(last=False)
        self.wake.set()

    async def run(self) -> None:
        """Send what is posted, in order, for ever; returns when the session bus is gone."""
        assert self.bus is not None
        gone = asyncio.ensure_future(self.bus.wait_for_disconnect())
        try:
            while not gone.done():
                if not self.queue:
                    self.wake.clear()
                    await _first(gone, self.wake.wait())
                    continue
                slot, toast = next(iter(self.queue.items()))
                owner = self.owner
                if await self._send(toast):
                    if self.queue.get(slot) is toast:
                        del self.queue[slot]
                    continue
                if self.owner and self.owner != owner:
                    continue  # a new server took the name while the call failed: try it at once
                # no server: wait for one to take the name (or try again later: it may be activatable)
                self.owner_seen.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_first(gone, self.owner_seen.wait()), RETRY)
        finally:
            gone.cancel()

    async def _send(self, toast: Toast) -> bool:
        """True when the notification is done with: shown, or refused by the server for itself (an error
        other than the server being absent: sending it again would be refused again)."""
        assert self.bus is not None
        if self.owner and self.caps_of != self.owner:
            await self._capabilities()
        replaces = self.ids.get(toast.key, 0) if toast.key else 0
        hints = {"urgency": Variant("y", toast.urgency), "category": Variant("s", "device")}
        msg = Message(
            destination=SERVER,
            path=SERVER_PATH,
            interface=SERVER,
            member="Notify",
            signature="susssasa{sv}i",
            body=[
                APP_NAME,
                replaces,
                ICONS.get(toast.urgency, ""),
                plain(toast.summary),
                body_text(toast.body, self.markup),
                [],
                hints,
                -1,
            ],
        )
        try:
            reply = await asyncio.wait_for(self.bus.call(msg), CALL_TIMEOUT)
        except (TimeoutError, OSError, EOFError):
            return False
        except Exception:  # the bus closed under the call
            return False
        if reply is None:
            return False
        if reply.message_type == MessageType.ERROR:
            return not (reply.error_name or "").startswith(UNAVAILABLE)  # an error always has its name
        if toast.key:
            self.ids[toast.key] = reply.body[0]
        return True

    async def _capabilities(self) -> None:
        """Whether the current server reads body markup: no only when it answers GetCapabilities without
        "body-markup"; an error, a timeout or an odd reply leaves it yes (escaped text is always safe). Asked
        once per server, whatever the answer, so that a server that never answers costs one timeout, not one
        per notification."""
        assert self.bus is not None
        owner = self.owner
        self.markup = True
        msg = Message(destination=SERVER, path=SERVER_PATH, interface=SERVER, member="GetCapabilities")
        with contextlib.suppress(Exception):
            reply = await asyncio.wait_for(self.bus.call(msg), CALL_TIMEOUT)
            if reply is not None and reply.message_type == MessageType.METHOD_RETURN and reply.signature == "as":
                self.markup = "body-markup" in reply.body[0]
        self.caps_of = owner


async def _first(*awaitables) -> None:
    """Wait until the first of these is done (a future passed in is left running, a coroutine is cancelled)."""
    tasks = [a if isinstance(a, asyncio.Future) else asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t, a in zip(tasks, awaitables, strict=True):
            if t is not a:
                t.cancel()
