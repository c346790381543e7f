"""Guard's `requeue` and `cancel` actions, with a fake Slurm: reading `scontrol show job -o` and a batch script's
--signal (gpukilld/acts/slurm.py), the engine's one act per job within the per-cycle cap, the runner asking Slurm
(or, in a dry run, never), and what each act is reported as. tests/package/test_booted_install.py shows the same
with the real slurmctld and slurmd."""

from __future__ import annotations

import asyncio
import signal
import stat

import pytest
from helpers.guard_inputs import OWN_PID, FakeTime, proc, snap

from gpukill.outcome import Outcome
from gpukill.policy import PolicyError, load_texts
from gpukilld import journal as audit
from gpukilld.acts import slurm
from gpukilld.acts.slurm import JobInfo, Ran, Slurm, SlurmError
from gpukilld.guard.engine import Engine, JobOrder, Violation
from gpukilld.guard.notify import NotifyConfig
from gpukilld.guard.runner import GuardRunner

# `scontrol show job -o` of Slurm 22.05.8 (Debian bookworm, recorded in the booted test's container): a job
# submitted with --wrap, running on node vm
RUNNING = (
    "JobId=42 JobName=wrap UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A Priority=4294901754 "
    "Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:03 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-12-07T11:18:04 EligibleTime=2026-12-07T11:18:04 AccrueTime=2026-12-07T11:18:04 "
    "StartTime=2026-12-07T11:18:04 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-12-07T11:18:04 Scheduler=Main Partition=debug AllocNode:Sid=vm:0 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=vm BatchHost=vm NumNodes=1 NumCPUs=1 NumTasks=1 "
    "CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=1000M,node=1,billing=1 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) "
    "DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) "
    "WorkDir=/tmp StdErr=/tmp/slurm-42.out StdIn=/dev/null StdOut=/tmp/slurm-42.out Power="
)
NO_REQUEUE = RUNNING.replace("Requeue=1", "Requeue=0")


def policy(action: str, extra: str = "", scope: str = "per_process", cap: int = 10) -> object:
    return load_texts(
        [
            (
                "p.yaml",
                f"max_kills_per_cycle: {cap}\nnotify: [journal]\nrules:\n  - name: r\n    action: {action}\n"
                f"    scope: {scope}\n{extra}"
                "    conditions: [{type: gpu_memory, operator: '>', value: 1GiB}]\n",
            )
        ]
    )


class FakeSlurm:
    """Answers Slurm's commands from a table of job lines; records every command asked."""

    def __init__(self, jobs: dict[str, str], fail: dict[str, Ran] | None = None) -> None:
        self.jobs = jobs
        self.fail = fail or {}
        self.asked: list[tuple[str, ...]] = []

    async def __call__(self, argv, timeout) -> Ran:
        argv = tuple(argv)
        self.asked.append(argv)
        if argv[:2] in (("scontrol", "requeue"),) or argv[0] == "scancel":
            return self.fail.get(argv[0] + " " + argv[-1], Ran(0, "", ""))
        if argv[:3] == ("scontrol", "show", "job"):
            line = self.jobs.get(argv[-1])
            if line is None:
                return Ran(1, "", "slurm_load_jobs error: Invalid job id specified\n")
            return Ran(0, line + "\n", "")
        if argv[:3] == ("scontrol", "write", "batch_script"):
            return Ran(0, self.jobs.get("script " + argv[3], "#!/bin/sh\nsleep 1\n"), "")
        return Ran(1, "", f"unexpected {argv}")


def run(coro):
    return asyncio.run(coro)


# -- reading Slurm ---------------------------------------------------------------------------------------------


def test_a_job_line_is_read_into_state_requeue_owner_and_host():
    info = slurm.parse_job("42", RUNNING)
    assert info == JobInfo("42", "RUNNING", True, "alice", 1000, "vm", 0) and info.batch_host == "vm"
    assert not slurm.parse_job("42", NO_REQUEUE).requeue
    fields = slurm.parse_fields("JobId=7 JobName=with spaces in it UserId=bob(1001) Command=/a b/c.sh")
    assert fields["JobName"] == "with spaces in it" and fields["Command"] == "/a b/c.sh"


def test_an_array_task_is_found_by_its_own_line():
    lines = "\n".join(RUNNING.replace("JobId=42 ", f"JobId={42 + i} ArrayJobId=42 ArrayTaskId={i} ") for i in range(3))
    assert slurm.parse_job("42_2", lines).job == "42_2"
    assert slurm.parse_job("43", lines).job == "43"
    with pytest.raises(SlurmError, match="does not describe job 99"):
        slurm.parse_job("99", lines)


