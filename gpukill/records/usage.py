"""The records of GPU usage accounting: one process's use of one GPU, and what GetUsage answers.

The daemon integrates every sample into a UsageRecord per (process, GPU) (gpukilld/usage/account.py); when the
process leaves that GPU or ends, the record is written to the journal (MESSAGE_ID in systemd/gpukill.catalog)
and to the store beside it (/var/lib/gpukill/usage.sqlite). GetUsage sums records, and the partial totals of the
processes still running, into UsageRows grouped by user, unit, Slurm job, pod, GPU or process.

A total nobody could measure is None, never 0: a backend without per-process utilization gives no SM seconds,
a device without a power sensor no energy. The *_known_seconds beside such a total say over how much of
gpu_seconds it was measured, so "12 SM seconds out of 3600 known" and "unknown" stay different answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .base import wire

# GetUsage's groupings (its query's "by"): the record field each groups on.
USAGE_BY = {"user": "uid", "unit": "unit", "job": "slurm_job", "pod": "pod_uid", "gpu": "device_id", "process": "pid"}
# Its names as a Literal, for the REST and MCP schemas' enums; built at run time: to mypy, a str
if TYPE_CHECKING:
    UsageBy = str
else:
    UsageBy = Literal[tuple(USAGE_BY)]

# How a record ended (UsageRecord.ended).
ENDED_LIVE = ""  # still on the GPU: partial totals
ENDED_EXITED = "exited"  # the process is gone
ENDED_LEFT = "left"  # the process runs on but no longer holds this GPU
ENDED_DAEMON_DOWN = "daemon-down"  # it ended while gpukilld was not running: totals up to gpukilld's last save


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageRecord:
    """One process's use of one GPU, from the first sample that saw it there to the last (or the latest sample,
    while it runs). A folded record (processes > 1, pid 0) sums several short processes of one user on one GPU
    that came faster than the journal's share for usage entries (gpukilld/usage/keeper.py)."""

    pid: int = wire("u", "process id (0 for a folded record)")
    start_time: int = wire("t", "field 22 of /proc/PID/stat, clock ticks since boot (0 for a folded record)")
    uid: int = wire("u", "the owner's uid")
    user: str = wire("s", "the owner's name")
    comm: str = wire("s", "the process name", "")
    unit: str | None = wire("s", "innermost systemd .service or .scope", None)
    slurm_job: str | None = wire("s", "Slurm job id", None)
    pod_uid: str | None = wire("s", "Kubernetes pod UID", None)
    container_id: str | None = wire("s", "docker, podman, containerd, cri-o", None)
    device: int = wire("u", "the device's global index")
    device_id: str = wire("s", "the device's id (UUID)")
    first_seen: float = wire("d", "seconds since the epoch: the first sample that saw it on the GPU")
    last_seen: float = wire("d", "seconds since the epoch: the last sample that saw it there")
    gpu_seconds: float = wire("d", "seconds on the GPU (between the samples that saw it there)", 0.0)
    sm_seconds: float | None = wire(
        "d",
        "utilization-weighted GPU seconds: its utilization (0 to 1) times the "
        "seconds, over sm_known_seconds; unknown where the backend never said",
        None,
    )
    sm_known_seconds: float = wire("d", "the part of gpu_seconds over which its utilization was known", 0.0)
    memory_byte_seconds: float = wire("d", "its GPU memory integrated over time (bytes times seconds)", 0.0)
    peak_memory: int = wire("t", "the most GPU memory a sample saw it hold, bytes", 0)
    energy_joules: float | None = wire(
        "d",
        "its share of the device's energy (power times seconds, shared by "
        "utilization, else by memory), over energy_known_seconds; unknown "
        "where the device reports no power",
        None,
    )
    energy_known_seconds: float = wire("d", "the part of gpu_seconds over which the device's power was known", 0.0)
    processes: int = wire("u", "processes summed in this record: 1, or more for a folded record", 1)
    ended: str = wire(
        "s", '"" while it runs, "exited", "left" (it runs on, off this GPU) or "daemon-down"', "", omit_empty=True
    )
    # The Slurm job came from SLURM_JOB_ID (owner and root only): shown to others as /proc would, not at all.
    job_from_environ: bool = wire(
        "b", "slurm_job was read from the process's environment (present when true)", False, omit_empty=True
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageRow:
    """GetUsage's totals of one group (a user, unit, job, pod, GPU or process) over the query's range.

    A record that lies partly in the range counts in proportion to the part of its life in the range (its use
    is taken as even over its life); peak_memory is the largest peak of the records counted."""

    key: str = wire(
        "s",
        "what the rows are grouped by: a user name, unit, job id, pod UID, GPU index or "
        '"PID:START"; "" for records without one (no unit, not in a job)',
        "",
    )
    hidden: bool = wire(
        "b",
        "the records' key is not the caller's to see (other users' units, say): grouped together (present when true)",
        False,
        omit_empty=True,
    )
    uid: int | None = wire("u", "the user (by user and by process)", None)
    user: str | None = wire("s", "the user's name (by user and by process)", None)
    device: int | None = wire("u", "the device's global index (by gpu)", None)
    device_id: str | None = wire("s", "the device's id (by gpu)", None)
    pid: int | None = wire("u", "process id (by process)", None)
    start_time: int | None = wire("t", "the process's start time (by process)", None)
    comm: str | None = wire("s", "the process name as the caller may see it (by process)", None)
    processes: int = wire("u", "distinct processes counted", 0)
    live: int = wire("u", "of which still on a GPU (their partial totals are counted)", 0)
    gpu_seconds: float = wire("d", "seconds on a GPU; a process on two GPUs counts on each", 0.0)
    sm_seconds: float | None = wire(
        "d", "utilization-weighted GPU seconds over sm_known_seconds; unknown where no record knew it", None
    )
    sm_known_seconds: float = wire("d", "the part of gpu_seconds with a known utilization", 0.0)
    memory_byte_seconds: float = wire("d", "GPU memory integrated over time, bytes times seconds", 0.0)
    peak_memory: int = wire("t", "the largest peak of the records counted, bytes", 0)
    energy_joules: float | None = wire(
        "d", "energy share over energy_known_seconds; unknown where no device reported power", None
    )
    energy_known_seconds: float = wire("d", "the part of gpu_seconds with a known device power", 0.0)
    first_seen: float = wire("d", "seconds since the epoch: the earliest record's first sample (in the range)", 0.0)
    last_seen: float = wire("d", "seconds since the epoch: the latest record's last sample (in the range)", 0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageReport:
    """GetUsage's reply: the rows, largest gpu_seconds first, and the range they cover."""

    since: float = wire("d", "seconds since the epoch: the range's start")
    until: float = wire("d", "seconds since the epoch: the range's end")
    by: str = wire("s", "user, unit, job, pod, gpu or process")
    rows: tuple[UsageRow, ...] = wire(
        "aa{sv}", "the groups, largest gpu_seconds first, at most the query's limit", (), of=UsageRow
    )
    rows_total: int = wire("u", "groups before the limit was applied", 0)
    # The store is rebuilt from the journal when it is missing (a new disk, a deleted file): until that ends,
    # older records may be missing from the answer, and the reply says so.
    rebuilding: bool = wire(
        "b",
        "the store is being rebuilt from the journal: older records may be missing (present when true)",
        False,
        omit_empty=True,
    )
