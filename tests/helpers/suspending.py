"""gpukilld on the fake NVIDIA host with the fake cuda-checkpoint, and workloads suspended on it: for the tests of
what people see of a suspended workload (top, the page, REST, the exporter, the accounting)."""

from __future__ import annotations

from .nvml_host import FakeNvidiaHost
from .testbed import Testbed, User

GIB = 2**30


def start_daemon(bed: Testbed, nvhost: FakeNvidiaHost) -> None:
    """gpukilld on `nvhost` (sampling every 0.3 s), suspending through the fake cuda-checkpoint; polkitd first."""
    bed.start_polkit()
    tool = nvhost.install_cuda_checkpoint()
    bed.write_conf(daemon={"backends": "nvidia", "cuda_checkpoint": tool})
    bed.start_daemon(args=["--sample-interval", "0.3"], env=nvhost.env())


def on_gpu(bed: Testbed, nvhost: FakeNvidiaHost, user: User, comm: str, memory: int, gpu: int = 0) -> int:
    """A process of `user` named `comm` holding `memory` bytes of GPU `gpu` in NVML, once gpukilld lists it: its
    PID."""
    victim = bed.victim(user, comm=comm)
    nvhost.refresh()
    nvhost.add_process(gpu, victim.pid, memory)
    nvhost.write()
    bed.wait_listed(victim.pid, comm=comm)
    return victim.pid


def suspended(bed: Testbed, nvhost: FakeNvidiaHost, user: User, comm: str, memory: int, gpu: int = 0) -> int:
    """on_gpu's process, suspended by its owner: its PID."""
    pid = on_gpu(bed, nvhost, user, comm, memory, gpu)
    r = bed.ctl(user, "suspend", str(pid))
    assert r.returncode == 0, r
    return pid
