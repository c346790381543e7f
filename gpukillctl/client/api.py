"""The typed client API of org.gpukill1, written once over any transport: records out, one exception per daemon error.

Methods return the records of gpukill/records/ (Device, Process, ResetReply, Finding, GuardStatus, Decision,
PolicyLoaded), built from the daemon's a{sv} by their one declaration: a value the daemon left out is the field's
default (None where it could not be read), keys a newer daemon adds are ignored. Kills return an Outcome.

Two transports carry the calls, each a subclass that implements `_call` and nothing of the API:
- gpukillctl/client/dbus.py, GpukillClient: dbus-fast on asyncio, for the long-lived front ends (top, monitor, the
  notify agent, the exporter, MCP, REST) and for signals (`events()`);
- gpukillctl/client/blocking.py, BlockingClient: jeepney's blocking connection, for one-shot commands, which then
  import neither asyncio nor dbus-fast (together ~60 ms of a ~100 ms `gpukillctl list`).
Both keep the same `await client.x()` API: the blocking transport's coroutines never suspend, so a one-shot
command runs them to the end without an event loop (blocking.finish), and every command is written once.

This module is imported at the CLI's start: nothing heavy (no asyncio, no D-Bus library) may be imported here.

Failures raise a ClientError. One from the daemon is of the class made here for its D-Bus error name, which is
also the shared error class of gpukill.errors that names it: `except errors.NoSuchProcess` catches what the
daemon reported as org.gpukill1.Error.NoSuchProcess. DaemonUnavailable: no bus, or no gpukilld on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from gpukill import errors, listing
from gpukill.records.base import from_plain, names
from gpukill.records.manager import Device, Process

# The listing's records alone are imported above: the others (a reset's reply, the audit's, the Guard's) are
# imported in the methods that return them, so that their modules load when those run, not at every start
# (gpukill/records/__init__.py); Outcome (an enum) likewise, in kill().
if TYPE_CHECKING:
    from gpukill.outcome import Outcome
    from gpukill.records.audit import AuditSettings, Finding
    from gpukill.records.guard import Decision, GuardStatus, ManagedPolicyEntry, PolicyLoaded, PostponeAnswer
    from gpukill.records.reclaim import KillReport, WorkloadReply
    from gpukill.records.status import BackendStatus, ResetReply, SamplingStatus
    from gpukill.records.suspend import SuspendedProcess, SuspendReply
    from gpukill.records.usage import UsageReport

BUS_NAME = "org.gpukill1"
OBJECT_PATH = "/org/gpukill1"
INTERFACE = "org.gpukill1.Manager"
GUARD_INTERFACE = "org.gpukill1.Guard"
CALL_TIMEOUT = 25.0
DEFAULT_GRACE = 5.0  # seconds: gpukilld's grace after SIGTERM when a kill names none
# Seconds a kill's reply may take beyond its grace: SIGKILL's wait and the watch of the GPU's memory (3 samples)
KILL_REPLY_MARGIN = 60.0
PROMPT_TIME = 300.0  # seconds for a password prompt, where one may be asked
# Seconds a suspend or resume may take: each driver call has 120 s in gpukilld and a checkpoint or restore 4 s more
# per GiB it copies (gpukilld/acts/cuda_checkpoint.py: 140 GiB, an H200's, ~11 min); the samples that must show the
# memory gone come on top
SUSPEND_REPLY_TIME = 1200.0
PAGE_SIZE = 500  # records per ListProcesses page: well inside one reply (the daemon allows up to 1000)
DBUS = ("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus")
UNKNOWN_METHOD = "org.freedesktop.DBus.Error.UnknownMethod"  # what the bus answers for a method gpukilld lacks
ALLOW_INTERACTIVE_AUTHORIZATION = 0x4  # the message flag, as the D-Bus specification numbers it

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
    # __module__ stays gpukillctl.client.dbus, where these classes have always been found
    return type(
        shared.__name__, (ClientError, shared), {"__module__": "gpukillctl.client.dbus", "__doc__": shared.__doc__}
    )


# One class per error the daemon sends, each named by its shared class's dbus_name.
ERRORS: dict[str, type[ClientError]] = {
    cls.dbus_name: _daemon_error(cls)
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.GpukillError)
}
# What the bus itself answers: polkit wanting a password where none may be asked is a denial.
ERRORS["org.freedesktop.DBus.Error.InteractiveAuthorizationRequired"] = ERRORS[errors.AccessDenied.dbus_name]
NOT_RUNNING = ("org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner")
TIMEOUT = "org.freedesktop.DBus.Error.Timeout"
# Where a compact row (gpukill/listing.py: the mask, then its COLUMNS) holds the keyset of paging.
ROW_DEVICE, ROW_PID = 1 + listing.COLUMNS.index("device"), 1 + listing.COLUMNS.index("pid")


DAEMON_UNAVAILABLE = "org.gpukill1.Error.DaemonUnavailable"  # what no D-Bus error names: no bus, or no gpukilld


def error_name(e: Exception) -> str:
    """The error name every client that reports a failure by name shows (the REST API's "error", the start of
    an MCP tool error): the full D-Bus error name, as the shared error class (gpukill.errors) or the bus names
    it; DAEMON_UNAVAILABLE without a daemon; org.gpukill1.Error.Failed for a failure nobody named."""
    if isinstance(e, DaemonUnavailable):
        return DAEMON_UNAVAILABLE
    if isinstance(e, errors.GpukillError):
        return e.dbus_name
    return (e.name if isinstance(e, ClientError) else "") or errors.GpukillError.dbus_name


def error_for(name: str, message: str) -> ClientError:
    """The exception for a D-Bus error reply."""
    if name in NOT_RUNNING:
        return DaemonUnavailable(name, "gpukilld is not running (org.gpukill1 is not on the system bus)")
    return ERRORS.get(name, ClientError)(name, message)


class Var(NamedTuple):
    """A D-Bus variant in a call's arguments, in no library's type: each transport writes it its own way."""

    signature: str
    value: Any


_UNSIGNED_BITS = {"y": 8, "q": 16, "u": 32, "t": 64}
_WRONG = object()  # what _typed answers for a value its signature does not take


def _typed(sig: str, value: Any) -> Any:
    """value as a Var of sig carries it (a number as a float for d, a tuple as a list), or _WRONG."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if sig == "d" and number:
        try:
            return float(value)
        except OverflowError:  # an int beyond every float
            return _WRONG
    if sig in _UNSIGNED_BITS and number and isinstance(value, int) and 0 <= value < 1 << _UNSIGNED_BITS[sig]:
        return value
    if (sig == "s" and isinstance(value, str)) or (sig == "b" and isinstance(value, bool)):
        return value
    if sig.startswith("a") and isinstance(value, list | tuple):
        items = [_typed(sig[1:], v) for v in value]
        return _WRONG if _WRONG in items else items
    return _WRONG


