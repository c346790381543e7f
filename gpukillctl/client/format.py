"""Human output: tables of devices and processes. Unknown values print as "–" (gpukill.text.UNKNOWN), never as 0.

Every text that comes from the daemon is escaped before it reaches the terminal (`shown`): a process picks its
own name and command line, and a name with an escape sequence must not repaint the admin's screen. JSON output
keeps the exact text.
"""

from __future__ import annotations

from gpukill.records.manager import STATE_OK, Device, Process
from gpukill.text import UNKNOWN, shown


def size(n: int | None) -> str:
    if n is None:
        return UNKNOWN
    value: float = n
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)


def percent(v: float | None) -> str:
    return UNKNOWN if v is None else f"{v:.0f}%"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns as wide as their widest cell, every cell escaped."""
    rows = [[shown(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def devices_table(devices: list[Device]) -> str:
    rows = []
    for d in devices:
        memory = f"{size(d.memory_used)} / {size(d.memory_total)}"
        temp = UNKNOWN if d.temperature is None else f"{d.temperature:.0f}°C"
        power = UNKNOWN if d.power is None else f"{d.power:.0f} W"
        state = d.state + (f" ({d.state_reason})" if d.state != STATE_OK and d.state_reason else "")
        rows.append([str(d.index), d.name, d.vendor, percent(d.utilization), memory, temp, power, state])
    return table(["GPU", "NAME", "VENDOR", "UTIL", "MEMORY", "TEMP", "POWER", "STATE"], rows)


def _owner(p: Process) -> str:
    if p.pod_uid:
        return f"pod:{p.pod_uid[:8]}"
    if p.container_id:
        return f"container:{p.container_id[:12]}"
    if p.slurm_job:
        return f"slurm:{p.slurm_job}"
    return p.unit or UNKNOWN


def processes_table(procs: list[Process]) -> str:
    if not procs:
        return "No GPU processes."
    rows = [
        [
            str(p.device),
            str(p.pid),
            p.user,
            p.comm or UNKNOWN,
            size(p.gpu_memory),
            percent(p.gpu_utilization),
            _owner(p),
        ]
        for p in procs
    ]
    return table(["GPU", "PID", "USER", "COMMAND", "GPU MEMORY", "UTIL", "UNIT/CONTAINER"], rows)


def user_name(uid: int) -> str:
    """A uid's user name here, or the number where this host has no such user (a suspended process's record
    carries its uid alone)."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def suspended_table(records: list) -> str:
    """The processes gpukilld holds suspended (gpukill.records.suspend.SuspendedProcess): state "suspended", or
    "stuck" with its remedy; HOST MEMORY is the GPU memory set aside in host memory."""
    import time

    rows = [
        [
            ",".join(map(str, r.devices)) or UNKNOWN,
            str(r.pid),
            user_name(r.uid),
            r.comm or UNKNOWN,
            r.state,
            size(r.memory),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(r.suspended_at)) if r.suspended_at else UNKNOWN,
            r.remedy or r.workload,
        ]
        for r in records
    ]
    return table(["GPU", "PID", "USER", "COMMAND", "STATE", "HOST MEMORY", "SINCE", "WORKLOAD / REMEDY"], rows)
