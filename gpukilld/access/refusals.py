"""Refused requests in the journal, folded per caller so no one can flood it.

journald rate-limits per service (RateLimitBurst per RateLimitIntervalSec): when gpukilld writes too much, it
drops gpukilld's entries, real kills and Guard actions among them. Every refusal (a kill of a PID that is not a
GPU process, a denial by polkit, a request while too many are pending) costs the caller nothing, so a user
could write thousands a second. Each person (a uid and its subordinate uids, gpukilld/access/people.py) may have BURST
refusals audited per WINDOW seconds, and everyone together TOTAL_BURST; beyond that they are counted, and when
the window ends one entry per person and kind says
how many were folded (GPUKILL_RESULT=folded, GPUKILL_FOLDED=N). Root's refusals and everything the daemon does
by itself (kills, resets, Guard) are never folded.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gpukill.units import format_duration

from .. import journal

WINDOW = 10.0
BURST = 20  # per person per window
TOTAL_BURST = 200  # everyone together per window


@dataclass(slots=True)
class _Window:
    start: float
    written: int = 0
    folded: Counter = field(default_factory=Counter)  # EventKind -> refusals not written


class RefusalLog:
    def __init__(self, auditor: journal.Audit, clock: Callable[[], float] = time.monotonic) -> None:
        self.audit = auditor
        self._clock = clock
        self._windows: dict[int, _Window] = {}
        self._total = _Window(clock())

    def log(self, uid: int | None, kind: journal.EventKind, message: str, **fields: object) -> bool:
        """Audit a refusal of a request by `uid`, or fold it; True when it was written."""
        if uid is None or uid == 0:
            self.audit.log(kind, message, **fields)
            return True
        now = self._clock()
        self.flush(now)
        window = self._windows.get(uid)
        if window is None:
            window = self._windows[uid] = _Window(now)
        if window.written >= BURST or self._total.written >= TOTAL_BURST:
            window.folded[kind] += 1
            return False
        window.written += 1
        self._total.written += 1
        self.audit.log(kind, message, **fields)
        return True

    def flush(self, now: float | None = None) -> None:
        """End the windows that are over: write what they folded. Called on every refusal and every sample."""
        now = self._clock() if now is None else now
        if now - self._total.start >= WINDOW:
            self._total = _Window(now)
        for uid in [u for u, w in self._windows.items() if now - w.start >= WINDOW]:
            window = self._windows.pop(uid)
            for kind, count in window.folded.items():
                self.audit.log(
                    kind,
                    f"{count} more refused request(s) of uid {uid} ({kind.name}) in "
                    f"{format_duration(now - window.start)} were not audited one by one",
                    result="folded",
                    folded=count,
                    caller_uid=uid,
                    action=kind.name.split("-")[0],
                )