@pytest.mark.parametrize("bad", ["", "42 43", "-1", "42;reboot", "1" * 11, "42_", "_1", "４２"])
def test_a_job_id_is_checked_before_any_command_sees_it(bad):
    fake = FakeSlurm({})
    with pytest.raises(SlurmError) as e:
        run(Slurm(fake).requeue(bad, 1000))
    assert e.value.result == slurm.NOT_A_JOB_ID and fake.asked == []


@pytest.mark.parametrize(
    ("option", "want"),
    [
        ("B:USR1@120", (signal.SIGUSR1, 120.0)),
        ("USR2", (signal.SIGUSR2, 60.0)),  # no @SECONDS: sbatch's sixty
        ("SIGTERM@30", (signal.SIGTERM, 30.0)),
        ("10@90", (10, 90.0)),
        ("RB:INT@5", (signal.SIGINT, 5.0)),
        ("B:KILL@60", None),  # a process cannot handle it: never a checkpoint signal
        ("STOP", None),
        ("B:NOPE@60", None),
        ("B:USR1@soon", None),
        ("99@10", None),
    ],
)
def test_sbatch_signal_options(option, want):
    assert slurm.parse_signal_option(option) == want


def test_a_batch_scripts_signal_directive_is_read_as_sbatch_reads_it():
    script = "#!/bin/bash\n#SBATCH --job-name=train\n#SBATCH --signal=B:USR1@120\n\npython train.py\n"
    assert slurm.script_signal(script) == (signal.SIGUSR1, 120.0)
    assert slurm.script_signal(script.replace("--signal=", "--signal ")) == (signal.SIGUSR1, 120.0)
    after = "#!/bin/bash\npython train.py\n#SBATCH --signal=B:USR1@120\n"  # after the first command: a comment
    assert slurm.script_signal(after) is None
    assert slurm.script_signal("#!/bin/sh\n# This script was created by sbatch --wrap.\n\nsleep 300\n") is None
    fake = FakeSlurm({"script 42": script})
    assert run(Slurm(fake).slurm_checkpoint("42")) == (signal.SIGUSR1, 120.0)
    assert fake.asked == [("scontrol", "write", "batch_script", "42", "-")]


# -- asking Slurm ----------------------------------------------------------------------------------------------


def test_a_requeueable_job_is_requeued_and_a_job_is_cancelled_by_scancel():
    fake = FakeSlurm({"42": RUNNING})
    run(Slurm(fake).requeue("42", 1000))
    run(Slurm(fake).cancel("42", 1000))
    show = ("scontrol", "show", "job", "-o", "42")
    assert fake.asked == [show, ("scontrol", "requeue", "42"), show, ("scancel", "42")]


def test_a_job_that_is_not_requeueable_is_refused_with_the_reason_and_slurm_is_not_asked():
    fake = FakeSlurm({"42": NO_REQUEUE})
    with pytest.raises(SlurmError) as e:
        run(Slurm(fake).requeue("42", 1000))
    assert e.value.result == slurm.NOT_REQUEUEABLE
    assert str(e.value) == "job 42 is not requeueable (sbatch --no-requeue or JobRequeue=0): not requeued"
    assert ("scontrol", "requeue", "42") not in fake.asked


@pytest.mark.parametrize("act", ["requeue", "cancel"])
def test_another_users_job_is_never_acted_on(act):
    """A task of one user's job can start a process with any SLURM_JOB_ID: the job's owner must be the process's."""
    fake = FakeSlurm({"42": RUNNING})
    with pytest.raises(SlurmError) as e:
        run(getattr(Slurm(fake), act)("42", 1001))
    assert e.value.result == slurm.NOT_THE_OWNER and "belongs to uid 1000" in str(e.value)
    assert fake.asked == [("scontrol", "show", "job", "-o", "42")]


def test_a_jobs_declared_signal_is_read_only_for_a_process_of_its_owner():
    """A process names its job in its environment: the signal of another user's job is never read for it."""
    script = "#!/bin/sh\n#SBATCH --signal=B:USR1@120\nsleep 300\n"
    fake = FakeSlurm({"42": RUNNING, "script 42": script})
    assert run(Slurm(fake).declared_signal("42", 1000)) == (signal.SIGUSR1, 120.0)
    fake.asked.clear()
    with pytest.raises(SlurmError) as e:
        run(Slurm(fake).declared_signal("42", 1001))
    assert e.value.result == slurm.NOT_THE_OWNER
    assert fake.asked == [("scontrol", "show", "job", "-o", "42")]


