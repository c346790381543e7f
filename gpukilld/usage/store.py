"""The usage store: every closed UsageRecord in an SQLite file beside the journal, for GetUsage to sum fast.

The journal entries (journal.USAGE) are the record; this file is a compact copy that answers `usage --since 30d
--by user` over 300,000 records in a fraction of what reading them back from the journal takes (bench/README.md,
"Usage queries"). It can always be made again: a missing or unreadable file is moved aside (.broken) and rebuilt
from the journal in a worker thread (gpukilld/usage/keeper.py), and until then replies say `rebuilding`.

- Writes come from the daemon's loop (add(), prune()) and never block it: they are queued to the store's own
  writer thread, which commits them in batches. A record already in the store (the same process, GPU and first
  sample) is not added twice, so a rebuild that reads entries the writer has stored too counts each once.
- Each query() runs in a worker thread on a connection of its own (WAL: readers never wait for the writer).
  The range's proration, what the viewer may see of other users' records (gpukilld/access/visibility.py) and
  the grouping are one SQL statement; the live processes' partial totals are put in a temporary table of that
  connection and summed in the same statement, so a process counted both closed (an earlier GPU) and live is
  one process. Records closed but not yet committed (queued for the writer, or closed on the loop since its
  last save) go in that table too: a record is counted from the moment it closes, once.
- Queries by user or GPU read daily totals (usage_day, kept by triggers) for the range's whole days and only
  the records at its ends one by one: 0.09 s instead of 0.97 s for 30 days of 300,000 records (_day_statement).
- A batch that cannot be committed for a reason that passes (sqlite3.OperationalError: a full disk, an I/O
  error) goes back to the head of the queue and is tried again RETRY seconds later; queries count it meanwhile,
  and the journal hears of it once per run of failures (files.WriteWatch), not once per sample.
- The file is root's, 0600 (the records name every user's processes), in the state directory.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sqlite3
import stat
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence

from gpukill.errors import GpukillError, NotSupported
from gpukill.records.usage import USAGE_BY, UsageRecord, UsageReport, UsageRow

from .. import journal
from ..access.visibility import ANONYMOUS, FULL, HIDDEN, PROGRAM, Viewer
from ..files import WriteWatch
from .query import UsageQuery

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
BATCH = 2000  # records per commit of the writer
GATHER = 0.05  # seconds the writer waits for more records of a burst before it commits what it has
MAX_PENDING = 200_000  # records queued for the writer at most; past it (a disk gone bad) they are dropped, logged
RETRY = 5.0  # seconds between tries of a batch that could not be committed (a full disk)
QUERY_DEADLINE = 20.0  # seconds a query may run before it is interrupted
BUSY_TIMEOUT_MS = 30_000  # a writer waits this long for another (rebuild and writer thread)

# The columns, in UsageRecord's field order; job_from_environ as 0/1.
COLUMNS = (
    "pid",
    "start_time",
    "uid",
    "user",
    "comm",
    "unit",
    "slurm_job",
    "pod_uid",
    "container_id",
    "device",
    "device_id",
    "first_seen",
    "last_seen",
    "gpu_seconds",
    "sm_seconds",
    "sm_known_seconds",
    "memory_byte_seconds",
    "peak_memory",
    "energy_joules",
    "energy_known_seconds",
    "processes",
    "ended",
    "job_from_environ",
)
_TYPES = {
    "pid": "INTEGER NOT NULL",
    "start_time": "INTEGER NOT NULL",
    "uid": "INTEGER NOT NULL",
    "user": "TEXT NOT NULL",
    "comm": "TEXT NOT NULL",
    "unit": "TEXT",
    "slurm_job": "TEXT",
    "pod_uid": "TEXT",
    "container_id": "TEXT",
    "device": "INTEGER NOT NULL",
    "device_id": "TEXT NOT NULL",
    "first_seen": "REAL NOT NULL",
    "last_seen": "REAL NOT NULL",
    "gpu_seconds": "REAL NOT NULL",
    "sm_seconds": "REAL",
    "sm_known_seconds": "REAL NOT NULL",
    "memory_byte_seconds": "REAL NOT NULL",
    "peak_memory": "INTEGER NOT NULL",
    "energy_joules": "REAL",
    "energy_known_seconds": "REAL NOT NULL",
    "processes": "INTEGER NOT NULL",
    "ended": "TEXT NOT NULL",
    "job_from_environ": "INTEGER NOT NULL",
}
_COLUMN_DEFS = ", ".join(f"{c} {_TYPES[c]}" for c in COLUMNS)
_DAY = "CAST({}.{} / 86400 AS INTEGER)"  # a record's UTC day (first or last), the same expression everywhere
_BUCKET = (
    "first_day = "
    + _DAY.format("OLD", "first_seen")
    + " AND last_day = "
    + _DAY.format("OLD", "last_seen")
    + " AND uid = OLD.uid AND user = OLD.user AND device_id = OLD.device_id AND device = OLD.device"
)
# Take OLD (a record) out of its day's totals: it became part of a process with several records, or was pruned.
_SUBTRACT = f"""UPDATE usage_day SET n = n - 1, processes = processes - OLD.processes,
    gpu_seconds = gpu_seconds - OLD.gpu_seconds, sm_seconds = sm_seconds - IFNULL(OLD.sm_seconds, 0),
    sm_n = sm_n - (OLD.sm_seconds IS NOT NULL), sm_known_seconds = sm_known_seconds - OLD.sm_known_seconds,
    memory_byte_seconds = memory_byte_seconds - OLD.memory_byte_seconds,
    energy_joules = energy_joules - IFNULL(OLD.energy_joules, 0), energy_n = energy_n - (OLD.energy_joules IS NOT NULL),
    energy_known_seconds = energy_known_seconds - OLD.energy_known_seconds WHERE {_BUCKET};"""
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS usage ({_COLUMN_DEFS},
    multi INTEGER NOT NULL DEFAULT 0  -- 1: its process has other records (GPUs) here; not in usage_day
);
-- one record per process, GPU and first sample (a folded record: per user, GPU and minute): INSERT OR IGNORE
-- keeps a record the rebuild reads back from the journal from counting twice
CREATE UNIQUE INDEX IF NOT EXISTS usage_record ON usage (pid, start_time, device_id, first_seen, uid);
-- the range's ends: records that end in the range's last day, and those that start before its first whole day
CREATE INDEX IF NOT EXISTS usage_last_seen ON usage (last_seen);
CREATE INDEX IF NOT EXISTS usage_first_seen ON usage (first_seen);
CREATE INDEX IF NOT EXISTS usage_multi ON usage (multi) WHERE multi = 1;
-- The records' totals per (first day, last day, user, GPU), kept by the triggers below: `usage --since 30d --by
-- user` (or --by gpu) sums ~20,000 of these and reads only the records at the range's ends one by one
-- (bench/README.md, "Usage queries"). A record of a process with several records (on two GPUs) is left out of
-- them and read one by one, so that the process is counted once.
CREATE TABLE IF NOT EXISTS usage_day (
    first_day INTEGER NOT NULL, last_day INTEGER NOT NULL, uid INTEGER NOT NULL, user TEXT NOT NULL,
    device_id TEXT NOT NULL, device INTEGER NOT NULL,
    n INTEGER NOT NULL, processes INTEGER NOT NULL, gpu_seconds REAL NOT NULL, sm_seconds REAL NOT NULL,
    sm_n INTEGER NOT NULL, sm_known_seconds REAL NOT NULL, memory_byte_seconds REAL NOT NULL,
    peak_memory INTEGER NOT NULL, energy_joules REAL NOT NULL, energy_n INTEGER NOT NULL,
    energy_known_seconds REAL NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL,
    PRIMARY KEY (first_day, last_day, uid, user, device_id, device)
) WITHOUT ROWID;
-- the longest record's life: how far before the range a record that reaches into it can have started
CREATE TABLE IF NOT EXISTS usage_meta (name TEXT PRIMARY KEY, value REAL NOT NULL) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS usage_added AFTER INSERT ON usage BEGIN
    INSERT INTO usage_day VALUES ({_DAY.format("NEW", "first_seen")}, {_DAY.format("NEW", "last_seen")}, NEW.uid,
        NEW.user, NEW.device_id, NEW.device, 1, NEW.processes, NEW.gpu_seconds, IFNULL(NEW.sm_seconds, 0),
        NEW.sm_seconds IS NOT NULL, NEW.sm_known_seconds, NEW.memory_byte_seconds, NEW.peak_memory,
        IFNULL(NEW.energy_joules, 0), NEW.energy_joules IS NOT NULL, NEW.energy_known_seconds, NEW.first_seen,
        NEW.last_seen)
    ON CONFLICT (first_day, last_day, uid, user, device_id, device) DO UPDATE SET n = n + 1,
        processes = processes + excluded.processes, gpu_seconds = gpu_seconds + excluded.gpu_seconds,
        sm_seconds = sm_seconds + excluded.sm_seconds, sm_n = sm_n + excluded.sm_n,
        sm_known_seconds = sm_known_seconds + excluded.sm_known_seconds,
        memory_byte_seconds = memory_byte_seconds + excluded.memory_byte_seconds,
        peak_memory = MAX(peak_memory, excluded.peak_memory), energy_joules = energy_joules + excluded.energy_joules,
        energy_n = energy_n + excluded.energy_n,
        energy_known_seconds = energy_known_seconds + excluded.energy_known_seconds,
        first_seen = MIN(first_seen, excluded.first_seen), last_seen = MAX(last_seen, excluded.last_seen);
    INSERT INTO usage_meta VALUES ('max_life', NEW.last_seen - NEW.first_seen)
    ON CONFLICT (name) DO UPDATE SET value = MAX(value, excluded.value);
    UPDATE usage SET multi = 1 WHERE NEW.pid != 0 AND pid = NEW.pid AND start_time = NEW.start_time AND multi = 0
        AND EXISTS (SELECT 1 FROM usage WHERE pid = NEW.pid AND start_time = NEW.start_time AND rowid != NEW.rowid);
END;
CREATE TRIGGER IF NOT EXISTS usage_multi AFTER UPDATE OF multi ON usage WHEN OLD.multi = 0 AND NEW.multi = 1 BEGIN
    {_SUBTRACT}
END;
CREATE TRIGGER IF NOT EXISTS usage_removed AFTER DELETE ON usage WHEN OLD.multi = 0 BEGIN
    {_SUBTRACT}
END;
"""
_INSERT = f"INSERT OR IGNORE INTO usage ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


