"""The condition types a Guard rule may use, each declared once: the one place a type is added or changed.

A ConditionType says what the parser checks (the kind of value, the operators, the scopes and the type's role
in each, why it does not fit the others), what the engine reads (an attribute of the subject it tests, or a
small function), how a value read is written in reasons, and how the engine may take shortcuts (lower
bounds, grouping by value) and choose victims (largest first by memory or utilization). gpukill.policy
validates from it, gpukilld.guard.conditions compiles from it, and docs/guard.md's condition table lists it
(tests/test_condition_types.py checks all three against it).

Readers name attributes of the views the daemon builds of a snapshot (gpukilld.guard.conditions: ProcView,
PeopleView for a user or a group, DeviceView) without importing them: this package never imports the daemon.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .device_faults import recovery_action
from .records.audit import FINDING_IDLE, FINDING_MINER
from .rules import PER_DEVICE, PER_GROUP, PER_PROCESS, PER_USER, SELECTOR, SUBJECT, Condition
from .units import format_duration, format_size

# Kinds: how a value is written in a policy, so how the parser reads it and the engine compares it. User and
# group conditions are decided on a subject's (uid, user name) (a group subject: on its name); an index on
# whether the subject is on that GPU (a process: any of its GPUs); the others on the value their reader reads.
STRING, USER, GROUP, INDEX = "string", "user", "group", "index"
PERCENT, CELSIUS, SIZE, DURATION, COUNT = "percent", "celsius", "size", "duration", "count"  # compared as numbers
KINDS = (STRING, USER, GROUP, INDEX, PERCENT, CELSIUS, SIZE, DURATION, COUNT)
MAX_COUNT = 1_000_000  # a count of processes compared with more than this is a typo, not a limit
MAX_INDEX = 1023  # GPU indexes a policy may name (no machine has more devices)

STRING_OPS = ("==", "!=", "in", "not_in", "contains_any", "matches")
USER_OPS = ("==", "!=", "in", "not_in", "matches")
GROUP_OPS = ("==", "!=", "in", "not_in")
INDEX_OPS = ("==", "!=")
NUMBER_OPS = (">", ">=", "<", "<=", "==", "!=")
OPERATORS = tuple(dict.fromkeys(STRING_OPS + USER_OPS + GROUP_OPS + NUMBER_OPS))
LIST_OPS = ("in", "not_in", "contains_any")  # operators whose value is a list

# The views a reader reads: a process (its devices summed), a user (the processes the rule counts, summed), a
# device, or a group (its members' processes the rule counts, summed). A condition reads the process where it
# selects processes, else the subject of the rule's scope.
ON_PROCESS, ON_USER, ON_DEVICE, ON_GROUP = "process", "user", "device", "group"
_SUBJECT_VIEW = {PER_PROCESS: ON_PROCESS, PER_USER: ON_USER, PER_DEVICE: ON_DEVICE, PER_GROUP: ON_GROUP}

# What "largest first" means when a per_user or per_device rule picks its victims; a rule whose conditions
# imply several orders takes the first of them here, and memory when they imply none.
BY_MEMORY, BY_UTILIZATION = "memory", "utilization"
VICTIM_ORDERS = (BY_MEMORY, BY_UTILIZATION)

Reader = str | Callable[[Any], Any]  # an attribute path (operator.attrgetter: "device.temperature") or a function


def view_of(scope: str, role: str) -> str:
    """The view a condition with this role in a rule of this scope reads."""
    return ON_PROCESS if role == SELECTOR else _SUBJECT_VIEW[scope]


def _percent(v: float) -> str:
    return f"{v:.0f}%"


def _celsius(v: float) -> str:
    return f"{v:g}°C"


@dataclass(frozen=True, slots=True)
class Share:
    """A value written as a percentage of a total ("90%"): how to read the subject's share, what it is of."""

    read: Reader  # the subject's value in percent of its total; None where either is unknown
    of: str  # as condition texts write it: "90% of the device's memory"


def _memory_share(d: Any) -> float | None:
    """A device view's memory in use, in percent of the device's total; unknown without both figures."""
    total = d.device.memory_total
    return None if d.memory_used is None or not total else d.memory_used * 100.0 / total


