"""A kill's GPU answer (gpukill/records/reclaim.py's Reclaim) in words: the daemon's journal MESSAGE, the CLI's
line and the MCP tool's text say it the same way. Process names are escaped: they are the process's choice."""

from __future__ import annotations

from typing import Any

from .text import shown
from .units import format_size

HOLDERS_SHOWN = 4  # in one line of text; the record and the journal's fields name up to MAX_HOLDERS


def holder_text(h: Any) -> str:
    parent = f", parent {h.parent}" if h.relation == "orphan" and h.parent else ""
    return f"PID {h.pid} ({shown(h.comm)}, {h.relation}{parent}) on GPU {h.device} ({format_size(h.memory)})"


def reclaim_text(r: Any) -> str:
    """One clause: 'GPU memory reclaimed (2.0 GiB)', 'exited, but GPU memory is still held by ...', ..."""
    if r.verdict == "reclaimed":
        # a backend that reads no per-process memory (0): nothing related is on the devices, no size to say
        return f"GPU memory reclaimed ({format_size(r.reclaimed)})" if r.reclaimed else "GPU memory reclaimed"
    if r.verdict == "held":
        named = list(r.holders[:HOLDERS_SHOWN])
        rest = len(r.holders) - len(named) + r.more
        more = f" and {rest} more" if rest else ""
        return (f"exited, but GPU memory is still held ({format_size(r.held)}) by "
                f"{', '.join(holder_text(h) for h in named)}{more}; {r.remedy}")
    if r.verdict == "stuck":
        return f"still alive after SIGKILL: {r.reason}; {r.remedy}"
    if r.verdict == "alive":
        return "GPU memory not reclaimed: it still runs"
    return "GPU memory not watched"
