"""The fake cuda-checkpoint (tests/helpers/fake_cuda_checkpoint/) on its own: the driver's state machine, the
real utility's command line, words and exit statuses, what the real pynvml reads from the fake NVML around a
checkpoint and a restore, and each injected failure. No root: the processes are the test's own children.

The fake runs as gpukilld runs it: with a clean environment (it finds both states from the JSON its install
writes beside it)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from helpers.nvml_host import fake_cuda_checkpoint, fake_nvidia_host, peer_view

GIB = 2**30
CLEAN_ENV = {"PATH": "/usr/bin:/bin"}
# cuda.h's codes, as the exit status keeps them (their low 8 bits)
INVALID_VALUE, OUT_OF_MEMORY, OPERATING_SYSTEM = 1, 2, 304 & 0xFF
ILLEGAL_STATE, NOT_SUPPORTED, TIMEOUT, UNKNOWN = 401 & 0xFF, 801 & 0xFF, 909 & 0xFF, 999 & 0xFF
ACTIONS = ("lock", "checkpoint", "restore", "unlock")


@pytest.fixture
def host(tmp_path):
    h = fake_nvidia_host(tmp_path, devices=2)
    h.install_cuda_checkpoint()
    return h


@pytest.fixture
def spawn():
    """start() -> a pid of a child of the test (a sleeper), ended after the test."""
    children: list[subprocess.Popen] = []

    def start() -> int:
        p = subprocess.Popen(["sleep", "600"])
        children.append(p)
        return p.pid

    yield start
    for p in children:
        p.kill()
        p.wait()


def ckpt(host, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(host.bin / "cuda-checkpoint"), *args], capture_output=True, text=True, env=CLEAN_ENV, timeout=timeout
    )


def action(host, name: str, pid: int, *extra: str) -> subprocess.CompletedProcess:
    return ckpt(host, "--action", name, "--pid", str(pid), *extra)


def state(host, pid: int) -> str:
    r = ckpt(host, "--get-state", "--pid", str(pid))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def gpu_process(host, spawn, gpu: int = 0, memory: int = 4 * GIB, **kwargs) -> int:
    pid = spawn()
    host.refresh()
    host.add_process(gpu, pid, memory, **kwargs)
    host.write()
    return pid


def failed_with(r: subprocess.CompletedProcess, code: int, words: str) -> bool:
    return r.returncode == code and r.stdout == "" and words in r.stderr and len(r.stderr.splitlines()) == 1


def test_help_and_usage_follow_the_real_utility(host):
    r = ckpt(host, "--help")
    assert r.returncode == 0
    assert r.stdout.startswith("CUDA checkpoint and restore utility.\nVersion 550.54.15.")  # the host's driver
    for line in (
        "--get-state --pid <pid>",
        "--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]",
        "--toggle --pid <pid>",
        "--get-restore-tid --pid <pid>",
        "--pid|-p <pid>",
        "--timeout|-t <timeout>",
    ):
        assert line in r.stdout.splitlines(), line
    assert ckpt(host, "-h").stdout == r.stdout
    for args, words in (
        (["--action", "freeze", "--pid", "1"], "Invalid action: freeze"),
        (["--get-state"], "No pid specified"),
        (["--pid", "1"], "No operation specified"),
        (["--get-state", "--pid", "x1"], "Invalid pid: x1"),
    ):
        bad = ckpt(host, *args)
        assert bad.returncode == 1 and bad.stderr.startswith(words + "\n") and bad.stdout == "", (args, bad)


def test_the_state_machine_and_every_wrong_state_call(host, spawn):
    pid = gpu_process(host, spawn)
    assert state(host, pid) == "running"
    wrong = {
        "running": ["checkpoint", "restore", "unlock"],
        "locked": ["lock", "restore"],
        "checkpointed": ["lock", "checkpoint", "unlock"],
    }
    path = [("lock", "locked"), ("checkpoint", "checkpointed"), ("restore", "locked"), ("unlock", "running")]
    for name, after in path:
        before = state(host, pid)
        for call in wrong.get(before, []):
            r = action(host, call, pid)
            assert failed_with(
                r,
                ILLEGAL_STATE,
                f'Could not {call} on process ID {pid}: "the operation cannot be performed in the present state"',
            ), (before, call, r)
            assert state(host, pid) == before
        r = action(host, name, pid)
        assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), (name, r)
        assert state(host, pid) == after
    assert host.checkpoint_states() == {pid: "running"}
    done = [(c["op"], c["before"], c["after"]) for c in host.checkpoint_calls() if c["op"] in ACTIONS and c["rc"] == 0]
    assert done == [
        ("lock", "running", "locked"),
        ("checkpoint", "locked", "checkpointed"),
        ("restore", "checkpointed", "locked"),
        ("unlock", "locked", "running"),
    ]
    refused = [c for c in host.checkpoint_calls() if c["rc"]]
    assert len(refused) == 10 and all(c["error"] == "CUDA_ERROR_ILLEGAL_STATE" for c in refused)


def test_toggle_and_the_restore_thread(host, spawn):
    pid = gpu_process(host, spawn)
    assert ckpt(host, "--toggle", "--pid", str(pid)).returncode == 0
    assert state(host, pid) == "checkpointed"
    tid = ckpt(host, "--get-restore-tid", "-p", str(pid))
    assert (tid.returncode, tid.stdout) == (0, f"{pid}\n")  # a thread of the process: the sleeper has one
    assert ckpt(host, "--toggle", "--pid", str(pid)).returncode == 0
    assert state(host, pid) == "running"
    assert action(host, "lock", pid).returncode == 0
    r = ckpt(host, "--toggle", "--pid", str(pid))
    assert failed_with(r, ILLEGAL_STATE, f'Error toggling CUDA in process ID {pid}: "the operation cannot be')


def test_no_cuda_process_and_no_process_are_invalid(host, spawn):
    plain = spawn()  # in no NVML list
    for args in (["--get-state", "--pid", str(plain)], ["--action", "lock", "--pid", str(plain)]):
        r = ckpt(host, *args)
        assert failed_with(r, INVALID_VALUE, f'process ID {plain}: "invalid argument"'), r
    sleeper = subprocess.Popen(["sleep", "600"])
    host.add_process(0, sleeper.pid, GIB)
    host.write()
    assert ckpt(host, "--toggle", "--pid", str(sleeper.pid)).returncode == 0
    sleeper.kill()
    sleeper.wait()  # reaped: its pid is no process now, checkpointed or not
    r = ckpt(host, "--get-state", "--pid", str(sleeper.pid))
    assert failed_with(r, INVALID_VALUE, f'Could not get state of process ID {sleeper.pid}: "invalid argument"'), r


def memory_and_pids(view: dict, uuid: str) -> tuple[int, int, list[list]]:
    v1, v2 = view["pynvml"][uuid]["v1"], view["pynvml"][uuid]["v2"]
    assert v1["free"] == v2["free"]
    return v1["free"], v2["used"], sorted(view["processes"][uuid])


def test_pynvml_sees_the_memory_freed_and_given_back(host, spawn):
    a = gpu_process(host, spawn, 0, 6 * GIB, sm=70)
    b = gpu_process(host, spawn, 0, 2 * GIB)
    c = gpu_process(host, spawn, 1, 3 * GIB)
    gpu0, gpu1 = host.device(0)["uuid"], host.device(1)["uuid"]
    before = peer_view(host)
    free0, used0, pids0 = memory_and_pids(before, gpu0)
    assert pids0 == [[a, 6 * GIB], [b, 2 * GIB]] and used0 == 8 * GIB

    assert action(host, "lock", a).returncode == 0
    assert memory_and_pids(peer_view(host), gpu0) == (free0, used0, pids0)  # a lock keeps the memory
    assert action(host, "checkpoint", a).returncode == 0
    during = peer_view(host)
    assert memory_and_pids(during, gpu0) == (free0 + 6 * GIB, 2 * GIB, [[b, 2 * GIB]])
    assert memory_and_pids(during, gpu1) == memory_and_pids(before, gpu1)  # another GPU, another process
    assert all(s["pid"] != a for s in host.refresh()["devices"][0]["process_util"])

    assert action(host, "restore", a).returncode == 0
    assert action(host, "unlock", a).returncode == 0
    after = peer_view(host)
    assert memory_and_pids(after, gpu0) == (free0, used0, pids0)
    assert any(s["pid"] == a and s["sm"] == 70 for s in host.refresh()["devices"][0]["process_util"])
    assert state(host, c) == "running"


def test_restore_without_the_memory_leaves_the_process_failed_for_good(host, spawn):
    big = gpu_process(host, spawn, 0, 40 * GIB)
    assert ckpt(host, "--toggle", "--pid", str(big)).returncode == 0
    free = 85520809984 - 536870912  # the fake H100's total less its reserved: nothing is allocated now
    filler = gpu_process(host, spawn, 0, free - 10 * GIB)  # another process takes the memory meanwhile
    r = action(host, "restore", big)
    assert failed_with(r, OUT_OF_MEMORY, f'Could not restore on process ID {big}: "out of memory"'), r
    assert state(host, big) == "failed"
    assert [p["pid"] for p in host.refresh()["devices"][0]["compute"]] == [filler]  # not half restored

    host.refresh()
    host.device(0)["compute"] = []  # the filler ends: the memory is free again, yet the process stays stuck
    host.device(0)["memory_allocated"] = 0
    host.write()
    r = action(host, "restore", big)
    assert failed_with(r, OPERATING_SYSTEM, '"OS call failed or operation not supported on this OS"'), r
    assert failed_with(action(host, "unlock", big), ILLEGAL_STATE, "present state")
    assert state(host, big) == "failed"

    forced = gpu_process(host, spawn, 1, 1 * GIB)
    host.checkpoint_fault(forced, restore_oom=True)
    assert ckpt(host, "--toggle", "--pid", str(forced)).returncode == 0
    assert failed_with(action(host, "restore", forced), OUT_OF_MEMORY, "out of memory")
    assert host.checkpoint_states()[forced] == "failed"


def test_lock_timeout(host, spawn):
    pid = gpu_process(host, spawn)
    host.checkpoint_fault(pid, lock_timeout=True)
    t0 = time.monotonic()
    r = action(host, "lock", pid, "--timeout", "400")
    took = time.monotonic() - t0
    assert failed_with(r, TIMEOUT, f'Could not lock on process ID {pid}: "the operation timed out"'), r
    assert 0.4 <= took < 10, took
    assert state(host, pid) == "running"
    host.checkpoint_fault(pid, lock_timeout=0.3)  # work that ends within a longer timeout: the lock waits for it
    t0 = time.monotonic()
    assert action(host, "lock", pid, "-t", "5000").returncode == 0
    assert time.monotonic() - t0 >= 0.3
    assert state(host, pid) == "locked"


def test_checkpoint_error_keeps_the_memory_and_the_lock(host, spawn):
    pid = gpu_process(host, spawn, 0, 5 * GIB)
    host.checkpoint_fault(pid, checkpoint_error=True)
    assert action(host, "lock", pid).returncode == 0
    r = action(host, "checkpoint", pid)
    assert failed_with(r, UNKNOWN, f'Could not checkpoint on process ID {pid}: "unknown error"'), r
    assert state(host, pid) == "locked"
    assert host.refresh()["devices"][0]["memory_allocated"] == 5 * GIB
    assert action(host, "unlock", pid).returncode == 0

    other = gpu_process(host, spawn, 1, 1 * GIB)
    host.checkpoint_fault(other, checkpoint_error="CUDA_ERROR_NOT_PERMITTED", checkpoint_error_state="failed")
    assert action(host, "lock", other).returncode == 0
    assert failed_with(action(host, "checkpoint", other), 800 & 0xFF, '"operation not permitted"')
    assert state(host, other) == "failed"
    host.clear_checkpoint_faults(pid)
    assert ckpt(host, "--toggle", "--pid", str(pid)).returncode == 0
    assert state(host, pid) == "checkpointed"


def test_a_mig_process_cannot_be_checkpointed(host, spawn):
    from helpers.nvml_host import mig_instance

    pid = spawn()
    gpu = host.device(1)
    gpu["mig_mode"] = 1
    gpu["mig_devices"] = [mig_instance("MIG-00000000-1111-2222-3333-444444444444", 1, 0, 10 * GIB)]
    host.add_process(1, pid, 2 * GIB, mig=0)
    host.write()
    assert action(host, "lock", pid).returncode == 0
    assert failed_with(action(host, "checkpoint", pid), NOT_SUPPORTED, '"operation not supported"')
    assert state(host, pid) == "locked"
    assert host.refresh()["devices"][1]["mig_devices"][0]["memory_allocated"] == 2 * GIB


def test_a_hang_costs_the_caller_its_timeout_and_changes_nothing(host, spawn):
    pid = gpu_process(host, spawn)
    host.checkpoint_fault(pid, hang={"checkpoint": 60})
    assert action(host, "lock", pid).returncode == 0  # only the named action hangs
    with pytest.raises(subprocess.TimeoutExpired):
        ckpt(host, "--action", "checkpoint", "--pid", str(pid), timeout=1.0)  # run() kills it at the timeout
    assert state(host, pid) == "locked"
    assert host.refresh()["devices"][0]["memory_allocated"] == 4 * GIB
    host.checkpoint_fault(pid, hang=0.5)  # every call
    t0 = time.monotonic()
    assert state(host, pid) == "locked"
    assert time.monotonic() - t0 >= 0.5


def test_the_copy_takes_the_memory_over_the_rate(host, spawn):
    pid = gpu_process(host, spawn, 0, 2 * GIB)
    host.set_checkpoint_copy_rate(4.0)  # 2 GiB at 4 GiB/s: half a second each way
    assert action(host, "lock", pid).returncode == 0
    for name in ("checkpoint", "restore"):
        t0 = time.monotonic()
        assert action(host, name, pid).returncode == 0
        assert time.monotonic() - t0 >= 0.5, name
    calls = [c for c in host.checkpoint_calls() if c["op"] in ("checkpoint", "restore")]
    assert [c["slept"] for c in calls] == [0.5, 0.5]
    assert all(c["seconds"] >= 0.5 for c in calls)


def test_concurrent_runs_keep_every_update(host, spawn):
    """Eight toggles at once, each reading and writing both states: none may write over another's."""
    pids = [gpu_process(host, spawn, i % 2, 1 * GIB) for i in range(8)]
    runs = [
        subprocess.Popen([str(host.bin / "cuda-checkpoint"), "--toggle", "--pid", str(p)], env=CLEAN_ENV) for p in pids
    ]
    assert [r.wait(60) for r in runs] == [0] * 8
    nvml = host.refresh()
    assert [d["compute"] for d in nvml["devices"]] == [[], []]
    assert [d["memory_allocated"] for d in nvml["devices"]] == [0, 0]
    assert host.checkpoint_states() == dict.fromkeys(pids, "checkpointed")
    # the host's own write takes the same lock, and after refresh() keeps what the fake did
    host.add_process(0, pids[0], 1 * GIB, kind="graphics")
    host.write()
    assert host.refresh()["devices"][0]["graphics"] == [{"pid": pids[0], "used_memory": GIB}]
    assert host.checkpoint_states()[pids[1]] == "checkpointed"


