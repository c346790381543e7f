"""The DRM backend on fixture hosts (tests/helpers/drm_fixtures.py): devices and telemetry per driver family,
per-process
utilization from two samples with a driven clock, memory per region, shared and vanishing clients, unreadable
fdinfo, KFD compute processes, the incremental scan, and resets writing (or reading) the right files.

The fixture /dev/dri nodes are real character devices, made with mknod: these tests need root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers.drm_fixtures import (
    DrmHost,
    amdgpu_fdinfo,
    i915_fdinfo,
    panfrost_fdinfo,
    xe_fdinfo,
)
from helpers.testbed import make_traversable

from gpukill.errors import DeviceBusy, NotSupported, ResetFailed
from gpukilld.backends.drm import DrmBackend
from gpukilld.backends.drm.rsmi import RsmiSource, bdf_to_address, merge
from gpukilld.backends.drm.scan import FdScanner
from gpukilld.backends.drm.telemetry import Telemetry
from gpukilld.model import MemoryRegion

REPO = Path(__file__).resolve().parents[1]
MiB, GiB = 1 << 20, 1 << 30
needs_mknod = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: fixture /dev/dri nodes are made with mknod")
pytestmark = needs_mknod


class Clock:
    """monotonic() for the backend, moved by the test."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def backend(host: DrmHost, clock: Clock, **kw) -> DrmBackend:
    return DrmBackend(str(host.sys), str(host.proc), str(host.debugfs), clock=clock, use_rsmi=False, **kw)


def by_pid(sample, pid: int):
    found = [p for p in sample.processes if p.pid == pid]
    assert len(found) == 1, sample.processes
    return found[0]


# -- per driver family -------------------------------------------------------------------------------


def test_amdgpu_telemetry_and_process_usage_from_two_samples(host):
    host.amdgpu(
        busy=37,
        vram_used=6 * GiB,
        vram_total=24 * GiB,
        edge_mc=45000,
        power_uw=98_500_000,
        sclk_hz=2_100_000_000,
        unique_id="4a3b2c1d0e0f1a2b",
        product_name="Radeon RX 7900 XTX",
    )
    host.process(4242, "train.py", start_time=555_000)
    host.open_file(4242, 0, "/dev/null")
    text = amdgpu_fdinfo(
        11, "0000:03:00.0", vram=4 * GiB, vram_resident=3 * GiB, gtt=256 * MiB, gfx_ns=1_000_000_000, compute_ns=0
    )
    host.open_drm(4242, 5, 128, text)
    clock = Clock(100.0)
    b = backend(host, clock)
    first = b.sample()
    assert by_pid(first, 4242).gpu_utilization is None  # one sample: nothing to compare with yet
    clock.t = 102.0
    host.set_fdinfo(
        4242,
        5,
        128,
        amdgpu_fdinfo(
            11,
            "0000:03:00.0",
            vram=4 * GiB,
            vram_resident=3 * GiB,
            gtt=256 * MiB,
            gfx_ns=2_500_000_000,
            compute_ns=200_000_000,
        ),
    )
    s = b.sample()
    (dev,) = s.devices
    assert dev.id == "GPU-4a3b2c1d0e0f1a2b" and dev.pci_bus_id == "0000:03:00.0" and dev.vendor == "amd"
    assert dev.name == "Radeon RX 7900 XTX"
    assert (dev.utilization, dev.memory_used, dev.memory_total) == (37.0, 6 * GiB, 24 * GiB)
    assert (dev.temperature, dev.power, dev.clock_mhz) == (45.0, 98.5, 2100.0)
    p = by_pid(s, 4242)
    assert (p.start_time, p.device_id) == (555_000, "GPU-4a3b2c1d0e0f1a2b")
    assert p.gpu_utilization == pytest.approx(75.0)  # gfx: 1.5 s busy in 2 s; compute 10 %: the busiest counts
    assert p.gpu_memory == 3 * GiB  # resident VRAM
    assert p.memory_regions == (
        MemoryRegion("cpu", 0, 0),
        MemoryRegion("gtt", 256 * MiB, 256 * MiB),
        MemoryRegion("vram", 4 * GiB, 3 * GiB),
    )


