"""Guard never acts on borrowed evidence, in the real daemon on the DRM backend: a DRM client passed
to a process of another uid under a per-user memory rule. Part of the hostile-user suite (test_hostile.py),
on its own because it needs the DRM fixture host.

How fd passing looks in /proc: after SCM_RIGHTS, the receiver's fd table holds the very drm_file the sender
opened, so both processes' fdinfo show the same drm-client-id with the same counters. The fixture /proc
(drm_fixtures.DrmHost) mirrors real processes of real users (their stat and status are the kernel's, so start
times and uids are real and kills are real) and gives both the same client's fdinfo.

A: gpkowner's miner shares a 6 GiB client with a process of gpkother that started earlier. Charged to the
   holder that started first, gpkother's, the client would get that process killed by the rule. It is
   charged to no one: nobody is over, nothing of gpkother's is killed or reported.
B: the same with a system account's process (messagebus, as dbus-daemon holding a queued fd): the client is the
   miner's, so the rule stops the miner, and the system process, protected and never charged, lives on.
"""

from __future__ import annotations

import json
import pwd
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
from helpers import testbed
from helpers.drm_fixtures import DrmHost, amdgpu_fdinfo
from helpers.marks import needs_root
from helpers.procs import pid_alive, spawn
from helpers.testbed import ROOT, Testbed, User

from gpukilld import journal as audit

pytestmark = needs_root

GiB = 1 << 30
PDEV = "0000:03:00.0"
RULE = "limit-user-memory"
GRACE, INTERVAL = 1.0, 0.2
POLICY = (
    f"rules:\n  - name: {RULE}\n    scope: per_user\n    action: kill\n    grace_period: {GRACE:g}s\n"
    "    conditions: [{type: user_memory, operator: '>', value: 4GiB}]\n"
)


def system_user() -> User:
    """A system account (uid < 1000) to run a daemon-like holder as: messagebus, as dbus-daemon runs, else daemon."""
    for name in ("messagebus", "daemon"):
        try:
            if pwd.getpwnam(name).pw_uid < testbed.REGULAR_UID_MIN:
                return User.get(name)
        except KeyError:
            continue
    pytest.skip("no system account (messagebus or daemon) to run a holder as")


@pytest.fixture(scope="module")
def drm_bed(users):
    """gpukilld on a fixture host with one amdgpu (render node 128), Guard enforcing POLICY."""
    root = tempfile.mkdtemp(prefix="gpukill-drm-guard-")
    bed = Testbed()
    try:
        host = DrmHost(root)
        host.amdgpu(PDEV, card=0, render=128, vram_used=12 * GiB, unique_id="00c0ffee0000a009")
        conf = host.config(bed.workdir / "gpukilld.conf", backends="drm", interval=INTERVAL)
        policy_dir = bed.workdir / "guard.d"
        policy_dir.mkdir()
        (policy_dir / "10-memory.yaml").write_text(POLICY)
        with open(conf, "a") as f:
            f.write(f"[guard]\npolicy_dir = {policy_dir}\nstate_dir = {bed.workdir / 'state'}\n")
        bed.start_bus()
        bed.start_journal()
        bed.start_daemon()
        yield bed, host
    finally:
        bed.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def guarded(drm_bed):
    bed, host = drm_bed
    before = len(bed.procs)
    yield bed, host
    for proc in bed.procs[before:]:
        testbed._kill_group(proc)
        shutil.rmtree(host.proc / str(proc.pid), ignore_errors=True)
    del bed.procs[before:]


def share_client(
    bed: Testbed, host: DrmHost, holders: list[tuple[subprocess.Popen, int]], client_id: int, vram: int
) -> None:
    """The same drm_file in each holder's fd table, as the receiver of an SCM_RIGHTS message holds it.

    The fixture's fd tables are written one after the other, and a sample between two writes would see one
    holder alone (a sender before it sends). So the client is empty until every holder is listed, and only then
    allocates `vram`: a sample between those two writes still sees both holders of one client."""
    for proc, fd in holders:
        host.mirror(proc.pid)
        host.open_drm(proc.pid, fd, 128, amdgpu_fdinfo(client_id, PDEV, vram=0))
    for proc, _ in holders:
        bed.wait_listed(proc.pid)
    for proc, fd in holders:
        host.set_fdinfo(proc.pid, fd, 128, amdgpu_fdinfo(client_id, PDEV, vram=vram, gfx_ns=10**9))


