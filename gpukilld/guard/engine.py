"""The guard's state machine: which rules hold for which subjects, and when to act.

Modelled on systemd-oomd: a condition with a duration holds only once it has been true continuously that
long for that subject (we remember when it first became true and forget it the moment it is false). When a
rule starts to hold for a subject, that is a violation: it is reported (notifications go out) and, for
action kill, the subject gets the rule's grace period to come back under. Still violating after the grace,
its processes are stopped through the daemon's kill path; after a kill the rule leaves that subject alone for
the cooldown, so the next decision is made on a snapshot that shows the kill's effect. At most
max_kills_per_cycle processes are ordered killed per evaluation, and a subject with a kill in flight gets no
second one. A rule's kill_scope (tree, unit) adds processes to each victim when the kill is ordered: each
passes the checks a subject passes or is left running with why, each counts toward the cap, and a victim goes
with its whole scope or waits for an evaluation with room for it.

A per_device rule with action reset (self-healing) orders a device reset instead: once its conditions hold
(a device in error for a while, say), not while a process holds the device unless the rule says force (then
the reset path kills the holders first), at most once per device within the rule's cooldown after the last
reset and at most max_resets_per_hour per device in the last hour, counting the resets of every rule; one
reset of a device at a time. A dry run counts its would-be resets the same way, apart from the real ones.

A rule with action requeue or cancel decides as a kill rule does (grace period, warnings, cooldown) but orders
Slurm's act on the jobs of its victims instead (JobOrder): each job once, whichever of its processes or rules
ask, each job one act toward max_kills_per_cycle, none again within the cooldown after Slurm answered; its
victims of no Slurm job are left running and reported once while they live.

A rule with action suspend (Rule.stops, as kill) decides the same way, with the same grace, warnings, cap and
cooldown: its KillOrder is carried out by the suspend path instead of the kill path. A suspended process leaves
the snapshot, so its episode ends with the order; Guard never resumes it (its owner or an admin does). A suspend
this host cannot do (gpukilld/acts/suspend.py's refusals) is not ordered again while the process lives.

A dry run decides the same, with one would-kill per episode: a subject that goes on violating is not announced
again every cooldown; when it stops (the process ended, or a condition no longer holds), a Left event says so
and why. Enforcing is unchanged: after a kill's cooldown a subject still violating is killed again.

This module decides and never acts: evaluate() returns events (Violation, GraceCancelled, KillOrder, JobOrder,
ResetOrder, Left) that
the runner (runner.py) carries out, and the clock is injected, so all of it is tested without waiting. With match: all
the duration windows are kept only while the rule's conditions without a duration hold, so a window measures
how long the rule as a whole has been about to fire (an xmrig above 95% for 5 minutes).

What survives what: a reload (set_policy) keeps the windows, grace periods, cooldowns and counters of a rule
that is unchanged (counters by name, whatever changed); enabling a disabled guard starts every window and
violation again (restart_windows); a daemon restart gives back the windows, episodes, cooldowns and reset
history of unchanged rules whose processes still run (clocks.py), so an episode is counted once.

Protection (conditions.py) hides system accounts and system units from every rule before any of this runs:
they are never chosen as victims and never counted in a user's, a group's or a device's figures.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpukill.errors import NotSupported, Protected
from gpukill.outcome import SIGNALLED, Outcome, result_text
from gpukill.records.guard import NOT_MET
from gpukill.records.reclaim import KILL_PROCESS, KILL_TREE
from gpukill.records.suspend import STUCK
from gpukill.rules import EMPTY_POLICY, KILL, MEAN, RESET, SUSPEND, Policy, Rule, stops_subject, through_slurm
from gpukill.units import format_duration

from ..acts.reclaim import remember_tree
from ..acts.selection import OTHER_USERS, unit_mates
from ..model import Snapshot
from ..proc.procfs import ProcFS
from .conditions import (
    CompiledCondition,
    CompiledRule,
    Cycle,
    DeviceView,
    Groups,
    PeopleView,
    ProcKey,
    ProcView,
    Protection,
    Subject,
    boot_seconds,
    process_views,
)
from .window_mean import WindowMean

PROTECTED = "protected (a system account or system unit): never touched"
# Refusals that the same process would meet again: protected, a suspend this host or its driver cannot do
# (gpukilld/acts/suspend.py's refusals, or its host memory cap), and a process a suspend left stuck (its remedy
# is an admin's): it is not ordered again while it lives.
UNTRIED = frozenset({Protected.result, NotSupported.result, STUCK})
HOUR = 3600.0  # the window of a reset rule's max_resets_per_hour
Tree = Callable[[int], Iterable[ProcKey]]  # a process and its descendants, by PID: for kill_scope tree


def proc_tree(pid: int) -> Iterable[ProcKey]:
    """The process and its live descendants as /proc has them now (acts.reclaim.remember_tree)."""
    return remember_tree(ProcFS(), [pid]).keys()


@dataclass(slots=True)
class Clock:
    monotonic: Callable[[], float] = time.monotonic  # durations, grace, cooldown
    boottime: Callable[[], float] = boot_seconds  # process runtimes (start times are ticks since boot)
    wall: Callable[[], float] = time.time  # what reports show


@dataclass(frozen=True, slots=True)
class Target:
    pid: int
    start_time: int
    uid: int
    user: str
    comm: str
    gpu_memory: int | None
    gpu_utilization: float | None
    unit: str = ""  # its systemd unit, "" where none is known
    slurm_job: str = ""  # its Slurm job's id, "" if none

    @classmethod
    def of(cls, p: ProcView) -> Target:
        return cls(
            p.pid, p.start_time, p.uid, p.user, p.comm, p.gpu_memory, p.gpu_utilization, p.unit or "", p.slurm_job
        )


@dataclass(frozen=True, slots=True)
class Violation:
    rule: Rule
    subject: str
    subject_key: Any
    uid: int | None  # the user concerned, where there is one (not for a device)
    targets: tuple[Target, ...]  # the processes concerned: for action kill, those that would be stopped now
    reason: str
    at: float  # wall clock
    reason_for_others: str = ""  # the reason as other users may read it (PolicyViolated goes to every listener)
    # A kill rule with a grace and a kill_scope other than process: one per target, what its kill will take with it
    # as the engine decides it now (the checkpoint signals of the grace's start go to the whole workload)
    scoped: tuple[Scoped, ...] = ()

    @property
    def workload(self) -> list[ProcKey]:
        """The targets and what the kill_scope adds to them, each once, targets first."""
        keys = dict.fromkeys((t.pid, t.start_time) for t in self.targets)
        for sc in self.scoped:
            keys.update(dict.fromkeys((m.pid, m.start_time) for m in sc.members))
        return list(keys)


@dataclass(frozen=True, slots=True)
class GraceWarning:
    """A warning of the rule's `warn:` schedule is due: the subject is still violating, its kill `remaining`
    seconds away (a kill rule with a grace period). The violation's own notice is the at_start warning."""

    rule: Rule
    subject: str
    subject_key: Any
    uid: int | None
    targets: tuple[Target, ...]  # the processes that would be stopped now
    remaining: float  # seconds until the grace ends
    number: int  # the warnings of this episode so far, this one included (the at_start one counts)
    reason: str
    reason_for_others: str = ""


