"""The DRM backend inside the real daemon: gpukilld (with `backends = drm, nvidia`: [paths] on a fixture host, and
NVIDIA GPUs from the fake libnvidia-ml of helpers/nvml_host.py) on a private bus, real processes holding fixture DRM
fds, gpukillctl as the client. Two real backends, since the simulated one is never mixed with real ones.

The processes are real: the fixture /proc mirrors their stat, status, cmdline, cgroup and environ from the real
/proc (symlinks), and adds DRM fds and fdinfo of the fixture's. So their start times are the kernel's and the
daemon's kill path (a pidfd on the real PID) stops them for real.
"""

from __future__ import annotations

import threading

import pytest
from helpers.drm_fixtures import amdgpu_fdinfo, i915_fdinfo
from helpers.nvml_host import fake_nvidia_host
from helpers.procs import pid_alive, spawn
from helpers.testbed import ROOT

from gpukilld import journal as audit

GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture
def nvhost(tmp_path):
    return fake_nvidia_host(tmp_path / "nvml", devices=4)


def test_daemon_on_a_mixed_host_lists_kills_and_resets(fresh_bed, users, host, nvhost):
    bed = fresh_bed
    host.amdgpu(
        "0000:03:00.0",
        card=0,
        render=128,
        busy=20,
        vram_used=3 * GiB,
        unique_id="00c0ffee12345678",
        product_name="AMD Instinct MI210",
    )
    host.i915("0000:00:02.0", card=1, render=129, act_freq_mhz=1100)
    host.asahi("206400000.gpu", card=2, render=130)
    host.ast("0000:02:00.0", card=3)
    fifo = host.amdgpu_recover(0, fifo=True)

    trainer = spawn(bed, users["owner"])
    host.mirror(trainer.pid)
    host.open_drm(
        trainer.pid,
        5,
        128,
        amdgpu_fdinfo(17, "0000:03:00.0", vram=4 * GiB, vram_resident=3 * GiB, gtt=512 * MiB, gfx_ns=10**9),
    )
    viewer = spawn(bed, users["owner"])
    host.mirror(viewer.pid)
    host.open_drm(viewer.pid, 4, 130, "")  # asahi: found through the fd alone
    encoder = spawn(bed, users["other"])
    host.mirror(encoder.pid)
    host.open_drm(encoder.pid, 6, 129, i915_fdinfo(3, "0000:00:02.0", render_ns=0, system0=64 * MiB))

    host.config(bed.workdir / "gpukilld.conf", backends="drm, nvidia")
    bed.start_daemon(env=nvhost.env())
    for p in (trainer, viewer, encoder):
        bed.wait_listed(p.pid)

    doc = bed.listing(users["owner"])  # the trainer's owner: its executable is shown to them alone
    devices = doc["devices"]
    indexes, ids = [d["index"] for d in devices], [d["id"] for d in devices]
    assert len(devices) == 3 + 4 and len(set(indexes)) == 7 and len(set(ids)) == 7  # and the 4 NVIDIA GPUs
    assert sorted(d["id"] for d in devices if d["backend"] == "nvidia") == sorted(
        nvhost.device(i)["uuid"] for i in range(4)
    )
    by_id = {d["id"]: d for d in devices}
    amd, intel, apple = by_id["GPU-00c0ffee12345678"], by_id["0000:00:02.0"], by_id["206400000.gpu"]
    assert "0000:02:00.0" not in by_id  # the BMC display is no GPU
    assert (amd["backend"], amd["vendor"], amd["name"], amd["pci_bus_id"]) == (
        "drm",
        "amd",
        "AMD Instinct MI210",
        "0000:03:00.0",
    )
    assert (amd["utilization"], amd["memory_used"], amd["temperature"], amd["clock_mhz"]) == (
        20.0,
        3 * GiB,
        45.0,
        2100.0,
    )
    assert (intel["vendor"], intel["clock_mhz"], intel["temperature"]) == ("intel", 1100.0, None)
    assert (apple["vendor"], apple["utilization"], apple["memory_used"], apple["temperature"]) == (
        "apple",
        None,
        None,
        None,
    )
    procs = {p["pid"]: p for p in doc["processes"]}
    t = procs[trainer.pid]
    assert (t["user"], t["device"], t["device_id"], t["gpu_memory"]) == ("gpkowner", amd["index"], amd["id"], 3 * GiB)
    assert t["memory_regions"] == {
        "cpu": {"total": 0, "resident": 0},
        "gtt": {"total": 512 * MiB, "resident": 512 * MiB},
        "vram": {"total": 4 * GiB, "resident": 3 * GiB},
    }
    assert t["exe"].startswith("/usr/bin/python3")  # the real process's executable, as the kernel shows it
    v = procs[viewer.pid]
    assert (v["device"], v["gpu_memory"], v["gpu_utilization"], v["memory_regions"]) == (
        apple["index"],
        None,
        None,
        None,
    )
    assert procs[encoder.pid]["user"] == "gpkother" and procs[encoder.pid]["device"] == intel["index"]

    status = bed.ctl(ROOT, "status")
    assert status.returncode == 0, status.stderr
    assert "asahi 206400000.gpu: no utilization, memory, temperature (the asahi driver" in status.stdout

    # Apple GPU: kill works on a process found only through its /dev/dri fd.
    k = bed.ctl(ROOT, "kill", str(viewer.pid))
    assert k.returncode == 0 and "terminated" in k.stdout, k
    assert viewer.wait(10) is not None

    # amdgpu reset: busy without force; with force the holder is killed first, then amdgpu_gpu_recover is read.
    busy = bed.ctl(ROOT, "reset", "0000:03:00.0")
    assert busy.returncode == 8 and f"{trainer.pid}" in busy.stderr, busy
    assert pid_alive(trainer.pid)
    opened = threading.Event()

    def answer_recovery():
        with open(fifo, "w") as f:  # returns when gpukilld opens this very file for reading
            opened.set()
            f.write("0\n")

    threading.Thread(target=answer_recovery, daemon=True).start()
    reset = bed.ctl(ROOT, "reset", "0000:03:00.0", "--force")
    assert reset.returncode == 0, reset
    assert opened.is_set() and "amdgpu GPU recovery of 0000:03:00.0 done" in reset.stdout
    assert trainer.wait(10) is not None
    entries = bed.wait_journal(MESSAGE_ID=audit.RESET.message_id)
    assert entries and "amdgpu GPU recovery of 0000:03:00.0 done" in entries[-1]["MESSAGE"]

    # Intel: PCI reset through the fixture's reset file, once its holder is gone.
    encoder.kill()
    encoder.wait(10)
    bed.wait_listed(encoder.pid, present=False)
    pci = bed.ctl(ROOT, "reset", "0000:00:02.0")
    assert pci.returncode == 0 and "PCI reset of 0000:00:02.0 done" in pci.stdout, pci
    assert (host.sys / "bus" / "pci" / "devices" / "0000:00:02.0" / "reset").read_text() == "1"
