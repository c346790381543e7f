"""What a rule looks at and how a condition is tested: views of the snapshot per subject, compiled predicates.

A snapshot has one record per (process, device). Rules look at subjects: a process (its devices summed:
memory added up, utilization the highest), a user (the processes counted for the rule, summed across
devices), a device, or a group its rule names (its members' processes counted for the rule, summed as a
user's are; membership primary or supplementary, as the group condition reads it). A value the backend cannot
read (None) never makes a condition true, whatever the operator: "unknown" is not "over" and not "under". A
process whose usage is partly charged to no one (a DRM context it shares with another user,
model.GpuProcess.shared_usage) has figures that are lower bounds: they can show it is over a limit, never that
it is under one.

What each condition type reads off these views (attributes by name), how its values are written in reasons
and which victims it kills first are declared in gpukill.condition_types; this module compiles a condition
from that declaration by its kind (text, user, group or number), never by its type's name.

Some processes are invisible to every rule, as if they were not on a GPU: PID 1, gpukilld, and what Protection
covers (system accounts, system units), so that no rule can be turned against the machine itself.
"""

from __future__ import annotations

import contextlib
import fnmatch
import grp
import operator
import os
import pwd
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from gpukill.condition_types import (
    BY_MEMORY,
    BY_UTILIZATION,
    CONDITION_TYPES,
    GROUP,
    INDEX,
    ON_GROUP,
    STRING,
    USER,
    victim_order,
    view_of,
)
from gpukill.procstat import CLK_TCK
from gpukill.rules import (
    MEAN,
    PER_GROUP,
    PER_PROCESS,
    PER_USER,
    SELECTOR,
    SUBJECT,
    Condition,
    Exemptions,
    Rule,
)

from ..config import DEFAULT_PROTECTED_UNITS, SYS_UID_MAX
from ..model import STATE_LOST, Device, Snapshot
from ..rogue.score import process_scores

MEMO_LIMIT = 20_000  # distinct strings remembered per condition (names, command lines) before starting over

ProcKey = tuple[int, int]  # (pid, start time): a process, never confused with a later one reusing the PID


@dataclass(slots=True)
class ProcView:
    key: ProcKey
    pid: int
    start_time: int
    uid: int
    user: str
    comm: str
    cmdline: str
    exe: str | None
    unit: str
    container: str
    gpu_memory: int | None  # summed over its devices; None when no device reports it
    gpu_utilization: float | None  # the highest over its devices
    runtime: float | None  # seconds since it started
    per_device: dict[int, tuple[int | None, float | None]] = field(default_factory=dict)  # index -> (mem, util)
    partial: bool = False  # gpu_memory and gpu_utilization leave out usage charged to no one: lower bounds
    system_unit: str = ""  # the unit under /system.slice that holds it, "" if none
    rogue_score: float = 0.0  # the highest score of the audit's findings about it (gpukilld/rogue/score.py); 0: none
    rogue_kind: str = ""  # that finding's kind (miner, idle); "": none
    slurm_job: str = ""  # the Slurm job id (cgroup, else SLURM_JOB_ID), "" if none

    @property
    def label(self) -> str:
        return f"PID {self.pid} ({self.comm}, user {self.user})"


def _utilization_by_device(procs: Iterable[ProcView]) -> dict[int, float] | None:
    """Per GPU, the processes' utilization there added up; None when no process's is known."""
    out: dict[int, float] = {}
    for p in procs:
        for index, (_mem, util) in p.per_device.items():
            if util is not None:
                out[index] = out.get(index, 0.0) + util
    return out or None


def _less(by_device: dict[int, float] | None, proc: ProcView) -> dict[int, float] | None:
    if by_device is None:
        return None
    out = dict(by_device)
    for index, (_mem, util) in proc.per_device.items():
        if index in out and util is not None:
            out[index] = max(0.0, out[index] - util)
    return out


