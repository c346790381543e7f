"""org.gpukill1.Manager on the system bus: a thin layer from D-Bus calls to the snapshot and Actions.

dbus-fast hands method bodies their arguments but not the message, and we need the sender (for polkit and
the audit) and its flags (interactive authorization). The door handler below sees every message first: it
denies anything the bouncer's table does not map, and otherwise remembers the message in a context variable
that the method reads. dbus-fast starts each async method as a Task, which copies the context at that moment.
"""

import functools
import math
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from dbus_fast import DBusError, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.constants import MessageFlag, PropertyAccess
from dbus_fast.service import ServiceInterface, dbus_property, method, signal

from gpukill.errors import GpukillError, InvalidArgs, ReplyTooLarge, TooBusy
from gpukill.regex import RegexError, compile_regex

from . import __version__, busio
from .actions import Actions, KillResult, ResetResult
from .bouncer import OUR_INTERFACES, READ_ONLY, Bouncer, action_for
from .callrate import RATE, CallRate
from .model import Device, GpuProcess, Snapshot
from .visibility import FULL, Viewer, seen_as

OBJECT_PATH = "/org/gpukill1"
BUS_NAME = "org.gpukill1"
INTERFACE = "org.gpukill1.Manager"

_current_call: ContextVar[Message | None] = ContextVar("gpukill_current_call", default=None)

NO_REPLY_EXPECTED = MessageFlag.NO_REPLY_EXPECTED.value
DEFAULT_GRACE = 5.0
MAX_FILTER_STRING = 4096

# A bus message may carry 32 MiB (dbus-daemon's max_message_size on the system bus). Replies are bounded well
# under it by construction: every string a process controls is bounded when sampled (procfs), so a record is
# at most ~11 KiB, a page of PAGE_MAX records fits, and a whole listing over MAX_REPLY is refused with
# ReplyTooLarge (clients then ask for pages) instead of failing to marshal for every caller.
MAX_REPLY = 16 << 20
PAGE_MAX = 1000
# What may wait in the daemon's own write queue before large replies are refused (TooBusy): callers who
# never read their replies must not grow the daemon's memory.
MAX_BACKLOG = 64 << 20


class Door:
    """First look at every message: hold each uid to its call rate, deny unmapped methods of our interfaces,
    remember the call for the method body, and answer the hot unfiltered ListProcesses from a body marshalled
    once per snapshot and kind of caller (when the caller's kind is known without a round trip)."""

    def __init__(self, bus: MessageBus, manager: "ManagerInterface", bouncer: Bouncer) -> None:
        self.bus = bus
        self.manager = manager
        self.bouncer = bouncer
        self.rate = CallRate()

    def __call__(self, msg: Message) -> Message | bool | None:
        if msg.message_type is not MessageType.METHOD_CALL or msg.path != OBJECT_PATH:
            return None
        iface = msg.interface
        no_reply = bool(msg.flags.value & NO_REPLY_EXPECTED)
        caller = self.bouncer.known(msg)  # a connection's first call is looked up by the method, then known
        if caller is not None and not self.rate.allow(caller.uid):
            return True if no_reply else Message.new_error(
                msg, TooBusy.dbus_name, f"uid {caller.uid} calls gpukilld more than {RATE:g} times a second; "
                                        "slow down")
        if iface in OUR_INTERFACES or iface is None:
            action = action_for(iface, msg.member)
            if action is None:
                return True if no_reply else Message.new_error(
                    msg, "org.freedesktop.DBus.Error.AccessDenied",
                    f"{iface or '(no interface)'}.{msg.member} is not a method gpukilld allows",
                )
            if no_reply and action == READ_ONLY:
                return True  # a question nobody waits to hear answered: nothing to do
            if msg.member == "ListProcesses" and msg.signature == "a{sv}" and not msg.body[0]:
                answered = self._list_all(msg)
                if answered is not None:
                    return answered
            _current_call.set(msg)
        elif no_reply:
            # Properties, Introspectable, Peer: only questions. Dropped, so that dbus-fast has no error to log
            # with a traceback for a call nobody waits on (any user could fill the journal with those).
            return True
        elif iface == "org.freedesktop.DBus.Properties" and msg.member == "Set":
            return Message.new_error(msg, "org.freedesktop.DBus.Error.PropertyReadOnly",
                                     "gpukilld properties are read-only")
        return None

    def _list_all(self, msg: Message) -> Message | bool | None:
        viewer = self.manager.known_viewer(msg)
        if viewer is None:
            return None  # first call of this connection: the method asks who it is
        try:
            body = self.manager.all_processes_body(viewer)
        except GpukillError as e:
            return Message.new_error(msg, e.dbus_name, str(e))
        if busio.send_premarshalled_reply(self.bus, msg, "aa{sv}", body):
            return True
        return None


