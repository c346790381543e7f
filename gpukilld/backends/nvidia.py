"""NVIDIA GPUs through NVML (pynvml, from the nvidia-ml-py package).

What a device cannot tell (NOT_SUPPORTED) is None, never 0. A device that reports GPU_IS_LOST or
RESET_REQUIRED is marked lost while the others keep updating. The devices are read off the sampler's thread with a
deadline, so an NVML call that hangs marks that device lost instead of stopping the sampler: by one reader
thread, all of them in turn, while none hangs, and a GPU the reader had not come to when one hung by a thread of
its own (see NvidiaBackend._read_all). Process
lists are sanity-checked against /proc, since a driver and bindings that disagree on the struct version of
the _v2/_v3 calls produce garbage PIDs and sizes; then the unversioned (v1) call is used instead.

Memory, of a GPU and of a MIG instance alike, is read through nvmlMemory_v2_t, whose `used` is allocated memory
only (nvml.h); the v1 struct, whose `used` adds the memory the driver reserves (hundreds of MiB on a GPU, 128 MiB
seen on an instance), only where the driver has no v2. Used memory then means the same for a GPU, its
instances and the processes on them, as in nvidia-smi and nvitop.

An idle host costs little: a sample makes only the NVML calls whose answers can change (a device's
handle and identity are read once; each process list is one call into a buffer kept between samples, where
pynvml makes two and builds an object per process), and a GPU process's start time is read from /proc once,
then held by the exit watch the simulated backend uses (gpukilld/proc/exit_watch.py): it is read again only
when its pidfd says it ended or when its PID is new to the lists. (No rotation reads it again besides: a pidfd
names one process for good and says when it ends, and a start time cannot change while its process lives. A
rotation reading each start time every 60-90 s would make ~27 reads a second on 8 x 256 that tell
nothing the watch does not.)
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import shutil
import struct
import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gpukill.device_faults import xid_reason
from gpukill.errors import NotSupported, ResetFailed
from gpukill.units import format_duration

from ..model import STATE_ERROR, STATE_LOST, STATE_OK, BackendStatus, DeviceReading, ProcessUsage
from ..proc.exit_watch import ExitWatch
from ..proc.procfs import ProcFS
from . import Backend, BackendSample

log = logging.getLogger(__name__)

DEVICE_DEADLINE = 2.0  # seconds one device may take to answer in one sample before it is marked lost
RESET_TIMEOUT = 120.0
RETRY_MIN, RETRY_MAX = 5.0, 300.0  # back-off between attempts to initialise NVML
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of a process outside MIG
VALUE_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE as an unsigned long long: memory NVML does not know
# nvmlProcessInfo_v2_t (the _v3 calls' record, pynvml's c_nvmlProcessInfo_v3_t) in the C layout: pid, memory,
# GPU instance, compute instance (24 bytes on x86-64 and arm64). Unpacked in one C call, not field by field
# through ctypes; tests/test_nvidia.py checks the values against the fake library's.
PROCESS_INFO = struct.Struct("@IQII")
PROCESS_KINDS = ("Compute", "Graphics", "MPSCompute")  # the three process lists, merged by PID
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
FI_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
RECOVERY_ACTIONS = {
    1: "GPU reset",
    2: "node reboot",
    3: "drain peer-to-peer",
    4: "drain and reset",
    5: "recover IMEX domain",
    6: "bus reset",
    7: "system reboot",
}


class _ProcessInfoV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _Worker:
    """A reader: a daemon thread running the calls queued to it, one at a time, in order.

    Not a ThreadPoolExecutor: Python joins a pool's threads at exit, so one stuck in a hung NVML call would hang
    gpukilld's exit, and how many threads a pool keeps depends on timing. Here each thread is one of ours, which
    stop() ends without waiting for it: at once if idle, else when the call it is in returns. A call cancelled
    before its turn (Future.cancel) is skipped."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> Future:
        return self.submit_all([(fn, args)])[0]

    def submit_all(self, calls: list[tuple]) -> list[Future]:
        """Each (fn, args) as a future of its own, all in one hand-over: the thread is woken once for them."""
        batch: list[tuple[Future, Any, tuple]] = [(Future(), fn, args) for fn, args in calls]
        self._calls.put(batch)
        return [fut for fut, _, _ in batch]

    def stop(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (batch := self._calls.get()) is not None:
            for fut, fn, args in batch:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(*args))
                except Exception as e:
                    fut.set_exception(e)


