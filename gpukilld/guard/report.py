"""What each guard event is reported as: its journal entry, its D-Bus signal, its entry among the recent events
and its notice (e-mail, webhook, desktop, journal), worded here and nowhere else.

Pure: no audit trail, no bus, no clock. The runner hands in the event with the host name and the time, and
writes, emits, remembers and sends what comes back as it is. One Report per engine event: a violation, a
grace period that ended without a kill, a dry run's kill order, one process of a kill order once the kill path
(the suspend path, for a rule with action suspend) has answered, the end of a dry run's episode (Left), a dry
run's reset order, or a reset order once the reset path has answered (its GuardActionTaken has pid 0 and the
device as subject; the reset path writes its own `reset` entry and DeviceReset signal, with the rule); a dry run's
requeue or cancel order, one job of such an order once Slurm has answered (guard-slurm, guard-slurm-refused), or
its processes of no Slurm job. Every wording of an outcome comes from gpukill.outcome, so the journal, the bus,
the recent events and the notices say the same; a suspended process's notice says how its owner resumes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpukill.outcome import Outcome, result_text, resume_hint
from gpukill.records.guard import RecentEvent
from gpukill.rules import JOB_DONE, KILL, REQUEUE, RESET, SUSPEND, Rule, stops_subject, through_slurm
from gpukill.text import shown
from gpukill.units import format_duration, format_size

from .. import journal as audit  # the event kinds (a local `journal` is an entry)
from .engine import (
    GraceCancelled,
    GraceWarning,
    JobOrder,
    KillOrder,
    KillOverCap,
    Left,
    ResetOrder,
    Scoped,
    Target,
    Violation,
    scoped_text,
    too_large_text,
    unattached_text,
)
from .notify import Notice

LEFT = "left"  # a dry run's episode ended: the result of its journal entry, the event of its recent entry


@dataclass(frozen=True, slots=True)
class AuditEntry:
    kind: audit.EventKind
    message: str
    fields: dict[str, Any]  # GPUKILL_* fields without the prefix, as Audit.log takes them


@dataclass(frozen=True, slots=True)
class Violated:
    """The arguments of GuardSignals.violated: PolicyViolated on the bus."""

    event: Violation
    dry_run: bool


@dataclass(frozen=True, slots=True)
class ActionTaken:
    """The arguments of GuardSignals.action_taken: GuardActionTaken on the bus."""

    rule: str
    subject: str
    action: str
    pid: int  # 0 where no process is concerned (a cancelled grace)
    start_time: int
    outcome: str  # an Outcome, or the kill path's refusal (GpukillError.result)
    dry_run: bool


@dataclass(frozen=True, slots=True)
class Entry:
    """One thing that happened, as the journal, the bus and the recent events each show it."""

    journal: AuditEntry
    signal: Violated | ActionTaken | None  # None: no signal of its own (a warning: its notice is the message)
    recent: RecentEvent


@dataclass(frozen=True, slots=True)
class Report:
    entries: tuple[Entry, ...]  # in the order they are reported: one per process for a kill order
    notice: Notice | None  # sent to the rule's notify targets; None: the event is not notified


def _nothing(rule: Rule, future: bool = False) -> str:
    """What a dry run or a cancelled grace did not do (future: will not do), for a rule that stops its subject."""
    if through_slurm(rule.action):
        return "Slurm will not be asked" if future else "Slurm was not asked"
    was = "will be" if future else "was"
    return f"nothing {was} suspended" if rule.action == SUSPEND else f"nothing {was} signalled"


def _stop_plan(rule: Rule, targets: tuple[Target, ...], left: str) -> str:
    """What happens to the targets when `left` (a duration; "" for now) is over: SIGTERM, a suspend, or Slurm's
    act on their jobs."""
    if rule.action == SUSPEND:
        aside = "their GPU memory set aside in host memory until resumed (gpukillctl resume PID)"
        if not left:
            return f"suspending {_pids(targets)} now: {aside}"
        return f"{_pids(targets)} are suspended in {left} unless it comes back under: {aside}"
    if through_slurm(rule.action):
        return _slurm_plan(rule, targets, f"in {left} unless it comes back under" if left else "now")
    if not left:
        return f"stopping {_pids(targets)} now"
    return f"{_pids(targets)} get SIGTERM in {left} unless it comes back under"


def _pids(targets: tuple[Target, ...]) -> str:
    return ", ".join(
        f"{t.pid} ({t.comm}" + (f", {format_size(t.gpu_memory)}" if t.gpu_memory else "") + ")" for t in targets
    )


@dataclass(frozen=True, slots=True)
class GuardNotice(Notice):
    """A notice and its body as other users may read it: the desktop channel sends it as the Notification
    signal, which every listener on the bus gets; e-mail and webhook go to the admin's addresses, whole."""

    body_for_others: str = ""


