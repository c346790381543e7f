"""What each guard event is reported as (gpukilld/guard/report.py): for a violation, a cancelled grace, a dry
run's kill order and a finished kill, the journal entry, the signal, the recent entry and the notice must say
the same thing (the same outcome in the same words, the same subject and processes); and the runner passes
them on as they are. No daemon: tests/test_guard_daemon.py shows them on a real bus and journal."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from gpukill.errors import GpukillError, NoSuchProcess, Protected
from gpukill.outcome import SIGNALLED, Outcome, guard_initiator, result_text
from gpukill.policy import load_texts
from gpukill.records.base import from_plain, to_plain
from gpukill.records.guard import RecentEvent
from gpukilld import journal as audit
from gpukilld.guard import report
from gpukilld.guard.engine import Clock, GraceCancelled, KillOrder, Left, Target, Violation
from gpukilld.guard.notify import NotifyConfig
from gpukilld.guard.runner import GuardRunner
from gpukilld.guard.state import MAX_RECENT, add_recent

HOST, NOW = "gpu-host-7", 1_700_000_123.5
POLICY = """
notify: [journal]
rules:
  - name: miners
    description: no crypto miners
    action: kill
    grace_period: 30s
    conditions: [{type: process_name, operator: ==, value: xmrig}]
  - name: hogs
    action: kill
    conditions: [{type: process_name, operator: ==, value: hog}]
  - name: tell
    action: notify
    conditions: [{type: process_name, operator: ==, value: tell}]
  - name: quiet
    action: log
    conditions: [{type: process_name, operator: ==, value: quiet}]
"""
PARSED = load_texts([("test.yaml", POLICY)])
RULES = {r.name: r for r in PARSED.rules}
MINER = Target(42, 4242, 1000, "alice", "xmrig", 3 * 1024**3, 0.9)
HELPER = Target(43, 4343, 1000, "alice", "helper", None, None)
USER = "user alice"


def lines_of(notice) -> dict[str, str]:
    """The notice's body as 'Label: text' lines."""
    return dict(line.split(": ", 1) for line in notice.body.splitlines())


def only(r: report.Report) -> report.Entry:
    assert len(r.entries) == 1
    return r.entries[0]


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_violation_says_the_same_in_the_journal_on_the_bus_in_recent_events_and_in_the_notice(rule, dry_run):
    ev = Violation(RULES[rule], USER, ("user", 1000), 1000, (MINER, HELPER), "gpu_memory > 2 GiB", NOW - 1)
    r = report.violation(ev, dry_run, HOST, NOW)
    entry = only(r)
    journal, notice = entry.journal, r.notice
    assert journal.kind is audit.GUARD_VIOLATION and entry.signal == report.Violated(ev, dry_run)
    happens = lines_of(notice)["What happens"]
    assert journal.message.endswith(f"; {happens}") and f"({ev.reason})" in journal.message
    assert ("dry run" in happens) == (dry_run and rule in ("miners", "hogs"))  # only a kill has one to skip
    if rule == "miners":
        assert "30s" in happens and "42 (xmrig, 3.0 GiB), 43 (helper)" in happens
    assert journal.fields["target_pids"] == ",".join(map(str, notice.data["pids"])) == "42,43"
    for key in ("subject", "reason", "dry_run", "grace"):
        assert journal.fields[key] == notice.data[key], key
    assert (journal.fields["rule_action"], journal.fields["target_uid"]) == (notice.data["action"], notice.data["uid"])
    assert entry.recent == RecentEvent(NOW, rule, USER, 1000, "violation", RULES[rule].action, "", None, dry_run)
    assert (notice.event, notice.rule, notice.subject) == ("violation", rule, USER)
    assert (notice.data["host"], notice.data["time"], notice.data["summary"]) == (HOST, NOW, notice.summary)
    assert lines_of(notice)["Host"] == HOST and lines_of(notice)["Subject"] == USER


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_cancelled_grace_is_one_outcome_everywhere_and_is_not_notified(dry_run):
    r = report.cancelled(GraceCancelled(RULES["miners"], USER, ("user", 1000), 1000), dry_run, NOW)
    entry = only(r)
    assert r.notice is None
    assert entry.journal.kind is audit.GUARD_ACTION and Outcome.CANCELLED.text in entry.journal.message
    assert entry.journal.fields["result"] == entry.signal.outcome == entry.recent.outcome == Outcome.CANCELLED
    assert entry.signal == report.ActionTaken("miners", USER, "kill", 0, 0, Outcome.CANCELLED, dry_run)
    assert (entry.recent.event, entry.recent.pid, entry.recent.dry_run) == ("cancelled", None, dry_run)
    assert entry.journal.fields["dry_run"] == int(dry_run)


