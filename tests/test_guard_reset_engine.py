"""Guard's action reset in the engine, without a daemon: when a reset is ordered (after the duration, never while
a process holds the device without force), how often (cooldown, hourly cap, one at a time), dry run and
TestPolicies previews, and the reports it becomes. The real daemon on simulated GPUs: test_guard_reset.py."""

from __future__ import annotations

import dataclasses

from helpers.guard_inputs import OWN_PID, FakeGroups, FakeTime, dev, proc, snap

from gpukill.device_faults import recovery_action, xid_reason
from gpukill.outcome import Outcome
from gpukill.policy import load_texts
from gpukilld.guard import report
from gpukilld.guard.engine import Engine, ResetOrder, Violation

XID = xid_reason(79, "GPU reset")


def policy(force: bool = False, cooldown: str = "1m", per_hour: int = 3, extra: str = ""):
    return load_texts(
        [
            (
                "heal.yaml",
                "rules:\n  - name: heal\n    scope: per_device\n    action: reset\n"
                f"    force: {str(force).lower()}\n    cooldown: {cooldown}\n"
                f"    max_resets_per_hour: {per_hour}\n    conditions:\n"
                "      - {type: device_state, operator: ==, value: error, duration: 10s}\n" + extra,
            )
        ]
    )


def broken(index: int = 0, state: str = "error", reason: str = XID):
    return dataclasses.replace(dev(index), state=state, state_reason=reason)


def engine_for(pol, clock: FakeTime) -> Engine:
    return Engine(pol, clock=clock.clock(), groups=FakeGroups({}), own_pid=OWN_PID)


def resets(events) -> list[ResetOrder]:
    return [e for e in events if isinstance(e, ResetOrder)]


def test_a_device_in_error_is_reset_after_the_duration_once_per_cooldown() -> None:
    clock = FakeTime()
    engine = engine_for(policy(cooldown="1m"), clock)
    devices = (broken(0), dev(1))
    assert resets(engine.evaluate(snap(devices=devices), False)) == []  # the duration starts
    clock.now += 9
    assert resets(engine.evaluate(snap(devices=devices), False)) == []
    clock.now += 1
    events = engine.evaluate(snap(devices=devices), False)
    (violation,) = [e for e in events if isinstance(e, Violation)]
    (order,) = resets(events)
    assert (order.subject_key, order.device_index, order.holders, order.force) == ("GPU-0", 0, (), False)
    assert order.reason == "device_state 'error' == 'error' for 10s" and violation.subject == order.subject
    clock.now += 1
    assert resets(engine.evaluate(snap(devices=devices), False)) == [], "one reset of a device at a time"
    engine.reset_finished(order, Outcome.RESET)
    for _ in range(58):  # still in error, but within the cooldown after the reset
        clock.now += 1
        assert resets(engine.evaluate(snap(devices=devices), False)) == []
    clock.now += 1.5
    assert [o.subject_key for o in resets(engine.evaluate(snap(devices=devices), False))] == ["GPU-0"]
    assert engine.stats["heal"].resets == 1


def test_at_most_max_resets_per_hour_whatever_the_cooldown() -> None:
    clock = FakeTime()
    engine = engine_for(policy(cooldown="10s", per_hour=2), clock)
    devices = (broken(0),)
    times = []
    while clock.now < 1000 + 3615:  # the first reset at 1010, the third an hour after it
        for order in resets(engine.evaluate(snap(devices=devices), False)):
            times.append(clock.now)
            engine.reset_finished(order, "reset-failed")  # failed attempts count too
        clock.now += 5
    assert times == [1010.0, 1020.0, 4610.0]
    assert engine.stats["heal"].failed == 3


def test_never_while_a_process_holds_the_device_unless_force() -> None:
    clock = FakeTime()
    holder = proc(500, "trainer", mem=1 << 30, util=10.0, device=0)
    system = proc(600, "dcgm", uid=0, user="root", device=0)  # protected: invisible to rules, still a holder
    for force in (False, True):
        engine = engine_for(policy(force=force), clock)
        for _ in range(30):
            events = engine.evaluate(snap(holder, system, devices=(broken(0),)), False)
            clock.now += 1
            if resets(events):
                break
        if not force:
            assert resets(events) == [] and engine.stats["heal"].triggers == 1
            (preview,) = engine.preview(snap(holder, system, devices=(broken(0),)))
            assert preview.status == "waiting" and "held by 2 process(es)" in preview.reason
            assert preview.pids == ()
            # the holders gone, the device is reset
            assert [o.subject_key for o in resets(engine.evaluate(snap(devices=(broken(0),)), False))] == ["GPU-0"]
        else:
            (order,) = resets(events)
            assert order.force and sorted(t.pid for t in order.holders) == [500, 600]