@dataclass(frozen=True, slots=True)
class ConditionType:
    name: str
    kind: str  # one of KINDS
    operators: tuple[str, ...]
    roles: dict[str, str]  # scope -> SUBJECT or SELECTOR; a scope missing here does not take the type
    reads: dict[str, Reader]  # view -> how the value is read there (every view the roles imply)
    # How a value read is written in reasons; None: reasons show the condition, never the text it matched
    # (a command line carries tokens, and PolicyViolated goes to every listener).
    printer: Callable[[Any], str] | None
    needs: str = ""  # why the type does not fit a scope it lacks
    # Views where the figure sums processes' usage, some of which may be charged to no one (the view's
    # `partial`): there it is a lower bound, enough to show a subject over a limit, never under one.
    lower_bound_on: tuple[str, ...] = ()
    indexed: bool = False  # few distinct values on a machine: the engine decides once per value
    victim_order: str | None = None  # one of VICTIM_ORDERS: the largest by it go first
    share: Share | None = None  # None: the type takes no percentage of a total
    values: tuple[str, ...] = ()  # the only values a policy may compare it with (a closed set); (): any
    # A device's health: a rule with such a condition looks at lost devices too (others only at present ones,
    # whose readings mean something).
    every_device: bool = False
    # The value reads what a caller who may not see all is not shown of another user's process (gpukilld/
    # visibility.py: the command line past its first word, the executable, a job id from the environment; the
    # audit's score and kind, added up from evidence such as those). Reasons shown to such a caller about
    # another user's subject name the condition, not its value or its text: "rogue_score withheld".
    withheld: bool = False
    # Scopes whose subjects this type names: there a rule needs a condition of it with == or in, and its subjects
    # are the values it names (per_group: the groups a group condition names, never every group of a machine).
    names: tuple[str, ...] = ()

    def reader(self, view: str, percent_of_total: bool = False) -> Callable[[Any], Any]:
        """How to read the value off a view: a C attrgetter where the reader is a name (no Python frame per
        subject when the engine filters thousands)."""
        how = self.share.read if self.share and percent_of_total else self.reads[view]
        return operator.attrgetter(how) if isinstance(how, str) else how

    def describe_for_others(self, cond: Condition, value: Any) -> str:
        """describe() as a caller who may not see all reads it of another user's subject (see `withheld`)."""
        return f"{self.name} withheld" if self.withheld else self.describe(cond, value)

    def describe(self, cond: Condition, value: Any) -> str:
        """The condition as a reason states it for a subject whose value is `value`: the value, then the
        condition it met ("gpu_utilization 99% > 95% for 5m"); "unknown" for a value the backend could not
        read; the condition alone for a type without a printer."""
        if self.printer is None:
            return cond.text
        return f"{self.name} {self.value_text(cond, value)} {cond.text.removeprefix(self.name + ' ')}"

    def value_text(self, cond: Condition, value: Any) -> str:
        """A value as reasons write it ("99%", "4.0 GiB"); "unknown" for None. Only for a type with a printer."""
        if value is None:
            return "unknown"
        if cond.percent_of_total:
            return _percent(value)
        if self.printer is None:
            raise TypeError(f"condition type {self.name} has no printer")
        return self.printer(value)


def _score(v: float) -> str:
    return f"{v:g}"


def _count(v: int) -> str:
    return str(v)


def _indexes(v: Any) -> str:
    """The GPUs a subject is on, as reasons write them ("0", "0,2")."""
    return ",".join(str(i) for i in sorted(v)) or "none"


def _device_index(d: Any) -> tuple[int, ...]:
    return (d.device.index,)


def _memory_free(d: Any) -> int | None:
    """A device view's memory not in use; unknown without both figures."""
    total = d.device.memory_total
    return None if d.memory_used is None or total is None else max(0, total - d.memory_used)


def _recovery_action(d: Any) -> str | None:
    """The recovery action the driver asked for with the device's last critical error (gpukill.device_faults)."""
    return recovery_action(d.device.state_reason)


# A device's state as gpukill.records declares it (STATE_OK, STATE_LOST, STATE_ERROR).
DEVICE_STATES = ("ok", "lost", "error")
_DEVICE_ONLY = {PER_DEVICE: SUBJECT}
_PROC_ROLES = {PER_PROCESS: SUBJECT, PER_USER: SELECTOR, PER_DEVICE: SELECTOR, PER_GROUP: SELECTOR}
_USER_ROLES = {PER_PROCESS: SUBJECT, PER_USER: SUBJECT, PER_DEVICE: SELECTOR, PER_GROUP: SELECTOR}
_GROUP_ROLES = {PER_PROCESS: SUBJECT, PER_USER: SUBJECT, PER_DEVICE: SELECTOR, PER_GROUP: SUBJECT}
_USER_ONLY = {PER_USER: SUBJECT}
_GROUP_ONLY = {PER_GROUP: SUBJECT}
# per_group: the group's total. Killing every member's process over a group-wide figure would be a disaster: the
# figure needs per_group, where only the largest processes go until the group is back under.
_GROUP_NEEDS = "{} sums the processes of a group's members: it needs scope per_group (with a group condition)"

