"""What every HTTP request to `gpukillctl serve` passes before the REST, MCP or dashboard app sees it.

On TCP (`--tcp`) every local user can reach the server, and a browser can be made to send requests there
(DNS rebinding, a page posting to localhost); the Unix socket of the default is the user's alone, and the same
gate stands in front of it (one rule for every client). A server running as alice must not let bob or a web
page act as alice. In order, each refusal a one-line JSON error ({"error", "message"}, as gpukillctl/serve/rest.py
answers) unless said otherwise:

1. who: `Authorization: Bearer TOKEN`, or the dashboard's session (gpukillctl/web/session.py), each
   compared in constant time (hmac.compare_digest), else 401; for a person opening the page (GET or HEAD of
   `/` or `/static/*`) the 401 is a small HTML page saying how to get in. A session is its cookie together
   with the page's half in the PAGE_HEADER header; the cookie alone, which a browser also hands to pages that
   other local users serve on other ports of the host, opens only the page's own files (`/`, `/static/*`).
   On loopback TCP a session's request must also come from a socket of the server's user (or root), as the
   kernel says (sock_diag): a secret replayed from another user's process counts for nothing, whatever the
   browser did. The one exception is the one-time link, `GET /login?code=CODE`, which is its own credential:
   after the Host check of 2 the gate answers it itself, 303 to `/#session=PAGE` (the page's half, in a
   fragment, which never leaves the browser) with the session cookie (HttpOnly; SameSite=Strict; Path=/), or
   a 403 HTML page;
2. the Host header must name this server (allowed_hosts), else 421; an Origin, when a browser sends one,
   must be one of allowed_origins, else 403 (the same rule as the MCP SDK's DNS-rebinding protection, which
   stays on behind this gate for /mcp too). A server on loopback (tunnel_ports) also answers a loopback
   address or localhost with any port, and an Origin that is exactly that Host's: what a browser at the end
   of `ssh -L LOCAL:127.0.0.1:PORT` sends. A DNS-rebinding page cannot send such a Host (its Host is its own
   name), and another port's page sends its own Origin, which is not the Host's;
3. cross-site: a request the cookie authenticated, whose method is not GET or HEAD, must carry an allowed
   Origin and `Content-Type: application/json`, else 403 CrossSite. SameSite=Strict already keeps the cookie
   off another site's requests; this is the second lock, and an HTML form can send neither. A bearer request
   is the token holder's own and is not asked;
4. the body: at most max_body bytes, declared (Content-Length) or counted as it arrives (chunked), else 413.
   The gate reads the whole body before the app sees any of it and hands it over in one message: the limit
   holds whatever the app does with the bytes (FastAPI turned an exception raised in its body parser into
   422, the MCP SDK into 500), and what reaches the app is a complete body or nothing. Only after 1, so only
   an authenticated client can make the server hold max_body bytes (a chunked body is counted while the
   request holds its place under 5);
5. at most max_in_flight requests at once outside the long_lived paths, else 429 at once (never queued). A
   long-lived path (/mcp, the dashboard's /ui/stream) holds its response open for as long as its client
   stays, so it is bounded by its own app (the SDK's limit of sessions, the hub's of subscribers).

`POST /login/link`, with the bearer token only (a cookie does not count there: a page must not mint logins),
is answered by the gate too: {"url": BASE/login?code=CODE}, a fresh one-time link to a running server.

Every response, the gate's own refusals too, carries the dashboard's security headers (SECURITY_HEADERS: a
Content-Security-Policy that allows no inline script and nothing from elsewhere, no framing, no sniffing, no
referrer) and `Cache-Control: no-store` except under /static/, whose files the pages app marks itself.

Pure ASGI and standard library only: nothing here depends on the web framework behind it. Anything but http
and lifespan (a websocket) is closed unanswered: nothing here serves one.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Protocol
from urllib.parse import parse_qs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Sessions(Protocol):
    """The dashboard's logins, as the gate asks them (gpukillctl/web/session.py's Sessions)."""

    def new_code(self) -> str: ...
    def redeem(self, code: str) -> Login | None: ...
    def valid(self, cookie: str | None, page: str | None = None, *, page_files: bool = False) -> bool: ...


class Login(Protocol):  # read-only: a login's secrets never change
    @property
    def cookie(self) -> str: ...
    @property
    def page(self) -> str: ...


PeerOwner = Callable[[tuple[str, int], tuple[str, int]], "int | None"]

MCP_PATH = "/mcp"
LOGIN_PATH = "/login"
LINK_PATH = "/login/link"
PAGE_HEADER = "x-gpukill-session"  # a session's page half, from its origin's storage (static/session.js)
PAGE_FRAGMENT = "session"  # the login's redirect, /#session=SECRET, hands the page its half
LOOPBACK_PREFIXES = ("127.", "::1", "::ffff:127.")
# A loopback address or localhost, with a port: the Host a browser sends through an ssh tunnel's local end.
_TUNNEL_HOST = re.compile(r"(?:127(?:\.(?:25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])){3}|localhost|\[::1\]):[0-9]{1,5}")
STATIC_PREFIX = "/static/"
SAFE_METHODS = ("GET", "HEAD")

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "worker-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",  # the one-time code in the URL goes nowhere else
    "x-frame-options": "DENY",
}

_HOW_TO_GET_IN = (
    "run <code>gpukillctl serve --open</code>, or open the one-time link <code>gpukillctl serve</code> printed "
    "when it started (a server already running: <code>POST /login/link</code> with its token answers a new one)"
)
# No script, no style, nothing loaded: these pages are answered before anyone is known.
LOGIN_NEEDED_PAGE = (
    '<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>gpukill: log in</title></head>\n'
    f"<body><h1>gpukill</h1><p>This dashboard needs you to log in: {_HOW_TO_GET_IN}.</p></body></html>\n"
).encode()
LINK_USED_PAGE = (
    '<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>gpukill: link not valid</title>'
    "</head>\n<body><h1>gpukill</h1><p>This link was used or has expired: a one-time link logs in once, "
    f"within 10 minutes. For a new one, {_HOW_TO_GET_IN}.</p></body></html>\n"
).encode()


class Gate:
    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str,
        allowed_hosts: Iterable[str],
        allowed_origins: Iterable[str],
        max_body: int,
        max_in_flight: int,
        sessions: Sessions | None = None,
        cookie: str = "",
        base_url: str = "http://localhost",
        long_lived: tuple[str, ...] = (MCP_PATH,),
        peer_owner: PeerOwner | None = None,
        owners: Iterable[int] = (),
        tunnel_ports: bool = False,
    ) -> None:
        self.app = app
        self.token = token.encode()
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.allowed_origins = frozenset(o.lower() for o in allowed_origins)
        self.max_body = max_body
        self.max_in_flight = max_in_flight
        self.sessions = sessions if cookie else None  # None: no dashboard logins, the token only
        self.cookie = cookie  # the session cookie's name (gpukillctl/web/session.py: cookie_name)
        self.base_url = base_url.rstrip("/")
        self.long_lived = long_lived
        self.in_flight = 0
        self.peer_owner = peer_owner  # who owns a loopback client's socket; None: not asked (the Unix socket)
        self.owners = frozenset(owners)  # the uids whose sockets may use a session
        self.tunnel_ports = tunnel_ports  # a loopback Host with any port (rule 2)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1008})
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        send = _with_headers(send, cache=not path.startswith(STATIC_PREFIX))
        headers = _headers(scope)
        if method == "GET" and path == LOGIN_PATH:
            await self.login(scope, headers, send)
            return
        bearer = self.token_ok(headers.get("authorization"))
        page_files = method in SAFE_METHODS and (path == "/" or path.startswith(STATIC_PREFIX))
        by_cookie = not bearer and self.session_ok(headers, page_files)
        refusal = self.refusal(headers, bearer or by_cookie)
        if refusal is None and by_cookie:
            refusal = self.peer_refusal(scope) or self.cross_site(method, path, headers)
        if refusal is not None:
            if refusal[0] == 401 and page_files:
                await _respond_html(send, 401, LOGIN_NEEDED_PAGE)  # a person opening the page
            else:
                await _respond(send, *refusal)
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _respond(send, 413, "PayloadTooLarge", f"the body is larger than {self.max_body} bytes")
            return
        if method == "POST" and path == LINK_PATH and self.sessions is not None:
            await self.new_link(send)
            return
        bounded = not self.is_long_lived(path)
        if bounded and self.in_flight >= self.max_in_flight:
            await _respond(
                send,
                429,
                "TooManyRequests",
                f"{self.max_in_flight} requests are in progress: try again",
                {"retry-after": "1"},
            )
            return
        self.in_flight += int(bounded)
        try:
            await self._forward(scope, receive, send)
        finally:
            self.in_flight -= int(bounded)

    def refusal(self, headers: dict[str, str], known: bool) -> tuple[int, str, str, dict[str, str]] | None:
        """Why the request is refused before anything else looks at it, or None; known: the token or a
        session cookie authenticated it."""
        if not known:
            return (
                401,
                "Unauthorized",
                "this server needs its token: Authorization: Bearer TOKEN",
                {"www-authenticate": "Bearer"},
            )
        return self.host_refusal(headers)

    def host_refusal(self, headers: dict[str, str]) -> tuple[int, str, str, dict[str, str]] | None:
        host = headers.get("host", "").lower()
        tunnel = self.tunnel_ports and _TUNNEL_HOST.fullmatch(host) is not None
        if host not in self.allowed_hosts and not tunnel:
            return (
                421,
                "BadHost",
                "the Host header does not name this server (through a tunnel: ssh -L "
                "LOCAL:127.0.0.1:PORT, then open the link on 127.0.0.1:LOCAL; another name: --allow-host)",
                {},
            )
        origin = headers.get("origin")
        if (
            origin is not None
            and origin.lower() not in self.allowed_origins
            and not (tunnel and origin.lower() == f"http://{host}")
        ):
            return 403, "BadOrigin", "requests from this Origin are not allowed", {}
        return None

    def cross_site(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str, str, dict] | None:
        """A cookie-authenticated change must come from this server's own page (rule 3)."""
        if method in SAFE_METHODS:
            return None
        if path == LINK_PATH:  # the cookie does not mint logins: the token's holder does
            return (
                401,
                "Unauthorized",
                "a new login link needs the token: Authorization: Bearer TOKEN",
                {"www-authenticate": "Bearer"},
            )
        content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if headers.get("origin") is None or content_type != "application/json":
            return (
                403,
                "CrossSite",
                "a change made with the session cookie needs this server's Origin and Content-Type: application/json",
                {},
            )
        return None

    def token_ok(self, authorization: str | None) -> bool:
        scheme, _, given = (authorization or "").partition(" ")
        # compare_digest takes as long whatever the first differing byte: no guessing the token byte by byte
        return hmac.compare_digest(given.strip().encode(), self.token) and scheme.lower() == "bearer"

    def session_ok(self, headers: dict[str, str], page_files: bool) -> bool:
        """The session's cookie, and with it the page's header unless the request is for the page's files."""
        header = headers.get("cookie")
        if self.sessions is None or not header:
            return False
        page = headers.get(PAGE_HEADER)
        values = [
            v.strip() for name, _, v in (p.partition("=") for p in header.split(";")) if name.strip() == self.cookie
        ]
        return any([self.sessions.valid(v, page, page_files=page_files) for v in values])

    def peer_refusal(self, scope: Scope) -> tuple[int, str, str, dict[str, str]] | None:
        """A session's request from a loopback socket that another user owns (rule 1), or whose owner the kernel
        no longer knows."""
        client, server = scope.get("client"), scope.get("server")
        if self.peer_owner is None or not client or not server or not str(client[0]).startswith(LOOPBACK_PREFIXES):
            return None
        uid = self.peer_owner((str(client[0]), int(client[1])), (str(server[0]), int(server[1])))
        if uid is not None and uid in self.owners:
            return None
        return (
            403,
            "NotYourSession",
            "this session belongs to the server's user: the request came from another user's process",
            {},
        )

    def is_long_lived(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in self.long_lived)

    async def login(self, scope: Scope, headers: dict[str, str], send: Send) -> None:
        """The one-time link: a session for a valid code (used up), else the 403 page."""
        refusal = self.host_refusal(headers)
        if refusal is not None:
            await _respond(send, *refusal)
            return
        codes = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("code", [])
        login = self.sessions.redeem(codes[0]) if self.sessions is not None and len(codes) == 1 else None
        if login is None:
            await _respond_html(send, 403, LINK_USED_PAGE)
            return
        cookie = f"{self.cookie}={login.cookie}; HttpOnly; SameSite=Strict; Path=/"  # no Max-Age: the browser's session
        location = f"/#{PAGE_FRAGMENT}={login.page}"
        raw = [(b"location", location.encode()), (b"set-cookie", cookie.encode()), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 303, "headers": raw})
        await send({"type": "http.response.body", "body": b""})

    async def new_link(self, send: Send) -> None:
        assert self.sessions is not None
        body = json.dumps({"url": f"{self.base_url}{LOGIN_PATH}?code={self.sessions.new_code()}"}).encode()
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": body})

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, given the whole body at once (413 past max_body; nothing if the client went away)."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect: nobody to answer
                return
            body += message.get("body", b"")
            if len(body) > self.max_body:
                await _respond(send, 413, "PayloadTooLarge", f"the body is larger than {self.max_body} bytes")
                return
            if not message.get("more_body", False):
                break
        delivered = False

        async def replay() -> Message:
            """The body, then what the client does next (a disconnect, which streaming responses wait for)."""
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


def _with_headers(send: Send, *, cache: bool) -> Send:
    """send, with the security headers (and no-store unless cache is the app's to say) on the response's start,
    replacing any the app set under the same names."""
    ours = dict(SECURITY_HEADERS, **({"cache-control": "no-store"} if cache else {}))
    raw_ours = [(k.encode(), v.encode()) for k, v in ours.items()]

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", ()) if k.decode("latin-1").lower() not in ours]
            message = {**message, "headers": kept + raw_ours}
        await send(message)

    return sending


def _headers(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name; a header sent twice counts as absent (which one would the
    app read?), so two Authorization or Host headers are refused like none."""
    seen: dict[str, str | None] = {}
    for raw_name, raw_value in scope.get("headers", ()):
        name = raw_name.decode("latin-1").lower()
        seen[name] = None if name in seen else raw_value.decode("latin-1")
    return {k: v for k, v in seen.items() if v is not None}


async def _respond(send: Send, status: int, name: str, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": name, "message": message}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def _respond_html(send: Send, status: int, page: bytes) -> None:
    raw = [(b"content-type", b"text/html; charset=utf-8"), (b"content-length", str(len(page)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": page})