def test_dry_run_orders_nothing_real_and_keeps_its_own_counts() -> None:
    clock = FakeTime()
    engine = engine_for(policy(cooldown="1m"), clock)
    devices = (broken(0),)
    engine.evaluate(snap(devices=devices), True)
    clock.now += 10
    (order,) = resets(engine.evaluate(snap(devices=devices), True))
    assert order.dry_run and engine.resetting == set() and engine.stats["heal"].would_reset == 1
    clock.now += 1
    assert resets(engine.evaluate(snap(devices=devices), True)) == [], "the dry run's cooldown"
    (real,) = resets(engine.evaluate(snap(devices=devices), False))  # dry run off: the real count is empty
    assert not real.dry_run
    done = report.would_reset(order, "host", 0.0)
    assert done.entries[0].signal.outcome == "would-reset" and done.entries[0].signal.pid == 0
    assert done.entries[0].journal.fields["rule"] == "heal"


def test_test_policies_previews_a_reset_without_ordering_it() -> None:
    clock = FakeTime()
    engine = engine_for(policy(), clock)
    (preview,) = engine.preview(snap(devices=(broken(0), dev(1))))
    assert (preview.action, preview.status, preview.wait, preview.subject) == (
        "reset",
        "waiting",
        10.0,
        "GPU 0 (GPU-0)",
    )
    assert engine.resets == {} and engine.stats["heal"].triggers == 0


def test_lost_devices_and_recovery_actions() -> None:
    """A rule on the device's health sees lost devices; recovery_action reads what the backend wrote."""
    assert recovery_action(XID) == "GPU reset" and recovery_action("Xid 13") is None
    clock = FakeTime()
    lost = policy(extra="").rules[0]
    text = (
        "rules:\n  - name: lost\n    scope: per_device\n    action: reset\n    conditions:\n"
        "      - {type: device_state, operator: in, value: [lost]}\n"
        "  - name: xid\n    scope: per_device\n    action: log\n    conditions:\n"
        "      - {type: recovery_action, operator: ==, value: GPU reset}\n"
        "  - name: hot\n    scope: per_device\n    action: log\n    conditions:\n"
        "      - {type: temperature, operator: '>', value: -100}\n"
    )
    engine = engine_for(load_texts([("p.yaml", text)]), clock)
    events = engine.evaluate(snap(devices=(broken(0, "lost", "NVML: GPU is lost"), broken(1), dev(2))), False)
    assert [o.subject_key for o in resets(events)] == ["GPU-0"]
    held = sorted((e.rule.name, e.subject_key) for e in events if isinstance(e, Violation))
    assert held == [("hot", "GPU-1"), ("hot", "GPU-2"), ("lost", "GPU-0"), ("xid", "GPU-1")]
    assert lost.cooldown == 60.0


def test_a_reset_is_reported_with_its_rule() -> None:
    clock = FakeTime()
    engine = engine_for(policy(force=True), clock)
    engine.evaluate(snap(proc(500), devices=(broken(0),)), False)
    clock.now += 10
    (order,) = resets(engine.evaluate(snap(proc(500), devices=(broken(0),)), False))
    done = report.reset_done(order, Outcome.RESET, "simulated reset of GPU-0 done (reset #1)", (500,), "h", 0.0)
    (entry,) = done.entries
    assert entry.journal.fields["rule"] == "heal" and entry.journal.fields["killed"] == "500"
    assert entry.journal.message.startswith("Guard rule heal: GPU 0 (GPU-0) reset: simulated reset")
    assert (entry.signal.action, entry.signal.pid, entry.signal.outcome) == ("reset", 0, "reset")
    failed = report.reset_done(order, "device-busy", "1 process(es) use the device", (), "h", 0.0)
    assert "not reset: 1 process(es) use the device" in failed.entries[0].journal.message
