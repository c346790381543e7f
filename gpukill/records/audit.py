"""The records of the rogue-activity audit (AuditRogue)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import wire

FINDING_MINER = "miner"  # a crypto miner: its name, command line, executable or connections
FINDING_ABUSER = "abuser"  # a user holding far more GPU memory or time than the others over a window
FINDING_IDLE = "idle"  # GPU memory held at 0% utilization longer than a threshold (a forgotten notebook)
MAX_SCORE = 100


@dataclass(frozen=True, slots=True)
class Evidence:
    """One rule of the audit's table that matched a finding's subject (the table: gpukilld/rogue/score.py)."""

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
    evidence: tuple[Evidence, ...] = wire(
        "aa{sv}", "why: the rules that matched, each with its points", (), of=Evidence
    )


# Ports of mining pools' stratum endpoints (each pool publishes its own; these are the common ones). Not here:
# 8888 (Jupyter's default: a notebook's clients connect to it) and 45560, 45700 (ethermine's and 2miners' SSL
# ports, but inside Linux's default ephemeral range 32768-60999, where every busy server's clients have their
# source ports): a pool port must be one that only a connection to a pool goes to.
DEFAULT_POOL_PORTS = (3333, 3334, 3357, 4444, 5555, 6666, 7777, 9999, 14433, 14444)
# The settings that are durations: seconds on the bus, gpukill.units' duration grammar as text ("30min").
AUDIT_DURATIONS = ("idle_after", "abuser_window")


@dataclass(frozen=True, slots=True)
class AuditSettings:
    """The rogue-activity audit's settings: gpukilld.conf's [audit] section, then gpukilld.conf.d/50-audit.conf
    (what SetAuditSettings and ImportAuditSettings write). The daemon's rules read this same record."""

    idle_after: float = wire(
        "d", "seconds of GPU memory held at 0% utilization before a process is an idle holder", 1800.0
    )
    idle_min_memory: int = wire("t", "bytes: less GPU memory than this held idle is not reported", 256 << 20)
    abuser_window: float = wire("d", "seconds of history over which users' shares are compared", 3600.0)
    abuser_share: float = wire("d", "percent of all GPU memory (or time) in the window that makes an abuser", 80.0)
    pool_ports: tuple[int, ...] = wire(
        "aq", "TCP ports of mining pools (outside the ephemeral range)", DEFAULT_POOL_PORTS
    )
    min_score: float = wire(
        "d", "AuditRogue reports findings of at least this score (0-100; Guard's rogue_score is not affected)", 0.0
    )
    allowed_users: tuple[str, ...] = wire(
        "as", "user names never reported (Guard's rogue_score reads 0 for their processes)", ()
    )
    allowed_processes: tuple[str, ...] = wire(
        "as",
        "absolute paths of executables whose processes are never "
        "reported, when the process runs that very file, owned by "
        "root and writable by no one else",
        (),
    )
