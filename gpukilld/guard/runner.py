"""Carries out what the engine decides: kills through the daemon's kill path, and for each event the journal
entry, D-Bus signal, recent entry and notice that report.py words for it; keeps the state across restarts.
Also where the policy in force is swapped.

The guard never signals by itself: every kill goes through Actions.kill with initiator "guard:RULE", which
pins the process with a pidfd, refuses protected processes and audits; every reset (action reset) through
Actions.reset with the rule, which checks the device can be reset, refuses while processes hold it unless
the rule says force (then kills them through the kill path first) and audits; every suspend (action suspend)
through the suspend path (Suspender.suspend) with no caller and initiator "guard:RULE", which makes every check a
manual suspend makes but polkit's, journals and signals ProcessSuspended (a refusal there is the rule's outcome,
never a kill instead, and Guard never resumes); every requeue or cancel of a Slurm job through acts/slurm.py
(Slurm's own scontrol requeue and scancel), once per job. Kills, suspends and Slurm's commands run as asyncio
tasks, so the evaluation of the next snapshot never waits for a grace period or for Slurm; a dry run never calls
the kill or suspend path, nor Slurm, at all.
Nothing here may raise into the daemon: a failure is logged and audited, and the daemon goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Protocol

from gpukill.errors import GpukillError, NoSuchProcess, NotSupported
from gpukill.outcome import Outcome, guard_initiator
from gpukill.policy import PolicyError, directory_texts, load_texts, name_warnings
from gpukill.records.base import from_plain, to_plain
from gpukill.records.guard import (
    Grace,
    GuardStatus,
    NotificationCounters,
    PostponeAnswer,
    Postponement,
    RecentEvent,
    RuleStatus,
    Window,
)
from gpukill.records.reclaim import KILL_TREE
from gpukill.records.suspend import STUCK, SUSPENDED, UNDONE
from gpukill.rules import EMPTY_POLICY, JOB_DONE, KILL, REQUEUE, SUSPEND, Policy, Rule, stops_subject
from gpukill.text import shown
from gpukill.units import format_duration

from .. import journal
from ..acts.checkpoint import Asked, asked_text
from ..acts.selection import Selection
from ..acts.slurm import FAILED, NOT_INSTALLED, NOT_THE_OWNER, Slurm, SlurmError
from ..config import Config
from ..files import WriteWatch
from ..model import Snapshot
from ..proc.procfs import user_name
from . import clocks, report
from .conditions import Protection
from .engine import (
    Clock,
    Engine,
    Event,
    GraceCancelled,
    GraceWarning,
    JobOrder,
    KillOrder,
    KillOverCap,
    Left,
    Postponed,
    Preview,
    ResetOrder,
    RuleStats,
    Scoped,
    Target,
    Violation,
)
from .notify import Notice, Notifier, NotifyConfig
from .state import MAX_NOTE, GuardState, add_recent, load_state, save_state, state_path

log = logging.getLogger(__name__)

SAVE_DELAY = 1.0  # counters are written at most once a second; switches and policies at once
KillPath = Callable[..., Awaitable[Any]]  # Actions.kill(caller, pid, start_time, grace, force, initiator)
WorkloadPath = Callable[..., Awaitable[Any]]  # Actions.kill_workload(caller, selection, grace, force, initiator)
ResetPath = Callable[..., Awaitable[Any]]  # Actions.reset(caller, device, force, rule) -> ResetReply
# Actions.ask_to_save(targets, initiator, rule, rule_checkpoint, dry_run) -> list[Asked]: checkpoint signals
AskPath = Callable[..., Awaitable[list[Asked]]]
SuspendPath = Callable[..., Awaitable[Any]]  # Suspender.suspend(caller, selection, initiator) -> SuspendReply


def _stamp(t: float) -> str:
    """A time in the journal's and the status's sentences: local, with its zone."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def notify_config(config: Config) -> NotifyConfig:
    return NotifyConfig(
        smtp_host=config.smtp_host,
        smtp_port=config.smtp_port,
        mail_from=config.mail_from,
        timeout=config.notify_timeout,
        owner_mail=config.owner_mail,
        owner_mesg=config.owner_mesg,
    )


def protection_of(config: Config) -> Protection:
    """[guard] protect_system_users and protected_units, as the engine applies them."""
    return Protection(config.guard_protected_uid_max, config.guard_protected_units)


class GuardSignals(Protocol):
    def violated(self, event: Violation, dry_run: bool) -> None: ...

    def action_taken(
        self, rule: str, subject: str, action: str, pid: int, start_time: int, outcome: str, dry_run: bool
    ) -> None: ...

    def notification(self, notice: Notice, uid: int | None) -> None: ...

    def reclaim_pending(self, target: Target, rule: str, deadline: float) -> None: ...


class _NoSignals:
    def violated(self, event: Violation, dry_run: bool) -> None:
        pass

    def action_taken(self, *args: Any) -> None:
        pass

    def notification(self, notice: Notice, uid: int | None) -> None:
        pass

    def reclaim_pending(self, target: Target, rule: str, deadline: float) -> None:
        pass


