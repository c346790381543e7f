"""The usage keeper: the accountant fed from the main loop, its closed records written to the journal and the
store, its running totals saved across restarts.

- Every snapshot goes to the Accountant (O(1) while the generation does not move). The records it closes are
  held until the state file no longer has them open, then written: one journal.USAGE entry each and, all of
  them unfolded, to the store. That order means a crash between the two loses an entry, never doubles one:
  the file never holds a record whose entry is already in the journal.
- The state is written every SAVE_EVERY seconds while any record is open, at most CLOSE_DELAY seconds after
  records close (coalesced: a host where processes come and go every second writes it once a second), and at
  stop.
- The journal's share: journald drops a unit's entries past its rate limit (10,000 in 30 s by default),
  whatever they are, so a flood of short GPU processes must not use it up and push the kills and refusals
  out. At most RATE entries a minute (BURST at once) go to the journal one per record; past that, closed records
  are folded per (uid, device) into one record a minute (pid 0, processes N, totals summed), written when the
  minute ends. The store still gets every record unfolded.
- At start the saved state is read back (records of processes gone meanwhile are written as "daemon-down"),
  the store opened and, when its file was missing, rebuilt from the journal in a thread of its own; its rows
  older than keep_days are deleted once a day, in a thread too. A store that could not be opened (a full disk
  at start) is tried again every REOPEN_EVERY seconds; once open, its rebuild reads back what closed meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from gpukill.procstat import read_stat
from gpukill.records.usage import ENDED_EXITED, UsageRecord

from .. import journal
from ..files import WriteWatch
from ..guard.clocks import boot_id
from .account import Accountant
from .journal_form import fields_of, message_of
from .state import read_state, state_path, write_state

log = logging.getLogger(__name__)

SAVE_EVERY = 30.0  # seconds between saves while any record is open
CLOSE_DELAY = 1.0  # closed records are written at most this long after they close, once the state is saved
RATE = 600  # usage entries a minute to the journal, at most ...
BURST = 3000  # ... with this many at once
FOLD_WINDOW = 60.0  # seconds: folded records are written when their minute ends
PRUNE_EVERY = 86400.0
FIRST_PRUNE = 60.0  # seconds after start: not in the start-up's rush
REOPEN_EVERY = 10.0  # seconds between tries to open a store that could not be opened


def still_running(root: str = "/proc") -> Callable[[int, int], bool]:
    """Whether (pid, start time) still runs, read from root: what tells "left" (it runs on, off that GPU) from
    "exited". A zombie has exited: a backend that follows processes by pidfd drops one the moment it dies,
    before its parent reaps it, and its /proc stat still shows the same start time until then."""

    def running(pid: int, start_time: int) -> bool:
        stat = read_stat(pid, root)
        return stat is not None and stat.start_time == start_time and stat.state not in ("Z", "X", "x")

    return running


def _journal_entries() -> Iterable[UsageRecord]:
    from .journal_read import read_usage_entries  # the store's half (part of the same folder)

    return read_usage_entries()


class UsageKeeper:
    def __init__(
        self,
        audit: journal.Audit,
        store: Any,
        state_dir: str,
        *,
        keep_days: int = 400,
        alive: Callable[[int, int], bool] | None = None,
        boot: str | None = None,
        entries: Callable[[], Iterable[UsageRecord]] = _journal_entries,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.audit = audit
        self.store = store
        self.state_dir = state_dir
        self.keep_days = keep_days
        self._alive = alive or still_running()
        self._boot = boot_id() if boot is None else boot
        self._entries = entries
        self._clock = clock
        self.accountant = Accountant(self._boot)
        self._started = False
        self._out: list[UsageRecord] = []  # closed, waiting for the state to be saved without them
        self._saved = -1e18  # when the state was last written (monotonic)
        self._tokens = float(BURST)
        self._tokens_at = 0.0
        self._folds: dict[tuple[int, str], list[UsageRecord]] = {}
        self._fold_end = 0.0
        self._next_prune = 0.0
        self._next_open = 0.0
        self.written = 0  # journal entries written (folded ones count once)
        self.folded = 0  # records folded into them
        self._save_watch = WriteWatch(
            audit,
            state_path(state_dir),
            "the usage totals of the open processes",
            "it is removed, so that a restart cannot count a record twice; the totals "
            "go on in memory and the closed records to the journal and the usage store",
        )

    # -- life cycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Restore the saved totals, open the store (rebuilding it from the journal in a thread when its file
        is missing). Never raises: without the state or the store the accounting goes on from now."""
        now = self._clock()
        self._tokens_at = now
        self._next_prune = now + FIRST_PRUNE
        closed: list[UsageRecord] = []
        data, note = read_state(self.state_dir)
        if note:
            log.warning("%s", note)
        if data is not None:
            try:
                closed = self.accountant.load(data, self._boot, self._alive, time.time())
            except Exception:  # a bug must not cost the daemon its start
                log.exception("the saved usage totals could not be restored")
            if self.accountant.load_note:
                log.warning("%s", self.accountant.load_note)
        self._open_store(now)
        self._started = True
        self._out.extend(closed)
        self._save(now)

    def _open_store(self, now: float) -> None:
        """Open the store, and rebuild it from the journal in a thread when its file was made anew."""
        self._next_open = now + REOPEN_EVERY
        try:
            fresh = not self.store.open()
        except Exception as e:
            log.error("the usage store cannot be opened: %s", e)
            fresh = False
        if fresh and getattr(self.store, "unavailable", None) is None:
            threading.Thread(target=self._rebuild, name="usage-rebuild", daemon=True).start()

    def stop(self) -> None:
        """Save the totals of the records still open, write what closed and what was folded; close the store."""
        if not self._started:
            return
        self._started = False
        try:
            self._save(self._clock())
            self._flush_folds()
        except Exception:  # the daemon stops all the same
            log.exception("writing the usage records at stop failed")
        try:
            self.store.close()
        except Exception as e:
            log.error("closing the usage store failed: %s", e)

    def live(self) -> list[UsageRecord]:
        """The open records' partial totals as of the latest snapshot, and the records closed since the last
        save (up to CLOSE_DELAY old, not yet handed to the store): a query counts both."""
        return [*self.accountant.live(), *self._out]

    # -- each snapshot (main loop) ---------------------------------------------------------------------

    def on_snapshot(self, snap: Any) -> None:
        """Integrate the snapshot; write what closed once the state is saved without it. Never raises."""
        if not self._started:
            return
        try:
            closed = self.accountant.observe(snap, self._alive)
            now = snap.monotonic
            self._out.extend(closed)
            since = now - self._saved
            if (self._out and since >= CLOSE_DELAY) or (since >= SAVE_EVERY and len(self.accountant)):
                self._save(now)
            if self._folds and now >= self._fold_end:
                self._flush_folds()
            if now >= self._next_prune:
                self._prune(now)
            if now >= self._next_open and getattr(self.store, "unavailable", None) is not None:
                self._open_store(now)
        except Exception:  # the accounting must never cost the loop, nor the snapshot's other readers
            log.exception("usage accounting failed on a snapshot")

    # -- writing ---------------------------------------------------------------------------------------

    def _save(self, now: float) -> None:
        """Write the state, then the records that closed."""
        try:
            write_state(self.state_dir, self.accountant.dump_json())
        except Exception as e:  # OSError; or a bug, which must not cost the daemon its start or its loop
            # A state file that cannot be replaced may hold open records that close now: it goes, so that a
            # restart cannot write them twice (their running totals are lost to a restart instead).
            if isinstance(e, OSError):
                self._save_watch.failed(e)
            else:
                log.exception("saving the usage totals failed")
            with contextlib.suppress(OSError):
                os.unlink(state_path(self.state_dir))
        else:
            self._save_watch.written()
        self._saved = now
        out, self._out = self._out, []
        if out:
            self._write(out, now)

    def _write(self, records: list[UsageRecord], now: float) -> None:
        try:
            self.store.add(records)
        except Exception as e:
            log.error("the usage store refused %d record(s): %s", len(records), e)
        self._tokens = min(float(BURST), self._tokens + (now - self._tokens_at) * RATE / 60.0)
        self._tokens_at = now
        for rec in records:
            if self._tokens >= 1:
                self._tokens -= 1
                self._log(rec)
            else:
                if not self._folds:
                    self._fold_end = now + FOLD_WINDOW
                self._folds.setdefault((rec.uid, rec.device_id), []).append(rec)

    def _log(self, rec: UsageRecord) -> None:
        self.audit.log(journal.USAGE, message_of(rec), **fields_of(rec))
        self.written += 1

    def _flush_folds(self) -> None:
        folds, self._folds = self._folds, {}
        for records in folds.values():
            self._log(fold(records))
            self.folded += len(records)
            self._tokens = max(0.0, self._tokens - 1)

    def _rebuild(self) -> None:
        try:
            n = self.store.rebuild(self._entries())
            log.info("the usage store was rebuilt from the journal: %d record(s)", n)
        except Exception:
            log.exception("rebuilding the usage store from the journal failed")

    def _prune(self, now: float) -> None:
        self._next_prune = now + PRUNE_EVERY
        if getattr(self.store, "rebuilding", False):
            self._next_prune = now + FIRST_PRUNE
            return
        keep = self.keep_days

        def prune() -> None:
            try:
                self.store.prune(keep)
            except Exception:
                log.exception("pruning the usage store failed")

        threading.Thread(target=prune, name="usage-prune", daemon=True).start()