@dataclass(slots=True)
class PeopleView:
    """A user (per_user) or a group (per_group), with the processes of theirs that the rule counts and their sums."""

    name: str  # the user's name; a group's as the rule names it (a name, or a gid as text)
    uid: int | None  # the user's; None: a group
    procs: list[ProcView]
    memory: int | None
    partial: bool = False  # some of its processes' usage is charged to no one: memory is a lower bound
    count: int = 0  # the processes counted (less those taken off by without())
    by_device: dict[int, float] | None = None  # GPU index -> its processes' utilization there, added up

    @property
    def key(self) -> int | str:
        return self.name if self.uid is None else self.uid

    @property
    def user(self) -> str:
        """The user's name, as a process's (what user conditions decide on)."""
        return self.name

    @property
    def label(self) -> str:
        return f"group {self.name}" if self.uid is None else f"user {self.name}"

    @property
    def utilization(self) -> float | None:
        """The busiest GPU's share taken by the processes (see condition_types: user_utilization)."""
        return None if self.by_device is None else max(self.by_device.values(), default=0.0)

    def without(self, proc: ProcView) -> PeopleView:
        """The figures as if proc were gone. Only the sums change (what conditions on a user or group read);
        the process list stays, so choosing victims among thousands costs no copies."""
        memory = None if self.memory is None else max(0, self.memory - (proc.gpu_memory or 0))
        return PeopleView(
            self.name, self.uid, self.procs, memory, self.partial, max(0, self.count - 1), _less(self.by_device, proc)
        )


@dataclass(slots=True)
class DeviceView:
    device: Device
    procs: list[ProcView]
    memory_used: int | None
    utilization: float | None

    @property
    def key(self) -> str:
        return self.device.id

    @property
    def label(self) -> str:
        return f"GPU {self.device.index} ({self.device.id})"

    def without(self, proc: ProcView) -> DeviceView:
        """The device as if proc were gone: its share of memory and utilization taken off (the sums only,
        as for PeopleView.without)."""
        mem, util = proc.per_device.get(self.device.index, (None, None))
        return DeviceView(
            self.device,
            self.procs,
            None if self.memory_used is None else max(0, self.memory_used - (mem or 0)),
            None if self.utilization is None else max(0.0, self.utilization - (util or 0.0)),
        )


Subject = ProcView | PeopleView | DeviceView


def _sum(values: Iterable[int | None]) -> int | None:
    total, known = 0, False
    for v in values:
        if v is not None:
            total += v
            known = True
    return total if known else None


def boot_seconds() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def process_views(
    snapshot: Snapshot, boot_now: float, reuse: dict[ProcKey, ProcView] | None = None
) -> dict[ProcKey, ProcView]:
    """One view per process: a process on two GPUs is one subject, with its memory added up. Views of the
    last cycle (reuse) are updated in place rather than made anew: every cycle would otherwise allocate
    thousands of objects, and the garbage collector's pauses would show in the evaluation time."""
    views: dict[ProcKey, ProcView] = {}
    old = reuse or {}
    tck = CLK_TCK
    scores = process_scores(snapshot.findings)
    for p in snapshot.processes:
        key = (p.pid, p.start_time)
        v = views.get(key)
        if v is not None:  # the same process on another device
            if p.gpu_memory is not None:
                v.gpu_memory = (v.gpu_memory or 0) + p.gpu_memory
            if p.gpu_utilization is not None:
                v.gpu_utilization = max(v.gpu_utilization or 0.0, p.gpu_utilization)
            v.per_device[p.device] = (p.gpu_memory, p.gpu_utilization)
            v.partial = v.partial or p.shared_usage
            continue
        runtime = max(0.0, boot_now - p.start_time / tck)
        v = old.get(key)
        if v is None:
            v = ProcView(
                key,
                p.pid,
                p.start_time,
                p.uid,
                p.user,
                p.comm,
                p.cmdline,
                p.exe,
                p.unit or "",
                p.container_id or "",
                p.gpu_memory,
                p.gpu_utilization,
                runtime,
                partial=p.shared_usage,
                system_unit=p.system_unit or "",
                slurm_job=p.slurm_job or "",
            )
        else:  # names change with exec and prctl, units with cgroup moves: every field is refreshed
            v.uid, v.user, v.comm, v.cmdline, v.exe = p.uid, p.user, p.comm, p.cmdline, p.exe
            v.unit, v.container, v.system_unit = p.unit or "", p.container_id or "", p.system_unit or ""
            v.slurm_job = p.slurm_job or ""
            v.gpu_memory, v.gpu_utilization, v.runtime = p.gpu_memory, p.gpu_utilization, runtime
            v.partial = p.shared_usage
            v.per_device.clear()
        v.per_device[p.device] = (p.gpu_memory, p.gpu_utilization)
        v.rogue_score, v.rogue_kind = scores.get(key, (0.0, ""))
        views[key] = v
    return views


