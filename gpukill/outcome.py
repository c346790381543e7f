"""How a kill ended and who asked for it, in the words of the bus and the journal, with the text people read.

An Outcome's value is what KillProcess returns, what ProcessKilled and GuardActionTaken carry, what
GPUKILL_RESULT holds and what the guard's recent events keep; its `text` is how messages, notices and the
CLI say it. A kill the kill path refused is no Outcome: its result is the GpukillError's `result`
("protected", "no-such-process", ...), and result_text() words both.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    TERMINATED = "terminated"  # exited within the grace after SIGTERM
    KILLED = "killed"  # needed SIGKILL
    STILL_ALIVE = "still-alive"  # outlived the grace and no force was asked (or survived SIGKILL: D state)
    WOULD_KILL = "would-kill"  # a dry run's kill: nothing was signalled
    CANCELLED = "cancelled"  # the guard's subject came back under within the grace: nothing was signalled
    RESET = "reset"  # a Guard reset rule's device was reset (a refusal is the reset path's result instead)
    WOULD_RESET = "would-reset"  # a dry run's reset: nothing was done
    OVER_CAP = "over-cap"  # a Guard kill whose kill_scope takes more processes than max_kills_per_cycle: none
    REQUEUED = "requeued"  # a Guard requeue rule's Slurm job was requeued (scontrol requeue)
    JOB_CANCELLED = "job-cancelled"  # a Guard cancel rule's Slurm job was cancelled (scancel)
    WOULD_REQUEUE = "would-requeue"  # a dry run's requeue: Slurm was not asked
    WOULD_CANCEL = "would-cancel"  # a dry run's cancel: Slurm was not asked
    NOT_A_JOB = "not-a-slurm-job"  # a requeue or cancel rule's process belongs to no Slurm job: left running
    SUSPENDED = "suspended"  # a Guard suspend rule's process was suspended (its GPU memory set aside in host memory)
    WOULD_SUSPEND = "would-suspend"  # a dry run's suspend: nothing was touched

    @property
    def text(self) -> str:
        """The phrase a message puts after the process (or, for CANCELLED, the subject) it is about."""
        return _TEXT[self]

    @property
    def signalled(self) -> bool:
        """A signal was sent: the kill path went through, whatever became of the process."""
        return self in SIGNALLED


_TEXT = {
    Outcome.TERMINATED: "terminated",
    Outcome.KILLED: "killed with SIGKILL",
    Outcome.STILL_ALIVE: "still alive after SIGTERM",
    Outcome.WOULD_KILL: "would stop",
    Outcome.CANCELLED: "came back under within the grace period",
    Outcome.RESET: "reset",
    Outcome.WOULD_RESET: "would be reset",
    Outcome.OVER_CAP: "not stopped: its kill_scope takes more processes than max_kills_per_cycle",
    Outcome.REQUEUED: "requeued",
    Outcome.JOB_CANCELLED: "cancelled",
    Outcome.WOULD_REQUEUE: "would requeue",
    Outcome.WOULD_CANCEL: "would cancel",
    Outcome.NOT_A_JOB: "left running: not a Slurm job's process",
    Outcome.SUSPENDED: "suspended",
    Outcome.WOULD_SUSPEND: "would suspend",
}
SIGNALLED = frozenset({Outcome.TERMINATED, Outcome.KILLED, Outcome.STILL_ALIVE})


def result_text(result: str, error: str = "", action: str = "kill") -> str:
    """A kill (or suspend) path's result as a message words it: an outcome's text, else why nothing was stopped
    (suspended: action "suspend") with the error's message where there is one, its result otherwise."""
    text = _TEXT.get(result)  # type: ignore[call-overload]  # a str finds the Outcome it equals
    if text is not None:
        return text
    return f"not {'suspended' if action == 'suspend' else 'stopped'}: {error or result}"


def resume_hint(pid: int) -> str:
    """What the owner of a process Guard (or an admin) suspended reads: how to have it back."""
    return f"suspended; resume with: gpukillctl resume {pid}"


# Who asked for a kill: ProcessKilled's `initiator` on the bus and GPUKILL_INITIATOR in the journal, the same
# word in both. Who the user is stays beside it (caller_uid, GPUKILL_CALLER_UID).
INITIATOR_USER = "user"  # a KillProcess call
INITIATOR_RESET = "reset"  # ResetDevice with force, clearing the device first


def guard_initiator(rule: str) -> str:
    """A Guard rule's kill."""
    return f"guard:{rule}"


# -- the GPU's answer to a kill (gpukill/records/reclaim.py's Reclaim) in words: the daemon's journal MESSAGE, the
# CLI's line, monitor's and the MCP tool's text say it the same way. Process names are escaped: their choice.

HOLDERS_SHOWN = 4  # in one line of text; the record and the journal's fields name up to MAX_HOLDERS


def holder_text(h: Any) -> str:
    from .text import shown
    from .units import format_size

    parent = f", parent {h.parent}" if h.relation == "orphan" and h.parent else ""
    return f"PID {h.pid} ({shown(h.comm)}, {h.relation}{parent}) on GPU {h.device} ({format_size(h.memory)})"


def reclaim_text(r: Any) -> str:
    """One clause: 'GPU memory reclaimed (2.0 GiB) 1.3s after SIGTERM', 'exited, but GPU memory is still held by
    ...', ...; every verdict but "reclaimed" says the memory is not back."""
    from .text import shown
    from .units import format_duration, format_size  # here: the outcomes above are imported by every kill's client

    # the remedy names a unit or container and the reason a cgroup: names a user can choose, escaped as a
    # process name is
    if r.verdict == "reclaimed":
        # a backend that reads no per-process memory (0): nothing related is on the devices, no size to say
        size = f" ({format_size(r.reclaimed)})" if r.reclaimed else ""
        # an older gpukilld says no seconds
        after = (
            f" {format_duration(r.seconds)} after {shown(r.first_signal or 'SIGTERM')}" if r.seconds is not None else ""
        )
        return f"GPU memory reclaimed{size}{after}"
    if r.verdict == "held":
        named = list(r.holders[:HOLDERS_SHOWN])
        rest = len(r.holders) - len(named) + r.more
        more = f" and {rest} more" if rest else ""
        return (
            f"exited, but GPU memory is still held ({format_size(r.held)}) by "
            f"{', '.join(holder_text(h) for h in named)}{more}; {shown(r.remedy)}"
        )
    if r.verdict == "stuck":
        return f"still alive after SIGKILL: {shown(r.reason)}; its GPU memory is not back until {shown(r.remedy)}"
    if r.verdict == "alive":
        return "GPU memory not reclaimed: it still runs"
    return "GPU memory not watched"
