"""What one KillWorkload names: a process tree, a systemd unit, a container or a Slurm job, turned into GPU processes.

Only processes on a GPU are ever signalled: a tree's processes that use no GPU (a shell, a data loader, a
monitoring helper sharing the process group) are listed as left running, never killed, because the kill path
acts on GPU processes alone (killer.open refuses the others) and a tree is the daemon's reading of ppid links,
not something the caller proved about each process. A tree is read from /proc once (remember_tree), its root
named by pid and start time as listed, so a PID reused since the listing selects nothing. A caller's job selects
the processes its own listing shows in that job (viewer): a job read from SLURM_JOB_ID is its owner's to see
(gpukilld/access/visibility.py), so a job id never tells a caller which of another user's processes carry it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpukill.errors import InvalidArgs, NoSuchProcess, NotAGpuProcess, ProcessChanged, Protected

from ..access.visibility import Viewer, as_seen_by
from ..model import GpuProcess, Snapshot
from ..proc.procfs import ProcFS
from .reclaim import remember_tree, workload_unit

MAX_WORKLOAD = 256  # GPU processes killed in one act; a larger selection is refused, never cut
MAX_NAME = 256
_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]+\.(service|scope)")
_CONTAINER = re.compile(r"[0-9a-f]{12,64}")
KILL_KEYS = ("tree", "unit", "container", "job")  # KillWorkload's selection keys

Key = tuple[int, int]
Left = tuple[int, int, int, str]  # a process not on a GPU: pid, start time, uid, comm
OTHER_USERS = "another user's process: a Guard rule stops its subject's owner's processes alone"
GUARD_ONLY = "not in the Guard rule's decision (it started since): left running; the next evaluation decides"


def unit_mates(me: Any, procs: Iterable[Any]) -> list[Any]:
    """The processes of `me`'s workload among procs (each with pid, start_time, unit and slurm_job, as
    GpuProcess and Guard's ProcView have): its Slurm job's, not the scope slurmstepd runs every job in; else its
    systemd unit's; itself alone in a login session, user@UID or init.scope."""
    if me.slurm_job:
        return [p for p in procs if p.slurm_job == me.slurm_job]
    if not workload_unit(me.unit):
        return [me]
    return [p for p in procs if p.unit == me.unit]


