"""Whether a process runs an allowed executable: the audit's allowed_processes, recognised by what its owner
cannot forge.

A process controls its own name (prctl PR_SET_NAME, argv[0], the file name of a copy it made), so an allow-list
of names would let a miner rename itself into it. What it does not control is which file the kernel executed:
/proc/PID/exe is that file, and stat() of it is the running inode, whatever path it shows. So a process is an
allowed one when, all of these:
- the path the kernel shows for its executable (not deleted) is one of allowed_processes, exactly;
- the file at that path on the host (the daemon's view) is the very inode it runs (same device and inode): a
  copy, a bind mount of the user's own file over the path in a namespace of theirs, or a container's file of
  the same name is another inode;
- that file is a regular file owned by root and writable by no one else (no group or other write bit), and so
  is every directory above it (owned by root, no group or other write bit): no ordinary user can have put a
  file of theirs there, or swap it later.
An allowed interpreter (/usr/bin/python3) allows whatever script it runs: allow programs, not interpreters.

An allowed file is trusted only while the process runs its own code (foreign_code): `LD_PRELOAD=~/miner.so
/usr/bin/sleep` runs an allowed file and a user's code. The mapped files are the fact (/proc/PID/maps: every
file mapped executable must pass the same test as the executable, and be the inode the process mapped); the
environment's LD_PRELOAD and LD_LIBRARY_PATH are evidence of intent, named in the reason; a tracer (TracerPid)
can write any code into the process, so a traced process is not trusted either.
"""

from __future__ import annotations

import os
import stat

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def _root_only(st: os.stat_result) -> bool:
    return st.st_uid == 0 and not st.st_mode & _WRITABLE_BY_OTHERS


def untrusted_because(path: str) -> str | None:
    """Why no process running the file at `path` could be an allowed one now, or None: for a refusal when an
    admin adds it (a mistyped path, or a tool under $HOME, would otherwise be listed and never match)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link: name the file it points to ({os.path.realpath(path)})"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if not _root_only(st):
        return f"{path} is not owned by root and writable by root alone: its owner could put any program there"
    folder = os.path.dirname(path)
    while True:
        try:
            st = os.stat(folder, follow_symlinks=False)
        except OSError as e:
            return f"{folder}: {e.strerror or e}"
        if not stat.S_ISDIR(st.st_mode) or not _root_only(st):
            return f"{folder} is not a folder owned by root and writable by root alone: the file could be replaced"
        if folder == "/":
            return None
        folder = os.path.dirname(folder)


def runs_trusted(proc_root: str, pid: int, exe: str) -> bool:
    """Whether PID runs the root-owned, root-only-writable file at the absolute path `exe` (see above)."""
    if not exe.startswith("/") or exe.endswith(" (deleted)"):
        return False
    try:
        running = os.stat(f"{proc_root}/{pid}/exe")  # the inode the kernel executed
    except OSError:
        return False
    return _root_only_file(exe, running.st_dev, running.st_ino)


def _root_only_file(path: str, dev: int, ino: int) -> bool:
    """Whether the file at `path` on the host is the inode (dev, ino), and one untrusted_because() finds no
    fault with: a regular file owned by root and writable by root alone, in such folders up to /."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino) and untrusted_because(path) is None


MAX_MAPS_BYTES = 1 << 20  # /proc/PID/maps read at most this far: a process can map many files
MAX_MAPPED_FILES = 512  # distinct files mapped executable; more is not judged, and not trusted
MAX_ENVIRON_BYTES = 128 << 10
_INTENT = (b"LD_PRELOAD=", b"LD_LIBRARY_PATH=")


def foreign_code(proc_root: str, pid: int) -> str | None:
    """Why the process may run code other than its own executable's and the host's root-owned libraries, or
    None: a tracer, or a file mapped executable that is not a root-only file of the host (see above)."""
    base = f"{proc_root}/{pid}"
    try:
        with open(f"{base}/status", "rb") as f:
            status = f.read(8192)
        with open(f"{base}/maps", "rb") as f:
            maps = f.read(MAX_MAPS_BYTES + 1)
    except OSError as e:
        return f"its memory map could not be read ({e.strerror or e})"
    tracer = next((line.split()[1] for line in status.splitlines() if line.startswith(b"TracerPid:")), b"0")
    if tracer != b"0":
        return f"it is being traced by PID {tracer.decode(errors='replace')}"
    if len(maps) > MAX_MAPS_BYTES:
        return "it maps more than its memory map's bound: not judged"
    seen: dict[bytes, list[bytes]] = {}  # path -> its first mapping's fields
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or b"x" not in fields[1] or not fields[5].startswith(b"/"):
            continue  # not executable, or anonymous, [vdso], [vsyscall]
        if fields[5] not in seen:
            seen[fields[5]] = fields
            if len(seen) > MAX_MAPPED_FILES:
                return f"it maps more than {MAX_MAPPED_FILES} files executable: not judged"
    for path, fields in seen.items():
        text = path.decode(errors="replace")
        if path.endswith(b" (deleted)") or not _root_only_file(text, *_mapped_inode(base, fields)):
            return f"it runs code from {text}, which is not a root-only file of the host{_intent(base)}"
    return None


def _mapped_inode(base: str, fields: list[bytes]) -> tuple[int, int]:
    """The (device, inode) of a mapping's file as stat() tells them: through map_files (CAP_SYS_ADMIN), as the
    executable's through /proc/PID/exe; else as maps writes them (a filesystem whose maps device differs from
    stat's, btrfs, then reads as another file: not trusted, never the other way)."""
    try:
        st = os.stat(f"{base}/map_files/{fields[0].decode()}")
        return st.st_dev, st.st_ino
    except OSError:
        major, _, minor = fields[3].partition(b":")
        return os.makedev(int(major, 16), int(minor, 16)), int(fields[4])


def _intent(base: str) -> str:
    """The environment's preload variables, as said in a reason (the mapped files are the fact)."""
    try:
        with open(f"{base}/environ", "rb") as f:
            environ = f.read(MAX_ENVIRON_BYTES)
    except OSError:
        return ""
    named = [v[:120].decode(errors="replace") for v in environ.split(b"\0") if v.startswith(_INTENT)]
    return f" ({', '.join(named)})" if named else ""
