"""The rogue-activity audit: the rules as one table, how they score, and what a caller may see of a finding.

Each rule of RULES looks at one subject (a process, or a user over a window) and, when it matches, gives
evidence: its name, what it adds to the score and what it saw. A subject's evidence of one kind (miner, abuser,
idle) is one finding, whose score is its evidence's points added up, at most 100.

Rules come in families (FAMILIES): the rules of a family read one fact told several ways (the name a process
gives itself is its comm, its argv[0] and its executable's file name), or facts an ordinary workload can show
(where its executable lives, which ports it talks to). A family adds at most its cap, whatever matched in it:
each rule adds its points until its family's cap is reached, in the table's order. No process family's cap
reaches 70, the example kill threshold of docs/audit.md, and the weak families (executable location, sockets,
allow-list)
together stay below it too: a kill at 70 needs a strong family (the name, the command line) and one more. So a process
whose only oddity is an executable under /tmp scores 25, a program named xmrig (name, argv[0] and executable
all say so) 60, the same with a connection to a pool port 90, and a renamed miner (comm python3) with a
stratum URL in its command line and its executable under /tmp 75, with a connection to a pool port 100.
Guard rules read a process's highest score and that finding's kind (condition types rogue_score and
rogue_kind).

What the rules read comes in as facts (ProcessFacts, UserFacts) built by gpukilld/rogue/watch.py in the
sampler thread from the snapshot, /proc (sockets) and the history of past snapshots; this module does no I/O.
Patterns are RE2 (gpukill.regex): they run on command lines a process chooses, which are bounded (4 KiB).

Privacy: each rule says which of the process's facts it reads (`reads`). A caller sees another user's finding
with only the evidence it could have derived from that process as ListProcesses shows it to them
(gpukilld/access/visibility.py): the name and the command line's first word where /proc shows them, never the
executable, the rest of the command line or the sockets (ptrace-gated); the GPU figures always. The score is
added up again from what is left, and a finding with no evidence left is not shown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpukill.records.audit import FINDING_ABUSER, FINDING_IDLE, FINDING_MINER, MAX_SCORE, Evidence, Finding
from gpukill.regex import compile_regex
from gpukill.text import bounded
from gpukill.units import format_duration, format_size

from ..access.visibility import ANONYMOUS, FULL, HIDDEN, PROGRAM, Viewer, first_word
from ..config import AuditSettings
from .sockets import Peer

MAX_DETAIL = 256  # bytes of an evidence's text

# What a rule reads of its subject, for the privacy rule above.
COMM, ARGV0, CMDLINE, EXE, SOCKETS, GPU = "comm", "argv0", "cmdline", "exe", "sockets", "gpu"
# What a viewer who is not the owner may see of another user's process, by how it sees others.
_SEEN_BY = {
    FULL: {COMM, ARGV0, CMDLINE, EXE, SOCKETS, GPU},
    PROGRAM: {COMM, ARGV0, GPU},
    ANONYMOUS: {GPU},
    HIDDEN: set(),
}


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
    pool_peers: tuple[Peer, ...] = ()  # the TCP connections it made to a pool port (sockets.py)
    # Its executable is deleted (exe ends in " (deleted)") and a new file stands at that path in the process's
    # mount namespace (an upgrade, apt, conda or uv, replaced it while it ran): True; nothing there: False; None:
    # not known (a filesystem that is not looked up in). Filled in by watch.py (gpukilld/rogue/exe_replaced.py).
    exe_replaced: bool | None = False
    idle_for: float | None = None  # seconds it has held memory at 0% utilization; None: it has not
    # It runs an executable of allowed_processes but other code too (a preloaded user library, a tracer): why.
    # Filled in by watch.py (gpukilld/rogue/trusted_exe.py's foreign_code); such a process is scored as any.
    untrusted_allowed: str | None = None


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
class Family:
    """Rules that read one fact, or one kind of weak evidence: together they add at most `cap` to a score."""

    name: str
    cap: int
    weak: bool  # evidence an ordinary workload can show; the weak families together stay below a kill


# A process's finding (miner, idle) is what Guard's rogue_score reads: no such family reaches 70 on its own.
NAME_FAMILY = Family("name", 60, weak=False)  # what the process calls itself: the subject chooses it, nobody else
CMDLINE_FAMILY = Family("command-line", 60, weak=False)  # its own arguments: a pool, a wallet
EXE_FAMILY = Family("exe-location", 25, weak=True)  # where its executable lives: installers put them oddly too
SOCKET_FAMILY = Family("sockets", 30, weak=True)  # which ports it talks to: servers and clients use those numbers too
IDLE_FAMILY = Family("idle", 50, weak=False)  # GPU figures the daemon measures itself
TRUST_FAMILY = Family("allow-list", 10, weak=True)  # an allowed program made to run a user's code
# A user's finding (abuser) is not a process's and never reaches rogue_score: its two rules add up to 100.
SHARE_FAMILY = Family("share", 100, weak=False)
FAMILIES = (NAME_FAMILY, CMDLINE_FAMILY, EXE_FAMILY, SOCKET_FAMILY, TRUST_FAMILY, IDLE_FAMILY, SHARE_FAMILY)


@dataclass(frozen=True, slots=True)
class RogueRule:
    name: str
    kind: str  # the finding it adds to: FINDING_MINER, FINDING_ABUSER or FINDING_IDLE
    points: int  # what it adds on its own (its family's cap bounds what it adds with the others)
    family: Family
    reads: str  # COMM, ARGV0, CMDLINE, EXE, SOCKETS or GPU
    doc: str  # one line, as docs/audit.md's table says it
    risk: str  # when an ordinary workload matches it, as docs/audit.md's table says it
    test: Callable[[Facts, AuditSettings], str | None]  # what it saw, or None when it does not match


# -- patterns -------------------------------------------------------------------------------------------------

MINER_NAMES = (
    "xmrig",
    "xmr-stak",
    "ethminer",
    "cpuminer",
    "minerd",
    "t-rex",
    "lolminer",
    "nbminer",
    "gminer",
    "ccminer",
    "phoenixminer",
    "nanominer",
    "teamredminer",
    "srbminer",
    "bminer",
    "cgminer",
    "bfgminer",
    "kawpowminer",
    "wildrig",
    "nheqminer",
    "excavator",
    "miniz",
    "rigel",
    "bzminer",
    "onezerominer",
    "ethdcrminer64",
    "z-enemy",
    "xmrig-cuda",
    "srbminer-multi",
)
# A known name, alone or with a version or variant after a separator (xmrig-6.21.0, cpuminer-opt, t-rex.exe).
_MINER_NAME = compile_regex(
    r"(?i)^(?:" + "|".join(n.replace(".", r"\.") for n in MINER_NAMES) + r")(?:[-_.][A-Za-z0-9._-]*)?$"
)
_STRATUM = compile_regex(r"(?i)stratum2?\+(?:tcp|ssl|tls)://[^\s\"']+")
POOL_DOMAINS = (
    "nanopool.org",
    "2miners.com",
    "f2pool.com",
    "ethermine.org",
    "supportxmr.com",
    "minexmr.com",
    "hashvault.pro",
    "herominers.com",
    "unmineable.com",
    "nicehash.com",
    "moneroocean.stream",
    "c3pool.com",
    "flexpool.io",
    "hiveon.net",
    "viabtc.com",
    "antpool.com",
    "poolin.com",
    "slushpool.com",
    "braiins.com",
    "xmrpool.eu",
    "kryptex.network",
    "woolypooly.com",
    "zergpool.com",
    "mining-dutch.nl",
    "prohashing.com",
    "miningpoolhub.com",
    "zpool.ca",
)
_POOL_HOST = compile_regex(
    r"(?i)(?:^|[^A-Za-z0-9.-])((?:[a-z0-9-]+\.)*(?:"
    + "|".join(d.replace(".", r"\.") for d in POOL_DOMAINS)
    + r"))(?:$|[^A-Za-z0-9.-])"
)
# Wallet-shaped words: Monero (95 base58 characters from 4 or 8), Ethereum-style (0x and 40 hex digits),
# Bitcoin bech32 (bc1...). Whole words only: a hash inside a longer token is not one.
_WALLET = compile_regex(
    r"(?:^|[\s=:/,.])([48][0-9AB][1-9A-HJ-NP-Za-km-z]{93}|0x[0-9a-fA-F]{40}"
    r"|bc1[ac-hj-np-z02-9]{25,87})(?:$|[\s,.])"
)
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
    """Deleted, and known to have nothing at its path now: an upgrade that replaced the file (a new one at the
    path) is not, nor is one on a filesystem that was not looked up in."""
    assert isinstance(facts, ProcessFacts)
    exe = facts.exe or ""
    return f"executable deleted: {_cut(exe)}" if exe.endswith(_DELETED) and facts.exe_replaced is False else None


def _exe_tmp(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    path = _exe_path(facts)
    return f"executable in a temporary directory: {_cut(path)}" if path.startswith(_TMP_DIRS) else None


# Hidden folders of a home directory where installers put interpreters and toolchains, as path components
# from the home directory ("*": any one folder). A GPU job runs from these every day, so they are not "hidden":
# uv's Pythons and tools, pyenv's versions, conda's and mamba's environments, pipx's and pipenv's venvs, pip's
# --user scripts and packages (nvidia-*, triton ship binaries there), cargo/rustup, nvm, mise/asdf, juliaup and
# Julia's artifacts, SDKMAN, pixi, the VS Code server. ~/miniconda3, ~/anaconda3 and ~/miniforge3 are not hidden
# to begin with. A hidden folder below one of these (~/.local/bin/.x/) is hidden again.
_INSTALLED = tuple(
    tuple(p.split("/"))
    for p in (
        ".local/bin",
        ".local/lib",
        ".local/share/uv",
        ".local/share/pipx",
        ".local/pipx",
        ".local/share/mamba",
        ".local/share/virtualenvs",
        ".local/share/hatch",
        ".local/share/pdm",
        ".local/share/mise",
        ".pyenv/versions",
        ".conda/envs",
        ".mamba/envs",
        ".micromamba/envs",
        ".pixi/envs",
        ".cargo/bin",
        ".rustup/toolchains",
        ".nvm/versions",
        ".asdf/installs",
        ".julia/juliaup",
        ".julia/artifacts",
        ".juliaup/bin",
        ".sdkman/candidates",
        ".vscode-server/bin",
        ".vscode-server/cli",
    )
)
# The same for a project's own environment, at any depth below the home directory: ~/proj/.venv/bin/python.
_PROJECT_ENVS = tuple(tuple(p.split("/")) for p in (".venv/bin", ".pixi/envs", ".tox/*/bin", ".nox/*/bin"))


def _starts_with(folders: list[str], at: int, pattern: tuple[str, ...]) -> bool:
    return len(folders) - at >= len(pattern) and all(
        want in ("*", got) for want, got in zip(pattern, folders[at : at + len(pattern)], strict=False)
    )


def _hidden_folder(folders: list[str]) -> str | None:
    """The first folder (below a home directory) whose name starts with a dot and that no installer put there."""
    at = 0
    while at < len(folders):
        patterns = _PROJECT_ENVS + (_INSTALLED if at == 0 else ())
        skip = next((len(p) for p in patterns if _starts_with(folders, at, p)), 0)
        if skip:
            at += skip
            continue
        if folders[at].startswith(".") and folders[at] not in (".", ".."):
            return folders[at]
        at += 1
    return None


def _exe_hidden(facts: Facts, _: AuditSettings) -> str | None:
    """Under a home directory (the owner's, /root, or /home/NAME), in a folder whose name starts with a dot,
    but for where installers put interpreters and toolchains (_INSTALLED, _PROJECT_ENVS)."""
    assert isinstance(facts, ProcessFacts)
    path = _exe_path(facts)
    homes = {h.rstrip("/") for h in (facts.home, "/root") if h and h != "/"}
    if path.startswith("/home/"):
        homes.add("/".join(path.split("/", 3)[:3]))
    for home in homes:
        if path.startswith(home + "/") and _hidden_folder(path[len(home) + 1 :].split("/")[:-1]) is not None:
            return f"executable in a hidden folder of a home directory: {_cut(path)}"
    return None


def _pool_port(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    if not facts.pool_peers:
        return None
    return _cut("connected to a mining pool port: " + ", ".join(str(p) for p in facts.pool_peers[:4]))


def _allowed_untrusted(facts: Facts, _: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    if facts.untrusted_allowed is None:
        return None
    return _cut(f"runs {facts.exe}, an allowed executable, but not trusted: {facts.untrusted_allowed}")


def _idle(facts: Facts, settings: AuditSettings) -> str | None:
    assert isinstance(facts, ProcessFacts)
    if facts.idle_for is None or facts.idle_for < settings.idle_after:
        return None
    return (
        f"held {format_size(facts.gpu_memory or 0)} of GPU memory at 0% utilization for over "
        f"{format_duration(settings.idle_after)}"
    )


def _hog(facts: Facts, settings: AuditSettings, share: float | None, had: str, what: str) -> str | None:
    """A user's share of the GPU `what` all users used, when it is abuser_share or more with others present."""
    assert isinstance(facts, UserFacts)
    if facts.users < 2 or share is None or share < settings.abuser_share:
        return None
    return (
        f"{had} {share:.0f}% of the GPU {what} used by {facts.users} users over the last "
        f"{format_duration(settings.abuser_window)}"
    )


def _memory_hog(facts: Facts, settings: AuditSettings) -> str | None:
    return _hog(facts, settings, getattr(facts, "memory_share", None), "held", "memory")


def _time_hog(facts: Facts, settings: AuditSettings) -> str | None:
    return _hog(facts, settings, getattr(facts, "time_share", None), "used", "time")


RULES: tuple[RogueRule, ...] = (
    RogueRule(
        "miner-name",
        FINDING_MINER,
        60,
        NAME_FAMILY,
        COMM,
        "the process name is a known miner's (xmrig, t-rex, ...)",
        "none seen: a program named like a miner, which its owner chose",
        _miner_name,
    ),
    RogueRule(
        "miner-program",
        FINDING_MINER,
        60,
        NAME_FAMILY,
        ARGV0,
        "the command line's program is a known miner's",
        "as miner-name",
        _miner_program,
    ),
    RogueRule(
        "miner-exe",
        FINDING_MINER,
        60,
        NAME_FAMILY,
        EXE,
        "the executable's file name is a known miner's",
        "as miner-name",
        _miner_exe,
    ),
    RogueRule(
        "stratum-url",
        FINDING_MINER,
        50,
        CMDLINE_FAMILY,
        CMDLINE,
        "a stratum+tcp://, stratum+ssl:// or stratum2+tcp:// URL in the command line",
        "low: a tool about mining (a pool monitor, a test of one) given a pool's URL",
        _stratum_url,
    ),
    RogueRule(
        "pool-host",
        FINDING_MINER,
        40,
        CMDLINE_FAMILY,
        CMDLINE,
        "a known mining pool's host name in the command line",
        "low: a script that queries a pool's API by its host name",
        _pool_host,
    ),
    RogueRule(
        "wallet",
        FINDING_MINER,
        30,
        CMDLINE_FAMILY,
        CMDLINE,
        "a wallet-shaped argument (Monero, 0x and 40 hex digits, bc1...)",
        "medium: any 0x and 40 hex digits (an Ethereum address or contract of a non-mining tool)",
        _wallet,
    ),
    RogueRule(
        "exe-deleted",
        FINDING_MINER,
        20,
        EXE_FAMILY,
        EXE,
        "the executable was deleted after it started, and nothing stands at its path now (looked up where "
        "that waits on no server)",
        "medium: a build that removes its output while it runs; an upgrade that replaced the file is not one",
        _exe_deleted,
    ),
    RogueRule(
        "exe-tmp",
        FINDING_MINER,
        25,
        EXE_FAMILY,
        EXE,
        "the executable lives under /tmp, /var/tmp or /dev/shm",
        "medium: test binaries, PyInstaller one-file apps and JIT launchers unpack there",
        _exe_tmp,
    ),
    RogueRule(
        "exe-hidden",
        FINDING_MINER,
        20,
        EXE_FAMILY,
        EXE,
        "the executable lives in a hidden folder of a home directory (~/.cache/x), but for where "
        "installers put interpreters and toolchains (~/.local/share/uv, ~/.pyenv/versions, ~/.conda/envs, "
        "...)",
        "medium: a tool installed by hand into a dot-folder (~/.cache/bazel test binaries)",
        _exe_hidden,
    ),
    RogueRule(
        "pool-port",
        FINDING_MINER,
        30,
        SOCKET_FAMILY,
        SOCKETS,
        "a TCP connection the process made (established or being made) to a port in pool_ports (sock_diag, "
        "by socket inode; accepted connections and ports in the ephemeral range never count)",
        "high: 3333, 4444, 5555, 7777, 9999 are also ports of ordinary services a job may talk to",
        _pool_port,
    ),
    RogueRule(
        "allowed-untrusted",
        FINDING_MINER,
        10,
        TRUST_FAMILY,
        EXE,
        "the process runs an executable of allowed_processes, but also a file mapped executable that is not "
        "a root-only file of the host (LD_PRELOAD of a user's library), or it is traced: scored as any "
        "process, this rule saying why",
        "low: a profiler or allocator preloaded from a home directory into an allowed program",
        _allowed_untrusted,
    ),
    RogueRule(
        "idle-memory",
        FINDING_IDLE,
        50,
        IDLE_FAMILY,
        GPU,
        "GPU memory (at least idle_min_memory) held at 0% utilization for idle_after",
        "it is what it says: a notebook waiting for its user is idle",
        _idle,
    ),
    RogueRule(
        "memory-hog",
        FINDING_ABUSER,
        50,
        SHARE_FAMILY,
        GPU,
        "a user held abuser_share of the GPU memory in use over abuser_window, with other users",
        "it is what it says: one big job among small ones",
        _memory_hog,
    ),
    RogueRule(
        "time-hog",
        FINDING_ABUSER,
        50,
        SHARE_FAMILY,
        GPU,
        "a user had abuser_share of the GPU time used over abuser_window, with other users",
        "as memory-hog",
        _time_hog,
    ),
)
RULE_BY_NAME = {r.name: r for r in RULES}
_ORDER = {r.name: i for i, r in enumerate(RULES)}
_PROCESS_RULES = tuple(r for r in RULES if r.kind != FINDING_ABUSER)
_USER_RULES = tuple(r for r in RULES if r.kind == FINDING_ABUSER)


def score_of(evidence: Iterable[Evidence]) -> int:
    return min(MAX_SCORE, sum(e.points for e in evidence))


def scored(matched: Iterable[tuple[RogueRule, str]]) -> tuple[Evidence, ...]:
    """Evidence of the matched rules (with what each saw), in the table's order, each worth what it adds: its
    points until its family's cap is reached (so a second rule of a full family adds 0, and is still shown)."""
    used: dict[str, int] = {}
    evidence = []
    for rule, detail in sorted(matched, key=lambda m: _ORDER[m[0].name]):
        adds = max(0, min(rule.points, rule.family.cap - used.get(rule.family.name, 0)))
        used[rule.family.name] = used.get(rule.family.name, 0) + adds
        evidence.append(Evidence(rule.name, adds, detail))
    return tuple(evidence)


def _findings(facts: Facts, rules: tuple[RogueRule, ...], settings: AuditSettings) -> list[Finding]:
    matched: dict[str, list[tuple[RogueRule, str]]] = {}
    for rule in rules:
        detail = rule.test(facts, settings)
        if detail is not None:
            matched.setdefault(rule.kind, []).append((rule, _cut(detail)))
    by_kind = {kind: scored(m) for kind, m in matched.items()}
    if isinstance(facts, ProcessFacts):
        pid, start_time, comm = facts.pid, facts.start_time, facts.comm
    else:  # a user's findings: no process
        pid, start_time, comm = None, None, ""
    return [
        Finding(
            kind=kind,
            score=score_of(evidence),
            uid=facts.uid,
            user=facts.user,
            pid=pid,
            start_time=start_time,
            comm=comm,
            devices=facts.devices,
            gpu_memory=facts.gpu_memory,
            evidence=tuple(evidence),
        )
        for kind, evidence in by_kind.items()
    ]


def process_findings(facts: ProcessFacts, settings: AuditSettings) -> list[Finding]:
    """One process's findings. They depend on nothing but its facts and the settings, and on idle_for only
    through whether it reached settings.idle_after: watch.py keeps them while those stay the same."""
    return _findings(facts, _PROCESS_RULES, settings)


def ranked(processes: Iterable[Finding], users: Iterable[UserFacts], settings: AuditSettings) -> tuple[Finding, ...]:
    """The processes' findings and the users', highest score first (then by kind, user, process)."""
    found = list(processes)
    for u in users:
        found.extend(_findings(u, _USER_RULES, settings))
    return tuple(sorted(found, key=lambda f: (-f.score, f.kind, f.uid, f.pid or 0)))


def evaluate(
    processes: Iterable[ProcessFacts], users: Iterable[UserFacts], settings: AuditSettings
) -> tuple[Finding, ...]:
    """Every finding, highest score first (then by kind, user, process)."""
    return ranked((f for p in processes for f in process_findings(p, settings)), users, settings)


def as_seen_by(finding: Finding, viewer: Viewer) -> Finding | None:
    """The finding as the viewer may see it (see the module's docstring); None when nothing of it is left."""
    if viewer.others == FULL or finding.uid == viewer.uid:
        return finding
    allowed = _SEEN_BY[viewer.others]
    # What is left is worth what it adds without the rest: a rule that added 0 behind a hidden one of its
    # family adds its points again.
    evidence = scored(
        (RULE_BY_NAME[e.rule], e.detail)
        for e in finding.evidence
        if e.rule in RULE_BY_NAME and RULE_BY_NAME[e.rule].reads in allowed
    )
    if not evidence:
        return None
    return dataclasses.replace(
        finding, evidence=evidence, score=score_of(evidence), comm=finding.comm if COMM in allowed else ""
    )


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
