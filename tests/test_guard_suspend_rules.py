"""Guard `action: suspend` without a daemon: the policy's grammar (the shipped example, FILE:LINE:COL errors), the
engine deciding as for a kill (grace, cap, dry run, refusals not retried), what report.py words for it (would
suspend, suspended with how to resume, not suspended and why), the runner handing the order to the suspend path
(caller None, initiator guard:RULE), and the desktop agent's notices of ProcessSuspended and ProcessResumed.
On the fake NVIDIA host with the real daemon: tests/test_guard_suspend.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from helpers.guard_inputs import OWN_PID, FakeTime, GiB, proc, snap
from helpers.testbed import REPO

from gpukill.errors import NotSupported
from gpukill.outcome import Outcome, guard_initiator, resume_hint
from gpukill.policy import PolicyError, load_paths, load_texts
from gpukill.records.guard import ViolationDetails
from gpukill.records.signals import GuardActionTaken, PolicyViolated, ProcessResumed, ProcessSuspended
from gpukill.records.suspend import DONE, STUCK, SUSPENDED, SuspendedProcess, SuspendReply
from gpukill.rules import KILL, SUSPEND
from gpukillctl.notify.events import CLAIM_WAIT, CRITICAL, Audience, Narrator, Step
from gpukilld import journal as audit
from gpukilld.guard import report
from gpukilld.guard.engine import Clock, Engine, KillOrder, Target, Violation
from gpukilld.guard.notify import NotifyConfig
from gpukilld.guard.runner import GuardRunner

EXAMPLES = REPO / "examples" / "guard.d"
IDLE = """
rules:
  - name: idle
    action: suspend
    grace_period: 30s
    warn: [at_start, 10s]
    conditions: [{type: gpu_memory, operator: '>', value: 1GiB}]