def user_views(procs: list[ProcView]) -> list[PeopleView]:
    by_uid: dict[int, list[ProcView]] = {}
    for p in procs:
        by_uid.setdefault(p.uid, []).append(p)
    return [
        PeopleView(
            ps[0].user,
            uid,
            ps,
            _sum(p.gpu_memory for p in ps),
            any(p.partial for p in ps),
            len(ps),
            _utilization_by_device(ps),
        )
        for uid, ps in by_uid.items()
    ]


def group_views(procs: list[ProcView], names: Iterable[str], groups: Groups) -> list[PeopleView]:
    """One view per group named (by name or gid as text) that has a member among the processes' users."""
    members: dict[int, frozenset[str]] = {}
    for p in procs:
        if p.uid not in members:
            members[p.uid] = groups.of(p.uid, p.user)
    out = []
    for name in dict.fromkeys(names):
        ps = [p for p in procs if name in members[p.uid]]
        if ps:
            out.append(
                PeopleView(
                    name,
                    None,
                    ps,
                    _sum(p.gpu_memory for p in ps),
                    any(p.partial for p in ps),
                    len(ps),
                    _utilization_by_device(ps),
                )
            )
    return out


def device_views(procs: list[ProcView], devices: tuple[Device, ...], every: bool = False) -> list[DeviceView]:
    """Devices that are present (not lost; with every, all of them), with the selected processes on each."""
    out = []
    for d in devices:
        if d.state == STATE_LOST and not every:
            continue
        out.append(DeviceView(d, [p for p in procs if d.index in p.per_device], d.memory_used, d.utilization))
    return out


class Groups:
    """Group names (and gids as text) a uid belongs to, primary and supplementary; cached for a while because
    every cycle asks and NSS lookups can be slow (LDAP)."""

    TTL = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cache: dict[int, tuple[frozenset[str], float]] = {}

    def of(self, uid: int, user: str) -> frozenset[str]:
        now = self._clock()
        hit = self._cache.get(uid)
        if hit is not None and now - hit[1] < self.TTL:
            return hit[0]
        names: set[str] = set()
        try:
            pw = pwd.getpwuid(uid)
            gids = os.getgrouplist(pw.pw_name, pw.pw_gid)
        except (KeyError, OSError):
            gids = []
        for gid in gids:
            names.add(str(gid))
            with contextlib.suppress(KeyError):  # a gid without a name still counts by number
                names.add(grp.getgrgid(gid).gr_name)
        result = frozenset(names)
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[uid] = (result, now)
        return result


class Exempt:
    """Whether a process is exempt under a set of exemptions; exempt processes are invisible to the rule.
    The answer depends on (uid, user, name, unit) only, so it is remembered per such tuple."""

    def __init__(self, exemptions: Exemptions, groups: Groups) -> None:
        self.e = exemptions
        self.groups = groups
        self._users = set(exemptions.users)
        self._memo: dict[tuple[int, str, str, str], str] = {}

    def __call__(self, p: ProcView) -> bool:
        return bool(self.why(p))

    def why(self, p: ProcView) -> str:
        """Which exemption covers the process ("exempt: user bob"), or "" when none does."""
        key = (p.uid, p.user, p.comm, p.unit)
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) >= MEMO_LIMIT:
                self._memo.clear()
            hit = self._memo[key] = self._decide(p)
        return hit

    def _decide(self, p: ProcView) -> str:
        e = self.e
        if e.users and (p.user in self._users or str(p.uid) in self._users):
            return f"exempt: user {p.user or p.uid}"
        if e.groups and (hit := sorted(self.groups.of(p.uid, p.user).intersection(e.groups))):
            return f"exempt: group {hit[0]}"
        if e.units and p.unit and any(fnmatch.fnmatchcase(p.unit, pat) for pat in e.units):
            return f"exempt: unit {p.unit}"
        if e.processes and any(fnmatch.fnmatchcase(p.comm, pat) for pat in e.processes):
            return f"exempt: process name {p.comm}"
        return ""


