"""After a kill, the GPU's answer: did the memory come back, and if not, who holds it (gpukill/records/reclaim.py).

A trainer's workers outlive it: killed alone, it exits and they, reparented to init or a subreaper, keep the GPU.
So before the signal the kill path remembers the target's tree (every descendant by ppid, each by pid and start
time, read from /proc in a worker thread), and after the exit it watches the devices the target used for a few
samples. A holder is a process on those devices that was in the remembered tree (a descendant, or an orphan once
its parent is gone) or shares the target's systemd unit, container, pod or Slurm job. The answer says how long the
memory took to come back: from the kill's first signal to the sample that showed it back. Login sessions
(session-N.scope), user@UID.service and init.scope are no workload: sharing one says nothing, so they relate
nobody; nor does a Slurm task's unit (slurmstepd's scope holds every job's steps): its job relates it. A target still
alive after SIGKILL is "stuck": the reason is read from its /proc state and wait channel,
and the remedy is a reset of its devices.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeGuard

from gpukill.records.reclaim import (
    DESCENDANT,
    HELD,
    MAX_HOLDERS,
    ORPHAN,
    RECLAIMED,
    SAME_CONTAINER,
    SAME_JOB,
    SAME_POD,
    SAME_UNIT,
    STUCK,
    Holder,
    Reclaim,
)

from ..model import GpuProcess, Snapshot
from ..proc.procfs import ProcFS

CGROUP_ROOT = "/sys/fs/cgroup"
WATCH_SAMPLES = 3  # samples after the exit: workers that exit on their parent's death have had time by then
MAX_TREE = 4096  # descendants remembered; a larger tree is cut (its holders still show by unit, container...)
_NO_WORKLOAD = re.compile(r"(session-[^/]*\.scope|user@\d+\.service|init\.scope)")
# Wait channels of NVIDIA's kernel modules (nvidia.ko, nvidia-uvm.ko: os_*, nv_*, _nv*, uvm_*).
_NVIDIA_WCHAN = re.compile(r"(nv|_nv|os_|uvm|nvidia)", re.IGNORECASE)

Key = tuple[int, int]  # (pid, start time)


def remember_tree(procfs: ProcFS, roots: Iterable[int]) -> dict[Key, int]:
    """Every live descendant of the roots, and the roots, with its parent: (pid, start time) -> ppid. Reads
    /proc/*/stat once (call it in a worker thread); at most MAX_TREE processes."""
    children: dict[int, list[tuple[int, int, int]]] = {}
    own: dict[int, tuple[int, int]] = {}
    for pid in procfs.pids():
        st = procfs.stat(pid)
        if st is None or st.is_kernel_thread:
            continue
        children.setdefault(st.ppid, []).append((pid, st.start_time, st.ppid))
        own[pid] = (st.start_time, st.ppid)
    tree: dict[Key, int] = {}
    todo = [pid for pid in roots if pid in own]
    for pid in todo:
        tree[(pid, own[pid][0])] = own[pid][1]
    while todo and len(tree) < MAX_TREE:
        pid = todo.pop()
        for child, start, ppid in children.get(pid, ()):
            if (child, start) not in tree and len(tree) < MAX_TREE:
                tree[(child, start)] = ppid
                todo.append(child)
    return tree


def workload_unit(unit: str | None) -> TypeGuard[str]:
    """Whether a unit is a workload of its own: not a login session, user@UID.service or init.scope."""
    return bool(unit and not _NO_WORKLOAD.fullmatch(unit))


@dataclass(frozen=True, slots=True)
class Workload:
    """What the kill's targets belong to, from the snapshot they were killed from."""

    units: frozenset[str]
    containers: frozenset[str]
    pods: frozenset[str]
    jobs: frozenset[str]
    owners: frozenset[int] = frozenset()  # the targets' uids: a unit relates its processes of these alone

    @classmethod
    def of(cls, procs: Iterable[GpuProcess]) -> Workload:
        procs = list(procs)
        return cls(
            # A Slurm task's unit is no workload of its own: slurmstepd runs every job's steps in one scope (or
            # slurmd's service), so its unit would relate other jobs, and a remedy `kill --unit` would stop them
            # all; its job is what it belongs to.
            frozenset(p.unit for p in procs if workload_unit(p.unit) and not p.slurm_job),
            frozenset(p.container_id for p in procs if p.container_id),
            frozenset(p.pod_uid for p in procs if p.pod_uid),
            frozenset(p.slurm_job for p in procs if p.slurm_job),
            frozenset(p.uid for p in procs),
        )

    def relation(self, p: GpuProcess) -> str | None:
        # A service may run many users' processes (JupyterHub's notebook servers in jupyterhub.service): another
        # user's is no leftover of this kill, and a remedy `kill --unit` would stop it too.
        if p.unit in self.units and p.uid in self.owners:
            return SAME_UNIT
        if p.container_id in self.containers:
            return SAME_CONTAINER
        if p.pod_uid in self.pods:
            return SAME_POD
        if p.slurm_job in self.jobs:
            return SAME_JOB
        return None


@dataclass(frozen=True, slots=True)
class FirstSignal:
    """The kill's first signal and when it was sent: what the answer's seconds count from. The caller of
    Killer.terminate records it just before that call (SIGTERM); a step that signals before the TERM (a
    checkpoint signal) records its own instead, with its earlier time."""

    name: str  # "SIGTERM", "SIGUSR1"
    at: float  # CLOCK_MONOTONIC (Watch's clock)


class Watch:
    """One kill's (or batch's) watch: made before the signal, asked after the exit."""

    def __init__(
        self,
        procfs: ProcFS,
        before: Snapshot,
        targets: Iterable[Key],
        tree: dict[Key, int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.procfs = procfs
        self.clock = clock
        self.targets = set(targets)
        self.tree = tree
        target_procs = [p for p in before.processes if (p.pid, p.start_time) in self.targets]
        self.device_ids = frozenset(p.device_id for p in target_procs)
        self.devices = tuple(sorted({p.device for p in target_procs}))
        self.workload = Workload.of(target_procs)
        self.tree_pids = {pid for pid, _ in tree}
        self._units: set[str | None] = set()  # of the last holders found
        self._containers: set[str | None] = set()
        # what the targets and everything related to them held before: what a full reclaim gives back
        self.before = sum(
            p.gpu_memory or 0
            for p in before.processes
            if p.device_id in self.device_ids and (self._key(p) in self.targets or self._related(p))
        )

    @staticmethod
    def _key(p: GpuProcess) -> Key:
        return (p.pid, p.start_time)

    def _related(self, p: GpuProcess) -> str | None:
        if self._key(p) in self.tree:
            return DESCENDANT
        return self.workload.relation(p)

    def holders(self, snap: Snapshot) -> list[Holder]:
        """The related processes holding memory on the watched devices, largest first. Reads the stat of at most
        MAX_HOLDERS + 1 processes' parents: a bounded read, fine on the loop."""
        # a process known to hold no memory there holds nothing back (one whose memory is unknown might)
        found = [
            (p, rel)
            for p in snap.processes
            if p.device_id in self.device_ids
            and self._key(p) not in self.targets
            and p.gpu_memory != 0
            and (rel := self._related(p)) is not None
        ]
        found.sort(key=lambda pr: (-(pr[0].gpu_memory or 0), pr[0].pid, pr[0].device))
        out: list[Holder] = []
        self._units = {p.unit for p, _ in found}
        self._containers = {p.container_id for p, _ in found}
        for p, rel in found:
            parent = 0
            if len(out) <= MAX_HOLDERS:
                st = self.procfs.stat(p.pid)
                parent = st.ppid if st is not None and st.start_time == p.start_time else 0
                if rel == DESCENDANT and parent not in self.tree_pids:
                    rel = ORPHAN  # its parent in the tree died: it was reparented (init, a subreaper)
            out.append(Holder(p.pid, p.start_time, p.uid, p.comm, p.device, p.gpu_memory or 0, rel, parent))
        return out

    async def after_exit(
        self, resample: Callable[[], Awaitable[Snapshot]], first: FirstSignal, samples: int = WATCH_SAMPLES
    ) -> Reclaim:
        """Watch the next samples until nothing related holds memory there, at most `samples` of them. Reclaimed,
        the answer's seconds run from the first signal to the arrival of the sample that showed the memory back.
        resample is the daemon's sampler (the next sample it takes), so the figure's resolution is one sample
        interval: the memory came back at most that much earlier than it says."""
        holders: list[Holder] = []
        seen = 0
        while seen < samples:
            holders = self.holders(await resample())
            seen += 1
            if not holders:
                break
        return self.answer(holders, seen, first)

    def answer(self, holders: list[Holder], samples: int, first: FirstSignal | None = None) -> Reclaim:
        """The verdict on the sample just taken (its holders); reclaimed, with the seconds since the first signal
        (when given) as the clock reads now."""
        held = sum(h.memory for h in holders)
        if not holders:
            return Reclaim(
                RECLAIMED,
                reclaimed=self.before,
                devices=self.devices,
                samples=samples,
                seconds=max(0.0, self.clock() - first.at) if first is not None else None,
                first_signal=first.name if first is not None else "",
            )
        return Reclaim(
            HELD,
            reclaimed=max(0, self.before - held),
            held=held,
            devices=self.devices,
            holders=tuple(holders[:MAX_HOLDERS]),
            more=max(0, len(holders) - MAX_HOLDERS),
            samples=samples,
            remedy=self._held_remedy(holders, self._units, self._containers),
        )

    def _held_remedy(self, holders: list[Holder], units: set[str | None], containers: set[str | None]) -> str:
        """The one act that stops every holder: their unit's (or container's) kill when they all share the
        target's, else a kill of each (orphans are no one's tree any more)."""
        if len(self.workload.units) == 1 and units == self.workload.units:
            return f"gpukillctl kill --unit {next(iter(self.workload.units))}"
        if len(self.workload.containers) == 1 and containers == self.workload.containers:
            return f"gpukillctl kill --container {next(iter(self.workload.containers))}"
        named = ", ".join(f"gpukillctl kill {h.pid}" for h in holders[:4])
        return named + (" and the others" if len(holders) > 4 else "") + " (kill --tree PID takes them with it)"

    def stuck(self, pid: int) -> Reclaim:
        """The target outlived SIGKILL: why, from /proc, and what frees the GPU."""
        return Reclaim(
            STUCK,
            devices=self.devices,
            reason=stuck_reason(self.procfs, pid),
            remedy=" or ".join(f"gpukillctl reset {d}" for d in self.devices) or "gpukillctl reset GPU",
        )


def stuck_reason(procfs: ProcFS, pid: int) -> str:
    """Why a process outlives SIGKILL, in words, from its state and wait channel."""
    st = procfs.stat(pid)
    if st is None:
        return "it exited after the wait for SIGKILL ended"
    wchan = procfs.wchan(pid) or "?"
    if st.state == "D":
        if wchan == "__refrigerator" or (frozen := frozen_by(procfs, pid)):
            # a frozen task sleeps where it was (TASK_FROZEN since Linux 6.1) or in __refrigerator
            return f"uninterruptible (D), frozen by the cgroup freezer{f' ({frozen})' if frozen else ''}: {wchan}"
        if _NVIDIA_WCHAN.match(wchan):
            return f"uninterruptible (D) in the NVIDIA driver: {wchan}"
        return f"uninterruptible (D) in the kernel: {wchan}"
    return f"state {st.state} in {wchan}"


def frozen_by(procfs: ProcFS, pid: int, cgroup_root: str = CGROUP_ROOT) -> str | None:
    """The cgroup v1 freezer group that holds the process FROZEN, or None."""
    for line in procfs.cgroup_lines(pid):
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "freezer" in controllers.split(","):
            try:
                with open(f"{cgroup_root}/freezer{path}/freezer.state", "rb") as f:
                    state = f.read(64).strip()
            except OSError:
                return None
            return path if state in (b"FROZEN", b"FREEZING") else None
    return None


def reclaim_fields(r: Reclaim) -> dict[str, object]:
    """The journal's fields for the answer: GPUKILL_RECLAIM, _RECLAIMED_BYTES, _HELD_BYTES, _HOLDERS (each holder as
    PID:START:RELATION:DEVICE:BYTES, space-separated), _HOLDERS_MORE, _STUCK_REASON, _REMEDY; for "reclaimed",
    _RECLAIM_SECONDS (from the first signal until the memory was back, to the millisecond) and
    _RECLAIM_FIRST_SIGNAL (what they count from)."""
    return {
        "reclaim": r.verdict,
        "reclaim_seconds": f"{r.seconds:.3f}" if r.seconds is not None else None,
        "reclaim_first_signal": r.first_signal or None,
        "reclaimed_bytes": r.reclaimed if r.verdict in (RECLAIMED, HELD) else None,
        "held_bytes": r.held if r.verdict == HELD else None,
        "holders": " ".join(f"{h.pid}:{h.start_time}:{h.relation}:{h.device}:{h.memory}" for h in r.holders) or None,
        "holders_more": r.more or None,
        "stuck_reason": r.reason or None,
        "remedy": r.remedy or None,
    }