def test_a_dry_run_kill_order_is_one_entry_per_process_and_one_notice():
    order = KillOrder(RULES["miners"], USER, ("user", 1000), 1000, (MINER, HELPER), True, 5.0, True, "why not")
    r = report.would_kill(order, HOST, NOW)
    assert len(r.entries) == 2
    for entry, t in zip(r.entries, order.targets, strict=True):
        j = entry.journal
        assert j.kind is audit.GUARD_DRY_RUN
        assert j.fields["result"] == entry.signal.outcome == entry.recent.outcome == r.notice.data["outcome"]
        assert entry.signal.outcome == Outcome.WOULD_KILL
        assert j.fields["target_pid"] == entry.signal.pid == entry.recent.pid == t.pid
        assert (j.fields["target_start_time"], j.fields["target_uid"]) == (entry.signal.start_time, t.uid)
        assert f"{Outcome.WOULD_KILL.text} PID {t.pid} ({t.comm}, user {t.user})" in j.message
        assert entry.signal.dry_run and entry.recent.dry_run and j.fields["dry_run"] == 1
    assert r.notice.summary.startswith(f"miners: {Outcome.WOULD_KILL.text} 42 (xmrig, 3.0 GiB), 43 (helper)")
    assert r.notice.data["pids"] == [42, 43] and r.notice.data["dry_run"] is True
    assert lines_of(r.notice)["Why"] == j.fields["reason"] == order.reason


def test_a_process_text_with_controls_stays_inside_its_line_of_every_notice():
    """The name, the subject and the reason come from the process; each control is escaped in the notice's
    lines and summary (what the terminal, the mail, the desktop and the journal target show); the webhook's
    data keep the exact text."""
    evil = "x\nForged: 1\x1b[2J\u2028\u202e\x85\x7f"
    target = dataclasses.replace(MINER, comm=evil)
    subject = f"PID 42 ({evil}, user alice)"
    ev = Violation(
        RULES["miners"],
        subject,
        ("k",),
        1000,
        (target,),
        f"process_name == {evil}",
        NOW,
        reason_for_others=f"others: {evil}",
    )
    order = KillOrder(RULES["hogs"], subject, ("k",), 1000, (target,), False, 5.0, False, ev.reason)
    escaped = "x\\x0aForged: 1\\x1b[2J\\u2028\\u202e\\x85\\x7f"
    for r in (
        report.violation(ev, False, HOST, NOW),
        report.would_kill(order, HOST, NOW),
        report.kill_done(order, target, Outcome.TERMINATED, "", HOST, NOW),
    ):
        notice = r.notice
        for text in (notice.summary, notice.body, notice.body_for_others):
            assert escaped in text and not any(line.startswith("Forged") for line in text.split("\n")), text
            assert not [c for c in text if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F)], text
        assert len(notice.body.split("\n")) == len(notice.body_for_others.split("\n"))
        assert notice.data["subject"] == subject and notice.data["reason"] == ev.reason  # the exact text


def test_a_dry_runs_episode_ending_is_journaled_with_why_and_not_notified():
    ev = Left(RULES["miners"], USER, ("user", 1000), 1000, "no longer holds: gpu_memory > 8GiB (now 2.0 GiB)")
    r = report.left(ev, NOW)
    entry = only(r)
    assert r.notice is None and entry.signal is None
    assert entry.journal.kind is audit.GUARD_DRY_RUN and entry.journal.fields["result"] == "left"
    assert entry.journal.message == (
        "Dry run: guard rule miners: user alice no longer violates it (no longer "
        "holds: gpu_memory > 8GiB (now 2.0 GiB)); its would-kill episode ended"
    )
    assert entry.journal.fields["reason"] == ev.why and entry.journal.fields["dry_run"] == 1
    assert entry.recent == RecentEvent(NOW, "miners", USER, 1000, "left", "kill", "", None, True)


