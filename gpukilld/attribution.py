"""Who a process belongs to beyond its uid: systemd unit, container, Kubernetes pod, Slurm job.

Read from the text of /proc/PID/cgroup, cgroup v2 ("0::/path") or v1 (one line per hierarchy); the Slurm job
also from the process's environment where the cgroup names none (Slurm with proctrack/linuxproc or pgid makes no
job cgroup, but every task inherits SLURM_JOB_ID).
"""

from __future__ import annotations

import re

from .model import Attribution

_CONTAINER_PATTERNS = (
    # systemd cgroup driver: docker-<id>.scope, libpod-<id>.scope, cri-containerd-<id>.scope, crio-<id>.scope
    re.compile(r"(?:docker|libpod|cri-containerd|crio|containerd)-([0-9a-f]{64})\.scope"),
    # cgroupfs driver: /docker/<id>, /libpod_parent/libpod-<id>, /kubepods/.../<id>
    re.compile(r"/(?:docker|libpod-|containerd/)?([0-9a-f]{64})(?:/|$)"),
)
# kubepods-burstable-pod1b2c_..._.slice (systemd driver, "_" for "-") or /kubepods/burstable/pod<uid>/
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_SLURM_JOB = re.compile(r"/job_(\d+)(?:/|$)")
# A job id as Slurm writes it: decimal, at most 32 bits. Anything else in SLURM_JOB_ID is not one.
_SLURM_JOB_ID = re.compile(rb"[0-9]{1,10}")
_SLURM_JOB_VAR = b"SLURM_JOB_ID="
_UNIT = re.compile(r"[^/]+\.(?:service|scope)$")
# A unit of the system manager: /system.slice, slices only, then the unit. Below a unit, cgroups are made by
# whoever it delegates to (user@UID.service, a Delegate=yes service): a unit name there proves nothing.
_SYSTEM_UNIT = re.compile(r"/system\.slice/(?:[^/]+\.slice/)*([^/]+\.(?:service|scope))(?:/|$)")


def _cgroup_path(text: str) -> str:
    """The path that says most: the v2 unified one, else v1's name=systemd, else the first."""
    v1_systemd = first = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            return path
        if controllers == "name=systemd":
            v1_systemd = path
        first = first or path
    return v1_systemd or first or ""


def _all_paths(text: str) -> list[str]:
    return [parts[2] for line in text.splitlines() if len(parts := line.split(":", 2)) == 3]


def _system_unit(text: str) -> str | None:
    """The system unit holding the process, from systemd's own hierarchy only (v2, or v1 name=systemd): no
    other v1 hierarchy is laid out by systemd, so no other can tell."""
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (hier == "0" and controllers == "") or controllers == "name=systemd":
            m = _SYSTEM_UNIT.match(path)
            return m.group(1) if m else None
    return None


def parse_cgroup(text: str) -> Attribution:
    path = _cgroup_path(text)
    paths = [path, *_all_paths(text)]  # v1 hosts spread containers and jobs over several hierarchies

    unit = None
    for component in reversed(path.split("/")):
        if _UNIT.fullmatch(component):
            unit = component
            break

    container_id = None
    for candidate in paths:
        for pattern in _CONTAINER_PATTERNS:
            if m := pattern.search(candidate):
                container_id = m.group(1)
                break
        if container_id:
            break

    pod_uid = next((m.group(1).replace("_", "-") for p in paths if (m := _POD.search(p))), None)
    slurm_job = next((m.group(1) for p in paths if (m := _SLURM_JOB.search(p))), None)
    return Attribution(unit=unit, container_id=container_id, pod_uid=pod_uid, slurm_job=slurm_job,
                       system_unit=_system_unit(text))


def slurm_job_from_environ(raw: bytes) -> str | None:
    """The job id in SLURM_JOB_ID of a process's environment (/proc/PID/environ: NUL-separated), None if absent
    or not a job id. The cgroup wins where it names a job: the process may rewrite its own environment, but
    only slurmd places it in a job's cgroup."""
    for item in raw.split(b"\0"):
        if item.startswith(_SLURM_JOB_VAR):
            value = item[len(_SLURM_JOB_VAR):]
            return value.decode() if _SLURM_JOB_ID.fullmatch(value) else None
    return None
