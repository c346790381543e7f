"""Finding DRM clients in /proc, incrementally: which processes hold a DRM file (character major 226), and
what each such file's fdinfo says.

A full scan stats every fd of every process: 100,000 stat calls on a host with 5,000 processes. So each
(pid, start time) is scanned once and remembered with a fingerprint of its fd table, (inode, mtime, size) of
/proc/PID/fd: a new process has a new inode, and since Linux 6.2 the size is the number of open fds, so an open
or close shows. Only processes whose fingerprint changed are scanned again; the others cost one stat. An fd
closed and another opened between two samples under the same number leaves the count as it was: the fdinfo
"ino:" line (the inode of the opened file) catches that for known DRM fds, and every process is scanned in
full at least once every `revalidate_every` samples, which also covers kernels before 6.2 (size always 0).

Reading another user's fdinfo needs ptrace-read rights, which the root daemon has; an fd table or fdinfo that
cannot be read is skipped, never an error.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from .drm_discovery import DRM_MAJOR
from .drm_fdinfo import FdInfo, parse_fdinfo

Fingerprint = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class DrmFd:
    fd: int
    minor: int  # which card or render node: 226:minor
    ino: int  # inode of the device node, as fdinfo's "ino:" line shows it


@dataclass(slots=True)
class _Proc:
    start_time: int
    fingerprint: Fingerprint | None  # None: scan again next time
    fds: tuple[DrmFd, ...]


@dataclass(frozen=True, slots=True)
class ClientRead:
    """One DRM fd of one process, with its parsed fdinfo (None when it could not be read)."""

    pid: int
    start_time: int
    fd: int
    minor: int
    info: FdInfo | None


@dataclass(slots=True)
class ScanStats:
    processes: int = 0  # processes looked at
    scanned: int = 0  # of which fd tables were read in full
    drm_fds: int = 0
    unreadable: int = 0  # DRM fds whose fdinfo could not be read


def _start_time(text: str) -> int | None:
    # comm may hold spaces and parentheses; field 22 is the 20th after the last ")".
    try:
        return int(text[text.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def read_start_time(proc_root: str, pid: int) -> int | None:
    text = _read(f"{proc_root}/{pid}/stat")
    return _start_time(text) if text else None


class FdScanner:
    def __init__(self, proc_root: str = "/proc", revalidate_every: int = 100) -> None:
        self.root = proc_root
        self.revalidate_every = max(1, revalidate_every)
        self._procs: dict[int, _Proc] = {}
        self._round = 0
        self.stats = ScanStats()

    def _scan_process(self, pid: int, fingerprint: Fingerprint) -> _Proc | None:
        start_time = read_start_time(self.root, pid)
        if start_time is None:
            return None
        fd_dir = f"{self.root}/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            return None
        fds = []
        for name in names:
            try:
                st = os.stat(f"{fd_dir}/{name}")  # follows the fd to the file it opened
            except OSError:
                continue  # closed meanwhile, or a file we may not see
            if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == DRM_MAJOR:
                fds.append(DrmFd(int(name), os.minor(st.st_rdev), st.st_ino))
        self.stats.scanned += 1
        return _Proc(start_time, fingerprint, tuple(sorted(fds, key=lambda f: f.fd)))

    def _read_clients(self, pid: int, proc: _Proc, out: list[ClientRead]) -> bool:
        """Read the fdinfo of each known DRM fd; False when the fd table changed under us (scan again)."""
        reads = []
        for drm_fd in proc.fds:
            text = _read(f"{self.root}/{pid}/fdinfo/{drm_fd.fd}")
            if text is None:
                if not os.path.lexists(f"{self.root}/{pid}/fd/{drm_fd.fd}"):
                    return False  # closed since the scan
                reads.append(ClientRead(pid, proc.start_time, drm_fd.fd, drm_fd.minor, None))
                continue
            info = parse_fdinfo(text)
            if info.ino is not None and info.ino != drm_fd.ino:
                return False  # the number now names another file
            reads.append(ClientRead(pid, proc.start_time, drm_fd.fd, drm_fd.minor, info))
        out.extend(reads)
        return True

    def scan(self) -> list[ClientRead]:
        self._round += 1
        self.stats = stats = ScanStats()
        try:
            pids = [int(n) for n in os.listdir(self.root) if n.isdigit()]
        except OSError:
            pids = []
        stats.processes = len(pids)
        seen = set()
        out: list[ClientRead] = []
        every, turn = self.revalidate_every, self._round % self.revalidate_every
        for pid in pids:
            try:
                st = os.stat(f"{self.root}/{pid}/fd")
            except OSError:
                continue  # exited, or not ours to read
            fingerprint = (st.st_ino, st.st_mtime_ns, st.st_size)
            seen.add(pid)
            proc = self._procs.get(pid)
            if proc is None or proc.fingerprint != fingerprint or pid % every == turn:
                proc = self._scan_process(pid, fingerprint)
                if proc is None:
                    self._procs.pop(pid, None)
                    continue
                self._procs[pid] = proc
            if not proc.fds:
                continue
            if not self._read_clients(pid, proc, out):
                proc = self._scan_process(pid, fingerprint)
                if proc is None:
                    self._procs.pop(pid, None)
                    continue
                self._procs[pid] = proc
                if not self._read_clients(pid, proc, out):
                    proc.fingerprint = None  # still moving: look again next sample
        for pid in self._procs.keys() - seen:
            del self._procs[pid]
        stats.drm_fds = len(out)
        stats.unreadable = sum(1 for r in out if r.info is None)
        return out
