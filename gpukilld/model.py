"""The daemon's snapshot: what the backends read, joined with /proc, as the sampler publishes it.

Devices are the bus's Device records (gpukill/records/); a backend reports a DeviceReading, the same fields
but the index and backend the sampler adds. Processes are the bus's Process records too, with the
system unit beside them that is not on the bus (GpuProcess).

A value a backend cannot read is None, never 0: "0 %" and "unknown" are different answers to an admin.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, Any

# Devices and memory regions are the records the bus carries, declared once in the shared package.
from gpukill.records.audit import Finding  # noqa: F401
from gpukill.records.manager import (  # noqa: F401
    STATE_ERROR,
    STATE_LOST,
    STATE_OK,
    Device,
    MemoryRegion,
    Process,
    find_device,
)
from gpukill.records.status import BackendStatus  # noqa: F401

_NUMBERED = ("index", "backend")  # what the sampler gives a device; the backend reads everything else

# What a backend reports for one device: a Device's fields but index and backend, with the same types and
# defaults. The sampler turns it into a Device (numbered()); a field added to Device comes with it.
if TYPE_CHECKING:
    DeviceReading = Any  # a class made at run time has no static type: to mypy, any reading
else:
    DeviceReading = make_dataclass(
        "DeviceReading",
        [
            (f.name, f.type, field(default=f.default)) if f.default is not MISSING else (f.name, f.type)
            for f in fields(Device)
            if f.name not in _NUMBERED
        ],
        frozen=True,
        slots=True,
    )


def numbered(reading: Any, index: int, backend: str) -> Device:
    """The Device a backend's reading becomes: its global index and its backend's name added."""
    return Device(index=index, backend=backend, **{f.name: getattr(reading, f.name) for f in fields(reading)})


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """What a backend knows of one process on one of its devices; host facts come from /proc later."""

    pid: int
    start_time: int  # clock ticks since boot, field 22 of /proc/PID/stat
    device_id: str
    gpu_memory: int | None = None
    gpu_utilization: float | None = None
    memory_regions: tuple[MemoryRegion, ...] = ()
    # Some of its usage is through a GPU context that processes of other users hold too (a DRM fd passed over a
    # socket): that part is charged to no one, so gpu_memory and gpu_utilization cover only the rest.
    shared_usage: bool = False


@dataclass(frozen=True, slots=True)
class Attribution:
    unit: str | None = None  # innermost systemd .service or .scope
    container_id: str | None = None  # docker, podman, containerd, cri-o
    pod_uid: str | None = None  # Kubernetes pod UID
    slurm_job: str | None = None
    # The system service or scope that holds the process: the first unit under /system.slice (through slices
    # only). Unlike `unit`, a user cannot forge it: below a unit, cgroups are whatever its owner creates.
    system_unit: str | None = None
    # The Slurm job came from SLURM_JOB_ID (readable by the owner and root only), not from a job cgroup.
    job_from_environ: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuProcess(Process):
    """A process on a GPU as the daemon holds it: the bus's Process record (flat, as the bus carries it) and
    what the daemon knows but does not publish."""

    # The system service or scope that holds the process (Attribution.system_unit): Guard's protection of
    # system units reads it, and unlike `unit` no user can forge it. Not on the bus (declared without wire()).
    system_unit: str | None = None
    # Attribution.job_from_environ: gpukilld/access/visibility.py shows such a job to the owner and full viewers only.
    # Not on
    # the bus either.
    job_from_environ: bool = False


# The attribution's fields, as GpuProcess holds them flat.
ATTRIBUTED = tuple(f.name for f in fields(Attribution))


@dataclass(frozen=True, slots=True)
class Snapshot:
    generation: int
    taken_at: float  # wall clock, seconds since the epoch
    devices: tuple[Device, ...]
    processes: tuple[GpuProcess, ...]
    backends: tuple[BackendStatus, ...]
    # The rogue-activity audit of these processes (gpukilld/rogue/score.py), every finding in full, highest score first.
    findings: tuple[Finding, ...] = ()
    # CLOCK_MONOTONIC when taken: what usage accounting measures intervals on (the wall clock may jump).
    monotonic: float = 0.0

    def find_device(self, key: str) -> Device | None:
        """A device by global index, id (UUID) or PCI bus id (gpukill.records.find_device)."""
        return find_device(self.devices, key)

    def processes_of(self, pid: int, start_time: int) -> list[GpuProcess]:
        return [p for p in self.processes if p.pid == pid and p.start_time == start_time]


EMPTY_SNAPSHOT = Snapshot(generation=0, taken_at=0.0, devices=(), processes=(), backends=())
