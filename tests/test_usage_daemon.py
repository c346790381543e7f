"""GPU usage accounting in the real daemon: simulated GPUs, real processes at known utilization and
memory for known durations, the USAGE entries read back from the test bed's journald with `journalctl -o json`.

Samples every INTERVAL seconds: a process is first seen up to one interval after it starts and last seen up to
one before it ends, so its GPU time is its life within two intervals (and the machine's load: SLACK)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from helpers.marks import needs_root
from helpers.testbed import OWNER, ROOT, Testbed, User
from helpers.waiting import wait_until

from gpukilld import journal
from gpukilld.usage.journal_form import record_from_journal
from gpukilld.usage.state import STATE_FILE

pytestmark = needs_root

INTERVAL = 0.25
SLACK = 1.0  # seconds: 2 CPUs shared by the test, the daemon, journald and the victims
GiB = 1 << 30
SIM = """devices:
  - {name: "Simulated H100", vendor: nvidia, uuid: GPU-0000-usage-0, memory_total: 80GiB, power: 100}
  - {name: "Simulated H100", vendor: nvidia, uuid: GPU-0000-usage-1, memory_total: 80GiB, power: 200}
  - {name: "Simulated MI210", vendor: amd, uuid: GPU-0000-usage-2, memory_total: 64GiB}
