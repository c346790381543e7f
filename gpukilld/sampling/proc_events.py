"""What processes become, told by the kernel's proc connector (netlink NETLINK_CONNECTOR, group CN_IDX_PROC).

The kernel multicasts an event when a process forks, execs, changes its name (prctl PR_SET_NAME, a write to
/proc/PID/comm), its uid, or exits. The sampler drains them without blocking at each sample and re-reads the
processes they name, so a GPU process that execs or renames itself into a miner is seen in the next sample,
not at its turn in the re-read rotation (gpukilld/sampling/sampler.py). Where the connector cannot be had, the sampler
polls instead and says why (`gpukillctl status`): it needs CAP_NET_ADMIN in the initial user namespace, the
initial network namespace (a unit with PrivateNetwork=, or RestrictAddressFamilies= without AF_NETLINK, loses
it) and the initial PID namespace (the kernel ignores a subscription from any other one, and its events carry
the initial namespace's PIDs). The kernel acknowledges a subscription it accepted, so "listening" here means
that acknowledgement came back: a subscription dropped in silence is polling, never believed.

The kernel filters by event kind (Linux 6.6, struct proc_input): only the kinds the sampler acts on are asked
for, so a fork bomb's forks and exits never reach the daemon. On older kernels every event comes and the others
are counted and dropped. (A filtered subscription gets no acknowledgement, the filter drops it too: the
subscription is made and acknowledged in the old form first, then narrowed.) Whatever comes, a drain reads at
most `max_events`; more pending, or a receive buffer that overran (ENOBUFS: events were lost), is an overrun,
and the caller re-reads everything it follows.

Our own reader rather than pyroute2's (pyroute2.netlink.connector.cn_proc), on measurement (bench/proc_connector,
bench/README.md "The kernel's proc connector"): in an interpreter that has what the daemon imports, pyroute2's
reader imports in 117-136 ms and its marshal decodes an event in 16-52 us into a dict of every field; this
module imports in 4-9 ms, decodes in 1-7 us, and the drain (receive included) costs ~2-3 us an event. The
format is three fixed C structs (nlmsghdr, cn_msg, proc_event), stable kernel ABI since 2.6.15.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
import time
from dataclasses import dataclass

NETLINK_CONNECTOR = 11  # include/uapi/linux/netlink.h
CN_IDX_PROC = 1  # include/uapi/linux/connector.h
CN_VAL_PROC = 1
NLMSG_DONE = 3
PROC_CN_MCAST_LISTEN = 1  # include/uapi/linux/cn_proc.h
PROC_CN_MCAST_IGNORE = 2

# proc_event.what
PROC_EVENT_NONE = 0x0  # the acknowledgement of a (un)subscription; its data is the error
PROC_EVENT_FORK = 0x1
PROC_EVENT_EXEC = 0x2
PROC_EVENT_UID = 0x4
PROC_EVENT_GID = 0x40
PROC_EVENT_SID = 0x80
PROC_EVENT_PTRACE = 0x100
PROC_EVENT_COMM = 0x200
PROC_EVENT_COREDUMP = 0x40000000
PROC_EVENT_EXIT = 0x80000000

# What the sampler acts on: a new program (exec), a new name (comm), a new owner (uid: the real uid it lists).
SAMPLER_KINDS = PROC_EVENT_EXEC | PROC_EVENT_COMM | PROC_EVENT_UID

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_HEAD = _NLMSGHDR.size + _CN_MSG.size  # 36: where proc_event starts
_DATA = _HEAD + _EVENT.size  # 52: where its event_data union starts
_IDS = struct.Struct("=II")  # (process_pid, process_tgid): the first words of exec, uid, gid, sid, comm, exit...
_FORK = struct.Struct("=IIII")  # parent_pid, parent_tgid, child_pid, child_tgid
_ACK_ERR = struct.Struct("=I")

MAX_EVENTS = 4096  # per drain (a sample): past it the caller re-reads everything instead
RCVBUF = 4 << 20  # bytes asked for the receive buffer (root may exceed rmem_max): some 5,000 events
# Seconds to wait for the kernel's acknowledgement: it is queued before send() returns (the kernel handles the
# message in the sender's context), so this is only the bound for a kernel that sends none.
ACK_WAIT = 0.5
_RECV = 65536  # one datagram is one event (under 100 bytes); the kernel never batches them


@dataclass(frozen=True, slots=True)
class Event:
    """One decoded event: its kind, and the process (thread group) it is about; a fork's is the child's."""

    kind: int
    tgid: int
    tid: int
    parent_tgid: int = 0  # forks only


@dataclass(frozen=True, slots=True)
class Drained:
    """What one drain read: the processes (tgids) with an event the caller asked for, the number of events
    read, and whether some were lost or left (the caller must then re-read everything it follows)."""

    pids: frozenset[int]
    events: int
    overrun: bool


def decode(data: bytes) -> Event | None:
    """One proc connector datagram as an Event; None for anything else (an acknowledgement, a short or foreign
    message)."""
    if len(data) < _DATA + _IDS.size:
        return None
    idx, val = _CN_MSG.unpack_from(data, _NLMSGHDR.size)[:2]
    if idx != CN_IDX_PROC or val != CN_VAL_PROC:
        return None
    what = _EVENT.unpack_from(data, _HEAD)[0]
    if what == PROC_EVENT_NONE:
        return None
    if what == PROC_EVENT_FORK:
        if len(data) < _DATA + _FORK.size:
            return None
        _ppid, ptgid, cpid, ctgid = _FORK.unpack_from(data, _DATA)
        return Event(what, ctgid, cpid, ptgid)
    tid, tgid = _IDS.unpack_from(data, _DATA)
    return Event(what, tgid, tid)


def _control(op: int, kinds: int | None, tag: int) -> bytes:
    """A subscription message: with `kinds` the 6.6 form (struct proc_input: op, event mask), else the old one.
    The kernel acknowledges it with ack = tag + 1 (cn_proc_ack), to every listener: the tag tells ours."""
    payload = struct.pack("=II", op, kinds) if kinds is not None else struct.pack("=I", op)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, tag, len(payload), 0) + payload
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, 0, 0) + cn


def _kernel_filters() -> bool:
    """Whether the kernel filters events by kind (Linux 6.6: struct proc_input). It does not say: a filtered
    subscription is not acknowledged, and an older kernel ignores one in silence."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 6)


