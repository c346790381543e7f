"""DrmBackend: the DRM package's modules put together behind the Backend interface.

Each sample: discover the cards (discovery), read the kernel's client lists where debugfs is readable
(clients, kfd), scan /proc for DRM clients (incrementally, and only the listed ones where it can, scan), turn counters
into utilization against the previous sample (usage), add KFD processes (kfd), read telemetry (telemetry,
rsmi). Resets are planned and run by reset. Every root (/sys, /proc, debugfs) comes from the configuration,
so the tests run all of it on fixture trees.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpukill.errors import DeviceBusy, ResetFailed

from ...config import read_sys_uid_max
from ...model import BackendStatus, DeviceReading
from ...proc.procfs import ProcFS
from .. import Backend, BackendSample
from .clients import read_clients
from .discovery import DrmCard, discover
from .fdinfo import EngineCounters
from .kfd import KfdUsage, read_kfd
from .reset import execute, plan_reset
from .rsmi import RsmiSource, merge
from .scan import ClientRead, FdScanner, holders, is_running, read_start_time
from .telemetry import Telemetry, TelemetryReader
from .usage import (
    UNKNOWN_UID,
    Client,
    Holder,
    UidOf,
    UsageRecords,
    UtilizationTracker,
    device_utilization,
)

log = logging.getLogger(__name__)

# Drivers whose fdinfo carries engine counters: where sysfs has no busy figure, the device's utilization is
# derived from its clients. Others (asahi) report none: their utilization stays unknown.
ENGINE_DRIVERS = {"amdgpu", "i915", "xe", "msm", "panfrost", "panthor", "v3d", "etnaviv", "lima", "powervr"}
WHY_UNAVAILABLE = {
    "asahi": "the asahi driver exports no usage counters in fdinfo and no hwmon sensors",
}


class DrmBackend(Backend):
    name = "drm"

    def __init__(
        self,
        sys_root: str = "/sys",
        proc_root: str = "/proc",
        debugfs_root: str = "/sys/kernel/debug",
        clock: Callable[[], float] = time.monotonic,
        use_rsmi: bool = True,
        revalidate_every: int = 100,
        system_uid_max: int | None = None,
    ) -> None:
        self.sys_root = sys_root
        self.proc_root = proc_root
        self.debugfs_root = debugfs_root
        self.clock = clock  # monotonic seconds; the tests drive it for exact percentages
        self.scanner = FdScanner(proc_root, revalidate_every)
        self.procfs = ProcFS(proc_root)
        # Holders up to this uid are system accounts: a client they share with one user is that user's.
        self.system_uid_max = read_sys_uid_max() if system_uid_max is None else system_uid_max
        self.tracker = UtilizationTracker()
        self.records = UsageRecords()  # last sample's ProcessUsage records, handed back while unchanged
        self.telemetry = TelemetryReader()
        self._use_rsmi = use_rsmi
        self._rsmi: RsmiSource | None = None
        self._notes: dict[str, str] = {}  # card id -> what it cannot report, and why
        self._lock = threading.Lock()  # reset runs in a worker thread while the sampler samples
        self._discovered: list[DrmCard] | None = None  # what status() just found, for the sample() that follows

    # -- status ----------------------------------------------------------------------------------------

    def status(self) -> BackendStatus:
        cards = discover(self.sys_root)
        self._discovered = cards  # the sampler asks status() right before sample(): one sysfs walk serves both
        if not cards:
            return BackendStatus(
                self.name,
                False,
                f"no DRM GPU under {self.sys_root}/class/drm "
                "(display-only devices and cards on NVIDIA's driver are not counted)",
            )
        listed = ", ".join(f"{c.driver} {c.pci_address or c.id}" for c in cards)
        parts = [f"{len(cards)} GPU{'s' if len(cards) > 1 else ''}: {listed}"]
        if self._rsmi is not None and any(c.driver == "amdgpu" for c in cards):
            parts.append(self._rsmi.reason)
        with self._lock:
            parts.extend(self._notes[c.id] for c in cards if c.id in self._notes)
        return BackendStatus(self.name, True, "; ".join(parts))

    # -- sampling --------------------------------------------------------------------------------------

    def _rsmi_source(self, cards: list[DrmCard]) -> RsmiSource | None:
        if self._use_rsmi and self._rsmi is None and any(c.driver == "amdgpu" for c in cards):
            self._rsmi = RsmiSource()  # only on hosts with an AMD GPU; imports pyrsmi if installed
        return self._rsmi

    def _fdinfo_clients(
        self,
        reads: list[ClientRead],
        by_minor: dict[int, DrmCard],
        now: float,
        clients: dict[tuple, Client],
        incomplete: set[str],
    ) -> None:
        for r in reads:
            card = by_minor.get(r.minor)
            if card is None:
                continue  # a DRM device we do not list (display-only, NVIDIA's)
            holder = (r.start_time, r.pid)
            info = r.info
            if info is None or info.client_id is None:
                key: tuple = (card.id, "fd", r.pid, r.start_time, r.fd)  # no id: cannot be matched to others
            else:
                key = (card.id, info.client_id)
            if info is None:
                incomplete.add(card.id)
                clients[key] = Client(key, card.id, {holder}, None)
                continue
            known = clients.get(key)
            if known is not None:  # the same client through a dup'ed or inherited fd: count it once
                known.holders.add(holder)
                continue
            has_usage_keys = bool(info.engines or info.regions)  # asahi prints neither: usage unknown
            engines = self.tracker.update(key, info.engines, now) if has_usage_keys else None
            clients[key] = Client(
                key,
                card.id,
                {holder},
                engines,
                info.regions,
                has_usage_keys=has_usage_keys,
                region_key=info.region_lines,
            )

    def _listed_clients(self, cards: list[DrmCard], kfd: list[KfdUsage]) -> dict[int, tuple] | None:
        """Every process the kernel names as a client of these cards, with its entry (rows per card, KFD), or
        None if a card's list cannot be read (then the scanner walks every fd table, as without debugfs)."""
        listed: dict[int, tuple] = {k.pid: ("kfd",) for k in kfd}
        for card in cards:
            rows = read_clients(self.debugfs_root, card.card_minor, card.pci_address)
            if rows is None:
                return None
            for tgid, count in rows.items():
                listed[tgid] = listed.get(tgid, ()) + ((card.card_minor, count),)
        return listed

    def _kfd_clients(
        self, kfd: list[KfdUsage], by_minor: dict[int, DrmCard], now: float, clients: dict[tuple, Client]
    ) -> None:
        for k in kfd:
            card = by_minor.get(k.render_minor)
            start_time = read_start_time(self.proc_root, k.pid)
            if card is None or start_time is None:
                continue
            key = (card.id, "kfd", k.pid, start_time)
            sdma = None
            if k.sdma_us is not None:
                sdma = self.tracker.update(key, {"sdma": EngineCounters(busy_ns=k.sdma_us * 1000)}, now)
            occupancy = None
            if k.cu_occupancy is not None and k.compute_units:
                occupancy = min(1.0, k.cu_occupancy / k.compute_units)
            clients[key] = Client(
                key, card.id, {(start_time, k.pid)}, sdma, has_usage_keys=True, occupancy=occupancy, kfd_vram=k.vram
            )

    def _holder_uids(self) -> UidOf:
        """uid_of for process_usages, asked only about clients with several holders; one read per holder."""
        known: dict[Holder, int | None] = {}

        def uid_of(holder: Holder) -> int | None:
            if holder not in known:
                start_time, pid = holder
                uid = self.procfs.uid(pid)
                # Read after the uid: the same start time means the uid was that holder's, not a newcomer's.
                if read_start_time(self.proc_root, pid) != start_time:
                    known[holder] = None  # gone since the scan: it holds nothing now
                else:
                    known[holder] = UNKNOWN_UID if uid is None else uid
            return known[holder]

        return uid_of

    def _note(self, card: DrmCard, t: Telemetry, utilization: float | None) -> str | None:
        missing = []
        if utilization is None and card.driver not in ENGINE_DRIVERS:
            missing.append("utilization")
        if t.memory_used is None and t.memory_total is None:
            missing.append("memory")
        if t.temperature is None:
            missing.append("temperature")
        if not missing:
            return None
        why = WHY_UNAVAILABLE.get(card.driver, f"not exported by the {card.driver} driver")
        return f"{card.driver} {card.pci_address or card.id}: no {', '.join(missing)} ({why})"

    def sample(self) -> BackendSample:
        now = self.clock()
        cards, self._discovered = self._discovered or discover(self.sys_root), None
        by_minor = {m: c for c in cards for m in (c.card_minor, c.render_minor)}
        clients: dict[tuple, Client] = {}
        incomplete: set[str] = set()  # devices with a client whose fdinfo could not be read
        kfd = read_kfd(self.sys_root)
        reads = self.scanner.scan(self._listed_clients(cards, kfd))
        self._fdinfo_clients(reads, by_minor, now, clients, incomplete)
        self._kfd_clients(kfd, by_minor, now, clients)
        self.tracker.end_round()

        sample = BackendSample(processes=self.records.build(clients.values(), self._holder_uids(), self.system_uid_max))
        rsmi = self._rsmi_source(cards)
        notes = {}
        for card in cards:
            t = self.telemetry.read(card, now)
            if card.driver == "amdgpu" and rsmi is not None:
                t = merge(rsmi.read(card.pci_address), t)
            utilization = t.utilization
            if utilization is None and card.driver in ENGINE_DRIVERS:
                on_card = [c for c in clients.values() if c.device_id == card.id]
                utilization = device_utilization(on_card, card.id not in incomplete)
            if (note := self._note(card, t, utilization)) is not None:
                notes[card.id] = note
            sample.devices.append(
                DeviceReading(
                    id=card.id,
                    vendor=card.vendor,
                    name=card.name,
                    pci_bus_id=card.pci_address,
                    utilization=utilization,
                    memory_used=t.memory_used,
                    memory_total=t.memory_total,
                    temperature=t.temperature,
                    power=t.power,
                    clock_mhz=t.clock_mhz,
                )
            )
        self.telemetry.forget({c.id for c in cards})
        with self._lock:
            self._notes = notes
        return sample

    # -- reset -----------------------------------------------------------------------------------------

    def _plan(self, device_id: str):
        cards = discover(self.sys_root)  # fresh: the device may have gone since the last sample
        card = next((c for c in cards if c.id == device_id), None)
        if card is None:
            raise ResetFailed(f"device {device_id} is no longer present")
        return plan_reset(card, cards, self.sys_root, self.debugfs_root)

    def check_reset(self, device_id: str) -> None:
        self._plan(device_id)

    def reset(self, device_id: str) -> str:
        """Reset, after a full scan finds nobody on the GPU (or on an XGMI peer, which is reset with it).

        The caller cleared the holders it knew of from the last sample; the incremental scan may lag behind
        an fd number reused between two samples, so this look is a full one, however long it takes."""
        plan = self._plan(device_id)
        cards = [plan.card] + [c for c in discover(self.sys_root) if (c.pci_address or c.id) in plan.peers]
        minors = {m for c in cards for m in (c.card_minor, c.render_minor)}
        pids = set(holders(self.proc_root, minors))
        pids.update(
            k.pid for k in read_kfd(self.sys_root) if k.render_minor in minors and is_running(self.proc_root, k.pid)
        )
        if pids:
            where = f"{plan.card.pci_address or plan.card.id}" + (" or its XGMI peers" if plan.peers else "")
            listed = ", ".join(map(str, sorted(pids)[:8]))
            raise DeviceBusy(f"{len(pids)} process(es) hold {where}: {listed}; nothing was reset{plan.peers_note}")
        return execute(plan)

    def close(self) -> None:
        """Shut down ROCm SMI (pyrsmi) and let go of /proc descriptors, after a reload replaced this backend.
        Idempotent."""
        self._use_rsmi = False  # a sample after this must not open a ROCm SMI session that nothing would close
        self.scanner.close()  # the holders' /proc descriptors (the sampler no longer samples this backend)
        if self._rsmi is not None:
            self._rsmi.close()
