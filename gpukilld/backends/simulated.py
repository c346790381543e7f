"""Simulated GPUs for hosts without any: devices from a YAML file, processes that are real.

A process is "on" simulated GPU N when its environment holds GPUKILL_SIM_GPU=N (or "0,2" for two);
GPUKILL_SIM_MEM (bytes or 4GiB) and GPUKILL_SIM_UTIL (percent) give its usage; GPUKILL_SIM_UTIL_CYCLE="100:1,0:9"
makes its utilization a repeating pattern instead (100% for 1 s, then 0% for 9 s: a keep-alive kernel, as KeepGPU
runs, for Guard's idle rules to be tried against). Because the processes
are real, kill, users and cgroups are all real. The file is re-read when it changes, so tests and demos
can lose a device or inject a fault while the daemon runs. A file with `scope: NAME` counts only processes that
also carry GPUKILL_SIM_SCOPE=NAME, so several simulated hosts (test runs, a demo) can share one machine.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import yaml

from gpukill.errors import ConfigError, NotSupported, ResetFailed
from gpukill.procstat import seconds_since_start
from gpukill.units import parse_size, short

from ..model import STATE_ERROR, STATE_LOST, STATE_OK, BackendStatus, DeviceReading, ProcessUsage
from ..proc.exit_watch import ExitWatch
from ..proc.procfs import ProcFS
from . import Backend, BackendSample

log = logging.getLogger(__name__)

_DEVICE_KEYS = {
    "name",
    "vendor",
    "uuid",
    "pci_bus_id",
    "memory_total",
    "memory_used",
    "utilization",
    "temperature",
    "power",
    "state",
    "state_reason",
    "reset",
}
_TOP_KEYS = {"devices", "faults", "scope"}
_FAULT_KEYS = {"hang_sampling"}
_TEMPERATURE = (-273.15, 1000.0)  # °C
_MAX_POWER = 1e6  # W: a GPU draws at most a few kW


@dataclass(frozen=True, slots=True)
class SimDevice:
    uuid: str
    name: str
    vendor: str
    pci_bus_id: str | None
    memory_total: int | None
    memory_used: int  # baseline used by nobody we can see (driver, other VMs)
    utilization: float  # baseline
    temperature: float | None
    power: float | None
    state: str
    state_reason: str
    reset: str  # "ok", "unsupported" or "fail: MESSAGE"


@dataclass(frozen=True, slots=True)
class SimConfig:
    devices: tuple[SimDevice, ...]
    hang_sampling: bool
    scope: str | None = None


# A process's verdict stands until one of these says it may have changed: its /proc inode (a reused PID),
# its pidfd (it ended), its youth (read every sample for YOUNG seconds: exec comes soon after fork), or its
# turn in the rotation (every RECHECK to 1.5 RECHECK seconds, OTHERS_SLOWER times that for a process on no
# GPU): a late exec out of or onto a simulated GPU, the one change a followed process's rotation looks for.
# A GPU process's rotation is the sampler's facts period (gpukilld/sampling/sampler.py INFO_TTL): the name,
# command line and executable in its record are the sampler's to keep fresh (at once with the proc
# connector, within 90 s polling), so what waits for this rotation is only the simulated driver's verdict on
# an old process's exec. Every 60-90 s it was a fifth of the idle daemon's /proc reads (bench/idle_cost).
YOUNG = 10.0
RECHECK = 120.0
# A process on no simulated GPU is read again OTHERS_SLOWER times less often: most of a busy host is such
# processes, and an old one exec'ing onto a GPU (the only change its rotation looks for) is rare: every 4-6
# minutes.
OTHERS_SLOWER = 2
# The scan of /proc is skipped while the namespace's last PID has not moved (no process was created, so none is
# new and no PID was reused; ended GPU processes are told by their pidfds), but made at least this often, for a
# PID counter that went all the way round to the same value between two samples (pid_max creations in one
# interval): a GPU process new then is found up to FULL_SCAN late; an ended one is told by its pidfd at once.
# On a 5,000-process host a scan takes ~8 ms: every 10 s it was 0.08 % of a core (bench/idle_cost), every
# 60 s it is 0.013 %.
FULL_SCAN = 60.0


@dataclass(frozen=True, slots=True)
class _Seen:
    ino: int
    start_time: int
    comm: str
    usage: SimUsage | None
    recheck_at: float  # monotonic; inf: read every sample


@dataclass(frozen=True, slots=True)
class SimUsage:
    gpus: tuple[int, ...]
    memory: int | None
    utilization: float | None
    cycle: tuple[tuple[float, float], ...] = ()  # (percent, seconds) repeated: utilization by the clock

    def utilization_now(self, now: float) -> float | None:
        if not self.cycle:
            return self.utilization
        at = now % sum(seconds for _, seconds in self.cycle)
        for percent, seconds in self.cycle:
            if at < seconds:
                return percent
            at -= seconds
        return self.cycle[-1][0]


def _number(value: object, where: str, lo: float, hi: float) -> float:
    """A finite number from lo to hi: ints of any size are compared exactly before float() (which would raise
    OverflowError), inf and nan are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {short(value, 60)}")
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"{where}: expected a number, got nan")
    if not lo <= value <= hi:
        raise ConfigError(f"{where}: expected a number from {lo:g} to {hi:g}, got {short(value, 60)}")
    return float(value) + 0.0  # -0.0 is 0


