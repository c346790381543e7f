"""What a process becomes is seen at once: the kernel's proc connector (gpukilld/sampling/proc_events.py) tells
the sampler of an exec, a rename (prctl PR_SET_NAME) or a new uid, and the process is read again in the next
sample, however old it is. Where the connector is unavailable (GPUKILLD_PROC_EVENTS=off, a network namespace
of its own, a PID namespace of its own) the daemon polls and `gpukillctl status` says so.

The must-show: a process that becomes a miner after running 15 s (renamed, or exec'd into a program named
xmrig) is killed by a real daemon enforcing a `process_name` rule within one sample interval plus the rule's
duration. Polling, it would be seen 60 to 90 s after it left the young window.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers.marks import needs_root
from helpers.procs import pid_alive
from helpers.testbed import REPO, ROOT, SYSTEM_PYTHON, Testbed
from helpers.waiting import wait_until

from gpukill.records.base import specs
from gpukill.records.status import SamplingStatus
from gpukilld.backends import Backend, BackendSample
from gpukilld.model import BackendStatus, DeviceReading, ProcessUsage
from gpukilld.proc.procfs import ProcFS
from gpukilld.sampling import proc_events
from gpukilld.sampling import sampler as sampler_module
from gpukilld.sampling.proc_events import ProcEvents
from gpukilld.sampling.sampler import Sampler

pytestmark = needs_root

INTERVAL = 1.0  # the daemon's default
DURATION = 2.0  # the rule's
SLACK = 3.0  # a loaded machine: the sample's own time, the kill path, this test's polling of /proc
BECOMES_AFTER = 15.0  # past the sampler's young window (10 s): only its rotation (60-90 s) would see it polling
POLICY = f"""rules:
  - name: miner-names
    action: kill
    conditions:
      - {{type: process_name, operator: contains_any, value: [xmrig], duration: "{DURATION:g}s"}}
"""


def comm_of(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def child(code: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [SYSTEM_PYTHON, "-c", code],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env or {"PATH": "/usr/bin:/bin"},
        cwd="/",
        start_new_session=True,
        **kw,
    )


def ready(proc: subprocess.Popen) -> subprocess.Popen:
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


RENAMES_ON_STDIN = """import ctypes, sys, time
print('ready', flush=True)
for line in sys.stdin:
    ctypes.CDLL(None).prctl(15, line.strip().encode(), 0, 0, 0)
    print('renamed', flush=True)
"""


def renamer() -> subprocess.Popen:
    """A process that renames itself to each line it reads."""
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", RENAMES_ON_STDIN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
        start_new_session=True,
    )
    return ready(proc)


def rename(proc: subprocess.Popen, name: str) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(name.encode() + b"\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == b"renamed"


# -- the reader ---------------------------------------------------------------------------------------------


def test_the_reader_is_told_of_a_rename_and_an_exec_as_they_happen():
    events = ProcEvents()
    assert events.open(), events.reason
    try:
        proc = renamer()
        events.drain()
        rename(proc, "xmrig")
        assert proc.pid in wait_until(lambda: events.drain().pids, 5, "no comm event")  # noqa: B023
        proc.kill()
        proc.wait()
        execs = child("import os; print('ready', flush=True); os.execv('/bin/sleep', ['sleep', '0.2'])")
        ready(execs)
        seen: set[int] = set()
        wait_until(lambda: execs.pid in (seen.update(events.drain().pids) or seen), 5, "no exec event")
        execs.wait()
        assert events.events >= 2 and events.overruns == 0
    finally:
        events.close()
    assert not events.listening and events.drain().events == 0


def _open_in(*unshare: str) -> tuple[bool, str]:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from gpukilld.sampling.proc_events import ProcEvents; "
        "e = ProcEvents(); print(e.open(), e.reason, sep='|')"
    )
    r = subprocess.run(
        ["unshare", *unshare, "--", sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    ok, reason = r.stdout.strip().split("|", 1)
    return ok == "True", reason


def test_in_a_network_namespace_of_its_own_the_connector_is_refused_and_says_why():
    assert _open_in("--net") == (
        False,
        "the proc connector refused: Connection refused (not the host's network namespace)",
    )


def test_in_a_pid_namespace_of_its_own_no_acknowledgement_means_no_events():
    # The kernel ignores a subscription from another PID namespace (its PIDs would not be ours) in silence, and
    # other listeners may keep events flowing to the socket all the same: only the acknowledgement counts.
    ok, reason = _open_in("--pid", "--fork", "--mount-proc")
    assert not ok and "did not acknowledge" in reason


def test_the_off_switch_and_a_foreign_proc_root_mean_polling(monkeypatch):
    monkeypatch.setenv(proc_events.OFF_SWITCH, "off")
    events = proc_events.open_for(True)
    assert not events.listening and events.reason == "turned off by GPUKILLD_PROC_EVENTS=off"
    monkeypatch.delenv(proc_events.OFF_SWITCH)
    events = proc_events.open_for(False)
    assert not events.listening and events.reason == "the proc root is not this host's /proc"


def _execs(n: int) -> None:
    """n execs, one after the other (each a proc connector event)."""
    subprocess.run(["sh", "-c", f"for i in $(seq {n}); do /bin/true; done"], check=True, timeout=60)


def test_a_flood_is_read_up_to_the_cap_then_counts_as_an_overrun():
    events = ProcEvents(max_events=8)
    assert events.open(), events.reason
    try:
        _execs(40)
        drained = events.drain()
        assert drained.overrun and drained.events == 8 and events.overruns == 1
        # what was left was dropped: later drains read only what came since (other users' execs, a few)
        wait_until(lambda: not events.drain().overrun, 10, "every drain overran", interval=0.02)
    finally:
        events.close()


def test_a_receive_buffer_that_overran_is_an_overrun():
    events = ProcEvents(rcvbuf=1)  # the kernel's minimum: a few events
    assert events.open(), events.reason
    try:
        _execs(60)
        assert events.drain().overrun  # ENOBUFS: events were lost
    finally:
        events.close()


# -- the sampler ----------------------------------------------------------------------------------------------


class OneGpu(Backend):
    """A backend that reports the given processes on one GPU: the sampler's part is what is tested."""

    name = "one-gpu"

    def __init__(self) -> None:
        self.usages: list[ProcessUsage] = []

    def status(self) -> BackendStatus:
        return BackendStatus(self.name, True, "test")

    def sample(self) -> BackendSample:
        return BackendSample(
            devices=[DeviceReading(id="GPU-T", vendor="test", name="test")], processes=list(self.usages)
        )

    def reset(self, device_id: str) -> str:
        raise NotImplementedError


