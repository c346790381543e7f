"""CPU time of work a test does in its own thread: the measure for a bound that guards against a blow-up (a
regular expression that backtracks, a parser or a sort gone quadratic). Wall time grows while other processes
hold the machine's cores (CI runs the suite on 2 cores, 4 workers at once); the calling thread's CPU time does
not, yet a blow-up still spends it. Work handed to other threads or processes is not counted: waiting on them
is bounded in wall time, with a comment saying why the bound is far from the failure it catches."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Took:
    seconds: float = 0.0  # the CPU time the calling thread spent in the block, set when the block ends


@contextmanager
def cpu_time() -> Iterator[Took]:
    """`with cpu_time() as took: ...`, then took.seconds: CPU seconds of the calling thread in the block."""
    took = Took()
    t0 = time.thread_time()
    try:
        yield took
    finally:
        took.seconds = time.thread_time() - t0