class ProcEvents:
    """A subscription to the proc connector, read without blocking. open() says whether it listens."""

    def __init__(self, kinds: int = SAMPLER_KINDS, max_events: int = MAX_EVENTS, rcvbuf: int = RCVBUF) -> None:
        self.kinds = kinds
        self.max_events = max_events
        self._rcvbuf = rcvbuf
        self._sock: socket.socket | None = None
        self.filtered = False  # whether the kernel sends only `kinds` (Linux 6.6), or everything
        self.reason = "not opened"  # why it does not listen; "" while it does
        self.events = 0  # events read since open
        self.overruns = 0  # drains that lost or left events

    @property
    def listening(self) -> bool:
        return self._sock is not None

    def fileno(self) -> int:
        return self._sock.fileno() if self._sock is not None else -1

    def open(self) -> bool:
        """Subscribe; False (and `reason` says why) where the connector cannot be had."""
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_CONNECTOR)
        except OSError as e:  # RestrictAddressFamilies=, or a kernel without CONFIG_PROC_EVENTS
            self.reason = f"no netlink connector socket: {e.strerror or e}"
            return False
        try:
            with contextlib.suppress(OSError):  # SO_RCVBUFFORCE needs CAP_NET_ADMIN; the default serves too
                sock.setsockopt(socket.SOL_SOCKET, 33, self._rcvbuf)  # SO_RCVBUFFORCE
            sock.bind((0, CN_IDX_PROC))
            tag = os.getpid() & 0x7FFFFFF
            sock.send(_control(PROC_CN_MCAST_LISTEN, None, tag))
            err = self._wait_ack(sock, tag)
            if err == 0 and _kernel_filters():
                # Now the kinds: the kernel keeps them with the socket and sends nothing else, its
                # acknowledgements included (so the subscription itself was proven in the old form, above).
                sock.send(_control(PROC_CN_MCAST_LISTEN, self.kinds, tag))
                filtered = True
            else:
                filtered = False
        except OSError as e:  # ECONNREFUSED: a network namespace other than the initial one
            sock.close()
            self.reason = f"the proc connector refused: {e.strerror or e}" + (
                " (not the host's network namespace)" if e.errno == errno.ECONNREFUSED else ""
            )
            return False
        if err is None:
            sock.close()
            self.reason = "the kernel did not acknowledge the subscription (not the host's PID or user namespace)"
            return False
        if err:
            sock.close()
            self.reason = f"the kernel refused the subscription: {os.strerror(err)}"
            return False
        sock.setblocking(False)
        self.filtered = filtered
        self._sock = sock
        self.reason = ""
        return True

    @staticmethod
    def _wait_ack(sock: socket.socket, tag: int) -> int | None:
        """The error the kernel acknowledged the subscription `tag` with (0: accepted); None if none came.

        Events that come meanwhile (other listeners make the kernel send them) are skipped: the caller reads
        every process once after opening anyway."""
        poller = select.poll()  # not select(): the descriptor may be past FD_SETSIZE
        poller.register(sock, select.POLLIN)
        deadline = time.monotonic() + ACK_WAIT
        while (left := deadline - time.monotonic()) > 0:
            if not poller.poll(left * 1000):
                return None
            try:
                data = sock.recv(_RECV)
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    continue
                raise
            if len(data) < _DATA + _ACK_ERR.size:
                continue
            _idx, _val, _cseq, ack, _len, _flags = _CN_MSG.unpack_from(data, _NLMSGHDR.size)
            if _EVENT.unpack_from(data, _HEAD)[0] == PROC_EVENT_NONE and ack == tag + 1:
                return _ACK_ERR.unpack_from(data, _DATA)[0]
        return None

    def drain(self) -> Drained:
        """The events queued since the last drain, without waiting: at most max_events of them."""
        sock = self._sock
        if sock is None:
            return Drained(frozenset(), 0, False)
        pids: set[int] = set()
        kinds = self.kinds
        recv = sock.recv
        n = 0
        overrun = False
        unpack_what = _EVENT.unpack_from
        unpack_ids = _IDS.unpack_from
        while True:
            if n >= self.max_events:
                overrun = True  # a flood: what is left is dropped below, and everything is re-read
                break
            try:
                data = recv(_RECV)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # the buffer overran: events were lost
                    overrun = True
                    continue
                raise
            n += 1
            if len(data) < _DATA + _IDS.size:
                continue
            what = unpack_what(data, _HEAD)[0]
            if what & kinds:
                if what == PROC_EVENT_FORK:
                    pids.add(unpack_ids(data, _DATA + 8)[1])  # the child's thread group
                else:
                    pids.add(unpack_ids(data, _DATA)[1])  # the thread group: a thread's rename is its process's
        if overrun:
            self._discard()
            self.overruns += 1
        self.events += n
        return Drained(frozenset(pids), n, overrun)

    def _discard(self) -> None:
        """Drop what is queued, in bounded time: the caller re-reads everything, so none of it is needed. A flood
        that outruns the reading is cut off at a buffer's worth (the next drain tells whether it goes on)."""
        sock = self._sock
        assert sock is not None
        for _ in range(self.max_events * 4):
            try:
                sock.recv(_RECV)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.send(_control(PROC_CN_MCAST_IGNORE, None, 0))  # the kernel counts its listeners
            self._sock.close()
            self._sock = None
            self.reason = "closed"


OFF_SWITCH = "GPUKILLD_PROC_EVENTS"  # "off": poll even where the connector could be had (tests, a diagnosis)


def open_for(procfs_is_hosts: bool) -> ProcEvents:
    """The daemon's subscription, listening where it can be (see `reason` where not). Its PIDs are the host's,
    so it serves a sampler only when the proc root is this host's /proc."""
    events = ProcEvents()
    if os.environ.get(OFF_SWITCH, "").strip().lower() in ("off", "0", "no", "false"):
        events.reason = f"turned off by {OFF_SWITCH}={os.environ[OFF_SWITCH].strip()[:16]}"
    elif not procfs_is_hosts:
        events.reason = "the proc root is not this host's /proc"
    else:
        events.open()
    return events