def _notice(
    rule: Rule,
    event: str,
    summary: str,
    lines: list[str],
    data: dict[str, Any],
    host: str,
    now: float,
    reason_for_others: str | None = None,
    private: tuple[str, ...] = (),
) -> GuardNotice:
    """reason_for_others: the Why line as others may read it (engine: reason_for_others); None: as it is.
    private: lines left out of the body as others read it (other processes' names and why they were spared).
    Each line and the summary are escaped here (shown()), before any channel sees them: a process's name,
    command line or unit may hold a newline or a terminal control, and must stay inside its own line on the
    terminal, in the mail (its Subject too), on the desktop and in the journal. The webhook's JSON keeps the
    exact values."""
    reason = str(data.get("reason", ""))
    shared = [
        f"Why: {reason_for_others}" if reason_for_others is not None and line == f"Why: {reason}" else line
        for line in lines
        if line not in private
    ]
    return GuardNotice(
        event,
        rule.name,
        str(data.get("subject", "")),
        shown(summary),
        "\n".join(map(shown, lines)) + "\n",
        {"event": event, "rule": rule.name, "host": host, "time": now, "summary": summary, **data},
        "\n".join(map(shown, shared)) + "\n",
    )


def ask_for_time(rule: Rule, targets: tuple[Target, ...]) -> list[str]:
    """How the owner asks for more time, where the rule allows it (`postpone:`), with its caps; [] otherwise."""
    caps = rule.postpone
    if caps is None or rule.action != KILL or not rule.grace_period:
        return []
    pid = str(targets[0].pid) if targets else "PID"
    times = "1 postponement" if caps.times == 1 else f"{caps.times} postponements"
    return [
        f"To ask for more time: gpukillctl postpone {pid} 20min --reason '...' "
        f"(rule {rule.name} allows up to {format_duration(caps.max)} more in {times})"
    ]


def _slurm_plan(rule: Rule, targets: tuple[Target, ...], when: str) -> str:
    """What a requeue or cancel rule does to the targets' jobs `when` ("in 2m unless it comes back under", "now"):
    "job 42 (PID 11 (python3)) is requeued through Slurm in 2m ...", with the processes of no Slurm job that it
    leaves running."""
    jobs = sorted({t.slurm_job for t in targets if t.slurm_job}, key=lambda j: (len(j), j))
    parts = []
    if jobs:
        of_jobs = _pids(tuple(t for t in targets if t.slurm_job))
        parts.append(f"job {', '.join(jobs)} (PID {of_jobs}) is {JOB_DONE[rule.action]} through Slurm {when}")
    strays = tuple(t for t in targets if not t.slurm_job)
    if strays:
        parts.append(unattached_text(rule.action, strays))
    return "; ".join(parts) or "nothing"


