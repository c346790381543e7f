"""The rogue-activity audit in the real daemon (AuditRogue, `gpukillctl audit`, Guard's rogue_score), on real
processes on the simulated backend, with real polkitd and journald.

The miner is a renamed one: a copy of python3 under /tmp, its name set to "python3" with prctl, a stratum URL
in its command line and a TCP connection to a pool port (a listener of the test's own on loopback, whose port
the bed's [audit] pool_ports names). The rules one by one are tests/test_rogue.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time

import pytest
from helpers import pools
from helpers.marks import needs_root
from helpers.testbed import ADMIN_RULES, PYTHON, ROOT, SYSTEM_PYTHON, Testbed, User
from helpers.waiting import wait_until

from gpukilld import journal as audit

pytestmark = needs_root

INTERVAL = 0.3
IDLE_AFTER = 3.0
STRATUM = "stratum+tcp://pool.example.net:3333"
MINER_CODE = """\
import ctypes, socket, sys, time
ctypes.CDLL(None).prctl(15, b"python3", 0, 0, 0)  # PR_SET_NAME: it passes for a trainer by its name
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("ready", flush=True)
time.sleep(600)
"""


def start_miner(bed: Testbed, user: User, exe: str, port: int, ready: bool = True) -> subprocess.Popen:
    """The miner, once it said it is connected; with ready=False, as soon as it runs (a Guard in force may kill
    it on its command line and executable alone, 75 points, before it connects or says anything)."""
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUKILL_SIM_GPU": "0",
        "GPUKILL_SIM_SCOPE": bed.scope,
        "GPUKILL_SIM_MEM": "6GiB",
        "GPUKILL_SIM_UTIL": "99",
    }
    proc = subprocess.Popen(
        [exe, "-c", MINER_CODE, str(port), "-o", STRATUM, "--threads", "8"],
        stdout=subprocess.PIPE,
        env=env,
        cwd="/",
        start_new_session=True,
        **user.popen_kwargs(),
    )
    bed.procs.append(proc)
    if ready:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def findings(bed: Testbed, user: User) -> list[dict]:
    r = bed.ctl(user, "audit", "--json")
    assert r.returncode == 0, r
    return json.loads(r.stdout)["findings"]


def finding_of(bed: Testbed, user: User, pid: int, kind: str) -> dict | None:
    return next((f for f in findings(bed, user) if f["pid"] == pid and f["kind"] == kind), None)


@pytest.fixture(scope="module")
def rbed(users):
    """A private system with the audit's thresholds made short, and a pool of our own on loopback."""
    b = Testbed()
    # connections complete in the backlog; nobody needs to accept them. Its port lies outside the ephemeral range
    # (the audit ignores pool ports inside it), on 127.0.0.1 or another loopback address.
    pool = pools.listen(pools.free_pool_port(), 16)
    exe = f"/tmp/x-{b.scope}"  # the miner's executable, under /tmp
    shutil.copy(SYSTEM_PYTHON, exe)
    try:
        (b.workdir / "guard.d").mkdir()
        b.write_conf(
            audit={"idle_after": IDLE_AFTER, "idle_min_memory": "1MiB", "pool_ports": f"{pool.getsockname()[1]} 3333"}
        )
        b.start_system(args=["--sample-interval", str(INTERVAL)])
        b.pool_port, b.miner_exe = pool.getsockname()[1], exe  # type: ignore[attr-defined]
        yield b
    finally:
        b.stop()
        pool.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(exe)


@pytest.fixture
def victims(rbed):
    before = len(rbed.procs)
    yield rbed
    rbed.kill_since(before)


def test_a_renamed_miner_is_found_with_its_evidence(victims, users):
    bed = victims
    owner, other = users["owner"], users["other"]
    miner = start_miner(bed, owner, bed.miner_exe, bed.pool_port)
    trainer = bed.victim(owner, gpu=0, mem="8GiB", util=95, comm="python3")
    bed.wait_listed(trainer.pid, comm="python3")
    assert bed.wait_listed(miner.pid, comm="python3")["exe"] == bed.miner_exe

    found = wait_until(lambda: finding_of(bed, ROOT, miner.pid, "miner"), 10, "the miner was not found")
    rules = {e["rule"]: e["detail"] for e in found["evidence"]}
    assert set(rules) == {"stratum-url", "exe-tmp", "pool-port"}, found
    assert STRATUM in rules["stratum-url"] and bed.miner_exe in rules["exe-tmp"]
    assert f"127.0.0.1:{bed.pool_port}" in rules["pool-port"]
    assert (found["score"], found["comm"], found["user"], found["devices"]) == (100, "python3", "gpkowner", [0])
    assert found["start_time"] == bed.wait_listed(miner.pid)["start_time"]
    assert not [f for f in findings(bed, ROOT) if f["pid"] == trainer.pid]  # a trainer by the same name is not

    # its owner sees it in full, as a table with the evidence
    r = bed.ctl(owner, "audit")
    assert r.returncode == 0 and "miner" in r.stdout and STRATUM in r.stdout and "+50 stratum-url" in r.stdout, r
    # another user sees the process listed with its program only, so none of this evidence: nothing at all
    assert miner.pid in bed.listed(other)
    assert not [f for f in findings(bed, other) if f["pid"] == miner.pid]
    assert "stratum" not in bed.ctl(other, "audit", "--json").stdout
    # the gpu-kill spelling runs the same audit
    r = bed.run_as(owner, [PYTHON, "-m", "gpukillctl.cli.compat", "--audit", "--rogue", "--output", "json"])
    assert r.returncode == 0 and any(f["pid"] == miner.pid for f in json.loads(r.stdout)["findings"]), r


