"""An owner's request for more time (a kill rule's `postpone: {max, times}`), with an injected clock: the key is
validated where it is written; a postponement moves the end of the episode's grace within the caps (granted,
granted in part, refused past times or max), the kill waits for the new end and the warnings follow it; it
ends with the episode and survives a reload of an unchanged rule and a restart. No waiting, no processes:
tests/test_guard_postpone_daemon.py shows the same through the bus on real processes."""

from __future__ import annotations

import pytest
from helpers.guard_inputs import OWN_PID, FakeTime, GiB, proc, snap

from gpukill.policy import PolicyError, load_texts
from gpukill.rules import Postpone
from gpukilld.guard import clocks
from gpukilld.guard.engine import Engine, GraceWarning, KillOrder, Violation


def rule(extra: str = "postpone: {max: 1h, times: 2}", grace: str = "30m", scope: str = "per_process") -> str:
    condition = (
        "{type: gpu_utilization, operator: '<', value: 5}"
        if scope == "per_process"
        else "{type: user_memory, operator: '>', value: 1GiB}"
    )
    return (
        f"rules:\n  - name: idle-gpu\n    scope: {scope}\n    conditions:\n      - {condition}\n"
        f"    action: kill\n    grace_period: {grace}\n    {extra}\n"
    )


def error_of(text: str) -> str:
    with pytest.raises(PolicyError) as e:
        load_texts([("p.yaml", text)])
    return "\n".join(e.value.errors)


def test_the_caps_are_read_into_the_rule_and_its_fingerprint():
    (r,) = load_texts([("p.yaml", rule())]).rules
    assert r.postpone == Postpone(3600.0, 2)
    (other,) = load_texts([("p.yaml", rule("postpone: {max: 2h, times: 2}"))]).rules
    assert r.fingerprint != other.fingerprint
    (none,) = load_texts([("p.yaml", rule("warn: [at_start]"))]).rules
    assert none.postpone is None


@pytest.mark.parametrize(
    ("extra", "grace", "says"),
    [
        ("postpone: {max: 1h, times: 2}", "0s", "p.yaml:8:5: postpone needs a grace_period"),
        ("postpone: {max: 0s, times: 2}", "30m", "p.yaml:8:21: postpone's max must be between 1s and 7d, not 0s"),
        ("postpone: {max: 1h, times: 0}", "30m", "p.yaml:8:32: postpone's times must be a whole number from 1 to 100"),
        ("postpone: {max: 1h}", "30m", "p.yaml:8:15: postpone needs 'times'"),
        ("postpone: {max: 1h, times: 2, for: 3}", "30m", "p.yaml:8:35: unknown field 'for' in postpone"),
        ("postpone: 1h", "30m", "p.yaml:8:15: postpone must be a mapping"),
    ],
)
def test_a_bad_postpone_is_refused_at_its_line_and_column(extra, grace, says):
    assert says in error_of(rule(extra, grace))


def test_postpone_applies_only_to_kill_rules():
    text = (
        "rules:\n  - name: n\n    conditions: [{type: gpu_utilization, operator: '<', value: 5}]\n"
        "    action: notify\n    postpone: {max: 1h, times: 2}\n"
    )
    assert "p.yaml:5:5: postpone applies only to action kill, not notify" in error_of(text)


def engine(text: str) -> tuple[Engine, FakeTime]:
    t = FakeTime()
    return Engine(load_texts([("p.yaml", text)]), t.clock(), own_pid=OWN_PID), t


def at(e: Engine, t: FakeTime, now: float, s) -> list:
    t.now = now
    return e.evaluate(s, False)


IDLE = snap(proc(10, "notebook", util=0, mem=4 * GiB))
KEY = (10, 100)


