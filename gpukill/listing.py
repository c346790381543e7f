"""The compact process listing (Manager.ListProcessesCompact): its one definition, shared by the daemon's
encoder and every client's decoder.

ListProcesses answers an a{sv} per record: each key and each variant's signature travel with every value, and
the client builds a Variant per value before it can read it. This form is one array of structs, a field per
column in the order of records.Process, with a bit mask per row saying which optional values are known, so
that "unknown" stays distinct from 0 or "" without variants (bench/README.md, list_latency, has the figures).
The reply is (format, rows): a client that meets a format it does not know says so in one line instead of
misreading the columns. Adding a column is a new FORMAT and a new signature, never a reinterpretation.

The decoder takes the reply's body as plain Python values (what dbus-fast, or any D-Bus library, gives for
structs, arrays and basic types), so it needs no bus library: the CLI imports this at start-up.
"""

from __future__ import annotations

from typing import Any

from gpukill.errors import GpukillError
from gpukill.records.manager import MemoryRegion, Process

METHOD = "ListProcessesCompact"
IN_SIGNATURE = "a{sv}"  # the filter of ListProcesses, same keys, same meaning
FORMAT = 1

# The columns of a row, after the mask, in the order of records.Process (tests/test_listing.py checks that).
COLUMNS = (
    "pid",
    "start_time",
    "uid",
    "user",
    "comm",
    "cmdline",
    "exe",
    "device",
    "device_id",
    "gpu_memory",
    "gpu_utilization",
    "unit",
    "container_id",
    "pod_uid",
    "slurm_job",
    "container_pid",
    "memory_regions",
    "shared_usage",
)
ROW_SIGNATURE = "(uutussssustdssssua(sytt)b)"  # the mask (u), then the columns
OUT_SIGNATURE = "ua" + ROW_SIGNATURE  # format, rows

# The row's mask: a bit set when the value is known. Where it is clear, the column holds 0 or "" (ignore it).
KNOWN_EXE = 1 << 0
KNOWN_GPU_MEMORY = 1 << 1
KNOWN_GPU_UTILIZATION = 1 << 2
KNOWN_UNIT = 1 << 3
KNOWN_CONTAINER_ID = 1 << 4
KNOWN_POD_UID = 1 << 5
KNOWN_SLURM_JOB = 1 << 6
KNOWN_CONTAINER_PID = 1 << 7
# A memory region's own mask: (name, mask, total, resident).
KNOWN_TOTAL = 1 << 0
KNOWN_RESIDENT = 1 << 1


class UnknownListingFormat(GpukillError):
    """The daemon answered in a listing format this client does not know (a newer gpukilld)."""


def _known(value: Any, bit: int) -> int:
    return 0 if value is None else bit


def encode_row(p: Process) -> tuple:
    """One process (the daemon's GpuProcess, or a Process) as a row of OUT_SIGNATURE's array."""
    mask = (
        _known(p.exe, KNOWN_EXE)
        | _known(p.gpu_memory, KNOWN_GPU_MEMORY)
        | _known(p.gpu_utilization, KNOWN_GPU_UTILIZATION)
        | _known(p.unit, KNOWN_UNIT)
        | _known(p.container_id, KNOWN_CONTAINER_ID)
        | _known(p.pod_uid, KNOWN_POD_UID)
        | _known(p.slurm_job, KNOWN_SLURM_JOB)
        | _known(p.container_pid, KNOWN_CONTAINER_PID)
    )
    regions = [
        (r.name, _known(r.total, KNOWN_TOTAL) | _known(r.resident, KNOWN_RESIDENT), r.total or 0, r.resident or 0)
        for r in p.memory_regions
    ]
    return (
        mask,
        p.pid,
        p.start_time,
        p.uid,
        p.user,
        p.comm,
        p.cmdline,
        p.exe or "",
        p.device,
        p.device_id,
        p.gpu_memory or 0,
        p.gpu_utilization or 0.0,
        p.unit or "",
        p.container_id or "",
        p.pod_uid or "",
        p.slurm_job or "",
        p.container_pid or 0,
        regions,
        bool(p.shared_usage),
    )


def reply_body(rows: list[tuple]) -> list:
    """The reply's body (OUT_SIGNATURE) for these rows."""
    return [FORMAT, rows]


def processes_from_reply(body: list | tuple) -> list[Process]:
    """The records of a reply (its body as plain values), in the reply's order; UnknownListingFormat when the
    daemon speaks a format this client does not know."""
    if len(body) != 2 or body[0] != FORMAT:
        got = body[0] if body and isinstance(body[0], int) else "?"
        raise UnknownListingFormat(
            f"gpukilld answered the compact listing in format {got}, this client reads "
            f"format {FORMAT}; upgrade gpukillctl"
        )
    out = []
    for (
        mask,
        pid,
        start_time,
        uid,
        user,
        comm,
        cmdline,
        exe,
        device,
        device_id,
        gpu_memory,
        gpu_utilization,
        unit,
        container_id,
        pod_uid,
        slurm_job,
        container_pid,
        regions,
        shared_usage,
    ) in body[1]:
        out.append(
            Process(
                pid=pid,
                start_time=start_time,
                uid=uid,
                user=user,
                comm=comm,
                cmdline=cmdline,
                exe=exe if mask & KNOWN_EXE else None,
                device=device,
                device_id=device_id,
                gpu_memory=gpu_memory if mask & KNOWN_GPU_MEMORY else None,
                gpu_utilization=gpu_utilization if mask & KNOWN_GPU_UTILIZATION else None,
                unit=unit if mask & KNOWN_UNIT else None,
                container_id=container_id if mask & KNOWN_CONTAINER_ID else None,
                pod_uid=pod_uid if mask & KNOWN_POD_UID else None,
                slurm_job=slurm_job if mask & KNOWN_SLURM_JOB else None,
                container_pid=container_pid if mask & KNOWN_CONTAINER_PID else None,
                memory_regions=tuple(
                    MemoryRegion(
                        name, total if known & KNOWN_TOTAL else None, resident if known & KNOWN_RESIDENT else None
                    )
                    for name, known, total, resident in regions
                )
                if regions
                else (),
                shared_usage=shared_usage,
            )
        )
    return out
