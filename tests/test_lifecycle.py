"""Daemon life cycle under a NOTIFY_SOCKET the test holds: READY, STATUS, WATCHDOG, RELOADING; device loss;
start-up errors; and that a testbed leaves no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from helpers.marks import needs_root
from helpers.procs import pid_alive
from helpers.testbed import PYTHON, REPO, ROOT, Testbed

from gpukilld import journal as audit

pytestmark = needs_root

HOLD_NAME = """
import asyncio
from dbus_fast import BusType
from dbus_fast.aio import MessageBus
async def main():
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    await bus.request_name("org.gpukill1")
    print("held", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def _sim(path: Path, **device_changes) -> None:
    data = yaml.safe_load((REPO / "examples" / "simulate.yaml").read_text())
    data["scope"] = yaml.safe_load(path.read_text())["scope"]  # keep the testbed's scope
    faults = device_changes.pop("faults", None)
    for index, changes in device_changes.items():
        data["devices"][int(index.removeprefix("gpu"))].update(changes)
    if faults:
        data["faults"] = faults
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)  # atomic, as an admin's editor would (the daemon never reads half a file)


def test_ready_only_once_the_name_is_owned(fresh_bed):
    bed = fresh_bed
    daemon = bed.start_daemon(wait_ready=False)
    t_ready = daemon.notify.wait_for("READY=1", 20)
    assert t_ready is not None, daemon.log()
    assert bed.name_has_owner("org.gpukill1")
    assert any(m.startswith("STATUS=4 GPUs") for _, m in daemon.notify.messages)
    assert any(m == f"MAINPID={daemon.proc.pid}" for _, m in daemon.notify.messages)