def test_i915_discrete_card_power_from_energy_and_device_utilization_from_clients(host):
    card = host.i915(act_freq_mhz=1300, energy_uj=1_000_000)
    host.process(300, "blender", start_time=10)
    host.process(301, "ffmpeg", start_time=11)
    pdev = "0000:00:02.0"
    host.open_drm(300, 7, 129, i915_fdinfo(1, pdev, render_ns=0, system0=8 * MiB, local0=512 * MiB))
    host.open_drm(301, 4, 129, i915_fdinfo(2, pdev, render_ns=0, copy_ns=0, system0=2 * MiB))
    clock = Clock(50.0)
    b = backend(host, clock)
    first = b.sample()
    assert first.devices[0].power is None and first.devices[0].utilization is None  # no deltas yet
    clock.t = 52.0
    host.set_attr(card / "hwmon" / "hwmon0", "energy1_input", 91_000_000)  # 90 J in 2 s
    host.set_fdinfo(
        300,
        7,
        129,
        i915_fdinfo(1, pdev, render_ns=500_000_000, video_ns=400_000_000, system0=8 * MiB, local0=512 * MiB),
    )
    host.set_fdinfo(301, 4, 129, i915_fdinfo(2, pdev, render_ns=800_000_000, copy_ns=200_000_000, system0=2 * MiB))
    s = b.sample()
    (dev,) = s.devices
    assert dev.id == pdev and dev.vendor == "intel" and dev.name == "Intel GPU [8086:56a0] (i915)"
    assert (dev.power, dev.clock_mhz, dev.temperature, dev.memory_used) == (45.0, 1300.0, None, None)
    assert dev.utilization == pytest.approx(65.0)  # render: 25 % + 40 % over both clients
    a, c = by_pid(s, 300), by_pid(s, 301)
    assert a.gpu_utilization == pytest.approx(25.0)  # render 25 %, video 0.4 s / 2 s / 2 engines = 10 %
    assert c.gpu_utilization == pytest.approx(40.0)
    assert a.gpu_memory == 512 * MiB and c.gpu_memory == 2 * MiB  # local0 on the card; system0 alone
    assert {r.name: r.resident for r in a.memory_regions} == {
        "system0": 8 * MiB,
        "local0": 512 * MiB,
        "stolen-system0": 0,
    }
    status = b.status()
    assert status.available and "i915 0000:00:02.0: no memory, temperature" in status.detail


def test_xe_cycles_temperature_and_power(host):
    card = host.xe(act_freq_mhz=2050, pkg_mc=61500, energy_uj=5_000_000)
    host.process(900, "llama-server", start_time=77)
    pdev = "0000:04:00.0"
    host.open_drm(900, 3, 130, xe_fdinfo(21, pdev, rcs=0, ccs=0, total_cycles=1_000_000, vram0=3 * GiB))
    clock = Clock(10.0)
    b = backend(host, clock)
    b.sample()
    clock.t = 11.0
    host.set_attr(card / "hwmon" / "hwmon0", "energy1_input", 155_000_000)
    host.set_fdinfo(900, 3, 130, xe_fdinfo(21, pdev, rcs=150_000, ccs=2_600_000, total_cycles=2_000_000, vram0=3 * GiB))
    s = b.sample()
    (dev,) = s.devices
    assert (dev.temperature, dev.power, dev.clock_mhz) == (61.5, 150.0, 2050.0)
    p = by_pid(s, 900)
    assert p.gpu_utilization == pytest.approx(65.0)  # ccs: 2.6 M of 4 engines x 1 M cycles; rcs 15 %
    assert dev.utilization == pytest.approx(65.0)
    assert p.gpu_memory == 3 * GiB and {r.name for r in p.memory_regions} == {"system", "gtt", "vram0", "stolen"}


def test_panfrost_platform_gpu_with_devfreq_and_cycles(host):
    host.panfrost(cur_freq_hz=600_000_000)
    host.process(1200, "kodi", start_time=5)
    host.open_drm(
        1200,
        9,
        128,
        panfrost_fdinfo(
            14, fragment_ns=0, fragment_cycles=0, vertex_ns=0, vertex_cycles=0, total=290 * MiB, resident=36496 * 1024
        ),
    )
    clock = Clock(0.0)
    b = backend(host, clock)
    b.sample()
    clock.t = 0.5
    host.set_fdinfo(
        1200,
        9,
        128,
        panfrost_fdinfo(
            14,
            fragment_ns=300_000_000,
            fragment_cycles=240_000_000,
            vertex_ns=20_000_000,
            vertex_cycles=16_000_000,
            total=290 * MiB,
            resident=36496 * 1024,
        ),
    )
    s = b.sample()
    (dev,) = s.devices
    assert dev.id == "fde60000.gpu" and dev.pci_bus_id is None and dev.vendor == "arm"
    assert dev.name == "Arm Mali GPU (panfrost, rockchip,rk3568-mali)"
    assert (dev.clock_mhz, dev.temperature, dev.power) == (600.0, None, None)
    p = by_pid(s, 1200)
    assert p.gpu_utilization == pytest.approx(60.0)  # 240 M cycles / (800 MHz x 0.5 s)
    assert dev.utilization == pytest.approx(60.0)
    assert p.gpu_memory == 36496 * 1024 and p.memory_regions == (MemoryRegion("memory", 290 * MiB, 36496 * 1024),)