@dataclass(frozen=True, slots=True)
class Selection:
    # "tree", "unit", "container"; "pid" and "job" (a Slurm job's, on this host: suspend and resume); or "unit_of"
    # (a Guard rule's kill_scope unit: the process's unit)
    kind: str
    value: str  # the unit's, container's or job's name; for a pid, tree or unit_of, the process's PID
    start_time: int = 0  # a tree's root (unit_of's process), as listed
    owner: int | None = None  # only this uid's processes (Guard's scoped kills: the subject's owner's alone)
    # Guard's scoped kills: the processes its rule decided to stop (None: every one selected), and those it
    # decided to leave running, with why ((pid, start time, "exempt: user bob"), ...). A process selected now
    # but in neither started since the decision: it is left running too (GUARD_ONLY).
    only: frozenset[Key] | None = None
    spare: tuple[tuple[int, int, str], ...] = ()
    viewer: Viewer | None = None  # a caller's "job": the job as its listing shows it (None: the daemon's view)

    @property
    def text(self) -> str:
        if self.kind == "unit_of":
            return f"unit of PID {self.value}"
        if self.kind == "pid":
            return f"PID {self.value}"
        if self.kind == "job":
            return f"Slurm job {self.value}"
        return f"tree of PID {self.value}" if self.kind == "tree" else f"{self.kind} {self.value}"

    def in_job(self, p: GpuProcess) -> bool:
        """p is of the selected job, as the viewer (if any) sees it."""
        seen = p if self.viewer is None else as_seen_by(p, self.viewer)
        return seen is not None and seen.slurm_job == self.value

    def guard_left(self, chosen: list[Key], owner_of: Callable[[Key], int | None]) -> list[tuple[Key, str]]:
        """Of the processes selected, those Guard's rule leaves running, with why: what it decided to spare,
        another user's (owner), and any that started since its decision (only). [] for a caller's selection."""
        spare = {(pid, start_time): why for pid, start_time, why in self.spare}
        left = []
        for key in chosen:
            if key in spare:
                left.append((key, spare[key]))
            elif self.owner is not None and owner_of(key) != self.owner:
                left.append((key, OTHER_USERS))
            elif self.only is not None and key not in self.only:
                left.append((key, GUARD_ONLY))
        return left

    @classmethod
    def parse_workload(cls, options: dict[str, object]) -> Selection:
        """From SuspendWorkload's or ResumeWorkload's selection a{sv}: exactly one of pid (ut), tree (ut), unit (s)
        or job (s, a Slurm job id)."""
        keys = ("pid", "tree", "unit", "job")
        unknown = [k for k in options if k not in keys]
        if unknown:
            raise InvalidArgs(f"unknown selection key {str(unknown[0])[:64]!r} (known: {', '.join(keys)})")
        if len(options) != 1:
            raise InvalidArgs(f"give exactly one of the selection keys {', '.join(keys)}")
        ((kind, value),) = options.items()
        if kind == "pid":
            if not (isinstance(value, list | tuple) and len(value) == 2 and all(type(v) is int for v in value)):
                raise InvalidArgs("selection 'pid' is (pid, start_time)")
            return dataclasses.replace(cls.parse({"tree": value}), kind="pid")
        return cls.parse({kind: value})

    @classmethod
    def parse(cls, options: dict[str, object]) -> Selection:
        """From KillWorkload's selection a{sv} (plain values): exactly one of tree (ut), unit (s), container (s)
        or job (s, a Slurm job id)."""
        given = [k for k in KILL_KEYS if k in options]
        unknown = [k for k in options if k not in KILL_KEYS]
        if unknown:
            raise InvalidArgs(f"unknown selection key {str(unknown[0])[:64]!r} (known: {', '.join(KILL_KEYS)})")
        if len(given) != 1:
            raise InvalidArgs(f"give exactly one of the selection keys {', '.join(KILL_KEYS)}")
        kind, value = given[0], options[given[0]]
        if kind == "job":
            # decimal, as the daemon lists a job: an array task's or a het job component's own id, not "12_3"
            if not (isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 10):
                raise InvalidArgs(f"selection 'job' is a Slurm job id (decimal digits), not {str(value)[:64]!r}")
            return cls("job", str(int(value)))
        if kind == "tree":
            if not (isinstance(value, list | tuple) and len(value) == 2 and all(type(v) is int for v in value)):
                raise InvalidArgs("selection 'tree' is (pid, start_time)")
            pid, start_time = value
            if not 0 < pid <= 2**22:
                raise InvalidArgs(f"pid {pid} is out of range")
            return cls("tree", str(pid), start_time)
        if not isinstance(value, str) or len(value) > MAX_NAME:
            raise InvalidArgs(f"selection {kind!r} is a name of at most {MAX_NAME} characters")
        if kind == "unit" and not _UNIT.fullmatch(value):
            raise InvalidArgs(f"not a systemd .service or .scope name: {value[:64]!r}")
        if kind == "container" and not _CONTAINER.fullmatch(value):
            raise InvalidArgs(f"not a container id (12 to 64 lowercase hex digits): {value[:64]!r}")
        return cls(kind, value)

    def resolve(self, procfs: ProcFS, snapshot: Snapshot) -> tuple[list[Key], list[Left]]:
        """The GPU processes selected, by PID, and (for a tree) the processes left running as not on a GPU.
        Reads /proc: call it in a worker thread."""
        on_gpu = {(p.pid, p.start_time): p for p in snapshot.processes}
        if self.kind == "unit_of":
            me = on_gpu.get((int(self.value), self.start_time))
            if me is None:
                raise NotAGpuProcess(f"PID {self.value} is not using a GPU")
            return sorted({(p.pid, p.start_time) for p in unit_mates(me, on_gpu.values())}), []
        if self.kind == "unit":
            return sorted(k for k, p in on_gpu.items() if p.unit == self.value), []
        if self.kind == "job":
            return sorted(k for k, p in on_gpu.items() if self.in_job(p)), []
        if self.kind == "container":
            ids = {p.container_id for p in on_gpu.values() if p.container_id and p.container_id.startswith(self.value)}
            if len(ids) > 1:
                raise InvalidArgs(f"container id {self.value} is ambiguous: {len(ids)} containers start with it")
            return sorted(k for k, p in on_gpu.items() if p.container_id in ids), []
        pid = int(self.value)
        st = procfs.stat(pid)
        if st is None:
            raise NoSuchProcess(f"no process with PID {pid}")
        if st.start_time != self.start_time:
            raise ProcessChanged(f"PID {pid} now belongs to another process than the one listed; list again")
        if self.kind == "pid":
            if (pid, st.start_time) not in on_gpu:
                raise NotAGpuProcess(f"PID {pid} is not using a GPU")
            return [(pid, st.start_time)], []
        if pid == 1 or st.is_kernel_thread:
            raise Protected(f"the tree of PID {pid} is the whole system: name a workload's own root")
        tree = remember_tree(procfs, [pid])
        chosen = sorted(k for k in tree if k in on_gpu)
        if not chosen:
            raise NotAGpuProcess(f"no process in the tree of PID {pid} is using a GPU")
        left = []
        for key in sorted(k for k in tree if k not in on_gpu):
            other = procfs.stat(key[0])
            if other is not None and other.start_time == key[1]:
                left.append((key[0], key[1], procfs.uid(key[0]) or 0, other.comm))
        return chosen, left
