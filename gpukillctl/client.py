"""The gpukill client library: org.gpukill1 over the system bus, typed records out.

Every front end (the CLI; a desktop agent, MCP, REST, an exporter) uses this module alone; none of them
touches a vendor library or /sys, so polkit decides for every one of them. Methods return the records of
gpukill/records.py (Device, Process, ResetReply, Finding, GuardStatus, Decision, PolicyLoaded), built from the daemon's
a{sv} by their one declaration: a value the daemon left out is the field's default (None where it could not
be read), keys a newer daemon adds are ignored. Kills return a gpukill.outcome.Outcome.

Failures raise a ClientError. One from the daemon is of the class made here for its D-Bus error name, which is
also the shared error class of gpukill.errors that names it: `except errors.NoSuchProcess` catches what the
daemon reported as org.gpukill1.Error.NoSuchProcess. DaemonUnavailable: no bus, or no gpukilld on it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.constants import MessageFlag

from gpukill import errors
from gpukill.outcome import Outcome
from gpukill.records import (
    BackendStatus,
    Decision,
    Device,
    Event,
    Finding,
    GuardStatus,
    PolicyLoaded,
    Process,
    ResetReply,
    from_plain,
    names,
    signal_record,
)

from . import remote

BUS_NAME = "org.gpukill1"
OBJECT_PATH = "/org/gpukill1"
INTERFACE = "org.gpukill1.Manager"
GUARD_INTERFACE = "org.gpukill1.Guard"
CALL_TIMEOUT = 25.0
PAGE_SIZE = 500  # records per ListProcesses page: well inside one reply (the daemon allows up to 1000)
MAX_QUEUED_EVENTS = 10_000  # signals kept for a consumer slower than gpukilld; the oldest go first
DBUS = ("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus")

# The keys of `list --json`, in their order.
DEVICE_KEYS = names(Device)
PROCESS_KEYS = names(Process)


class ClientError(Exception):
    """A failure with the D-Bus error name that caused it ("" when not from the daemon)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class DaemonUnavailable(ClientError):
    """No system bus, or gpukilld is not on it."""


def _daemon_error(shared: type[errors.GpukillError]) -> type[ClientError]:
    return type(shared.__name__, (ClientError, shared), {"__module__": __name__, "__doc__": shared.__doc__})


# One class per error the daemon sends, each named by its shared class's dbus_name.
ERRORS: dict[str, type[ClientError]] = {
    cls.dbus_name: _daemon_error(cls) for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.GpukillError)
}
# What the bus itself answers: polkit wanting a password where none may be asked is a denial.
ERRORS["org.freedesktop.DBus.Error.InteractiveAuthorizationRequired"] = ERRORS[errors.AccessDenied.dbus_name]
NOT_RUNNING = ("org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner")


def error_for(name: str, message: str) -> ClientError:
    """The exception for a D-Bus error reply."""
    if name in NOT_RUNNING:
        return DaemonUnavailable(name, "gpukilld is not running (org.gpukill1 is not on the system bus)")
    return ERRORS.get(name, ClientError)(name, message)


@dataclass(frozen=True, slots=True)
class DaemonStatus:
    """The Manager's properties: Version, SampleInterval, Backends."""

    version: str
    sample_interval: float  # seconds between samples: listings are at most this old
    backends: tuple[BackendStatus, ...]


def unwrap(value: Any) -> Any:
    """Variants, a{sv} and arrays of them as plain dicts and lists."""
    if isinstance(value, Variant):
        return unwrap(value.value)
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap(v) for v in value]
    return value


def _record(cls: type, raw: dict[str, Variant]) -> Any:
    return from_plain(cls, unwrap(raw))