@dataclass(frozen=True, slots=True)
class Protection:
    """Processes that no rule may touch or count, whatever the policy says: those of system accounts (uid up to
    uid_max, root included; None: none by uid) and those of system units matching `units` (shell patterns).

    Both rest on facts a user cannot forge. A uid is the kernel's. A unit counts only as the system unit that
    holds the process (the first one under /system.slice), never as the innermost unit name: in a delegated
    subtree (their user@UID.service) users create cgroups of any name, dbus.service included. A process in a
    container is judged by its unit alone: root inside a container is that container's workload, not a system
    account of the host (GPU containers often run as root; protecting them would hide every miner in one)."""

    uid_max: int | None = SYS_UID_MAX
    units: tuple[str, ...] = DEFAULT_PROTECTED_UNITS

    def covers(self, p: ProcView) -> bool:
        return bool(self.why(p))

    def why(self, p: ProcView) -> str:
        """What protects the process ("protected: system unit sshd.service"), or "" when nothing does."""
        if self.uid_max is not None and p.uid <= self.uid_max and not p.container:
            return f"protected: system account {p.user or p.uid}"
        if p.system_unit and _unit_protected(self.units, p.system_unit):
            return f"protected: system unit {p.system_unit}"
        return ""


@lru_cache(maxsize=4096)  # a few dozen system units on a host, every cycle: match each once
def _unit_protected(patterns: tuple[str, ...], unit: str) -> bool:
    return any(fnmatch.fnmatchcase(unit, pat) for pat in patterns)


_COMPARE = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}


def string_test(op: str, value: Any) -> Callable[[str], bool]:
    if op == "==":
        return lambda s: s == value
    if op == "!=":
        return lambda s: s != value
    if op == "in":
        values = frozenset(value)
        return lambda s: s in values
    if op == "not_in":
        values = frozenset(value)
        return lambda s: s not in values
    if op == "contains_any":
        return lambda s: any(v in s for v in value)
    if op == "matches":
        return lambda s: value.search(s) is not None
    raise AssertionError(op)


