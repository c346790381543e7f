"""The records of the rogue-activity audit (AuditRogue)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import wire

FINDING_MINER = "miner"  # a crypto miner: its name, command line, executable or connections
FINDING_ABUSER = "abuser"  # a user holding far more GPU memory or time than the others over a window
FINDING_IDLE = "idle"  # GPU memory held at 0% utilization longer than a threshold (a forgotten notebook)
FINDING_KINDS = (FINDING_MINER, FINDING_ABUSER, FINDING_IDLE)
MAX_SCORE = 100


@dataclass(frozen=True, slots=True)
class Evidence:
    """One rule of the audit's table that matched a finding's subject (the table: gpukilld/rogue.py)."""

    rule: str = wire("s", "the rule's name in the table (miner-name, stratum-url, exe-tmp, ...)")
    points: int = wire("u", "what it adds to the finding's score")
    detail: str = wire("s", "what was seen, at most 256 characters (a process chose part of it: escape it)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """What AuditRogue reports for one process (miner, idle) or one user (abuser), as the caller may see it."""

    kind: str = wire("s", '"miner", "abuser" or "idle"')
    score: int = wire("u", "its evidence's points added up, at most 100")
    uid: int = wire("u", "the user concerned")
    user: str = wire("s", "the user's name")
    pid: int | None = wire("u", "the process; left out for a user's finding (abuser)", None)
    start_time: int | None = wire("t", "the process's start time, clock ticks since boot (for KillProcess)", None)
    comm: str = wire("s", "the process name as the caller may see it", "", omit_empty=True)
    devices: tuple[int, ...] = wire("au", "the global indexes of the devices concerned", ())
    gpu_memory: int | None = wire("t", "bytes of GPU memory the process (or user) holds now", None)
    evidence: tuple[Evidence, ...] = wire("aa{sv}", "why: the rules that matched, each with its points", (),
                                          of=Evidence)
