"""The kill path on real processes: grace and force, PID reuse, protected targets, signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from helpers.marks import needs_root
from helpers.procs import received, signal_recorder
from helpers.testbed import SYSTEM_PYTHON, start_time_of

from gpukilld import journal as audit

pytestmark = needs_root


def _grace(seconds: float) -> dict:
    return {"$variant": ["d", seconds]}


def test_sigterm_ignoring_victim_is_killed_by_force(victims, users, alive):
    bed = victims
    rec = bed.record_signals(users["other"])  # signals reach unprivileged listeners too
    victim = bed.victim(users["owner"], gpu=0, ignore_term=True, comm="stubborn")
    listed = bed.wait_listed(victim.pid)
    t0 = time.monotonic()
    r = bed.manager(
        users["owner"],
        "KillProcess",
        "uta{sv}",
        [victim.pid, listed["start_time"], {"force": {"$variant": ["b", True]}, "grace": _grace(1.0)}],
    )
    elapsed = time.monotonic() - t0
    assert r.ok and r.body == ["killed"], r
    assert elapsed >= 1.0, "SIGKILL must come only after the grace"
    assert victim.wait(5) == -9
    sig = rec.wait_for("ProcessKilled", where=lambda b: b[0] == victim.pid)
    assert sig is not None
    pid, start_time, uid, comm, devices, outcome, caller_uid, initiator, reclaim = sig["body"]
    assert reclaim["verdict"] == "reclaimed"  # after the exit, nothing related holds its GPU
    assert (start_time, uid, comm, outcome, caller_uid, initiator) == (
        listed["start_time"],
        users["owner"].uid,
        "stubborn",
        "killed",
        users["owner"].uid,
        "user",
    )
    assert devices == [listed["device_id"]]
    entry = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entry and entry[0]["GPUKILL_RESULT"] == "killed" and entry[0]["GPUKILL_FORCE"] == "1"
    # the journal names who asked as the bus does; the caller's uid stands beside it in both
    assert (entry[0]["GPUKILL_INITIATOR"], entry[0]["GPUKILL_CALLER_UID"]) == (initiator, str(caller_uid))


def test_force_sends_sigterm_before_sigkill_and_the_memory_is_timed_from_sigterm(victims, users):
    """kill --force never sends SIGKILL without SIGTERM first: a process that handles every signal it can names
    each it got (SIGTERM alone: SIGKILL ended it, after the grace), and the seconds until its memory was back
    count from that SIGTERM, the grace included. (Grace 0, where SIGKILL follows at once: test_memory_back.py.)"""
    bed = victims
    victim = signal_recorder(bed, users["owner"], mem="1GiB")
    bed.wait_listed(victim.pid)
    cli = bed.ctl(users["owner"], "kill", str(victim.pid), "--force", "--grace", "1")
    assert cli.returncode == 0, cli
    assert victim.wait(5) == -signal.SIGKILL
    assert received(victim) == ["SIGTERM"]
    said = re.fullmatch(
        rf"PID {victim.pid} \(python3\) killed with SIGKILL after the grace period; "
        r"GPU memory reclaimed \(1\.0 GiB\) (\d+(?:\.\d)?)s after SIGTERM\n",
        cli.stdout,
    )
    assert said and float(said.group(1)) >= 1.0, cli.stdout
    entry = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entry and entry[0]["GPUKILL_RESULT"] == "killed", entry
    assert float(entry[0]["GPUKILL_RECLAIM_SECONDS"]) >= 1.0 and entry[0]["GPUKILL_RECLAIM_FIRST_SIGNAL"] == "SIGTERM"


def test_without_force_it_is_reported_still_alive(victims, users, alive):
    bed = victims
    victim = bed.victim(users["owner"], gpu=0, ignore_term=True)
    listed = bed.wait_listed(victim.pid)
    r = bed.manager(
        users["owner"], "KillProcess", "uta{sv}", [victim.pid, listed["start_time"], {"grace": _grace(0.5)}]
    )
    assert r.ok and r.body == ["still-alive"], r
    assert alive(victim.pid)
    entry = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entry[0]["GPUKILL_RESULT"] == "still-alive"
    # and the CLI says so with its own exit code
    cli = bed.ctl(users["owner"], "kill", str(victim.pid), "--grace", "0.2")
    assert cli.returncode == 10, cli
    assert "still alive" in cli.stderr and cli.stderr.count("\n") == 1


def test_stale_start_time_is_refused_and_nothing_is_signalled(victims, users, alive):
    """PID reuse: the caller names (pid, start time) as listed; a different start time means another process."""
    bed = victims
    victim = bed.victim(users["owner"], gpu=0)
    listed = bed.wait_listed(victim.pid)
    for stale in (listed["start_time"] - 1, listed["start_time"] + 1, 0):
        r = bed.manager(users["root"], "KillProcess", "uta{sv}", [victim.pid, stale, {}])
        assert r.error == "org.gpukill1.Error.ProcessChanged", r
    time.sleep(0.3)
    assert alive(victim.pid), "nothing may be signalled on a start-time mismatch"
    entries = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL_FAILED.message_id)
    assert len(entries) == 3 and {e["GPUKILL_RESULT"] for e in entries} == {"process-changed"}
    assert bed.journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id) == []


def test_real_pid_reuse(victims, users, alive):
    """A listed process exits and a new one gets the same PID (forced through ns_last_pid): refused."""
    bed = victims
    victim = bed.victim(users["owner"], gpu=0)
    listed = bed.wait_listed(victim.pid)
    pid = victim.pid
    os.killpg(pid, 9)
    victim.wait()
    # Make the kernel hand out `pid` again (needs root; ns_last_pid is the last PID given out).
    newcomer = None
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(
            [SYSTEM_PYTHON, "-c", "import time; time.sleep(60)"],
            env={"GPUKILL_SIM_GPU": "0", "GPUKILL_SIM_SCOPE": bed.scope},
            start_new_session=True,
        )
        bed.procs.append(p)
        if p.pid == pid:
            newcomer = p
            break
        p.kill()
        p.wait()
    assert newcomer is not None, "could not reuse the PID"
    assert start_time_of(pid) != listed["start_time"]
    r = bed.manager(users["root"], "KillProcess", "uta{sv}", [pid, listed["start_time"], {}])
    assert r.error == "org.gpukill1.Error.ProcessChanged", r
    assert alive(pid), "the newcomer holding the reused PID must not be signalled"


def test_protected_targets(victims, users, alive):
    bed = victims
    daemon_pid = bed.daemon.proc.pid
    cases = {
        1: "org.gpukill1.Error.Protected",
        daemon_pid: "org.gpukill1.Error.Protected",
        2: "org.gpukill1.Error.Protected",  # kthreadd
    }
    for pid, error in cases.items():
        r = bed.manager(users["root"], "KillProcess", "uta{sv}", [pid, start_time_of(pid), {}])
        assert r.error == error, (pid, r)
    # a real process of the owner that is not on any GPU
    plain = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", "import time; time.sleep(60)"], user=users["owner"].uid, env={}, start_new_session=True
    )
    bed.procs.append(plain)
    time.sleep(0.3)
    r = bed.manager(users["owner"], "KillProcess", "uta{sv}", [plain.pid, start_time_of(plain.pid), {}])
    assert r.error == "org.gpukill1.Error.NotAGpuProcess", r
    assert alive(plain.pid) and alive(daemon_pid)
    # gone entirely
    r = bed.manager(users["root"], "KillProcess", "uta{sv}", [4194000, 1, {}])
    assert r.error == "org.gpukill1.Error.NoSuchProcess", r
    refused = bed.wait_journal(GPUKILL_TARGET_PID="1", MESSAGE_ID=audit.KILL_FAILED.message_id)
    assert refused and refused[-1]["GPUKILL_RESULT"] == "protected"


def test_kill_through_cli_by_owner(victims, users):
    bed = victims
    victim = bed.victim(users["owner"], gpu=1, comm="xmrig")
    bed.wait_listed(victim.pid, comm="xmrig")
    r = bed.ctl(users["owner"], "kill", str(victim.pid))
    assert r.returncode == 0, r
    # no size (the victim says none), but the seconds from SIGTERM until the memory was back
    assert re.fullmatch(
        rf"PID {victim.pid} \(xmrig\) terminated; GPU memory reclaimed \S+ after SIGTERM", r.stdout.strip()
    )
    bed.wait_listed(victim.pid, present=False)


def test_grace_zero_reports_the_exit_sigterm_caused(victims, users, alive):
    """`kill --grace 0`: SIGTERM, then the answer says what became of the process; one that exits on SIGTERM
    is terminated (exit status 0) in the reply, the CLI and the journal, never "still alive"."""
    bed = victims
    victim = bed.victim(users["owner"], gpu=0, comm="quitter")
    listed = bed.wait_listed(victim.pid, comm="quitter")
    r = bed.manager(users["owner"], "KillProcess", "uta{sv}", [victim.pid, listed["start_time"], {"grace": _grace(0)}])
    assert r.ok and r.body == ["terminated"], r
    assert victim.wait(5) == -15
    entry = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entry and entry[0]["GPUKILL_RESULT"] == "terminated" and "still alive" not in entry[0]["MESSAGE"], entry
    victim = bed.victim(users["owner"], gpu=0, comm="quitter")
    bed.wait_listed(victim.pid, comm="quitter")
    cli = bed.ctl(users["owner"], "kill", str(victim.pid), "--grace", "0")
    assert cli.returncode == 0, cli
    assert cli.stdout.startswith(f"PID {victim.pid} (quitter) terminated"), cli.stdout
    assert victim.wait(5) == -15
    entry = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entry and entry[0]["GPUKILL_RESULT"] == "terminated", entry
    # one that ignores SIGTERM is still reported alive, after the short wait for the exit
    stubborn = bed.victim(users["owner"], gpu=0, ignore_term=True)
    bed.wait_listed(stubborn.pid)
    cli = bed.ctl(users["owner"], "kill", str(stubborn.pid), "--grace", "0")
    assert cli.returncode == 10 and "still alive" in cli.stderr, cli
    assert alive(stubborn.pid)
