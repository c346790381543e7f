"""The notification agent's decisions without a bus (gpukillctl/notify/events.py, gate.py): whom an
event concerns, a grace that ends in a cancellation, folding, and the gate's burst and summary."""

from __future__ import annotations

from gpukill.records.guard import ViolationDetails
from gpukill.records.signals import GuardActionTaken, Notification, PolicyViolated, ProcessKilled
from gpukillctl.notify.desktop import body_text
from gpukillctl.notify.events import CLAIM_WAIT, CRITICAL, NORMAL, Audience, Narrator, Step
from gpukillctl.notify.gate import Gate, Toast

ME, THEM = 1001, 1002
WALL = 1.7e9


def violated(uid: int, grace: float = 30.0, subject: str = "user me") -> PolicyViolated:
    return PolicyViolated(
        "cap", subject, "kill", False, ViolationDetails("per_user", "9 GiB > 8 GiB", grace, uid, (42,), WALL)
    )


def test_a_cancelled_grace_closes_the_users_countdown_in_place():
    n = Narrator(Audience(ME))
    (opened,) = n.on_event(violated(ME), 0.0, WALL + 10)  # 10 s of the 30 s grace already ran
    assert opened.step is Step.OPEN and opened.urgency == CRITICAL and opened.summary.endswith("in 20s")
    assert n.next_due() == 1.0 and [t.summary for t in n.tick(1.0)] == ["user me will be stopped in 19s"]
    (closed,) = n.on_event(GuardActionTaken("cap", "user me", "kill", 0, 0, "cancelled", False), 2.0, WALL)
    assert closed.key == opened.key and closed.step is Step.CLOSE and closed.urgency == NORMAL
    assert "nothing was stopped" in closed.body and n.tick(3.0) == []


def test_a_requeue_rules_grace_counts_down_to_slurms_act_and_closes_with_the_job():
    n = Narrator(Audience(ME))
    requeue = PolicyViolated(
        "idle", "PID 42 (x)", "requeue", False, ViolationDetails("per_process", "idle", 30.0, ME, (42,), WALL)
    )
    (opened,) = n.on_event(requeue, 0.0, WALL)
    assert opened.urgency == CRITICAL and "Slurm is asked to requeue its job in 30s" in opened.body
    (done,) = n.on_event(GuardActionTaken("idle", "PID 42 (x)", "requeue", 42, 5, "requeued", False), 1.0, WALL)
    assert done.key == opened.key and done.step is Step.CLOSE and "PID 42 requeued." in done.body


def test_other_users_events_are_not_shown_unless_everything_is_asked():
    kill = ProcessKilled(7, 1, THEM, "x", ("GPU-0",), "terminated", 0, "user")
    for event in (kill, violated(THEM), Notification(THEM, "cap", "s", "b")):
        assert Narrator(Audience(ME)).on_event(event, 0.0, WALL) == []
        assert Narrator(Audience(ME, everything=True)).on_event(event, 0.0, WALL) != []


def test_a_guard_kill_is_shown_once_and_a_notice_of_the_same_rule_is_folded():
    n = Narrator(Audience(ME))
    n.on_event(violated(ME, grace=0.0, subject="PID 42 (x)"), 0.0, WALL)
    kill = ProcessKilled(42, 5, ME, "x", ("GPU-0",), "terminated", 0, "guard:cap")
    assert n.on_event(kill, 0.1, WALL) == []  # waits for its GuardActionTaken
    (done,) = n.on_event(GuardActionTaken("cap", "PID 42 (x)", "kill", 42, 5, "terminated", False), 0.2, WALL)
    assert done.step is Step.CLOSE and "x (PID 42) terminated." in done.body
    assert n.on_event(Notification(ME, "cap", "cap: PID 42 terminated", "..."), 0.3, WALL) == []
    assert n.tick(0.2 + CLAIM_WAIT + 1) == []
    # a Guard kill whose GuardActionTaken never comes is shown by itself
    n.on_event(ProcessKilled(43, 6, ME, "y", (), "killed", 0, "guard:cap"), 10.0, WALL)
    (alone,) = n.tick(10.0 + CLAIM_WAIT)
    assert alone.summary == "GPU process stopped: y (PID 43)" and "Guard rule cap" in alone.body


def test_the_gate_shows_a_burst_then_one_summary_and_passes_updates_of_what_it_showed():
    g = Gate(burst=2, refill=5.0)
    shown = [t for i in range(10) for t in g.admit(Toast(f"kill {i}", "", NORMAL), 0.0)]
    assert [t.summary for t in shown] == ["kill 0", "kill 1"]
    assert g.due() == 5.0 and g.flush(4.0) == []
    (summary,) = g.flush(5.0)
    assert summary.summary == "8 GPU notifications at once" and summary.body.endswith("… and 2 more")
    assert g.admit(Toast("held", "", CRITICAL, "k", Step.OPEN), 5.0) == []
    assert g.admit(Toast("update", "", CRITICAL, "k", Step.UPDATE), 5.0) == []  # its pop-up was never shown
    g2 = Gate()
    g2.admit(Toast("open", "", CRITICAL, "k", Step.OPEN), 0.0)
    assert [t.summary for t in g2.admit(Toast("update", "", CRITICAL, "k", Step.UPDATE), 0.1)] == ["update"]


def test_body_markup_and_control_characters_are_escaped():
    assert body_text("a<b>&c\x1b[1m\nnext", markup=True) == "a&lt;b&gt;&amp;c\\x1b[1m\nnext"
    assert body_text("a<b>\x07", markup=False) == "a<b>\\x07"


def test_a_newline_in_a_process_name_stays_inside_its_line_of_the_pop_up():
    """A process names itself "x\\nForged: yes": the agent's body is lines of its own, and the name must add none."""
    n = Narrator(Audience(ME))
    name = "x\nForged: yes"
    toasts = [
        *n.on_event(ProcessKilled(7, 1, ME, name, ("GPU-0",), "terminated", 0, "user"), 0.0, WALL),
        *n.on_event(violated(ME, subject=f"PID 8 ({name}, user me)"), 0.0, WALL),
        *n.on_event(GuardActionTaken("cap", f"PID 8 ({name}, user me)", "kill", 8, 1, "terminated", False), 1.0, WALL),
    ]
    assert len(toasts) == 3
    for toast in toasts:
        lines = body_text(toast.body, markup=True).split("\n")
        assert "\n" not in toast.summary and not [line for line in lines if line.startswith("Forged")], toast
    assert all("x\\x0aForged: yes" in t.summary + t.body for t in toasts[:2])
    (closed,) = toasts[2:]
    assert closed.step is Step.CLOSE and closed.key == toasts[1].key  # the same subject, escaped alike
