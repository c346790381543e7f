"""What gpukilld announces: one record per signal, its fields in the order of the signal's arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import from_plain, names, wire
from .guard import ViolationDetails
from .reclaim import UNWATCHED, Reclaim
from .suspend import SuspendedProcess


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
    # the last argument, added with the watch of the GPU: an older daemon's 8-argument signal has none
    reclaim: Reclaim = wire(
        "a{sv}", "the GPU's answer: memory reclaimed, held by whom, or stuck and why", Reclaim(UNWATCHED), of=Reclaim
    )


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
    action: str = wire("s", '"kill", "suspend", "notify" or "log"')
    dry_run: bool = wire("b", "nothing will be signalled")
    details: ViolationDetails = wire("a{sv}", "scope, reason, grace, uid, pids, time", of=ViolationDetails)


@dataclass(frozen=True, slots=True)
class GuardActionTaken:
    """org.gpukill1.Guard.GuardActionTaken: a Guard kill ended, would have happened, or was called off."""

    rule: str = wire("s", "the rule's name")
    subject: str = wire("s", "the process, user or device")
    action: str = wire("s", '"kill" or "suspend" (its outcome "suspended", "would-suspend" or a refusal)')
    pid: int = wire("u", "the process (0 for a cancelled grace)")
    start_time: int = wire("t", "its start time")
    outcome: str = wire("s", 'an outcome, "would-kill", "cancelled", or the refusal ("protected", ...)')
    dry_run: bool = wire("b", "nothing was signalled")


@dataclass(frozen=True, slots=True)
class SnapshotChanged:
    """org.gpukill1.Manager.SnapshotChanged: what the listings show changed with this sample; list again."""

    generation: int = wire("t", "the sample's number, growing while the daemon runs (a restart starts again)")


@dataclass(frozen=True, slots=True)
class ReclaimPending:
    """org.gpukill1.Guard.ReclaimPending: a kill rule's grace began, or was postponed; the process is stopped at
    the deadline unless its subject comes back under the rule (or its owner asks for more time: Postpone)."""

    pid: int = wire("u", "the process")
    start_time: int = wire("t", "its start time, clock ticks since boot")
    uid: int = wire("u", "its owner")
    unit: str = wire("s", 'its systemd unit, "" where none is known')
    rule: str = wire("s", "the kill rule's name")
    deadline: int = wire("t", "when the grace ends, seconds since the epoch")


@dataclass(frozen=True, slots=True)
class ProcessSuspended:
    """org.gpukill1.Manager.ProcessSuspended: a process of a workload was suspended (its GPU memory set aside)."""

    process: SuspendedProcess = wire("a{sv}", "the process as ListSuspended lists it", of=SuspendedProcess)
    caller_uid: int = wire("u", "who asked (0 for the daemon itself)")


@dataclass(frozen=True, slots=True)
class ProcessResumed:
    """org.gpukill1.Manager.ProcessResumed: a resume of a process ended: state "running", or "stuck" and why."""

    process: SuspendedProcess = wire(
        "a{sv}", "the process, its state and, when stuck, error and remedy", of=SuspendedProcess
    )
    caller_uid: int = wire("u", "who asked (0 for the daemon itself)")


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
    ("org.gpukill1.Manager", "SnapshotChanged"): SnapshotChanged,
    ("org.gpukill1.Manager", "ProcessSuspended"): ProcessSuspended,
    ("org.gpukill1.Manager", "ProcessResumed"): ProcessResumed,
    ("org.gpukill1.Guard", "PolicyViolated"): PolicyViolated,
    ("org.gpukill1.Guard", "GuardActionTaken"): GuardActionTaken,
    ("org.gpukill1.Guard", "Notification"): Notification,
    ("org.gpukill1.Guard", "ReclaimPending"): ReclaimPending,
}
# And the other way round: the (interface, member) a record was sent as.
SIGNAL_OF: dict[type, tuple[str, str]] = {cls: key for key, cls in SIGNALS.items()}
Event = (
    ProcessKilled
    | DeviceReset
    | DeviceStateChanged
    | SnapshotChanged
    | ProcessSuspended
    | ProcessResumed
    | PolicyViolated
    | GuardActionTaken
    | Notification
    | ReclaimPending
)


def signal_record(interface: str, member: str, args: list[Any]) -> Any:
    """The record of a signal from its arguments (variants unwrapped), or None when it is not one of ours or
    its arguments do not fit the declaration (a newer daemon's signal, or not gpukilld's)."""
    cls = SIGNALS.get((interface, member))
    if cls is None:
        return None
    keys = names(cls)
    if cls is ProcessKilled and len(args) == len(keys) - 1:
        keys = keys[:-1]  # an older gpukilld's, without the reclaim: its default stands
    elif cls is ProcessKilled and len(args) == len(keys) and not isinstance(args[-1], dict):
        return None  # a reclaim that is no record: not gpukilld's signal
    if len(args) != len(keys):
        return None
    try:  # a value of the wrong type is left out by from_plain, and every signal field is required
        return from_plain(cls, dict(zip(keys, args, strict=True)))
    except TypeError:
        return None
