"""How a device's fault is written in its state_reason, and read back by Guard conditions.

A backend that learns of a critical error (NVML's Xid events, with the recovery action the driver asks for)
writes it with xid_reason(); Guard's `recovery_action` condition reads the action back with recovery_action().
Both sides use this module, so the text and its reading cannot drift apart.
"""

from __future__ import annotations

import re

_ACTION = " recovery action: "
_RECOVERY = re.compile(r"; recovery action: ([^;]{1,100})$")  # bounded: a reason is a short driver text


def xid_reason(xid: int, action: str | None) -> str:
    """'Xid 79' or 'Xid 79; recovery action: GPU reset'."""
    return f"Xid {xid}" + (f";{_ACTION}{action}" if action else "")


def recovery_action(reason: str | None) -> str | None:
    """The recovery action a reason names ("GPU reset", "node reboot", ...); None where it names none."""
    if not reason or len(reason) > 1000:
        return None
    m = _RECOVERY.search(reason)
    return m.group(1).strip() if m else None
