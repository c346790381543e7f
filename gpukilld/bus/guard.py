"""org.gpukill1.Guard on the system bus: a thin layer from D-Bus calls to the GuardRunner.

GetStatus and TestPolicies are read-only (TestPolicies never acts; a policy a caller sends is evaluated in a
child process against what the caller may list, see gpukilld/guard/sandbox.py and gpukilld/access/visibility.py; one
test per caller at a
time). Enable, Disable, SetDryRun and LoadPolicy are allowed by the bouncer's check, with the action its
table gives them (manage-guard); the bouncer audits a denial, the runner what it does. The managed user, group
and GPU policies (ListPolicies, ExportPolicies: read-only; SetPolicy, RemovePolicy, ImportPolicies:
manage-policies) are files in guard.d that gpukilld/guard/managed.py writes and audits. The caller is
identified from the message the Door (door.py) remembered for this call, as for the Manager interface. The
runner's events reach the signals here through main, which wires them. Every reply is bounded: at most
MAX_REPORT entries per list, MAX_PREVIEWS decisions.

Reasons follow the viewer as listings do: about another user's process or user, a caller who may not see all
gets the reason as the engine words it for others (reason_for_others: a condition type that reads what
gpukilld/access/visibility.py and AuditRogue withhold is named, "rogue_score withheld", not described), in TestPolicies
of the
policy in force, in GetStatus's windows and in PolicyViolated, which every listener on the bus receives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

from dbus_fast import DBusError, Message, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, method, signal

from gpukill.condition_types import CONDITION_TYPES
from gpukill.errors import InvalidArgs, NoSuchProcess, TooBusy
from gpukill.policy import check_text
from gpukill.policy.bounds import MAX_POSTPONE
from gpukill.records.base import from_plain
from gpukill.records.guard import Decision, GuardStatus, ManagedPolicyEntry, PolicyLoaded, ViolationDetails
from gpukill.text import shown

from .. import journal
from ..access.bouncer import Bouncer, Caller, Request
from ..access.callrate import LISTING_BURST, LISTING_RATE, CallRate
from ..access.visibility import FULL, PROGRAM, Viewer, as_seen_by
from ..guard.engine import Target, Violation
from ..guard.managed import ManagedPolicies, check_settings, check_target, parse_import
from ..guard.notify import Notice
from ..guard.runner import GuardRunner
from ..guard.sandbox import Sandbox, bounded_previews
from ..model import Snapshot
from ..names import GUARD_INTERFACE
from ..proc.procfs import user_name
from ..rogue.score import findings_as_seen
from . import writer as busio
from .door import current_caller, dbus_errors, name_outputs
from .wire import to_dbus

NO_UID = 0xFFFFFFFF  # a notice about a device concerns no one user
MAX_NAME = 4096
POLICY_LISTINGS = ("ListPolicies", "ExportPolicies")
MAX_REASON = 200  # characters of a Postpone's reason: a line for the journal and `guard status`
MAX_REPORT = 200  # entries of each list in GetStatus (windows, graces: one per subject, as many as processes)


def check_postpone(seconds: float, reason: str) -> tuple[float, str]:
    """Postpone's arguments, bounded: a duration of more than 0 and at most MAX_POSTPONE (a rule's max caps it
    further), a reason of at most MAX_REASON characters with its control characters escaped."""
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_POSTPONE:
        raise InvalidArgs(f"seconds must be more than 0 and at most {MAX_POSTPONE:g}, not {seconds:g}")
    if len(reason) > MAX_REASON:
        raise InvalidArgs(f"the reason is longer than {MAX_REASON} characters")
    return seconds, shown(reason)


def _clean_name(name: str) -> str:
    if len(name) > MAX_NAME:
        raise InvalidArgs(f"the policy name is longer than {MAX_NAME} characters")
    name = "".join(ch if ch.isprintable() else "?" for ch in name)
    return name or "<policy>"


def _plain_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """SetPolicy's a{sv} as the plain values managed_policy.parse_settings reads (it checks keys and types)."""
    check_settings(settings)  # bounded before anything is unwrapped
    return {key: value.value if isinstance(value, Variant) else value for key, value in settings.items()}