def _sampler(events: ProcEvents | None, proc: subprocess.Popen) -> tuple[Sampler, OneGpu]:
    backend = OneGpu()
    start = ProcFS().start_time(proc.pid)
    assert start is not None
    backend.usages = [ProcessUsage(proc.pid, start, "GPU-T", 1 << 30, 50.0)]
    return Sampler([backend], 1.0, ProcFS(), lambda snap, changes: None, events=events), backend


def _comm(sampler: Sampler) -> str:
    return sampler.sample_once()[0].processes[0].comm


@pytest.fixture
def old(monkeypatch):
    """Every process counts as old (past the young window: polling reads it only in its rotation)."""
    monkeypatch.setattr(sampler_module, "YOUNG", 0.0)


def test_the_sampler_reads_a_renamed_process_again_in_the_next_sample(old):
    events = ProcEvents()
    assert events.open(), events.reason
    proc = renamer()
    try:
        sampler, _ = _sampler(events, proc)
        assert _comm(sampler) == "python3" and _comm(sampler) == "python3"
        rename(proc, "xmrig")
        assert _comm(sampler) == "xmrig"
        status = sampler.sampling_status()
        assert status.mode == "events" and status.events >= 1 and status.overruns == 0
        assert status.detail.startswith("the kernel's proc connector: ")
    finally:
        proc.kill()
        events.close()


def test_polling_sees_an_old_process_renamed_only_at_its_turn(old):
    proc = renamer()
    try:
        sampler, _ = _sampler(None, proc)
        assert _comm(sampler) == "python3"
        rename(proc, "xmrig")
        assert _comm(sampler) == "python3", "polling: read again 60 to 90 s later"
        status = sampler.sampling_status()
        assert status.mode == "polling" and "re-read every 60 to 90 s" in status.detail
    finally:
        proc.kill()


def test_after_an_overrun_the_sampler_reads_every_process_again(old):
    events = ProcEvents(max_events=1)
    assert events.open(), events.reason
    proc = renamer()
    try:
        sampler, _ = _sampler(events, proc)
        assert _comm(sampler) == "python3"
        _execs(10)  # its event is behind these: dropped with them
        rename(proc, "xmrig")
        assert _comm(sampler) == "xmrig"
        assert sampler.sampling_status().overruns >= 1
    finally:
        proc.kill()
        events.close()


def test_the_sampling_record_is_documented_with_its_property():
    xml = (REPO / "dbus" / "org.gpukill1.xml").read_text()
    at = xml.index('<property name="Sampling" type="a{sv}"')
    doc = xml[xml.rindex("<!--", 0, at) : at]
    assert all(re.search(rf"\b{name}\b", doc) for name, _ in specs(SamplingStatus))
    assert [f.name for f in dataclasses.fields(SamplingStatus)] == ["mode", "detail", "events", "overruns"]


# -- the daemon ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pbed(users):
    """A private system whose gpukilld samples every second and enforces a process_name rule."""
    b = Testbed()
    try:
        (b.workdir / "guard.d").mkdir(exist_ok=True)
        b.write_conf()
        b.start_system(args=["--sample-interval", str(INTERVAL)])
        (b.workdir / "miners.yaml").write_text(POLICY)
        b.enforce(b.workdir / "miners.yaml")
        yield b
    finally:
        b.stop()


