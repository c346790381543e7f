"""A kill is done when the GPU memory is back: the answer (reclaimed, held by whom, stuck and why) through the bus
reply, ProcessKilled, the journal and the CLI; workloads reclaimed in one act (kill --tree, --unit)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.marks import needs_root
from helpers.testbed import SYSTEM_PYTHON
from helpers.workloads import frozen, trainer, why_no_freezer

from gpukill.units import format_duration
from gpukilld import journal as audit

pytestmark = needs_root


def _grace(seconds: float) -> dict:
    return {"$variant": ["d", seconds]}


def _v(d: dict) -> dict:
    """An a{sv} from the call helper, its variants unwrapped (nested records too)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and "$variant" in v:
            v = v["$variant"][1]
        if isinstance(v, dict):
            v = _v(v)
        elif isinstance(v, list):
            v = [_v(e) if isinstance(e, dict) else e for e in v]
        out[k] = v
    return out


@pytest.fixture
def workloads(victims):
    made = []
    yield made
    for w in made:
        w.cleanup()


def _listed_all(bed, pids):
    for pid in pids:
        bed.wait_listed(pid)


def test_orphaned_workers_are_named_in_the_answer_the_signal_and_the_journal(victims, users, workloads):
    bed = victims
    rec = bed.record_signals(users["owner"])
    w = trainer(bed, users["owner"], workers=4, mem="1GiB")
    workloads.append(w)
    _listed_all(bed, [w.pid, *w.workers])
    start = bed.wait_listed(w.pid)["start_time"]
    r = bed.manager(users["owner"], "KillProcessReport", "uta{sv}", [w.pid, start, {"grace": _grace(2.0)}])
    assert r.ok, r
    report = _v(r.body[0])
    assert report["outcome"] == "terminated"
    rc = report["reclaim"]
    assert rc["verdict"] == "held", rc
    assert sorted(h["pid"] for h in rc["holders"]) == sorted(w.workers)
    assert {h["relation"] for h in rc["holders"]} == {"orphan"}  # their parent died: reparented
    assert all(h["parent"] != w.pid and h["device"] == 0 for h in rc["holders"])
    assert rc["held"] == 4 << 30 and rc["reclaimed"] == 1 << 30
    assert all(w.alive(p) for p in w.workers), "a kill of the trainer alone signals no worker"
    sig = rec.wait_for("ProcessKilled", where=lambda b: b[0] == w.pid)
    assert sig is not None and len(sig["body"]) == 9
    assert _v(sig["body"][8])["verdict"] == "held"
    entry = bed.wait_journal(GPUKILL_TARGET_PID=str(w.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entry, "the kill is audited"
    e = entry[0]
    assert e["GPUKILL_RECLAIM"] == "held" and e["GPUKILL_HELD_BYTES"] == str(4 << 30)
    assert sorted(int(h.split(":")[0]) for h in e["GPUKILL_HOLDERS"].split()) == sorted(w.workers)
    assert "still held" in e["MESSAGE"] and str(w.workers[0]) in e["MESSAGE"]


def test_the_cli_says_memory_held_with_an_exit_code_of_its_own(victims, users, workloads):
    bed = victims
    w = trainer(bed, users["owner"], workers=2, mem="512MiB")
    workloads.append(w)
    _listed_all(bed, [w.pid, *w.workers])
    cli = bed.ctl(users["owner"], "kill", str(w.pid), "--grace", "2")
    assert cli.returncode == 14, cli
    assert cli.stderr.count("\n") == 1 and "still held" in cli.stderr
    assert all(f"PID {p} " in cli.stderr for p in w.workers), cli.stderr
    assert "orphan" in cli.stderr


def test_a_lone_process_is_reclaimed(victims, users):
    bed = victims
    victim = bed.victim(users["owner"], gpu=0, mem="2GiB")
    bed.wait_listed(victim.pid)
    cli = bed.ctl(users["owner"], "kill", str(victim.pid))
    assert cli.returncode == 0, cli
    assert "terminated; GPU memory reclaimed (2.0 GiB)" in cli.stdout, cli.stdout


def test_the_answer_says_how_long_after_sigterm_the_memory_was_back(victims, users):
    """The seconds from SIGTERM to the sample that showed the memory back, in the bus reply, ProcessKilled and
    the journal, the same figure in each; none while the memory is still held."""
    bed = victims
    rec = bed.record_signals(users["owner"])
    victim = bed.victim(users["owner"], gpu=0, mem="2GiB")
    start = bed.wait_listed(victim.pid)["start_time"]
    t0 = time.monotonic()
    r = bed.manager(users["owner"], "KillProcessReport", "uta{sv}", [victim.pid, start, {"grace": _grace(2.0)}])
    took = time.monotonic() - t0
    assert r.ok, r
    rc = _v(r.body[0])["reclaim"]
    assert rc["verdict"] == "reclaimed" and rc["reclaimed"] == 2 << 30 and rc["first_signal"] == "SIGTERM", rc
    # the victim dies of SIGTERM at once: the figure is the wait for the sample that no longer lists it
    assert 0 < rc["seconds"] <= took, (rc, took)
    sig = rec.wait_for("ProcessKilled", where=lambda b: b[0] == victim.pid)
    assert sig is not None and _v(sig["body"][8])["seconds"] == rc["seconds"]
    e = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id)[0]
    assert e["GPUKILL_RECLAIM_SECONDS"] == f"{rc['seconds']:.3f}" and e["GPUKILL_RECLAIM_FIRST_SIGNAL"] == "SIGTERM"
    assert f"GPU memory reclaimed (2.0 GiB) {format_duration(rc['seconds'])} after SIGTERM" in e["MESSAGE"], e
    # memory still held: no figure anywhere
    w = trainer(bed, users["owner"], workers=1, mem="512MiB")
    try:
        _listed_all(bed, [w.pid, *w.workers])
        start = bed.wait_listed(w.pid)["start_time"]
        r = bed.manager(users["owner"], "KillProcessReport", "uta{sv}", [w.pid, start, {"grace": _grace(2.0)}])
        rc = _v(r.body[0])["reclaim"]
        assert rc["verdict"] == "held" and "seconds" not in rc and "first_signal" not in rc, rc
        e = bed.wait_journal(GPUKILL_TARGET_PID=str(w.pid), MESSAGE_ID=audit.KILL.message_id)[0]
        assert "GPUKILL_RECLAIM_SECONDS" not in e, e
    finally:
        w.cleanup()


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"ignore_term": True},
        {"helpers": 2},
        {"stopped": True},
    ],
    ids=["workers", "ignoring-sigterm", "non-gpu-helpers", "stopped"],
)
def test_kill_tree_reclaims_the_workload(victims, users, workloads, variant):
    bed = victims
    stopped = variant.get("stopped", False)
    w = trainer(bed, users["owner"], workers=4, mem="1GiB", **{k: v for k, v in variant.items() if k != "stopped"})
    workloads.append(w)
    _listed_all(bed, [w.pid, *w.workers])
    if stopped:  # a stopped trainer and workers: SIGTERM waits for a SIGCONT that never comes, SIGKILL does not
        for pid in [w.pid, *w.workers]:
            os.kill(pid, signal.SIGSTOP)
    cli = bed.ctl(users["owner"], "kill", "--tree", str(w.pid), "--force", "--grace", "0.5")
    assert cli.returncode == 0, cli
    assert f"tree of PID {w.pid}: GPU memory reclaimed (5.0 GiB)" in cli.stdout, cli.stdout
    assert w.left() == [], "every GPU process of the tree ended"
    # non-GPU helpers of the tree are never signalled: listed as left running
    assert all(w.alive(h) for h in w.helpers)
    assert all(f"PID {h} (python3) not on a GPU: left running" in cli.stdout for h in w.helpers), cli.stdout
    assert cli.stdout.count("\n") == 1 + 4 + len(w.helpers) + 1  # one line each, then the GPU's