def violation(ev: Violation, dry_run: bool, host: str, now: float, saving: str = "") -> Report:
    """saving: the checkpoint signals sent when the grace began, in words (acts/checkpoint.py's asked_text:
    "sent SIGUSR1 to PID 12 to save, waiting up to 2min"; in a dry run "would send ..."); "" when none was."""
    rule = ev.rule
    dry = f" (dry run: {_nothing(rule, future=True)})" if dry_run and stops_subject(rule.action) else ""
    if stops_subject(rule.action):
        plan = _stop_plan(rule, ev.targets, format_duration(rule.grace_period) if rule.grace_period else "")
        what = f"its process(es) {plan}" if rule.grace_period and not through_slurm(rule.action) else plan
    elif rule.action == RESET:
        dry = " (dry run: nothing will be reset)" if dry_run else ""
        what = _reset_plan(rule, ev.targets)
    else:
        what = "notifying" if rule.action == "notify" else "logged"
    if saving:
        what += f"; {saving}"
    journal = AuditEntry(
        audit.GUARD_VIOLATION,
        f"Guard rule {rule.name}: {ev.subject} violates it ({ev.reason}); {what}{dry}",
        {
            "action": "guard",
            "result": "violation",
            "rule": rule.name,
            "rule_action": rule.action,
            "subject": ev.subject,
            "reason": ev.reason,
            "grace": rule.grace_period,
            "dry_run": int(dry_run),
            "target_pids": ",".join(str(t.pid) for t in ev.targets) or None,
            "target_uid": ev.uid,
        },
    )
    recent = RecentEvent(now, rule.name, ev.subject, ev.uid, "violation", rule.action, "", None, dry_run)
    notice = _notice(
        rule,
        "violation",
        f"{rule.name}: {ev.subject} violates the rule",
        [
            f"Host: {host}",
            f"Rule: {rule.name}" + (f" ({rule.description})" if rule.description else ""),
            f"Subject: {ev.subject}",
            f"Why: {ev.reason}",
            f"What happens: {what}{dry}",
            *(
                [f"Checkpoint: the job was asked to save its work now ({saving}); it may exit by itself before"]
                if saving and not dry_run
                else []
            ),
            *ask_for_time(rule, ev.targets),
        ],
        {
            "subject": ev.subject,
            "reason": ev.reason,
            "action": rule.action,
            "dry_run": dry_run,
            "grace": rule.grace_period,
            "pids": [t.pid for t in ev.targets],
            "uid": ev.uid,
        },
        host,
        now,
        ev.reason_for_others,
    )
    # With a warn schedule the violation's notice is its at_start warning: sent only if the schedule says so.
    warned_at_start = not rule.warn or not stops_subject(rule.action) or rule.warn[0] >= rule.grace_period
    return Report((Entry(journal, Violated(ev, dry_run), recent),), notice if warned_at_start else None)


def warning(ev: GraceWarning, dry_run: bool, host: str, now: float) -> Report:
    """A warning of the rule's schedule: what will be stopped (or suspended), when, why, and what the owner can
    do."""
    rule = ev.rule
    left = format_duration(max(1.0, round(ev.remaining)))
    dry = f" (dry run: {_nothing(rule, future=True)})" if dry_run else ""
    what = f"{_stop_plan(rule, ev.targets, left)}{dry}"
    journal = AuditEntry(
        audit.GUARD_WARNING,
        f"Guard rule {rule.name}: warning {ev.number} of {len(rule.warn)} to {ev.subject}: {what} ({ev.reason})",
        {
            "action": "guard",
            "result": "warning",
            "rule": rule.name,
            "subject": ev.subject,
            "reason": ev.reason,
            "remaining": round(ev.remaining, 1),
            "warning": ev.number,
            "dry_run": int(dry_run),
            "target_pids": ",".join(str(t.pid) for t in ev.targets) or None,
            "target_uid": ev.uid,
        },
    )
    recent = RecentEvent(now, rule.name, ev.subject, ev.uid, "warning", rule.action, "", None, dry_run)
    stopped = "suspended" if rule.action == SUSPEND else JOB_DONE.get(rule.action, "stopped")
    notice = _notice(
        rule,
        "warning",
        f"{rule.name}: {ev.subject} will be {stopped} in {left}",
        [
            f"Host: {host}",
            f"Rule: {rule.name}" + (f" ({rule.description})" if rule.description else ""),
            f"Subject: {ev.subject}",
            f"Why: {ev.reason}",
            f"What happens: {what}",
            "What to do: end the process or bring it back under the rule before then; ask the "
            "administrators for an exemption if it must run",
            *ask_for_time(rule, ev.targets),
        ],
        {
            "subject": ev.subject,
            "reason": ev.reason,
            "action": rule.action,
            "dry_run": dry_run,
            "remaining": ev.remaining,
            "warning": ev.number,
            "pids": [t.pid for t in ev.targets],
            "uid": ev.uid,
        },
        host,
        now,
        ev.reason_for_others,
    )
    return Report((Entry(journal, None, recent),), notice)


def cancelled(ev: GraceCancelled, dry_run: bool, now: float) -> Report:
    """Not notified: the violation was, and nothing happened since."""
    outcome = Outcome.CANCELLED
    journal = AuditEntry(
        audit.GUARD_ACTION,
        f"Guard rule {ev.rule.name}: {ev.subject} {outcome.text}; {_nothing(ev.rule)}",
        {
            "action": "guard",
            "result": outcome,
            "rule": ev.rule.name,
            "subject": ev.subject,
            "target_uid": ev.uid,
            "dry_run": int(dry_run),
        },
    )
    signal = ActionTaken(ev.rule.name, ev.subject, ev.rule.action, 0, 0, outcome, dry_run)
    recent = RecentEvent(now, ev.rule.name, ev.subject, ev.uid, "cancelled", ev.rule.action, outcome, None, dry_run)
    return Report((Entry(journal, signal, recent),), None)