def test_granted_within_the_caps_the_kill_waits_for_the_new_deadline():
    t0 = FakeTime().now
    e, t = engine(rule())
    assert [type(ev) for ev in at(e, t, t0, IDLE)] == [Violation]
    assert e.pending_graces(10, 100) == [("idle-gpu", KEY)]
    assert e.pending_graces(10, 101) == []  # another process with that PID names nothing
    t.now = t0 + 600
    got = e.postpone("idle-gpu", KEY, 1200.0, "saving", "alice")
    assert got is not None and got.granted == 1200 and got.left == 1 and got.text == "granted 20min"
    assert got.deadline == pytest.approx(t.clock().wall() + 1200 + 1200)  # 20m of the grace were left, +20m
    assert [x.pid for x in got.targets] == [10]
    grace = e.grace_report()[0]
    assert grace["remaining"] == pytest.approx(2400)
    assert (grace["postponed"], grace["postponements"], grace["postponed_by"], grace["postpone_reason"]) == (
        1200.0,
        1,
        "alice",
        "saving",
    )
    assert at(e, t, t0 + 1800, IDLE) == []  # the grace's first end: no kill
    assert at(e, t, t0 + 2999, IDLE) == []
    assert [type(ev) for ev in at(e, t, t0 + 3000, IDLE)] == [KillOrder]  # the new end
    assert e.postpone("idle-gpu", KEY, 60.0, "", "alice") is None  # ordered: nothing pending any more


def test_partly_granted_then_refused_past_max_and_past_times():
    t0 = FakeTime().now
    e, t = engine(rule("postpone: {max: 1h, times: 3}"))
    at(e, t, t0, IDLE)
    assert e.postpone("idle-gpu", KEY, 2400.0, "a", "alice").granted == 2400  # 40m
    half = e.postpone("idle-gpu", KEY, 1800.0, "b", "alice")
    assert half.granted == 1200 and half.left == 1
    assert half.text == "granted 20min of 30min asked: the rule's max is 1h and 40min were granted before"
    none = e.postpone("idle-gpu", KEY, 60.0, "c", "alice")
    assert none.refused and none.deadline == 0 and "max of 1h per episode was granted before" in none.text
    assert e.grace_report()[0]["remaining"] == pytest.approx(1800 + 3600)
    assert e.grace_report()[0]["postpone_reason"] == "b"  # a refusal changes nothing


def test_refused_beyond_times():
    t0 = FakeTime().now
    e, t = engine(rule())
    at(e, t, t0, IDLE)
    assert e.postpone("idle-gpu", KEY, 60.0, "", "alice").left == 1
    assert e.postpone("idle-gpu", KEY, 60.0, "", "alice").left == 0
    third = e.postpone("idle-gpu", KEY, 60.0, "", "alice")
    assert third.refused and third.text == "rule idle-gpu allows 2 postponements per episode; both used"
    assert e.grace_report()[0]["remaining"] == pytest.approx(1800 + 120)


def test_a_rule_without_postpone_refuses_with_why():
    t0 = FakeTime().now
    e, t = engine(rule("warn: [at_start]"))
    at(e, t, t0, IDLE)
    got = e.postpone("idle-gpu", KEY, 60.0, "", "alice")
    assert got.refused and got.text == "rule idle-gpu allows no postponement"


def test_the_warnings_follow_the_new_deadline():
    t0 = FakeTime().now
    e, t = engine(rule("postpone: {max: 1h, times: 2}\n    warn: [at_start, 15m, 1m]"))
    at(e, t, t0, IDLE)
    (w,) = at(e, t, t0 + 900, IDLE)  # 15m left
    assert isinstance(w, GraceWarning) and w.number == 2
    e.postpone("idle-gpu", KEY, 1200.0, "", "alice")  # 35m left: the 15m warning comes again, re-timed
    assert e.grace_report()[0]["warnings_sent"] == 1
    assert e.grace_report()[0]["next_warning"] == pytest.approx(1200)
    assert at(e, t, t0 + 1000, IDLE) == []
    (w,) = at(e, t, t0 + 2100, IDLE)
    assert w.number == 2 and w.remaining == pytest.approx(900)
    (w,) = at(e, t, t0 + 2940, IDLE)
    assert w.number == 3 and w.remaining == pytest.approx(60)
    assert [type(ev) for ev in at(e, t, t0 + 3000, IDLE)] == [KillOrder]


