"""`gpukillctl monitor` as an unprivileged user on the real test bed: every signal kind, produced by real acts
(a Guard kill with a desktop notice, a reset, a device lost and back), as JSON lines whose keys are exactly the
signal's arguments in dbus/org.gpukill1.xml and as escaped human lines; Ctrl-C ends it quietly; `| head -1` ends
when head does; with gpukilld stopped it says so once and waits."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import xml.etree.ElementTree as ET

import pytest
import yaml
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO, ROOT, Testbed, User
from helpers.waiting import wait_until

from gpukill.records.base import names
from gpukill.records.guard import ViolationDetails

pytestmark = needs_root

SAMPLE_INTERVAL = "0.2"
PROBE_DEVICE = "2"  # the simulated MI210: resets succeed, and no test here puts a process on it
LOST_DEVICE = 1
RULE = "stop-gpkmon"
COMM = "gpkmon\x1b[1m"  # a name with an escape sequence: exact in JSON, escaped in human lines
POLICY = f"""rules:
  - name: {RULE}
    conditions: [{{type: process_name, operator: contains_any, value: [gpkmon]}}]
    action: kill
    grace_period: 1s  # a grace: ReclaimPending is heard too
    force: true
    notify: [desktop]
"""
ENVELOPE = ["format", "time", "interface", "signal"]


def xml_signals() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """member -> (interface, [(argument name, type), ...]) from the interface XML."""
    root = ET.parse(REPO / "dbus" / "org.gpukill1.xml").getroot()
    return {
        sig.get("name"): (iface.get("name"), [(a.get("name"), a.get("type")) for a in sig.iter("arg")])
        for iface in root.iter("interface")
        for sig in iface.iter("signal")
    }


SIGNALS = xml_signals()
JSON_TYPES = {"u": int, "t": int, "s": str, "b": bool, "d": float, "as": list, "au": list, "a{sv}": dict}


@pytest.fixture(scope="module")
def mbed(users):
    """A private system of this module's own: Guard set up, a device that goes lost, gpukilld stopped once."""
    b = Testbed()
    try:
        (b.workdir / "guard.d").mkdir()
        b.start_system(args=["--sample-interval", SAMPLE_INTERVAL])
        (b.workdir / "monitor.yaml").write_text(POLICY)
        b.enforce(b.workdir / "monitor.yaml")
        yield b
    finally:
        b.stop()


@pytest.fixture
def bed(mbed):
    before = len(mbed.procs)
    yield mbed
    mbed.kill_since(before)


