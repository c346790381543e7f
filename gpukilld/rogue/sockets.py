"""Which GPU processes made TCP connections to pool ports: sock_diag dumps per network namespace
(gpukill/kernel/sock_diag.py), matched by socket inode against the processes' descriptors (/proc/PID/fd).

Only connections the process made count. A socket accepted on a listening port has the *client's* port as its
remote port, which whoever connects chooses: bob binding his client socket to port 3333 and connecting to
alice's notebook server would make her server look connected to a pool. So a connected socket whose local port
a LISTEN socket of the same namespace holds is an accepted one, and is left out; so is a socket another uid owns
(it was made by another user, whatever process holds it now).

Read in the sampler thread only, and within a budget per round (RoundBudget: namespaces dumped, bytes received,
descriptors looked at, seconds); what does not fit is deferred to the next round, never dropped:
- each namespace is dumped with the kernel filtering on the pool ports (so a namespace padded with thousands
  of sockets costs the kernel's walk, not ours; a family with no TCP socket in use, by the namespace's sockstat,
  is not dumped), the host's (the daemon's own) too, at most every HOST_TTL seconds unless a process is new: a
  socket stays in the namespace it was made in when its process moves to another;
- a process's descriptors are looked at only when a namespace it can hold sockets of has a candidate owned by
  its uid, and then all of them, over as many rounds as the budget takes (no fixed cap that 4,096 padding
  descriptors could fill before the pool socket).

What cannot be seen: a connection whose namespace is neither the process's own nor the host's (made in one
namespace, then the process moved to a third), more than MAX_CANDIDATES connections to pool ports in one
namespace (the rest that round), a miner whose outbound socket is bound to a port it also listens on
(SO_REUSEPORT), and a connection accepted on a port whose listener has since closed is counted as made.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gpukill.kernel import sock_diag
from gpukill.kernel.sock_diag import TcpSocket

log = logging.getLogger("gpukilld")

MAX_CANDIDATES = 4096  # connections to pool ports kept of one namespace per round
# Seconds the host namespace's candidates serve (every round reads processes there). A dump walks the kernel's
# whole TCP hash table, which is sized by memory (262,144 buckets on a 24 GiB VM: 0.8 ms of kernel time a dump,
# more on a big server), and a round came every few seconds on 2,048 GPU processes. A candidate kept this long
# never stands for a socket that is gone: it counts only while the process still holds its inode (_scan_fds),
# and a TCP socket's remote end never changes once connected. What waits is a connection made after the dump
# by a process read before the next one: seen in its next turn (SOCKETS_TTL), unless it is new or exec'd.
HOST_TTL = 15.0
LISTEN_CHUNK = 256  # local-port ranges per LISTEN dump (one netlink attribute holds the filter)
_FAMILIES = (socket.AF_INET, socket.AF_INET6)


@dataclass(frozen=True, slots=True)
class Peer:
    """The remote end of one of a process's TCP connections."""

    address: str  # 192.0.2.1 or 2001:db8::1
    port: int

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


@dataclass(frozen=True, slots=True)
class RoundBudget:
    """What one audit round may spend on sockets; past any of these the rest waits for the next round."""

    namespaces: int = 64  # network namespaces dumped (the host's included)
    bytes: int = 4 << 20  # received from the kernel, all dumps together
    fds: int = 1 << 17  # descriptor entries looked at in /proc/PID/fd, all processes together
    seconds: float = 0.25  # of socket work (checked between namespaces and every 1,024 descriptors)
    processes: int = 8192  # due processes looked at (one stat of /proc/PID/ns/net each)


def netns_of(root: str, pid: int) -> int | None:
    """The inode of the process's network namespace: processes sharing it share the sockets."""
    try:
        return os.stat(f"{root}/{pid}/ns/net").st_ino
    except OSError:
        return None