class GpukillClient:
    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus

    @classmethod
    async def connect(cls, host: str | None = None) -> GpukillClient:
        """The system bus here, or that of `host` ([user@]host[:port]) over ssh (gpukillctl/remote.py)."""
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
        return self.bus.unique_name

    def close(self) -> None:
        self.bus.disconnect()

    async def _call(self, member: str, signature: str = "", body: list | None = None, *,
                    interface: str = INTERFACE, interactive: bool = False, timeout: float = CALL_TIMEOUT) -> list:
        msg = Message(destination=BUS_NAME, path=OBJECT_PATH, interface=interface, member=member,
                      signature=signature, body=body or [],
                      flags=MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION if interactive else MessageFlag.NONE)
        reply = await self._send(msg, timeout, "gpukilld")
        if reply.message_type == MessageType.ERROR:
            text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else reply.error_name
            raise error_for(reply.error_name, text)
        return reply.body

    async def list_devices(self) -> list[Device]:
        (devices,) = await self._call("ListDevices")
        return [_record(Device, d) for d in devices]

    async def list_processes(self, filter: dict[str, Variant] | None = None) -> list[Process]:
        """Every process the daemon shows us; page by page when the whole listing is too large for one reply."""
        try:
            (procs,) = await self._call("ListProcesses", "a{sv}", [filter or {}])
        except errors.ReplyTooLarge:
            procs = await self._pages(filter or {})
        return [_record(Process, p) for p in procs]

    async def _pages(self, filter: dict[str, Variant]) -> list[dict[str, Variant]]:
        """Keyset pages in (device, pid) order: a process that comes or goes between pages shifts nothing."""
        procs: list[dict[str, Variant]] = []
        page_filter = {**filter, "limit": Variant("u", PAGE_SIZE)}
        while True:
            (page,) = await self._call("ListProcesses", "a{sv}", [page_filter])
            procs.extend(page)
            if len(page) < PAGE_SIZE:
                return procs
            last = page[-1]
            page_filter["after"] = Variant("(uu)", [last["device"].value, last["pid"].value])

    async def kill(self, pid: int, start_time: int, *, force: bool = False, grace: float | None = None,
                   interactive: bool = False) -> Outcome:
        options: dict[str, Variant] = {"force": Variant("b", force)}
        if grace is not None:
            options["grace"] = Variant("d", float(grace))
        # The daemon may wait the whole grace, then SIGKILL's wait, plus a password prompt.
        timeout = (grace if grace is not None else 5.0) + 30.0 + (300.0 if interactive else 0.0)
        (outcome,) = await self._call("KillProcess", "uta{sv}", [pid, start_time, options],
                                      interactive=interactive, timeout=timeout)
        try:
            return Outcome(outcome)
        except ValueError:
            raise ClientError("", f"gpukilld answered an unknown outcome: {outcome!r}") from None

    async def reset(self, device: str, *, force: bool = False, interactive: bool = False) -> ResetReply:
        (result,) = await self._call("ResetDevice", "sa{sv}", [device, {"force": Variant("b", force)}],
                                     interactive=interactive, timeout=600.0 if interactive else 300.0)
        return _record(ResetReply, result)

    async def audit_rogue(self) -> list[Finding]:
        """The rogue-activity audit of the current snapshot (miners, abusers, idle holders), highest score
        first, filtered as ListProcesses filters: evidence the caller may not see is left out."""
        (findings,) = await self._call("AuditRogue")
        return [_record(Finding, f) for f in findings]

    async def status(self) -> DaemonStatus:
        (props,) = await self._call("GetAll", "s", [INTERFACE], interface="org.freedesktop.DBus.Properties")
        return DaemonStatus(
            version=props["Version"].value,
            sample_interval=props["SampleInterval"].value,
            backends=tuple(BackendStatus(n, bool(a), d) for n, a, d in props["Backends"].value),
        )

    # -- Guard Mode (org.gpukill1.Guard) ---------------------------------------------------------------

    async def _guard(self, member: str, signature: str = "", body: list | None = None, *,
                     interactive: bool = False, timeout: float = CALL_TIMEOUT) -> list:
        return await self._call(member, signature, body, interface=GUARD_INTERFACE, interactive=interactive,
                                timeout=timeout + (300.0 if interactive else 0.0))

    async def guard_status(self) -> GuardStatus:
        (status,) = await self._guard("GetStatus")
        return _record(GuardStatus, status)

    async def guard_enable(self, enabled: bool = True, *, interactive: bool = False) -> None:
        await self._guard("Enable" if enabled else "Disable", interactive=interactive)

    async def guard_set_dry_run(self, dry_run: bool, *, interactive: bool = False) -> None:
        await self._guard("SetDryRun", "b", [dry_run], interactive=interactive)

    async def guard_load_policy(self, name: str, text: str, *, interactive: bool = False) -> PolicyLoaded:
        """Make the policy the one in force; errors.InvalidPolicy when it is invalid."""
        (result,) = await self._guard("LoadPolicy", "ss", [name, text], interactive=interactive)
        return _record(PolicyLoaded, result)

    async def guard_test(self, name: str = "", text: str = "") -> list[Decision]:
        """What a policy (text "": the one in force) would do with the current snapshot; never acts."""
        (decisions,) = await self._guard("TestPolicies", "ss", [name, text], timeout=CALL_TIMEOUT + 15.0)
        return [_record(Decision, d) for d in decisions]

    # -- signals -----------------------------------------------------------------------------------------

    async def events(self, max_queued: int = MAX_QUEUED_EVENTS, *,
                     on_absent: Callable[[], None] | None = None) -> AsyncIterator[Event]:
        """Every signal gpukilld sends from now on, as its record of gpukill/records.py, in order; the iteration
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
        rules = [f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}'",
                 f"type='signal',sender='{DBUS[0]}',path='{DBUS[1]}',interface='{DBUS[2]}',"
                 f"member='NameOwnerChanged',arg0='{BUS_NAME}'"]
        self.bus.add_message_handler(on_message)
        gone = asyncio.ensure_future(self.bus.wait_for_disconnect())
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

    async def _send(self, msg: Message, timeout: float, who: str) -> Message:
        """The reply to msg (an error reply included); a ClientError when `who` does not answer within timeout,
        DaemonUnavailable when the bus connection is lost."""
        try:
            return await asyncio.wait_for(self.bus.call(msg), timeout)
        except TimeoutError:
            raise ClientError("org.freedesktop.DBus.Error.Timeout", f"{who} did not answer within {timeout:g}s") from None
        except Exception as e:
            raise DaemonUnavailable("", f"lost the system bus: {e}") from None

    async def _bus_call(self, member: str, arg: str) -> list:
        """A call of the bus itself (org.freedesktop.DBus) with one string argument."""
        msg = Message(destination=DBUS[0], path=DBUS[1], interface=DBUS[2], member=member, signature="s", body=[arg])
        reply = await self._send(msg, CALL_TIMEOUT, f"the system bus ({member})")
        if reply is None or reply.message_type == MessageType.ERROR:
            raise ClientError(reply.error_name if reply else "", f"{member} failed on the system bus")
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