def _dbus_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Our failures become the D-Bus errors named in errors.py; the caller gets one line, never a traceback.
    A call sent with NO_REPLY_EXPECTED gets no error at all: dbus-fast would log it with a traceback, and that
    would let any user write to the journal at will (the refusal itself is audited, folded per uid)."""

    @functools.wraps(fn)
    async def wrapper(self: Any, *args: Any) -> Any:
        try:
            return await fn(self, *args)
        except (GpukillError, DBusError) as e:
            msg = _current_call.get()
            if msg is not None and msg.flags.value & NO_REPLY_EXPECTED:
                return None
            if isinstance(e, DBusError):
                raise
            raise DBusError(e.dbus_name, str(e)) from None

    return wrapper


def device_to_dbus(d: Device) -> dict[str, Variant]:
    out = {
        "index": Variant("u", d.index), "id": Variant("s", d.id), "backend": Variant("s", d.backend),
        "vendor": Variant("s", d.vendor), "name": Variant("s", d.name), "state": Variant("s", d.state),
    }
    if d.state_reason:
        out["state_reason"] = Variant("s", d.state_reason)
    if d.pci_bus_id is not None:
        out["pci_bus_id"] = Variant("s", d.pci_bus_id)
    for key, sig, value in (
        ("utilization", "d", d.utilization), ("memory_used", "t", d.memory_used),
        ("memory_total", "t", d.memory_total), ("temperature", "d", d.temperature), ("power", "d", d.power),
        ("power_limit", "d", d.power_limit), ("mig_mode", "b", d.mig_mode), ("parent_id", "s", d.parent_id),
        ("clock_mhz", "d", d.clock_mhz),
    ):
        if value is not None:
            out[key] = Variant(sig, value)
    return out


def process_to_dbus(p: GpuProcess) -> dict[str, Variant]:
    out = {
        "pid": Variant("u", p.pid), "start_time": Variant("t", p.start_time), "uid": Variant("u", p.uid),
        "user": Variant("s", p.user), "comm": Variant("s", p.comm), "cmdline": Variant("s", p.cmdline),
        "device": Variant("u", p.device), "device_id": Variant("s", p.device_id),
    }
    a = p.attribution
    for key, sig, value in (
        ("exe", "s", p.exe), ("gpu_memory", "t", p.gpu_memory), ("gpu_utilization", "d", p.gpu_utilization),
        ("unit", "s", a.unit), ("container_id", "s", a.container_id), ("pod_uid", "s", a.pod_uid),
        ("slurm_job", "s", a.slurm_job), ("container_pid", "u", p.container_pid),
    ):
        if value is not None:
            out[key] = Variant(sig, value)
    if p.shared_usage:  # part of its usage is through a DRM client other users' processes hold: charged to no one
        out["shared_usage"] = Variant("b", True)
    if p.memory_regions:  # region -> {"total": bytes, "resident": bytes}, each only where known
        out["memory_regions"] = Variant("a{sa{st}}", {
            r.name: {k: v for k, v in (("total", r.total), ("resident", r.resident)) if v is not None}
            for r in p.memory_regions
        })
    return out


def _option(options: dict[str, Variant], key: str, kinds: str | tuple[str, ...], where: str) -> Any:
    """The option's value if its signature is one of kinds (a string of one-letter signatures, or a tuple)."""
    v = options[key]
    if v.signature not in (tuple(kinds) if isinstance(kinds, str) else kinds):
        raise InvalidArgs(f"{where} {key!r} has type {v.signature[:32]!r}, expected one of {list(kinds)}")
    return v.value


