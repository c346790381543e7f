"""The audit's eyes: it sees every snapshot the sampler makes (in the sampler thread, never on the main loop)
and turns it, /proc and the history of past snapshots into the facts the rules of gpukilld/rogue.py read.

History kept here, and only here:
- since when each process has held memory at 0% utilization (idle holders);
- each user's GPU memory-seconds and utilization-seconds over the last abuser_window (abusers), as running
  sums over one entry per sample.
Host facts read here: each GPU process's TCP connections to pool ports (gpukilld/sockets.py), cached per
process for SOCKETS_TTL seconds like its command line, each network namespace's tables read once per round.
"""

from __future__ import annotations

import collections
import pwd
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from gpukill.records import Finding

from . import sockets
from .config import AuditSettings
from .model import GpuProcess
from .rogue import ProcessFacts, UserFacts, evaluate
from .sockets import Peer

SOCKETS_TTL = 10.0  # seconds before a process's connections are read again
MAX_GAP = 60.0  # seconds: a longer pause between samples (a suspended host) counts as this long


@lru_cache(maxsize=4096)
def home_of(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_dir
    except KeyError:
        return None


@dataclass(slots=True)
class _Usage:
    """A process's figures in one snapshot, its devices summed."""

    p: GpuProcess
    devices: list[int] = field(default_factory=list)
    memory: int | None = None
    utilization: float | None = None
    unknown_util: bool = False  # a device could not read its utilization: it is not known to be 0


class RogueWatch:
    def __init__(self, proc_root: str, settings: AuditSettings | None = None) -> None:
        self.proc_root = proc_root
        self.settings = settings or AuditSettings()  # replaced on reload
        self._idle_since: dict[tuple[int, int], float] = {}
        self._peers: dict[tuple[int, int], tuple[tuple[Peer, ...], float]] = {}
        # One entry per sample: (time, seconds it stands for, {uid: (memory, utilization)}), and the sums.
        self._window: collections.deque[tuple[float, float, dict[int, tuple[int, float]]]] = collections.deque()
        self._memory_seconds: dict[int, float] = collections.defaultdict(float)
        self._util_seconds: dict[int, float] = collections.defaultdict(float)
        self._last: float | None = None

    def __call__(self, processes: Sequence[GpuProcess], now: float) -> tuple[Finding, ...]:
        """The findings for this snapshot's processes; `now` is monotonic seconds."""
        usages = self._usages(processes)
        self._track_idle(usages, now)
        self._track_window(usages, now)
        self._refresh_peers(usages, now)
        settings = self.settings
        facts = [ProcessFacts(pid=u.p.pid, start_time=u.p.start_time, uid=u.p.uid, user=u.p.user, comm=u.p.comm,
                              cmdline=u.p.cmdline, exe=u.p.exe, home=home_of(u.p.uid), devices=tuple(u.devices),
                              gpu_memory=u.memory, pool_peers=self._peers.get(key, ((), 0.0))[0],
                              idle_for=now - self._idle_since[key] if key in self._idle_since else None)
                 for key, u in usages.items()]
        return evaluate(facts, self._user_facts(usages, now), settings)

    @staticmethod
    def _usages(processes: Sequence[GpuProcess]) -> dict[tuple[int, int], _Usage]:
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

    def _track_idle(self, usages: dict[tuple[int, int], _Usage], now: float) -> None:
        floor = max(1, self.settings.idle_min_memory)
        idle_since = {}
        for key, u in usages.items():
            # Unknown utilization is not 0%, and usage shared with others is a lower bound: neither is idle.
            if (u.memory or 0) >= floor and u.utilization == 0.0 and not u.unknown_util and not u.p.shared_usage:
                idle_since[key] = self._idle_since.get(key, now)
        self._idle_since = idle_since

    def _track_window(self, usages: dict[tuple[int, int], _Usage], now: float) -> None:
        seconds = 0.0 if self._last is None else min(max(0.0, now - self._last), MAX_GAP)
        self._last = now
        per_user: dict[int, tuple[int, float]] = {}
        for u in usages.values():
            memory, util = per_user.get(u.p.uid, (0, 0.0))
            per_user[u.p.uid] = (memory + (u.memory or 0), util + (u.utilization or 0.0))
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

    def _user_facts(self, usages: dict[tuple[int, int], _Usage], now: float) -> list[UserFacts]:
        covered = now - self._window[0][0] if self._window else 0.0
        enough = covered >= self.settings.abuser_window / 2  # too short a history compares nothing
        total_memory = sum(max(0.0, v) for v in self._memory_seconds.values())
        total_util = sum(max(0.0, v) for v in self._util_seconds.values())
        users = sum(1 for uid in self._memory_seconds
                    if self._memory_seconds[uid] > 0.5 or self._util_seconds[uid] > 1e-6)
        now_by_uid: dict[int, tuple[str, set[int], int | None]] = {}
        for u in usages.values():
            name, devices, memory = now_by_uid.get(u.p.uid, (u.p.user, set(), None))
            devices.update(u.devices)
            if u.memory is not None:
                memory = (memory or 0) + u.memory
            now_by_uid[u.p.uid] = (name, devices, memory)

        def share(part: float, total: float) -> float | None:
            return part * 100.0 / total if enough and total > 0 else None

        return [UserFacts(uid=uid, user=name, devices=tuple(sorted(devices)), gpu_memory=memory, users=users,
                          memory_share=share(max(0.0, self._memory_seconds.get(uid, 0.0)), total_memory),
                          time_share=share(max(0.0, self._util_seconds.get(uid, 0.0)), total_util))
                for uid, (name, devices, memory) in now_by_uid.items()]

    def _refresh_peers(self, usages: dict[tuple[int, int], _Usage], now: float) -> None:
        """Connections to pool ports of the processes whose reading is older than SOCKETS_TTL; each network
        namespace's tables read at most once per round."""
        ports = frozenset(self.settings.pool_ports)
        tables: dict[int | None, dict[int, Peer]] = {}
        kept: dict[tuple[int, int], tuple[tuple[Peer, ...], float]] = {}
        for key, u in usages.items():
            cached = self._peers.get(key)
            if cached is not None and now - cached[1] < SOCKETS_TTL:
                kept[key] = cached
                continue
            peers: tuple[Peer, ...] = ()
            inodes = sockets.socket_inodes(self.proc_root, u.p.pid) if ports else set()
            if inodes:
                netns = sockets.netns_of(self.proc_root, u.p.pid)
                table = tables.get(netns)
                if table is None:
                    table = tables[netns] = sockets.read_tables(self.proc_root, u.p.pid)
                peers = tuple(sorted({table[i] for i in inodes if i in table and table[i].port in ports},
                                     key=lambda peer: (peer.address, peer.port)))
            kept[key] = (peers, now)
        self._peers = kept  # processes gone from the GPUs are forgotten
