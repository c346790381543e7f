"""The files gpukilld keeps on a really full file system: a small tmpfs, mounted in the mount namespace the
daemon runs in (the bed's journald's), filled up with a file. Guard's state, the policy files in guard.d, the
audit settings' drop-in, the usage totals and the usage store: the daemon keeps sampling, what is in force stays
whole, the journal says once what could not be written and where, a change that needs the disk is refused in
one line, and once space is freed the next write succeeds (gpukilld/files.py's WriteWatch)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.marks import needs_root
from helpers.testbed import OTHER, ROOT, Testbed
from helpers.waiting import wait_until

from gpukilld import journal
from gpukilld.files import WriteWatch

INTERVAL = 0.3
WATCH = (
    "rules:\n  - {name: watch, action: log, conditions: [{type: gpu_utilization, operator: '>', value: 50,"
    " duration: 1h}]}\n"
)


# -- WriteWatch alone ------------------------------------------------------------------------------------------


class Entries:
    def __init__(self) -> None:
        self.logged: list[tuple[str, str, dict]] = []

    def log(self, kind: journal.EventKind, message: str, **fields: object) -> None:
        self.logged.append((kind.name, message, fields))


def test_a_run_of_failures_is_one_entry_and_the_success_after_it_one_more():
    audit, now = Entries(), [0.0]
    watch = WriteWatch(audit, "/var/lib/gpukill/x.json", "the x", "the old file stays", clock=lambda: now[0])
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    for _ in range(50):  # a save per sample
        watch.failed(full)
        now[0] += 1
    assert [(k, m) for k, m, _ in audit.logged] == [
        ("write-failed", "cannot write /var/lib/gpukill/x.json (the x): No space left on device; the old file stays")
    ]
    assert audit.logged[0][2]["file"] == "/var/lib/gpukill/x.json"
    watch.written()
    watch.written()
    assert [k for k, _, _ in audit.logged] == ["write-failed", "write-recovered"]
    assert audit.logged[1][2]["failures"] == 50


def test_a_disk_that_flaps_makes_at_most_one_pair_per_period():
    audit, now = Entries(), [0.0]
    watch = WriteWatch(audit, "/s/f", "the f", "kept", clock=lambda: now[0])
    for _ in range(100):  # fails, then succeeds on the space its removal freed, and so on
        watch.failed(OSError(errno.ENOSPC, "No space left on device"))
        watch.written()
        now[0] += 1
    assert [k for k, _, _ in audit.logged] == ["write-failed", "write-recovered"]
    now[0] += WriteWatch.REPORT_EVERY
    watch.failed(OSError(errno.ENOSPC, "No space left on device"))
    assert [k for k, _, _ in audit.logged][-1] == "write-failed" and len(audit.logged) == 3


# -- the real daemon on a full tmpfs ---------------------------------------------------------------------------


class Disk:
    """A tmpfs of `size` at `where`, seen by the daemon (in the bed's mount namespace); the test reaches it
    through /proc/JOURNALD/root."""

    def __init__(self, bed: Testbed, size: str = "512k") -> None:
        self.bed = bed
        self.where = bed.workdir / "disk"
        self.where.mkdir()
        subprocess.run(
            bed.in_journal_ns(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(self.where)]),
            check=True,
        )
        self.filler = self.seen("filler")

    def seen(self, *parts: str) -> Path:
        """A path on the tmpfs as this process reaches it."""
        return Path(f"/proc/{self.bed.journal_pid}/root{self.where}", *parts)

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in (1 << 16, 4096, 1):
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * chunk):
                        pass
        finally:
            os.close(fd)
        with pytest.raises(OSError) as e:
            self.seen("probe").write_bytes(b"x")
        assert e.value.errno == errno.ENOSPC

    def free(self) -> None:
        self.filler.unlink()

    def unmount(self, *extra: Path) -> None:
        for path in (*extra, self.where):
            subprocess.run(self.bed.in_journal_ns(["umount", "-l", str(path)]), check=False)


def entries(bed: Testbed, kind: journal.EventKind, path: Path | str) -> list[dict]:
    return bed.journal(MESSAGE_ID=kind.message_id, GPUKILL_FILE=str(path))


def snapshots(rec) -> int:
    with rec._cond:
        return sum(1 for s in rec.signals if s["member"] == "SnapshotChanged")


@pytest.fixture
def guard_disk(fresh_bed, users):
    """The daemon with guard.d, its state directory and gpukilld.conf.d on one small tmpfs."""
    bed = fresh_bed
    disk = Disk(bed)
    confd = bed.workdir / "gpukilld.conf.d"
    confd.mkdir()
    try:
        for sub in ("guard.d", "state", "conf.d"):
            disk.seen(sub).mkdir(mode=0o755)
        disk.seen("guard.d", "watch.yaml").write_text(WATCH)
        subprocess.run(bed.in_journal_ns(["mount", "--bind", str(disk.where / "conf.d"), str(confd)]), check=True)
        bed.write_conf(
            guard={"policy_dir": disk.where / "guard.d", "state_dir": disk.where / "state"}, usage={"enabled": "no"}
        )
        bed.start_daemon(args=["--sample-interval", str(INTERVAL)])
        yield bed, disk
    finally:
        bed.stop_daemon()
        disk.unmount(confd)


@pytest.mark.usefixtures("users")
@needs_root
def test_guard_state_policies_and_settings_survive_a_full_disk(guard_disk):
    bed, disk = guard_disk
    state = disk.seen("state", "guard-state.json")
    state_in_ns = disk.where / "state" / "guard-state.json"
    dropin = disk.seen("conf.d", "50-audit.conf")
    for args in (["guard", "enable"], ["guard", "dry-run", "off"], ["audit", "settings", "set", "idle_after=1"]):
        r = bed.ctl(ROOT, *args)
        assert r.returncode == 0, r
    before = {p: p.read_bytes() for p in (state, dropin, disk.seen("guard.d", "watch.yaml"))}
    assert json.loads(before[state])["dry_run"] is False
    rec = bed.record_signals(ROOT)

    disk.fill()
    for args in (["dry-run", "on"], ["disable"], ["enable"]):  # each a save of the state that fails
        r = bed.ctl(ROOT, "guard", *args)
        assert r.returncode == 0, r  # in force, and the admin is told it is not kept
        assert r.stderr.strip() == (
            f"gpukillctl: in force, but not kept across a restart of gpukilld: cannot write "
            f"{state_in_ns}: No space left on device"
        ), r
    assert bed.guard_status()["dry_run"] is True
    r = bed.ctl(ROOT, "guard", "status")
    assert f"state not saved (a restart resumes from it as last saved): cannot write {state_in_ns}" in r.stdout, r
    # refused in one line, naming the file and why; nothing left behind
    r = bed.ctl(ROOT, "guard", "policy", "add", "user", OTHER, "--memory-limit", "8GiB")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r
    assert "No space left on device" in r.stderr and str(disk.where / "guard.d") in r.stderr, r
    r = bed.ctl(ROOT, "audit", "settings", "set", "idle_after=2")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r
    assert "No space left on device" in r.stderr and "50-audit.conf" in r.stderr, r
    assert sorted(os.listdir(disk.seen("guard.d"))) == ["watch.yaml"]
    assert sorted(os.listdir(disk.seen("state"))) == ["guard-state.json"]
    assert {p: p.read_bytes() for p in before} == before  # the files as last written, whole

    # the daemon samples on: a process that comes is listed and announced, and so is one that goes
    seen = snapshots(rec)
    v = bed.victim(ROOT, gpu=0, util=90, comm="afterfull")
    assert bed.wait_listed(v.pid, comm="afterfull")
    wait_until(lambda: snapshots(rec) > seen, 10, "no SnapshotChanged after the disk filled")
    seen = snapshots(rec)
    v.kill()
    v.wait(10)
    bed.wait_listed(v.pid, present=False)
    wait_until(lambda: snapshots(rec) > seen, 10, "no SnapshotChanged for a process gone")
    failed = wait_until(lambda: entries(bed, journal.WRITE_FAILED, state_in_ns), 10, "no journal entry")
    assert len(failed) == 1 and failed[0]["PRIORITY"] == "3", failed
    assert "No space left on device" in failed[0]["MESSAGE"] and failed[0]["GPUKILL_ERROR"], failed

    disk.free()
    r = bed.ctl(ROOT, "guard", "dry-run", "off")
    assert r.returncode == 0 and r.stderr == "", r
    assert json.loads(state.read_bytes())["dry_run"] is False
    assert bed.guard_status()["state_error"] == ""
    recovered = wait_until(lambda: entries(bed, journal.WRITE_RECOVERED, state_in_ns), 10, "no recovery entry")
    assert int(recovered[0]["GPUKILL_FAILURES"]) >= 3, recovered  # dry-run on, disable, enable at least
    assert len(entries(bed, journal.WRITE_FAILED, state_in_ns)) == 1
    r = bed.ctl(ROOT, "audit", "settings", "set", "idle_after=2")
    assert r.returncode == 0, r
    assert "idle_after = 2" in dropin.read_text()
    r = bed.ctl(ROOT, "guard", "policy", "add", "user", OTHER, "--memory-limit", "8GiB")
    assert r.returncode == 0, r
    assert len(os.listdir(disk.seen("guard.d"))) == 2


@pytest.fixture
def usage_disk(fresh_bed, users):
    """The daemon with its state directory (the usage totals and store) on one small tmpfs."""
    bed = fresh_bed
    disk = Disk(bed, size="2m")
    try:
        disk.seen("state").mkdir(mode=0o755)
        (bed.workdir / "guard.d").mkdir()
        bed.write_conf(guard={"state_dir": disk.where / "state"})
        bed.start_daemon(args=["--sample-interval", str(INTERVAL)])
        yield bed, disk
    finally:
        bed.stop_daemon()
        disk.unmount()


STORED = (
    "import sqlite3, sys; c = sqlite3.connect(f'file:{sys.argv[1]}?mode=ro', uri=True); "
    "print(c.execute('SELECT count(*) FROM usage WHERE pid = ?', (int(sys.argv[2]),)).fetchone()[0])"
)


def stored(bed: Testbed, disk: Disk, pid: int) -> int:
    """The records of pid in the store's file (0 before the daemon made it), read in the daemon's mount
    namespace: SQLite resolves /proc/PID/root as the link it is, to this namespace's /."""
    if not disk.seen("state", "usage.sqlite").exists():
        return 0
    r = subprocess.run(
        bed.in_journal_ns([sys.executable, "-c", STORED, str(disk.where / "state" / "usage.sqlite"), str(pid)]),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(r.stdout)


def used(bed: Testbed, name: str) -> list[dict]:
    r = bed.ctl(ROOT, "usage", "--by", "process", "--name", name, "--since", "10min", "--json")
    assert r.returncode == 0, r
    return json.loads(r.stdout)["rows"]


@pytest.mark.usefixtures("users")
@needs_root
def test_usage_records_are_held_while_the_disk_is_full_and_stored_once_it_is_not(usage_disk):
    bed, disk = usage_disk
    store = disk.where / "state" / "usage.sqlite"
    first = bed.victim(ROOT, gpu=0, util=50, comm="beforefull", lifetime=1.0)
    first.wait(30)
    wait_until(lambda: stored(bed, disk, first.pid), 15, "the first record was not stored")

    disk.fill()
    ended = []
    for n in range(3):  # several closes over a few seconds: several saves that fail
        v = bed.victim(ROOT, gpu=0, util=50, comm=f"whilefull{n}", lifetime=1.0)
        v.wait(30)
        ended.append(v.pid)
    for n, pid in enumerate(ended):
        rows = wait_until(lambda n=n: used(bed, f"whilefull{n}"), 15, f"whilefull{n} not counted")
        assert [r["pid"] for r in rows] == [pid]
    assert not any(stored(bed, disk, pid) for pid in ended)  # counted from memory: the file could not take them
    failed = wait_until(lambda: entries(bed, journal.WRITE_FAILED, store), 15, "no entry for the store")
    time.sleep(2 * INTERVAL)
    assert len(entries(bed, journal.WRITE_FAILED, store)) == 1, failed
    assert "usage store" in failed[0]["MESSAGE"] and "full" in failed[0]["GPUKILL_ERROR"], failed
    assert bed.wait_listed(bed.victim(ROOT, gpu=0, util=50, comm="sampling").pid, comm="sampling")

    disk.free()
    wait_until(lambda: entries(bed, journal.WRITE_RECOVERED, store), 15, "the store did not write again")
    assert all(stored(bed, disk, pid) == 1 for pid in ended)
    for n, pid in enumerate(ended):
        assert [r["pid"] for r in used(bed, f"whilefull{n}")] == [pid]  # once, not twice
    assert len(entries(bed, journal.WRITE_FAILED, store)) == 1


@pytest.fixture
def full_at_start(fresh_bed, users):
    """The daemon started with its state directory on a tmpfs already full: no usage store yet."""
    bed = fresh_bed
    disk = Disk(bed)
    try:
        disk.seen("state").mkdir(mode=0o755)
        (bed.workdir / "guard.d").mkdir()
        bed.write_conf(guard={"state_dir": disk.where / "state"})
        disk.fill()
        bed.start_daemon(args=["--sample-interval", str(INTERVAL)])
        yield bed, disk
    finally:
        bed.stop_daemon()
        disk.unmount()


@pytest.mark.usefixtures("users")
@needs_root
def test_a_store_that_could_not_be_made_at_start_is_made_once_there_is_space(full_at_start):
    bed, disk = full_at_start
    store = disk.where / "state" / "usage.sqlite"
    r = bed.ctl(ROOT, "usage")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r
    assert "cannot be opened" in r.stderr and "full" in r.stderr, r
    assert not disk.seen("state", "usage.sqlite").exists()  # nothing half made left behind
    failed = wait_until(lambda: entries(bed, journal.WRITE_FAILED, store), 10, "no entry for the store")
    assert len(failed) == 1, failed
    v = bed.victim(ROOT, gpu=0, util=50, comm="closedwhilefull", lifetime=1.0)
    v.wait(30)
    wait_until(
        lambda: bed.journal(MESSAGE_ID=journal.USAGE.message_id, GPUKILL_TARGET_PID=str(v.pid)),
        15,
        "no usage entry in the journal",
    )

    disk.free()
    wait_until(lambda: entries(bed, journal.WRITE_RECOVERED, store), 20, "the store was not made")
    rows = wait_until(lambda: used(bed, "closedwhilefull"), 15, "the record was not read back from the journal")
    assert [r["pid"] for r in rows] == [v.pid]
    assert stored(bed, disk, v.pid) == 1


# The store's writer in a process of its own in the daemon's mount namespace, on the tmpfs, its retry and queue
# bound made small: 20 samples of 10 records each while the disk is full.
HELD = """
import logging, os, sqlite3, sys, time
from gpukill.records.usage import UsageRecord
from gpukilld.usage import store as st
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
st.RETRY, st.MAX_PENDING = 0.05, 10
disk = sys.argv[1]
s = st.UsageStore(os.path.join(disk, "usage.sqlite"))
s.open()
fd = os.open(os.path.join(disk, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
for chunk in (1 << 16, 4096, 1):
    try:
        while os.write(fd, b"\\0" * chunk):
            pass
    except OSError:
        pass
os.close(fd)
for n in range(20):
    s.add([UsageRecord(pid=n * 10 + i, start_time=1, uid=0, user="root", comm="x", device=0, device_id="GPU-0",
                       first_seen=1000.0, last_seen=2000.0, gpu_seconds=1.0, sm_seconds=None,
                       sm_known_seconds=0.0, memory_byte_seconds=0.0, peak_memory=0, ended="exited")
           for i in range(10)])
    time.sleep(0.05)
print("HELD", len(s._unsaved()), flush=True)
os.unlink(os.path.join(disk, "filler"))
print("FLUSHED", s.flush(10), flush=True)
s.close()
print("STORED", sqlite3.connect(os.path.join(disk, "usage.sqlite")).execute("SELECT count(*) FROM usage").fetchone()[0])
"""


@pytest.mark.usefixtures("users")
@needs_root
def test_the_store_holds_at_most_its_bound_and_says_so_once(fresh_bed):
    bed = fresh_bed
    disk = Disk(bed)
    try:
        r = subprocess.run(
            bed.in_journal_ns([sys.executable, "-c", HELD, str(disk.where)]),
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        )
    finally:
        disk.unmount()
    assert r.returncode == 0, r
    lines = r.stdout.splitlines()
    assert "HELD 10" in lines and "FLUSHED True" in lines and "STORED 10" in lines, r.stdout
    # one line, whether the writer's connection or its first batch met the full disk first
    assert sum("cannot write" in line for line in lines) == 1, r.stdout
    # 190 dropped past the bound, told in one line while the disk is full (and the rest, if any, at close)
    dropped = [int(line.split()[2]) for line in lines if "records dropped" in line]
    assert sum(dropped) == 190 and 1 <= len(dropped) <= 2, r.stdout
    assert any("written again" in line for line in lines), r.stdout
