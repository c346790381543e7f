"""The records gpukilld hands out, each declared once: its fields, their D-Bus signatures and what they mean.

Everything else is derived from these declarations: the daemon's a{sv} marshalling (gpukilld/bus/wire.py), the
client's typed records (gpukillctl/client/dbus.py builds these same classes from what it receives), `list --json`
and the JSON the policy sandbox exchanges with its child (`to_plain` / `from_plain` here). A device field is
one edit here plus its documentation (the JSON section of docs/using.md, dbus/org.gpukill1.xml): the daemon
holds these Devices, and its backends' DeviceReading is derived from them. The daemon's GpuProcess is this Process with
the system unit added; a process field is one edit here plus its documentation and where it is read (ProcInfo
from /proc, or a backend's ProcessUsage); tests/test_records.py checks they agree.

On the bus a record is an a{sv}. A value nobody could read is None and left out, never sent as 0; a field
declared `omit_empty` is also left out when empty ("", (), False): shared_usage is there only when true.
A client fills what was left out with the field's default. The plain (JSON) form has every field, null
where left out (false for a flag); a map keyed by name (memory_regions, notifications) keeps the bus's
shape: its entries carry only the values that are known.

Types: "q", "u", "t" are int; "d" float; "b" bool; "s" str; "as"/"au"/"aq" tuples; "aa{sv}" a tuple of records;
"a{sv}" one record, or with `key` a tuple of records keyed by that field (the entries as a{sv} variants);
"a{sa{sT}}" likewise, each entry an a{sT} of the record's values.

Split by who needs them, and loaded on first use: a frozen, slotted dataclass generates and compiles its methods
when its class statement runs (~0.35 ms each), and a one-shot `gpukillctl list` needs 3 of the 24 records. So
`from gpukill.records import X` (or `records.X`) imports X's module the first time X is asked for; the
declaring modules are base (wire() and the plain form), manager (the listings': devices, processes, memory regions),
status (the Manager's others: a reset's reply, backends, sampling), audit, guard, signals, usage and reclaim
(a kill's answer: the memory back or who holds it).
tests/test_records_lazy.py checks that _HOME names every public name of those modules.
"""

from __future__ import annotations

from typing import Any

from .base import Wire, from_plain, known_values, left_out, names, specs, to_plain, wire

# The module that declares each public name, but base's (imported above).
_HOME: dict[str, str] = {
    **dict.fromkeys(("STATE_OK", "STATE_LOST", "STATE_ERROR", "Device", "MemoryRegion", "Process", "find_device"),
                    "manager"),
    **dict.fromkeys(("ResetReply", "BackendStatus", "SAMPLING_EVENTS", "SAMPLING_POLLING", "SamplingStatus"),
                    "status"),
    **dict.fromkeys(("FINDING_MINER", "FINDING_ABUSER", "FINDING_IDLE", "FINDING_KINDS", "MAX_SCORE", "Evidence",
                     "Finding", "DEFAULT_POOL_PORTS", "AUDIT_DURATIONS", "AuditSettings"), "audit"),
    **dict.fromkeys(("RuleStatus", "RecentEvent", "Window", "Grace", "NotificationCounters", "GuardStatus",
                     "Decision", "ViolationDetails", "PolicyLoaded", "ManagedPolicyEntry"), "guard"),
    **dict.fromkeys(("ProcessKilled", "DeviceReset", "DeviceStateChanged", "PolicyViolated", "GuardActionTaken",
                     "SnapshotChanged", "NO_UID", "Notification", "SIGNALS", "SIGNAL_OF", "Event",
                     "signal_record"), "signals"),
    **dict.fromkeys(("USAGE_BY", "ENDED_LIVE", "ENDED_EXITED", "ENDED_LEFT", "ENDED_DAEMON_DOWN", "UsageRecord",
                     "UsageRow", "UsageReport"), "usage"),
    **dict.fromkeys(("RECLAIMED", "HELD", "STUCK", "ALIVE", "UNWATCHED", "VERDICTS", "DESCENDANT", "ORPHAN",
                     "SAME_UNIT", "SAME_CONTAINER", "SAME_POD", "SAME_JOB", "MAX_HOLDERS", "Holder", "Reclaim",
                     "WorkloadEntry", "WorkloadReply", "KillReport", "KILL_PROCESS", "KILL_TREE", "KILL_UNIT",
                     "KILL_SCOPES"), "reclaim"),
}

__all__ = ["Wire", "from_plain", "known_values", "left_out", "names", "specs", "to_plain", "wire", *_HOME]


def __getattr__(name: str) -> Any:
    """A record (or constant) of a module not imported yet: import it, and keep the name here for next time."""
    home = _HOME.get(name)
    # plain import statements, not importlib: tests/test_imports.py's graph and `python -X importtime` see them
    if home == "manager":
        from . import manager as module
    elif home == "status":
        from . import status as module
    elif home == "audit":
        from . import audit as module
    elif home == "guard":
        from . import guard as module
    elif home == "signals":
        from . import signals as module
    elif home == "usage":
        from . import usage as module
    elif home == "reclaim":
        from . import reclaim as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
