"""What an idle DRM sample reads and redoes (bench/fdinfo_scan): with trusted client lists, a holder's
fdinfo is read through a descriptor of its /proc directory, and its fd table is stat'ed only with its slice; a
busy client's fdinfo is parsed from its engine lines on (the rest looked up); unchanged figures keep their
ProcessUsage record; discovery and hwmon labels are read again only when sysfs re-creates them. And what must
stay: a reused PID is a new process, an exit or a new client shows in the next sample, a passed fd within the
safety net's period. The fixture /dev/dri nodes are made with mknod: those tests need root."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

import pytest
from helpers.drm_fixtures import DrmHost, amdgpu_fdinfo, i915_fdinfo, msm_fdinfo, panfrost_fdinfo, xe_fdinfo

from gpukilld.backends.drm import DrmBackend, discovery, fdinfo, scan, telemetry
from gpukilld.backends.drm.scan import SAFETY_NET_PERIOD

GiB = 1 << 30
needs_mknod = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: fixture /dev/dri nodes are made with mknod")
PREFIX = "pos:\t0\nflags:\t02100002\nmnt_id:\t24\nino:\t77\n"


@pytest.fixture
def host():
    root = tempfile.mkdtemp(prefix="gpukill-drm-cost-")
    try:
        yield DrmHost(root, debugfs_clients=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def crowd(host: DrmHost, first: int = 5000, count: int = 40) -> None:
    host.amdgpu()
    for pid in range(first, first + count):
        host.process(pid, "idle", start_time=pid)
        for fd in range(3):
            host.open_file(pid, fd, "/dev/null")


def backend(host: DrmHost, **kw) -> DrmBackend:
    return DrmBackend(
        str(host.sys), str(host.proc), str(host.debugfs), clock=lambda: 0.0, use_rsmi=False, revalidate_every=1000, **kw
    )


def by_pid(sample) -> dict[int, object]:
    return {p.pid: p for p in sample.processes}


def holders(host: DrmHost, pids: range) -> None:
    for n, pid in enumerate(pids):
        host.process(pid, "trainer", start_time=10 + n)
        host.open_drm(pid, 4, 128, amdgpu_fdinfo(100 + n, "0000:03:00.0", vram=GiB))


def in_slice(b: DrmBackend, pid: int, round_: int) -> bool:
    """Whether the safety net stats pid's fd table in that round (scan.SLICES; none in a listing round)."""
    turn = round_ % SAFETY_NET_PERIOD
    return turn != 0 and pid % scan.SLICES == turn - 1


class Counting:
    """os.stat of fd tables and os.open of fdinfo files, by the pid they name, during the samples it wraps."""

    def __init__(self, monkeypatch) -> None:
        self.fd_stats: Counter[str] = Counter()
        self.fdinfo_opens = 0
        real_stat, real_open = os.stat, os.open

        def stat(path, *a, **kw):
            if isinstance(path, str) and path.endswith("/fd") and "dir_fd" in kw:
                self.fd_stats[path.split("/")[0]] += 1
            return real_stat(path, *a, **kw)

        def open_(path, *a, **kw):
            if isinstance(path, str) and "fdinfo/" in path:
                self.fdinfo_opens += 1
            return real_open(path, *a, **kw)

        monkeypatch.setattr(os, "stat", stat)
        monkeypatch.setattr(os, "open", open_)


# -- what an idle listed sample reads -------------------------------------------------------------------------


@needs_mknod
def test_a_listed_holder_is_read_through_its_pinned_directory_and_stat_ed_only_with_its_slice(host, monkeypatch):
    crowd(host)
    holders(host, range(7001, 7011))  # one holder per slot
    b = backend(host)
    b.sample()  # the walk
    b.sample()
    counting = Counting(monkeypatch)
    for _ in range(SAFETY_NET_PERIOD):
        s = b.sample()
        assert set(by_pid(s)) == set(range(7001, 7011))
        assert not b.scanner.stats.walked
    # every process, holders included, once in the period (its slice); before, each holder every sample
    assert set(counting.fd_stats.values()) == {1}
    assert {str(p) for p in range(7001, 7011)} <= set(counting.fd_stats)
    assert counting.fdinfo_opens == 10 * SAFETY_NET_PERIOD  # each holder's one DRM fd, each sample