def test_a_postponement_ends_with_the_episode():
    t0 = FakeTime().now
    e, t = engine(rule())
    at(e, t, t0, IDLE)
    e.postpone("idle-gpu", KEY, 600.0, "", "alice")
    busy = snap(proc(10, "notebook", util=90, mem=4 * GiB))
    assert [type(ev).__name__ for ev in at(e, t, t0 + 60, busy)] == ["GraceCancelled"]
    assert e.pending_graces(10, 100) == []
    at(e, t, t0 + 120, IDLE)  # a new episode: the whole grace, both postponements again
    assert e.grace_report()[0]["remaining"] == pytest.approx(1800)
    assert e.postpone("idle-gpu", KEY, 60.0, "", "alice").left == 1


def test_a_user_rule_is_postponed_by_any_of_the_users_processes():
    t0 = FakeTime().now
    e, t = engine(rule(scope="per_user"))
    s = snap(proc(10, mem=2 * GiB), proc(11, mem=1 * GiB, start=200), proc(20, uid=1001, user="bob", mem=5 * GiB))
    at(e, t, t0, s)
    assert e.pending_graces(11, 200) == [("idle-gpu", 1000)]
    assert sorted(e.pending_graces(20, 100)) == [("idle-gpu", 1001)]
    assert e.postpone("idle-gpu", 1000, 60.0, "", "alice").granted == 60
    assert {g["subject"]: g["postponed"] for g in e.grace_report()} == {"user alice": 60.0, "user bob": 0.0}


def test_a_postponement_survives_a_reload_of_the_unchanged_rule_and_a_restart():
    t0 = FakeTime().now
    e, t = engine(rule())
    at(e, t, t0, IDLE)
    e.postpone("idle-gpu", KEY, 600.0, "saving", "alice")
    e.set_policy(load_texts([("again.yaml", rule())]))
    assert e.grace_report()[0]["postponed"] == 600
    saved = clocks.save(e, "boot")
    again = Engine(e.policy, t.clock(), own_pid=OWN_PID)
    restored, note = clocks.restore(again, saved, "boot", lambda pid, start: True)
    assert restored and note is None
    grace = again.grace_report()[0]
    assert (grace["remaining"], grace["postponements"], grace["postpone_reason"]) == (pytest.approx(2400), 1, "saving")
    assert again.pending_graces(10, 100) == [("idle-gpu", KEY)]  # before its first evaluation too
    assert again.postpone("idle-gpu", KEY, 60.0, "", "alice").text == "granted 1min"
    assert again.postpone("idle-gpu", KEY, 60.0, "", "alice").refused
    assert at(again, t, t0 + 2459, IDLE) == []
    assert [type(ev) for ev in at(again, t, t0 + 2460, IDLE)] == [KillOrder]
    e.set_policy(load_texts([("changed.yaml", rule("postpone: {max: 2h, times: 2}"))]))
    assert e.grace_report() == []  # a rule that changed starts afresh


def test_saved_postponements_of_the_wrong_shape_are_dropped():
    t0 = FakeTime().now
    e, t = engine(rule())
    at(e, t, t0, IDLE)
    e.postpone("idle-gpu", KEY, 600.0, "", "alice")
    saved = clocks.save(e, "boot")
    saved["rules"][0]["episodes"][0][7] = {"seconds": 600, "times": 9, "reason": "", "by": ""}
    again = Engine(e.policy, t.clock(), own_pid=OWN_PID)
    restored, note = clocks.restore(again, saved, "boot", lambda pid, start: True)
    assert again.grace_report() == [] and "1 malformed" in note


def test_the_owners_warnings_say_how_to_ask_with_the_caps():
    from gpukilld.guard import report

    t0 = FakeTime().now
    e, t = engine(rule("postpone: {max: 1h, times: 2}\n    warn: [at_start, 15m]"))
    (v,) = at(e, t, t0, IDLE)
    ask = "To ask for more time: gpukillctl postpone 10 20min --reason '...' (rule idle-gpu allows up to 1h more in 2"
    assert ask in report.violation(v, False, "host", 0.0).notice.body
    (w,) = at(e, t, t0 + 900, IDLE)
    assert ask in report.warning(w, False, "host", 0.0).notice.body
    plain, t = engine(rule("warn: [at_start]"))
    (v,) = at(plain, t, t0, IDLE)
    assert "To ask for more time" not in report.violation(v, False, "host", 0.0).notice.body