def _check_keys(options: dict[str, Variant], known: tuple[str, ...], where: str) -> None:
    for key in options:
        if key not in known:
            raise InvalidArgs(f"unknown {where} {key[:64]!r} (known: {', '.join(known)})")


ProcessFilter = Callable[[GpuProcess], bool]


@dataclass(frozen=True, slots=True)
class Query:
    tests: list[ProcessFilter]
    limit: int | None  # records per page; None: all at once (ReplyTooLarge when they do not fit)
    after: tuple[int, int] | None  # (device, pid) of the last record of the previous page


def build_query(raw: dict[str, Variant], snapshot: Snapshot) -> Query:
    _check_keys(raw, ("device", "user", "name", "name_regex", "min_memory", "limit", "after"), "filter key")
    tests: list[ProcessFilter] = []
    if "device" in raw:
        dev = _option(raw, "device", "suy", "filter")
        device = snapshot.find_device(str(dev)[:MAX_FILTER_STRING])
        index = device.index if device else -1
        tests.append(lambda p: p.device == index)
    if "user" in raw:
        user = _option(raw, "user", "suy", "filter")
        if isinstance(user, int):
            tests.append(lambda p: p.uid == user)
        else:
            user = user[:MAX_FILTER_STRING]
            tests.append(lambda p: p.user == user or str(p.uid) == user)
    if "name" in raw:
        name = _option(raw, "name", "s", "filter")[:MAX_FILTER_STRING]
        tests.append(lambda p: name in p.comm)
    if "name_regex" in raw:
        try:
            rx = compile_regex(_option(raw, "name_regex", "s", "filter"))
        except RegexError as e:
            raise InvalidArgs(f"filter 'name_regex': {e}") from None
        decided: dict[str, bool] = {}  # names repeat: one RE2 search per distinct name

        def matches(p: GpuProcess) -> bool:
            hit = decided.get(p.comm)
            if hit is None:
                hit = decided[p.comm] = rx.search(p.comm) is not None
            return hit

        tests.append(matches)
    if "min_memory" in raw:
        floor = _option(raw, "min_memory", "tuiyqx", "filter")
        tests.append(lambda p: (p.gpu_memory or 0) >= floor)
    limit = None
    if "limit" in raw:
        limit = _option(raw, "limit", "uqy", "filter")
        if not 1 <= limit <= PAGE_MAX:
            raise InvalidArgs(f"filter 'limit' must be from 1 to {PAGE_MAX}, not {limit}")
    after = None
    if "after" in raw:
        after = tuple(_option(raw, "after", ("(uu)",), "filter"))
    return Query(tests, limit, after)  # type: ignore[arg-type]


def _value_size(sig: str, value: Any) -> int:
    """An upper bound of the marshalled size of one value (alignment padding included)."""
    if sig == "s":
        return 8 + len(value.encode())
    if sig in ("u", "b", "y", "q", "n", "i"):
        return 8
    if sig in ("t", "d", "x"):
        return 16
    if sig in ("as", "au"):
        return 8 + sum(_value_size(sig[1], v) for v in value)
    return len(busio.marshal_body(sig, [value])) + 8


def record_size(record: dict[str, Variant]) -> int:
    """An upper bound of the marshalled size of an a{sv} record, to bound replies before marshalling them."""
    return 8 + sum(16 + len(k) + _value_size(v.signature, v.value) for k, v in record.items())


Record = tuple[GpuProcess, dict[str, Variant], int]  # the process as seen, its a{sv}, its size bound


def _record(p: GpuProcess) -> Record:
    d = process_to_dbus(p)
    return (p, d, record_size(d))


