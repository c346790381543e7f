"""Sampling that reads only what may have changed (bench/idle_cost) and still sees every change that matters:
a process that ends is gone from the next sample (a zombie too), a reused PID is a new process, exec and
renames are seen (at once while a process is young, in rotation after), records and findings are reused only
while their inputs are equal, and the incremental audit finds what a full evaluation finds."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.guard_inputs import GiB, proc
from helpers.waiting import wait_until

from gpukill.procstat import ProcStat
from gpukilld.backends import Backend, BackendSample
from gpukilld.backends import simulated as simulated_module
from gpukilld.backends.simulated import SimulatedBackend
from gpukilld.config import AuditSettings
from gpukilld.model import BackendStatus, DeviceReading, ProcessUsage
from gpukilld.proc import exit_watch as exit_watch_module
from gpukilld.proc.exit_watch import ExitWatch
from gpukilld.proc.procfs import ProcFS
from gpukilld.rogue.watch import RogueWatch
from gpukilld.sampling import sampler as sampler_module
from gpukilld.sampling.sampler import Sampler

SCOPE = f"sampling-cost-{os.getpid()}"
SIM = "scope: {scope}\ndevices:\n  - name: g0\n    uuid: GPU-0\n  - name: g1\n    uuid: GPU-1\n"


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def spawn(children: list, code: str, gpu: str | None = "0", **env: str) -> subprocess.Popen:
    environ = {"PATH": "/usr/bin:/bin", **env}
    if gpu is not None:
        environ.update(GPUKILL_SIM_GPU=gpu, GPUKILL_SIM_SCOPE=SCOPE)
    p = subprocess.Popen([sys.executable, "-c", code], env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    children.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    return p


SLEEPER = "import sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\ntime.sleep(3600)\n"
# Renames itself (prctl PR_SET_NAME) to the line it reads, once.
RENAMER = (
    "import ctypes, sys, time\nprint('ready', flush=True)\nname = sys.stdin.readline().strip().encode()\n"
    "ctypes.CDLL(None).prctl(15, name, 0, 0, 0)\nprint('renamed', flush=True)\ntime.sleep(3600)\n"
)


def backend(tmp_path: Path, procfs: ProcFS | None = None) -> SimulatedBackend:
    path = tmp_path / "sim.yaml"
    path.write_text(SIM.format(scope=SCOPE))
    return SimulatedBackend(str(path), procfs)


def listed(b: SimulatedBackend) -> set[int]:
    return {u.pid for u in b.sample().processes}


# -- the kernel says who ended --------------------------------------------------------------------------------


def test_exit_watch_reports_an_end_once_a_zombie_before_it_is_reaped(children):
    p = spawn(children, SLEEPER, gpu=None)
    start = ProcFS().stat(p.pid).start_time
    watch = ExitWatch()
    assert watch.follow(p.pid, start) and len(watch) == 1
    assert not watch.follow(p.pid, start + 1)  # not that process: the start time differs
    assert watch.ended() == set()
    p.kill()
    wait_until(lambda: ProcFS().stat(p.pid).state == "Z", 30, "the child did not die")
    assert watch.ended() == {(p.pid, start)} and len(watch) == 0  # a zombie, not reaped yet
    assert watch.ended() == set()
    p.wait()
    assert not watch.follow(p.pid, start)  # gone
    watch.close()


def test_exit_watch_holds_no_more_pidfds_than_its_budget(children):
    """Users choose how many processes there are: past its budget the watch says no, and the caller re-reads."""
    a, b = spawn(children, SLEEPER, gpu=None), spawn(children, SLEEPER, gpu=None)
    watch = ExitWatch(budget=1)
    assert watch.follow(a.pid, ProcFS().stat(a.pid).start_time)
    assert not watch.follow(b.pid, ProcFS().stat(b.pid).start_time) and len(watch) == 1
    watch.close()


def test_the_default_budget_leaves_the_headroom_of_the_descriptor_limit():
    soft, _ = exit_watch_module.resource.getrlimit(exit_watch_module.resource.RLIMIT_NOFILE)
    assert exit_watch_module.fd_budget() == max(0, soft - exit_watch_module.FD_HEADROOM)


# -- the simulated backend ------------------------------------------------------------------------------------


def test_a_gpu_process_that_ends_is_gone_from_the_next_sample_zombie_or_reaped(tmp_path, children, monkeypatch):
    monkeypatch.setattr(simulated_module, "YOUNG", 0.0)  # not read every sample: only its pidfd tells
    b = backend(tmp_path)
    p, q = spawn(children, SLEEPER), spawn(children, SLEEPER)
    assert {p.pid, q.pid} <= listed(b)
    p.kill()
    wait_until(lambda: ProcFS().stat(p.pid).state == "Z", 30, "the child did not die")
    assert p.pid not in listed(b) and q.pid in listed(b)  # a zombie holds no GPU
    p.wait()
    assert p.pid not in listed(b)
    q.kill()
    q.wait()  # reaped at once: its PID leaves /proc
    assert q.pid not in listed(b)


def test_unchanged_samples_hand_back_the_same_records(tmp_path, children):
    b = backend(tmp_path)
    spawn(children, SLEEPER)
    first = b.sample().processes
    again = b.sample().processes
    assert first and all(x is y for x, y in zip(first, again, strict=True))


def test_a_new_process_on_no_gpu_leaves_the_records_standing(tmp_path, children):
    """A busy host starts processes all the time, most on no GPU: each is read once (it is new to /proc), and the
    GPU processes' records stay the same objects. (They were built anew whenever any process appeared.)"""
    b = backend(tmp_path)
    spawn(children, SLEEPER)
    first = b.sample().processes
    b.sample()
    spawn(children, SLEEPER, gpu=None)
    again = b.sample().processes
    assert first and all(x is y for x, y in zip(first, again, strict=True))


