"""org.gpukill1.Guard on the system bus: a thin layer from D-Bus calls to the GuardRunner.

GetStatus and TestPolicies are read-only (TestPolicies never acts; a policy a caller sends is evaluated in a
child process against what the caller may list, see sandbox.py and visibility.py; one test per caller at a
time). Enable, Disable, SetDryRun and LoadPolicy need org.gpukill.manage-guard, as the bouncer's table says;
each request, allowed or denied, is audited (denials folded per uid when there are many: refusals.py). The
caller is identified from the message the door handler (manager.Door) remembered for this call, as for the
Manager interface. Every reply is bounded: at most MAX_REPORT entries per list, MAX_PREVIEWS decisions.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from dbus_fast import DBusError, Variant
from dbus_fast.service import ServiceInterface, method, signal

from gpukill.errors import AccessDenied, InvalidArgs, TooBusy
from gpukill.policy import check_text

from .. import audit
from ..bouncer import Bouncer, Caller, action_for

# The door handler and the error wrapper are the Manager's: one way to identify callers and report errors.
from ..manager import _current_call, _dbus_errors, _name_outputs
from ..model import Snapshot
from ..refusals import RefusalLog
from ..visibility import FULL, PROGRAM, Viewer, as_seen_by
from .engine import Violation
from .notify import Notice
from .runner import GuardRunner
from .sandbox import Sandbox, bounded_previews

GUARD_INTERFACE = "org.gpukill1.Guard"
NO_UID = 0xFFFFFFFF  # a notice about a device concerns no one user
MAX_NAME = 4096
MAX_REPORT = 200  # entries of each list in GetStatus (windows, graces: one per subject, as many as processes)

_TYPES = {"pid": "u", "uid": "u", "start_time": "t", "pids": "au", "conditions": "as", "files": "as", "more": "u",
          "windows_more": "u", "graces_more": "u", "recent_more": "u"}


def _variant(key: str, value: Any) -> Variant | None:
    if value is None:
        return None
    if isinstance(value, tuple):  # dbus-fast marshals arrays from lists
        value = list(value)
    sig = _TYPES.get(key)
    if sig is not None:
        return Variant(sig, value)
    if isinstance(value, bool):
        return Variant("b", value)
    if isinstance(value, int):
        return Variant("t" if value >= 0 else "x", value)
    if isinstance(value, float):
        return Variant("d", value)
    if isinstance(value, str):
        return Variant("s", value)
    if isinstance(value, dict):
        return Variant("a{sv}", record(value))
    if isinstance(value, list | tuple):
        return Variant("aa{sv}", [record(v) for v in value])
    raise TypeError(f"{key}: {type(value).__name__}")


def record(d: dict[str, Any]) -> dict[str, Variant]:
    """A plain dict as a{sv}; None values are left out, as everywhere in the API."""
    out = {}
    for k, v in d.items():
        var = _variant(k, v)
        if var is not None:
            out[k] = var
    return out


def _clean_name(name: str) -> str:
    if len(name) > MAX_NAME:
        raise InvalidArgs(f"the policy name is longer than {MAX_NAME} characters")
    name = "".join(ch if ch.isprintable() else "?" for ch in name)
    return name or "<policy>"


def view_snapshot(snapshot: Snapshot, viewer: Viewer) -> Snapshot:
    """The snapshot as the viewer may list it: what a policy it sends is tested against."""
    if viewer.others == FULL:
        return snapshot
    seen = tuple(q for p in snapshot.processes if (q := as_seen_by(p, viewer)) is not None)
    return dataclasses.replace(snapshot, processes=seen)


def visible_decisions(previews: list[dict[str, Any]], snapshot: Snapshot, viewer: Viewer) -> list[dict[str, Any]]:
    """Decisions of the policy in force as the viewer may see them: where /proc hides other users' processes
    (hidepid), a decision about only hidden processes is left out and hidden PIDs are taken out of the rest."""
    if viewer.others in (FULL, PROGRAM):
        return previews
    mine = {p.pid for p in snapshot.processes if p.uid == viewer.uid}
    out = []
    for d in previews:
        pids = list(d.get("pids") or ())
        if pids and not any(pid in mine for pid in pids):
            continue
        out.append({**d, "pids": [pid for pid in pids if pid in mine]})
    return out


def status_as_seen(status: dict[str, Any], viewer: Viewer) -> dict[str, Any]:
    """The guard's status as the viewer may see it, bounded: windows and graces are one entry per subject (as
    many as processes), so at most MAX_REPORT of each with a count of the rest. Where /proc hides other users'
    processes (hidepid), entries about another user's process or user are left out (devices stay)."""
    hides = viewer.others not in (FULL, PROGRAM)
    for key in ("windows", "graces", "recent"):
        entries = status.get(key) or []
        if hides:
            entries = [e for e in entries if e.get("uid") is None or e.get("uid") == viewer.uid]
        if len(entries) > MAX_REPORT:
            status[f"{key}_more"] = len(entries) - MAX_REPORT
            entries = entries[:MAX_REPORT]
        status[key] = entries
    return status


