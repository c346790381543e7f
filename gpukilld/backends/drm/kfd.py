"""ROCm compute processes from /sys/class/kfd/kfd: their queues are not DRM clients, so fdinfo misses them.

kfd/topology/nodes/N/gpu_id        the id KFD uses for a GPU (0 on CPU nodes)
kfd/topology/nodes/N/properties    "name value" lines: drm_render_minor ties the node to a render node,
                                   simd_count / simd_per_cu gives the number of compute units
kfd/proc/PID/vram_<gpu_id>         bytes of VRAM the process allocated through /dev/kfd
kfd/proc/PID/sdma_<gpu_id>         microseconds its SDMA (copy) queues were busy
kfd/proc/PID/stats_<gpu_id>/cu_occupancy   compute units its waves occupy right now
"""

from __future__ import annotations

from dataclasses import dataclass

from .sysfs import listdir, read_int, read_text


@dataclass(frozen=True, slots=True)
class KfdGpu:
    gpu_id: int
    render_minor: int
    compute_units: int | None


@dataclass(frozen=True, slots=True)
class KfdUsage:
    pid: int
    render_minor: int
    vram: int | None  # bytes
    sdma_us: int | None  # microseconds busy, cumulative
    cu_occupancy: int | None  # compute units occupied now
    compute_units: int | None  # of how many


def _properties(text: str) -> dict[str, int]:
    props = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        try:
            props[name] = int(value)
        except ValueError:
            continue
    return props


def kfd_gpus(sys_root: str) -> dict[int, KfdGpu]:
    nodes = f"{sys_root}/class/kfd/kfd/topology/nodes"
    gpus = {}
    for node in listdir(nodes):
        gpu_id = read_int(f"{nodes}/{node}/gpu_id")
        if not gpu_id:
            continue  # a CPU node
        props = _properties(read_text(f"{nodes}/{node}/properties") or "")
        if "drm_render_minor" not in props:
            continue
        simds, per_cu = props.get("simd_count"), props.get("simd_per_cu")
        gpus[gpu_id] = KfdGpu(gpu_id, props["drm_render_minor"], simds // per_cu if simds and per_cu else None)
    return gpus


def read_kfd(sys_root: str) -> list[KfdUsage]:
    """Every process with KFD state on a GPU; empty where KFD is absent (no ROCm, or not amdgpu)."""
    base = f"{sys_root}/class/kfd/kfd/proc"
    pids = [p for p in listdir(base) if p.isdigit()]
    if not pids:
        return []
    gpus = kfd_gpus(sys_root)
    usages = []
    for pid in pids:
        entries = listdir(f"{base}/{pid}")
        ids = {int(n[5:]) for n in entries if n.startswith("vram_") and n[5:].isdigit()}
        for gpu_id in sorted(ids):
            gpu = gpus.get(gpu_id)
            if gpu is None:
                continue
            usages.append(
                KfdUsage(
                    pid=int(pid),
                    render_minor=gpu.render_minor,
                    vram=read_int(f"{base}/{pid}/vram_{gpu_id}"),
                    sdma_us=read_int(f"{base}/{pid}/sdma_{gpu_id}"),
                    cu_occupancy=read_int(f"{base}/{pid}/stats_{gpu_id}/cu_occupancy"),
                    compute_units=gpu.compute_units,
                )
            )
    return usages