def guard_entries(bed: Testbed, pid: int) -> list[dict]:
    """Every journal entry in which the guard or the kill path took PID as its target."""
    found = []
    for kind in (audit.GUARD_ACTION, audit.GUARD_DRY_RUN, audit.KILL):
        found += bed.journal(MESSAGE_ID=kind.message_id, GPUKILL_TARGET_PID=str(pid))
    return found + bed.journal(MESSAGE_ID=audit.GUARD_VIOLATION.message_id, GPUKILL_TARGET_PIDS=str(pid))


def guard_status(bed: Testbed) -> dict:
    r = bed.ctl(ROOT, "guard", "status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def serving(bed: Testbed, user) -> None:
    """As in test_hostile.py: another user's list answers within 2 s, from the same gpukilld."""
    t0 = time.monotonic()
    r = bed.ctl(user, "list")
    assert r.returncode == 0 and time.monotonic() - t0 < 2.0, r.stderr
    assert bed.daemon.proc.poll() is None


def test_a_client_shared_with_another_user_is_charged_to_no_one(guarded, users):
    bed, host = guarded
    other = spawn(bed, users["other"])  # started first: the holder a first-holder rule would charge
    time.sleep(0.05)  # a later start time, in clock ticks
    miner = spawn(bed, users["owner"])
    share_client(bed, host, [(other, 5), (miner, 7)], client_id=40, vram=6 * GiB)
    time.sleep(3 * INTERVAL)
    procs = bed.listed()
    for p in (other, miner):
        assert procs[p.pid]["device_id"] == "GPU-00c0ffee0000a009" and procs[p.pid]["gpu_memory"] is None
    evaluations = guard_status(bed)["evaluations"]

    time.sleep(GRACE + 10 * INTERVAL + 1.0)  # the rule would have fired and its grace run out by now
    assert pid_alive(other.pid), "a process of gpkother was killed for a client gpkowner holds too"
    assert pid_alive(miner.pid)
    st = guard_status(bed)
    assert st["evaluations"] > evaluations + 5, "the guard did not evaluate meanwhile"
    rule = next(r for r in st["rules"] if r["name"] == RULE)
    assert (rule["triggers"], rule["kills"]) == (0, 0), rule
    assert st["graces"] == [] and st["windows"] == []
    assert guard_entries(bed, other.pid) == [] and guard_entries(bed, miner.pid) == []
    assert bed.journal(MESSAGE_ID=audit.GUARD_VIOLATION.message_id, GPUKILL_SUBJECT="user gpkother") == []
    serving(bed, users["admin"])


def test_a_client_shared_with_a_system_daemon_is_the_users(guarded, users):
    bed, host = guarded
    daemon = spawn(bed, system_user())  # as dbus-daemon holding the fd of a message it queued
    time.sleep(0.05)
    miner = spawn(bed, users["owner"])
    share_client(bed, host, [(daemon, 9), (miner, 7)], client_id=41, vram=6 * GiB)
    t0 = time.monotonic()

    deadline = t0 + GRACE + 15
    while miner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert miner.returncode == -signal.SIGTERM, "the miner's usage was not charged to the miner"
    assert time.monotonic() - t0 >= GRACE
    time.sleep(3 * INTERVAL)
    assert pid_alive(daemon.pid), "the system account's process was killed"
    assert guard_entries(bed, daemon.pid) == []

    violation = bed.wait_journal(
        MESSAGE_ID=audit.GUARD_VIOLATION.message_id, GPUKILL_RULE=RULE, GPUKILL_TARGET_PIDS=str(miner.pid)
    )
    assert violation and violation[0]["GPUKILL_SUBJECT"] == "user gpkowner"
    assert "user_memory 6.0 GiB" in violation[0]["GPUKILL_REASON"], violation[0]
    action = bed.wait_journal(MESSAGE_ID=audit.GUARD_ACTION.message_id, GPUKILL_TARGET_PID=str(miner.pid))
    assert action and action[0]["GPUKILL_RESULT"] == "terminated"
    # Now the only holder, the system process is charged the client (the kernel keeps it alive for it), and
    # Guard still leaves it alone: a system account is protected whatever it holds.
    time.sleep(GRACE + 5 * INTERVAL)
    assert pid_alive(daemon.pid) and guard_entries(bed, daemon.pid) == []
    assert bed.listed()[daemon.pid]["gpu_memory"] == 6 * GiB
    serving(bed, users["admin"])
