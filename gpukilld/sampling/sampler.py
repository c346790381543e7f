"""The sampler: one thread that reads every backend at a fixed interval into an immutable Snapshot.

D-Bus reads are served from the latest snapshot, never by touching vendors per call. The thread pings the
systemd watchdog (after a sample, and while sleeping between samples) only when the daemon's main loop has
taken the latest snapshot it published (`taken`): a backend that hangs stops the pings, and so does a main
loop that hangs, even in a call that lets this thread run on (a blocking syscall releases the interpreter
lock). Either way systemd restarts the daemon.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpukill.procstat import seconds_since_start
from gpukill.records.status import SAMPLING_EVENTS, SAMPLING_POLLING, SamplingStatus

from ..backends import Backend, BackendSample
from ..model import (
    ATTRIBUTED,
    STATE_LOST,
    STATE_OK,
    BackendStatus,
    Device,
    Finding,
    GpuProcess,
    ProcessUsage,
    Snapshot,
    numbered,
)
from ..proc.procfs import ProcFS, ProcInfo
from .proc_events import ProcEvents

log = logging.getLogger(__name__)

# A GpuProcess joins what /proc says (ProcInfo, its cgroup attribution flat) with what its backend says
# (ProcessUsage), field by name, and the device's global index.
_FROM_HOST = tuple(f.name for f in dataclasses.fields(ProcInfo) if f.name != "attribution")
_FROM_BACKEND = tuple(f.name for f in dataclasses.fields(ProcessUsage) if f.name not in _FROM_HOST)

# A process's /proc facts are read when it first shows up, then again all of them when the kernel's proc
# connector says it exec'd, renamed itself (prctl PR_SET_NAME, /proc/PID/comm) or changed its uid: in the next
# sample (gpukilld/sampling/proc_events.py). No event tells a cgroup move or a command line rewritten in place
# (setproctitle), so every INFO_TTL (spread up to 1.5 INFO_TTL) it is read again all the same.
# Without the connector (polling: not root, not the host's namespaces, a unit without AF_NETLINK) the sampler
# looks for those changes itself: its stat (name, start time) every sample while it is YOUNG (fork, exec and a
# rename come early), then every STAT_TTL (spread up to 1.5 STAT_TTL), with its command line, exe and cgroup
# again when its name changed or every INFO_TTL; what an older process becomes is then seen up to 90 s late.
# Whether it still runs is its backend's to say, each sample. Reading every GPU process's files every second
# costs more than everything else the daemon does on a busy host (bench/idle_cost); a stat every 30-45 s is
# still the largest part of an idle polling daemon (55 a second on 2,048 GPU processes), and what it
# looks for in a process past its first 10 s, a late rename or exec, is rare enough to wait a minute for.
YOUNG = 10.0
STAT_TTL = 60.0
INFO_TTL = 120.0


@dataclass(frozen=True, slots=True)
class _Known:
    """A process's host facts as last read, and when to look again (monotonic seconds; inf: every sample)."""

    info: ProcInfo
    stat_due: float
    info_due: float


@dataclass(frozen=True, slots=True)
class StateChange:
    device: Device
    previous: str | None  # None: first time seen


