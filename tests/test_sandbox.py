"""The TestPolicies sandbox child on its own: it runs a caller's policy only after dropping every privilege,
and refuses to run at all when it cannot."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys

import pytest
from helpers.testbed import REPO

from gpukilld.guard import sandbox
from gpukilld.guard.sandbox import DYNAMIC_UIDS, SANDBOX_USER, sandbox_ids, snapshot_to_json
from gpukilld.model import Device, GpuProcess, Snapshot

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the sandbox child drops from root to an account of its own"
)

SNAPSHOT = Snapshot(
    generation=1,
    taken_at=0.0,
    devices=(Device(0, "GPU-0", "simulated", "simulated", "GPU", None, 10.0, 1 << 30, 8 << 30, 40.0, 50.0),),
    processes=(
        GpuProcess(
            pid=4242,
            start_time=1,
            uid=1000,
            user="alice",
            comm="xmrig",
            cmdline="xmrig --pool x",
            exe=None,
            device=0,
            device_id="GPU-0",
            gpu_memory=1 << 30,
            gpu_utilization=99.0,
        ),
    ),
    backends=(),
)
POLICY = "rules:\n  - {name: m, action: log, conditions: [{type: process_name, operator: ==, value: xmrig}]}\n"


def run_child(uid: int, gid: int, prefix: list[str] | None = None, text: str = POLICY) -> subprocess.CompletedProcess:
    request = {
        "name": "t.yaml",
        "text": text,
        "own_pid": os.getpid(),
        "snapshot": snapshot_to_json(SNAPSHOT),
        "protection": {"uid_max": 999, "units": []},
    }
    return subprocess.run(
        [*(prefix or []), sys.executable, "-m", "gpukilld.guard.sandbox", str(uid), str(gid)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )


def test_the_child_runs_the_policy_as_the_sandbox_account():
    uid, gid = sandbox_ids()
    r = run_child(uid, gid)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ran_as"] == [uid, gid] and uid != 0 and gid != 0
    assert [(p["rule"], p["pids"]) for p in out["previews"]] == [("m", [4242])]


def test_the_child_refuses_to_run_as_root():
    r = run_child(0, 0)
    assert r.returncode == 70 and r.stdout == "" and "must not be root" in r.stderr


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is needed")
def test_the_child_fails_closed_when_it_cannot_drop_privileges():
    """Without CAP_SETUID and CAP_SETGID (a unit that lost them) setuid fails: the child must not go on as root
    with the caller's policy, it exits without reading it."""
    uid, gid = sandbox_ids()
    no_setuid = ["setpriv", "--bounding-set=-setuid,-setgid", "--inh-caps=-setuid,-setgid"]
    r = run_child(uid, gid, prefix=no_setuid)
    assert r.returncode == 70 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert "refusing to evaluate the policy" in r.stderr


def test_the_child_is_confined():
    """Limits a policy cannot lift: no core file, a handful of fds, no fork, idle scheduling, nice 19."""
    code = (
        "import os, resource, json, sys\n"
        "print(json.dumps([resource.getrlimit(resource.RLIMIT_CORE), resource.getrlimit(resource.RLIMIT_NPROC),"
        " resource.getrlimit(resource.RLIMIT_NOFILE)[0], os.sched_getscheduler(0) == os.SCHED_IDLE, "
        "os.nice(0)]))"
    )
    uid, gid = sandbox_ids()
    probe = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from gpukilld.guard import sandbox; "
        f"sandbox._confine({uid}, {gid}); exec({code!r})"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, cwd="/")
    assert r.returncode == 0, r.stderr
    core, nproc, nofile, idle, nice = json.loads(r.stdout)
    assert core == [0, 0] and nproc == [0, 0] and nofile == sandbox.CHILD_FILES and idle and nice == 19
    forked = subprocess.run(
        [sys.executable, "-c", probe.replace(f"exec({code!r})", "import os; os.fork()")],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )
    assert forked.returncode != 0 and "BlockingIOError" in forked.stderr


def test_the_sandbox_account(monkeypatch):
    """gpukill-sandbox where the packages made it; else a uid of systemd's DynamicUser range that no account,
    group or dynamic user holds: never nobody."""
    uid, gid = sandbox_ids()
    try:
        pw = pwd.getpwnam(SANDBOX_USER)
        assert (uid, gid) == (pw.pw_uid, pw.pw_gid)
    except KeyError:
        assert uid in DYNAMIC_UIDS and gid == uid
        with pytest.raises(KeyError):
            pwd.getpwuid(uid)
    assert uid != 65534
    taken = list(DYNAMIC_UIDS)[:3]
    monkeypatch.setattr(sandbox, "SANDBOX_USER", "no-such-user-gpukill")
    monkeypatch.setattr(sandbox.os.path, "exists", lambda p: p in {f"{sandbox.DYNAMIC_UID_LOCKS}/{u}" for u in taken})
    assert sandbox_ids()[0] not in taken
