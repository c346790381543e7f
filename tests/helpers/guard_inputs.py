"""The guard engine's inputs without a daemon: a clock the test sets, group membership from a table, and
devices, processes and snapshots as the sampler would hand them over."""

from __future__ import annotations

from dataclasses import dataclass

from gpukilld.guard.conditions import Groups
from gpukilld.guard.engine import Clock
from gpukilld.model import Device, GpuProcess, Snapshot

GiB = 1024**3
OWN_PID = 4_000_000


@dataclass
class FakeTime:
    now: float = 1000.0

    def clock(self) -> Clock:
        return Clock(monotonic=lambda: self.now, boottime=lambda: self.now, wall=lambda: 1.7e9 + self.now)


class FakeGroups(Groups):
    def __init__(self, table: dict[int, set[str]]) -> None:
        super().__init__()
        self.table = table

    def of(self, uid: int, user: str) -> frozenset[str]:
        return frozenset(self.table.get(uid, set()))


def dev(index: int, temperature: float | None = 40.0, util: float | None = 0.0, used: int | None = 0) -> Device:
    return Device(index, f"GPU-{index}", "simulated", "nvidia", "H100", None, util, used, 80 * GiB, temperature, 100.0)


def proc(
    pid: int,
    comm: str = "python",
    mem: int | None = None,
    util: float | None = None,
    uid: int = 1000,
    user: str = "alice",
    device: int = 0,
    start: int = 100,
    unit: str | None = None,
    cmdline: str | None = None,
    system_unit: str | None = None,
    container: str | None = None,
    shared: bool = False,
    slurm_job: str | None = None,
) -> GpuProcess:
    return GpuProcess(
        pid=pid,
        start_time=start,
        uid=uid,
        user=user,
        comm=comm,
        cmdline=cmdline or comm,
        exe=f"/usr/bin/{comm}",
        device=device,
        device_id=f"GPU-{device}",
        gpu_memory=mem,
        gpu_utilization=util,
        unit=unit,
        system_unit=system_unit,
        container_id=container,
        shared_usage=shared,
        slurm_job=slurm_job,
    )


def snap(*processes: GpuProcess, devices: tuple[Device, ...] | None = None) -> Snapshot:
    return Snapshot(1, 0.0, devices or tuple(dev(i) for i in range(4)), tuple(processes), ())