def _same(values: list[Any]) -> Any:
    first = values[0]
    return first if all(v == first for v in values) else None


def fold(records: list[UsageRecord]) -> UsageRecord:
    """Several closed records of one user on one GPU as one: pid 0, the totals summed, the extremes of first
    and last seen; a label (unit, job, pod, container) kept where all of them share it."""
    head = records[0]
    sm = [r.sm_seconds for r in records if r.sm_seconds is not None]
    energy = [r.energy_joules for r in records if r.energy_joules is not None]
    job = _same([r.slurm_job for r in records])
    return replace(
        head,
        pid=0,
        start_time=0,
        comm="",
        unit=_same([r.unit for r in records]),
        slurm_job=job,
        pod_uid=_same([r.pod_uid for r in records]),
        container_id=_same([r.container_id for r in records]),
        first_seen=min(r.first_seen for r in records),
        last_seen=max(r.last_seen for r in records),
        gpu_seconds=sum(r.gpu_seconds for r in records),
        sm_seconds=sum(sm) if sm else None,
        sm_known_seconds=sum(r.sm_known_seconds for r in records),
        memory_byte_seconds=sum(r.memory_byte_seconds for r in records),
        peak_memory=max(r.peak_memory for r in records),
        energy_joules=sum(energy) if energy else None,
        energy_known_seconds=sum(r.energy_known_seconds for r in records),
        processes=sum(r.processes for r in records),
        ended=_same([r.ended for r in records]) or ENDED_EXITED,
        job_from_environ=job is not None and any(r.job_from_environ for r in records),
    )