"""
HOST, NOW = "gpu-host-7", 1_700_000_123.5
NOTEBOOK = Target(42, 4242, 1000, "alice", "python3", 8 * GiB, 0.0)


def policy(text: str):
    return load_texts([("p.yaml", text)])


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as e:
        policy(text)
    return e.value.errors


# -- the grammar ---------------------------------------------------------------------------------------------


def test_the_shipped_suspend_policy_is_reclaim_idle_with_action_suspend_and_its_workers():
    (suspend,) = load_paths([str(EXAMPLES / "reclaim-idle-suspend.yaml")]).rules
    (kill,) = load_paths([str(EXAMPLES / "reclaim-idle.yaml")]).rules
    assert suspend.action == SUSPEND and suspend.stops and kill.stops and kill.action == KILL
    assert suspend.kill_scope == "tree"
    same = ("name", "conditions", "match", "scope", "grace_period", "warn", "notify", "exemptions")
    assert [getattr(suspend, f) for f in same if f != "conditions"] == [
        getattr(kill, f) for f in same if f != "conditions"
    ]
    assert [c.text for c in suspend.conditions] == [c.text for c in kill.conditions]


def test_a_suspend_rule_takes_the_keys_of_when_and_what_and_not_those_of_signals():
    (rule,) = policy(IDLE.replace("    warn:", "    kill_scope: unit\n    warn:")).rules
    assert (rule.grace_period, rule.warn, rule.kill_scope) == (30.0, (30.0, 10.0), "unit")
    assert errors(IDLE + "    force: true\n    kill_grace: 2s\n") == [
        "p.yaml:8:5: force applies only to actions kill and reset, not suspend",
        "p.yaml:9:5: kill_grace applies only to action kill, not suspend",
    ]
    assert errors(IDLE.replace("action: suspend", "action: notify")) == [
        "p.yaml:5:5: grace_period applies only to actions kill, suspend, requeue and cancel, not notify",
        "p.yaml:6:5: warn applies only to actions kill, suspend, requeue and cancel, not notify",
    ]


def test_suspend_per_device_and_an_unknown_action_are_errors_where_they_are_written():
    text = IDLE.replace("    action: suspend", "    scope: per_device\n    action: suspend").replace(
        "type: gpu_memory", "type: device_memory"
    )
    (error,) = errors(text)
    assert error.startswith("p.yaml:5:13: action suspend sets an owner's workload aside"), error
    assert "needs scope per_process, per_user or per_group, not per_device" in error
    (error,) = errors(IDLE.replace("action: suspend", "action: pause"))
    assert error == "p.yaml:4:13: unknown action 'pause' (known: kill, suspend, notify, log, reset, requeue, cancel)"
    (error,) = errors(
        "rules:\n  - name: u\n    scope: per_user\n    action: suspend\n"
        "    conditions: [{type: process_name, operator: ==, value: x}]\n"
    )
    assert "with action suspend it would suspend every selected process" in error


# -- the engine ----------------------------------------------------------------------------------------------


def test_the_engine_suspends_as_it_kills_after_the_grace_within_the_cap_and_counts_suspends():
    t = FakeTime()
    e = Engine(policy(IDLE.replace("rules:", "max_kills_per_cycle: 1\nrules:")), t.clock(), own_pid=OWN_PID)
    s = snap(proc(10, "python3", mem=8 * GiB), proc(11, "python3", mem=4 * GiB, device=1))
    events = e.evaluate(s, False)
    assert [type(x).__name__ for x in events] == ["Violation", "Violation"]
    assert e.grace_report()[0]["remaining"] == 30
    t.now += 30
    (order,) = e.evaluate(s, False)  # the cap: one process per evaluation
    assert isinstance(order, KillOrder) and order.rule.action == SUSPEND and order.targets[0].pid == 10
    e.kill_finished(order, order.targets[0], Outcome.SUSPENDED)
    assert (e.stats["idle"].suspends, e.stats["idle"].kills, e.stats["idle"].failed) == (1, 0, 0)
    (preview,) = [p for p in e.preview(s) if p.pids == (11,)]
    assert preview.action == SUSPEND and preview.status == "now"


def test_a_suspend_this_host_cannot_do_is_not_ordered_again_while_the_process_lives():
    t = FakeTime()
    e = Engine(policy(IDLE), t.clock(), own_pid=OWN_PID)
    s = snap(proc(10, "python3", mem=8 * GiB))
    e.evaluate(s, False)
    t.now += 30
    (order,) = e.evaluate(s, False)
    e.kill_finished(order, order.targets[0], NotSupported.result)
    assert e.stats["idle"].failed == 1
    t.now += 3600  # long past the cooldown: still refused by the host, so never ordered again
    assert [x for x in e.evaluate(s, False) if isinstance(x, KillOrder)] == []


def test_a_dry_run_would_suspend_once_per_episode():
    t = FakeTime()
    e = Engine(policy(IDLE), t.clock(), own_pid=OWN_PID)
    s = snap(proc(10, "python3", mem=8 * GiB))
    e.evaluate(s, True)
    t.now += 30
    (order,) = e.evaluate(s, True)
    assert order.dry_run and e.stats["idle"].would_suspend == 1 and e.stats["idle"].would_kill == 0
    t.now += 60
    assert e.evaluate(s, True) == []


# -- the words -----------------------------------------------------------------------------------------------


def test_what_a_suspend_rule_says_before_during_and_after():
    (rule,) = policy(IDLE).rules
    ev = Violation(rule, "PID 42 (python3, user alice)", (42, 4242), 1000, (NOTEBOOK,), "gpu_memory > 1GiB", NOW)
    violation = report.violation(ev, False, HOST, NOW)
    assert "42 (python3, 8.0 GiB) are suspended in 30s unless it comes back under" in violation.notice.body
    assert "gpukillctl resume PID" in violation.notice.body
    order = KillOrder(rule, ev.subject, ev.subject_key, 1000, (NOTEBOOK,), False, 5.0, True, ev.reason)
    (dry,) = report.would_kill(order, HOST, NOW).entries
    assert "would suspend PID 42 (python3, 8.0 GiB, user alice)" in dry.journal.message, dry.journal.message
    assert dry.journal.message.endswith("nothing was suspended")
    assert dry.signal.outcome == Outcome.WOULD_SUSPEND and dry.signal.action == SUSPEND
    done = report.kill_done(dataclasses.replace(order, dry_run=False), NOTEBOOK, Outcome.SUSPENDED, "", HOST, NOW)
    (entry,) = done.entries
    assert f"PID 42 (python3, user alice) {resume_hint(42)}" in entry.journal.message
    assert "Result: PID 42 (python3, user alice) suspended; resume with: gpukillctl resume 42" in done.notice.body
    assert (entry.signal.action, entry.signal.outcome, entry.recent.action) == (SUSPEND, "suspended", SUSPEND)
    why = "NVIDIA driver 535.1 cannot suspend: the checkpoint API needs driver 550 or later"
    refused = report.kill_done(order, NOTEBOOK, NotSupported.result, why, HOST, NOW)
    assert f"not suspended: {why}" in refused.notice.body


# -- the runner ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("refused", [False, True], ids=["suspended", "refused"])
def test_the_runner_suspends_through_the_suspend_path_as_the_daemon_and_never_kills(tmp_path, refused):
    calls, kills = [], []

    async def suspend(caller, selection, initiator):
        calls.append((caller, selection, initiator))
        if refused:
            raise NotSupported("GPU 0 is a MIG device: the driver cannot checkpoint processes on MIG instances")
        record = SuspendedProcess(10, 100, 1000, "python3", SUSPENDED, (0,), ("GPU-0",), 8 * GiB, "PID 10", NOW)
        return SuspendReply("PID 10", "suspend", DONE, "1 process(es) suspended", (record,), 8 * GiB, "sigstop")

    async def kill(*args):
        kills.append(args)

    clock = Clock(monotonic=lambda: 1.0, boottime=lambda: 1.0, wall=lambda: NOW)
    runner = GuardRunner(
        kill,
        audit.Audit(None),
        NotifyConfig(),
        str(tmp_path / "g"),
        str(tmp_path / "s"),
        clock=clock,
        own_pid=OWN_PID,
        suspend=suspend,
    )
    runner.engine.set_policy(
        policy(IDLE.replace("grace_period: 30s", "grace_period: 0s").replace("    warn: [at_start, 10s]\n", ""))
    )
    (order,) = [
        e for e in runner.engine.evaluate(snap(proc(10, "python3", mem=8 * GiB)), False) if isinstance(e, KillOrder)
    ]

    async def run() -> None:
        runner._handle(order, False)
        await asyncio.gather(*runner._tasks)
        runner.stop()

    asyncio.run(run())
    ((caller, selection, initiator),) = calls
    assert (caller, selection.kind, selection.value, selection.start_time, initiator) == (
        None,
        "pid",
        "10",
        100,
        guard_initiator("idle"),
    )
    assert kills == []
    stats = runner.engine.stats["idle"]
    assert (stats.suspends, stats.failed) == ((0, 1) if refused else (1, 0))
    (recent,) = [r for r in runner.state.recent if r["event"] == "action"]
    assert recent["outcome"] == ("not-supported" if refused else "suspended")
    assert runner.engine.busy == set() and (runner.engine.refused == {(10, 100)}) == refused


# -- the desktop agent ---------------------------------------------------------------------------------------

ME, ADMIN = 1001, 0


def held(initiator: str = "user", state: str = SUSPENDED, **more) -> SuspendedProcess:
    return SuspendedProcess(
        42, 5, ME, "python3", state, (0,), ("GPU-0",), 8 * GiB, "PID 42", NOW, initiator=initiator, **more
    )


def test_an_admins_suspend_and_resume_of_my_workload_tell_me_how_and_by_whom():
    n = Narrator(Audience(ME))
    (toast,) = n.on_event(ProcessSuspended(held(), ADMIN), 0.0, NOW)
    assert toast.summary == "GPU process suspended: python3 (PID 42)"
    assert "8.0 GiB of GPU memory set aside in host memory, asked by root" in toast.body
    assert "resume with: gpukillctl resume 42" in toast.body
    (back,) = n.on_event(ProcessResumed(held(state="running"), ME), 1.0, NOW)
    assert back.summary == "GPU process resumed: python3 (PID 42)" and "asked by you" in back.body
    stuck = held(state=STUCK, error="CUDA_ERROR_OUT_OF_MEMORY", remedy="kill it (gpukillctl kill 42)")
    (bad,) = n.on_event(ProcessResumed(stuck, ADMIN), 2.0, NOW)
    assert bad.urgency == CRITICAL and "kill it (gpukillctl kill 42)" in bad.body
    assert Narrator(Audience(ME + 1)).on_event(ProcessSuspended(held(), ADMIN), 0.0, NOW) == []


def test_a_guard_suspend_counts_down_then_closes_with_how_to_resume():
    n = Narrator(Audience(ME))
    details = ViolationDetails("per_process", "idle", 30.0, ME, (42,), NOW)
    (opened,) = n.on_event(PolicyViolated("idle", "PID 42 (python3)", SUSPEND, False, details), 0.0, NOW)
    assert opened.summary == "PID 42 (python3) will be suspended in 30s" and opened.step is Step.OPEN
    assert n.on_event(ProcessSuspended(held(guard_initiator("idle")), 0), 30.0, NOW) == []  # its GuardActionTaken
    taken = GuardActionTaken("idle", "PID 42 (python3)", SUSPEND, 42, 5, Outcome.SUSPENDED, False)
    (closed,) = n.on_event(taken, 30.1, NOW)
    assert closed.step is Step.CLOSE and "python3 (PID 42) suspended; resume with: gpukillctl resume 42." in closed.body
    assert n.tick(30.1 + CLAIM_WAIT + 1) == []
    n.on_event(ProcessSuspended(dataclasses.replace(held(guard_initiator("idle")), pid=43), 0), 40.0, NOW)
    (alone,) = n.tick(40.0 + CLAIM_WAIT)  # no GuardActionTaken came: shown by itself
    assert alone.summary == "GPU process suspended: python3 (PID 43)" and "Guard rule idle" in alone.body
