"""What the desktop notification agent shows for each of gpukilld's signals, and to whom. Pure: no bus, and the
caller passes the time in, so the countdowns and the waits here are tested with a clock the test sets.

A signal becomes Toasts (a desktop notification's content). Toasts with the same key are one notification
updated in place: a Guard violation opens it (critical, with the time left while a kill waits for its grace),
each second of the countdown updates it, and the GuardActionTaken that ends it (killed, cancelled, refused)
closes it with the outcome. The records' text is escaped as it comes in (gpukill.text.shown): a process
chooses its name, and a newline in it must not become a line of the body, which the agent joins from lines
of its own. A Notification's body is lines already, each escaped by the daemon; the desktop end escapes each
line again and the markup (desktop.py).

Whom an event concerns (Audience): ProcessKilled by its uid, ProcessSuspended and ProcessResumed by their
process's uid, PolicyViolated by details.uid, Notification by its uid; GuardActionTaken carries no uid, so it
concerns the user when it ends a violation of theirs (same rule and subject) or stops a process of theirs (the
kill path's ProcessKilled, or the suspend path's ProcessSuspended, which comes just before it, said whose the
process was). A suspend says how to resume: `gpukillctl resume PID`. Device events concern no one user: they
are shown with `--all` only.
"""

from __future__ import annotations

import math
import pwd
from collections import OrderedDict
from dataclasses import dataclass, field, fields, is_dataclass, replace
from enum import Enum
from typing import Any

from gpukill.outcome import INITIATOR_RESET, INITIATOR_USER, Outcome, result_text, resume_hint
from gpukill.records.manager import STATE_OK
from gpukill.records.signals import (
    NO_UID,
    DeviceReset,
    DeviceStateChanged,
    Event,
    GuardActionTaken,
    Notification,
    PolicyViolated,
    ProcessKilled,
    ProcessResumed,
    ProcessSuspended,
)
from gpukill.records.suspend import STUCK
from gpukill.rules import KILL, SUSPEND, stops_subject, through_slurm
from gpukill.text import shown
from gpukill.units import format_duration, format_size

LOW, NORMAL, CRITICAL = 0, 1, 2  # the urgency hint of the notification spec
GUARD_PREFIX = "guard:"
# A Guard kill's ProcessKilled (a Guard suspend's ProcessSuspended) waits this long for its GuardActionTaken,
# which says the same with the rule's context; without one (a daemon stopped between the two) it is shown by
# itself.
CLAIM_WAIT = 2.0
# An ended violation's notification takes the outcomes of the rest of its kill (a per_user rule stops
# several processes) for this long.
CLOSED_KEPT = 30.0
# A Notification signal for a rule whose violation or outcome this agent showed this recently says nothing
# new (a rule with `notify: [desktop]` words the same event a second time): it is folded.
FOLD_WINDOW = 10.0
MAX_TRACKED = 1024  # open violations and waiting Guard kills remembered, the oldest forgotten first


class Step(Enum):
    OPEN = "open"  # a new pop-up (the first of its key, or one without a key)
    UPDATE = "update"  # new text for an open pop-up; dropped when that pop-up was never shown
    CLOSE = "close"  # the last text of a key: in place when its pop-up is shown, else a pop-up of its own


@dataclass(frozen=True, slots=True)
class Toast:
    summary: str  # one line, its text escaped
    body: str  # lines, each escaped
    urgency: int = NORMAL
    key: str = ""  # "" for a notification of its own
    step: Step = Step.OPEN


@dataclass(frozen=True, slots=True)
class Audience:
    """Whose events are shown: the user's own, or (`--all`, an admin's opt-in) everyone's."""

    uid: int
    everything: bool = False

    def concerns(self, uid: int | None) -> bool:
        return self.everything or (uid is not None and uid == self.uid)


@dataclass(slots=True)
class Slot:
    """A violation of one rule by one subject that the user is shown, until its outcome and a while after."""

    rule: str
    subject: str
    reason: str
    deadline: float | None  # monotonic time the grace ends, for a kill that waits; None: no countdown
    action: str = KILL  # the rule's: kill, suspend, or requeue or cancel (Slurm acts on the job)
    shown_seconds: int = -1  # the time left the notification says now
    outcomes: list[str] = field(default_factory=list)  # one line per process the rule's kill ended
    closed_at: float | None = None


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _one_line_texts(record: Any, keep: tuple[str, ...] = ()) -> Any:
    """The record with each text in it (and in the records within it) escaped by shown(), but the fields in
    keep; the record itself when nothing needed escaping."""
    changes: dict[str, Any] = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if f.name in keep:
            continue
        new: object  # the value escaped: a text, texts, or a record
        if isinstance(value, str):
            new = shown(value)
        elif isinstance(value, tuple) and all(isinstance(v, str) for v in value):
            new = tuple(map(shown, value))
        elif is_dataclass(value):
            new = _one_line_texts(value)
        else:
            continue
        if new != value:
            changes[f.name] = new
    return replace(record, **changes) if changes else record