def test_recent_events_fold_repeats_with_their_count_and_first_time():
    recent: list[dict] = []
    flap = [
        RecentEvent(NOW + i, "miners", USER, 1000, event, "kill", "", None, True)
        for i in range(3)
        for event in ("violation", "left")
    ]
    for e in flap:
        add_recent(recent, to_plain(e))
    add_recent(recent, to_plain(RecentEvent(NOW + 9, "miners", "user bob", 1001, "violation", "kill", "", None, True)))
    shown = [from_plain(RecentEvent, d) for d in json.loads(json.dumps(recent))]
    assert [(e.subject, e.event, e.repeats, e.since, e.time) for e in shown] == [
        (USER, "violation", 3, NOW, NOW + 2),
        (USER, "left", 3, NOW, NOW + 2),
        ("user bob", "violation", None, None, NOW + 9),
    ]
    for i in range(MAX_RECENT + 5):  # distinct events still keep at most MAX_RECENT, newest last
        add_recent(recent, to_plain(RecentEvent(NOW + 10 + i, "miners", f"user u{i}", i, "violation", "kill")))
    assert len(recent) == MAX_RECENT and recent[-1]["subject"] == f"user u{MAX_RECENT + 4}"


REFUSED = Protected("PID 42 is a kernel thread")


@pytest.mark.parametrize(
    "outcome, error", [*((o, "") for o in sorted(SIGNALLED)), (REFUSED.result, str(REFUSED)), (GpukillError.result, "")]
)
@pytest.mark.parametrize("subject", [USER, f"PID {MINER.pid} (xmrig, user alice)"])
def test_a_finished_kill_words_its_outcome_the_same_in_the_journal_and_the_notice(outcome, error, subject):
    order = KillOrder(RULES["hogs"], subject, ("k",), 1000, (MINER,), False, 5.0, False, "gpu_memory > 2 GiB")
    r = report.kill_done(order, MINER, outcome, error, HOST, NOW)
    entry, notice = only(r), r.notice
    text = result_text(outcome, error)
    said = f"PID 42 (xmrig, user alice) {text}"
    assert entry.journal.kind is audit.GUARD_ACTION
    assert entry.journal.message.startswith(f"Guard rule hogs: {said}")
    assert lines_of(notice)["Result"] == said and notice.summary == f"hogs: PID 42 (xmrig) {text}"
    assert (f" for {USER} " in entry.journal.message) == (subject == USER)  # a process is not named twice
    results = (entry.journal.fields["result"], entry.signal.outcome, entry.recent.outcome, notice.data["outcome"])
    assert results == (outcome,) * 4
    assert entry.journal.fields["error"] == (error or None)
    assert entry.signal == report.ActionTaken("hogs", subject, "kill", 42, 4242, outcome, False)
    assert entry.recent == RecentEvent(NOW, "hogs", subject, 1000, "action", "kill", outcome, 42, False)
    assert (notice.data["pids"], notice.data["uid"], notice.data["dry_run"]) == ([42], 1000, False)


def test_outcome_texts_and_refusals():
    assert [o.text for o in SIGNALLED] and all(result_text(o) == o.text for o in Outcome)
    assert result_text("killed") == Outcome.KILLED.text == "killed with SIGKILL"  # the kill path's str
    assert result_text(NoSuchProcess.result) == "not stopped: no-such-process"
    assert result_text(REFUSED.result, str(REFUSED)) == f"not stopped: {REFUSED}"
    assert "terminated" in SIGNALLED and Protected.result not in SIGNALLED and not Outcome.WOULD_KILL.signalled
    assert guard_initiator("miners") == "guard:miners"


class Sink:
    """The runner's outputs: its audit trail, its GuardSignals and its notifier, all in one list."""

    def __init__(self) -> None:
        self.got: list[tuple] = []
        self.config = NotifyConfig()

    def log(self, kind, message, **fields):
        self.got.append(("journal", kind, message, fields))

    def violated(self, event, dry_run):
        self.got.append(("violated", event, dry_run))

    def action_taken(self, *args):
        self.got.append(("action_taken", *args))

    def notification(self, notice, uid):
        self.got.append(("notification", notice, uid))

    def send(self, targets, notice):
        self.got.append(("notice", targets, notice))

    def close(self):
        pass