class Sampler:
    def __init__(
        self,
        backends: Sequence[Backend],
        interval: float,
        procfs: ProcFS,
        publish: Callable[[Snapshot, list[StateChange]], None],
        watchdog: Callable[[], None] = lambda: None,
        watchdog_interval: float | None = None,
        audit: Callable[[Sequence[GpuProcess], float], tuple[Finding, ...]] | None = None,
        events: ProcEvents | None = None,
    ) -> None:
        self.backends = list(backends)
        self.interval = interval
        self.procfs = procfs
        self._publish = publish
        # The rogue-activity audit (gpukilld/rogue/watch.py, RogueWatch): it sees every sample's processes, here in this
        # thread.
        self.audit = audit
        self._watchdog = watchdog
        # The kernel's proc connector, listening (else None: polling, and _polling_reason says why).
        self._events = events if events is not None and events.listening else None
        self._polling_reason = (events.reason if events is not None else "") or "not asked for"
        self._events_read = 0
        self._overruns = 0
        # Ping at least every watchdog_interval while idle; sampling itself must finish within WatchdogSec.
        self._ping_every = min(interval, watchdog_interval) if watchdog_interval else interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._generation = 0
        self._last_content: tuple | None = None
        self._index_of: dict[str, int] = {}  # device id -> global index, stable for the daemon's life
        self._last_devices: dict[str, Device] = {}
        self._last_samples: dict[str, BackendSample] = {}
        self._known: dict[tuple[int, int], _Known] = {}
        self._key_of: dict[int, tuple[int, int]] = {}  # pid -> its key in _known: what an event's PID names
        self._due: list[tuple[float, tuple[int, int]]] = []  # heap of (stat_due, key) for the non-young
        self._young: set[tuple[int, int]] = set()
        # The last sample's inputs and the records built from them, reused while they do not change.
        self._last_inputs: tuple | None = None
        self._last_processes: list[GpuProcess] = []
        # (pid, start time, device) -> the inputs, the record, and its host facts as GpuProcess's keywords
        self._records: dict[tuple[int, int, str], tuple[ProcInfo, ProcessUsage, int, GpuProcess, dict]] = {}
        self._published: Snapshot | None = None  # the latest snapshot handed to the main loop
        self._taken = True  # whether the main loop has taken it

    # -- thread control --------------------------------------------------------------------------------

    def start(self) -> None:
        # A daemon thread: a backend stuck in a vendor call must not keep the process alive at exit.
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def taken(self, snapshot: Snapshot) -> None:
        """Called by the main loop when it has taken a snapshot: the loop is alive, pings may go on."""
        if snapshot is self._published:
            self._taken = True

    def _ping(self) -> None:
        if self._taken:
            self._watchdog()

    def _run(self) -> None:
        try:
            self._sample_until_stopped()
        finally:
            if self._events is not None:
                self._events.close()  # the kernel counts its listeners: tell it this one left

    def _sample_until_stopped(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                snapshot, changes = self.sample_once()
                self._taken = False
                self._published = snapshot
                self._publish(snapshot, changes)
            except Exception:  # a bug in one sample must not end sampling for good
                log.exception("sampling failed")
            self._ping()
            deadline = started + self.interval  # a fixed rate: the sample's own time is not added to the wait
            while (left := deadline - time.monotonic()) > 0:
                if self._stop.wait(min(left, self._ping_every)):
                    return
                self._ping()

    # -- one sample ------------------------------------------------------------------------------------

    def _sample_backend(self, backend: Backend) -> tuple[BackendSample, BackendStatus]:
        status = backend.status()
        if not status.available:
            return BackendSample(), status
        try:
            sample = backend.sample()
        except Exception as e:  # keep the devices listed, marked lost, rather than let them vanish
            log.error("backend %s failed to sample: %s", backend.name, e)
            reason = f"{backend.name} backend error: {e}"
            last = self._last_samples.get(backend.name, BackendSample())
            lost = [dataclasses.replace(d, state=STATE_LOST, state_reason=reason) for d in last.devices]
            return BackendSample(devices=lost), BackendStatus(backend.name, False, reason)
        self._last_samples[backend.name] = sample
        return sample, status

    def _index(self, device_id: str) -> int:
        if device_id not in self._index_of:
            self._index_of[device_id] = len(self._index_of)
        return self._index_of[device_id]

    def sampling_status(self) -> SamplingStatus:
        """How what processes become is learnt (the Sampling property); read by the main loop."""
        events = self._events
        if events is None:
            return SamplingStatus(
                SAMPLING_POLLING,
                f"the kernel's proc connector is unavailable: "
                f"{self._polling_reason}; processes are re-read every {STAT_TTL:g} to "
                f"{STAT_TTL * 1.5:g} s",
                self._events_read,
                self._overruns,
            )
        told = (
            "exec, comm and uid events only (filtered by the kernel)"
            if events.filtered
            else "every event (this kernel does not filter by kind); exec, comm and uid ones are acted on"
        )
        return SamplingStatus(
            SAMPLING_EVENTS, f"the kernel's proc connector: {told}", self._events_read, self._overruns
        )

    def _drain_events(self) -> set[tuple[int, int]] | None:
        """The followed processes the proc connector named since the last sample (to read again in full); None
        for all of them (events were lost, or more came than one sample reads: a fork bomb's flood)."""
        events = self._events
        if events is None:
            return set()
        try:
            drained = events.drain()
        except OSError as e:  # the socket broke: poll from now on, after reading everything once
            log.error("the kernel's proc connector failed (%s); polling from now on", e)
            self._events = None
            self._polling_reason = f"it failed: {e}"
            events.close()
            return None
        self._events_read += drained.events
        if drained.overrun:
            self._overruns += 1
            return None
        key_of = self._key_of
        return {key for pid in drained.pids if (key := key_of.get(pid)) is not None}

    def _read_info(
        self, pid: int, start_time: int, now: float, known: _Known | None, changed: bool = False
    ) -> ProcInfo | None:
        """Read the process's stat, and its other facts when new, told `changed`, renamed or due; remember when to
        look again."""
        key = (pid, start_time)
        stat = self.procfs.stat(pid)
        if stat is None or stat.start_time != start_time:
            self._forget(key)
            return None
        events = self._events is not None
        young = not events and seconds_since_start(start_time, time.clock_gettime(time.CLOCK_BOOTTIME)) < YOUNG
        if (
            known is not None
            and not changed
            and known.info.comm == stat.comm
            and now < known.info_due
            and not (key in self._young and not young)
        ):  # no longer young: read it all once more
            info = known.info
            info_due = known.info_due
        else:
            read = self.procfs.info(pid, stat)
            if read is None:
                self._forget(key)
                return None
            info = read
            if known is not None and info == known.info:
                info = known.info  # read again and found the same: the same object, so nothing counts as changed
            info_due = now + INFO_TTL * (1 + (pid % 64) / 128)  # spread: not every process in one sample
        if events:  # the kernel tells what it becomes: look again only for what it cannot tell
            self._young.discard(key)
            stat_due = info_due
            heapq.heappush(self._due, (stat_due, key))
        elif young:
            self._young.add(key)
            stat_due = math.inf
        else:
            self._young.discard(key)
            stat_due = now + STAT_TTL * (1 + (pid % 64) / 128)
            heapq.heappush(self._due, (stat_due, key))
        self._known[key] = _Known(info, stat_due, info_due)
        self._key_of[pid] = key
        return info

    def _forget(self, key: tuple[int, int]) -> None:
        self._known.pop(key, None)
        self._young.discard(key)
        if self._key_of.get(key[0]) == key:
            del self._key_of[key[0]]

    def _host_info(self, pid: int, start_time: int, now: float) -> ProcInfo | None:
        """/proc facts of (pid, start time), from what was read before unless new or due (_recheck)."""
        known = self._known.get((pid, start_time))
        if known is not None:
            return known.info
        return self._read_info(pid, start_time, now, None)

    def _recheck(self, now: float) -> bool:
        """Read again the processes the kernel named, and those young or due; whether any of their facts
        changed."""
        told = self._drain_events()
        if told is None:
            told = set(self._known)
        due = set(self._young) | told
        while self._due and self._due[0][0] <= now:
            when, key = heapq.heappop(self._due)
            known = self._known.get(key)
            if known is not None and known.stat_due == when:
                due.add(key)
        changed = False
        for key in due:
            known = self._known.get(key)
            if known is not None and self._read_info(*key, now, known, key in told) is not known.info:
                changed = True
        return changed

    def sample_once(self) -> tuple[Snapshot, list[StateChange]]:
        devices: dict[str, Device] = {}
        statuses: list[BackendStatus] = []
        usages = []
        for backend in self.backends:
            sample, status = self._sample_backend(backend)
            statuses.append(status)
            for r in sample.devices:
                devices[r.id] = numbered(r, self._index(r.id), backend.name)
            usages.extend(sample.processes)

        # A device that stops being reported stays listed as lost: an admin must see that it went away.
        for dev_id, old in self._last_devices.items():
            if dev_id not in devices:
                devices[dev_id] = dataclasses.replace(
                    old,
                    state=STATE_LOST,
                    state_reason="no longer reported by its backend",
                    utilization=None,
                    memory_used=None,
                    temperature=None,
                    power=None,
                    clock_mhz=None,
                )

        changes = [
            StateChange(dev, self._last_devices[dev.id].state if dev.id in self._last_devices else None)
            for dev in devices.values()
            if (dev.id not in self._last_devices and dev.state != STATE_OK)
            or (dev.id in self._last_devices and self._last_devices[dev.id].state != dev.state)
        ]
        self._last_devices = devices

        now = time.monotonic()
        processes = self._processes(devices, usages, now)
        findings = self._audit(processes, now)
        content = (tuple(sorted(devices.values(), key=lambda d: d.index)), tuple(processes), tuple(statuses), findings)
        # The generation is the content's version: readers rebuild their replies only when it changes.
        if self._last_content != content:
            self._generation += 1
            self._last_content = content
        snapshot = Snapshot(
            generation=self._generation,
            taken_at=time.time(),
            devices=content[0],
            processes=content[1],
            backends=content[2],
            findings=findings,
            monotonic=now,
        )
        return snapshot, changes

    def _processes(self, devices: dict[str, Device], usages: list[ProcessUsage], now: float) -> list[GpuProcess]:
        """The GpuProcess records: the last sample's when neither the backends' usages (the same records: backends
        hand back unchanged ones), the devices' numbering nor any re-read host fact changed."""
        inputs = (usages, [(d.id, d.index) for d in devices.values()])
        changed = self._recheck(now)
        if not changed and inputs == self._last_inputs:
            return self._last_processes
        processes = []
        records = {}
        for u in usages:
            dev = devices.get(u.device_id)
            if dev is None:
                continue
            info = self._host_info(u.pid, u.start_time, now)
            if info is None:
                continue  # gone, or the PID was reused since the backend saw it
            rkey = (u.pid, u.start_time, u.device_id)
            last = self._records.get(rkey)
            host = last[4] if last is not None and last[0] is info else None
            if host is not None and last is not None and last[2] == dev.index and last[1] == u:
                record = last[3]  # equal inputs: the same immutable record
            else:
                if host is None:  # new host facts; else a busy client's figures: only the backend's part is new
                    host = {n: getattr(info, n) for n in _FROM_HOST}
                    host.update({n: getattr(info.attribution, n) for n in ATTRIBUTED})
                record = GpuProcess(**host, **{n: getattr(u, n) for n in _FROM_BACKEND}, device=dev.index)
            records[rkey] = (info, u, dev.index, record, host)
            processes.append(record)
        self._records = records
        live = {(u.pid, u.start_time) for u in usages}
        for key in self._known.keys() - live:
            self._forget(key)
        if len(self._due) > 2 * len(self._known) + 64:  # drop the stale heap entries of forgotten processes
            self._due = [(when, key) for when, key in self._due if key in self._known]
            heapq.heapify(self._due)
        processes.sort(key=lambda p: (p.device, p.pid))
        self._last_inputs = inputs
        self._last_processes = processes
        return processes

    def _audit(self, processes: list[GpuProcess], now: float) -> tuple[Finding, ...]:
        if self.audit is None:
            return ()
        try:
            return self.audit(processes, now)
        except Exception:  # a bug in the audit must not cost the sample: the listing and Guard go on without it
            log.exception("the rogue-activity audit failed")
            return ()
