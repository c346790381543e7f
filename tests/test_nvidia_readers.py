"""Who reads the GPUs (gpukilld/backends/nvidia.py, NvidiaBackend._read_all): one reader thread, all of them in
turn, while none hangs (one hand-over a sample: a thread per GPU costs ~1 ms a sample in wake-ups on 8
GPUs); and a hung call still costs only its own GPU, in the sample it hangs in and in the ones after.

In-process: the fake libnvidia-ml loaded under its soname, its "slow_ms" fault making every call of one GPU
sleep; the backend sampled directly, each device read recorded with the thread that made it."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
from helpers.nvml_host import fake_nvidia_host
from helpers.waiting import wait_until

from gpukilld.backends import nvidia
from gpukilld.backends.nvidia import NvidiaBackend

GPUS = 8
# Wall time, as a hung call sleeps: a healthy read takes milliseconds, and well under a second on a loaded
# machine (CI runs 4 workers on 2 cores), so only the hung GPU misses the deadline.
DEADLINE = 1.0
HANG = 5.0  # seconds each call of the hung GPU takes: past two deadlines and a sample, yet short to wait out


@pytest.fixture
def nvhost(tmp_path, monkeypatch):
    host = fake_nvidia_host(tmp_path, devices=GPUS)
    ctypes.CDLL(str(host.lib), mode=ctypes.RTLD_GLOBAL)
    for key, value in host.env().items():
        if key.startswith("GPUKILL_FAKE_"):
            monkeypatch.setenv(key, value)
    return host


@pytest.fixture
def readers(monkeypatch) -> list[tuple[int, str]]:
    """(GPU index, the name of the thread that read it), each device read of the test, in order."""
    seen: list[tuple[int, str]] = []
    read = NvidiaBackend._read_device

    def recorded(self, state):
        seen.append((state.index, threading.current_thread().name))
        return read(self, state)

    monkeypatch.setattr(NvidiaBackend, "_read_device", recorded)
    return seen


def states(sample) -> list[str]:
    return [d.state for d in sample.devices]


def nvml_threads() -> list[str]:
    return sorted(th.name for th in threading.enumerate() if th.name.startswith("nvml-"))


def test_every_gpu_is_read_by_one_reader_thread(nvhost, readers):
    b = NvidiaBackend(device_deadline=DEADLINE)
    try:
        for _ in range(3):
            assert states(b.sample()) == ["ok"] * GPUS
        assert readers == [(i, "nvml-reader-1") for i in range(GPUS)] * 3
        assert nvml_threads() == ["nvml-reader-1"]
    finally:
        b.close()


def started(readers: list) -> NvidiaBackend:
    """A backend past its first sample (NVML initialised, every handle read: calls a fault would slow too)."""
    b = NvidiaBackend(device_deadline=DEADLINE)
    assert states(b.sample()) == ["ok"] * GPUS
    del readers[:]
    return b


def test_a_hung_call_costs_its_own_gpu_only_in_its_sample_and_after(nvhost, readers):
    b = started(readers)
    nvhost.fault(2, slow_ms=int(HANG * 1000))
    try:
        t0 = time.monotonic()
        first = b.sample()
        took = time.monotonic() - t0
        # GPU 2 is lost at the deadline; the five the reader had not come to were read by threads of their own
        assert states(first) == ["ok", "ok", "lost"] + ["ok"] * 5, states(first)
        assert first.devices[2].state_reason == f"NVML did not answer within {DEADLINE:g}s"
        assert readers[:3] == [(0, "nvml-reader-1"), (1, "nvml-reader-1"), (2, "nvml-reader-1")], readers
        assert sorted(readers[3:]) == [(i, f"nvml-{i}") for i in range(3, GPUS)], readers  # in parallel
        assert DEADLINE <= took < 2 * DEADLINE + 0.5, took

        # the next sample: the reader still in GPU 2's call is left to it, a new one reads the others at once
        del readers[:]
        t0 = time.monotonic()
        second = b.sample()
        assert time.monotonic() - t0 < DEADLINE  # nothing in this sample's reads hangs: no deadline waited
        assert states(second) == ["ok", "ok", "lost"] + ["ok"] * 5, states(second)
        assert readers == [(i, "nvml-reader-2") for i in range(GPUS) if i != 2], readers

        # the call returns: the old reader skips what was taken from it and ends; GPU 2 is read again
        nvhost.clear_faults(2)
        wait_until(lambda: "nvml-reader-1" not in nvml_threads(), HANG + 10, "the hung reader never ended")
        del readers[:]
        assert states(b.sample()) == ["ok"] * GPUS
        assert readers == [(i, "nvml-reader-2") for i in range(GPUS)], readers
    finally:
        b.close()


def test_a_gpu_that_hangs_in_its_own_thread_is_skipped_until_it_returns(nvhost, readers):
    """Two hung GPUs: the second one hangs in the thread it was handed to; neither holds up a sample twice."""
    b = started(readers)
    nvhost.fault(2, slow_ms=int(HANG * 1000))
    nvhost.fault(5, slow_ms=int(HANG * 1000))
    try:
        t0 = time.monotonic()
        first = b.sample()
        assert time.monotonic() - t0 < 2 * DEADLINE + 0.5  # twice the deadline at most, however many hang
        assert states(first) == ["ok", "ok", "lost", "ok", "ok", "lost", "ok", "ok"], states(first)
        t0 = time.monotonic()
        assert states(b.sample()) == ["ok", "ok", "lost", "ok", "ok", "lost", "ok", "ok"]
        assert time.monotonic() - t0 < DEADLINE
    finally:
        b.close()
    # the hung readers end when their calls return, and are not left to a test that counts the threads
    wait_until(lambda: not nvml_threads(), HANG + 10, lambda: f"readers still running: {nvml_threads()}")
    assert nvidia.DEVICE_DEADLINE > DEADLINE  # the daemon's own deadline is longer than this test's