def test_asahi_gpu_is_listed_with_its_processes_and_unknown_usage(host):
    host.asahi()
    host.process(1500, "firefox", start_time=42)
    host.open_drm(1500, 12, 128, "")  # the asahi driver prints no drm- keys: only fs/proc's generic lines
    host.open_drm(1500, 13, 128, "")
    clock = Clock()
    b = backend(host, clock)
    b.sample()
    clock.t += 1
    s = b.sample()
    (dev,) = s.devices
    assert dev.id == "206400000.gpu" and dev.vendor == "apple" and dev.name == "Apple GPU (asahi, apple,agx-t8103)"
    assert (dev.utilization, dev.memory_used, dev.memory_total, dev.temperature) == (None, None, None, None)
    p = by_pid(s, 1500)  # found through its /dev/dri fds: once, though it holds two
    assert (p.device_id, p.gpu_memory, p.gpu_utilization, p.memory_regions) == ("206400000.gpu", None, None, ())
    detail = b.status().detail
    assert "asahi 206400000.gpu: no utilization, memory, temperature (the asahi driver exports no usage" in detail


# -- clients -----------------------------------------------------------------------------------------


def test_fd_shared_across_fork_and_dup_is_counted_once(host):
    host.amdgpu()
    host.process(500, "trainer", start_time=1000)
    host.process(501, "trainer-worker", start_time=1200)  # forked later, inherited fd 5
    pdev = "0000:03:00.0"

    def text(ns):
        return amdgpu_fdinfo(31, pdev, vram=2 * GiB, gfx_ns=ns)

    host.open_drm(500, 5, 128, text(0))
    host.open_drm(500, 6, 128, text(0))  # dup(5): same drm_file, same client id
    host.open_drm(501, 5, 128, text(0))
    clock = Clock(0.0)
    b = backend(host, clock)
    b.sample()
    clock.t = 1.0
    for pid, fd in ((500, 5), (500, 6), (501, 5)):
        host.set_fdinfo(pid, fd, 128, text(300_000_000))
    s = b.sample()
    parent, child = by_pid(s, 500), by_pid(s, 501)
    assert parent.gpu_memory == 2 * GiB and parent.gpu_utilization == pytest.approx(30.0)  # not 4 GiB, not 60 %
    assert child.gpu_memory is None and child.gpu_utilization is None  # listed (it holds the GPU), no usage


def test_client_that_exits_between_samples(host):
    host.amdgpu()
    pdev = "0000:03:00.0"
    for pid, cid in ((600, 1), (601, 2)):
        host.process(pid, f"job{pid}", start_time=pid)
        host.open_drm(pid, 5, 128, amdgpu_fdinfo(cid, pdev, vram=GiB, gfx_ns=0))
    clock = Clock(0.0)
    b = backend(host, clock)
    assert {p.pid for p in b.sample().processes} == {600, 601}
    host.exit(600)
    clock.t = 2.0
    host.set_fdinfo(601, 5, 128, amdgpu_fdinfo(2, pdev, vram=GiB, gfx_ns=1_000_000_000))
    s = b.sample()
    assert [p.pid for p in s.processes] == [601] and s.processes[0].gpu_utilization == pytest.approx(50.0)
    assert b.scanner.stats.processes == 1


