"""The audit's eyes: it sees every snapshot the sampler makes (in the sampler thread, never on the main loop)
and turns it, /proc and the history of past snapshots into the facts the rules of gpukilld/rogue/score.py read.

History kept here, and only here:
- since when each process has held memory at 0% utilization (idle holders);
- each user's GPU memory-seconds and utilization-seconds over the last abuser_window (abusers), as running
  sums over one entry per sample.
Host facts read here: each GPU process's outbound TCP connections to pool ports (gpukilld/rogue/sockets.py: sock_diag
per network namespace, within a budget per round), cached per process for SOCKETS_TTL seconds or a little more.
A process due for a read that the round's budget does not reach waits, first in line, for the next round.

The settings' allow-lists apply to what comes out: an allowed user's findings, and those of a process running an
allowed executable (gpukilld/rogue/trusted_exe.py: by the file it runs, never by a name), are never in the snapshot, so
neither AuditRogue nor Guard's rogue_score sees them. Each round also leaves its basis (the facts its findings
were made from) for AuditRogueWith to score again with one scan's thresholds, and says which settings made which
findings (made_with), so that a change of settings can wait for findings made with it.
"""

from __future__ import annotations

import collections
import heapq
import pwd
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from gpukill.records.audit import Finding

from .. import audit_settings
from ..config import AuditSettings
from ..model import GpuProcess
from ..proc.procfs import ProcFS
from .exe_replaced import DELETED, ExeLookups
from .score import ProcessFacts, UserFacts, process_findings, ranked
from .sockets import Peer, PoolConnections, RoundBudget
from .trusted_exe import foreign_code, runs_trusted

# Seconds before a process's connections are read again (spread up to 1.5 times that, so that not every process
# is read in one sample): reading the descriptors of thousands of GPU processes every 10 s cost the daemon more
# than the rest of its sampling (bench/idle_cost). A miner connects at start, when it is read at once.
SOCKETS_TTL = 60.0
EPHEMERAL_TTL = 60.0  # seconds between reads of net.ipv4.ip_local_port_range (an admin may change it)
MAX_GAP = 60.0  # seconds: a longer pause between samples (a suspended host) counts as this long
# Seconds before a process running an allowed executable has its mapped files read again: a library it loads
# later (dlopen) is seen within this long.
TRUST_TTL = 60.0


