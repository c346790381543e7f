"""`over: mean`: a duration judged by the mean of its samples, so a keep-alive burst every few seconds
does not restart a 2-hour idle clock, while real work does; bounded memory per subject; validated FILE:LINE:COL."""

from __future__ import annotations

import pytest
from helpers.guard_inputs import OWN_PID, FakeTime, GiB, proc, snap

from gpukill.policy import PolicyError, load_texts
from gpukilld.guard.engine import Engine, KillOrder, Violation
from gpukilld.guard.window_mean import BUCKETS, WindowMean

IDLE = (
    "rules:\n  - name: reclaim\n    conditions:\n"
    "      - {type: gpu_memory, operator: '>', value: 256MiB, duration: 100s}\n"
    "      - {type: gpu_utilization, operator: '<', value: 15, duration: 100s, over: mean}\n"
    "    action: kill\n"
)


def engine(text: str = IDLE) -> tuple[Engine, FakeTime]:
    t = FakeTime()
    return Engine(load_texts([("m.yaml", text)]), t.clock(), own_pid=OWN_PID), t


def run(e: Engine, t: FakeTime, seconds: int, util_at) -> list:
    """One evaluation a second for `seconds`, the process's utilization util_at(second); the events."""
    events = []
    start = t.now
    for i in range(seconds):
        t.now = start + i
        events += e.evaluate(snap(proc(10, "notebook", util=util_at(i), mem=4 * GiB)), False)
    return events


def test_a_keep_alive_burst_does_not_restart_the_idle_clock():
    e, t = engine()
    events = run(e, t, 120, lambda i: 100 if i % 10 == 0 else 0)  # 1 s at 100 % every 10 s: mean 10 %
    assert [type(ev) for ev in events] == [Violation, KillOrder]
    assert "gpu_utilization < 15% on average over 1min 40s (mean 10%)" in events[0].reason


def test_every_sample_would_have_been_gamed_by_the_same_burst():
    e, t = engine(IDLE.replace(", over: mean", ""))
    assert run(e, t, 300, lambda i: 100 if i % 10 == 0 else 0) == []


def test_real_work_keeps_the_mean_up_and_nothing_happens():
    e, t = engine()
    assert run(e, t, 300, lambda i: 90) == []
    assert run(e, t, 300, lambda i: 100 if i % 4 == 0 else 0) == []  # busy a quarter of the time: mean 25 %


def test_memory_given_back_ends_the_window():
    e, t = engine()
    run(e, t, 50, lambda i: 0)
    t.now += 1
    assert e.evaluate(snap(proc(10, "notebook", util=0, mem=0)), False) == []  # no memory held: not idle
    assert run(e, t, 99, lambda i: 0) == []  # the 100 s start again
    assert [type(ev) for ev in run(e, t, 3, lambda i: 0)] == [Violation, KillOrder]


def test_the_mean_holds_at_most_BUCKETS_buckets_and_forgets_what_left_the_span():
    m = WindowMean(0.0, 64.0)
    for i in range(10_000):
        m.add(float(i), 100.0 if i < 9_000 else 0.0)
    assert len(m.buckets) <= BUCKETS and m.value() == 0.0


@pytest.mark.parametrize(
    ("condition", "where", "says"),
    [
        ("{type: gpu_utilization, operator: '<', value: 5, over: mean}", "m.yaml:3:67", "needs a duration"),
        (
            "{type: gpu_utilization, operator: '<', value: 5, duration: 1m, over: median}",
            "m.yaml:3:87",
            "over must be one of every, mean",
        ),
        (
            "{type: process_name, operator: '==', value: x, duration: 1m, over: mean}",
            "m.yaml:3:79",
            "needs a condition on a number",
        ),
    ],
)
def test_a_bad_over_is_refused_at_its_line_and_column(condition, where, says):
    with pytest.raises(PolicyError) as e:
        load_texts([("m.yaml", f"rules:\n  - name: r\n    conditions: [{condition}]\n    action: log\n")])
    assert where in str(e.value) and says in str(e.value), str(e.value)
