"""What an idle NVIDIA host costs the backend: NVML calls per sample, counted by the fake library
itself, and /proc reads per sample, counted at ProcFS; and that what it does not read again is still seen at once
(a process that ends, a new one) because the exit watch says when to read again.

In-process: the fake libnvidia-ml loaded under its soname (so pynvml's dlopen finds it), real child processes
listed as the GPU processes, the backend sampled directly."""

from __future__ import annotations

import ctypes
import subprocess
import time

import pytest
from helpers.nvml_host import fake_nvidia_host

from gpukilld.backends.nvidia import NvidiaBackend
from gpukilld.proc.procfs import ProcFS

GPUS = 8
PER_GPU = 16
GIB = 2**30
# An unchanged host's sample: the device count and the Xid event poll, then per GPU utilization, memory,
# temperature, power, power limit, MIG mode, the three process lists (one call each) and the per-process
# utilization. Handles are looked up once, and each list is one call into a buffer kept between samples.
CALLS_PER_IDLE_SAMPLE = 2 + GPUS * 10


class CountingProcFS(ProcFS):
    """This host's /proc, counting the stat reads the backend makes."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = 0

    def stat(self, pid):
        self.stats += 1
        return super().stat(pid)


@pytest.fixture(scope="module")
def nvhost(tmp_path_factory):
    return fake_nvidia_host(tmp_path_factory.mktemp("nvml-cost"), devices=GPUS)


@pytest.fixture
def gpu_host(nvhost, monkeypatch):
    """The fake host, with PER_GPU sleeping children on each GPU; the library loaded in this process."""
    ctypes.CDLL(str(nvhost.lib), mode=ctypes.RTLD_GLOBAL)
    for key, value in nvhost.env().items():
        if key.startswith("GPUKILL_FAKE_"):
            monkeypatch.setenv(key, value)
    saved = nvhost.snapshot()
    procs = [subprocess.Popen(["sleep", "300"]) for _ in range(GPUS * PER_GPU)]
    for n, p in enumerate(procs):
        nvhost.add_process(n % GPUS, p.pid, GIB, kind="graphics" if n % 4 == 3 else "compute")
    nvhost.write()
    yield nvhost, procs
    for p in procs:
        p.kill()
        p.wait()
    nvhost.state = saved
    nvhost.write()


def listed(sample) -> set[tuple[int, int]]:
    return {(p.pid, p.start_time) for p in sample.processes}


def start_time(pid: int) -> int:
    return ProcFS().start_time(pid)


def test_an_idle_sample_makes_only_the_calls_whose_answers_can_change_and_reads_no_proc(gpu_host):
    nvhost, procs = gpu_host
    procfs = CountingProcFS()
    b = NvidiaBackend(procfs)
    try:
        first = b.sample()
        assert listed(first) == {(p.pid, start_time(p.pid)) for p in procs}
        b.sample()
        calls, procfs.stats = nvhost.calls(), 0
        idle = b.sample()
        calls, stats = nvhost.calls() - calls, procfs.stats
        assert listed(idle) == listed(first)
        # every start time held by the exit watch: none read again until one ends (or its turn in the rotation)
        assert (calls <= CALLS_PER_IDLE_SAMPLE, stats) == (True, 0), (calls, stats)
    finally:
        b.close()


def test_what_is_not_read_again_is_still_seen_in_the_next_sample(gpu_host):
    nvhost, procs = gpu_host
    b = NvidiaBackend(CountingProcFS())
    try:
        b.sample()
        b.sample()
        # One ends (reaped) while the driver still lists it, as it may for a moment: gone from the next sample.
        gone = procs[5]
        gone.kill()
        gone.wait()
        assert gone.pid not in {p.pid for p in b.sample().processes}
        # A new process on GPU 2: in the next sample, with its start time.
        new = subprocess.Popen(["sleep", "300"])
        procs.append(new)
        nvhost.add_process(2, new.pid, 2 * GIB)
        nvhost.write()
        got = {p.pid: p for p in b.sample().processes}
        assert (got[new.pid].start_time, got[new.pid].gpu_memory) == (start_time(new.pid), 2 * GIB)
    finally:
        b.close()


def test_an_unchanged_host_hands_back_the_same_records(gpu_host):
    """The same objects, so that the sampler's comparison of this sample's usages with the last one's is an
    identity check per record, and it reuses the GpuProcess records it built (as for the simulated backend)."""
    b = NvidiaBackend(CountingProcFS())
    try:
        b.sample()
        one, two = b.sample().processes, b.sample().processes
        assert len(one) == len(two) == GPUS * PER_GPU
        assert all(a is b for a, b in zip(one, two, strict=True))
    finally:
        b.close()


def test_a_followed_start_time_is_not_read_again_however_long_it_runs(gpu_host, monkeypatch):
    """A pidfd says when its process ends, and a start time cannot change while it lives: an unchanged host's
    start times are read once, not again in a rotation (the 60-90 s one there was read 2,048 stats a turn that
    the watch had answered already), hours of clock later as in the next second."""
    now = [time.monotonic()]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    b = NvidiaBackend(CountingProcFS())
    try:
        one = b.sample().processes
        b.procfs.stats = 0
        for _ in range(20):
            now[0] += 600.0
            later = b.sample().processes
        assert b.procfs.stats == 0
        assert all(x is y for x, y in zip(one, later, strict=True))
    finally:
        b.close()


def test_a_process_the_watch_cannot_hold_is_read_every_sample(gpu_host):
    """Past the watch's descriptor budget nothing tells of an end: such a process is read again each sample, and
    the records are not reused, so one that ends is still gone from the next sample."""
    from gpukilld.proc.exit_watch import ExitWatch

    nvhost, procs = gpu_host
    procfs = CountingProcFS()
    b = NvidiaBackend(procfs)
    b._watch = ExitWatch(budget=0)
    try:
        b.sample()
        procfs.stats = 0
        b.sample()
        assert procfs.stats >= GPUS * PER_GPU  # every start time read again
        gone = procs[9]
        gone.kill()
        gone.wait()
        assert gone.pid not in {p.pid for p in b.sample().processes}
    finally:
        b.close()


class CountingChecks(NvidiaBackend):
    """Counts the process lists decoded and checked (_plausible runs once for each list made from NVML's bytes)."""

    checked = 0

    def _plausible(self, records, total):
        self.checked += 1
        return super()._plausible(records, total)


def test_an_unchanged_gpus_lists_are_not_decoded_again_and_a_changed_one_is_seen_at_once(gpu_host):
    """NVML writes the same bytes for an unchanged GPU's three lists: its entries are the last sample's, not
    decoded and checked again; a GPU whose list changed (memory, a process's utilization) is read anew, in the
    next sample, and only it."""
    nvhost, procs = gpu_host
    b = CountingChecks(CountingProcFS())
    try:
        b.sample()
        b.sample()
        b.checked = 0
        before = {(p.pid, p.device_id): p for p in b.sample().processes}
        assert b.checked == 0
        # GPU 2's first process now holds 5 GiB: its three lists are decoded again, the other GPUs' are not.
        entry = nvhost.device(2)["compute"][0]
        entry["used_memory"] = 5 * GIB
        nvhost.write()
        after = {(p.pid, p.device_id): p for p in b.sample().processes}
        assert b.checked == 3
        key = (entry["pid"], nvhost.device(2)["uuid"])
        assert (before[key].gpu_memory, after[key].gpu_memory) == (GIB, 5 * GIB)
        assert all(after[k] is before[k] for k in before if k != key)
        # A utilization sample for a process on GPU 5: seen in the next sample, though the lists are unchanged.
        busy = procs[5]
        nvhost.device(5)["process_util"].append({"pid": busy.pid, "sm": 42, "mem": 1, "timestamp": 7})
        nvhost.write()
        b.checked = 0
        now = {p.pid: p for p in b.sample().processes}
        assert (b.checked, now[busy.pid].gpu_utilization) == (0, 42.0)
    finally:
        b.close()
