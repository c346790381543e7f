"""What a kill got back: whether the GPU memory of what was killed came back, and if not, who holds it.

A kill is done when the memory is back, not when the signal is sent: after the target exits the daemon watches
the devices it used for a few samples (gpukilld/acts/reclaim.py) and says one of the verdicts below. The same
record is in the reply of KillProcessReport and KillWorkload, in ProcessKilled's last argument and, field by
field, in the kill's journal entry (GPUKILL_RECLAIM, GPUKILL_RECLAIMED_BYTES, GPUKILL_HELD_BYTES,
GPUKILL_HOLDERS, GPUKILL_STUCK_REASON, GPUKILL_RECLAIM_SECONDS).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import wire

RECLAIMED = "reclaimed"  # the target exited and nothing related to it holds memory on its devices
HELD = "held"  # the target exited, but related processes (its orphans, its unit's...) still hold memory there
STUCK = "stuck"  # still alive after SIGKILL: `reason` says where it waits, `remedy` what frees the GPU
ALIVE = "alive"  # still alive after SIGTERM, no force asked: nothing was watched
UNWATCHED = "unwatched"  # not watched: a reset clearing its device (the reset itself frees it)

# How a holder is related to what was killed (Holder.relation).
DESCENDANT = "descendant"  # in the target's tree when it was signalled, its parent still in that tree
ORPHAN = "orphan"  # was in the tree; its parent died and it was reparented (to init or a subreaper)
SAME_UNIT = "unit"
SAME_CONTAINER = "container"
SAME_POD = "pod"
SAME_JOB = "job"

# What one Guard kill takes with it (a kill rule's kill_scope): the process alone, its tree (descendants on a
# GPU), or its systemd unit's GPU processes; the subject's owner's alone either way.
KILL_PROCESS = "process"
KILL_TREE = "tree"
KILL_UNIT = SAME_UNIT
KILL_SCOPES = (KILL_PROCESS, KILL_TREE, KILL_UNIT)

MAX_HOLDERS = 16  # holders named in one record; `more` counts the rest (a reply stays small whatever runs)


@dataclass(frozen=True, slots=True)
class Holder:
    """A process that still holds GPU memory on a device the target used, related to the target."""

    pid: int = wire("u", "the process")
    start_time: int = wire("t", "its start time, clock ticks since boot: pass it to KillProcess")
    uid: int = wire("u", "its owner")
    comm: str = wire("s", "its name (the process chose it: escape before showing)")
    device: int = wire("u", "the device's global index")
    memory: int = wire("t", "bytes it holds there (0 where the backend cannot say)")
    relation: str = wire("s", '"descendant", "orphan", "unit", "container", "pod" or "job"')
    parent: int = wire("u", "its parent now (1 or a subreaper for an orphan)", 0)


@dataclass(frozen=True, slots=True)
class Reclaim:
    """The GPU's answer to a kill (or to a batch of kills: KillWorkload watches them together)."""

    verdict: str = wire("s", '"reclaimed", "held", "stuck", "alive" or "unwatched"')
    reclaimed: int = wire("t", "bytes freed on the devices watched, as the samples before and after say", 0)
    held: int = wire("t", "bytes the holders still hold", 0)
    devices: tuple[int, ...] = wire("au", "the devices watched (global indexes)", ())
    holders: tuple[Holder, ...] = wire(
        "aa{sv}", f"at most {MAX_HOLDERS}, largest first", (), omit_empty=True, of=Holder
    )
    more: int = wire("u", "holders not listed", 0, omit_empty=True)
    samples: int = wire("u", "samples watched after the exit", 0)
    seconds: float | None = wire(
        "d",
        'for "reclaimed": seconds from the first signal (first_signal) to the sample that showed the memory back; '
        "the daemon's own samples, so up to one sample interval late",
        None,
    )
    first_signal: str = wire(
        "s", 'what seconds counts from: "SIGTERM", or a checkpoint signal sent before it', "", omit_empty=True
    )
    reason: str = wire("s", 'for "stuck": the state and wait channel read from /proc', "", omit_empty=True)
    remedy: str = wire(
        "s", 'for "stuck" and "held": what frees the GPU (gpukillctl reset N, kill --tree ...)', "", omit_empty=True
    )