def test_kill_unit_reclaims_a_double_forked_worker(victims, users, workloads):
    """A worker that left the tree (double fork, own session) before the kill is still in the unit's cgroup."""
    from helpers.cgroups import Cgroups, systemd_roots, why_no_cgroups

    if why := why_no_cgroups():
        pytest.skip(why)
    bed = victims
    unit = f"train-{bed.scope[-6:]}.service".replace("_", "-")
    groups = Cgroups()
    dirs = [groups.make(root, f"system.slice/{unit}") for root in systemd_roots()]
    w = trainer(bed, users["owner"], workers=2, mem="1GiB", double_fork=True)
    workloads.append(w)
    try:
        for pid in [w.pid, *w.workers]:
            for d in dirs:
                (d / "cgroup.procs").write_text(str(pid))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            units = {p["pid"]: p.get("unit") for p in bed.processes()}
            if all(units.get(p) == unit for p in [w.pid, *w.workers]):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the unit is not listed: {units}")
        # kill PID alone names the escaped worker by its unit
        cli = bed.ctl(users["owner"], "kill", str(w.pid), "--grace", "2")
        assert cli.returncode == 14, cli
        assert f"PID {w.workers[-1]} " in cli.stderr and "unit" in cli.stderr, cli.stderr
        assert f"gpukillctl kill --unit {unit}" in cli.stderr
        cli = bed.ctl(users["owner"], "kill", "--unit", unit, "--force", "--grace", "0.5")
        assert cli.returncode == 0, cli
        assert f"unit {unit}: GPU memory reclaimed" in cli.stdout, cli.stdout
        assert w.left() == []
    finally:
        w.cleanup()
        groups.cleanup()