@dataclass
class _DeviceState:
    """What we remember about one physical GPU between samples."""

    index: int
    uuid: str | None = None
    name: str = "NVIDIA GPU"
    pci_bus_id: str | None = None
    last_util_ts: int = 0
    handle: object = None  # NVML's handle for this GPU: fixed for the life of the NVML session, read once
    lists: dict = field(default_factory=dict)  # process-list symbol -> the record buffer kept between samples
    # The last sample's three lists as NVML wrote them and what was made of them (merged by PID, then the
    # listed entries): the same bytes, total memory, instances and utilization make the same entries, so an
    # unchanged GPU's are handed back without decoding or checking them again (the sampler compares by identity).
    merged: tuple | None = None  # ((raw lists, total), {pid: (memory, gi, ci)})
    listed: tuple | None = None  # ((merged, instances, utilization), [Listed])
    pending: Future | None = None  # a read still running from an earlier sample (a hung call)
    worker: _Worker | None = None  # this GPU's own reader, started the first time another GPU's call hung
    error: str = ""  # an Xid / recovery action reported since the last successful reset
    mig_names: dict[str, str] = field(default_factory=dict)

    @property
    def device_id(self) -> str:
        """The UUID; before it could ever be read (lost from the start), the PCI address or the index."""
        return self.uuid or self.pci_bus_id or f"nvidia:{self.index}"


Listed = tuple[int, str, "int | None", "float | None"]  # (pid, device id, memory, utilization) from NVML


@dataclass
class _DeviceRead:
    devices: list[DeviceReading]
    processes: list[Listed]  # start times are added on the sampling thread (_with_start_times)