def test_the_runner_passes_each_report_on_as_it_is(tmp_path):
    sink = Sink()
    kills = []

    async def kill(caller, pid, start_time, grace, force, initiator):
        kills.append((caller, pid, initiator))
        raise REFUSED

    clock = Clock(monotonic=lambda: 1.0, boottime=lambda: 1.0, wall=lambda: NOW)
    runner = GuardRunner(
        kill, sink, NotifyConfig(), str(tmp_path / "g"), str(tmp_path / "s"), clock=clock, signals=sink
    )
    runner.notifier.close()
    runner.notifier = sink
    runner._host = HOST
    runner.engine.set_policy(PARSED)  # its notify: journal is where both notices go
    ev = Violation(RULES["tell"], USER, ("user", 1000), 1000, (MINER,), "why", NOW)
    order = KillOrder(RULES["hogs"], USER, ("user", 1000), 1000, (MINER,), False, 5.0, False, "why")

    gone = Left(RULES["miners"], USER, ("user", 1000), 1000, "gone: no longer on a GPU, or exempt")

    async def run() -> None:
        runner._handle(ev, False)
        runner._handle(order, False)
        await asyncio.gather(*runner._tasks)
        runner._handle(gone, True)
        runner.stop()

    asyncio.run(run())
    expected = []
    for r in (
        report.violation(ev, False, HOST, NOW),
        report.kill_done(order, MINER, REFUSED.result, str(REFUSED), HOST, NOW),
    ):
        e = only(r)
        signal = (
            ("violated", e.signal.event, e.signal.dry_run)
            if isinstance(e.signal, report.Violated)
            else ("action_taken", *dataclasses.astuple(e.signal))
        )
        expected += [
            ("journal", e.journal.kind, e.journal.message, e.journal.fields),
            signal,
            ("notice", ("journal",), r.notice),
        ]
    e = only(report.left(gone, NOW))
    expected.append(("journal", e.journal.kind, e.journal.message, e.journal.fields))  # no signal, no notice
    assert sink.got == expected
    assert kills == [(None, MINER.pid, guard_initiator("hogs"))]
    recent = [
        only(report.violation(ev, False, HOST, NOW)).recent,
        only(report.kill_done(order, MINER, REFUSED.result, str(REFUSED), HOST, NOW)).recent,
        e.recent,
    ]
    assert runner.state.recent == [to_plain(e) for e in recent]
    saved = json.loads(json.dumps(runner.state.recent))  # as the state file keeps them across a restart
    assert [from_plain(RecentEvent, d) for d in saved] == recent


def test_a_scoped_kill_names_what_it_stopped_with_the_target_and_what_it_left_running():
    """kill_scope: the journal entry, the recent event's detail and the notice name the members stopped with
    the target (with what became of each) and those left running with why; a dry run's entry says the same
    without results."""
    from gpukilld.guard.engine import Scoped

    worker = Target(44, 4444, 1000, "alice", "python3", None, None)
    scoped = Scoped((worker,), ((HELPER, "exempt: process name helper"),))
    order = KillOrder(
        RULES["hogs"],
        "PID 42 (xmrig, user alice)",
        (42, 4242),
        1000,
        (MINER,),
        True,
        5.0,
        False,
        "process_name == 'hog'",
        scoped=(scoped,),
    )
    done = report.kill_done(order, MINER, Outcome.TERMINATED, "", HOST, NOW, scoped, {(44, 4444): (Outcome.KILLED, "")})
    entry = only(done)
    said = "with PID 44 (python3) killed with SIGKILL; left running: PID 43 (helper, exempt: process name helper)"
    assert said in entry.journal.message, entry.journal.message
    assert (entry.journal.fields["scope_pids"], entry.journal.fields["left_running"]) == ("44", "43")
    assert entry.recent.detail == said
    assert lines_of(done.notice)["Scope"] == said
    assert "Scope:" not in done.notice.body_for_others  # other processes' names are the admin's to read
    dry = only(report.would_kill(dataclasses.replace(order, dry_run=True), HOST, NOW))
    assert "with PID 44 (python3); left running: PID 43 (helper, exempt: process name helper)" in dry.journal.message
    assert dry.recent.detail == "with PID 44 (python3); left running: PID 43 (helper, exempt: process name helper)"