def view_snapshot(snapshot: Snapshot, viewer: Viewer) -> Snapshot:
    """The snapshot as the viewer may list it: what a policy it sends is tested against."""
    if viewer.others == FULL:
        return snapshot
    seen = tuple(q for p in snapshot.processes if (q := as_seen_by(p, viewer)) is not None)
    # the audit's findings as AuditRogue shows them to the viewer: rogue_score reads only what they may see
    return dataclasses.replace(snapshot, processes=seen, findings=tuple(findings_as_seen(snapshot.findings, viewer)))


def _theirs(uid: int | None, viewer: Viewer) -> bool:
    """Whether an entry about this user's subject is another user's to this viewer, who may not see all."""
    return viewer.others != FULL and uid is not None and uid != viewer.uid


def visible_decisions(previews: list[dict[str, Any]], snapshot: Snapshot, viewer: Viewer) -> list[dict[str, Any]]:
    """Decisions of the policy in force as the viewer may see them: about another user's subject with the
    reason as others may read it (engine.Preview.reason_for_others: no value or text of what ListProcesses and
    AuditRogue withhold from them); where /proc hides other users' processes (hidepid), a decision about only
    hidden processes is left out and hidden PIDs are taken out of the rest; so is one about another user's
    subject that names no process (a subject watched but not met: its label names the process)."""
    previews = [{**d, "reason": d["reason_for_others"]} if _theirs(d.get("uid"), viewer) else d for d in previews]
    if viewer.others in (FULL, PROGRAM):
        return previews
    mine = {p.pid for p in snapshot.processes if p.uid == viewer.uid}
    out = []
    for d in previews:
        pids = list(d.get("pids") or ())
        if pids and not any(pid in mine for pid in pids) or not pids and _theirs(d.get("uid"), viewer):
            continue
        out.append({**d, "pids": [pid for pid in pids if pid in mine]})
    return out


def _condition_for_others(text: str) -> str:
    """A window's condition as others may read it about another user's subject (condition_types' `withheld`):
    its type where its text would say what the subject's withheld facts matched."""
    ctype = CONDITION_TYPES.get(text.split(" ", 1)[0])
    return f"{ctype.name} withheld" if ctype is not None and ctype.withheld else text


def status_as_seen(status: GuardStatus, viewer: Viewer) -> GuardStatus:
    """The guard's status as the viewer may see it, bounded: windows and graces are one entry per subject (as
    many as processes), so at most MAX_REPORT of each with a count of the rest. Where /proc hides other users'
    processes (hidepid), entries about another user's process or user are left out (devices stay); a window
    about another user's subject names a withheld condition by its type only, as reasons do, and a recent
    event's detail (the other processes a kill_scope stopped or left running, by name) is left out."""
    hides = viewer.others not in (FULL, PROGRAM)
    bounded: dict[str, Any] = {}
    for key in ("windows", "graces", "recent"):
        entries = getattr(status, key)
        if hides:
            entries = tuple(e for e in entries if e.uid is None or e.uid == viewer.uid)
            if key == "recent":
                entries = tuple(dataclasses.replace(e, detail="") if e.detail else e for e in entries)
        if key == "windows":
            entries = tuple(
                dataclasses.replace(e, condition=_condition_for_others(e.condition)) if _theirs(e.uid, viewer) else e
                for e in entries
            )
        if len(entries) > MAX_REPORT:
            bounded[f"{key}_more"] = len(entries) - MAX_REPORT
            entries = entries[:MAX_REPORT]
        bounded[key] = entries
    return dataclasses.replace(status, **bounded)