def would_kill(order: KillOrder, host: str, now: float) -> Report:
    """A dry run's kill (or suspend) order: one entry per process it names, one notice for them all."""
    rule = order.rule
    outcome = Outcome.WOULD_SUSPEND if rule.action == SUSPEND else Outcome.WOULD_KILL
    entries = []
    for i, t in enumerate(order.targets):
        scoped = order.scoped[i] if i < len(order.scoped) else None
        detail = scoped_text(scoped) if scoped is not None else ""
        held = f", {format_size(t.gpu_memory)}" if t.gpu_memory and rule.action == SUSPEND else ""
        journal = AuditEntry(
            audit.GUARD_DRY_RUN,
            f"Dry run: guard rule {rule.name} {outcome.text} PID {t.pid} ({t.comm}{held}, user "
            f"{t.user}) for {order.subject}{f'; {detail}' if detail else ''}; {_nothing(rule)}",
            {
                "action": "guard",
                "result": outcome,
                "rule": rule.name,
                "subject": order.subject,
                "target_pid": t.pid,
                "target_start_time": t.start_time,
                "target_uid": t.uid,
                "target_comm": t.comm,
                "force": int(order.force),
                "reason": order.reason,
                "dry_run": 1,
                **_scope_fields(scoped),
            },
        )
        signal = ActionTaken(rule.name, order.subject, rule.action, t.pid, t.start_time, outcome, True)
        recent = RecentEvent(
            now, rule.name, order.subject, t.uid, "action", rule.action, outcome, t.pid, True, detail=detail
        )
        entries.append(Entry(journal, signal, recent))
    would = "would have suspended" if rule.action == SUSPEND else "would have stopped"
    notice = _notice(
        rule,
        "action",
        f"{rule.name}: {outcome.text} {_pids(order.targets)} (dry run)",
        [
            f"Host: {host}",
            f"Rule: {rule.name}",
            f"Subject: {order.subject}",
            f"Why: {order.reason}",
            f"Dry run: {would} {_pids(order.targets)}; {_nothing(rule)}",
        ],
        {
            "subject": order.subject,
            "reason": order.reason,
            "action": rule.action,
            "dry_run": True,
            "outcome": outcome,
            "pids": [t.pid for t in order.targets],
            "uid": order.uid,
        },
        host,
        now,
        order.reason_for_others,
    )
    return Report(tuple(entries), notice)


def left(ev: Left, now: float) -> Report:
    """A subject a dry run announced no longer violates the rule. Not notified: nothing happened to it."""
    rule = ev.rule
    journal = AuditEntry(
        audit.GUARD_DRY_RUN,
        f"Dry run: guard rule {rule.name}: {ev.subject} no longer violates it ({ev.why}); its "
        f"{Outcome.WOULD_SUSPEND if rule.action == SUSPEND else Outcome.WOULD_KILL} episode ended",
        {
            "action": "guard",
            "result": LEFT,
            "rule": rule.name,
            "subject": ev.subject,
            "reason": ev.why,
            "target_uid": ev.uid,
            "dry_run": 1,
        },
    )
    recent = RecentEvent(now, rule.name, ev.subject, ev.uid, LEFT, rule.action, "", None, True)
    return Report((Entry(journal, None, recent),), None)


def _scope_fields(scoped: Scoped | None) -> dict[str, Any]:
    """GPUKILL_SCOPE_PIDS (what the kill_scope stopped with the target) and GPUKILL_LEFT_RUNNING (what it left)."""
    if scoped is None:
        return {}
    return {
        "scope_pids": ",".join(str(m.pid) for m in scoped.members) or None,
        "left_running": ",".join(str(t.pid) for t, _ in scoped.left) or None,
    }


