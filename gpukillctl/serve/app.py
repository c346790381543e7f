"""The one ASGI app `gpukillctl serve` runs, behind the gate (gpukillctl/http/gate.py: token or session
cookie, Host and Origin, cross-site changes, body size, requests in flight, the security headers); and `run`,
which serves it with uvicorn on the socket server.py bound, each connection under gpukillctl/http/protocol.py's
request deadline and bound on connections.

Mounted in this order (the first that matches answers): the MCP Streamable HTTP app at /mcp; the dashboard's
live hub (/ui/hosts, /ui/stream: gpukillctl/web/hub.py); the REST API of each other host of the dashboard at
/hosts/ID/v1 (one build_rest per host, reaching that host's gpukilld over ssh); the dashboard's page and
assets (/, /static/NAME: gpukillctl/web/pages.py); then the REST API of this machine under /v1.

Every app reaches gpukilld the same way, through a Connect and the typed client, as the server's user, so the
daemon's polkit decides and its journal records whatever a page, a REST client or an assistant asks. The MCP
app keeps the SDK's own DNS-rebinding protection on, with the same hosts and origins as the gate, and its
bound on the request body and on sessions. Mounted here, its session manager is run by this app's lifespan
(Starlette does not run a mounted app's lifespan), which also stops the hub's feeds at exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator, Iterable, Iterator

import uvicorn
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from gpukill.policy import MAX_POLICY_BYTES

from ..client.dbus import Connect
from ..http.gate import MCP_PATH, Gate, PeerOwner
from ..http.protocol import MAX_CONNECTIONS, DeadlineProtocol
from ..web.hosts import HostSpec, local_host
from ..web.hub import Hub
from ..web.pages import page_routes
from ..web.session import COOKIE, Sessions
from .mcp import build_mcp
from .rest import build_rest

# A policy of MAX_POLICY_BYTES sent to /v1/guard/test as a JSON string, its newlines and quotes escaped, fits.
MAX_BODY = 2 * MAX_POLICY_BYTES + 4096
MAX_IN_FLIGHT = 16  # REST requests at once: each holds a bus connection, a kill up to its grace and more
MAX_MCP_SESSIONS = 16  # MCP sessions at once (an assistant keeps one open while it runs)
# uvicorn's own bound on connections and tasks together (503 past it), only a backstop: DeadlineProtocol keeps
# connections to MAX_CONNECTIONS by closing idle ones, and each connection runs one request at a time.
MAX_TASKS = 2 * MAX_CONNECTIONS
# Responses that stay open for their client's whole visit, outside the gate's MAX_IN_FLIGHT: an MCP session's
# event stream (bounded by MAX_MCP_SESSIONS) and the dashboard's event stream (bounded by the hub's subscribers).
STREAM_PATH = "/ui/stream"
LONG_LIVED = (MCP_PATH, STREAM_PATH)
# asyncio accepts up to its server's backlog of connections in one turn of its loop, before DeadlineProtocol sees
# any of them. Under a flood of new connections, a batch as large as uvicorn's default backlog (2048) makes each
# turn long, and every step of a real request waits for a whole turn; and each connection of a batch is an open
# file until it is seen and closed: three batches (accepted, being seen, being closed) exceed the 1024 files
# systemd allows by default, and accept() fails with EMFILE, after which asyncio accepts nobody for a second.
# So a small batch, and a long queue in the kernel (LISTEN_QUEUE, within net.core.somaxconn), which costs no
# open file: a connection that finds the queue full waits for its SYN's resend, a second, whoever's it is.
ACCEPT_BATCH = MAX_CONNECTIONS
LISTEN_QUEUE = 4096


def build_app(
    connect: Connect,
    *,
    token: str,
    allowed_hosts: Iterable[str],
    allowed_origins: Iterable[str],
    hosts: list[HostSpec] | None = None,
    sessions: Sessions | None = None,
    cookie: str = COOKIE,
    base_url: str = "http://localhost",
    peer_owner: PeerOwner | None = None,
    tunnel_ports: bool = False,
) -> Gate:
    """The app for this machine's gpukilld (connect) and the dashboard's hosts (host 0 first: this machine);
    sessions: the dashboard's logins, whose codes server.py prints or opens; base_url: where clients reach the
    server, for the one-time links POST /login/link makes; peer_owner: who owns a loopback client's socket (TCP),
    so that a session counts only from the server's user (or root); tunnel_ports: a server on loopback, which
    also answers the Host of an ssh tunnel's local end (gpukillctl/http/gate.py, rule 2)."""
    allowed, origins = list(allowed_hosts), list(allowed_origins)
    shown = hosts if hosts is not None else [local_host()]
    mcp = build_mcp(connect)
    mcp_app = mcp.streamable_http_app(
        streamable_http_path=MCP_PATH,
        max_request_body_size=MAX_BODY,
        max_sessions=MAX_MCP_SESSIONS,
        transport_security=TransportSecuritySettings(
            enable_dns_rebinding_protection=True, allowed_hosts=allowed, allowed_origins=origins
        ),
    )
    hub = Hub(shown)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            async with mcp.session_manager.run():
                yield
        finally:
            await hub.aclose()

    remote_rest = [Mount(f"/hosts/{host.id}", app=build_rest(host.connect)) for host in shown if host.id != 0]
    inner = Starlette(
        routes=[
            Route(MCP_PATH, endpoint=mcp_app),
            *hub.routes,
            *remote_rest,
            *page_routes(),
            Mount("/", app=build_rest(connect)),
        ],
        lifespan=lifespan,
        # Starlette calls it with the HTTPException it is registered for; its type says any Exception
        exception_handlers={HTTPException: _http_error},  # type: ignore[dict-item]
    )
    return Gate(
        inner,
        token=token,
        allowed_hosts=allowed,
        allowed_origins=origins,
        max_body=MAX_BODY,
        max_in_flight=MAX_IN_FLIGHT,
        sessions=sessions if sessions is not None else Sessions(),
        cookie=cookie,
        base_url=base_url,
        long_lived=LONG_LIVED,
        peer_owner=peer_owner,
        owners=(os.getuid(), 0),
        tunnel_ports=tunnel_ports,
    )


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    """A path no app takes (Mount("/") does not match a path holding a newline) in the JSON of every error."""
    names = {404: "NotFound", 405: "MethodNotAllowed"}
    return JSONResponse(
        {"error": names.get(e.status_code, "HTTPError"), "message": str(e.detail)},
        status_code=e.status_code,
        headers=e.headers,
    )


class Server(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, then the listening sockets' queue lengthened to LISTEN_QUEUE: asyncio set it to the
        backlog, which is also its batch of accepts (ACCEPT_BATCH)."""
        await super().startup(sockets)
        for sock in sockets or ():
            sock.listen(LISTEN_QUEUE)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM, SIGINT and SIGHUP (the terminal or the ssh session that ran it went away) end the server
        gracefully and then `run` returns, so that the command can clean up (its token file): uvicorn's own
        version raises the signal again once the server stopped, which would end the process first."""
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(app: Gate, sock: socket.socket) -> bool:
    """Serve on the bound socket until SIGTERM, SIGINT or SIGHUP; whether the server had started. No access log (the
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
        backlog=ACCEPT_BATCH,
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=5,
    )
    server = Server(config)
    server.run(sockets=[sock])
    return server.started
