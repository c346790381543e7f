"""Host-side facts about a process, read from /proc: the same code for every backend.

The proc root is configurable so tests can point it at fixture trees.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
from dataclasses import dataclass
from functools import lru_cache
from typing import BinaryIO

from gpukill.checkpoint import BadDeclaration, Declaration, from_environ
from gpukill.procstat import ProcStat, read_stat
from gpukill.text import bounded

from ..model import Attribution
from .attribution import parse_cgroup, slurm_job_from_environ, trusts_environment

# Text a process controls is bounded where it is read, so no record, reply or condition grows with it.
MAX_CMDLINE = 4096  # bytes of UTF-8; longer command lines end in CUT_MARKER
CUT_MARKER = " …[cut]"
MAX_EXE = 4096  # PATH_MAX
MAX_CGROUP = 65536  # /proc/PID/cgroup: a line per hierarchy, each at most PATH_MAX
# /proc/PID/environ, read for SLURM_JOB_ID where the cgroup names no job and slurmd's unit holds the process
# (attribution.trusts_environment). Environments are a few KiB; a variable past this many bytes is not looked
# for, so one sample's reads stay small whatever a process puts there.
MAX_ENVIRON = 131072
# /proc/PID/status: ~1.5 KiB, but its Groups: line holds up to NGROUPS_MAX (65,536) gids
MAX_STATUS = 1 << 20
MAX_WCHAN = 128  # a kernel symbol's name (KSYM_NAME_LEN is 512; the driver's are far shorter)
_PROC_ROOT_INO = 1  # fs/proc/internal.h PROC_ROOT_INO: the root of every procfs mount


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


def read_cmdline(f: BinaryIO) -> str:
    """A command line as one string, arguments joined by spaces, cut at MAX_CMDLINE bytes (with CUT_MARKER).

    argv may legally be megabytes (ARG_MAX); only its start is read, so neither a reply, a condition nor the
    daemon's memory grows with what a process puts there."""
    raw = f.read(MAX_CMDLINE + 1)
    cut = len(raw) > MAX_CMDLINE
    text = raw[:MAX_CMDLINE].rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    text = bounded(text, MAX_CMDLINE, "")  # undecodable bytes became 3-byte U+FFFD: bound it again
    return text + CUT_MARKER if cut else text


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

    def pid_inodes(self) -> dict[int, int]:
        """Every process's PID with the inode of its /proc directory, from one directory read (getdents gives
        the inodes with the names). On procfs the inode is made when the directory is first looked up and a
        reused PID gets a new one, so an unchanged inode is the same process (a changed one may be too, after
        the kernel dropped its cache: read it again then)."""
        try:
            with os.scandir(self.root) as entries:
                return {int(e.name): e.inode() for e in entries if e.name.isdigit()}
        except OSError:
            return {}

    def last_pid(self) -> int | None:
        """The PID most recently handed out in the reader's PID namespace (/proc/loadavg's last field; the
        kernel counts threads too). While it stays the same no process was created, so no PID was reused and a
        scan of /proc would find nothing new. None where it cannot be read."""
        try:
            with open(f"{self.root}/loadavg", "rb") as f:
                return int(f.read(128).rsplit(None, 1)[-1])
        except (OSError, ValueError, IndexError):
            return None

    def is_this_hosts(self) -> bool:
        """Whether the root is this PID namespace's procfs (not a copy or a fixture tree): only then do its PIDs
        name processes a pidfd can hold, and its inodes mean what pid_inodes() says."""
        try:
            return (
                os.path.samestat(os.stat(f"{self.root}/self"), os.stat("/proc/self"))
                and os.stat(self.root).st_ino == _PROC_ROOT_INO
            )
        except OSError:
            return False

    def stat(self, pid: int) -> ProcStat | None:
        return read_stat(pid, self.root)

    def start_time(self, pid: int) -> int | None:
        st = self.stat(pid)
        return st.start_time if st else None

    def wchan(self, pid: int) -> str | None:
        """Where in the kernel the process waits (/proc/PID/wchan: a symbol, "0" when running), or None."""
        try:
            with open(self._path(pid, "wchan"), "rb") as f:
                return bounded(f.read(MAX_WCHAN).decode("ascii", "replace").strip(), MAX_WCHAN, "") or None
        except OSError:
            return None

    def cgroup_lines(self, pid: int) -> list[str]:
        """/proc/PID/cgroup's lines (bounded), [] when unreadable."""
        try:
            with open(self._path(pid, "cgroup"), encoding="utf-8", errors="replace") as f:
                return f.read(MAX_CGROUP).splitlines()
        except OSError:
            return []

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

    def slurm_job(self, pid: int) -> str | None:
        """SLURM_JOB_ID from the process's environment (root reads any), bounded; None if absent or unreadable."""
        try:
            with open(self._path(pid, "environ"), "rb") as f:
                return slurm_job_from_environ(f.read(MAX_ENVIRON))
        except OSError:
            return None

    def checkpoint(self, pid: int) -> Declaration | BadDeclaration | None:
        """The checkpoint the process declares in GPUKILL_CHECKPOINT (gpukill.checkpoint), read bounded as
        SLURM_JOB_ID is: None when it declares none (or cannot be read), the error when its value is malformed.
        A variable the bound cuts is left out rather than read half."""
        try:
            with open(self._path(pid, "environ"), "rb") as f:
                raw = f.read(MAX_ENVIRON + 1)
        except OSError:
            return None
        if len(raw) > MAX_ENVIRON:
            raw = raw[:MAX_ENVIRON].rpartition(b"\0")[0]
        return from_environ(raw)

    def _status_fields(self, pid: int, keys: tuple[str, ...]) -> dict[str, str]:
        """These fields of /proc/PID/status (those present), each value stripped; {} when unreadable.

        Looked up in the text rather than by splitting its ~55 lines: this is half of a process's re-read in the
        sampler's rotation (bench/idle_cost), and the fields asked for are two of them."""
        try:
            fd = os.open(self._path(pid, "status"), os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.read(fd, 4096)  # the whole file in one read, but for a long Groups: line (before NSpid:)
                if len(data) == 4096:
                    parts = [data]
                    total = len(data)
                    while total < MAX_STATUS and (more := os.read(fd, 65536)):
                        parts.append(more)
                        total += len(more)
                    data = b"".join(parts)
            finally:
                os.close(fd)
            text = "\n" + data.decode("utf-8", "replace")
        except OSError:
            return {}
        fields = {}
        for key in keys:
            at = text.find(f"\n{key}:")  # a line's start: no other field's name ends in one of these
            if at >= 0:
                start = at + len(key) + 2
                end = text.find("\n", start)
                fields[key] = text[start : end if end >= 0 else len(text)].strip()
        return fields

    def uid(self, pid: int) -> int | None:
        """The real uid (who started it, as info() reads it); None if the process cannot be read."""
        try:
            return int(self._status_fields(pid, ("Uid",))["Uid"].split()[0])
        except (KeyError, ValueError, IndexError):
            return None

    def info(self, pid: int, stat: ProcStat | None = None) -> ProcInfo | None:
        stat = stat or self.stat(pid)
        if stat is None:
            return None
        status = self._status_fields(pid, ("Uid", "NSpid"))
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
                cmdline = read_cmdline(f)
        except OSError:
            cmdline = ""
        try:
            # bytes: a path need not be UTF-8, and a str with surrogates cannot be sent on the bus
            exe: str | None = bounded(os.readlink(self._path(pid, "exe").encode()).decode("utf-8", "replace"), MAX_EXE)
        except OSError:
            exe = None
        try:
            with open(self._path(pid, "cgroup"), encoding="utf-8", errors="replace") as f:
                attribution = parse_cgroup(f.read(MAX_CGROUP))
        except OSError:
            attribution = Attribution()
        if trusts_environment(attribution) and (job := self.slurm_job(pid)) is not None:
            attribution = dataclasses.replace(attribution, slurm_job=job, job_from_environ=True)
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