def test_slurms_failure_says_what_slurm_said():
    fake = FakeSlurm(
        {"42": RUNNING},
        fail={"scontrol 42": Ran(1, "", "Requested operation is presently disabled for job 42\n")},
    )
    with pytest.raises(SlurmError) as e:
        run(Slurm(fake).requeue("42", 1000))
    assert e.value.result == slurm.FAILED
    assert str(e.value) == "scontrol requeue: Requested operation is presently disabled for job 42"
    with pytest.raises(SlurmError, match="Invalid job id specified"):
        run(Slurm(fake).cancel("43", 1000))


def fake_command(tmp_path, name: str, body: str) -> None:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_host_without_slurm_gets_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm, "SLURM_PATH", str(tmp_path))
    with pytest.raises(SlurmError) as e:
        run(Slurm().cancel("42", 1000))
    assert e.value.result == slurm.NOT_INSTALLED and "scontrol not found" in str(e.value)


def test_a_command_is_bounded_in_time_and_output(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm, "SLURM_PATH", f"{tmp_path}:/usr/bin:/bin")
    fake_command(tmp_path, "scontrol", 'head -c 1000000 /dev/zero | tr "\\0" x; echo "$PATH" >&2\n')
    fake_command(tmp_path, "scancel", "exec sleep 30\n")
    ran = run(slurm.run_command(["scontrol", "show"], 10))
    assert len(ran.stdout) == slurm.MAX_OUTPUT and ran.returncode == 0
    assert ran.stderr.strip() == slurm.SLURM_PATH  # its own environment, not the daemon's
    with pytest.raises(SlurmError, match=r"scancel 42 did not answer within 0.3s"):
        run(slurm.run_command(["scancel", "42"], 0.3))


# -- the policy ------------------------------------------------------------------------------------------------


def test_requeue_and_cancel_take_a_grace_and_warnings_but_not_the_kill_paths_keys():
    rule = policy("requeue", "    grace_period: 2m\n    warn: [at_start, 30s]\n").rules[0]  # type: ignore[attr-defined]
    assert (rule.action, rule.grace_period, rule.warn) == ("requeue", 120.0, (120.0, 30.0))
    for key in ("force: true", "kill_grace: 5s", "kill_scope: tree"):
        with pytest.raises(PolicyError, match=f"{key.split(':')[0]} applies only to actions? kill[ ,].*not cancel"):
            policy("cancel", f"    {key}\n")


# -- the engine ------------------------------------------------------------------------------------------------


def job_orders(events) -> list[JobOrder]:
    return [e for e in events if isinstance(e, JobOrder)]


def test_one_act_per_job_whichever_of_its_processes_violate():
    t = FakeTime()
    e = Engine(policy("requeue"), t.clock(), own_pid=OWN_PID)
    s = snap(
        proc(10, mem=2 << 30, slurm_job="42"),
        proc(11, mem=2 << 30, slurm_job="42"),
        proc(12, mem=2 << 30, slurm_job="43"),
    )
    (a, b) = job_orders(e.evaluate(s, False))  # three subjects, two jobs
    assert [j for j, _ in a.jobs + b.jobs] == ["42", "43"]
    assert [t.pid for t in a.jobs[0][1]] == [10]
    assert job_orders(e.evaluate(s, False)) == []  # in flight


def test_a_per_user_subjects_jobs_count_toward_the_cap_one_each():
    t = FakeTime()
    e = Engine(
        load_texts(
            [
                (
                    "p.yaml",
                    "max_kills_per_cycle: 1\nrules:\n  - name: r\n    action: cancel\n    scope: per_user\n"
                    "    conditions: [{type: user_memory, operator: '>', value: 1GiB}]\n",
                )
            ]
        ),
        t.clock(),
        own_pid=OWN_PID,
    )
    s = snap(
        proc(10, mem=2 << 30, slurm_job="42"),
        proc(11, mem=2 << 30, slurm_job="42"),
        proc(12, mem=3 << 30, slurm_job="43"),
        proc(13, mem=1 << 30),
    )
    (order,) = job_orders(e.evaluate(s, False))
    # largest first until under: 12 (job 43), then 10 and 11 (job 42); the cap of 1 takes one job
    assert [(j, [t.pid for t in ts]) for j, ts in order.jobs] == [("43", [12])] and order.unattached == ()
    e.job_finished(order, "43", True)
    t.now += 11  # the subject's cooldown; Slurm ended job 43's process
    (order,) = job_orders(e.evaluate(snap(*s.processes[:2], s.processes[3]), False))
    assert [(j, [t.pid for t in ts]) for j, ts in order.jobs] == [("42", [10, 11])]
    assert e.stats["r"].kills == 1


