"""How many pop-ups the desktop notification agent opens: a burst of events becomes one summary, never a
hundred pop-ups. Pure; the caller passes the monotonic time.

A token bucket: BURST new pop-ups at once, then one more every REFILL seconds. An event that finds no token
is held; when the next token comes, everything held is shown as one summary notification (its urgency the
highest of what it holds). Updates of a pop-up already shown pass without a token: they change no count on
the screen. An update of a pop-up that was held is dropped (the summary said it); the outcome that closes it
opens a pop-up of its own, through the bucket like any new one.
"""

from __future__ import annotations

from collections import OrderedDict

from .events import Step, Toast

BURST = 3  # pop-ups shown one by one before the rest wait for a summary
REFILL = 5.0  # seconds per pop-up after a burst
SUMMARY_LINES = 6  # events named in a summary's body; the rest are counted
MAX_OPEN_KEYS = 1024


class Gate:
    def __init__(self, burst: int = BURST, refill: float = REFILL) -> None:
        self.burst = burst
        self.refill = refill
        self.tokens = float(burst)
        self.stamp: float | None = None
        self.open_keys: OrderedDict[str, None] = OrderedDict()  # keys whose pop-up was shown
        self.held: list[Toast] = []  # the first SUMMARY_LINES held, for the summary's body
        self.held_count = 0
        self.held_urgency = 0

    def _fill(self, now: float) -> None:
        if self.stamp is not None:
            self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) / self.refill)
        self.stamp = now

    def admit(self, toast: Toast, now: float) -> list[Toast]:
        """What to show now of this toast: itself, or nothing (held, or an update of a held pop-up)."""
        if toast.key and toast.key in self.open_keys and toast.step is not Step.OPEN:
            return [toast]
        if toast.step is Step.UPDATE:
            return []
        self._fill(now)
        if self.held_count == 0 and self.tokens >= 1:
            self.tokens -= 1
            self._opened(toast.key)
            return [toast]
        if len(self.held) < SUMMARY_LINES:
            self.held.append(toast)
        self.held_count += 1
        self.held_urgency = max(self.held_urgency, toast.urgency)
        return []

    def _opened(self, key: str) -> None:
        if key:
            self.open_keys[key] = None
            self.open_keys.move_to_end(key)
            while len(self.open_keys) > MAX_OPEN_KEYS:
                self.open_keys.popitem(last=False)

    def due(self) -> float | None:
        """The monotonic time flush() will show the held events, or None when none is held."""
        if not self.held_count:
            return None
        if self.stamp is None or self.tokens >= 1:
            return self.stamp or 0.0
        return self.stamp + (1 - self.tokens) * self.refill

    def flush(self, now: float) -> list[Toast]:
        """The summary of what is held, once a token is there."""
        if not self.held_count:
            return []
        self._fill(now)
        if self.tokens < 1:
            return []
        self.tokens -= 1
        if self.held_count == 1:
            toast = self.held[0]
            self._opened(toast.key)
        else:
            lines = [t.summary for t in self.held]
            if self.held_count > len(lines):
                lines.append(f"… and {self.held_count - len(lines)} more")
            toast = Toast(f"{self.held_count} GPU notifications at once", "\n".join(lines), self.held_urgency)
        self.held, self.held_count, self.held_urgency = [], 0, 0
        return [toast]