def test_a_forgotten_notebook_is_found_after_the_threshold(victims, users):
    bed = victims
    owner, other = users["owner"], users["other"]
    # The daemon cannot see the notebook before it is started, so its idle time counts from after `started`:
    # a finding before IDLE_AFTER has passed since then is early. (A reference taken once both are listed
    # is later than the daemon's first sighting by the listing's polls, which a slow machine stretches.)
    started = time.monotonic()
    notebook = bed.victim(owner, gpu=1, mem="2GiB", util=0, comm="notebook")
    busy = bed.victim(owner, gpu=1, mem="2GiB", util=40, comm="busy")
    bed.wait_listed(busy.pid, comm="busy")
    bed.wait_listed(notebook.pid, comm="notebook")
    if time.monotonic() - started < IDLE_AFTER - 1.0:  # listed in good time (a second to ask): not yet found
        assert finding_of(bed, ROOT, notebook.pid, "idle") is None

    found = wait_until(lambda: finding_of(bed, ROOT, notebook.pid, "idle"), 10, "the notebook was not found")
    assert time.monotonic() - started >= IDLE_AFTER
    assert [(e["rule"], e["points"]) for e in found["evidence"]] == [("idle-memory", 50)]
    assert "2.0 GiB" in found["evidence"][0]["detail"] and found["gpu_memory"] == 2 << 30
    assert finding_of(bed, ROOT, busy.pid, "idle") is None
    # GPU figures are for everyone who may list the process: another user sees this finding, name included
    seen = finding_of(bed, other, notebook.pid, "idle")
    assert seen is not None and seen["comm"] == "notebook" and seen["score"] == 50


def test_a_guard_rule_on_rogue_score_kills_the_miner_and_not_the_trainer(victims, users):
    bed = victims
    owner = users["owner"]
    policy = bed.workdir / "rogue.yaml"
    policy.write_text(
        "rules:\n  - name: no-miners\n    action: kill\n    conditions:\n"
        "      - {type: rogue_score, operator: '>=', value: 70}\n"
        "      - {type: rogue_kind, operator: '==', value: miner}\n"
    )
    trainer = bed.victim(owner, gpu=0, mem="8GiB", util=95, comm="python3")
    bed.wait_listed(trainer.pid, comm="python3")
    try:
        for args in (["load", str(policy)], ["dry-run", "off"], ["enable"]):
            r = bed.ctl(ROOT, "guard", *args)
            assert r.returncode == 0, r
        # the proc connector shows the miner to the daemon at its exec, so the kill may come before "ready"
        miner = start_miner(bed, owner, bed.miner_exe, bed.pool_port, ready=False)
        wait_until(lambda: miner.poll() is not None, 15, "the guard did not kill the miner")
        kill = wait_until(
            lambda: bed.journal(GPUKILL_TARGET_PID=str(miner.pid), MESSAGE_ID=audit.KILL.message_id),
            10,
            "the kill is not in the journal",
        )
        assert kill[0]["GPUKILL_INITIATOR"] == "guard:no-miners"
        time.sleep(3 * INTERVAL)
        assert trainer.poll() is None  # the trainer, by the same name on the same GPU, lives
    finally:
        bed.ctl(ROOT, "guard", "disable")


@pytest.fixture
def noaccess(fresh_bed, users):
    """gpukilld reading a proc mounted with hidepid=noaccess (tests/test_privacy.py's way)."""
    bed = fresh_bed
    proc = bed.workdir / "proc"
    proc.mkdir()
    subprocess.run(bed.in_journal_ns(["mount", "-t", "proc", "-o", "hidepid=noaccess", "proc", str(proc)]), check=True)
    exe = f"/tmp/x-{bed.scope}"
    shutil.copy(SYSTEM_PYTHON, exe)
    pool = pools.listen(pools.free_pool_port(), 16)
    try:
        bed.start_polkit([ADMIN_RULES])
        bed.write_conf(
            paths={"proc": proc},
            audit={"idle_after": 0, "idle_min_memory": "1MiB", "pool_ports": pool.getsockname()[1]},
        )
        bed.start_daemon(args=["--sample-interval", str(INTERVAL)])
        yield bed, exe, pool.getsockname()[1]
    finally:
        bed.stop_daemon()
        subprocess.run(bed.in_journal_ns(["umount", "-l", str(proc)]), check=False)
        pool.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(exe)


def test_hidepid_keeps_the_evidence_from_other_users(noaccess, users):
    bed, exe, port = noaccess
    owner, other, admin = users["owner"], users["other"], users["admin"]
    miner = start_miner(bed, owner, exe, port)
    notebook = bed.victim(owner, gpu=1, mem="2GiB", util=0, comm="notebook")
    wait_until(
        lambda: finding_of(bed, ROOT, miner.pid, "miner") and finding_of(bed, ROOT, notebook.pid, "idle"),
        10,
        "the findings did not come",
    )
    # the owner and a viewer of every process (polkit's view-all, through the example rules) see it all
    for full in (owner, admin):
        assert {e["rule"] for e in finding_of(bed, full, miner.pid, "miner")["evidence"]} == {
            "stratum-url",
            "exe-tmp",
            "pool-port",
        }
    # another user, to whom /proc shows only that the processes exist: GPU figures, no name, no evidence of
    # the command line, the executable or the sockets
    seen = findings(bed, other)
    assert not [f for f in seen if f["kind"] == "miner"]
    idle = next(f for f in seen if f["pid"] == notebook.pid)
    assert (idle["kind"], idle["comm"], idle["user"]) == ("idle", None, "gpkowner")
    text = json.dumps(seen)
    assert "stratum" not in text and exe not in text and "notebook" not in text
