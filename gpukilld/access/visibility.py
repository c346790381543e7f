"""What a caller sees of other users' processes.

gpukilld reads /proc as root, so it could hand any user what /proc hides from them. It never does:

- root, and callers polkit grants org.gpukill.view-all-processes, see every process in full;
- everyone sees their own processes in full;
- of other users' processes, a caller sees what /proc would show them, and less where /proc is generous with
  secrets: the executable (/proc/PID/exe is ptrace-gated) never, the command line only up to its first word
  (arguments carry tokens and passwords; /proc shows them to everyone by default, we do not repeat that),
  and a Slurm job id only where a job cgroup names it (one read from SLURM_JOB_ID comes from
  /proc/PID/environ, which only the owner and root may read);
- where /proc is mounted with hidepid=noaccess (1), other users' processes are listed without anything /proc
  keeps for their owner (name, command line, unit, container), and with hidepid=invisible (2) or ptraceable (4)
  they are not listed at all; members of the mount's gid= group are exempt, as /proc makes them.

GPU facts (device, memory, utilization) are the daemon's own and go with every process a caller may see.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..model import GpuProcess

HIDEPID_OFF, HIDEPID_NOACCESS, HIDEPID_INVISIBLE = 0, 1, 2
_HIDEPID = {
    "0": HIDEPID_OFF,
    "off": HIDEPID_OFF,
    "1": HIDEPID_NOACCESS,
    "noaccess": HIDEPID_NOACCESS,
    "2": HIDEPID_INVISIBLE,
    "invisible": HIDEPID_INVISIBLE,
    "4": HIDEPID_INVISIBLE,
    "ptraceable": HIDEPID_INVISIBLE,
}

# How a viewer sees other users' processes.
FULL = "full"  # everything (root, view-all)
PROGRAM = "program"  # no executable; the command line cut to its first word
ANONYMOUS = "anonymous"  # no name, command line, executable, unit or container (hidepid=noaccess)
HIDDEN = "hidden"  # not listed (hidepid=invisible)


@dataclass(frozen=True, slots=True)
class ProcRules:
    """The host's /proc access rules (proc(5): hidepid= and gid= mount options)."""

    hidepid: int = HIDEPID_OFF
    gid: int | None = None  # members of this group are not subject to hidepid


def parse_mountinfo(text: str, mount_point: str) -> ProcRules:
    """The rules of the proc mount at mount_point in /proc/self/mountinfo text (the last one mounted wins).
    An option the kernel does not know is read as the strictest meaning: hiding too much is the safe error."""
    rules = ProcRules()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 10 or fields[4] != mount_point or "-" not in fields:
            continue
        sep = fields.index("-")
        if fields[sep + 1] != "proc":
            continue
        options = fields[5].split(",") + (fields[sep + 3].split(",") if len(fields) > sep + 3 else [])
        hidepid, gid = HIDEPID_OFF, None
        for option in options:
            key, _, value = option.partition("=")
            if key == "hidepid":
                hidepid = _HIDEPID.get(value, HIDEPID_INVISIBLE)
            elif key == "gid" and value.isdigit():
                gid = int(value)
        rules = ProcRules(hidepid, gid)
    return rules


def read_proc_rules(proc_root: str = "/proc") -> ProcRules:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            return parse_mountinfo(f.read(), proc_root.rstrip("/") or "/")
    except OSError:
        return ProcRules(HIDEPID_INVISIBLE)  # cannot tell: assume the strictest


@dataclass(frozen=True, slots=True)
class Viewer:
    """A caller as far as listings go: whose processes it sees in full, and how it sees the others."""

    uid: int
    others: str  # FULL, PROGRAM, ANONYMOUS or HIDDEN

    @property
    def key(self) -> tuple[int, str]:
        """Viewers with equal keys get equal listings (FULL viewers all share one)."""
        return (-1, FULL) if self.others == FULL else (self.uid, self.others)


def viewer_for(uid: int, gids: tuple[int, ...], sees_all: bool, rules: ProcRules) -> Viewer:
    if sees_all or uid == 0:
        return Viewer(uid, FULL)
    if rules.hidepid == HIDEPID_OFF or (rules.gid is not None and rules.gid in gids):
        return Viewer(uid, PROGRAM)
    return Viewer(uid, ANONYMOUS if rules.hidepid == HIDEPID_NOACCESS else HIDDEN)


def first_word(cmdline: str) -> str:
    return cmdline.split(" ", 1)[0]


def as_seen_by(p: GpuProcess, viewer: Viewer) -> GpuProcess | None:
    """The process as the viewer may see it; None when it may not see it at all."""
    if viewer.others == FULL or p.uid == viewer.uid:
        return p
    return seen_as(p, viewer.others)


def seen_as(p: GpuProcess, others: str) -> GpuProcess | None:
    """Another user's process in one of the reduced forms."""
    if others == FULL:
        return p
    if others == PROGRAM:
        # a job id read from SLURM_JOB_ID goes where /proc/PID/environ goes: to the owner and root only
        return dataclasses.replace(
            p, cmdline=first_word(p.cmdline), exe=None, slurm_job=None if p.job_from_environ else p.slurm_job
        )
    if others == ANONYMOUS:
        # the system unit stays: systemd tells anyone a PID's unit (GetUnitByPID), and Guard's protection uses it
        return dataclasses.replace(
            p,
            comm="",
            cmdline="",
            exe=None,
            container_pid=None,
            unit=None,
            container_id=None,
            pod_uid=None,
            slurm_job=None,
        )
    return None
