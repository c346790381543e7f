"""Fake mining pools on loopback for the audit's socket tests: listeners on a pool port, where connections
complete in the backlog (nobody needs to accept them).

A pool port must lie outside the host's ephemeral range (net.ipv4.ip_local_port_range): the audit ignores pool
ports inside it (gpukilld/rogue/sockets.py). 127.0.0.0/8 is all loopback, so when 127.0.0.1:PORT is taken (another
test run on the machine) the listener takes the same port on another loopback address.
"""

from __future__ import annotations

import contextlib
import random
import socket

from gpukilld.audit_settings import ephemeral_range


def listen(port: int, backlog: int = 64) -> socket.socket:
    """A listener on PORT of 127.0.0.1, or of another 127.x.y.z when that one is taken."""
    for n in range(64):
        address = "127.0.0.1" if n == 0 else f"127.{random.randrange(1, 255)}.0.{random.randrange(1, 255)}"
        s = socket.socket()
        try:
            s.bind((address, port))
        except OSError:
            s.close()
            continue
        s.listen(backlog)
        return s
    raise RuntimeError(f"no loopback address has port {port} free")


def free_pool_port() -> int:
    """A TCP port outside the ephemeral range that no socket of 127.0.0.1 holds now."""
    span = ephemeral_range() or (32768, 60999)
    low, high = (20000, span[0] - 1) if span[0] > 20000 else (span[1] + 1, 65535)
    for _ in range(256):
        port = random.randint(low, high)
        with contextlib.closing(socket.socket()) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port outside the ephemeral range")
