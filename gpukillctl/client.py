"""The gpukill client library: org.gpukill1 over the system bus, plain Python values out.

Front ends (the CLI, later MCP and REST) use this module alone; none of them touches a vendor library or
/sys, so polkit decides for every one of them. Records come back as dicts with every documented key present
and None where the daemon could not read a value (see DEVICE_KEYS and PROCESS_KEYS: the stable JSON shape).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.constants import MessageFlag

BUS_NAME = "org.gpukill1"
OBJECT_PATH = "/org/gpukill1"
INTERFACE = "org.gpukill1.Manager"
GUARD_INTERFACE = "org.gpukill1.Guard"
CALL_TIMEOUT = 25.0
REPLY_TOO_LARGE = "org.gpukill1.Error.ReplyTooLarge"
PAGE_SIZE = 500  # records per ListProcesses page: well inside one reply (the daemon allows up to 1000)

DEVICE_KEYS = ("index", "id", "backend", "vendor", "name", "pci_bus_id", "utilization", "memory_used",
               "memory_total", "temperature", "power", "state", "state_reason", "power_limit", "mig_mode",
               "parent_id", "clock_mhz")
PROCESS_KEYS = ("pid", "start_time", "uid", "user", "comm", "cmdline", "exe", "device", "device_id",
                "gpu_memory", "gpu_utilization", "unit", "container_id", "pod_uid", "slurm_job", "container_pid",
                "memory_regions", "shared_usage")


class ClientError(Exception):
    """A failure with the D-Bus error name that caused it ("" when not from the daemon)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class DaemonUnavailable(ClientError):
    pass


@dataclass(frozen=True, slots=True)
class DaemonStatus:
    version: str
    sample_interval: float
    backends: list[tuple[str, bool, str]]


def _plain(value: Any) -> Any:
    if isinstance(value, Variant):
        return _plain(value.value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _record(raw: dict[str, Variant], keys: tuple[str, ...]) -> dict[str, Any]:
    rec: dict[str, Any] = {k: None for k in keys}
    if "shared_usage" in rec:
        rec["shared_usage"] = False  # a flag: left out of the daemon's record when false
    for k, v in raw.items():
        if k in rec:  # keys a newer daemon adds are left out until documented here
            rec[k] = _plain(v)
    return rec


class GpukillClient:
    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus

    @classmethod
    async def connect(cls) -> GpukillClient:
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
        try:
            reply = await asyncio.wait_for(self.bus.call(msg), timeout)
        except TimeoutError:
            raise ClientError("org.freedesktop.DBus.Error.Timeout", f"gpukilld did not answer within {timeout:g}s") from None
        except Exception as e:
            raise DaemonUnavailable("", f"lost the system bus: {e}") from None
        if reply.message_type == MessageType.ERROR:
            text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else reply.error_name
            if reply.error_name in ("org.freedesktop.DBus.Error.ServiceUnknown",
                                    "org.freedesktop.DBus.Error.NameHasNoOwner"):
                raise DaemonUnavailable(reply.error_name, "gpukilld is not running (org.gpukill1 is not on the system bus)")
            raise ClientError(reply.error_name, text)
        return reply.body

    async def list_devices(self) -> list[dict[str, Any]]:
        (devices,) = await self._call("ListDevices")
        return [_record(d, DEVICE_KEYS) for d in devices]

    async def list_processes(self, filter: dict[str, Variant] | None = None) -> list[dict[str, Any]]:
        """Every process the daemon shows us; page by page when the whole listing is too large for one reply."""
        try:
            (procs,) = await self._call("ListProcesses", "a{sv}", [filter or {}])
        except ClientError as e:
            if e.name != REPLY_TOO_LARGE:
                raise
            procs = await self._pages(filter or {})
        return [_record(p, PROCESS_KEYS) for p in procs]

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
                   interactive: bool = False) -> str:
        options: dict[str, Variant] = {"force": Variant("b", force)}
        if grace is not None:
            options["grace"] = Variant("d", float(grace))
        # The daemon may wait the whole grace, then SIGKILL's wait, plus a password prompt.
        timeout = (grace if grace is not None else 5.0) + 30.0 + (300.0 if interactive else 0.0)
        (outcome,) = await self._call("KillProcess", "uta{sv}", [pid, start_time, options],
                                      interactive=interactive, timeout=timeout)
        return outcome

    async def reset(self, device: str, *, force: bool = False, interactive: bool = False) -> dict[str, Any]:
        (result,) = await self._call("ResetDevice", "sa{sv}", [device, {"force": Variant("b", force)}],
                                     interactive=interactive, timeout=600.0 if interactive else 300.0)
        return {k: _plain(v) for k, v in result.items()}

    async def status(self) -> DaemonStatus:
        (props,) = await self._call("GetAll", "s", [INTERFACE], interface="org.freedesktop.DBus.Properties")
        return DaemonStatus(
            version=props["Version"].value,
            sample_interval=props["SampleInterval"].value,
            backends=[(n, bool(a), d) for n, a, d in props["Backends"].value],
        )

    # -- Guard Mode (org.gpukill1.Guard) ---------------------------------------------------------------

    async def _guard(self, member: str, signature: str = "", body: list | None = None, *,
                     interactive: bool = False, timeout: float = CALL_TIMEOUT) -> list:
        return await self._call(member, signature, body, interface=GUARD_INTERFACE, interactive=interactive,
                                timeout=timeout + (300.0 if interactive else 0.0))

    async def guard_status(self) -> dict[str, Any]:
        (status,) = await self._guard("GetStatus")
        return _deep(status)

    async def guard_enable(self, enabled: bool = True, *, interactive: bool = False) -> None:
        await self._guard("Enable" if enabled else "Disable", interactive=interactive)

    async def guard_set_dry_run(self, dry_run: bool, *, interactive: bool = False) -> None:
        await self._guard("SetDryRun", "b", [dry_run], interactive=interactive)

    async def guard_load_policy(self, name: str, text: str, *, interactive: bool = False) -> dict[str, Any]:
        """Make the policy the one in force; ClientError org.gpukill1.Error.InvalidPolicy when invalid."""
        (result,) = await self._guard("LoadPolicy", "ss", [name, text], interactive=interactive)
        return _deep(result)

    async def guard_test(self, name: str = "", text: str = "") -> list[dict[str, Any]]:
        """What a policy (text "": the one in force) would do with the current snapshot; never acts."""
        (decisions,) = await self._guard("TestPolicies", "ss", [name, text], timeout=CALL_TIMEOUT + 15.0)
        return [_deep(d) for d in decisions]


def _deep(value: Any) -> Any:
    """Variants, a{sv} and arrays of them as plain dicts and lists."""
    if isinstance(value, Variant):
        return _deep(value.value)
    if isinstance(value, dict):
        return {k: _deep(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep(v) for v in value]
    return value
