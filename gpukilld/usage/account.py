"""The accountant: every snapshot's GPU processes integrated into one UsageRecord per (process, GPU).

Hold-last: what a sample saw of a process on a GPU (its gpu_memory, gpu_utilization, the device's power)
counts from that sample to the next one that still sees it there. A record closes at the first sample that no
longer lists it on that GPU, its last_seen the last sample that did: the time after that last sample is not
counted, since nobody saw it there.

- SM seconds: utilization/100 × dt, over the dt where the backend gave a utilization (sm_known_seconds).
- Memory: bytes × dt (a sample without a figure counts 0 bytes), and the largest figure seen (peak).
- Energy: the device's power (W) × dt, shared among the records on that device in that sample: by their
  utilization when every one of them has one and they sum over 0; else by memory when that sums over 0; else
  equally. Only over the dt where the device reported power (energy_known_seconds).

Cost, on the daemon's main loop once per snapshot: a snapshot of the same generation as the last holds the
same processes with the same values, so only its time is remembered (O(1)); the totals at any instant are
what was accumulated plus each record's rates times the time since its segment began. Another generation folds
every open record's segment into its totals and takes the new rates (O(n)).

Intervals are measured on Snapshot.monotonic (the wall clock may jump); records are labelled with
Snapshot.taken_at (wall clock). Across a restart (load/dump, the file is gpukilld/usage/state.py's) totals
are kept on CLOCK_BOOTTIME with the boot id.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpukill.records.usage import (
    ENDED_DAEMON_DOWN,
    ENDED_EXITED,
    ENDED_LEFT,
    ENDED_LIVE,
    UsageRecord,
)

from ..model import GpuProcess, Snapshot
from . import state

# The longest gap across a restart that is counted at the rates saved before it: an upgrade or a crash and
# systemd's restart take seconds; past this, what the process did meanwhile is not known (the gap is not
# counted, and gpu_seconds says less than last_seen - first_seen).
MAX_GAP = 300.0

Key = tuple[int, int, str]  # (pid, start time, device id)


@dataclass(slots=True)
class _Open:
    """One open record: its labels (the latest sample's), its totals up to `since`, and the rates that hold
    from `since` (CLOCK_MONOTONIC)."""

    pid: int
    start_time: int
    device_id: str
    device: int
    uid: int
    user: str
    comm: str
    unit: str | None
    slurm_job: str | None
    pod_uid: str | None
    container_id: str | None
    job_from_environ: bool
    first_seen: float
    since: float
    since_wall: float  # the wall clock of the sample at `since` (its last_seen, as of then)
    gpu: float = 0.0
    sm: float = 0.0
    sm_known: float = 0.0
    memory: float = 0.0
    peak: int = 0
    energy: float = 0.0
    energy_known: float = 0.0
    sm_rate: float | None = None
    memory_rate: float = 0.0
    power_rate: float | None = None
    # Restored from the state file and not yet seen by a sample: last_seen as saved (wall clock); None once seen.
    saved_last_seen: float | None = None
    # The sample record its rates come from: the sampler hands on the same immutable record while nothing of it
    # changes, so a new generation leaves this record's segment running when it is handed the same one.
    proc: GpuProcess | None = None
    encoded: bytes | None = None  # its state-file entry, encoded, while its segment runs (dump_json)

    def advance(self, to: float) -> None:
        """Fold the segment from `since` to `to` into the totals."""
        dt = to - self.since
        if dt > 0:
            self.gpu += dt
            self.memory += self.memory_rate * dt
            if self.sm_rate is not None:
                self.sm += self.sm_rate * dt
                self.sm_known += dt
            if self.power_rate is not None:
                self.energy += self.power_rate * dt
                self.energy_known += dt
        self.since = to

    def take(self, p: GpuProcess, power_rate: float | None) -> None:
        """The labels and rates of a sample that sees it."""
        self.proc = p
        self.device, self.uid, self.user, self.comm = p.device, p.uid, p.user, p.comm
        self.unit, self.slurm_job, self.pod_uid, self.container_id = p.unit, p.slurm_job, p.pod_uid, p.container_id
        self.job_from_environ = p.job_from_environ
        self.sm_rate = _fraction(p.gpu_utilization)
        memory = p.gpu_memory if p.gpu_memory is not None and p.gpu_memory > 0 else 0
        self.memory_rate = float(memory)
        self.peak = max(self.peak, memory)
        self.power_rate = power_rate

    def record(self, last_seen: float, ended: str, at: float | None = None) -> UsageRecord:
        """Its totals as a record: up to `since`, or (at) up to that instant at the current rates."""
        gpu, sm, sm_known, memory = self.gpu, self.sm, self.sm_known, self.memory
        energy, energy_known = self.energy, self.energy_known
        if at is not None and (dt := at - self.since) > 0:
            gpu += dt
            memory += self.memory_rate * dt
            if self.sm_rate is not None:
                sm += self.sm_rate * dt
                sm_known += dt
            if self.power_rate is not None:
                energy += self.power_rate * dt
                energy_known += dt
        return UsageRecord(
            pid=self.pid,
            start_time=self.start_time,
            uid=self.uid,
            user=self.user,
            comm=self.comm,
            unit=self.unit,
            slurm_job=self.slurm_job,
            pod_uid=self.pod_uid,
            container_id=self.container_id,
            device=self.device,
            # to the millisecond, as the journal writes them: the store's key (with the first sample) is then
            # the same for a record added by the keeper and for the one a rebuild reads back from the journal
            device_id=self.device_id,
            first_seen=round(self.first_seen, 3),
            last_seen=round(max(last_seen, self.first_seen), 3),
            gpu_seconds=gpu,
            sm_seconds=sm if sm_known > 0 else None,
            sm_known_seconds=sm_known,
            memory_byte_seconds=memory,
            peak_memory=self.peak,
            energy_joules=energy if energy_known > 0 else None,
            energy_known_seconds=energy_known,
            ended=ended,
            job_from_environ=self.job_from_environ,
        )


def _fraction(utilization: float | None) -> float | None:
    if utilization is None or not math.isfinite(utilization):
        return None
    return min(1.0, max(0.0, utilization / 100.0))


def power_shares(snap: Snapshot) -> dict[Key, float | None]:
    """Each (process, GPU)'s share of its device's power in this sample, watts (None: the device reports none).
    By utilization when every process on the device has one and they sum over 0; else by memory when that
    sums over 0; else equally."""
    power = {d.id: d.power for d in snap.devices}
    on: dict[str, list[GpuProcess]] = {}
    for p in snap.processes:
        on.setdefault(p.device_id, []).append(p)
    shares: dict[Key, float | None] = {}
    for device_id, procs in on.items():
        watts = power.get(device_id)
        if watts is None or not math.isfinite(watts) or watts < 0:
            for p in procs:
                shares[(p.pid, p.start_time, device_id)] = None
            continue
        utils = [_fraction(p.gpu_utilization) for p in procs]
        known = [u for u in utils if u is not None]
        total: float
        if len(known) == len(utils) and (total := sum(known)) > 0:
            weights = known
        else:
            weights = [float(p.gpu_memory) if p.gpu_memory and p.gpu_memory > 0 else 0.0 for p in procs]
            total = sum(weights)
            if total <= 0:
                weights, total = [1.0] * len(procs), float(len(procs))
        for p, w in zip(procs, weights, strict=True):
            shares[(p.pid, p.start_time, device_id)] = watts * w / total
    return shares


class Accountant:
    """The open records, fed one snapshot at a time on the main loop."""

    def __init__(self, boot: str = "", offset: Callable[[], float] = state.boottime_offset) -> None:
        self.boot = boot  # this boot's id: what dump() writes and load() compares
        self._offset = offset  # CLOCK_BOOTTIME - CLOCK_MONOTONIC now
        self._open: dict[Key, _Open] = {}
        self._generation: int | None = None
        self._monotonic = 0.0  # the latest snapshot's
        self._wall = 0.0
        self.load_note: str | None = None  # what load() could not give back, in one line

    def __len__(self) -> int:
        return len(self._open)

    def observe(self, snap: Snapshot, alive: Callable[[int, int], bool]) -> list[UsageRecord]:
        """Integrate one snapshot; the records it closes (ended "exited" or "left", or "left"/"daemon-down"
        for a restored record its first snapshot does not list)."""
        if snap.generation == self._generation:  # the same processes and values: only the time moves
            self._monotonic, self._wall = snap.monotonic, snap.taken_at
            return []
        now, wall = snap.monotonic, snap.taken_at
        last_mono, last_wall = self._monotonic, self._wall  # the last sample: it saw every open record
        seen: dict[Key, GpuProcess] = {(p.pid, p.start_time, p.device_id): p for p in snap.processes}
        shares = power_shares(snap)
        closed: list[UsageRecord] = []
        still_on = None
        for key, rec in list(self._open.items()):
            p = seen.get(key)
            if p is not None:
                share = shares.get(key)
                if p is rec.proc and share == rec.power_rate and rec.saved_last_seen is None:
                    continue  # the same values as its last sample: its segment goes on, nothing to fold
                rec.encoded = None
                if rec.saved_last_seen is not None:  # restored: the gap since the save, at the saved rates
                    if 0 <= now - rec.since <= MAX_GAP:
                        rec.advance(now)
                    rec.since = now
                    rec.saved_last_seen = None
                else:
                    rec.advance(now)
                rec.since_wall = wall
                rec.take(p, share)
                continue
            del self._open[key]
            if still_on is None:
                still_on = {(q.pid, q.start_time) for q in snap.processes}
            on_gpu = (rec.pid, rec.start_time) in still_on or alive(rec.pid, rec.start_time)
            if rec.saved_last_seen is not None:  # restored, and gone from its GPU while gpukilld was down
                closed.append(rec.record(rec.saved_last_seen, ENDED_LEFT if on_gpu else ENDED_DAEMON_DOWN))
            else:
                rec.advance(last_mono)
                closed.append(rec.record(last_wall, ENDED_LEFT if on_gpu else ENDED_EXITED))
        for key, p in seen.items():
            if key not in self._open:
                rec = _Open(
                    pid=p.pid,
                    start_time=p.start_time,
                    device_id=p.device_id,
                    device=p.device,
                    uid=p.uid,
                    user=p.user,
                    comm=p.comm,
                    unit=None,
                    slurm_job=None,
                    pod_uid=None,
                    container_id=None,
                    job_from_environ=False,
                    first_seen=wall,
                    since=now,
                    since_wall=wall,
                )
                rec.take(p, shares.get(key))
                self._open[key] = rec
        self._generation, self._monotonic, self._wall = snap.generation, now, wall
        return closed

    def live(self) -> list[UsageRecord]:
        """Every open record's partial totals as of the latest snapshot (ended "")."""
        out = []
        for rec in self._open.values():
            if rec.saved_last_seen is not None:
                out.append(rec.record(rec.saved_last_seen, ENDED_LIVE))
            else:
                out.append(rec.record(self._wall, ENDED_LIVE, at=self._monotonic))
        return out

    # -- across a restart ------------------------------------------------------------------------------

    def _entry(self, rec: _Open) -> dict[str, Any]:
        """The record as state.py writes it: totals as of its segment's start (CLOCK_MONOTONIC), "held": its rates
        held until the latest snapshot; it does not change while its segment runs."""
        pending = rec.saved_last_seen is not None
        record = rec.record(rec.saved_last_seen if rec.saved_last_seen is not None else rec.since_wall, ENDED_LIVE)
        return state.entry_of(
            state.SavedRecord(record, rec.since, not pending, rec.sm_rate, rec.memory_rate, rec.power_rate)
        )

    def dump(self) -> dict[str, Any]:
        """The state to save: the open records and the latest snapshot's instant, with this boot's id and the
        offset that puts the instants on CLOCK_BOOTTIME."""
        return state.header(self.boot, self._offset(), self._monotonic, self._wall) | {
            "records": [self._entry(rec) for rec in self._open.values()]
        }

    def dump_json(self) -> bytes:
        """dump() as the file's bytes. Each record's entry is encoded again only when its segment changed: an
        idle host's save, and a busy host's for the records that did not change, reuse what was encoded."""
        parts = []
        for rec in self._open.values():
            if rec.encoded is None:
                rec.encoded = state.encode_records(self._entry(rec))
            parts.append(rec.encoded)
        return state.encode(
            state.header(self.boot, self._offset(), self._monotonic, self._wall), b"[" + b",".join(parts) + b"]"
        )

    def load(self, data: Any, boot: str, alive: Callable[[int, int], bool], now_wall: float) -> list[UsageRecord]:
        """Take back the open records saved by the daemon before (the state file's JSON). Returns the records
        closed because of the restart (ended "daemon-down": another boot's, or processes gone); where anything
        was dropped or not given back, load_note says why in one line (for the log). Call before the first
        observe()."""
        self.load_note = None
        parsed = state.parse_state(data, boot)
        if parsed is None:
            self.load_note = "the saved usage totals are not in a format this daemon reads: they are not restored"
            return []
        offset = self._offset()
        mono_now = state.boottime() - offset
        shift = parsed.offset - offset  # the saving daemon's monotonic instants on this one's
        until = parsed.until + shift
        closed: list[UsageRecord] = []
        dropped, restored, gone = parsed.dropped, 0, 0
        in_future = parsed.until_wall > now_wall + state.SLACK or (parsed.this_boot and until > mono_now + state.SLACK)
        for saved in parsed.entries:
            rec = saved.record
            key = (rec.pid, rec.start_time, rec.device_id)
            if (
                key in self._open
                or in_future
                or rec.last_seen > now_wall + state.SLACK
                or (saved.held and saved.at > parsed.until + state.SLACK)
            ):
                dropped += 1
                continue
            open_ = _Open(
                pid=rec.pid,
                start_time=rec.start_time,
                device_id=rec.device_id,
                device=rec.device,
                uid=rec.uid,
                user=rec.user,
                comm=rec.comm,
                unit=rec.unit,
                slurm_job=rec.slurm_job,
                pod_uid=rec.pod_uid,
                container_id=rec.container_id,
                job_from_environ=rec.job_from_environ,
                first_seen=rec.first_seen,
                since=saved.at + shift,
                since_wall=rec.last_seen,
                gpu=rec.gpu_seconds,
                sm=rec.sm_seconds or 0.0,
                sm_known=rec.sm_known_seconds,
                memory=rec.memory_byte_seconds,
                peak=rec.peak_memory,
                energy=rec.energy_joules or 0.0,
                energy_known=rec.energy_known_seconds,
                sm_rate=saved.sm_rate,
                memory_rate=saved.memory_rate,
                power_rate=saved.power_rate,
            )
            last_seen = rec.last_seen
            if saved.held:  # seen by every sample up to the latest one saved, at these rates
                open_.advance(until)
                last_seen = max(parsed.until_wall, rec.last_seen)
            if not parsed.this_boot or not alive(rec.pid, rec.start_time):
                # It ended while gpukilld was not running: what it had up to the save is kept.
                closed.append(open_.record(last_seen, ENDED_DAEMON_DOWN))
                gone += 1
                continue
            open_.saved_last_seen = last_seen
            self._open[key] = open_
            restored += 1
        notes = []
        if not parsed.this_boot and parsed.entries:
            notes.append(f"saved in another boot (boot id {parsed.boot_id}): {gone} record(s) closed as daemon-down")
        elif gone:
            notes.append(f"{gone} record(s) of processes gone meanwhile closed as daemon-down")
        if in_future:
            notes.append("the save's instant lies ahead of the clocks: nothing restored")
        if dropped:
            notes.append(f"{dropped} malformed or excess entr{'y' if dropped == 1 else 'ies'} dropped")
        if notes:
            self.load_note = f"usage totals restored ({restored} open records); " + "; ".join(notes)
        return closed
