"""The sampler: one thread that reads every backend at a fixed interval into an immutable Snapshot.

D-Bus reads are served from the latest snapshot, never by touching vendors per call. The thread pings the
systemd watchdog (after a sample, and while sleeping between samples) only when the daemon's main loop has
taken the latest snapshot it published (`taken`): a backend that hangs stops the pings, and so does a main
loop that hangs, even in a call that lets this thread run on (a blocking syscall releases the interpreter
lock). Either way systemd restarts the daemon.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .backends import Backend, BackendSample
from .model import (
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
from .procfs import ProcFS, ProcInfo

log = logging.getLogger(__name__)

# A GpuProcess joins what /proc says (ProcInfo, its cgroup attribution flat) with what its backend says
# (ProcessUsage), field by name, and the device's global index.
_FROM_HOST = tuple(f.name for f in dataclasses.fields(ProcInfo) if f.name != "attribution")
_FROM_BACKEND = tuple(f.name for f in dataclasses.fields(ProcessUsage) if f.name not in _FROM_HOST)

INFO_TTL = 10.0  # seconds before cmdline, exe and cgroup of a process are read again (cgroup moves are rare)


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
    ) -> None:
        self.backends = list(backends)
        self.interval = interval
        self.procfs = procfs
        self._publish = publish
        # The rogue-activity audit (rogue_watch.RogueWatch): it sees every sample's processes, here in this thread.
        self.audit = audit
        self._watchdog = watchdog
        # Ping at least every watchdog_interval while idle; sampling itself must finish within WatchdogSec.
        self._ping_every = min(interval, watchdog_interval) if watchdog_interval else interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._generation = 0
        self._last_content: tuple | None = None
        self._index_of: dict[str, int] = {}  # device id -> global index, stable for the daemon's life
        self._last_devices: dict[str, Device] = {}
        self._last_samples: dict[str, BackendSample] = {}
        self._info_cache: dict[tuple[int, int], tuple[ProcInfo, float]] = {}
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

    def _host_info(self, pid: int, start_time: int, now: float) -> ProcInfo | None:
        """/proc facts, cached per (pid, start time). stat is read every time because exec and prctl change
        the name without changing the start time; the rest (cmdline, exe, cgroup) is refreshed with it."""
        stat = self.procfs.stat(pid)
        if stat is None or stat.start_time != start_time:
            return None
        cached = self._info_cache.get((pid, start_time))
        if cached and cached[0].comm == stat.comm and now - cached[1] < INFO_TTL:
            return cached[0]
        info = self.procfs.info(pid, stat)
        if info is not None:
            self._info_cache[(pid, start_time)] = (info, now)
        return info

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
                    old, state=STATE_LOST, state_reason="no longer reported by its backend",
                    utilization=None, memory_used=None, temperature=None, power=None, clock_mhz=None,
                )

        changes = [
            StateChange(dev, self._last_devices[dev.id].state if dev.id in self._last_devices else None)
            for dev in devices.values()
            if (dev.id not in self._last_devices and dev.state != STATE_OK)
            or (dev.id in self._last_devices and self._last_devices[dev.id].state != dev.state)
        ]
        self._last_devices = devices

        processes = []
        live_keys = set()
        now = time.monotonic()
        for u in usages:
            dev = devices.get(u.device_id)
            if dev is None:
                continue
            key = (u.pid, u.start_time)
            live_keys.add(key)
            info = self._host_info(u.pid, u.start_time, now)
            if info is None:
                continue  # gone, or the PID was reused since the backend saw it
            processes.append(GpuProcess(**{n: getattr(info, n) for n in _FROM_HOST},
                                        **{n: getattr(info.attribution, n) for n in ATTRIBUTED},
                                        **{n: getattr(u, n) for n in _FROM_BACKEND}, device=dev.index))
        for key in self._info_cache.keys() - live_keys:
            del self._info_cache[key]

        processes.sort(key=lambda p: (p.device, p.pid))
        findings = self._audit(processes, now)
        content = (tuple(sorted(devices.values(), key=lambda d: d.index)), tuple(processes), tuple(statuses),
                   findings)
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
        )
        return snapshot, changes

    def _audit(self, processes: list[GpuProcess], now: float) -> tuple[Finding, ...]:
        if self.audit is None:
            return ()
        try:
            return self.audit(processes, now)
        except Exception:  # a bug in the audit must not cost the sample: the listing and Guard go on without it
            log.exception("the rogue-activity audit failed")
            return ()