def test_an_exec_into_a_simulated_gpu_is_seen_while_young_and_in_rotation_when_old(tmp_path, children, monkeypatch):
    b = backend(tmp_path)
    env_line = f"GPUKILL_SIM_GPU=1 GPUKILL_SIM_SCOPE={SCOPE}"
    code = (
        "import os, sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"
        f"os.execvp('env', ['env', *{env_line.split()!r}, 'sleep', '3600'])\n"
    )
    young = spawn(children, code, gpu=None)
    assert young.pid not in listed(b)
    young.stdin.write(b"go\n")
    young.stdin.flush()
    wait_until(lambda: young.pid in listed(b), 30, "the exec of a young process was not seen")

    monkeypatch.setattr(simulated_module, "YOUNG", 0.0)  # every process is old: read once, then in rotation
    monkeypatch.setattr(simulated_module, "RECHECK", 0.5)
    old = spawn(children, code, gpu=None)
    assert old.pid not in listed(b)
    old.stdin.write(b"go\n")
    old.stdin.flush()
    wait_until(lambda: ProcFS().stat(old.pid).comm == "sleep", 30, "no exec")
    assert old.pid not in listed(b)  # not due yet: the verdict stands
    wait_until(lambda: old.pid in listed(b), 30, "the rotation did not read the process again")


class ReusedPid(ProcFS):
    """/proc with one made-up process whose PID is reused: a new inode, start time and environment."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 0

    def pid_inodes(self) -> dict[int, int]:
        return {4_000_000: 100 + self.generation}

    def is_this_hosts(self) -> bool:
        return True  # so the backend trusts inodes, as on a real /proc

    def last_pid(self) -> int:
        return 4_000_000 + self.generation  # the kernel made a process: the PID counter moved

    def stat(self, pid: int) -> ProcStat | None:
        return ProcStat(pid=pid, comm="worker", state="S", ppid=1, flags=0, start_time=1 + self.generation)

    def environ(self, pid: int) -> dict[str, str]:
        return {"GPUKILL_SIM_GPU": "0", "GPUKILL_SIM_SCOPE": SCOPE} if self.generation else {"HOME": "/"}


def test_a_reused_pid_is_read_as_a_new_process(tmp_path):
    fake = ReusedPid()
    b = backend(tmp_path, fake)
    assert listed(b) == set() and listed(b) == set()  # an old process, not on a GPU: not read again soon
    fake.generation = 1  # the PID now names another process
    assert [(u.pid, u.start_time) for u in b.sample().processes] == [(4_000_000, 2)]


class Counted(ProcFS):
    """This host's /proc, counting its scans, with a PID counter the test moves."""

    def __init__(self) -> None:
        super().__init__()
        self.scans = 0
        self.counter = 1

    def pid_inodes(self) -> dict[int, int]:
        self.scans += 1
        return super().pid_inodes()

    def last_pid(self) -> int:
        return self.counter