class GuardRunner:
    def __init__(
        self,
        kill: KillPath,
        auditor: journal.Audit,
        notify_config: NotifyConfig,
        policy_dir: str,
        state_dir: str,
        clock: Clock | None = None,
        own_pid: int | None = None,
        protection: Protection | None = None,
        signals: GuardSignals | None = None,
        reset: ResetPath | None = None,
        proc_root: str = "/proc",
        kill_workload: WorkloadPath | None = None,
        ask_to_save: AskPath | None = None,
        slurm: Slurm | None = None,
        suspend: SuspendPath | None = None,
    ) -> None:
        self.kill = kill
        # Actions.ask_to_save: a kill rule's checkpoint signals at the start of its grace, and its kills' checkpoint
        # step; None: a runner without them (its kills are called as before, with no checkpoint option)
        self.ask_to_save = ask_to_save
        self._asked: dict[tuple[int, int], Asked] = {}  # sent at a grace's start, awaited by its kill
        self.slurm = slurm  # Slurm's commands, for rules with action requeue or cancel; None: such acts are refused
        self.suspend = suspend  # None: a suspend rule's orders are refused as not supported
        # Actions.kill_workload, for rules with kill_scope tree or unit; None: such a rule kills its target alone
        self.kill_workload = kill_workload
        self.reset = reset  # None: resets are refused as not supported (a runner without a reset path)
        self.audit = auditor
        self.policy_dir = policy_dir
        self.state_dir = state_dir
        self.clock = clock or Clock()
        self.engine = Engine(clock=self.clock, own_pid=own_pid, protection=protection)
        self.state = GuardState()
        self._save_watch = self._watch_for(state_dir)
        self.notifier = Notifier(
            notify_config, self._delivery_failed, self._journal_notice, self._desktop_notice, self._owner_warned
        )
        self.signals: GuardSignals = signals if signals is not None else _NoSignals()
        self.started = False
        self.policy_error = ""  # why the last attempt to read the policy files failed ("" when it did not)
        self.state_error = ""  # why the last save of the state failed ("" when it did not): GetStatus says it
        self.evaluations = 0
        self.max_eval_seconds = 0.0
        self._last_eval = -math.inf
        self._tasks: set[asyncio.Task] = set()
        self._save_handle: asyncio.TimerHandle | None = None
        self._host = socket.gethostname()
        self._boot = clocks.boot_id()  # the clocks saved are this boot's; others' are dropped at start
        self._alive = clocks.process_alive(proc_root)

    @property
    def policy(self) -> Policy:
        return self.engine.policy

    @property
    def dry_run(self) -> bool:
        """In force: SetDryRun(true), or dry_run: true in the policy, makes every rule dry."""
        return self.state.dry_run or self.policy.settings.dry_run

    # -- life cycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Restore the saved state and the policy; evaluation begins with the next snapshot."""
        state, warning = load_state(self.state_dir)
        if warning:
            log.error("%s", warning)
            self.audit.log(
                journal.GUARD_POLICY,
                f"Guard state unreadable: {warning}",
                action="guard",
                result="state-unreadable",
                error=warning,
            )
        self.state = state
        for name, d in state.stats.items():
            self.engine.stats[name] = RuleStats.from_dict(d)
        policy = self._initial_policy()
        self.engine.set_policy(policy)
        self._warn_unknown_names(policy)
        if state.clocks is not None and state.enabled:  # disabled: enabling starts every window afresh anyway
            self._restore_clocks(state.clocks)
        self.started = True
        self.audit.log(
            journal.GUARD_POLICY,
            f"Guard {'enabled' if state.enabled else 'disabled'}{', dry run' if self.dry_run else ''}: "
            f"{len(policy.rules)} rule(s) from {policy.source}",
            action="guard",
            result="started",
            enabled=int(state.enabled),
            dry_run=int(self.dry_run),
            rules=",".join(r.name for r in policy.rules) or None,
        )

    def _initial_policy(self) -> Policy:
        """The policy to enforce at start: guard.d's, or (it is broken) the last good one saved in the state,
        or none. Whatever the files hold, the daemon starts: every failure is a rejection with a reason."""
        saved = self.state.policy_files
        if self.state.policy_source == "loaded" and saved:
            try:
                return load_texts(saved)
            except Exception as e:  # saved by an older version that accepted more: fall back to the files
                log.error("the policy loaded before the restart is no longer valid: %s", e)
        try:
            texts = directory_texts(self.policy_dir)
            policy = load_texts(texts) if texts else EMPTY_POLICY
        except Exception as e:  # the parser raises only PolicyError; anything else is still a rejection
            self._rejected(e, "start", self.policy_dir)
            if saved:
                try:
                    policy = load_texts(saved)
                except Exception as e2:
                    log.error("the last good policy saved in the state cannot be used either: %s", e2)
                    return EMPTY_POLICY
                log.warning("enforcing the last good policy (%s) until the files are fixed", policy.source)
                return policy
            return EMPTY_POLICY
        if (self.state.policy_source, self.state.policy_files, self.state.files_dry_run) != (
            "files",
            texts,
            policy.settings.dry_run,
        ):
            self.state.policy_source, self.state.policy_files = "files", texts
            self.state.files_dry_run, self.state.loaded_by, self.state.loaded_at = policy.settings.dry_run, "", 0.0
            self._save_now()
        return policy

    def _restore_clocks(self, saved: dict[str, Any]) -> None:
        """The windows and graces running when the daemon stopped, and the checkpoint signals their kills await
        (clocks.py); never fails the start."""
        try:
            restored, note = clocks.restore(self.engine, saved, self._boot, self._alive)
        except Exception:  # a bug in reading them must not keep the guard (or the daemon) from starting
            log.exception("the guard's saved clocks could not be restored; windows and graces start afresh")
            self.engine.restart_windows()
            return
        if note:
            log.warning("%s", note)
        elif restored:
            log.info("guard clocks restored: %d entries", restored)
        try:
            asked, note = clocks.restore_asked(saved, self._boot, self._alive)
        except Exception:  # as above: the kills go on, each without the wait of a signal sent before the restart
            log.exception("the checkpoint signals saved with the guard's clocks could not be restored")
            return
        if note:
            log.warning("%s", note)
        self._remember_asked(asked)

    def stop(self) -> None:
        if self._save_handle is not None:
            self._save_handle.cancel()
            self._save_handle = None
        if self.started:  # counters, and the clocks as they are at the stop
            self._save_now()
        self.notifier.close()

    def configure(self, notify_config: NotifyConfig, policy_dir: str, state_dir: str, protection: Protection) -> None:
        """After a reload of gpukilld.conf; a queued notice already in a channel keeps its old relay."""
        self.engine.protection = protection
        self.policy_dir = policy_dir
        if state_dir != self.state_dir:
            self.state_dir = state_dir
            self._save_now()
        if notify_config != self.notifier.config:
            old = self.notifier
            self.notifier = Notifier(
                notify_config, self._delivery_failed, self._journal_notice, self._desktop_notice, self._owner_warned
            )
            self.notifier.keep_counts(old)
            old.close()

    # -- policy and switches ---------------------------------------------------------------------------

    def _rejected(self, e: Exception, who: str, where: str = "") -> PolicyError:
        """Report a policy that cannot be used (the one in force stays). Anything but a PolicyError is a bug
        of the parser: it becomes one too (FILE:1:1 and a one-line reason), so that a policy can only ever be
        rejected, never stop the daemon; its traceback goes to the log."""
        if not isinstance(e, PolicyError):
            log.error("reading the policy failed unexpectedly", exc_info=e)
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            e = PolicyError([f"{where or self.policy_dir}:1:1: the policy could not be read ({reason})"])
        self.policy_error = str(e)  # one line: the first error and how many more (PolicyError caps them)
        for line in e.errors:
            log.error("%s", line)
        self.audit.log(
            journal.GUARD_POLICY,
            f"Guard policy rejected ({who}); the policy in force stays: {e}",
            action="guard",
            result="rejected",
            error=str(e),
            requested_by=who,
        )
        return e

    @staticmethod
    def _warn_unknown_names(policy: Policy) -> None:
        """Journal a warning for each user or group name of the policy in force that this host does not know
        (FILE:LINE:COL: warning: no user 'alcie' on this host). The lookups go through NSS, which may wait on
        a directory server: they run in a thread of their own, never on the main loop."""
        if not policy.names:
            return

        def warn() -> None:
            try:
                for line in name_warnings(policy):
                    log.warning("%s", line)
            except Exception:  # a lookup that fails oddly must not end the daemon (it cannot: a thread)
                log.exception("looking up the policy's user and group names failed")

        threading.Thread(target=warn, name="policy-names", daemon=True).start()

    def _install(
        self, policy: Policy, source: str, texts: list[tuple[str, str]], who: str, loaded_by: str = ""
    ) -> None:
        """Swap the policy in force. Loaded (LoadPolicy): who loaded it and when are kept for the status and a
        later reload. From guard.d over a loaded policy: what it replaces is journaled and kept for the status,
        and dry run stays as it was unless guard.d's own dry_run changed since it was last read (_keep_dry_run)."""
        was_dry, was_loaded = self.dry_run, self.state.policy_source == "loaded"
        replaced = self._loaded_text() if was_loaded and source == "files" else ""
        old = replaced or f"the policy {self.policy.source}"
        now = self.clock.wall()
        self.engine.set_policy(policy)
        self._warn_unknown_names(policy)
        self.state.policy_source, self.state.policy_files = source, texts
        self.policy_error = ""
        if source == "loaded":
            self.state.loaded_by, self.state.loaded_at = loaded_by or who, now
            self.state.replaced, self.state.replaced_at = "", 0.0
        else:
            files_turned_off = self.state.files_dry_run and not policy.settings.dry_run
            self.state.files_dry_run = policy.settings.dry_run
            self.state.loaded_by, self.state.loaded_at = "", 0.0
            if replaced:
                self.state.replaced, self.state.replaced_at = replaced[:MAX_NOTE], now
        self._save_now()
        names = ", ".join(r.name for r in policy.rules) or "none"
        self.audit.log(
            journal.GUARD_POLICY,
            f"Guard policy from {policy.source} in force ({who}): rules {names}"
            + (f"; it replaces {replaced}" if replaced else ""),
            action="guard",
            result="loaded",
            source=policy.source,
            rules=names,
            requested_by=who,
            replaced=replaced or None,
        )
        if source == "files" and was_dry and not self.dry_run and not files_turned_off:
            self._keep_dry_run(
                f"kept on when guard.d was re-read ({who}) at {_stamp(now)}: the policy it "
                f"replaced, {old}, had dry_run: true; `gpukillctl guard dry-run off` enforces",
                who,
            )

    def _keep_dry_run(self, why: str, who: str) -> None:
        """A re-read of guard.d that would have ended a dry run the admin did not end: the switch holds it."""
        self.state.dry_run, self.state.dry_run_kept = True, why[:MAX_NOTE]
        self._save_now()
        self.audit.log(
            journal.GUARD_POLICY, f"Guard dry run {why}", action="guard", result="dry-run-kept", requested_by=who
        )

    def _loaded_text(self) -> str:
        """The loaded policy in force, as the journal and the status name it."""
        name = ", ".join(n for n, _ in self.state.policy_files) or "<policy>"
        by = self.state.loaded_by or "an unknown caller"
        at = f" at {_stamp(self.state.loaded_at)}" if self.state.loaded_at else ""
        return f"the policy {name} loaded by {by}{at}"

    def reload_files(self, who: str = "reload") -> bool:
        """Re-read guard.d (SIGHUP). On any error the policy in force stays and False is returned."""
        try:
            texts = directory_texts(self.policy_dir)
            policy = load_texts(texts) if texts else EMPTY_POLICY
        except Exception as e:  # the parser raises only PolicyError; anything else is still a rejection
            self._rejected(e, who, self.policy_dir)
            return False
        self._install(policy, "files", texts, who)
        return True

    def load_policy(self, name: str, text: str, who: str, uid: int | None = None) -> Policy:
        """Validate, then swap atomically; PolicyError (the policy in force stays) otherwise. uid: the caller,
        named with its user name in the status and in what a reload says it replaced."""
        try:
            policy = load_texts([(name, text)])
        except Exception as e:  # the parser raises only PolicyError; anything else is still a rejection
            error = self._rejected(e, who, name)
            if error is e:
                raise
            raise error from e
        self._install(
            policy, "loaded", [(name, text)], who, loaded_by=f"{user_name(uid)} (uid {uid})" if uid is not None else who
        )
        return policy

    def set_enabled(self, enabled: bool, who: str) -> None:
        if enabled and not self.state.enabled:
            self.engine.restart_windows()  # time spent disabled must not count towards a duration
        self.state.enabled = enabled
        self._save_now()
        self.audit.log(
            journal.GUARD_POLICY,
            f"Guard {'enabled' if enabled else 'disabled'} by {who}",
            action="guard",
            result="enabled" if enabled else "disabled",
            requested_by=who,
        )

    def set_dry_run(self, dry_run: bool, who: str) -> None:
        """The admin's switch; a policy in force with dry_run: true keeps every rule dry whatever it says, and
        the journal says so."""
        self.state.dry_run, self.state.dry_run_kept = dry_run, ""
        self._save_now()
        held = ""
        if not dry_run and self.policy.settings.dry_run:
            held = f"; dry run stays on: the policy in force ({self.policy.source}) sets dry_run: true"
        self.audit.log(
            journal.GUARD_POLICY,
            f"Guard dry run {'on' if dry_run else 'off'}, set by {who}{held}",
            action="guard",
            result="dry-run-on" if dry_run else "dry-run-off",
            requested_by=who,
            dry_run=int(self.dry_run),
        )

    # -- evaluation ------------------------------------------------------------------------------------

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """Called by the daemon for every snapshot; evaluates when due and starts what the engine decides."""
        if not self.started or not self.state.enabled or not self.policy.rules:
            return
        now = self.clock.monotonic()
        interval = self.policy.settings.sample_interval
        if interval and now - self._last_eval < interval * 0.95:  # snapshots come with some jitter
            return
        self._last_eval = now
        dry_run = self.dry_run
        try:
            events = self.engine.evaluate(snapshot, dry_run)
        except Exception:  # a bug in a rule must not take the daemon (and its manual kill path) down
            log.exception("guard evaluation failed")
            return
        self.evaluations += 1
        self.max_eval_seconds = max(self.max_eval_seconds, self.engine.last_eval_seconds)
        for event in events:
            try:
                self._handle(event, dry_run)
            except Exception:
                log.exception("guard could not carry out %s", type(event).__name__)
        if self.engine.clocks_changed:  # at once: a crash must not lose a grace that has begun
            self._save_now()
        elif events:
            self._save_soon()

    def _handle(self, event: Event, dry_run: bool) -> None:
        host, now = self._host, self.clock.wall()
        if isinstance(event, Violation):
            if self.ask_to_save is not None and event.rule.action == KILL and event.rule.grace_period > 0:
                self._start(self._violation_asking(event, dry_run, host, now))
            else:
                self._publish(event.rule, report.violation(event, dry_run, host, now))
            if stops_subject(event.rule.action) and event.rule.grace_period and not dry_run:
                self._reclaim_pending(event.rule, event.targets, event.at + event.rule.grace_period)
        elif isinstance(event, GraceWarning):
            self._publish(event.rule, report.warning(event, dry_run, host, now))
        elif isinstance(event, GraceCancelled):
            self._publish(event.rule, report.cancelled(event, dry_run, now))
        elif isinstance(event, Left):
            self._publish(event.rule, report.left(event, now))
        elif isinstance(event, KillOverCap):
            self._publish(event.rule, report.over_cap(event, dry_run, host, now))
        elif isinstance(event, ResetOrder):
            if event.dry_run:
                self._publish(event.rule, report.would_reset(event, host, now))
            else:
                task = asyncio.get_running_loop().create_task(self._reset(event))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        elif isinstance(event, JobOrder):
            if event.dry_run:
                self._publish(event.rule, report.would_act_on_jobs(event, host, now))
                return
            if event.unattached:
                self._publish(event.rule, report.unattached(event, host, now))
            for job, _ in event.jobs:
                task = asyncio.get_running_loop().create_task(self._act_on_job(event, job))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        elif isinstance(event, KillOrder):
            if event.dry_run:
                self._publish(event.rule, report.would_kill(event, host, now))
            else:
                act = self._suspend if event.rule.action == SUSPEND else self._kill
                for i, target in enumerate(event.targets):
                    scoped = event.scoped[i] if i < len(event.scoped) else None
                    task = asyncio.get_running_loop().create_task(act(event, target, scoped))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

    def _start(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _violation_asking(self, event: Violation, dry_run: bool, host: str, now: float) -> None:
        """A kill rule's grace begins: the processes its kill will take (the targets, and what its kill_scope adds
        to them) that declare a checkpoint signal (or all, by the rule's checkpoint:) get it now, the leader
        rule deciding who of a batch, through the kill path's pinning and checks (in a dry run: none, said as
        "would send"); what was sent is saved at once, so that a restart keeps the kill waiting for it; then the
        violation is reported, saying so."""
        asked: list[Asked] = []
        assert self.ask_to_save is not None
        try:
            asked = await self.ask_to_save(
                event.workload,
                guard_initiator(event.rule.name),
                event.rule.name,
                event.rule.checkpoint,
                dry_run,
            )
        except Exception:
            log.exception("guard could not send the checkpoint signals of rule %s", event.rule.name)
        if not dry_run and asked:
            self._remember_asked(asked)
            self._save_now()
        try:
            self._publish(event.rule, report.violation(event, dry_run, host, now, asked_text(asked, dry_run)))
        except Exception:
            log.exception("guard could not report the violation of rule %s", event.rule.name)

    def _remember_asked(self, asked: Iterable[Asked]) -> None:
        """Checkpoint signals sent at a grace's start (or restored after a restart), until their kill is over;
        a day old, or past MAX_ASKED, the oldest are forgotten."""
        for a in asked:
            self._asked[(a.pid, a.start_time)] = a
        stale = time.monotonic() - 86400.0  # a grace lasts at most a day: its kill never comes after that
        for key in [k for k, a in self._asked.items() if a.sent_at < stale]:
            del self._asked[key]
        while len(self._asked) > clocks.MAX_ASKED:
            del self._asked[next(iter(self._asked))]

    def _checkpoint_options(self, order: KillOrder, keys: list[tuple[int, int]]) -> dict[str, Any]:
        """The kill path's checkpoint options for an order's kill: the waits of the signals sent when its grace
        began, or (grace 0) the whole checkpoint step; {} for a runner without checkpoints. What was sent stays
        remembered (and saved) until the kill is over: a restart during the wait resumes it."""
        if self.ask_to_save is None:
            return {}
        asked = {k: self._asked[k] for k in keys if k in self._asked}
        return {
            "checkpoint": order.rule.grace_period == 0,
            "rule_checkpoint": order.rule.checkpoint,
            "asked": asked,
        }

    async def _kill(self, order: KillOrder, t: Target, scoped: Scoped | None = None) -> None:
        error = ""
        results: dict[tuple[int, int], tuple[str, str]] = {}
        unsent = (NoSuchProcess.result, "gone before the kill")  # what a member the act did not reach became
        try:
            scope = order.rule.kill_scope
            if scoped is not None and self.kill_workload is not None:
                # the target and what the engine decided its tree (or unit) adds, each checked as the target
                # was; those it left running are named with why, and anything that started since is left too
                selection = Selection(
                    "tree" if scope == KILL_TREE else "unit_of",
                    str(t.pid),
                    t.start_time,
                    t.uid,
                    only=frozenset((m.pid, m.start_time) for m in (t, *scoped.members)),
                    spare=tuple((p.pid, p.start_time, why) for p, why in scoped.left),
                )
                keys = [(m.pid, m.start_time) for m in (t, *scoped.members)]
                reply = await self.kill_workload(
                    None,
                    selection,
                    order.kill_grace,
                    order.force,
                    guard_initiator(order.rule.name),
                    **self._checkpoint_options(order, keys),
                )
                results = {(e.pid, e.start_time): (e.result, e.error) for e in reply.entries}
                outcome, error = results.get((t.pid, t.start_time), (NoSuchProcess.result, "gone before the kill"))
            else:
                result = await self.kill(
                    None,
                    t.pid,
                    t.start_time,
                    order.kill_grace,
                    order.force,
                    guard_initiator(order.rule.name),
                    **self._checkpoint_options(order, [(t.pid, t.start_time)]),
                )
                outcome = result.outcome
        except GpukillError as e:  # protected, gone, PID reused: the kill path audited it already
            outcome, error = e.result, str(e)
            unsent = (outcome, error)  # refused as a whole: none of its members was stopped either
        except Exception as e:
            log.exception("guard kill of PID %d failed", t.pid)
            outcome, error = GpukillError.result, f"{type(e).__name__}: {e}"
            unsent = (outcome, error)
        for m in (t, *(scoped.members if scoped is not None else ())):
            self._asked.pop((m.pid, m.start_time), None)  # the kill is over, and its checkpoint wait with it
        if scoped is not None:
            if self.kill_workload is None:
                unsent = (NotSupported.result, "this daemon has no workload kill path for Guard")
            results = {(m.pid, m.start_time): results.get((m.pid, m.start_time), unsent) for m in scoped.members}
        try:
            for m in scoped.members if scoped is not None else ():
                self.engine.kill_finished(order, m, results[(m.pid, m.start_time)][0])
            self.engine.kill_finished(order, t, outcome)
            self._publish(
                order.rule, report.kill_done(order, t, outcome, error, self._host, self.clock.wall(), scoped, results)
            )
            self._save_soon()
        except Exception:
            log.exception("guard could not report the kill of PID %d", t.pid)

    async def _act_on_job(self, order: JobOrder, job: str) -> None:
        """Ask Slurm to requeue or cancel one job of the order, as the job of its processes' owner."""
        targets = dict(order.jobs)[job]
        message = error = ""
        outcome: str  # Outcome.REQUEUED or JOB_CANCELLED, or the SlurmError's result
        verb = JOB_DONE[order.rule.action]
        try:
            uids = {t.uid for t in targets}
            if self.slurm is None:
                raise SlurmError(NOT_INSTALLED, f"this daemon has no Slurm path for Guard: job {job} not {verb}")
            if len(uids) != 1:
                raise SlurmError(NOT_THE_OWNER, f"job {job}'s processes belong to several users: not {verb}")
            if order.rule.action == REQUEUE:
                message, outcome = await self.slurm.requeue(job, uids.pop()), Outcome.REQUEUED
            else:
                message, outcome = await self.slurm.cancel(job, uids.pop()), Outcome.JOB_CANCELLED
        except SlurmError as e:
            outcome, error = e.result, str(e)
        except Exception as e:
            log.exception("guard %s of Slurm job %s failed", order.rule.action, job)
            outcome, error = FAILED, f"{type(e).__name__}: {e}"
        try:
            self.engine.job_finished(order, job, outcome in (Outcome.REQUEUED, Outcome.JOB_CANCELLED))
            self._publish(
                order.rule, report.job_done(order, job, outcome, message, error, self._host, self.clock.wall())
            )
            self._save_soon()
        except Exception:
            log.exception("guard could not report the %s of Slurm job %s", order.rule.action, job)

    async def _suspend(self, order: KillOrder, t: Target, scoped: Scoped | None = None) -> None:
        """One target of a suspend rule's order, with what its kill_scope adds, suspended together or not at all:
        the suspend path refuses a workload the rule would leave a process of running."""
        results: dict[tuple[int, int], tuple[str, str]] = {}
        unsent = (NoSuchProcess.result, "gone before the suspend")  # a member the suspend did not list
        scope = order.rule.kill_scope
        selection = Selection(
            "pid" if scoped is None else "tree" if scope == KILL_TREE else "unit_of",
            str(t.pid),
            t.start_time,
            t.uid,
            only=frozenset((m.pid, m.start_time) for m in (t, *(scoped.members if scoped else ()))),
            spare=tuple((p.pid, p.start_time, why) for p, why in scoped.left) if scoped else (),
        )
        try:
            if self.suspend is None:
                raise NotSupported("this daemon has no suspend path for Guard")
            reply = await self.suspend(None, selection, guard_initiator(order.rule.name))
            for e in reply.entries:
                if e.state == SUSPENDED:
                    results[(e.pid, e.start_time)] = (Outcome.SUSPENDED, "")
                elif e.state == STUCK:
                    results[(e.pid, e.start_time)] = (STUCK, f"{e.error}; {e.remedy}")
                else:  # running again: the suspend was undone
                    results[(e.pid, e.start_time)] = (UNDONE, reply.message)
        except GpukillError as e:  # refused (not supported here, busy, gone): the suspend path audited it already
            unsent = (e.result, str(e))
        except Exception as e:
            log.exception("guard suspend of PID %d failed", t.pid)
            unsent = (GpukillError.result, f"{type(e).__name__}: {e}")
        members = scoped.members if scoped is not None else ()
        results = {(m.pid, m.start_time): results.get((m.pid, m.start_time), unsent) for m in (t, *members)}
        outcome, error = results[(t.pid, t.start_time)]
        try:
            for m in members:
                self.engine.kill_finished(order, m, results[(m.pid, m.start_time)][0])
            self.engine.kill_finished(order, t, outcome)
            self._publish(
                order.rule, report.kill_done(order, t, outcome, error, self._host, self.clock.wall(), scoped, results)
            )
            self._save_soon()
        except Exception:
            log.exception("guard could not report the suspend of PID %d", t.pid)

    async def _reset(self, order: ResetOrder) -> None:
        killed: tuple[int, ...] = ()
        outcome: str  # Outcome.RESET, or the error's result
        try:
            if self.reset is None:
                raise NotSupported("this daemon has no reset path for Guard")
            reply = await self.reset(None, order.subject_key, order.force, order.rule.name)
            outcome, detail, killed = Outcome.RESET, reply.message, tuple(reply.killed)
        except GpukillError as e:  # busy, not supported, failed: the reset path audited it already
            outcome, detail = e.result, str(e)
        except Exception as e:
            log.exception("guard reset of %s failed", order.subject)
            outcome, detail = GpukillError.result, f"{type(e).__name__}: {e}"
        try:
            self.engine.reset_finished(order, outcome)
            self._publish(order.rule, report.reset_done(order, outcome, detail, killed, self._host, self.clock.wall()))
            self._save_soon()
        except Exception:
            log.exception("guard could not report the reset of %s", order.subject)

    def _publish(self, rule: Rule, done: report.Report) -> None:
        """Write, emit and remember each entry of a report, in its order, then send its notice."""
        for entry in done.entries:
            self.audit.log(entry.journal.kind, entry.journal.message, **entry.journal.fields)
            signal = entry.signal
            if isinstance(signal, report.Violated):
                self.signals.violated(signal.event, signal.dry_run)
            elif signal is not None:
                self.signals.action_taken(
                    signal.rule,
                    signal.subject,
                    signal.action,
                    signal.pid,
                    signal.start_time,
                    signal.outcome,
                    signal.dry_run,
                )
            add_recent(self.state.recent, to_plain(entry.recent))
        targets = self._targets(rule)
        if done.notice is not None and targets:
            self.notifier.send(targets, done.notice)

    def _targets(self, rule: Rule) -> tuple[str, ...]:
        if rule.notify is not None:
            return rule.notify
        return () if rule.action == "log" else self.policy.settings.notify  # log: the journal entry only

    # -- postponements ---------------------------------------------------------------------------------

    def _reclaim_pending(self, rule: Rule, targets: tuple[Target, ...], deadline: float) -> None:
        """ReclaimPending for each process a kill rule's grace will end: when it starts, and again with the new
        deadline after a postponement. Never in a dry run (nothing is reclaimed)."""
        for t in targets:
            self.signals.reclaim_pending(t, rule.name, deadline)

    def postpone(
        self, pid: int, start_time: int, seconds: float, reason: str, caller_uid: int, who: str
    ) -> PostponeAnswer:
        """An owner's request for `seconds` more before the kill of (pid, start_time), already authorized: each
        kill rule's episode whose grace runs on the process (engine.pending_graces) is postponed within its
        caps. Each answer, granted or refused, is journaled; one granted is signalled (ReclaimPending with the
        new deadline) and saved at once, as a grace that begins is."""
        dry_run = self.dry_run
        answers: list[Postponement] = []
        for rule_name, key in self.engine.pending_graces(pid, start_time):
            got = self.engine.postpone(rule_name, key, seconds, reason, who)
            if got is None:
                continue
            answers.append(Postponement(rule_name, got.subject, got.granted, got.deadline, got.left, got.text))
            self._journal_postponement(pid, start_time, seconds, reason, caller_uid, who, got.text, got)
            if not got.refused and not dry_run:
                self._reclaim_pending(got.rule, got.targets, got.deadline)
        if not answers:
            text = f"no grace is running on PID {pid}: no kill rule is counting down to it"
            self._journal_postponement(pid, start_time, seconds, reason, caller_uid, who, text, None)
        elif any(a.granted for a in answers):
            text = "; ".join(f"rule {a.rule}: {a.text}" for a in answers)
        else:
            text = "; ".join(a.text for a in answers)
        if self.engine.clocks_changed:
            self._save_now()
        return PostponeAnswer(pid=pid, start_time=start_time, asked=seconds, rules=tuple(answers), text=text)

    def _journal_postponement(
        self,
        pid: int,
        start_time: int,
        seconds: float,
        reason: str,
        caller_uid: int,
        who: str,
        text: str,
        got: Postponed | None,
    ) -> None:
        granted = got.granted if got is not None else 0.0
        result = "refused" if granted <= 0 else "partly-granted" if granted < seconds else "granted"
        rule = got.rule.name if got is not None else None
        when = f"; the grace now ends at {_stamp(got.deadline)}" if got is not None and granted > 0 else ""
        self.audit.log(
            journal.GUARD_POSTPONE,
            f"Guard: {who} asked for {format_duration(seconds)} more before "
            + (f"rule {rule} stops PID {pid}" if rule else f"a kill of PID {pid}")
            + f" ({shown(reason) or 'no reason given'}): {text}{when}",
            action="guard",
            result=result,
            rule=rule,
            subject=got.subject if got is not None else None,
            target_pid=pid,
            target_start_time=start_time,
            target_uid=got.uid if got is not None else None,
            caller_uid=caller_uid,
            requested_by=who,
            asked=seconds,
            granted=granted,
            deadline=got.deadline if got is not None and granted > 0 else None,
            postpone_reason=reason or None,
            error=text if granted <= 0 else None,
        )

    # -- notifications ---------------------------------------------------------------------------------

    def _journal_notice(self, notice: Notice) -> None:
        self.audit.log(
            journal.GUARD_NOTICE,
            f"gpukill guard: {notice.summary}",
            action="guard",
            result=notice.event,
            rule=notice.rule,
            subject=notice.subject,
        )

    def _desktop_notice(self, notice: Notice) -> None:
        """Notification goes to every listener on the bus, not only the user it is for: its body says why only
        as other users may read it (report.GuardNotice); the e-mail and the webhook say it whole."""
        if isinstance(notice, report.GuardNotice):
            notice = dataclasses.replace(notice, body=notice.body_for_others)
        self.signals.notification(notice, notice.data.get("uid"))

    def _owner_warned(self, channel: str, target: str, notice: Notice, outcome: str, detail: str) -> None:
        """From a channel thread: each delivery to the subject's owner, whatever became of it."""
        self.audit.log(
            journal.GUARD_WARNING,
            f"Guard warning for rule {notice.rule} to the owner by {channel} "
            f"({target or 'nobody'}): {outcome}" + (f", {detail}" if detail else ""),
            action="guard",
            result="owner-warned",
            rule=notice.rule,
            subject=notice.subject,
            channel=channel,
            target=target or None,
            outcome=outcome,
            error=detail or None,
        )

    def _delivery_failed(self, target: str, notice: Notice, error: str) -> None:
        """From a channel thread: the audit trail is thread-safe."""
        self.audit.log(
            journal.GUARD_NOTIFY_FAILED,
            f"Guard notification to {target} for rule {notice.rule} failed: {error}",
            action="guard",
            result="notify-failed",
            rule=notice.rule,
            target=target,
            error=error,
        )

    # -- reports ---------------------------------------------------------------------------------------

    def status(self) -> GuardStatus:
        """The switches, the policy in force with each rule's counters, what is running now; recent events as
        the state keeps them (plain dicts, possibly from an older daemon: read leniently)."""
        rules = tuple(
            RuleStatus(
                name=rule.name,
                description=rule.description,
                action=rule.action,
                scope=rule.scope,
                match=rule.match,
                conditions=tuple(c.text for c in rule.conditions),
                **self.engine.stats.get(rule.name, RuleStats()).to_dict(),
            )
            for rule in self.policy.rules
        )
        return GuardStatus(
            enabled=self.state.enabled,
            dry_run=self.state.dry_run,
            policy_dry_run=self.policy.settings.dry_run,
            source=self.state.policy_source,
            files=tuple(self.policy.sources),
            loaded_by=self.state.loaded_by,
            loaded_at=self.state.loaded_at,
            dry_run_kept=self.state.dry_run_kept,
            replaced=self.state.replaced,
            replaced_at=self.state.replaced_at,
            policy_error=self.policy_error,
            state_error=self.state_error,
            rules=rules,
            recent=tuple(from_plain(RecentEvent, e) for e in self.state.recent[-20:]),
            windows=tuple(from_plain(Window, w) for w in self.engine.windows_report()),
            graces=tuple(from_plain(Grace, g) for g in self.engine.grace_report()),
            evaluations=self.evaluations,
            last_eval_ms=self.engine.last_eval_seconds * 1000,
            max_eval_ms=self.max_eval_seconds * 1000,
            notifications=tuple(
                NotificationCounters(
                    channel=channel,
                    queued=s.queued,
                    delivered=s.delivered,
                    skipped=s.skipped,
                    failed=s.failed,
                    dropped=s.dropped,
                    announced=s.announced,
                )
                for channel, s in self.notifier.stats().items()
            ),
        )

    def preview(self, snapshot: Snapshot) -> list[Preview]:
        return self.engine.preview(snapshot)

    # -- persistence -----------------------------------------------------------------------------------

    def _save_now(self) -> None:
        if self._save_handle is not None:  # this write has what it would have written
            self._save_handle.cancel()
            self._save_handle = None
        self.state.stats = {name: s.to_dict() for name, s in self.engine.stats.items()}
        if self.started:  # before start() has restored them, the clocks loaded stay as they were read
            self.state.clocks = clocks.save(self.engine, self._boot, self._asked.values())
            self.engine.clocks_changed = False
        if self._save_watch.path != state_path(self.state_dir):
            self._save_watch = self._watch_for(self.state_dir)
        try:
            save_state(self.state_dir, self.state)
        except OSError as e:
            self.state_error = f"cannot write {self._save_watch.path}: {e.strerror or e}"
            self._save_watch.failed(e)
        else:
            self.state_error = ""
            self._save_watch.written()

    def _watch_for(self, state_dir: str) -> WriteWatch:
        return WriteWatch(
            self.audit,
            state_path(state_dir),
            "Guard's state",
            "Guard enforces what is in force; a restart before the next save resumes from the file as last written",
        )

    def _save_soon(self) -> None:
        if self._save_handle is not None:
            return
        loop = asyncio.get_running_loop()

        def save() -> None:
            self._save_handle = None
            self._save_now()

        self._save_handle = loop.call_later(SAVE_DELAY, save)