@needs_mknod
def test_the_sample_that_lists_proc_stats_no_slice(host, monkeypatch):
    """Listing /proc and a slice's stats in one sample made it the slowest of the period (the p95): the
    processes are cut in SAFETY_NET_PERIOD - 1 slices, one per other sample, and each is still looked at once
    in the period."""
    count = 10 * scan.SLICES  # ten in each slice
    crowd(host, count=count)
    b = backend(host)
    b.sample()
    b.sample()
    counting = Counting(monkeypatch)
    per_sample = []
    for _ in range(2 * SAFETY_NET_PERIOD):
        before = sum(counting.fd_stats.values())
        b.sample()
        per_sample.append((b.scanner.stats.listed_proc, sum(counting.fd_stats.values()) - before))
    assert [n for listed, n in per_sample if listed] == [0, 0]
    assert sorted({n for listed, n in per_sample if not listed}) == [count // scan.SLICES]
    assert set(counting.fd_stats.values()) == {2}  # each process twice in two periods


@needs_mknod
def test_a_holder_past_the_pin_budget_is_stat_ed_every_sample(host, monkeypatch):
    monkeypatch.setattr(scan, "PINNED_MAX", 1)
    crowd(host, count=10)
    holders(host, range(7001, 7003))
    b = backend(host)
    b.sample()
    b.sample()
    assert len(b.scanner._pins) == 1
    counting = Counting(monkeypatch)
    for _ in range(SAFETY_NET_PERIOD):
        assert set(by_pid(b.sample())) == {7001, 7002}
    stats = [counting.fd_stats[str(p)] for p in (7001, 7002)]
    assert sorted(stats) == [1, SAFETY_NET_PERIOD]  # the pinned one with its slice, the other every sample


@needs_mknod
def test_close_lets_go_of_every_pinned_directory(host):
    crowd(host, count=10)
    holders(host, range(7001, 7006))
    before = len(os.listdir("/proc/self/fd"))
    b = backend(host)
    b.sample()
    assert len(b.scanner._pins) == 5 and len(os.listdir("/proc/self/fd")) == before + 5
    b.close()
    assert len(os.listdir("/proc/self/fd")) == before
    assert set(by_pid(b.sample())) == set(range(7001, 7006))  # a later sample takes them again


# -- what must still be seen in the next sample ---------------------------------------------------------------


@needs_mknod
def test_a_listed_holder_whose_pid_is_reused_with_the_same_entry_is_the_new_process(host):
    crowd(host)
    b = backend(host)
    b.sample()
    b.sample()
    # a pid outside the slice of the sample after the reuse (three samples on): only its pin can tell then
    pid = next(p for p in range(7001, 7100) if not in_slice(b, p, b.scanner._round + 3))
    host.process(pid, "first", start_time=111)
    host.open_drm(pid, 4, 128, amdgpu_fdinfo(1, "0000:03:00.0", vram=GiB))
    assert by_pid(b.sample())[pid].start_time == 111
    assert by_pid(b.sample())[pid].start_time == 111
    host.exit(pid)  # and a new process under the same number, with the same fd, the same row in the list
    host.process(pid, "second", start_time=222)
    host.open_drm(pid, 4, 128, amdgpu_fdinfo(2, "0000:03:00.0", vram=2 * GiB))
    assert not in_slice(b, pid, b.scanner._round + 1)
    got = by_pid(b.sample())[pid]
    assert (got.start_time, got.gpu_memory) == (222, 2 * GiB)


@needs_mknod
def test_an_exit_a_closed_client_and_a_new_one_show_in_the_next_sample(host):
    crowd(host)
    holders(host, range(7001, 7004))
    b = backend(host)
    b.sample()
    b.sample()
    host.exit(7001)
    host.close_fd(7002, 4)
    host.process(7005, "new", start_time=99)
    host.open_drm(7005, 4, 128, amdgpu_fdinfo(9, "0000:03:00.0", vram=GiB))
    assert set(by_pid(b.sample())) == {7003, 7005}


@needs_mknod
def test_a_listed_holder_that_receives_an_fd_shows_it_within_the_safety_net_period(host):
    crowd(host)
    holders(host, [7001])
    host.process(7100, "sender", start_time=5)
    host.open_drm(7100, 6, 128, amdgpu_fdinfo(50, "0000:03:00.0", vram=GiB))
    b = backend(host, system_uid_max=999)
    b.sample()
    b.sample()
    host.open_drm(7001, 9, 128, amdgpu_fdinfo(50, "0000:03:00.0", vram=GiB), listed=False)  # SCM_RIGHTS
    host.uids[7001] = 2000  # another user's process than the sender's (uid 1000)
    (host.proc / "7001" / "status").write_text(
        (host.proc / "7001" / "status")
        .read_text()
        .replace("Uid:\t1000\t1000\t1000\t1000", "Uid:\t2000\t2000\t2000\t2000")
    )
    shared = [by_pid(b.sample())[7100].shared_usage for _ in range(SAFETY_NET_PERIOD)]
    assert shared[-1]  # the receiver was looked at with its slice: the client is both users', no one's
    assert by_pid(b.sample())[7001].shared_usage


# -- what is not redone ---------------------------------------------------------------------------------------


@needs_mknod
def test_an_unchanged_process_keeps_its_record_and_a_changed_one_gets_a_new_one(host):
    crowd(host, count=10)
    host.process(7001, "idle", start_time=1)
    host.open_drm(7001, 4, 128, amdgpu_fdinfo(1, "0000:03:00.0", vram=GiB, gfx_ns=10))
    host.process(7002, "busy", start_time=2)
    host.open_drm(7002, 4, 128, amdgpu_fdinfo(2, "0000:03:00.0", vram=GiB, gfx_ns=10))
    t = [0.0]
    b = DrmBackend(str(host.sys), str(host.proc), str(host.debugfs), clock=lambda: t[0], use_rsmi=False)
    b.sample()
    t[0] = 1.0
    first = by_pid(b.sample())
    t[0] = 2.0
    host.set_fdinfo(7002, 4, 128, amdgpu_fdinfo(2, "0000:03:00.0", vram=2 * GiB, gfx_ns=500_000_010))
    second = by_pid(b.sample())
    assert second[7001] is first[7001]  # the sampler and the audit see the same record and skip it
    assert second[7002] is not first[7002]
    assert (second[7002].gpu_memory, second[7002].gpu_utilization) == (2 * GiB, 50.0)


def _variants() -> list[str]:
    texts = [
        amdgpu_fdinfo(3, "0000:03:00.0", vram=GiB, gtt=2 << 20, gfx_ns=5, compute_ns=7, dma_ns=1),
        amdgpu_fdinfo(4, "0000:03:00.0", vram=GiB, vram_resident=GiB // 2),
        i915_fdinfo(5, "0000:00:02.0", render_ns=9, video_ns=3, system0=1 << 23, local0=GiB),
        xe_fdinfo(6, "0000:03:00.0", rcs=10, ccs=20, total_cycles=1000, vram0=GiB, gtt=1 << 20),
        msm_fdinfo(7, elapsed_ns=10, cycles=100, maxfreq_hz=1_000_000, total=GiB, resident=GiB // 4),
        panfrost_fdinfo(8, fragment_ns=1, fragment_cycles=2, vertex_ns=3, vertex_cycles=4, total=GiB),
        "drm-driver:\tx\ndrm-engine-a:\t1 ns\ndrm-total-vram:\t1 MiB\ndrm-engine-a:\t2 ns\n",  # memory after
        "drm-driver:\tx\ndrm-maxfreq-a:\t1 MHz\ndrm-cycles-a:\t5\ndrm-resident-vram:\t2 KiB\n",
        "drm-driver:\tx\ndrm-engine-a:\t1 ns\ndrm-client-id:\t4\n",  # identity after an engine line
        "drm-memory-vram:\t4 KiB\ndrm-engine-gfx:\t3 ns\ndrm-resident-vram:\t8 KiB\n",
    ]
    rng = random.Random(24)
    shuffled = []
    for text in texts:
        lines = (PREFIX + text).splitlines()
        for _ in range(6):
            rng.shuffle(lines)
            shuffled.append("\n".join(lines) + "\n")
    return [PREFIX + t for t in texts] + shuffled


def _same(a: fdinfo.FdInfo, b: fdinfo.FdInfo) -> bool:
    return repr(a) == repr(b) and a.region_lines == b.region_lines


def test_the_parse_from_the_engine_lines_on_is_the_full_parse():
    for text in _variants():
        for _ in range(2):  # a head parsed, then looked up
            assert _same(fdinfo.parse_fdinfo(text), fdinfo._parse_all(text)), text


def test_a_busy_client_s_lines_before_its_engines_are_parsed_once(monkeypatch):
    calls = []
    real = fdinfo._parse_all
    monkeypatch.setattr(fdinfo, "_parse_all", lambda text: calls.append(text) or real(text))
    results = []
    for tick in range(1, 6):  # (amdgpu prints an engine once the client used it)
        text = PREFIX + amdgpu_fdinfo(31, "0000:03:00.0", vram=GiB, gfx_ns=tick * 1000, compute_ns=tick)
        results.append((fdinfo.parse_fdinfo(text), real(text)))
    assert len(calls) == 1 and "drm-engine" not in calls[0]  # the head, once
    assert all(_same(got, want) for got, want in results)
    assert results[2][0].engines["gfx"].busy_ns == 3000
    assert results[0][0].regions is results[4][0].regions  # memory unchanged: the same figures, shared


@needs_mknod
def test_discovery_walks_a_card_again_only_when_sysfs_re_creates_it(host, monkeypatch):
    host.amdgpu(product_name="First")
    walks = []
    real = discovery._card
    monkeypatch.setattr(discovery, "_card", lambda *a: walks.append(a[1]) or real(*a))
    for _ in range(5):
        assert [c.name for c in discovery.discover(str(host.sys))] == ["First"]
    assert walks == ["card0"]
    # the device removed and another board added in its slot: new sysfs directories
    shutil.rmtree(host.sys / "devices")
    for link in (host.sys / "class" / "drm").iterdir():
        link.unlink()
    shutil.rmtree(host.sys / "bus")
    host.amdgpu(product_name="Second")
    assert [c.name for c in discovery.discover(str(host.sys))] == ["Second"] and len(walks) == 2


@needs_mknod
def test_hwmon_labels_are_read_once_per_hwmon_directory(host, monkeypatch):
    dev = host.amdgpu()
    card = discovery.discover(str(host.sys))[0]
    reads = []
    real = telemetry.read_text
    monkeypatch.setattr(telemetry, "read_text", lambda path: reads.append(path) or real(path))
    reader = telemetry.TelemetryReader()
    for _ in range(4):
        t = reader.read(card, 1.0)
        assert (t.temperature, t.clock_mhz) == (45.0, 2100.0)
    assert sum(p.endswith("_label") for p in reads) == 3  # temp1, temp2, freq1: once
    shutil.rmtree(dev / "hwmon" / "hwmon0")  # the driver reloaded: a new hwmon, other labels
    host.hwmon(
        dev,
        "amdgpu",
        {"temp1_input": 61000, "temp1_label": "junction", "freq2_input": 1_000_000_000, "freq2_label": "sclk"},
    )
    t = reader.read(card, 2.0)
    assert (t.temperature, t.clock_mhz) == (61.0, 1000.0)


# -- the kernel's side of the pin -----------------------------------------------------------------------------


def test_a_proc_directory_descriptor_stops_naming_a_process_once_it_has_ended():
    """What the pin relies on, on this host's /proc: look-ups under an O_PATH descriptor of /proc/PID fail once
    that process is gone (a new process under the number would be another task), and work while it runs."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        pin = os.open(f"/proc/{child.pid}", scan._PIN_FLAGS)
        try:
            handle = os.open("stat", os.O_RDONLY, dir_fd=pin)
            os.close(handle)
            child.stdin.close()  # type: ignore[union-attr]
            child.wait()
            with pytest.raises(OSError):
                os.close(os.open("stat", os.O_RDONLY, dir_fd=pin))
        finally:
            os.close(pin)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
