"""Who a process belongs to beyond its uid: systemd unit, container, Kubernetes pod, Slurm job.

Read from the text of /proc/PID/cgroup, cgroup v2 ("0::/path") or v1 (one line per hierarchy). A label is
taken only from the tree whose owner makes it, never from a name: below a unit that delegates (user@UID.service,
a Delegate=yes service) a user creates cgroups of any name, so a `job_4242`, `pod<uuid>` or
`docker-<id>.scope` there is just a directory name. So:

- a Slurm job only from slurmstepd's hierarchy: cgroup v1 `/slurm/uid_N/job_N/…` at a hierarchy's root (with
  several slurmd on a host `/slurm_<node>/…`), cgroup v2 `/system.slice/[<node>_]slurmstepd.scope/job_N/…`;
- a pod only under kubepods (`/kubepods.slice/…` with the systemd cgroup driver, `/kubepods/…` with cgroupfs);
- a container only as a runtime scope in system.slice or machine.slice (`docker-<id>.scope`, `libpod-…`,
  `cri-containerd-…`, `crio-…`, through slices only), in a pod's slice under kubepods, or in the cgroupfs
  drivers' roots (`/docker/<id>`, `/libpod_parent/libpod-<id>`, `/kubepods/…/pod<uid>/<id>`);
- only root creates a directory at a hierarchy's root or in a system slice, so none of these can be made by a
  user; the first match from the root wins, so what a job's user may create below its own step names nothing.

The Slurm job also comes from the process's environment where the cgroup names none (Slurm with proctrack/
linuxproc or pgid makes no job cgroup, but every task inherits SLURM_JOB_ID), but only for a process in
slurmd's own unit (slurmd.service, slurmstepd.scope): a user can start a process with any environment in a
login session, a user unit, cron or at, and none of those is slurmd's. Such a job id is marked as from the
environment (Attribution.job_from_environ): /proc/PID/environ is readable only by its owner and root, so
gpukilld/access/visibility.py shows it to no one else.

Every label is bounded: ids by their grammar, unit names by systemd's (at most 255 characters of
[A-Za-z0-9:_.\\@-]); a component outside it names no unit.
"""

from __future__ import annotations

import re
from functools import lru_cache

from ..model import Attribution

_HEX64 = r"([0-9a-f]{64})"
_RUNTIME_SCOPE = rf"(?:docker|libpod|cri-containerd|crio|containerd)-{_HEX64}\.scope"
# kubepods-burstable-pod1b2c_..._.slice (systemd driver, "_" for "-") or /kubepods/burstable/pod<uid>/
_POD_UID = r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
_QOS = r"(?:burstable|besteffort)"
_POD_PATTERNS = (
    re.compile(rf"/kubepods\.slice/(?:kubepods-{_QOS}\.slice/)?kubepods-(?:{_QOS}-)?{_POD_UID}\.slice(?:/|$)"),
    re.compile(rf"/kubepods/(?:{_QOS}/)?{_POD_UID}(?:/|$)"),
)
# Each anchored at the hierarchy's root (match, not search).
_CONTAINER_PATTERNS = (
    # systemd cgroup driver: the runtime's scope in a system slice, or in a pod's slice
    re.compile(rf"/(?:system|machine)\.slice/(?:[^/]+\.slice/)*{_RUNTIME_SCOPE}(?:/|$)"),
    re.compile(rf"/kubepods\.slice/(?:[^/]+\.slice/)*{_RUNTIME_SCOPE}(?:/|$)"),
    # cgroupfs driver: /docker/<id>, /libpod_parent/libpod-<id>, /kubepods/[qos/]pod<uid>/<id>
    re.compile(rf"/docker/{_HEX64}(?:/|$)"),
    re.compile(rf"/libpod_parent/libpod-{_HEX64}(?:/|$)"),
    re.compile(rf"/kubepods/(?:{_QOS}/)?pod[0-9a-f-]{{36}}/{_HEX64}(?:/|$)"),
)
_JOB = r"job_([0-9]{1,10})"  # a job id as Slurm writes it: decimal, at most 32 bits
_SLURM_PATTERNS = (
    re.compile(rf"/slurm(?:_[^/]+)?/uid_[0-9]+/{_JOB}(?:/|$)"),  # cgroup/v1, in the controllers it uses
    re.compile(rf"/system\.slice/(?:[^/]+_)?slurmstepd\.scope/{_JOB}(?:/|$)"),  # cgroup/v2
)
# A job id as Slurm writes it in SLURM_JOB_ID. Anything else is not one.
_SLURM_JOB_ID = re.compile(rb"[0-9]{1,10}")
_SLURM_JOB_VAR = b"SLURM_JOB_ID="
# The units slurmd runs tasks in where it makes no job cgroup (proctrack/linuxproc, pgid): only there is the
# environment's job id Slurm's (a user cannot put a process in them).
_SLURM_UNITS = re.compile(r"slurmd(?:@[^/]+)?\.service|(?:[^/]+_)?slurmstepd\.scope")
# A systemd unit name (systemd's unit-name.h: at most 255 bytes, these characters), of a service or scope.
_UNIT_NAME = r"[A-Za-z0-9:_.\\@-]{1,247}\.(?:service|scope)"
_UNIT = re.compile(_UNIT_NAME)
# A unit of the system manager: /system.slice, slices only, then the unit. Below a unit, cgroups are made by
# whoever it delegates to (user@UID.service, a Delegate=yes service): a unit name there proves nothing.
_SYSTEM_UNIT = re.compile(rf"/system\.slice/(?:[^/]+\.slice/)*({_UNIT_NAME})(?:/|$)")


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


