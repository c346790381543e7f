"""Suspend and resume through gpukilld on the fake NVIDIA host: the real pynvml against the C NVML fake, and the
fake cuda-checkpoint (tests/helpers/fake_cuda_checkpoint/), which follows the utility's command line and edits the
NVML fake's state as the driver would (a checkpointed process leaves the GPU's lists and its memory is freed; a
restore puts it back; no action completes on a stopped or frozen process). Failures are injected per PID through
FakeNvidiaHost.checkpoint_fault.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from helpers.marks import needs_root
from helpers.nvml_host import fake_nvidia_host, mig_instance
from helpers.testbed import PYTHON, ROOT, SYSTEM_PYTHON
from helpers.waiting import wait_until

from gpukilld import journal as audit

pytestmark = needs_root

GIB = 2**30
ACTIONS = ("lock", "checkpoint", "restore", "unlock")

# A process that counts, writing its count to PATH every 50 ms; with WORKERS > 0 it starts that many counting
# children first (a DataLoader's workers), and prints "ready PID..." with theirs.
COUNTER = r"""
import os, subprocess, sys, time
path, workers, top = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
kids = [subprocess.Popen([sys.executable, sys.argv[0], f"{path}.{i}", "0", "0"]) for i in range(workers)]
if top:
    print("ready", *(k.pid for k in kids), flush=True)