@pytest.fixture
def xmrig():
    """A program named xmrig (a copy of sleep) that any user may run."""
    d = Path(tempfile.mkdtemp(prefix="gpukill-xmrig-"))
    try:
        d.chmod(0o755)
        shutil.copy("/bin/sleep", d / "xmrig")
        (d / "xmrig").chmod(0o755)
        yield d / "xmrig"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _on_gpu(bed: Testbed, user, code: str) -> subprocess.Popen:
    env = {"PATH": "/usr/bin:/bin", "GPUKILL_SIM_GPU": "0", "GPUKILL_SIM_SCOPE": bed.scope, "GPUKILL_SIM_UTIL": "99"}
    proc = child(code, env, **user.popen_kwargs())
    bed.procs.append(proc)
    return ready(proc)


def _killed_in_time(bed: Testbed, procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, float]:
    """For each process: seconds from the moment it was named xmrig to its exit, once each has exited or the
    deadline (timeout after its renaming) passed."""
    became: dict[str, float] = {}
    gone: dict[str, float] = {}
    deadline = time.monotonic() + BECOMES_AFTER + 10 + timeout
    while len(gone) < len(procs) and time.monotonic() < deadline:
        now = time.monotonic()
        for what, proc in procs.items():
            if what not in became and comm_of(proc.pid) == "xmrig":
                became[what] = now
            if what not in gone and proc.poll() is not None:
                gone[what] = now
            if what in became and what not in gone and now - became[what] > timeout:
                gone[what] = float("inf")
        time.sleep(0.02)
    return {what: gone.get(what, float("inf")) - became.get(what, float("inf")) for what in procs}


def _status(bed: Testbed) -> str:
    r = bed.ctl(ROOT, "status")
    assert r.returncode == 0, r
    return r.stdout


def test_a_process_that_becomes_a_miner_after_15s_is_killed_within_an_interval_and_the_duration(pbed, users, xmrig):
    bed = pbed
    before = len(bed.procs)
    try:
        line = next(x for x in _status(bed).splitlines() if x.startswith("process changes:"))
        assert line.startswith("process changes: events - the kernel's proc connector"), line
        renamed = _on_gpu(
            bed,
            users["owner"],
            "import ctypes, time\nprint('ready', flush=True)\n"
            f"time.sleep({BECOMES_AFTER})\nctypes.CDLL(None).prctl(15, b'xmrig', 0, 0, 0)\n"
            "time.sleep(600)\n",
        )
        execd = _on_gpu(
            bed,
            users["owner"],
            "import os, time\nprint('ready', flush=True)\n"
            f"time.sleep({BECOMES_AFTER})\nos.execv({str(xmrig)!r}, ['xmrig', '600'])\n",
        )
        bystander = _on_gpu(bed, users["owner"], "import time\nprint('ready', flush=True)\ntime.sleep(600)\n")
        bound = INTERVAL + DURATION + SLACK
        took = _killed_in_time(bed, {"renamed": renamed, "exec'd": execd}, bound)
        print(f"seconds from becoming xmrig to killed, bound {bound:g}: {took}")
        assert all(t <= bound for t in took.values()), f"seconds from becoming xmrig to killed: {took}"
        assert all(t >= DURATION - 0.5 for t in took.values()), f"killed before the rule's duration: {took}"
        assert pid_alive(bystander.pid)
        assert re.search(r"process changes: events - .*", _status(bed))
    finally:
        bed.kill_since(before)


def _restart(bed: Testbed, env: dict | None = None, wrap: list[str] | None = None) -> None:
    bed.stop_daemon()
    if wrap:
        inner = bed.in_journal_ns
        bed.in_journal_ns = lambda argv: inner([*wrap, "--", *argv])  # type: ignore[method-assign]
    try:
        bed.start_daemon(args=["--sample-interval", str(INTERVAL)], env=env)
    finally:
        if wrap:
            del bed.in_journal_ns


def test_polling_is_the_fallback_says_so_and_still_kills(pbed, users):
    bed = pbed
    before = len(bed.procs)
    try:
        _restart(bed, env={proc_events.OFF_SWITCH: "off"})
        out = _status(bed)
        assert (
            "process changes: polling - the kernel's proc connector is unavailable: turned off by "
            "GPUKILLD_PROC_EVENTS=off; processes are re-read every 60 to 90 s" in out
        ), out
        # a young process is read every sample while polling: renamed at 2 s, it is killed as soon
        young = _on_gpu(
            bed,
            users["owner"],
            "import ctypes, time\nprint('ready', flush=True)\ntime.sleep(2)\n"
            "ctypes.CDLL(None).prctl(15, b'xmrig', 0, 0, 0)\ntime.sleep(600)\n",
        )
        bound = INTERVAL + DURATION + SLACK
        took = _killed_in_time(bed, {"young": young}, bound)
        assert took["young"] <= bound, took

        # in a network namespace of its own the daemon still serves, and polls
        _restart(bed, wrap=["unshare", "--net"])
        assert bed.daemon is not None
        assert os.readlink(f"/proc/{bed.daemon.proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        out = _status(bed)
        assert (
            "process changes: polling - the kernel's proc connector is unavailable: the proc connector "
            "refused: Connection refused (not the host's network namespace)" in out
        ), out
    finally:
        bed.kill_since(before)
        _restart(bed)