@pytest.mark.parametrize("refused", [False, True], ids=["stopped", "refused-as-a-whole"])
def test_the_runner_stops_only_what_the_engine_decided_and_frees_every_member(tmp_path, refused):
    """The runner hands KillWorkload the members the engine checked (only) and those it left running with why
    (spare); every member's answer frees it and counts, and an act refused as a whole is each member's answer."""
    from helpers.guard_inputs import OWN_PID, proc, snap

    from gpukill.records.reclaim import WorkloadEntry, WorkloadReply

    calls = []

    async def kill_workload(caller, selection, grace, force, initiator):
        calls.append(selection)
        if refused:
            raise REFUSED
        return WorkloadReply(
            selection.text,
            (
                WorkloadEntry(10, 100, 1000, "trainer", Outcome.TERMINATED),
                WorkloadEntry(11, 100, 1000, "python", Outcome.KILLED),
            ),
        )

    clock = Clock(monotonic=lambda: 1.0, boottime=lambda: 1.0, wall=lambda: NOW)
    runner = GuardRunner(
        None,
        audit.Audit(None),
        NotifyConfig(),
        str(tmp_path / "g"),
        str(tmp_path / "s"),
        clock=clock,
        own_pid=OWN_PID,
        kill_workload=kill_workload,
    )
    runner.engine.tree = lambda pid: [(10, 100), (11, 100), (12, 100)]
    runner.engine.set_policy(
        load_texts(
            [
                (
                    "p.yaml",
                    "rules:\n  - name: t\n    action: kill\n    kill_scope: tree\n"
                    "    exemptions: {processes: [ckpt]}\n    conditions: [{type: "
                    "process_name, operator: ==, value: trainer}]\n",
                )
            ]
        )
    )
    (order,) = [
        e
        for e in runner.engine.evaluate(snap(proc(10, "trainer"), proc(11), proc(12, "ckpt")), False)
        if isinstance(e, KillOrder)
    ]

    async def run() -> None:
        runner._handle(order, False)
        await asyncio.gather(*runner._tasks)
        runner.stop()

    asyncio.run(run())
    (selection,) = calls
    assert (selection.kind, selection.value, selection.owner) == ("tree", "10", 1000)
    assert selection.only == {(10, 100), (11, 100)} and selection.spare == ((12, 100, "exempt: process name ckpt"),)
    assert runner.engine.busy == set() and not runner.engine.states[0].in_flight
    stats = runner.engine.stats["t"]
    assert (stats.kills, stats.failed) == ((0, 2) if refused else (2, 0))
    (recent,) = runner.state.recent
    want = f"with PID 11 (python) not stopped: {REFUSED}" if refused else "with PID 11 (python) killed with SIGKILL"
    assert recent["detail"] == want + "; left running: PID 12 (ckpt, exempt: process name ckpt)"


def test_a_recent_events_detail_is_left_out_where_proc_hides_other_users():
    """The detail names other processes of a kill_scope (another user's among them): a viewer to whom /proc
    hides other users' processes gets the event without it; one who sees programs gets it whole."""
    from gpukill.records.guard import GuardStatus
    from gpukilld.access.visibility import HIDDEN, PROGRAM, Viewer
    from gpukilld.bus.guard import status_as_seen

    event = RecentEvent(
        NOW,
        "t",
        "PID 10 (trainer, user alice)",
        1000,
        "action",
        "kill",
        "terminated",
        10,
        False,
        detail="left running: PID 14 (python, exempt: user bob)",
    )
    status = GuardStatus(True, False, False, "files", recent=(event,))
    assert status_as_seen(status, Viewer(1000, PROGRAM)).recent == (event,)
    assert status_as_seen(status, Viewer(1000, HIDDEN)).recent == (dataclasses.replace(event, detail=""),)