# What a kill's checkpoint step did (CheckpointStep.result).
SAVED = "saved"  # the checkpoint signal was sent and every process it went to exited within the wait
STILL_RUNNING = "still-running"  # sent, but some were still running after the wait: SIGTERM followed
UNDECLARED = "undeclared"  # no process of the kill declared a checkpoint signal: none was sent
MALFORMED = "malformed"  # a declaration could not be followed (the error says why): no signal was sent to it
LED = "led"  # the target inherits its declaration from a declaring GPU process, its parent: that one is asked
CHECKPOINTS_OFF = "off"  # the policy's max_checkpoint_wait is 0: no checkpoint signal is sent


@dataclass(frozen=True, slots=True)
class CheckpointStep:
    """What a kill asked with the option checkpoint did before SIGTERM (gpukill/checkpoint.py)."""

    result: str = wire("s", '"saved", "still-running", "undeclared", "malformed", "led" or "off"')
    text: str = wire("s", 'in words: "SIGUSR1 sent to PID 12; it exited after saving (3.1 s)"')
    signal: str = wire("s", 'the signal sent ("SIGUSR1"); "" when none was', "", omit_empty=True)
    pids: tuple[int, ...] = wire("au", "the processes it was sent to", (), omit_empty=True)
    wait: float = wire("d", "seconds the exit was awaited at most: the declared wait, capped by the policy", 0.0)
    waited: float = wire("d", "seconds waited", 0.0)
    source: str = wire("s", '"environment", "slurm" or "policy FILE:LINE:COL"', "", omit_empty=True)
    error: str = wire("s", 'for "malformed": why the declaration cannot be followed', "", omit_empty=True)


@dataclass(frozen=True, slots=True)
class WorkloadEntry:
    """One process of a KillWorkload: what became of it, or why it was not signalled."""

    pid: int = wire("u", "the process")
    start_time: int = wire("t", "its start time")
    uid: int = wire("u", "its owner")
    comm: str = wire("s", "its name (the process chose it: escape before showing)")
    result: str = wire(
        "s",
        'an outcome ("terminated", "killed", "still-alive") or the refusal ("access-denied", '
        '"protected", "process-changed", "no-such-process", "not-a-gpu-process")',
    )
    error: str = wire("s", "why it was refused", "", omit_empty=True)
    on_gpu: bool = wire("b", "it used a GPU when selected", True)


@dataclass(frozen=True, slots=True)
class WorkloadReply:
    """What KillWorkload returns: each selected process, then the GPU's answer for them all."""

    selection: str = wire("s", 'what was selected: "tree of PID N", "unit NAME", "container ID" or "Slurm job N"')
    entries: tuple[WorkloadEntry, ...] = wire("aa{sv}", "each process selected, by PID", (), of=WorkloadEntry)
    reclaim: Reclaim = wire("a{sv}", "the GPU's answer for the batch", Reclaim(UNWATCHED), of=Reclaim)
    hidden: int = wire(
        "u",
        "other users' processes selected that /proc hides from the caller (hidepid=invisible), not listed in entries",
        0,
        omit_empty=True,
    )
    checkpoint: CheckpointStep | None = wire(
        "a{sv}", "with the option checkpoint: what its step did before SIGTERM", None, of=CheckpointStep
    )


@dataclass(frozen=True, slots=True)
class KillReport:
    """What KillProcessReport returns: KillProcess's outcome and the GPU's answer."""

    outcome: str = wire("s", '"terminated", "killed" or "still-alive" (gpukill.outcome)')
    reclaim: Reclaim = wire("a{sv}", "whether the memory came back, and who holds it", Reclaim(UNWATCHED), of=Reclaim)
    checkpoint: CheckpointStep | None = wire(
        "a{sv}", "with the option checkpoint: what its step did before SIGTERM", None, of=CheckpointStep
    )
