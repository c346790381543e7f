"""What a Guard policy is, as records: settings, and rules made of conditions, a scope, an action, exemptions.

A rule looks at subjects of its scope: each process (per_process), each user with their processes
(per_user), each device with the processes on it (per_device) or each group its group condition names, with
its members' processes (per_group). Its conditions combine with AND unless it says `match: any`. A condition
is about the subject (SUBJECT), or, in per_user, per_device and per_group scopes, about a process (SELECTOR):
then it picks which of the subject's processes the rule counts and may kill. When the
rule holds for a subject, its action is taken: kill, suspend (its GPU memory set aside in host memory until the
owner resumes it), notify, log, (per_device only) reset the device, or requeue or cancel the Slurm job of the
subject's processes.
Descriptions are prose for humans and never change what a rule does.

Which condition types exist, and what each means in each scope, is gpukill.condition_types; reading these
records from YAML is gpukill.policy; evaluating them is the daemon's (gpukilld.guard).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .checkpoint import DEFAULT_MAX_WAIT, Declaration
from .records.reclaim import KILL_PROCESS
from .regex import compile_regex

PER_PROCESS, PER_USER, PER_DEVICE, PER_GROUP = "per_process", "per_user", "per_device", "per_group"
SCOPES = (PER_PROCESS, PER_USER, PER_DEVICE, PER_GROUP)
KILL = "kill"  # stop the subject's processes through the kill path, after the rule's grace period
# Suspend the subject's processes through the suspend path, after the rule's grace period: their GPU memory is set
# aside in host memory and they are frozen until the owner or an admin resumes them (Guard never resumes).
SUSPEND = "suspend"
RESET = "reset"  # reset the device (scope per_device): its holders are killed first only with force
# Ask Slurm to requeue (scontrol requeue) or cancel (scancel) the job of the subject's processes, after the
# rule's grace period; a process of no Slurm job is left running
REQUEUE, CANCEL = "requeue", "cancel"
ACTIONS = (KILL, SUSPEND, "notify", "log", RESET, REQUEUE, CANCEL)
SLURM_ACTIONS = (REQUEUE, CANCEL)
JOB_DONE = {REQUEUE: "requeued", CANCEL: "cancelled"}  # what a requeue or cancel rule did to a job, in words
STOPPING_ACTIONS = (KILL, SUSPEND, *SLURM_ACTIONS)


def stops_subject(action: str) -> bool:
    """Whether the action stops the subject's processes (kill, suspend, requeue, cancel): such a rule gives the
    subject its grace period and warnings, counts toward max_kills_per_cycle and cools down after it acts."""
    return action in STOPPING_ACTIONS


def through_slurm(action: str) -> bool:
    """Whether the action is carried out by Slurm on the process's job rather than by signalling processes."""
    return action in SLURM_ACTIONS


# A reset rule's defaults: at most one reset of a device per cooldown, and a few per hour, whatever the rule says
# of its conditions: a device that a reset does not heal must not be reset over and over.
RESET_COOLDOWN = 600.0
MAX_RESETS_PER_HOUR = 3
MATCHES = ("all", "any")
EVERY, MEAN = "every", "mean"  # how a condition's duration is judged (Condition.over)
OVERS = (EVERY, MEAN)
SUBJECT, SELECTOR = "subject", "selector"  # a condition's role in its rule's scope (see above)

_RE2_PATTERN = type(compile_regex(""))


@dataclass(frozen=True, slots=True)
class Condition:
    type: str  # a name in condition_types.CONDITION_TYPES
    operator: str
    value: Any  # normalized: str, int, float, tuple of those, or a compiled RE2 pattern for `matches`
    duration: float | None  # seconds the condition must hold continuously; None: at once
    percent_of_total: bool  # a share of the total ("90%" of the device's memory), for types that take one
    role: str  # SUBJECT or SELECTOR in the rule's scope
    where: str  # FILE:LINE:COL
    text: str  # e.g. "gpu_utilization > 95 for 5m"
    # How a duration is judged: "every" sample of it (the window restarts when one fails), or the "mean" of
    # the samples over it (a keep-alive burst moves the mean a little and restarts nothing).
    over: str = "every"


