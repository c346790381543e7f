"""From fdinfo counters to usage: per-client utilization between two samples, each client counted once, and
per-process and per-device figures.

Utilization of an engine over the time between a client's previous and current sample:
    drm-cycles and drm-total-cycles (xe)        d(cycles) / (d(total cycles) x capacity)
    drm-cycles and drm-maxfreq (msm, panfrost)  d(cycles) / (maxfreq x dt x capacity)
    drm-engine ns (i915, amdgpu, ...)           d(ns) / (dt x capacity)
The first sample of a client has nothing to compare with: its utilization is None, not 0. A counter lower than
the largest value seen is held at that value until it climbs past it (drm-usage-stats.rst: drivers may go
backwards briefly and must catch up), so a dip never gives a negative or inflated figure.

A process's utilization is its busiest engine (engines run in parallel; adding render and copy time would go
past 100 %), summed over its clients. A client shared by several processes (an fd inherited across fork,
dup'ed, or passed over a socket with SCM_RIGHTS) is one (device, drm-client-id), counted once, under its owner;
the other holders are still listed on the device (a reset must stop them too) but with unknown usage, since
none of it is theirs alone. Between users, holding an fd proves nothing about whose the client is: anyone can
pass one to a process of another user (dbus-daemon holds the fds of the messages it queues), so the owner is:
    holders of one uid (fork, dup)                the one that started first
    one regular uid, the rest system accounts     the first holder of that uid: a daemon handed an fd neither
                                                  pays for it nor hides it
    several regular uids (with no regular one:    no one: every holder is flagged shared_usage and its figures
    several system uids), or an unreadable uid    leave the client out, so no user is charged on another's word
Holders that exited since the scan are left out of this. A uid is looked up only for clients with more than one
holder, which are rare, so the scan stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ...model import MemoryRegion, ProcessUsage
from .fdinfo import EngineCounters, Region

LOCAL_REGIONS = ("vram", "local")  # device memory (amdgpu vram, xe vram0, i915 local0); the rest is system RAM

ClientKey = tuple  # (device id, drm-client-id) or, for a client without an id, (device id, pid, start, fd)
Holder = tuple[int, int]  # (start time, pid): min() is the holder that started first
# A holder's real uid; None: it exited (or its PID was reused) since the scan; UNKNOWN_UID: alive, unreadable.
UidOf = Callable[[Holder], int | None]
UNKNOWN_UID = -1


# The largest counter values seen for one engine of one client: (busy ns, cycles, total cycles). A tuple, not a
# record: 200 clients x a few engines of them are made every sample.
Marks = tuple[int | None, int | None, int | None]


def _advance(previous: int | None, current: int | None) -> tuple[int | None, int | None]:
    """(delta, new mark) for a counter that may dip: stay with the larger previous value until it is passed."""
    if current is None or previous is None:
        return None, current
    mark = previous if previous > current else current
    return mark - previous, mark


def engine_fraction(engine: EngineCounters, prev: Marks, dt: float) -> tuple[float | None, Marks]:
    """Fraction (0..1) of the engine this client kept busy, and the marks to keep."""
    busy, cycles, total = engine.busy_ns, engine.cycles, engine.total_cycles
    if cycles is None and total is None and prev[1] is None and prev[2] is None:  # ns engines (i915, amdgpu)
        d_busy, mark = _advance(prev[0], busy)
        marks: Marks = (mark, None, None)
        d_cycles = d_total = None
    else:
        d_busy, m_busy = _advance(prev[0], busy)
        d_cycles, m_cycles = _advance(prev[1], cycles)
        d_total, m_total = _advance(prev[2], total)
        marks = (m_busy, m_cycles, m_total)
    capacity = engine.capacity
    if d_cycles is not None and d_total is not None:
        value = d_cycles / (d_total * capacity) if d_total > 0 else None
    elif d_cycles is not None and engine.maxfreq_hz:
        value = d_cycles / (engine.maxfreq_hz * dt * capacity) if dt > 0 else None
    elif d_busy is not None:
        value = d_busy / (dt * 1e9 * capacity) if dt > 0 else None
    else:
        value = None
    return (None if value is None else min(1.0, max(0.0, value))), marks


class UtilizationTracker:
    """Counters of every client from its previous sample; forgets clients that were not seen in a sample."""

    def __init__(self) -> None:
        self._clients: dict[ClientKey, tuple[float, dict[str, Marks]]] = {}  # key -> (when, marks per engine)
        self._seen: set[ClientKey] = set()

    def update(self, key: ClientKey, engines: dict[str, EngineCounters], now: float) -> dict[str, float] | None:
        """Per-engine busy fraction since this client's last update; None on its first."""
        self._seen.add(key)
        prev = self._clients.get(key)
        if prev is None:
            self._clients[key] = (now, {name: (e.busy_ns, e.cycles, e.total_cycles) for name, e in engines.items()})
            return None
        at, old_marks = prev
        dt = now - at
        fractions = {}
        marks: dict[str, Marks] = {}
        for name, engine in engines.items():
            old = old_marks.get(name)
            if (
                old is not None
                and old[0] == engine.busy_ns
                and engine.cycles is None
                and old[1] is None
                and engine.total_cycles is None
                and old[2] is None
            ):  # an ns counter that did not move
                marks[name] = old
                if old[0] is not None and dt > 0:
                    fractions[name] = 0.0
                continue
            if old is None:
                # A counter that appeared since counted from zero: amdgpu prints an engine only once the
                # client used it. A GPU timestamp (drm-total-cycles) has no such zero: wait for the next.
                if engine.total_cycles is not None:
                    marks[name] = (engine.busy_ns, engine.cycles, engine.total_cycles)
                    continue
                old = (0 if engine.busy_ns is not None else None, 0 if engine.cycles is not None else None, None)
            value, marks[name] = engine_fraction(engine, old, dt)
            if value is not None:
                fractions[name] = value
        self._clients[key] = (now, marks)
        return fractions

    def end_round(self) -> None:
        """Clients not updated since the last round exited: drop them, so a reused id starts afresh."""
        for key in self._clients.keys() - self._seen:
            del self._clients[key]
        self._seen = set()


