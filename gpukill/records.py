"""The records gpukilld hands out, each declared once: its fields, their D-Bus signatures and what they mean.

Everything else is derived from these declarations: the daemon's a{sv} marshalling (gpukilld/wire.py), the
client's typed records (gpukillctl/client.py builds these same classes from what it receives), `list --json`
and the JSON the policy sandbox exchanges with its child (`to_plain` / `from_plain` here). A device field is
one edit here plus its documentation (README's JSON section, dbus/org.gpukill1.xml): the daemon holds these
Devices, and its backends' DeviceReading is derived from them. The daemon's GpuProcess is this Process with
the system unit added; a process field is one edit here plus its documentation and where it is read (ProcInfo
from /proc, or a backend's ProcessUsage); tests/test_records.py checks they agree.

On the bus a record is an a{sv}. A value nobody could read is None and left out, never sent as 0; a field
declared `omit_empty` is also left out when empty ("", (), False): shared_usage is there only when true.
A client fills what was left out with the field's default. The plain (JSON) form has every field, null
where left out (false for a flag); a map keyed by name (memory_regions, notifications) keeps the bus's
shape: its entries carry only the values that are known.

Types: "u", "t" are int; "d" float; "b" bool; "s" str; "as"/"au" tuples; "aa{sv}" a tuple of records;
"a{sv}" one record, or with `key` a tuple of records keyed by that field (the entries as a{sv} variants);
"a{sa{sT}}" likewise, each entry an a{sT} of the record's values.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

STATE_OK = "ok"
STATE_LOST = "lost"  # the device stopped answering (fell off the bus, GPU_IS_LOST, a hung driver call)
STATE_ERROR = "error"  # answering, but the driver reported a critical error (an Xid): it needs attention

_REQUIRED: Any = dataclasses.MISSING


@dataclass(frozen=True, slots=True)
class Wire:
    """How one field travels: its D-Bus signature, its meaning, and when it is left out."""

    sig: str
    doc: str
    omit_empty: bool = False  # left out when empty or false too, not only when None
    of: type | None = None  # the record type of a nested record, list or keyed map
    key: str | None = None  # for a keyed map: the field of `of` whose value is the key


def wire(sig: str, doc: str, default: Any = _REQUIRED, *, omit_empty: bool = False, of: type | None = None,
         key: str | None = None) -> Any:
    """A dataclass field that travels on the bus with this signature."""
    return field(default=default, metadata={"wire": Wire(sig, doc, omit_empty, of, key)})


@functools.cache
def specs(cls: type) -> tuple[tuple[str, Wire], ...]:
    """The record's fields in order, each with how it travels. A field declared without wire() (the daemon's
    GpuProcess.system_unit) is not on the bus, nor in the plain form."""
    return tuple((f.name, f.metadata["wire"]) for f in dataclasses.fields(cls) if "wire" in f.metadata)


def names(cls: type) -> tuple[str, ...]:
    """The record's keys, in the order of the bus and of JSON."""
    return tuple(name for name, _ in specs(cls))


def left_out(spec: Wire, value: Any) -> bool:
    """Whether the value is left out of the record on the bus."""
    return value is None or (spec.omit_empty and not value)


# -- the plain form: JSON, and what the client holds once the variants are unwrapped -------------------------


def to_plain(record: Any) -> dict[str, Any]:
    """Every field in order, JSON-ready: null where the bus leaves the value out (false for a flag)."""
    out: dict[str, Any] = {}
    for name, spec in specs(type(record)):
        value = getattr(record, name)
        if left_out(spec, value):
            out[name] = False if value is False else None
        else:
            out[name] = _plain_value(spec, value)
    return out


def _plain_value(spec: Wire, value: Any) -> Any:
    if spec.of is None:
        return list(value) if isinstance(value, tuple) else value
    if spec.key is not None:
        return {getattr(entry, spec.key): known_values(entry, spec.key) for entry in value}
    if spec.sig == "aa{sv}":
        return [to_plain(entry) for entry in value]
    return to_plain(value)