def kill_done(
    order: KillOrder,
    t: Target,
    outcome: str,
    error: str,
    host: str,
    now: float,
    scoped: Scoped | None = None,
    results: dict[tuple[int, int], tuple[str, str]] | None = None,
) -> Report:
    """One process of a kill (or suspend) order once the kill (suspend) path answered: an Outcome, or its
    refusal's result with the error's message (the path audited the refusal itself; this entry says what became
    of the rule's act). scoped: what the rule's kill_scope added to it, with the path's results for those (each
    process's own entry has the details). A suspended process's owner reads how to resume it."""
    text = resume_hint(t.pid) if outcome == Outcome.SUSPENDED else result_text(outcome, error, order.rule.action)
    detail = scoped_text(scoped, results or {}) if scoped is not None else ""
    return _kill_result(
        order.rule,
        order.subject,
        order.reason,
        order.reason_for_others,
        t,
        outcome,
        text,
        detail,
        {"force": int(order.force), "error": error or None, **_scope_fields(scoped)},
        False,
        host,
        now,
    )


def _kill_result(
    rule: Rule,
    subject: str,
    reason: str,
    reason_for_others: str,
    t: Target,
    outcome: str,
    text: str,
    detail: str,
    fields: dict[str, Any],
    dry_run: bool,
    host: str,
    now: float,
) -> Report:
    """What became of a kill rule's act on one process, `text` after its name, `detail` (the kill_scope's) after
    that: the journal entry, GuardActionTaken, the recent event and the notice."""
    whose = "" if subject.startswith(f"PID {t.pid} ") else f" for {subject}"
    also = f"; {detail}" if detail else ""
    scope_line = (f"Scope: {detail}",) if detail else ()
    journal = AuditEntry(
        audit.GUARD_ACTION,
        f"Guard rule {rule.name}: PID {t.pid} ({t.comm}, user {t.user}) {text}{whose}{also} ({reason})",
        {
            "action": "guard",
            "result": outcome,
            "rule": rule.name,
            "subject": subject,
            "target_pid": t.pid,
            "target_start_time": t.start_time,
            "target_uid": t.uid,
            "target_comm": t.comm,
            **fields,
            "dry_run": int(dry_run),
        },
    )
    signal = ActionTaken(rule.name, subject, rule.action, t.pid, t.start_time, outcome, dry_run)
    recent = RecentEvent(now, rule.name, subject, t.uid, "action", rule.action, outcome, t.pid, dry_run, detail=detail)
    notice = _notice(
        rule,
        "action",
        f"{rule.name}: PID {t.pid} ({t.comm}) {text}",
        [
            f"Host: {host}",
            f"Rule: {rule.name}",
            f"Subject: {subject}",
            f"Why: {reason}",
            f"Result: PID {t.pid} ({t.comm}, user {t.user}) {text}",
            *scope_line,
        ],
        {
            "subject": subject,
            "reason": reason,
            "action": rule.action,
            "dry_run": dry_run,
            "outcome": outcome,
            "pids": [t.pid],
            "uid": t.uid,
        },
        host,
        now,
        reason_for_others,
        scope_line,
    )
    return Report((Entry(journal, signal, recent),), notice)


def over_cap(ev: KillOverCap, dry_run: bool, host: str, now: float) -> Report:
    """A due kill whose kill_scope is larger than the per-cycle cap: nothing is stopped, and the admin is told
    why (once per episode) and what lets it happen."""
    why = too_large_text(ev.rule, ev.needed, ev.cap)
    return _kill_result(
        ev.rule,
        ev.subject,
        ev.reason,
        ev.reason_for_others,
        ev.target,
        Outcome.OVER_CAP,
        f"not stopped: {why}",
        "",
        {"error": why},
        dry_run,
        host,
        now,
    )


def _reset_plan(rule: Rule, holders: tuple[Target, ...]) -> str:
    cap = f"at most once per {format_duration(rule.cooldown)} and {rule.max_resets_per_hour} time(s) an hour per device"
    if not holders:
        return f"resetting the device ({cap})"
    if rule.force:
        return f"killing its process(es) {_pids(holders)}, then resetting the device ({cap})"
    return f"no reset while its process(es) {_pids(holders)} run (force: false); then resetting it ({cap})"


