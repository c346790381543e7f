"""What `guard test`, `guard status` and top say about a rule with windows, on the shipped reclaim-idle policy
(examples/guard.d/reclaim-idle.yaml) as it is, with an injected clock: a subject is "will kill in T" only
when every condition holds now and only time is left; a busy holder, whose mean is above the threshold, is
watched and not met, with its mean, and is in no window or grace that status and top show.
The daemon tests (test_guard_reclaim.py) show the same through the bus and the CLI."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from helpers.guard_inputs import OWN_PID, FakeTime, GiB, proc, snap
from helpers.testbed import REPO

from gpukill.policy import load_paths, load_texts
from gpukill.records.base import from_plain
from gpukill.records.guard import Decision, GuardStatus, RecentEvent, Window
from gpukillctl.cli.guard import _decision_row, _status, _when
from gpukillctl.top.model import GuardMarks
from gpukilld.access.visibility import HIDDEN, Viewer
from gpukilld.bus.guard import visible_decisions
from gpukilld.guard.engine import Engine, KillOrder

RECLAIM = REPO / "examples" / "guard.d" / "reclaim-idle.yaml"
RULE = "reclaim-idle-gpus"
MiB = 1 << 20


def reclaim(t: FakeTime) -> Engine:
    return Engine(load_paths([str(RECLAIM)]), t.clock(), own_pid=OWN_PID)


def run(e: Engine, t: FakeTime, seconds: int, *procs) -> None:
    """Evaluate now and once a minute after, enforcing, for `seconds`."""
    assert e.evaluate(snap(*procs), False) == []
    for _ in range(seconds // 60):
        t.now += 60
        assert e.evaluate(snap(*procs), False) == []


TRAINER = proc(10, "train", mem=30 * GiB, util=87)
IDLE = proc(11, "notebook", mem=4 * GiB, util=5, device=1)


def an_hour_in() -> Engine:
    """reclaim-idle after an hour of a trainer at 87% and an idle holder at 5%."""
    t = FakeTime()
    e = reclaim(t)
    run(e, t, 3600, TRAINER, IDLE)
    return e


def test_a_busy_holder_is_watched_not_met_with_its_mean_and_an_idle_one_will_be_killed_in_human_time():
    previews = {p.subject: p for p in an_hour_in().preview(snap(TRAINER, IDLE))}
    busy = previews["PID 10 (train, user alice)"]
    assert busy.status == "not-met" and busy.pids == () and busy.wait == 0
    assert busy.reason == "not met: gpu_utilization < 15% on average over 2h (mean 87%)"
    still = previews["PID 11 (notebook, user alice)"]
    # an hour of the two-hour windows left, then the 30-minute grace
    assert still.status == "waiting" and still.pids == (11,) and still.wait == 3600 + 1800
    assert "mean 5%" in still.reason
    when = _decision_row(
        from_plain(
            Decision,
            {
                "rule": RULE,
                "subject": still.subject,
                "action": "kill",
                "status": still.status,
                "wait": still.wait,
                "pids": [11],
            },
        )
    )
    assert when[2:4] == ["kill 11", "in 1h 30min"]


def test_a_momentary_burst_does_not_hide_an_idle_mean_nor_a_quiet_moment_make_a_trainer_a_victim():
    now = snap(proc(10, "train", mem=30 * GiB, util=0), proc(11, "notebook", mem=4 * GiB, util=100, device=1))
    previews = {p.subject: p for p in an_hour_in().preview(now)}
    assert previews["PID 10 (train, user alice)"].status == "not-met"  # its mean is the mean, not this instant
    assert previews["PID 11 (notebook, user alice)"].status == "waiting"
    assert previews["PID 11 (notebook, user alice)"].wait == 3600 + 1800


def test_an_instant_value_that_fails_a_windowed_condition_is_not_met_with_its_value():
    t = FakeTime()
    e = reclaim(t)
    small = proc(12, "probe", mem=100 * MiB, util=0)
    run(e, t, 600, small)
    (p,) = e.preview(snap(small))
    assert p.status == "not-met" and p.reason == "not met: gpu_memory > 256MiB for 2h (now 100.0 MiB)"
    busy_small = proc(13, "probe", mem=100 * MiB, util=90)  # nothing of the rule holds: not watched, not listed
    assert [x.subject for x in e.preview(snap(small, busy_small))] == ["PID 12 (probe, user alice)"]


def test_a_policy_tested_as_if_loaded_now_judges_the_mean_by_the_value_now():
    t = FakeTime()
    fresh = reclaim(t)  # TestPolicies with a policy sent: no samples yet
    previews = {p.subject: p for p in fresh.preview(snap(TRAINER, IDLE))}
    assert previews["PID 10 (train, user alice)"].status == "not-met"
    assert previews["PID 10 (train, user alice)"].reason.endswith("(mean 87%)")
    assert previews["PID 11 (notebook, user alice)"].wait == 7200 + 1800


def test_status_and_top_show_only_subjects_whose_conditions_hold_now():
    t = FakeTime()
    e = reclaim(t)
    run(e, t, 600, TRAINER, IDLE)
    windows = e.windows_report()
    assert {w["subject"] for w in windows} == {"PID 11 (notebook, user alice)"}
    assert sorted(w["condition"] for w in windows) == [
        "gpu_memory > 256MiB for 2h",
        "gpu_utilization < 15% on average over 2h",
    ]
    status = GuardStatus(
        enabled=True,
        dry_run=False,
        policy_dry_run=False,
        source="files",
        windows=tuple(from_plain(Window, w) for w in windows),
    )
    marks = GuardMarks.of(status)
    assert set(marks.by_pid) == {11}


def test_match_any_keeps_every_window_it_may_act_on():
    t = FakeTime()
    e = Engine(
        load_texts(
            [
                (
                    "any.yaml",
                    "rules:\n  - name: any\n    match: any\n    action: log\n"
                    "    conditions:\n"
                    "      - {type: gpu_memory, operator: '>', value: 1GiB, duration: 1h}\n"
                    "      - {type: gpu_utilization, operator: '>', value: 90, duration: 1h}\n",
                )
            ]
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    run(e, t, 120, proc(10, mem=4 * GiB, util=5))
    assert [w["condition"] for w in e.windows_report()] == ["gpu_memory > 1GiB for 1h"]
    (p,) = e.preview(snap(proc(10, mem=4 * GiB, util=5)))
    assert p.status == "waiting" and p.wait == 3600 - 120


def test_guard_status_prints_a_folded_recent_event_with_its_count_and_first_time(capsys):
    folded = RecentEvent(1.7e9 + 120, RULE, "user alice", 1000, "violation", "kill", "", None, True, 3, 1.7e9)

    class Client:
        async def guard_status(self) -> GuardStatus:
            return GuardStatus(enabled=True, dry_run=True, policy_dry_run=False, source="files", recent=(folded,))

    assert asyncio.run(_status(Client(), argparse.Namespace(json=False))) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "user alice" in x]
    assert line == [f"  {_when(1.7e9 + 120)}  {RULE}: user alice: violation (dry run) (×3 since {_when(1.7e9)})"]


def test_where_other_users_processes_are_hidden_their_not_met_subjects_are_too():
    bob = proc(20, "train", mem=30 * GiB, util=87, uid=1001, user="bob")
    previews = [dataclasses.asdict(p) for p in an_hour_in().preview(snap(TRAINER, IDLE, bob))]
    assert sorted((d["subject"], d["status"]) for d in previews) == [
        ("PID 10 (train, user alice)", "not-met"),
        ("PID 11 (notebook, user alice)", "waiting"),
        ("PID 20 (train, user bob)", "not-met"),
    ]
    seen = visible_decisions(previews, snap(TRAINER, IDLE, bob), Viewer(1000, HIDDEN))
    assert sorted(d["subject"] for d in seen) == ["PID 10 (train, user alice)", "PID 11 (notebook, user alice)"]


def test_the_preview_says_when_the_engine_kills_through_window_grace_flight_and_cooldown():
    """At every step the preview's status and wait (act_wait, engine.py) say what evaluate then does: nothing
    while the window, the grace, the kill in flight and the cooldown run, a kill the moment it says "now"."""
    t = FakeTime()
    e = Engine(
        load_texts(
            [
                (
                    "p.yaml",
                    "cooldown: 40s\nrules:\n  - name: hog\n    action: kill\n"
                    "    grace_period: 30s\n    conditions:\n"
                    "      - {type: gpu_memory, operator: '>', value: 1GiB, duration: 20s}\n",
                )
            ]
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    s = snap(proc(10, "hog", mem=2 * GiB, util=50))
    kills, predicted = [], None
    for _ in range(30):
        (p,) = e.preview(s)
        if predicted is None and p.status == "waiting":
            predicted = t.now + p.wait
        orders = [ev for ev in e.evaluate(s, False) if isinstance(ev, KillOrder)]
        assert (p.status == "now") == bool(orders), (t.now, p)
        for order in orders:
            assert t.now == predicted, "the kill comes when the preview said it would"
            kills.append(t.now)
            (after,) = e.preview(s)
            assert after.status == "in-flight"
            e.kill_finished(order, order.targets[0], "still-alive")  # survived: the cooldown starts
            predicted = None
        t.now += 5
    first = 1000.0 + 20 + 30  # the window, then the grace
    assert kills == [first, first + 40, first + 80]  # then once a cooldown, each from the kill's answer