def test_a_stopped_process_waits_out_every_action_and_completes_once_it_runs(host, spawn):
    """The driver acts through a thread of the process: stopped, none of the four actions completes."""
    pid = gpu_process(host, spawn, 0, 2 * GIB)
    host.set_checkpoint_stopped_wait(0.3)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = action(host, "lock", pid, "--timeout", "400")
        assert failed_with(r, TIMEOUT, f'Could not lock on process ID {pid}: "the operation timed out"'), r
        assert 0.4 <= time.monotonic() - t0 < 10
        assert state(host, pid) == "running"  # get-state answers at once
        os.kill(pid, signal.SIGCONT)
        assert action(host, "lock", pid).returncode == 0
        for name, before in (("checkpoint", "locked"), ("unlock", "locked")):
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            assert failed_with(action(host, name, pid), TIMEOUT, '"the operation timed out"'), name
            assert time.monotonic() - t0 >= 0.3 and state(host, pid) == before
            os.kill(pid, signal.SIGCONT)
        assert action(host, "checkpoint", pid).returncode == 0
        os.kill(pid, signal.SIGSTOP)
        assert failed_with(action(host, "restore", pid), TIMEOUT, "timed out")
        assert state(host, pid) == "checkpointed" and host.refresh()["devices"][0]["memory_allocated"] == 0
        host.set_checkpoint_stopped_wait(10)
        threading.Timer(0.5, os.kill, (pid, signal.SIGCONT)).start()  # thawed while the call waits
        t0 = time.monotonic()
        assert action(host, "restore", pid).returncode == 0
        assert 0.4 <= time.monotonic() - t0 < 5
    finally:
        os.kill(pid, signal.SIGCONT)
    assert action(host, "unlock", pid).returncode == 0 and state(host, pid) == "running"
    held = [c for c in host.checkpoint_calls() if c.get("held")]
    assert [c["op"] for c in held] == ["lock", "checkpoint", "unlock", "restore"]
    assert all(c["error"] == "CUDA_ERROR_TIMEOUT" for c in held)