def _sim_device(i: int, raw: object, where: str) -> SimDevice:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    if unknown := set(raw) - _DEVICE_KEYS:
        raise ConfigError(f"{where}: unknown key {short(sorted(unknown, key=lambda k: short(k, 60))[0], 60)}")
    try:
        memory_total = parse_size(raw["memory_total"], bare=1) if "memory_total" in raw else None
        memory_used = parse_size(raw.get("memory_used", 0), bare=1)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    state = raw.get("state", STATE_OK)
    if state not in (STATE_OK, STATE_LOST, STATE_ERROR):
        raise ConfigError(f"{where}: state must be 'ok', 'lost' or 'error', not {state!r}")
    reset = str(raw.get("reset", "ok"))
    if reset not in ("ok", "unsupported") and not reset.startswith("fail:"):
        raise ConfigError(f"{where}: reset must be 'ok', 'unsupported' or 'fail: MESSAGE'")
    return SimDevice(
        uuid=str(raw.get("uuid") or f"SIM-{i:04d}"),
        name=str(raw.get("name", f"Simulated GPU {i}")),
        vendor=str(raw.get("vendor", "simulated")),
        pci_bus_id=str(raw["pci_bus_id"]) if "pci_bus_id" in raw else None,
        memory_total=memory_total,
        memory_used=memory_used,
        utilization=_number(raw.get("utilization", 0), f"{where}.utilization", 0.0, 100.0),
        temperature=(
            _number(raw["temperature"], f"{where}.temperature", *_TEMPERATURE) if "temperature" in raw else None
        ),
        power=_number(raw["power"], f"{where}.power", 0.0, _MAX_POWER) if "power" in raw else None,
        state=state,
        state_reason=str(raw.get("state_reason", "")),
        reset=reset,
    )