class NvidiaBackend(Backend):
    name = "nvidia"

    def __init__(
        self, procfs: ProcFS | None = None, nvidia_smi: str = "nvidia-smi", device_deadline: float = DEVICE_DEADLINE
    ) -> None:
        self.procfs = procfs or ProcFS()
        self.nvidia_smi = nvidia_smi
        self.device_deadline = device_deadline
        self._nvml: Any = None  # the pynvml module (untyped) once NVML is initialised
        self._status = BackendStatus(self.name, False, "not initialised yet")
        self.driver_version: str | None = None  # NVML's, once initialised: what suspend's refusals read
        self._next_attempt = 0.0
        self._retry = RETRY_MIN
        self._devices: dict[int, _DeviceState] = {}
        # The reader that reads every GPU in turn (_read_all), and the reads it was last given: one still running
        # at the next sample is a hung call, which that reader is left to.
        self._reader: _Worker | None = None
        self._reader_reads: list[Future] = []
        self._readers_started = 0
        self._events = None
        # The start time of each listed GPU process, valid while the exit watch holds it (until its pidfd says it
        # ended). Without a watch (a fixture /proc) every sample reads them all.
        self._watch = ExitWatch() if self.procfs.is_this_hosts() else None
        self._start_times: dict[int, int] = {}  # pid -> start time, of the processes the watch follows
        # The last sample's lists and the records made from them: the same records while nothing changed, so
        # that the sampler tells at once that they are (equal lists of the same objects) and reuses what it built.
        self._last: tuple[list[Listed], list[ProcessUsage]] = ([], [])
        # Held by status() and sample(), so that close() (from another thread, after a reload replaced this
        # backend) never pulls NVML from under a sample in progress, nor initialises NVML again after it.
        self._lock = threading.Lock()
        self._closed = False

    # -- initialisation with back-off -------------------------------------------------------------------

    def status(self) -> BackendStatus:
        with self._lock:
            self._ensure_init()
            return self._status

    def _ensure_init(self) -> None:
        if self._closed or self._nvml is not None or time.monotonic() < self._next_attempt:
            return
        try:
            import pynvml
        except ImportError:
            self._fail("the nvidia-ml-py package (pynvml) is not installed")
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            self._fail("no NVIDIA driver: libnvidia-ml.so.1 not found")
            return
        except pynvml.NVMLError as e:
            self._fail(f"NVML could not start: {e}")
            return
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()  # one per nvmlInit: else every retry would leave NVML initialised once more
            self._fail(f"NVML could not start: {e}")
            return
        self._nvml = pynvml
        self.driver_version = driver.decode() if isinstance(driver, bytes) else str(driver)
        self._retry = RETRY_MIN
        self._events = self._register_events(pynvml, count)
        self._status = BackendStatus(self.name, True, f"NVML, driver {driver}, {count} GPUs")

    def _fail(self, why: str) -> None:
        self._status = BackendStatus(self.name, False, f"{why}; retrying in {format_duration(self._retry)}")
        self._next_attempt = time.monotonic() + self._retry
        self._retry = min(self._retry * 2, RETRY_MAX)

    @staticmethod
    def _register_events(nv, count: int):
        try:
            events = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            return None
        for i in range(count):
            with contextlib.suppress(nv.NVMLError):  # a device without event support reports no Xids
                nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(i), XID_EVENT, events)
        return events

    # -- sampling -------------------------------------------------------------------------------------------

    def sample(self) -> BackendSample:
        with self._lock:
            return self._sample()

    def _sample(self) -> BackendSample:
        self._ensure_init()
        nv = self._nvml
        if nv is None or self._closed:
            return BackendSample()
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as e:
            raise RuntimeError(f"NVML stopped answering: {e}") from None
        self._drain_xid_events()
        reads = self._read_all([self._devices.setdefault(i, _DeviceState(i)) for i in range(count)])
        sample = BackendSample()
        listed: list[Listed] = []
        for i in range(count):
            state = self._devices[i]
            fut = reads.get(i)
            try:
                if fut is None or not fut.done():
                    raise TimeoutError
                read = fut.result()
            except TimeoutError:
                sample.devices.append(self._lost(state, f"NVML did not answer within {self.device_deadline:g}s"))
                continue
            except Exception as e:  # a bug in reading one device must not hide the others
                log.error("reading NVIDIA GPU %d failed: %s", i, e)
                sample.devices.append(self._lost(state, f"read failed: {e}"))
                continue
            sample.devices.extend(read.devices)
            listed.extend(read.processes)
        sample.processes = self._with_start_times(listed)
        return sample

    def _read_all(self, states: list[_DeviceState]) -> dict[int, Future]:
        """Each GPU's read of this sample, by index; one that did not answer within the deadline is not done.

        One reader thread reads them all in turn: one hand-over a sample, where a thread per GPU costs eight,
        whose wake-ups and GIL hand-offs take ~1 ms a sample on 8 GPUs against 0.2 ms of reading.
        A hung call must still cost only its own GPU: a GPU whose read of an earlier sample has not returned is
        not read again; when the deadline passes, the reads the reader had not come to are
        cancelled and each is given to a thread of that GPU's own, with a deadline of its own; and a reader
        still inside a call at the next sample is left to it (it ends when the call returns), a new one reading
        the others. So a sample waits at most twice the deadline, once for the reader and once for the GPUs it
        left, however many hang."""
        if any(not fut.done() for fut in self._reader_reads) and self._reader is not None:
            self._reader.stop()
            self._reader = None
        if self._reader is None:
            self._readers_started += 1
            self._reader = _Worker(f"nvml-reader-{self._readers_started}")
        due = [s for s in states if s.pending is None or s.pending.done()]  # not still stuck in an earlier call
        futures = self._reader.submit_all([(self._read_device, (s,)) for s in due])
        self._reader_reads = futures
        reads: dict[int, Future] = {}
        for state, fut in zip(due, futures, strict=True):
            state.pending = reads[state.index] = fut
        if not futures:
            return reads
        with contextlib.suppress(TimeoutError):  # the reads' own outcomes are the caller's to read
            futures[-1].exception(timeout=self.device_deadline)  # in turn: the last done means all are
        left = [s for s, fut in zip(due, futures, strict=True) if fut.cancel()]  # the reader never came to them
        if not left:
            return reads
        for state in left:
            if state.worker is None:
                state.worker = _Worker(f"nvml-{state.index}")
            state.pending = reads[state.index] = state.worker.submit(self._read_device, state)
        deadline = time.monotonic() + self.device_deadline
        for state in left:
            with contextlib.suppress(TimeoutError):
                reads[state.index].exception(timeout=max(0.0, deadline - time.monotonic()))
        return reads

    def _with_start_times(self, listed: list[Listed]) -> list[ProcessUsage]:
        """The listed processes with their start times; one /proc no longer has (exited, or in a PID namespace
        we cannot see) is left out. Run on the sampling thread only: the exit watch is not shared with workers."""
        known = self._start_times
        watch = self._watch
        due: set[int] = set()
        start: int | None
        if watch is not None:
            for pid, start in watch.ended():
                if known.get(pid) == start:
                    due.add(pid)  # ended, or its PID reused: read it again if it is still listed
            if listed == self._last[0]:
                # Nothing listed changed: read the ended ones' start times again (a PID the lists still name may
                # be a new process's); while none is, the last records still hold. A changed one leaves every due
                # one read: none is due.
                if self._still_as_they_were(due):
                    return list(self._last[1])
                due = set()
        out = []
        # The last sample's records by what NVML said, for those whose start time is as it was: the same objects,
        # so the sampler still compares by identity.
        records = {(p.pid, p.device_id, p.gpu_memory, p.gpu_utilization): p for p in self._last[1]}
        for item in listed:
            pid, device_id, memory, util = item
            if watch is None:
                start = self.procfs.start_time(pid)
            elif pid in known and pid not in due:
                start = known[pid]
            else:
                start = self._read_start(pid)
                due.discard(pid)
            if start is None:
                continue
            last = records.get(item)
            out.append(
                last
                if last is not None and last.start_time == start
                else ProcessUsage(pid, start, device_id, memory, util)
            )
        if watch is not None:
            for pid in due | (known.keys() - {p.pid for p in out}):  # ended and not listed, or no longer listed
                self._forget(pid)
            # Reused next time only if the watch holds every listed process: the end of any other would go unseen.
            self._last = (listed, out) if all(pid in known for pid, *_ in listed) else ([], [])
        return list(out)

    def _still_as_they_were(self, due: set[int]) -> bool:
        """Read each due PID's start time again; whether every one is followed with the start time it had."""
        same = True
        for pid in due:
            old = self._start_times.get(pid)
            if self._read_start(pid) != old or pid not in self._start_times:
                same = False
        return same

    def _read_start(self, pid: int) -> int | None:
        old = self._start_times.get(pid)
        start = self.procfs.start_time(pid)
        if old is not None and old != start:
            self._forget(pid)
        if start is None or self._watch is None or not self._watch.follow(pid, start):
            self._start_times.pop(pid, None)  # gone, or cannot be followed: read it each sample instead
            return start
        self._start_times[pid] = start
        return start

    def _forget(self, pid: int) -> None:
        old = self._start_times.pop(pid, None)
        if old is not None and self._watch is not None:  # start times are kept only while a watch follows them
            self._watch.forget((pid, old))

    def _lost(self, state: _DeviceState, reason: str) -> DeviceReading:
        return DeviceReading(
            id=state.device_id,
            vendor="nvidia",
            name=state.name,
            pci_bus_id=state.pci_bus_id,
            state=STATE_LOST,
            state_reason=reason,
        )

    def _get(self, fn, *args, default=None):
        """One NVML getter: NOT_SUPPORTED and friends give `default` (None: unknown, never 0)."""
        nv = self._nvml
        try:
            return fn(*args)
        except (nv.NVMLError_GpuIsLost, nv.NVMLError_ResetRequired):
            raise
        except nv.NVMLError:
            return default

    def _read_device(self, state: _DeviceState) -> _DeviceRead:
        nv = self._nvml
        try:
            if state.handle is None:
                state.handle = nv.nvmlDeviceGetHandleByIndex(state.index)
            handle = state.handle
            if state.uuid is None:  # identity does not change: read it once
                state.uuid = nv.nvmlDeviceGetUUID(handle)
                state.name = nv.nvmlDeviceGetName(handle)
                state.pci_bus_id = self._get(lambda: nv.nvmlDeviceGetPciInfo(handle).busId)
                if isinstance(state.pci_bus_id, bytes):
                    state.pci_bus_id = state.pci_bus_id.decode()
            return self._read_live(state, handle)
        except nv.NVMLError_GpuIsLost:
            return _DeviceRead([self._lost(state, "NVML: GPU is lost")], [])
        except nv.NVMLError_ResetRequired:
            return _DeviceRead([self._lost(state, "NVML: GPU requires a reset")], [])

    def _read_live(self, state: _DeviceState, handle) -> _DeviceRead:
        nv = self._nvml
        util = self._get(nv.nvmlDeviceGetUtilizationRates, handle)
        memory = self._memory(handle)
        temperature = self._get(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
        power_mw = self._get(nv.nvmlDeviceGetPowerUsage, handle)
        limit_mw = self._get(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
        mig = self._get(nv.nvmlDeviceGetMigMode, handle)
        mig_on = None if mig is None else bool(mig[0])
        total = memory.total if memory is not None else None
        device = DeviceReading(
            id=state.device_id,
            vendor="nvidia",
            name=state.name,
            pci_bus_id=state.pci_bus_id,
            utilization=float(util.gpu) if util is not None else None,
            memory_used=memory.used if memory is not None else None,
            memory_total=total,
            temperature=float(temperature) if temperature is not None else None,
            power=power_mw / 1000 if power_mw is not None else None,
            power_limit=limit_mw / 1000 if limit_mw is not None else None,
            mig_mode=mig_on,
            state=STATE_ERROR if state.error else STATE_OK,
            state_reason=state.error,
        )
        instances = self._mig_instances(state, handle) if mig_on else {}
        usage = self._process_util(state, handle)
        merged = self._running_processes(state, handle, total)
        ids = {key: uuid for key, (uuid, _) in instances.items()}
        if state.listed is not None and state.listed[0][0] is merged and state.listed[0][1:] == (ids, usage):
            processes = state.listed[1]
        else:
            processes = []
            for pid, (memory_used, gi, ci) in merged.items():
                device_id = ids.get((gi, ci), device.id)
                util_pct = None if usage is None else float(usage.get(pid, 0))
                processes.append((pid, device_id, memory_used, util_pct))
            state.listed = ((merged, ids, usage), processes)
        devices = [device] + [reading for _, reading in instances.values()]
        return _DeviceRead(devices, processes)

    def _memory(self, handle):
        """A GPU's or MIG instance's memory: the v2 struct, or v1 where the driver lacks v2 (one older than
        NVML 11.6/11.7, or a device that does not support it); None when unknown. See the module's docstring."""
        nv = self._nvml
        try:
            return nv.nvmlDeviceGetMemoryInfo(handle, nv.nvmlMemory_v2)
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound, nv.NVMLError_ArgumentVersionMismatch):
            return self._get(nv.nvmlDeviceGetMemoryInfo, handle)
        except (nv.NVMLError_GpuIsLost, nv.NVMLError_ResetRequired):
            raise
        except nv.NVMLError:
            return None

    def _mig_instances(self, state: _DeviceState, handle) -> dict[tuple[int, int], tuple[str, DeviceReading]]:
        """MIG instances as devices of their own, keyed by (GPU instance, compute instance)."""
        nv = self._nvml
        found = {}
        count = self._get(nv.nvmlDeviceGetMaxMigDeviceCount, handle, default=0)
        for i in range(count):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except nv.NVMLError_NotFound:
                continue
            except nv.NVMLError:
                break
            uuid = self._get(nv.nvmlDeviceGetUUID, mig)
            gi = self._get(nv.nvmlDeviceGetGpuInstanceId, mig)
            ci = self._get(nv.nvmlDeviceGetComputeInstanceId, mig)
            if uuid is None or gi is None or ci is None:
                continue
            memory = self._memory(mig)
            state.mig_names[uuid] = f"{state.name} MIG {gi}/{ci}"
            found[(gi, ci)] = (
                uuid,
                DeviceReading(
                    id=uuid,
                    vendor="nvidia",
                    name=f"{state.name} MIG {gi}/{ci}",
                    pci_bus_id=state.pci_bus_id,
                    memory_used=memory.used if memory is not None else None,
                    memory_total=memory.total if memory is not None else None,
                    parent_id=state.uuid,
                ),
            )
        return found

    def _process_util(self, state: _DeviceState, handle) -> dict[int, int] | None:
        """SM utilization per PID since the last sample; NOT_FOUND means no samples, i.e. 0 % for everyone."""
        nv = self._nvml
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(handle, state.last_util_ts)
        except nv.NVMLError_NotFound:
            return {}
        except (nv.NVMLError_GpuIsLost, nv.NVMLError_ResetRequired):
            raise
        except nv.NVMLError:
            return None
        latest: dict[int, tuple[int, int]] = {}
        for s in samples:
            if s.pid not in latest or s.timeStamp > latest[s.pid][0]:
                latest[s.pid] = (s.timeStamp, s.smUtil)
            state.last_util_ts = max(state.last_util_ts, s.timeStamp)
        return {pid: min(100, sm) for pid, (_, sm) in latest.items()}

    def _running_processes(
        self, state: _DeviceState, handle, total: int | None
    ) -> dict[int, tuple[int | None, int, int]]:
        """Compute, graphics and MPS lists merged by PID: {pid: (memory, gpu instance, compute instance)}; the
        last sample's dict itself when NVML wrote the same bytes."""
        raws = tuple(
            self._get(self._process_list, state, handle, f"nvmlDeviceGet{kind}RunningProcesses_v3", default=b"")
            for kind in PROCESS_KINDS
        )
        key = (raws, total)
        if state.merged is not None and state.merged[0] == key:
            return state.merged[1]
        merged: dict[int, tuple[int | None, int, int]] = {}
        reusable = True
        for kind, raw in zip(PROCESS_KINDS, raws, strict=True):
            if isinstance(raw, bytes):
                records = [
                    (pid, None if memory == VALUE_NOT_AVAILABLE else memory, gi, ci)
                    for pid, memory, gi, ci in PROCESS_INFO.iter_unpack(raw)
                ]
            else:  # read through pynvml or the v1 call: no bytes to compare next time
                records, reusable = raw, False
            if not self._plausible(records, total):
                log.warning("NVML %s process list looks like a struct-version mismatch; using the v1 call", kind)
                records = self._v1_processes(handle, f"nvmlDeviceGet{kind}RunningProcesses")
                reusable = False
            for pid, memory, gi, ci in records:
                old = merged.get(pid)
                if old is None or (memory or 0) > (old[0] or 0):
                    merged[pid] = (memory, gi, ci)
        state.merged = (key, merged) if reusable else None
        return merged

    def _process_list(self, state: _DeviceState, handle, symbol: str) -> bytes | list[tuple[int, int | None, int, int]]:
        """One process list, as pynvml's _v3 wrapper reads it (the same struct), in one call while the buffer
        kept from the last sample is large enough (pynvml asks for the size each time, then decodes each
        record into an object of its own): its records' bytes, PROCESS_INFO each; or the records, decoded, where
        it is read through pynvml or the v1 call."""
        nv = self._nvml
        if ctypes.sizeof(nv.c_nvmlProcessInfo_v3_t) != PROCESS_INFO.size:  # a pynvml whose record differs from ours
            return [(p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) for p in getattr(nv, symbol)(handle)]
        try:
            fn = nv._nvmlGetFunctionPointer(symbol)
        except nv.NVMLError_FunctionNotFound:  # a driver older than the _v3 calls (before 510)
            return self._v1_processes(handle, symbol.removesuffix("_v3"))
        buf = state.lists.get(symbol)
        count = ctypes.c_uint(0 if buf is None else len(buf))
        ret = fn(handle, ctypes.byref(count), buf)
        if ret == nv.NVML_ERROR_INSUFFICIENT_SIZE:  # more processes than the buffer holds: grow it, as pynvml does
            buf = state.lists[symbol] = (nv.c_nvmlProcessInfo_v3_t * (count.value * 2 + 5))()
            count.value = len(buf)
            ret = fn(handle, ctypes.byref(count), buf)
        if ret != nv.NVML_SUCCESS:
            raise nv.NVMLError(ret)
        if count.value == 0 or buf is None:  # none listed (a buffer is grown whenever one is)
            return b""
        return ctypes.string_at(buf, min(count.value, len(buf)) * PROCESS_INFO.size)

    def _plausible(self, records: list[tuple], total: int | None) -> bool:
        known = self._start_times  # followed GPU processes: alive, and no kernel thread, when last read
        for pid, memory, gi, ci in records:
            if pid <= 0 or pid > 2**22:
                return False
            if pid not in known and ((stat := self.procfs.stat(pid)) is None or stat.is_kernel_thread):
                return False
            if memory is not None and total is not None and memory > total:
                return False
            if (gi == NO_INSTANCE) != (ci == NO_INSTANCE) or (gi != NO_INSTANCE and gi > 64):
                return False
        return True

    def _v1_processes(self, handle, symbol: str) -> list[tuple[int, int | None, int, int]]:
        nv = self._nvml
        try:
            fn = nv._nvmlGetFunctionPointer(symbol)
        except nv.NVMLError:
            return []
        count = ctypes.c_uint(0)
        ret = fn(handle, ctypes.byref(count), None)
        if ret == nv.NVML_SUCCESS or ret != nv.NVML_ERROR_INSUFFICIENT_SIZE:
            return []
        count.value = count.value * 2 + 5
        buf = (_ProcessInfoV1 * count.value)()
        if fn(handle, ctypes.byref(count), buf) != nv.NVML_SUCCESS:
            return []
        out = []
        for p in buf[: count.value]:
            memory = None if p.usedGpuMemory == 2**64 - 1 else p.usedGpuMemory
            out.append((p.pid, memory, NO_INSTANCE, NO_INSTANCE))
        return out

    # -- Xid events -------------------------------------------------------------------------------------

    def _drain_xid_events(self) -> None:
        nv = self._nvml
        if self._events is None:
            return
        for _ in range(64):  # bounded: a storm of events must not stall the sample
            try:
                event = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:
                return  # timeout: nothing pending
            if event.eventType != XID_EVENT:
                continue
            index = self._index_of_handle(event.device)
            if index is None:
                continue
            state = self._devices.setdefault(index, _DeviceState(index))
            state.error = xid_reason(event.eventData, self._recovery_action(event.device))  # Guard reads it back

    def _index_of_handle(self, handle) -> int | None:
        try:
            return self._nvml.nvmlDeviceGetIndex(handle)
        except self._nvml.NVMLError:
            return None

    def _recovery_action(self, handle) -> str | None:
        nv = self._nvml
        try:
            (value,) = nv.nvmlDeviceGetFieldValues(handle, [FI_GPU_RECOVERY_ACTION])
        except nv.NVMLError:
            return None
        if value.nvmlReturn != nv.NVML_SUCCESS:
            return None
        return RECOVERY_ACTIONS.get(value.value.uiVal)

    # -- reset ----------------------------------------------------------------------------------------------

    def _state_for(self, device_id: str) -> _DeviceState | None:
        return next((s for s in self._devices.values() if s.uuid == device_id), None)

    def check_reset(self, device_id: str) -> None:
        if any(device_id in s.mig_names for s in self._devices.values()):
            raise NotSupported(f"{device_id} is a MIG instance: reset its parent GPU instead")
        if self._state_for(device_id) is None:
            raise ResetFailed(f"GPU {device_id} is no longer present")
        if shutil.which(self.nvidia_smi) is None:
            raise NotSupported(f"GPU reset needs {self.nvidia_smi}, which is not installed")

    def reset(self, device_id: str) -> str:
        self.check_reset(device_id)
        argv = [self.nvidia_smi, "--gpu-reset", "-i", device_id]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=RESET_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise ResetFailed(f"nvidia-smi --gpu-reset did not finish within {RESET_TIMEOUT:g}s") from None
        text = " ".join((r.stdout + " " + r.stderr).split())
        if r.returncode != 0:
            raise ResetFailed(f"nvidia-smi --gpu-reset failed (exit {r.returncode}): {text or 'no output'}")
        state = self._state_for(device_id)
        if state is not None:
            state.error = ""  # a successful reset clears a reported Xid
        return text or f"GPU {device_id} reset"

    def close(self) -> None:
        """Give back what _ensure_init took: one nvmlShutdown for its nvmlInit (NVML counts them, so a backend
        that replaced this one keeps working), the event set, the workers. Safe while the sampler samples: it
        waits for a sample in progress, which a call hung on the sampler's own thread can make forever, so
        call it off the event loop. Idempotent; a closed backend reports itself unavailable and reads nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._status = BackendStatus(self.name, False, "closed")
            nv, events, self._events = self._nvml, self._events, None
            for worker in [self._reader, *(state.worker for state in self._devices.values())]:
                if worker is not None:
                    worker.stop()  # never joined: one stuck in NVML ends when its call returns
            self._reader = None
        if nv is None:
            return  # NVML was never initialised: nothing to give back
        # Outside the lock: if NVML hangs here, only the closing thread waits. self._nvml stays set, for a
        # worker still inside a call.
        if events is not None:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(events)
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()