def test_tree_of_a_reused_pid_signals_nothing(victims, users, workloads, alive):
    bed = victims
    w = trainer(bed, users["owner"], workers=1, mem="1GiB")
    workloads.append(w)
    listed = bed.wait_listed(w.pid)
    for stale in (listed["start_time"] - 1, listed["start_time"] + 1):
        r = bed.manager(
            users["root"], "KillWorkload", "a{sv}a{sv}", [{"tree": {"$variant": ["(ut)", [w.pid, stale]]}}, {}]
        )
        assert r.error == "org.gpukill1.Error.ProcessChanged", r
    time.sleep(0.3)
    assert w.left() == [w.pid, *w.workers], "nothing may be signalled on a start-time mismatch"


def _python_as(bed, user) -> Path:
    """A setuid copy of the system's Python that runs as `user`: another user's helper in one's tree."""
    helper_dir = bed.workdir / "setuid"
    helper_dir.mkdir(exist_ok=True)
    os.chmod(helper_dir, 0o755)
    helper = helper_dir / "python-as-other"
    shutil.copy2(os.path.realpath(SYSTEM_PYTHON), helper)
    os.chown(helper, user.uid, user.gid)
    os.chmod(helper, 0o4755)
    return helper


def test_another_users_setuid_helper_in_ones_tree_is_refused_and_reported(victims, users, workloads, tmp_path):
    """The owner's trainer runs a setuid helper that becomes the other user (real uid too): polkit refuses the
    owner its kill, and the answer lists it, not stopped, beside the owner's killed processes."""
    bed = victims
    helper = _python_as(bed, users["other"])
    code = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([{str(helper)!r}, '-c', 'import os, time; u = os.geteuid(); "
        "os.setresuid(u, u, u); print(os.getuid(), flush=True); time.sleep(3600)'], stdout=subprocess.PIPE)\n"
        "print(p.pid, p.stdout.readline().decode().strip(), flush=True)\ntime.sleep(3600)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "GPUKILL_SIM_GPU": "0", "GPUKILL_SIM_SCOPE": bed.scope, "GPUKILL_SIM_MEM": "1GiB"}
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", code],
        stdout=subprocess.PIPE,
        env=env,
        cwd="/",
        start_new_session=True,
        **users["owner"].popen_kwargs(),
    )
    bed.procs.append(proc)
    child, child_uid = proc.stdout.readline().split()
    child = int(child)
    assert int(child_uid) == users["other"].uid, "the helper became the other user"
    assert bed.wait_listed(child)["uid"] == users["other"].uid
    start = bed.wait_listed(proc.pid)["start_time"]
    cli = bed.ctl(users["owner"], "kill", "--tree", str(proc.pid), "--grace", "2")
    try:
        assert cli.returncode == 4, cli  # access denied: the first failure
        assert f"PID {proc.pid} (python3) terminated" in cli.stdout
        assert f"PID {child} " in cli.stderr and "not stopped" in cli.stderr, cli.stderr
        assert proc.wait(5) is not None
        assert os.path.exists(f"/proc/{child}"), "the other user's helper is never signalled"
        denied = bed.wait_journal(GPUKILL_TARGET_PID=str(child), MESSAGE_ID=audit.KILL_DENIED.message_id)
        assert denied, "polkit's refusal is audited"
        r = bed.manager(
            users["root"], "KillWorkload", "a{sv}a{sv}", [{"tree": {"$variant": ["(ut)", [proc.pid, start]]}}, {}]
        )
        assert r.error == "org.gpukill1.Error.NoSuchProcess", r
    finally:
        subprocess.run(["kill", "-9", str(child)], check=False)


def test_a_process_stuck_after_sigkill_gets_its_reason_and_the_reset(victims, users, workloads):
    if why := why_no_freezer():
        pytest.skip(why)
    bed = victims
    rec = bed.record_signals(users["owner"])
    w = frozen(bed, users["owner"], mem="1GiB")
    workloads.append(w)
    listed = bed.wait_listed(w.pid)
    r = bed.manager(
        users["owner"],
        "KillProcessReport",
        "uta{sv}",
        [w.pid, listed["start_time"], {"force": {"$variant": ["b", True]}, "grace": _grace(0.2)}],
    )
    assert r.ok, r
    report = _v(r.body[0])
    assert report["outcome"] == "still-alive"
    rc = report["reclaim"]
    assert rc["verdict"] == "stuck"
    assert rc["reason"].startswith(f"uninterruptible (D), frozen by the cgroup freezer (/{w.frozen.name}): "), rc
    assert rc["remedy"] == f"gpukillctl reset {listed['device']}"
    assert w.alive(w.pid), "the fixture outlives SIGKILL"
    sig = rec.wait_for("ProcessKilled", where=lambda b: b[0] == w.pid)
    assert sig is not None and _v(sig["body"][8])["verdict"] == "stuck"
    e = bed.wait_journal(GPUKILL_TARGET_PID=str(w.pid), MESSAGE_ID=audit.KILL.message_id)[0]
    assert e["GPUKILL_RECLAIM"] == "stuck" and w.frozen.name in e["GPUKILL_STUCK_REASON"]
    assert e["GPUKILL_REMEDY"] == f"gpukillctl reset {listed['device']}"
    cli = bed.ctl(users["owner"], "kill", str(w.pid), "--force", "--grace", "0.2")
    assert cli.returncode == 10, cli
    assert "still alive after SIGKILL: uninterruptible (D)" in cli.stderr
    assert f"gpukillctl reset {listed['device']}" in cli.stderr and cli.stderr.count("\n") == 1


def test_selection_errors_are_one_line(victims, users):
    bed = victims
    invalid = "org.freedesktop.DBus.Error.InvalidArgs"
    for sel, err in [
        ({}, invalid),
        ({"unit": {"$variant": ["s", "no unit"]}}, invalid),
        ({"container": {"$variant": ["s", "xyz"]}}, invalid),
        ({"tree": {"$variant": ["s", "1"]}}, invalid),
        ({"tree": {"$variant": ["(ut)", [1, 0]]}}, "org.gpukill1.Error.ProcessChanged"),
        ({"bogus": {"$variant": ["s", "x"]}}, invalid),
        ({"job": {"$variant": ["s", "12_3"]}}, invalid),
        ({"job": {"$variant": ["u", 12]}}, invalid),
    ]:
        r = bed.manager(users["owner"], "KillWorkload", "a{sv}a{sv}", [sel, {}])
        assert r.error == err and "\n" not in r.message, (sel, r)
    cli = bed.ctl(users["owner"], "kill", "--unit", "not a unit")
    assert cli.returncode == 2 and "Traceback" not in cli.stderr
    cli = bed.ctl(users["owner"], "kill", "--unit", "nothing-here.service")  # no such unit: a typo, not "none"
    assert cli.returncode == 15 and cli.stderr == (
        "gpukillctl: no such unit 'nothing-here.service' on this host "
        "(systemd has no unit file and no running unit of that name)\n"
    ), cli


GUARD_POLICY = """rules:
  - name: stop-trainers
    conditions: [{type: process_name, operator: ==, value: trainer}]
    action: kill
    force: true
    kill_grace: 1s
    kill_scope: %s
"""


@pytest.mark.parametrize("kill_scope", ["tree", "process"])
def test_guard_with_kill_scope_tree_leaves_no_worker_behind(users, tmp_path, kill_scope):
    """The rule names the trainer alone (its workers are python3): with kill_scope tree its kill takes every
    worker, SIGTERM-ignoring ones too; with the default (process) the workers stay, named as holders."""
    from helpers.testbed import Testbed
    from helpers.waiting import wait_until

    bed = Testbed()
    w = None
    try:
        (bed.workdir / "guard.d").mkdir(exist_ok=True)
        bed.start_system(args=["--sample-interval", "0.3"])
        w = trainer(bed, users["owner"], workers=4, mem="1GiB", ignore_term=True, comm="trainer")
        _listed_all(bed, [w.pid, *w.workers])
        policy = tmp_path / "scoped.yaml"
        policy.write_text(GUARD_POLICY % kill_scope)
        policy.chmod(0o644)
        bed.enforce(policy)
        assert wait_until(lambda: not w.alive(w.pid), 20), "the guard never killed the trainer"
        entry = bed.wait_journal(GPUKILL_TARGET_PID=str(w.pid), MESSAGE_ID=audit.KILL.message_id)[0]
        assert entry["GPUKILL_INITIATOR"] == "guard:stop-trainers"
        if kill_scope == "tree":
            assert wait_until(lambda: w.left() == [], 10), f"workers left behind: {w.left()}"
            assert entry["GPUKILL_RECLAIM"] == "reclaimed" and entry["GPUKILL_SELECTION"] == f"tree of PID {w.pid}"
            for pid in w.workers:
                killed = bed.wait_journal(GPUKILL_TARGET_PID=str(pid), MESSAGE_ID=audit.KILL.message_id)
                assert killed and killed[0]["GPUKILL_INITIATOR"] == "guard:stop-trainers"
        else:
            time.sleep(1.0)
            assert sorted(w.left()) == sorted(w.workers), "a process-scoped kill takes the trainer alone"
            assert entry["GPUKILL_RECLAIM"] == "held"
            assert sorted(int(h.split(":")[0]) for h in entry["GPUKILL_HOLDERS"].split()) == sorted(w.workers)
    finally:
        if w is not None:
            w.cleanup()
        bed.stop()


SCOPED_TREE = r"""
import ctypes, json, subprocess, sys, time
worker = "import ctypes, sys, time\nif sys.argv[1]:\n    ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)\n" \
         "print('ready', flush=True)\ntime.sleep(3600)\n"
kids = [subprocess.Popen([sys.executable, "-c", worker, name], stdout=subprocess.PIPE)
        for name in ("", "ckpt-writer", "", "")]
as_other = "import os, time; u = os.geteuid(); os.setresuid(u, u, u); print('ready', flush=True); time.sleep(3600)"
kids.append(subprocess.Popen([sys.argv[1], "-c", as_other], stdout=subprocess.PIPE))
for k in kids:
    k.stdout.readline()
ctypes.CDLL(None).prctl(15, b"trainer", 0, 0, 0)
print(json.dumps([k.pid for k in kids]), flush=True)
time.sleep(3600)
"""

SCOPED_POLICY = """max_kills_per_cycle: %d
exemptions: {users: [%s]}
rules:
  - name: stop-trainers
    conditions: [{type: process_name, operator: ==, value: trainer}]
    action: kill
    force: true
    kill_grace: 1s
    kill_scope: tree
    exemptions: {processes: ['ckpt-*'], units: ['keep-*.service']}
"""


def test_guard_kill_scope_leaves_exempt_and_protected_members_running_and_names_them(users, tmp_path):
    """A trainer's tree under kill_scope tree: its plain worker goes with it; a worker exempt by name, one exempt
    by unit, one in a protected system unit and another user's (exempt by the global exemptions) are alive
    afterwards, each named with why in the journal and in guard status."""
    from helpers.cgroups import Cgroups, systemd_roots, why_no_cgroups
    from helpers.testbed import Testbed
    from helpers.waiting import wait_until

    if why := why_no_cgroups():
        pytest.skip(why)
    bed = Testbed()
    groups = Cgroups()
    kids: list[int] = []
    try:
        tag = bed.scope[-6:].replace("_", "-")
        keep, protect = f"keep-{tag}.service", f"protect-{tag}.service"
        (bed.workdir / "guard.d").mkdir(exist_ok=True)
        bed.write_conf(guard={"protected_units": protect})
        bed.start_system(args=["--sample-interval", "0.3"])
        helper = _python_as(bed, users["other"])
        env = {
            "PATH": "/usr/bin:/bin",
            "GPUKILL_SIM_GPU": "0",
            "GPUKILL_SIM_SCOPE": bed.scope,
            "GPUKILL_SIM_MEM": "1GiB",
        }
        proc = subprocess.Popen(
            [SYSTEM_PYTHON, "-c", SCOPED_TREE, str(helper)],
            stdout=subprocess.PIPE,
            env=env,
            cwd="/",
            start_new_session=True,
            **users["owner"].popen_kwargs(),
        )
        bed.procs.append(proc)
        kids = json.loads(proc.stdout.readline())
        plain, named, in_keep, in_protect, others = kids
        for unit, pid in ((keep, in_keep), (protect, in_protect)):
            for root in systemd_roots():
                (groups.make(root, f"system.slice/{unit}") / "cgroup.procs").write_text(str(pid))
        assert wait_until(
            lambda: {p["pid"]: (p["comm"], p.get("unit")) for p in bed.processes()}.get(in_keep) == ("python3", keep),
            10,
        ), "the unit is not listed"
        bed.wait_listed(named, comm="ckpt-writer")
        for pid in (proc.pid, plain, in_protect, others):
            bed.wait_listed(pid)
        policy = tmp_path / "scoped.yaml"
        policy.write_text(SCOPED_POLICY % (10, users["other"].name))
        policy.chmod(0o644)
        bed.enforce(policy)
        assert proc.wait(20) is not None, "the guard never killed the trainer"
        assert wait_until(
            lambda: (
                not os.path.exists(f"/proc/{plain}/stat")
                or Path(f"/proc/{plain}/stat").read_text().split(") ")[1][0] == "Z"
            ),
            10,
        )
        for pid in (named, in_keep, in_protect, others):
            assert Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z", f"PID {pid} was killed"
        (done,) = bed.wait_journal(GPUKILL_TARGET_PID=str(proc.pid), MESSAGE_ID=audit.GUARD_ACTION.message_id)
        assert done["GPUKILL_SCOPE_PIDS"] == str(plain), done
        assert sorted(map(int, done["GPUKILL_LEFT_RUNNING"].split(","))) == sorted([named, in_keep, in_protect, others])
        text = done["MESSAGE"]
        assert f"with PID {plain} (python3) " in text, text
        for why in (
            f"PID {named} (ckpt-writer, exempt: process name ckpt-writer)",
            f"PID {in_keep} (python3, exempt: unit {keep})",
            f"PID {in_protect} (python3, protected: system unit {protect})",
            f"PID {others} (python-as-other, exempt: user {users['other'].name})",
        ):
            assert why in text, (why, text)
        killed = bed.wait_journal(GPUKILL_TARGET_PID=str(plain), MESSAGE_ID=audit.KILL.message_id)
        assert killed and killed[0]["GPUKILL_INITIATOR"] == "guard:stop-trainers"
        for pid in (named, in_keep, in_protect, others):
            assert not bed.journal(GPUKILL_TARGET_PID=str(pid), MESSAGE_ID=audit.KILL.message_id)
        status = bed.ctl(users["root"], "guard", "status")
        assert f"left running: PID {named} (ckpt-writer, exempt: process name ckpt-writer)" in status.stdout, status
    finally:
        for pid in kids:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        groups.cleanup()
        bed.stop()


def test_guard_kill_scope_members_count_toward_max_kills_per_cycle(users, tmp_path):
    """A trainer with three workers is four kills: under max_kills_per_cycle 3 none is signalled (never half a
    workload), and the journal says why once."""
    from helpers.testbed import Testbed

    bed = Testbed()
    w = None
    try:
        (bed.workdir / "guard.d").mkdir(exist_ok=True)
        bed.start_system(args=["--sample-interval", "0.3"])
        w = trainer(bed, users["owner"], workers=3, mem="1GiB", comm="trainer")
        _listed_all(bed, [w.pid, *w.workers])
        policy = tmp_path / "capped.yaml"
        policy.write_text(SCOPED_POLICY % (3, "nobody-at-all"))
        policy.chmod(0o644)
        bed.enforce(policy)
        (held,) = bed.wait_journal(GPUKILL_TARGET_PID=str(w.pid), MESSAGE_ID=audit.GUARD_ACTION.message_id)
        assert held["GPUKILL_RESULT"] == "over-cap", held
        assert "its kill_scope tree takes 4 processes, more than max_kills_per_cycle (3)" in held["MESSAGE"]
        time.sleep(2.0)  # several more evaluations
        assert sorted(w.left()) == sorted([w.pid, *w.workers]), "nothing of the workload is signalled"
        assert len(bed.journal(GPUKILL_TARGET_PID=str(w.pid), MESSAGE_ID=audit.GUARD_ACTION.message_id)) == 1
        assert not bed.journal(MESSAGE_ID=audit.KILL.message_id)
    finally:
        if w is not None:
            w.cleanup()
        bed.stop()


def test_kill_scope_is_validated():
    from gpukill.policy import PolicyError, load_texts

    (rule,) = load_texts([("p.yaml", GUARD_POLICY % "unit")]).rules
    assert rule.kill_scope == "unit"
    with pytest.raises(PolicyError, match="kill_scope must be one of process, tree, unit"):
        load_texts([("p.yaml", GUARD_POLICY % "everything")])
    with pytest.raises(PolicyError, match="kill_scope applies only to actions kill and suspend"):
        load_texts(
            [
                (
                    "p.yaml",
                    (GUARD_POLICY % "tree")
                    .replace("action: kill", "action: log")
                    .replace("    force: true\n    kill_grace: 1s\n", ""),
                )
            ]
        )


# -- the answer's logic on fixture /proc trees (no daemon) --------------------------------------------------


def _stat_line(pid: int, comm: str, state: str, ppid: int, start: int) -> str:
    # fields 3.. of /proc/PID/stat: state (3), ppid (4), ..., flags (9), ..., starttime (22)
    rest = [state, str(ppid), "0", "0", "0", "0", "0"] + ["0"] * 12 + [str(start)] + ["0"] * 30
    return f"{pid} ({comm}) {' '.join(rest)}\n"


def _fixture_proc(root, procs):
    for pid, comm, state, ppid, start, wchan in procs:
        d = root / str(pid)
        d.mkdir()
        (d / "stat").write_text(_stat_line(pid, comm, state, ppid, start))
        (d / "wchan").write_text(wchan)
        (d / "cgroup").write_text("0::/user.slice\n")


def test_the_reason_names_the_nvidia_driver_and_the_state(tmp_path):
    from gpukilld.acts.reclaim import stuck_reason
    from gpukilld.proc.procfs import ProcFS

    _fixture_proc(
        tmp_path,
        [
            (10, "train", "D", 1, 5, "nvidia_ioctl"),
            (11, "train", "D", 1, 5, "os_acquire_mutex"),
            (12, "train", "D", 1, 5, "io_schedule"),
            (13, "train", "S", 1, 5, "do_sys_poll"),
        ],
    )
    procfs = ProcFS(str(tmp_path))
    assert stuck_reason(procfs, 10) == "uninterruptible (D) in the NVIDIA driver: nvidia_ioctl"
    assert stuck_reason(procfs, 11) == "uninterruptible (D) in the NVIDIA driver: os_acquire_mutex"
    assert stuck_reason(procfs, 12) == "uninterruptible (D) in the kernel: io_schedule"
    assert stuck_reason(procfs, 13) == "state S in do_sys_poll"
    assert stuck_reason(procfs, 99) == "it exited after the wait for SIGKILL ended"


def test_holders_are_the_remembered_tree_and_the_workload_never_a_login_session(tmp_path):
    """The tree is remembered before the signal; after it, a worker whose parent died is an orphan, one whose
    parent lives a descendant; a process of the same unit is related, one of the same login session is not."""
    from gpukilld.acts.reclaim import Watch, remember_tree
    from gpukilld.model import GpuProcess, Snapshot
    from gpukilld.proc.procfs import ProcFS

    def gpu(pid, start, unit, mem=1 << 30):
        return GpuProcess(
            pid=pid,
            start_time=start,
            uid=1000,
            user="u",
            comm=f"p{pid}",
            cmdline="",
            exe=None,
            device=0,
            device_id="GPU-0",
            gpu_memory=mem,
            gpu_utilization=None,
            unit=unit,
        )

    # 100 the trainer, 101 its worker, 102 a worker's child; 200 same unit, 300 same login session, 400 a stranger
    _fixture_proc(
        tmp_path,
        [
            (100, "trainer", "S", 1, 5, "0"),
            (101, "w", "S", 100, 6, "0"),
            (102, "w2", "S", 101, 7, "0"),
            (200, "u", "S", 1, 8, "0"),
            (300, "s", "S", 1, 9, "0"),
            (400, "x", "S", 1, 10, "0"),
        ],
    )
    procfs = ProcFS(str(tmp_path))
    tree = remember_tree(procfs, [100])
    assert set(tree) == {(100, 5), (101, 6), (102, 7)}
    before = Snapshot(
        1,
        0.0,
        (),
        (
            gpu(100, 5, "train.service"),
            gpu(101, 6, "train.service"),
            gpu(102, 7, "train.service"),
            gpu(200, 8, "train.service"),
            gpu(300, 9, "session-3.scope"),
            gpu(400, 10, None),
        ),
        (),
    )
    watch = Watch(procfs, before, [(100, 5)], tree)
    # the trainer died: 101 was reparented to init, 102's parent 101 lives
    (tmp_path / "101" / "stat").write_text(_stat_line(101, "w", "S", 1, 6))
    shutil.rmtree(tmp_path / "100")
    after = Snapshot(2, 1.0, (), before.processes[1:], ())
    holders = {h.pid: h for h in watch.holders(after)}
    assert set(holders) == {101, 102, 200}
    assert (holders[101].relation, holders[101].parent) == ("orphan", 1)
    assert (holders[102].relation, holders[102].parent) == ("descendant", 101)
    assert holders[200].relation == "unit"
    answer = watch.answer(list(holders.values()), 3)
    assert answer.verdict == "held" and answer.held == 3 << 30 and answer.reclaimed == 1 << 30
    assert answer.remedy == "gpukillctl kill --unit train.service"
    # a 300-process session: bounded, the rest counted
    many = Snapshot(3, 2.0, (), tuple(gpu(1000 + i, 11, "train.service", 1) for i in range(300)), ())
    lots = watch.answer(watch.holders(many), 3)
    assert len(lots.holders) == 16 and lots.more == 284


def test_the_answers_names_are_escaped_in_its_line():
    """A holder's name, the unit of a remedy and the cgroup of a reason are names a user chooses: the one line
    a terminal (or the journal's MESSAGE) gets escapes them."""
    from gpukill.outcome import reclaim_text
    from gpukill.records.reclaim import Holder, Reclaim

    esc = "\x1b]0;owned\x07"
    held = Reclaim(
        "held",
        held=1 << 30,
        holders=(Holder(7, 1, 1000, f"w{esc}", 0, 1 << 30, "unit", 0),),
        remedy=f"gpukillctl kill --unit a{esc}.service",
    )
    stuck = Reclaim(
        "stuck", reason=f"uninterruptible (D), frozen by the cgroup freezer (/f{esc})", remedy="gpukillctl reset 0"
    )
    for text in (reclaim_text(held), reclaim_text(stuck)):
        assert "\x1b" not in text and "\x07" not in text and "\\x1b" in text, text


def test_a_slurm_tasks_unit_relates_nobody_its_job_does(tmp_path):
    """slurmstepd runs every job's steps in one scope: a task's unit must not make another job's process a holder
    (nor advise `kill --unit slurmstepd.scope`, which would stop every job on the node); its job does. A
    process known to hold no memory holds nothing back."""
    from gpukilld.acts.reclaim import Watch
    from gpukilld.model import GpuProcess, Snapshot
    from gpukilld.proc.procfs import ProcFS

    def gpu(pid, job, mem=1 << 30):
        return GpuProcess(
            pid=pid,
            start_time=pid,
            uid=1000,
            user="u",
            comm=f"p{pid}",
            cmdline="",
            exe=None,
            device=0,
            device_id="GPU-0",
            gpu_memory=mem,
            gpu_utilization=None,
            unit="slurmstepd.scope",
            slurm_job=job,
        )

    _fixture_proc(tmp_path, [(pid, f"p{pid}", "S", 1, pid, "0") for pid in (10, 11, 12, 13)])
    before = Snapshot(1, 0.0, (), (gpu(10, "7"), gpu(11, "7"), gpu(12, "8"), gpu(13, "7", mem=0)), ())
    watch = Watch(ProcFS(str(tmp_path)), before, [(10, 10)], {})
    holders = watch.holders(Snapshot(2, 1.0, (), before.processes[1:], ()))
    assert [(h.pid, h.relation) for h in holders] == [(11, "job")]
    assert "--unit" not in watch.answer(holders, 3).remedy

    # a service running many users' processes (JupyterHub's): another user's is no holder of this kill
    hub = [
        dataclasses.replace(p, unit="jupyterhub.service", slurm_job=None, uid=1000 + (p.pid == 12))
        for p in before.processes
    ]
    watch = Watch(ProcFS(str(tmp_path)), Snapshot(3, 2.0, (), tuple(hub), ()), [(10, 10)], {})
    holders = watch.holders(Snapshot(4, 3.0, (), tuple(hub[1:]), ()))
    assert [(h.pid, h.relation) for h in holders] == [(11, "unit")]
