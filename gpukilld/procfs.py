"""Host-side facts about a process, read from /proc: the same code for every backend.

The proc root is configurable so tests can point it at fixture trees.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from functools import lru_cache

from .attribution import parse_cgroup
from .model import Attribution

PF_KTHREAD = 0x00200000  # include/linux/sched.h: "I am a kernel thread"


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


@dataclass(frozen=True, slots=True)
class ProcInfo:
    pid: int
    start_time: int
    uid: int
    user: str
    comm: str
    cmdline: str
    exe: str | None
    attribution: Attribution
    container_pid: int | None


def parse_stat(pid: int, text: str) -> ProcStat:
    # comm may hold spaces and parentheses: it runs from the first "(" to the last ")".
    open_paren = text.index("(")
    close_paren = text.rindex(")")
    comm = text[open_paren + 1 : close_paren]
    rest = text[close_paren + 2 :].split()
    # rest[0] is field 3 (state); field N is rest[N - 3].
    return ProcStat(
        pid=pid,
        comm=comm,
        state=rest[0],
        ppid=int(rest[1]),
        flags=int(rest[6]),
        start_time=int(rest[19]),
    )


@lru_cache(maxsize=4096)
def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class ProcFS:
    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def _path(self, pid: int, name: str) -> str:
        return f"{self.root}/{pid}/{name}"

    def pids(self) -> list[int]:
        try:
            return [int(n) for n in os.listdir(self.root) if n.isdigit()]
        except OSError:
            return []

    def stat(self, pid: int) -> ProcStat | None:
        try:
            with open(self._path(pid, "stat"), encoding="utf-8", errors="replace") as f:
                return parse_stat(pid, f.read())
        except (OSError, ValueError, IndexError):
            return None

    def start_time(self, pid: int) -> int | None:
        st = self.stat(pid)
        return st.start_time if st else None

    def environ(self, pid: int) -> dict[str, str]:
        try:
            with open(self._path(pid, "environ"), "rb") as f:
                raw = f.read()
        except OSError:
            return {}
        env: dict[str, str] = {}
        for item in raw.split(b"\0"):
            key, sep, value = item.partition(b"=")
            if sep:
                env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        return env

    def _status_fields(self, pid: int) -> dict[str, str]:
        fields: dict[str, str] = {}
        try:
            with open(self._path(pid, "status"), encoding="utf-8", errors="replace") as f:
                for line in f:
                    key, sep, value = line.partition(":")
                    if sep:
                        fields[key] = value.strip()
        except OSError:
            pass
        return fields

    def info(self, pid: int, stat: ProcStat | None = None) -> ProcInfo | None:
        stat = stat or self.stat(pid)
        if stat is None:
            return None
        status = self._status_fields(pid)
        try:
            uid = int(status["Uid"].split()[0])  # real uid: who started it, not a setuid identity
        except (KeyError, ValueError, IndexError):
            return None
        container_pid = None
        nspid = status.get("NSpid", "").split()
        if len(nspid) > 1:
            container_pid = int(nspid[-1])
        try:
            with open(self._path(pid, "cmdline"), "rb") as f:
                cmdline = f.read().rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            cmdline = ""
        try:
            exe: str | None = os.readlink(self._path(pid, "exe"))
        except OSError:
            exe = None
        try:
            with open(self._path(pid, "cgroup"), encoding="utf-8", errors="replace") as f:
                attribution = parse_cgroup(f.read())
        except OSError:
            attribution = Attribution()
        return ProcInfo(
            pid=pid,
            start_time=stat.start_time,
            uid=uid,
            user=user_name(uid),
            comm=stat.comm,
            cmdline=cmdline,
            exe=exe,
            attribution=attribution,
            container_pid=container_pid,
        )