def test_a_process_of_no_job_is_reported_once_and_left_running():
    t = FakeTime()
    e = Engine(policy("requeue"), t.clock(), own_pid=OWN_PID)
    s = snap(proc(10, mem=2 << 30))
    events = e.evaluate(s, False)
    (violation,) = [ev for ev in events if isinstance(ev, Violation)]
    (order,) = job_orders(events)
    assert order.jobs == () and [t.pid for t in order.unattached] == [10]
    t.now += 60
    assert job_orders(e.evaluate(s, False)) == []  # said once while it lives
    assert e.busy == set() and e.stats["r"].kills == 0


def test_a_dry_run_orders_each_job_once_per_episode():
    t = FakeTime()
    e = Engine(policy("cancel"), t.clock(), own_pid=OWN_PID)
    s = snap(proc(10, mem=2 << 30, slurm_job="42"))
    (order,) = job_orders(e.evaluate(s, True))
    assert order.dry_run and e.stats["r"].would_kill == 1 and e.busy == set()
    t.now += 60
    assert job_orders(e.evaluate(s, True)) == []


def test_the_preview_says_requeue_and_names_the_job():
    t = FakeTime()
    e = Engine(policy("requeue", "    grace_period: 1m\n"), t.clock(), own_pid=OWN_PID)
    (a, b) = e.preview(snap(proc(10, mem=2 << 30, slurm_job="42"), proc(11, mem=2 << 30)))
    assert (a.action, a.pids, a.status) == ("requeue", (10,), "waiting")
    assert a.reason.endswith("; requeues job 42 through Slurm")
    assert "not a Slurm job's process: action requeue does nothing to PID 11 (python), left running" in b.reason


# -- the runner and the reports --------------------------------------------------------------------------------


class Journal:
    def __init__(self) -> None:
        self.entries: list[tuple[audit.EventKind, str, dict]] = []

    def log(self, kind, message, **fields):
        self.entries.append((kind, message, fields))


def runner_with(tmp_path, fake: FakeSlurm, action: str = "requeue") -> tuple[GuardRunner, Journal]:
    journal = Journal()
    r = GuardRunner(
        None,
        journal,  # type: ignore[arg-type]
        NotifyConfig(),
        str(tmp_path / "g"),
        str(tmp_path / "s"),
        clock=FakeTime().clock(),
        own_pid=OWN_PID,
        slurm=Slurm(fake),
    )
    r.engine.set_policy(policy(action))  # type: ignore[arg-type]
    return r, journal


def carry_out(r: GuardRunner, events, dry_run: bool = False) -> None:
    async def go() -> None:
        for ev in events:
            r._handle(ev, dry_run)
        await asyncio.gather(*r._tasks)
        r.stop()

    asyncio.run(go())


@pytest.mark.parametrize(
    ("action", "line", "kind", "result", "said"),
    [
        ("requeue", RUNNING, audit.GUARD_SLURM, Outcome.REQUEUED, "Guard rule r: requeued job 42 for PID 10"),
        (
            "requeue",
            NO_REQUEUE,
            audit.GUARD_SLURM_REFUSED,
            slurm.NOT_REQUEUEABLE,
            "Guard rule r: job 42 is not requeueable (sbatch --no-requeue or JobRequeue=0): not requeued for PID 10",
        ),
        ("cancel", RUNNING, audit.GUARD_SLURM, Outcome.JOB_CANCELLED, "Guard rule r: cancelled job 42 for PID 10"),
    ],
)
def test_the_runner_asks_slurm_once_and_journals_what_became_of_the_job(tmp_path, action, line, kind, result, said):
    fake = FakeSlurm({"42": line})
    r, journal = runner_with(tmp_path, fake, action)
    s = snap(proc(10, "sleep", mem=2 << 30, uid=1000, slurm_job="42"), proc(11, "sleep", mem=2 << 30, uid=1000))
    carry_out(r, r.engine.evaluate(s, False))
    acts = [a for a in fake.asked if a[:2] == ("scontrol", "requeue") or a[0] == "scancel"]
    assert acts == (
        []
        if result == slurm.NOT_REQUEUEABLE
        else [("scontrol", "requeue", "42") if action == "requeue" else ("scancel", "42")]
    )
    (entry,) = [e for e in journal.entries if e[2].get("slurm_job") == "42"]
    assert entry[0] == kind and entry[1].startswith(said), entry[1]
    assert entry[2]["result"] == result and entry[2]["target_pids"] == "10" and entry[2]["rule_action"] == action
    (stray,) = [e for e in journal.entries if e[2].get("result") == Outcome.NOT_A_JOB]
    assert stray[0] == audit.GUARD_SLURM_REFUSED and stray[2]["target_pid"] == 11
    assert f"not a Slurm job's process: action {action} does nothing" in stray[2]["error"]
    stats = r.engine.stats["r"]
    assert (stats.kills, stats.failed) == ((0, 1) if result == slurm.NOT_REQUEUEABLE else (1, 0))
    assert r.engine.busy == set() and not r.engine.states[0].in_flight
    recent = [e for e in r.state.recent if e.get("event") == "action"]
    assert {e["outcome"] for e in recent} == {result, Outcome.NOT_A_JOB}
    assert any(e.get("detail") == "job 42" for e in recent)


