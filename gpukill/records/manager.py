"""Manager's records that the listings report: the devices, the processes and their memory regions. Alone here,
apart from the Manager's other records (status.py), because a one-shot `gpukillctl list` builds these and no
other (gpukill/records/__init__.py says why that counts).
Imported by the listing path (`gpukillctl list`), the daemon and every client."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .base import wire

STATE_OK = "ok"
STATE_LOST = "lost"  # the device stopped answering (fell off the bus, GPU_IS_LOST, a hung driver call)
STATE_ERROR = "error"  # answering, but the driver reported a critical error (an Xid): it needs attention


@dataclass(frozen=True, slots=True)
class Device:
    """A GPU as ListDevices reports it. The daemon holds these in its snapshot (gpukilld/model.py)."""

    index: int = wire("u", "global index across vendors, stable while the daemon runs")
    id: str = wire("s", "stable id: the UUID where the vendor has one, else the PCI address")
    backend: str = wire("s", "the backend that reads it (nvidia, drm, simulated)")
    vendor: str = wire("s", "nvidia, amd, intel, ...")
    name: str = wire("s", "the product name")
    pci_bus_id: str | None = wire("s", "PCI address", None)
    utilization: float | None = wire("d", "percent", None)
    memory_used: int | None = wire("t", "bytes", None)
    memory_total: int | None = wire("t", "bytes", None)
    temperature: float | None = wire("d", "degrees Celsius", None)
    power: float | None = wire("d", "watts", None)
    state: str = wire("s", '"ok"; "lost": not answering; "error": answering but with a critical driver error', STATE_OK)
    state_reason: str = wire("s", "why it is not ok", "", omit_empty=True)
    power_limit: float | None = wire("d", "watts, the enforced limit", None)
    mig_mode: bool | None = wire("b", "NVIDIA Multi-Instance GPU mode; None where the device has none", None)
    parent_id: str | None = wire("s", "for a partition (a MIG instance): the id of its physical GPU", None)
    clock_mhz: float | None = wire("d", "current graphics clock, MHz", None)


def find_device(devices: Iterable[Device], key: str) -> Device | None:
    """A device by global index, id (UUID) or PCI bus id, as every selection by GPU names one (the daemon's
    filters, the CLI's check that a GPU exists); ids are matched case-insensitively."""
    key = key.strip()
    if key.isascii() and key.isdigit():  # "²" is a digit to isdigit(), not to int()
        index = int(key)
        return next((d for d in devices if d.index == index), None)
    low = key.lower()
    return next((d for d in devices if d.id.lower() == low or (d.pci_bus_id or "").lower() == low), None)


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A process's GPU memory in one region (vram, gtt, system0, ...), as DRM fdinfo or KFD report it."""

    name: str = wire("s", "the region as the driver names it (the key of memory_regions)")
    total: int | None = wire("t", "bytes: every buffer created in the region, backed or not", None)
    resident: int | None = wire("t", "bytes: buffers whose backing store is present", None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Process:
    """A process on a GPU as ListProcesses reports it: one record per (process, device), flat.

    The daemon's GpuProcess (gpukilld/model.py) is this record and the system unit, which is not on the bus."""

    pid: int = wire("u", "process id")
    start_time: int = wire("t", "field 22 of /proc/PID/stat, clock ticks since boot: pass it to KillProcess")
    uid: int = wire("u", "the owner's uid")
    user: str = wire("s", "the owner's name")
    comm: str = wire("s", "the process name")
    cmdline: str = wire("s", "arguments joined by spaces, at most 4096 bytes")
    exe: str | None = wire("s", "the executable's path", None)
    device: int = wire("u", "the device's global index")
    device_id: str = wire("s", "the device's id")
    gpu_memory: int | None = wire("t", "bytes of GPU memory", None)
    gpu_utilization: float | None = wire("d", "percent", None)
    unit: str | None = wire("s", "innermost systemd .service or .scope", None)
    container_id: str | None = wire("s", "docker, podman, containerd, cri-o", None)
    pod_uid: str | None = wire("s", "Kubernetes pod UID", None)
    slurm_job: str | None = wire("s", "Slurm job id", None)
    container_pid: int | None = wire("u", "PID inside the innermost PID namespace, from NSpid", None)
    memory_regions: tuple[MemoryRegion, ...] = wire(
        "a{sa{st}}",
        "GPU memory per region: region -> {total, resident}, each where known",
        (),
        omit_empty=True,
        of=MemoryRegion,
        key="name",
    )
    # Some of its usage is through a GPU context that processes of other users hold too (a DRM fd passed
    # over a socket): that part is charged to no one, so gpu_memory and gpu_utilization cover only the rest.
    shared_usage: bool = wire("b", "part of its usage is charged to no one (present when true)", False, omit_empty=True)
