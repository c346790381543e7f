"""The Guard's records: its status, its policy's decisions, what LoadPolicy returns and the managed policies."""

from __future__ import annotations

from dataclasses import dataclass

from .base import wire


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleStatus:
    """A rule of the policy in force with its counters (GetStatus rules)."""

    name: str = wire("s", "the rule's name")
    description: str = wire("s", "the rule's description", "")
    action: str = wire("s", "kill, suspend, notify, log or reset")
    scope: str = wire("s", "per_process, per_user, per_device or per_group")
    match: str = wire("s", "all or any of the conditions", "all")
    conditions: tuple[str, ...] = wire("as", "each condition as text", ())
    triggers: int = wire("t", "violations: a subject starting to violate the rule", 0)
    kills: int = wire("t", "processes signalled", 0)
    would_kill: int = wire("t", "processes a dry run would have signalled", 0)
    cancelled: int = wire("t", "violations that ended within the grace period", 0)
    failed: int = wire("t", "kills the kill path refused, resets the reset path refused or that failed", 0)
    resets: int = wire("t", "devices reset (action reset)", 0)
    would_reset: int = wire("t", "device resets a dry run would have made", 0)
    suspends: int = wire("t", "processes suspended (action suspend)", 0)
    would_suspend: int = wire("t", "processes a dry run would have suspended", 0)
    last_triggered: float = wire("d", "seconds since the epoch, 0 never", 0.0)


@dataclass(frozen=True, slots=True)
class RecentEvent:
    """A recent guard event (GetStatus recent, newest last)."""

    time: float = wire("d", "seconds since the epoch", 0.0)
    rule: str = wire("s", "the rule's name", "")
    subject: str = wire("s", "the process, user or device concerned", "")
    uid: int | None = wire("u", "the user concerned, where one is", None)
    event: str = wire("s", '"violation", "warning", "action", "cancelled" or "left" (a dry run\'s episode ended)', "")
    action: str = wire("s", "the rule's action", "")
    outcome: str = wire("s", 'the kill\'s outcome or refusal, "" for a violation', "")
    pid: int | None = wire("u", "the process, where one is concerned", None)
    dry_run: bool = wire("b", "nothing was signalled", False)
    repeats: int | None = wire("u", "times it happened, folded into this entry (time: the last); absent: once", None)
    since: float | None = wire("d", "with repeats: when it first happened, seconds since the epoch", None)
    detail: str = wire(
        "s",
        "what the rule's kill_scope stopped with the process, and what it left running and why",
        "",
        omit_empty=True,
    )


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
    warnings_sent: int = wire("u", "warnings of the rule's warn schedule sent so far (at_start counts)", 0)
    next_warning: float | None = wire("d", "seconds until the next scheduled warning; absent: none is left", None)
    postponed: float = wire("d", "seconds its owner's postponements added to the grace in all", 0.0)
    postponements: int = wire("u", "postponements granted in this episode", 0)
    postponed_by: str = wire("s", "who asked the last postponement", "", omit_empty=True)
    postpone_reason: str = wire("s", "the reason given with the last postponement", "", omit_empty=True)


@dataclass(frozen=True, slots=True)
class NotificationCounters:
    """One notification channel's counters (GetStatus notifications, keyed by channel)."""

    channel: str = wire("s", "email, webhook, owner-mail, tty or desktop (the key of notifications)")
    queued: int = wire("t", "notices queued", 0)
    delivered: int = wire(
        "t", "notices written to a terminal, accepted by the mail server (250 after DATA) or by the webhook (2xx)", 0
    )
    failed: int = wire("t", "notices that could not be delivered: a write error, a timeout, a refusal", 0)
    dropped: int = wire("t", "notices dropped, the queue being full", 0)
    skipped: int = wire("t", "notices with nothing to deliver to: no terminal, mesg n, no address", 0)
    announced: int = wire("t", "desktop: Notification signals sent; no agent answers whether it showed one", 0)


