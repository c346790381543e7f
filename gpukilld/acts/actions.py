"""The privileged acts, bus-independent: kill a process, reset a device. Each one is authorized and audited.

The bus layer (gpukilld/bus/manager.py) turns D-Bus calls into these; Guard Mode calls the same kill path. Whether a
caller may is the bouncer's check, which audits a denial itself. Other refusals of a caller's request go
through the bouncer's RefusalLog (folded per person when there are too many); what the daemon does is always
audited one by one. Process names are escaped in the human text (MESSAGE, errors), exact in the fields.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gpukill.errors import (
    DeviceBusy,
    GpukillError,
    NoSuchDevice,
    NotSupported,
    Protected,
    ResetFailed,
)
from gpukill.outcome import INITIATOR_RESET, Outcome, guard_initiator
from gpukill.records import ResetReply
from gpukill.text import shown

from .. import journal
from ..access.bouncer import KILL_METHOD, RESET_METHOD, Bouncer, Caller, Request
from ..backends import Backend
from ..model import Snapshot
from .killer import Killer, check_grace

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
    ) -> None:
        self._snapshot = snapshot
        self.backends = backends
        self.bouncer = bouncer
        self.killer = killer
        self.audit = auditor
        self._on_killed = on_killed
        self._on_reset = on_reset
        self._resample = resample
        self.refusals = bouncer.refusals  # the bouncer's: all refusals of a caller are folded together

    @staticmethod
    def _caller_fields(caller: Caller | None) -> dict[str, object]:
        if caller is None:
            return {"caller_uid": None, "caller_pid": None}
        return {"caller_uid": caller.uid, "caller_pid": caller.pid}

    def _refused(self, caller: Caller | None, kind: journal.EventKind, message: str, **fields: object) -> None:
        # folded per person: a uid's subordinate uids are not 65,536 more windows (gpukilld/access/people.py)
        self.refusals.log(self.bouncer.people.person(caller.uid) if caller else None, kind, message, **fields)

    async def kill(
        self, caller: Caller | None, pid: int, start_time: int, grace: float, force: bool, initiator: str
    ) -> KillResult:
        """Kill (pid, start_time). caller None means the daemon itself acts (a reset with force, Guard).
        initiator (gpukill.outcome's) goes into the journal and ProcessKilled as it is."""
        base = {
            "action": "kill", "target_pid": pid, "target_start_time": start_time, "initiator": initiator,
            "force": int(force), **self._caller_fields(caller),
        }
        who = f"uid {caller.uid}" if caller else initiator
        try:
            check_grace(grace)
            target = self.killer.open(pid, start_time, self._snapshot())
        except GpukillError as e:
            self._refused(caller, journal.KILL_FAILED, f"Kill of PID {pid} requested by {who} refused: {e}",
                          result=e.result, error=str(e), **base)
            raise
        try:
            fields = {**base, "target_uid": target.uid, "target_comm": target.comm,
                      "device": ",".join(target.device_ids)}
            label = f"PID {pid} ({shown(target.comm)}, user {shown(target.user)})"
            if caller is not None:
                fields["polkit_action"] = await self.bouncer.check(
                    caller, KILL_METHOD,
                    {"pid": str(pid), "target_user": target.user, "device": ",".join(target.device_ids)},
                    target.uid,
                    request=Request(journal.KILL_DENIED, f"Kill of {label}",
                                    f"kill PID {pid} ({shown(target.comm)}) of user {shown(target.user)}", fields),
                )
            outcome = await self.killer.terminate(target, grace, force)
        finally:
            target.close()
        self.audit.log(journal.KILL, f"{label} {outcome.text}; requested by {who}",
                       result=outcome, grace=grace, **fields)
        result = KillResult(pid, start_time, target.uid, target.comm, target.device_ids, outcome, initiator)
        self._on_killed(result, caller)
        return result

    async def reset(self, caller: Caller | None, device_key: str, force: bool, rule: str = "") -> ResetReply:
        """Reset a device. caller None means the daemon itself acts: a Guard reset rule (`rule`), whose reset
        keeps every check but polkit's (the device resettable, nothing on it or, with force, its holders killed
        first through the kill path) and is audited with the rule."""
        who = f"uid {caller.uid}" if caller else guard_initiator(rule)
        base = {"action": "reset", "force": int(force), **self._caller_fields(caller),
                **({"initiator": guard_initiator(rule), "rule": rule} if caller is None else {})}
        snapshot = self._snapshot()
        device = snapshot.find_device(device_key) if len(device_key) <= 256 else None
        if device is None:
            key = shown(device_key[:64])
            err = NoSuchDevice(f"no GPU '{key}' (give an index, UUID or PCI bus id)")
            self._refused(caller, journal.RESET_FAILED, f"Reset of '{key}' requested by {who}: {err}",
                          result=err.result, device=device_key[:256], **base)
            raise err
        fields = {**base, "device": device.id, "device_index": device.index}
        if caller is not None:
            await self.bouncer.check(
                caller, RESET_METHOD, {"device": device.id, "device_index": str(device.index)},
                request=Request(journal.RESET_DENIED, f"Reset of GPU {device.index} ({device.id})",
                                f"reset GPU {device.index}", fields),
            )
        try:
            backend = self.backends.get(device.backend)
            if backend is None:
                raise NotSupported(f"the {device.backend} backend is no longer configured")
            backend.check_reset(device.id)  # never kill to clear a device that cannot be reset anyway
            killed = await self._clear_device(device.id, force,
                                              INITIATOR_RESET if caller else guard_initiator(rule))
            message = await asyncio.to_thread(backend.reset, device.id)
        except GpukillError as e:
            self.audit.log(journal.RESET_FAILED, f"Reset of GPU {device.index} ({device.id}) failed: {e}",
                           result=e.result, error=str(e), **fields)
            self._on_reset(ResetReply(device.index, device.id, str(e), ()), False)
            raise
        result = ResetReply(device.index, device.id, message, tuple(killed))
        self.audit.log(journal.RESET, f"GPU {device.index} ({device.id}) reset by {who}: {message}",
                       result="reset", killed=",".join(map(str, killed)) or None, **fields)
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
                result = await self.kill(None, pid, start_time, RESET_KILL_GRACE, True, initiator)
            except Protected as e:
                raise DeviceBusy(f"cannot clear the device: {e}") from None
            except GpukillError:
                continue  # gone meanwhile: nothing left to clear
            if result.outcome == Outcome.STILL_ALIVE:
                raise ResetFailed(f"PID {pid} survived SIGKILL; the device was not reset")
            killed.append(pid)
        return killed
