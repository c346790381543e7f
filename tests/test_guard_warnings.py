"""A kill rule's warning schedule (`warn:`): validated where it is written, sent when due during the
grace period with how long is left, one warning for several due at once, none after the kill or once the subject
comes back under, and kept across a daemon restart (the clocks). Engine with an injected clock; the daemon test
(test_guard_reclaim.py) shows the journal entries on real processes."""

from __future__ import annotations

import pytest
from helpers.guard_inputs import OWN_PID, FakeTime, GiB, proc, snap

from gpukill.policy import PolicyError, load_texts
from gpukilld.guard import clocks, report
from gpukilld.guard.engine import Engine, GraceWarning, KillOrder, Violation


def rule(warn: str, grace: str = "100s", action: str = "kill") -> str:
    return (
        "rules:\n  - name: idle\n    conditions:\n      - {type: gpu_utilization, operator: '<', value: 5}\n"
        f"    action: {action}\n    grace_period: {grace}\n    warn: {warn}\n"
    )


def policy(text: str):
    return load_texts([("w.yaml", text)])


def error_of(text: str) -> str:
    with pytest.raises(PolicyError) as e:
        policy(text)
    return str(e.value)


def test_the_schedule_is_kept_largest_first_with_at_start_as_the_grace_period():
    r = policy(rule("[1m, at_start, 10s]")).rules[0]
    assert r.warn == (100.0, 60.0, 10.0)


@pytest.mark.parametrize(
    ("warn", "grace", "where", "says"),
    [
        ("[at_start, 2m]", "100s", "w.yaml:7:22", "must fall within the grace period"),
        ("[0s]", "100s", "w.yaml:7:12", "must fall within the grace period"),
        ("[1m, 1m]", "100s", "w.yaml:7:16", "twice"),
        ("[]", "100s", "w.yaml:7:11", "an empty list"),
        ("soon", "100s", "w.yaml:7:11", "warn must be a list"),
        ("[tomorrow]", "100s", "w.yaml:7:12", "a warning"),
        ("[at_start]", "0s", "w.yaml:7:5", "warn needs a grace_period"),
    ],
)
def test_a_bad_schedule_is_refused_at_its_line_and_column(warn, grace, where, says):
    message = error_of(rule(warn, grace))
    assert where in message and says in message, message


def test_warn_applies_only_to_kill_rules():
    message = error_of(
        rule("[at_start]", action="notify").replace("    grace_period: 100s\n", "") + "    notify: [journal]\n"
    )
    assert "warn applies only to actions kill, suspend, requeue and cancel" in message


def engine(warn: str) -> tuple[Engine, FakeTime]:
    t = FakeTime()
    return Engine(policy(rule(warn)), t.clock(), own_pid=OWN_PID), t


def at(e: Engine, t: FakeTime, now: float, s) -> list:
    t.now = now
    return e.evaluate(s, False)


def test_warnings_come_when_due_with_what_is_left_then_the_kill_at_the_end_of_the_grace():
    t0 = FakeTime().now
    e, t = engine("[at_start, 30s, 10s]")
    s = snap(proc(10, "notebook", util=0, mem=4 * GiB))
    first = at(e, t, t0, s)
    assert [type(ev) for ev in first] == [Violation]
    assert report.violation(first[0], False, "host", 0.0).notice is not None  # at_start: the violation's notice
    assert at(e, t, t0 + 69, s) == []
    (w,) = at(e, t, t0 + 70, s)
    assert isinstance(w, GraceWarning) and w.remaining == 30 and w.number == 2 and w.targets[0].pid == 10
    text = report.warning(w, False, "host", 0.0)
    assert "will be stopped in 30s" in text.notice.summary and "What to do" in text.notice.body
    assert text.entries[0].journal.kind.name == "guard-warning" and text.entries[0].signal is None
    grace = e.grace_report()[0]
    assert grace["warnings_sent"] == 2 and grace["next_warning"] == pytest.approx(20)
    assert at(e, t, t0 + 80, s) == []
    (w,) = at(e, t, t0 + 90, s)
    assert w.number == 3 and w.remaining == 10
    assert e.grace_report()[0]["next_warning"] is None
    assert [type(ev) for ev in at(e, t, t0 + 100, s)] == [KillOrder]
    assert at(e, t, t0 + 105, s) == []  # no warning after the kill


def test_without_at_start_the_violation_sends_no_notice_and_warnings_due_together_make_one():
    t0 = FakeTime().now
    e, t = engine("[30s, 20s]")
    s = snap(proc(10, "notebook", util=0, mem=4 * GiB))
    (v,) = at(e, t, t0, s)
    assert report.violation(v, False, "host", 0.0).notice is None
    (w,) = at(e, t, t0 + 85, s)  # both due by now (a slow evaluation interval): one warning, 15 s left
    assert w.number == 2 and w.remaining == 15


def test_coming_back_under_ends_the_schedule():
    t0 = FakeTime().now
    e, t = engine("[at_start, 10s]")
    idle, busy = snap(proc(10, util=0)), snap(proc(10, util=90))
    at(e, t, t0, idle)
    assert [type(ev).__name__ for ev in at(e, t, t0 + 50, busy)] == ["GraceCancelled"]
    assert [type(ev) for ev in at(e, t, t0 + 60, idle)] == [Violation]  # a new episode, a new schedule
    assert at(e, t, t0 + 149, idle) == []
    assert isinstance(at(e, t, t0 + 150, idle)[0], GraceWarning)


def test_the_warnings_sent_survive_a_restart():
    t0 = FakeTime().now
    e, t = engine("[at_start, 30s, 10s]")
    s = snap(proc(10, util=0))
    at(e, t, t0, s)
    at(e, t, t0 + 75, s)
    saved = clocks.save(e, "boot")
    again = Engine(e.policy, t.clock(), own_pid=OWN_PID)
    restored, _ = clocks.restore(again, saved, "boot", lambda pid, start: True)
    assert restored and again.grace_report()[0]["warnings_sent"] == 2
    assert at(again, t, t0 + 80, s) == []  # the 30 s warning is not sent twice
    assert isinstance(at(again, t, t0 + 90, s)[0], GraceWarning)