def tcp_families(net_dir: str) -> list[int]:
    """The address families with TCP sockets in use in a namespace, from its sockstat counters (kept by the
    kernel per namespace: no walk). A dump walks the whole host's TCP hash table, every namespace's sockets,
    whatever the namespace asked about: one not needed is the cheapest. Unreadable: both."""
    families: list[int] = []
    for name, family, key in (("sockstat", socket.AF_INET, "TCP:"), ("sockstat6", socket.AF_INET6, "TCP6:")):
        try:
            with open(f"{net_dir}/{name}", encoding="ascii", errors="replace") as f:
                words = next((line.split() for line in f if line.startswith(key)), [])
            if len(words) >= 3 and words[1] == "inuse" and words[2] == "0":
                continue
        except OSError:
            pass
        families.append(family)
    return families


def _own_netns() -> int | None:
    try:
        return os.stat("/proc/thread-self/ns/net").st_ino
    except OSError:
        return None


@dataclass(slots=True)
class _Scan:
    """A process's descriptors looked at so far (over rounds): where to go on, and the sockets found."""

    done: int = 0
    inodes: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Spent:
    namespaces: int = 0
    bytes: int = 0
    fds: int = 0
    deadline: float = 0.0

    def dumps_over(self, budget: RoundBudget) -> bool:
        return self.namespaces >= budget.namespaces or self.bytes >= budget.bytes or time.monotonic() >= self.deadline

    def scans_over(self, budget: RoundBudget) -> bool:
        return self.fds >= budget.fds or time.monotonic() >= self.deadline


Key = TypeVar("Key", bound=Hashable)  # what the caller knows a process by