CONDITION_TYPES: dict[str, ConditionType] = {
    t.name: t
    for t in (
        ConditionType("process_name", STRING, STRING_OPS, _PROC_ROLES, {ON_PROCESS: "comm"}, None, indexed=True),
        ConditionType("cmdline", STRING, STRING_OPS, _PROC_ROLES, {ON_PROCESS: "cmdline"}, None, withheld=True),
        ConditionType("exe", STRING, STRING_OPS, _PROC_ROLES, {ON_PROCESS: "exe"}, None, indexed=True, withheld=True),
        ConditionType("unit", STRING, STRING_OPS, _PROC_ROLES, {ON_PROCESS: "unit"}, None, indexed=True),
        ConditionType("container", STRING, STRING_OPS, _PROC_ROLES, {ON_PROCESS: "container"}, None, indexed=True),
        # The Slurm job the process belongs to (its cgroup, else its SLURM_JOB_ID in slurmd's unit); "" outside
        # any job. Withheld: which of the two a reason's job came from is not in the reason.
        ConditionType(
            "slurm_job", STRING, STRING_OPS, _PROC_ROLES, {ON_PROCESS: "slurm_job"}, None, indexed=True, withheld=True
        ),
        ConditionType("user", USER, USER_OPS, _USER_ROLES, {ON_PROCESS: "user", ON_USER: "user"}, repr, indexed=True),
        # In per_group the group is the subject, named by this condition (see `names`).
        ConditionType(
            "group",
            GROUP,
            GROUP_OPS,
            _GROUP_ROLES,
            {ON_PROCESS: "user", ON_USER: "user", ON_GROUP: "name"},
            None,
            indexed=True,
            names=(PER_GROUP,),
        ),
        # A GPU by its index: a process is on it when any of its records is; a device is it or not.
        ConditionType(
            "gpu",
            INDEX,
            INDEX_OPS,
            {PER_PROCESS: SUBJECT, PER_USER: SELECTOR, PER_DEVICE: SUBJECT, PER_GROUP: SELECTOR},
            {ON_PROCESS: "per_device", ON_DEVICE: _device_index},
            _indexes,
        ),
        ConditionType(
            "gpu_utilization",
            PERCENT,
            NUMBER_OPS,
            {PER_PROCESS: SUBJECT, PER_USER: SELECTOR, PER_DEVICE: SUBJECT, PER_GROUP: SELECTOR},
            {ON_PROCESS: "gpu_utilization", ON_DEVICE: "utilization"},
            _percent,
            lower_bound_on=(ON_PROCESS,),
            victim_order=BY_UTILIZATION,
        ),
        ConditionType(
            "gpu_memory",
            SIZE,
            NUMBER_OPS,
            _PROC_ROLES,
            {ON_PROCESS: "gpu_memory"},
            format_size,
            lower_bound_on=(ON_PROCESS,),
            victim_order=BY_MEMORY,
        ),
        ConditionType("runtime", DURATION, NUMBER_OPS, _PROC_ROLES, {ON_PROCESS: "runtime"}, format_duration),
        # Killing every process of a user over a user-wide sum would be a disaster: the sum needs per_user,
        # where only the largest processes are killed until the user is back under.
        ConditionType(
            "user_memory",
            SIZE,
            NUMBER_OPS,
            _USER_ONLY,
            {ON_USER: "memory"},
            format_size,
            "user_memory sums a user's processes across devices: it needs scope per_user",
            lower_bound_on=(ON_USER,),
            victim_order=BY_MEMORY,
        ),
        # On each GPU, the user's processes' utilization there added up; the highest over the GPUs (so 0 to
        # 100: "no user takes more than 80% of any GPU").
        ConditionType(
            "user_utilization",
            PERCENT,
            NUMBER_OPS,
            _USER_ONLY,
            {ON_USER: "utilization"},
            _percent,
            "user_utilization adds up a user's processes on each GPU: it needs scope per_user",
            lower_bound_on=(ON_USER,),
            victim_order=BY_UTILIZATION,
        ),
        # How many GPU processes the rule counts for the user: a kill stops the largest (by memory) of them
        # only, until the count is back to the limit.
        ConditionType(
            "user_processes",
            COUNT,
            NUMBER_OPS,
            _USER_ONLY,
            {ON_USER: "count"},
            _count,
            "user_processes counts a user's GPU processes: it needs scope per_user",
        ),
        ConditionType(
            "group_memory",
            SIZE,
            NUMBER_OPS,
            _GROUP_ONLY,
            {ON_GROUP: "memory"},
            format_size,
            _GROUP_NEEDS.format("group_memory"),
            lower_bound_on=(ON_GROUP,),
            victim_order=BY_MEMORY,
        ),
        ConditionType(
            "group_utilization",
            PERCENT,
            NUMBER_OPS,
            _GROUP_ONLY,
            {ON_GROUP: "utilization"},
            _percent,
            _GROUP_NEEDS.format("group_utilization"),
            lower_bound_on=(ON_GROUP,),
            victim_order=BY_UTILIZATION,
        ),
        ConditionType(
            "group_processes",
            COUNT,
            NUMBER_OPS,
            _GROUP_ONLY,
            {ON_GROUP: "count"},
            _count,
            _GROUP_NEEDS.format("group_processes"),
        ),
        ConditionType(
            "device_memory",
            SIZE,
            NUMBER_OPS,
            {PER_DEVICE: SUBJECT},
            {ON_DEVICE: "memory_used"},
            format_size,
            "device_memory is a device's value: it needs scope per_device",
            victim_order=BY_MEMORY,
            share=Share(_memory_share, "the device's memory"),
        ),
        # Memory kept free (a reservation): below it, the device's largest processes go until it is back.
        ConditionType(
            "device_memory_free",
            SIZE,
            NUMBER_OPS,
            _DEVICE_ONLY,
            {ON_DEVICE: _memory_free},
            format_size,
            "device_memory_free is a device's value: it needs scope per_device",
            victim_order=BY_MEMORY,
        ),
        ConditionType(
            "temperature",
            CELSIUS,
            NUMBER_OPS,
            {PER_DEVICE: SUBJECT},
            {ON_DEVICE: "device.temperature"},
            _celsius,
            "temperature is a device's value: it needs scope per_device",
        ),
        # The rogue-activity audit's verdict on a process (gpukilld/rogue/score.py): its highest finding's score (0 to
        # 100, 0 without a finding) and that finding's kind. A user's findings (abuser) are not a process's.
        ConditionType(
            "rogue_score", PERCENT, NUMBER_OPS, _PROC_ROLES, {ON_PROCESS: "rogue_score"}, _score, withheld=True
        ),
        ConditionType(
            "rogue_kind",
            STRING,
            ("==", "!=", "in"),
            _PROC_ROLES,
            {ON_PROCESS: "rogue_kind"},
            repr,
            indexed=True,
            values=(FINDING_MINER, FINDING_IDLE),
            withheld=True,
        ),
        # What the backend says of the device's health (self-healing resets): a driver's text, not a process's.
        ConditionType(
            "device_state",
            STRING,
            ("==", "!=", "in"),
            _DEVICE_ONLY,
            {ON_DEVICE: "device.state"},
            repr,
            "device_state is a device's value: it needs scope per_device",
            values=DEVICE_STATES,
            every_device=True,
        ),
        ConditionType(
            "state_reason",
            STRING,
            STRING_OPS,
            _DEVICE_ONLY,
            {ON_DEVICE: "device.state_reason"},
            repr,
            "state_reason is a device's value: it needs scope per_device",
            every_device=True,
        ),
        ConditionType(
            "recovery_action",
            STRING,
            STRING_OPS,
            _DEVICE_ONLY,
            {ON_DEVICE: _recovery_action},
            repr,
            "recovery_action is a device's value: it needs scope per_device",
            every_device=True,
        ),
    )
}


def victim_order(type_names: Iterable[str]) -> str:
    """What "largest first" means for a rule with conditions of these types (see VICTIM_ORDERS)."""
    implied = {CONDITION_TYPES[t].victim_order for t in type_names}
    return next((order for order in VICTIM_ORDERS if order in implied), BY_MEMORY)