n = 0
while True:
    n += 1
    with open(path + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(path + ".tmp", path)
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def nvhost(tmp_path_factory):
    return fake_nvidia_host(tmp_path_factory.mktemp("nvml"), devices=2)


class Suspending:
    """gpukilld on the fake NVIDIA host with the fake cuda-checkpoint, and the counting workloads."""

    def __init__(self, bed, nvhost, users) -> None:
        self.bed, self.nv, self.users = bed, nvhost, users
        self.dir = Path(tempfile.mkdtemp(prefix="gpukill-suspend-"))
        os.chmod(self.dir, 0o777)
        nvhost.checkpoint_state_path.unlink(missing_ok=True)  # the driver's states and faults of earlier tests
        self.tool = nvhost.install_cuda_checkpoint()
        self.calls_before = len(nvhost.checkpoint_calls())
        self.counter = self.dir / "counter.py"
        self.counter.write_text(COUNTER)
        self.counter.chmod(0o644)

    def start(self, driver: str = "550.54.15", **daemon: str) -> None:
        self.nv.refresh()
        self.nv.state["driver_version"] = driver
        self.nv.write()
        self.bed.write_conf(daemon={"backends": "nvidia", "cuda_checkpoint": self.tool, **daemon})
        self.bed.start_daemon(args=["--sample-interval", "0.3"], env=self.nv.env())

    def counting(self, user_key: str = "owner", workers: int = 0, memory: int = 2 * GIB) -> list[tuple[int, Path]]:
        """A counter (and its workers), each on GPU 0 with `memory`: [(pid, its count file)], the root first."""
        path = self.dir / f"count-{len(self.bed.procs)}"
        user = self.users[user_key]
        proc = subprocess.Popen(
            [SYSTEM_PYTHON, str(self.counter), str(path), str(workers), "1"],
            stdout=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
            start_new_session=True,
            **user.popen_kwargs(),
        )
        self.bed.procs.append(proc)
        assert proc.stdout is not None
        words = proc.stdout.readline().split()
        assert words[:1] == [b"ready"], words
        members = [(proc.pid, path)] + [(int(pid), Path(f"{path}.{i}")) for i, pid in enumerate(words[1:])]
        self.nvml(lambda state: [self._add(state, pid, memory) for pid, _ in members])
        for pid, _ in members:
            self.bed.wait_listed(pid)
        return members

    @staticmethod
    def _add(state: dict, pid: int, memory: int) -> None:
        state["devices"][0]["compute"].append({"pid": pid, "used_memory": memory})

    def nvml(self, change) -> None:
        """Change the NVML fake's state as it is now (the fake cuda-checkpoint edits it too), its memory recounted."""
        self.nv.refresh()
        change(self.nv.state)
        for dev in self.nv.state["devices"]:
            dev["memory_allocated"] = sum(p.get("used_memory", 0) for p in dev["compute"])
        self.nv.write()

    def states(self) -> dict[int, str]:
        """The driver's state of each process the fake cuda-checkpoint has seen."""
        return self.nv.checkpoint_states()

    def calls(self) -> list[tuple[str, int]]:
        """The actions the daemon ran through the fake in this test, failed ones too: (action, PID)."""
        calls = self.nv.checkpoint_calls()[self.calls_before :]
        return [(c["op"], c["pid"]) for c in calls if c["op"] in ACTIONS]

    def ctl(self, user_key: str, *args: str) -> subprocess.CompletedProcess:
        return self.bed.ctl(self.users[user_key], *args)

    def suspended(self) -> list[dict]:
        r = self.bed.manager(ROOT, "ListSuspended")
        assert r.ok, r
        return r.body[0]

    def used(self, gpu: int = 0) -> int:
        return self.bed.listing()["devices"][gpu]["memory_used"]


def count(path: Path) -> int:
    return int(path.read_text() or 0)


def counting_on(path: Path) -> bool:
    before = count(path)
    time.sleep(0.4)
    return count(path) > before


@pytest.fixture
def sus(fresh_bed, nvhost, users):
    saved = nvhost.snapshot()
    fresh_bed.start_polkit()
    s = Suspending(fresh_bed, nvhost, users)
    yield s
    nvhost.state = saved
    nvhost.write()


def test_suspend_frees_the_gpu_and_resume_gives_it_back_while_the_count_waits(sus):
    sus.start()
    heard = sus.bed.record_signals(sus.users["owner"])
    ((pid, path),) = sus.counting(memory=2 * GIB)
    assert sus.used() == 2 * GIB
    r = sus.ctl("owner", "suspend", str(pid))
    assert r.returncode == 0, r
    assert "1 process(es) suspended: 2.0 GiB" in r.stdout and "SIGSTOP" in r.stdout, r.stdout
    assert sus.states()[pid] == "checkpointed"
    wait_until(lambda: sus.used() == 0, 5, "the GPU's memory was not freed in the listing")
    doc = sus.bed.listing(sus.users["owner"])
    assert pid not in {p["pid"] for p in doc["processes"]}
    (held,) = doc["suspended"]
    assert (held["pid"], held["state"], held["memory"], held["frozen"]) == (pid, "suspended", 2 * GIB, "sigstop")
    assert "suspended" in sus.ctl("owner", "list").stdout
    assert sus.bed.listing(ROOT, "--user", "gpkowner", "--device", "0")["suspended"] == doc["suspended"]
    assert sus.bed.listing(ROOT, "--device", "1")["suspended"] == []  # list's filters select these too
    assert not counting_on(path)  # frozen while suspended
    (entry,) = sus.bed.wait_journal(MESSAGE_ID=audit.SUSPEND.message_id, GPUKILL_ACTION="suspend")
    assert entry["GPUKILL_TARGET_PID"] == str(pid) and entry["GPUKILL_MEMORY"] == str(2 * GIB)

    r = sus.ctl("owner", "resume", str(pid))
    assert r.returncode == 0, r
    assert "1 process(es) resumed: 2.0 GiB" in r.stdout, r.stdout
    assert sus.states()[pid] == "running"
    wait_until(lambda: sus.used() == 2 * GIB, 5, "the memory did not come back")
    sus.bed.wait_listed(pid)
    assert counting_on(path)  # the count continues where it stopped
    assert sus.suspended() == []
    assert [op for op, _ in sus.calls()] == list(ACTIONS)
    for member, state in (("ProcessSuspended", "suspended"), ("ProcessResumed", "running")):
        signal = heard.wait_for(member)
        assert signal is not None, f"no {member} signal"
        process, caller_uid = signal["body"]
        assert (process["pid"], process["state"], caller_uid) == (pid, state, sus.users["owner"].uid), signal


def test_resume_waits_for_the_memory_and_says_the_figures(sus):
    sus.start()
    ((pid, _),) = sus.counting(memory=8 * GIB)
    assert sus.ctl("owner", "suspend", str(pid)).returncode == 0
    hog = sus.bed.victim(sus.users["other"])
    sus.nvml(lambda state: sus._add(state, hog.pid, 75 * GIB))
    sus.bed.wait_listed(hog.pid)
    r = sus.ctl("owner", "resume", str(pid))
    assert r.returncode == 8, r  # busy
    assert r.stderr.strip() == "gpukillctl: GPU 0 has 4.6 GiB free; the workload needs 8.0 GiB", r.stderr
    assert sus.suspended()[0]["state"] == "suspended"  # nothing touched
    sus.nvml(lambda state: state["devices"][0]["compute"].pop(-1))
    wait_until(lambda: sus.ctl("owner", "resume", str(pid)).returncode == 0, 10, "resume never went through")


def test_a_process_on_two_gpus_needs_its_memory_back_on_each(sus):
    sus.start()
    ((pid, _),) = sus.counting(memory=2 * GIB)
    sus.nvml(lambda state: state["devices"][1]["compute"].append({"pid": pid, "used_memory": GIB}))
    wait_until(lambda: sus.used(1) == GIB, 5, "not listed on GPU 1")
    assert sus.ctl("owner", "suspend", str(pid)).returncode == 0
    (held,) = sus.suspended()
    assert (held["devices"], held["memory"], held["device_memory"]) == ([0, 1], 3 * GIB, [2 * GIB, GIB])
    hog = sus.bed.victim(sus.users["other"])
    sus.nvml(lambda state: state["devices"][1]["compute"].append({"pid": hog.pid, "used_memory": 79 * GIB}))
    sus.bed.wait_listed(hog.pid)
    r = sus.ctl("owner", "resume", str(pid))
    assert r.returncode == 8 and "GPU 1 has 663.0 MiB free; the workload needs 1.0 GiB" in r.stderr, r


@pytest.mark.parametrize("step", ["lock", "checkpoint"])
def test_a_failure_on_one_of_two_leaves_both_running(sus, step):
    sus.start(driver="610.43")
    (root, proot), (worker, pworker) = sus.counting(workers=1)
    sus.nv.checkpoint_fault(worker, **({"lock_timeout": True} if step == "lock" else {"checkpoint_error": True}))
    r = sus.ctl("owner", "suspend", "--tree", str(root))
    assert r.returncode == 1, r
    assert f"{step} of PID {worker} failed" in r.stdout and "every process is running again" in r.stdout, r.stdout
    states = sus.states()
    assert states[root] == states[worker] == "running"
    calls = sus.calls()
    assert ("unlock", root) in calls
    if step == "lock":  # the lock waited out the daemon's --timeout for the worker's submitted work
        assert ("lock", worker) in calls and ("unlock", worker) not in calls
    else:  # the root was checkpointed: restored, then unlocked; the worker unlocked
        assert ("restore", root) in calls and ("unlock", worker) in calls
    wait_until(lambda: sus.used() == 4 * GIB, 5, "the restored memory is not back on the GPU")
    assert counting_on(proot) and counting_on(pworker)
    assert sus.suspended() == []
    assert sus.bed.wait_journal(MESSAGE_ID=audit.SUSPEND_FAILED.message_id, GPUKILL_RESULT="undone")


def test_restore_out_of_memory_is_stuck_with_its_remedy_and_killed_through_the_suspended_path(sus, alive):
    sus.start()
    ((pid, _),) = sus.counting()
    assert sus.ctl("owner", "suspend", str(pid)).returncode == 0
    sus.nv.checkpoint_fault(pid, restore_oom=True)
    r = sus.ctl("owner", "resume", str(pid))
    assert r.returncode == 1, r
    assert "stuck" in r.stdout and "kill it (gpukillctl kill" in r.stdout, r.stdout
    (held,) = sus.suspended()
    assert held["state"] == "stuck" and "out of memory" in held["error"] and held["remedy"]
    entries = sus.bed.wait_journal(MESSAGE_ID=audit.SUSPEND_FAILED.message_id, GPUKILL_ACTION="resume")
    assert entries and entries[0]["GPUKILL_REMEDY"]
    calls = len(sus.calls())
    time.sleep(1)
    assert len(sus.calls()) == calls  # never retried by itself
    r = sus.ctl("owner", "kill", str(pid))
    assert r.returncode == 0, r
    wait_until(lambda: not alive(pid), 5, "the stuck process was not killed")
    assert sus.suspended() == []


def test_kill_of_a_suspended_process_sends_sigkill_and_forgets_it(sus, alive):
    sus.start()
    ((pid, _),) = sus.counting()
    assert sus.ctl("owner", "suspend", str(pid)).returncode == 0
    r = sus.ctl("owner", "kill", str(pid))
    assert r.returncode == 0, r
    wait_until(lambda: not alive(pid), 5, "the suspended process was not killed")
    assert sus.suspended() == []
    assert sus.bed.wait_journal(MESSAGE_ID=audit.SUSPEND.message_id, GPUKILL_ACTION="kill")


def test_no_kill_meets_a_process_mid_suspend(sus, alive):
    sus.start()
    ((pid, _),) = sus.counting()
    sus.nv.checkpoint_fault(pid, hang={"checkpoint": 3})  # a slow copy of a large process's memory
    suspending = subprocess.Popen(
        [PYTHON, "-m", "gpukillctl", "suspend", str(pid)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=sus.bed.env(),
    )
    wait_until(lambda: sus.states().get(pid) == "locked", 10, "never locked")
    r = sus.ctl("root", "kill", "--force", str(pid))
    assert r.returncode == 13, r  # busy: try again
    assert "is being suspended; kill it once the suspend is done" in r.stderr, r.stderr
    out, _ = suspending.communicate(timeout=30)
    assert suspending.returncode == 0 and "suspended" in out, out
    assert sus.ctl("root", "kill", str(pid)).returncode == 0  # now through the suspended path: SIGKILL
    wait_until(lambda: not alive(pid), 5, "the suspended process was not killed")


def test_refusals_are_one_line_and_touch_nothing(sus):
    def mig(state: dict) -> None:
        gpu = state["devices"][1]
        gpu["mig_mode"] = 1
        gpu["mig_devices"] = [mig_instance("MIG-11111111-2222-3333-4444-555555555555", 1, 0, 10 * GIB)]

    sus.nvml(mig)
    sus.start()
    ((pid, _),) = sus.counting(memory=64 * GIB)
    r = sus.ctl("owner", "suspend", str(pid))
    assert r.returncode == 9, r
    assert r.stderr.count("\n") == 1 and "does not fit in host memory" in r.stderr, r.stderr
    ((two, _), (worker, _)) = sus.counting(workers=1, memory=GIB)
    r = sus.ctl("owner", "suspend", "--tree", str(two))
    assert r.returncode == 9 and "CUDA IPC between them needs driver 610" in r.stderr, r
    on_mig = sus.bed.victim(sus.users["owner"])

    def onto_mig(state: dict) -> None:
        state["devices"][1]["mig_devices"][0]["compute"].append({"pid": on_mig.pid, "used_memory": GIB})

    sus.nvml(onto_mig)
    sus.bed.wait_listed(on_mig.pid)
    r = sus.ctl("owner", "suspend", str(on_mig.pid))
    assert r.returncode == 9 and r.stderr.count("\n") == 1 and "MIG" in r.stderr, r
    assert sus.calls() == []


def test_an_old_driver_is_refused_in_one_line(sus):
    sus.start(driver="535.104.05")
    ((pid, path),) = sus.counting()
    r = sus.ctl("owner", "suspend", str(pid))
    assert r.returncode == 9, r
    assert r.stderr == (
        "gpukillctl: NVIDIA driver 535.104.05 cannot suspend: the checkpoint API needs driver 550 or later\n"
    )
    assert sus.calls() == [] and counting_on(path)


def test_another_users_suspend_and_resume_are_refused_by_polkit(sus):
    sus.start()
    ((pid, path),) = sus.counting()
    r = sus.ctl("other", "suspend", str(pid))
    assert r.returncode == 4, r  # denied: suspend-any-process needs an administrator
    assert sus.calls() == [] and counting_on(path)
    assert sus.bed.wait_journal(MESSAGE_ID=audit.SUSPEND_DENIED.message_id)
    assert sus.ctl("owner", "suspend", str(pid)).returncode == 0
    r = sus.ctl("other", "resume", str(pid))
    assert r.returncode == 4, r
    assert sus.suspended()[0]["state"] == "suspended"
    assert sus.ctl("root", "resume", str(pid)).returncode == 0


def test_a_restart_keeps_the_suspended_workload_and_drops_a_gone_one(sus):
    sus.start()
    ((pid, path),) = sus.counting()
    ((gone, _),) = sus.counting()
    assert sus.ctl("owner", "suspend", str(pid)).returncode == 0
    assert sus.ctl("owner", "suspend", str(gone)).returncode == 0
    sus.bed.stop_daemon()
    os.kill(gone, 9)
    wait_until(lambda: not Path(f"/proc/{gone}").exists() or "Z" in Path(f"/proc/{gone}/stat").read_text(), 5, "")
    next(p for p in sus.bed.procs if p.pid == gone).wait(5)
    sus.start()
    (held,) = sus.suspended()
    assert (held["pid"], held["state"]) == (pid, "suspended")  # kept, never resumed by itself
    assert not counting_on(path) and sus.states()[pid] == "checkpointed"
    assert sus.bed.wait_journal(
        MESSAGE_ID=audit.SUSPEND.message_id, GPUKILL_ACTION="gone", GPUKILL_TARGET_PID=str(gone)
    )
    assert sus.ctl("owner", "resume", str(pid)).returncode == 0
    assert counting_on(path)


def test_a_dataloader_tree_is_suspended_and_resumed_as_one(sus):
    sus.start(driver="610.43")
    members = sus.counting(workers=2, memory=GIB)
    root = members[0][0]
    assert sus.used() == 3 * GIB
    r = sus.ctl("owner", "suspend", "--tree", str(root))
    assert r.returncode == 0, r
    assert "3 process(es) suspended: 3.0 GiB" in r.stdout, r.stdout
    wait_until(lambda: sus.used() == 0, 5, "the tree's memory was not freed")
    assert {h["pid"] for h in sus.suspended()} == {pid for pid, _ in members}
    assert not any(counting_on(path) for _, path in members)
    worker = members[2][0]
    r = sus.ctl("owner", "resume", str(worker))  # any member names the workload: resumed whole
    assert r.returncode == 0, r
    assert "3 process(es) resumed: 3.0 GiB" in r.stdout, r.stdout
    wait_until(lambda: sus.used() == 3 * GIB, 5, "the tree's memory did not come back")
    assert all(counting_on(path) for _, path in members)


def test_selection_errors_are_one_line(sus):
    sus.start()
    r = sus.ctl("owner", "resume", "--unit", "nothing-here.service")
    assert r.returncode == 5 and r.stderr.count("\n") == 1 and "is suspended" in r.stderr, r
    r = sus.bed.manager(ROOT, "SuspendWorkload", "a{sv}a{sv}", [{"container": {"$variant": ["s", "0" * 12]}}, {}])
    assert not r.ok and "unknown selection key" in r.message, r


def test_a_gpu_without_a_checkpoint_api_is_refused_in_one_line(victims, users):
    """The session's bed: simulated GPUs, which (as AMD's and Intel's) no driver API can set aside."""
    victim = victims.victim(users["owner"], mem="1GiB")
    victims.wait_listed(victim.pid)
    r = victims.ctl(users["owner"], "suspend", str(victim.pid))
    assert r.returncode == 9, r
    assert r.stderr == (
        "gpukillctl: GPU 0 is simulated: no driver API sets a process's GPU memory aside today; kill or wait\n"
    )
    assert victim.poll() is None