@dataclass(frozen=True, slots=True)
class GraceCancelled:
    rule: Rule
    subject: str
    subject_key: Any
    uid: int | None


@dataclass(frozen=True, slots=True)
class Scoped:
    """What a rule's kill_scope adds to one target: the processes stopped with it, each of which passed the
    checks the target passed, and those of its tree or unit left running, with why ("exempt: user bob")."""

    members: tuple[Target, ...] = ()
    left: tuple[tuple[Target, str], ...] = ()


def scoped_text(scoped: Scoped, results: dict[ProcKey, tuple[str, str]] | None = None) -> str:
    """A kill_scope's additions in words: "with PID 11 (python3); left running: PID 13 (ckpt, exempt: ...)";
    with the kill path's results ((pid, start time) -> (outcome or refusal, error)), what became of each."""
    parts = []
    if scoped.members:

        def done(m: Target) -> str:
            if results is None:
                return ""
            return " " + result_text(*results.get((m.pid, m.start_time), ("no-such-process", "gone before the kill")))

        parts.append("with " + ", ".join(f"PID {m.pid} ({m.comm}){done(m)}" for m in scoped.members))
    if scoped.left:
        parts.append("left running: " + ", ".join(f"PID {t.pid} ({t.comm}, {why})" for t, why in scoped.left))
    return "; ".join(parts)


def job_verb(action: str) -> str:
    """What a requeue or cancel rule does to a job, as a verb: "requeues", "cancels"."""
    return f"{action}s"


def unattached_text(action: str, targets: Iterable[Target]) -> str:
    """Why a requeue or cancel rule leaves processes running: they belong to no Slurm job."""
    pids = ", ".join(f"PID {t.pid} ({t.comm})" for t in targets)
    return f"not a Slurm job's process: action {action} does nothing to {pids}, left running"


def too_large_text(rule: Rule, needed: int, cap: int) -> str:
    """Why a victim whose kill_scope is larger than the per-cycle cap is never stopped."""
    return (
        f"its kill_scope {rule.kill_scope} takes {needed} processes, more than max_kills_per_cycle ({cap}): "
        "none is stopped until the cap is raised"
    )


@dataclass(frozen=True, slots=True)
class KillOrder:
    """Stop a subject's processes: by the kill path, or by the suspend path for a rule with action suspend."""

    rule: Rule
    subject: str
    subject_key: Any
    uid: int | None
    targets: tuple[Target, ...]
    force: bool
    kill_grace: float
    dry_run: bool
    reason: str
    reason_for_others: str = ""  # as Violation's
    scoped: tuple[Scoped, ...] = ()  # one per target, for a rule whose kill_scope is not process

    @property
    def count(self) -> int:
        """The processes the order stops: its targets and what their kill_scope adds."""
        return len(self.targets) + sum(len(sc.members) for sc in self.scoped)


@dataclass(frozen=True, slots=True)
class KillOverCap:
    """A kill is due, but its first target and what the rule's kill_scope adds take more processes than
    max_kills_per_cycle: nothing is stopped (never half a workload). Reported once per episode."""

    rule: Rule
    subject: str
    subject_key: Any
    uid: int | None
    target: Target
    needed: int
    cap: int
    reason: str
    reason_for_others: str = ""  # as Violation's


@dataclass(frozen=True, slots=True)
class JobOrder:
    """Ask Slurm to requeue or cancel jobs (actions requeue and cancel): each job once, with the subject's
    processes of it that the rule stops; and the subject's processes of no Slurm job, which the action leaves
    running (reported once while they live)."""

    rule: Rule
    subject: str
    subject_key: Any
    uid: int | None
    jobs: tuple[tuple[str, tuple[Target, ...]], ...]  # (job id, its processes), one act each toward the cap
    unattached: tuple[Target, ...]
    dry_run: bool
    reason: str
    reason_for_others: str = ""  # as Violation's


@dataclass(frozen=True, slots=True)
class ResetOrder:
    """Reset a device (action reset). Its holders, every process on it when ordered (protected ones too:
    the reset path refuses to kill those), are killed first by the reset path; ordered only with force."""

    rule: Rule
    subject: str
    subject_key: str  # the device's id
    device_index: int
    holders: tuple[Target, ...]
    force: bool
    dry_run: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Left:
    """A subject a dry run announced a would-kill for no longer violates the rule: its episode ended."""

    rule: Rule
    subject: str
    subject_key: Any
    uid: int | None
    why: str  # the conditions that no longer hold, with their values; or that the subject is gone


@dataclass(frozen=True, slots=True)
class Postponed:
    """The answer to an owner's request for more time for one episode of one kill rule: granted (in part, or
    all of it), or refused with why. deadline: when the grace now ends, seconds since the epoch (0: refused)."""

    rule: Rule
    subject: str
    uid: int | None
    asked: float
    granted: float
    deadline: float
    left: int  # postponements the episode has left
    text: str  # one line: what was granted and why not more, or why none
    targets: tuple[Target, ...] = ()  # the processes the kill would stop (ReclaimPending goes to each)

    @property
    def refused(self) -> bool:
        return self.granted <= 0


Event = Violation | GraceWarning | GraceCancelled | KillOrder | KillOverCap | JobOrder | ResetOrder | Left