def load_sim_config(path: str) -> SimConfig:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        problem = " ".join(str(getattr(e, "problem", None) or e).split())  # a ReaderError's text has two lines
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    except (ValueError, OverflowError, TypeError, RecursionError, MemoryError) as e:
        # PyYAML's constructors call int() (more than 4300 digits: ValueError), float(), datetime(), chr();
        # its composer and constructor recurse once per level of nesting
        reason = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        raise ConfigError(f"{path}: not valid YAML: {' '.join(reason.split())[:300]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        raise ConfigError(f"{path}: expected a mapping with a 'devices:' list")
    if unknown := set(data) - _TOP_KEYS:
        raise ConfigError(
            f"{path}: unknown key {short(sorted(unknown, key=lambda k: short(k, 60))[0], 60)} "
            f"(known: {', '.join(sorted(_TOP_KEYS))})"
        )
    faults = data.get("faults") or {}
    if not isinstance(faults, dict) or (set(faults) - _FAULT_KEYS):
        raise ConfigError(f"{path}: 'faults' takes only: {', '.join(sorted(_FAULT_KEYS))}")
    devices = []
    for i, raw in enumerate(data["devices"]):
        where = f"{path}: devices[{i}]"
        try:
            devices.append(_sim_device(i, raw, where))
        except (ValueError, OverflowError) as e:  # str() of an int of more than 4300 digits (0b..., 0x...)
            raise ConfigError(f"{where}: {' '.join(str(e).split())[:300]}") from None
    if len({d.uuid for d in devices}) != len(devices):
        raise ConfigError(f"{path}: two devices share one uuid")
    scope = data.get("scope")
    if scope is not None and not isinstance(scope, str):
        raise ConfigError(f"{path}: scope must be a string")
    return SimConfig(devices=tuple(devices), hang_sampling=bool(faults.get("hang_sampling", False)), scope=scope)


def parse_usage(env: dict[str, str], scope: str | None = None) -> SimUsage | None:
    spec = env.get("GPUKILL_SIM_GPU")
    if spec is None or (scope is not None and env.get("GPUKILL_SIM_SCOPE") != scope):
        return None
    try:
        gpus = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        return None
    memory = utilization = None
    if "GPUKILL_SIM_MEM" in env:
        try:
            memory = parse_size(env["GPUKILL_SIM_MEM"], bare=1)
        except ValueError:
            memory = None
    if "GPUKILL_SIM_UTIL" in env:
        try:
            utilization = max(0.0, min(100.0, float(env["GPUKILL_SIM_UTIL"])))
        except ValueError:
            utilization = None
    return SimUsage(gpus=gpus, memory=memory, utilization=utilization, cycle=_cycle(env.get("GPUKILL_SIM_UTIL_CYCLE")))


def _cycle(spec: str | None) -> tuple[tuple[float, float], ...]:
    """GPUKILL_SIM_UTIL_CYCLE: PERCENT:SECONDS pairs, comma-separated (at most 16); () when absent or malformed."""
    if not spec:
        return ()
    try:
        steps = tuple((float(p), float(s)) for p, s in (step.split(":") for step in spec.split(",")[:16]))
    except ValueError:
        return ()
    if not all(0 <= p <= 100 and 0 < s <= 86400 for p, s in steps):
        return ()
    return steps


class SimulatedBackend(Backend):
    name = "simulated"

    def __init__(self, path: str, procfs: ProcFS | None = None) -> None:
        self.path = path
        self.procfs = procfs or ProcFS()
        self._config = load_sim_config(path)  # a broken file at start-up is fatal: say so and stop
        self._mtime = self._file_mtime()
        # Per (pid, start time, comm): exec replaces the environment but keeps pid and start time, and a
        # process caught between fork and exec (systemd names it "(sleep)" there) must be read again after.
        self._usage: dict[tuple[int, int, str], SimUsage | None] = {}
        # What each process of the last scan was found to be, to read only what may have changed (_scan_usage).
        self._scan: dict[int, int] = {}  # pid -> inode of /proc/PID
        self._seen: dict[int, _Seen] = {}
        self._young: set[int] = set()  # read every sample
        self._rotation: list[tuple[float, int]] = []  # (when, pid): heap of the next re-reads of the others
        self._found: dict[int, tuple[int, SimUsage]] | None = None
        self._cycling = False  # whether any process found has a utilization cycle (its records change each sample)
        self._scanned: tuple[int | None, float] = (None, -math.inf)  # (last PID, monotonic time) at the last scan
        # The ends of GPU processes, from the kernel; without it (a fixture /proc) every process is read each time.
        self._watch = ExitWatch() if self.procfs.is_this_hosts() else None
        self._last_sample: tuple[SimConfig, dict, BackendSample] | None = None
        self._lock = threading.Lock()
        self._resets: dict[str, int] = {}

    def _file_mtime(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return None

    def _reload_if_changed(self) -> None:
        mtime = self._file_mtime()
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            config = load_sim_config(self.path)
        except ConfigError as e:
            log.error("%s; keeping the devices loaded before", e)
            return
        if config.scope != self._config.scope:
            self._forget_all()  # cached verdicts were made for the old scope
        self._config = config

    def status(self) -> BackendStatus:
        return BackendStatus(self.name, True, f"{len(self._config.devices)} devices from {self.path}")

    def _scan_usage(self) -> dict[int, tuple[int, SimUsage]]:
        """Every process whose environment puts it on a simulated GPU: pid -> (start time, usage).

        Only what may have changed is read (see _Seen): a PID new to /proc or with a new /proc inode (reused),
        a GPU process that ended (its pidfd says), a young process, and old ones in rotation. The rest is the
        verdict of an earlier sample."""
        now = time.monotonic()
        last_pid = self.procfs.last_pid() if self._watch is not None else None
        if last_pid is not None and last_pid == self._scanned[0] and now - self._scanned[1] < FULL_SCAN:
            scan = self._scan  # no process created since the last scan
        else:
            scan = self.procfs.pid_inodes()  # read after last_pid: a process made between them shows next time
            self._scanned = (last_pid, now)
        due: set[int] = set()
        if scan is not self._scan and scan != self._scan:
            for pid, _ino in scan.items() - self._scan.items():
                due.add(pid)  # new, or its PID reused
            for pid in self._scan.keys() - scan.keys():
                self._forget(pid)
            self._scan = scan
        if self._watch is None:
            due = set(scan)  # nothing says which processes are unchanged: read them all, as every sample did
        else:
            due.update(pid for pid, _start in self._watch.ended() if pid in scan)
        due.update(pid for pid in self._young if pid in scan)
        while self._rotation and self._rotation[0][0] <= now:
            when, pid = heapq.heappop(self._rotation)
            seen = self._seen.get(pid)
            if seen is not None and seen.recheck_at == when:
                due.add(pid)
        for pid in due:
            self._read(pid, scan[pid], now)
        if self._found is None:
            self._found = {
                pid: (seen.start_time, seen.usage) for pid, seen in self._seen.items() if seen.usage is not None
            }
            self._cycling = any(u.cycle for _, u in self._found.values())  # once per change, not per sample
        return self._found

    def _read(self, pid: int, ino: int, now: float) -> None:
        stat = self.procfs.stat(pid)
        old = self._seen.get(pid)
        if stat is None:
            self._forget(pid)
            return
        if old is not None and (old.start_time, old.comm) != (stat.start_time, stat.comm):
            self._usage.pop((pid, old.start_time, old.comm), None)
            if self._watch is not None and old.start_time != stat.start_time:
                self._watch.forget((pid, old.start_time))
        usage = None
        again = False  # read it again next sample
        if not (stat.is_kernel_thread or stat.state == "Z"):
            key = (pid, stat.start_time, stat.comm)
            if key in self._usage:
                usage = self._usage[key]
            else:
                env = self.procfs.environ(pid)
                usage = parse_usage(env, self._config.scope)
                # An empty environment is not remembered: during execve the new name shows before the new
                # environment does, and a verdict made then would stand for the process's whole life.
                if env:
                    self._usage[key] = usage
                else:
                    again = True
        if self._watch is not None:
            if usage is None:
                self._watch.forget((pid, stat.start_time))
            elif not self._watch.follow(pid, stat.start_time):
                again = True  # its end would go unseen: read it every sample instead
        # A young process is read every sample: fork then exec (a new name and environment) happens early.
        again = (
            again
            or self._watch is None
            or seconds_since_start(stat.start_time, time.clock_gettime(time.CLOCK_BOOTTIME)) < YOUNG
        )
        if again:
            self._young.add(pid)
            recheck_at = math.inf
        else:
            self._young.discard(pid)
            every = RECHECK if usage is not None else RECHECK * OTHERS_SLOWER
            recheck_at = now + every * (1 + (pid % 64) / 128)  # spread over the interval, not all at once
            heapq.heappush(self._rotation, (recheck_at, pid))
        self._seen[pid] = _Seen(ino, stat.start_time, stat.comm, usage, recheck_at)
        # Only a GPU process found, changed or gone changes what is found: a new process on no GPU (most of what
        # a busy host starts) leaves the last records standing.
        before = (old.usage, old.start_time) if old is not None and old.usage is not None else None
        if before != ((usage, stat.start_time) if usage is not None else None):
            self._found = None

    def _forget(self, pid: int) -> None:
        seen = self._seen.pop(pid, None)
        self._young.discard(pid)
        if seen is not None:
            self._usage.pop((pid, seen.start_time, seen.comm), None)
            if self._watch is not None:
                self._watch.forget((pid, seen.start_time))
            if seen.usage is not None:
                self._found = None

    def _forget_all(self) -> None:
        for pid in list(self._seen):
            self._forget(pid)
        self._scan = {}
        self._scanned = (None, -math.inf)
        self._rotation = []
        self._usage.clear()
        self._found = None

    def sample(self) -> BackendSample:
        self._reload_if_changed()
        while self._config.hang_sampling:  # fault injection: a backend that stops answering
            threading.Event().wait(0.2)
            self._reload_if_changed()
        config = self._config
        usage = self._scan_usage()
        last = self._last_sample
        now = time.monotonic()
        if last is not None and last[0] is config and last[1] is usage and not self._cycling:
            # Nothing changed: the same records, so the sampler can tell at once (and reuse what it built).
            return BackendSample(devices=list(last[2].devices), processes=list(last[2].processes))
        per_device: dict[int, list[ProcessUsage]] = {i: [] for i in range(len(config.devices))}
        for pid, (start_time, u) in usage.items():
            for gpu in u.gpus:
                if gpu in per_device and config.devices[gpu].state != STATE_LOST:  # in error: still answering
                    per_device[gpu].append(
                        ProcessUsage(pid, start_time, config.devices[gpu].uuid, u.memory, u.utilization_now(now))
                    )
        sample = BackendSample()
        for i, dev in enumerate(config.devices):
            procs = per_device[i]
            sample.processes.extend(procs)
            if dev.state == STATE_LOST:
                sample.devices.append(
                    DeviceReading(
                        id=dev.uuid,
                        vendor=dev.vendor,
                        name=dev.name,
                        pci_bus_id=dev.pci_bus_id,
                        memory_total=dev.memory_total,
                        state=dev.state,
                        state_reason=dev.state_reason or "simulated device lost",
                    )
                )
                continue
            used = dev.memory_used + sum(p.gpu_memory or 0 for p in procs)
            util = min(100.0, dev.utilization + sum(p.gpu_utilization or 0 for p in procs))
            sample.devices.append(
                DeviceReading(
                    id=dev.uuid,
                    vendor=dev.vendor,
                    name=dev.name,
                    pci_bus_id=dev.pci_bus_id,
                    utilization=util,
                    memory_used=used,
                    memory_total=dev.memory_total,
                    temperature=dev.temperature,
                    power=dev.power,
                    # in error (an Xid, say): readings and processes as before, and the driver's reason
                    state=dev.state,
                    state_reason=dev.state_reason if dev.state == STATE_ERROR else "",
                )
            )
        self._last_sample = (config, usage, sample)
        return sample

    def _device(self, device_id: str) -> SimDevice:
        dev = next((d for d in self._config.devices if d.uuid == device_id), None)
        if dev is None:
            raise ResetFailed(f"device {device_id} is no longer present")
        return dev

    def check_reset(self, device_id: str) -> None:
        dev = self._device(device_id)
        if dev.reset == "unsupported":
            raise NotSupported(f"reset is not supported on {dev.name} ({device_id})")

    def reset(self, device_id: str) -> str:
        self.check_reset(device_id)
        dev = self._device(device_id)
        if dev.reset.startswith("fail:"):
            raise ResetFailed(dev.reset[5:].strip() or "simulated reset failure")
        with self._lock:
            self._resets[device_id] = self._resets.get(device_id, 0) + 1
            count = self._resets[device_id]
        return f"simulated reset of {device_id} done (reset #{count})"