@dataclass(frozen=True, slots=True)
class Exemptions:
    users: tuple[str, ...] = ()  # names, or uids written as numbers
    groups: tuple[str, ...] = ()
    units: tuple[str, ...] = ()  # shell patterns on the systemd unit (e.g. "slurmstepd*")
    processes: tuple[str, ...] = ()  # shell patterns on the process name

    def __bool__(self) -> bool:
        return bool(self.users or self.groups or self.units or self.processes)

    def merged(self, other: Exemptions) -> Exemptions:
        def union(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(dict.fromkeys(a + b))

        return Exemptions(
            union(self.users, other.users),
            union(self.groups, other.groups),
            union(self.units, other.units),
            union(self.processes, other.processes),
        )


@dataclass(frozen=True, slots=True)
class Postpone:
    """How much more time a kill rule lets a subject's owner ask for, per episode (`postpone: {max: 1h,
    times: 2}`): at most `max` seconds in all, in at most `times` postponements. A postponement moves the end
    of the episode's grace period later; it ends with the episode."""

    max: float
    times: int


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    description: str
    conditions: tuple[Condition, ...]
    match: str  # one of MATCHES
    scope: str  # one of SCOPES
    action: str  # one of ACTIONS
    force: bool  # kill: SIGKILL after kill_grace if SIGTERM did not do it; reset: kill the device's holders first
    grace_period: float  # seconds a violating subject has to come back under before a kill (suspend, requeue, cancel)
    kill_grace: float | None  # None: the policy's kill_grace
    notify: tuple[str, ...] | None  # None: the policy's default targets
    exemptions: Exemptions
    where: str
    # Action reset only: no second reset of the device within the cooldown after one, at most so many an hour.
    cooldown: float = RESET_COOLDOWN
    max_resets_per_hour: int = MAX_RESETS_PER_HOUR
    # Actions kill, suspend, requeue and cancel with a grace period only: when to warn, as seconds before the grace
    # ends, largest first (`at_start` is the grace period itself). Empty: the violation's notice is the one warning.
    warn: tuple[float, ...] = ()
    # Action kill or suspend only: what one kill (or suspend) of a process takes with it (records.reclaim's
    # KILL_SCOPES). "tree": its descendants on a GPU too (a trainer's workers); "unit": the GPU processes of its
    # systemd unit. Only the subject's owner's processes: Guard acts for no caller, and a setuid helper of another
    # user in the tree is not the rule's. A suspend takes its whole scope or nothing.
    kill_scope: str = KILL_PROCESS
    # Action kill with a grace period only: how long an owner may postpone the kill (None: never).
    postpone: Postpone | None = None
    # Action kill only: the checkpoint signal its victims that declare none themselves get before SIGTERM
    # (gpukill.checkpoint; source "policy FILE:LINE:COL"). None: only what a process declares itself.
    checkpoint: Declaration | None = None

    @property
    def stops(self) -> bool:
        """Its action stops the subject's processes (stops_subject): a grace period, warnings, victims chosen and
        counted toward max_kills_per_cycle, a cooldown after; what stops them is the action's path."""
        return stops_subject(self.action)

    @property
    def fingerprint(self) -> tuple:
        """What the rule does, without where it was written: an unchanged rule keeps its windows on reload."""
        return (
            self.name,
            self.match,
            self.scope,
            self.action,
            self.force,
            self.grace_period,
            self.kill_grace,
            self.notify,
            self.exemptions,
            self.cooldown,
            self.max_resets_per_hour,
            self.warn,
            self.kill_scope,
            self.postpone,
            None if self.checkpoint is None else (self.checkpoint.signal, self.checkpoint.wait, self.checkpoint.each),
            tuple(
                (c.type, c.operator, _fingerprint_value(c.value), c.duration, c.percent_of_total, c.over)
                for c in self.conditions
            ),
        )


def _fingerprint_value(value: Any) -> Any:
    """Compiled patterns compare by their text (RE2 patterns compare by identity, and one compiled from the
    same text after a reload is another object)."""
    return ("re", value.pattern) if isinstance(value, _RE2_PATTERN | re.Pattern) else value


@dataclass(frozen=True, slots=True)
class Settings:
    sample_interval: float | None = None  # None: every snapshot the daemon takes
    dry_run: bool = False
    max_kills_per_cycle: int = 10
    cooldown: float = 10.0
    kill_grace: float = 5.0
    # The longest a kill waits for a job to exit after its checkpoint signal, whatever it declared; 0: no
    # checkpoint signal is ever sent.
    max_checkpoint_wait: float = DEFAULT_MAX_WAIT
    notify: tuple[str, ...] = ()
    exemptions: Exemptions = field(default_factory=Exemptions)


@dataclass(frozen=True, slots=True)
class Policy:
    settings: Settings
    rules: tuple[Rule, ...]
    sources: tuple[str, ...]  # file names, in the order they were read
    # The user and group names it writes: (user or group, name, FILE:LINE:COL), each once; an id is not one.
    names: tuple[tuple[str, str, str], ...] = field(default=(), compare=False)

    @property
    def source(self) -> str:
        return ", ".join(self.sources) if self.sources else "(none)"


EMPTY_POLICY = Policy(Settings(), (), ())
