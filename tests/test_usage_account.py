"""GPU usage accounting without a daemon: the accountant fed synthetic snapshots at known instants,
its state across a simulated restart, the journal entry's form, the keeper's bound on the journal, [usage].

Every figure is exact: utilizations, memory and power are chosen so that the sums are exact in binary."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest
from helpers.waiting import wait_until

from gpukill.errors import ConfigError
from gpukill.records.usage import UsageRecord
from gpukilld import journal
from gpukilld.config import load_config
from gpukilld.model import Device, GpuProcess, Snapshot
from gpukilld.usage import keeper as keeper_mod
from gpukilld.usage import state
from gpukilld.usage.account import MAX_GAP, Accountant, power_shares
from gpukilld.usage.journal_form import fields_of, message_of, record_from_journal
from gpukilld.usage.keeper import UsageKeeper, fold

GiB = 1 << 30
WALL = 1_700_000_000.0  # the wall clock reads WALL + the monotonic one in these snapshots
BOOT = "5e1f0c1e-0000-4000-8000-000000000022"


def device(index: int, power: float | None = 100.0) -> Device:
    return Device(index=index, id=f"GPU-{index}", backend="simulated", vendor="nvidia", name="H100", power=power)


def gp(
    pid: int,
    device_index: int = 0,
    util: float | None = 50.0,
    mem: int | None = 2 * GiB,
    start: int = 7,
    uid: int = 1000,
    user: str = "alice",
    comm: str = "python3",
) -> GpuProcess:
    return GpuProcess(
        pid=pid,
        start_time=start,
        uid=uid,
        user=user,
        comm=comm,
        cmdline=comm,
        exe=None,
        device=device_index,
        device_id=f"GPU-{device_index}",
        gpu_memory=mem,
        gpu_utilization=util,
    )


class Feed:
    """Snapshots as the sampler makes them: the generation moves only when the content does."""

    def __init__(self, devices: tuple[Device, ...] = (device(0), device(1))) -> None:
        self.devices = devices
        self.generation = 0
        self.last: tuple | None = None

    def at(self, t: float, *procs: GpuProcess, devices: tuple[Device, ...] | None = None) -> Snapshot:
        devs = devices or self.devices
        content = (devs, procs)
        if content != self.last:
            self.generation += 1
            self.last = content
        return Snapshot(
            generation=self.generation, taken_at=WALL + t, devices=devs, processes=procs, backends=(), monotonic=t
        )


def dead(pid: int, start: int) -> bool:
    return False


def living(pid: int, start: int) -> bool:
    return True


def run(acc: Accountant, feed: Feed, times, *procs: GpuProcess, alive=dead) -> list[UsageRecord]:
    closed = []
    for t in times:
        closed += acc.observe(feed.at(t, *procs), alive)
    return closed


# -- integration -------------------------------------------------------------------------------------------


def test_totals_of_a_process_at_known_utilization_memory_and_power_are_exact():
    acc, feed = Accountant(BOOT), Feed()
    assert run(acc, feed, range(11), gp(10)) == []  # seen at 0..10 s
    closed = acc.observe(feed.at(11), dead)  # gone at 11 s
    assert len(closed) == 1
    r = closed[0]
    assert (r.pid, r.start_time, r.device, r.device_id, r.uid, r.user, r.comm) == (
        10,
        7,
        0,
        "GPU-0",
        1000,
        "alice",
        "python3",
    )
    assert (r.first_seen, r.last_seen) == (WALL, WALL + 10)  # the last sample that saw it, not the one after
    assert r.gpu_seconds == 10
    assert (r.sm_seconds, r.sm_known_seconds) == (5, 10)  # 50 % for 10 s
    assert r.memory_byte_seconds == 20 * GiB and r.peak_memory == 2 * GiB
    assert (r.energy_joules, r.energy_known_seconds) == (1000, 10)  # alone on a 100 W device
    assert r.ended == "exited" and r.processes == 1
    assert acc.live() == []


def test_an_unchanged_generation_costs_nothing_per_process_and_totals_still_grow():
    class Untouchable(tuple):
        def __iter__(self):
            raise AssertionError("the processes were read although the generation did not move")

    acc, feed = Accountant(BOOT), Feed()
    first = feed.at(0, gp(10))
    acc.observe(first, dead)
    for t in range(1, 21):  # as the sampler hands over an unchanged content: the same generation
        same = replace(
            first,
            taken_at=WALL + t,
            monotonic=float(t),
            processes=Untouchable(first.processes),
            devices=Untouchable(first.devices),
        )
        assert acc.observe(same, dead) == []
    (live,) = acc.live()
    assert (live.gpu_seconds, live.sm_seconds, live.memory_byte_seconds) == (20, 10, 40 * GiB)
    assert live.last_seen == WALL + 20 and live.ended == ""
    # a value that changes makes a new generation: the new rates count from that sample on
    acc.observe(feed.at(21, gp(10, util=100.0, mem=GiB)), dead)
    acc.observe(feed.at(25, gp(10, util=100.0, mem=GiB)), dead)  # same content: O(1) again
    (r,) = acc.observe(feed.at(26), dead)
    assert r.gpu_seconds == 25 and r.last_seen == WALL + 25
    assert r.sm_seconds == 0.5 * 21 + 1.0 * 4  # hold-last: 50 % from 0 to 21 s, then 100 %
    assert r.memory_byte_seconds == 2 * GiB * 21 + GiB * 4 and r.peak_memory == 2 * GiB


def test_a_process_on_two_gpus_is_accounted_on_each_and_leaving_one_is_left():
    acc, feed = Accountant(BOOT), Feed()
    both = (gp(10, 0, util=25.0), gp(10, 1, util=75.0, mem=GiB))
    run(acc, feed, range(5), *both)  # 0..4 s on both
    closed = run(acc, feed, range(5, 9), both[0])  # then on GPU 0 only; the process is dead to /proc too
    assert len(closed) == 1
    assert (closed[0].device, closed[0].ended, closed[0].gpu_seconds) == (1, "left", 4)
    assert closed[0].sm_seconds == 3 and closed[0].memory_byte_seconds == 4 * GiB
    (r,) = acc.observe(feed.at(9), dead)
    assert (r.device, r.ended, r.gpu_seconds, r.sm_seconds) == (0, "exited", 8, 2)


def test_left_when_its_stat_still_matches():
    acc, feed = Accountant(BOOT), Feed()
    run(acc, feed, range(3), gp(10))
    (r,) = acc.observe(feed.at(3), living)
    assert r.ended == "left"


def test_energy_is_shared_by_utilization_else_memory_else_equally():
    devs = (device(0, 300.0),)
    a, b = gp(1, util=20.0, mem=GiB), gp(2, util=40.0, mem=3 * GiB)
    snap = Feed(devs).at(0, a, b)
    assert power_shares(snap) == {(1, 7, "GPU-0"): pytest.approx(100.0), (2, 7, "GPU-0"): pytest.approx(200.0)}
    by_memory = Feed(devs).at(0, replace(a, gpu_utilization=None), b)  # not every one has a utilization
    assert power_shares(by_memory) == {(1, 7, "GPU-0"): 75.0, (2, 7, "GPU-0"): 225.0}
    idle = Feed(devs).at(
        0, replace(a, gpu_utilization=0.0, gpu_memory=None), replace(b, gpu_utilization=0.0, gpu_memory=0)
    )
    assert power_shares(idle) == {(1, 7, "GPU-0"): 150.0, (2, 7, "GPU-0"): 150.0}
    no_power = Feed((device(0, None),)).at(0, a, b)
    assert set(power_shares(no_power).values()) == {None}

    acc, feed = Accountant(BOOT), Feed((device(0, 300.0),))
    run(acc, feed, range(5), gp(1, util=25.0), gp(2, util=75.0))
    r1, r2 = sorted(acc.observe(feed.at(5), dead), key=lambda r: r.pid)
    assert (r1.energy_joules, r2.energy_joules) == (300.0, 900.0)  # 75 W and 225 W for 4 s
    assert r1.energy_joules + r2.energy_joules == 300.0 * 4  # the device's energy, all of it shared


def test_unknown_utilization_and_power_stay_unknown_not_zero():
    acc, feed = Accountant(BOOT), Feed((device(0, None),))
    run(acc, feed, range(4), gp(10, util=None))
    (r,) = acc.observe(feed.at(4), dead)
    assert r.gpu_seconds == 3
    assert (r.sm_seconds, r.sm_known_seconds) == (None, 0)
    assert (r.energy_joules, r.energy_known_seconds) == (None, 0)
    # known for part of the time: the part is said
    acc, feed = Accountant(BOOT), Feed()
    run(acc, feed, range(0, 3), gp(10, util=None))
    run(acc, feed, range(3, 7), gp(10, util=50.0))
    (r,) = acc.observe(feed.at(7), dead)
    assert (r.gpu_seconds, r.sm_seconds, r.sm_known_seconds) == (6, 1.5, 3)


def test_a_process_seen_once_has_no_time_on_the_gpu():
    acc, feed = Accountant(BOOT), Feed()
    acc.observe(feed.at(0, gp(10)), dead)
    (r,) = acc.observe(feed.at(1), dead)
    assert (r.gpu_seconds, r.first_seen, r.last_seen, r.sm_seconds, r.energy_joules) == (0, WALL, WALL, None, None)
    assert r.peak_memory == 2 * GiB


# -- across a restart --------------------------------------------------------------------------------------


def restarted(
    acc: Accountant, alive=living, boot: str = BOOT, now_wall: float = WALL + 1e6
) -> tuple[Accountant, list[UsageRecord]]:
    """A new accountant given the old one's state through JSON, as the file carries it (same boot: the
    monotonic clock reads on; CLOCK_BOOTTIME is it plus 500 s of suspend, for both)."""
    saved = json.loads(json.dumps(acc.dump()))
    new = Accountant(BOOT, offset=lambda: 500.0)
    closed = new.load(saved, boot, alive, now_wall)
    return new, closed


def whole_life(times, procs_at) -> list[UsageRecord]:
    acc, feed = Accountant(BOOT, offset=lambda: 500.0), Feed()
    out = []
    for t in times:
        out += acc.observe(feed.at(t, *procs_at(t)), dead)
    return out


def test_a_restart_in_the_middle_loses_and_doubles_nothing():
    def procs_at(t):
        return (gp(10, 0, util=50.0), gp(10, 1, util=25.0, mem=GiB)) if t < 20 else ()

    # uninterrupted: seen at 0..19 s, gone at 20 s
    expected = sorted(whole_life(range(21), procs_at), key=lambda r: r.device)
    # the same, with the daemon down from 10.5 s to 12 s (the samples at 11 s are never taken)
    acc, feed = Accountant(BOOT, offset=lambda: 500.0), Feed()
    for t in range(11):
        assert acc.observe(feed.at(t, *procs_at(t)), dead) == []
    new, closed = restarted(acc)
    assert closed == [] and new.load_note is None and len(new) == 2
    assert sorted(r.gpu_seconds for r in new.live()) == [10, 10]  # the saved totals, before any sample
    feed2 = Feed()
    out = []
    for t in range(12, 21):
        out += new.observe(feed2.at(t, *procs_at(t)), dead)
    assert sorted(out, key=lambda r: r.device) == expected
    assert [r.gpu_seconds for r in expected] == [19, 19]


def test_a_save_while_the_generation_stood_still_holds_the_partial_totals():
    acc, feed = Accountant(BOOT, offset=lambda: 500.0), Feed()
    run(acc, feed, range(0, 30, 3), gp(10, util=50.0))  # one generation from 0 to 27 s
    new, _ = restarted(acc)
    (live,) = new.live()
    assert (live.gpu_seconds, live.sm_seconds, live.last_seen) == (27, 13.5, WALL + 27)
    feed2 = Feed()
    new.observe(feed2.at(30, gp(10, util=50.0)), dead)
    (r,) = new.observe(feed2.at(31), dead)
    assert (r.gpu_seconds, r.sm_seconds, r.first_seen, r.last_seen) == (30, 15, WALL, WALL + 30)


def test_a_gap_longer_than_max_gap_is_not_counted():
    acc, feed = Accountant(BOOT, offset=lambda: 500.0), Feed()
    run(acc, feed, range(5), gp(10))
    new, _ = restarted(acc)
    late = 4 + MAX_GAP + 1
    feed2 = Feed()
    new.observe(feed2.at(late, gp(10)), dead)
    new.observe(feed2.at(late + 2, gp(10)), dead)
    (r,) = new.observe(feed2.at(late + 3), dead)
    assert r.gpu_seconds == 4 + 2  # before the restart, and after it; the unknown gap is not counted
    assert r.last_seen - r.first_seen == late + 2


def test_a_restored_record_its_first_snapshot_does_not_list_closes_at_the_saved_instant():
    acc, feed = Accountant(BOOT, offset=lambda: 500.0), Feed()
    run(acc, feed, range(6), gp(10))
    new, _ = restarted(acc)
    (r,) = new.observe(Feed().at(8), living)
    assert (r.gpu_seconds, r.last_seen, r.ended) == (5, WALL + 5, "left")
    new, _ = restarted(acc)
    (r,) = new.observe(Feed().at(8), dead)
    assert r.ended == "daemon-down"


def test_state_of_another_boot_or_of_processes_gone_is_closed_as_daemon_down():
    acc, feed = Accountant(BOOT, offset=lambda: 500.0), Feed()
    run(acc, feed, range(8), gp(10), gp(11, util=None))
    new, closed = restarted(acc, boot="another-boot")
    assert len(new) == 0 and "another boot" in new.load_note
    assert sorted((r.pid, r.ended, r.gpu_seconds, r.last_seen) for r in closed) == [
        (10, "daemon-down", 7, WALL + 7),
        (11, "daemon-down", 7, WALL + 7),
    ]
    assert next(r for r in closed if r.pid == 11).sm_seconds is None
    new, closed = restarted(acc, alive=lambda pid, start: pid == 11)
    assert [r.pid for r in closed] == [10] and [r.pid for r in new.live()] == [11]
    assert "gone" in new.load_note


def test_a_malformed_state_drops_its_bad_entries_with_one_line_and_keeps_the_rest():
    acc, feed = Accountant(BOOT, offset=lambda: 500.0), Feed()
    run(acc, feed, range(3), gp(10))
    data = json.loads(json.dumps(acc.dump()))
    good = data["records"][0]
    bad = [
        dict(good, pid=-1),
        dict(good, gpu_seconds=float("nan")),
        dict(good, user="x" * 5000),
        dict(good, memory_rate="lots"),
        dict(good, device_id=""),
        dict(good, last_seen=good["first_seen"] - 1),
        {k: v for k, v in good.items() if k != "at"},
        "not an entry",
        dict(good, sm_rate=7.0),
        dict(good, pid=11, at=good["at"] + 1e6),
    ]  # an instant in the future
    data["records"] = [*bad, good]
    new = Accountant(BOOT, offset=lambda: 500.0)
    assert new.load(json.loads(json.dumps(data)), BOOT, living, WALL + 1e6) == []
    assert [r.pid for r in new.live()] == [10]
    assert "10 malformed or excess entries dropped" in new.load_note and "\n" not in new.load_note
    for junk in (None, [], {"format": 99, "records": []}, {"format": 1, "records": "x"}, "text"):
        new = Accountant(BOOT)
        assert new.load(junk, BOOT, living, WALL) == [] and len(new) == 0
        assert "not in a format" in new.load_note


def test_a_save_encodes_only_the_records_whose_values_changed(monkeypatch):
    calls = []
    encode = state.encode_records
    monkeypatch.setattr(state, "encode_records", lambda entry: calls.append(entry["pid"]) or encode(entry))
    acc, feed = Accountant(BOOT, offset=lambda: 500.0), Feed()
    # on two GPUs (a process's power share moves with its neighbours'); the sampler hands on the same record
    # while nothing of it changes
    ten, eleven = gp(10), gp(11, device_index=1)
    acc.observe(feed.at(0, ten, eleven), dead)
    first = json.loads(acc.dump_json())
    for t in range(1, 6):  # the same generation: nothing encoded again
        acc.observe(feed.at(t, ten, eleven), dead)
        last = json.loads(acc.dump_json())
    assert sorted(calls) == [10, 11] and last["records"] == first["records"] and last["until"] == 5
    new = Accountant(BOOT, offset=lambda: 500.0)
    new.load(last, BOOT, living, WALL + 100)
    assert [(r.gpu_seconds, r.last_seen) for r in new.live()] == [(5, WALL + 5)] * 2
    acc.observe(feed.at(6, gp(10, util=10.0), eleven), dead)  # a new generation: only PID 10 changed
    assert json.loads(acc.dump_json())["records"] == json.loads(json.dumps(acc.dump()))["records"]
    assert sorted(calls) == [10, 10, 11]
    (r11,) = [r for r in acc.live() if r.pid == 11]
    assert (r11.gpu_seconds, r11.sm_seconds, r11.last_seen) == (6, 3, WALL + 6)  # its segment went on


def test_the_state_file_is_written_atomically_0600_and_a_broken_one_is_kept_aside(tmp_path):
    acc, feed = Accountant(BOOT), Feed()
    run(acc, feed, range(3), gp(10))
    state.write_state(str(tmp_path), acc.dump())
    path = tmp_path / state.STATE_FILE
    assert (path.stat().st_mode & 0o777) == 0o600
    data, note = state.read_state(str(tmp_path))
    assert note is None and data["boot_id"] == BOOT and len(data["records"]) == 1
    path.write_text("{not json")
    data, note = state.read_state(str(tmp_path))
    assert data is None and "cannot be read" in note and (tmp_path / "usage-state.json.broken").exists()
    assert state.read_state(str(tmp_path)) == (None, None)  # moved aside: a fresh start


# -- the journal entry ------------------------------------------------------------------------------------


RECORD = UsageRecord(
    pid=4242,
    start_time=123456,
    uid=1000,
    user="alice",
    comm="python3",
    unit="job.service",
    slurm_job="77",
    device=0,
    device_id="GPU-0",
    first_seen=WALL,
    last_seen=WALL + 3720,
    gpu_seconds=3720.0,
    sm_seconds=2280.0,
    sm_known_seconds=3720.0,
    memory_byte_seconds=6.1 * GiB * 3600,
    peak_memory=4 * GiB,
    energy_joules=212_000.0,
    energy_known_seconds=3720.0,
    ended="exited",
    job_from_environ=True,
)


def as_journal(rec: UsageRecord) -> dict[str, str]:
    """The entry as `journalctl -o json` gives it back: GPUKILL_-prefixed strings."""
    return {journal.field_name(k): str(v) for k, v in fields_of(rec).items() if v is not None} | {
        "MESSAGE_ID": journal.USAGE.message_id,
        "_UID": "0",
    }


def test_the_message_reads_like_systemds_consumed_line():
    assert message_of(RECORD) == (
        "PID 4242 (python3, user alice) on GPU 0: consumed 1h 2min GPU time (38min at "
        "full SM), 6.1 GiB·h memory, peak 4.0 GiB, 212 kJ."
    )
    unknown = replace(RECORD, comm="a\x1b[31mb", sm_seconds=None, sm_known_seconds=0, energy_joules=None)
    assert message_of(unknown) == (
        "PID 4242 (a\\x1b[31mb, user alice) on GPU 0: consumed 1h 2min GPU time, 6.1 GiB·h memory, peak 4.0 GiB."
    )
    assert message_of(replace(RECORD, pid=0, start_time=0, comm="", processes=40)).startswith(
        "40 processes of user alice on GPU 0: consumed"
    )


def test_fields_read_back_as_the_same_record():
    entry = as_journal(RECORD)
    assert entry["GPUKILL_SM_SECONDS"] == "2280.000" and entry["GPUKILL_JOB_FROM_ENVIRON"] == "1"
    assert record_from_journal(entry) == RECORD
    bare = replace(RECORD, unit=None, slurm_job=None, sm_seconds=None, energy_joules=None, job_from_environ=False)
    entry = as_journal(bare)
    assert "GPUKILL_SM_SECONDS" not in entry and "GPUKILL_JOB_FROM_ENVIRON" not in entry
    assert record_from_journal(entry) == bare


@pytest.mark.parametrize(
    "change",
    [
        {"GPUKILL_GPU_SECONDS": "-1"},
        {"GPUKILL_GPU_SECONDS": "nan"},
        {"GPUKILL_MEMORY_BYTE_SECONDS": "inf"},
        {"GPUKILL_TARGET_PID": "12x"},
        {"GPUKILL_TARGET_PID": str(1 << 32)},
        {"GPUKILL_TARGET_USER": "u" * 4097},
        {"GPUKILL_ENDED": "vanished"},
        {"GPUKILL_ENDED": ""},
        {"GPUKILL_TARGET_UID": ["1", "2"]},
        {"GPUKILL_DEVICE": [104, 105]},
        {"GPUKILL_LAST_SEEN": str(WALL - 1)},
        {"GPUKILL_PROCESSES": "0"},
        {"GPUKILL_JOB_FROM_ENVIRON": "yes"},
        {"_UID": "1000"},
        {"MESSAGE_ID": "0" * 32},
        {"GPUKILL_ENERGY_JOULES": "1e999"},
        {"GPUKILL_TARGET_PID": "²"},
    ],
)
def test_a_malformed_entry_is_not_read(change):
    assert record_from_journal(as_journal(RECORD) | change) is None


@pytest.mark.parametrize(
    "missing",
    [
        "GPUKILL_TARGET_PID",
        "GPUKILL_DEVICE",
        "GPUKILL_FIRST_SEEN",
        "GPUKILL_ENDED",
        "GPUKILL_GPU_SECONDS",
        "GPUKILL_PEAK_MEMORY",
    ],
)
def test_an_entry_missing_a_field_is_not_read(missing):
    entry = as_journal(RECORD)
    del entry[missing]
    assert record_from_journal(entry) is None


# -- the keeper ---------------------------------------------------------------------------------------------


class FakeAudit:
    def __init__(self) -> None:
        self.entries: list[tuple[str, dict]] = []

    def log(self, kind, message, **fields) -> None:
        assert kind is journal.USAGE
        self.entries.append((message, fields))


class FakeStore:
    def __init__(self, exists: bool = True) -> None:
        self.exists = exists
        self.added: list[UsageRecord] = []
        self.rebuilt: list[UsageRecord] = []
        self.pruned: list[int] = []
        self.closed = False
        self.rebuilding = False

    def open(self) -> bool:
        return self.exists

    def add(self, records) -> None:
        self.added.extend(records)

    def rebuild(self, records) -> int:
        self.rebuilt.extend(records)
        return len(self.rebuilt)

    def prune(self, keep_days) -> None:
        self.pruned.append(keep_days)

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def keeper(tmp_path, store=None, alive=dead, clock=None, entries=lambda: iter(())) -> UsageKeeper:
    k = UsageKeeper(
        FakeAudit(),
        store or FakeStore(),
        str(tmp_path),
        alive=alive,
        boot=BOOT,
        entries=entries,
        clock=clock or Clock(),
    )
    k.start()
    return k


def saved_pids(tmp_path) -> list[int]:
    data, _ = state.read_state(str(tmp_path))
    return [r["pid"] for r in data["records"]]


def test_the_keeper_writes_a_closed_record_once_the_state_no_longer_holds_it(tmp_path):
    k = keeper(tmp_path)
    feed = Feed()
    for t in range(5):
        k.on_snapshot(feed.at(t, gp(10), gp(11)))
    assert saved_pids(tmp_path) == []  # saved at start; the next save is due in SAVE_EVERY
    k.on_snapshot(feed.at(5, gp(11)))  # 10 ends
    assert [f["TARGET_PID"] for _, f in k.audit.entries] == [10]
    assert saved_pids(tmp_path) == [11]
    message, fields = k.audit.entries[0]
    assert message.startswith("PID 10 (python3, user alice) on GPU 0: consumed 4s GPU time (2s at full SM)")
    assert fields["ENDED"] == "exited" and fields["GPU_SECONDS"] == "4.000"
    assert [r.pid for r in k.store.added] == [10]
    assert [r.pid for r in k.live()] == [11]
    k.on_snapshot(feed.at(35, gp(11)))  # SAVE_EVERY later: saved again while a record is open
    again = Accountant(BOOT)
    again.load(json.loads((tmp_path / state.STATE_FILE).read_text()), BOOT, living, WALL + 100)
    assert [(r.pid, round(r.gpu_seconds, 3), r.last_seen) for r in again.live()] == [(11, 35, WALL + 35)]
    k.stop()
    assert k.store.closed and saved_pids(tmp_path) == [11]


def test_the_keeper_carries_totals_across_a_restart_and_writes_each_record_once(tmp_path):
    store = FakeStore()
    k = keeper(tmp_path, store, alive=living)
    feed = Feed()
    for t in range(10):
        k.on_snapshot(feed.at(t, gp(10)))
    k.stop()
    assert k.audit.entries == []
    k2 = keeper(tmp_path, store, alive=living)
    feed2 = Feed()
    for t in range(11, 16):
        k2.on_snapshot(feed2.at(t, gp(10)))
    k2.on_snapshot(feed2.at(16))
    k2.stop()
    (rec,) = store.added
    # (the keeper's clocks are the real ones: CLOCK_BOOTTIME and CLOCK_MONOTONIC are read a few µs apart)
    assert (rec.gpu_seconds, rec.sm_seconds) == (pytest.approx(15, abs=1e-3), pytest.approx(7.5, abs=1e-3))
    assert (rec.first_seen, rec.last_seen) == (WALL, WALL + 15)
    assert len(k2.audit.entries) == 1
    k3 = keeper(tmp_path, store, alive=dead)  # nothing open any more: nothing more is written
    k3.stop()
    assert k3.audit.entries == [] and len(store.added) == 1


def test_the_keeper_closes_another_boots_records_as_daemon_down(tmp_path):
    acc = Accountant("an-older-boot")
    run(acc, Feed(), range(4), gp(10))
    state.write_state(str(tmp_path), acc.dump())
    k = keeper(tmp_path)
    assert [(f["TARGET_PID"], f["ENDED"]) for _, f in k.audit.entries] == [(10, "daemon-down")]
    assert saved_pids(tmp_path) == []


def test_the_keeper_starts_whatever_the_state_file_holds(tmp_path):
    for junk in ("{", "[]", json.dumps({"format": 1, "boot_id": BOOT, "records": [{"pid": "x"}] * 3}), "\0" * 10):
        (tmp_path / state.STATE_FILE).write_text(junk)
        k = keeper(tmp_path)
        assert k.audit.entries == [] and k.live() == []
        k.on_snapshot(Feed().at(0, gp(10)))
        assert len(k.live()) == 1


def test_a_missing_store_is_rebuilt_from_the_journal_in_a_thread(tmp_path):
    store = FakeStore(exists=False)
    k = keeper(tmp_path, store, entries=lambda: iter([RECORD]))
    wait_until(lambda: store.rebuilt, 30, "the store was never rebuilt", interval=0.05)
    assert store.rebuilt == [RECORD]
    k.stop()


def test_the_store_is_pruned_once_a_day(tmp_path):
    clock = Clock()
    store = FakeStore()
    k = keeper(tmp_path, store, clock=clock)
    k.keep_days = 30
    feed = Feed()
    k.on_snapshot(feed.at(keeper_mod.FIRST_PRUNE + 1))
    k.on_snapshot(feed.at(keeper_mod.FIRST_PRUNE + 2))
    k.on_snapshot(feed.at(keeper_mod.FIRST_PRUNE + keeper_mod.PRUNE_EVERY + 2))
    wait_until(lambda: len(store.pruned) == 2, 30, lambda: f"pruned {store.pruned}", interval=0.05)
    assert store.pruned == [30, 30]


def test_a_flood_of_short_processes_is_folded_past_the_journals_share(tmp_path):
    k = keeper(tmp_path)
    feed = Feed()
    n = keeper_mod.BURST + 500
    short = [gp(1000 + i, uid=1000 + i % 2, user=f"u{i % 2}") for i in range(n)]
    k.on_snapshot(feed.at(0, *short))
    k.on_snapshot(feed.at(2, *short))
    k.on_snapshot(feed.at(4))  # all end within one second
    assert len(k.audit.entries) == keeper_mod.BURST  # the burst, one entry each
    assert len(k.store.added) == n  # the store has every one
    k.on_snapshot(feed.at(4 + keeper_mod.FOLD_WINDOW + 1))  # the minute is over: one record per user and GPU
    folded = k.audit.entries[keeper_mod.BURST :]
    assert sorted((f["TARGET_PID"], f["TARGET_UID"], f["PROCESSES"]) for _, f in folded) == [
        (0, 1000, 250),
        (0, 1001, 250),
    ]
    assert all(f["GPU_SECONDS"] == "500.000" and f["TARGET_COMM"] == "" for _, f in folded)
    assert folded[0][0].startswith("250 processes of user u")
    # the share refills at RATE a minute: 10 a second
    more = [gp(9000 + i, start=8) for i in range(30)]
    t = 4 + keeper_mod.FOLD_WINDOW + 2
    k.on_snapshot(feed.at(t, *more))
    k.on_snapshot(feed.at(t + 2))
    assert len(k.audit.entries) == keeper_mod.BURST + 2 + 30


def test_fold_sums_and_keeps_only_shared_labels():
    a = replace(RECORD, pid=1, unit="a.service")
    b = replace(RECORD, pid=2, first_seen=WALL - 5, last_seen=WALL + 9000, sm_seconds=None, peak_memory=8 * GiB)
    f = fold([a, b])
    assert (f.pid, f.start_time, f.comm, f.processes, f.unit, f.slurm_job) == (0, 0, "", 2, None, "77")
    assert (f.first_seen, f.last_seen, f.gpu_seconds, f.sm_seconds, f.peak_memory) == (
        WALL - 5,
        WALL + 9000,
        7440,
        2280,
        8 * GiB,
    )


# -- [usage] in gpukilld.conf ---------------------------------------------------------------------------------


def test_usage_section_defaults_and_values(tmp_path):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text("[daemon]\n")
    c = load_config(str(conf))
    assert (c.usage_enabled, c.usage_keep_days) == (True, 400)
    conf.write_text("[usage]\nenabled = no\nkeep_days = 30\n")
    c = load_config(str(conf))
    assert (c.usage_enabled, c.usage_keep_days) == (False, 30)


@pytest.mark.parametrize(
    "text, says",
    [
        ("[usage]\nenabled = maybe\n", ":2: enabled must be yes or no"),
        ("[usage]\n\nkeep_days = 0\n", ":3: keep_days must be a whole number of days between 1 and 36500"),
        ("[usage]\nkeep_days = 1.5\n", ":2: keep_days must be"),
        ("[usage]\nkeep_days = " + "9" * 5000 + "\n", ":2: keep_days must be"),
        ("[usage]\nkeep = 3\n", ":2: unknown key 'keep' in [usage]"),
    ],
)
def test_usage_section_errors_say_what_and_where(tmp_path, text, says):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(conf))
    assert says in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith(str(conf))


def test_state_file_mode_survives_umask(tmp_path):
    old = os.umask(0)
    try:
        state.write_state(str(tmp_path), Accountant(BOOT).dump())
    finally:
        os.umask(old)
    assert ((tmp_path / state.STATE_FILE).stat().st_mode & 0o777) == 0o600


def test_a_record_reads_back_from_its_journal_entry_with_the_same_store_key():
    acc = Accountant(BOOT)
    closed = []
    for i, wall in enumerate([WALL + 0.1234567, WALL + 1.9876543, WALL + 3.5]):
        closed += acc.observe(
            Snapshot(
                generation=i + 1,
                taken_at=wall,
                devices=(device(0),),
                processes=(gp(10),) if i < 2 else (),
                backends=(),
                monotonic=float(i),
            ),
            dead,
        )
    (rec,) = closed
    back = record_from_journal(as_journal(rec))
    assert (back.first_seen, back.last_seen) == (rec.first_seen, rec.last_seen) == (WALL + 0.123, WALL + 1.988)


def test_a_zombie_has_exited_not_left():
    """A backend following processes by pidfd drops one as it dies, before its parent reaps it: the record then
    closes as "exited", though /proc still shows the zombie with the same start time."""
    import subprocess

    from gpukill.procstat import read_stat
    from gpukilld.usage.keeper import still_running

    running = still_running()
    me = read_stat(os.getpid())
    assert me is not None and running(os.getpid(), me.start_time)
    child = subprocess.Popen(["sleep", "0"])
    start = read_stat(child.pid).start_time
    deadline = time.monotonic() + 10
    while read_stat(child.pid).state != "Z":  # exited, not reaped yet: Popen reaps only when asked
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not running(child.pid, start)
    assert not running(os.getpid(), me.start_time + 1)  # another start time: the PID was reused
    child.wait()
    assert not running(child.pid, start)


def test_gpu_time_stops_while_a_process_is_suspended_and_counts_again_after_its_resume(tmp_path):
    """A suspended process leaves the GPU's lists (its memory is in host memory) and runs on, stopped: its record
    closes as "left" at the last sample that saw it, and the resume opens a new one at the first sample that sees
    it again. The time between counts in neither; the two add up, once, to the time it held the GPU, in the
    journal and in what GetUsage sums (the store and the open records together)."""
    from gpukilld.access.visibility import FULL, Viewer
    from gpukilld.usage.query import UsageQuery
    from gpukilld.usage.store import UsageStore

    k = keeper(tmp_path, alive=living)
    feed = Feed()
    for t in range(11):  # on GPU 0 from 0 s to 10 s
        k.on_snapshot(feed.at(t, gp(10)))
    for t in range(11, 111):  # suspended for 100 s: off the lists, alive (frozen)
        k.on_snapshot(feed.at(t))
    (paused,) = k.store.added
    assert (paused.ended, paused.gpu_seconds, paused.last_seen) == ("left", 10, WALL + 10)
    assert paused.memory_byte_seconds == 10 * 2 * GiB and paused.sm_seconds == 5
    assert k.live() == []  # nothing runs up while it is suspended
    for t in range(111, 121):  # resumed: the same process (PID and start time) listed again, 111 s to 120 s
        k.on_snapshot(feed.at(t, gp(10)))
    (running,) = k.live()
    assert (running.first_seen, running.gpu_seconds, running.ended) == (WALL + 111, 9, "")

    store = UsageStore(str(tmp_path / "store" / "usage.sqlite"))
    store.open()
    try:
        store.add(list(k.store.added))
        assert store.flush()

        def gpu_seconds(live: list[UsageRecord]) -> float:
            (row,) = store.query(UsageQuery(since=WALL, until=WALL + 1000), Viewer(0, FULL), live).rows
            return row.gpu_seconds

        assert gpu_seconds(k.live()) == 10 + 9  # the stored half and the running half, each once
        k.on_snapshot(feed.at(121))  # suspended again (or ended): the second record closes too
        store.add(k.store.added[1:])
        assert store.flush()
        assert [(r.first_seen, r.gpu_seconds) for r in k.store.added] == [(WALL, 10), (WALL + 111, 9)]
        assert gpu_seconds(k.live()) == 19 and k.live() == []
    finally:
        store.close()
    assert [f["GPU_SECONDS"] for _, f in k.audit.entries] == ["10.000", "9.000"]  # journaled once each
    k.stop()