@dataclass(slots=True)
class RuleStats:
    triggers: int = 0  # violations (a subject starting to violate the rule)
    kills: int = 0  # processes signalled, and jobs requeued or cancelled through Slurm
    would_kill: int = 0  # processes a dry run would have signalled, jobs it would have requeued or cancelled
    cancelled: int = 0  # violations that ended within the grace period
    failed: int = 0  # kills the kill path refused (protected, gone, PID reused); resets and job acts refused or failed
    last_triggered: float = 0.0  # wall clock
    resets: int = 0  # devices reset
    would_reset: int = 0  # resets a dry run would have made
    suspends: int = 0  # processes suspended (action suspend)
    would_suspend: int = 0  # processes a dry run would have suspended

    def to_dict(self) -> dict[str, Any]:  # the counts (int) and last_triggered (float)
        return {
            "triggers": self.triggers,
            "kills": self.kills,
            "would_kill": self.would_kill,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "last_triggered": self.last_triggered,
            "resets": self.resets,
            "would_reset": self.would_reset,
            "suspends": self.suspends,
            "would_suspend": self.would_suspend,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RuleStats:
        s = cls()
        for k in (
            "triggers",
            "kills",
            "would_kill",
            "cancelled",
            "failed",
            "resets",
            "would_reset",
            "suspends",
            "would_suspend",
        ):
            v = d.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                setattr(s, k, v)
        v = d.get("last_triggered")
        if isinstance(v, int | float) and not isinstance(v, bool):
            s.last_triggered = float(v)
        return s


@dataclass(slots=True)
class Episode:
    """A subject violating a rule, from the first evaluation it holds until the first it does not."""

    since: float  # monotonic
    grace_until: float
    label: str
    uid: int | None
    acted: bool = False  # a kill (or a dry run's would-kill) was ordered in this episode: a dry run orders no other
    warned: int = 0  # the rule's warn schedule sent so far: its first `warned` items (at_start with the violation)
    over_cap: bool = False  # a KillOverCap was reported in this episode
    # The owner's postponements (a kill rule's `postpone:`): seconds granted in all, how many, the last one's
    # reason and who asked it. grace_until already counts what was granted.
    postponed: float = 0.0
    postponements: int = 0
    postpone_reason: str = ""
    postponed_by: str = ""
    # The processes of the subject as last evaluated (a process's, a user's, a device's or a group's): which
    # episodes a process names when its owner asks for time. Not saved: the next evaluation sets it again.
    members: frozenset[ProcKey] = frozenset()
    targets: tuple[Target, ...] = ()  # those a kill would stop, as last decided: whom ReclaimPending names


@dataclass(slots=True)
class RuleState:
    rule: Rule
    compiled: CompiledRule
    windows: dict[int, dict[Any, float]] = field(default_factory=dict)  # condition index -> key -> since
    seen: dict[Any, Subject] = field(default_factory=dict)  # subjects in a window, for reports
    episodes: dict[Any, Episode] = field(default_factory=dict)
    cooldown: dict[Any, float] = field(default_factory=dict)  # key -> monotonic time it ends
    dry_cooldown: dict[Any, float] = field(default_factory=dict)  # the same after a dry run's would-kill
    in_flight: dict[Any, set[ProcKey]] = field(default_factory=dict)
    # over: mean conditions: condition index -> key -> the mean of its window. Not saved across a restart: a
    # restored window of such a condition starts again (a mean of samples the new daemon did not see is none).
    means: dict[int, dict[Any, WindowMean]] = field(default_factory=dict)
    # Actions requeue and cancel: processes of no Slurm job already reported as left running (once while they live)
    unattached: set[ProcKey] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Preview:
    """What TestPolicies reports for one rule and subject; nothing is ever done for it."""

    rule: str
    subject: str
    action: str
    status: str  # "now", "waiting", "exempt", "in-flight", "not-met" (watched; a condition does not hold now)
    wait: float  # seconds until the action would be taken (durations, grace, cooldown still to run)
    pids: tuple[int, ...]
    reason: str
    # The user whose process or processes the decision is about (None: a device), and the reason as a caller
    # who may not see all reads it about another user's (condition_types' `withheld`): gpukilld/bus/guard.py picks.
    uid: int | None = None
    reason_for_others: str = ""


def grace_of(rule: Rule) -> float:
    """The grace period a violation of the rule starts: a kill, suspend, requeue or cancel rule's; no other
    action waits for one."""
    return rule.grace_period if stops_subject(rule.action) else 0.0


def act_wait(
    rule: Rule, grace_until: float | None, cooldown_until: float, now: float, windows_left: float = 0.0
) -> float:
    """Seconds until the rule acts on a subject (0: now), as evaluate decides and preview reports it: the grace
    period of its violation (grace_until; None: not violating yet, so its windows still to run, then the whole
    grace), and after that the cooldown that follows a kill of it."""
    until = now + windows_left + grace_of(rule) if grace_until is None else grace_until
    return max(0.0, until - now, cooldown_until - now)


def _number(cc: CompiledCondition, value: float) -> str:
    """A mean as reasons write it: with its type's printer, else as a plain number."""
    return cc.ctype.printer(value) if cc.ctype.printer else f"{value:g}"


def _uid_of(s: Subject) -> int | None:
    return s.uid if isinstance(s, ProcView | PeopleView) else None


class Engine:
    def __init__(
        self,
        policy: Policy = EMPTY_POLICY,
        clock: Clock | None = None,
        groups: Groups | None = None,
        own_pid: int | None = None,
        protection: Protection | None = None,
        tree: Tree = proc_tree,
    ) -> None:
        self.clock = clock or Clock()
        self.tree = tree
        self.groups = groups or Groups(self.clock.monotonic)
        self.own_pid = os.getpid() if own_pid is None else own_pid
        # System accounts and units no rule may see (gpukilld.conf [guard]); replaced on reload, used from the
        # next evaluation on: a subject it now hides simply stops holding.
        self.protection = protection or Protection()
        self.stats: dict[str, RuleStats] = {}
        self.busy: set[ProcKey] = set()  # processes with a kill in flight, whichever rule ordered it
        self.refused: set[ProcKey] = set()  # the kill path refused them (protected): not tried again
        # Device id -> monotonic times of the resets ordered in the last hour, by any rule (attempts count: a
        # reset that fails is not retried at once); a dry run's apart. Devices with a reset in flight.
        self.resets: dict[str, list[float]] = {}
        self.dry_resets: dict[str, list[float]] = {}
        self.resetting: set[str] = set()
        # Slurm job id -> monotonic time until which no rule acts on the job again (requeue, cancel): infinite
        # while Slurm is being asked, then the cooldown; a dry run's apart. One act per job, whichever process
        # or rule asked for it.
        self.jobs: dict[str, float] = {}
        self.dry_jobs: dict[str, float] = {}
        self.policy = EMPTY_POLICY
        self.states: list[RuleState] = []
        self.last_eval_seconds = 0.0
        # Set when a window, episode (grace), cooldown or reset history starts or ends: the runner then saves
        # the clocks at once (clocks.py), so that a crash loses no grace that has begun; cleared by the runner.
        self.clocks_changed = False
        self._views: dict[ProcKey, ProcView] = {}  # the last cycle's, updated in place by the next
        self.set_policy(policy)

    # -- policy ----------------------------------------------------------------------------------------

    def _compile(self, rule: Rule, policy: Policy) -> CompiledRule:
        return CompiledRule(rule, policy.settings.exemptions, self.groups, self.own_pid)

    def set_policy(self, policy: Policy) -> None:
        """Swap the policy. A rule that is unchanged keeps its windows, grace periods and cooldowns, so
        reloading the same files does not restart a 5-minute window; counters are kept by rule name."""
        old = {s.rule.name: s for s in self.states}
        states = []
        for rule in policy.rules:
            compiled = self._compile(rule, policy)
            prev = old.get(rule.name)
            if (
                prev is not None
                and prev.rule.fingerprint == rule.fingerprint
                and prev.compiled.exemptions_key == compiled.exemptions_key
            ):
                prev.rule, prev.compiled = rule, compiled
                states.append(prev)
            else:
                new = RuleState(rule, compiled, windows={c.index: {} for c in compiled.timed})
                if prev is not None:  # a kill in flight under the old rule still blocks a second one
                    new.in_flight = prev.in_flight
                states.append(new)
            self.stats.setdefault(rule.name, RuleStats())
        self.policy = policy
        self.states = states

    def restart_windows(self) -> None:
        """Forget every window and violation (the guard was off): they start again from the next snapshot.
        Cooldowns and kills in flight stay."""
        for st in self.states:
            st.windows = {i: {} for i in st.windows}
            st.seen.clear()
            st.episodes.clear()
        self.clocks_changed = True

    # -- evaluation ------------------------------------------------------------------------------------

    def evaluate(self, snapshot: Snapshot, dry_run: bool) -> list[Event]:
        t0 = time.perf_counter()
        now, wall = self.clock.monotonic(), self.clock.wall()
        self._views = process_views(snapshot, self.clock.boottime(), self._views)
        procs = list(self._views.values())
        if self.refused:
            self.refused &= self._views.keys()
        for jobs in (self.jobs, self.dry_jobs):
            for job in [j for j, until in jobs.items() if until <= now]:
                del jobs[job]
        cycle = Cycle(procs, snapshot.devices, self.own_pid, self.protection)
        events: list[Event] = []
        kills_left = self.policy.settings.max_kills_per_cycle
        for st in self.states:
            subjects = st.compiled.subjects(cycle)
            holding = self._match(st, subjects, cycle, now)
            kills_left = self._act(st, holding, now, wall, dry_run, kills_left, events, cycle, subjects)
        self.last_eval_seconds = time.perf_counter() - t0
        return events

    def _match(self, st: RuleState, subjects: list[Subject], cycle: Cycle, now: float) -> list[Subject]:
        """Subjects for which the rule holds, durations included; updates the duration windows."""
        c = st.compiled
        match_all = st.rule.match == "all"
        cands = c.narrow(subjects, cycle) if match_all else subjects
        if not c.timed:
            if match_all:
                return cands
            return [s for s in cands if any(cc.test(s) for cc in c.instant)]
        windows: dict[int, dict[Any, float]] = {}
        seen: dict[Any, Subject] = {}
        held: list[set[Any]] = []
        for cc in c.timed:
            old = st.windows[cc.index]
            if cc.cond.over == MEAN:
                true_now = self._means(st, cc, cands, now)
                window = {s.key: st.means[cc.index][s.key].since for s in true_now}
            else:
                true_now = cc.filter(cands)
                window = {s.key: old.get(s.key, now) for s in true_now}  # a window starts, goes on, or is gone
            windows[cc.index] = window
            if window.keys() != old.keys():  # a window started or ended (the rest keep their start)
                self.clocks_changed = True
            seen.update((s.key, s) for s in true_now)
            limit = now - cc.cond.duration  # type: ignore[operator]  # a timed condition has a duration
            held.append({k for k, since in window.items() if since <= limit})
        st.windows = windows
        st.seen = seen
        if match_all:
            first, rest = held[0], held[1:]
            return [s for s in cands if s.key in first and all(s.key in h for h in rest)]
        held_any = set().union(*held)
        return [s for s in cands if s.key in held_any or any(cc.test(s) for cc in c.instant)]

    @staticmethod
    def _means(st: RuleState, cc: CompiledCondition, cands: list[Subject], now: float) -> list[Subject]:
        """over: mean. Each candidate's value goes into its window's mean; one that is not a candidate now, or
        whose value is unknown, loses its window (unknown is never idle). The subjects whose mean satisfies
        the condition; the engine then holds those whose window is as long as the duration."""
        means = st.means.setdefault(cc.index, {})
        span = cc.cond.duration or 0.0
        kept: dict[Any, WindowMean] = {}
        holding = []
        for s in cands:
            value = cc.number(s)  # type: ignore[misc]  # over: mean is on numbers, which set number
            if value is None:
                continue
            mean = means.get(s.key) or WindowMean(now, span)
            mean.add(now, float(value))
            kept[s.key] = mean
            if cc.holds_for(mean.value()):  # type: ignore[misc]  # set with number
                holding.append(s)
        st.means[cc.index] = kept
        return holding

    def _reason(self, st: RuleState, s: Subject, for_others: bool = False) -> str:
        """Each condition that holds with the subject's value; for_others: as a caller who may not see all reads
        it about another user's subject (a withheld type named, not described)."""
        c = st.compiled
        parts = [
            self._mean_reason(st, cc, s)
            if cc.cond.over == MEAN
            else cc.ctype.describe_for_others(cc.cond, cc.read(s))
            if for_others
            else cc.describe(s)
            for cc in c.conditions
            if cc.cond.over == MEAN or cc.test(s)
        ]
        if c.selectors:
            parts.append(
                f"counting {len(s.procs)} process(es) with "  # type: ignore[union-attr]  # selectors: users, groups
                + " and ".join(cc.cond.text for cc in c.selectors)
            )
        return "; ".join(parts)

    @staticmethod
    def _mean_reason(st: RuleState, cc: CompiledCondition, s: Subject) -> str:
        """An over: mean condition with the mean of its window (the same for others: a mean of a value that
        condition types withhold is not offered by any, as only numbers are averaged)."""
        mean = st.means.get(cc.index, {}).get(s.key)
        got = "no samples" if mean is None else f"mean {_number(cc, mean.value())}"
        return f"{cc.cond.text} ({got})"

    def _mean_now(self, st: RuleState, cc: CompiledCondition, s: Subject) -> float | None:
        """An over: mean condition's mean for the subject; with no samples yet (a policy tested as if loaded
        now, a subject new since the last evaluation), its value now, which is what its window starts with."""
        mean = st.means.get(cc.index, {}).get(s.key)
        if mean is not None and mean.count:
            return mean.value()
        value = cc.number(s)  # type: ignore[misc]  # over: mean is on numbers, which set number
        return None if value is None else float(value)

    def _holds(self, st: RuleState, cc: CompiledCondition, s: Subject) -> bool:
        """Whether a condition holds for the subject now, its duration set aside; over: mean by its mean."""
        if cc.cond.over == MEAN:
            value = self._mean_now(st, cc, s)
            return value is not None and cc.holds_for(value)  # type: ignore[misc]  # set with number
        return cc.test(s)

    def _unmet(self, st: RuleState, s: Subject, for_others: bool = False) -> str:
        """The conditions that do not hold for the subject now, each with its value: "gpu_utilization < 15%
        on average over 2h (mean 87%)"; for_others as _reason's."""
        parts = []
        for cc in st.compiled.conditions:
            if self._holds(st, cc, s):
                continue
            if cc.cond.over == MEAN:
                value = self._mean_now(st, cc, s)
                parts.append(f"{cc.cond.text} ({'unknown' if value is None else 'mean ' + _number(cc, value)})")
            elif for_others and cc.ctype.withheld:
                parts.append(f"{cc.cond.text} ({cc.ctype.name} withheld)")
            elif cc.ctype.printer is None:
                parts.append(cc.cond.text)
            else:
                parts.append(f"{cc.cond.text} (now {cc.ctype.value_text(cc.cond, cc.read(s))})")
        return "; ".join(parts)

    def _left_why(self, st: RuleState, s: Subject | None, now: float) -> str:
        """Why a subject no longer violates the rule: the conditions that stopped holding, or that it is gone."""
        if s is None:
            return "gone: no longer on a GPU, or exempt"
        unmet = self._unmet(st, s)
        if unmet:
            return f"no longer holds: {unmet}"
        return "a condition's duration starts again"

    def _going(self, p: ProcView) -> bool:
        return p.key in self.busy

    def _refused(self, p: ProcView) -> bool:
        return p.key in self.refused

    def _act(
        self,
        st: RuleState,
        holding: list[Subject],
        now: float,
        wall: float,
        dry_run: bool,
        kills_left: int,
        events: list[Event],
        cycle: Cycle,
        subjects: list[Subject],
    ) -> int:
        rule = st.rule
        settings = self.policy.settings
        stats = self.stats[rule.name]
        held = set()
        for s in holding:
            key = s.key
            held.add(key)
            ep = st.episodes.get(key)
            if ep is None:
                grace = grace_of(rule)
                ep = st.episodes[key] = Episode(now, now + grace, s.label, _uid_of(s))
                ep.warned = 1 if rule.warn and rule.warn[0] >= grace else 0  # at_start: the violation's notice
                self.clocks_changed = True
                stats.triggers += 1
                stats.last_triggered = wall
                scoped: tuple[Scoped, ...] = ()
                if stops_subject(rule.action):
                    concerned = st.compiled.victims(s, self._going, self._refused)
                    ep.targets = tuple(Target.of(p) for p in concerned)
                    scoped = self._grace_scope(st, concerned, cycle)
                else:
                    concerned = [s] if isinstance(s, ProcView) else list(s.procs)
                events.append(
                    Violation(
                        rule,
                        s.label,
                        key,
                        ep.uid,
                        tuple(Target.of(p) for p in concerned),
                        self._reason(st, s),
                        wall,
                        self._reason(st, s, for_others=True),
                        scoped,
                    )
                )
            if rule.action == RESET:
                self._reset(st, s, now, dry_run, cycle, events)  # type: ignore[arg-type]  # per_device only
                continue
            if stops_subject(rule.action) and not ep.acted and now < ep.grace_until:
                ep.members = frozenset((s.key,) if isinstance(s, ProcView) else (p.key for p in s.procs))
            if stops_subject(rule.action) and rule.warn and not ep.acted and now < ep.grace_until:
                self._warn(st, s, ep, now, events)
            if not stops_subject(rule.action) or st.in_flight.get(key):
                continue
            if dry_run and ep.acted:
                continue  # one would-kill per episode: the journal hears again when the subject leaves
            cooldown = st.dry_cooldown if dry_run else st.cooldown  # dry run off: enforce at once
            if act_wait(rule, ep.grace_until, cooldown.get(key, 0.0), now) > 0:
                continue
            victims = st.compiled.victims(s, self._going, self._refused)
            if through_slurm(rule.action):
                kills_left = self._order_jobs(st, s, ep, victims, kills_left, now, dry_run, events)
                continue
            plan = self._plan(st, victims, kills_left, cycle)  # the cap holds the rest for the next cycle
            if not plan:
                if victims and not ep.over_cap and (needed := self.scope_too_large(st, victims[0], cycle)):
                    ep.over_cap = True
                    events.append(
                        KillOverCap(
                            rule,
                            s.label,
                            key,
                            ep.uid,
                            Target.of(victims[0]),
                            needed,
                            settings.max_kills_per_cycle,
                            self._reason(st, s),
                            self._reason(st, s, for_others=True),
                        )
                    )
                continue
            kill_grace = rule.kill_grace if rule.kill_grace is not None else settings.kill_grace
            order = KillOrder(
                rule,
                s.label,
                key,
                ep.uid,
                tuple(Target.of(v) for v, _ in plan),
                rule.force,
                kill_grace,
                dry_run,
                self._reason(st, s),
                self._reason(st, s, for_others=True),
                tuple(sc for _, sc in plan) if rule.kill_scope != KILL_PROCESS else (),
            )
            kills_left -= order.count
            ep.acted = True
            self.clocks_changed = True
            if dry_run and rule.action == SUSPEND:
                stats.would_suspend += order.count
                st.dry_cooldown[key] = now + settings.cooldown
            elif dry_run:
                stats.would_kill += order.count
                st.dry_cooldown[key] = now + settings.cooldown  # as if killed: decide again after the cooldown
            else:
                keys = {(t.pid, t.start_time) for sc in order.scoped for t in sc.members}
                keys |= {v.key for v, _ in plan}
                st.in_flight[key] = keys
                self.busy |= keys
            events.append(order)
        ended = [k for k in st.episodes if k not in held]
        by_key = {s.key: s for s in subjects} if ended and dry_run else {}
        for key in ended:
            ep = st.episodes.pop(key)
            self.clocks_changed = True
            if stops_subject(rule.action) and not ep.acted:
                stats.cancelled += 1
                events.append(GraceCancelled(rule, ep.label, key, ep.uid))
            elif stops_subject(rule.action) and dry_run:
                events.append(Left(rule, ep.label, key, ep.uid, self._left_why(st, by_key.get(key), now)))
        for cooldowns in (st.cooldown, st.dry_cooldown):
            for key in [k for k, until in cooldowns.items() if until <= now]:
                del cooldowns[key]
                self.clocks_changed = True
        return kills_left

    def _order_jobs(
        self,
        st: RuleState,
        s: Subject,
        ep: Episode,
        victims: list[ProcView],
        room: int,
        now: float,
        dry_run: bool,
        events: list[Event],
    ) -> int:
        """A requeue or cancel rule's act on a subject: the Slurm jobs of its victims, each once and each one act
        toward the per-cycle cap (`room`; a job acted on lately, or one over the cap, waits), and its victims of
        no Slurm job, reported once as left running. The cap left after it."""
        rule, settings = st.rule, self.policy.settings
        st.unattached &= self._views.keys()
        busy = self.dry_jobs if dry_run else self.jobs
        by_job: dict[str, list[Target]] = {}
        unattached = []
        for v in victims:
            if not v.slurm_job:
                if v.key not in st.unattached:
                    unattached.append(Target.of(v))
            elif v.slurm_job not in busy:
                by_job.setdefault(v.slurm_job, []).append(Target.of(v))
        jobs = tuple((job, tuple(targets)) for job, targets in by_job.items())[: max(room, 0)]
        if not jobs and not unattached:
            return room
        st.unattached.update((t.pid, t.start_time) for t in unattached)
        ep.acted = True  # decided: no cancelled grace is reported when the subject leaves
        self.clocks_changed = True
        if jobs:
            for job, _ in jobs:
                busy[job] = now + settings.cooldown if dry_run else math.inf
            if dry_run:
                self.stats[rule.name].would_kill += len(jobs)
                st.dry_cooldown[s.key] = now + settings.cooldown
            else:
                keys = {(t.pid, t.start_time) for _, targets in jobs for t in targets}
                st.in_flight[s.key] = keys
                self.busy |= keys
        events.append(
            JobOrder(
                rule,
                s.label,
                s.key,
                ep.uid,
                jobs,
                tuple(unattached),
                dry_run,
                self._reason(st, s),
                self._reason(st, s, for_others=True),
            )
        )
        return room - len(jobs)

    def _plan(self, st: RuleState, victims: list[ProcView], room: int, cycle: Cycle) -> list[tuple[ProcView, Scoped]]:
        """The victims to stop now, each with what the rule's kill_scope adds to it, within `room` kills (the
        per-cycle cap left). Every process a scope adds is a kill toward the cap, and a victim is stopped with
        its whole scope or waits for a later cycle with it: a workload is never half-killed by the cap."""
        plan: list[tuple[ProcView, Scoped]] = []
        taken: set[ProcKey] = set()
        for v in victims:
            if v.key in taken:  # already in an earlier victim's tree or unit
                continue
            scoped = self._scope(st, v, cycle, taken)
            need = 1 + len(scoped.members)
            if need > room:
                break
            room -= need
            taken.add(v.key)
            taken.update((m.pid, m.start_time) for m in scoped.members)
            plan.append((v, scoped))
        return plan

    def _scope(self, st: RuleState, v: ProcView, cycle: Cycle, taken: set[ProcKey]) -> Scoped:
        """What the rule's kill_scope adds to victim v: the GPU processes of its tree (read from /proc) or of
        its unit, each checked as a subject is (PID 1 and gpukilld, the rule's global and own exemptions, the
        protected accounts and units, v's owner's processes alone); those that fail are left running, with why."""
        scope = st.rule.kill_scope
        if scope == KILL_PROCESS:
            return Scoped()
        if scope == KILL_TREE:
            by_key = {p.key: p for p in cycle.procs}
            try:
                tree = set(self.tree(v.pid))
            except OSError:  # /proc unreadable: the victim alone, as kill_scope process would
                tree = set()
            mates = [by_key[k] for k in sorted(tree) if k in by_key] if v.key in tree else []
        else:
            mates = unit_mates(v, cycle.procs)
        members, left = [], []
        exempt = st.compiled.exempt
        for m in mates:
            if m.key == v.key or m.key in taken or self._going(m):
                continue
            why = (
                "protected: PID 1 and gpukilld are never touched"
                if m.pid in (1, self.own_pid)
                else (exempt.why(m) if exempt is not None else "")
                or cycle.protection.why(m)
                or ("protected: the kill path refused it" if self._refused(m) else "")
                or (OTHER_USERS if m.uid != v.uid else "")
            )
            if why:
                left.append((Target.of(m), why))
            else:
                members.append(Target.of(m))
        return Scoped(tuple(members), tuple(left))

    def _grace_scope(self, st: RuleState, victims: list[ProcView], cycle: Cycle) -> tuple[Scoped, ...]:
        """What a kill rule's kill_scope will take with each victim, decided as its kill decides it, for the
        checkpoint signals sent when its grace begins: the workload's leader may be a member, not a victim (a
        per_user rule's victim is the worker with the most memory; its trainer is in the unit). () for
        kill_scope process and for a rule without a grace (its kill's own checkpoint step asks then)."""
        rule = st.rule
        if rule.action != KILL or rule.kill_scope == KILL_PROCESS or not rule.grace_period:
            return ()
        taken: set[ProcKey] = set()
        out = []
        for v in victims:
            scoped = self._scope(st, v, cycle, taken)
            taken.add(v.key)
            taken.update((m.pid, m.start_time) for m in scoped.members)
            out.append(scoped)
        return tuple(out)

    def scope_too_large(self, st: RuleState, victim: ProcView, cycle: Cycle) -> int:
        """How many processes the victim and its kill_scope take when that is more than max_kills_per_cycle:
        such a scope is never killed (0: it fits)."""
        if st.rule.kill_scope == KILL_PROCESS:
            return 0
        need = 1 + len(self._scope(st, victim, cycle, set()).members)
        return need if need > self.policy.settings.max_kills_per_cycle else 0

    def _warn(self, st: RuleState, s: Subject, ep: Episode, now: float, events: list[Event]) -> None:
        """The schedule's next warning, if due. Several due at once (a long evaluation interval, a restart)
        make one warning: the owner needs to know how long is left, not to be told twice."""
        schedule, due = st.rule.warn, ep.warned
        while due < len(schedule) and now >= ep.grace_until - schedule[due]:
            due += 1
        if due == ep.warned:
            return
        ep.warned = due
        self.clocks_changed = True
        victims = st.compiled.victims(s, self._going, self._refused)
        ep.targets = tuple(Target.of(p) for p in victims)
        events.append(
            GraceWarning(
                st.rule,
                s.label,
                s.key,
                ep.uid,
                tuple(Target.of(p) for p in victims),
                ep.grace_until - now,
                due,
                self._reason(st, s),
                self._reason(st, s, for_others=True),
            )
        )

    # -- postponements ---------------------------------------------------------------------------------

    def pending_graces(self, pid: int, start_time: int) -> list[tuple[str, Any]]:
        """(rule name, subject key) of each kill rule's episode whose grace is still running and whose subject
        holds the process: its own for per_process, the user, device or group it is counted in otherwise."""
        now, key = self.clock.monotonic(), (pid, start_time)
        return [
            (st.rule.name, subject)
            for st in self.states
            if st.rule.action == KILL
            for subject, ep in st.episodes.items()
            if not ep.acted and now < ep.grace_until and (key in ep.members or subject == key)
        ]

    def postpone(self, rule_name: str, subject_key: Any, seconds: float, reason: str, who: str) -> Postponed | None:
        """Move the end of an episode's grace later by `seconds`, within the rule's postpone caps: at most what
        is left of its max, refused past its times. The warnings of the rule's schedule follow the new end:
        those whose time before it has not come yet are sent again when it does. None: no such episode (it
        ended, or the rule changed)."""
        st = next((x for x in self.states if x.rule.name == rule_name), None)
        ep = st.episodes.get(subject_key) if st is not None else None
        now = self.clock.monotonic()
        if st is None or ep is None or ep.acted or now >= ep.grace_until:
            return None
        rule, caps = st.rule, st.rule.postpone

        def answer(granted: float, left: int, text: str) -> Postponed:
            deadline = self.clock.wall() + (ep.grace_until - now)
            return Postponed(
                rule, ep.label, ep.uid, seconds, granted, deadline if granted > 0 else 0.0, left, text, ep.targets
            )

        asked = format_duration(seconds)
        if caps is None:
            return answer(0.0, 0, f"rule {rule.name} allows no postponement")
        if ep.postponements >= caps.times:
            used = "it was used" if caps.times == 1 else "both used" if caps.times == 2 else f"all {caps.times} used"
            many = "1 postponement" if caps.times == 1 else f"{caps.times} postponements"
            return answer(0.0, 0, f"rule {rule.name} allows {many} per episode; {used}")
        room = caps.max - ep.postponed
        left = caps.times - ep.postponements
        if room <= 0:
            return answer(
                0.0, left, f"rule {rule.name}'s max of {format_duration(caps.max)} per episode was granted before"
            )
        granted = min(seconds, room)
        ep.grace_until += granted
        ep.postponed += granted
        ep.postponements += 1
        ep.postpone_reason, ep.postponed_by = reason, who
        remaining = ep.grace_until - now
        # the schedule's warnings not yet due before the new end come again, re-timed; at_start was the start's
        at_start = 1 if rule.warn and rule.warn[0] >= rule.grace_period else 0
        ep.warned = max(at_start, sum(1 for offset in rule.warn if offset >= remaining))
        self.clocks_changed = True
        if granted < seconds:
            before = ep.postponed - granted
            text = (
                f"granted {format_duration(granted)} of {asked} asked: the rule's max is "
                f"{format_duration(caps.max)}"
                + (f" and {format_duration(before)} were granted before" if before else "")
            )
        else:
            text = f"granted {asked}"
        return answer(granted, left - 1, text)

    # -- resets ----------------------------------------------------------------------------------------

    @staticmethod
    def holders(device: DeviceView, cycle: Cycle) -> list[ProcView]:
        """Every process on the device, whatever the rule's exemptions and Protection hide from it: a reset
        stops them all."""
        return [p for p in cycle.procs if device.device.index in p.per_device]

    def reset_wait(self, rule: Rule, device_id: str, now: float, dry_run: bool) -> float:
        """Seconds until the rule's cooldown and hourly cap allow another reset of the device (0: now)."""
        history = (self.dry_resets if dry_run else self.resets).get(device_id, [])
        recent = [t for t in history if t > now - HOUR]
        if not recent:
            return 0.0
        wait = recent[-1] + rule.cooldown - now
        if len(recent) >= rule.max_resets_per_hour:  # until the oldest that fills the cap is an hour old
            wait = max(wait, recent[len(recent) - rule.max_resets_per_hour] + HOUR - now)
        return max(0.0, wait)

    def _reset(
        self, st: RuleState, device: DeviceView, now: float, dry_run: bool, cycle: Cycle, events: list[Event]
    ) -> None:
        rule, key = st.rule, device.key
        if key in self.resetting or self.reset_wait(rule, key, now, dry_run) > 0:
            return
        holders = self.holders(device, cycle)
        if holders and not rule.force:
            return  # never while processes hold it: the violation said so; decided again each cycle
        history = self.dry_resets if dry_run else self.resets
        history[key] = [t for t in history.get(key, []) if t > now - HOUR] + [now]
        st.episodes[key].acted = True
        self.clocks_changed = True
        if dry_run:
            self.stats[rule.name].would_reset += 1
        else:
            self.resetting.add(key)
        events.append(
            ResetOrder(
                rule,
                device.label,
                key,
                device.device.index,
                tuple(Target.of(p) for p in holders),
                rule.force,
                dry_run,
                self._reason(st, device),
            )
        )

    def reset_finished(self, order: ResetOrder, outcome: str) -> None:
        """The reset path's answer for an order: "reset", or its refusal's or failure's result."""
        self.resetting.discard(order.subject_key)
        stats = self.stats.setdefault(order.rule.name, RuleStats())
        if outcome == Outcome.RESET:
            stats.resets += 1
        else:
            stats.failed += 1

    def job_finished(self, order: JobOrder, job: str, acted: bool) -> None:
        """Slurm's answer for one job of an order (acted: requeued or cancelled; else refused or failed): frees
        its processes, starts the job's cooldown and, with the order's last job, the subject's."""
        now = self.clock.monotonic()
        self.jobs[job] = now + self.policy.settings.cooldown
        stats = self.stats.setdefault(order.rule.name, RuleStats())
        if acted:
            stats.kills += 1
        else:
            stats.failed += 1
        keys = {(t.pid, t.start_time) for j, targets in order.jobs if j == job for t in targets}
        self.busy -= keys
        st = next((s for s in self.states if s.rule.name == order.rule.name), None)
        pending = st.in_flight.get(order.subject_key) if st is not None else None
        if st is not None and pending is not None:
            pending -= keys
            if not pending:
                del st.in_flight[order.subject_key]
                st.cooldown[order.subject_key] = now + self.policy.settings.cooldown
                self.clocks_changed = True

    def kill_finished(self, order: KillOrder, target: Target, outcome: str) -> None:
        """The kill (or suspend) path's answer for one target of an order (an Outcome, or the result of its
        refusal): frees the subject, starts its cooldown. A process refused for good (protected; a suspend this
        host cannot do) is not tried again while it lives."""
        pkey = (target.pid, target.start_time)
        self.busy.discard(pkey)
        stats = self.stats.setdefault(order.rule.name, RuleStats())
        if outcome in SIGNALLED:
            stats.kills += 1
        elif outcome == Outcome.SUSPENDED:
            stats.suspends += 1
        else:
            stats.failed += 1
            if outcome in UNTRIED:
                self.refused.add(pkey)
        st = next((s for s in self.states if s.rule.name == order.rule.name), None)
        if st is None:
            return
        pending = st.in_flight.get(order.subject_key)
        if pending is not None:
            pending.discard(pkey)
            if not pending:
                del st.in_flight[order.subject_key]
                st.cooldown[order.subject_key] = self.clock.monotonic() + self.policy.settings.cooldown
                self.clocks_changed = True

    # -- reports ---------------------------------------------------------------------------------------

    def windows_report(self) -> list[dict[str, Any]]:
        """Subjects inside a duration window that runs toward an act: which rule and condition, for how long,
        out of how long. With match: all, only subjects for which every condition holds now (a process holding
        memory while busy is in the memory condition's window, yet nothing will happen to it)."""
        now = self.clock.monotonic()
        out = []
        for st in self.states:
            toward: set[Any] | None = None  # None: every window (match: any, each one leads to the act)
            if st.rule.match == "all" and st.windows:
                toward = set.intersection(*(set(w) for w in st.windows.values()))
            for index, window in st.windows.items():
                cond = st.rule.conditions[index]
                for key, since in window.items():
                    if toward is not None and key not in toward:
                        continue
                    subject = st.seen.get(key)
                    out.append(
                        {
                            "rule": st.rule.name,
                            "subject": subject.label if subject else str(key),
                            "uid": _uid_of(subject) if subject else None,
                            "condition": cond.text,
                            "elapsed": now - since,
                            "duration": cond.duration,
                        }
                    )
        return out

    def grace_report(self) -> list[dict[str, Any]]:
        """Subjects violating a kill rule and still inside its grace period."""
        now = self.clock.monotonic()
        return [
            {
                "rule": st.rule.name,
                "subject": ep.label,
                "uid": ep.uid,
                "remaining": ep.grace_until - now,
                "warnings_sent": ep.warned,
                "next_warning": (
                    ep.grace_until - st.rule.warn[ep.warned] - now if ep.warned < len(st.rule.warn) else None
                ),
                "postponed": ep.postponed,
                "postponements": ep.postponements,
                "postponed_by": ep.postponed_by,
                "postpone_reason": ep.postpone_reason,
            }
            for st in self.states
            if stops_subject(st.rule.action)
            for ep in st.episodes.values()
            if not ep.acted and now < ep.grace_until
        ]

    def preview(self, snapshot: Snapshot) -> list[Preview]:
        """What the policy would do with this snapshot, given the windows and grace periods running now.
        Changes nothing: no window, episode, cooldown or counter."""
        now = self.clock.monotonic()
        procs = list(process_views(snapshot, self.clock.boottime()).values())  # fresh: the engine's stay as they are
        cycle = Cycle(procs, snapshot.devices, self.own_pid, self.protection)
        out: list[Preview] = []
        for st in self.states:
            c, rule = st.compiled, st.rule
            visible = c.visible(cycle)
            for s in c.subjects(cycle):
                if rule.match == "any":
                    if any(self._holds(st, cc, s) for cc in c.conditions):
                        out.append(self._preview_one(st, s, now, cycle))
                    continue
                if not all(cc.test(s) for cc in c.instant):
                    continue  # not watched: the rule's conditions without a duration leave it out
                held = sum(self._holds(st, cc, s) for cc in c.timed)
                if held == len(c.timed):
                    out.append(self._preview_one(st, s, now, cycle))
                elif held:  # watched, but a windowed condition does not hold now: nothing happens while so
                    out.append(
                        Preview(
                            rule.name,
                            s.label,
                            rule.action,
                            NOT_MET,
                            0.0,
                            (),
                            "not met: " + self._unmet(st, s),
                            _uid_of(s),
                            "not met: " + self._unmet(st, s, for_others=True),
                        )
                    )
            if c.scope == "per_process":  # what the rule would match but may not touch: say so, not nothing
                shown = {p.key for p in visible}
                for p in procs:
                    if p.key not in shown and all(sel.test(p) for sel in c.selectors) and c.holds_now(p):
                        why = PROTECTED if cycle.protection.covers(p) else "exempt or protected: never touched"
                        out.append(Preview(rule.name, p.label, rule.action, "exempt", 0.0, (p.pid,), why, p.uid, why))
        return out

    def _preview_one(self, st: RuleState, s: Subject, now: float, cycle: Cycle) -> Preview:
        c, rule, key = st.compiled, st.rule, s.key
        waits = [
            # a timed condition has a duration
            max(0.0, cc.cond.duration - (now - self._window_start(st, cc, key, now)))  # type: ignore[operator]
            for cc in c.timed
            if self._holds(st, cc, s)
        ]
        if rule.match == "all":
            duration_left = max(waits, default=0.0)
        else:
            duration_left = 0.0 if any(cc.test(s) for cc in c.instant) else min(waits, default=0.0)
        ep = st.episodes.get(key)
        # Previews show what enforcing would do: its cooldowns, not a dry run's.
        wait = act_wait(rule, ep.grace_until if ep else None, st.cooldown.get(key, 0.0), now, duration_left)
        if rule.action == RESET:
            return self._preview_reset(
                st,
                s,  # type: ignore[arg-type]  # a reset rule's subjects are devices (per_device)
                max(wait, self.reset_wait(rule, key, now, False)),  # type: ignore[arg-type]  # a device's id
                cycle,
            )
        reason, for_others = self._reason(st, s), self._reason(st, s, for_others=True)
        if through_slurm(rule.action):
            victims = c.victims(s, self._going, self._refused)
            pids = tuple(v.pid for v in victims)
            status = "in-flight" if st.in_flight.get(key) else ("now" if wait <= 0 else "waiting")
            jobs = sorted({v.slurm_job for v in victims if v.slurm_job}, key=lambda j: (len(j), j))
            strays = [v for v in victims if not v.slurm_job]
            if jobs:
                reason += f"; {job_verb(rule.action)} job {', '.join(jobs)} through Slurm"
                for_others += f"; {job_verb(rule.action)} {len(jobs)} Slurm job(s)"
            if strays:
                reason += "; " + unattached_text(rule.action, [Target.of(v) for v in strays])
                for_others += f"; {len(strays)} process(es) of no Slurm job left running"
        elif stops_subject(rule.action):
            victims = c.victims(s, self._going, self._refused)
            plan = self._plan(st, victims, self.policy.settings.max_kills_per_cycle, cycle)
            pids = tuple(pid for v, sc in plan for pid in (v.pid, *(m.pid for m in sc.members)))
            status = "in-flight" if st.in_flight.get(key) else ("now" if wait <= 0 else "waiting")
            scope = "; ".join(filter(None, (scoped_text(sc) for _, sc in plan)))
            if victims and not plan and (needed := self.scope_too_large(st, victims[0], cycle)):
                status = "waiting"
                scope = too_large_text(rule, needed, self.policy.settings.max_kills_per_cycle)
            if scope:  # others read how many, not other processes' names or why they were spared
                reason = f"{reason}; {scope}"
                added = sum(len(sc.members) for _, sc in plan)
                left = sum(len(sc.left) for _, sc in plan)
                for_others += (
                    f"; {scope}" if not plan else f"; its kill_scope adds {added} process(es), leaves {left} running"
                )
        else:
            pids = (s.pid,) if isinstance(s, ProcView) else tuple(p.pid for p in s.procs)
            status = "now" if wait <= 0 else "waiting"
        return Preview(rule.name, s.label, rule.action, status, max(0.0, wait), pids, reason, _uid_of(s), for_others)

    @staticmethod
    def _window_start(st: RuleState, cc: CompiledCondition, key: Any, now: float) -> float:
        """When the condition's window for the subject began: its running window; for over: mean, when its
        mean began (a mean above the threshold at the last evaluation has no window, yet its samples count);
        now when there is neither."""
        since = st.windows.get(cc.index, {}).get(key)
        if since is None and cc.cond.over == MEAN:
            mean = st.means.get(cc.index, {}).get(key)
            since = mean.since if mean is not None else None
        return now if since is None else since

    def _preview_reset(self, st: RuleState, device: DeviceView, wait: float, cycle: Cycle) -> Preview:
        """A reset rule's decision: the holders it would kill first (force), or why it waits for them."""
        rule, reason = st.rule, self._reason(st, device)
        holders = self.holders(device, cycle)
        if device.key in self.resetting:
            status = "in-flight"
        elif holders and not rule.force:
            status = "waiting"
            reason += f"; held by {len(holders)} process(es): no reset while they run (force: false)"
        else:
            status = "now" if wait <= 0 else "waiting"
        pids = tuple(p.pid for p in holders) if rule.force else ()
        return Preview(rule.name, device.label, rule.action, status, max(0.0, wait), pids, reason, None, reason)