def would_reset(order: ResetOrder, host: str, now: float) -> Report:
    """A dry run's reset order: nothing is killed, nothing is reset."""
    rule, outcome = order.rule, Outcome.WOULD_RESET
    killed = f"; its process(es) {_pids(order.holders)} would be killed first" if order.holders else ""
    journal = AuditEntry(
        audit.GUARD_DRY_RUN,
        f"Dry run: guard rule {rule.name}: {order.subject} {outcome.text}{killed}; nothing was done",
        {
            "action": "guard",
            "result": outcome,
            "rule": rule.name,
            "rule_action": RESET,
            "subject": order.subject,
            "device": order.subject_key,
            "force": int(order.force),
            "reason": order.reason,
            "dry_run": 1,
            "target_pids": ",".join(str(t.pid) for t in order.holders) or None,
        },
    )
    signal = ActionTaken(rule.name, order.subject, RESET, 0, 0, outcome, True)
    recent = RecentEvent(now, rule.name, order.subject, None, "action", RESET, outcome, None, True)
    notice = _notice(
        rule,
        "action",
        f"{rule.name}: {order.subject} {outcome.text} (dry run)",
        [
            f"Host: {host}",
            f"Rule: {rule.name}",
            f"Subject: {order.subject}",
            f"Why: {order.reason}",
            f"Dry run: {order.subject} {outcome.text}{killed}; nothing was done",
        ],
        {
            "subject": order.subject,
            "reason": order.reason,
            "action": RESET,
            "dry_run": True,
            "outcome": outcome,
            "pids": [t.pid for t in order.holders],
            "uid": None,
        },
        host,
        now,
    )
    return Report((Entry(journal, signal, recent),), notice)


def reset_done(order: ResetOrder, outcome: str, detail: str, killed: tuple[int, ...], host: str, now: float) -> Report:
    """A reset order once the reset path answered: Outcome.RESET with the backend's message, or the result of
    its refusal or failure with the error's message (the reset path audited the reset itself)."""
    rule = order.rule
    text = f"{Outcome.RESET.text}: {detail}" if outcome == Outcome.RESET else f"not reset: {detail or outcome}"
    after = f" after killing {', '.join(map(str, killed))}" if killed else ""
    journal = AuditEntry(
        audit.GUARD_ACTION,
        f"Guard rule {rule.name}: {order.subject} {text}{after} ({order.reason})",
        {
            "action": "guard",
            "result": outcome,
            "rule": rule.name,
            "rule_action": RESET,
            "subject": order.subject,
            "device": order.subject_key,
            "force": int(order.force),
            "killed": ",".join(map(str, killed)) or None,
            "error": None if outcome == Outcome.RESET else detail or None,
            "dry_run": 0,
        },
    )
    signal = ActionTaken(rule.name, order.subject, RESET, 0, 0, outcome, False)
    recent = RecentEvent(now, rule.name, order.subject, None, "action", RESET, outcome, None, False)
    notice = _notice(
        rule,
        "action",
        f"{rule.name}: {order.subject} {text}",
        [
            f"Host: {host}",
            f"Rule: {rule.name}",
            f"Subject: {order.subject}",
            f"Why: {order.reason}",
            f"Result: {order.subject} {text}{after}",
        ],
        {
            "subject": order.subject,
            "reason": order.reason,
            "action": RESET,
            "dry_run": False,
            "outcome": outcome,
            "pids": list(killed),
            "uid": None,
        },
        host,
        now,
    )
    return Report((Entry(journal, signal, recent),), notice)


# -- requeue and cancel: Slurm's acts on jobs ---------------------------------------------------------------------


def _job_report(
    order: JobOrder,
    kind: audit.EventKind,
    outcome: str,
    job: str,
    targets: tuple[Target, ...],
    text: str,
    fields: dict[str, Any],
    host: str,
    now: float,
) -> tuple[Entry, GuardNotice]:
    """One job of a requeue or cancel order (or one process of no job): `text` says what became of it, after the
    rule's name ("requeued job 42", "would requeue job 42", "not requeued: ..."); the journal entry, the
    GuardActionTaken (the job's first process), the recent event and the notice."""
    rule, first = order.rule, targets[0]
    whose = "" if order.subject in text else f" for {order.subject}"
    journal = AuditEntry(
        kind,
        f"Guard rule {rule.name}: {text}{whose} ({order.reason})",
        {
            "action": "guard",
            "result": outcome,
            "rule": rule.name,
            "rule_action": rule.action,
            "subject": order.subject,
            "slurm_job": job or None,
            "target_pid": first.pid,
            "target_start_time": first.start_time,
            "target_pids": ",".join(str(t.pid) for t in targets),
            "target_uid": first.uid,
            "target_comm": first.comm,
            "reason": order.reason,
            **fields,
            "dry_run": int(order.dry_run),
        },
    )
    detail = f"job {job}" if job else ""
    signal = ActionTaken(rule.name, order.subject, rule.action, first.pid, first.start_time, outcome, order.dry_run)
    recent = RecentEvent(
        now,
        rule.name,
        order.subject,
        first.uid,
        "action",
        rule.action,
        outcome,
        first.pid,
        order.dry_run,
        detail=detail,
    )
    notice = _notice(
        rule,
        "action",
        f"{rule.name}: {text}",
        [
            f"Host: {host}",
            f"Rule: {rule.name}",
            f"Subject: {order.subject}",
            f"Why: {order.reason}",
            f"Result: {text} ({_pids(targets)})",
        ],
        {
            "subject": order.subject,
            "reason": order.reason,
            "action": rule.action,
            "dry_run": order.dry_run,
            "outcome": outcome,
            "job": job,
            "pids": [t.pid for t in targets],
            "uid": first.uid,
        },
        host,
        now,
        order.reason_for_others,
    )
    return Entry(journal, signal, recent), notice


