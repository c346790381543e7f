"""TCP sockets of one network namespace, from the kernel's sock_diag netlink interface (NETLINK_SOCK_DIAG,
INET_DIAG, linux/inet_diag.h): a small reader of our own (struct packing, no dependency). The daemon's audit
dumps a namespace's connections (gpukilld/rogue/sockets.py); `gpukillctl serve` asks who owns the one socket
a request came in on (owner()).

Why not /proc/PID/net/tcp*: those tables list every socket of the namespace as text, so a user padding their
own namespace with thousands of sockets made the daemon parse megabytes; here the kernel filters (states, and a
bytecode filter on ports) and sends only the matches, 72 bytes each.

Why not pyroute2's DiagSocket: it sends no bytecode filter (INET_DIAG_REQ_BYTECODE), so every socket of the
namespace still comes back, and it parses each into nested dicts: on a namespace of 10,000 connections one dump
took 780 ms, this reader 37 ms for all of them and 2.7 ms with the port filter (/proc/net/tcp read and split:
35 ms). bench/sock_diag/run.py measures it.

A netlink socket belongs to the network namespace of the thread that created it, for its life: `open_in()`
makes it in a short-lived thread that setns()es there (setns(CLONE_NEWNET) is per thread; Python 3.11 has no
os.setns, hence ctypes), so the sampler thread itself never changes namespace.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_REQ_BYTECODE = 1
# inet_diag_bc_op codes
BC_JMP, BC_S_GE, BC_S_LE, BC_D_GE, BC_D_LE = 1, 2, 3, 4, 5
# TCP states (include/net/tcp_states.h) as the bit masks inet_diag_req_v2.idiag_states takes
CONNECTING = (1 << 1) | (1 << 2)  # ESTABLISHED, SYN_SENT: a connection made or being made
LISTENING = 1 << 10
CLONE_NEWNET = 0x40000000

_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_REQUEST = struct.Struct("=BBBBI4x32sI8s")  # inet_diag_req_v2 (ports and addresses left 0: the filter does it)
_OP = struct.Struct("=BBH")  # inet_diag_bc_op
_MSG_LEN = 72  # inet_diag_msg
RECV_BUFFER = 64 << 10  # the kernel sends dumps in datagrams of at most 32 KiB


@dataclass(frozen=True, slots=True)
class TcpSocket:
    """One socket of a dump: what the audit needs of it."""

    state: int
    local_port: int
    remote_address: str  # 192.0.2.1 or 2001:db8::1 (IPv4-mapped IPv6 as IPv4)
    remote_port: int
    uid: int  # its owner, as the daemon's user namespace sees it
    inode: int


def port_ranges(ports: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted ports merged into inclusive ranges: fewer filter ops for the kernel to run per socket."""
    ranges: list[tuple[int, int]] = []
    for port in sorted(set(ports)):
        if ranges and ranges[-1][1] == port - 1:
            ranges[-1] = (ranges[-1][0], port)
        else:
            ranges.append((port, port))
    return ranges


def bytecode(ranges: list[tuple[int, int]], remote: bool) -> bytes:
    """An INET_DIAG_REQ_BYTECODE program accepting a socket whose remote (or local) port is in one of the
    ranges. Each range is a block of 20 bytes: GE lo (else next block), LE hi (else next block), JMP to the end
    (accept: the kernel accepts a socket whose program ends exactly at its end); after the last block a JMP past
    the end rejects. The kernel's audit (inet_diag_bc_audit) follows the `yes` offsets, so every block is on that
    path."""
    ge, le = (BC_D_GE, BC_D_LE) if remote else (BC_S_GE, BC_S_LE)
    total = 20 * len(ranges) + 4
    out = bytearray()
    for i, (low, high) in enumerate(ranges):
        rest = total - 20 * i
        out += _OP.pack(ge, 8, 20) + _OP.pack(0, 0, low)
        out += _OP.pack(le, 8, 12) + _OP.pack(0, 0, high)
        out += _OP.pack(BC_JMP, 4, rest - 16)
    out += _OP.pack(BC_JMP, 4, 8)
    return bytes(out)


MAX_RANGES = (0xFFFF - 4 - 4) // 20  # one netlink attribute holds the program


def request(family: int, states: int, program: bytes, seq: int = 1) -> bytes:
    attr = struct.pack("=HH", 4 + len(program), INET_DIAG_REQ_BYTECODE) + program
    attr += b"\0" * (-len(attr) % 4)
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, states, b"", 0, b"") + attr
    return _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def _address(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, raw[12:16])
    return socket.inet_ntop(socket.AF_INET6, raw)


class DumpCut(Exception):
    """A dump stopped at its byte limit: what came before it is in `sockets`."""

    def __init__(self, sockets: list[TcpSocket], received: int) -> None:
        super().__init__(f"sock_diag dump cut at {received} bytes")
        self.sockets, self.received = sockets, received


