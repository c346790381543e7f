"""Records that flow from the backends through the snapshot to the bus.

A value a backend cannot read is None, never 0: "0 %" and "unknown" are different answers to an admin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STATE_OK = "ok"
STATE_LOST = "lost"  # the device stopped answering (fell off the bus, GPU_IS_LOST, a hung driver call)
STATE_ERROR = "error"  # answering, but the driver reported a critical error (an Xid): it needs attention


@dataclass(frozen=True, slots=True)
class Device:
    index: int  # global index across all backends, assigned by the sampler
    id: str  # stable id: UUID where the vendor has one, else the PCI address
    backend: str
    vendor: str
    name: str
    pci_bus_id: str | None
    utilization: float | None  # percent
    memory_used: int | None  # bytes
    memory_total: int | None  # bytes
    temperature: float | None  # degrees Celsius
    power: float | None  # watts
    state: str = STATE_OK
    state_reason: str = ""
    power_limit: float | None = None  # watts, the enforced limit
    mig_mode: bool | None = None  # NVIDIA Multi-Instance GPU mode; None where the device has no such mode
    parent_id: str | None = None  # for a partition (a MIG instance): the id of its physical GPU
    clock_mhz: float | None = None  # current graphics clock


@dataclass(frozen=True, slots=True)
class DeviceReading:
    """What a backend reports for one device; the sampler turns it into a Device with a global index."""

    id: str
    vendor: str
    name: str
    pci_bus_id: str | None = None
    utilization: float | None = None
    memory_used: int | None = None
    memory_total: int | None = None
    temperature: float | None = None
    power: float | None = None
    state: str = STATE_OK
    state_reason: str = ""
    power_limit: float | None = None
    mig_mode: bool | None = None
    parent_id: str | None = None
    clock_mhz: float | None = None


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A process's GPU memory in one region (vram, gtt, system0, ...), as DRM fdinfo or KFD report it."""

    name: str
    total: int | None  # bytes: every buffer created in the region, backed or not
    resident: int | None  # bytes: buffers whose backing store is present


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


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    start_time: int
    uid: int
    user: str
    comm: str
    cmdline: str
    exe: str | None
    device: int  # global device index
    device_id: str
    gpu_memory: int | None
    gpu_utilization: float | None
    attribution: Attribution = field(default_factory=Attribution)
    container_pid: int | None = None  # PID inside the innermost PID namespace, from NSpid
    memory_regions: tuple[MemoryRegion, ...] = ()
    shared_usage: bool = False  # as ProcessUsage.shared_usage: its figures leave out a part charged to no one


@dataclass(frozen=True, slots=True)
class BackendStatus:
    name: str
    available: bool
    detail: str  # why it is unavailable, or a one-line summary (driver version, device count)


@dataclass(frozen=True, slots=True)
class Snapshot:
    generation: int
    taken_at: float  # wall clock, seconds since the epoch
    devices: tuple[Device, ...]
    processes: tuple[GpuProcess, ...]
    backends: tuple[BackendStatus, ...]

    def find_device(self, key: str) -> Device | None:
        """A device by global index, id (UUID) or PCI bus id; ids are matched case-insensitively."""
        key = key.strip()
        if key.isdigit():
            index = int(key)
            return next((d for d in self.devices if d.index == index), None)
        low = key.lower()
        for device in self.devices:
            if device.id.lower() == low or (device.pci_bus_id or "").lower() == low:
                return device
        return None

    def processes_of(self, pid: int, start_time: int) -> list[GpuProcess]:
        return [p for p in self.processes if p.pid == pid and p.start_time == start_time]


EMPTY_SNAPSHOT = Snapshot(generation=0, taken_at=0.0, devices=(), processes=(), backends=())