def _first(patterns: tuple[re.Pattern[str], ...], paths: list[str]) -> str | None:
    """The first group of the first pattern matching a path from its hierarchy's root."""
    for path in paths:
        for pattern in patterns:
            if m := pattern.match(path):
                return m.group(1)
    return None


# The same text comes back for every process of a unit, and for each again at every re-read of its facts
# (the sampler's rotation): the parse (a dozen anchored patterns) is kept for the last PARSED_KEPT texts seen,
# those of at most PARSED_TEXT_MAX characters (a v1 host's dozen hierarchies fit; a user's long made-up
# paths are parsed each time rather than held): at most 4 MiB.
PARSED_KEPT = 1024
PARSED_TEXT_MAX = 4096


def parse_cgroup(text: str) -> Attribution:
    return _parse_kept(text) if len(text) <= PARSED_TEXT_MAX else _parse(text)


@lru_cache(maxsize=PARSED_KEPT)
def _parse_kept(text: str) -> Attribution:
    return _parse(text)


def _parse(text: str) -> Attribution:
    path = _cgroup_path(text)
    paths = [path, *_all_paths(text)]  # v1 hosts spread containers and jobs over several hierarchies
    # the innermost unit: a user's own (user@UID.service/app.slice/x.service) is theirs to name, and says so
    unit = next((c for c in reversed(path.split("/")) if _UNIT.fullmatch(c)), None)
    pod_uid = _first(_POD_PATTERNS, paths)
    return Attribution(
        unit=unit,
        container_id=_first(_CONTAINER_PATTERNS, paths),
        pod_uid=pod_uid.replace("_", "-") if pod_uid else None,
        slurm_job=_first(_SLURM_PATTERNS, paths),
        system_unit=_system_unit(text),
    )


def trusts_environment(attribution: Attribution) -> bool:
    """Whether the process's SLURM_JOB_ID may name its job: it runs in slurmd's own unit, which no user can
    put a process in, and no job cgroup names one already."""
    return (
        attribution.slurm_job is None
        and attribution.system_unit is not None
        and _SLURM_UNITS.fullmatch(attribution.system_unit) is not None
    )


def slurm_job_from_environ(raw: bytes) -> str | None:
    """The job id in SLURM_JOB_ID of a process's environment (/proc/PID/environ: NUL-separated), None if absent
    or not a job id. The cgroup wins where it names a job: the process may rewrite its own environment, but
    only slurmd places it in a job's cgroup."""
    for item in raw.split(b"\0"):
        if item.startswith(_SLURM_JOB_VAR):
            value = item[len(_SLURM_JOB_VAR) :]
            return value.decode() if _SLURM_JOB_ID.fullmatch(value) else None
    return None
