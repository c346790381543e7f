"""The suspended workloads gpukilld holds, kept in its state directory so that a restart neither loses them nor
resumes them by itself.

Each workload is kept whole (its processes' records, how it was frozen, its units and jobs for a later
selection), written as one JSON file after every change (gpukilld/files.py replace_file: whole or not at all).
At start-up a recorded process that no longer exists (its PID gone, or another process's: the start time
differs) is dropped, and the journal says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field

from gpukill.records.base import from_plain, to_plain
from gpukill.records.suspend import SUSPENDED, SuspendedProcess

from .. import journal
from ..files import read_kept, replace_file
from ..proc.procfs import ProcFS
from .freezer import Frozen

log = logging.getLogger(__name__)

FILE = "suspended.json"
MAX_FILE = 16 << 20
Key = tuple[int, int]


@dataclass(slots=True)
class Workload:
    """One suspended workload: its GPU processes' records and how it is frozen."""

    selection: str
    processes: list[SuspendedProcess]
    frozen: Frozen
    units: tuple[str, ...] = ()
    jobs: tuple[str, ...] = ()
    busy: bool = field(default=False, compare=False)  # an act (resume, a kill) runs on it: one at a time

    def key_set(self) -> set[Key]:
        return {(p.pid, p.start_time) for p in self.processes}

    def pids(self) -> set[int]:
        """Its GPU processes and the other members frozen with it."""
        return {p.pid for p in self.processes} | {pid for pid, _ in self.frozen.members}

    @property
    def memory(self) -> int:
        return sum(p.memory for p in self.processes if p.state == SUSPENDED)

    def plain(self) -> dict:
        return {
            "selection": self.selection,
            "processes": [to_plain(p) for p in self.processes],
            "frozen": {"kind": self.frozen.kind, "control": self.frozen.control, "members": self.frozen.members},
            "units": list(self.units),
            "jobs": list(self.jobs),
        }

    @classmethod
    def from_json(cls, value: dict) -> Workload:
        frozen = value["frozen"]
        return cls(
            str(value["selection"]),
            [from_plain(SuspendedProcess, p) for p in value["processes"]],
            Frozen(str(frozen["kind"]), str(frozen["control"]), tuple((int(a), int(b)) for a, b in frozen["members"])),
            tuple(str(u) for u in value.get("units", ())),
            tuple(str(j) for j in value.get("jobs", ())),
        )


class SuspendedWorkloads:
    """The workloads suspended now, by their processes, and the file that keeps them."""

    def __init__(self, state_dir: str, auditor: journal.Audit, procfs: ProcFS) -> None:
        self.path = os.path.join(state_dir, FILE)
        self.audit = auditor
        self.procfs = procfs
        self.workloads: list[Workload] = []

    def load(self) -> None:
        """The kept workloads, each process checked to be the one recorded; those gone are dropped and said."""
        value, why = read_kept(self.path, MAX_FILE)
        if why is not None:
            log.error("%s", why)
            self.audit.log(journal.SUSPEND_FAILED, f"Suspended workloads not restored: {why}", result="unreadable")
        loaded = []
        for raw in (value or {}).get("workloads", []):
            try:
                loaded.append(Workload.from_json(raw))
            except (KeyError, TypeError, ValueError) as e:
                log.error("%s: a workload's record is malformed (%s); dropped", self.path, e)
        self.workloads = loaded
        if self.drop_gone() == 0 and loaded:
            log.info("%d suspended workload(s) kept from before the restart", len(loaded))

    def drop_gone(self) -> int:
        """Forget the recorded processes that no longer exist (pid and start time), each with a journal entry,
        and the workloads left empty; saves when something was dropped. How many were dropped."""
        dropped = 0
        for workload in list(self.workloads):
            alive = []
            for p in workload.processes:
                if self.procfs.start_time(p.pid) == p.start_time:
                    alive.append(p)
                    continue
                dropped += 1
                self.audit.log(
                    journal.SUSPEND,
                    f"Suspended PID {p.pid} ({p.comm}) of {workload.selection} no longer exists; its record dropped",
                    action="gone",
                    result="gone",
                    target_pid=p.pid,
                    target_start_time=p.start_time,
                    target_uid=p.uid,
                    target_comm=p.comm,
                    selection=workload.selection,
                )
            workload.processes = alive
            if not alive:
                self.workloads.remove(workload)
        if dropped:
            self.save()
        return dropped

    def save(self) -> None:
        data = json.dumps({"version": 1, "workloads": [w.plain() for w in self.workloads]})
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
            replace_file(self.path, data)
        except OSError as e:  # what is suspended stays so; a restart would not know it, and the journal says it
            log.error("cannot write %s: %s", self.path, e)
            self.audit.log(
                journal.WRITE_FAILED,
                f"Could not write {self.path} (suspended workloads): {e}",
                file=self.path,
                what="suspended workloads",
                error=str(e),
            )

    def add(self, workload: Workload) -> None:
        self.workloads.append(workload)
        self.save()

    def remove(self, workload: Workload) -> None:
        if workload in self.workloads:
            self.workloads.remove(workload)
        self.save()

    def replace(self, workload: Workload, processes: list[SuspendedProcess]) -> None:
        """Its records now (a resume or a kill changed them); an empty workload is forgotten."""
        workload.processes = processes
        if not processes:
            self.remove(workload)
        else:
            self.save()

    def holding(self, pid: int, start_time: int) -> tuple[Workload, SuspendedProcess] | None:
        """The workload and record of a suspended (or stuck) GPU process."""
        for workload in self.workloads:
            for p in workload.processes:
                if (p.pid, p.start_time) == (pid, start_time):
                    return workload, p
        return None

    def of_pid(self, pid: int) -> Workload | None:
        """The workload a PID belongs to (one of its GPU processes or a member frozen with it)."""
        return next((w for w in self.workloads if pid in w.pids()), None)

    def records(self) -> list[SuspendedProcess]:
        return sorted((p for w in self.workloads for p in w.processes), key=lambda p: p.pid)

    def held_memory(self) -> int:
        return sum(w.memory for w in self.workloads)

    def selected(self, kind: str, value: str) -> list[Workload]:
        """The workloads a resume's selection names: a PID or tree root of one, or a unit's or job's."""
        if kind in ("pid", "tree"):
            found = self.of_pid(int(value))
            return [found] if found else []
        if kind == "unit":
            return [w for w in self.workloads if value in w.units]
        if kind == "job":
            return [w for w in self.workloads if value in w.jobs]
        return []

    @staticmethod
    def with_state(p: SuspendedProcess, state: str, error: str = "", remedy: str = "") -> SuspendedProcess:
        return dataclasses.replace(p, state=state, error=error, remedy=remedy)
