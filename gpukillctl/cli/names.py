"""Whether a name a selection gives exists: a user, a group, a systemd unit, a GPU.

A selection that matches nothing is two different answers. A name that exists but has no GPU process (a user
with nothing running) is a fact: exit status 0, and a line on stderr says so. A name that does not exist (a
typo: `--user alcie`, `--unit foo.servce`, `--device 9`) is an error with its own exit status,
EXIT_NO_SUCH_NAME, so that a script does not read "nothing to do" where it asked for the wrong thing.

Users and groups are this host's (NSS: passwd and group files, LDAP, ...); a number is a uid or gid and
always exists. A GPU is one the daemon lists (its index, UUID or PCI bus id: gpukill.records.find_device). A
unit exists when systemd has it on this host: a unit file, an alias link or a template for it in one of
systemd's unit directories (systemd.unit(5): system and user ones, transient and generated ones included), or
a cgroup of that name (a running unit: a scope, a user's unit). The check reads files, not systemd's bus API,
so it also works where the system bus has no systemd (a container, the test bed). Over -H the host is another
one, whose users, groups and units this one cannot tell: only the GPU is checked there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from gpukill.text import shown

# systemd.unit(5)'s unit search paths of the system and user managers, and Debian's /lib before merged /usr.
UNIT_DIRS = (
    "/etc/systemd/system.control",
    "/run/systemd/system.control",
    "/run/systemd/transient",
    "/run/systemd/generator.early",
    "/etc/systemd/system",
    "/etc/systemd/system.attached",
    "/run/systemd/system",
    "/run/systemd/system.attached",
    "/run/systemd/generator",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
    "/run/systemd/generator.late",
    "/etc/systemd/user",
    "/run/systemd/user",
    "/usr/local/lib/systemd/user",
    "/usr/lib/systemd/user",
    "/lib/systemd/user",
)
CGROUP_ROOT = "/sys/fs/cgroup"
MAX_CGROUP_DIRS = 100_000  # directories looked at for a running unit's cgroup: a big Kubernetes node has ~10,000


def no_such_user(name: str) -> str | None:
    """Why `name` names no user here, or None: a uid, or a name NSS knows."""
    return _no_such("user", name)


def no_such_group(name: str) -> str | None:
    """Why `name` names no group here, or None: a gid, or a name NSS knows."""
    return _no_such("group", name)


def _no_such(kind: str, name: str) -> str | None:
    import grp
    import pwd

    if name.isascii() and name.isdigit():
        return None
    try:
        (pwd.getpwnam if kind == "user" else grp.getgrnam)(name)
    except (KeyError, ValueError, UnicodeEncodeError):
        return f"no such {kind} {shown(name)!r} on this host"
    return None


def no_such_device(devices: Iterable, key: str) -> str | None:
    """Why `key` names none of the GPUs listed, or None. `devices` are the daemon's (ListDevices)."""
    from gpukill.records.manager import find_device

    devices = list(devices)
    if find_device(devices, key) is not None:
        return None
    have = ", ".join(str(d.index) for d in devices) or "none"
    return f"no such GPU {shown(key)!r} (GPUs here: {have}; an index, UUID or PCI bus id)"


def _template(unit: str) -> str | None:
    """foo@bar.service's template, foo@.service; None for a unit that is no template's instance."""
    prefix, at, rest = unit.partition("@")
    if not at or "." not in rest:
        return None
    return f"{prefix}@.{rest.rsplit('.', 1)[1]}"


def _cgroup_roots(root: str) -> list[str]:
    """The hierarchies systemd names units in: the unified one, or (v1 and hybrid) name=systemd and unified."""
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        return [root]
    return [d for d in (os.path.join(root, "systemd"), os.path.join(root, "unified")) if os.path.isdir(d)]


def unit_running(unit: str, root: str = CGROUP_ROOT) -> bool:
    """Whether some cgroup is named `unit` (systemd makes one per running service and scope), looking at no
    more than MAX_CGROUP_DIRS directories."""
    seen = 0
    for top in _cgroup_roots(root):
        for _dirpath, dirnames, _files in os.walk(top, onerror=lambda e: None):
            if unit in dirnames:
                return True
            seen += len(dirnames)
            if seen > MAX_CGROUP_DIRS:
                return False
    return False


def no_such_unit(unit: str, dirs: Iterable[str] = UNIT_DIRS, root: str = CGROUP_ROOT) -> str | None:
    """Why systemd on this host has no unit `unit`, or None: a unit file (or alias link, or template) in its
    unit directories, or a running unit's cgroup."""
    names = [n for n in (unit, _template(unit)) if n]
    if any(os.path.lexists(os.path.join(d, n)) for d in dirs for n in names):
        return None
    if unit_running(unit, root):
        return None
    return f"no such unit {shown(unit)!r} on this host (systemd has no unit file and no running unit of that name)"


def none_selected(what: str) -> None:
    """Say on stderr that an existing user, GPU or unit has no GPU processes (exit status 0)."""
    print(f"gpukillctl: {shown(what)} has no GPU processes", file=sys.stderr)