def test_proc_is_scanned_when_a_process_was_created_and_every_full_scan_interval(tmp_path, children, monkeypatch):
    procfs = Counted()
    b = backend(tmp_path, procfs)
    p = spawn(children, SLEEPER)
    assert p.pid in listed(b) and procfs.scans == 1
    assert p.pid in listed(b) and procfs.scans == 1  # no process created: the last scan stands
    q = spawn(children, SLEEPER)
    procfs.counter += 1
    assert q.pid in listed(b) and procfs.scans == 2
    monkeypatch.setattr(simulated_module, "FULL_SCAN", 0.0)  # the counter may have wrapped round: scan anyway
    listed(b)
    assert procfs.scans == 3


def test_the_last_pid_moves_when_a_process_is_created(children):
    before = ProcFS().last_pid()
    p = spawn(children, SLEEPER)
    after = ProcFS().last_pid()
    assert before is not None and after is not None and after != before and (after >= p.pid or after < before)
    assert ProcFS("/nonexistent").last_pid() is None


# -- the sampler ----------------------------------------------------------------------------------------------


class Fixed(Backend):
    """A backend that reports the given processes on one device."""

    name = "fixed"

    def __init__(self) -> None:
        self.usages: list[ProcessUsage] = []

    def status(self) -> BackendStatus:
        return BackendStatus(self.name, True, "")

    def sample(self) -> BackendSample:
        return BackendSample(devices=[DeviceReading(id="GPU-F", vendor="x", name="x")], processes=list(self.usages))

    def reset(self, device_id: str) -> str:
        raise NotImplementedError


def test_the_sampler_reuses_records_and_sees_a_rename_at_once_when_young_in_rotation_when_old(children, monkeypatch):
    fixed = Fixed()
    s = Sampler([fixed], 1.0, ProcFS(), lambda snap, changes: None)
    young = spawn(children, RENAMER, gpu=None)
    fixed.usages = [ProcessUsage(young.pid, ProcFS().stat(young.pid).start_time, "GPU-F", GiB, 1.0)]
    first, _ = s.sample_once()
    again, _ = s.sample_once()
    assert again.generation == first.generation and again.processes[0] is first.processes[0]
    other = spawn(children, SLEEPER, gpu=None)  # another process comes: the first one's record stays
    fixed.usages.append(ProcessUsage(other.pid, ProcFS().stat(other.pid).start_time, "GPU-F", GiB, 1.0))
    changed, _ = s.sample_once()
    assert changed.generation != first.generation and len(changed.processes) == 2
    assert any(p is first.processes[0] for p in changed.processes)
    fixed.usages.pop()
    young.stdin.write(b"renamed-young\n")
    young.stdin.flush()
    assert young.stdout.readline().strip() == b"renamed"
    assert s.sample_once()[0].processes[0].comm == "renamed-young"

    monkeypatch.setattr(sampler_module, "YOUNG", 0.0)
    monkeypatch.setattr(sampler_module, "STAT_TTL", 0.5)
    old = spawn(children, RENAMER, gpu=None)
    fixed.usages = [ProcessUsage(old.pid, ProcFS().stat(old.pid).start_time, "GPU-F", GiB, 1.0)]
    assert s.sample_once()[0].processes[0].comm == ProcFS().stat(old.pid).comm
    old.stdin.write(b"renamed-old\n")
    old.stdin.flush()
    assert old.stdout.readline().strip() == b"renamed"
    assert s.sample_once()[0].processes[0].comm != "renamed-old"  # not due yet
    wait_until(lambda: s.sample_once()[0].processes[0].comm == "renamed-old", 30, "the rename was never read")
    # usage changed: a new record; the backend stops reporting it: gone from the next sample
    fixed.usages = [dataclasses.replace(fixed.usages[0], gpu_memory=2 * GiB)]
    assert s.sample_once()[0].processes[0].gpu_memory == 2 * GiB
    fixed.usages = []
    assert s.sample_once()[0].processes == ()
    old.send_signal(signal.SIGKILL)