@lru_cache(maxsize=4096)
def home_of(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_dir
    except KeyError:
        return None


@dataclass(frozen=True, slots=True)
class Basis:
    """What one round's findings were made from, for scoring them again with other thresholds (AuditRogueWith).
    Immutable once made: the sampler thread makes a new one each round, readers take it as it is."""

    now: float  # monotonic seconds of the round
    settings: AuditSettings  # the settings in force then
    processes: tuple[ProcessFacts, ...]  # each GPU process's facts (idle_for as when they were made)
    idle_since: dict[tuple[int, int], float]  # since when each idle holder (of the configured floor) has been idle
    users: tuple[UserFacts, ...]
    allowed: frozenset[tuple[int, int]]  # processes running an allowed executable (trusted_exe.py)

    def rescored(self, settings: AuditSettings) -> tuple[Finding, ...]:
        """The findings with these thresholds instead (the allow-lists are the round's): idle clocks run for the
        configured idle_min_memory, so a higher floor leaves holders out, never a lower one in (the caller
        refuses that)."""
        found = []
        for facts in self.processes:
            since = self.idle_since.get((facts.pid, facts.start_time))
            idle_for = (
                self.now - since if since is not None and (facts.gpu_memory or 0) >= settings.idle_min_memory else None
            )
            found.extend(process_findings(replace(facts, idle_for=idle_for), settings))
        return allowed_out(ranked(found, self.users, settings), self.settings, self.allowed)


def allowed_out(
    findings: tuple[Finding, ...], settings: AuditSettings, allowed: frozenset[tuple[int, int]]
) -> tuple[Finding, ...]:
    """The findings but those of allowed users and of processes that run an allowed executable."""
    users = settings.allowed_users
    if not users and not allowed:
        return findings
    return tuple(
        f
        for f in findings
        if f.user not in users and (f.pid is None or f.start_time is None or (f.pid, f.start_time) not in allowed)
    )


@dataclass(slots=True)
class _Usage:
    """A process's figures in one snapshot, its devices summed."""

    p: GpuProcess
    devices: list[int] = field(default_factory=list)
    memory: int | None = None
    utilization: float | None = None
    unknown_util: bool = False  # a device could not read its utilization: it is not known to be 0


def _program(u: _Usage) -> tuple[str | None, str]:
    """What a process runs: an exec changes it (and its connections are read again)."""
    return u.p.exe, u.p.cmdline


class RogueWatch:
    """Called once per sample. Work is kept in proportion to what changed: while the sample's processes are the
    last sample's (the sampler hands back the same records), their sums, idle clocks and findings are kept, and
    only the processes whose connections are due for a re-read, or that hold memory idle, are looked at again.
    The findings are the same as evaluating every process every sample (rogue.evaluate)."""

    def __init__(
        self, proc_root: str, settings: AuditSettings | None = None, budget: RoundBudget | None = None
    ) -> None:
        self.proc_root = proc_root
        self.settings = settings or AuditSettings()  # replaced on reload
        self._idle_since: dict[tuple[int, int], float] = {}
        # While the processes stay the same, an idle process's findings change only when it reaches idle_after
        # (score.process_findings) or its deleted executable is looked up again (ExeLookups): the heap of
        # (when it reaches idle_after, key), and the idle ones running a deleted file, are all that is looked at
        # again, not every idle process every sample (8 GPUs x 256 idle processes: ~9 ms a sample otherwise).
        self._idle_due: list[tuple[float, tuple[int, int]]] = []
        self._idle_deleted: set[tuple[int, int]] = set()
        self._peers: dict[tuple[int, int], tuple[tuple[Peer, ...], float]] = {}
        # What each process was (exe, command line) when its connections were read: a process that execs into
        # another program is read again in that sample, not a TTL later (the proc connector shows the exec at once).
        self._read_as: dict[tuple[int, int], tuple[str | None, str]] = {}
        self._peers_due: list[tuple[float, tuple[int, int]]] = []  # heap of (when, key): the next re-reads
        self._connections: PoolConnections[tuple[int, int]] = PoolConnections(proc_root, budget)
        self._exe_lookups = ExeLookups(proc_root)  # deleted executables: replaced by an upgrade, or not
        # Processes due for a read that a round's budget did not reach, in the order they became due (a dict
        # for its order): the next round starts with them.
        self._waiting: dict[tuple[int, int], None] = {}
        self._ephemeral: tuple[float, tuple[int, int] | None] | None = None  # (read at, range)
        # One entry per sample: (time, seconds it stands for, {uid: (memory, utilization)}), and the sums.
        self._window: collections.deque[tuple[float, float, dict[int, tuple[int, float]]]] = collections.deque()
        self._memory_seconds: dict[int, float] = collections.defaultdict(float)
        self._util_seconds: dict[int, float] = collections.defaultdict(float)
        self._last: float | None = None
        # The last sample's processes and what was derived from them alone.
        self._processes: Sequence[GpuProcess] | None = None
        self._settings: AuditSettings | None = None
        self._usages: dict[tuple[int, int], _Usage] = {}
        self._per_user: dict[int, tuple[int, float]] = {}
        self._now_by_uid: dict[int, tuple[str, tuple[int, ...], int | None]] = {}
        # Per process: what its findings were made from, and the findings.
        self._found: dict[tuple[int, int], tuple[tuple, list[Finding], ProcessFacts]] = {}
        self._process_findings: list[Finding] = []
        self._facts: tuple[ProcessFacts, ...] = ()  # the basis's: rebuilt when a process's facts were made again
        self._facts_stale = False
        # Per process running a path of allowed_processes: (that path, whether it runs that trusted file, why
        # it is not trusted although it does (foreign_code), when that was read).
        self._trusted: dict[tuple[int, int], tuple[str, bool, str | None, float]] = {}
        self._procfs = ProcFS(proc_root)
        self._allowed: frozenset[tuple[int, int]] = frozenset()
        self.basis: Basis | None = None  # the last round's
        # (findings, settings) of the last rounds, appended in the sampler thread (a deque's append is atomic).
        self.made_with: collections.deque[tuple[tuple[Finding, ...], AuditSettings]] = collections.deque(maxlen=8)

    def __call__(self, processes: Sequence[GpuProcess], now: float) -> tuple[Finding, ...]:
        """The findings for this snapshot's processes; `now` is monotonic seconds."""
        settings = self.settings
        fresh = settings is not self._settings or not (processes is self._processes or processes == self._processes)
        if fresh:
            if settings is not self._settings:
                self._found.clear()  # made with the old thresholds
            self._settings = settings
            self._processes = processes
            self._usages = self._usages_of(processes)
            self._per_user, self._now_by_uid = self._per_user_of(self._usages)
            self._track_idle(self._usages, now)
        usages = self._usages
        self._track_window(now)
        reread = self._refresh_peers(usages, now, fresh)
        if fresh:
            self._allowed = self._allowed_processes(usages, settings, now)
        # Findings change with a process's facts (fresh), its connections (reread) or its idle clock.
        recheck = usages.keys() if fresh else reread | self._idle_deleted | self._idle_reached(now)
        changed = fresh
        for key in recheck:
            changed |= self._evaluate(key, usages[key], now, settings)
        if fresh:
            for key in self._found.keys() - usages.keys():
                del self._found[key]
        if changed:
            self._process_findings = [f for key in usages for f in self._found[key][1]]
        if changed or self._facts_stale:
            self._facts = tuple(self._found[key][2] for key in usages)
            self._facts_stale = False
        users = self._user_facts(now)
        found = allowed_out(ranked(self._process_findings, users, settings), settings, self._allowed)
        self.basis = Basis(now, settings, self._facts, self._idle_since, tuple(users), self._allowed)
        self.made_with.append((found, settings))
        return found

    def _allowed_processes(
        self, usages: dict[tuple[int, int], _Usage], settings: AuditSettings, now: float
    ) -> frozenset[tuple[int, int]]:
        """The processes that run an executable of allowed_processes and only their own code: the file checked
        once per process and path, the code every TRUST_TTL."""
        paths = settings.allowed_processes
        if not paths:
            self._trusted.clear()
            return frozenset()
        trusted = {}
        for key, u in usages.items():
            exe = u.p.exe
            if exe is None or exe not in paths:
                continue
            last = self._trusted.get(key)
            if last is None or last[0] != exe:
                runs = runs_trusted(self.proc_root, key[0], exe)
                last = (exe, runs, None, -TRUST_TTL)
            if last[1] and now - last[3] >= TRUST_TTL:
                last = (exe, True, foreign_code(self.proc_root, key[0]), now)
            # the start time read after the reads: the PID was this process's when they were made
            if last[1] and self._procfs.start_time(key[0]) != key[1]:
                last = (exe, False, None, now)
            trusted[key] = last
        self._trusted = trusted
        return frozenset(key for key, (_, runs, foreign, _) in trusted.items() if runs and foreign is None)

    def _evaluate(self, key: tuple[int, int], u: _Usage, now: float, settings: AuditSettings) -> bool:
        """Find the process's findings again if what they are made from changed; whether they changed."""
        idle_for = now - self._idle_since[key] if key in self._idle_since else None
        peers = self._peers.get(key, ((), 0.0))[0]
        # What ProcessFacts is made of, not the whole record: utilization moves every sample on a busy GPU and
        # counts here only through the idle clock, so re-scoring on it cost every process's rules each sample.
        p = u.p
        # A deleted executable is looked up (lstat, in the process's mount namespace; again after RECHECK): an
        # upgrade that put a new file at its path is no evidence, and the answer is part of the inputs.
        replaced = self._exe_lookups(key, p.exe, now)
        trust = self._trusted.get(key)
        untrusted = trust[2] if trust is not None and trust[1] else None
        inputs = (
            p.uid,
            p.user,
            p.comm,
            p.cmdline,
            p.exe,
            replaced,
            u.devices,
            u.memory,
            peers,
            idle_for is not None and idle_for >= settings.idle_after,
            untrusted,
        )
        last = self._found.get(key)
        if last is not None and last[0] == inputs:
            return False
        facts = ProcessFacts(
            pid=u.p.pid,
            start_time=u.p.start_time,
            uid=u.p.uid,
            user=u.p.user,
            comm=u.p.comm,
            cmdline=u.p.cmdline,
            exe=u.p.exe,
            home=home_of(u.p.uid),
            devices=tuple(u.devices),
            gpu_memory=u.memory,
            pool_peers=peers,
            exe_replaced=replaced,
            idle_for=idle_for,
            untrusted_allowed=untrusted,
        )
        found = process_findings(facts, settings)
        self._found[key] = (inputs, found, facts)
        self._facts_stale = True
        return last is None or last[1] != found

    @staticmethod
    def _usages_of(processes: Sequence[GpuProcess]) -> dict[tuple[int, int], _Usage]:
        usages: dict[tuple[int, int], _Usage] = {}
        for p in processes:
            u = usages.setdefault((p.pid, p.start_time), _Usage(p))
            u.devices.append(p.device)
            if p.gpu_memory is not None:
                u.memory = (u.memory or 0) + p.gpu_memory
            if p.gpu_utilization is None:
                u.unknown_util = True
            else:
                u.utilization = max(u.utilization or 0.0, p.gpu_utilization)
        return usages

    @staticmethod
    def _per_user_of(usages: dict[tuple[int, int], _Usage]) -> tuple[dict, dict]:
        """Per uid: (memory, utilization) summed for the window; (name, devices, memory now) for its facts."""
        per_user: dict[int, tuple[int, float]] = {}
        now_by_uid: dict[int, tuple[str, set[int], int | None]] = {}
        for u in usages.values():
            memory, util = per_user.get(u.p.uid, (0, 0.0))
            per_user[u.p.uid] = (memory + (u.memory or 0), util + (u.utilization or 0.0))
            name, devices, held = now_by_uid.get(u.p.uid, (u.p.user, set(), None))
            devices.update(u.devices)
            if u.memory is not None:
                held = (held or 0) + u.memory
            now_by_uid[u.p.uid] = (name, devices, held)
        return per_user, {
            uid: (name, tuple(sorted(devices)), held) for uid, (name, devices, held) in now_by_uid.items()
        }

    def _track_idle(self, usages: dict[tuple[int, int], _Usage], now: float) -> None:
        floor = max(1, self.settings.idle_min_memory)
        idle_since = {}
        for key, u in usages.items():
            # Unknown utilization is not 0%, and usage shared with others is a lower bound: neither is idle.
            if (u.memory or 0) >= floor and u.utilization == 0.0 and not u.unknown_util and not u.p.shared_usage:
                idle_since[key] = self._idle_since.get(key, now)
        self._idle_since = idle_since
        after = self.settings.idle_after
        self._idle_due = [(since + after, key) for key, since in idle_since.items() if since + after > now]
        heapq.heapify(self._idle_due)
        self._idle_deleted = {key for key in idle_since if (exe := usages[key].p.exe) and exe.endswith(DELETED)}

    def _idle_reached(self, now: float) -> set[tuple[int, int]]:
        """The idle processes that reached idle_after since the last sample."""
        reached = set()
        while self._idle_due and self._idle_due[0][0] <= now:
            _, key = heapq.heappop(self._idle_due)
            if key in self._idle_since:
                reached.add(key)
        return reached

    def _track_window(self, now: float) -> None:
        seconds = 0.0 if self._last is None else min(max(0.0, now - self._last), MAX_GAP)
        self._last = now
        per_user = self._per_user  # the same dict for every sample with the same processes: one entry is small
        self._window.append((now, seconds, per_user))
        for uid, (memory, util) in per_user.items():
            self._memory_seconds[uid] += memory * seconds
            self._util_seconds[uid] += util * seconds
        while self._window and self._window[0][0] < now - self.settings.abuser_window:
            _, old_seconds, old = self._window.popleft()
            for uid, (memory, util) in old.items():
                self._memory_seconds[uid] -= memory * old_seconds
                self._util_seconds[uid] -= util * old_seconds
                if self._memory_seconds[uid] <= 0.5 and self._util_seconds[uid] <= 1e-6:
                    del self._memory_seconds[uid], self._util_seconds[uid]

    def _user_facts(self, now: float) -> list[UserFacts]:
        covered = now - self._window[0][0] if self._window else 0.0
        enough = covered >= self.settings.abuser_window / 2  # too short a history compares nothing
        total_memory = sum(max(0.0, v) for v in self._memory_seconds.values())
        total_util = sum(max(0.0, v) for v in self._util_seconds.values())
        users = sum(
            1 for uid in self._memory_seconds if self._memory_seconds[uid] > 0.5 or self._util_seconds[uid] > 1e-6
        )

        def share(part: float, total: float) -> float | None:
            return part * 100.0 / total if enough and total > 0 else None

        return [
            UserFacts(
                uid=uid,
                user=name,
                devices=devices,
                gpu_memory=memory,
                users=users,
                memory_share=share(max(0.0, self._memory_seconds.get(uid, 0.0)), total_memory),
                time_share=share(max(0.0, self._util_seconds.get(uid, 0.0)), total_util),
            )
            for uid, (name, devices, memory) in self._now_by_uid.items()
        ]

    def _refresh_peers(self, usages: dict[tuple[int, int], _Usage], now: float, fresh: bool) -> set[tuple[int, int]]:
        """Outbound connections to pool ports of the processes read SOCKETS_TTL ago or more (or never), as far as
        the round's budget goes (the rest wait for the next round, first in line); the processes read."""
        if fresh:
            for key in self._peers.keys() - usages.keys():
                del self._peers[key]  # processes gone from the GPUs are forgotten
                self._read_as.pop(key, None)
            for key in self._waiting.keys() - usages.keys():
                del self._waiting[key]
            self._connections.forget(usages.keys())
            for key, u in usages.items():
                if key not in self._peers or self._read_as.get(key) != _program(u):
                    self._waiting.setdefault(key)
        while self._peers_due and self._peers_due[0][0] <= now:
            _, key = heapq.heappop(self._peers_due)
            cached = self._peers.get(key)
            if cached is not None and now - cached[1] >= SOCKETS_TTL and key in usages:
                self._waiting.setdefault(key)
        if not self._waiting:
            return set()
        ports = audit_settings.outside_range(self.settings.pool_ports, self._ephemeral_range(now))
        # "new" for the socket layer: never read, or read as another program (a fresh dump of the host's namespace)
        read = self._connections.read(
            [(key, key[0], usages[key].p.uid) for key in self._waiting],
            ports,
            new=(
                key
                for key in self._waiting
                if key not in self._peers or self._read_as.get(key) != _program(usages[key])
            ),
        )
        for key, peers in read.items():
            del self._waiting[key]
            self._peers[key] = (peers, now)
            self._read_as[key] = _program(usages[key])
            heapq.heappush(self._peers_due, (now + SOCKETS_TTL * (1 + (key[0] % 64) / 128), key))
        if len(self._peers_due) > 2 * len(self._peers) + 64:  # entries of forgotten processes
            self._peers_due = [(when, key) for when, key in self._peers_due if key in self._peers]
            heapq.heapify(self._peers_due)
        return set(read)

    def _ephemeral_range(self, now: float) -> tuple[int, int] | None:
        """The host's ephemeral port range, read again every EPHEMERAL_TTL seconds: pool ports inside it are
        not used (gpukilld/config.py leaves them out of the configuration already, with a log line)."""
        if self._ephemeral is None or now - self._ephemeral[0] >= EPHEMERAL_TTL:
            self._ephemeral = (now, audit_settings.ephemeral_range())
        return self._ephemeral[1]
