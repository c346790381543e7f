"""The mean of a subject's values over the last `span` seconds (a condition's `over: mean`), in bounded memory.

Samples are summed into BUCKETS buckets of span / BUCKETS seconds each, and a bucket leaves once it is older
than the span: a 2-hour window at 1 Hz holds 64 buckets, not 7,200 samples, for each process it follows. The
mean is of the samples, each weighing the same (Guard evaluates at a steady interval); the oldest bucket, partly
outside the span, counts whole, so the window is up to one bucket (1/64 of it) longer than the span.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

BUCKETS = 64


@dataclass(slots=True)
class WindowMean:
    since: float  # monotonic: when it was first seen (its window's start for reports and for the duration)
    span: float
    # [bucket number, sum, count], oldest first
    buckets: deque[list[float]] = field(default_factory=deque)
    total: float = 0.0
    count: int = 0

    def add(self, now: float, value: float) -> None:
        width = self.span / BUCKETS or 1.0
        number = now // width
        buckets = self.buckets
        if buckets and buckets[-1][0] == number:
            buckets[-1][1] += value
            buckets[-1][2] += 1
        else:
            buckets.append([number, value, 1])
        self.total += value
        self.count += 1
        while buckets[0][0] <= number - BUCKETS:
            _, gone, n = buckets.popleft()
            self.total -= gone
            self.count -= int(n)

    def value(self) -> float:
        return self.total / self.count if self.count else 0.0
