"""Which of the processes we follow have ended, told by the kernel instead of found by re-reading /proc.

Each followed process is held by a pidfd in one epoll set. A pidfd becomes readable when its process ends
(a zombie included) and it always names that one process, so a reused PID can never pass for it: asking
"who ended since the last sample?" is one epoll_wait that returns only the ended ones, however many are
followed. A process that cannot be followed (no pidfd: descriptors exhausted, a kernel before 5.3, a /proc
that is not this host's) is reported by follow() as not followed, and the caller re-reads it each time.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select

from gpukill.procstat import read_stat

Key = tuple[int, int]  # (pid, start time)
# Descriptors never taken by pidfds: users choose how many processes there are, and the daemon must still open
# /proc files, state files and polkit's connection whatever they do. Past the budget, follow() says no and
# the caller re-reads (slower, never wrong).
FD_HEADROOM = 512


def fd_budget() -> int:
    """How many pidfds may be held: the soft descriptor limit less FD_HEADROOM (gpukilld raises it at start)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else max(0, soft - FD_HEADROOM)


class ExitWatch:
    def __init__(self, budget: int | None = None) -> None:
        self._budget = fd_budget() if budget is None else budget
        self._epoll: select.epoll | None = None
        self._fds: dict[Key, int] = {}
        self._keys: dict[int, Key] = {}  # fd -> key
        self._usable = hasattr(os, "pidfd_open")

    def __len__(self) -> int:
        return len(self._fds)

    def follow(self, pid: int, start_time: int) -> bool:
        """Follow (pid, start time) until it ends; False when it cannot be followed (or is gone already)."""
        key = (pid, start_time)
        if key in self._fds:
            return True
        if not self._usable or len(self._fds) >= self._budget:
            return False
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        # The PID may have been reused between the caller's read and pidfd_open: the start time says.
        stat = read_stat(pid)
        if stat is None or stat.start_time != start_time:
            os.close(fd)
            return False
        try:
            if self._epoll is None:
                self._epoll = select.epoll()
            self._epoll.register(fd, select.EPOLLIN)
        except OSError:
            os.close(fd)
            return False
        self._fds[key] = fd
        self._keys[fd] = key
        return True

    def ended(self) -> set[Key]:
        """The followed processes that ended since the last call; they are no longer followed."""
        if self._epoll is None or not self._fds:
            return set()
        gone: set[Key] = set()
        while True:
            events = self._epoll.poll(0, 1024)
            for fd, _ in events:
                key = self._keys.get(fd)
                if key is not None:
                    gone.add(key)
                    self.forget(key)
            if len(events) < 1024:
                return gone

    def forget(self, key: Key) -> None:
        fd = self._fds.pop(key, None)
        if fd is None:
            return
        del self._keys[fd]
        with contextlib.suppress(OSError):
            self._epoll.unregister(fd)  # type: ignore[union-attr]  # open since the fd was registered
        os.close(fd)

    def close(self) -> None:
        for key in list(self._fds):
            self.forget(key)
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