def test_a_process_read_again_in_rotation_and_found_the_same_leaves_the_records_standing(children, monkeypatch):
    """In rotation (polling) a few processes are read again each sample; found as they were, the sample's
    records are the last one's, not built again for every process (they were, each sample, on a busy host)."""
    monkeypatch.setattr(sampler_module, "YOUNG", 0.0)
    monkeypatch.setattr(sampler_module, "STAT_TTL", 0.0)  # every process due every sample, stat and all
    monkeypatch.setattr(sampler_module, "INFO_TTL", 0.0)
    fixed = Fixed()
    s = Sampler([fixed], 1.0, ProcFS(), lambda snap, changes: None)
    procs = [spawn(children, SLEEPER, gpu=None) for _ in range(3)]
    fixed.usages = [ProcessUsage(p.pid, ProcFS().stat(p.pid).start_time, "GPU-F", GiB, 1.0) for p in procs]
    first, _ = s.sample_once()
    again, _ = s.sample_once()
    assert len(first.processes) == 3
    assert all(a is b for a, b in zip(first.processes, again.processes, strict=True))


# -- the incremental audit ------------------------------------------------------------------------------------


class Forgetful(RogueWatch):
    """A watch that keeps its history (idle clocks, the window, connections) but derives and evaluates
    everything again each sample, as every sample did before the audit became incremental."""

    def __call__(self, processes, now):
        self._processes = None
        self._found.clear()
        return super().__call__(processes, now)


def test_the_incremental_audit_finds_what_a_full_evaluation_finds():
    """One watch is handed the same list while nothing changes (the sampler's way); the other evaluates
    everything each sample. Idle clocks cross their threshold between changes, the abuser window slides,
    processes come and go, the thresholds are reloaded."""
    settings = AuditSettings(
        idle_after=30.0, idle_min_memory=1 << 20, abuser_window=60.0, abuser_share=70.0, pool_ports=()
    )
    incremental, full = RogueWatch("/nonexistent", settings), Forgetful("/nonexistent", settings)
    idle = proc(11, mem=4 * GiB, util=0.0, uid=1000, user="u1000")
    busy = proc(12, mem=9 * GiB, util=90.0, uid=1000, user="u1000")
    other = proc(21, mem=1 * GiB, util=10.0, uid=2000, user="u2000", comm="xmrig")
    timeline = [[idle, busy, other]] * 40 + [[idle, other]] * 15 + [[busy, other]] * 50 + [[other]] * 10
    last = None
    seen_kinds = set()
    for i, processes in enumerate(timeline):
        now = 2.0 * i
        handed = last if processes == last else list(processes)
        last = handed
        if i == 30:  # a reload with another threshold while the idle process stays idle: new wording
            settings = dataclasses.replace(settings, idle_after=20.0)
            incremental.settings = full.settings = settings
        expected = full(list(processes), now)
        assert incremental(handed, now) == expected, f"sample {i} at {now} s"
        seen_kinds |= {f.kind for f in expected}
    assert seen_kinds == {"idle", "abuser", "miner"}  # the timeline exercises every kind of finding


def test_the_audit_scores_a_process_again_when_its_facts_change_not_its_utilization(monkeypatch):
    """A busy GPU's utilization moves every sample (new records each time): that alone re-scores nothing, as the
    process rules do not read it; a new command line does."""
    from gpukilld.rogue import watch as rogue_watch_module

    scored: list[int] = []
    real = rogue_watch_module.process_findings
    monkeypatch.setattr(
        rogue_watch_module,
        "process_findings",
        lambda facts, settings: scored.append(facts.pid) or real(facts, settings),
    )
    watch = RogueWatch("/nonexistent", AuditSettings(pool_ports=()))
    miner = [proc(pid, mem=GiB, util=50.0, comm="xmrig") for pid in (31, 32)]
    first = watch(miner, 0.0)
    assert sorted(scored) == [31, 32] and {f.kind for f in first} == {"miner"}
    for i in range(1, 4):
        assert watch([dataclasses.replace(p, gpu_utilization=50.0 + i) for p in miner], float(i)) == first
    assert sorted(scored) == [31, 32]
    watch([dataclasses.replace(miner[0], cmdline="xmrig --donate-level 0"), miner[1]], 4.0)
    assert sorted(scored) == [31, 31, 32]


