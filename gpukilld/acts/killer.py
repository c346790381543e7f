"""The kill path: every signal the daemon sends goes through here.

The target is named by (pid, start time) as the caller saw it in a listing. We open a pidfd first and only
then compare the start time, so the process we check is the one we signal: if the PID was reused after the
listing, the start time differs and nothing is sent; if the process dies after the check, the pidfd refers to
the dead process and the signal goes nowhere, never to a newcomer with the same PID.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
from dataclasses import dataclass

from gpukill.errors import InvalidArgs, NoSuchProcess, NotAGpuProcess, ProcessChanged, Protected
from gpukill.limits import MAX_GRACE
from gpukill.outcome import Outcome

from ..model import Snapshot
from ..proc.procfs import ProcFS, user_name

KILL_WAIT = 5.0  # how long SIGKILL gets before we report the process still alive
# With grace 0 and no force: how long the exit that SIGTERM causes gets to show. The kernel acts on a signal when
# the process next runs, so even one that dies at once is alive for a moment after the send; the answer says
# what happened, not what had happened within microseconds.
TERM_SETTLE = 2.0


@dataclass(slots=True)
class PinnedProcess:
    """A process to kill, held by its pidfd from the checks to the signal, so a reused PID is never signalled."""

    pid: int
    start_time: int
    uid: int
    user: str
    comm: str
    device_ids: tuple[str, ...]
    pidfd: int

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def check_grace(grace: float) -> float:
    if not (0 <= grace <= MAX_GRACE):  # also rejects NaN
        raise InvalidArgs(f"grace must be between 0 and {MAX_GRACE:g} seconds, not {grace!r}")
    return grace


class Killer:
    def __init__(self, procfs: ProcFS | None = None) -> None:
        self.procfs = procfs or ProcFS()  # always the real /proc: we signal real processes
        self.own_pid = os.getpid()

    def open(self, pid: int, start_time: int, snapshot: Snapshot) -> PinnedProcess:
        """Pin the target with a pidfd and check it may be killed; raise if not. Sends nothing."""
        if pid <= 0 or pid > 2**22:  # PID_MAX_LIMIT
            raise InvalidArgs(f"pid {pid} is out of range")
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise NoSuchProcess(f"no process with PID {pid}") from None
        except OSError as e:
            raise NoSuchProcess(f"cannot open PID {pid}: {e.strerror}") from None
        try:
            stat = self.procfs.stat(pid)
            if stat is None:
                raise NoSuchProcess(f"process {pid} exited")
            # These errors reach a caller before any authorization: they say no more than kill(2) would (the
            # PID exists or not), never another process's name or start time.
            if stat.start_time != start_time:
                raise ProcessChanged(f"PID {pid} now belongs to another process than the one listed; list again")
            if pid == 1:
                raise Protected("PID 1 (init) is protected")
            if stat.is_kernel_thread:  # PF_KTHREAD: authoritative, unlike "parent is PID 2" inside containers
                raise Protected(f"PID {pid} is a kernel thread")
            if pid == self.own_pid:
                raise Protected("gpukilld does not kill itself")
            on_gpu = snapshot.processes_of(pid, start_time)
            if not on_gpu:
                raise NotAGpuProcess(f"PID {pid} is not using a GPU")
            first = on_gpu[0]
            return PinnedProcess(
                pid=pid,
                start_time=start_time,
                uid=first.uid,
                user=first.user or user_name(first.uid),
                comm=stat.comm,
                device_ids=tuple(p.device_id for p in on_gpu),
                pidfd=pidfd,
            )
        except BaseException:
            os.close(pidfd)
            raise

    @staticmethod
    def _exited(pidfd: int) -> bool:
        """Whether the process has exited already (its pidfd is readable), without waiting."""
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(0))

    @staticmethod
    async def _wait_exit(pidfd: int, timeout: float) -> bool:
        """True when the process exits within timeout; a pidfd becomes readable when its process exits."""
        if Killer._exited(pidfd):
            return True
        loop = asyncio.get_running_loop()
        exited = loop.create_future()

        def wake() -> None:
            if not exited.done():
                exited.set_result(True)

        loop.add_reader(pidfd, wake)
        try:
            await asyncio.wait_for(exited, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(pidfd)

    @staticmethod
    def send(target: PinnedProcess, signum: int) -> bool:
        """Send a signal the target declared it handles (its checkpoint signal) through its pidfd: False when
        it has exited already. TERM and KILL go through terminate()."""
        try:
            signal.pidfd_send_signal(target.pidfd, signum)
        except ProcessLookupError:
            return False
        return True

    @staticmethod
    def exited(target: PinnedProcess) -> bool:
        return Killer._exited(target.pidfd)

    @staticmethod
    async def wait_all(targets: list[PinnedProcess], timeout: float) -> list[bool]:
        """Whether each target exited within timeout, all awaited together (on the loop: pidfds are readable
        when their process exits)."""
        return list(await asyncio.gather(*(Killer._wait_exit(t.pidfd, timeout) for t in targets)))

    async def terminate(self, target: PinnedProcess, grace: float, force: bool) -> Outcome:
        """SIGTERM, wait up to grace; with force, SIGKILL after the grace. Returns the outcome. Grace 0 without
        force waits up to TERM_SETTLE for the exit SIGTERM causes; with force, SIGKILL follows at once."""
        try:
            signal.pidfd_send_signal(target.pidfd, signal.SIGTERM)
        except ProcessLookupError:
            return Outcome.TERMINATED  # it exited between the check and the signal: the goal is met
        if await self._wait_exit(target.pidfd, grace if grace > 0 or force else TERM_SETTLE):
            return Outcome.TERMINATED
        if not force:
            return Outcome.STILL_ALIVE
        try:
            signal.pidfd_send_signal(target.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            return Outcome.TERMINATED
        return Outcome.KILLED if await self._wait_exit(target.pidfd, KILL_WAIT) else Outcome.STILL_ALIVE
