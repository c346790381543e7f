"""The dashboard's live data: one feed per host, pushed to every open page as Server-Sent Events.

Thirty-two open tabs must cost gpukilld no more than one: so the pages never list, the hub does. Per host one
bus connection (over ssh for a remote host), started when the first page subscribes and stopped LINGER after
the last leaves (a reload does not reconnect); on each SnapshotChanged (client.snapshot_changes(), spread as
every observer's is) ONE list_devices(), ONE list_processes() and ONE list of the suspended processes, turned
into the host's view and JSON-encoded once, and the same bytes handed to every subscriber; ProcessSuspended and
ProcessResumed list again too (a suspended process leaves the GPU's lists a sample before gpukilld records it
suspended). gpukilld's other signals go out as `signal` events.

A subscriber never holds the hub up: it keeps the newest view of each host and at most MAX_SIGNALS signals
(the oldest go), and its own task writes them as fast as its page reads. A host that does not answer is
`down` with its one-line error and retried with backoff, in its own task: the other hosts go on. At most
MAX_SUBSCRIBERS streams at once (503 past it): each holds a connection of the server's.

Everything a process or a host chose (names, command lines, error texts) goes out as JSON strings, never
markup: the page sets them as text.

GET /ui/hosts   {"hosts": [{"id", "name", "api"}]}
GET /ui/stream  text/event-stream: `host` events (a HostView), `signal` events, `: ping` every PING seconds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gpukill.procstat import seconds_since_start
from gpukill.records.base import to_plain
from gpukill.records.manager import Device, Process
from gpukill.records.signals import ProcessResumed, ProcessSuspended, SnapshotChanged
from gpukill.records.suspend import SuspendedProcess

from ..client.dbus import DaemonUnavailable, GpukillClient
from ..client.format import user_name
from ..http.protocol import MAX_CONNECTIONS
from .hosts import HostSpec

# Each stream holds one of the server's connections for its whole life (gpukillctl/http/protocol.py does not
# reclaim a connection being answered): past this many, the rest are kept for REST and MCP requests. With the
# page's SharedWorker a browser holds one stream, whatever its number of tabs.
MAX_SUBSCRIBERS = MAX_CONNECTIONS - 16
MAX_SIGNALS = 256  # per subscriber; a page slower than that loses the oldest (it still gets every view)
LINGER = 30.0  # seconds a feed outlives its last subscriber: a page reloaded does not cost a new connection
PING = 15.0  # seconds between comment lines on a quiet stream: proxies and browsers keep it open
BACKOFF_FIRST, BACKOFF_MAX = 2.0, 60.0  # retrying a host that is down: doubling from the first to the last
SIGNAL_TYPES = (
    "ProcessKilled",
    "ProcessSuspended",
    "ProcessResumed",
    "DeviceReset",
    "DeviceStateChanged",
    "PolicyViolated",
    "GuardActionTaken",
    "Notification",
)


def sse(event: str, data: Any) -> bytes:
    """One Server-Sent Event. JSON escapes every line break, so the data is one `data:` line whatever it holds."""
    return b"event: %s\ndata: %s\n\n" % (event.encode(), json.dumps(data, separators=(",", ":")).encode())


PING_EVENT = b": ping\n\n"


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


class IdleClock:
    """How long each process has held GPU memory at 0% utilization without a break, as the hub's listings saw it
    (as of each listing: the page adds the time since). Keyed by (pid, start time, device): a pid reused, or the
    same process on another GPU, starts anew. Only the processes of the last listing are kept."""

    def __init__(self) -> None:
        self.since: dict[tuple[int, int, int], float] = {}

    def update(self, processes: Iterable[Process], now: float) -> list[float | None]:
        since: dict[tuple[int, int, int], float] = {}
        out: list[float | None] = []
        for p in processes:
            if p.gpu_utilization == 0 and p.gpu_memory:  # None (unknown) is not idle
                key = (p.pid, p.start_time, p.device)
                since[key] = self.since.get(key, now)
                out.append(now - since[key])
            else:
                out.append(None)
        self.since = since
        return out


class Feed:
    """One host's bus connection and its current view (already encoded), kept up to date while it runs."""

    def __init__(self, host: HostSpec, on_view: Callable[[Feed], None], on_signal: Callable[[bytes], None]) -> None:
        self.host = host
        self.on_view, self.on_signal = on_view, on_signal
        self.task: asyncio.Task | None = None
        self.interval = 0.0
        self.idle = IdleClock()
        self.view = b""
        self.listed = False  # since the last connection was made
        self.shown: tuple[str, str] = ("", "")  # the state and error of the view last published
        self._set_state("connecting", "")

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self) -> None:
        if not self.running:
            self.task = asyncio.create_task(self._run(), name=f"gpukill hub feed {self.host.id}")

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is None:
            return
        task.cancel()
        # Reset before waiting for it to end: a subscriber arriving meanwhile starts a new task, whose views
        # must not be overwritten by this one's end. What the next start shows until it has listed:
        self.idle = IdleClock()
        self._set_state("connecting", "", publish=False)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    def _set_state(self, state: str, error: str, publish: bool = True) -> None:
        if (state, error) == self.shown:  # a host still down for the same reason: nothing new to show
            return
        self.shown = (state, error)
        self._publish(
            {
                "id": self.host.id,
                "name": self.host.name,
                "state": state,
                "error": error,
                "generation": None,
                "at": time.time(),
                "interval": self.interval,
                "devices": [],
                "processes": [],
                "suspended": [],
            },
            publish,
        )

    def _publish(self, view: dict[str, Any], publish: bool = True) -> None:
        self.view = sse("host", view)
        self.shown = (view["state"], view["error"])
        if publish:
            self.on_view(self)

    async def _run(self) -> None:
        backoff = BACKOFF_FIRST
        while True:
            self.listed = False
            try:
                client = await self.host.connect()
            except Exception as e:  # DaemonUnavailable with ssh's or the bus's word, or anything a host made
                error = one_line(e)
            else:
                try:
                    await self._follow(client)
                    error = "the connection to the host's bus closed"
                except Exception as e:  # a failed call, or a reply this client could not read: the host is down
                    error = one_line(e)
                finally:
                    client.close()
            if self.listed:  # it was up: a host that comes back after a blip is retried soon
                backoff = BACKOFF_FIRST
            self.idle = IdleClock()
            self._set_state("down", error)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _follow(self, client: GpukillClient) -> None:
        """List, then list again on each change, until the connection ends (raises when a call fails)."""
        changed = asyncio.Event()
        generation: list[int | None] = [None]
        self.interval = (await client.status()).sample_interval

        async def watch() -> None:
            async for change in client.snapshot_changes(self.interval):
                generation[0] = change.generation
                changed.set()

        # Both follow a restart of gpukilld, but while it is away nothing would say so: the view would stay "up"
        # with the last listing. When org.gpukill1 leaves the bus the host is down, and retried.
        absent = asyncio.Event()
        watcher = asyncio.create_task(watch())
        forwarder = asyncio.create_task(self._forward_signals(client, absent.set, changed.set))
        try:
            await self._list(client, None)
            # That listing may have been taken before the subscriptions were in place (they are made meanwhile,
            # on the same connection), and a change in between would show only with the next one: when a whole
            # interval passes without a change, list once more; from then on, only on changes.
            timeout: float | None = max(self.interval, 1.0)
            while True:
                waiters = {asyncio.ensure_future(changed.wait()), asyncio.ensure_future(absent.wait())}
                done, _ = await asyncio.wait({*waiters, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                for waiter in waiters:
                    waiter.cancel()
                if absent.is_set():
                    raise DaemonUnavailable("", "gpukilld is not running (org.gpukill1 left the bus)")
                if watcher in done and not changed.is_set():
                    watcher.result()  # the connection closed (returns), or the watch failed (raises)
                    return
                timeout = None
                changed.clear()  # changes that come while listing fold into the next listing
                await self._list(client, generation[0])
        finally:
            for task in (watcher, forwarder):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _list(self, client: GpukillClient, generation: int | None) -> None:
        devices = await client.list_devices()
        processes = await client.list_processes()
        suspended = await client.suspended()
        # a host of 2,048 processes is a view of ~850 KB: built and encoded in a thread, so that the server's
        # other requests and hosts do not wait for it (the IdleClock is this feed's alone)
        at = time.time()
        data = await asyncio.to_thread(lambda: sse("host", self.view_of(devices, processes, generation, at, suspended)))
        self.view, self.shown = data, ("up", "")
        self.on_view(self)
        self.listed = True

    def view_of(
        self,
        devices: list[Device],
        processes: list[Process],
        generation: int | None,
        at: float,
        suspended: Sequence[SuspendedProcess] = (),
    ) -> dict[str, Any]:
        # runtime from this machine's boot clock: a remote host's start times count from its own boot
        boot = time.clock_gettime(time.CLOCK_BOOTTIME) if self.host.id == 0 else None
        idle = self.idle.update(processes, time.monotonic())
        rows = []
        for p, idle_seconds in zip(processes, idle, strict=True):
            row = to_plain(p)
            row["runtime"] = max(0.0, seconds_since_start(p.start_time, boot)) if boot is not None else None
            row["idle_seconds"] = idle_seconds
            rows.append(row)
        return {
            "id": self.host.id,
            "name": self.host.name,
            "state": "up",
            "error": "",
            "generation": generation,
            "at": at,
            "interval": self.interval,
            "devices": [to_plain(d) for d in devices],
            "processes": rows,
            "suspended": self.suspended_rows(suspended, processes),
        }

    def suspended_rows(self, suspended: Sequence[SuspendedProcess], processes: list[Process]) -> list[dict[str, Any]]:
        """The suspended processes as the page shows them: each record with its owner's name ("user"), as the
        host's listing names that uid, else as this machine does for its own host, else the uid."""
        names = {p.uid: p.user for p in processes}
        rows = []
        for r in suspended:
            row = to_plain(r)
            row["user"] = names.get(r.uid) or (user_name(r.uid) if self.host.id == 0 else str(r.uid))
            rows.append(row)
        return rows

    async def _forward_signals(
        self, client: GpukillClient, on_absent: Callable[[], None], on_suspension: Callable[[], None]
    ) -> None:
        async for record in client.events(on_absent=on_absent):
            if isinstance(record, SnapshotChanged):  # it becomes the next host event
                continue
            if isinstance(record, ProcessSuspended | ProcessResumed):  # the suspended list changed: list again
                on_suspension()
            kind = type(record).__name__
            if kind in SIGNAL_TYPES:
                self.on_signal(
                    sse("signal", {"host": self.host.id, "type": kind, "record": to_plain(record), "at": time.time()})
                )


class Subscriber:
    """One open stream's backlog, bounded whatever its page does: the newest view per host, the last signals."""

    def __init__(self, views: dict[int, bytes]) -> None:
        self.views = dict(views)
        self.signals: collections.deque[bytes] = collections.deque(maxlen=MAX_SIGNALS)
        self.ready = asyncio.Event()
        self.ready.set()  # the first views

    def offer_view(self, host: int, data: bytes) -> None:
        self.views[host] = data  # an older one not yet written is dropped: the page needs only the newest
        self.ready.set()

    def offer_signal(self, data: bytes) -> None:
        self.signals.append(data)
        self.ready.set()

    def take(self) -> list[bytes]:
        """What to write now: the signals in order, then each host's view (a kill's signal before the listing
        without the process)."""
        out = [*self.signals, *self.views.values()]
        self.signals.clear()
        self.views.clear()
        self.ready.clear()
        return out


class Hub:
    def __init__(
        self,
        hosts: list[HostSpec],
        *,
        linger: float = LINGER,
        ping: float = PING,
        max_subscribers: int = MAX_SUBSCRIBERS,
    ) -> None:
        self.hosts = hosts
        self.linger, self.ping, self.max_subscribers = linger, ping, max_subscribers
        self.subscribers: set[Subscriber] = set()  # before the feeds, which publish their first view at once
        self.feeds = [Feed(h, self._on_view, self._on_signal) for h in hosts]
        self._stop_timer: asyncio.TimerHandle | None = None
        self._stopping: asyncio.Future | None = None  # the feeds' stops, gathered
        self.routes = [
            Route("/ui/hosts", self._list_hosts, methods=["GET"]),
            Route("/ui/stream", self._stream, methods=["GET"]),
        ]

    # -- subscribers -----------------------------------------------------------------------------------

    def subscribe(self) -> Subscriber | None:
        """A new subscriber with every host's current view; None when MAX_SUBSCRIBERS are open."""
        if len(self.subscribers) >= self.max_subscribers:
            return None
        if self._stop_timer is not None:
            self._stop_timer.cancel()
            self._stop_timer = None
        for feed in self.feeds:
            feed.start()
        sub = Subscriber({f.host.id: f.view for f in self.feeds})
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        if not self.subscribers and self._stop_timer is None:
            self._stop_timer = asyncio.get_running_loop().call_later(self.linger, self._stop_feeds)

    def _stop_feeds(self) -> None:
        self._stop_timer = None
        if not self.subscribers:
            self._stopping = asyncio.ensure_future(asyncio.gather(*(f.stop() for f in self.feeds)))

    def _on_view(self, feed: Feed) -> None:
        for sub in self.subscribers:
            sub.offer_view(feed.host.id, feed.view)

    def _on_signal(self, data: bytes) -> None:
        for sub in self.subscribers:
            sub.offer_signal(data)

    async def aclose(self) -> None:
        """Stop every feed (the server's lifespan calls this as it ends)."""
        if self._stop_timer is not None:
            self._stop_timer.cancel()
            self._stop_timer = None
        await asyncio.gather(*(f.stop() for f in self.feeds))
        if self._stopping is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._stopping

    # -- routes ----------------------------------------------------------------------------------------

    async def _list_hosts(self, request: Request) -> Response:
        return JSONResponse({"hosts": [{"id": h.id, "name": h.name, "api": h.api} for h in self.hosts]})

    async def _stream(self, request: Request) -> Response:
        sub = self.subscribe()
        if sub is None:
            return JSONResponse(
                {
                    "error": "ServiceUnavailable",
                    "message": f"{self.max_subscribers} pages follow this server already: close one",
                },
                status_code=503,
                headers={"retry-after": "5"},
            )
        return EventStream(self, sub)


class EventStream(Response):
    """The stream of one subscriber: written by its own task; the client's disconnect ends it at once (not at
    the next write, which may be a ping away)."""

    # Not Response's headers: with no body given it would declare content-length: 0 and end the stream at once.
    HEADERS = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-store"),
        (b"x-accel-buffering", b"no"),
    ]  # a proxy (nginx) in front must not hold the events back

    def __init__(self, hub: Hub, sub: Subscriber) -> None:
        self.hub, self.sub = hub, sub
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.HEADERS})
            writer = asyncio.ensure_future(self._write(send))
            gone = asyncio.ensure_future(self._disconnected(receive))
            try:
                await asyncio.wait({writer, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.hub.unsubscribe(self.sub)  # before anything is awaited: a page that left is forgotten at once
                for task in (writer, gone):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
        finally:
            self.hub.unsubscribe(self.sub)  # also when the start could not be sent

    async def _write(self, send: Any) -> None:
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow the cancel that ends this task
            # when its wait completes in the same turn, and the stream would never end
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.hub.ping):
                    await self.sub.ready.wait()
            chunks = self.sub.take() or [PING_EVENT]
            for chunk in chunks:  # each shared bytes object as it is: no copy per subscriber here
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

    @staticmethod
    async def _disconnected(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