def test_a_dry_run_never_calls_slurm(tmp_path):
    fake = FakeSlurm({"42": RUNNING})
    r, journal = runner_with(tmp_path, fake)
    carry_out(r, r.engine.evaluate(snap(proc(10, "sleep", mem=2 << 30, uid=1000, slurm_job="42")), True), True)
    assert fake.asked == []
    (entry,) = [e for e in journal.entries if e[2].get("slurm_job") == "42"]
    assert entry[0] == audit.GUARD_DRY_RUN and entry[2]["result"] == Outcome.WOULD_REQUEUE
    assert "would requeue job 42 (dry run: Slurm was not asked)" in entry[1]


def test_a_job_whose_processes_are_of_two_users_is_not_acted_on(tmp_path):
    fake = FakeSlurm({"42": RUNNING})
    r, journal = runner_with(tmp_path, fake)
    r.engine.set_policy(
        load_texts(
            [
                (
                    "p.yaml",
                    "rules:\n  - name: r\n    action: requeue\n    scope: per_device\n"
                    "    conditions: [{type: temperature, operator: '>', value: 30}]\n",
                )
            ]
        )
    )
    s = snap(
        proc(10, mem=2 << 30, uid=1000, slurm_job="42"),
        proc(11, mem=2 << 30, uid=1001, user="bob", slurm_job="42"),
    )
    carry_out(r, r.engine.evaluate(s, False))
    assert not [a for a in fake.asked if a[:2] == ("scontrol", "requeue")]
    (entry,) = [e for e in journal.entries if e[2].get("slurm_job") == "42"]
    assert entry[2]["result"] == slurm.NOT_THE_OWNER and "belong to several users" in entry[1]


def test_a_runner_without_slurm_refuses_and_says_so(tmp_path):
    r, journal = runner_with(tmp_path, FakeSlurm({}))
    r.slurm = None
    carry_out(r, r.engine.evaluate(snap(proc(10, mem=2 << 30, uid=1000, slurm_job="42")), False))
    (entry,) = [e for e in journal.entries if e[2].get("slurm_job") == "42"]
    assert entry[2]["result"] == slurm.NOT_INSTALLED and "no Slurm path" in entry[1]


def test_the_violation_and_its_warnings_say_slurm_acts_on_the_job_and_what_is_left_running():
    from gpukilld.guard import report
    from gpukilld.guard.engine import GraceWarning

    t = FakeTime()
    rule = (
        "rules:\n  - name: r\n    action: requeue\n    scope: per_user\n    grace_period: 2m\n"
        "    warn: [at_start, 1m]\n    conditions: [{type: user_memory, operator: '>', value: 1GiB}]\n"
    )
    e = Engine(load_texts([("p.yaml", rule)]), t.clock(), own_pid=OWN_PID)
    s = snap(proc(10, "sleep", mem=3 << 30, slurm_job="42"), proc(11, mem=2 << 30))
    (v,) = [ev for ev in e.evaluate(s, False) if isinstance(ev, Violation)]
    said = report.violation(v, False, "h", 0.0).entries[0].journal.message
    assert (
        "job 42 (PID 10 (sleep, 3.0 GiB)) is requeued through Slurm in 2min unless it comes back under; "
        "not a Slurm job's process: action requeue does nothing to PID 11 (python), left running" in said
    ), said
    t.now += 61
    (w,) = [ev for ev in e.evaluate(s, False) if isinstance(ev, GraceWarning)]
    warned = report.warning(w, True, "h", 0.0)
    assert "is requeued through Slurm in 59s unless it comes back under" in warned.entries[0].journal.message
    assert warned.entries[0].recent.action == "requeue"