def plain_variants(
    values: dict[str, Any], sigs: dict[str, str], what: str, text_too: tuple[str, ...] = ()
) -> dict[str, Any]:
    """An a{sv} from plain values: each as a Var of its key's signature in sigs (an int where a d goes as a float,
    a tuple as a list), a Var or a dbus-fast Variant as it is, None left out; a key of text_too also takes a
    string, sent as one (a size or a duration, which gpukilld reads in gpukill.units' grammar).
    errors.InvalidArgs in one line naming the key for a key sigs does not hold or a value not of its type: the
    client sends what it was given or nothing."""
    invalid = ERRORS[errors.InvalidArgs.dbus_name]
    out: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        if key not in sigs:
            raise invalid(errors.InvalidArgs.dbus_name, f"unknown {what} {key[:64]!r} (known: {', '.join(sigs)})")
        if isinstance(value, Var) or type(value).__name__ == "Variant":
            out[key] = value
            continue
        if key in text_too and isinstance(value, str):
            out[key] = Var("s", value)
            continue
        typed = _typed(sigs[key], value)
        if typed is _WRONG:
            raise invalid(
                errors.InvalidArgs.dbus_name, f"{what} {key}: {repr(value)[:64]} is not of its type ({sigs[key]})"
            )
        out[key] = Var(sigs[key], typed)
    return out