def dump(
    sock: socket.socket, family: int, states: int, program: bytes, max_bytes: int, buffer: bytearray | None = None
) -> tuple[list[TcpSocket], int]:
    """The sockets of one family in the given states that the program accepts, and the bytes received.
    Past max_bytes the dump is abandoned (DumpCut; the caller closes the socket, which frees the kernel's side)."""
    buf = buffer if buffer is not None else bytearray(RECV_BUFFER)
    view = memoryview(buf)
    sock.send(request(family, states, program))
    found: list[TcpSocket] = []
    received = 0
    while True:
        n = sock.recv_into(buf)
        received += n
        offset = 0
        while offset + _HEADER.size <= n:
            length, kind, _, _, _ = _HEADER.unpack_from(buf, offset)
            if length < _HEADER.size or offset + length > n:
                raise OSError("sock_diag: malformed netlink message")
            if kind == NLMSG_DONE:
                return found, received
            if kind == NLMSG_ERROR:
                code = -struct.unpack_from("=i", buf, offset + 16)[0]
                raise OSError(code, f"sock_diag: {os.strerror(code)}")
            if kind == SOCK_DIAG_BY_FAMILY and length >= _HEADER.size + _MSG_LEN:
                m = offset + _HEADER.size
                fam, state = buf[m], buf[m + 1]
                sport, dport = struct.unpack_from("!HH", buf, m + 4)
                uid, inode = struct.unpack_from("=II", buf, m + 64)
                found.append(TcpSocket(state, sport, _address(fam, bytes(view[m + 24 : m + 40])), dport, uid, inode))
            offset += (length + 3) & ~3
        if received >= max_bytes:
            raise DumpCut(found, received)


_ID = struct.Struct("!HH16s16s")  # inet_diag_sockid's ports and addresses, in network byte order
_NO_COOKIE = b"\xff" * 8  # INET_DIAG_NOCOOKIE: any socket with these ends
ALL_STATES = 0xFFFFFFFF


def owner(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid that owns the TCP socket of this network namespace whose own end is `local` and whose peer is
    `remote` (addresses as text, IPv4 or IPv6): one exact lookup, one message each way, whatever the number of
    sockets. None where the kernel knows no such socket (it closed) or the address is not an IP address."""
    try:
        family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
        src, dst = (socket.inet_pton(family, a) for a in (local[0], remote[0]))
    except (OSError, ValueError):
        return None
    body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, ALL_STATES)
    body += _ID.pack(local[1], remote[1], src.ljust(16, b"\0"), dst.ljust(16, b"\0"))
    body += struct.pack("=I", 0) + _NO_COOKIE
    message = _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + body
    with _diag_socket() as sock:
        sock.send(message)
        reply = sock.recv(RECV_BUFFER)
    if len(reply) < _HEADER.size + _MSG_LEN:
        return None  # NLMSG_ERROR (ENOENT: no such socket), or nothing usable
    length, kind, _, _, _ = _HEADER.unpack_from(reply)
    if kind != SOCK_DIAG_BY_FAMILY or length < _HEADER.size + _MSG_LEN:
        return None
    (uid,) = struct.unpack_from("=I", reply, _HEADER.size + 64)
    return uid


_libc = ctypes.CDLL(None, use_errno=True)


def _diag_socket() -> socket.socket:
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
    s.settimeout(2.0)  # the kernel answers a dump at once; never wait on it for long
    return s


def open_in(ns_fd: int | None) -> socket.socket:
    """A sock_diag socket of the network namespace that ns_fd (an open /proc/PID/ns/net) names; None: our own."""
    (result,) = open_many([ns_fd])
    if isinstance(result, OSError):
        raise result
    return result


def open_many(ns_fds: list[int | None]) -> list[socket.socket | OSError]:
    """A sock_diag socket in each namespace (None: our own), or why not, in order. Those of other namespaces are
    made in one thread of its own that setns()es from one to the next and then ends, so no thread of the daemon
    is left in another namespace; one thread for them all: starting a thread costs up to a millisecond on a busy
    host, setns microseconds."""
    made: dict[int, socket.socket | OSError] = {}

    def enter() -> None:
        for i, ns_fd in enumerate(ns_fds):
            if ns_fd is None:
                continue
            try:
                if _libc.setns(ns_fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns: {os.strerror(err)}")
                made[i] = _diag_socket()
            except OSError as e:  # this thread stays where it was: the next setns goes on from there
                made[i] = e

    if any(fd is not None for fd in ns_fds):
        thread = threading.Thread(target=enter, name="gpukilld-netns", daemon=True)
        thread.start()
        thread.join()
    out: list[socket.socket | OSError] = []
    for i, ns_fd in enumerate(ns_fds):
        if ns_fd is None:
            try:
                out.append(_diag_socket())
            except OSError as e:
                out.append(e)
        else:
            out.append(made.get(i) or OSError("setns thread ended early"))
    return out
