"""The guard's state machine with an injected clock: durations, AND by default, grace, per-user largest-first,
cooldown, the per-cycle cap, kills in flight, exemptions, protection of system accounts and units, usage
charged to no one, dry run and previews. No waiting, no processes:
the daemon tests (test_guard_daemon.py) show the same on real processes."""

from __future__ import annotations

from helpers.cpu_time import cpu_time
from helpers.guard_inputs import OWN_PID, FakeGroups, FakeTime, GiB, dev, proc, snap
from helpers.testbed import REPO

from gpukill.policy import PolicyError, load_paths, load_texts
from gpukill.procstat import CLK_TCK
from gpukilld.guard import clocks
from gpukilld.guard.conditions import Protection
from gpukilld.guard.engine import PROTECTED, Engine, GraceCancelled, KillOrder, KillOverCap, Left, Violation
from gpukilld.model import Snapshot


def policy(text: str):
    return load_texts([("test.yaml", text)])


def first_policy():
    return load_paths([str(REPO / "tests" / "guard_policies" / "first-policy.yaml")])


def kinds(events) -> list[str]:
    return [type(e).__name__ for e in events]


def step(engine: Engine, t: FakeTime, snapshot: Snapshot, seconds: float, dry_run: bool = False) -> list:
    t.now += seconds
    return engine.evaluate(snapshot, dry_run)


def test_duration_holds_only_after_being_true_that_long_and_restarts_when_false():
    t = FakeTime()
    e = Engine(first_policy(), t.clock(), own_pid=OWN_PID)
    busy = snap(proc(10, "xmrig", util=99))
    idle = snap(proc(10, "xmrig", util=20))
    assert e.evaluate(busy, False) == []
    assert step(e, t, busy, 299) == []  # 4m59s: not yet
    assert e.windows_report()[0]["elapsed"] == 299
    assert step(e, t, idle, 0.5) == []  # dropped under: the window is gone
    assert e.windows_report() == []
    assert step(e, t, busy, 0.5) == []
    assert step(e, t, busy, 299.9) == []
    events = step(e, t, busy, 0.1)  # 5 minutes continuously
    assert kinds(events) == ["Violation", "KillOrder"]
    order = events[1]
    assert order.targets[0].pid == 10 and order.force and order.kill_grace == 5.0
    assert order.rule.name == "block-crypto-miners"


def test_conditions_combine_with_and():
    t = FakeTime()
    e = Engine(first_policy(), t.clock(), own_pid=OWN_PID)
    s = snap(proc(10, "python", util=99), proc(11, "xmrig", util=50), proc(12, "cpuminer-opt", util=100, device=1))
    e.evaluate(s, False)
    events = step(e, t, s, 301)
    assert [ev.targets[0].pid for ev in events if isinstance(ev, KillOrder)] == [12]  # name AND load, nothing else