def _row(r: UsageRecord) -> tuple:
    # first and last_seen to the millisecond, as the journal has them ("%.3f"): a record the writer stored and the
    # rebuild reads back from the journal then has the same key, and is stored once
    return (
        r.pid,
        r.start_time,
        r.uid,
        r.user,
        r.comm,
        r.unit,
        r.slurm_job,
        r.pod_uid,
        r.container_id,
        r.device,
        r.device_id,
        round(r.first_seen, 3),
        round(r.last_seen, 3),
        r.gpu_seconds,
        r.sm_seconds,
        r.sm_known_seconds,
        r.memory_byte_seconds,
        r.peak_memory,
        r.energy_joules,
        r.energy_known_seconds,
        r.processes,
        r.ended,
        1 if r.job_from_environ else 0,
    )


class UsageStore:
    def __init__(self, path: str, audit: journal.Audit | None = None) -> None:
        self.path = path
        self._watch = WriteWatch(
            audit,
            path,
            "the usage store",
            f"the records not stored are kept in memory (at most {MAX_PENDING}), counted by "
            f"usage queries and tried again every {RETRY:.0f} s, or, where the store cannot be "
            "opened, read back from the journal once it can; the journal has them all",
        )
        self.rebuilding = False
        self.unavailable: str | None = "the usage store is not open yet"  # why queries cannot be answered
        self._pending: deque[tuple] = deque()  # rows and ("prune", cutoff) for the writer
        self._cond = threading.Condition()
        self._busy = False  # the writer holds rows it has taken from _pending
        self._writing: list[tuple] = []  # ... these, until they are committed
        self._stopping = False
        self._writer: threading.Thread | None = None
        self._dropped = 0  # records add() could not queue, not yet logged
        self._dropped_told = 0.0  # when the next line about them may be logged (monotonic)
        self._opened_at = 0.0  # records that ended after this are the writer's, not the rebuild's

    # -- opening ---------------------------------------------------------------------------------------

    def open(self) -> bool:
        """Open (or create) the file and start the writer. False when the store is new or was moved aside as
        unreadable: a rebuild from the journal is due. Never raises: a store that cannot be opened at all (the
        state directory unwritable) leaves GetUsage answering NotSupported with the reason."""
        try:
            fresh = self._open_file()
        except (OSError, sqlite3.Error) as e:  # the keeper tries again (a full disk at start may pass)
            self.unavailable = f"the usage store {self.path} cannot be opened: {e}"
            self._watch.failed(e)
            return False
        self._watch.written()
        self.unavailable = None
        # a rebuild is due (the keeper starts it in a thread): replies say so from now, not only once it runs
        self.rebuilding = fresh
        self._opened_at = time.time()
        self._writer = threading.Thread(target=self._write_loop, name="usage-store", daemon=True)
        self._writer.start()
        return not fresh

    def _open_file(self) -> bool:
        """True when the file had to be made anew."""
        os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
        fresh = False
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            fresh = True
        else:
            if not stat.S_ISREG(st.st_mode):
                self._move_aside("not a regular file")
                fresh = True
        if not fresh:
            try:
                with contextlib.closing(self._connect()) as conn:
                    version = conn.execute("PRAGMA user_version").fetchone()[0]
                    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
                    if version != SCHEMA_VERSION:
                        raise sqlite3.DatabaseError(f"schema version {version}, not {SCHEMA_VERSION}")
                    conn.executescript(SCHEMA)
                os.chmod(self.path, 0o600)
                return False
            except sqlite3.DatabaseError as e:  # not a database, corrupt, another schema
                self._move_aside(str(e))
                fresh = True
        # created 0600 before SQLite opens it: its -wal and -shm files take the database's mode
        os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        try:
            with contextlib.closing(self._connect()) as conn:
                conn.executescript(SCHEMA)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:  # half made (a full disk): gone, so that the next try starts it anew
            for suffix in ("", "-wal", "-shm", "-journal"):
                with contextlib.suppress(OSError):
                    os.unlink(self.path + suffix)
            raise
        return fresh

    def _move_aside(self, why: str) -> None:
        log.warning(
            "usage store %s unreadable (%s): moved aside as %s.broken, to be rebuilt from the journal",
            self.path,
            why,
            self.path,
        )
        os.replace(self.path, self.path + ".broken")
        for suffix in ("-wal", "-shm", "-journal"):  # a stale WAL must not be applied to the new file
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path + suffix, self.path + ".broken" + suffix)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable up to the last checkpoint on power loss
        # the GROUP BY's sorter is faster with SQLite's default temp_store (0.57 s against 0.85 s for 300,000
        # records, the sort spilling to a temporary file) than with temp_store=MEMORY; reads through mmap
        conn.execute("PRAGMA mmap_size=268435456")
        return conn

    # -- writing ---------------------------------------------------------------------------------------

    def add(self, records: Sequence[UsageRecord]) -> None:
        """Queue closed records for the writer thread; returns at once."""
        if not records or self._writer is None:
            return
        with self._cond:
            room = MAX_PENDING - len(self._pending) - len(self._writing)  # a batch being tried may come back
            if room < len(records):
                self._dropped += len(records) - max(room, 0)
                records = records[: max(room, 0)]
            self._pending.extend(_row(r) for r in records)
            self._cond.notify_all()  # the writer, whoever else waits (flush)

    def prune(self, keep_days: float) -> None:
        """Queue the deletion of records that ended more than keep_days ago."""
        if self._writer is None:
            return
        with self._cond:
            self._pending.append(("prune", time.time() - keep_days * 86400.0))
            self._cond.notify_all()  # the writer, whoever else waits (flush)

    def _unsaved(self) -> list[tuple]:
        """The rows queued or being written: closed records a query must count though the file lacks them."""
        with self._cond:
            return [r for r in (*self._writing, *self._pending) if r[0] != "prune"]

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued is committed (tests, and close())."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._writer is None or not self._writer.is_alive():
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def _write_loop(self) -> None:
        conn = None
        while conn is None:  # the disk may fill between open() and here: the writer waits, it does not end
            try:
                conn = self._connect()
            except sqlite3.Error as e:
                self._watch.failed(e)
                if self._stopping:
                    return
                self._pause(RETRY)
        with contextlib.closing(conn):
            while True:
                with self._cond:
                    if not self._pending and not self._stopping:
                        self._cond.wait()  # no timeout: an idle daemon's writer never wakes (add() notifies)
                    if not self._pending:
                        if self._stopping:
                            return
                        continue
                    if len(self._pending) < BATCH and not self._stopping:
                        self._cond.wait(GATHER)  # a burst in progress: let it gather into one commit
                    batch = [self._pending.popleft() for _ in range(min(BATCH, len(self._pending)))]
                    self._busy = True
                    self._writing = batch
                    dropped = 0
                    if self._dropped and time.monotonic() >= self._dropped_told:  # a line per REPORT_EVERY at most
                        dropped, self._dropped = self._dropped, 0
                        self._dropped_told = time.monotonic() + WriteWatch.REPORT_EVERY
                if dropped:
                    log.warning(
                        "usage store: %d records dropped (the writer is behind, or its writes fail); the "
                        "journal has them",
                        dropped,
                    )
                retry = False
                try:
                    self._write(conn, batch)
                except sqlite3.OperationalError as e:  # a full disk, an I/O error: it may pass
                    self._watch.failed(e)
                    retry = not self._stopping
                    if not retry:
                        log.warning(
                            "usage store: %d records not stored at stop: %s; the journal has them", len(batch), e
                        )
                except sqlite3.Error as e:  # a file gone bad: the journal still has the records
                    log.warning("usage store: %d records not stored: %s", len(batch), e)
                except Exception:  # a value SQLite cannot take (a bug upstream): the writer must live on
                    log.exception("usage store: %d records not stored", len(batch))
                else:
                    self._watch.written()
                finally:
                    with self._cond:
                        if retry:  # first again, in their order; add() keeps the queue's bound
                            self._pending.extendleft(reversed(batch))
                        self._busy = False
                        self._writing = []
                        self._cond.notify_all()
                if retry:
                    self._pause(RETRY)

    def _pause(self, seconds: float) -> None:
        """Wait before the next try, or until close() asks the writer to stop."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while not self._stopping and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)

    @staticmethod
    def _write(conn: sqlite3.Connection, batch: list[tuple]) -> None:
        rows = [r for r in batch if r[0] != "prune"]
        cutoffs = [r[1] for r in batch if r[0] == "prune"]
        conn.execute("BEGIN IMMEDIATE")
        try:
            try:
                conn.executemany(_INSERT, rows)
            except (ValueError, OverflowError):  # one value SQLite cannot take (a bug upstream): the others go in
                for row in rows:
                    try:
                        conn.execute(_INSERT, row)
                    except (ValueError, OverflowError) as e:
                        log.warning("usage store: a record of PID %s not stored: %s", row[0], e)
            for cutoff in cutoffs:
                # whole days, so that usage_day's totals go with their records
                conn.execute(
                    f"DELETE FROM usage WHERE {_DAY.format('usage', 'last_seen')} < ?", (int(cutoff // 86400),)
                )
                conn.execute("DELETE FROM usage_day WHERE n <= 0")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # SQLite rolls back by itself after some errors (a full disk)
                conn.execute("ROLLBACK")
            raise

    def rebuild(self, records: Iterable[UsageRecord]) -> int:
        """Store every record of the iterable (the journal's, read_usage_entries); blocking, for a worker thread.
        Returns how many were new. `rebuilding` is true meanwhile. Records that ended after open() are left out:
        the keeper adds those itself (and a folded journal entry of them would count them twice); one that ended
        before but was closed after (at a restart) comes both ways with the same key, and is stored once."""
        if self.unavailable is not None:
            return 0
        self.rebuilding = True
        added = 0
        try:
            with contextlib.closing(self._connect()) as conn:
                batch: list[tuple] = []
                for record in records:
                    if record.last_seen >= self._opened_at:
                        continue
                    batch.append(_row(record))
                    if len(batch) >= 10 * BATCH:
                        added += self._insert(conn, batch)
                        batch = []
                added += self._insert(conn, batch)
        except sqlite3.Error as e:
            log.warning("usage store: rebuild stopped after %d records: %s", added, e)
        finally:
            self.rebuilding = False
        return added

    @staticmethod
    def _insert(conn: sqlite3.Connection, rows: list[tuple]) -> int:
        if not rows:
            return 0
        conn.execute("BEGIN IMMEDIATE")  # the write lock first: the rowids counted below are this batch's alone
        try:
            last = "SELECT IFNULL(MAX(rowid), 0) FROM usage"  # total_changes would count the triggers' updates too
            before = conn.execute(last).fetchone()[0]
            conn.executemany(_INSERT, rows)
            added = conn.execute(last).fetchone()[0] - before
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return added

    def close(self) -> None:
        """Commit what is queued and stop the writer."""
        writer = self._writer
        if writer is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        writer.join(timeout=30)
        self._writer = None
        if self._dropped:  # those since the last line about them
            log.warning(
                "usage store: %d records dropped (the writer is behind, or its writes fail); the journal has them",
                self._dropped,
            )
            self._dropped = 0

    # -- reading ---------------------------------------------------------------------------------------

    def query(self, q: UsageQuery, viewer: Viewer, live: Sequence[UsageRecord]) -> UsageReport:
        """The report of q as the viewer may see it, the live records' partial totals included; blocking, on a
        connection of its own (called in a worker thread)."""
        if self.unavailable is not None:
            raise NotSupported(self.unavailable)
        rebuilding = self.rebuilding  # read before: a rebuild that ends during the query may have missed rows
        deadline = time.monotonic() + QUERY_DEADLINE
        try:
            # Taken before the read below starts: a closed record is in the store's file, or still on its way
            # there (queued, being written, or closed on the loop less than CLOSE_DELAY ago and given in `live`).
            current = _unique([*(_row(r) for r in live), *self._unsaved()])
            with contextlib.closing(self._connect()) as conn:
                conn.set_progress_handler(lambda: time.monotonic() > deadline, 100_000)
                conn.execute(f"CREATE TEMP TABLE live ({_COLUMN_DEFS})")
                conn.executemany(
                    _INSERT.replace("INTO usage", "INTO temp.live"),
                    [r for r in current if r[_LAST] >= q.since and r[_FIRST] <= q.until],
                )
                # One read of the file from here on; a record committed since `current` was taken is in both,
                # and counts once: the file's
                conn.execute("BEGIN")
                conn.execute(_UNSAVED_ONLY)
                if _by_day(q):
                    sql, params = _day_statement(q, viewer, conn)
                else:
                    sql, params = _statement(q, viewer, _scan_better(conn, q.since))
                found = conn.execute(sql, params).fetchall()
                conn.execute("ROLLBACK")
        except sqlite3.OperationalError as e:
            if time.monotonic() > deadline:
                raise GpukillError(
                    f"the usage query took over {QUERY_DEADLINE:.0f} s; ask for a shorter range or a narrower filter"
                ) from None
            raise GpukillError(f"the usage store could not be read: {e}") from None
        except sqlite3.DatabaseError as e:
            raise GpukillError(f"the usage store could not be read: {e}") from None
        rows = tuple(_usage_row(r, q.since, q.until) for r in found)
        return UsageReport(
            since=q.since,
            until=q.until,
            by=q.by,
            rows=rows,
            rows_total=found[0][-1] if found else 0,
            rebuilding=rebuilding,
        )


_FIRST, _LAST, _ENDED = COLUMNS.index("first_seen"), COLUMNS.index("last_seen"), COLUMNS.index("ended")
_IDENTITY = tuple(COLUMNS.index(c) for c in ("pid", "start_time", "device_id", "first_seen", "uid"))  # usage_record
_UNSAVED_ONLY = (
    "DELETE FROM temp.live WHERE ended != '' AND EXISTS (SELECT 1 FROM main.usage u WHERE "
    + " AND ".join(f"u.{c} = live.{c}" for c in ("pid", "start_time", "device_id", "first_seen", "uid"))
    + ")"
)


def _unique(rows: list[tuple]) -> list[tuple]:
    """One row per record: a record seen open (in `live`) and then closed (queued) counts as closed."""
    by_identity: dict[tuple, tuple] = {}
    for row in rows:
        key = tuple(row[i] for i in _IDENTITY)
        if key not in by_identity or row[_ENDED]:
            by_identity[key] = row
    return list(by_identity.values())


def _scan_better(conn: sqlite3.Connection, since: float) -> bool:
    """Whether the range covers enough of the store that reading it all is faster than the index: judged from
    the time span of the records (two index lookups), as records are written at a steady rate."""
    first, last = conn.execute("SELECT MIN(last_seen), MAX(last_seen) FROM main.usage").fetchone()
    if first is None or last <= first:
        return False
    return (last - max(since, first)) / (last - first) > SCAN_SHARE


# -- the statement ---------------------------------------------------------------------------------------------

# Fields other users' records may hide from a viewer (visibility.py's seen_as, for records).
_HIDEABLE = ("comm", "unit", "slurm_job", "pod_uid", "container_id")


def _hidden(field: str, viewer: Viewer) -> str:
    """An SQL condition: this row's field is not the viewer's to see ("0": always visible)."""
    if viewer.others in (FULL, HIDDEN):  # HIDDEN: only the viewer's own records are read at all
        return "0"
    if viewer.others == PROGRAM:
        return "(uid != :viewer AND job_from_environ)" if field == "slurm_job" else "0"
    assert viewer.others == ANONYMOUS, viewer.others
    return "(uid != :viewer)"


def _seen(field: str, viewer: Viewer) -> str:
    """The field as the viewer sees it: NULL where hidden (so no filter matches it)."""
    hidden = _hidden(field, viewer)
    return field if hidden == "0" else f"(CASE WHEN {hidden} THEN NULL ELSE {field} END)"


_FILTER_COLUMN = {"unit": "unit", "job": "slurm_job", "pod": "pod_uid"}
# pid_max is at most 2^22 (PID_MAX_LIMIT): start_time * 2^22 + pid is one integer per process (an integer is
# cheaper to count DISTINCT than text: 0.18 s against 0.36 s over 300,000 records)
_PROCESS = "(start_time * 4194304 + pid)"
# Above this share of the store in the range, scanning the table beats the index on last_seen (300,000 records,
# all in the range: 0.15 s scanned, 0.67 s through the index)
SCAN_SHARE = 0.25
_NUMBERS = (
    "pid, start_time, uid, user, device, device_id, first_seen, last_seen, gpu_seconds, sm_seconds, "
    "sm_known_seconds, memory_byte_seconds, peak_memory, energy_joules, energy_known_seconds, processes"
)


# Each row's grouping: (GROUP BY, its key, the row's uid, user, device, device_id, pid, start_time, comm); by
# unit, job or pod (_BY_KEY) the key column k of the records' select.
_GROUPS = {
    "user": ("uid", "MAX(user)", "uid, MAX(user), NULL, NULL, NULL, NULL, NULL"),
    "gpu": ("device_id", "CAST(MAX(device) AS TEXT)", "NULL, NULL, MAX(device), device_id, NULL, NULL, NULL"),
    "process": (
        "uid, pid, start_time",
        "pid || ':' || start_time",
        "uid, MAX(user), NULL, NULL, pid, start_time, MAX(k)",
    ),
}
_BY_KEY = ("h, k", "k", "NULL, NULL, NULL, NULL, NULL, NULL, NULL")
# The columns after the processes count, the same in both statements: the live processes, the prorated sums,
# the peak, the range seen, and rows_total.
_TOTALS = f"""COUNT(DISTINCT CASE WHEN is_live AND pid != 0 THEN {_PROCESS} END)
         + SUM(CASE WHEN is_live AND pid = 0 THEN processes ELSE 0 END),
       SUM(gpu_seconds * f) AS g, SUM(sm_seconds * f), SUM(sm_known_seconds * f), SUM(memory_byte_seconds * f),
       MAX(peak_memory), SUM(energy_joules * f), SUM(energy_known_seconds * f),
       MIN(first_seen), MAX(last_seen),
       COUNT(*) OVER ()"""

# A record in the range [since, until]: overlapping it, or sampled once (last_seen == first_seen) inside it.
_OVERLAP = (
    "last_seen >= :since AND first_seen <= :until AND "
    "(last_seen <= first_seen OR (last_seen > :since AND first_seen < :until))"
)
# The part of a record's life in the range: most records lie wholly in a long range, so that is tested first
# with two comparisons, before MIN and MAX (300,000 records: 0.21 s against 0.51 s).
_FRACTION = (
    "(CASE WHEN (first_seen >= :since AND last_seen <= :until) OR last_seen <= first_seen THEN 1.0 "
    "ELSE (MIN(last_seen, :until) - MAX(first_seen, :since)) / (last_seen - first_seen) END)"
)


def _whose(q: UsageQuery, viewer: Viewer, params: dict) -> list[str]:
    """The conditions on whose records count: the viewer's own only where /proc hides the others (HIDDEN), and
    the query's user."""
    where = ["uid = :viewer"] if viewer.others == HIDDEN else []
    if isinstance(q.user, int):
        where.append("uid = :user")
        params["user"] = q.user
    elif q.user is not None:
        where.append("(user = :user OR CAST(uid AS TEXT) = :user)")
        params["user"] = q.user
    return where


def _on_device(q: UsageQuery, params: dict) -> list[str]:
    """The query's device: an index, or an id (any case) or index as text."""
    if isinstance(q.device, int):
        params["device"] = q.device
        return ["device = :device"]
    if q.device is not None:
        params["device"] = q.device
        return ["(device_id = :device COLLATE NOCASE OR CAST(device AS TEXT) = :device)"]
    return []


def _statement(q: UsageQuery, viewer: Viewer, scan: bool) -> tuple[str, dict]:
    """The one statement of a query; scan: read the whole table rather than through the index on last_seen."""
    params: dict = {"since": q.since, "until": q.until, "viewer": viewer.uid, "limit": q.limit}
    # A record counts for the part of its life in the range (one sampled once: whole, if in the range).
    where = [_OVERLAP, *_whose(q, viewer, params)]
    if q.name is not None:
        where.append(f"instr({_seen('comm', viewer)}, :name) > 0")
        params["name"] = q.name
    for key, column in _FILTER_COLUMN.items():
        value = getattr(q, key)
        if value is not None:
            where.append(f"{_seen(column, viewer)} = :{key}")
            params[key] = value
    where += _on_device(q, params)
    column = USAGE_BY[q.by]
    if q.by in ("unit", "job", "pod"):  # others' values the viewer may not see: one group, key "", hidden
        h = _hidden(column, viewer)
        grouped = f"{h} AS h, (CASE WHEN {h} THEN '' ELSE COALESCE({column}, '') END) AS k"
    elif q.by == "process":
        grouped = f"0 AS h, COALESCE({_seen('comm', viewer)}, '') AS k"  # k: the name as seen
    else:
        grouped = "0 AS h, NULL AS k"
    fraction = f"{_FRACTION} AS f"
    conditions = " AND ".join(where)
    records = (
        f"SELECT {_NUMBERS}, {grouped}, {fraction}, 0 AS is_live FROM main.usage{' NOT INDEXED' if scan else ''}"
        f" WHERE {conditions} UNION ALL "
        f"SELECT {_NUMBERS}, {grouped}, {fraction}, ended = '' AS is_live FROM temp.live WHERE {conditions}"
    )
    group, key, extra = _GROUPS.get(q.by, _BY_KEY)
    sql = f"""
SELECT {key} AS key, MAX(h), {extra},
       COUNT(DISTINCT CASE WHEN pid != 0 THEN {_PROCESS} END) + SUM(CASE WHEN pid = 0 THEN processes ELSE 0 END),
       {_TOTALS}
FROM ({records})
GROUP BY {group}
ORDER BY g DESC, key
LIMIT :limit
"""
    return sql, params


def _by_day(q: UsageQuery) -> bool:
    """Whether usage_day can answer: grouped by user or GPU, filtered by nothing it does not hold."""
    return q.by in ("user", "gpu") and q.name is None and q.unit is None and q.job is None and q.pod is None


_COMMON = (
    "uid, user, device_id, device, pid, start_time, {raw} AS raw, {live} AS is_live, {processes} AS processes, "
    "gpu_seconds, sm_seconds, sm_known_seconds, memory_byte_seconds, {peak} AS peak_memory, energy_joules, "
    "energy_known_seconds, {first} AS first_seen, {last} AS last_seen, {f} AS f"
)


def _day_statement(q: UsageQuery, viewer: Viewer, conn: sqlite3.Connection) -> tuple[str, dict]:
    """The statement of a query usage_day can answer. The range's whole UTC days [ds, du) come from usage_day;
    the records one by one are those (a) ending on or after day du, (b) starting before day ds, (c) of processes
    with several records, and (d) the stored records of processes still live (added one by one, and taken out
    of usage_day's sums by a negative copy), so that every process is counted once."""
    ds = math.ceil(q.since / 86400)
    ds += ds * 86400 < q.since
    du = math.floor(q.until / 86400)
    du -= du * 86400 > q.until
    max_life = conn.execute("SELECT IFNULL(MAX(value), 0) FROM usage_meta WHERE name = 'max_life'").fetchone()[0]
    params: dict = {
        "since": q.since,
        "until": q.until,
        "viewer": viewer.uid,
        "limit": q.limit,
        "ds": ds,
        "du": du,
        "ds_t": ds * 86400.0,
        "du_t": du * 86400.0,
        "earliest": q.since - max_life - 1,
    }
    filters = [*_whose(q, viewer, params), *_on_device(q, params)]
    first_day, last_day = _DAY.format("usage", "first_seen"), _DAY.format("usage", "last_seen")
    in_days = f"{first_day} >= :ds AND {last_day} < :du"
    one = _COMMON.format(
        raw=1, live=0, processes="processes", peak="peak_memory", first="first_seen", last="last_seen", f=_FRACTION
    )
    live_keys = "(pid, start_time) IN (SELECT pid, start_time FROM temp.live WHERE pid != 0)"
    where = " AND ".join([_OVERLAP, *filters])
    plain = " AND ".join(filters) or "1"
    parts = [
        f"SELECT {one} FROM main.usage INDEXED BY usage_last_seen WHERE last_seen >= :du_t - 1 AND {last_day} >= :du"
        f" AND {where}",
        f"SELECT {one} FROM main.usage INDEXED BY usage_first_seen WHERE first_seen >= :earliest"
        f" AND first_seen < :ds_t + 1 AND {first_day} < :ds AND {last_day} < :du AND {where}",
        f"SELECT {one} FROM main.usage INDEXED BY usage_multi WHERE multi = 1 AND {in_days} AND {where}",
        f"SELECT {one} FROM main.usage WHERE multi = 0 AND {in_days} AND {live_keys} AND {where}",
        "SELECT "
        + _COMMON.format(raw=0, live=0, processes="-processes", peak=0, first="NULL", last="NULL", f=-1.0)
        + f" FROM main.usage WHERE multi = 0 AND {in_days} AND {live_keys} AND {plain}",
        "SELECT "
        + _COMMON.format(
            raw=1,
            live="ended = ''",
            processes="processes",
            peak="peak_memory",
            first="first_seen",
            last="last_seen",
            f=_FRACTION,
        )
        + f" FROM temp.live WHERE {where}",
        "SELECT uid, user, device_id, device, NULL, NULL, 0, 0, processes, gpu_seconds, "
        "CASE WHEN sm_n > 0 THEN sm_seconds END, sm_known_seconds, memory_byte_seconds, peak_memory, "
        "CASE WHEN energy_n > 0 THEN energy_joules END, energy_known_seconds, first_seen, last_seen, 1.0 "
        f"FROM main.usage_day WHERE first_day >= :ds AND last_day < :du AND n > 0 AND {plain}",
    ]
    group, key, extra = _GROUPS[q.by]  # user or gpu (_by_day)
    sql = f"""
SELECT {key} AS key, 0, {extra},
       COUNT(DISTINCT CASE WHEN raw AND pid != 0 THEN {_PROCESS} END)
         + SUM(CASE WHEN raw AND pid != 0 THEN 0 ELSE processes END),
       {_TOTALS}
FROM ({" UNION ALL ".join(parts)})
GROUP BY {group}
ORDER BY g DESC, key
LIMIT :limit
"""
    return sql, params


def _usage_row(r: tuple, since: float, until: float) -> UsageRow:
    """A row of the statement; first_seen and last_seen clamped to the range here (MIN(MAX(first_seen, since))
    per record in SQL cost 0.1 s over 300,000 records)."""
    (
        key,
        hidden,
        uid,
        user,
        device,
        device_id,
        pid,
        start_time,
        comm,
        processes,
        live,
        gpu_seconds,
        sm_seconds,
        sm_known,
        memory,
        peak,
        energy,
        energy_known,
        first,
        last,
        _total,
    ) = r
    return UsageRow(
        key=key or "",
        hidden=bool(hidden),
        uid=uid,
        user=user,
        device=device,
        device_id=device_id,
        pid=pid,
        start_time=start_time,
        comm=comm,
        processes=processes or 0,
        live=live or 0,
        gpu_seconds=gpu_seconds or 0.0,
        sm_seconds=sm_seconds,
        sm_known_seconds=sm_known or 0.0,
        memory_byte_seconds=memory or 0.0,
        peak_memory=peak or 0,
        energy_joules=energy,
        energy_known_seconds=energy_known or 0.0,
        first_seen=max(first, since),
        last_seen=min(last, until),
    )
