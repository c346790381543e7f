"""Suspend and resume: a workload's GPU memory set aside in host memory by NVIDIA's driver, and given back.

Suspend: the workload is resolved as a kill's is (gpukilld/acts/selection.py: a PID, a tree, a unit, a Slurm
job), every refusal is checked before anything is touched (each one line: not an NVIDIA GPU, a MIG instance, a
driver older than 550, several processes on a driver older than 610, not x86-64, no cuda-checkpoint, too little
host memory), each GPU process is pinned by pidfd and start time and authorized by polkit (own or any); then
all are locked, all checkpointed, the next samples must show their memory gone from the device, and the workload
is frozen (freezer.py). A step that fails undoes what was done: restore and unlock what was checkpointed, unlock
what was locked, thaw; a process that cannot be brought back is recorded `stuck` with its remedy, never retried.

Resume: only when each device has the recorded memory free now; thaw (the driver restores a process through a
thread of its own, which a stopped process never runs; its CUDA calls stay locked), restore all, unlock all. A
failed restore leaves the process `stuck` with its remedy. One act at a time per workload; a kill of a suspended process
(kill_suspended) is refused while a resume of its workload runs, so no signal ever meets a process mid-restore.
The driver is reached through the cuda-checkpoint utility (checkpoint.py); records are kept in the state
directory (suspended.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gpukill.errors import DeviceBusy, GpukillError, InvalidArgs, NoSuchProcess, NotSupported, TooBusy
from gpukill.outcome import INITIATOR_USER, Outcome
from gpukill.records.suspend import (
    DONE,
    FROZEN_CGROUP,
    PARTIAL,
    RUNNING,
    STUCK,
    SUSPENDED,
    UNDONE,
    SuspendedProcess,
    SuspendReply,
)
from gpukill.text import shown
from gpukill.units import format_size

from .. import journal
from ..access.bouncer import RESUME_METHOD, SUSPEND_METHOD, Bouncer, Caller, Method, Request
from ..backends import Backend
from ..model import GpuProcess, Snapshot
from ..proc.procfs import ProcFS, user_name
from .cuda_checkpoint import CHECKPOINTED, LOCKED, CheckpointError, CudaCheckpoint, find_cuda_checkpoint
from .cuda_checkpoint import RUNNING as DRIVER_RUNNING
from .freezer import Frozen, freeze, thaw
from .killer import KILL_WAIT, Killer, PinnedProcess
from .selection import GUARD_ONLY, MAX_WORKLOAD, Selection
from .suspended import SuspendedWorkloads, Workload

MIN_DRIVER = 550  # the driver's checkpoint API
MIN_DRIVER_IPC = 610  # CUDA IPC between the processes of a workload
VERIFY_SAMPLES = 3  # samples that may pass before a checkpointed process's memory must be gone from the device
UNSUPPORTED_VENDOR = "no driver API sets a process's GPU memory aside today; kill or wait"
REMEDY_RESTORE = (
    "the driver could not give its GPU memory back: the process cannot continue; kill it (gpukillctl kill PID) "
    "and start it again"
)
REMEDY_UNLOCK = "its CUDA calls stay locked: run `cuda-checkpoint --action unlock --pid PID` as root, or kill it"


@dataclass(frozen=True, slots=True)
class SuspendSettings:
    """gpukilld.conf's: the utility (None: looked up) and the cap of host memory held (None: half of MemTotal)."""

    cuda_checkpoint: str | None = None
    host_memory_max: int | None = None
    sys_root: str = "/sys"


def _driver_major(version: str | None) -> int | None:
    head = (version or "").split(".")[0]
    return int(head) if head.isdigit() else None


