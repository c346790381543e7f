"""The rogue-activity audit: the rules as one table, how they score, and what a caller may see of a finding.

Each rule of RULES looks at one subject (a process, or a user over a window) and, when it matches, gives
evidence: its name, its points and what it saw. A subject's evidence of one kind (miner, abuser, idle) is one
finding, whose score is its evidence's points added up, at most 100. So a process whose only oddity is an
executable under /tmp scores 25, and a renamed miner (comm python3) with a stratum URL in its command line
and its executable under /tmp scores 75, with a connection to a pool port 100. Guard rules read a process's
highest score and that finding's kind (condition types rogue_score and rogue_kind).

What the rules read comes in as facts (ProcessFacts, UserFacts) built by gpukilld/rogue_watch.py in the
sampler thread from the snapshot, /proc (sockets) and the history of past snapshots; this module does no I/O.
Patterns are RE2 (gpukill.regex): they run on command lines a process chooses, which are bounded (4 KiB).

Privacy: each rule says which of the process's facts it reads (`reads`). A caller sees another user's finding
with only the evidence it could have derived from that process as ListProcesses shows it to them
(gpukilld/visibility.py): the name and the command line's first word where /proc shows them, never the
executable, the rest of the command line or the sockets (ptrace-gated); the GPU figures always. The score is
added up again from what is left, and a finding with no evidence left is not shown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpukill.records import FINDING_ABUSER, FINDING_IDLE, FINDING_MINER, MAX_SCORE, Evidence, Finding
from gpukill.regex import compile_regex
from gpukill.text import bounded
from gpukill.units import format_duration, format_size

from .config import AuditSettings
from .sockets import Peer
from .visibility import ANONYMOUS, FULL, HIDDEN, PROGRAM, Viewer, first_word

MAX_DETAIL = 256  # bytes of an evidence's text

# What a rule reads of its subject, for the privacy rule above.
COMM, ARGV0, CMDLINE, EXE, SOCKETS, GPU = "comm", "argv0", "cmdline", "exe", "sockets", "gpu"
# What a viewer who is not the owner may see of another user's process, by how it sees others.
_SEEN_BY = {FULL: {COMM, ARGV0, CMDLINE, EXE, SOCKETS, GPU}, PROGRAM: {COMM, ARGV0, GPU}, ANONYMOUS: {GPU},
            HIDDEN: set()}


@dataclass(frozen=True, slots=True)
class ProcessFacts:
    """What the process rules read of one process (its devices summed)."""

    pid: int
    start_time: int
    uid: int
    user: str
    comm: str
    cmdline: str
    exe: str | None
    home: str | None  # the owner's home directory
    devices: tuple[int, ...]
    gpu_memory: int | None
    pool_peers: tuple[Peer, ...] = ()  # its TCP connections to a pool port
    idle_for: float | None = None  # seconds it has held memory at 0% utilization; None: it has not


@dataclass(frozen=True, slots=True)
class UserFacts:
    """What the user rules read of one user with processes on a GPU now, over the window."""

    uid: int
    user: str
    devices: tuple[int, ...]
    gpu_memory: int | None  # now
    users: int  # users with GPU usage in the window, this one included
    memory_share: float | None  # percent of all GPU memory-seconds in the window; None: not enough history
    time_share: float | None  # percent of all GPU utilization-seconds in the window


Facts = ProcessFacts | UserFacts


@dataclass(frozen=True, slots=True)
class RogueRule:
    name: str
    kind: str  # the finding it adds to: FINDING_MINER, FINDING_ABUSER or FINDING_IDLE
    points: int
    reads: str  # COMM, ARGV0, CMDLINE, EXE, SOCKETS or GPU
    doc: str  # one line, as README's table says it
    test: Callable[[Facts, AuditSettings], str | None]  # what it saw, or None when it does not match


# -- patterns -------------------------------------------------------------------------------------------------

MINER_NAMES = ("xmrig", "xmr-stak", "ethminer", "cpuminer", "minerd", "t-rex", "lolminer", "nbminer", "gminer",
               "ccminer", "phoenixminer", "nanominer", "teamredminer", "srbminer", "bminer", "cgminer",
               "bfgminer", "kawpowminer", "wildrig", "nheqminer", "excavator", "miniz", "rigel", "bzminer",
               "onezerominer", "ethdcrminer64", "z-enemy", "xmrig-cuda", "srbminer-multi")
# A known name, alone or with a version or variant after a separator (xmrig-6.21.0, cpuminer-opt, t-rex.exe).
_MINER_NAME = compile_regex(r"(?i)^(?:" + "|".join(n.replace(".", r"\.") for n in MINER_NAMES)
                            + r")(?:[-_.][A-Za-z0-9._-]*)?$")
_STRATUM = compile_regex(r"(?i)stratum2?\+(?:tcp|ssl|tls)://[^\s\"']+")
POOL_DOMAINS = ("nanopool.org", "2miners.com", "f2pool.com", "ethermine.org", "supportxmr.com", "minexmr.com",
                "hashvault.pro", "herominers.com", "unmineable.com", "nicehash.com", "moneroocean.stream",
                "c3pool.com", "flexpool.io", "hiveon.net", "viabtc.com", "antpool.com", "poolin.com",
                "slushpool.com", "braiins.com", "xmrpool.eu", "kryptex.network", "woolypooly.com",
                "zergpool.com", "mining-dutch.nl", "prohashing.com", "miningpoolhub.com", "zpool.ca")
_POOL_HOST = compile_regex(r"(?i)(?:^|[^A-Za-z0-9.-])((?:[a-z0-9-]+\.)*(?:"
                           + "|".join(d.replace(".", r"\.") for d in POOL_DOMAINS) + r"))(?:$|[^A-Za-z0-9.-])")
# Wallet-shaped words: Monero (95 base58 characters from 4 or 8), Ethereum-style (0x and 40 hex digits),
# Bitcoin bech32 (bc1...). Whole words only: a hash inside a longer token is not one.
_WALLET = compile_regex(r"(?:^|[\s=:/,.])([48][0-9AB][1-9A-HJ-NP-Za-km-z]{93}|0x[0-9a-fA-F]{40}"
                        r"|bc1[ac-hj-np-z02-9]{25,87})(?:$|[\s,.])")
_TMP_DIRS = ("/tmp/", "/var/tmp/", "/dev/shm/")
_DELETED = " (deleted)"


def _cut(text: str) -> str:
    return bounded(text, MAX_DETAIL, "…")


def _exe_path(facts: ProcessFacts) -> str:
    return (facts.exe or "").removesuffix(_DELETED)


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _miner_name(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    return f"process name {facts.comm!r} is a known miner's" if _MINER_NAME.search(facts.comm) else None


def _miner_program(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    program = _basename(first_word(facts.cmdline))
    return f"program {_cut(program)!r} is a known miner's" if program and _MINER_NAME.search(program) else None


def _miner_exe(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    name = _basename(_exe_path(facts))
    return f"executable {_cut(name)!r} is a known miner's" if name and _MINER_NAME.search(name) else None


def _stratum_url(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    m = _STRATUM.search(facts.cmdline)
    return f"stratum URL in the command line: {_cut(m.group(0))}" if m else None


def _pool_host(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    m = _POOL_HOST.search(facts.cmdline)
    return f"mining pool host in the command line: {_cut(m.group(1))}" if m else None


def _wallet(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    m = _WALLET.search(facts.cmdline)
    if not m:
        return None
    word = m.group(1)
    return f"wallet-shaped argument {word[:6]}…{word[-4:]}"


def _exe_deleted(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    exe = facts.exe or ""
    return f"executable deleted: {_cut(exe)}" if exe.endswith(_DELETED) else None


def _exe_tmp(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    path = _exe_path(facts)
    return f"executable in a temporary directory: {_cut(path)}" if path.startswith(_TMP_DIRS) else None


def _exe_hidden(facts: Facts, _: AuditSettings) -> str | None:
    """Under a home directory (the owner's, /root, or /home/NAME), in a folder whose name starts with a dot."""
    assert isinstance(facts, ProcessFacts)
    path = _exe_path(facts)
    homes = {h.rstrip("/") for h in (facts.home, "/root") if h and h != "/"}
    if path.startswith("/home/"):
        homes.add("/".join(path.split("/", 3)[:3]))
    for home in homes:
        if path.startswith(home + "/"):
            folders = path[len(home) + 1:].split("/")[:-1]
            if any(f.startswith(".") and f not in (".", "..") for f in folders):
                return f"executable in a hidden folder of a home directory: {_cut(path)}"
    return None


def _pool_port(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    if not facts.pool_peers:
        return None
    return _cut("connected to a mining pool port: " + ", ".join(str(p) for p in facts.pool_peers[:4]))


def _idle(facts: Facts, settings: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    if facts.idle_for is None or facts.idle_for < settings.idle_after:
        return None
    return (f"held {format_size(facts.gpu_memory or 0)} of GPU memory at 0% utilization for over "
            f"{format_duration(settings.idle_after)}")


def _hog(facts: Facts, settings: AuditSettings, share: float | None, had: str, what: str) -> str | None:
    """A user's share of the GPU `what` all users used, when it is abuser_share or more with others present."""
    assert isinstance(facts, UserFacts)
    if facts.users < 2 or share is None or share < settings.abuser_share:
        return None
    return (f"{had} {share:.0f}% of the GPU {what} used by {facts.users} users over the last "
            f"{format_duration(settings.abuser_window)}")


def _memory_hog(facts: Facts, settings: AuditSettings) -> str | None:
    return _hog(facts, settings, getattr(facts, "memory_share", None), "held", "memory")


def _time_hog(facts: Facts, settings: AuditSettings) -> str | None:
    return _hog(facts, settings, getattr(facts, "time_share", None), "used", "time")


RULES: tuple[RogueRule, ...] = (
    RogueRule("miner-name", FINDING_MINER, 60, COMM, "the process name is a known miner's (xmrig, t-rex, ...)",
              _miner_name),
    RogueRule("miner-program", FINDING_MINER, 60, ARGV0, "the command line's program is a known miner's",
              _miner_program),
    RogueRule("miner-exe", FINDING_MINER, 60, EXE, "the executable's file name is a known miner's", _miner_exe),
    RogueRule("stratum-url", FINDING_MINER, 50, CMDLINE,
              "a stratum+tcp://, stratum+ssl:// or stratum2+tcp:// URL in the command line", _stratum_url),
    RogueRule("pool-host", FINDING_MINER, 40, CMDLINE, "a known mining pool's host name in the command line",
              _pool_host),
    RogueRule("wallet", FINDING_MINER, 30, CMDLINE,
              "a wallet-shaped argument (Monero, 0x and 40 hex digits, bc1...)", _wallet),
    RogueRule("exe-deleted", FINDING_MINER, 20, EXE, "the executable was deleted after it started", _exe_deleted),
    RogueRule("exe-tmp", FINDING_MINER, 25, EXE, "the executable lives under /tmp, /var/tmp or /dev/shm", _exe_tmp),
    RogueRule("exe-hidden", FINDING_MINER, 20, EXE,
              "the executable lives in a hidden folder of a home directory (~/.cache/x)", _exe_hidden),
    RogueRule("pool-port", FINDING_MINER, 30, SOCKETS,
              "a TCP connection to a mining pool port (from /proc/PID/net/tcp*, by socket inode)", _pool_port),
    RogueRule("idle-memory", FINDING_IDLE, 50, GPU,
              "GPU memory (at least idle_min_memory) held at 0% utilization for idle_after", _idle),
    RogueRule("memory-hog", FINDING_ABUSER, 50, GPU,
              "a user held abuser_share of the GPU memory in use over abuser_window, with other users", _memory_hog),
    RogueRule("time-hog", FINDING_ABUSER, 50, GPU,
              "a user had abuser_share of the GPU time used over abuser_window, with other users", _time_hog),
)
RULE_BY_NAME = {r.name: r for r in RULES}
_PROCESS_RULES = tuple(r for r in RULES if r.kind != FINDING_ABUSER)
_USER_RULES = tuple(r for r in RULES if r.kind == FINDING_ABUSER)


def score_of(evidence: Iterable[Evidence]) -> int:
    return min(MAX_SCORE, sum(e.points for e in evidence))


def _findings(facts: Facts, rules: tuple[RogueRule, ...], settings: AuditSettings) -> list[Finding]:
    by_kind: dict[str, list[Evidence]] = {}
    for rule in rules:
        detail = rule.test(facts, settings)
        if detail is not None:
            by_kind.setdefault(rule.kind, []).append(Evidence(rule.name, rule.points, _cut(detail)))
    is_process = isinstance(facts, ProcessFacts)
    return [Finding(kind=kind, score=score_of(evidence), uid=facts.uid, user=facts.user,
                    pid=facts.pid if isinstance(facts, ProcessFacts) else None,
                    start_time=facts.start_time if isinstance(facts, ProcessFacts) else None,
                    comm=facts.comm if is_process else "", devices=facts.devices, gpu_memory=facts.gpu_memory,
                    evidence=tuple(evidence))
            for kind, evidence in by_kind.items()]


def process_findings(facts: ProcessFacts, settings: AuditSettings) -> list[Finding]:
    """One process's findings. They depend on nothing but its facts and the settings, and on idle_for only
    through whether it reached settings.idle_after: rogue_watch.py keeps them while those stay the same."""
    return _findings(facts, _PROCESS_RULES, settings)


def ranked(processes: Iterable[Finding], users: Iterable[UserFacts], settings: AuditSettings) -> tuple[Finding, ...]:
    """The processes' findings and the users', highest score first (then by kind, user, process)."""
    found = list(processes)
    for u in users:
        found.extend(_findings(u, _USER_RULES, settings))
    return tuple(sorted(found, key=lambda f: (-f.score, f.kind, f.uid, f.pid or 0)))


def evaluate(processes: Iterable[ProcessFacts], users: Iterable[UserFacts],
             settings: AuditSettings) -> tuple[Finding, ...]:
    """Every finding, highest score first (then by kind, user, process)."""
    return ranked((f for p in processes for f in process_findings(p, settings)), users, settings)


def as_seen_by(finding: Finding, viewer: Viewer) -> Finding | None:
    """The finding as the viewer may see it (see the module's docstring); None when nothing of it is left."""
    if viewer.others == FULL or finding.uid == viewer.uid:
        return finding
    allowed = _SEEN_BY[viewer.others]
    evidence = tuple(e for e in finding.evidence if e.rule in RULE_BY_NAME and RULE_BY_NAME[e.rule].reads in allowed)
    if not evidence:
        return None
    return dataclasses.replace(finding, evidence=evidence, score=score_of(evidence),
                               comm=finding.comm if COMM in allowed else "")


def findings_as_seen(findings: Iterable[Finding], viewer: Viewer) -> list[Finding]:
    """The findings the viewer may see, highest score first."""
    seen = [s for f in findings if (s := as_seen_by(f, viewer)) is not None]
    return sorted(seen, key=lambda f: (-f.score, f.kind, f.uid, f.pid or 0))


def process_scores(findings: Iterable[Finding]) -> dict[tuple[int, int], tuple[int, str]]:
    """(pid, start time) -> (the highest score of the process's findings, that finding's kind): what the Guard
    condition types rogue_score and rogue_kind read."""
    best: dict[tuple[int, int], tuple[int, str]] = {}
    for f in findings:
        if f.pid is None or f.start_time is None:
            continue
        key = (f.pid, f.start_time)
        if key not in best or f.score > best[key][0]:
            best[key] = (f.score, f.kind)
    return best
