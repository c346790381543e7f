"""What every HTTP request to `gpukillctl serve` passes before the REST or MCP app sees it.

On TCP (`--tcp`) every local user can reach the server, and a browser can be made to send requests there
(DNS rebinding, a page posting to localhost); the Unix socket of the default is the user's alone, and the same
gate stands in front of it (one rule for every client). A server running as alice must not let bob or a web
page act as alice. In order, each refusal a one-line JSON error ({"error", "message"}, as gpukillctl/serve/rest.py
answers):

1. the token: `Authorization: Bearer TOKEN`, compared in constant time (hmac.compare_digest), else 401;
2. the Host header must name this server (allowed_hosts), else 421; an Origin, when a browser sends one,
   must be one of allowed_origins, else 403 (the same rule as the MCP SDK's DNS-rebinding protection, which
   stays on behind this gate for /mcp too);
3. the body: at most max_body bytes, declared (Content-Length) or counted as it arrives (chunked), else 413.
   The gate reads the whole body before the app sees any of it and hands it over in one message: the limit
   holds whatever the app does with the bytes (FastAPI turned an exception raised in its body parser into
   422, the MCP SDK into 500), and what reaches the app is a complete body or nothing. Only after the token
   passed, so only its holder can make the server hold max_body bytes (a chunked body is counted while the
   request holds its place under 4);
4. at most max_in_flight requests at once outside /mcp, else 429 at once (never queued). /mcp is bounded by
   the SDK's own limit of sessions, since an MCP session's event stream stays open for its whole life.

Pure ASGI and standard library only: nothing here depends on the web framework behind it. Anything but http
and lifespan (a websocket) is closed unanswered: nothing here serves one.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MCP_PATH = "/mcp"


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
    ) -> None:
        self.app = app
        self.token = token.encode()
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.allowed_origins = frozenset(o.lower() for o in allowed_origins)
        self.max_body = max_body
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = _headers(scope)
        refusal = self.refusal(headers)
        if refusal is not None:
            await _respond(send, *refusal)
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _respond(send, 413, "PayloadTooLarge", f"the body is larger than {self.max_body} bytes")
            return
        bounded = not _is_mcp(scope.get("path", ""))
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

    def refusal(self, headers: dict[str, str]) -> tuple[int, str, str, dict[str, str]] | None:
        """Why the request is refused before anything else looks at it, or None."""
        if not self.token_ok(headers.get("authorization")):
            return (
                401,
                "Unauthorized",
                "this server needs its token: Authorization: Bearer TOKEN",
                {"www-authenticate": "Bearer"},
            )
        if headers.get("host", "").lower() not in self.allowed_hosts:
            return 421, "BadHost", "the Host header does not name this server", {}
        origin = headers.get("origin")
        if origin is not None and origin.lower() not in self.allowed_origins:
            return 403, "BadOrigin", "requests from this Origin are not allowed", {}
        return None

    def token_ok(self, authorization: str | None) -> bool:
        scheme, _, given = (authorization or "").partition(" ")
        # compare_digest takes as long whatever the first differing byte: no guessing the token byte by byte
        return hmac.compare_digest(given.strip().encode(), self.token) and scheme.lower() == "bearer"

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


def _is_mcp(path: str) -> bool:
    return path == MCP_PATH or path.startswith(MCP_PATH + "/")


def _headers(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name; a header sent twice counts as absent (which one would the
    app read?), so two Authorization or Host headers are refused like none."""
    seen: dict[str, str | None] = {}
    for raw_name, raw_value in scope.get("headers", ()):
        name = raw_name.decode("latin-1").lower()
        seen[name] = None if name in seen else raw_value.decode("latin-1")
    return {k: v for k, v in seen.items() if v is not None}


async def _respond(
    send: Send, status: int, name: str, message: str, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps({"error": name, "message": message}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
