"""uvicorn's HTTP/1.1 protocol (h11) with what `gpukillctl serve` needs of a connection: a deadline to receive
each request, and room kept for a real request however many connections sit idle.

uvicorn alone gives neither (measured with uvicorn 0.54, tests/test_serve_security.py): `timeout_keep_alive`
is armed only once a response is complete and disarmed by any byte received, so a connection that never
sends a request line, or sends its headers a byte at a time, or never finishes its body, is kept forever;
`limit_concurrency` counts those connections and answers 503 to every request past it, so 64 idle
connections, which anyone who can connect may open without a token, lock everyone out;
`h11_max_incomplete_event_size` bounds the size of the headers, not the time they take.

Here, then:
- A connection owes a request from the moment it is accepted, or its last response is complete, until the
  request's body has arrived whole (request line, headers and body): past `request_timeout` it is closed
  (an app still waiting for the body sees http.disconnect). A request being answered owes nothing: a kill
  with its grace, or an MCP event stream, takes as long as it takes.
- At most `max_connections` connections, shared fairly among their peers: when one more is accepted, a
  connection that owes a request (an idle keep-alive connection, a slow or silent client) is closed to make
  room, the one that has owed the longest of the peer holding the most connections, the new one counted. A
  peer is the user who owns the client's socket on loopback TCP, as the kernel says (sock_diag: a local user
  cannot pass for another), else the client's address; on the Unix socket, only the server's user (and
  root) can connect, and they are one peer. So a flood of connections that never finish their request
  closes only the flood's own: another user's fresh connection is never the one closed while the flooding
  user holds more (closing the oldest of all would let a flood of thousands of connections a second close
  every other client's before its request arrives). When the peers holding the most have no connection that
  owes a request, the new one gets 503 and is closed. Answering takes the token (the gate checks it before
  anything else), so only the token's holder can keep connections from being reclaimed.

The one class is given to uvicorn as its `http` protocol, so the server does not change with the packages
installed (uvicorn picks httptools over h11 when httptools is there).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol

from gpukill.kernel import sock_diag

from .gate import LOOPBACK_PREFIXES

REQUEST_TIMEOUT = 10.0  # seconds to receive a request whole: 2 MiB needs ~1.7 Mbit/s
MAX_CONNECTIONS = 64

_FULL = json.dumps(
    {"error": "ServiceUnavailable", "message": f"the server's {MAX_CONNECTIONS} connections are taken: try again"}
).encode()
FULL_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n\r\n%s" % (len(_FULL), _FULL)
)


class DeadlineProtocol(H11Protocol):
    request_timeout = REQUEST_TIMEOUT
    max_connections = MAX_CONNECTIONS

    # uvicorn's h11 protocol is a stream's: its transport is a Transport, where asyncio's type says BaseTransport
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.owing_since: float | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.peer = peer_of(transport)
        super().connection_made(transport)
        self._follow()
        self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        self._stop_deadline()  # the next request's time starts now
        super().on_response_complete()  # may start a pipelined request, or close the connection
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def owes_request(self) -> bool:
        """No request yet since the last answer, or one whose body is still arriving."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or cycle.more_body

    def _follow(self) -> None:
        if self.transport.is_closing():
            self._stop_deadline()
        elif self.owes_request():
            if self.deadline is None:
                self.owing_since = self.loop.time()
                self.deadline = self.loop.call_later(self.request_timeout, self._too_slow)
        else:
            self._stop_deadline()

    def _stop_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = None
        self.owing_since = None

    def _too_slow(self) -> None:
        self.deadline = None
        self.transport.close()

    def _make_room(self) -> None:
        if len(self.connections) <= self.max_connections:
            return
        open_ = [c for c in self.connections if isinstance(c, DeadlineProtocol) and not c.transport.is_closing()]
        held = Counter(c.peer for c in open_)
        waiting = [
            c for c in open_ if c is not self and c.owing_since is not None and held[c.peer] >= held[self.peer]
        ]  # never one of a peer holding fewer than the newcomer's
        if waiting:
            victim = min(waiting, key=lambda c: (-held[c.peer], c.peer != self.peer, c.owing_since))
            victim._stop_deadline()
            victim.transport.close()
            self.connections.discard(victim)  # gone now, though connection_lost comes on the next turn
            return
        self._stop_deadline()
        self.transport.write(FULL_RESPONSE)
        self.transport.close()
        self.connections.discard(self)


Peer = tuple[str, object]


def peer_of(transport: asyncio.BaseTransport) -> Peer:
    """Whom a connection counts against: ("uid", UID) for loopback TCP, the user owning the client's socket as
    the kernel says; ("address", ADDRESS) for TCP from elsewhere, or where the kernel no longer knows the
    socket (its client already closed it); ("local", "") on a Unix socket, whose clients are the server's user
    (and root)."""
    client, server = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if not isinstance(client, tuple) or not isinstance(server, tuple):
        return ("local", "")
    address = str(client[0])
    if address.startswith(LOOPBACK_PREFIXES):
        try:  # the client's end of the connection: its socket, and so its owner
            uid = sock_diag.owner((address, int(client[1])), (str(server[0]), int(server[1])))
        except OSError:  # no netlink socket to ask with
            uid = None
        if uid is not None:
            return ("uid", uid)
    return ("address", address)