def test_no_ready_when_the_name_is_taken(fresh_bed):
    bed = fresh_bed
    holder = subprocess.Popen(
        [PYTHON, "-c", HOLD_NAME], env=bed.env(), stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    bed.procs.append(holder)
    assert holder.stdout.readline().strip() == "held"
    daemon = bed.start_daemon(wait_ready=False)
    assert daemon.proc.wait(20) == 1
    assert daemon.notify.times("READY=1") == []
    assert "owned by another process" in daemon.log()
    assert "Traceback" not in daemon.log()


def test_watchdog_stops_when_the_sampler_hangs(fresh_bed):
    bed = fresh_bed
    daemon = bed.start_daemon(args=["--sample-interval", "0.2"], env={"WATCHDOG_USEC": "1000000"})
    time.sleep(1.5)
    assert len(daemon.notify.times("WATCHDOG=1")) >= 3, daemon.notify.messages

    _sim(daemon.sim_path, faults={"hang_sampling": True})
    time.sleep(1.0)  # let the sampler pick the fault up and block in it
    hung_since = time.monotonic()
    time.sleep(2.5)
    assert [t for t in daemon.notify.times("WATCHDOG=1") if t > hung_since] == [], "pings must stop"
    # the bus side still answers from the last snapshot
    r = bed.manager(ROOT, "ListDevices")
    assert r.ok and len(r.body[0]) == 4

    _sim(daemon.sim_path)  # the backend answers again: pings resume
    resumed = time.monotonic()
    assert daemon.notify.wait_for("WATCHDOG=1", 5, after=resumed) is not None


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is needed to freeze the main loop (make deps installs it)")
def test_watchdog_stops_when_the_main_loop_hangs(fresh_bed):
    """A main loop stuck in a call that lets other threads run (here gdb makes it call sleep(); in life a
    blocking syscall) must stop the pings as a hung sampler does: before, the sampler pinged on regardless, so
    systemd never restarted a daemon that no longer answered anyone."""
    bed = fresh_bed
    daemon = bed.start_daemon(args=["--sample-interval", "0.2"], env={"WATCHDOG_USEC": "1000000"})
    time.sleep(1.0)
    assert len(daemon.notify.times("WATCHDOG=1")) >= 3, daemon.notify.messages
    gdb = subprocess.Popen(
        [
            "gdb",
            "-nx",
            "-q",
            "-batch",
            "-p",
            str(daemon.proc.pid),
            "-ex",
            "echo calling\\n",
            "-ex",
            "call (unsigned int)sleep(5)",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in gdb.stdout:
            if line.strip() == "calling":
                break
        frozen = time.monotonic()  # the main thread sleeps from now; every other thread runs
        time.sleep(4.0)
        pings = [t for t in daemon.notify.times("WATCHDOG=1") if frozen + 1.0 < t < frozen + 4.0]
        assert pings == [], f"{len(pings)} pings while the main loop was frozen"
    finally:
        gdb.wait(30)
    thawed = time.monotonic()
    assert daemon.notify.wait_for("WATCHDOG=1", 5, after=thawed) is not None, "pings did not resume"
    assert daemon.proc.poll() is None


def test_reload_rereads_config_and_keeps_it_on_error(fresh_bed):
    bed = fresh_bed
    daemon = bed.start_daemon()
    conf = bed.workdir / "gpukilld.conf"

    def interval() -> float:
        r = bed.call_as(
            ROOT,
            "org.gpukill1",
            "/org/gpukill1",
            "org.freedesktop.DBus.Properties",
            "Get",
            "ss",
            ["org.gpukill1.Manager", "SampleInterval"],
        )
        return r.body[0]

    assert interval() == 1.0
    conf.write_text("[daemon]\nsample_interval = 0.5\n")
    t0 = time.monotonic()
    os.kill(daemon.proc.pid, signal.SIGHUP)
    t_reloading = daemon.notify.wait_for("RELOADING=1", 10, after=t0)
    t_ready = daemon.notify.wait_for("READY=1", 10, after=t0)
    assert t_reloading is not None and t_ready is not None and t_reloading <= t_ready
    assert interval() == 0.5

    conf.write_text("[daemon]\nsample_interval = 0.5\nbogus = 1\n")
    t1 = time.monotonic()
    os.kill(daemon.proc.pid, signal.SIGHUP)
    assert daemon.notify.wait_for("READY=1", 10, after=t1) is not None
    assert interval() == 0.5, "a broken file must leave the configuration in force"
    entries = bed.wait_journal(GPUKILL_RESULT="reload-failed")
    assert entries and f"{conf}:3: unknown key 'bogus'" in entries[-1]["MESSAGE"]
    assert daemon.proc.poll() is None


def test_lost_device_is_signalled_and_others_keep_updating(fresh_bed):
    bed = fresh_bed
    daemon = bed.start_daemon(args=["--sample-interval", "0.2"])
    rec = bed.record_signals()
    _sim(daemon.sim_path, gpu1={"state": "lost", "state_reason": "Xid 79: GPU has fallen off the bus"})
    sig = rec.wait_for("DeviceStateChanged", where=lambda b: b[0] == 1 and b[2] == "lost")
    assert sig is not None
    assert sig["body"][3] == "Xid 79: GPU has fallen off the bus"
    devices = {d["index"]: d for d in bed.manager(ROOT, "ListDevices").body[0]}
    assert devices[1]["state"] == "lost" and "utilization" not in devices[1]
    assert devices[0]["state"] == "ok"
    # the other GPUs keep updating: a new process on GPU 0 shows up
    victim = bed.victim(ROOT, gpu=0, mem="3GiB")
    listed = bed.wait_listed(victim.pid)
    assert listed["device"] == 0
    entry = bed.wait_journal(MESSAGE_ID=audit.DEVICE_STATE.message_id, GPUKILL_STATE="lost")
    assert entry and entry[0]["GPUKILL_DEVICE_INDEX"] == "1"
    _sim(daemon.sim_path)
    assert rec.wait_for("DeviceStateChanged", where=lambda b: b[0] == 1 and b[2] == "ok") is not None
    r = bed.ctl(ROOT, "status")
    assert r.returncode == 0 and "4 GPUs (0 lost)" in r.stdout


def test_startup_errors_are_one_line(users, tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("devices:\n  - name: [unclosed\n")
    bad_conf = tmp_path / "bad.conf"
    bad_conf.write_text("[daemon]\nsample_interval = fast\n")
    cases = [
        (["--simulate", str(bad_yaml)], f"{bad_yaml}:"),
        (["--simulate", str(tmp_path / "missing.yaml")], "cannot read"),
        (["--config", str(bad_conf)], f"{bad_conf}:2: sample_interval: not a duration: 'fast'"),
        (["--sample-interval", "2h"], "--sample-interval: sample_interval must be between"),
        (["--sample-interval", "5 parsecs"], "--sample-interval: not a duration: '5 parsecs'"),
    ]
    for args, expected in cases:
        r = subprocess.run(
            [PYTHON, "-m", "gpukilld", *args],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(REPO), "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent"},
        )
        assert r.returncode == 1, (args, r)
        assert expected in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_teardown_leaves_no_process_behind(users):
    bed = Testbed()
    bed.start_bus()
    bed.start_journal()
    bed.start_polkit()
    bed.start_daemon()
    bed.victim(users["owner"], gpu=0, ignore_term=True)
    bed.record_signals()
    pids = [p.pid for p in bed.procs]
    assert len(pids) >= 6
    bed.stop()
    assert [p for p in pids if pid_alive(p)] == []
    # nothing anywhere still refers to the testbed's directory (its bus socket, notify socket, logs)
    leftovers = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if str(bed.workdir).encode() in cmdline:
                leftovers.append(entry)
    assert leftovers == []