"""


def approx(value: float):
    return pytest.approx(value, rel=1e-3)


@pytest.fixture
def ubed(users):
    b = Testbed()
    try:
        b.start_bus()
        b.start_journal()
        (b.workdir / "sim.yaml").write_text(SIM)
        yield b
    finally:
        b.stop()


def start(bed: Testbed) -> None:
    bed.start_daemon(sim_yaml=bed.workdir / "sim.yaml", args=["--sample-interval", str(INTERVAL)])


def entries(bed: Testbed, pid: int) -> list[dict]:
    return bed.journal(MESSAGE_ID=journal.USAGE.message_id, GPUKILL_TARGET_PID=str(pid))


def wait_entries(bed: Testbed, pid: int, n: int = 1, timeout: float = 15.0) -> list[dict]:
    return wait_until(
        lambda: e if len(e := entries(bed, pid)) >= n else None,
        timeout,
        lambda: f"PID {pid}: {len(entries(bed, pid))} usage entries, not {n}\n{bed.daemon.log()[-2000:]}",
    )


def living(bed: Testbed, user: User, lifetime: float, **kw) -> tuple[subprocess.Popen, float]:
    """A victim that exits by itself after `lifetime` seconds, and the wall-clock instant it started."""
    t = time.time()
    proc = bed.victim(user, lifetime=lifetime, **kw)
    return proc, t


def ended(proc: subprocess.Popen) -> float:
    proc.wait(30)
    return time.time()


def test_totals_of_processes_at_known_utilization_and_memory_match_their_lives(ubed, users):
    start(ubed)
    one, t_one = living(ubed, users["owner"], 3.0, gpu=0, mem="2GiB", util=50)
    two, t_two = living(ubed, users["owner"], 3.0, gpu="1,2", mem="1GiB", util=40)  # on two GPUs
    blind, _ = living(ubed, ROOT, 3.0, gpu=2, mem="1GiB")  # no utilization: SM time unknown
    t_end = {p.pid: ended(p) for p in (one, two, blind)}

    (e,) = wait_entries(ubed, one.pid)
    r = record_from_journal(e)
    assert r is not None, e
    assert e["_UID"] == "0" and e["PRIORITY"] == str(journal.USAGE.priority)
    life = t_end[one.pid] - t_one
    assert life - 2 * INTERVAL - SLACK <= r.gpu_seconds <= life
    assert t_one - 0.1 <= r.first_seen and r.last_seen <= t_end[one.pid]
    assert r.gpu_seconds == pytest.approx(r.last_seen - r.first_seen, abs=0.05)
    # the rates are exact: SM time, memory time and energy follow the GPU time (written to the millisecond)
    assert r.sm_seconds == approx(0.5 * r.gpu_seconds) and r.sm_known_seconds == approx(r.gpu_seconds)
    assert r.memory_byte_seconds == approx(2 * GiB * r.gpu_seconds) and r.peak_memory == 2 * GiB
    assert r.energy_joules == approx(100 * r.gpu_seconds)  # alone on a 100 W GPU
    assert (r.uid, r.user, r.device, r.ended, r.processes) == (users["owner"].uid, OWNER, 0, "exited", 1)
    assert e["MESSAGE"].startswith(f"PID {one.pid} (python3, user {OWNER}) on GPU 0: consumed ")

    pair = sorted((record_from_journal(x) for x in wait_entries(ubed, two.pid, 2)), key=lambda x: x.device)
    assert [x.device for x in pair] == [1, 2]
    life = t_end[two.pid] - t_two
    for x in pair:
        assert life - 2 * INTERVAL - SLACK <= x.gpu_seconds <= life
        assert x.sm_seconds == approx(0.4 * x.gpu_seconds)
    assert pair[0].energy_joules == approx(200 * pair[0].gpu_seconds)
    assert pair[1].energy_joules is None and pair[1].energy_known_seconds == 0  # GPU 2 reports no power
    assert "GPUKILL_ENERGY_JOULES" not in next(x for x in entries(ubed, two.pid) if x["GPUKILL_DEVICE_INDEX"] == "2")

    (b,) = wait_entries(ubed, blind.pid)
    rb = record_from_journal(b)
    assert rb.sm_seconds is None and rb.sm_known_seconds == 0 and "GPUKILL_SM_SECONDS" not in b
    assert rb.gpu_seconds > 0 and rb.user == "root"

    # journalctl -o verbose shows the fields, the MESSAGE_ID and the message
    out = subprocess.run(
        ubed.in_journal_ns(
            [
                "journalctl",
                "--no-pager",
                "-o",
                "verbose",
                f"MESSAGE_ID={journal.USAGE.message_id}",
                f"GPUKILL_TARGET_PID={one.pid}",
            ]
        ),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    for field in (
        "GPUKILL_GPU_SECONDS=",
        "GPUKILL_SM_SECONDS=",
        "GPUKILL_MEMORY_BYTE_SECONDS=",
        "GPUKILL_PEAK_MEMORY=2147483648",
        "GPUKILL_ENERGY_JOULES=",
        "GPUKILL_ENDED=exited",
        f"MESSAGE_ID={journal.USAGE.message_id}",
        "GPUKILL_EVENT=usage",
        "at full SM",
    ):
        assert field in out, out


def test_a_restart_in_the_middle_loses_and_doubles_nothing(ubed, users):
    start(ubed)
    through, t_through = living(ubed, users["owner"], 10.0, gpu=0, mem="1GiB", util=50)
    during, _ = living(ubed, users["owner"], 60.0, gpu=1, mem="1GiB", util=25)
    wait_until(lambda: {through.pid, during.pid} <= {p["pid"] for p in ubed.processes()}, 10, "never listed")
    time.sleep(1.5)
    ubed.stop_daemon()  # SIGTERM: the totals saved at stop
    t_stop = time.time()
    saved = ubed.workdir / "state" / STATE_FILE
    assert saved.exists() and (saved.stat().st_mode & 0o777) == 0o600
    assert entries(ubed, through.pid) == [] and entries(ubed, during.pid) == []
    os.kill(during.pid, signal.SIGKILL)  # ends while gpukilld is down
    during.wait(10)
    time.sleep(2.0)  # down for longer than the test's tolerance: the gap must be counted, not lost
    start(ubed)
    t_end = ended(through)

    (e,) = wait_entries(ubed, through.pid)
    r = record_from_journal(e)
    life = t_end - t_through
    # the time the daemon was down is counted at the rates of the last sample before it (within MAX_GAP)
    assert life - 2 * INTERVAL - SLACK <= r.gpu_seconds <= life, (r, life)
    assert r.first_seen < t_stop < r.last_seen and r.ended == "exited"
    assert r.sm_seconds == approx(0.5 * r.gpu_seconds)
    assert r.memory_byte_seconds == approx(GiB * r.gpu_seconds)

    (d,) = wait_entries(ubed, during.pid)
    rd = record_from_journal(d)
    assert rd.ended == "daemon-down" and rd.last_seen <= t_stop  # what it had at the save, nothing after
    assert rd.gpu_seconds >= 1.5 - 2 * INTERVAL - SLACK
    time.sleep(3 * INTERVAL)
    ubed.stop_daemon()
    start(ubed)  # a third start: nothing left open, nothing written again
    time.sleep(5 * INTERVAL)
    assert len(entries(ubed, through.pid)) == 1 and len(entries(ubed, during.pid)) == 1


def test_a_crash_after_a_record_was_written_does_not_write_it_again(ubed, users):
    start(ubed)
    short, _ = living(ubed, users["owner"], 5.0, gpu=0, mem="1GiB", util=10)
    long, t_long = living(ubed, users["owner"], 60.0, gpu=0, mem="1GiB", util=10)
    wait_until(lambda: {short.pid, long.pid} <= {p["pid"] for p in ubed.processes()}, 10, "never listed")
    ubed.stop_daemon()  # saved with both open
    start(ubed)
    short.wait(10)
    wait_entries(ubed, short.pid)  # written: the state was saved without it first
    os.killpg(ubed.daemon.proc.pid, signal.SIGKILL)  # a crash: no save at stop
    ubed.daemon.proc.wait(5)
    ubed.stop_daemon()
    start(ubed)
    wait_until(lambda: long.pid in {p["pid"] for p in ubed.processes()}, 10, "never listed")
    os.kill(long.pid, signal.SIGKILL)
    long.wait(10)
    (e,) = wait_entries(ubed, long.pid)
    assert record_from_journal(e).first_seen < t_long + 2  # carried through both restarts
    time.sleep(4 * INTERVAL)
    assert len(entries(ubed, short.pid)) == 1


def test_usage_off_accounts_nothing(ubed, users):
    ubed.write_conf(usage={"enabled": "no"})
    start(ubed)
    proc, _ = living(ubed, users["owner"], 1.5, gpu=0, mem="1GiB", util=10)
    proc.wait(10)
    time.sleep(6 * INTERVAL)
    assert entries(ubed, proc.pid) == []
    assert not (ubed.workdir / "state" / STATE_FILE).exists()


def sighup(bed: Testbed) -> None:
    """One reload, waited for as systemd does: RELOADING=1, then READY=1."""
    t0 = time.monotonic()
    os.kill(bed.daemon.proc.pid, signal.SIGHUP)
    reloading = bed.daemon.notify.wait_for("RELOADING=1", 10, after=t0)
    assert reloading is not None, bed.daemon.log()
    assert bed.daemon.notify.wait_for("READY=1", 10, after=reloading) is not None, bed.daemon.log()


def test_a_reload_turns_the_accounting_off_and_on(ubed, users):
    start(ubed)
    before, _ = living(ubed, users["owner"], 60.0, gpu=0, mem="1GiB", util=10)
    wait_until(lambda: before.pid in {p["pid"] for p in ubed.processes()}, 10, "never listed")
    ubed.write_conf(usage={"enabled": "no"})
    sighup(ubed)  # off: the open records' totals saved, nothing more accounted
    off, _ = living(ubed, users["owner"], 1.0, gpu=1, mem="1GiB", util=10)
    off.wait(10)
    time.sleep(4 * INTERVAL)
    assert entries(ubed, off.pid) == [] and entries(ubed, before.pid) == []
    ubed.write_conf(usage={"enabled": "yes"})
    sighup(ubed)  # on again: what was saved is taken back
    time.sleep(2 * INTERVAL)
    os.kill(before.pid, signal.SIGKILL)
    before.wait(10)
    (e,) = wait_entries(ubed, before.pid)
    assert record_from_journal(e).ended == "exited"
    assert entries(ubed, off.pid) == []