class CompiledCondition:
    """A condition ready to test subjects one by one (test) or a list at a time (filter, the fast path).

    Where the answer depends on one attribute only (a name, a user), it is decided once per distinct value
    and remembered: names and command lines repeat every cycle, so a regular expression runs once per value.
    """

    __slots__ = (
        "cond",
        "index",
        "attr",
        "decide",
        "test",
        "filter",
        "cheap",
        "ctype",
        "read",
        "_memo",
        "number",
        "holds_for",
    )

    def __init__(self, cond: Condition, index: int, scope: str, groups: Groups) -> None:
        self.cond = cond
        self.index = index
        self.attr: str | None = None  # the attribute processes are grouped by to decide once per value
        self._memo: dict[Any, bool] = {}
        self.ctype = ctype = CONDITION_TYPES[cond.type]
        view = view_of(scope, cond.role)
        self.read = get = ctype.reader(view, cond.percent_of_total)  # the value, for reasons
        # For a condition on a number: the subject's value as compared (None: unknown), and whether a value
        # (a window's mean, over: mean) satisfies the condition. None for the other kinds.
        self.number: Callable[[Any], Any] | None = None
        self.holds_for: Callable[[float], bool] | None = None
        self.decide: Callable[[Any], bool] | None  # set by each kind below: None where no answer is per value
        op, value = cond.operator, cond.value
        listed = op in ("in", "not_in")
        if ctype.kind == USER:
            names = {v for v in (value if listed else (value,)) if isinstance(v, str) and not v.isdigit()}
            uids = {int(v) for v in (value if listed else (value,)) if not isinstance(v, str) or v.isdigit()}
            if op == "matches":
                name_test = string_test(op, value)
                self._keyed(ctype.indexed, "uid", lambda k: name_test(k[1]), _uid_and_name)
            else:
                want = op not in ("!=", "not_in")
                self._keyed(ctype.indexed, "uid", lambda k: (k[1] in names or k[0] in uids) is want, _uid_and_name)
        elif ctype.kind == GROUP and view == ON_GROUP:  # the subject is the group: decided on its name
            name_test = string_test(op, value)
            self._keyed(False, None, name_test, operator.attrgetter("name"))
        elif ctype.kind == GROUP:

            def member(k: tuple[int, str]) -> bool:
                groups_of = groups.of(k[0], k[1])
                if listed:
                    return groups_of.isdisjoint(value) is (op == "not_in")
                return (value in groups_of) is (op == "==")

            self._keyed(ctype.indexed, "uid", member, _uid_and_name)
        elif ctype.kind == INDEX:  # the subject's GPUs (a process's: those of its records) hold the index or not
            want = op == "=="
            self.decide = None
            self.test = lambda s: (value in get(s)) is want
            self.filter = lambda items: [s for s in items if (value in get(s)) is want]
        elif ctype.kind == STRING:
            test = string_test(op, value)
            self._keyed(ctype.indexed, ctype.reads[view], lambda v: v is not None and test(v), get)
        else:
            compare, limit = _COMPARE[op], value
            self.decide = None
            if view in ctype.lower_bound_on and op not in (">", ">="):
                # A lower bound cannot show a subject is under a limit (or at it): only complete figures can.
                # For these operators a partial figure reads as unknown, which never makes a condition true.
                complete = get
                get = lambda s: None if s.partial else complete(s)  # noqa: E731 - replaces the getter above
            self.test = lambda s: (v := get(s)) is not None and compare(v, limit)
            self.number, self.holds_for = get, lambda v: compare(v, limit)
            # attrgetter and operator.gt are C: no Python frame per subject in the comprehension
            self.filter = lambda items: [s for s in items if (v := get(s)) is not None and compare(v, limit)]
        self.cheap = self.decide is not None

    def _keyed(self, indexed: bool, attr: Any, decide: Callable[[Any], bool], key: Callable[[Any], Any]) -> None:
        """Decide on key(subject), once per distinct key; with indexed, the first test of a rule on processes
        runs over them grouped by attr (a name), once per value."""
        self.attr = attr if indexed else None
        self.decide = decide
        memo = self._memo

        def test(s: Any) -> bool:
            k = key(s)
            r = memo.get(k)
            if r is None:
                if len(memo) >= MEMO_LIMIT:
                    memo.clear()
                r = memo[k] = decide(k)
            return r

        self.test = test
        self.filter = lambda items: [s for s in items if test(s)]

    def filter_indexed(self, index: dict[Any, list[ProcView]]) -> list[ProcView]:
        """The filter over processes grouped by this condition's attribute: one decision per value."""
        memo, decide = self._memo, self.decide
        out: list[ProcView] = []
        for k, procs in index.items():
            if self.attr == "uid":  # user and group conditions decide on (uid, name)
                k = (k, procs[0].user)
            r = memo.get(k)
            if r is None:
                r = memo[k] = decide(k)  # type: ignore[misc]  # set wherever attr is
            if r:
                out.extend(procs)
        return out

    def describe(self, subject: Any) -> str:
        """The subject's value for the condition, as audit entries and notifications show it."""
        return self.ctype.describe(self.cond, self.read(subject))