def known_values(record: Any, key: str | None = None) -> dict[str, Any]:
    """A keyed map's entry: the record's values that are not left out, but its key."""
    return {name: _plain_value(spec, value) for name, spec in specs(type(record))
            if name != key and not left_out(spec, value := getattr(record, name))}


def from_plain(cls: type, data: dict[str, Any]) -> Any:
    """The record from a plain dict (JSON, or an a{sv} with its variants unwrapped). Keys it does not
    declare are ignored (a newer daemon may send more); a value of the wrong type counts as left out."""
    values = {}
    for name, spec in specs(cls):
        value = _from_plain_value(spec, data.get(name))
        if value is not None:
            values[name] = value
    return cls(**values)


def _from_plain_value(spec: Wire, value: Any) -> Any:
    if value is None:
        return None
    if spec.of is None:
        return _scalar(spec.sig, value)
    if spec.key is not None:
        if not isinstance(value, dict):
            return None
        return tuple(from_plain(spec.of, {**entry, spec.key: k}) for k, entry in value.items()
                     if isinstance(k, str) and isinstance(entry, dict))
    if spec.sig == "aa{sv}":
        if not isinstance(value, list | tuple):
            return None
        return tuple(from_plain(spec.of, e) for e in value if isinstance(e, dict))
    return from_plain(spec.of, value) if isinstance(value, dict) else None


_INT_RANGE = {"u": 1 << 32, "t": 1 << 64}


def _scalar(sig: str, value: Any) -> Any:
    """The value as its signature's Python type, or None when it is not one."""
    if sig in ("as", "au"):
        if not isinstance(value, list | tuple):
            return None
        items = [_scalar(sig[1], v) for v in value]
        return None if None in items else tuple(items)
    if sig == "b":
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):
        return None
    if sig == "s":
        return value if isinstance(value, str) else None
    if sig == "d":
        return float(value) if isinstance(value, int | float) else None
    if sig in _INT_RANGE:
        return value if isinstance(value, int) and 0 <= value < _INT_RANGE[sig] else None
    raise ValueError(f"no plain form for signature {sig!r}")


