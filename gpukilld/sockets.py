"""A process's TCP connections, from /proc: its socket inodes (/proc/PID/fd) matched against the TCP tables of
its own network namespace (/proc/PID/net/tcp and tcp6, so a container's connections are read where they are).

Read in the sampler thread only, for the audit's pool-port rule, and bounded: at most MAX_FDS descriptors
per process and MAX_TABLE bytes per table (a busy server's tables can hold millions of lines).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

MAX_FDS = 4096  # descriptors looked at per process
MAX_TABLE = 4 << 20  # bytes of one /proc/PID/net/tcp* table
# TCP states (include/net/tcp_states.h) that are a connection made or being made.
_CONNECTED = {"01", "02"}  # ESTABLISHED, SYN_SENT


@dataclass(frozen=True, slots=True)
class Peer:
    """The remote end of one of a process's TCP connections."""

    address: str  # as the table holds it, decoded: 192.0.2.1 or 2001:db8::1
    port: int

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


def socket_inodes(root: str, pid: int) -> set[int]:
    """The inodes of the process's sockets (at most MAX_FDS descriptors looked at); empty when unreadable."""
    inodes: set[int] = set()
    try:
        with os.scandir(f"{root}/{pid}/fd") as entries:
            for n, entry in enumerate(entries):
                if n >= MAX_FDS:
                    break
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    continue
                if target.startswith("socket:[") and target.endswith("]") and target[8:-1].isdigit():
                    inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _address(hex_addr: str) -> str:
    """An address of /proc/net/tcp*: 4 or 16 bytes in hex, each 32-bit word in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ".".join(str(b) for b in words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # IPv4-mapped
        return ".".join(str(b) for b in words[12:])
    return str(ipaddress.IPv6Address(words))


def parse_table(text: str) -> dict[int, Peer]:
    """Connected sockets of one /proc/net/tcp* table by inode: their remote ends."""
    peers: dict[int, Peer] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] not in _CONNECTED or not fields[9].isdigit():
            continue
        addr, _, port = fields[2].partition(":")
        try:
            peers[int(fields[9])] = Peer(_address(addr), int(port, 16))
        except ValueError:
            continue
    return peers


def netns_of(root: str, pid: int) -> int | None:
    """The inode of the process's network namespace: processes sharing it share the tables."""
    try:
        return os.stat(f"{root}/{pid}/ns/net").st_ino
    except OSError:
        return None


def read_tables(root: str, pid: int) -> dict[int, Peer]:
    """Connected TCP sockets (v4 and v6) of the process's network namespace, by inode."""
    peers: dict[int, Peer] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{root}/{pid}/net/{name}", encoding="ascii", errors="replace") as f:
                peers.update(parse_table(f.read(MAX_TABLE)))
        except OSError:
            continue
    return peers
