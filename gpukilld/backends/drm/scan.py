"""Finding DRM clients in /proc, incrementally: which processes hold a DRM file (character major 226), and
what each such file's fdinfo says.

A full scan stats every fd of every process: 100,000 stat calls on a host with 5,000 processes. So each
(pid, start time) is scanned once and remembered with a fingerprint of its fd table, (inode, mtime, size) of
/proc/PID/fd: a new process has a new inode, and since Linux 6.2 the size is the number of open fds, so an open
or close shows. On older kernels (size always 0) the fingerprint holds the fd numbers instead, which costs a
directory read per process. Only processes whose fingerprint changed are scanned again; the others cost one
stat. What a fingerprint cannot see is an fd closed and its number reused for another file between two samples:
for known DRM fds the fdinfo "ino:" line (the inode of the opened file) catches it, and every process is
scanned in full at least once every `revalidate_every` looks at it. A reset does not rely on any of this: it
looks for holders with a full scan (`holders`) right before it acts.

Where the kernel lists a device's clients itself (debugfs dri/N/clients, KFD's proc/ directory: clients.py,
kfd.py), even the one stat per process is skipped: a sample looks only at the listed processes, the ones it
already knows hold a DRM fd, and a slice of the others (the safety net, below), so its cost follows the number
of GPU clients rather than of processes. The full walk stays for the first sample and for every sample where
a list cannot be read or trusted. There, a listed process's entry (its rows per device) replaces the periodic
re-read of its fd table: a DRM file it opens or closes adds or removes a row, which sends the scanner back to
the table; an unlisted process is re-read every `revalidate_every` looks, a look being every SAFETY_NET_PERIOD
samples. And an fdinfo whose bytes are those of the last sample is not parsed again (most clients' counters
do not move between two samples).

Each process found holding a DRM fd is also held by a descriptor of its /proc/PID directory (O_PATH), and its
fdinfo is opened relative to that: such a descriptor names one process, not a number, and every look-up under it
fails once that process has exited and been reaped, even if the number names a new process by then (procfs
resolves it through the task it was opened on; on a fixture tree, a deleted directory does the same). So a
reused PID cannot pass for a holder, and with trusted lists a holder whose entry did not change needs no stat of
its fd table each sample: it is looked at with its slice like every other process (an fd it received over a
socket, which no list shows, is found there, as for any unlisted process), and its fdinfo read says the rest (a
DRM fd closed: the open fails; its number reused: the "ino:" line differs).

Reading another user's fdinfo needs ptrace-read rights, which the root daemon has; an fd table or fdinfo that
cannot be read is skipped, never an error.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from gpukill.procstat import ProcStat, parse_stat

from ...proc.exit_watch import fd_budget
from .discovery import DRM_MAJOR
from .fdinfo import FdInfo, parse_fdinfo

Fingerprint = tuple[int, int, int | tuple[str, ...]]  # fd dir inode, mtime, size or fd numbers

# The kernel's client lists name the process that opened a DRM file or last used it, so a holder that inherited
# one (or was passed it) and has not used it shows only in its fd table: with the lists, every process is still
# walked once every SAFETY_NET_PERIOD samples. One sample of the period lists /proc (a process new there is
# looked at at once); each of the others walks one of SLICES slices (pid % SLICES), so no sample pays for both.
# 20 samples (20 s at 1 Hz) keeps the idle daemon's cost low (bench/fdinfo_scan); a reset does not rely on it
# (holders() walks every table before it acts).
SAFETY_NET_PERIOD = 20
SLICES = SAFETY_NET_PERIOD - 1
# At most this many holders are held by a /proc/PID descriptor, and at most a quarter of the descriptors the
# process may hold besides its headroom (exit_watch.fd_budget: pidfds, files and the bus come first); one past it
# is stat'ed every sample instead, as without one.
PINNED_MAX = 1024
_PIN_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC
_ABSENT = object()  # a pid without an entry in the last sample's lists


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
    # Looks until this fd table is read in full again, changed or not: a look is every sample on a walk, every
    # SAFETY_NET_PERIOD samples in the slice (so the slice does not re-read nearly every table it visits), and
    # none for a listed process whose entry in the kernel's lists did not change (that entry is the check).
    looks_left: int


@dataclass(slots=True)  # not frozen: made 200 times a sample, and a frozen __init__ costs twice as much
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
    unstatted: int = 0  # of which holders read through their pinned /proc directory, without a stat
    scanned: int = 0  # of which fd tables were read in full
    walked: bool = False  # every process was looked at (no client list, or a list could not be trusted)
    listed_proc: bool = False  # /proc itself was listed (a walk, or every SAFETY_NET_PERIOD samples)
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
        self._walked = False  # a full walk has been made: the cache knows every process once
        self._listed: Mapping[str, object] = {}  # the kernel's client lists of the last sample: pid -> its entry
        self._holding: set[str] = set()  # pids with a DRM fd at the last sample
        # The safety net's slices: the pids of the last listing of /proc, by pid % SLICES (a pid stays in its
        # slice, so each is looked at every SAFETY_NET_PERIOD samples). /proc is listed once every
        # SAFETY_NET_PERIOD samples (listing 5,000 entries costs as much as the rest of a listed sample), and a
        # pid that a listing shows for the first time is looked at at once: so a process started between two
        # listings is looked at within SAFETY_NET_PERIOD samples too. Kept up to date by set differences with
        # the last listing (_listing, non-pid names included), so a listing costs C-level set work plus the churn.
        self._listing: set[str] = set()
        # The last listing as it came: a listing equal to it (nothing started or ended since) needs no set work.
        self._names: list[str] = []
        self._slices: list[set[str]] = [set() for _ in range(SLICES)]
        # Last sample's fdinfo of each DRM fd, raw and parsed: most clients' counters do not move between two
        # samples (an idle desktop's compositor, a paused job), and equal bytes need no parse.
        self._fdinfo: dict[tuple[str, int], tuple[bytes, FdInfo]] = {}
        # Holders by pid: (start time, an O_PATH descriptor of their /proc/PID), see the module's docstring.
        self._pins: dict[str, tuple[int, int]] = {}
        self._pin_budget = fd_budget() // 4
        self._rescanned: set[str] = set()  # pids whose fd table this sample read (their start time was read too)
        self.stats = ScanStats()

    def close(self) -> None:
        """Let go of the holders' /proc/PID descriptors (a later scan takes them again). Idempotent."""
        pins, self._pins = self._pins, {}
        for _, handle in pins.values():
            os.close(handle)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit, or an __init__ that did not finish
            self.close()

    def _pin(self, root_fd: int, pid: str, start_time: int) -> None:
        """Hold pid's /proc directory, if it is still the process with this start time."""
        try:
            handle = os.open(pid, _PIN_FLAGS, dir_fd=root_fd)
        except OSError:
            return
        try:
            stat_fd = os.open("stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=handle)
            try:
                text = os.read(stat_fd, 4096).decode("utf-8", "replace")
            finally:
                os.close(stat_fd)
        except OSError:
            text = ""
        st = _stat(int(pid), text)
        if st is None or st.start_time != start_time:  # not the process the scan saw: look again, unpinned
            os.close(handle)
            return
        self._pins[pid] = (start_time, handle)

    def _repin(self, root_fd: int, holding: set[str], procs: dict[str, _Proc]) -> None:
        """Hold exactly this sample's holders, each as the process (start time) the scan saw: a holder whose fd
        table was not read again this sample is the process it was, and keeps its pin."""
        pins = self._pins
        for pid in pins.keys() - holding:
            os.close(pins.pop(pid)[1])
        for pid in (holding - pins.keys()) | (self._rescanned & holding):
            start_time = procs[pid].start_time
            pin = pins.get(pid)
            if pin is not None:
                if pin[0] == start_time:
                    continue
                os.close(pins.pop(pid)[1])  # the pid is another process's now
            if len(pins) < min(PINNED_MAX, self._pin_budget):
                self._pin(root_fd, pid, start_time)

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
        self._rescanned.add(pid)
        every = self.revalidate_every
        # Spread the full re-reads over the period, so no one sample pays for all of them.
        return _Proc(start_time, fingerprint, tuple(fds), every if known is not None else int(pid) % every + 1)

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

    def _fdinfo_of(
        self, base: int, path: str, pid: str, fd: int, seen: dict[tuple[str, int], tuple[bytes, FdInfo]]
    ) -> FdInfo | None:
        """One DRM fd's fdinfo (path under base: /proc or the process's pinned directory), parsed only when its
        bytes differ from the last sample's; None: unreadable."""
        try:
            handle = os.open(path, _READ_FLAGS, dir_fd=base)
        except OSError:
            return None
        try:
            raw = os.read(handle, 65536)  # one read: the kernel prints an fdinfo in one go, a few hundred bytes
        except OSError:
            return None
        finally:
            os.close(handle)
        key = (pid, fd)
        known = self._fdinfo.get(key)
        info = known[1] if known is not None and known[0] == raw else parse_fdinfo(raw.decode("utf-8", "replace"))
        seen[key] = (raw, info)
        return info

    def _read_clients(
        self,
        root_fd: int,
        pid: str,
        proc: _Proc,
        out: list[ClientRead],
        seen: dict[tuple[str, int], tuple[bytes, FdInfo]],
    ) -> bool:
        """Read the fdinfo of each known DRM fd; False when the fd table changed under us, or the process it was
        read for is gone (scan again)."""
        reads = []
        number = int(pid)
        pin = self._pins.get(pid)
        base, prefix = (pin[1], "") if pin is not None and pin[0] == proc.start_time else (root_fd, pid + "/")
        for drm_fd in proc.fds:
            info = self._fdinfo_of(base, f"{prefix}fdinfo/{drm_fd.fd}", pid, drm_fd.fd, seen)
            if info is None:
                try:
                    os.lstat(f"{prefix}fd/{drm_fd.fd}", dir_fd=base)
                except OSError:
                    return False  # closed since the scan, or (pinned) the process exited
                reads.append(ClientRead(number, proc.start_time, drm_fd.fd, drm_fd.minor, None))
                continue
            if info.ino is not None and info.ino != drm_fd.ino:
                return False  # the number now names another file
            reads.append(ClientRead(number, proc.start_time, drm_fd.fd, drm_fd.minor, info))
        out.extend(reads)
        return True

    def _relist(self, current: set[str]) -> list[str]:
        """Bring the slices to a fresh listing of /proc; the pids it shows that the last listing did not."""
        last, slices = self._listing, self._slices
        for pid in last - current:
            if pid.isdigit():  # non-pid names ("self", "sys") are in no slice
                slices[int(pid) % SLICES].discard(pid)
        new = [pid for pid in current - last if pid.isdigit()]
        for pid in new:
            slices[int(pid) % SLICES].add(pid)
        self._listing = current
        return new

    def _candidates(
        self, names: list[str] | None, walk: bool, listed: Mapping[str, object], pinned: set[str]
    ) -> tuple[list[str], set[str]]:
        """The pids to stat this sample: all of them on a walk; else the listed ones, the known holders, the
        safety net's slice of this sample (none in the one that lists /proc) and, when /proc was listed
        (names), its new pids; but not
        the pinned holders (whose entry did not change) outside the slice: those are returned apart, to be read
        without a stat."""
        new = self._relist(set(names)) if names is not None and names != self._names else []
        if walk:
            assert names is not None  # a walk lists /proc
            return [pid for pid in names if pid.isdigit()], set()
        turn = self._round % SAFETY_NET_PERIOD  # 0: the sample that lists /proc
        chosen = list(self._slices[turn - 1]) if turn else []
        chosen.extend(pid for pid in new if not turn or int(pid) % SLICES != turn - 1)
        extra = listed.keys() | self._holding  # one that is not in /proc (gone, another namespace's) fails its stat
        extra.difference_update(chosen)
        unstatted = extra & pinned
        extra -= unstatted
        chosen.extend(extra)
        return chosen, unstatted

    def scan(self, listed: Mapping[int, object] | None = None) -> list[ClientRead]:
        """The DRM fds held now and their fdinfo.

        listed: the tgids the kernel lists as DRM clients (KFD's included), from every device's list, each with
        its entry there (e.g. how many rows name it): a listed process whose entry did not change since the
        last sample keeps its cached fd table without the periodic re-read, since a DRM file it opened or
        closed would have changed its entry. None where some list could not be read: walk every process."""
        self._round += 1
        self.stats = stats = ScanStats()
        self._rescanned = set()
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            self._forget_all()
            return []
        walk = listed is None or not self._walked
        stats.walked = walk
        listed_now = {} if listed is None else {str(p): entry for p, entry in listed.items()}
        last = self._listed
        # Read in full once: the kernel says it is a client now, or its entry moved (a DRM file opened or closed)
        changed = set() if walk else {p for p, entry in listed_now.items() if last.get(p, _ABSENT) != entry}
        self._listed = listed_now
        out: list[ClientRead] = []
        try:
            names: list[str] | None = None
            if walk or not self._listing or self._round % SAFETY_NET_PERIOD == 0:
                names = os.listdir(self.root)  # by path: ~20% cheaper than through root_fd (no fdopendir of a dup)
                stats.listed_proc = True
            # _repin left every pin on a holder of the last sample, with that holder's start time
            pinned = set() if walk else self._pins.keys() - changed
            # brings _listing to names, if listed now
            candidates, unstatted = self._candidates(names, walk, listed_now, pinned)
            kept = self._kept(names, walk)
            if names is not None:
                self._names = names
            with_drm = self._look(root_fd, candidates, unstatted, kept, changed, walk, listed_now)
            self._walked = self._walked or walk
            self._procs = kept  # on a walk, processes that left /proc are forgotten here
            self._read_holders(root_fd, with_drm, kept, out)
        finally:
            os.close(root_fd)
        stats.unreadable = sum(1 for r in out if r.info is None)
        return out

    def _forget_all(self) -> None:
        """/proc cannot be opened: no process is known, none pinned."""
        self._procs, self._holding, self._fdinfo = {}, set(), {}
        self._listing, self._names = set(), []
        self.close()
        for members in self._slices:
            members.clear()

    def _kept(self, names: list[str] | None, walk: bool) -> dict[str, _Proc]:
        """Where this sample's processes go: a new table on a walk; else the last one, in place (a sample visits
        a tenth of the processes), less those that left /proc when it was listed (a reused pid meanwhile shows
        a new fd-directory inode when looked at)."""
        if walk:
            return {}
        procs = self._procs
        if names is not None and names != self._names:
            for gone in procs.keys() - self._listing:
                del procs[gone]
        return procs

    def _look(
        self,
        root_fd: int,
        candidates: list[str],
        unstatted: set[str],
        kept: dict[str, _Proc],
        changed: set[str],
        walk: bool,
        listed_now: Mapping[str, object],
    ) -> list[str]:
        """Stat each candidate's fd directory and read its table again where it moved, is due, or the kernel's
        entry for it changed; the pinned holders (unstatted) are taken as they are. The pids that hold DRM fds."""
        procs = self._procs
        with_drm = []
        fstat = os.stat
        fd_counts = self.fd_counts is True
        looked = 0
        for pid in candidates:
            try:
                st = fstat(pid + "/fd", dir_fd=root_fd)  # relative: no walk of the root path each time
            except OSError:
                kept.pop(pid, None)
                continue  # exited, or not ours to read
            if fd_counts:
                fingerprint: Fingerprint = (st.st_ino, st.st_mtime_ns, st.st_size)
            else:
                read = self._fingerprint(pid, st)
                fd_counts = self.fd_counts is True
                if read is None:
                    kept.pop(pid, None)
                    continue
                fingerprint = read
            proc = procs.get(pid)
            if proc is None or proc.fingerprint != fingerprint or pid in changed:
                fresh = True
            elif walk or pid not in listed_now:  # a listed process's unchanged entry stands for the re-read
                proc.looks_left -= 1
                fresh = proc.looks_left <= 0
            else:
                fresh = False
            if fresh or proc is None:  # (never known is always fresh)
                proc = self._scan_process(pid, fingerprint, proc)
                if proc is None:
                    kept.pop(pid, None)
                    continue
            kept[pid] = proc
            looked += 1
            if proc.fds:
                with_drm.append(pid)
        for pid in unstatted:  # pinned holders: their fdinfo reads below tell whether they are still there
            proc = procs.get(pid)
            if proc is not None:
                looked += 1
                self.stats.unstatted += 1
                if proc.fds:
                    with_drm.append(pid)
        self.stats.processes = looked
        return with_drm

    def _read_holders(self, root_fd: int, with_drm: list[str], kept: dict[str, _Proc], out: list[ClientRead]) -> None:
        """Each holder's DRM fds' fdinfo into out; a holder whose table moved meanwhile is looked at again (then
        next sample, if it is still moving). The holders and their pins follow."""
        seen: dict[tuple[str, int], tuple[bytes, FdInfo]] = {}
        holding = set()
        for pid in with_drm:
            proc = kept[pid]
            if not self._read_clients(root_fd, pid, proc, out, seen):
                fresh = self._scan_process(pid, proc.fingerprint or (0, 0, 0), None)  # the table moved: look again
                if fresh is None:
                    del kept[pid]
                    continue
                kept[pid] = fresh
                if not self._read_clients(root_fd, pid, fresh, out, seen):
                    fresh.fingerprint = None  # still moving: look again next sample
            if kept[pid].fds:
                holding.add(pid)
        self._holding = holding
        self._repin(root_fd, holding, kept)
        self._fdinfo = seen  # fds not read this sample are forgotten
