"""The privileged acts, bus-independent: kill a process, reset a device. Each one is authorized and audited.

The bus layer (gpukilld/bus/manager.py) turns D-Bus calls into these; Guard Mode calls the same kill path. Whether a
caller may is the bouncer's check, which audits a denial itself. Other refusals of a caller's request go
through the bouncer's RefusalLog (folded per person when there are too many); what the daemon does is always
audited one by one. Process names are escaped in the human text (MESSAGE, errors), exact in the fields.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gpukill.checkpoint import Declaration
from gpukill.errors import (
    DeviceBusy,
    GpukillError,
    InvalidArgs,
    NoSuchDevice,
    NotAGpuProcess,
    NotSupported,
    Protected,
    ResetFailed,
)
from gpukill.outcome import INITIATOR_RESET, Outcome, guard_initiator, reclaim_text
from gpukill.records.reclaim import ALIVE, UNWATCHED, CheckpointStep, Reclaim, WorkloadEntry, WorkloadReply
from gpukill.records.status import ResetReply
from gpukill.rules import KILL
from gpukill.text import shown

from .. import journal
from ..access.bouncer import KILL_METHOD, RESET_METHOD, WORKLOAD_METHOD, Bouncer, Caller, Method, Request
from ..backends import Backend
from ..model import Snapshot
from .checkpoint import Asked, Checkpoints
from .killer import Killer, PinnedProcess, check_grace
from .reclaim import FirstSignal, Watch, reclaim_fields, remember_tree
from .selection import MAX_WORKLOAD, Selection
from .suspend import Suspender

log = logging.getLogger(__name__)

RESET_KILL_GRACE = 5.0


@dataclass(frozen=True, slots=True)
class KillResult:
    pid: int
    start_time: int
    uid: int
    comm: str
    device_ids: tuple[str, ...]
    outcome: Outcome
    initiator: str  # gpukill.outcome's: INITIATOR_USER, INITIATOR_RESET or guard_initiator(RULE)
    reclaim: Reclaim = Reclaim(UNWATCHED)  # the GPU's answer (reclaim.py)
    checkpoint: CheckpointStep | None = None  # what the checkpoint step did, where the kill had one


def _owner(snapshot: Snapshot, key: tuple[int, int]) -> int | None:
    listed = snapshot.processes_of(*key)
    return listed[0].uid if listed else None


def _first_signal(step: CheckpointStep | None) -> FirstSignal:
    """The first signal of a kill, for the seconds until its memory is back: the checkpoint signal when one was
    sent (its wait, Guard's grace included, counts), else the SIGTERM about to be sent."""
    now = time.monotonic()
    if step is not None and step.signal and step.pids:
        return FirstSignal(step.signal, now - step.waited)
    return FirstSignal("SIGTERM", now)


def _entry_of(snapshot: Snapshot, pid: int, start_time: int, result: str, error: str) -> WorkloadEntry:
    """A refused process of a batch, named as the snapshot listed it."""
    listed = next(iter(snapshot.processes_of(pid, start_time)), None)
    return WorkloadEntry(pid, start_time, listed.uid if listed else 0, listed.comm if listed else "", result, error)


class Actions:
    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        backends: dict[str, Backend],
        bouncer: Bouncer,
        killer: Killer,
        auditor: journal.Audit,
        on_killed: Callable[[KillResult, Caller | None], None],
        on_reset: Callable[[ResetReply, bool], None],
        resample: Callable[[], Awaitable[Snapshot]],
        suspender: Suspender | None = None,
    ) -> None:
        self._snapshot = snapshot
        # The suspended processes: they left the GPU's lists, and a kill of one goes through its own path.
        self.suspender = suspender
        self.backends = backends
        self.bouncer = bouncer
        self.killer = killer
        self.audit = auditor
        self._on_killed = on_killed
        self._on_reset = on_reset
        self._resample = resample
        self.refusals = bouncer.refusals  # the bouncer's: all refusals of a caller are folded together
        self.checkpoints = Checkpoints(killer, auditor)

    @staticmethod
    def _caller_fields(caller: Caller | None) -> dict[str, object]:
        if caller is None:
            return {"caller_uid": None, "caller_pid": None}
        return {"caller_uid": caller.uid, "caller_pid": caller.pid}

    def _refused(self, caller: Caller | None, kind: journal.EventKind, message: str, **fields: object) -> None:
        # folded per person: a uid's subordinate uids are not 65,536 more windows (gpukilld/access/people.py)
        self.refusals.log(self.bouncer.people.person(caller.uid) if caller else None, kind, message, **fields)

    async def kill(
        self,
        caller: Caller | None,
        pid: int,
        start_time: int,
        grace: float,
        force: bool,
        initiator: str,
        watch: bool = True,
        method: Method = KILL_METHOD,
        checkpoint: bool = False,
        rule_checkpoint: Declaration | None = None,
        asked: dict[tuple[int, int], Asked] | None = None,
    ) -> KillResult:
        """Kill (pid, start_time). caller None means the daemon itself acts (a reset with force, Guard).
        initiator (gpukill.outcome's) goes into the journal and ProcessKilled as it is. watch: after the exit,
        watch its devices for the GPU's answer (reclaim.py); a reset clearing its device does not. method: the
        bus method called (KillProcess, KillProcessReport): its row of the bouncer's table decides.
        checkpoint: before SIGTERM, the checkpoint step (checkpoint.py), with rule_checkpoint for a process that
        declares none; asked: checkpoint signals Guard sent already, whose waits the kill finishes first."""
        base = self._base(caller, pid, start_time, force, initiator)
        who = self._who(caller, initiator)
        suspended = self.suspender.pin_suspended(pid, start_time) if self.suspender else None
        if suspended is not None:
            return await self._kill_suspended(caller, suspended, grace, base, method, who, initiator)
        try:
            check_grace(grace)
            if self.suspender is not None:
                self.suspender.check_not_suspending(pid, start_time)
            snapshot = self._snapshot()
            target = self.killer.open(pid, start_time, snapshot)
        except GpukillError as e:
            self._refused(
                caller,
                journal.KILL_FAILED,
                f"Kill of PID {pid} requested by {who} refused: {e}",
                result=e.result,
                error=str(e),
                **base,
            )
            raise
        try:
            fields = self._fields(target, base)
            if caller is not None:
                fields["polkit_action"] = await self._authorize(caller, target, fields, method)
            the_watch = await self._watch(snapshot, [target]) if watch else None
            step = await self._checkpoint([(target, fields)], snapshot, checkpoint, rule_checkpoint, asked)
            first = _first_signal(step)  # what the answer's seconds count from
            outcome = await self._terminate(target, grace, force, step)
            reclaim = await self._answer(the_watch, [(target, outcome)], force, first)
        finally:
            target.close()
        return self._done(caller, target, outcome, reclaim, grace, fields, who, initiator, step)

    async def _checkpoint(
        self,
        pinned: list[tuple[PinnedProcess, dict[str, object]]],
        snapshot: Snapshot,
        checkpoint: bool,
        rule_checkpoint: Declaration | None,
        asked: dict[tuple[int, int], Asked] | None,
    ) -> CheckpointStep | None:
        """The checkpoint step before SIGTERM: Guard's signals sent earlier awaited, or (asked for) the whole
        step; None when there is none."""
        targets = [t for t, _ in pinned]
        fields = {t.pid: f for t, f in pinned}
        if asked:
            step = await self.checkpoints.await_asked(targets, asked, fields)
            if step is not None:
                return step
        if checkpoint:
            return await self.checkpoints.before_term(targets, snapshot, fields, rule_checkpoint)
        return None

    async def _terminate(
        self, target: PinnedProcess, grace: float, force: bool, step: CheckpointStep | None
    ) -> Outcome:
        """SIGTERM as today, unless the checkpoint step saw the process exit already: no TERM then."""
        if step is not None and self.killer.exited(target):
            return Outcome.TERMINATED
        return await self.killer.terminate(target, grace, force)

    async def ask_to_save(
        self,
        targets: list[tuple[int, int]],
        initiator: str,
        rule: str,
        rule_checkpoint: Declaration | None,
        dry_run: bool,
    ) -> list[Asked]:
        """Guard, when a kill rule's grace begins: send the targets that declare a checkpoint signal their
        signal now, each pinned and checked as the kill path pins and checks it (what it refuses gets nothing);
        in a dry run nothing is sent, and what would be is returned."""
        snapshot = self._snapshot()
        pinned: list[PinnedProcess] = []
        try:
            for pid, start_time in targets:
                try:
                    pinned.append(self.killer.open(pid, start_time, snapshot))
                except GpukillError:
                    continue  # gone or refused: its kill, if it comes, is refused and audited there
            fields: dict[str, object] = {"initiator": initiator, "rule": rule}
            return await self.checkpoints.ask(
                pinned, snapshot, {t.pid: fields for t in pinned}, rule_checkpoint, dry_run
            )
        finally:
            for t in pinned:
                t.close()

    async def _kill_suspended(
        self,
        caller: Caller | None,
        target: PinnedProcess,
        grace: float,
        base: dict[str, object],
        method: Method,
        who: str,
        initiator: str,
    ) -> KillResult:
        """A suspended process: not on a GPU's list any more, killed by the suspend path (SIGKILL to the
        checkpointed process, never while its resume runs), authorized and audited as any kill."""
        assert self.suspender is not None
        try:
            fields = self._fields(target, base)
            if caller is not None:
                fields["polkit_action"] = await self._authorize(caller, target, fields, method)
            outcome = await self.suspender.kill_suspended(target, who)
        finally:
            target.close()
        return self._done(caller, target, outcome, Reclaim(UNWATCHED), grace, fields, who, initiator)

    @staticmethod
    def _base(caller: Caller | None, pid: int, start_time: int, force: bool, initiator: str) -> dict[str, object]:
        return {
            "action": KILL,
            "target_pid": pid,
            "target_start_time": start_time,
            "initiator": initiator,
            "force": int(force),
            **Actions._caller_fields(caller),
        }

    @staticmethod
    def _who(caller: Caller | None, initiator: str) -> str:
        return f"uid {caller.uid}" if caller else initiator

    @staticmethod
    def _fields(target: PinnedProcess, base: dict[str, object]) -> dict[str, object]:
        return {**base, "target_uid": target.uid, "target_comm": target.comm, "device": ",".join(target.device_ids)}

    @staticmethod
    def _label(target: PinnedProcess) -> str:
        return f"PID {target.pid} ({shown(target.comm)}, user {shown(target.user)})"

    async def _authorize(self, caller: Caller, target: PinnedProcess, fields: dict[str, object], method: Method) -> str:
        return await self.bouncer.check(
            caller,
            method,
            {"pid": str(target.pid), "target_user": target.user, "device": ",".join(target.device_ids)},
            target.uid,
            request=Request(
                journal.KILL_DENIED,
                f"Kill of {self._label(target)}",
                f"kill PID {target.pid} ({shown(target.comm)}) of user {shown(target.user)}",
                fields,
            ),
        )

    async def _watch(self, snapshot: Snapshot, targets: list[PinnedProcess]) -> Watch:
        """Remember the targets' trees before any signal: their orphans are named if they keep the GPU."""
        procfs = self.killer.procfs
        tree = await asyncio.to_thread(remember_tree, procfs, [t.pid for t in targets])
        return Watch(procfs, snapshot, [(t.pid, t.start_time) for t in targets], tree)

    async def _answer(
        self, the_watch: Watch | None, ended: list[tuple[PinnedProcess, Outcome]], force: bool, first: FirstSignal
    ) -> Reclaim:
        """The GPU's answer once every target ended (or outlived its signals); reclaimed, it says how long after
        the first signal the memory was back."""
        if the_watch is None:
            return Reclaim(UNWATCHED)
        alive = [t for t, outcome in ended if outcome == Outcome.STILL_ALIVE]
        if alive and force:  # SIGKILL was sent and did not end it
            return the_watch.stuck(alive[0].pid)
        if alive:
            return Reclaim(ALIVE, devices=the_watch.devices, remedy="kill --force sends SIGKILL")
        return await the_watch.after_exit(self._resample, first)

    def _done(
        self,
        caller: Caller | None,
        target: PinnedProcess,
        outcome: Outcome,
        reclaim: Reclaim,
        grace: float,
        fields: dict[str, object],
        who: str,
        initiator: str,
        step: CheckpointStep | None = None,
    ) -> KillResult:
        saved = f"; checkpoint: {step.text}" if step is not None else ""
        self.audit.log(
            journal.KILL,
            f"{self._label(target)} {outcome.text}{saved}; {reclaim_text(reclaim)}; requested by {who}",
            result=outcome,
            grace=grace,
            checkpoint=step.result if step is not None else None,
            **fields,
            **reclaim_fields(reclaim),
        )
        result = KillResult(
            target.pid,
            target.start_time,
            target.uid,
            target.comm,
            target.device_ids,
            outcome,
            initiator,
            reclaim,
            step,
        )
        self._on_killed(result, caller)
        return result

    async def kill_workload(
        self,
        caller: Caller | None,
        selection: Selection,
        grace: float,
        force: bool,
        initiator: str,
        method: Method = WORKLOAD_METHOD,
        checkpoint: bool = False,
        rule_checkpoint: Declaration | None = None,
        asked: dict[tuple[int, int], Asked] | None = None,
    ) -> WorkloadReply:
        """Kill every GPU process a selection names (a tree, a unit, a container, a Slurm job), each as kill()
        kills one: pinned by pidfd and start time before any signal, each authorized by polkit (one after the
        other, so a prompt's auth_admin_keep covers the rest), refusals reported per process (when polkit
        refuses every one, the call is refused as a single kill would be); then all are signalled together and
        the GPU's answer is watched once for the batch. checkpoint, rule_checkpoint, asked: as kill()'s, for the batch
        (its leaders get the signal, all are awaited together)."""
        check_grace(grace)
        snapshot = await self._resample()  # a worker started since the last sample is in the batch too
        procfs = self.killer.procfs
        who = self._who(caller, initiator)
        try:
            chosen, not_on_gpu = await asyncio.to_thread(selection.resolve, procfs, snapshot)
        except GpukillError as e:  # gone, a reused PID, nothing of it on a GPU: audited as a single kill's
            pid = int(selection.value) if selection.kind in ("tree", "pid", "unit_of") else 0  # a job's is no PID
            self._refused(
                caller,
                journal.KILL_FAILED,
                f"Kill of the {selection.text} requested by {who} refused: {e}",
                result=e.result,
                error=str(e),
                selection=selection.text,
                **self._base(caller, pid, selection.start_time, force, initiator),
            )
            raise
        # Guard's: what its rule decided to leave running (exempt, protected), with why; then the subject's
        # owner's processes alone; then what the rule decided to stop, nothing that started since
        left = selection.guard_left(chosen, lambda k: _owner(snapshot, k))
        spared = {k for k, _ in left}
        chosen = [k for k in chosen if k not in spared]
        if len(chosen) > MAX_WORKLOAD:
            raise InvalidArgs(
                f"{selection.text} selects {len(chosen)} GPU processes; at most {MAX_WORKLOAD} are killed in one act"
            )
        entries: dict[int, WorkloadEntry] = {
            pid: _entry_of(snapshot, pid, start_time, Protected.result, why)
            for (pid, start_time), why in left[:MAX_WORKLOAD]
        }
        pinned: list[tuple[PinnedProcess, dict[str, object]]] = []
        try:
            for pid, start_time in chosen:
                base = self._base(caller, pid, start_time, force, initiator)
                try:
                    if self.suspender is not None:
                        self.suspender.check_not_suspending(pid, start_time)
                    target = self.killer.open(pid, start_time, snapshot)
                except GpukillError as e:
                    self._refused(
                        caller,
                        journal.KILL_FAILED,
                        f"Kill of PID {pid} requested by {who} ({selection.text}) refused: {e}",
                        result=e.result,
                        error=str(e),
                        **base,
                    )
                    entries[pid] = _entry_of(snapshot, pid, start_time, e.result, str(e))
                    continue
                pinned.append((target, self._fields(target, base) | {"selection": selection.text}))
            allowed: list[tuple[PinnedProcess, dict[str, object]]] = []
            denied: GpukillError | None = None
            for target, fields in pinned:
                if caller is not None:
                    try:
                        fields["polkit_action"] = await self._authorize(caller, target, fields, method)
                    except GpukillError as e:  # another user's process in one's tree: refused, and said so
                        entries[target.pid] = WorkloadEntry(
                            target.pid, target.start_time, target.uid, target.comm, e.result, str(e)
                        )
                        denied = denied or e
                        continue
                allowed.append((target, fields))
            if denied is not None and not allowed:
                raise denied
            the_watch = await self._watch(snapshot, [t for t, _ in allowed]) if allowed else None
            step = await self._checkpoint(allowed, snapshot, checkpoint, rule_checkpoint, asked) if allowed else None
            first = _first_signal(step)  # what the answer's seconds count from
            outcomes = await asyncio.gather(*(self._terminate(t, grace, force, step) for t, _ in allowed))
            ended = [(t, o) for (t, _), o in zip(allowed, outcomes, strict=True)]
            reclaim = await self._answer(the_watch, ended, force, first)
        finally:
            for target, _ in pinned:
                target.close()
        for (target, fields), outcome in zip(allowed, outcomes, strict=True):
            self._done(caller, target, outcome, reclaim, grace, fields, who, initiator, step)
            entries[target.pid] = WorkloadEntry(target.pid, target.start_time, target.uid, target.comm, outcome)
        for pid, start_time, uid, comm in not_on_gpu[:MAX_WORKLOAD]:
            entries.setdefault(
                pid,
                WorkloadEntry(
                    pid, start_time, uid, comm, NotAGpuProcess.result, "not on a GPU: left running", on_gpu=False
                ),
            )
        return WorkloadReply(
            selection.text,
            tuple(entries[pid] for pid in sorted(entries)),
            reclaim,
            checkpoint=step if allowed else None,
        )

    async def reset(self, caller: Caller | None, device_key: str, force: bool, rule: str = "") -> ResetReply:
        """Reset a device. caller None means the daemon itself acts: a Guard reset rule (`rule`), whose reset
        keeps every check but polkit's (the device resettable, nothing on it or, with force, its holders killed
        first through the kill path) and is audited with the rule."""
        who = f"uid {caller.uid}" if caller else guard_initiator(rule)
        base = {
            "action": "reset",
            "force": int(force),
            **self._caller_fields(caller),
            **({"initiator": guard_initiator(rule), "rule": rule} if caller is None else {}),
        }
        snapshot = self._snapshot()
        device = snapshot.find_device(device_key) if len(device_key) <= 256 else None
        if device is None:
            key = shown(device_key[:64])
            err = NoSuchDevice(f"no GPU '{key}' (give an index, UUID or PCI bus id)")
            self._refused(
                caller,
                journal.RESET_FAILED,
                f"Reset of '{key}' requested by {who}: {err}",
                result=err.result,
                device=device_key[:256],
                **base,
            )
            raise err
        fields = {**base, "device": device.id, "device_index": device.index}
        if caller is not None:
            await self.bouncer.check(
                caller,
                RESET_METHOD,
                {"device": device.id, "device_index": str(device.index)},
                request=Request(
                    journal.RESET_DENIED,
                    f"Reset of GPU {device.index} ({device.id})",
                    f"reset GPU {device.index}",
                    fields,
                ),
            )
        try:
            backend = self.backends.get(device.backend)
            if backend is None:
                raise NotSupported(f"the {device.backend} backend is no longer configured")
            backend.check_reset(device.id)  # never kill to clear a device that cannot be reset anyway
            killed = await self._clear_device(device.id, force, INITIATOR_RESET if caller else guard_initiator(rule))
            message = await asyncio.to_thread(backend.reset, device.id)
        except GpukillError as e:
            self.audit.log(
                journal.RESET_FAILED,
                f"Reset of GPU {device.index} ({device.id}) failed: {e}",
                result=e.result,
                error=str(e),
                **fields,
            )
            self._on_reset(ResetReply(device.index, device.id, str(e), ()), False)
            raise
        result = ResetReply(device.index, device.id, message, tuple(killed))
        self.audit.log(
            journal.RESET,
            f"GPU {device.index} ({device.id}) reset by {who}: {message}",
            result="reset",
            killed=",".join(map(str, killed)) or None,
            **fields,
        )
        self._on_reset(result, True)
        return result

    async def _clear_device(self, device_id: str, force: bool, initiator: str) -> list[int]:
        """Make sure nothing runs on the device: DeviceBusy without force, else kill each holder first."""
        snapshot = await self._resample()  # a process may have started since the last sample
        holders = {(p.pid, p.start_time): p for p in snapshot.processes if p.device_id == device_id}
        if not holders:
            return []
        if not force:
            names = ", ".join(f"{p.pid} ({shown(p.comm)})" for p in list(holders.values())[:8])
            raise DeviceBusy(f"{len(holders)} process(es) use the device: {names}; use force to kill them first")
        killed = []
        for (pid, start_time), _proc in holders.items():
            try:
                result = await self.kill(None, pid, start_time, RESET_KILL_GRACE, True, initiator, watch=False)
            except Protected as e:
                raise DeviceBusy(f"cannot clear the device: {e}") from None
            except GpukillError:
                continue  # gone meanwhile: nothing left to clear
            if result.outcome == Outcome.STILL_ALIVE:
                raise ResetFailed(f"PID {pid} survived SIGKILL; the device was not reset")
            killed.append(pid)
        return killed