def test_unreadable_fdinfo_is_skipped_without_an_error(host):
    """As an unprivileged reader (like a daemon without ptrace rights): the fdinfo it may not read is skipped;
    the holder is still listed, its usage unknown, and the device's derived utilization with it."""
    host.i915()
    pdev = "0000:00:02.0"
    host.process(700, "mine", start_time=1)
    host.process(701, "theirs", start_time=2)
    host.open_drm(700, 5, 129, i915_fdinfo(1, pdev, render_ns=0, system0=4 * MiB))
    host.open_drm(701, 5, 129, i915_fdinfo(2, pdev, render_ns=0, system0=8 * MiB))
    os.chmod(host.proc / "701" / "fdinfo" / "5", 0o400)  # root's, as another user's would be to us
    script = (
        "import json, sys\n"
        "from gpukilld.backends.drm import DrmBackend\n"
        "b = DrmBackend(sys.argv[1], sys.argv[2], sys.argv[3], use_rsmi=False)\n"
        "b.sample(); s = b.sample()\n"
        "print(json.dumps({'procs': {p.pid: p.gpu_memory for p in s.processes},\n"
        "                  'util': s.devices[0].utilization, 'unreadable': b.scanner.stats.unreadable}))\n"
    )
    make_traversable(REPO)  # the unprivileged reader imports gpukilld from the checkout
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run(
        ["/usr/bin/python3", "-c", script, str(host.sys), str(host.proc), str(host.debugfs)],
        user=65534,
        group=65534,
        extra_groups=[],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = json.loads(r.stdout)
    assert out == {"procs": {"700": 4 * MiB, "701": None}, "util": None, "unreadable": 1}


def test_kfd_compute_process_is_listed_with_its_vram(host):
    host.amdgpu()
    host.kfd_gpu(1, gpu_id=45678, render_minor=128, simd_count=416, simd_per_cu=4)  # 104 compute units
    host.process(800, "python3", start_time=9000)
    host.kfd_process(800, 45678, vram=8 * GiB, sdma_us=0, cu_occupancy=26)
    clock = Clock(0.0)
    b = backend(host, clock)
    s = b.sample()
    p = by_pid(s, 800)
    assert p.device_id == "0000:03:00.0" and p.start_time == 9000
    assert p.gpu_memory == 8 * GiB and p.memory_regions == (MemoryRegion("vram", 8 * GiB, None),)
    assert p.gpu_utilization == pytest.approx(25.0)  # 26 of 104 compute units occupied


def test_kfd_and_render_fd_of_one_rocm_process_are_not_added_up(host):
    host.amdgpu()
    host.kfd_gpu(1, gpu_id=45678, render_minor=128)
    host.process(810, "rocm-app", start_time=50)
    host.open_drm(810, 4, 128, amdgpu_fdinfo(40, "0000:03:00.0", vram=6 * GiB, gfx_ns=0))
    host.kfd_process(810, 45678, vram=5 * GiB, sdma_us=0, cu_occupancy=0)
    clock = Clock(0.0)
    b = backend(host, clock)
    b.sample()
    clock.t = 1.0
    host.kfd_process(810, 45678, vram=5 * GiB, sdma_us=200_000, cu_occupancy=0)  # SDMA busy 0.2 s of 1 s
    p = by_pid(b.sample(), 810)
    assert p.gpu_memory == 6 * GiB  # the KFD buffers are in the render fd's VM: max, never the sum
    assert p.gpu_utilization == pytest.approx(20.0)


# -- the incremental scan ----------------------------------------------------------------------------


def test_scan_reads_only_changed_fd_tables_and_catches_reuse(host):
    host.amdgpu()
    for pid in range(2500, 2510):  # none of them is due for revalidation in rounds 1..4 (pid % 1000)
        host.process(pid, "idle", start_time=pid)
        for fd in range(3):
            host.open_file(pid, fd, "/dev/null")
    host.process(2600, "gpu", start_time=1)
    host.open_drm(2600, 3, 128, amdgpu_fdinfo(5, "0000:03:00.0", vram=GiB))
    b = backend(host, Clock(), revalidate_every=1000)
    b.sample()
    assert b.scanner.stats.scanned == 11
    b.sample()
    assert b.scanner.stats.scanned == 0  # nothing changed: one stat per process, fdinfo of the DRM fd only
    host.open_drm(2505, 7, 128, amdgpu_fdinfo(6, "0000:03:00.0", vram=2 * GiB))
    s = b.sample()
    assert b.scanner.stats.scanned == 1 and by_pid(s, 2505).gpu_memory == 2 * GiB
    # fd 3 of 2600 closed and the number reused for another file between two samples (same count, and
    # the fixture directory's mtime put back): the fdinfo "ino:" no longer matches the device node's.
    fd_dir = host.proc / "2600" / "fd"
    before = os.stat(fd_dir)
    host.close_fd(2600, 3)
    host.open_file(2600, 3, "/dev/null")
    os.utime(fd_dir, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert all(p.pid != 2600 for p in b.sample().processes)


def test_every_process_is_revalidated_within_the_period(host):
    host.amdgpu()
    host.process(3000, "late", start_time=1)
    host.open_file(3000, 0, "/dev/null")
    b = backend(host, Clock(), revalidate_every=4)
    b.sample()
    fd_dir = host.proc / "3000" / "fd"
    before = os.stat(fd_dir)
    host.close_fd(3000, 0)  # swapped for a DRM fd behind a fingerprint that did not move
    host.open_drm(3000, 0, 128, amdgpu_fdinfo(8, "0000:03:00.0", vram=GiB))
    os.utime(fd_dir, ns=(before.st_atime_ns, before.st_mtime_ns))
    found = [any(p.pid == 3000 for p in b.sample().processes) for _ in range(4)]
    assert found.count(True) >= 1 and found[-1]


def test_kernels_before_6_2_fingerprint_the_fd_numbers(host):
    """Before Linux 6.2 the size of /proc/PID/fd is 0 whatever is open; the scanner then keeps the fd numbers.
    The fixture directory's size never moves either, so a new fd behind a restored mtime shows the difference."""
    host.amdgpu()
    host.process(3100, "late-opener", start_time=1)
    host.open_file(3100, 0, "/dev/null")
    by_numbers = FdScanner(str(host.proc), revalidate_every=1000, fd_counts=False)
    by_size = FdScanner(str(host.proc), revalidate_every=1000)
    by_numbers.scan()
    by_size.scan()
    assert by_size.fd_counts is True  # found out from the tree: a non-zero size
    fd_dir = host.proc / "3100" / "fd"
    before = os.stat(fd_dir)
    host.open_drm(3100, 5, 128, amdgpu_fdinfo(8, "0000:03:00.0", vram=GiB))
    os.utime(fd_dir, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert [r.pid for r in by_numbers.scan()] == [3100]
    assert by_size.scan() == []  # same size, same mtime: only the periodic re-read would find it


# -- resets ------------------------------------------------------------------------------------------


def test_reset_refuses_while_a_full_scan_finds_holders(host):
    a = host.amdgpu("0000:c1:00.0", card=0, render=128)
    peer = host.amdgpu("0000:c2:00.0", card=1, render=129)
    host.xgmi_hive([a, peer], hive_id=77)
    host.amdgpu_recover(0, "0\n")
    host.amdgpu_recover(1, "0\n")
    host.kfd_gpu(1, gpu_id=1111, render_minor=128)
    b = backend(host, Clock())
    host.process(4100, "on-peer", start_time=5)  # opened after the last sample: only a full scan sees it
    host.open_drm(4100, 9, 129, amdgpu_fdinfo(3, "0000:c2:00.0", vram=GiB))
    with pytest.raises(
        DeviceBusy,
        match="1 process\\(es\\) hold 0000:c1:00.0 or its XGMI peers: 4100; nothing "
        "was reset; XGMI hive 77: its peers 0000:c2:00.0 are reset with it",
    ):
        b.reset("0000:c1:00.0")
    host.exit(4100)
    host.process(4101, "rocm-only", start_time=6)
    host.kfd_process(4101, 1111, vram=GiB)
    with pytest.raises(DeviceBusy, match="hold 0000:c1:00.0 or its XGMI peers: 4101;"):
        b.reset("0000:c1:00.0")
    host.exit(4101)  # KFD's entry outlives the /proc one for a moment: a dead PID holds nothing
    assert b.reset("0000:c1:00.0").startswith("amdgpu GPU recovery of 0000:c1:00.0 done")


def test_amdgpu_reset_reads_amdgpu_gpu_recover(host):
    host.amdgpu()
    fifo = host.amdgpu_recover(0, fifo=True)
    b = backend(host, Clock())
    (dev,) = b.sample().devices
    opened = threading.Event()

    def answer():
        with open(fifo, "w") as f:  # returns once the backend opened it for reading: proof of the path
            opened.set()
            f.write("0\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    b.check_reset(dev.id)
    assert b.reset(dev.id) == "amdgpu GPU recovery of 0000:03:00.0 done"
    t.join(5)
    assert opened.is_set()


def test_amdgpu_reset_failure_names_the_error_and_xgmi_peers(host):
    a = host.amdgpu("0000:c1:00.0", card=0, render=128)
    peer = host.amdgpu("0000:c2:00.0", card=1, render=129)
    host.xgmi_hive([a, peer], hive_id=1234567890123)
    host.amdgpu_recover(0, "-110\n")
    host.amdgpu_recover(1, "0\n")
    b = backend(host, Clock())
    assert b.reset("0000:c2:00.0") == (
        "amdgpu GPU recovery of 0000:c2:00.0 done; XGMI hive 1234567890123: its peers 0000:c1:00.0 are reset with it"
    )
    with pytest.raises(
        ResetFailed,
        match=r"recovery of 0000:c1:00.0 failed: Connection timed out \(ETIMEDOUT\); "
        r"XGMI hive 1234567890123: its peers 0000:c2:00.0 are reset with it",
    ):
        b.reset("0000:c1:00.0")


def test_amdgpu_reset_without_debugfs_is_not_supported(host):
    host.amdgpu()
    b = backend(host, Clock())
    with pytest.raises(NotSupported, match="needs debugfs: .*/dri/0/amdgpu_gpu_recover not found"):
        b.check_reset("0000:03:00.0")


def test_pci_reset_writes_the_reset_file_and_respects_reset_method(host):
    dev = host.i915()
    b = backend(host, Clock())
    assert b.reset("0000:00:02.0") == "PCI reset of 0000:00:02.0 done (methods tried in order: flr bus)"
    assert (dev / "reset").read_text() == "1"
    host.set_attr(dev, "reset_method", "")
    with pytest.raises(NotSupported, match="resets are disabled for 0000:00:02.0 \\(its reset_method is empty\\)"):
        b.check_reset("0000:00:02.0")
    (dev / "reset").unlink()
    with pytest.raises(NotSupported, match="no reset for PCI device 0000:00:02.0"):
        b.check_reset("0000:00:02.0")


def test_platform_gpu_reset_is_not_supported_and_a_gone_device_fails(host):
    host.asahi()
    b = backend(host, Clock())
    with pytest.raises(NotSupported, match="the asahi driver of this platform device has no reset interface"):
        b.check_reset("206400000.gpu")
    with pytest.raises(ResetFailed, match="no longer present"):
        b.reset("0000:99:00.0")


# -- the host as a whole -----------------------------------------------------------------------------


def test_mixed_host_lists_each_gpu_once_in_card_order(host):
    host.amdgpu("0000:03:00.0", card=0, render=128, unique_id="00aa11bb22cc33dd")
    host.i915("0000:00:02.0", card=1, render=129)
    host.xe("0000:04:00.0", card=2, render=130)
    host.ast("0000:02:00.0", card=3)  # the BMC's display: no render node, not a GPU
    host.amdgpu("0000:83:00.0", card=4, render=131, unique_id="00aa11bb22cc33dd")  # a serial seen twice
    b = backend(host, Clock())
    s = b.sample()
    assert [(d.id, d.vendor) for d in s.devices] == [
        ("GPU-00aa11bb22cc33dd", "amd"),
        ("0000:00:02.0", "intel"),
        ("0000:04:00.0", "intel"),
        ("0000:83:00.0", "amd"),
    ]
    assert b.status().detail.startswith(
        "4 GPUs: amdgpu 0000:03:00.0, i915 0000:00:02.0, xe 0000:04:00.0, amdgpu 0000:83:00.0"
    )


def test_no_gpu_means_unavailable_with_the_reason(host):
    host.ast()
    status = backend(host, Clock()).status()
    assert not status.available and "no DRM GPU under" in status.detail


def test_pyrsmi_absent_falls_back_to_sysfs(host):
    """pyrsmi is not installed here (no ROCm): the backend says so and reads sysfs. The pyrsmi path itself
    needs ROCm and an AMD GPU to be exercised; only its pure helpers are checked below."""
    try:
        import pyrsmi  # noqa: F401

        pytest.skip("pyrsmi is installed here: the fallback is not what runs")
    except ImportError:
        pass
    host.amdgpu(busy=12)
    b = DrmBackend(str(host.sys), str(host.proc), str(host.debugfs), clock=Clock())
    assert b.sample().devices[0].utilization == 12.0
    assert "pyrsmi is not installed; AMD telemetry from sysfs" in b.status().detail
    assert not RsmiSource().available


def test_pyrsmi_helpers():
    assert bdf_to_address((0x0001 << 32) | (0xC1 << 8) | (0x1F << 3) | 0x7) == "0001:c1:1f.7"
    merged = merge(Telemetry(utilization=50.0, power=None), Telemetry(utilization=10.0, power=80.0, temperature=40.0))
    assert (merged.utilization, merged.power, merged.temperature) == (50.0, 80.0, 40.0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