def test_match_any():
    t = FakeTime()
    e = Engine(
        policy(
            "rules:\n  - name: any\n    match: any\n    action: notify\n    notify: [journal]\n"
            "    conditions:\n      - {type: process_name, operator: ==, value: xmrig}\n"
            "      - {type: gpu_utilization, operator: '>', value: 95, duration: 1m}\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    s = snap(proc(10, "xmrig", util=1), proc(11, "python", util=99), proc(12, "python", util=10))
    assert [ev.subject for ev in e.evaluate(s, False)] == ["PID 10 (xmrig, user alice)"]
    assert [ev.subject for ev in step(e, t, s, 60)] == ["PID 11 (python, user alice)"]
    assert step(e, t, s, 60) == []  # one violation per episode, not one per cycle


def test_grace_period_then_kill_largest_first_only_until_under():
    t = FakeTime()
    e = Engine(first_policy(), t.clock(), own_pid=OWN_PID)
    s = snap(
        proc(10, mem=5 * GiB),
        proc(11, mem=4 * GiB, device=1),
        proc(12, mem=1 * GiB, device=2),
        proc(20, mem=7 * GiB, uid=1001, user="bob"),
    )
    events = e.evaluate(s, False)
    assert kinds(events) == ["Violation"]
    v = events[0]
    assert v.subject == "user alice" and v.uid == 1000 and [x.pid for x in v.targets] == [10]
    assert "10.0 GiB" in v.reason
    assert e.grace_report()[0]["remaining"] == 30
    assert step(e, t, s, 29.9) == []  # not before the grace ends
    events = step(e, t, s, 0.1)
    assert kinds(events) == ["KillOrder"]
    assert [x.pid for x in events[0].targets] == [10]  # 10 GiB - 5 GiB = 5 GiB: under, so only the largest
    assert not events[0].force


def test_per_user_kills_several_when_one_is_not_enough():
    t = FakeTime()
    e = Engine(
        policy(
            "rules:\n  - name: cap\n    scope: per_user\n    action: kill\n"
            "    conditions: [{type: user_memory, operator: '>', value: 3GiB}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    events = e.evaluate(snap(proc(10, mem=2 * GiB), proc(11, mem=5 * GiB), proc(12, mem=4 * GiB)), False)
    order = next(ev for ev in events if isinstance(ev, KillOrder))
    assert [x.pid for x in order.targets] == [11, 12]  # 11 GiB -> 6 GiB -> 2 GiB <= 3 GiB


def test_coming_back_under_during_the_grace_cancels():
    t = FakeTime()
    e = Engine(first_policy(), t.clock(), own_pid=OWN_PID)
    over = snap(proc(10, mem=5 * GiB), proc(11, mem=4 * GiB))
    under = snap(proc(10, mem=5 * GiB))
    e.evaluate(over, False)
    events = step(e, t, under, 10)
    assert kinds(events) == ["GraceCancelled"] and events[0].subject == "user alice"
    assert step(e, t, under, 60) == []
    assert e.stats["limit-user-memory"].cancelled == 1 and e.stats["limit-user-memory"].triggers == 1
    # over again later: a new violation and a new full grace period
    assert kinds(step(e, t, over, 1)) == ["Violation"]
    assert step(e, t, over, 29) == []
    assert kinds(step(e, t, over, 1)) == ["KillOrder"]


def test_no_second_kill_while_one_is_in_flight_then_cooldown():
    t = FakeTime()
    e = Engine(
        policy(
            "cooldown: 20s\nrules:\n  - name: cap\n    scope: per_user\n    action: kill\n"
            "    conditions: [{type: user_memory, operator: '>', value: 3GiB}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    s = snap(proc(10, mem=5 * GiB), proc(11, mem=1 * GiB))
    order = next(ev for ev in e.evaluate(s, False) if isinstance(ev, KillOrder))
    assert [x.pid for x in order.targets] == [10]
    for _ in range(5):  # the kill is slow (grace of SIGTERM): the next snapshots still show the process
        assert step(e, t, s, 1) == []
    e.kill_finished(order, order.targets[0], "still-alive")  # it survived SIGTERM (no force)
    assert step(e, t, s, 19) == []  # cooldown
    events = step(e, t, s, 1)
    assert kinds(events) == ["KillOrder"] and events[0].targets[0].pid == 10  # tried again after the cooldown
    assert e.stats["cap"].kills == 1


def test_cap_on_kills_per_cycle():
    t = FakeTime()
    e = Engine(
        policy(
            "max_kills_per_cycle: 2\nrules:\n  - name: miners\n    action: kill\n"
            "    conditions: [{type: process_name, operator: ==, value: xmrig}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    s = snap(*(proc(10 + i, "xmrig") for i in range(5)))
    first = [x.pid for ev in e.evaluate(s, False) if isinstance(ev, KillOrder) for x in ev.targets]
    second = [x.pid for ev in step(e, t, s, 1) if isinstance(ev, KillOrder) for x in ev.targets]
    third = [x.pid for ev in step(e, t, s, 1) if isinstance(ev, KillOrder) for x in ev.targets]
    assert len(first) == 2 and len(second) == 2 and len(third) == 1
    assert sorted(first + second + third) == [10, 11, 12, 13, 14]


def test_exempt_and_protected_processes_are_never_touched():
    t = FakeTime()
    groups = FakeGroups({1002: {"research", "1002"}})
    text = (
        "exemptions: {users: [root]}\nrules:\n  - name: miners\n    action: kill\n"
        "    exemptions: {groups: [research], units: ['slurm*.scope'], processes: ['xmrig-ok*']}\n"
        "    conditions: [{type: process_name, operator: contains_any, value: [xmrig]}]\n"
    )
    e = Engine(load_texts([("p.yaml", text)]), t.clock(), groups=groups, own_pid=OWN_PID)
    s = snap(
        proc(1, "xmrig"),
        proc(OWN_PID, "xmrig"),
        proc(10, "xmrig", uid=0, user="root"),
        proc(11, "xmrig", uid=1002, user="carol"),
        proc(12, "xmrig", unit="slurm-42.scope"),
        proc(13, "xmrig-ok-bench"),
        proc(14, "xmrig"),
    )
    killed = [x.pid for ev in e.evaluate(s, False) if isinstance(ev, KillOrder) for x in ev.targets]
    assert killed == [14]
    exempt = {p.pids[0] for p in e.preview(s) if p.status == "exempt"}
    assert exempt == {1, OWN_PID, 10, 11, 12, 13}


def test_refused_by_the_kill_path_is_not_retried():
    t = FakeTime()
    e = Engine(
        policy(
            "cooldown: 1s\nrules:\n  - name: miners\n    action: kill\n"
            "    conditions: [{type: process_name, operator: ==, value: xmrig}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    s = snap(proc(10, "xmrig"))
    order = next(ev for ev in e.evaluate(s, False) if isinstance(ev, KillOrder))
    e.kill_finished(order, order.targets[0], "protected")
    assert [ev for ev in step(e, t, s, 5) if isinstance(ev, KillOrder)] == []
    assert e.stats["miners"].failed == 1


def test_dry_run_orders_nothing_in_flight_and_one_would_kill_per_episode():
    t = FakeTime()
    e = Engine(
        policy(
            "cooldown: 10s\nrules:\n  - name: miners\n    action: kill\n"
            "    conditions: [{type: process_name, operator: ==, value: xmrig}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    s = snap(proc(10, "xmrig"))
    events = e.evaluate(s, True)
    assert kinds(events) == ["Violation", "KillOrder"] and events[1].dry_run
    assert e.busy == set()  # nothing will report back: a dry run never reaches the kill path
    later = [ev for _ in range(60) for ev in step(e, t, s, 1, dry_run=True)]  # a minute, six cooldowns
    assert later == [], "one would-kill for the episode, not one per cooldown"
    assert e.stats["miners"].would_kill == 1 and e.stats["miners"].kills == 0
    real = step(e, t, s, 1, dry_run=False)  # dry run switched off: the would-kill does not hold it back
    assert kinds(real) == ["KillOrder"] and not real[0].dry_run and e.busy == {(10, 100)}


def test_a_dry_run_says_when_a_subject_leaves_and_why_then_announces_a_new_episode():
    t = FakeTime()
    e = Engine(
        policy(
            "cooldown: 10s\nrules:\n  - name: busy\n    action: kill\n"
            "    conditions: [{type: gpu_utilization, operator: '>', value: 90, duration: 5s}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    busy, calm = snap(proc(10, util=99)), snap(proc(10, util=20))
    e.evaluate(busy, True)
    assert kinds(step(e, t, busy, 5, dry_run=True)) == ["Violation", "KillOrder"]
    assert [ev for _ in range(30) for ev in step(e, t, busy, 1, dry_run=True)] == []
    (left,) = step(e, t, calm, 1, dry_run=True)
    assert isinstance(left, Left) and left.subject == "PID 10 (python, user alice)"
    assert left.why == "no longer holds: gpu_utilization > 90% for 5s (now 20%)"
    step(e, t, busy, 1, dry_run=True)
    assert kinds(step(e, t, busy, 5, dry_run=True)) == ["Violation", "KillOrder"]  # a new episode, announced
    (gone,) = step(e, t, snap(), 1, dry_run=True)
    assert isinstance(gone, Left) and gone.why.startswith("gone")
    assert step(e, t, snap(), 1, dry_run=False) == []  # enforcing: an episode's end says nothing new


def test_a_dry_runs_episode_survives_a_reload_and_a_restart_without_a_second_would_kill():
    t = FakeTime()
    text = (
        "cooldown: 10s\nrules:\n  - name: miners\n    action: kill\n"
        "    conditions: [{type: process_name, operator: ==, value: xmrig}]\n"
    )
    e = Engine(policy(text), t.clock(), own_pid=OWN_PID)
    s = snap(proc(10, "xmrig"))
    assert kinds(e.evaluate(s, True)) == ["Violation", "KillOrder"]
    e.set_policy(policy(text))  # an unchanged rule keeps its episode
    assert [ev for _ in range(20) for ev in step(e, t, s, 1, dry_run=True)] == []
    e2 = Engine(policy(text), t.clock(), own_pid=OWN_PID)
    restored, _ = clocks.restore(e2, clocks.save(e, "boot"), "boot", lambda pid, start: True)
    assert restored >= 1
    assert [ev for _ in range(20) for ev in step(e2, t, s, 1, dry_run=True)] == []


def test_per_device_rules():
    t = FakeTime()
    e = Engine(
        policy(
            "rules:\n  - name: full\n    scope: per_device\n    action: kill\n    conditions:\n"
            "      - {type: device_memory, operator: '>', value: '90%'}\n"
            "      - {type: user, operator: '!=', value: root}\n"
            "  - name: hot\n    scope: per_device\n    action: log\n"
            "    conditions: [{type: temperature, operator: '>=', value: 85, duration: 30s}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    devices = (dev(0, used=78 * GiB, temperature=90.0), dev(1, used=10 * GiB, temperature=None))
    s = snap(
        proc(10, mem=40 * GiB),
        proc(11, mem=30 * GiB),
        proc(12, mem=8 * GiB, uid=0, user="root"),
        proc(13, mem=10 * GiB, device=1),
        devices=devices,
    )
    events = e.evaluate(s, False)
    order = next(ev for ev in events if isinstance(ev, KillOrder))
    assert order.subject == "GPU 0 (GPU-0)" and [x.pid for x in order.targets] == [10]  # root's is not selected
    hot = [ev for ev in step(e, t, s, 30) if isinstance(ev, Violation)]
    assert [ev.subject for ev in hot] == ["GPU 0 (GPU-0)"]  # GPU 1's temperature is unknown: never "hot"


def test_unknown_values_never_make_a_condition_true():
    t = FakeTime()
    e = Engine(
        policy(
            "rules:\n  - name: small\n    action: log\n"
            "    conditions: [{type: gpu_memory, operator: '<', value: 1GiB}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    assert e.evaluate(snap(proc(10, mem=None), proc(11, mem=1024)), False)[0].subject.startswith("PID 11")


def test_a_process_on_two_gpus_is_one_subject_with_its_memory_summed():
    t = FakeTime()
    e = Engine(
        policy(
            "rules:\n  - name: big\n    action: kill\n"
            "    conditions: [{type: gpu_memory, operator: '>', value: 6GiB}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    events = e.evaluate(snap(proc(10, mem=4 * GiB, device=0), proc(10, mem=4 * GiB, device=1)), False)
    assert kinds(events) == ["Violation", "KillOrder"] and len(events[1].targets) == 1


def test_runtime_cmdline_and_group_conditions():
    t = FakeTime(now=10_000.0)
    groups = FakeGroups({1000: {"students"}})
    e = Engine(
        load_texts(
            [
                (
                    "p.yaml",
                    "rules:\n  - name: long\n    action: log\n    conditions:\n"
                    "      - {type: runtime, operator: '>', value: 1h}\n"
                    "      - {type: group, operator: ==, value: students}\n"
                    "      - {type: cmdline, operator: matches, value: '--epochs[= ]1000'}\n",
                )
            ]
        ),
        t.clock(),
        groups=groups,
        own_pid=OWN_PID,
    )
    started_two_hours_ago = int((10_000 - 7200) * CLK_TCK)
    started_now = int(10_000 * CLK_TCK)
    s = snap(
        proc(10, cmdline="python train.py --epochs 1000", start=started_two_hours_ago),
        proc(11, cmdline="python train.py --epochs 1000", start=started_now),
        proc(12, cmdline="python train.py --epochs 1000", start=started_two_hours_ago, uid=1001, user="bob"),
        proc(13, cmdline="python train.py --epochs 10", start=started_two_hours_ago),
    )
    assert [ev.subject for ev in e.evaluate(s, False)] == ["PID 10 (python, user alice)"]


def test_an_unchanged_rule_keeps_its_window_across_a_reload():
    t = FakeTime()
    e = Engine(first_policy(), t.clock(), own_pid=OWN_PID)
    s = snap(proc(10, "xmrig", util=99))
    e.evaluate(s, False)
    step(e, t, s, 200)
    e.set_policy(first_policy())  # the same files read again (SIGHUP)
    assert kinds(step(e, t, s, 100)) == ["Violation", "KillOrder"]
    changed = load_texts(
        [("p.yaml", (REPO / "tests/guard_policies/first-policy.yaml").read_text().replace("95", "90"))]
    )
    e2 = Engine(first_policy(), t.clock(), own_pid=OWN_PID)
    e2.evaluate(s, False)
    step(e2, t, s, 200)
    e2.set_policy(changed)  # a changed rule starts over
    assert step(e2, t, s, 100) == []


def test_preview_reports_and_changes_nothing():
    t = FakeTime()
    e = Engine(first_policy(), t.clock(), own_pid=OWN_PID)
    s = snap(proc(10, "xmrig", util=99), proc(11, mem=5 * GiB), proc(12, mem=4 * GiB, device=1))
    e.evaluate(s, False)
    t.now += 120
    before = (e.windows_report(), e.grace_report(), {k: v.to_dict() for k, v in e.stats.items()})
    previews = {p.rule: p for p in e.preview(s)}
    assert before == (e.windows_report(), e.grace_report(), {k: v.to_dict() for k, v in e.stats.items()})
    miners = previews["block-crypto-miners"]
    assert miners.status == "waiting" and miners.wait == 180 and miners.pids == (10,)
    memory = previews["limit-user-memory"]
    assert memory.status == "now" and memory.pids == (11,)  # its 30 s grace ran out while we waited
    fresh = Engine(first_policy(), t.clock(), own_pid=OWN_PID)  # as TestPolicies with a new policy
    assert {p.rule: p.wait for p in fresh.preview(s)} == {"block-crypto-miners": 300, "limit-user-memory": 30}


def test_grace_cancelled_event_type():
    t = FakeTime()
    e = Engine(first_policy(), t.clock(), own_pid=OWN_PID)
    e.evaluate(snap(proc(10, mem=9 * GiB)), False)
    events = step(e, t, snap(), 1)
    assert isinstance(events[0], GraceCancelled) and events[0].uid == 1000


def test_a_process_renamed_since_the_last_cycle_is_judged_by_its_new_name():
    """Views are reused from cycle to cycle: every field must follow the snapshot (exec, prctl, cgroups)."""
    t = FakeTime()
    e = Engine(
        policy(
            "rules:\n  - name: miners\n    action: kill\n"
            "    conditions: [{type: process_name, operator: ==, value: xmrig}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    assert e.evaluate(snap(proc(10, "python", mem=GiB)), False) == []
    events = step(e, t, snap(proc(10, "xmrig", mem=2 * GiB)), 1)
    assert kinds(events) == ["Violation", "KillOrder"] and events[1].targets[0].gpu_memory == 2 * GiB


def test_choosing_victims_among_thousands_stays_cheap():
    """A user with 5,000 processes far over the limit: choosing largest-first must not copy lists per pick."""
    t = FakeTime()
    e = Engine(
        policy(
            "rules:\n  - name: cap\n    scope: per_user\n    action: kill\n"
            "    conditions: [{type: user_memory, operator: '>', value: 1GiB}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    s = snap(*(proc(10 + i, mem=GiB + i, device=i % 4) for i in range(5000)))
    with cpu_time() as took:
        order = next(ev for ev in e.evaluate(s, False) if isinstance(ev, KillOrder))
    assert took.seconds < 1.5, took.seconds
    assert [x.pid for x in order.targets] == [10 + 4999 - i for i in range(10)]  # largest first, capped at 10


# -- protection ------------------------------------------------------------------------------------------------

MINERS_NOW = (
    "rules:\n  - name: miners\n    action: kill\n    conditions: [{type: process_name, operator: ==, value: xmrig}]\n"
)
USER_CAP = (
    "rules:\n  - name: cap\n    scope: per_user\n    action: kill\n"
    "    conditions: [{type: user_memory, operator: '>', value: 8GiB}]\n"
)


def killed(events) -> list[int]:
    return [x.pid for ev in events if isinstance(ev, KillOrder) for x in ev.targets]


def test_system_accounts_and_system_units_are_never_touched_and_say_so_in_previews():
    t = FakeTime()
    e = Engine(policy(MINERS_NOW), t.clock(), own_pid=OWN_PID)  # the default protection: uid <= 999, the units
    s = snap(
        proc(10, "xmrig", uid=0, user="root"),
        proc(11, "xmrig", uid=100, user="messagebus"),
        proc(12, "xmrig", uid=999, user="sysacct"),
        proc(13, "xmrig", uid=1005, user="svc", unit="dbus.service", system_unit="dbus.service"),
        proc(14, "xmrig", uid=1005, user="svc", unit="worker.service", system_unit="getty@tty1.service"),
        # a cgroup named dbus.service in gpkowner's delegated subtree: its innermost unit, not a system unit
        proc(15, "xmrig", uid=1000, unit="dbus.service"),
        proc(16, "xmrig", uid=1000, system_unit="cron.service"),  # a system unit, but not a protected one
        proc(17, "xmrig", uid=1000),
    )
    previews = {p.pids[0]: p for p in e.preview(s)}  # TestPolicies: what it would do, and what it may not touch
    assert {pid for pid, p in previews.items() if p.status == "exempt"} == {10, 11, 12, 13, 14}
    assert all(previews[pid].reason == PROTECTED for pid in (10, 11, 12, 13, 14))
    assert [previews[pid].status for pid in (15, 16, 17)] == ["now"] * 3
    assert killed(e.evaluate(s, False)) == [15, 16, 17]


def test_protected_processes_do_not_count_in_a_users_sum_nor_become_a_devices_victims():
    t = FakeTime()
    text = USER_CAP + (
        "  - name: full\n    scope: per_device\n    action: kill\n"
        "    conditions: [{type: device_memory, operator: '>', value: '90%'}]\n"
    )
    s = snap(
        proc(10, mem=6 * GiB, system_unit="systemd-foo.service"),  # alice's, in a protected system unit
        proc(11, mem=4 * GiB, device=1),
        proc(20, mem=60 * GiB, uid=0, user="root"),
        proc(21, mem=10 * GiB, uid=1001, user="bob", device=1),
        devices=(dev(0, used=78 * GiB), dev(1, used=74 * GiB)),
    )
    e = Engine(policy(text), t.clock(), own_pid=OWN_PID)
    events = e.evaluate(s, False)
    # alice: 4 GiB counted, not 10. GPU 0 is over 90% only through root's 60 GiB: nothing there may go.
    assert [ev.subject for ev in events if isinstance(ev, Violation)] == ["user bob", "GPU 0 (GPU-0)", "GPU 1 (GPU-1)"]
    assert killed(events) == [21]  # bob's, for the user rule; GPU 1 is then back under (64 of 80 GiB)
    unprotected = Engine(policy(text), t.clock(), own_pid=OWN_PID, protection=Protection(None, ()))
    assert killed(unprotected.evaluate(s, False)) == [10, 20, 21]  # alice at 10 GiB; root at 60 GiB


def test_protection_is_configurable():
    t = FakeTime()
    s = snap(proc(10, "xmrig", uid=0, user="root"), proc(11, "xmrig", uid=1005, system_unit="dbus.service"))
    off = Engine(policy(MINERS_NOW), t.clock(), own_pid=OWN_PID, protection=Protection(None, ()))
    assert killed(off.evaluate(s, False)) == [10, 11]
    units_only = Engine(policy(MINERS_NOW), t.clock(), own_pid=OWN_PID, protection=Protection(None, ("dbus.*",)))
    assert killed(units_only.evaluate(s, False)) == [10]
    on = Engine(policy(MINERS_NOW), t.clock(), own_pid=OWN_PID)
    assert killed(on.evaluate(s, False)) == []
    on.protection = Protection(None, ())  # a reload of gpukilld.conf: the next evaluation sees it
    assert killed(step(on, t, s, 1)) == [10, 11]


def test_root_in_a_container_is_a_workload_not_a_system_account():
    t = FakeTime()
    e = Engine(policy(MINERS_NOW), t.clock(), own_pid=OWN_PID)
    s = snap(
        proc(10, "xmrig", uid=0, user="root", container="c0ffee" * 10 + "abcd"), proc(11, "xmrig", uid=0, user="root")
    )
    assert killed(e.evaluate(s, False)) == [10]


def test_usage_charged_to_no_one_makes_figures_lower_bounds():
    """A process sharing a DRM context with another user: its own part is known, the shared part is not.
    That can show it is over a limit, never that it is under one."""
    t = FakeTime()
    text = (
        "rules:\n  - name: big\n    action: log\n"
        "    conditions: [{type: gpu_memory, operator: '>', value: 1GiB}]\n"
        "  - name: small\n    action: log\n"
        "    conditions: [{type: gpu_memory, operator: '<', value: 1GiB}]\n"
        "  - name: idle\n    action: log\n"
        "    conditions: [{type: gpu_utilization, operator: '<=', value: 5}]\n"
        "  - name: light-user\n    scope: per_user\n    action: log\n"
        "    conditions: [{type: user_memory, operator: '<', value: 1GiB}]\n"
        "  - name: heavy-user\n    scope: per_user\n    action: log\n"
        "    conditions: [{type: user_memory, operator: '>=', value: 2GiB}]\n"
    )
    e = Engine(policy(text), t.clock(), own_pid=OWN_PID)
    s = snap(
        proc(10, mem=2 * GiB, util=0.0, shared=True),
        proc(11, mem=None, util=None, shared=True, device=1),
        proc(20, mem=GiB // 2, util=0.0, uid=1001, user="bob"),
    )
    got = sorted((ev.rule.name, ev.subject) for ev in e.evaluate(s, False))
    assert got == [
        ("big", "PID 10 (python, user alice)"),
        ("heavy-user", "user alice"),
        ("idle", "PID 20 (python, user bob)"),
        ("light-user", "user bob"),
        ("small", "PID 20 (python, user bob)"),
    ]


def test_a_process_on_two_gpus_is_partial_if_either_record_is():
    t = FakeTime()
    e = Engine(
        policy(
            "rules:\n  - name: small\n    action: log\n"
            "    conditions: [{type: gpu_memory, operator: '<', value: 4GiB}]\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    assert e.evaluate(snap(proc(10, mem=GiB, device=0), proc(10, mem=None, device=1, shared=True)), False) == []
    assert len(step(e, t, snap(proc(10, mem=GiB, device=0), proc(10, mem=GiB, device=1)), 1)) == 1


# -- per_group, not_in, gpu, device_memory_free (gpu-kill's group and GPU policies) ------------------------------

GROUP_CAP = (
    "rules:\n  - name: research\n    scope: per_group\n    action: kill\n    conditions:\n"
    "      - {type: group, operator: in, value: [research, '2000']}\n"
    "      - {type: group_memory, operator: '>', value: 8GiB}\n"
)


def test_per_group_looks_at_the_groups_it_names_and_kills_largest_first_until_under():
    t = FakeTime()
    groups = FakeGroups({1000: {"research", "users"}, 1001: {"research", "users"}, 1002: {"users", "2000"}})
    e = Engine(policy(GROUP_CAP), t.clock(), groups=groups, own_pid=OWN_PID)
    s = snap(
        proc(10, mem=5 * GiB),
        proc(11, mem=2 * GiB, device=1),
        proc(20, mem=4 * GiB, uid=1001, user="bob"),
        proc(30, mem=7 * GiB, uid=1002, user="carol"),
    )
    events = e.evaluate(s, False)
    # research: 11 GiB; the gid 2000: 7 GiB; "users" (18 GiB) is not named, so not looked at
    assert [ev.subject for ev in events if isinstance(ev, Violation)] == ["group research"]
    assert killed(events) == [10]  # 11 - 5 = 6 GiB: under
    assert events[0].uid is None and "counting" not in events[0].reason


def test_per_group_needs_a_group_condition_naming_its_groups():
    for conds, error in [
        (
            "      - {type: group_memory, operator: '>', value: 8GiB}\n",
            "test.yaml:2:5: rule 'g' in scope per_group needs a group condition with == or in naming its group(s)",
        ),
        (
            "      - {type: group, operator: '!=', value: research}\n"
            "      - {type: group_memory, operator: '>', value: 8GiB}\n",
            "test.yaml:2:5: rule 'g' in scope per_group needs a group condition with == or in naming its group(s)",
        ),
    ]:
        text = "rules:\n  - name: g\n    scope: per_group\n    action: kill\n    conditions:\n" + conds
        try:
            policy(text)
        except PolicyError as err:
            assert err.errors == [error]
        else:
            raise AssertionError("accepted")
    text = (
        "rules:\n  - name: g\n    scope: per_group\n    match: any\n    action: log\n    conditions:\n"
        "      - {type: group, operator: ==, value: research}\n"
        "      - {type: group_memory, operator: '>', value: 8GiB}\n"
    )
    try:
        policy(text)
    except PolicyError as err:
        assert err.errors == [
            "test.yaml:4:12: match any is not supported in scope per_group: its group condition "
            "holds for every subject it names"
        ]
    else:
        raise AssertionError("accepted")


def test_not_in_and_the_gpu_condition():
    t = FakeTime()
    groups = FakeGroups({1001: {"staff"}})
    e = Engine(
        policy(
            "rules:\n  - name: others-on-0\n    action: log\n    conditions:\n"
            "      - {type: gpu, operator: ==, value: 0}\n"
            "      - {type: user, operator: not_in, value: [alice, 1003]}\n"
            "      - {type: group, operator: not_in, value: [staff]}\n"
            "      - {type: process_name, operator: not_in, value: [sshd]}\n"
        ),
        t.clock(),
        groups=groups,
        own_pid=OWN_PID,
    )
    s = snap(
        proc(10),
        proc(20, uid=1001, user="bob"),
        proc(30, uid=1002, user="carol", device=1),
        proc(31, uid=1002, user="carol", device=1),
        proc(31, uid=1002, user="carol", device=0),
        proc(32, "sshd", uid=1002, user="carol"),
        proc(40, uid=1003, user="dave"),
    )
    assert [ev.subject for ev in e.evaluate(s, False)] == ["PID 31 (python, user carol)"]


def test_device_memory_free_and_user_processes():
    t = FakeTime()
    e = Engine(
        policy(
            "rules:\n  - name: keep-free\n    scope: per_device\n    action: kill\n    conditions:\n"
            "      - {type: device_memory_free, operator: '<', value: 20GiB}\n"
            "  - name: two-each\n    scope: per_user\n    action: kill\n    conditions:\n"
            "      - {type: user_processes, operator: '>', value: 2}\n"
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    s = snap(
        proc(10, mem=10 * GiB),
        proc(11, mem=30 * GiB),
        proc(20, mem=5 * GiB, uid=1001, user="bob"),
        devices=(dev(0, used=70 * GiB),),
    )  # 10 GiB free of 80
    events = e.evaluate(s, False)
    assert killed(events) == [11]  # 40 GiB free after the largest; alice has 2 processes: not over
    assert events[0].reason == "device_memory_free 10.0 GiB < 20GiB"


def test_a_groups_grace_survives_a_daemon_restart():
    """clocks.py saves a per_group episode under the group's name and gives it back: the grace goes on."""
    from gpukilld.guard import clocks

    t = FakeTime()
    groups = FakeGroups({1000: {"research"}})
    text = GROUP_CAP.replace("    action: kill\n", "    action: kill\n    grace_period: 30s\n")
    s = snap(proc(10, mem=9 * GiB))
    e = Engine(policy(text), t.clock(), groups=groups, own_pid=OWN_PID)
    assert [ev.subject for ev in e.evaluate(s, False)] == ["group research"]
    t.now += 20
    saved = clocks.save(e, "boot")
    again = Engine(policy(text), t.clock(), groups=groups, own_pid=OWN_PID)
    clocks.restore(again, saved, "boot", lambda pid, start: True)
    assert again.grace_report()[0]["remaining"] == 10
    assert killed(step(again, t, s, 10)) == [10]  # no second violation, no new grace


SCOPED = (
    "max_kills_per_cycle: {cap}\nexemptions: {{users: [bob]}}\nrules:\n  - name: trainers\n    action: kill\n"
    "    kill_scope: {scope}\n    exemptions: {{processes: ['ckpt*'], units: ['keep-*.service']}}\n"
    "    conditions: [{{type: process_name, operator: ==, value: trainer}}]\n"
)


def _tree(children: dict[int, list[int]]):
    """A fake /proc tree: each PID's descendants, itself included (every process here starts at tick 100)."""

    def tree(pid: int) -> list[tuple[int, int]]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append((p, 100))
            todo.extend(children.get(p, []))
        return out

    return tree


def test_kill_scope_members_pass_the_checks_their_target_passed():
    """A trainer's tree: a plain worker goes with it; a worker exempt by name (rule), by unit (rule) or by user
    (global), one in a protected system unit, another user's and PID 1 are left running, each with why."""
    t = FakeTime()
    e = Engine(
        policy(SCOPED.format(cap=10, scope="tree")),
        t.clock(),
        groups=FakeGroups({}),
        own_pid=OWN_PID,
        tree=_tree({10: [11, 12, 13, 14, 15, 17, 1]}),
    )
    s = snap(
        proc(10, "trainer"),
        proc(11, "python"),
        proc(12, "ckpt-writer"),
        proc(13, "python", unit="keep-1.service"),
        proc(14, "python", uid=1001, user="bob"),
        proc(15, "python", system_unit="sshd.service"),
        proc(16, "python"),
        proc(17, "python", uid=1002, user="carol"),
        proc(1, "python"),
    )
    (preview,) = [p for p in e.preview(s) if p.rule == "trainers"]
    assert preview.pids == (10, 11) and "left running: PID 1 (python, protected" in preview.reason
    assert "PID 14 (python, exempt: user bob)" in preview.reason
    assert preview.reason_for_others.endswith("; its kill_scope adds 1 process(es), leaves 6 running")
    (order,) = [ev for ev in e.evaluate(s, False) if isinstance(ev, KillOrder)]
    assert [x.pid for x in order.targets] == [10] and order.count == 2
    (scoped,) = order.scoped
    assert [m.pid for m in scoped.members] == [11]
    assert {x.pid: why for x, why in scoped.left} == {
        1: "protected: PID 1 and gpukilld are never touched",
        12: "exempt: process name ckpt-writer",
        13: "exempt: unit keep-1.service",
        14: "exempt: user bob",
        15: "protected: system unit sshd.service",
        17: "another user's process: a Guard rule stops its subject's owner's processes alone",
    }
    assert e.busy == {(10, 100), (11, 100)}  # the members are in flight too: no other rule orders them


def test_kill_scope_unit_members_pass_the_checks_too():
    t = FakeTime()
    e = Engine(policy(SCOPED.format(cap=10, scope="unit")), t.clock(), groups=FakeGroups({}), own_pid=OWN_PID)
    s = snap(
        proc(10, "trainer", unit="train.service"),
        proc(11, "python", unit="train.service"),
        proc(12, "ckpt", unit="train.service"),
        proc(13, "python", unit="other.service"),
    )
    (order,) = [ev for ev in e.evaluate(s, False) if isinstance(ev, KillOrder)]
    assert [m.pid for m in order.scoped[0].members] == [11]
    assert [(x.pid, why) for x, why in order.scoped[0].left] == [(12, "exempt: process name ckpt")]


WORKER_CAP = (
    "rules:\n  - name: cap\n    scope: per_user\n    action: kill\n    grace_period: {grace}\n"
    "    kill_scope: {scope}\n    conditions: [{{type: user_memory, operator: '>', value: 3GiB}}]\n"
)


def test_a_kill_rules_violation_names_what_its_kill_scope_takes_with_each_victim():
    """A per_user rule's victim is the worker with the most memory; its trainer, in the same unit, comes with it.
    The violation that begins the grace names both (the checkpoint signals then go to the whole workload)."""
    s = snap(
        proc(10, "trainer", mem=GiB, unit="train.service"),
        proc(11, "python", mem=3 * GiB, unit="train.service"),
        proc(12, "python", mem=GiB, unit="other.service"),
    )
    t = FakeTime()
    e = Engine(policy(WORKER_CAP.format(grace="30s", scope="unit")), t.clock(), own_pid=OWN_PID)
    (ev,) = e.evaluate(s, False)
    assert isinstance(ev, Violation) and [x.pid for x in ev.targets] == [11]
    assert [[m.pid for m in sc.members] for sc in ev.scoped] == [[10]]
    assert ev.workload == [(11, 100), (10, 100)]
    for grace, scope in (("30s", "process"), ("0s", "unit")):  # nothing added; no grace: the kill's own step asks
        e = Engine(policy(WORKER_CAP.format(grace=grace, scope=scope)), FakeTime().clock(), own_pid=OWN_PID)
        (ev,) = [x for x in e.evaluate(s, False) if isinstance(x, Violation)]
        assert ev.scoped == () and ev.workload == [(11, 100)]


def test_kill_scope_members_count_toward_the_cap_and_a_scope_is_never_half_killed():
    """Cap 3: trainer 10 and its two workers fill it; trainer 20 and its worker wait for the next cycle, whole;
    trainer 30 with four workers would take 5: never stopped, said once per episode and in the preview."""
    t = FakeTime()
    e = Engine(
        policy(SCOPED.format(cap=3, scope="tree")),
        t.clock(),
        groups=FakeGroups({}),
        own_pid=OWN_PID,
        tree=_tree({10: [11, 12], 20: [21], 30: [31, 32, 33, 34]}),
    )
    s = snap(*(proc(p, "trainer") for p in (10, 20, 30)), *(proc(p) for p in (11, 12, 21, 31, 32, 33, 34)))
    events = e.evaluate(s, True)
    first = [ev for ev in events if isinstance(ev, KillOrder)]
    assert [(o.targets[0].pid, [m.pid for m in o.scoped[0].members]) for o in first] == [(10, [11, 12])]
    assert e.stats["trainers"].would_kill == 3
    over = [ev for ev in events if isinstance(ev, KillOverCap)]
    assert [(ev.target.pid, ev.needed, ev.cap) for ev in over] == [(30, 5, 3)]
    events = step(e, t, s, 1, dry_run=True)
    second = [ev for ev in events if isinstance(ev, KillOrder)]
    assert [(o.targets[0].pid, [m.pid for m in o.scoped[0].members]) for o in second] == [(20, [21])]
    assert not [ev for ev in events if isinstance(ev, KillOverCap)]  # once per episode
    (p30,) = [p for p in e.preview(s) if p.subject.startswith("PID 30 ")]
    assert p30.status == "waiting" and p30.pids == ()
    assert "its kill_scope tree takes 5 processes, more than max_kills_per_cycle (3)" in p30.reason