class GuardInterface(ServiceInterface):
    def __init__(self, runner: GuardRunner, bouncer: Bouncer, snapshot: Callable[[], Snapshot],
                 refusals: RefusalLog) -> None:
        super().__init__(GUARD_INTERFACE)
        self._runner = runner
        self._bouncer = bouncer
        self._snapshot = snapshot
        self._refusals = refusals
        self._sandbox = Sandbox()
        runner.signals = self

    async def _caller(self) -> Caller:
        msg = _current_call.get()
        if msg is None:
            raise AccessDenied("caller could not be identified")
        try:
            return await self._bouncer.caller(msg)
        except Exception as e:
            raise AccessDenied(f"caller could not be identified: {e}") from None

    async def _authorize(self, member: str, details: dict[str, str], what: str) -> str:
        """Who asked, once polkit (or root) allows it; AccessDenied (or TooBusy) otherwise. Audited either way."""
        caller = await self._caller()
        action = action_for(GUARD_INTERFACE, member)
        if action is None:  # cannot happen while the door denies unmapped methods; refuse rather than act
            raise AccessDenied(f"{member} is not a method gpukilld allows")
        who = f"uid {caller.uid}" + (f" (PID {caller.pid})" if caller.pid else "")
        busy: TooBusy | None = None
        try:
            allowed, why = await self._bouncer.authorize(caller, action, {"operation": member, **details})
        except TooBusy as e:
            allowed, why, busy = False, str(e), e
        if not allowed:
            self._refusals.log(caller.uid, audit.GUARD_POLICY, f"Guard request {member} denied to {who}: {why}",
                               action="guard", result="busy" if busy else "denied", polkit_action=action,
                               reason=why, caller_uid=caller.uid, caller_pid=caller.pid, requested_by=who)
            if busy is not None:
                raise busy
            raise AccessDenied(f"not authorized to {what}: {why}")
        return who

    # -- methods ---------------------------------------------------------------------------------------

    @method()
    @_dbus_errors
    async def Enable(self):  # no return annotation: dbus-fast would read one as the reply signature
        self._runner.set_enabled(True, await self._authorize("Enable", {}, "enable the guard"))

    @method()
    @_dbus_errors
    async def Disable(self):
        self._runner.set_enabled(False, await self._authorize("Disable", {}, "disable the guard"))

    @method()
    @_dbus_errors
    async def SetDryRun(self, dry_run: "b"):
        who = await self._authorize("SetDryRun", {"dry_run": str(bool(dry_run)).lower()}, "change dry run")
        self._runner.set_dry_run(bool(dry_run), who)

    @method()
    @_dbus_errors
    async def LoadPolicy(self, name: "s", text: "s") -> "a{sv}":
        name = _clean_name(name)
        who = await self._authorize("LoadPolicy", {"policy": name[:256]}, "load a guard policy")
        policy = self._runner.load_policy(name, text, who)
        return {"source": Variant("s", policy.source), "rules": Variant("as", [r.name for r in policy.rules])}

    @method()
    @_dbus_errors
    async def GetStatus(self) -> "a{sv}":
        viewer = await self._bouncer.viewer(await self._caller())
        try:
            return record(status_as_seen(self._runner.status(), viewer))
        except Exception as e:  # a report must never cost the daemon
            raise DBusError("org.gpukill1.Error.Failed", f"status unavailable: {type(e).__name__}: {e}") from None

    @method()
    @_dbus_errors
    async def TestPolicies(self, name: "s", text: "s") -> "aa{sv}":
        caller = await self._caller()
        viewer = await self._bouncer.viewer(caller)
        snapshot = self._snapshot()
        if text:
            name = _clean_name(name)
            check_text(text, name)  # no child for what cannot be a policy
            previews = await self._sandbox.preview(name, text, view_snapshot(snapshot, viewer), os.getpid(),
                                                   caller.uid, self._runner.engine.protection)
        else:
            previews = bounded_previews(visible_decisions(
                [dataclasses.asdict(p) for p in self._runner.preview(snapshot)], snapshot, viewer))
        return [record(p) for p in previews]

    @signal()
    def PolicyViolated(self, event: Violation, dry_run: bool) -> "sssba{sv}":
        details = record({"scope": event.rule.scope, "reason": event.reason, "grace": event.rule.grace_period,
                          "uid": event.uid, "pids": [t.pid for t in event.targets], "time": event.at})
        return [event.rule.name, event.subject, event.rule.action, dry_run, details]

    @signal()
    def GuardActionTaken(self, rule: str, subject: str, action: str, pid: int, start_time: int, outcome: str,
                         dry_run: bool) -> "sssutsb":
        return [rule, subject, action, pid, start_time, outcome, dry_run]

    @signal()
    def Notification(self, notice: Notice, uid: int | None) -> "usss":
        return [NO_UID if uid is None else uid, notice.rule, notice.summary, notice.body]

    # -- GuardSignals, for the runner ------------------------------------------------------------------

    def violated(self, event: Violation, dry_run: bool) -> None:
        self.PolicyViolated(event, dry_run)

    def action_taken(self, rule: str, subject: str, action: str, pid: int, start_time: int, outcome: str,
                     dry_run: bool) -> None:
        self.GuardActionTaken(rule, subject, action, pid, start_time, outcome, dry_run)

    def notification(self, notice: Notice, uid: int | None) -> None:
        self.Notification(notice, uid)


# Names for return values and signal arguments, as in dbus/org.gpukill1.xml.
OUTPUT_NAMES = {
    "Enable": [], "Disable": [], "SetDryRun": [],
    "LoadPolicy": ["result"],
    "GetStatus": ["status"],
    "TestPolicies": ["decisions"],
    "PolicyViolated": ["rule", "subject", "action", "dry_run", "details"],
    "GuardActionTaken": ["rule", "subject", "action", "pid", "start_time", "outcome", "dry_run"],
    "Notification": ["uid", "rule", "summary", "body"],
}
_name_outputs(GuardInterface, OUTPUT_NAMES)