def _unattached(order: JobOrder, host: str, now: float) -> list[tuple[Entry, GuardNotice]]:
    """The order's processes of no Slurm job: left running, each said once while it lives."""
    return [
        _job_report(
            order,
            audit.GUARD_SLURM_REFUSED,
            Outcome.NOT_A_JOB,
            "",
            (t,),
            f"PID {t.pid} ({t.comm}, user {t.user}) {Outcome.NOT_A_JOB.text}",
            {"error": unattached_text(order.rule.action, (t,))},
            host,
            now,
        )
        for t in order.unattached
    ]


def _joined(order: JobOrder, parts: list[tuple[Entry, GuardNotice]]) -> Report:
    """One report for an order's entries, with one notice: the first's, or theirs together."""
    if not parts:
        return Report((), None)
    notice = parts[0][1]
    if len(parts) > 1:
        lines = "".join("Result: " + n.body.split("Result: ", 1)[1] for _, n in parts[1:])
        others = "".join("Result: " + n.body_for_others.split("Result: ", 1)[1] for _, n in parts[1:])
        notice = GuardNotice(
            notice.event,
            notice.rule,
            notice.subject,
            f"{order.rule.name}: {len(parts)} results for {shown(order.subject)}",
            notice.body + lines,
            notice.data,
            notice.body_for_others + others,
        )
    return Report(tuple(e for e, _ in parts), notice)


def would_act_on_jobs(order: JobOrder, host: str, now: float) -> Report:
    """A dry run's requeue or cancel order: "would requeue job 42" for each job (Slurm is not asked), and each
    process of no job left running."""
    outcome = Outcome.WOULD_REQUEUE if order.rule.action == REQUEUE else Outcome.WOULD_CANCEL
    parts = [
        _job_report(
            order,
            audit.GUARD_DRY_RUN,
            outcome,
            job,
            targets,
            f"{outcome.text} job {job} (dry run: Slurm was not asked)",
            {},
            host,
            now,
        )
        for job, targets in order.jobs
    ]
    return _joined(order, parts + _unattached(order, host, now))


def unattached(order: JobOrder, host: str, now: float) -> Report:
    """An enforcing order's processes of no Slurm job, reported when the order is taken."""
    return _joined(order, _unattached(order, host, now))


def job_done(order: JobOrder, job: str, outcome: str, message: str, error: str, host: str, now: float) -> Report:
    """One job of an order once Slurm answered: Outcome.REQUEUED or JOB_CANCELLED with what Slurm said, or a
    refusal's or failure's result (slurm.SlurmError's) with its message."""
    targets = next(t for j, t in order.jobs if j == job)
    if outcome in (Outcome.REQUEUED, Outcome.JOB_CANCELLED):
        text, kind = f"{Outcome(outcome).text} job {job}", audit.GUARD_SLURM
    else:
        verb = JOB_DONE[order.rule.action]
        text, kind = f"job {job} not {verb}: {error or outcome}", audit.GUARD_SLURM_REFUSED
        if error.startswith(f"job {job} "):  # Slurm's refusal already says which job and what was not done
            text = error
    fields = {"slurm_message": message or None, "error": error or None}
    return _joined(order, [_job_report(order, kind, outcome, job, targets, text, fields, host, now)])
