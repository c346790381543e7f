"""The gpukill client library on asyncio: org.gpukill1 over the system bus with dbus-fast, typed records out.

Every front end (the CLI; a desktop agent, MCP, REST, an exporter) uses the typed API of
gpukillctl/client/api.py (ClientAPI), written once; none of them touches a vendor library or /sys, so polkit
decides for every one of them. This module is its asyncio transport, for the long-lived front ends, and
gpukilld's signals as records (`events()`); one-shot commands use gpukillctl/client/blocking.py instead.
The errors, records and constants of api.py are re-exported here, where callers have always found them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.constants import MessageFlag

from gpukill.records.signals import Event, SnapshotChanged, signal_record

from . import remote
from .api import (  # noqa: F401 (re-exported: the client library's names, where callers import them)
    BUS_NAME,
    CALL_TIMEOUT,
    DBUS,
    DEVICE_KEYS,
    ERRORS,
    GUARD_INTERFACE,
    INTERFACE,
    NOT_RUNNING,
    OBJECT_PATH,
    PAGE_SIZE,
    PROCESS_KEYS,
    TIMEOUT,
    ClientAPI,
    ClientError,
    DaemonStatus,
    DaemonUnavailable,
    Var,
    error_for,
)

MAX_QUEUED_EVENTS = 10_000  # signals kept for a consumer slower than gpukilld; the oldest go first
# An observer that lists on SnapshotChanged waits a random part of at most this fraction of SampleInterval
# first (as systemd's RandomizedDelaySec spreads timers). Every listener hears the signal in the same
# millisecond: without it, 32 observers queue 32 listings behind one another (p99 ~27 ms on 2 CPUs). A quarter
# keeps what the delay adds to a listing's age well under the interval it may be old anyway, and ends the
# spread long before the next sample can change the listing again (bench/README.md, list_latency).
SPREAD_FRACTION = 0.25


def spread_delay(interval: float, rand: Callable[[], float] = random.random) -> float:
    """A delay drawn anew, evenly from [0, SPREAD_FRACTION * interval): a client's wait after SnapshotChanged."""
    return max(interval, 0.0) * SPREAD_FRACTION * rand()


class SnapshotChange(NamedTuple):
    generation: int  # the last SnapshotChanged's (changes heard during the delay are folded into one)
    heard_at: float  # time.monotonic() when the first of them arrived: the listing is this much older


def unwrap(value: Any) -> Any:
    """Variants (dbus-fast's, or api.py's Var), a{sv} and arrays of them as plain dicts and lists."""
    if isinstance(value, Variant | Var):
        return unwrap(value.value)
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap(v) for v in value]
    return value


