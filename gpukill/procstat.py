"""/proc/PID/stat, parsed the one way: the daemon's sampler and kill path, and the client asking a start time.

comm may hold spaces and parentheses (a process names itself), so it runs from the first "(" to the last ")".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PF_KTHREAD = 0x00200000  # include/linux/sched.h: "I am a kernel thread"
CLK_TCK = os.sysconf("SC_CLK_TCK")  # clock ticks a second: the unit of start_time


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    comm: str
    state: str
    ppid: int
    flags: int
    start_time: int  # clock ticks since boot

    @property
    def is_kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def parse_stat(pid: int, text: str) -> ProcStat:
    open_paren = text.index("(")
    close_paren = text.rindex(")")
    comm = text[open_paren + 1 : close_paren]
    # rest[0] is field 3 (state); field N is rest[N - 3]. Split no further than start time (field 22): the 30
    # fields after it are never read, and the sampler parses thousands of these.
    rest = text[close_paren + 2 :].split(None, 20)
    return ProcStat(
        pid=pid,
        comm=comm,
        state=rest[0],
        ppid=int(rest[1]),
        flags=int(rest[6]),
        start_time=int(rest[19]),
    )


def seconds_since_start(start_time: int, boottime: float) -> float:
    """How long ago a process started, given its start_time and CLOCK_BOOTTIME now."""
    return boottime - start_time / CLK_TCK


def read_stat(pid: int, root: str = "/proc") -> ProcStat | None:
    """The process's stat, or None when it is gone (or its stat cannot be parsed)."""
    # os.read rather than open(): no buffered text stream to build, which the sampler notices at thousands of
    # processes. One read is the whole file: procfs renders stat at once and it is far under 4 KiB.
    try:
        fd = os.open(f"{root}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        return parse_stat(pid, raw.decode("utf-8", "replace"))
    except (OSError, ValueError, IndexError):
        return None
