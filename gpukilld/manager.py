"""org.gpukill1.Manager on the system bus: a thin layer from D-Bus calls to the snapshot and Actions.

dbus-fast hands method bodies their arguments but not the message, and we need the sender (for polkit and
the audit) and its flags (interactive authorization). The door handler below sees every message first: it
denies anything the bouncer's table does not map, and otherwise remembers the message in a context variable
that the method reads. dbus-fast starts each async method as a Task, which copies the context at that moment.
"""

import functools
import math
import re
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from dbus_fast import DBusError, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.constants import MessageFlag, PropertyAccess
from dbus_fast.service import ServiceInterface, dbus_property, method, signal

from . import __version__, busio
from .actions import Actions, KillResult, ResetResult
from .bouncer import OUR_INTERFACES, Bouncer, action_for
from .errors import GpukillError, InvalidArgs
from .model import Device, GpuProcess, Snapshot

OBJECT_PATH = "/org/gpukill1"
BUS_NAME = "org.gpukill1"
INTERFACE = "org.gpukill1.Manager"

_current_call: ContextVar[Message | None] = ContextVar("gpukill_current_call", default=None)

NO_REPLY_EXPECTED = MessageFlag.NO_REPLY_EXPECTED.value
DEFAULT_GRACE = 5.0
MAX_FILTER_STRING = 4096


class Door:
    """First look at every message: deny unmapped methods of our interfaces, remember the call for the
    method body, and answer the hot unfiltered ListProcesses from a body marshalled once per snapshot."""

    def __init__(self, bus: MessageBus, manager: "ManagerInterface") -> None:
        self.bus = bus
        self.manager = manager

    def __call__(self, msg: Message) -> Message | bool | None:
        if msg.message_type is not MessageType.METHOD_CALL or msg.path != OBJECT_PATH:
            return None
        iface = msg.interface
        if iface in OUR_INTERFACES or iface is None:
            if action_for(iface, msg.member) is None:
                return Message.new_error(
                    msg, "org.freedesktop.DBus.Error.AccessDenied",
                    f"{iface or '(no interface)'}.{msg.member} is not a method gpukilld allows",
                )
            if (msg.member == "ListProcesses" and msg.signature == "a{sv}" and not msg.body[0]
                    and not msg.flags.value & NO_REPLY_EXPECTED
                    and busio.send_premarshalled_reply(self.bus, msg, "aa{sv}", self.manager.all_processes_body())):
                return True
            _current_call.set(msg)
        elif iface == "org.freedesktop.DBus.Properties" and msg.member == "Set":
            return Message.new_error(msg, "org.freedesktop.DBus.Error.PropertyReadOnly",
                                     "gpukilld properties are read-only")
        return None


def _dbus_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Our failures become the D-Bus errors named in errors.py; the caller gets one line, never a traceback."""

    @functools.wraps(fn)
    async def wrapper(self: Any, *args: Any) -> Any:
        try:
            return await fn(self, *args)
        except GpukillError as e:
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
    if p.memory_regions:  # region -> {"total": bytes, "resident": bytes}, each only where known
        out["memory_regions"] = Variant("a{sa{st}}", {
            r.name: {k: v for k, v in (("total", r.total), ("resident", r.resident)) if v is not None}
            for r in p.memory_regions
        })
    return out


def _option(options: dict[str, Variant], key: str, kinds: str, where: str) -> Any:
    v = options[key]
    if v.signature not in kinds:
        raise InvalidArgs(f"{where} {key!r} has type {v.signature!r}, expected one of {list(kinds)}")
    return v.value


def _check_keys(options: dict[str, Variant], known: tuple[str, ...], where: str) -> None:
    for key in options:
        if key not in known:
            raise InvalidArgs(f"unknown {where} {key[:64]!r} (known: {', '.join(known)})")


ProcessFilter = Callable[[GpuProcess], bool]


def build_filter(raw: dict[str, Variant], snapshot: Snapshot) -> list[ProcessFilter]:
    _check_keys(raw, ("device", "user", "name", "name_regex", "min_memory"), "filter key")
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
            tests.append(lambda p: p.user == user or str(p.uid) == user)
    if "name" in raw:
        name = _option(raw, "name", "s", "filter")[:MAX_FILTER_STRING]
        tests.append(lambda p: name in p.comm)
    if "name_regex" in raw:
        pattern = _option(raw, "name_regex", "s", "filter")
        if len(pattern) > 1024:
            raise InvalidArgs("filter 'name_regex' is longer than 1024 characters")
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise InvalidArgs(f"filter 'name_regex' is not a valid regular expression: {e}") from None
        tests.append(lambda p: rx.search(p.comm) is not None)  # comm is at most 15 bytes: bounded work
    if "min_memory" in raw:
        floor = _option(raw, "min_memory", "tuiyqx", "filter")
        tests.append(lambda p: (p.gpu_memory or 0) >= floor)
    return tests


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
        self._processes_reply: list[tuple[GpuProcess, dict[str, Variant]]] = []
        self._body_generation = -1
        self._processes_body = b""

    def all_processes_body(self) -> bytes:
        """The marshalled body of an unfiltered ListProcesses reply, built once per snapshot."""
        processes = self._converted()[1]
        if self._body_generation != self._cache_generation:
            self._processes_body = busio.marshal_body("aa{sv}", [[d for _, d in processes]])
            self._body_generation = self._cache_generation
        return self._processes_body

    def _converted(self) -> tuple[list[dict[str, Variant]], list[tuple[GpuProcess, dict[str, Variant]]]]:
        """Replies built once per snapshot: most calls in a second see the same one."""
        snap = self._snapshot()
        if snap.generation != self._cache_generation:
            self._devices_reply = [device_to_dbus(d) for d in snap.devices]
            self._processes_reply = [(p, process_to_dbus(p)) for p in snap.processes]
            self._cache_generation = snap.generation
        return self._devices_reply, self._processes_reply

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
        return self._converted()[0]

    @method()
    def ListProcesses(self, filter: "a{sv}") -> "aa{sv}":
        _, processes = self._converted()
        if not filter:
            return [d for _, d in processes]
        try:
            tests = build_filter(filter, self._snapshot())
        except GpukillError as e:
            raise DBusError(e.dbus_name, str(e)) from None
        return [d for p, d in processes if all(t(p) for t in tests)]

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