def test_idle_processes_are_looked_at_again_only_when_they_reach_idle_after(monkeypatch):
    """An unchanged host of processes holding memory at 0% (every process of the fake NVIDIA host, which reports
    no utilization samples): their findings change only when one reaches idle_after, so only then is one
    evaluated again, not every idle process every sample; a deleted executable still is."""
    evaluated: list[int] = []
    real = RogueWatch._evaluate
    monkeypatch.setattr(
        RogueWatch, "_evaluate", lambda self, key, *rest: evaluated.append(key[0]) or real(self, key, *rest)
    )
    watch = RogueWatch("/nonexistent", AuditSettings(idle_after=30.0, idle_min_memory=1 << 20, pool_ports=()))
    idle = [proc(100 + i, mem=GiB, util=0.0) for i in range(50)]
    deleted = dataclasses.replace(proc(200, mem=GiB, util=0.0), exe="/usr/bin/python3.11 (deleted)")
    host = [*idle, deleted]
    assert watch(host, 0.0) == () and len(evaluated) == 51
    for t in range(1, 30):
        evaluated.clear()
        assert watch(host, float(t)) == ()
        assert evaluated == [200], (t, len(evaluated))  # the deleted executable's lookup is due every RECHECK
    evaluated.clear()
    found = watch(host, 30.0)
    assert len(evaluated) == 51 and {f.kind for f in found} == {"idle"} and len(found) == 51


def made_up_process(root: Path, pid: int, status_extra: str = "", groups: int = 0, cgroup: str = "0::/\n") -> None:
    """A process in a fixture /proc tree: stat, status (Groups: as long as asked), cmdline, cgroup."""
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(
        f"{pid} (made up) S 1 {pid} {pid} 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 4242 " + " ".join(["0"] * 30) + "\n"
    )
    gids = " ".join(str(1000 + n) for n in range(groups))
    (d / "status").write_text(
        f"Name:\tmade up\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t{pid}\nPid:\t{pid}\n"
        f"Uid:\t1234\t1234\t1234\t1234\nGid:\t1234\t1234\t1234\t1234\nGroups:\t{gids}\n"
        f"{status_extra}VmRSS:\t100 kB\n"
    )
    (d / "cmdline").write_bytes(b"made\0up\0")
    (d / "cgroup").write_text(cgroup)


def test_status_fields_past_a_long_groups_line_are_read(tmp_path):
    # The sampler looks two fields up in status rather than splitting every line; NSpid: comes after Groups:,
    # which holds up to 65,536 gids: past the first read, it must still be found.
    made_up_process(tmp_path, 100, "NSpid:\t100\t7\n", groups=20_000)
    made_up_process(tmp_path, 101, "NSpid:\t101\n")
    procfs = ProcFS(str(tmp_path))
    assert (tmp_path / "100" / "status").stat().st_size > 100_000
    far, near = procfs.info(100), procfs.info(101)
    assert far is not None and (far.uid, far.container_pid, far.start_time) == (1234, 7, 4242)
    assert near is not None and (near.uid, near.container_pid) == (1234, None)
    assert procfs.uid(100) == 1234


def test_a_cgroup_parse_is_kept_for_short_texts_only():
    from gpukilld.proc import attribution

    unit = "0::/system.slice/gpukill-parse-kept.service\n"
    before = attribution._parse_kept.cache_info()
    first, again = attribution.parse_cgroup(unit), attribution.parse_cgroup(unit)
    assert first is again and first.unit == "gpukill-parse-kept.service"  # the same text: the same parse
    assert attribution._parse_kept.cache_info().hits > before.hits
    # A user's made-up path as long as /proc shows (a delegated subtree): parsed each time, never held
    long = "0::/user.slice/user-1000.slice/user@1000.service/" + "x" * attribution.PARSED_TEXT_MAX + "/a.scope\n"
    size = attribution._parse_kept.cache_info().currsize
    assert attribution.parse_cgroup(long).unit == "a.scope"
    assert attribution._parse_kept.cache_info().currsize == size


def test_a_name_that_spells_a_status_field_does_not_pass_for_it(children):
    # The fields are looked up in status's text: a process that names itself "x\nUid:\t4242" must not pass for
    # uid 4242 (the kernel escapes the newline in Name:; the real Uid: line is what counts).
    code = (
        "import ctypes, time\nctypes.CDLL(None).prctl(15, b'x\\nUid:\\t4242\\t4242', 0, 0, 0)\n"
        "print('ready', flush=True)\ntime.sleep(3600)\n"
    )
    p = spawn(children, code, gpu=None)
    info = ProcFS("/proc").info(p.pid)
    assert info is not None and info.uid == os.getuid() != 4242 and "Uid" in info.comm
    assert ProcFS("/proc").uid(p.pid) == os.getuid()
