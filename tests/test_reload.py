"""Reload (SIGHUP) gives back what the backends it replaces took, keeps the backends whose settings did not
change, and leaves the daemon flat: 50 reloads of a real gpukilld on the fake NVIDIA host (pynvml against the C
fake libnvidia-ml, which counts nvmlInit/nvmlShutdown and event sets) and on the simulated backend.
Also: the simulated backend is refused next to a real one, at start and on reload.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from helpers.marks import needs_root
from helpers.nvml_host import fake_nvidia_host
from helpers.testbed import REPO, ROOT, NotifyListener
from helpers.waiting import wait_until

from gpukill.errors import ConfigError
from gpukilld.backends.registry import build_backends
from gpukilld.config import Config

GIB = 2**30
INTERVAL = 0.1  # seconds between samples: a replaced backend is closed after two, so each reload takes ~0.3 s
WARM_UP, RELOADS = 5, 50
# RSS settles for a while without any leak (allocator arenas and free lists warming up): measured on this test,
# +0.5 MiB from reload 5 to 50, then +0.14 MiB to 100 and +0.05 MiB to 200, much the same when the backends are
# kept. A replaced NVIDIA backend that stayed referenced after its close (8 GPUs: ~40 KiB of Python objects, by
# tracemalloc) would add ~1.8 MiB over the 45 measured reloads on top of that; one never closed would also
# leave its 8 reader threads, which the thread count catches. 1.5 MiB: about 3 times the drift, below that leak.
# Threads and fds have no such noise: equal.
RSS_TOLERANCE_KIB = 1536
POLL = 0.02  # seconds between two looks while waiting


# -- helpers ---------------------------------------------------------------------------------------------------


def usage(pid: int) -> tuple[int, int, int]:
    """(threads, open fds, VmRSS in KiB) of a process, from /proc."""
    threads = len(os.listdir(f"/proc/{pid}/task"))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return threads, fds, rss


def steady_usage(pid: int, timeout: float = 10.0) -> tuple[int, int, int]:
    """Usage once threads and fds hold still for a few sample intervals (a close thread finishing, a worker
    ending after its sentinel)."""
    deadline = time.monotonic() + timeout
    last = usage(pid)
    while time.monotonic() < deadline:
        time.sleep(INTERVAL * 3)
        now = usage(pid)
        if now[:2] == last[:2]:
            return now
        last = now
    return last


def device_states(bed) -> list[str]:
    r = bed.manager(ROOT, "ListDevices")
    assert r.ok, r
    return [d["state"] for d in sorted(r.body[0], key=lambda d: d["index"])]


def sighup(daemon) -> None:
    """One reload, waited for as systemd does: RELOADING=1, then READY=1."""
    t0 = time.monotonic()
    os.kill(daemon.proc.pid, signal.SIGHUP)
    reloading = daemon.notify.wait_for("RELOADING=1", 10, after=t0)
    assert reloading is not None, daemon.log()
    assert daemon.notify.wait_for("READY=1", 10, after=reloading) is not None, daemon.log()


def write_conf(bed, backends: str, proc: Path, smtp_port: int = 25) -> None:
    bed.write_conf(
        daemon={"backends": backends, "sample_interval": INTERVAL},
        paths={"proc": proc},
        notify={"smtp_port": smtp_port},
    )


def proc_roots(bed) -> list[Path]:
    """Two paths to the same /proc: a reload that switches between them changes the setting every backend is
    built from, so it replaces them, while the daemon sees the very same processes."""
    roots = [bed.workdir / "proc-a", bed.workdir / "proc-b"]
    for root in roots:
        root.symlink_to("/proc")
    return roots


def assert_flat(pid: int, warm: tuple[int, int, int], what: str) -> tuple[int, int, int]:
    # Equal, once the last reload's close has run: poll a little, since it runs ~2 samples after READY.
    end = wait_until(
        lambda: (u := steady_usage(pid))[:2] == warm[:2] and u, 10, interval=POLL, fail=False
    ) or steady_usage(pid)
    assert end[0] == warm[0], f"{what}: threads {warm[0]} after {WARM_UP} reloads, {end[0]} after {RELOADS}"
    assert end[1] == warm[1], f"{what}: fds {warm[1]} after {WARM_UP} reloads, {end[1]} after {RELOADS}"
    assert end[2] - warm[2] <= RSS_TOLERANCE_KIB, f"{what}: RSS {warm[2]} KiB -> {end[2]} KiB"
    return end


# -- the must-show test: NVIDIA ------------------------------------------------------------------------------


@pytest.fixture
def nvhost(tmp_path):
    return fake_nvidia_host(tmp_path / "nvml")  # 8 GPUs


@needs_root
def test_fifty_reloads_on_nvidia_give_back_everything(fresh_bed, nvhost, users):
    bed = fresh_bed
    proc_a, proc_b = proc_roots(bed)
    write_conf(bed, "nvidia", proc_a)
    bed.start_polkit()
    daemon = bed.start_daemon(env=nvhost.env())
    pid = daemon.proc.pid
    assert daemon.notify.wait_for(f"MAINPID={pid}", 1) is not None  # the PID we measure is gpukilld's
    wait_until(
        lambda: nvhost.counts()["init"] == 1, 10, lambda: f"NVML counts {nvhost.counts()}: not one init", interval=POLL
    )

    # 1. A reload that changes nothing the backend is built from (here [notify], as for guard.d) keeps it: no
    #    second nvmlInit, and what only the running backend knows survives, e.g. an Xid reported once by NVML.
    nvhost.state["xid_events"] = [{"device": 1, "xid": 79, "seq": 1}]
    nvhost.write()
    wait_until(
        lambda: device_states(bed) == ["ok", "error"] + ["ok"] * 6,
        10,
        lambda: f"GPU 1 not in error after its Xid: {device_states(bed)}",
        interval=POLL,
    )
    for port in (26, 27, 25):
        write_conf(bed, "nvidia", proc_a, smtp_port=port)
        sighup(daemon)
    time.sleep(INTERVAL * 5)
    assert nvhost.counts() == {"init": 1, "shutdown": 0, "event_set_create": 1, "event_set_free": 0}
    assert device_states(bed) == ["ok", "error"] + ["ok"] * 6

    # 2. Reloads that change a setting it is built from ([paths] proc) replace it: each new backend takes NVML
    #    once and each replaced one gives it back (nvmlShutdown, nvmlEventSetFree, its threads end).
    warm = None
    for i in range(1, RELOADS + 1):
        write_conf(bed, "nvidia", proc_b if i % 2 else proc_a)
        sighup(daemon)
        want = {"init": 1 + i, "shutdown": i, "event_set_create": 1 + i, "event_set_free": i}
        got = wait_until(lambda want=want: (c := nvhost.counts()) == want and c, 10, interval=POLL, fail=False)
        assert got, f"reload {i}: NVML counts {nvhost.counts()}, want {want}\n{daemon.log()}"
        if i == WARM_UP:
            warm = steady_usage(pid)
    assert warm is not None
    end = assert_flat(pid, warm, "nvidia")

    # Still serving, with the last backend: a process on GPU 2 is listed through the bus.
    job = bed.victim(users["owner"], comm="after-reloads")
    nvhost.add_process(2, job.pid, 3 * GIB)
    nvhost.write()
    listed = bed.wait_listed(job.pid, comm="after-reloads")
    assert listed["device"] == 2 and listed["gpu_memory"] == 3 * GIB
    assert daemon.proc.poll() is None and "Traceback" not in daemon.log(), daemon.log()
    print(f"\nnvidia: threads/fds/RSS KiB after {WARM_UP} reloads {warm}, after {RELOADS} {end}")


# -- the same on the simulated backend, reloads back to back ----------------------------------------------------


@needs_root
def test_fifty_reloads_on_simulated_gpus_stay_flat_and_mixing_is_refused(fresh_bed, users):
    bed = fresh_bed
    proc_a, proc_b = proc_roots(bed)
    write_conf(bed, "simulated", proc_a)
    daemon = bed.start_daemon()
    pid = daemon.proc.pid
    warm = None
    for i in range(1, RELOADS + 1):  # not waiting for the closes: replaced backends queue up to be closed
        write_conf(bed, "simulated", proc_b if i % 2 else proc_a)
        sighup(daemon)
        if i == WARM_UP:
            warm = steady_usage(pid)
    assert warm is not None
    end = assert_flat(pid, warm, "simulated")

    job = bed.victim(users["owner"], gpu=1, mem="2GiB", comm="sim-after")
    assert bed.wait_listed(job.pid, comm="sim-after")["device"] == 1

    # A reload into a configuration that mixes simulated and real GPUs is refused; the running one stays.
    conf = bed.workdir / "gpukilld.conf"
    conf.write_text(f"[daemon]\nbackends = nvidia, simulated\n[guard]\npolicy_dir = {bed.workdir / 'guard.d'}\n")
    sighup(daemon)
    entries = bed.wait_journal(GPUKILL_RESULT="reload-failed")
    assert (
        entries and "backends = nvidia, simulated: the simulated backend cannot be combined" in entries[-1]["MESSAGE"]
    ), entries
    assert bed.wait_listed(job.pid, comm="sim-after")["device"] == 1
    assert daemon.proc.poll() is None
    print(f"\nsimulated: threads/fds/RSS KiB after {WARM_UP} reloads {warm}, after {RELOADS} {end}")


# -- mixing simulated with real backends is refused at start -------------------------------------------------


@pytest.mark.parametrize("real", ["nvidia", "drm"])
def test_simulated_next_to_a_real_backend_never_starts(tmp_path, real):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text(f"[daemon]\nsample_interval = 1\nbackends = {real}, simulated\n")
    listener = NotifyListener(tmp_path / "notify.sock")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "DBUS_"))}
        env.update(NOTIFY_SOCKET=listener.path, PYTHONPATH=str(REPO), DBUS_SYSTEM_BUS_ADDRESS="unix:path=/nonexistent")
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpukilld",
                "--config",
                str(conf),
                "--simulate",
                str(REPO / "examples" / "simulate.yaml"),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
            cwd=str(REPO),
        )
        assert r.returncode == 1 and r.stdout == "", r
        assert r.stderr.startswith(
            f"gpukilld: {conf}:3: backends = {real}, simulated: the simulated backend "
            "cannot be combined with real backends"
        ), r.stderr
        assert r.stderr.count("\n") == 1, r.stderr  # one line, no traceback
        assert listener.messages == []  # never READY, not even STATUS
    finally:
        listener.close()


def test_registry_refuses_mixing_and_allows_simulated_alone():
    for names in (("nvidia", "simulated"), ("simulated", "drm"), ("drm", "nvidia", "simulated")):
        with pytest.raises(ConfigError, match=r"the simulated backend cannot be combined with real backends"):
            build_backends(Config(backends=names, simulate="x.yaml"))
    sim = str(REPO / "examples" / "simulate.yaml")
    # `auto` with a device file means simulated only: still allowed, as is naming it alone
    assert [b.name for b in build_backends(Config(simulate=sim))] == ["simulated"]
    assert [b.name for b in build_backends(Config(backends=("simulated",), simulate=sim))] == ["simulated"]


def test_reload_keeps_backends_whose_settings_did_not_change():
    sim = str(REPO / "examples" / "simulate.yaml")
    old_config = Config(backends=("nvidia", "drm"), simulate=sim)
    old = build_backends(old_config)
    same = build_backends(Config(backends=("nvidia", "drm"), sample_interval=5.0, smtp_port=26), (old_config, old))
    assert same[0] is old[0] and same[1] is old[1]
    moved = build_backends(Config(backends=("drm", "nvidia"), sys_root="/elsewhere"), (old_config, old))
    assert moved[1] is old[0] and moved[0] is not old[1] and moved[0].sys_root == "/elsewhere"


# -- close() of each backend -------------------------------------------------------------------------------------


def test_nvidia_close_gives_back_nvml_and_never_waits_for_a_hung_call(nvhost, monkeypatch):
    from gpukilld.backends.nvidia import NvidiaBackend

    # The fake library loaded in this process under its soname, so that pynvml's dlopen finds it.
    ctypes.CDLL(str(nvhost.lib), mode=ctypes.RTLD_GLOBAL)
    for key, value in nvhost.env().items():
        if key.startswith("GPUKILL_FAKE_"):
            monkeypatch.setenv(key, value)
    base = nvhost.counts()
    nvhost.fault(2, slow_ms=3000)  # GPU 2's calls hang 3 s: its read outlives the 0.3 s deadline
    b = NvidiaBackend(device_deadline=0.3)
    sampled = {}
    before = set(threading.enumerate())  # another test's reader may still be in a hung call
    t = threading.Thread(target=lambda: sampled.update(s=b.sample()))
    t.start()
    wait_until(
        lambda: any(th.name.startswith("nvml-") for th in set(threading.enumerate()) - before),
        10,
        "no nvml- reader thread ever ran",
        interval=POLL,
    )
    started = time.monotonic()
    b.close()  # waits for the sample in progress (0.3 s deadline), not for GPU 2's hung call
    took = time.monotonic() - started
    t.join(10)
    # wall time, as waiting is the failure: the hung call's 3 s; the 0.3 s deadline stretches on a loaded host
    assert took < 2.0, took
    states = [d.state for d in sampled["s"].devices]  # the sample was not cut short by the close
    assert states == ["ok", "ok", "lost"] + ["ok"] * 5, states
    workers = [th for th in threading.enumerate() if th.name.startswith("nvml-")]
    assert nvhost.counts() == {
        "init": base["init"] + 1,
        "shutdown": base["shutdown"] + 1,
        "event_set_create": base["event_set_create"] + 1,
        "event_set_free": base["event_set_free"] + 1,
    }
    for w in workers:  # the idle ones at once, GPU 2's when its call returns
        w.join(10)
        assert not w.is_alive(), w.name
    # closed for good: nothing read, NVML never initialised again, a second close is a no-op
    assert b.sample().devices == [] and not b.status().available
    b.close()
    assert nvhost.counts()["init"] == base["init"] + 1 and nvhost.counts()["shutdown"] == base["shutdown"] + 1


@needs_root  # the DRM fixture's device nodes are made with mknod
def test_drm_close_shuts_pyrsmi_down_once(tmp_path, monkeypatch):
    from helpers.drm_fixtures import DrmHost

    from gpukilld.backends.drm import DrmBackend

    calls = {"init": 0, "shutdown": 0}
    rocml = types.SimpleNamespace(
        smi_initialize=lambda: calls.__setitem__("init", calls["init"] + 1),
        smi_shutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        smi_get_device_count=lambda: 1,
        smi_get_device_pci_id=lambda i: 3 << 8,  # 0000:03:00.0
        smi_get_device_utilization=lambda i: 42,
    )
    package = types.ModuleType("pyrsmi")
    package.rocml = rocml  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyrsmi", package)
    host = DrmHost(tmp_path / "host")
    host.amdgpu("0000:03:00.0", busy=7)
    b = DrmBackend(str(host.sys), str(host.proc), str(host.debugfs))
    assert b.sample().devices[0].utilization == 42.0  # from the (fake) ROCm SMI
    b.close()
    b.close()
    assert calls == {"init": 1, "shutdown": 1}
    assert b.sample().devices[0].utilization == 7.0  # sysfs only: no new ROCm SMI session after close
    assert calls == {"init": 1, "shutdown": 1}