def _slot_key(rule: str, subject: str) -> str:
    return f"guard\0{rule}\0{subject}"


def _process(comm: str, pid: int) -> str:
    return f"{comm} (PID {pid})"


Stopped = ProcessKilled | ProcessSuspended  # what the kill or suspend path said of a Guard rule's process


def _key_of(e: Stopped) -> tuple[int, int]:
    p = e.process if isinstance(e, ProcessSuspended) else e
    return (p.pid, p.start_time)


def _comm_of(e: Stopped) -> str:
    return e.process.comm if isinstance(e, ProcessSuspended) else e.comm


def _gpus(devices: tuple[int, ...]) -> str:
    return ", ".join(f"GPU {d}" for d in devices) or "a GPU"


class Narrator:
    """Signals in, Toasts out; tick() for what time changes (countdowns, Guard kills left unclaimed)."""

    def __init__(self, audience: Audience) -> None:
        self.audience = audience
        self.slots: OrderedDict[str, Slot] = OrderedDict()
        self.unclaimed: OrderedDict[tuple[int, int], tuple[Stopped, float]] = OrderedDict()
        self.rule_shown: dict[str, float] = {}

    # -- signals --------------------------------------------------------------------------------------

    def on_event(self, event: Event, now: float, wall: float) -> list[Toast]:
        """The Toasts for one signal; now is monotonic, wall the epoch time (a violation's grace started
        at its details.time, which is wall clock)."""
        event = _one_line_texts(event, keep=("body",) if isinstance(event, Notification) else ())
        if isinstance(event, ProcessKilled):
            return self._killed(event, now)
        if isinstance(event, ProcessSuspended):
            return self._suspended(event, now)
        if isinstance(event, ProcessResumed):
            return self._resumed(event)
        if isinstance(event, PolicyViolated):
            return self._violated(event, now, wall)
        if isinstance(event, GuardActionTaken):
            return self._action(event, now)
        if isinstance(event, Notification):
            return self._notice(event, now)
        if isinstance(event, DeviceStateChanged | DeviceReset):
            return self._device(event) if self.audience.everything else []
        return []

    def _killed(self, k: ProcessKilled, now: float) -> list[Toast]:
        if not self.audience.concerns(k.uid):
            return []
        if k.initiator.startswith(GUARD_PREFIX):  # GuardActionTaken follows and says it with its context
            self.unclaimed[_key_of(k)] = (k, now + CLAIM_WAIT)
            _trim(self.unclaimed)
            return []
        return [self._kill_toast(k)]

    def _suspended(self, e: ProcessSuspended, now: float) -> list[Toast]:
        if not self.audience.concerns(e.process.uid):
            return []
        if e.process.initiator.startswith(GUARD_PREFIX):  # GuardActionTaken follows, as for a Guard kill
            self.unclaimed[_key_of(e)] = (e, now + CLAIM_WAIT)
            _trim(self.unclaimed)
            return []
        return [self._suspend_toast(e)]

    def _by(self, initiator: str, caller_uid: int) -> str:
        """Who asked, as the user reads it."""
        if initiator.startswith(GUARD_PREFIX):
            return f"Guard rule {initiator.removeprefix(GUARD_PREFIX)}"
        if initiator == INITIATOR_RESET:
            return "a reset of its GPU"
        if initiator in (INITIATOR_USER, ""):
            return "you" if caller_uid == self.audience.uid else user_name(caller_uid)
        return initiator

    def _suspend_toast(self, e: ProcessSuspended) -> Toast:
        p = e.process
        whose = "" if p.uid == self.audience.uid else f" of {user_name(p.uid)}"
        return Toast(
            f"GPU process suspended: {_process(p.comm, p.pid)}",
            f"{_process(p.comm, p.pid)}{whose} on {_gpus(p.devices)}: {format_size(p.memory)} of GPU memory set "
            f"aside in host memory, asked by {self._by(p.initiator, e.caller_uid)}.\n"
            f"It waits, frozen: {resume_hint(p.pid).removeprefix('suspended; ')}.",
            NORMAL,
        )

    def _resumed(self, e: ProcessResumed) -> list[Toast]:
        p = e.process
        if not self.audience.concerns(p.uid):
            return []
        whose = "" if p.uid == self.audience.uid else f" of {user_name(p.uid)}"
        by = self._by(INITIATOR_USER, e.caller_uid)
        if p.state == STUCK:
            return [
                Toast(
                    f"GPU process stuck: {_process(p.comm, p.pid)}",
                    f"{_process(p.comm, p.pid)}{whose} could not be resumed ({p.error}), asked by {by}.\n{p.remedy}",
                    CRITICAL,
                )
            ]
        return [
            Toast(
                f"GPU process resumed: {_process(p.comm, p.pid)}",
                f"{_process(p.comm, p.pid)}{whose} on {_gpus(p.devices)}: its {format_size(p.memory)} of GPU "
                f"memory is back, asked by {by}.",
                NORMAL,
            )
        ]

    def _alone(self, e: Stopped) -> Toast:
        """A Guard kill's or suspend's own notification, when no GuardActionTaken claimed it."""
        return self._suspend_toast(e) if isinstance(e, ProcessSuspended) else self._kill_toast(e)

    def _kill_toast(self, k: ProcessKilled) -> Toast:
        by = self._by(k.initiator, k.caller_uid)
        alive = k.outcome == Outcome.STILL_ALIVE
        summary = f"GPU process {'still running' if alive else 'stopped'}: {_process(k.comm, k.pid)}"
        whose = "" if k.uid == self.audience.uid else f" of {user_name(k.uid)}"
        body = (
            f"{_process(k.comm, k.pid)}{whose} on {', '.join(k.devices) or 'a GPU'}: "
            f"{result_text(k.outcome)}, asked by {by}."
        )
        return Toast(summary, body, CRITICAL if alive else NORMAL)

    def _violated(self, v: PolicyViolated, now: float, wall: float) -> list[Toast]:
        d = v.details
        if not self.audience.concerns(d.uid) or v.action == "log":  # a log rule is meant to be quiet
            return []
        key = _slot_key(v.rule, v.subject)
        waits = stops_subject(v.action) and not v.dry_run
        left = max(0.0, d.grace - max(0.0, wall - d.time)) if d.time else d.grace
        slot = Slot(v.rule, v.subject, d.reason, now + left if waits else None, v.action)
        self.slots[key] = slot
        self.slots.move_to_end(key)
        _trim(self.slots)
        self.rule_shown[v.rule] = now
        if waits:
            return [self._countdown(slot, now, Step.OPEN)]
        if stops_subject(v.action):  # a dry run: nothing will be signalled (suspended)
            suspend = v.action == SUSPEND
            return [
                Toast(
                    f"Dry run: Guard would {'suspend' if suspend else 'stop'} {v.subject}",
                    f"Guard rule {v.rule}: {d.reason}. The rule is in dry run: nothing is "
                    f"{'suspended' if suspend else 'signalled'}.",
                    NORMAL,
                    key,
                    Step.OPEN,
                )
            ]
        return [Toast(f"Guard rule {v.rule}: {v.subject}", f"{d.reason}.", NORMAL, key, Step.OPEN)]

    def _countdown(self, slot: Slot, now: float, step: Step) -> Toast:
        assert slot.deadline is not None
        seconds = max(0, math.ceil(slot.deadline - now - 1e-6))
        slot.shown_seconds = seconds
        stopped = "suspended" if slot.action == SUSPEND else "stopped"
        if seconds and slot.action == SUSPEND:
            summary = f"{slot.subject} will be suspended in {format_duration(seconds)}"
            then = (
                f"It is suspended in {format_duration(seconds)} unless it comes back within the rule: its GPU "
                "memory set aside in host memory until you resume it (gpukillctl resume PID)."
            )
        elif seconds:
            summary = f"{slot.subject} will be stopped in {format_duration(seconds)}"
            then = f"It gets SIGTERM in {format_duration(seconds)} unless it comes back within the rule."
            if through_slurm(slot.action):
                then = (
                    f"Slurm is asked to {slot.action} its job in {format_duration(seconds)} unless it comes back "
                    "within the rule."
                )
        else:
            summary = f"{slot.subject} is being {stopped}"
            then = f"Its grace period is over: it is being {stopped} now."
        return Toast(
            summary,
            f"Guard rule {slot.rule}: {slot.reason}.\n{then}",
            CRITICAL,
            _slot_key(slot.rule, slot.subject),
            step,
        )

    def _action(self, a: GuardActionTaken, now: float) -> list[Toast]:
        key = _slot_key(a.rule, a.subject)
        slot = self.slots.get(key)
        claimed = self.unclaimed.pop((a.pid, a.start_time), None) if a.pid else None
        if slot is None and claimed is None and not self.audience.everything:
            return []
        self.rule_shown[a.rule] = now
        comm = _comm_of(claimed[0]) if claimed else ""
        if a.outcome == Outcome.CANCELLED:
            undone = "suspended" if a.action == SUSPEND else "stopped"
            line = f"{a.subject} {Outcome.CANCELLED.text}: nothing was {undone}."
            summary = f"Guard warning over: {a.subject}"
        else:
            what = _process(comm, a.pid) if comm else f"PID {a.pid}"
            done = result_text(a.outcome, action=a.action)
            line = (
                f"{what} {resume_hint(a.pid) if a.outcome == Outcome.SUSPENDED else done}"
                + (" (dry run)" if a.dry_run else "")
                + "."
            )
            summary = (
                f"Guard rule {a.rule}: {what} {done}"
                if slot is None or not slot.outcomes
                else f"Guard rule {a.rule}: {len(slot.outcomes) + 1} processes of {a.subject}"
            )
        if slot is None:
            return [Toast(summary, f"Guard rule {a.rule}, {a.subject}: {line}", NORMAL)]
        slot.outcomes.append(line)
        slot.closed_at = now
        slot.deadline = None
        reason = f"Guard rule {a.rule}: {slot.reason}."
        return [Toast(summary, "\n".join([reason, *slot.outcomes]), NORMAL, key, Step.CLOSE)]

    def _notice(self, n: Notification, now: float) -> list[Toast]:
        uid = None if n.uid == NO_UID else n.uid
        if not self.audience.concerns(uid):
            return []
        shown_at = self.rule_shown.get(n.rule)
        if shown_at is not None and now - shown_at < FOLD_WINDOW:
            return []
        return [Toast(n.summary, n.body, NORMAL)]

    def _device(self, e: DeviceStateChanged | DeviceReset) -> list[Toast]:
        if isinstance(e, DeviceReset):
            killed = f" {len(e.killed)} process(es) were stopped first." if e.killed else ""
            return [
                Toast(
                    f"GPU {e.index} {'reset' if e.success else 'reset failed'}",
                    f"GPU {e.index} ({e.id}): {e.message}.{killed}",
                    NORMAL if e.success else CRITICAL,
                )
            ]
        bad = e.state != STATE_OK
        return [
            Toast(
                f"GPU {e.index} is {e.state}",
                f"GPU {e.index} ({e.id}) is {e.state}" + (f": {e.reason}." if e.reason else "."),
                CRITICAL if bad else NORMAL,
            )
        ]

    # -- time -----------------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Toast]:
        """The countdowns whose shown time changed, and the Guard kills no GuardActionTaken claimed."""
        toasts = []
        for key, slot in list(self.slots.items()):
            if (
                slot.deadline is not None
                and slot.shown_seconds > 0
                and math.ceil(slot.deadline - now - 1e-6) != slot.shown_seconds
            ):
                toasts.append(self._countdown(slot, now, Step.UPDATE))
            if slot.closed_at is not None and now - slot.closed_at > CLOSED_KEPT:
                del self.slots[key]
        for pid_start, (k, until) in list(self.unclaimed.items()):
            if now >= until:
                del self.unclaimed[pid_start]
                toasts.append(self._alone(k))
        self.rule_shown = {r: t for r, t in self.rule_shown.items() if now - t < FOLD_WINDOW}
        return toasts

    def next_due(self) -> float | None:
        """The monotonic time tick() has something to do, or None."""
        times = [until for _, until in self.unclaimed.values()]
        for slot in self.slots.values():
            if slot.deadline is not None and slot.shown_seconds > 0:
                times.append(slot.deadline - (slot.shown_seconds - 1))  # the shown second changes
            if slot.closed_at is not None:
                times.append(slot.closed_at + CLOSED_KEPT)
        return min(times, default=None)


def _trim(table: OrderedDict) -> None:
    while len(table) > MAX_TRACKED:
        table.popitem(last=False)