def audit_variants(values: dict[str, Any]) -> dict[str, Any]:
    """Audit settings or thresholds as an a{sv}: plain_variants with the signatures AuditSettings declares."""
    from gpukill.records.audit import AuditSettings
    from gpukill.records.base import specs

    return plain_variants(values, {name: spec.sig for name, spec in specs(AuditSettings)}, "audit setting")


# GetUsage's query keys and the signature each goes as (the daemon takes more for some: these are the ones the
# clients send).
USAGE_QUERY = {
    "since": "d",
    "until": "d",
    "by": "s",
    "user": "s",
    "name": "s",
    "unit": "s",
    "job": "s",
    "pod": "s",
    "device": "s",
    "limit": "u",
}


def usage_variants(query: dict[str, Any]) -> dict[str, Any]:
    """GetUsage's a{sv} from plain values (numbers for since/until, an int limit, text for the rest):
    plain_variants with USAGE_QUERY's signatures."""
    return plain_variants(query, USAGE_QUERY, "usage query key")


@dataclass(frozen=True, slots=True)
class DaemonStatus:
    """The Manager's properties: Version, SampleInterval, Backends, Sampling."""

    version: str
    sample_interval: float  # seconds between samples: listings are at most this old
    backends: tuple[BackendStatus, ...]
    sampling: SamplingStatus | None = None  # None: a daemon from before the Sampling property


TEXT_SETTINGS = ("memory_limit", "reserved_memory", "grace")  # sizes and durations SetPolicy takes as text too


def policy_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """SetPolicy's a{sv}: plain_variants with the signatures ManagedPolicyEntry declares for its settings, a size
    or a duration also as text ("8GiB", "2min": the daemon reads gpukill.units' grammar)."""
    from gpukill.records.base import specs
    from gpukill.records.guard import ManagedPolicyEntry

    sigs = {
        name: spec.sig for name, spec in specs(ManagedPolicyEntry) if name not in ("kind", "target", "file", "edited")
    }
    return plain_variants(settings, sigs, "policy setting", TEXT_SETTINGS)