def wrap(value: Any) -> Any:
    """A call's arguments for dbus-fast: each Var as a Variant (structs as lists, as dbus-fast writes them)."""
    if isinstance(value, Var):
        return Variant(value.signature, wrap(value.value))
    if isinstance(value, dict):
        return {k: wrap(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [wrap(v) for v in value]
    return value


class GpukillClient(ClientAPI):
    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self._disconnected: asyncio.Future | None = None  # one watch on the connection's end, shared by events()

    @classmethod
    async def connect(cls, host: str | None = None) -> GpukillClient:
        """The system bus here, or that of `host` ([user@]host[:port]) over ssh (gpukillctl/client/remote.py)."""
        if host:
            try:
                return cls(await remote.connect(host))
            except remote.RemoteError as e:
                raise DaemonUnavailable("", str(e)) from None  # the caller knows which host it asked for
        try:
            bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        except Exception as e:
            raise DaemonUnavailable("", f"cannot connect to the system bus: {e}") from None
        return cls(bus)

    @property
    def unique_name(self) -> str:
        return self.bus.unique_name or ""  # None only before the connection's Hello, which connect() awaits

    def close(self) -> None:
        self.bus.disconnect()

    async def _call(
        self,
        member: str,
        signature: str = "",
        body: list | None = None,
        *,
        interface: str = INTERFACE,
        interactive: bool = False,
        timeout: float = CALL_TIMEOUT,
    ) -> list:
        msg = Message(
            destination=BUS_NAME,
            path=OBJECT_PATH,
            interface=interface,
            member=member,
            signature=signature,
            body=wrap(body or []),
            flags=MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION if interactive else MessageFlag.NONE,
        )
        reply = await self._send(msg, timeout, "gpukilld")
        if reply.message_type == MessageType.ERROR:
            name = reply.error_name or ""
            text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else name
            raise error_for(name, text)
        return unwrap(reply.body)

    # -- signals -----------------------------------------------------------------------------------------

    async def events(
        self, max_queued: int = MAX_QUEUED_EVENTS, *, on_absent: Callable[[], None] | None = None
    ) -> AsyncGenerator[Event, None]:
        """Every signal gpukilld sends from now on, as its record of gpukill/records/, in order; the iteration
        ends when the bus connection closes. While gpukilld is not running the iteration waits for it, and a
        restart is followed: the new daemon's signals keep coming.

        Only gpukilld's own signals count. On the system bus any connection may emit a signal with our path,
        interface and member, so each one is checked against the connection that owns org.gpukill1 now
        (GetNameOwner, then NameOwnerChanged); a forged one is dropped, even when another match rule of this
        connection lets it in. A consumer slower than the signals loses the oldest beyond max_queued, so
        neither this process's memory nor the daemon's (the bus queues what we do not read) is at stake.

        on_absent() is called when gpukilld is found not running, once subscribed (so whatever it brings next
        is heard): at the start, and each time it goes away."""
        if max_queued < 1:
            raise ValueError(f"max_queued must be at least 1, not {max_queued}")
        queue: collections.deque[Event] = collections.deque(maxlen=max_queued)
        arrived = asyncio.Event()
        owner: list[str | None] = [None]
        owner_heard = [False]  # a NameOwnerChanged came: newer than any GetNameOwner answer still on its way

        def on_message(msg: Message) -> None:
            if msg.message_type is not MessageType.SIGNAL:
                return
            if (msg.sender, msg.path, msg.interface, msg.member) == (*DBUS, "NameOwnerChanged"):
                if msg.signature == "sss" and msg.body[0] == BUS_NAME:
                    owner[0] = msg.body[2] or None
                    owner_heard[0] = True
                    if owner[0] is None and on_absent is not None:
                        on_absent()
                return
            if owner[0] is None or msg.sender != owner[0] or msg.path != OBJECT_PATH:
                return
            record = signal_record(msg.interface or "", msg.member or "", unwrap(msg.body))
            if record is not None:
                queue.append(record)
                arrived.set()

        # The daemon's own signals, and the name's changes of owner; the rules are in place before the owner is
        # asked for, so no change between the two is missed.
        rules = [
            f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}'",
            f"type='signal',sender='{DBUS[0]}',path='{DBUS[1]}',interface='{DBUS[2]}',"
            f"member='NameOwnerChanged',arg0='{BUS_NAME}'",
        ]
        self.bus.add_message_handler(on_message)
        if self._disconnected is None:
            self._disconnected = asyncio.ensure_future(self.bus.wait_for_disconnect())
            self._disconnected.add_done_callback(lambda t: t.cancelled() or t.exception())  # it ended: enough
        # Shielded: cancelling a task that waits on dbus-fast's one disconnect future cancels that future, and
        # every later events() on this connection (snapshot_changes() after another) would end at once.
        gone = asyncio.shield(self._disconnected)
        try:
            for rule in rules:
                await self._bus_call("AddMatch", rule)
            current = await self._name_owner()
            if not owner_heard[0]:  # else the answer is older than what the handler already heard
                owner[0] = current
                if current is None and on_absent is not None:
                    on_absent()
            while True:
                while queue:
                    yield queue.popleft()
                arrived.clear()
                waiter = asyncio.ensure_future(arrived.wait())
                await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if gone.done() and not queue:
                    return
        finally:
            if gone.done() and not gone.cancelled():
                gone.exception()  # how the connection ended does not matter here: it ended
            gone.cancel()
            self.bus.remove_message_handler(on_message)
            if self.bus.connected:
                for rule in rules:
                    with contextlib.suppress(ClientError):
                        await self._bus_call("RemoveMatch", rule)

    async def snapshot_changes(self, interval: float | None = None) -> AsyncIterator[SnapshotChange]:
        """Each time gpukilld's listings change: SnapshotChanged, then a delay of spread_delay(interval) (the
        daemon's SampleInterval unless given), so that observers do not all list in the same millisecond.
        Changes heard during the delay are folded into one. The iteration ends as events() does."""
        if interval is None:
            interval = (await self.status()).sample_interval
        heard = asyncio.Event()
        latest: list[SnapshotChange | None] = [None]

        async def listen() -> None:
            async for event in self.events():
                if isinstance(event, SnapshotChanged):
                    first = latest[0].heard_at if latest[0] is not None else time.monotonic()
                    latest[0] = SnapshotChange(event.generation, first)
                    heard.set()

        listener = asyncio.ensure_future(listen())
        try:
            while True:
                waiter = asyncio.ensure_future(heard.wait())
                await asyncio.wait({waiter, listener}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if not heard.is_set():
                    listener.result()  # the connection closed (or the listener failed: raised here)
                    return
                await asyncio.sleep(spread_delay(interval))
                change, latest[0] = latest[0], None
                heard.clear()
                assert change is not None
                yield change
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await listener

    async def _send(self, msg: Message, timeout: float, who: str) -> Message:
        """The reply to msg (an error reply included); a ClientError when `who` does not answer within timeout,
        DaemonUnavailable when the bus connection is lost."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the reply when it arrives in the same
            # turn of the loop as a cancel (Ctrl-C of --watch), and the cancel is lost; timeout() keeps it.
            async with asyncio.timeout(timeout):
                return await self.bus.call(msg)
        except TimeoutError:
            raise ClientError(TIMEOUT, f"{who} did not answer within {timeout:g}s") from None
        except Exception as e:
            raise DaemonUnavailable("", f"lost the system bus: {e}") from None

    async def _bus_call(self, member: str, arg: str) -> list:
        """A call of the bus itself (org.freedesktop.DBus) with one string argument."""
        msg = Message(destination=DBUS[0], path=DBUS[1], interface=DBUS[2], member=member, signature="s", body=[arg])
        reply = await self._send(msg, CALL_TIMEOUT, f"the system bus ({member})")
        if reply.message_type == MessageType.ERROR:
            raise ClientError(reply.error_name or "", f"{member} failed on the system bus")
        return reply.body

    async def _name_owner(self) -> str | None:
        """The unique name of the connection that owns org.gpukill1, or None while gpukilld is not running."""
        try:
            return (await self._bus_call("GetNameOwner", BUS_NAME))[0]
        except DaemonUnavailable:
            raise
        except ClientError as e:
            if e.name == "org.freedesktop.DBus.Error.NameHasNoOwner":
                return None
            raise


# How a server (MCP, REST) reaches gpukilld: a fresh connection per request, as the user who runs it.
Connect = Callable[[], Awaitable[GpukillClient]]
T = TypeVar("T")


async def using(connect: Connect, act: Callable[[GpukillClient], Awaitable[T]]) -> T:
    """act(client) on a connection of its own, closed after: a daemon restart between requests costs nothing."""
    client = await connect()
    try:
        return await act(client)
    finally:
        client.close()