class Cycle:
    """What one evaluation computes once and every rule shares: the processes a set of exemptions leaves
    visible, those grouped by an attribute, and user and device views of them."""

    def __init__(
        self, procs: list[ProcView], devices: tuple[Device, ...], own_pid: int, protection: Protection | None = None
    ) -> None:
        self.procs = procs
        self.devices = devices
        self.own_pid = own_pid
        self.protection = protection or Protection()
        self._unprotected: list[ProcView] | None = None
        self._visible: dict[Exemptions, list[ProcView]] = {}
        # Keyed by id() of a list, which each entry keeps alive so the id cannot be reused this cycle.
        self._index: dict[tuple[int, str], tuple[list[ProcView], dict[Any, list[ProcView]]]] = {}
        self._users: dict[int, tuple[list[ProcView], list[PeopleView]]] = {}
        self._devices: dict[tuple[int, bool], tuple[list[ProcView], list[DeviceView]]] = {}

    def visible(self, exemptions: Exemptions, exempt: Exempt | None) -> list[ProcView]:
        """Not PID 1, not gpukilld, not protected, not exempt: the processes a rule may look at."""
        hit = self._visible.get(exemptions)
        if hit is None:
            if self._unprotected is None:
                own, covers = self.own_pid, self.protection.covers
                self._unprotected = [p for p in self.procs if p.pid != 1 and p.pid != own and not covers(p)]
            hit = self._unprotected if exempt is None else [p for p in self._unprotected if not exempt(p)]
            self._visible[exemptions] = hit
        return hit

    def index(self, procs: list[ProcView], attr: str) -> dict[Any, list[ProcView]]:
        key = (id(procs), attr)
        cached = self._index.get(key)
        if cached is not None:
            return cached[1]
        groups: dict[Any, list[ProcView]] = {}
        get = operator.attrgetter(attr)
        for p in procs:
            v = get(p)
            if v in groups:
                groups[v].append(p)
            else:
                groups[v] = [p]
        self._index[key] = (procs, groups)
        return groups

    def users(self, procs: list[ProcView], shared: bool) -> list[PeopleView]:
        if not shared:
            return user_views(procs)
        cached = self._users.get(id(procs))
        if cached is None:
            cached = self._users[id(procs)] = (procs, user_views(procs))
        return cached[1]

    def device_views(self, procs: list[ProcView], shared: bool, every: bool = False) -> list[DeviceView]:
        if not shared:
            return device_views(procs, self.devices, every)
        cached = self._devices.get((id(procs), every))
        if cached is None:
            cached = self._devices[(id(procs), every)] = (procs, device_views(procs, self.devices, every))
        return cached[1]


