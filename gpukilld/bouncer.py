"""Who may call what: one table maps every method to a polkit action; anything unmapped is denied.

Read-only methods map to READ_ONLY and need no authorization. Root callers skip polkit. Everyone else is
judged by polkitd, asked with the caller's bus name as subject, so polkit sees the real process and user.
If polkitd is absent or fails, the answer is no.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

log = logging.getLogger(__name__)

MANAGER = "org.gpukill1.Manager"
GUARD = "org.gpukill1.Guard"
READ_ONLY = ""  # needs no authorization
KILL_OWN = "org.gpukill.kill-own-process"
KILL_ANY = "org.gpukill.kill-any-process"
RESET_DEVICE = "org.gpukill.reset-device"
MANAGE_GUARD = "org.gpukill.manage-guard"

# KillProcess is mapped to KILL_ANY here; the handler lowers it to KILL_OWN when the caller owns the target.
METHOD_ACTIONS: dict[tuple[str, str], str] = {
    (MANAGER, "ListDevices"): READ_ONLY,
    (MANAGER, "ListProcesses"): READ_ONLY,
    (MANAGER, "KillProcess"): KILL_ANY,
    (MANAGER, "ResetDevice"): RESET_DEVICE,
    # Guard Mode: reading the state and asking what a policy would do (TestPolicies never acts) are open to
    # everyone; whatever changes what the guard enforces needs manage-guard.
    (GUARD, "GetStatus"): READ_ONLY,
    (GUARD, "TestPolicies"): READ_ONLY,
    (GUARD, "Enable"): MANAGE_GUARD,
    (GUARD, "Disable"): MANAGE_GUARD,
    (GUARD, "SetDryRun"): MANAGE_GUARD,
    (GUARD, "LoadPolicy"): MANAGE_GUARD,
}
OUR_INTERFACES = {iface for iface, _ in METHOD_ACTIONS}

# Message flag: the caller is willing to wait for a password prompt (dbus spec, ALLOW_INTERACTIVE_AUTHORIZATION).
FLAG_ALLOW_INTERACTIVE = 0x4
POLKIT_ALLOW_USER_INTERACTION = 0x1
POLKIT_TIMEOUT = 25.0
POLKIT_INTERACTIVE_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class Caller:
    sender: str  # unique bus name
    uid: int
    pid: int | None
    interactive: bool


def action_for(interface: str | None, member: str) -> str | None:
    """The action for a method, or None when unmapped (deny). A call without interface matches by member."""
    if interface is not None:
        return METHOD_ACTIONS.get((interface, member))
    matches = [a for (_, m), a in METHOD_ACTIONS.items() if m == member]
    return matches[0] if len(matches) == 1 else None


class Bouncer:
    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self._creds: dict[str, tuple[int, int | None]] = {}

    async def caller(self, msg: Message) -> Caller:
        sender = msg.sender
        creds = self._creds.get(sender)
        if creds is None:
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
            creds = (int(info["UnixUserID"].value), int(pid_v.value) if pid_v else None)
            # Unique names are never reused on a bus; bound the cache anyway.
            if len(self._creds) > 4096:
                self._creds.clear()
            self._creds[sender] = creds
        interactive = bool(msg.flags.value & FLAG_ALLOW_INTERACTIVE)
        return Caller(sender=sender, uid=creds[0], pid=creds[1], interactive=interactive)

    async def authorize(self, caller: Caller, action: str, details: dict[str, str]) -> tuple[bool, str]:
        """(allowed, why). Root needs no polkit; read-only actions need nothing."""
        if action == READ_ONLY:
            return True, "read-only"
        if caller.uid == 0:
            return True, "root"
        flags = POLKIT_ALLOW_USER_INTERACTION if caller.interactive else 0
        timeout = POLKIT_INTERACTIVE_TIMEOUT if caller.interactive else POLKIT_TIMEOUT
        try:
            call = self.bus.call(
                Message(
                    destination="org.freedesktop.PolicyKit1",
                    path="/org/freedesktop/PolicyKit1/Authority",
                    interface="org.freedesktop.PolicyKit1.Authority",
                    member="CheckAuthorization",
                    signature="(sa{sv})sa{ss}us",
                    body=[
                        ["system-bus-name", {"name": Variant("s", caller.sender)}],
                        action,
                        details,
                        flags,
                        "",
                    ],
                ),
            )
            # polkit may wait for the user to type a password: allow that, but never forever
            reply = await asyncio.wait_for(call, timeout)
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