@dataclass(frozen=True, slots=True)
class GuardStatus:
    """What GetStatus returns: the switches, the policy in force, its rules and what is running now."""

    enabled: bool = wire("b", "the guard evaluates the policy")
    dry_run: bool = wire("b", "set by SetDryRun (or kept on by a re-read of guard.d): nothing is signalled")
    policy_dry_run: bool = wire("b", "set in the policy: nothing is signalled")
    source: str = wire("s", '"files" (guard.d) or "loaded" (LoadPolicy)')
    files: tuple[str, ...] = wire("as", "the policy's files or name", ())
    loaded_by: str = wire("s", 'loaded: who loaded it, "alice (uid 1000)"; "" for guard.d\'s', "")
    loaded_at: float = wire("d", "loaded: when, seconds since the epoch; 0 for guard.d's", 0.0)
    dry_run_kept: str = wire("s", 'why a re-read of guard.d, not an admin, holds dry_run on; "" otherwise', "")
    replaced: str = wire(
        "s",
        "the loaded policy the last re-read of guard.d replaced (name, by whom, when); "
        '"" none since the last LoadPolicy',
        "",
    )
    replaced_at: float = wire("d", "when guard.d replaced it, seconds since the epoch; 0 none", 0.0)
    policy_error: str = wire("s", 'why the files were last rejected, or ""', "")
    state_error: str = wire(
        "s",
        "why the state (switches, policy, clocks) could not be saved: in force, but a "
        'restart resumes from the file as last written; "" when the last save succeeded',
        "",
    )
    rules: tuple[RuleStatus, ...] = wire("aa{sv}", "the rules in force, with their counters", (), of=RuleStatus)
    recent: tuple[RecentEvent, ...] = wire("aa{sv}", "recent events, newest last", (), of=RecentEvent)
    windows: tuple[Window, ...] = wire("aa{sv}", "subjects inside a duration window", (), of=Window)
    graces: tuple[Grace, ...] = wire("aa{sv}", "subjects inside a grace period", (), of=Grace)
    evaluations: int = wire("t", "evaluations since the daemon started", 0)
    last_eval_ms: float = wire("d", "milliseconds the last evaluation took", 0.0)
    max_eval_ms: float = wire("d", "milliseconds the slowest evaluation took", 0.0)
    notifications: tuple[NotificationCounters, ...] = wire(
        "a{sv}", "counters per notification channel", (), of=NotificationCounters, key="channel"
    )
    recent_more: int | None = wire("u", "recent events left out past the first 200", None)
    windows_more: int | None = wire("u", "windows left out past the first 200", None)
    graces_more: int | None = wire("u", "graces left out past the first 200", None)


NOT_MET = "not-met"  # a Decision's status: watched, but a windowed condition does not hold now


@dataclass(frozen=True, slots=True)
class Decision:
    """What TestPolicies reports for one rule and subject; nothing is ever done for it."""

    rule: str = wire("s", "the rule's name")
    subject: str = wire("s", "the process, user or device")
    action: str = wire("s", "the rule's action")
    status: str = wire(
        "s",
        '"now", "waiting", "in-flight", "exempt", "not-met" (watched: a windowed condition does '
        'not hold now, nothing is done while so); "truncated": the count of the rest',
    )
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


@dataclass(frozen=True, slots=True)
class ManagedPolicyEntry:
    """A user, group or GPU policy that gpukilld keeps as a file in the Guard policy directory (ListPolicies,
    SetPolicy, ImportPolicies); the limits are gpukill/managed_policy.py's ManagedPolicy, as the daemon read
    them back from the file."""

    kind: str = wire("s", '"user", "group" or "gpu"')
    target: str = wire("s", "the user name, group name or GPU index the policy is for")
    file: str = wire("s", "its file in the Guard policy directory (guard.d)", "")
    edited: bool = wire("b", "the file was changed by hand since gpukilld wrote it", False)
    memory_limit: int | None = wire("t", "bytes of GPU memory (user, group: summed over their processes)", None)
    utilization_limit: float | None = wire("d", "percent of GPU utilization", None)
    process_limit: int | None = wire("u", "GPU processes at once (user, group)", None)
    allowed_users: tuple[str, ...] = wire(
        "as", "gpu: only these users may hold it (none: everyone)", (), omit_empty=True
    )
    reserved_memory: int | None = wire("t", "gpu: bytes kept free on the device", None)
    grace: float = wire("d", "seconds over a limit before the kill", 30.0)


@dataclass(frozen=True, slots=True)
class Postponement:
    """What one kill rule's episode got of a Postpone request (PostponeAnswer rules)."""

    rule: str = wire("s", "the kill rule's name")
    subject: str = wire("s", "the rule's subject: the process, its user, device or group")
    granted: float = wire("d", "seconds granted; 0: refused", 0.0)
    deadline: float = wire("d", "when the grace now ends, seconds since the epoch; 0: refused", 0.0)
    left: int = wire("u", "postponements the episode has left", 0)
    text: str = wire("s", "one line: what was granted and why not more, or why none", "")


@dataclass(frozen=True, slots=True, kw_only=True)
class PostponeAnswer:
    """What Postpone returns: per kill rule whose grace is running on the process, what was granted."""

    pid: int = wire("u", "the process named")
    start_time: int = wire("t", "its start time")
    asked: float = wire("d", "seconds asked")
    rules: tuple[Postponement, ...] = wire(
        "aa{sv}", "one per kill rule with a grace running on the process", (), of=Postponement
    )
    text: str = wire("s", "one line: what was granted, or why nothing was", "")

    @property
    def granted(self) -> bool:
        return any(r.granted > 0 for r in self.rules)