class CompiledRule:
    """A rule ready to run: exemptions, selectors (which processes count) and subject conditions."""

    def __init__(self, rule: Rule, global_exemptions: Exemptions, groups: Groups, own_pid: int) -> None:
        self.rule = rule
        self.scope = rule.scope
        self.groups = groups
        # per_group: the groups the rule's naming condition names (== or in): its subjects.
        self.named: tuple[str, ...] = tuple(
            v
            for c in rule.conditions
            if c.role == SUBJECT and rule.scope in CONDITION_TYPES[c.type].names and c.operator in ("==", "in")
            for v in (c.value if c.operator == "in" else (c.value,))
        )
        exemptions = global_exemptions.merged(rule.exemptions)
        self.exempt = Exempt(exemptions, groups) if exemptions else None
        self.exemptions_key = exemptions
        self.own_pid = own_pid
        compiled = [CompiledCondition(c, i, rule.scope, groups) for i, c in enumerate(rule.conditions)]
        # Cheap tests first so the others see fewer subjects; selectors always combine with AND.
        self.selectors = sorted((c for c in compiled if c.cond.role == SELECTOR), key=lambda c: not c.cheap)
        subject = [c for c in compiled if c.cond.role != SELECTOR]
        # Conditions with a duration come last, each tracked on its own.
        self.instant = sorted((c for c in subject if c.cond.duration is None), key=lambda c: not c.cheap)
        self.timed = [c for c in subject if c.cond.duration is not None]
        self.conditions = subject
        # What "largest first" means when a per-user or per-device rule picks its victims.
        self.size_of = _SIZE_OF[victim_order(c.type for c in rule.conditions)]
        # A rule on a device's health (device_state == lost, ...) looks at lost devices too.
        self.every_device = any(CONDITION_TYPES[c.type].every_device for c in rule.conditions)

    def visible(self, cycle: Cycle) -> list[ProcView]:
        return cycle.visible(self.exemptions_key, self.exempt)

    def _filter_first(self, conds: list[CompiledCondition], procs: list[ProcView], cycle: Cycle) -> list[ProcView]:
        """AND of conditions on processes; the first, if it looks at a name or a user, once per value."""
        first = conds[0]
        out = first.filter_indexed(cycle.index(procs, first.attr)) if first.attr is not None else first.filter(procs)
        for c in conds[1:]:
            if not out:
                break
            out = c.filter(out)
        return out

    def subjects(self, cycle: Cycle) -> list[Subject]:
        """The subjects the rule looks at; for per_process with match all, already narrowed by the
        conditions without a duration (the rest is up to the engine)."""
        visible = self.visible(cycle)
        selected = self._filter_first(self.selectors, visible, cycle) if self.selectors else visible
        if self.scope == PER_PROCESS:
            # per_process: the subjects are the processes (list is invariant: list[ProcView] is no list[Subject])
            return selected  # type: ignore[return-value]
        shared = not self.selectors  # views of the visible processes are the same for every such rule
        if self.scope == PER_USER:
            return cycle.users(selected, shared)  # type: ignore[return-value]  # as above, of PeopleView
        if self.scope == PER_GROUP:
            return group_views(selected, self.named, self.groups)  # type: ignore[return-value]  # as above
        return cycle.device_views(selected, shared, self.every_device)  # type: ignore[return-value]  # as above

    def narrow(self, subjects: list[Subject], cycle: Cycle) -> list[Subject]:
        """Subjects for which every condition without a duration holds (match all)."""
        if not self.instant or not subjects:
            return subjects
        if self.scope == PER_PROCESS:
            # per_process: the subjects are processes (list is invariant: list[Subject] is no list[ProcView])
            return self._filter_first(self.instant, subjects, cycle)  # type: ignore[arg-type, return-value]
        for c in self.instant:
            subjects = c.filter(subjects)
        return subjects

    def holds_now(self, subject: Subject) -> bool:
        """Whether the subject conditions hold at this instant, durations set aside (victim choice, preview)."""
        # A mean over a window (over: mean) has no value at an instant: it counts as holding here, so victims
        # are chosen by the other conditions (a user's processes largest first while those hold).
        conditions = [c for c in self.conditions if c.cond.over != MEAN]
        if not conditions:
            return True
        if self.rule.match == "any":
            return any(c.test(subject) for c in conditions)
        return all(c.test(subject) for c in conditions)

    def victims(
        self, subject: Subject, going: Callable[[ProcView], bool], refused: Callable[[ProcView], bool]
    ) -> list[ProcView]:
        """Which processes to stop for a subject that violates the rule. A process subject is itself; for a
        user or a device, the largest first, only until the rest would no longer violate the rule. Processes
        `going` (a kill in flight) count as gone; `refused` ones (the kill path said protected) stay."""
        if isinstance(subject, ProcView):
            return [] if going(subject) or refused(subject) else [subject]
        chosen: list[ProcView] = []
        remaining = subject
        for p in subject.procs:
            if going(p):
                remaining = remaining.without(p)
        for p in sorted(subject.procs, key=lambda p: self.size_of(p, subject), reverse=True):
            if not self.holds_now(remaining):
                break
            if refused(p) or going(p):
                continue
            chosen.append(p)
            remaining = remaining.without(p)
        return chosen


def _memory_size(p: ProcView, subject: Subject) -> tuple[float, float]:
    if isinstance(subject, DeviceView):
        mem, util = p.per_device.get(subject.device.index, (None, None))
        return (mem or 0, util or 0.0)
    return (p.gpu_memory or 0, p.gpu_utilization or 0.0)


def _util_size(p: ProcView, subject: Subject) -> tuple[float, ...]:
    """By utilization. A user's or a group's figure is its busiest GPU's: there, what a process takes of that
    GPU comes first (one busy elsewhere would bring nothing down), then its own highest, then its memory."""
    by_device = subject.by_device if isinstance(subject, PeopleView) else None
    if by_device:
        busiest = max(by_device, key=by_device.__getitem__)
        on_it = p.per_device.get(busiest, (None, None))[1]
        return (on_it or 0.0, p.gpu_utilization or 0.0, p.gpu_memory or 0)
    mem, util = _memory_size(p, subject)
    return (util, mem)


_SIZE_OF = {BY_MEMORY: _memory_size, BY_UTILIZATION: _util_size}


def _uid_and_name(s: ProcView | PeopleView) -> tuple[int | None, str]:
    """What user and group conditions decide on: the uid, and the name where a policy gives one."""
    return (s.uid, s.user)
