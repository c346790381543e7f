"""Who may do what: one table maps every method to a polkit action, and check() is the one decision.

Read-only methods map to READ_ONLY and need no authorization; anything unmapped is denied. An entry may be an
own/any pair (KillProcess, Postpone): the action for the caller's own target, or the stricter one for anyone else's.
Every privileged act (Actions.kill and .reset, the Guard interface's switches) calls check(), which picks the
action from the table, asks polkit, writes a denial's audit entry (through the RefusalLog, folded per person)
and raises it. Root callers skip polkit. Everyone else is judged by polkitd, asked with the caller's bus name
as subject, so polkit sees the real process and user. If polkitd is absent or fails, the answer is no. Checks
take turns at polkit (polkit_queue.py): a few of each person's at once (a person: a uid and its subordinate uids,
people.py), the rest waiting in that person's queue, first come first served; only a full queue is TooBusy. A
check that outlives its timeout (counted from its arrival, the wait for its turn included) is cancelled at
polkitd. VIEW_ALL is no method's action: it is asked, never interactively, to decide whether a
caller sees other users' processes in full (sees_all, viewer; visibility.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.constants import MessageFlag

from gpukill.errors import AccessDenied, TooBusy

from .. import journal
from ..names import GUARD_INTERFACE, MANAGER_INTERFACE
from .people import People, shared
from .polkit_queue import PolkitQueue
from .refusals import RefusalLog
from .visibility import ProcRules, Viewer, viewer_for

log = logging.getLogger(__name__)

READ_ONLY = ""  # needs no authorization
KILL_OWN = "org.gpukill.kill-own-process"
KILL_ANY = "org.gpukill.kill-any-process"
RESET_DEVICE = "org.gpukill.reset-device"
MANAGE_GUARD = "org.gpukill.manage-guard"
MANAGE_POLICIES = "org.gpukill.manage-policies"  # the managed user, group and GPU policies in guard.d
CONFIGURE_AUDIT = "org.gpukill.configure-audit"  # the rogue-activity audit's thresholds and allow-lists
POSTPONE_OWN = "org.gpukill.postpone-own"  # more time before a Guard kill of one's own process
POSTPONE_ANY = "org.gpukill.postpone-any"
SUSPEND_OWN = "org.gpukill.suspend-own-process"
SUSPEND_ANY = "org.gpukill.suspend-any-process"
RESUME_OWN = "org.gpukill.resume-own-process"
RESUME_ANY = "org.gpukill.resume-any-process"

Method = tuple[str, str]  # (interface, member), as called on the bus
KILL_METHOD: Method = (MANAGER_INTERFACE, "KillProcess")
RESET_METHOD: Method = (MANAGER_INTERFACE, "ResetDevice")
KILL_REPORT_METHOD: Method = (MANAGER_INTERFACE, "KillProcessReport")
WORKLOAD_METHOD: Method = (MANAGER_INTERFACE, "KillWorkload")
SUSPEND_METHOD: Method = (MANAGER_INTERFACE, "SuspendWorkload")
RESUME_METHOD: Method = (MANAGER_INTERFACE, "ResumeWorkload")


class OwnOrAny(str):
    """A table entry decided by whose target it is. As a string it is the action for another user's target
    (the stricter one: what a check without a target asks, and what the .policy file must define); `own` is
    the action asked when the caller owns the target."""

    own: str

    def __new__(cls, own: str, others: str) -> OwnOrAny:
        entry = super().__new__(cls, others)
        entry.own = own
        return entry


METHOD_ACTIONS: dict[Method, str] = {
    (MANAGER_INTERFACE, "ListDevices"): READ_ONLY,
    (MANAGER_INTERFACE, "ListProcesses"): READ_ONLY,
    (MANAGER_INTERFACE, "ListProcessesCompact"): READ_ONLY,  # ListProcesses in another form, filtered alike
    (MANAGER_INTERFACE, "AuditRogue"): READ_ONLY,  # filtered per caller as ListProcesses is
    # The audit's settings: reading them and a one-off scan with other thresholds (filtered as AuditRogue) are
    # open to everyone; changing what the audit reports, and what Guard's rogue_score reads, is configure-audit.
    (MANAGER_INTERFACE, "AuditRogueWith"): READ_ONLY,
    (MANAGER_INTERFACE, "GetAuditSettings"): READ_ONLY,
    (MANAGER_INTERFACE, "ExportAuditSettings"): READ_ONLY,
    (MANAGER_INTERFACE, "SetAuditSettings"): CONFIGURE_AUDIT,
    (MANAGER_INTERFACE, "ImportAuditSettings"): CONFIGURE_AUDIT,
    # GPU usage accounting: everyone sees their own records, others' as the listings show others' processes
    (MANAGER_INTERFACE, "GetUsage"): READ_ONLY,
    KILL_METHOD: OwnOrAny(own=KILL_OWN, others=KILL_ANY),
    # KillProcess with the GPU's answer; a workload's processes, each process of it asked as one kill
    KILL_REPORT_METHOD: OwnOrAny(own=KILL_OWN, others=KILL_ANY),
    WORKLOAD_METHOD: OwnOrAny(own=KILL_OWN, others=KILL_ANY),
    RESET_METHOD: RESET_DEVICE,
    # Suspend and resume: each process of the workload asked as one, by whose process it is; the list of what is
    # suspended is filtered per caller as the listings are
    SUSPEND_METHOD: OwnOrAny(own=SUSPEND_OWN, others=SUSPEND_ANY),
    RESUME_METHOD: OwnOrAny(own=RESUME_OWN, others=RESUME_ANY),
    (MANAGER_INTERFACE, "ListSuspended"): READ_ONLY,
    # Guard Mode: reading the state and asking what a policy would do (TestPolicies never acts) are open to
    # everyone; whatever changes what the guard enforces needs manage-guard.
    (GUARD_INTERFACE, "GetStatus"): READ_ONLY,
    (GUARD_INTERFACE, "TestPolicies"): READ_ONLY,
    (GUARD_INTERFACE, "Enable"): MANAGE_GUARD,
    (GUARD_INTERFACE, "Disable"): MANAGE_GUARD,
    (GUARD_INTERFACE, "SetDryRun"): MANAGE_GUARD,
    (GUARD_INTERFACE, "LoadPolicy"): MANAGE_GUARD,
    # More time before a kill rule's kill, within the rule's caps: an owner for their own process without a
    # password; for another user's, an admin.
    (GUARD_INTERFACE, "Postpone"): OwnOrAny(own=POSTPONE_OWN, others=POSTPONE_ANY),
    # Managed policies (files gpukilld writes into guard.d): reading them is open to everyone, as GetStatus's
    # rules are; whatever writes a file needs manage-policies.
    (GUARD_INTERFACE, "ListPolicies"): READ_ONLY,
    (GUARD_INTERFACE, "ExportPolicies"): READ_ONLY,
    (GUARD_INTERFACE, "SetPolicy"): MANAGE_POLICIES,
    (GUARD_INTERFACE, "RemovePolicy"): MANAGE_POLICIES,
    (GUARD_INTERFACE, "ImportPolicies"): MANAGE_POLICIES,
}

POLKIT_NAME = "org.freedesktop.PolicyKit1"
POLKIT_PATH = "/org/freedesktop/PolicyKit1/Authority"
POLKIT_AUTHORITY = "org.freedesktop.PolicyKit1.Authority"

# Message flag: the caller is willing to wait for a password prompt (dbus spec, ALLOW_INTERACTIVE_AUTHORIZATION).
FLAG_ALLOW_INTERACTIVE = 0x4
POLKIT_ALLOW_USER_INTERACTION = 0x1
POLKIT_TIMEOUT = 25.0
POLKIT_INTERACTIVE_TIMEOUT = 300.0

# Not a method: what lets a caller see other users' processes in full (command lines, executables).
VIEW_ALL = "org.gpukill.view-all-processes"
VIEW_ALL_TTL = 60.0  # seconds a polkit answer about VIEW_ALL is kept for a connection


@dataclass(frozen=True, slots=True)
class Caller:
    sender: str  # unique bus name
    uid: int
    pid: int | None
    interactive: bool
    gids: tuple[int, ...] = ()  # primary and supplementary groups, as the bus daemon saw them

    @property
    def who(self) -> str:
        """The caller as the journal names it."""
        return f"uid {self.uid}" + (f" (PID {self.pid})" if self.pid else "")


@dataclass(frozen=True, slots=True)
class Request:
    """A privileged act as the audit of its denial tells it."""

    kind: journal.EventKind  # the journal entry a denial gets
    text: str  # the act, for the journal: "Kill of PID 42 (python, user alice)"
    purpose: str  # the act, for the caller's error: "not authorized to <purpose>: <why>"
    fields: dict[str, object]  # the act's journal fields, as its other entries have them


def action_for(interface: str | None, member: str) -> str | None:
    """The table's entry for a method (an action, an OwnOrAny pair, or READ_ONLY), or None when unmapped (deny).
    A call without interface matches by member."""
    if interface is not None:
        return METHOD_ACTIONS.get((interface, member))
    matches = [a for (_, m), a in METHOD_ACTIONS.items() if m == member]
    return matches[0] if len(matches) == 1 else None


class Bouncer:
    def __init__(
        self,
        bus: MessageBus,
        refusals: RefusalLog | None = None,
        clock: Callable[[], float] = time.monotonic,
        timeout: float = POLKIT_TIMEOUT,
        interactive_timeout: float = POLKIT_INTERACTIVE_TIMEOUT,
        proc_rules: Callable[[], ProcRules] = ProcRules,
        people: People | None = None,
        queue: PolkitQueue | None = None,
    ) -> None:
        self.bus = bus
        # Refused requests, folded per person (people.py): the bouncer writes its denials there, Actions its other
        # refusals.
        self.refusals = refusals if refusals is not None else RefusalLog(journal.Audit())
        self._proc_rules = proc_rules  # the host's hidepid, for viewer()
        self._clock = clock
        self.timeout = timeout
        self.interactive_timeout = interactive_timeout
        self._creds: dict[str, tuple[int, int | None, tuple[int, ...]]] = {}
        self.people = people if people is not None else shared()  # whom each uid's limits are charged to
        self.queue = queue if queue is not None else PolkitQueue()  # turns at polkit, per person
        self._serial = 0
        self._view_all: dict[str, tuple[bool, float]] = {}  # sender -> (answer, when)

    def known(self, msg: Message) -> Caller | None:
        """The caller of msg if its credentials are cached already (no bus round trip), else None."""
        creds = self._creds.get(msg.sender)
        if creds is None:
            return None
        return Caller(msg.sender, creds[0], creds[1], bool(msg.flags.value & FLAG_ALLOW_INTERACTIVE), creds[2])

    async def caller(self, msg: Message) -> Caller:
        sender = msg.sender
        if sender not in self._creds:
            reply = await self.bus.call(
                Message(
                    destination="org.freedesktop.DBus",
                    path="/org/freedesktop/DBus",
                    interface="org.freedesktop.DBus",
                    member="GetConnectionCredentials",
                    signature="s",
                    body=[sender],
                )
            )
            if reply is None or reply.message_type != MessageType.METHOD_RETURN:
                raise PermissionError(f"cannot identify caller {sender}")
            info = reply.body[0]
            pid_v = info.get("ProcessID")
            gids_v = info.get("UnixGroupIDs")
            # Unique names are never reused on a bus; bound the cache anyway.
            if len(self._creds) > 4096:
                self._creds.clear()
            self._creds[sender] = (
                int(info["UnixUserID"].value),
                int(pid_v.value) if pid_v else None,
                tuple(int(g) for g in gids_v.value) if gids_v else (),
            )
        caller = self.known(msg)
        assert caller is not None
        return caller

    def cached_sees_all(self, caller: Caller) -> bool | None:
        """Whether the caller may see every process in full, if known without asking polkit now."""
        if caller.uid == 0:
            return True
        hit = self._view_all.get(caller.sender)
        if hit is None or self._clock() - hit[1] > VIEW_ALL_TTL:
            return None
        return hit[0]

    async def sees_all(self, caller: Caller) -> bool:
        """Root, or polkit grants VIEW_ALL (asked without interaction, as listing must never prompt). Any
        failure, a busy polkit included, means no: the caller gets the limited view, never an error."""
        known = self.cached_sees_all(caller)
        if known is not None:
            return known
        try:
            allowed, _why = await self.authorize(dataclasses.replace(caller, interactive=False), VIEW_ALL, {})
        except TooBusy:
            return False  # not cached: asked again on the next call
        if len(self._view_all) > 4096:
            self._view_all.clear()
        self._view_all[caller.sender] = (allowed, self._clock())
        return allowed

    async def viewer(self, caller: Caller) -> Viewer:
        """How the caller sees other users' processes (visibility.py)."""
        return viewer_for(caller.uid, caller.gids, await self.sees_all(caller), self._proc_rules())

    def known_viewer(self, caller: Caller) -> Viewer | None:
        """viewer() if it is known without asking polkit now, else None."""
        sees_all = self.cached_sees_all(caller)
        return None if sees_all is None else viewer_for(caller.uid, caller.gids, sees_all, self._proc_rules())

    async def check(
        self,
        caller: Caller,
        method: Method,
        details: dict[str, str],
        target_uid: int | None = None,
        *,
        request: Request,
    ) -> str:
        """The action from the table that allows `caller` to call `method`, on a target of uid target_uid where
        there is one (an own/any entry asks its own action when that is the caller's uid). details are shown by
        polkit. A denial is audited here, as `request` tells it, and raised: AccessDenied, or TooBusy when too
        many checks are waiting for polkit. A method the table does not map is denied."""
        entry = action_for(*method)
        busy: TooBusy | None = None
        if entry is None:
            action, allowed, why = READ_ONLY, False, f"{method[1]} is not a method gpukilld allows"
        else:
            action = entry.own if isinstance(entry, OwnOrAny) and target_uid == caller.uid else str(entry)
            try:
                allowed, why = await self.authorize(caller, action, details)
            except TooBusy as e:
                allowed, why, busy = False, str(e), e
        if allowed:
            return action
        self.refusals.log(
            self.people.person(caller.uid),
            request.kind,  # folded per person, as callrate.py counts
            f"{request.text} {'refused' if busy else 'denied'} to {caller.who}: {why}",
            **{
                **request.fields,
                "caller_uid": caller.uid,
                "caller_pid": caller.pid,
                "result": "busy" if busy else "denied",
                "polkit_action": action or None,
                "reason": why,
            },
        )
        if busy is not None:
            raise busy
        raise AccessDenied(f"not authorized to {request.purpose}: {why}")

    async def authorize(self, caller: Caller, action: str, details: dict[str, str]) -> tuple[bool, str]:
        """(allowed, why): the polkit question itself, asked by check() and sees_all() (nothing else names an
        action). Root needs no polkit; read-only actions need nothing. The check waits its turn at polkit in the
        queue of the caller's person and kind (polkit_queue.py); TooBusy when that queue is full: nothing is
        asked then."""
        if action == READ_ONLY:
            return True, "read-only"
        if caller.uid == 0:
            return True, "root"
        person = self.people.person(caller.uid)
        timeout = self.interactive_timeout if caller.interactive else self.timeout
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        try:
            await self.queue.take(person, caller.interactive, timeout, self.people.charged(caller.uid))
        except TimeoutError:
            # not a warning: a user's flood of never-answered prompts must not become as many journal lines
            log.debug("polkit check for %s by uid %d had no turn within %gs", action, caller.uid, timeout)
            return False, f"polkit did not answer within {timeout:g}s (the check waited for its turn)"
        try:
            return await self._check(caller, action, details, timeout - (loop.time() - arrived))
        finally:
            self.queue.give_back(person, caller.interactive)

    async def _check(
        self, caller: Caller, action: str, details: dict[str, str], left: float | None = None
    ) -> tuple[bool, str]:
        """Ask polkit; left: what the check's timeout has left after its wait for a turn (all of it when None)."""
        flags = POLKIT_ALLOW_USER_INTERACTION if caller.interactive else 0
        timeout = self.interactive_timeout if caller.interactive else self.timeout
        self._serial += 1
        cancellation_id = f"gpukilld-{self._serial}"  # unique per gpukilld connection, as polkit requires
        call = self.bus.call(
            Message(
                destination=POLKIT_NAME,
                path=POLKIT_PATH,
                interface=POLKIT_AUTHORITY,
                member="CheckAuthorization",
                signature="(sa{sv})sa{ss}us",
                body=[
                    ["system-bus-name", {"name": Variant("s", caller.sender)}],
                    action,
                    details,
                    flags,
                    cancellation_id,
                ],
            ),
        )
        try:
            # polkit may wait for the user to type a password: allow that, but never forever
            reply = await asyncio.wait_for(call, timeout if left is None else max(left, 0.0))
        except TimeoutError:
            self._cancel(cancellation_id)
            log.warning("polkit check for %s by uid %d timed out after %gs; cancelled", action, caller.uid, timeout)
            return False, f"polkit did not answer within {timeout:g}s"
        except Exception as e:  # polkitd absent, bus error: deny
            log.warning("polkit check for %s failed: %s", action, e)
            return False, f"polkit unavailable: {e}"
        if reply is None or reply.message_type != MessageType.METHOD_RETURN:
            why = reply.body[0] if reply and reply.body else "no reply"
            return False, f"polkit unavailable: {reply.error_name if reply else ''} {why}".strip()
        is_authorized, is_challenge, _details = reply.body[0]
        if is_authorized:
            return True, "polkit"
        return False, "authentication required" if is_challenge else "not authorized by polkit"

    def _cancel(self, cancellation_id: str) -> None:
        """Tell polkit to drop a check we stopped waiting for (it closes the password dialog, if any)."""
        msg = Message(
            destination=POLKIT_NAME,
            path=POLKIT_PATH,
            interface=POLKIT_AUTHORITY,
            member="CancelCheckAuthorization",
            signature="s",
            body=[cancellation_id],
            flags=MessageFlag.NO_REPLY_EXPECTED,
        )
        try:
            self.bus.send(msg)
        except Exception as e:  # the bus is going away: nothing left to cancel
            log.debug("could not cancel polkit check %s: %s", cancellation_id, e)
