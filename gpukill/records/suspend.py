"""Suspended workloads: a workload's GPU memory set aside in host memory by the driver, given back later.

gpukilld suspends a workload (SuspendWorkload) by locking, checkpointing and freezing each of its GPU processes
(NVIDIA's cuda-checkpoint); it then holds a SuspendedProcess record for each until ResumeWorkload gives the
memory back, the process is killed, or it ends. The records are what ListSuspended lists, what `gpukillctl list`
shows as state "suspended" (host memory held) and what the ProcessSuspended/ProcessResumed signals carry.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import wire

# A process's state in a record (SuspendedProcess.state) and in a reply's entries.
SUSPENDED = "suspended"  # checkpointed and frozen: its GPU memory is in host memory
STUCK = "stuck"  # the driver could not give it back (or undo a step): `remedy` says what to do
RUNNING = "running"  # on the GPU again (resumed, or brought back after a failure part-way)

# What a SuspendReply says of the act as a whole.
DONE = "done"  # every process suspended (resumed)
UNDONE = "undone"  # a step failed part-way; every process is running again: `message` says why
PARTIAL = "partial"  # a step failed and a process could not be brought back: see the entries' `stuck`

# How the workload was frozen (SuspendedProcess.frozen).
FROZEN_CGROUP = "cgroup"  # its own cgroup's freezer (cgroup v2 cgroup.freeze, or v1 freezer.state)
FROZEN_SIGSTOP = "sigstop"  # SIGSTOP to each of its processes (its cgroup holds other processes too)


@dataclass(frozen=True, slots=True)
class SuspendedProcess:
    """One process of a suspended workload (or one that was, in a reply's entries)."""

    pid: int = wire("u", "the process")
    start_time: int = wire("t", "its start time, clock ticks since boot")
    uid: int = wire("u", "its owner")
    comm: str = wire("s", "its name (the process chose it: escape before showing)")
    state: str = wire("s", '"suspended", "stuck" or "running"')
    devices: tuple[int, ...] = wire("au", "the GPUs it held memory on (global indexes when suspended)", ())
    device_ids: tuple[str, ...] = wire("as", "the same GPUs by UUID", ())
    memory: int = wire("t", "bytes of GPU memory set aside in host memory (what a resume needs free)", 0)
    device_memory: tuple[int, ...] = wire("at", "the same per GPU, in the order of device_ids", ())
    workload: str = wire("s", 'the workload it was suspended with: "tree of PID 42", "unit x.service", ...', "")
    suspended_at: float = wire("d", "when it was suspended, seconds since the epoch", 0.0)
    frozen: str = wire("s", '"cgroup" (its cgroup\'s freezer) or "sigstop"', "", omit_empty=True)
    error: str = wire("s", "what failed, for a process not suspended or stuck", "", omit_empty=True)
    remedy: str = wire("s", 'for "stuck": what frees the GPU or brings the process back', "", omit_empty=True)
    initiator: str = wire(
        "s", 'who had it suspended: "user" (a SuspendWorkload call) or "guard:RULE" (a Guard rule)', "", omit_empty=True
    )


@dataclass(frozen=True, slots=True)
class SuspendReply:
    """What SuspendWorkload and ResumeWorkload return."""

    selection: str = wire("s", 'what was selected: "PID 42", "tree of PID 42", "unit x.service", "Slurm job 123"')
    act: str = wire("s", '"suspend" or "resume"')
    result: str = wire("s", '"done", "undone" (a step failed, all running again) or "partial" (some stuck)')
    message: str = wire("s", "one line: what was done, or what failed and what was undone")
    entries: tuple[SuspendedProcess, ...] = wire("aa{sv}", "each process, by PID", (), of=SuspendedProcess)
    memory: int = wire("t", "bytes of GPU memory moved (set aside or given back)", 0)
    frozen: str = wire("s", '"cgroup" or "sigstop": how the workload was (un)frozen', "", omit_empty=True)
