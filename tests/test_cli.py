"""gpukillctl as users run it: one-line errors with distinct exit codes, never a traceback; stable JSON."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml
from helpers.marks import needs_root
from helpers.testbed import OTHER, PYTHON, REPO, ROOT

from gpukillctl.cli.names import UNIT_DIRS
from gpukillctl.client.dbus import DEVICE_KEYS, PROCESS_KEYS
from gpukilld import journal as audit

pytestmark = needs_root


def assert_one_line_error(r: subprocess.CompletedProcess, code: int, text: str) -> None:
    assert r.returncode == code, r
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpukillctl"), r.stderr
    assert text in r.stderr, r.stderr


def test_usage_errors(bed, users):
    other = users["other"]
    for args, text in [
        (["kill", "abc"], "not a PID"),
        (["kill", "-5"], ""),
        (["kill", "0"], "PID out of range"),
        (["kill", "99999999999"], "PID out of range"),
        (["kill", "12", "--grace", "soon"], "argument --grace: not a duration: 'soon'"),
        (["kill", "12", "--grace", "1h"], "grace must be between"),
        (["kill", "12", "--grace", "1e9"], "not a duration: '1e9'"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
        (["list", "--min-memory", "lots"], "argument --min-memory: not a size: 'lots'"),
        (["list", "--min-memory", "5"], "a bare number is not a size: '5' (write a unit: 8GiB, 8GB, 512MiB, 4096B)"),
        (["audit", "--idle-after", "5 parsecs"], "argument --idle-after: idle_after: not a duration"),
    ]:
        assert_one_line_error(bed.ctl(other, *args), 2, text)


def test_help_lists_exit_codes(bed, users):
    r = bed.ctl(users["other"], "--help")
    assert r.returncode == 0
    for line in ("3   gpukilld or the system bus is not reachable", "4   access denied", "6   the PID now belongs"):
        assert line in r.stdout


def test_a_name_that_does_not_exist_is_exit_status_15(bed, users):
    """A typo is not "nothing to do": no such user, unit or GPU is one line and exit status 15, with nothing on
    stdout (not even an empty JSON listing)."""
    other = users["other"]
    for args, text in [
        (["list", "--user", "gpk-nosuch"], "no such user 'gpk-nosuch' on this host"),
        (["list", "--json", "--user", "gpk-nosuch"], "no such user 'gpk-nosuch' on this host"),
        (["list", "--device", "9"], "no such GPU '9' (GPUs here: 0, 1, 2, 3;"),
        (["list", "--device", "GPU-nosuch", "--user", OTHER], "no such GPU 'GPU-nosuch'"),
        (["usage", "--user", "gpk-nosuch"], "no such user 'gpk-nosuch' on this host"),
        (["usage", "--unit", "foo.servce"], "no such unit 'foo.servce' on this host"),
        (["usage", "--device", "9"], "no such GPU '9'"),
        (
            ["kill", "--unit", "foo-typo.service"],
            "no such unit 'foo-typo.service' on this host (systemd has no unit file",
        ),
    ]:
        r = bed.ctl(other, *args)
        assert_one_line_error(r, 15, text)
        assert r.stdout == "", r
    # not a unit name at all (no unit type is "servce"): a usage error, before the daemon is asked
    assert_one_line_error(bed.ctl(other, "kill", "--unit", "foo.servce"), 2, "not a systemd .service or .scope")
    r = bed.ctl(other, "--help")
    assert "15  no such user, group, unit or GPU" in r.stdout


def test_a_name_that_exists_but_has_no_gpu_processes_is_exit_status_0_with_a_line(bed, users):
    """nobody (an account of every host, which no test runs a GPU process as: the session's bed accumulates
    usage of the test users) runs nothing on a GPU here: exit status 0, the (empty) listing, and a line saying
    so."""
    other = users["other"]
    r = bed.ctl(other, "list", "--user", "nobody")
    assert r.returncode == 0 and r.stderr == "gpukillctl: user nobody has no GPU processes\n", r
    r = bed.ctl(other, "list", "--json", "--user", "4000000")  # a uid exists whether or not it has a name
    assert r.returncode == 0 and json.loads(r.stdout)["processes"] == [], r
    assert r.stderr == "gpukillctl: user 4000000 has no GPU processes\n"
    r = bed.ctl(other, "usage", "--user", "nobody", "--since", "1h")
    assert r.returncode == 0 and r.stderr == "gpukillctl: usage: user nobody has no GPU use recorded in this range\n", r
    unit = "systemd-journald.service"
    if not any(os.path.exists(os.path.join(d, unit)) for d in UNIT_DIRS):
        pytest.skip(f"no {unit} file on this host to stand for a unit that exists")
    r = bed.ctl(other, "kill", "--unit", unit)
    assert r.returncode == 0 and r.stdout == f"no GPU processes of unit {unit} on this host\n", r


def test_daemon_errors(victims, users):
    bed = victims
    owner, other = users["owner"], users["other"]
    victim = bed.victim(owner, gpu=2, comm="busy")
    bed.wait_listed(victim.pid)
    assert_one_line_error(bed.ctl(other, "kill", str(victim.pid)), 4, "not authorized to kill")
    assert_one_line_error(bed.ctl(other, "reset", "0"), 4, "not authorized to reset")
    assert_one_line_error(bed.ctl(other, "kill", "4194000"), 5, "no process with PID 4194000")
    assert_one_line_error(bed.ctl(ROOT, "kill", "1"), 7, "PID 1 (init) is protected")
    assert_one_line_error(bed.ctl(ROOT, "kill", str(os.getpid())), 7, "is not using a GPU")
    assert_one_line_error(bed.ctl(ROOT, "kill", str(victim.pid), "--start-time", "5"), 6, "list again")
    assert_one_line_error(bed.ctl(ROOT, "reset", "no-such-gpu"), 5, "no GPU 'no-such-gpu'")
    assert_one_line_error(bed.ctl(ROOT, "reset", "3"), 9, "not supported")
    assert_one_line_error(bed.ctl(ROOT, "reset", "2"), 8, "1 process(es) use the device")
    assert_one_line_error(bed.ctl(other, "list", "--name-regex", "(["), 2, "not a valid regular expression")


def test_daemon_absent_and_bus_absent(fresh_bed, users):
    bed = fresh_bed  # a bus without gpukilld on it
    assert_one_line_error(bed.ctl(users["other"], "list"), 3, "gpukilld is not running")
    r = subprocess.run(
        [PYTHON, "-m", "gpukillctl", "status"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO), "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent"},
    )
    assert_one_line_error(r, 3, "cannot connect to the system bus")


def test_failed_reset_leaves_device_and_says_so(fresh_bed, users):
    bed = fresh_bed
    sim = yaml.safe_load((REPO / "examples" / "simulate.yaml").read_text())
    sim["devices"][0]["reset"] = "fail: GPU 0000:18:00.0 is in use by the display server"
    path = bed.workdir / "failing.yaml"
    path.write_text(yaml.safe_dump(sim))
    bed.start_daemon(sim_yaml=path)
    rec = bed.record_signals()
    before = bed.manager(ROOT, "ListDevices").body[0][0]
    r = bed.ctl(ROOT, "reset", "GPU-8f1c6a2e-0b7d-4c1e-9a55-3d2e7f10a001")
    assert_one_line_error(r, 11, "in use by the display server")
    assert bed.manager(ROOT, "ListDevices").body[0][0] == before
    sig = rec.wait_for("DeviceReset")
    assert sig and sig["body"][:3] == [0, before["id"], False]
    entry = bed.wait_journal(MESSAGE_ID=audit.RESET_FAILED.message_id)
    assert entry and entry[0]["GPUKILL_RESULT"] == "reset-failed"


def test_force_reset_kills_holders_first(victims, users, alive):
    bed = victims
    rec = bed.record_signals()
    holder = bed.victim(users["owner"], gpu=1, ignore_term=True, comm="holder")
    bed.wait_listed(holder.pid)
    r = bed.ctl(ROOT, "reset", "1", "--force")
    assert r.returncode == 0, r
    assert f"killed first: {holder.pid}" in r.stdout
    assert not alive(holder.pid)
    kill = rec.wait_for("ProcessKilled", where=lambda b: b[0] == holder.pid)
    assert kill and kill["body"][5] == "killed" and kill["body"][7] == "reset"
    reset = rec.wait_for("DeviceReset", where=lambda b: b[0] == 1)
    assert reset and reset["body"][2] is True and reset["body"][4] == [holder.pid]
    assert bed.wait_journal(
        MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(holder.pid), GPUKILL_INITIATOR="reset"
    )


def test_json_output_is_stable(victims, users):
    bed = victims
    victim = bed.victim(users["owner"], gpu=3, mem="1500MiB", util=12.5, comm="jsonner")
    bed.wait_listed(victim.pid, comm="jsonner")
    doc = bed.listing(users["other"])
    assert doc["format"] == 1
    assert [list(d) for d in doc["devices"]] == [list(DEVICE_KEYS)] * 4
    dev3 = doc["devices"][3]
    assert dev3["temperature"] is None and dev3["power"] is None  # unknown is null, never 0
    assert dev3["memory_total"] == 16 * 2**30
    proc = next(p for p in doc["processes"] if p["pid"] == victim.pid)
    assert list(proc) == list(PROCESS_KEYS)
    assert proc["user"] == "gpkowner" and proc["uid"] == users["owner"].uid and proc["comm"] == "jsonner"
    assert proc["gpu_memory"] == 1500 * 2**20 and proc["gpu_utilization"] == 12.5 and proc["device"] == 3
    assert proc["exe"] is None or proc["exe"].startswith("/usr/bin/python3")
    table = bed.ctl(users["other"], "list")
    assert table.returncode == 0 and "jsonner" in table.stdout and "Simulated Arc A770" in table.stdout
