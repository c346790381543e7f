"""The usage store and GetUsage's query (gpukilld/usage/store.py, query.py, journal_read.py), in-process on real
SQLite files: the range's proration, every grouping, the filters, what each kind of viewer sees of its own and
others' records, limit and rows_total, the live records' merge, the rebuild, a corrupt file, the bounds."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading

import pytest
from dbus_fast import Variant

from gpukill.errors import InvalidArgs, NotSupported
from gpukill.records.usage import UsageRecord
from gpukilld import journal
from gpukilld.access.visibility import ANONYMOUS, FULL, HIDDEN, PROGRAM, Viewer
from gpukilld.usage import journal_read
from gpukilld.usage.journal_form import fields_of
from gpukilld.usage.query import MAX_LIMIT, UsageQuery, parse_query
from gpukilld.usage.store import UsageStore
from gpukilld.usage.store import _row as store_row

ALICE, BOB = 2001, 2002
ROOT_VIEW = Viewer(0, FULL)
GiB = 1 << 30


def rec(
    pid: int = 100, uid: int = ALICE, first: float = 1000.0, last: float = 2000.0, device: int = 0, **kw
) -> UsageRecord:
    span = last - first
    values = dict(
        pid=pid,
        start_time=pid * 10,
        uid=uid,
        user={ALICE: "alice", BOB: "bob"}.get(uid, f"u{uid}"),
        comm="python3",
        device=device,
        device_id=f"GPU-{device:04d}",
        first_seen=first,
        last_seen=last,
        gpu_seconds=span,
        sm_seconds=span / 2,
        sm_known_seconds=span,
        memory_byte_seconds=span * GiB,
        peak_memory=GiB,
        ended="exited",
    )
    values.update(kw)
    return UsageRecord(**values)


@pytest.fixture
def store(tmp_path):
    s = UsageStore(str(tmp_path / "state" / "usage.sqlite"))
    assert s.open() is False  # new: a rebuild is due
    yield s
    s.close()


def put(store: UsageStore, *records: UsageRecord) -> None:
    store.add(list(records))
    assert store.flush()


def ask(store: UsageStore, viewer: Viewer = ROOT_VIEW, live=(), **kw):
    kw.setdefault("since", 0.0)
    kw.setdefault("until", 10_000.0)
    return store.query(UsageQuery(**kw), viewer, list(live))


def by_key(report) -> dict:
    return {(r.key, r.hidden): r for r in report.rows}


# -- the range ------------------------------------------------------------------------------------------------


def test_a_record_counts_for_the_part_of_its_life_in_the_range(store):
    put(store, rec(first=1000, last=2000, energy_joules=400.0, energy_known_seconds=1000.0))
    row = ask(store, since=1500, until=5000).rows[0]
    assert row.gpu_seconds == pytest.approx(500)
    assert row.sm_seconds == pytest.approx(250) and row.sm_known_seconds == pytest.approx(500)
    assert row.memory_byte_seconds == pytest.approx(500 * GiB)
    assert row.energy_joules == pytest.approx(200) and row.energy_known_seconds == pytest.approx(500)
    assert row.peak_memory == GiB  # not prorated
    assert (row.first_seen, row.last_seen) == (1500, 2000)  # within the range
    inner = ask(store, since=1250, until=1500).rows[0]
    assert inner.gpu_seconds == pytest.approx(250) and (inner.first_seen, inner.last_seen) == (1250, 1500)


def test_a_record_touching_the_range_or_outside_it_is_not_counted(store):
    put(store, rec(first=1000, last=2000))
    assert ask(store, since=2000, until=3000).rows == ()
    assert ask(store, since=0, until=1000).rows == ()
    assert ask(store, since=2500, until=3000).rows_total == 0


def test_a_record_sampled_once_counts_whole_when_in_the_range(store):
    put(store, rec(first=1500, last=1500, gpu_seconds=0.0, memory_byte_seconds=0.0, peak_memory=5))
    assert ask(store, since=1000, until=2000).rows[0].peak_memory == 5
    assert ask(store, since=1500, until=2000).rows[0].processes == 1
    assert ask(store, since=1600, until=2000).rows == ()


def test_unknown_stays_unknown_and_known_parts_add_up(store):
    put(
        store,
        rec(pid=1, sm_seconds=None, sm_known_seconds=0.0),
        rec(pid=2, uid=BOB, first=1000, last=1100, sm_seconds=None, sm_known_seconds=0.0),
    )
    rows = by_key(ask(store))
    assert rows[("alice", False)].sm_seconds is None and rows[("alice", False)].energy_joules is None
    put(store, rec(pid=3, first=1000, last=1100, sm_seconds=10.0, sm_known_seconds=100.0))
    alice = by_key(ask(store))[("alice", False)]
    assert alice.sm_seconds == pytest.approx(10) and alice.sm_known_seconds == pytest.approx(100)
    assert alice.gpu_seconds == pytest.approx(1100)


# -- grouping -------------------------------------------------------------------------------------------------


def sample_set() -> list[UsageRecord]:
    return [
        rec(pid=1, uid=ALICE, device=0, unit="train.service", slurm_job="77", pod_uid="pod-a", comm="trainer"),
        rec(
            pid=1,
            uid=ALICE,
            device=1,
            unit="train.service",
            slurm_job="77",
            pod_uid="pod-a",
            comm="trainer",
            first=1000,
            last=1500,
        ),  # the same process on a second GPU
        rec(
            pid=2,
            uid=BOB,
            device=1,
            unit="bob.scope",
            slurm_job="88",
            comm="notebook",
            first=1000,
            last=1200,
            job_from_environ=True,
        ),
        rec(pid=3, uid=BOB, device=0, comm="bench", first=1000, last=1100),  # no unit, job or pod
    ]


@pytest.mark.parametrize(
    ("by", "expected"),
    [
        ("user", {"alice": (1500, 1), "bob": (300, 2)}),
        ("unit", {"train.service": (1500, 1), "bob.scope": (200, 1), "": (100, 1)}),
        ("job", {"77": (1500, 1), "88": (200, 1), "": (100, 1)}),
        ("pod", {"pod-a": (1500, 1), "": (300, 2)}),
        ("gpu", {"0": (1100, 2), "1": (700, 2)}),
        ("process", {"1:10": (1500, 1), "2:20": (200, 1), "3:30": (100, 1)}),
    ],
)
def test_rows_are_grouped_by_each_key(store, by, expected):
    put(store, *sample_set())
    report = ask(store, by=by)
    assert report.by == by and report.rows_total == len(expected)
    got = {r.key: (round(r.gpu_seconds), r.processes) for r in report.rows}
    assert got == expected
    assert [r.gpu_seconds for r in report.rows] == sorted((r.gpu_seconds for r in report.rows), reverse=True)
    first = report.rows[0]
    if by in ("user", "process"):
        assert (first.uid, first.user) == (ALICE, "alice")
    if by == "process":
        assert (first.pid, first.start_time, first.comm) == (1, 10, "trainer")
    if by == "gpu":
        assert (first.device, first.device_id) == (0, "GPU-0000")
    if by in ("unit", "job", "pod"):
        assert first.uid is None and first.pid is None


def test_limit_keeps_the_largest_and_rows_total_counts_all(store):
    put(store, *(rec(pid=p, uid=3000 + p, first=1000, last=1000 + 10 * p) for p in range(1, 21)))
    report = ask(store, limit=5)
    assert report.rows_total == 20 and [r.uid for r in report.rows] == [3020, 3019, 3018, 3017, 3016]


# -- filters --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filters", "keys"),
    [
        ({"user": "bob"}, {"2:20", "3:30"}),
        ({"user": str(BOB)}, {"2:20", "3:30"}),
        ({"user": ALICE}, {"1:10"}),
        ({"name": "note"}, {"2:20"}),
        ({"unit": "train.service"}, {"1:10"}),
        ({"job": "88"}, {"2:20"}),
        ({"pod": "pod-a"}, {"1:10"}),
        ({"device": 1}, {"1:10", "2:20"}),
        ({"device": "gpu-0000"}, {"1:10", "3:30"}),  # a UUID in any case
        ({"device": "0"}, {"1:10", "3:30"}),
        ({"user": "bob", "device": 0}, {"3:30"}),
        ({"unit": "nothing.service"}, set()),
    ],
)
def test_filters_select_records(store, filters, keys):
    put(store, *sample_set())
    assert {r.key for r in ask(store, by="process", **filters).rows} == keys


# -- visibility -----------------------------------------------------------------------------------------------


def test_a_full_viewer_sees_everything(store):
    put(store, *sample_set())
    rows = by_key(ask(store, Viewer(ALICE, FULL), by="job"))
    assert set(rows) == {("77", False), ("88", False), ("", False)}


def test_everyone_sees_their_own_records_in_full(store):
    put(store, *sample_set())
    for others in (PROGRAM, ANONYMOUS, HIDDEN):
        rows = by_key(ask(store, Viewer(BOB, others), by="job"))
        assert ("88", False) in rows, others  # bob's own job from his environment
        assert ask(store, Viewer(BOB, others), by="process", name="note").rows[0].comm == "notebook"


def test_program_viewers_see_others_but_a_job_read_from_the_environment(store):
    put(store, *sample_set())
    alice = Viewer(ALICE, PROGRAM)
    rows = by_key(ask(store, alice, by="job"))
    assert set(rows) == {("77", False), ("", True), ("", False)}  # bob's 88 hidden, his job-less record not
    assert rows[("", True)].gpu_seconds == pytest.approx(200)
    assert ask(store, alice, job="88").rows == ()  # a filter matches only what the viewer sees
    units = by_key(ask(store, alice, by="unit"))
    assert ("bob.scope", False) in units  # units are shown to others, as /proc shows them
    assert {r.comm for r in ask(store, alice, by="process").rows} == {"trainer", "notebook", "bench"}


def test_anonymous_viewers_see_others_uid_and_gpu_facts_only(store):
    put(store, *sample_set())
    alice = Viewer(ALICE, ANONYMOUS)
    users = by_key(ask(store, alice))
    assert users[("bob", False)].gpu_seconds == pytest.approx(300)  # uid, user, totals
    for by, own in (("unit", "train.service"), ("job", "77"), ("pod", "pod-a")):
        rows = by_key(ask(store, alice, by=by))
        assert set(rows) == {(own, False), ("", True)}, by
        assert rows[("", True)].gpu_seconds == pytest.approx(300) and rows[("", True)].processes == 2
    processes = {r.key: r for r in ask(store, alice, by="process").rows}
    assert processes["2:20"].comm == "" and processes["1:10"].comm == "trainer"
    assert ask(store, alice, name="note").rows == () and ask(store, alice, unit="bob.scope").rows == ()
    assert ask(store, alice, by="gpu").rows_total == 2


def test_hidden_viewers_count_only_their_own(store):
    put(store, *sample_set())
    report = ask(store, Viewer(BOB, HIDDEN), by="gpu")
    assert {r.key: round(r.gpu_seconds) for r in report.rows} == {"0": 100, "1": 200}
    assert ask(store, Viewer(BOB, HIDDEN), user="alice").rows == ()


# -- live records ---------------------------------------------------------------------------------------------


def test_live_records_are_merged_and_a_process_counted_once(store):
    put(store, rec(pid=1, device=0, first=1000, last=2000))
    live = [
        rec(pid=1, device=1, first=1500, last=3000, ended=""),  # the same process, now on GPU 1
        rec(pid=9, uid=BOB, first=2500, last=3000, ended=""),
    ]
    rows = by_key(ask(store, live=live))
    assert rows[("alice", False)].gpu_seconds == pytest.approx(2500)
    assert (rows[("alice", False)].processes, rows[("alice", False)].live) == (1, 1)
    assert (rows[("bob", False)].processes, rows[("bob", False)].live) == (1, 1)
    # live records are filtered per viewer too
    assert set(by_key(ask(store, Viewer(ALICE, HIDDEN), live=live))) == {("alice", False)}
    assert ask(store, live=live, since=3500, until=4000).rows == ()


@pytest.mark.parametrize("by", ["user", "process"])  # by user: the daily totals' statement; by process: the other
def test_a_record_closed_counts_before_it_is_committed_and_once_after(store, by):
    """A query between a record's close and its commit (queued while the writer waits for the file) counts it;
    so does one that races the commit, once. Before, the journal had the record and the query did not."""
    blocker = sqlite3.connect(store.path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # the writer waits for the file; readers do not (WAL)
    try:
        store.add([rec(pid=7, uid=BOB, first=1000, last=1600)])
        closing = rec(pid=8, first=1000, last=1300)  # closed on the loop, not yet handed to the store
        rows = by_key(ask(store, by=by, live=[closing, rec(pid=9, first=1000, last=1100, ended="")]))
        total = sum(r.gpu_seconds for r in rows.values())
        assert total == pytest.approx(600 + 300 + 100), rows
        assert sum(r.processes for r in rows.values()) == 3 and sum(r.live for r in rows.values()) == 1
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert store.flush()
    # committed now, and still given as unsaved (the copy raced the commit): counted once
    store._writing = [store_row(rec(pid=7, uid=BOB, first=1000, last=1600))]
    try:
        rows = by_key(ask(store, by=by))
    finally:
        store._writing = []
    assert sum(r.gpu_seconds for r in rows.values()) == pytest.approx(600), rows


def test_folded_records_count_their_processes(store):
    put(
        store,
        rec(pid=0, start_time=0, comm="", processes=40, first=1000, last=1060),
        rec(pid=0, start_time=0, comm="", processes=25, first=1060, last=1120),
        rec(pid=5),
    )
    assert ask(store).rows[0].processes == 66


# -- the file -------------------------------------------------------------------------------------------------


def test_the_file_is_made_0600_and_reopened_without_a_rebuild(tmp_path):
    path = tmp_path / "usage.sqlite"
    s = UsageStore(str(path))
    assert s.open() is False
    put(s, rec())
    for suffix in ("", "-wal", "-shm"):  # SQLite gives its WAL files the database's mode
        assert stat.S_IMODE((tmp_path / f"usage.sqlite{suffix}").stat().st_mode) == 0o600, suffix
    s.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    s = UsageStore(str(path))
    assert s.open() is True
    assert ask(s).rows[0].gpu_seconds == pytest.approx(1000)
    s.close()


def test_a_corrupt_file_is_moved_aside_and_rebuilt(tmp_path):
    path = tmp_path / "usage.sqlite"
    path.write_bytes(b"SQLite format 3\0" + os.urandom(8192))
    s = UsageStore(str(path))
    assert s.open() is False  # a rebuild is due; nothing raised
    assert (tmp_path / "usage.sqlite.broken").exists()
    assert s.rebuild(iter([rec(), rec(pid=2)])) == 2
    assert ask(s).rows[0].processes == 2
    s.close()


def test_another_schema_is_moved_aside(tmp_path):
    path = tmp_path / "usage.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE usage (x)")
    conn.commit()
    conn.close()
    s = UsageStore(str(path))
    assert s.open() is False and (tmp_path / "usage.sqlite.broken").exists()
    s.close()


def test_a_store_that_cannot_be_opened_is_not_supported(tmp_path):
    (tmp_path / "file").write_text("")
    s = UsageStore(str(tmp_path / "file" / "usage.sqlite"))  # its directory is a file
    assert s.open() is False
    with pytest.raises(NotSupported, match="cannot be opened"):
        ask(s)
    s.add([rec()])  # dropped, no error
    assert s.rebuild([rec()]) == 0


def test_the_rebuild_adds_each_record_once_and_says_it_is_rebuilding(store):
    put(store, rec(pid=1))
    assert ask(store).rebuilding  # due since open() found no file, before the keeper's thread starts it
    seen: list[bool] = []

    def records():
        seen.append(store.rebuilding)
        yield rec(pid=1)  # also stored by the writer: not counted twice
        yield rec(pid=2)
        seen.append(ask(store).rebuilding)

    assert store.rebuild(records()) == 1
    assert seen == [True, True] and store.rebuilding is False and ask(store).rebuilding is False
    assert ask(store).rows[0].gpu_seconds == pytest.approx(2000)


def test_prune_deletes_what_ended_before_keep_days(store):
    import time

    now = time.time()
    put(store, rec(pid=1, first=now - 10 * 86400, last=now - 9 * 86400), rec(pid=2, first=now - 3600, last=now))
    store.prune(5)
    assert store.flush()
    assert [r.key for r in ask(store, by="process", since=0, until=now + 1).rows] == ["2:20"]


def test_adds_from_many_threads_all_land(store):
    threads = [
        threading.Thread(target=lambda base=b: store.add([rec(pid=base + i) for i in range(500)]))
        for b in range(0, 4000, 1000)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.flush()
    assert ask(store).rows[0].processes == 2000


# -- the query's bounds ---------------------------------------------------------------------------------------

NOW = 1_800_000_000.0


def test_the_query_has_defaults():
    q = parse_query({}, NOW)
    assert (q.since, q.until, q.by, q.limit) == (NOW - 86400, NOW, "user", MAX_LIMIT)
    q = parse_query(
        {
            "since": Variant("t", 5),
            "until": Variant("i", 10),
            "user": Variant("u", 7),
            "device": Variant("s", " GPU-1 "),
            "limit": Variant("u", 3),
            "by": Variant("s", "pod"),
        },
        NOW,
    )
    assert (q.since, q.until, q.user, q.device, q.limit, q.by) == (5.0, 10.0, 7, "GPU-1", 3, "pod")


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"since2": Variant("d", 1.0)}, "unknown usage query key 'since2'"),
        ({"since": Variant("s", "30d")}, "'since' has type 's'"),
        ({"since": Variant("d", float("nan"))}, "'since' must be seconds"),
        ({"until": Variant("d", float("inf"))}, "'until' must be seconds"),
        ({"since": Variant("i", -5)}, "'since' must be seconds"),
        ({"since": Variant("d", NOW), "until": Variant("d", NOW)}, "must be before"),
        ({"since": Variant("d", NOW + 10)}, "must be before"),
        ({"by": Variant("s", "week")}, "'by' must be one of"),
        ({"limit": Variant("u", 0)}, "'limit' must be from 1 to 1000"),
        ({"limit": Variant("u", 1001)}, "'limit' must be from 1 to 1000"),
        ({"user": Variant("d", 1.0)}, "'user' has type 'd'"),
        ({"name": Variant("s", "x" * 5000)}, "'name' is 5000 characters long"),
        ({"device": Variant("s", "x" * 5000)}, "'device' is 5000 characters long"),
        ({"unit": Variant("as", ["a"])}, "'unit' has type 'as'"),
        ({f"k{i}": Variant("u", i) for i in range(11)}, "has 11 keys"),
    ],
)
def test_a_bad_query_is_one_line_naming_what(raw, says):
    with pytest.raises(InvalidArgs) as e:
        parse_query(raw, NOW)
    assert says in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300


# -- the journal reader ---------------------------------------------------------------------------------------


def entry(r: UsageRecord, **over: object) -> dict:
    out = {journal.field_name(k): str(v) for k, v in fields_of(r).items() if v is not None}
    out.update(MESSAGE_ID=journal.USAGE.message_id, _UID="0", MESSAGE="PID ...")
    out.update({k: v for k, v in over.items()})
    return out


def test_the_journal_reader_takes_only_root_s_well_formed_entries(tmp_path):
    good, other = rec(pid=1), rec(pid=2, uid=BOB, unit="x.service", job_from_environ=True, slurm_job="9")
    lines = [
        json.dumps(entry(good)),
        "not json",
        json.dumps(entry(rec(pid=3), _UID="2002")),  # forged by a user
        json.dumps(entry(rec(pid=4), GPUKILL_TARGET_COMM="x" * 70_000)),  # over the line bound
        json.dumps(entry(rec(pid=5), GPUKILL_GPU_SECONDS="-1")),
        json.dumps([1, 2]),
        json.dumps(entry(rec(pid=6), GPUKILL_UNIT=[1, 2])),  # a binary or repeated field
        json.dumps(entry(other)),
    ]
    data = tmp_path / "entries.json"
    data.write_text("\n".join(lines) + "\n")
    fake = tmp_path / "journalctl"
    args = tmp_path / "args"
    fake.write_text(f'#!/bin/sh\necho "$@" > {args}\nexec cat {data}\n')
    fake.chmod(0o755)
    got = list(journal_read.read_usage_entries(str(fake)))
    assert got == [good, other]
    argv = args.read_text().split()
    assert f"MESSAGE_ID={journal.USAGE.message_id}" in argv and "_UID=0" in argv and "json" in argv


def test_the_journal_reader_without_journalctl_reads_nothing(tmp_path):
    assert list(journal_read.read_usage_entries(str(tmp_path / "none"))) == []


def test_a_record_stored_and_read_back_from_the_journal_is_stored_once(store):
    precise = rec(pid=7, first=1000.123456789, last=1999.987654321)
    put(store, precise)
    from gpukilld.usage.journal_form import record_from_journal

    again = record_from_journal(entry(precise))  # what the rebuild reads: the times to the millisecond
    assert again is not None and again.first_seen != precise.first_seen
    assert store.rebuild([again]) == 0
    assert ask(store).rows[0].processes == 1 and ask(store).rows[0].gpu_seconds == pytest.approx(999.864, abs=1e-3)


def test_the_rebuild_leaves_records_that_ended_after_the_store_opened_to_the_writer(store):
    import time

    later = time.time() + 5  # ended after open(): the keeper adds it, and its journal entry may be a fold
    assert store.rebuild([rec(pid=1), rec(pid=0, start_time=0, processes=9, first=later - 60, last=later)]) == 1
    assert ask(store, until=later + 10).rows[0].processes == 1


def test_a_value_sqlite_refuses_does_not_stop_the_writer(store):
    put(store, rec(pid=1, comm="bad\udcff"), rec(pid=2))  # a lone surrogate cannot be encoded
    put(store, rec(pid=3))
    assert ask(store).rows[0].processes == 2


# -- the daily totals (usage_day) against the records one by one ------------------------------------------------

DAY = 86400.0
T0 = 1_790_000_000.0  # a UTC day starts 1,000 s later (T0 % DAY == 85,600)


def random_records(rnd, n: int) -> list[UsageRecord]:
    out = []
    for i in range(n):
        first = T0 + rnd.random() * 10 * DAY
        life = rnd.choice([0.0, 5.0, 600.0, 5000.0, 0.7 * DAY, 2.5 * DAY])
        uid = rnd.choice([ALICE, BOB, 2003])
        kw = dict(
            pid=1000 + i,
            uid=uid,
            first=first,
            last=first + life,
            device=rnd.randrange(3),
            sm_seconds=None if rnd.random() < 0.3 else life * rnd.random(),
            energy_joules=None if rnd.random() < 0.5 else life * 100,
            peak_memory=rnd.randrange(1, 100),
        )
        if rnd.random() < 0.05:  # folded
            kw.update(pid=0, start_time=0, processes=rnd.randrange(2, 50), comm="")
        out.append(rec(**kw))
        if kw["pid"] and rnd.random() < 0.15:  # the same process on another GPU, or back on one later
            second = first + rnd.random() * life
            out.append(rec(**{**kw, "device": (kw["device"] + 1) % 3, "first": second, "last": first + life}))
    return out


def test_the_daily_totals_answer_as_the_records_one_by_one(store, monkeypatch):
    import random

    from gpukilld.usage import store as store_module

    rnd = random.Random(22)
    records = random_records(rnd, 1500)
    put(store, *records[:700])
    assert store.rebuild(records[700:]) > 0
    stored = [r for r in records if r.pid]
    live = [
        rec(pid=r.pid, uid=r.uid, device=(r.device + 2) % 3, first=r.last_seen, last=r.last_seen + 50, ended="")
        for r in rnd.sample(stored, 40)
    ]  # processes with records stored, live on another GPU
    live += [rec(pid=90_000 + i, uid=BOB, first=T0 + 9 * DAY, last=T0 + 10 * DAY, ended="") for i in range(5)]

    def both(viewer, **kw):
        by_day = ask(store, viewer, live=live, **kw)
        monkeypatch.setattr(store_module, "_by_day", lambda q: False)
        one_by_one = ask(store, viewer, live=live, **kw)
        monkeypatch.undo()
        return by_day, one_by_one

    checked = 0
    for since, until in [
        (T0, T0 + 10 * DAY),
        (T0 + 1.5 * DAY, T0 + 7.2 * DAY),
        (T0 + 1000, T0 + 1000 + 3 * DAY),
        (T0 + 2.1 * DAY, T0 + 2.3 * DAY),
        (T0 - DAY, T0 + 20 * DAY),
        (T0 + 3 * DAY, T0 + 3 * DAY + 1),
    ]:
        for by in ("user", "gpu"):
            for viewer in (ROOT_VIEW, Viewer(BOB, PROGRAM), Viewer(BOB, HIDDEN)):
                for extra in ({}, {"user": "alice"}, {"device": 1}, {"device": "GPU-0002"}):
                    a, b = both(viewer, since=since, until=until, by=by, **extra)
                    assert a.rows_total == b.rows_total
                    for x, y in zip(a.rows, b.rows, strict=True):
                        assert (x.key, x.processes, x.live, x.peak_memory) == (
                            y.key,
                            y.processes,
                            y.live,
                            y.peak_memory,
                        ), (since, until, by)
                        for field in (
                            "gpu_seconds",
                            "sm_seconds",
                            "sm_known_seconds",
                            "memory_byte_seconds",
                            "energy_joules",
                            "energy_known_seconds",
                            "first_seen",
                            "last_seen",
                        ):
                            u, v = getattr(x, field), getattr(y, field)
                            assert (u is None) == (v is None) and (
                                u is None or u == pytest.approx(v, rel=1e-9, abs=1e-6)
                            ), field
                    checked += len(a.rows)
    assert checked > 200
    conn = sqlite3.connect(store.path)
    assert conn.execute("SELECT COUNT(*) FROM usage_day").fetchone()[0] > 10  # the totals exist, and were used
    assert conn.execute("SELECT COUNT(*) FROM usage WHERE multi = 1").fetchone()[0] > 100


def test_pruning_keeps_the_daily_totals_with_their_records(store):
    import time

    now = time.time()
    put(store, *(rec(pid=p, first=now - p * DAY / 3, last=now - p * DAY / 3 + 100) for p in range(1, 40)))
    store.prune(5)
    assert store.flush()
    conn = sqlite3.connect(store.path)
    left = conn.execute("SELECT COUNT(*), SUM(gpu_seconds) FROM usage").fetchone()
    totals = conn.execute("SELECT SUM(n), SUM(gpu_seconds) FROM usage_day").fetchone()
    assert 10 < left[0] < 39 and totals[0] == left[0] and totals[1] == pytest.approx(left[1])