class ClientAPI:
    """The typed methods of gpukilld's Manager and Guard interfaces. A subclass supplies the transport: `_call`,
    which returns the reply's body as plain values (variants unwrapped, structs as lists) or raises the
    ClientError of error_for; `unique_name` and `close`."""

    @property
    def unique_name(self) -> str:
        """This connection's unique name on the bus (":1.42")."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

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
        raise NotImplementedError

    async def list_devices(self) -> list[Device]:
        (devices,) = await self._call("ListDevices")
        return [from_plain(Device, d) for d in devices]

    async def list_processes(self, filter: dict[str, Any] | None = None) -> list[Process]:
        """Every process the daemon shows us; page by page when the whole listing is too large for one reply.
        filter: ListProcesses' keys, each value a Var (the async transport also takes dbus-fast Variants).
        Asked in the compact form (gpukill/listing.py: no variants, a fraction of the bytes and of the
        decoding)."""
        try:
            try:
                body = await self._call(listing.METHOD, listing.IN_SIGNATURE, [filter or {}])
            except errors.ReplyTooLarge:
                body = await self._compact_pages(filter or {})
            return listing.processes_from_reply(body)
        except listing.UnknownListingFormat as e:
            raise ClientError("", str(e)) from None

    async def _compact_pages(self, filter: dict[str, Any]) -> list:
        """The compact listing's body, gathered in keyset pages in (device, pid) order: a process that comes
        or goes between pages shifts nothing."""
        rows: list = []
        page_filter = {**filter, "limit": Var("u", PAGE_SIZE)}
        while True:
            form, page = await self._call(listing.METHOD, listing.IN_SIGNATURE, [page_filter])
            if form != listing.FORMAT:
                return [form, page]  # processes_from_reply says which format it cannot read
            rows.extend(page)
            if len(page) < PAGE_SIZE:
                return [form, rows]
            page_filter["after"] = Var("(uu)", (page[-1][ROW_DEVICE], page[-1][ROW_PID]))

    async def kill(
        self,
        pid: int,
        start_time: int,
        *,
        force: bool = False,
        grace: float | None = None,
        interactive: bool = False,
        checkpoint: bool = False,
    ) -> Outcome:
        options, timeout = self._kill_options(force, grace, interactive, checkpoint)
        (outcome,) = await self._call(
            "KillProcess", "uta{sv}", [pid, start_time, options], interactive=interactive, timeout=timeout
        )
        from gpukill.outcome import Outcome

        try:
            return Outcome(outcome)
        except ValueError:
            raise ClientError("", f"gpukilld answered an unknown outcome: {outcome!r}") from None

    @staticmethod
    def _kill_options(
        force: bool, grace: float | None, interactive: bool, checkpoint: bool = False
    ) -> tuple[dict[str, Var], float]:
        """A kill's options and how long to wait for its reply: the grace, then KILL_REPLY_MARGIN (SIGKILL's wait,
        the watch of the GPU), the longest checkpoint wait a policy allows when the kill has that step, and a
        password prompt's time when one may be asked."""
        options: dict[str, Var] = {"force": Var("b", force)}
        if grace is not None:
            options["grace"] = Var("d", float(grace))
        waited = (grace if grace is not None else DEFAULT_GRACE) + KILL_REPLY_MARGIN
        if checkpoint:
            from gpukill.checkpoint import MAX_CHECKPOINT_WAIT

            options["checkpoint"] = Var("b", True)
            waited += MAX_CHECKPOINT_WAIT
        return options, waited + (PROMPT_TIME if interactive else 0.0)

    async def kill_report(
        self,
        pid: int,
        start_time: int,
        *,
        force: bool = False,
        grace: float | None = None,
        interactive: bool = False,
        checkpoint: bool = False,
    ) -> KillReport:
        """kill() with the GPU's answer: the outcome and whether the memory came back (gpukill/records/reclaim.py)."""
        from gpukill.records.reclaim import KillReport

        options, timeout = self._kill_options(force, grace, interactive, checkpoint)
        (report,) = await self._call(
            "KillProcessReport", "uta{sv}", [pid, start_time, options], interactive=interactive, timeout=timeout
        )
        return from_plain(KillReport, report)

    async def kill_workload(
        self,
        selection: dict[str, Var],
        *,
        force: bool = False,
        grace: float | None = None,
        interactive: bool = False,
        checkpoint: bool = False,
    ) -> WorkloadReply:
        """Every GPU process of a tree ({"tree": Var("(ut)", (pid, start))}), unit or container in one act."""
        from gpukill.records.reclaim import WorkloadReply

        options, timeout = self._kill_options(force, grace, interactive, checkpoint)
        (reply,) = await self._call(
            "KillWorkload", "a{sv}a{sv}", [selection, options], interactive=interactive, timeout=timeout + 60.0
        )
        return from_plain(WorkloadReply, reply)

    async def suspend_workload(self, selection: dict[str, Var], *, interactive: bool = False) -> SuspendReply:
        """SuspendWorkload: a workload's GPU memory set aside in host memory (selection: exactly one of pid or tree,
        Var("(ut)", (pid, start)), unit or job, Var("s", name))."""
        return await self._suspend_call("SuspendWorkload", selection, interactive)

    async def resume_workload(self, selection: dict[str, Var], *, interactive: bool = False) -> SuspendReply:
        """ResumeWorkload: a suspended workload's GPU memory given back (selection as suspend_workload's)."""
        return await self._suspend_call("ResumeWorkload", selection, interactive)

    async def _suspend_call(self, member: str, selection: dict[str, Var], interactive: bool) -> SuspendReply:
        from gpukill.records.suspend import SuspendReply

        (reply,) = await self._call(
            member,
            "a{sv}a{sv}",
            [selection, {}],
            interactive=interactive,
            timeout=SUSPEND_REPLY_TIME + (PROMPT_TIME if interactive else 0.0),
        )
        return from_plain(SuspendReply, reply)

    async def list_suspended(self) -> list[SuspendedProcess]:
        """The processes gpukilld holds suspended (or stuck), as the caller may see them."""
        from gpukill.records.suspend import SuspendedProcess

        (records,) = await self._call("ListSuspended")
        return [from_plain(SuspendedProcess, r) for r in records]

    async def suspended(self) -> list[SuspendedProcess]:
        """list_suspended(), or [] from a gpukilld that suspends nothing (one older than ListSuspended, or one
        without the NVIDIA backend's checkpoint support): what every view lists beside the running processes."""
        try:
            return await self.list_suspended()
        except ClientError as e:
            if e.name in (UNKNOWN_METHOD, errors.NotSupported.dbus_name):
                return []
            raise

    async def reset(self, device: str, *, force: bool = False, interactive: bool = False) -> ResetReply:
        from gpukill.records.status import ResetReply

        (result,) = await self._call(
            "ResetDevice",
            "sa{sv}",
            [device, {"force": Var("b", force)}],
            interactive=interactive,
            timeout=600.0 if interactive else 300.0,
        )
        return from_plain(ResetReply, result)

    async def audit_rogue(self, thresholds: dict[str, Any] | None = None) -> list[Finding]:
        """The rogue-activity audit of the current snapshot (miners, abusers, idle holders), highest score
        first, filtered as ListProcesses filters: evidence the caller may not see is left out. thresholds: for
        this scan only (AuditRogueWith: min_score, idle_after, idle_min_memory, abuser_share, as plain values
        or Vars); None: the settings in force (AuditRogue)."""
        from gpukill.records.audit import Finding

        if thresholds is None:
            (findings,) = await self._call("AuditRogue")
        else:
            (findings,) = await self._call("AuditRogueWith", "a{sv}", [audit_variants(thresholds)])
        return [from_plain(Finding, f) for f in findings]

    async def audit_settings(self) -> AuditSettings:
        """The audit's settings in force (thresholds, allow-lists)."""
        from gpukill.records.audit import AuditSettings

        (settings,) = await self._call("GetAuditSettings")
        return from_plain(AuditSettings, settings)

    async def set_audit_settings(self, changes: dict[str, Any], *, interactive: bool = False) -> AuditSettings:
        """Change the given settings (plain values or Vars; the others stay); errors.InvalidArgs when one is
        invalid (nothing changes then), errors.AccessDenied when polkit says no."""
        from gpukill.records.audit import AuditSettings

        (settings,) = await self._call(
            "SetAuditSettings",
            "a{sv}",
            [audit_variants(changes)],
            interactive=interactive,
            timeout=CALL_TIMEOUT + (PROMPT_TIME if interactive else 0.0),
        )
        return from_plain(AuditSettings, settings)

    async def export_audit_settings(self) -> str:
        """The settings in force as an [audit] section (canonical: it imports back to the same text)."""
        (text,) = await self._call("ExportAuditSettings")
        return text

    async def import_audit_settings(self, name: str, text: str, *, interactive: bool = False) -> AuditSettings:
        """Change the settings an [audit] text names; errors.InvalidArgs "NAME:LINE: ..." when it is invalid."""
        from gpukill.records.audit import AuditSettings

        (settings,) = await self._call(
            "ImportAuditSettings",
            "ss",
            [name, text],
            interactive=interactive,
            timeout=CALL_TIMEOUT + (PROMPT_TIME if interactive else 0.0),
        )
        return from_plain(AuditSettings, settings)

    async def usage(self, query: dict[str, Any] | None = None) -> UsageReport:
        """GetUsage: the GPU use recorded in a range, grouped (query: since, until, by, user, name, unit, job, pod,
        device, limit as plain values, see usage_variants), filtered as the listings are: other users' records
        as the caller may see them. errors.NotSupported when gpukilld keeps no accounting ([usage] enabled = no)."""
        from gpukill.records.usage import UsageReport

        (report,) = await self._call(
            "GetUsage", "a{sv}", [usage_variants(query or {})], timeout=CALL_TIMEOUT + 35.0
        )  # a month of records is read in a thread
        return from_plain(UsageReport, report)

    async def status(self) -> DaemonStatus:
        from gpukill.records.status import BackendStatus, SamplingStatus

        (props,) = await self._call("GetAll", "s", [INTERFACE], interface="org.freedesktop.DBus.Properties")
        sampling = props.get("Sampling")
        return DaemonStatus(
            version=props["Version"],
            sample_interval=props["SampleInterval"],
            backends=tuple(BackendStatus(n, bool(a), d) for n, a, d in props["Backends"]),
            sampling=from_plain(SamplingStatus, sampling) if isinstance(sampling, dict) else None,
        )

    # -- Guard Mode (org.gpukill1.Guard) ---------------------------------------------------------------

    async def _guard(
        self,
        member: str,
        signature: str = "",
        body: list | None = None,
        *,
        interactive: bool = False,
        timeout: float = CALL_TIMEOUT,
    ) -> list:
        return await self._call(
            member,
            signature,
            body,
            interface=GUARD_INTERFACE,
            interactive=interactive,
            timeout=timeout + (PROMPT_TIME if interactive else 0.0),
        )

    async def guard_status(self) -> GuardStatus:
        from gpukill.records.guard import GuardStatus

        (status,) = await self._guard("GetStatus")
        return from_plain(GuardStatus, status)

    async def guard_enable(self, enabled: bool = True, *, interactive: bool = False) -> None:
        await self._guard("Enable" if enabled else "Disable", interactive=interactive)

    async def guard_set_dry_run(self, dry_run: bool, *, interactive: bool = False) -> None:
        await self._guard("SetDryRun", "b", [dry_run], interactive=interactive)

    async def guard_load_policy(self, name: str, text: str, *, interactive: bool = False) -> PolicyLoaded:
        """Make the policy the one in force; errors.InvalidPolicy when it is invalid."""
        from gpukill.records.guard import PolicyLoaded

        (result,) = await self._guard("LoadPolicy", "ss", [name, text], interactive=interactive)
        return from_plain(PolicyLoaded, result)

    async def guard_test(self, name: str = "", text: str = "") -> list[Decision]:
        """What a policy (text "": the one in force) would do with the current snapshot; never acts."""
        from gpukill.records.guard import Decision

        (decisions,) = await self._guard("TestPolicies", "ss", [name, text], timeout=CALL_TIMEOUT + 15.0)
        return [from_plain(Decision, d) for d in decisions]

    async def guard_postpone(
        self, pid: int, start_time: int, seconds: float, reason: str = "", *, interactive: bool = False
    ) -> PostponeAnswer:
        """Ask for `seconds` more before a Guard kill rule stops (pid, start_time): per kill rule whose grace
        runs on it, what was granted within its caps, or why nothing was."""
        from gpukill.records.guard import PostponeAnswer

        (result,) = await self._guard(
            "Postpone", "utds", [pid, start_time, float(seconds), reason], interactive=interactive
        )
        return from_plain(PostponeAnswer, result)

    # -- the managed user, group and GPU policies (files gpukilld keeps in guard.d) -----------------------

    async def guard_list_policies(self) -> list[ManagedPolicyEntry]:
        from gpukill.records.guard import ManagedPolicyEntry

        (policies,) = await self._guard("ListPolicies")
        return [from_plain(ManagedPolicyEntry, p) for p in policies]

    async def guard_set_policy(
        self, kind: str, target: str, settings: dict[str, Any], *, interactive: bool = False
    ) -> ManagedPolicyEntry:
        """Create or replace the kind's policy for target (settings: memory_limit, utilization_limit,
        process_limit, allowed_users, reserved_memory, grace as plain values); errors.InvalidArgs for a setting
        the daemon cannot take, errors.InvalidPolicy when guard.d with it does not validate."""
        from gpukill.records.guard import ManagedPolicyEntry

        (policy,) = await self._guard(
            "SetPolicy", "ssa{sv}", [kind, target, policy_settings(settings)], interactive=interactive
        )
        return from_plain(ManagedPolicyEntry, policy)

    async def guard_remove_policy(self, kind: str, target: str, *, interactive: bool = False) -> None:
        await self._guard("RemovePolicy", "ss", [kind, target], interactive=interactive)

    async def guard_export_policies(self) -> str:
        (text,) = await self._guard("ExportPolicies")
        return text

    async def guard_import_policies(
        self, name: str, text: str, *, replace: bool = False, interactive: bool = False
    ) -> list[ManagedPolicyEntry]:
        """All or nothing; replace: the managed policies the text does not name are removed."""
        from gpukill.records.guard import ManagedPolicyEntry

        (policies,) = await self._guard("ImportPolicies", "ssb", [name, text, replace], interactive=interactive)
        return [from_plain(ManagedPolicyEntry, p) for p in policies]
