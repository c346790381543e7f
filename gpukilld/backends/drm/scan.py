"""Finding DRM clients in /proc, incrementally: which processes hold a DRM file (character major 226), and
what each such file's fdinfo says.

A full scan stats every fd of every process: 100,000 stat calls on a host with 5,000 processes. So each
(pid, start time) is scanned once and remembered with a fingerprint of its fd table, (inode, mtime, size) of
/proc/PID/fd: a new process has a new inode, and since Linux 6.2 the size is the number of open fds, so an open
or close shows. On older kernels (size always 0) the fingerprint holds the fd numbers instead, which costs a
directory read per process. Only processes whose fingerprint changed are scanned again; the others cost one
stat. What a fingerprint cannot see is an fd closed and its number reused for another file between two samples:
for known DRM fds the fdinfo "ino:" line (the inode of the opened file) catches it, and every process is
scanned in full at least once every `revalidate_every` samples. A reset does not rely on any of this: it looks
for holders with a full scan (`holders`) right before it acts.

Reading another user's fdinfo needs ptrace-read rights, which the root daemon has; an fd table or fdinfo that
cannot be read is skipped, never an error.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from gpukill.procstat import ProcStat, parse_stat

from .discovery import DRM_MAJOR
from .fdinfo import FdInfo, parse_fdinfo

Fingerprint = tuple[int, int, int | tuple[str, ...]]  # fd dir inode, mtime, size or fd numbers


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
    due: int  # the scan round by which this fd table is read in full again, changed or not


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


def _stat(pid: int, text: str | None) -> ProcStat | None:
    try:
        return parse_stat(pid, text) if text else None
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
    st = _stat(pid, _read(f"{proc_root}/{pid}/stat"))
    return st.start_time if st else None


def is_running(proc_root: str, pid: int) -> bool:
    """Alive and not a zombie (a zombie's files are closed; only its parent's wait is missing)."""
    st = _stat(pid, _read(f"{proc_root}/{pid}/stat"))
    return st is not None and st.state not in "ZX"


def _drm_fds(fd_dir: str) -> list[DrmFd] | None:
    """Every DRM fd in one fd table (None if it cannot be read): the full, expensive look."""
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
    return sorted(fds, key=lambda f: f.fd)


def holders(proc_root: str, minors: set[int]) -> list[int]:
    """PIDs holding any of these DRM minors now, from a full scan of every fd table: what a reset checks."""
    found = []
    for pid in os.listdir(proc_root):
        if pid.isdigit():
            fds = _drm_fds(f"{proc_root}/{pid}/fd")
            if fds and any(f.minor in minors for f in fds) and is_running(proc_root, int(pid)):
                found.append(int(pid))
    return sorted(found)


class FdScanner:
    def __init__(self, proc_root: str = "/proc", revalidate_every: int = 100, fd_counts: bool | None = None) -> None:
        self.root = proc_root
        self.revalidate_every = max(1, revalidate_every)
        # Whether the size of /proc/PID/fd is the number of open fds (Linux 6.2+); None: find out.
        self.fd_counts = fd_counts
        self._procs: dict[str, _Proc] = {}  # by PID as /proc names it: no int() per process per sample
        self._round = 0
        self.stats = ScanStats()

    def _scan_process(self, pid: str, fingerprint: Fingerprint, known: _Proc | None) -> _Proc | None:
        if known is not None and known.fingerprint == fingerprint:
            start_time: int | None = known.start_time  # a periodic re-read of the same process
        else:
            start_time = read_start_time(self.root, int(pid))
        if start_time is None:
            return None
        fds = _drm_fds(f"{self.root}/{pid}/fd")
        if fds is None:
            return None
        self.stats.scanned += 1
        every = self.revalidate_every
        # Spread the full re-reads over the period, so no one sample pays for all of them.
        due = self._round + (every if known is not None else int(pid) % every + 1)
        return _Proc(start_time, fingerprint, tuple(fds), due)

    def _fingerprint(self, pid: str, st: os.stat_result) -> Fingerprint | None:
        if self.fd_counts is None and st.st_size == 0:
            try:
                if os.listdir(f"{self.root}/{pid}/fd"):
                    self.fd_counts = False  # fds open, size 0: a kernel before 6.2
            except OSError:
                return None
        elif self.fd_counts is None:
            self.fd_counts = True
        if self.fd_counts is False:
            try:
                return (st.st_ino, st.st_mtime_ns, tuple(sorted(os.listdir(f"{self.root}/{pid}/fd"))))
            except OSError:
                return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _read_clients(self, pid: str, proc: _Proc, out: list[ClientRead]) -> bool:
        """Read the fdinfo of each known DRM fd; False when the fd table changed under us (scan again)."""
        reads = []
        base = f"{self.root}/{pid}"
        number = int(pid)
        for drm_fd in proc.fds:
            text = _read(f"{base}/fdinfo/{drm_fd.fd}")
            if text is None:
                if not os.path.lexists(f"{base}/fd/{drm_fd.fd}"):
                    return False  # closed since the scan
                reads.append(ClientRead(number, proc.start_time, drm_fd.fd, drm_fd.minor, None))
                continue
            info = parse_fdinfo(text)
            if info.ino is not None and info.ino != drm_fd.ino:
                return False  # the number now names another file
            reads.append(ClientRead(number, proc.start_time, drm_fd.fd, drm_fd.minor, info))
        out.extend(reads)
        return True

    def scan(self) -> list[ClientRead]:
        self._round += 1
        self.stats = stats = ScanStats()
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            self._procs = {}
            return []
        try:
            names = os.listdir(root_fd)
            procs, kept, with_drm = self._procs, {}, []
            round_ = self._round
            fstat = os.stat
            fd_counts = self.fd_counts is True
            for pid in names:
                if not pid.isdigit():
                    continue
                try:
                    st = fstat(pid + "/fd", dir_fd=root_fd)  # relative: no walk of the root path each time
                except OSError:
                    continue  # exited, or not ours to read
                if fd_counts:
                    fingerprint: Fingerprint | None = (st.st_ino, st.st_mtime_ns, st.st_size)
                else:
                    fingerprint = self._fingerprint(pid, st)
                    fd_counts = self.fd_counts is True
                    if fingerprint is None:
                        continue
                proc = procs.get(pid)
                if proc is None or proc.fingerprint != fingerprint or proc.due <= round_:
                    proc = self._scan_process(pid, fingerprint, proc)
                    if proc is None:
                        continue
                kept[pid] = proc
                if proc.fds:
                    with_drm.append(pid)
        finally:
            os.close(root_fd)
        stats.processes = len(kept)
        self._procs = kept  # processes that left /proc are forgotten here
        out: list[ClientRead] = []
        for pid in with_drm:
            proc = kept[pid]
            if self._read_clients(pid, proc, out):
                continue
            fresh = self._scan_process(pid, proc.fingerprint or (0, 0, 0), None)  # the table moved: look again
            if fresh is None:
                del kept[pid]
                continue
            kept[pid] = fresh
            if not self._read_clients(pid, fresh, out):
                fresh.fingerprint = None  # still moving: look again next sample
        stats.drm_fds = len(out)
        stats.unreadable = sum(1 for r in out if r.info is None)
        return out