def _check_size(records: list[Record], what: str) -> None:
    size = sum(r[2] for r in records)
    if size > MAX_REPLY:
        raise ReplyTooLarge(
            f"{what} ({len(records)} records, up to {size / (1 << 20):.1f} MiB) does not fit in one reply "
            f"({MAX_REPLY >> 20} MiB); ask for pages with the filter keys 'limit' (at most {PAGE_MAX}) and 'after'")


class ManagerInterface(ServiceInterface):
    def __init__(self, snapshot: Callable[[], Snapshot], actions: Actions, bouncer: Bouncer,
                 sample_interval: Callable[[], float]) -> None:
        super().__init__(INTERFACE)
        self._snapshot = snapshot
        self._actions = actions
        self._bouncer = bouncer
        self._sample_interval = sample_interval
        self._cache_generation = -1
        self._devices_reply: list[dict[str, Variant]] = []
        self._full: list[Record] = []  # every process in full, in (device, pid) order
        self._reduced: dict[str, list[Record | None]] = {}  # others' processes in one reduced form, by index
        self._views: dict[tuple[int, str], list[Record]] = {}  # a viewer's listing
        self._bodies: dict[tuple[int, str], bytes] = {}  # a viewer's whole listing, marshalled
        self.bus: MessageBus | None = None  # set by main: replies are refused while its queue is backed up

    # -- listings, built once per snapshot and kind of viewer ------------------------------------------------

    def _fresh(self) -> None:
        snap = self._snapshot()
        if snap.generation != self._cache_generation:
            self._devices_reply = [device_to_dbus(d) for d in snap.devices]
            self._full = [_record(p) for p in snap.processes]
            self._reduced, self._views, self._bodies = {}, {}, {}
            self._cache_generation = snap.generation

    def _view(self, viewer: Viewer) -> list[Record]:
        self._fresh()
        if viewer.others == FULL:
            return self._full
        view = self._views.get(viewer.key)
        if view is None:
            reduced = self._reduced.get(viewer.others)
            if reduced is None:
                reduced = self._reduced[viewer.others] = [
                    None if (q := seen_as(p, viewer.others)) is None else _record(q) for p, _, _ in self._full]
            view = [full if full[0].uid == viewer.uid else other
                    for full, other in zip(self._full, reduced, strict=True)
                    if full[0].uid == viewer.uid or other is not None]
            if len(self._views) > 256:  # distinct callers in one sample interval: bound the cache
                self._views.clear()
                self._bodies.clear()
            self._views[viewer.key] = view  # type: ignore[assignment]
        return view  # type: ignore[return-value]

    def all_processes_body(self, viewer: Viewer) -> bytes:
        """The marshalled body of an unfiltered ListProcesses reply for this viewer, built once per snapshot;
        ReplyTooLarge when it would not fit, TooBusy while the connection is backed up."""
        view = self._view(viewer)
        body = self._bodies.get(viewer.key)
        if body is None:
            _check_size(view, "the listing")
            body = self._bodies[viewer.key] = busio.marshal_body("aa{sv}", [[d for _, d, _ in view]])
        self._check_backlog()
        return body

    def _check_backlog(self) -> None:
        if self.bus is not None and (queued := busio.backlog_bytes(self.bus)) > MAX_BACKLOG:
            raise TooBusy(f"gpukilld has {queued >> 20} MiB of replies waiting for the bus; try again shortly")

    def known_viewer(self, msg: Message) -> Viewer | None:
        """The viewer for a call whose caller and view-all answer are known without a round trip."""
        caller = self._bouncer.known(msg)
        return None if caller is None else self._bouncer.known_viewer(caller)

    async def _caller(self):
        msg = _current_call.get()
        if msg is None:  # cannot happen while door() is installed; refuse rather than act unidentified
            raise DBusError("org.freedesktop.DBus.Error.AccessDenied", "caller could not be identified")
        try:
            return await self._bouncer.caller(msg)
        except Exception as e:
            raise DBusError("org.freedesktop.DBus.Error.AccessDenied", f"caller could not be identified: {e}") from None

    # -- methods ---------------------------------------------------------------------------------------

    @method()
    def ListDevices(self) -> "aa{sv}":
        self._fresh()
        return self._devices_reply

    @method()
    @_dbus_errors
    async def ListProcesses(self, filter: "a{sv}") -> "aa{sv}":
        viewer = await self._bouncer.viewer(await self._caller())
        view = self._view(viewer)
        query = build_query(filter, self._snapshot())
        selected = [r for r in view if all(t(r[0]) for t in query.tests)] if query.tests else view
        if query.after is not None:
            after = query.after
            selected = [r for r in selected if (r[0].device, r[0].pid) > after]
        if query.limit is not None:
            selected = selected[:query.limit]
        _check_size(selected, "the page" if query.limit else "the listing")
        self._check_backlog()
        return [d for _, d, _ in selected]

    @method()
    @_dbus_errors
    async def KillProcess(self, pid: "u", start_time: "t", options: "a{sv}") -> "s":
        caller = await self._caller()
        _check_keys(options, ("force", "grace"), "option")
        force = bool(_option(options, "force", "b", "option")) if "force" in options else False
        grace = float(_option(options, "grace", "duiyqxt", "option")) if "grace" in options else DEFAULT_GRACE
        if math.isnan(grace):
            raise InvalidArgs("option 'grace' is not a number")
        result = await self._actions.kill(caller, pid, start_time, grace, force, f"uid:{caller.uid}")
        return result.outcome

    @method()
    @_dbus_errors
    async def ResetDevice(self, device: "s", options: "a{sv}") -> "a{sv}":
        caller = await self._caller()
        _check_keys(options, ("force",), "option")
        force = bool(_option(options, "force", "b", "option")) if "force" in options else False
        result = await self._actions.reset(caller, device, force)
        return {
            "device": Variant("u", result.device_index),
            "device_id": Variant("s", result.device_id),
            "message": Variant("s", result.message),
            "killed": Variant("au", list(result.killed)),
        }

    # -- properties ------------------------------------------------------------------------------------

    @dbus_property(access=PropertyAccess.READ)
    def Version(self) -> "s":
        return __version__

    @dbus_property(access=PropertyAccess.READ)
    def Backends(self) -> "a(sbs)":
        return [[b.name, b.available, b.detail] for b in self._snapshot().backends]

    @dbus_property(access=PropertyAccess.READ)
    def SampleInterval(self) -> "d":
        return self._sample_interval()

    # -- signals ---------------------------------------------------------------------------------------

    @signal()
    def ProcessKilled(self, result: KillResult, caller_uid: int) -> "utusassus":
        return [result.pid, result.start_time, result.uid, result.comm, list(result.device_ids),
                result.outcome, caller_uid, result.initiator]

    @signal()
    def DeviceReset(self, result: ResetResult, success: bool) -> "usbsau":
        return [result.device_index, result.device_id, success, result.message, list(result.killed)]

    @signal()
    def DeviceStateChanged(self, device: Device) -> "usss":
        return [device.index, device.id, device.state, device.state_reason]


# Names for return values and signal arguments, as in dbus/org.gpukill1.xml (dbus-fast leaves them unnamed).
OUTPUT_NAMES = {
    "ListDevices": ["devices"],
    "ListProcesses": ["processes"],
    "KillProcess": ["outcome"],
    "ResetDevice": ["result"],
    "ProcessKilled": ["pid", "start_time", "uid", "comm", "devices", "outcome", "caller_uid", "initiator"],
    "DeviceReset": ["index", "id", "success", "message", "killed"],
    "DeviceStateChanged": ["index", "id", "state", "reason"],
}


def _name_outputs(cls: type, names: dict[str, list[str]]) -> None:
    for member in vars(cls).values():
        d = getattr(member, "__dict__", {})
        item = d.get("__DBUS_METHOD") or d.get("__DBUS_SIGNAL")
        if item is None:
            continue
        args = item.introspection.out_args if "__DBUS_METHOD" in d else item.introspection.args
        for arg, name in zip(args, names[item.name], strict=True):
            arg.name = name


_name_outputs(ManagerInterface, OUTPUT_NAMES)