class Monitor:
    """`gpukillctl monitor ARGS` running as a user, its stdout and stderr lines collected as they come."""

    def __init__(self, bed: Testbed, user: User, *args: str, argv: list[str] | None = None) -> None:
        # as a user runs it: stdout block-buffered into a pipe, so each line is there only if monitor flushes it
        env = {k: v for k, v in bed.env().items() if k != "PYTHONUNBUFFERED"}
        self.proc = subprocess.Popen(
            argv or [PYTHON, "-m", "gpukillctl", "monitor", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
            start_new_session=True,
            **user.popen_kwargs(),
        )
        bed.procs.append(self.proc)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, lines), daemon=True).start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def interrupt(self) -> int:
        """Ctrl-C, as a terminal sends it; the exit status."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(10)


def probe_until(bed: Testbed, cond, what: str) -> None:
    """Reset the probe device until cond() holds: a monitor is listening once it prints the reset (there is no
    other way to know when the bus has taken its match rule)."""

    def probed():
        if cond():
            return True
        assert bed.ctl(ROOT, "reset", PROBE_DEVICE).returncode == 0
        return wait_until(cond, 0.5, fail=False)

    wait_until(probed, 20, what, interval=0)


def set_device_state(bed: Testbed, index: int, state: str, reason: str = "") -> None:
    """The simulated backend re-reads its file when it changes: a device falls off the bus, or comes back."""
    sim = yaml.safe_load(bed.daemon.sim_path.read_text())
    sim["devices"][index].update(state=state, state_reason=reason)
    bed.daemon.sim_path.write_text(yaml.safe_dump(sim))


def check_against_xml(line: dict) -> None:
    """The line's keys are the envelope, then exactly the signal's arguments in order, each of its type."""
    interface, args = SIGNALS[line["signal"]]
    assert list(line) == ENVELOPE + [name for name, _ in args], line
    assert line["format"] == 1 and line["interface"] == interface
    assert isinstance(line["time"], float) and abs(line["time"] - time.time()) < 120
    for name, sig in args:
        value = line[name]
        assert isinstance(value, JSON_TYPES[sig]) and (sig == "b" or not isinstance(value, bool)), (name, value)
        if sig in ("u", "t"):
            assert 0 <= value < (1 << 32 if sig == "u" else 1 << 64)
        if sig in ("as", "au"):
            assert all(isinstance(v, JSON_TYPES[sig[1]]) for v in value), (name, value)
    if line["signal"] == "PolicyViolated":
        assert list(line["details"]) == list(names(ViolationDetails))


def test_every_signal_kind_as_json_and_human_lines(bed, users):
    owner, other = users["owner"], users["other"]
    as_json = Monitor(bed, other, "--json")
    human = Monitor(bed, other)
    probe_until(bed, lambda: as_json.out and human.out, "the monitors never printed the probe's reset")

    victim = bed.victim(owner, gpu=0, comm=COMM)  # the Guard rule kills it after a second, with a desktop notice
    set_device_state(bed, LOST_DEVICE, "lost", "fell off the bus")
    # "list again" is for observers: monitor leaves it out; a suspend needs the NVIDIA backend, which this
    # bed's simulated GPUs are not (tests/test_suspend.py hears those signals on the fake NVIDIA host)
    wanted = set(SIGNALS) - {"SnapshotChanged", "ProcessSuspended", "ProcessResumed"}

    def seen() -> set[str]:
        return {json.loads(line)["signal"] for line in as_json.out}

    wait_until(lambda: seen() >= wanted, 20, lambda: f"missing {wanted - seen()}: {as_json.out}")
    assert "SnapshotChanged" not in seen()  # the victim came and went: the listing changed
    set_device_state(bed, LOST_DEVICE, "ok")
    wait_until(lambda: any('"state": "ok"' in line for line in as_json.out), 10, "the device never came back")
    wait_until(lambda: any(line.endswith(" is ok\n") for line in human.out), 5, "the human monitor fell behind")
    assert as_json.interrupt() == 0 and human.interrupt() == 0, "Ctrl-C ends monitor with status 0"
    assert as_json.err == [] and human.err == [], "quietly"

    lines = [json.loads(line) for line in as_json.out]
    for line in lines:
        check_against_xml(line)
    by_kind = {}
    for line in lines:
        by_kind.setdefault(line["signal"], []).append(line)
    killed = next(k for k in by_kind["ProcessKilled"] if k["pid"] == victim.pid)
    assert (killed["comm"], killed["uid"], killed["initiator"], killed["caller_uid"]) == (
        COMM,
        owner.uid,
        f"guard:{RULE}",
        0,
    )
    assert killed["outcome"] in ("terminated", "killed") and victim.wait(5) is not None
    violated = next(v for v in by_kind["PolicyViolated"] if v["rule"] == RULE)
    assert violated["details"]["pids"] == [victim.pid] and violated["details"]["uid"] == owner.uid
    taken = next(t for t in by_kind["GuardActionTaken"] if t["pid"] == victim.pid)
    assert (taken["rule"], taken["action"], taken["outcome"], taken["dry_run"]) == (
        RULE,
        "kill",
        killed["outcome"],
        False,
    )
    notice = next(n for n in by_kind["Notification"] if n["rule"] == RULE)
    assert notice["uid"] == owner.uid and notice["summary"]
    assert [(s["index"], s["state"], s["reason"]) for s in by_kind["DeviceStateChanged"]][:1] == [
        (LOST_DEVICE, "lost", "fell off the bus")
    ]
    assert by_kind["DeviceStateChanged"][-1]["state"] == "ok"
    reset = by_kind["DeviceReset"][0]
    assert (reset["index"], reset["success"], reset["killed"]) == (int(PROBE_DEVICE), True, [])

    # The same signals in words, in the same order, one line each, with the process's name escaped. (Not the
    # probes' resets: one monitor may have heard a probe the other was not yet listening for.)
    text = "".join(human.out)
    kinds = [line.split()[2] for line in human.out]
    assert [k for k in kinds if k != "DeviceReset"] == [
        line["signal"] for line in lines if line["signal"] != "DeviceReset"
    ]
    assert len(kinds) == len(human.out) >= 7
    assert "\x1b" not in text and "gpkmon\\x1b[1m" in text
    assert f"PID {victim.pid} (gpkmon\\x1b[1m, uid {owner.uid})" in text and f"by guard:{RULE}" in text
    assert f"GPU {LOST_DEVICE} (" in text and "is lost: fell off the bus" in text


def test_count_stops_after_n_signals_and_must_be_positive(bed, users):
    r = bed.ctl(users["other"], "monitor", "--count", "0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "at least 1" in r.stderr, r
    counted = Monitor(bed, users["other"], "--json", "--count", "2")
    probe_until(bed, lambda: counted.proc.poll() is not None, "monitor --count 2 never ended")
    assert counted.proc.wait(5) == 0 and len(counted.out) == 2 and counted.err == []


def test_a_closed_pipe_ends_it_at_once(bed, users):
    """`monitor | head -1`: head exits after one line and the pipeline ends then, not at the next signal; the
    monitor's own status (pipefail) is 0 and it prints nothing."""
    script = f"set -o pipefail; {PYTHON} -m gpukillctl monitor --json | head -1"
    pipeline = Monitor(bed, users["other"], argv=["bash", "-c", script])
    probe_until(bed, lambda: pipeline.out, "head never printed a line")
    assert pipeline.proc.wait(5) == 0, pipeline.err
    assert len(pipeline.out) == 1 and json.loads(pipeline.out[0])["signal"] == "DeviceReset"
    assert pipeline.err == []


def test_without_gpukilld_it_says_so_once_and_waits(bed, users):
    bed.stop_daemon()
    try:
        waiting = Monitor(bed, users["other"])
        wait_until(lambda: waiting.err, 10, "monitor never said it is waiting")
        time.sleep(0.5)
        assert waiting.proc.poll() is None, "it waits rather than exits"
    finally:
        bed.start_daemon(args=["--sample-interval", SAMPLE_INTERVAL])
    assert bed.ctl(ROOT, "reset", PROBE_DEVICE).returncode == 0  # the subscription was in place all along
    wait_until(lambda: waiting.out, 10, "the signal of the daemon that came was not printed")
    assert waiting.out[0].split()[2] == "DeviceReset"
    assert waiting.interrupt() == 0
    assert waiting.err == ["gpukillctl: gpukilld is not running; waiting for it\n"]
