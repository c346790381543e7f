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
        on_host = os.stat(exe, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(on_host.st_mode) or (running.st_dev, running.st_ino) != (on_host.st_dev, on_host.st_ino):
        return False
    if not _root_only(on_host):
        return False
    folder = os.path.dirname(exe)
    while True:
        try:
            st = os.stat(folder, follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or not _root_only(st):
            return False
        if folder == "/":
            return True
        folder = os.path.dirname(folder)