@dataclass(slots=True)
class Client:
    """One DRM client (or KFD process) on one device, as seen in one sample."""

    key: ClientKey
    device_id: str
    holders: set[Holder]
    engines: dict[str, float] | None  # busy fraction per engine; None: not known (first sample, unreadable)
    regions: dict[str, Region] = field(default_factory=dict)
    has_usage_keys: bool = False  # the driver printed engine or memory keys at all
    occupancy: float | None = None  # KFD: fraction of compute units busy with this process's waves
    kfd_vram: int | None = None  # KFD: VRAM allocated through /dev/kfd
    # What the regions were parsed from (FdInfo.region_lines): equal keys, equal regions. None: not known.
    region_key: tuple | None = None


def region_bytes(region: Region) -> int | None:
    return region.resident if region.resident is not None else region.total


def gpu_memory(regions: dict[str, Region]) -> int | None:
    """Device memory where the client has any (a discrete GPU), else all of it (an integrated one shares RAM)."""
    local = {n: r for n, r in regions.items() if n.startswith(LOCAL_REGIONS)}
    values = [region_bytes(r) for r in (local or regions).values()]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _sum(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else a + b


def _busiest(per_engine: dict[str, float]) -> float | None:
    return min(100.0, 100.0 * max(per_engine.values())) if per_engine else None


def owner(client: Client, uid_of: UidOf, system_uid_max: int) -> Holder | None:
    """The holder a client's usage is charged to, or None: charged to no one (see the module's docstring)."""
    if len(client.holders) == 1:
        return next(iter(client.holders))
    uids = {h: u for h in client.holders if (u := uid_of(h)) is not None}
    if not uids:
        return min(client.holders)  # all gone since the scan: their records are dropped with them
    if UNKNOWN_UID in uids.values():
        return None
    regular = {h: u for h, u in uids.items() if u > system_uid_max}
    candidates = regular or uids
    return min(candidates) if len(set(candidates.values())) == 1 else None


class UsageRecords:
    """process_usages, sample after sample, handing back last sample's ProcessUsage where its figures did not
    change: the sampler and the audit then see the same record and skip it (they compare by identity first). A
    client's memory figures are worked out again only when its fdinfo's region lines changed (region_key)."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, int, str], ProcessUsage] = {}  # (pid, start time, device) -> last record
        self._memory: dict[ClientKey, tuple[tuple, int | None, tuple[MemoryRegion, ...]]] = {}

    def _regions_of(self, c: Client, memory: dict) -> tuple[int | None, tuple[MemoryRegion, ...]]:
        key = c.region_key
        if key is not None:
            known = self._memory.get(c.key)
            if known is not None and known[0] == key:
                memory[c.key] = known
                return known[1], known[2]
        regions = c.regions
        figures = (gpu_memory(regions), tuple(MemoryRegion(n, r.total, r.resident) for n, r in sorted(regions.items())))
        if key is not None:
            memory[c.key] = (key, *figures)
        return figures

    def _record(
        self,
        last: dict,
        key: tuple[int, int, str],
        memory: int | None,
        utilization: float | None,
        regions: tuple[MemoryRegion, ...],
        shared: bool,
    ) -> ProcessUsage:
        known = self._last.get(key)
        if (
            known is not None
            and known.gpu_utilization == utilization
            and known.gpu_memory == memory
            and known.shared_usage == shared
            and known.memory_regions == regions
        ):
            record = known
        else:
            record = ProcessUsage(
                pid=key[0],
                start_time=key[1],
                device_id=key[2],
                gpu_memory=memory,
                gpu_utilization=utilization,
                memory_regions=regions,
                shared_usage=shared,
            )
        last[key] = record
        return record

    def build(self, clients: Iterable[Client], uid_of: UidOf, system_uid_max: int) -> list[ProcessUsage]:
        """One ProcessUsage per (process, device): owned clients summed, shared ones counted under their owner
        (uid_of and system_uid_max decide who that is), unowned ones nowhere but in the shared_usage flag."""
        owned: dict[tuple[int, int, str], list[Client]] = {}
        unowned: set[tuple[int, int, str]] = set()
        for client in clients:
            charged = owner(client, uid_of, system_uid_max)
            for holder in client.holders:
                key = (holder[1], holder[0], client.device_id)
                slot = owned.setdefault(key, [])
                if charged is None:
                    unowned.add(key)
                elif holder == charged:
                    slot.append(client)
        usages = []
        last: dict[tuple[int, int, str], ProcessUsage] = {}
        memory_of: dict[ClientKey, tuple[tuple, int | None, tuple[MemoryRegion, ...]]] = {}
        for key, mine in sorted(owned.items()):
            shared = key in unowned
            if len(mine) == 1 and mine[0].occupancy is None and mine[0].kfd_vram is None:
                # Nearly every process holds one client of a device: its own figures, with nothing to add up.
                c = mine[0]
                utilization = None
                if c.engines is not None:  # the driver reported engines; none moved: 0
                    utilization = _busiest(c.engines) if c.engines else 0.0
                memory, regions = self._regions_of(c, memory_of)
                usages.append(self._record(last, key, memory, utilization, regions, shared))
                continue
            usages.append(self._record(last, key, *_summed(mine), shared))
        self._last, self._memory = last, memory_of
        return usages


def _summed(mine: list[Client]) -> tuple[int | None, float | None, tuple[MemoryRegion, ...]]:
    """(memory, utilization, regions) of a process from all its owned clients on one device (KFD included)."""
    engines: dict[str, float] = {}
    known_engines = False
    regions: dict[str, Region] = {}
    occupancy: float | None = None
    kfd_vram: int | None = None
    for c in mine:
        if c.engines is not None:
            known_engines = True
            for name, value in c.engines.items():
                engines[name] = engines.get(name, 0.0) + value
        for name, r in c.regions.items():
            acc = regions.setdefault(name, Region())
            acc.total, acc.resident = _sum(acc.total, r.total), _sum(acc.resident, r.resident)
        if c.occupancy is not None:
            occupancy = (occupancy or 0.0) + c.occupancy
        kfd_vram = _sum(kfd_vram, c.kfd_vram)
    utilization = _busiest(engines) if known_engines else None
    if known_engines and utilization is None:
        utilization = 0.0  # the driver reported engines and none moved
    if occupancy is not None:
        utilization = max(utilization or 0.0, min(100.0, 100.0 * occupancy))
    memory = gpu_memory(regions)
    if kfd_vram is not None:  # KFD buffers live in the same VM the render fd reports: never add the two
        memory = max(memory or 0, kfd_vram)
        if not regions:
            regions["vram"] = Region(total=kfd_vram)
    return memory, utilization, tuple(MemoryRegion(n, r.total, r.resident) for n, r in sorted(regions.items()))


def process_usages(clients: Iterable[Client], uid_of: UidOf, system_uid_max: int) -> list[ProcessUsage]:
    """UsageRecords.build for one sample, with nothing to reuse."""
    return UsageRecords().build(clients, uid_of, system_uid_max)


def device_utilization(clients: list[Client], complete: bool) -> float | None:
    """Busiest engine summed over every client of one device, for drivers with no busy figure in sysfs.

    None unless every client's share is known (complete: no unreadable fdinfo; none in its first sample)."""
    if not complete or any(c.engines is None for c in clients if c.has_usage_keys):
        return None
    per_engine: dict[str, float] = {}
    for c in clients:
        for name, value in (c.engines or {}).items():
            per_engine[name] = per_engine.get(name, 0.0) + value
    return _busiest(per_engine) if per_engine else 0.0
