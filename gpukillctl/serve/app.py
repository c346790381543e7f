"""The one ASGI app `gpukillctl serve` runs: the REST API under /v1 and the MCP Streamable HTTP app at /mcp,
both behind the gate (gpukillctl/http/gate.py: token, Host and Origin, body size, requests in flight); and
`run`, which serves it with uvicorn on the socket server.py bound, each connection under
gpukillctl/http/protocol.py's request deadline and bound on connections.

Both apps reach gpukilld the same way, through `connect` and the typed client, as the server's user. The MCP
app keeps the SDK's own DNS-rebinding protection on, with the same hosts and origins as the gate, and its
bound on the request body and on sessions. Mounted here, its session manager is run by this app's lifespan
(Starlette does not run a mounted app's lifespan).
"""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import AsyncIterator, Iterable, Iterator

import uvicorn
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from gpukill.policy import MAX_POLICY_BYTES

from ..client.dbus import Connect
from ..http.gate import MCP_PATH, Gate
from ..http.protocol import MAX_CONNECTIONS, DeadlineProtocol
from .mcp import build_mcp
from .rest import build_rest

# A policy of MAX_POLICY_BYTES sent to /v1/guard/test as a JSON string, its newlines and quotes escaped, fits.
MAX_BODY = 2 * MAX_POLICY_BYTES + 4096
MAX_IN_FLIGHT = 16  # REST requests at once: each holds a bus connection, a kill up to its grace and more
MAX_MCP_SESSIONS = 16  # MCP sessions at once (an assistant keeps one open while it runs)
# uvicorn's own bound on connections and tasks together (503 past it), only a backstop: DeadlineProtocol keeps
# connections to MAX_CONNECTIONS by closing idle ones, and each connection runs one request at a time.
MAX_TASKS = 2 * MAX_CONNECTIONS


def build_app(
    connect: Connect, *, token: str, allowed_hosts: Iterable[str], allowed_origins: Iterable[str]
) -> Gate:
    hosts, origins = list(allowed_hosts), list(allowed_origins)
    mcp = build_mcp(connect)
    mcp_app = mcp.streamable_http_app(
        streamable_http_path=MCP_PATH,
        max_request_body_size=MAX_BODY,
        max_sessions=MAX_MCP_SESSIONS,
        transport_security=TransportSecuritySettings(
            enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins
        ),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with mcp.session_manager.run():
            yield

    inner = Starlette(
        routes=[Route(MCP_PATH, endpoint=mcp_app), Mount("/", app=build_rest(connect))], lifespan=lifespan
    )
    return Gate(
        inner,
        token=token,
        allowed_hosts=hosts,
        allowed_origins=origins,
        max_body=MAX_BODY,
        max_in_flight=MAX_IN_FLIGHT,
    )


class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT end the server gracefully and then `run` returns, so that the command can clean
        up (its token file): uvicorn's own version raises the signal again once the server stopped, which
        would end the process first."""
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(app: Gate, sock: socket.socket) -> bool:
    """Serve on the bound socket until SIGTERM or SIGINT; whether the server had started. No access log (the
    daemon's journal has every act, and a log of requests would hold what clients asked for), no server
    header, no proxy headers trusted, no websockets."""
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        http=DeadlineProtocol,
        ws="none",
        lifespan="on",
        limit_concurrency=MAX_TASKS,
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=5,
    )
    server = Server(config)
    server.run(sockets=[sock])
    return server.started
