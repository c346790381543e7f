"""Freezing a suspended workload, so that its processes do not spin on their locked CUDA calls.

The workload's own cgroup is frozen where it has one: every process of the cgroup (and of the cgroups below it)
is one of the workload's, so freezing it stops nothing else (cgroup v2's cgroup.freeze, or cgroup v1's freezer
hierarchy's freezer.state). Otherwise (a login session, a scope shared with other work) each process of the
workload gets SIGSTOP through its pidfd, its start time checked, and SIGCONT to thaw. Blocking (reads /proc and
/sys, waits for a cgroup to say it is frozen): run it in a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

from gpukill.records.suspend import FROZEN_CGROUP, FROZEN_SIGSTOP

from ..proc.procfs import ProcFS

Key = tuple[int, int]
FREEZE_WAIT = 2.0  # seconds a cgroup gets to report itself frozen
MAX_CGROUP_PROCS = 100_000


@dataclass(frozen=True, slots=True)
class Frozen:
    """How a workload is frozen: kind (FROZEN_CGROUP or FROZEN_SIGSTOP), the cgroup's control file, the members."""

    kind: str
    control: str  # cgroup.freeze or freezer.state; "" for SIGSTOP
    members: tuple[Key, ...]

    @property
    def text(self) -> str:
        where = os.path.dirname(self.control)
        return f"its cgroup {where} frozen" if self.kind == FROZEN_CGROUP else "SIGSTOP sent to each of its processes"


def _cgroup_lines(procfs: ProcFS, pid: int) -> list[tuple[str, str, str]]:
    """/proc/PID/cgroup as (hierarchy, controllers, path)."""
    out = []
    for line in procfs.cgroup_lines(pid):
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        out.append((hierarchy, controllers, path))
    return out


def _control_of(procfs: ProcFS, sys_root: str, pid: int) -> str | None:
    """The freezer control file of the process's cgroup: v2's cgroup.freeze, else v1's freezer.state; None for
    the root cgroup or where there is no freezer."""
    for hierarchy, controllers, path in _cgroup_lines(procfs, pid):
        if hierarchy == "0" and controllers == "" and path not in ("", "/"):
            control = os.path.join(sys_root, "fs/cgroup", path.lstrip("/"), "cgroup.freeze")
            if os.path.exists(control):
                return control
    for _, controllers, path in _cgroup_lines(procfs, pid):
        if "freezer" in controllers.split(",") and path not in ("", "/"):
            control = os.path.join(sys_root, "fs/cgroup/freezer", path.lstrip("/"), "freezer.state")
            if os.path.exists(control):
                return control
    return None


def _pids_under(directory: str) -> set[int] | None:
    """Every process of the cgroup and of those below it; None when that cannot be read whole."""
    pids: set[int] = set()
    try:
        for here, _dirs, files in os.walk(directory):
            if "cgroup.procs" in files:
                with open(os.path.join(here, "cgroup.procs"), encoding="ascii") as f:
                    pids.update(int(line) for line in f if line.strip())
            if len(pids) > MAX_CGROUP_PROCS:
                return None
    except (OSError, ValueError):
        return None
    return pids


def _own_cgroup(procfs: ProcFS, sys_root: str, members: list[Key]) -> str | None:
    """The freezer control file of the cgroup the members alone make up, or None where there is no such cgroup."""
    controls = {_control_of(procfs, sys_root, pid) for pid, _ in members}
    if len(controls) != 1:
        return None
    (control,) = controls
    if control is None:
        return None
    inside = _pids_under(os.path.dirname(control))
    if inside is None or os.getpid() in inside or not inside <= {pid for pid, _ in members}:
        return None
    return control


def _signal_each(procfs: ProcFS, members: tuple[Key, ...], sig: signal.Signals) -> list[int]:
    """sig to each member through its pidfd, its start time checked; the PIDs that were gone."""
    gone = []
    for pid, start_time in members:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            gone.append(pid)
            continue
        try:
            if procfs.start_time(pid) != start_time:
                gone.append(pid)
                continue
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            gone.append(pid)
        finally:
            os.close(fd)
    return gone


def _write(control: str, value: str) -> None:
    with open(control, "w", encoding="ascii") as f:
        f.write(value)


def _cgroup_frozen(control: str) -> bool:
    if control.endswith("freezer.state"):
        with open(control, encoding="ascii") as f:
            return f.read().strip() == "FROZEN"
    with open(os.path.join(os.path.dirname(control), "cgroup.events"), encoding="ascii") as f:
        return "frozen 1" in f.read().splitlines()


def freeze(procfs: ProcFS, sys_root: str, members: list[Key]) -> Frozen:
    """Freeze the workload's members: their own cgroup where they have one, else SIGSTOP each. OSError when
    the cgroup cannot be frozen (it is thawed again then)."""
    control = _own_cgroup(procfs, sys_root, members)
    if control is None:
        frozen = Frozen(FROZEN_SIGSTOP, "", tuple(members))
        _signal_each(procfs, frozen.members, signal.SIGSTOP)
        return frozen
    _write(control, "FROZEN" if control.endswith("freezer.state") else "1")
    deadline = time.monotonic() + FREEZE_WAIT
    while not _cgroup_frozen(control):
        if time.monotonic() > deadline:
            thaw(procfs, Frozen(FROZEN_CGROUP, control, tuple(members)))
            raise OSError(f"{os.path.dirname(control)} did not freeze within {FREEZE_WAIT:g}s")
        time.sleep(0.02)
    return Frozen(FROZEN_CGROUP, control, tuple(members))


def thaw(procfs: ProcFS, frozen: Frozen) -> None:
    """Undo freeze(); a member that ended meanwhile is passed over, a cgroup removed meanwhile too."""
    if frozen.kind == FROZEN_CGROUP:
        with contextlib.suppress(FileNotFoundError):
            _write(frozen.control, "THAWED" if frozen.control.endswith("freezer.state") else "0")
        return
    _signal_each(procfs, frozen.members, signal.SIGCONT)