class PoolConnections(Generic[Key]):
    """Reads, round by round, the pool-port connections of the processes handed to it."""

    def __init__(self, proc_root: str, budget: RoundBudget | None = None) -> None:
        self.proc_root = proc_root
        self.budget = budget or RoundBudget()
        self._scans: dict[Key, _Scan] = {}  # processes whose descriptors are being looked at over rounds
        self._buffer = bytearray(sock_diag.RECV_BUFFER)
        self.last_round: dict[str, float] = {}  # what the last round spent and deferred (tests, bench)
        self._host: tuple[float, tuple, int | None, list[TcpSocket]] | None = None  # (when, ports, netns, found)
        self._said: set[str] = set()

    def _cannot(self, e: OSError) -> None:
        """Say once per reason that sockets cannot be read (sock_diag missing, setns refused by the unit)."""
        reason = e.strerror or str(e)
        if reason not in self._said:
            self._said.add(reason)
            log.warning("the audit cannot read the sockets of a network namespace: %s", reason)

    def forget(self, keep: Iterable[Key]) -> None:
        """Drop what is kept for processes no longer asked about."""
        keep = set(keep)
        for key in self._scans.keys() - keep:
            del self._scans[key]

    def read(
        self, due: list[tuple[Key, int, int]], ports: Iterable[int], new: Iterable[Key] = ()
    ) -> dict[Key, tuple[Peer, ...]]:
        """due: (key, pid, uid) in the order they wait; new: those never read (for them the host's namespace is
        dumped again, not served from the last HOST_TTL seconds: a process connects when it starts). The
        connections to `ports` of the processes finished this round, by key; the others are deferred (asked
        about again next round)."""
        started = time.monotonic()
        spent = _Spent(deadline=started + self.budget.seconds)
        ranges = sock_diag.port_ranges(ports)[: sock_diag.MAX_RANGES]
        done: dict[Key, tuple[Peer, ...]] = {}
        if not ranges:
            return {key: () for key, _, _ in due}
        host = _own_netns()
        by_netns = self._by_netns(due, host, done)
        candidates = self._read_namespaces(by_netns, host, ranges, set(new), started, spent)
        self._match(by_netns, candidates, host, spent, done)
        self.last_round = {
            "seconds": time.monotonic() - started,
            "namespaces": spent.namespaces,
            "bytes": spent.bytes,
            "fds": spent.fds,
            "finished": len(done),
            "deferred": len(due) - len(done),
        }
        return done

    def _by_netns(
        self, due: list[tuple[Key, int, int]], host: int | None, done: dict[Key, tuple[Peer, ...]]
    ) -> dict[int, list[tuple[Key, int, int]]]:
        """The due processes by namespace, in order of waiting, as far as the budget goes; those gone are done
        (with nothing)."""
        budget = self.budget
        by_netns: dict[int, list[tuple[Key, int, int]]] = {}
        for n, (key, pid, uid) in enumerate(due):
            if n >= budget.processes:
                break
            netns = netns_of(self.proc_root, pid)
            if netns is None:
                done[key] = ()  # gone, or no /proc: nothing to read
                continue
            if netns not in by_netns and len(by_netns) + (host not in by_netns) >= budget.namespaces:
                continue  # a namespace of its own past the budget: next round
            by_netns.setdefault(netns, []).append((key, pid, uid))
        return by_netns

    def _read_namespaces(
        self,
        by_netns: dict[int, list[tuple[Key, int, int]]],
        host: int | None,
        ranges: list[tuple[int, int]],
        new: set[Key],
        started: float,
        spent: _Spent,
    ) -> dict[int, list[TcpSocket]]:
        """Each namespace's candidate connections: the host's first (sockets made there before a process
        moved), then the others; their sock_diag sockets made in one go (sock_diag.open_many), dumped as far as
        the budget goes. A namespace missing from the answer is deferred."""
        candidates: dict[int, list[TcpSocket]] = {}
        order = ([host] if host is not None and by_netns else []) + [ns for ns in by_netns if ns != host]
        ns_fds: list[int] = []  # every one opened, closed at the end
        try:
            reading = self._open_namespaces(order, by_netns, host, ns_fds)
            cached = self._host
            if (
                cached is not None
                and host is not None
                and reading
                and reading[0][1] is None
                and cached[1] == tuple(ranges)
                and cached[2] == host
                and started - cached[0] < HOST_TTL
                and not any(key in new for members in by_netns.values() for key, _, _ in members)
            ):
                candidates[host] = cached[3]
                reading = reading[1:]
            diag = sock_diag.open_many([fd for _, fd in reading])
            try:
                for (netns, ns_fd), s in zip(reading, diag, strict=True):
                    if spent.dumps_over(self.budget):
                        break
                    if isinstance(s, OSError):
                        self._cannot(s)
                        candidates[netns] = []  # nothing seen there (said once in the log)
                        continue
                    net = "/proc/thread-self/net" if ns_fd is None else f"{self.proc_root}/{by_netns[netns][0][1]}/net"
                    candidates[netns] = self._candidates(s, ns_fd, ranges, tcp_families(net), spent)
                    if ns_fd is None:
                        self._host = (started, tuple(ranges), host, candidates[netns])
            finally:
                for s in diag:
                    if not isinstance(s, OSError):
                        s.close()
        finally:
            for fd in ns_fds:
                os.close(fd)
        return candidates

    def _open_namespaces(
        self, order: list[int], by_netns: dict[int, list[tuple[Key, int, int]]], host: int | None, ns_fds: list[int]
    ) -> list[tuple[int, int | None]]:
        """(namespace, its fd; None: the host's, ours) for each namespace still there; every fd opened is added
        to ns_fds, for the caller to close."""
        reading: list[tuple[int, int | None]] = []
        for netns in order:
            if netns == host:
                reading.append((netns, None))
                continue
            try:
                fd = os.open(f"{self.proc_root}/{by_netns[netns][0][1]}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # the process is gone (its key is asked about again, and then found gone)
            ns_fds.append(fd)
            if os.fstat(fd).st_ino == netns:  # else it moved (or its pid was reused) since the stat
                reading.append((netns, fd))
        return reading

    def _match(
        self,
        by_netns: dict[int, list[tuple[Key, int, int]]],
        candidates: dict[int, list[TcpSocket]],
        host: int | None,
        spent: _Spent,
        done: dict[Key, tuple[Peer, ...]],
    ) -> None:
        """Processes of the namespaces read: their descriptors, where a candidate of their uid is, as far as
        the budget goes."""
        host_candidates = candidates.get(host, []) if host is not None else []
        scanned = False  # the first scan of a round goes on even past the budget: every round makes progress
        for netns, members in by_netns.items():
            if netns not in candidates:
                continue  # deferred with its namespace
            here = candidates[netns] + (host_candidates if netns != host else [])
            for key, pid, uid in members:
                mine = {c.inode: c for c in here if c.uid == uid}
                if not mine:
                    done[key] = ()
                    self._scans.pop(key, None)
                    continue
                if scanned and spent.scans_over(self.budget):
                    continue
                scanned = True
                held = self._scan_fds(key, pid, mine.keys(), spent)
                if held is not None:
                    done[key] = tuple(
                        sorted(
                            {Peer(mine[i].remote_address, mine[i].remote_port) for i in held},
                            key=lambda peer: (peer.address, peer.port),
                        )
                    )

    def _candidates(
        self, s: socket.socket, ns_fd: int | None, ranges: list[tuple[int, int]], families: list[int], spent: _Spent
    ) -> list[TcpSocket]:
        """The namespace's connections to pool ports that were not accepted on a listening port (a namespace
        that cannot be read has none: setns refused, or the kernel without sock_diag)."""
        spent.namespaces += 1
        found: list[TcpSocket] = []
        cut = False
        program = sock_diag.bytecode(ranges, remote=True)
        try:
            for family in families:
                left = max(1, min(self.budget.bytes - spent.bytes, MAX_CANDIDATES * 128))
                try:
                    got, n = sock_diag.dump(s, family, sock_diag.CONNECTING, program, left, self._buffer)
                except sock_diag.DumpCut as e:
                    spent.bytes += e.received
                    found += e.sockets
                    cut = True  # the rest of that dump is still queued on s: it is closed, never read again
                    break
                spent.bytes += n
                found += got
            if not found:
                return []
            if cut:
                with sock_diag.open_in(ns_fd) as fresh:
                    return self._not_accepted(fresh, found[:MAX_CANDIDATES], families, spent)
            return self._not_accepted(s, found[:MAX_CANDIDATES], families, spent)
        except OSError:
            return []

    def _not_accepted(
        self, s: socket.socket, found: list[TcpSocket], families: list[int], spent: _Spent
    ) -> list[TcpSocket]:
        """Leave out the sockets whose local port a LISTEN socket of their namespace holds: accepted ones."""
        listening: set[int] = set()
        ranges = sock_diag.port_ranges(c.local_port for c in found)
        for i in range(0, len(ranges), LISTEN_CHUNK):
            program = sock_diag.bytecode(ranges[i : i + LISTEN_CHUNK], remote=False)
            for family in families:
                try:
                    got, n = sock_diag.dump(s, family, sock_diag.LISTENING, program, 1 << 20, self._buffer)
                except sock_diag.DumpCut:
                    return []  # a namespace padded with listeners on exactly these ports: nothing is trusted
                spent.bytes += n
                listening.update(c.local_port for c in got)
        return [c for c in found if c.local_port not in listening]

    def _scan_fds(self, key: Key, pid: int, wanted: Iterable[int], spent: _Spent) -> set[int] | None:
        """Which of the wanted socket inodes the process holds; None: not all its descriptors were looked at in
        this round's budget (it goes on next round from where it stopped)."""
        wanted = set(wanted)
        scan = self._scans.get(key) or _Scan()
        scan.inodes &= wanted  # a socket closed since it was found is not held any more
        n = 0
        try:
            with os.scandir(f"{self.proc_root}/{pid}/fd") as entries:
                for n, entry in enumerate(entries, 1):
                    if n <= scan.done:
                        continue  # looked at in an earlier round (cheap: no readlink)
                    spent.fds += 1
                    try:
                        target = os.readlink(entry.path)
                    except OSError:
                        continue
                    if target.startswith("socket:[") and target[8:-1].isdigit() and int(target[8:-1]) in wanted:
                        scan.inodes.add(int(target[8:-1]))
                    if not n & 1023 and spent.scans_over(self.budget):
                        scan.done = n
                        self._scans[key] = scan
                        return None
        except OSError:
            pass  # gone, or not readable: what was found is all there is
        self._scans.pop(key, None)
        return scan.inodes