def test_a_frozen_cgroup_holds_the_process_as_a_stop_does(tmp_path, monkeypatch):
    """cgroup v2 (its own cgroup.freeze or events, or an ancestor's cgroup.freeze) and v1's freezer.state."""
    fake = fake_cuda_checkpoint()
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    monkeypatch.setattr(fake, "PROC", str(proc))
    monkeypatch.setattr(fake, "CGROUP_ROOT", str(cgroups))
    job = cgroups / "work.slice" / "job.scope"
    job.mkdir(parents=True)
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "stat").write_text("7 (train (1)) S 1 7 7 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0\n")
    (proc / "7" / "cgroup").write_text("0::/work.slice/job.scope\n")
    for name, text in (("cgroup.freeze", "0\n"), ("cgroup.events", "populated 1\nfrozen 0\n")):
        (job / name).write_text(text)
    assert not fake.held(7)
    (job / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    assert fake.held(7)
    (job / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    (cgroups / "work.slice" / "cgroup.freeze").write_text("1\n")  # freezing from above, not yet frozen
    assert fake.held(7)
    (cgroups / "work.slice" / "cgroup.freeze").write_text("0\n")
    (proc / "7" / "cgroup").write_text("4:freezer:/job\n0::/\n")
    (cgroups / "freezer" / "job").mkdir(parents=True)
    for text, frozen in (("THAWED\n", False), ("FREEZING\n", True), ("FROZEN\n", True)):
        (cgroups / "freezer" / "job" / "freezer.state").write_text(text)
        assert fake.held(7) is frozen, text
    (proc / "7" / "cgroup").write_text("0::/\n")
    (proc / "7" / "stat").write_text("7 (train) t 1 7 7 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0\n")
    assert fake.held(7)  # stopped by a tracer
    assert not fake.held(8)  # no such process: the state machine answers for it
