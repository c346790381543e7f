"""Whether a process's deleted executable was replaced: a new file stands at its path now, as an upgrade (apt's
dpkg, conda, uv) leaves it when it renames a new interpreter over one a job is running. Only "deleted and
nothing at its path" is the audit's exe-deleted evidence (gpukilld/rogue/score.py).

The path is looked up in the process's own mount namespace and root (/proc/PID/root + path), so a container's
upgrade is judged inside the container. Read in the sampler thread: the path is lstat()ed, never opened, and only
on filesystems that answer from the kernel. A path lookup on a FUSE filesystem waits for its server, which an
unprivileged user runs (in a user namespace of their own), and one on a network filesystem waits for a server
that may be gone: neither may hold the sampler. Where the lookup is not made (those filesystems, overlay, a
symbolic link on the way), the answer is None, "not known": the rule takes no evidence from what it could not
check, as a conda environment replaced on an NFS home or an upgrade inside a container must not count.
"""

from __future__ import annotations

import os
import stat

DELETED = " (deleted)"  # what the kernel appends to /proc/PID/exe's target once the file is unlinked
MAX_MOUNTINFO = 1 << 20  # bytes of /proc/PID/mountinfo: a user namespace may hold thousands of mounts
# Filesystems whose lookups the kernel answers itself (block devices, memory). overlay is left out: its lower
# layers may be any filesystem, FUSE included, and a user namespace may mount one.
LOCAL_FILESYSTEMS = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "zfs",
        "f2fs",
        "bcachefs",
        "jfs",
        "reiserfs",
        "tmpfs",
        "devtmpfs",
        "ramfs",
        "squashfs",
        "erofs",
        "vfat",
        "exfat",
        "iso9660",
    }
)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in a mount point as \\ooo (octal)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and len(field[i + 1 : i + 4]) == 3:
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _under(path: str, mount_point: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def lookup_is_local(mountinfo: str, path: str) -> bool:
    """Whether every mount a lookup of `path` crosses (each whose mount point is `path` or above it) is of a
    LOCAL_FILESYSTEMS type, by the process's mountinfo (mount points relative to the process's root)."""
    crossed = False
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            return False  # not mountinfo's shape: do not guess
        if len(fields) <= sep + 1:
            return False
        if _under(path, _unescape(fields[4])):
            crossed = True
            if fields[sep + 1] not in LOCAL_FILESYSTEMS:
                return False
    return crossed


def exe_replaced(proc_root: str, pid: int, exe: str | None) -> bool | None:
    """For `exe` (the process's /proc/PID/exe target) deleted: True when a regular file stands at its path in the
    process's mount namespace now, False when nothing does (or something that is not a file), None when that
    cannot be looked up without waiting on a filesystem's server or following a symbolic link (see the module's
    docstring). False when it is not deleted."""
    if not exe or not exe.endswith(DELETED):
        return False
    path = exe.removesuffix(DELETED)
    parts = path.split("/")[1:]
    if not path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in parts):
        return None
    try:
        with open(f"{proc_root}/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
            mountinfo = f.read(MAX_MOUNTINFO + 1)
    except OSError:
        return None
    if len(mountinfo) > MAX_MOUNTINFO or not lookup_is_local(mountinfo, path):
        return None
    # lstat, one component after the other: a symbolic link on the way (an absolute one would be followed from
    # this daemon's root, not the process's) ends the look, so the lookup crosses only the mounts checked above.
    where = f"{proc_root}/{pid}/root"
    try:
        for part in parts:
            where += "/" + part
            mode = os.lstat(where).st_mode
            if stat.S_ISLNK(mode):
                return None
    except (FileNotFoundError, NotADirectoryError):
        return False
    except (OSError, ValueError):
        return None
    return stat.S_ISREG(mode)


RECHECK = 30.0  # seconds before a process's deleted executable is looked up again


class ExeLookups:
    """exe_replaced() per process (pid, start time), looked up again at most every RECHECK seconds: the audit
    looks at every process on every sample whose records moved (a busy GPU's utilization moves each one), and an
    upgrade leaves every process of that interpreter deleted at once; a replacement is seen within RECHECK."""

    def __init__(self, proc_root: str) -> None:
        self.proc_root = proc_root
        self._seen: dict[tuple[int, int], tuple[str, bool | None, float]] = {}  # key -> (exe, answer, when)
        self._prune_at = 64

    def __call__(self, key: tuple[int, int], exe: str | None, now: float) -> bool | None:
        if not exe or not exe.endswith(DELETED):
            return False
        seen = self._seen.get(key)
        if seen is not None and seen[0] == exe and now - seen[2] < RECHECK:
            return seen[1]
        answer = exe_replaced(self.proc_root, key[0], exe)
        self._seen[key] = (exe, answer, now)
        if len(self._seen) > self._prune_at:  # processes gone, or no longer deleted, are not asked for again
            self._seen = {k: v for k, v in self._seen.items() if now - v[2] < 2 * RECHECK}
            self._prune_at = 2 * len(self._seen) + 64
        return answer
