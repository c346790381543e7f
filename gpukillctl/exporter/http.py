"""The exporter's HTTP side: /metrics served on the exporter's event loop, bounded, no thread per connection.

prometheus_client's own server (start_http_server) starts a thread for every connection and waits for its
request without a deadline: N idle connections are N threads, and they last. Here a connection is a coroutine
on the loop that also reads the daemon, bounded three ways:
- at most MAX_CONNECTIONS open at once; one more is answered 503 at once and closed (Prometheus retries at its
  next scrape; no client waits on a queue that an idle crowd fills);
- its request head (request line and headers, at most MAX_HEAD bytes) must have arrived HEAD_DEADLINE seconds
  after it connected, and the answer must be taken within WRITE_DEADLINE: an idle or slow client is closed;
- the exposition is rendered by a fixed pool of RENDER_THREADS threads (the only threads the server has), so
  that a large --per-process page does not hold the loop.
One request per connection (`Connection: close`): Prometheus connects again at its next scrape.

The content type follows the Accept header as prometheus_client's server chooses it (choose_encoder: the text
format, or OpenMetrics), and the page is gzipped when the client accepts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

MAX_CONNECTIONS = 256  # open at once (an idle one costs a socket and a coroutine); a scrape needs one
MAX_HEAD = 16 * 1024  # bytes of request line and headers; a scrape's are a few hundred
HEAD_DEADLINE = 5.0  # seconds from connecting to the end of the request head
WRITE_DEADLINE = 10.0  # seconds for the client to take the answer
RENDER_THREADS = 2
PATHS = ("/metrics", "/")
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def gzip_wanted(accept_encoding: str) -> bool:
    for part in accept_encoding.split(","):
        name, _, params = part.partition(";")
        if name.strip().lower() == "gzip" and params.replace(" ", "").lower() not in ("q=0", "q=0.0", "q=0.00"):
            return True
    return False


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]] | None:
    """(method, path, headers lowercased) of an HTTP/1.x request head, or None if it is not one."""
    lines = head.decode("latin-1").split("\r\n")  # every byte is a latin-1 character: no decoding error
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    method, target, _ = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            return None
        headers[name.lower()] = value.strip()
    return method, target.split("?", 1)[0], headers


class MetricsServer:
    """Serves at /metrics what render(reading, Accept header) -> (body, content type) makes, in a pool thread,
    of the reading that `reading()` awaits (the reader's cache)."""

    def __init__(self, reading: Callable[[], Awaitable[object]], render: Callable[[object, str], tuple[bytes, str]]):
        self.reading = reading
        self.render = render
        self.open = 0
        self.pool = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="metrics-render")
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._connection, host, port, limit=MAX_HEAD, reuse_address=True)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        full = self.open >= MAX_CONNECTIONS
        self.open += 1
        try:
            if full:
                await self._answer(writer, 503, b"too many connections; try again\n")
            else:
                await self._serve(reader, writer)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away, or took too long: nothing to answer
        finally:
            self.open -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_DEADLINE)
        except (asyncio.LimitOverrunError, ValueError):
            await self._answer(writer, 431, b"request head too large\n")
            return
        request = parse_head(head[:-4])
        if request is None:
            await self._answer(writer, 400, b"not an HTTP/1.x request\n")
            return
        method, path, headers = request
        if method not in ("GET", "HEAD"):
            await self._answer(writer, 405, b"GET or HEAD only\n", [("Allow", "GET, HEAD")])
            return
        if path not in PATHS:
            await self._answer(writer, 404, b"metrics are at /metrics\n")
            return
        reading = await self.reading()
        loop = asyncio.get_running_loop()
        wants_gzip = gzip_wanted(headers.get("accept-encoding", ""))

        def render() -> tuple[bytes, str]:
            body, content_type = self.render(reading, headers.get("accept", ""))
            return (gzip.compress(body) if wants_gzip else body), content_type

        body, content_type = await loop.run_in_executor(self.pool, render)
        extra = [("Content-Type", content_type)] + ([("Content-Encoding", "gzip")] if wants_gzip else [])
        await self._answer(writer, 200, body, extra, send_body=method == "GET")

    @staticmethod
    async def _answer(
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        headers: list[tuple[str, str]] | None = None,
        send_body: bool = True,
    ) -> None:
        headers = headers or [("Content-Type", "text/plain; charset=utf-8")]
        lines = [
            f"HTTP/1.1 {status} {REASONS[status]}",
            *(f"{k}: {v}" for k, v in headers),
            f"Content-Length: {len(body)}",
            "Connection: close",
            "",
            "",
        ]
        writer.write("\r\n".join(lines).encode("latin-1") + (body if send_body else b""))
        await asyncio.wait_for(writer.drain(), WRITE_DEADLINE)