class GuardInterface(ServiceInterface):
    def __init__(
        self, runner: GuardRunner, bouncer: Bouncer, snapshot: Callable[[], Snapshot], bus: MessageBus | None = None
    ) -> None:
        super().__init__(GUARD_INTERFACE)
        self._runner = runner
        self._bouncer = bouncer
        self._snapshot = snapshot
        self._sandbox = Sandbox()
        self._managed = ManagedPolicies(runner, runner.audit)
        self.bus = bus  # the early answers write to it
        # ListPolicies and ExportPolicies, open to every user: (what guard.d's listing gave, the reply's body
        # marshalled once), so a flood of them costs a lookup and a write each, not a marshalling.
        self._policy_bodies: dict[str, tuple[object, bytes]] = {}
        self._listing_rate = CallRate(rate=LISTING_RATE, burst=LISTING_BURST)  # per person, as the Door's

    async def _authorize(self, member: str, details: dict[str, str], what: str) -> Caller:
        """Who asked (caller.who: as the runner's audit names them), once the bouncer allows it; the bouncer
        audits a denial and raises it (AccessDenied or TooBusy)."""
        caller = await current_caller(self._bouncer)
        request = Request(
            journal.GUARD_POLICY, f"Guard request {member}", what, {"action": "guard", "requested_by": caller.who}
        )
        await self._bouncer.check(caller, (GUARD_INTERFACE, member), {"operation": member, **details}, request=request)
        return caller

    async def _authorize_policies(self, member: str, operation: str, about: dict[str, str]) -> Caller:
        """As _authorize, for the managed policies (manage-policies): a denial is audited as their change would
        be. about: kind and target, or the import's name as policy (bounded already), shown by polkit too."""
        caller = await current_caller(self._bouncer)
        fields: dict[str, object] = {
            "action": "guard",
            "operation": operation,
            "requested_by": caller.who,
            **{("policy_" + k if k in ("kind", "target") else k): v for k, v in about.items()},
        }
        request = Request(journal.GUARD_MANAGED_POLICY, f"Guard request {member}", "change guard policies", fields)
        await self._bouncer.check(caller, (GUARD_INTERFACE, member), {"operation": member, **about}, request=request)
        return caller

    # -- methods ---------------------------------------------------------------------------------------

    @method()
    @dbus_errors
    async def Enable(self):  # no return annotation: dbus-fast would read one as the reply signature
        self._runner.set_enabled(True, (await self._authorize("Enable", {}, "enable the guard")).who)

    @method()
    @dbus_errors
    async def Disable(self):
        self._runner.set_enabled(False, (await self._authorize("Disable", {}, "disable the guard")).who)

    @method()
    @dbus_errors
    async def SetDryRun(self, dry_run: "b"):
        caller = await self._authorize("SetDryRun", {"dry_run": str(bool(dry_run)).lower()}, "change dry run")
        self._runner.set_dry_run(bool(dry_run), caller.who)

    @method()
    @dbus_errors
    async def LoadPolicy(self, name: "s", text: "s") -> "a{sv}":
        name = _clean_name(name)
        caller = await self._authorize("LoadPolicy", {"policy": name[:256]}, "load a guard policy")
        policy = self._runner.load_policy(name, text, caller.who, caller.uid)
        return to_dbus(PolicyLoaded(policy.source, tuple(r.name for r in policy.rules)))

    @method()
    @dbus_errors
    async def GetStatus(self) -> "a{sv}":
        viewer = await self._bouncer.viewer(await current_caller(self._bouncer))
        try:
            return to_dbus(status_as_seen(self._runner.status(), viewer))
        except Exception as e:  # a report must never cost the daemon
            raise DBusError("org.gpukill1.Error.Failed", f"status unavailable: {type(e).__name__}: {e}") from None

    @method()
    @dbus_errors
    async def TestPolicies(self, name: "s", text: "s") -> "aa{sv}":
        caller = await current_caller(self._bouncer)
        viewer = await self._bouncer.viewer(caller)
        snapshot = self._snapshot()
        if text:
            name = _clean_name(name)
            check_text(text, name)  # no child for what cannot be a policy
            previews = await self._sandbox.preview(
                name, text, view_snapshot(snapshot, viewer), os.getpid(), caller.uid, self._runner.engine.protection
            )
        else:
            previews = bounded_previews(
                visible_decisions([dataclasses.asdict(p) for p in self._runner.preview(snapshot)], snapshot, viewer)
            )
        return [to_dbus(from_plain(Decision, p)) for p in previews]

    @method()
    @dbus_errors
    async def ListPolicies(self) -> "aa{sv}":
        self._listing_budget(await current_caller(self._bouncer), "ListPolicies")
        return [to_dbus(e) for e in self._managed.entries()]

    @method()
    @dbus_errors
    async def SetPolicy(self, kind: "s", target: "s", settings: "a{sv}") -> "a{sv}":
        check_target(kind, target)  # bounded before polkit shows them
        caller = await self._authorize_policies("SetPolicy", "set", {"kind": kind, "target": target})
        entry = self._managed.set(kind, target, _plain_settings(settings), caller.uid, caller.who)
        return to_dbus(entry)

    @method()
    @dbus_errors
    async def RemovePolicy(self, kind: "s", target: "s"):
        check_target(kind, target)
        caller = await self._authorize_policies("RemovePolicy", "remove", {"kind": kind, "target": target})
        self._managed.remove(kind, target, caller.uid, caller.who)

    @method()
    @dbus_errors
    async def ExportPolicies(self) -> "s":
        self._listing_budget(await current_caller(self._bouncer), "ExportPolicies")
        return self._managed.export()

    @method()
    @dbus_errors
    async def ImportPolicies(self, name: "s", text: "s", replace: "b") -> "aa{sv}":
        name = _clean_name(name)
        check_text(text, name)  # a caller's 30 MiB text is refused before polkit is asked
        caller = await self._authorize_policies("ImportPolicies", "import", {"policy": name[:256]})
        policies = await asyncio.to_thread(parse_import, name, text)  # seconds for a megabyte: not on the loop
        entries = self._managed.import_parsed(name, policies, bool(replace), caller.uid, caller.who)
        return [to_dbus(e) for e in entries]

    def _listing_budget(self, caller: Caller, member: str) -> None:
        """TooBusy past the person's budget of policy listings (LISTING_RATE a second)."""
        if not self._listing_rate.allow(self._bouncer.people.person(caller.uid) if caller.uid else 0):
            raise TooBusy(
                f"{self._bouncer.people.charged(caller.uid)} asks {member} more than "
                f"{LISTING_RATE:g} times a second; slow down"
            )

    def early_answer(self, msg: Message) -> Message | bool | None:
        """The Door's EarlyAnswer for ListPolicies and ExportPolicies: the reply from a body marshalled once per
        listing of guard.d (gpukilld/guard/managed.py serves the listing until the files change); None for
        anything else, or when the bus's writer is not as expected (the method answers)."""
        if msg.interface != GUARD_INTERFACE or msg.member not in POLICY_LISTINGS or msg.signature or self.bus is None:
            return None
        caller = self._bouncer.known(msg)
        if caller is None:
            return None  # the method answers, and asks who it is
        try:
            self._listing_budget(caller, msg.member)
        except TooBusy as e:
            return Message.new_error(msg, e.dbus_name, str(e))
        made: list[ManagedPolicyEntry] | str
        if msg.member == "ListPolicies":
            made, signature = self._managed.entries(), "aa{sv}"
        else:
            made, signature = self._managed.export(), "s"
        cached = self._policy_bodies.get(msg.member)
        if cached is None or cached[0] is not made:
            value = [to_dbus(e) for e in made] if isinstance(made, list) else made
            cached = self._policy_bodies[msg.member] = (made, busio.marshal_body(signature, [value]))
        return True if busio.send_premarshalled_reply(self.bus, msg, signature, cached[1]) else None

    @method()
    @dbus_errors
    async def Postpone(self, pid: "u", start_time: "t", seconds: "d", reason: "s") -> "a{sv}":
        seconds, reason = check_postpone(seconds, reason)  # bounded before polkit shows anything
        caller = await current_caller(self._bouncer)
        listed = next(iter(self._snapshot().processes_of(pid, start_time)), None)
        fields: dict[str, object] = {
            "action": "guard",
            "target_pid": pid,
            "target_start_time": start_time,
            "caller_uid": caller.uid,
            "requested_by": caller.who,
            "asked": seconds,
            "postpone_reason": reason or None,
        }
        if listed is None:
            error = NoSuchProcess(f"PID {pid} (start time {start_time}) is not a GPU process gpukilld lists")
            self._bouncer.refusals.log(
                self._bouncer.people.person(caller.uid),
                journal.GUARD_POSTPONE,
                f"Postponement for PID {pid} asked by {caller.who} refused: {error}",
                **fields,
                result=error.result,
                error=str(error),
            )
            raise error
        user = shown(listed.user)
        await self._bouncer.check(
            caller,
            (GUARD_INTERFACE, "Postpone"),
            {"pid": str(pid), "target_user": listed.user, "seconds": f"{seconds:g}"},
            listed.uid,
            request=Request(
                journal.GUARD_POSTPONE,
                f"Postponement of the kill of PID {pid} ({shown(listed.comm)}, user {user})",
                f"postpone the kill of PID {pid} of user {user}",
                {**fields, "target_uid": listed.uid},
            ),
        )
        who = await asyncio.to_thread(user_name, caller.uid)  # NSS may ask a directory server: not on the loop
        return to_dbus(self._runner.postpone(pid, start_time, seconds, reason, caller.uid, who))

    @signal()
    def ReclaimPending(self, target: Target, rule: str, deadline: float) -> "utusst":
        return [target.pid, target.start_time, target.uid, target.unit, rule, max(0, int(deadline))]

    @signal()
    def PolicyViolated(self, event: Violation, dry_run: bool) -> "sssba{sv}":
        # every listener on the bus gets it: the reason as other users may read it (the journal has it whole)
        details = to_dbus(
            ViolationDetails(
                scope=event.rule.scope,
                reason=event.reason_for_others,
                grace=event.rule.grace_period,
                uid=event.uid,
                pids=tuple(t.pid for t in event.targets),
                time=event.at,
            )
        )
        return [event.rule.name, event.subject, event.rule.action, dry_run, details]

    @signal()
    def GuardActionTaken(
        self, rule: str, subject: str, action: str, pid: int, start_time: int, outcome: str, dry_run: bool
    ) -> "sssutsb":
        return [rule, subject, action, pid, start_time, outcome, dry_run]

    @signal()
    def Notification(self, notice: Notice, uid: int | None) -> "usss":
        return [NO_UID if uid is None else uid, notice.rule, notice.summary, notice.body]


# Names for return values and signal arguments, as in dbus/org.gpukill1.xml.
OUTPUT_NAMES = {
    "Enable": [],
    "Disable": [],
    "SetDryRun": [],
    "LoadPolicy": ["result"],
    "GetStatus": ["status"],
    "TestPolicies": ["decisions"],
    "ListPolicies": ["policies"],
    "SetPolicy": ["policy"],
    "RemovePolicy": [],
    "ExportPolicies": ["text"],
    "ImportPolicies": ["policies"],
    "Postpone": ["result"],
    "ReclaimPending": ["pid", "start_time", "uid", "unit", "rule", "deadline"],
    "PolicyViolated": ["rule", "subject", "action", "dry_run", "details"],
    "GuardActionTaken": ["rule", "subject", "action", "pid", "start_time", "outcome", "dry_run"],
    "Notification": ["uid", "rule", "summary", "body"],
}
name_outputs(GuardInterface, OUTPUT_NAMES)
