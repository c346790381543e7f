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
- At most `max_connections` connections: when one more is accepted, the connection that has owed a request
  the longest is closed to make room (an idle keep-alive connection, a slow or silent client); when every
  connection is being answered, the new one gets 503 and is closed. An idle flood can then delay a real
  client by nothing more than the time it takes to accept it. Answering takes the token (the gate checks
  it before anything else), so only the token's holder can keep connections from being reclaimed.

The one class is given to uvicorn as its `http` protocol, so the server does not change with the packages
installed (uvicorn picks httptools over h11 when httptools is there).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT = 10.0  # seconds to receive a request whole: 2 MiB needs ~1.7 Mbit/s
MAX_CONNECTIONS = 64

_FULL = json.dumps(
    {"error": "ServiceUnavailable", "message": f"{MAX_CONNECTIONS} requests are being answered: try again"}
).encode()
FULL_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n\r\n%s" % (len(_FULL), _FULL)
)


class DeadlineProtocol(H11Protocol):
    request_timeout = REQUEST_TIMEOUT
    max_connections = MAX_CONNECTIONS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.owing_since: float | None = None
        self.deadline: asyncio.TimerHandle | None = None
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
        waiting = [
            c
            for c in self.connections
            if c is not self and isinstance(c, DeadlineProtocol) and c.owing_since is not None
            and not c.transport.is_closing()
        ]
        if waiting:
            oldest = min(waiting, key=lambda c: c.owing_since)
            oldest._stop_deadline()
            oldest.transport.close()
            self.connections.discard(oldest)  # gone now, though connection_lost comes on the next turn
            return
        self._stop_deadline()
        self.transport.write(FULL_RESPONSE)
        self.transport.close()
        self.connections.discard(self)