# -- Manager: devices and processes ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Device:
    """A GPU as ListDevices reports it. The daemon holds these in its snapshot (gpukilld/model.py)."""

    index: int = wire("u", "global index across vendors, stable while the daemon runs")
    id: str = wire("s", "stable id: the UUID where the vendor has one, else the PCI address")
    backend: str = wire("s", "the backend that reads it (nvidia, drm, simulated)")
    vendor: str = wire("s", "nvidia, amd, intel, ...")
    name: str = wire("s", "the product name")
    pci_bus_id: str | None = wire("s", "PCI address", None)
    utilization: float | None = wire("d", "percent", None)
    memory_used: int | None = wire("t", "bytes", None)
    memory_total: int | None = wire("t", "bytes", None)
    temperature: float | None = wire("d", "degrees Celsius", None)
    power: float | None = wire("d", "watts", None)
    state: str = wire("s", '"ok"; "lost": not answering; "error": answering but with a critical driver error',
                      STATE_OK)
    state_reason: str = wire("s", "why it is not ok", "", omit_empty=True)
    power_limit: float | None = wire("d", "watts, the enforced limit", None)
    mig_mode: bool | None = wire("b", "NVIDIA Multi-Instance GPU mode; None where the device has none", None)
    parent_id: str | None = wire("s", "for a partition (a MIG instance): the id of its physical GPU", None)
    clock_mhz: float | None = wire("d", "current graphics clock, MHz", None)


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A process's GPU memory in one region (vram, gtt, system0, ...), as DRM fdinfo or KFD report it."""

    name: str = wire("s", "the region as the driver names it (the key of memory_regions)")
    total: int | None = wire("t", "bytes: every buffer created in the region, backed or not", None)
    resident: int | None = wire("t", "bytes: buffers whose backing store is present", None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Process:
    """A process on a GPU as ListProcesses reports it: one record per (process, device), flat.

    The daemon's GpuProcess (gpukilld/model.py) is this record and the system unit, which is not on the bus."""

    pid: int = wire("u", "process id")
    start_time: int = wire("t", "field 22 of /proc/PID/stat, clock ticks since boot: pass it to KillProcess")
    uid: int = wire("u", "the owner's uid")
    user: str = wire("s", "the owner's name")
    comm: str = wire("s", "the process name")
    cmdline: str = wire("s", "arguments joined by spaces, at most 4096 bytes")
    exe: str | None = wire("s", "the executable's path", None)
    device: int = wire("u", "the device's global index")
    device_id: str = wire("s", "the device's id")
    gpu_memory: int | None = wire("t", "bytes of GPU memory", None)
    gpu_utilization: float | None = wire("d", "percent", None)
    unit: str | None = wire("s", "innermost systemd .service or .scope", None)
    container_id: str | None = wire("s", "docker, podman, containerd, cri-o", None)
    pod_uid: str | None = wire("s", "Kubernetes pod UID", None)
    slurm_job: str | None = wire("s", "Slurm job id", None)
    container_pid: int | None = wire("u", "PID inside the innermost PID namespace, from NSpid", None)
    memory_regions: tuple[MemoryRegion, ...] = wire(
        "a{sa{st}}", "GPU memory per region: region -> {total, resident}, each where known", (),
        omit_empty=True, of=MemoryRegion, key="name")
    # Some of its usage is through a GPU context that processes of other users hold too (a DRM fd passed
    # over a socket): that part is charged to no one, so gpu_memory and gpu_utilization cover only the rest.
    shared_usage: bool = wire("b", "part of its usage is charged to no one (present when true)", False,
                              omit_empty=True)


@dataclass(frozen=True, slots=True)
class ResetReply:
    """What ResetDevice returns."""

    device: int = wire("u", "the device's global index")
    device_id: str = wire("s", "the device's id")
    message: str = wire("s", "the backend's text")
    killed: tuple[int, ...] = wire("au", "PIDs killed first (reset with force)", ())


@dataclass(frozen=True, slots=True)
class BackendStatus:
    """One entry of the Backends property, a (sbs) struct."""

    name: str = wire("s", "the backend's name")
    available: bool = wire("b", "whether it reads devices")
    detail: str = wire("s", "why it is unavailable, or a one-line summary (driver version, device count)")


# -- Audit (AuditRogue) ----------------------------------------------------------------------------------

FINDING_MINER = "miner"  # a crypto miner: its name, command line, executable or connections
FINDING_ABUSER = "abuser"  # a user holding far more GPU memory or time than the others over a window
FINDING_IDLE = "idle"  # GPU memory held at 0% utilization longer than a threshold (a forgotten notebook)
FINDING_KINDS = (FINDING_MINER, FINDING_ABUSER, FINDING_IDLE)
MAX_SCORE = 100


@dataclass(frozen=True, slots=True)
class Evidence:
    """One rule of the audit's table that matched a finding's subject (the table: gpukilld/rogue.py)."""

    rule: str = wire("s", "the rule's name in the table (miner-name, stratum-url, exe-tmp, ...)")
    points: int = wire("u", "what it adds to the finding's score")
    detail: str = wire("s", "what was seen, at most 256 characters (a process chose part of it: escape it)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """What AuditRogue reports for one process (miner, idle) or one user (abuser), as the caller may see it."""

    kind: str = wire("s", '"miner", "abuser" or "idle"')
    score: int = wire("u", "its evidence's points added up, at most 100")
    uid: int = wire("u", "the user concerned")
    user: str = wire("s", "the user's name")
    pid: int | None = wire("u", "the process; left out for a user's finding (abuser)", None)
    start_time: int | None = wire("t", "the process's start time, clock ticks since boot (for KillProcess)", None)
    comm: str = wire("s", "the process name as the caller may see it", "", omit_empty=True)
    devices: tuple[int, ...] = wire("au", "the global indexes of the devices concerned", ())
    gpu_memory: int | None = wire("t", "bytes of GPU memory the process (or user) holds now", None)
    evidence: tuple[Evidence, ...] = wire("aa{sv}", "why: the rules that matched, each with its points", (),
                                          of=Evidence)


# -- Guard ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleStatus:
    """A rule of the policy in force with its counters (GetStatus rules)."""

    name: str = wire("s", "the rule's name")
    description: str = wire("s", "the rule's description", "")
    action: str = wire("s", "kill, notify, log or reset")
    scope: str = wire("s", "per_process, per_user or per_device")
    match: str = wire("s", "all or any of the conditions", "all")
    conditions: tuple[str, ...] = wire("as", "each condition as text", ())
    triggers: int = wire("t", "violations: a subject starting to violate the rule", 0)
    kills: int = wire("t", "processes signalled", 0)
    would_kill: int = wire("t", "processes a dry run would have signalled", 0)
    cancelled: int = wire("t", "violations that ended within the grace period", 0)
    failed: int = wire("t", "kills the kill path refused, resets the reset path refused or that failed", 0)
    resets: int = wire("t", "devices reset (action reset)", 0)
    would_reset: int = wire("t", "device resets a dry run would have made", 0)
    last_triggered: float = wire("d", "seconds since the epoch, 0 never", 0.0)


@dataclass(frozen=True, slots=True)
class RecentEvent:
    """A recent guard event (GetStatus recent, newest last)."""

    time: float = wire("d", "seconds since the epoch", 0.0)
    rule: str = wire("s", "the rule's name", "")
    subject: str = wire("s", "the process, user or device concerned", "")
    uid: int | None = wire("u", "the user concerned, where one is", None)
    event: str = wire("s", '"violation", "action" or "cancelled"', "")
    action: str = wire("s", "the rule's action", "")
    outcome: str = wire("s", "the kill's outcome or refusal, \"\" for a violation", "")
    pid: int | None = wire("u", "the process, where one is concerned", None)
    dry_run: bool = wire("b", "nothing was signalled", False)


@dataclass(frozen=True, slots=True)
class Window:
    """A subject inside a condition's duration window (GetStatus windows)."""

    rule: str = wire("s", "the rule's name")
    subject: str = wire("s", "the process, user or device")
    uid: int | None = wire("u", "the user concerned, where one is", None)
    condition: str = wire("s", "the condition as text", "")
    elapsed: float = wire("d", "seconds it has held", 0.0)
    duration: float = wire("d", "seconds it must hold", 0.0)


@dataclass(frozen=True, slots=True)
class Grace:
    """A subject violating a kill rule, still inside its grace period (GetStatus graces)."""

    rule: str = wire("s", "the rule's name")
    subject: str = wire("s", "the process, user or device")
    uid: int | None = wire("u", "the user concerned, where one is", None)
    remaining: float = wire("d", "seconds left", 0.0)


@dataclass(frozen=True, slots=True)
class NotificationCounters:
    """One notification channel's counters (GetStatus notifications, keyed by channel)."""

    channel: str = wire("s", "email or webhook (the key of notifications)")
    queued: int = wire("t", "notices queued", 0)
    delivered: int = wire("t", "notices delivered", 0)
    failed: int = wire("t", "notices that could not be delivered", 0)
    dropped: int = wire("t", "notices dropped, the queue being full", 0)


@dataclass(frozen=True, slots=True)
class GuardStatus:
    """What GetStatus returns: the switches, the policy in force, its rules and what is running now."""

    enabled: bool = wire("b", "the guard evaluates the policy")
    dry_run: bool = wire("b", "set by SetDryRun: nothing is signalled")
    policy_dry_run: bool = wire("b", "set in the policy: nothing is signalled")
    source: str = wire("s", '"files" (guard.d) or "loaded" (LoadPolicy)')
    files: tuple[str, ...] = wire("as", "the policy's files or name", ())
    policy_error: str = wire("s", 'why the files were last rejected, or ""', "")
    rules: tuple[RuleStatus, ...] = wire("aa{sv}", "the rules in force, with their counters", (),
                                         of=RuleStatus)
    recent: tuple[RecentEvent, ...] = wire("aa{sv}", "recent events, newest last", (), of=RecentEvent)
    windows: tuple[Window, ...] = wire("aa{sv}", "subjects inside a duration window", (), of=Window)
    graces: tuple[Grace, ...] = wire("aa{sv}", "subjects inside a grace period", (), of=Grace)
    evaluations: int = wire("t", "evaluations since the daemon started", 0)
    last_eval_ms: float = wire("d", "milliseconds the last evaluation took", 0.0)
    max_eval_ms: float = wire("d", "milliseconds the slowest evaluation took", 0.0)
    notifications: tuple[NotificationCounters, ...] = wire(
        "a{sv}", "counters per notification channel", (), of=NotificationCounters, key="channel")
    recent_more: int | None = wire("u", "recent events left out past the first 200", None)
    windows_more: int | None = wire("u", "windows left out past the first 200", None)
    graces_more: int | None = wire("u", "graces left out past the first 200", None)


@dataclass(frozen=True, slots=True)
class Decision:
    """What TestPolicies reports for one rule and subject; nothing is ever done for it."""

    rule: str = wire("s", "the rule's name")
    subject: str = wire("s", "the process, user or device")
    action: str = wire("s", "the rule's action")
    status: str = wire("s", '"now", "waiting", "in-flight", "exempt"; "truncated": the count of the rest')
    wait: float = wire("d", "seconds of duration, grace or cooldown still to run", 0.0)
    pids: tuple[int, ...] = wire("au", "what would be signalled", ())
    reason: str = wire("s", "why, at most 512 characters", "")
    more: int | None = wire("u", "with status truncated: how many decisions were left out", None)


@dataclass(frozen=True, slots=True)
class ViolationDetails:
    """The details of a PolicyViolated signal."""

    scope: str = wire("s", "the rule's scope")
    reason: str = wire("s", "why the subject violates the rule")
    grace: float = wire("d", "the rule's grace period, seconds")
    uid: int | None = wire("u", "the user concerned, where one is", None)
    pids: tuple[int, ...] = wire("au", "for kill: the processes that would be stopped now", ())
    time: float = wire("d", "seconds since the epoch", 0.0)


@dataclass(frozen=True, slots=True)
class PolicyLoaded:
    """What LoadPolicy returns."""

    source: str = wire("s", '"loaded"')
    rules: tuple[str, ...] = wire("as", "the rule names now in force", ())


# -- Signals: what gpukilld announces, one record per signal, fields in the order of its arguments -----------


@dataclass(frozen=True, slots=True)
class ProcessKilled:
    """org.gpukill1.Manager.ProcessKilled: a kill finished."""

    pid: int = wire("u", "the process")
    start_time: int = wire("t", "its start time, clock ticks since boot")
    uid: int = wire("u", "its owner")
    comm: str = wire("s", "its name (the process chose it: escape before showing)")
    devices: tuple[str, ...] = wire("as", "the ids of the devices it used")
    outcome: str = wire("s", '"terminated", "killed" or "still-alive" (gpukill.outcome)')
    caller_uid: int = wire("u", "who asked (0 for the daemon itself: a reset with force, a Guard rule)")
    initiator: str = wire("s", '"user" (a KillProcess call), "reset", or "guard:RULE"')


@dataclass(frozen=True, slots=True)
class DeviceReset:
    """org.gpukill1.Manager.DeviceReset: a reset was attempted."""

    index: int = wire("u", "the device's global index")
    id: str = wire("s", "the device's id")
    success: bool = wire("b", "whether the device was reset")
    message: str = wire("s", "the backend's text, or why it failed")
    killed: tuple[int, ...] = wire("au", "PIDs killed first (reset with force)")


@dataclass(frozen=True, slots=True)
class DeviceStateChanged:
    """org.gpukill1.Manager.DeviceStateChanged: a device became lost, erroneous or ok again."""

    index: int = wire("u", "the device's global index")
    id: str = wire("s", "the device's id")
    state: str = wire("s", '"ok", "lost" or "error"')
    reason: str = wire("s", "why, where known")


@dataclass(frozen=True, slots=True)
class PolicyViolated:
    """org.gpukill1.Guard.PolicyViolated: a rule started to hold for a subject (after its durations)."""

    rule: str = wire("s", "the rule's name")
    subject: str = wire("s", "the process, user or device it holds for")
    action: str = wire("s", '"kill", "notify" or "log"')
    dry_run: bool = wire("b", "nothing will be signalled")
    details: ViolationDetails = wire("a{sv}", "scope, reason, grace, uid, pids, time", of=ViolationDetails)


@dataclass(frozen=True, slots=True)
class GuardActionTaken:
    """org.gpukill1.Guard.GuardActionTaken: a Guard kill ended, would have happened, or was called off."""

    rule: str = wire("s", "the rule's name")
    subject: str = wire("s", "the process, user or device")
    action: str = wire("s", '"kill"')
    pid: int = wire("u", "the process (0 for a cancelled grace)")
    start_time: int = wire("t", "its start time")
    outcome: str = wire("s", 'an outcome, "would-kill", "cancelled", or the refusal ("protected", ...)')
    dry_run: bool = wire("b", "nothing was signalled")


NO_UID = 0xFFFFFFFF  # Notification's uid when the notice concerns no one user (a device)


@dataclass(frozen=True, slots=True)
class Notification:
    """org.gpukill1.Guard.Notification: a rule's "desktop" notice, for the user it concerns."""

    uid: int = wire("u", "the user concerned; NO_UID (4294967295) for none")
    rule: str = wire("s", "the rule's name")
    summary: str = wire("s", "one line")
    body: str = wire("s", "the notice's text")


# Every signal by (interface, member), as dbus/org.gpukill1.xml declares them.
SIGNALS: dict[tuple[str, str], type] = {
    ("org.gpukill1.Manager", "ProcessKilled"): ProcessKilled,
    ("org.gpukill1.Manager", "DeviceReset"): DeviceReset,
    ("org.gpukill1.Manager", "DeviceStateChanged"): DeviceStateChanged,
    ("org.gpukill1.Guard", "PolicyViolated"): PolicyViolated,
    ("org.gpukill1.Guard", "GuardActionTaken"): GuardActionTaken,
    ("org.gpukill1.Guard", "Notification"): Notification,
}
# And the other way round: the (interface, member) a record was sent as.
SIGNAL_OF: dict[type, tuple[str, str]] = {cls: key for key, cls in SIGNALS.items()}
Event = ProcessKilled | DeviceReset | DeviceStateChanged | PolicyViolated | GuardActionTaken | Notification


def signal_record(interface: str, member: str, args: list[Any]) -> Any:
    """The record of a signal from its arguments (variants unwrapped), or None when it is not one of ours or
    its arguments do not fit the declaration (a newer daemon's signal, or not gpukilld's)."""
    cls = SIGNALS.get((interface, member))
    if cls is None or len(args) != len(names(cls)):
        return None
    try:  # a value of the wrong type is left out by from_plain, and every signal field is required
        return from_plain(cls, dict(zip(names(cls), args, strict=True)))
    except TypeError:
        return None