def _meminfo(proc_root: str) -> dict[str, int]:
    """/proc/meminfo's MemTotal and MemAvailable, in bytes."""
    out = {}
    try:
        with open(os.path.join(proc_root, "meminfo"), encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable") and rest.split() and rest.split()[0].isdigit():
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _remedy(text: str, pid: int) -> str:
    return text.replace("PID", str(pid))


class Suspender:
    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        resample: Callable[[], Awaitable[Snapshot]],
        backends: Callable[[], dict[str, Backend]],
        bouncer: Bouncer,
        killer: Killer,
        auditor: journal.Audit,
        kept: SuspendedWorkloads,
        settings: Callable[[], SuspendSettings],
        on_suspended: Callable[[SuspendedProcess, Caller | None], None],
        on_resumed: Callable[[SuspendedProcess, Caller | None], None],
    ) -> None:
        self._snapshot = snapshot
        self._resample = resample
        self._backends = backends
        self.bouncer = bouncer
        self.killer = killer
        self.procfs: ProcFS = killer.procfs
        self.audit = auditor
        self.kept = kept
        self._settings = settings
        self._on_suspended = on_suspended
        self._on_resumed = on_resumed
        self._busy: set[tuple[int, int]] = set()  # the GPU processes a suspend works on now

    # -- what is suspended ------------------------------------------------------------------------------

    def records(self) -> list[SuspendedProcess]:
        return self.kept.records()

    def check_not_suspending(self, pid: int, start_time: int) -> None:
        """TooBusy while a suspend works on the process: no signal meets it mid-checkpoint."""
        if (pid, start_time) in self._busy:
            raise TooBusy(f"PID {pid} is being suspended; kill it once the suspend is done")

    # -- refusals, before anything is touched -------------------------------------------------------------

    def _refusal(self, snapshot: Snapshot, procs: dict[tuple[int, int], list[GpuProcess]]) -> str | None:
        """Why this workload cannot be suspended here, in one line; None when it can."""
        for listed in procs.values():
            for p in listed:
                device = snapshot.find_device(p.device_id)
                backend = device.backend if device else "?"
                if backend != "nvidia":
                    vendor = "simulated" if backend == "simulated" else f"an AMD/Intel GPU ({backend} backend)"
                    return f"GPU {p.device} is {vendor}: {UNSUPPORTED_VENDOR}"
                if device is not None and (device.parent_id or device.mig_mode):
                    return f"GPU {p.device} is a MIG device: the driver cannot checkpoint processes on MIG instances"
        machine = platform.machine()
        if machine != "x86_64":
            return f"suspend needs an x86-64 host (the driver's checkpoint API); this one is {machine}"
        version = getattr(self._backends().get("nvidia"), "driver_version", None)
        major = _driver_major(version)
        if major is None:
            return "the NVIDIA driver's version is unknown (NVML did not start): nothing can be suspended"
        if major < MIN_DRIVER:
            return f"NVIDIA driver {version} cannot suspend: the checkpoint API needs driver {MIN_DRIVER} or later"
        if major < MIN_DRIVER_IPC and len(procs) > 1:
            return (
                f"NVIDIA driver {version} cannot suspend a workload of {len(procs)} processes together: CUDA IPC "
                f"between them needs driver {MIN_DRIVER_IPC} or later; suspend one process (gpukillctl suspend PID)"
            )
        if find_cuda_checkpoint(self._settings().cuda_checkpoint) is None:
            where = self._settings().cuda_checkpoint or "/usr/bin, /usr/local/bin or /usr/local/cuda/bin"
            return f"NVIDIA's cuda-checkpoint utility is not installed ({where}; gpukilld.conf cuda_checkpoint)"
        need = sum(p.gpu_memory or 0 for listed in procs.values() for p in listed)
        info = _meminfo(self.procfs.root)
        available = info.get("MemAvailable", 0)
        if need > available:
            return (
                f"the workload's {format_size(need)} of GPU memory does not fit in host memory: "
                f"{format_size(available)} available"
            )
        cap = self._settings().host_memory_max
        cap = cap if cap is not None else info.get("MemTotal", 0) // 2
        held = self.kept.held_memory()
        if held + need > cap:
            return (
                f"the workload's {format_size(need)} of GPU memory is over what suspended workloads may hold: "
                f"{format_size(cap)} (gpukilld.conf suspend_host_memory_max), {format_size(held)} held already"
            )
        return None

    # -- suspend ------------------------------------------------------------------------------------------

    @staticmethod
    def _caller_fields(caller: Caller | None) -> dict[str, object]:
        return {"caller_uid": caller.uid if caller else None, "caller_pid": caller.pid if caller else None}

    def _refused(
        self, caller: Caller | None, act: str, selection: Selection, e: GpukillError, initiator: str = INITIATOR_USER
    ) -> None:
        who = caller.who if caller else initiator
        self.bouncer.refusals.log(
            self.bouncer.people.person(caller.uid) if caller else None,
            journal.SUSPEND_FAILED,
            f"{act.capitalize()} of the {selection.text} requested by {who} refused: {e}",
            action=act,
            selection=selection.text,
            result=e.result,
            error=str(e),
            initiator=initiator,
            **self._caller_fields(caller),
        )

    async def _authorize(self, caller: Caller, target: PinnedProcess, act: str, method: Method, selection: str) -> None:
        fields = {
            "action": act,
            "selection": selection,
            "target_pid": target.pid,
            "target_start_time": target.start_time,
            "target_uid": target.uid,
            "target_comm": target.comm,
        }
        label = f"PID {target.pid} ({shown(target.comm)}, user {shown(target.user)})"
        await self.bouncer.check(
            caller,
            method,
            {"pid": str(target.pid), "target_user": target.user, "device": ",".join(target.device_ids)},
            target.uid,
            request=Request(
                journal.SUSPEND_DENIED,
                f"{act.capitalize()} of {label}",
                f"{act} PID {target.pid} ({shown(target.comm)}) of user {shown(target.user)}",
                fields,
            ),
        )

    async def suspend(
        self, caller: Caller | None, selection: Selection, initiator: str = INITIATOR_USER
    ) -> SuspendReply:
        """Suspend every GPU process of the selection together, or none (see the module's docstring). caller None:
        the daemon itself (a Guard rule, initiator "guard:RULE"), with every check but polkit's; a process its
        selection leaves running (Guard's spare, owner, only) refuses the whole: never half a workload."""
        try:
            snapshot = await self._resample()
            chosen, left = await asyncio.to_thread(selection.resolve, self.procfs, snapshot)
            if spared := selection.guard_left(chosen, lambda k: next((p.uid for p in snapshot.processes_of(*k)), None)):
                (pid, _), spared_why = spared[0]
                error = TooBusy if spared_why == GUARD_ONLY else NotSupported
                raise error(
                    f"PID {pid} of the {selection.text} would be left running ({spared_why}): a workload is "
                    "suspended whole or not at all"
                )
            if len(chosen) > MAX_WORKLOAD:
                raise InvalidArgs(f"{selection.text} selects {len(chosen)} GPU processes; at most {MAX_WORKLOAD}")
            if any(k in self._busy for k in chosen):
                raise TooBusy(f"a suspend of {selection.text} runs already; try again when it is done")
            if held := next((k for k in chosen if self.kept.holding(*k)), None):
                raise InvalidArgs(f"PID {held[0]} is suspended already (gpukillctl resume {held[0]})")
            procs = {k: snapshot.processes_of(*k) for k in chosen}
            why = self._refusal(snapshot, procs)
            if why is not None:
                raise NotSupported(why)
        except GpukillError as e:
            self._refused(caller, "suspend", selection, e, initiator)
            raise
        self._busy.update(chosen)
        pinned: list[PinnedProcess] = []
        try:
            try:
                for pid, start_time in chosen:
                    pinned.append(self.killer.open(pid, start_time, snapshot))
            except GpukillError as e:
                self._refused(caller, "suspend", selection, e, initiator)
                raise
            if caller is not None:
                for target in pinned:  # one after the other: a prompt's auth_admin_keep covers the rest
                    await self._authorize(caller, target, "suspend", SUSPEND_METHOD, selection.text)
            # frozen with them: the tree's other processes of the same owners (another user's helper in one's
            # tree was not asked about, and gets no signal)
            owners = {t.uid for t in pinned}
            members = sorted(set(chosen) | {(pid, start) for pid, start, uid, _comm in left if uid in owners})
            return await self._suspend_pinned(caller, selection, snapshot, procs, pinned, members, initiator)
        finally:
            for target in pinned:
                target.close()
            self._busy.difference_update(chosen)

    def _tool(self) -> CudaCheckpoint:
        path = find_cuda_checkpoint(self._settings().cuda_checkpoint)
        if path is None:
            raise NotSupported("NVIDIA's cuda-checkpoint utility is no longer installed")
        return CudaCheckpoint(path)

    async def _step(
        self, tool: CudaCheckpoint, action: str, targets: list[PinnedProcess], moved: dict[int, int] | None = None
    ) -> dict[int, str]:
        """One step for every target at once (moved: the bytes each copies, by PID); the errors by PID."""
        results = await asyncio.gather(
            *(tool.act(action, t.pid, moved=(moved or {}).get(t.pid, 0)) for t in targets), return_exceptions=True
        )
        return {t.pid: str(r) or type(r).__name__ for t, r in zip(targets, results, strict=True) if r is not None}

    async def _memory_gone(self, targets: list[PinnedProcess]) -> list[PinnedProcess]:
        """The targets the samples still list on a GPU after VERIFY_SAMPLES of them ([] when all left)."""
        still = targets
        for _ in range(VERIFY_SAMPLES):
            snapshot = await self._resample()
            still = [t for t in targets if snapshot.processes_of(t.pid, t.start_time)]
            if not still:
                return []
        return still

    async def _suspend_pinned(
        self,
        caller: Caller | None,
        selection: Selection,
        snapshot: Snapshot,
        procs: dict[tuple[int, int], list[GpuProcess]],
        pinned: list[PinnedProcess],
        members: list[tuple[int, int]],
        initiator: str,
    ) -> SuspendReply:
        who = caller.who if caller else initiator
        tool = self._tool()
        errors = await self._step(tool, "lock", pinned)
        if not errors:
            moved = {t.pid: sum(p.gpu_memory or 0 for p in procs[(t.pid, t.start_time)]) for t in pinned}
            errors = await self._step(tool, "checkpoint", pinned, moved)
        if not errors:
            still = await self._memory_gone(pinned)
            errors = {
                t.pid: f"its memory is still on GPU {procs[(t.pid, t.start_time)][0].device} after {VERIFY_SAMPLES} "
                "samples"
                for t in still
            }
        frozen: Frozen | None = None
        if not errors:
            try:
                frozen = await asyncio.to_thread(freeze, self.procfs, self._settings().sys_root, members)
            except OSError as e:
                errors = {0: f"the workload could not be frozen: {e}"}
        now = time.time()

        def record(t: PinnedProcess, state: str, error: str = "", remedy: str = "") -> SuspendedProcess:
            listed = procs[(t.pid, t.start_time)]
            per_device: dict[str, int] = {}
            for p in listed:
                per_device[p.device_id] = per_device.get(p.device_id, 0) + (p.gpu_memory or 0)
            return SuspendedProcess(
                t.pid,
                t.start_time,
                t.uid,
                t.comm,
                state,
                tuple(sorted({p.device for p in listed})),
                tuple(per_device),
                sum(per_device.values()),
                tuple(per_device.values()),
                selection.text,
                now,
                frozen.kind if frozen and state == SUSPENDED else "",
                error,
                remedy,
                initiator,
            )

        listed = [p for k in procs for p in procs[k]]
        units = tuple(sorted({p.unit for p in listed if p.unit}))
        jobs = tuple(sorted({p.slurm_job for p in listed if p.slurm_job}))
        if errors:
            return await self._undo(caller, selection, tool, pinned, errors, record, units, jobs, initiator)
        assert frozen is not None
        records = [record(t, SUSPENDED) for t in pinned]
        self.kept.add(Workload(selection.text, records, frozen, units, jobs))
        memory = sum(r.memory for r in records)
        for r in records:
            self.audit.log(
                journal.SUSPEND,
                f"PID {r.pid} ({shown(r.comm)}) of {selection.text} suspended: {format_size(r.memory)} of GPU memory "
                f"set aside in host memory, {frozen.text}; requested by {who}",
                action="suspend",
                result=SUSPENDED,
                selection=selection.text,
                target_pid=r.pid,
                target_start_time=r.start_time,
                target_uid=r.uid,
                target_comm=r.comm,
                device=",".join(r.device_ids),
                memory=r.memory,
                frozen=frozen.kind,
                initiator=initiator,
                **self._caller_fields(caller),
            )
            self._on_suspended(r, caller)
        message = (
            f"{len(records)} process(es) suspended: {format_size(memory)} of GPU memory set aside in host memory; "
            f"{frozen.text}"
        )
        return SuspendReply(selection.text, "suspend", DONE, message, tuple(records), memory, frozen.kind)

    async def _undo(
        self,
        caller: Caller | None,
        selection: Selection,
        tool: CudaCheckpoint,
        pinned: list[PinnedProcess],
        errors: dict[int, str],
        record: Callable[..., SuspendedProcess],
        units: tuple[str, ...],
        jobs: tuple[str, ...],
        initiator: str,
    ) -> SuspendReply:
        """Bring every process back after a step failed: restore and unlock what was checkpointed, unlock what
        was locked (the driver says which); what cannot be brought back is recorded stuck."""
        entries = []
        for t in pinned:
            error = errors.get(t.pid, "")
            try:
                state = await tool.state(t.pid)
                if state == CHECKPOINTED:
                    try:
                        await tool.act("restore", t.pid, moved=record(t, RUNNING).memory)
                    except CheckpointError as e:
                        entries.append(record(t, STUCK, f"{error}; {e}".lstrip("; "), _remedy(REMEDY_RESTORE, t.pid)))
                        continue
                    state = LOCKED
                if state == LOCKED:
                    try:
                        await tool.act("unlock", t.pid)
                    except CheckpointError as e:
                        entries.append(record(t, STUCK, f"{error}; {e}".lstrip("; "), _remedy(REMEDY_UNLOCK, t.pid)))
                        continue
                    state = DRIVER_RUNNING
                if state != DRIVER_RUNNING:
                    entries.append(
                        record(t, STUCK, f"{error}; driver state {state}".lstrip("; "), _remedy(REMEDY_RESTORE, t.pid))
                    )
                    continue
            except CheckpointError as e:
                entries.append(record(t, STUCK, f"{error}; {e}".lstrip("; "), _remedy(REMEDY_RESTORE, t.pid)))
                continue
            entries.append(record(t, RUNNING, error))
        first = errors.get(0) or next(iter(errors.values()))
        stuck = [e for e in entries if e.state == STUCK]
        if stuck:
            self.kept.add(
                Workload(selection.text, stuck, Frozen("", "", ()), units, jobs)
            )  # listed, and killed through the suspended path, never retried by itself
            message = (
                f"suspend failed ({first}); {len(entries) - len(stuck)} process(es) running again, "
                f"{len(stuck)} stuck: {stuck[0].remedy}"
            )
        else:
            message = f"suspend failed ({first}); every process is running again"
        self.audit.log(
            journal.SUSPEND_FAILED,
            f"Suspend of the {selection.text} requested by {caller.who if caller else initiator}: {message}",
            action="suspend",
            selection=selection.text,
            result="partial" if stuck else "undone",
            error=first,
            stuck=",".join(str(e.pid) for e in stuck) or None,
            remedy=stuck[0].remedy if stuck else None,
            initiator=initiator,
            **self._caller_fields(caller),
        )
        return SuspendReply(selection.text, "suspend", PARTIAL if stuck else UNDONE, message, tuple(entries), 0, "")

    # -- resume -------------------------------------------------------------------------------------------

    def _pin(self, p: SuspendedProcess) -> PinnedProcess | None:
        """A recorded process held by its pidfd, or None when it no longer exists (pid and start time)."""
        try:
            pidfd = os.pidfd_open(p.pid)
        except OSError:
            return None
        if self.procfs.start_time(p.pid) != p.start_time:
            os.close(pidfd)
            return None
        return PinnedProcess(p.pid, p.start_time, p.uid, user_name(p.uid), p.comm, p.device_ids, pidfd)

    def _check_free(self, snapshot: Snapshot, records: list[SuspendedProcess]) -> None:
        """DeviceBusy with the figures unless each device has the memory its records need free now."""
        needed: dict[str, int] = {}
        for r in records:
            for device_id, memory in zip(r.device_ids, r.device_memory, strict=False):
                needed[device_id] = needed.get(device_id, 0) + memory
        for device_id, need in needed.items():
            device = snapshot.find_device(device_id)
            if device is None:
                raise DeviceBusy(f"GPU {device_id} is not present: the workload needs {format_size(need)} there")
            free = (device.memory_total or 0) - (device.memory_used or 0)
            if need > free:
                raise DeviceBusy(
                    f"GPU {device.index} has {format_size(free)} free; the workload needs {format_size(need)}"
                )

    async def resume(self, caller: Caller | None, selection: Selection) -> SuspendReply:
        """Give a suspended workload its GPU memory back (see the module's docstring)."""
        try:
            self.kept.drop_gone()  # a few reads of /proc/PID/stat
            if (
                selection.kind in ("pid", "tree")
                and selection.start_time
                and self.procfs.start_time(int(selection.value)) != selection.start_time
            ):
                raise NoSuchProcess(f"PID {selection.value} now belongs to another process than the one listed")
            workloads = self.kept.selected(selection.kind, selection.value)
            if not workloads:
                raise NoSuchProcess(f"nothing of the {selection.text} is suspended")
            if any(w.busy for w in workloads):
                raise TooBusy(f"a resume or kill of the {selection.text} runs already; try again when it is done")
        except GpukillError as e:
            self._refused(caller, "resume", selection, e)
            raise
        for w in workloads:
            w.busy = True
        pinned: list[tuple[Workload, SuspendedProcess, PinnedProcess]] = []
        try:
            for w in workloads:
                for p in w.processes:
                    target = self._pin(p)
                    if target is not None:
                        pinned.append((w, p, target))
            if caller is not None:
                for _, _, target in pinned:
                    await self._authorize(caller, target, "resume", RESUME_METHOD, selection.text)
            try:
                self._check_free(await self._resample(), [p for _, p, _ in pinned])
            except GpukillError as e:
                self._refused(caller, "resume", selection, e)
                raise
            return await self._resume_pinned(caller, selection, workloads, pinned)
        finally:
            for _, _, target in pinned:
                target.close()
            for w in workloads:
                w.busy = False

    async def _resume_pinned(
        self,
        caller: Caller | None,
        selection: Selection,
        workloads: list[Workload],
        pinned: list[tuple[Workload, SuspendedProcess, PinnedProcess]],
    ) -> SuspendReply:
        tool = self._tool()
        targets = [t for _, _, t in pinned]
        # Thawed first: the driver restores a process through a thread of its own (its restore thread, as
        # cuCheckpointProcessGetRestoreThreadId names it), which a stopped or frozen process never runs. Its CUDA
        # calls stay locked until the unlock below.
        for w in workloads:
            if w.frozen.members:
                await asyncio.to_thread(thaw, self.procfs, w.frozen)
        restore_errors = await self._step(tool, "restore", targets, {p.pid: p.memory for _, p, _ in pinned})
        restored = [t for t in targets if t.pid not in restore_errors]
        unlock_errors = await self._step(tool, "unlock", restored)
        entries: list[SuspendedProcess] = []
        for _, p, t in pinned:
            if t.pid in restore_errors:
                entry = self.kept.with_state(p, STUCK, restore_errors[t.pid], _remedy(REMEDY_RESTORE, t.pid))
            elif t.pid in unlock_errors:
                entry = self.kept.with_state(p, STUCK, unlock_errors[t.pid], _remedy(REMEDY_UNLOCK, t.pid))
            else:
                entry = self.kept.with_state(p, RUNNING)
            entries.append(entry)
        stuck = [e for e in entries if e.state == STUCK]
        for w in workloads:
            keep = [e for e in entries if e.state == STUCK and (e.pid, e.start_time) in w.key_set()]
            w.frozen = Frozen("", "", ())  # thawed: a stuck process left is not frozen any more
            self.kept.replace(w, keep)
        memory = sum(e.memory for e in entries if e.state == RUNNING)
        who = caller.who if caller else "gpukilld"
        for e in entries:
            self.audit.log(
                journal.SUSPEND if e.state == RUNNING else journal.SUSPEND_FAILED,
                f"PID {e.pid} ({shown(e.comm)}) of {selection.text} "
                + (
                    f"resumed: {format_size(e.memory)} of GPU memory given back"
                    if e.state == RUNNING
                    else f"could not be resumed ({e.error}): stuck; {e.remedy}"
                )
                + f"; requested by {who}",
                action="resume",
                result=e.state,
                selection=selection.text,
                target_pid=e.pid,
                target_start_time=e.start_time,
                target_uid=e.uid,
                target_comm=e.comm,
                device=",".join(e.device_ids),
                memory=e.memory,
                error=e.error or None,
                remedy=e.remedy or None,
                **self._caller_fields(caller),
            )
            self._on_resumed(e, caller)
        frozen = workloads[0].frozen.kind if workloads else ""
        if stuck:
            message = (
                f"{len(entries) - len(stuck)} process(es) resumed, {len(stuck)} stuck ({stuck[0].error}): "
                f"{stuck[0].remedy}"
            )
            return SuspendReply(selection.text, "resume", PARTIAL, message, tuple(entries), memory, frozen)
        message = f"{len(entries)} process(es) resumed: {format_size(memory)} of GPU memory given back"
        return SuspendReply(selection.text, "resume", DONE, message, tuple(entries), memory, frozen)

    # -- a kill of a suspended process --------------------------------------------------------------------

    def pin_suspended(self, pid: int, start_time: int) -> PinnedProcess | None:
        """A suspended (or stuck) process held by its pidfd, for the kill path; None when it is not one."""
        held = self.kept.holding(pid, start_time)
        return self._pin(held[1]) if held else None

    async def kill_suspended(self, target: PinnedProcess, who: str) -> Outcome:
        """SIGKILL to a checkpointed, frozen process (never to one mid-restore: refused while its workload's
        resume runs), then its workload thawed if nothing of it is left suspended, and its record removed."""
        held = self.kept.holding(target.pid, target.start_time)
        if held is None:
            raise NoSuchProcess(f"PID {target.pid} is no longer suspended")
        workload, record = held
        if workload.busy:
            raise TooBusy(f"PID {target.pid} is being resumed; kill it once the resume is done")
        workload.busy = True
        try:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(target.pidfd, signal.SIGKILL)
            exited = await Killer._wait_exit(target.pidfd, KILL_WAIT)
            rest = [p for p in workload.processes if (p.pid, p.start_time) != (target.pid, target.start_time)]
            if workload.frozen.members and (not rest or (not exited and workload.frozen.kind == FROZEN_CGROUP)):
                # a v1 freezer holds a killed task until thawed; v2 and SIGSTOP let SIGKILL through
                await asyncio.to_thread(thaw, self.procfs, workload.frozen)
                exited = exited or await Killer._wait_exit(target.pidfd, KILL_WAIT)
            self.kept.replace(workload, rest)
        finally:
            workload.busy = False
        outcome = Outcome.KILLED if exited else Outcome.STILL_ALIVE
        self.audit.log(
            journal.SUSPEND,
            f"Suspended PID {target.pid} ({shown(target.comm)}) of {workload.selection} killed: {outcome.text}; "
            f"requested by {who}",
            action="kill",
            result=outcome,
            selection=workload.selection,
            target_pid=target.pid,
            target_start_time=target.start_time,
            target_uid=target.uid,
            target_comm=target.comm,
            memory=record.memory,
        )
        return outcome
