"""`gpukillctl exporter`: gpukilld's devices, attribution and Guard counters for Prometheus.

An unprivileged client of the system bus (gpukilld itself opens no port). A reading of the daemon is one
ListDevices, one ListProcesses, the Manager's properties and Guard's GetStatus, run concurrently on one
connection. Over HTTP one reading serves every scrape of a sample interval (the daemon's SampleInterval,
within MIN_REFRESH..MAX_REFRESH): the daemon's listings change no faster, and scrapes that come faster (many
Prometheus servers, a dashboard, a loop of curl) cost the daemon nothing more; concurrent scrapes of a stale
reading share the one read in flight. Without that, ~50 scrapes a second were 200 calls a second, gpukilld's
per-uid call rate, and the daemon's TooBusy answers turned into gpukill_up 0.
The accounting's counters (gpukill_gpu_seconds_total, ...) are GetUsage's totals since the exporter started,
one GetUsage per grouping (user, unit, job) at most every USAGE_REFRESH seconds (each asks the daemon's store,
not its snapshot, so it is asked less often than the listings), the last answer serving the readings between.
Kills and resets, which no daemon property counts, are counted as gpukilld signals them (ProcessKilled,
DeviceReset), on a second connection, since the exporter started; every scrape gets the counts of then.
Served over HTTP at /metrics (127.0.0.1:9835 unless --listen/--port say otherwise) by exporter/http.py (bounded
connections, deadlines, a fixed pool of rendering threads), or, with --textfile DIR, written to
DIR/gpukill.prom for node_exporter's textfile collector every --interval, from a reading made for it (written
whole to a temporary file and renamed over, so node_exporter never reads half a file).

Registered by gpukillctl/cli/main.py without importing prometheus_client: it is the optional extra `exporter`, and only
this
command needs it (it says what to install, in one line, when it is missing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..client.dbus import ClientError, GpukillClient
from ..client.exits import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from ..client.format import user_name
from ..client.ports import port_number
from ..http.listen import ServeError

if TYPE_CHECKING:  # imported where first used: prometheus_client is loaded only then
    from .metrics import UsageCounters

PROG = "gpukillctl exporter"
INSTALL_HINT = "pip install 'gpukill[exporter]', or the package gpukill-exporter"
DEFAULT_PORT = 9835
TEXTFILE_NAME = "gpukill.prom"
SCRAPE_TIMEOUT = 10.0  # seconds: a reading that takes longer says the daemon is down rather than hang
# Over HTTP, a reading serves the scrapes of one SampleInterval, kept within these bounds: a daemon sampling
# 20 times a second is not read 20 times a second, nor gpukill_up left an hour old by one sampling hourly.
MIN_REFRESH, MAX_REFRESH = 0.25, 15.0
DEFAULT_REFRESH = 1.0  # until the daemon has said its interval (gpukilld's default)
USAGE_REFRESH = 10.0  # seconds between GetUsage readings (a counter 10 s old is fresher than any scrape needs)


def positive_seconds(text: str) -> float:
    """The sampling interval in gpukill.units' duration grammar (15, 15s, 1min), 1 s to 1 h."""
    from gpukill.units import parse_duration

    try:
        value = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not 1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"the interval must be between 1 and 3600 seconds, not {text}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "exporter",
        help="Prometheus metrics: devices, per-user/unit/job/pod memory, GPU-time counters, Guard counters",
        description="Expose gpukilld's devices, GPU memory per user, unit, Slurm job, pod and container, and "
        "Guard's counters as Prometheus metrics, and the usage accounting's GPU seconds, memory byte-seconds, SM "
        "seconds and energy per user, unit and Slurm job as counters since the exporter started, read from the "
        "daemon at most once per sample interval (the accounting at most every 10 s) "
        "(one reading serves every scrape of the interval). Serves /metrics "
        f"over HTTP (default 127.0.0.1:{DEFAULT_PORT}), or writes DIR/{TEXTFILE_NAME} for "
        f"node_exporter with --textfile. Needs prometheus_client ({INSTALL_HINT}). The system unit "
        "gpukill-exporter.service runs it. See gpukillctl(1).",
    )
    p.add_argument(
        "--listen", metavar="ADDR", default="127.0.0.1", help="the address to serve /metrics on (default 127.0.0.1)"
    )
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument("--textfile", metavar="DIR", help=f"write DIR/{TEXTFILE_NAME} (atomically) instead of serving HTTP")
    p.add_argument(
        "--interval",
        type=positive_seconds,
        default=15.0,
        metavar="DURATION",
        help="with --textfile: time between writes, e.g. 15s or 1min (default 15s)",
    )
    p.add_argument("--once", action="store_true", help="with --textfile: write once and exit")
    p.add_argument(
        "--per-process",
        action="store_true",
        help="also one series per GPU process (a new series for every PID: mind the cardinality)",
    )
    p.set_defaults(offline=cmd_exporter)


def say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


# -- reading the daemon ----------------------------------------------------------------------------------


class DaemonReader:
    """One bus connection, kept across readings and made again when lost; reads run on the running loop.
    current() is the cached reading HTTP scrapes get; read() is a new one (the textfile's)."""

    def __init__(self, clock=time.monotonic, wall=time.time) -> None:
        from .metrics import SignalCounts

        self.clock = clock
        self.wall = wall
        self.started = wall()  # GetUsage's since: the counters count from the exporter's start
        self.usage: UsageCounters | None = (
            None  # UsageCounters once GetUsage answered; None while the daemon keeps no accounting
        )
        self._usage_at: float | None = None  # when the usage was last read, on self.clock
        self.client: GpukillClient | None = None
        self.signals = SignalCounts()
        self.refresh = DEFAULT_REFRESH  # seconds a reading serves: the daemon's SampleInterval, bounded
        self.reads = 0  # readings made of the daemon
        self._cached = None  # the latest Reading
        self._cached_at = 0.0  # when that reading started, on self.clock
        self._in_flight: asyncio.Future | None = None

    async def current(self):
        """The latest reading if it started less than one sample interval ago, else a new one, shared with
        every scrape that asks while it is made; the signal counts as of now either way."""
        if self._cached is None or self.clock() - self._cached_at >= self.refresh:
            if self._in_flight is None:
                self._in_flight = asyncio.ensure_future(self._renew())
            await asyncio.shield(self._in_flight)  # a scrape that gives up does not cancel the others' read
        return dataclasses.replace(
            self._cached, signals=self._signal_counts(), age=max(0.0, self.clock() - self._cached_at)
        )

    async def _renew(self) -> None:
        from .metrics import Reading

        started = self.clock()
        try:
            reading = await self.read()
        except Exception as e:  # not the daemon's answer but a fault of ours: served as "down", and said
            say(f"reading gpukilld failed: {type(e).__name__}: {e}")
            reading = Reading()
        finally:
            self._in_flight = None
        self._cached, self._cached_at = reading, started

    async def count_signals(self) -> None:
        """Count kills and resets as gpukilld signals them, on a connection of its own (events() follows daemon
        restarts; a lost bus connection is made again after a second)."""
        while True:
            try:
                listener = await GpukillClient.connect()
            except ClientError:
                await asyncio.sleep(1.0)
                continue
            try:
                async for event in listener.events():
                    self.signals.count(event)
            except ClientError:
                pass
            finally:
                listener.close()
            await asyncio.sleep(1.0)

    async def _client(self) -> GpukillClient:
        if self.client is None or not self.client.bus.connected:
            self.client = await GpukillClient.connect()
        return self.client

    async def read(self):
        """The daemon now, as a Reading (daemon_up false when it does not answer in SCRAPE_TIMEOUT)."""
        from .metrics import Reading

        started = time.monotonic()
        self.reads += 1
        try:
            reading = await asyncio.wait_for(self._read(), SCRAPE_TIMEOUT)
        except TimeoutError:
            reading = Reading()
        return dataclasses.replace(reading, seconds=time.monotonic() - started, signals=self._signal_counts())

    def _signal_counts(self):
        """A copy: a pool thread renders it while the loop may count the next signal."""
        return dataclasses.replace(self.signals, kills=dict(self.signals.kills), resets=dict(self.signals.resets))

    async def _read(self):
        from .metrics import Reading

        try:
            client = await self._client()
            devices, processes, status, suspended = await asyncio.gather(
                client.list_devices(), client.list_processes(), client.status(), client.suspended()
            )
        except ClientError:
            return Reading()
        self.refresh = min(MAX_REFRESH, max(MIN_REFRESH, float(status.sample_interval)))
        try:
            guard = await client.guard_status()
        except ClientError:  # Guard's counters are left out; devices and attribution still count
            guard = None
        await self._read_usage(client)
        return Reading(
            tuple(devices),
            tuple(processes),
            status.backends,
            guard,
            True,
            status.version,
            usage=None if self.usage is None else self.usage.copy(),
            suspended=tuple(suspended),
            user_names=tuple((uid, user_name(uid)) for uid in {r.uid for r in suspended}),
        )

    async def _read_usage(self, client: GpukillClient) -> None:
        """GetUsage per grouping, since the exporter started, when the last reading is USAGE_REFRESH old. A
        daemon without the accounting leaves the counters out; another failure keeps the last values."""
        from gpukill import errors

        from .metrics import USAGE_GROUPINGS, UsageCounters

        if self._usage_at is not None and self.clock() - self._usage_at < USAGE_REFRESH:
            return
        self._usage_at = self.clock()
        now = self.wall()
        try:
            reports = await asyncio.gather(
                *(
                    client.usage({"since": self.started, "until": max(now, self.started + 1), "by": by})
                    for by, _ in USAGE_GROUPINGS
                )
            )
        except errors.NotSupported:
            self.usage = None
            return
        except ClientError:
            return
        counters = self.usage or UsageCounters()
        for (_, label), report in zip(USAGE_GROUPINGS, reports, strict=True):
            counters.update(label, report, now)
        self.usage = counters


def make_collector(read, per_process: bool):
    """A prometheus_client Collector whose collect() exposes read(), a Reading of the daemon."""
    from .metrics import families

    class GpukillCollector:
        def collect(self):
            return families(read(), per_process)

    return GpukillCollector()


def render(reading, accept: str, per_process: bool) -> tuple[bytes, str]:
    """The exposition of a reading in the format the Accept header asks for (as prometheus_client's own server
    chooses it: the text format, or OpenMetrics), and its content type."""
    from prometheus_client.exposition import choose_encoder

    encoder, content_type = choose_encoder(accept)
    return encoder(make_collector(lambda: reading, per_process)), content_type


# -- serving ---------------------------------------------------------------------------------------------


def cmd_exporter(args: argparse.Namespace) -> int:
    try:
        import prometheus_client  # noqa: F401
    except ModuleNotFoundError:
        say(f"needs prometheus_client, which is not installed: {INSTALL_HINT}")
        return EXIT_FAILURE
    if args.textfile is None and args.once:
        say("--once goes with --textfile")
        return EXIT_USAGE
    try:
        return asyncio.run(_textfile(args) if args.textfile is not None else _http(args))
    except ServeError as e:
        say(str(e))
        return e.code


def _registry(collector):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _http(args: argparse.Namespace) -> int:
    from .http import MetricsServer

    reader = DaemonReader()
    server = MetricsServer(reader.current, lambda reading, accept: render(reading, accept, args.per_process))
    try:
        await server.start(args.listen, args.port)
    except OSError as e:  # asyncio's message repeats the address: the error's own words suffice
        if e.errno is not None and e.errno > 0 and not isinstance(e, socket.gaierror):
            reason = os.strerror(e.errno)
        else:
            reason = e.strerror or str(e)
        raise ServeError(f"cannot listen on {args.listen} port {args.port}: {reason}") from None
    say(f"serving /metrics on {args.listen} port {args.port}")
    counting = asyncio.ensure_future(reader.count_signals())
    try:
        await _until_stopped()
    finally:
        counting.cancel()
        await server.close()
        if reader.client is not None:
            reader.client.close()
    return EXIT_OK


async def _textfile(args: argparse.Namespace) -> int:
    from prometheus_client import write_to_textfile

    directory = Path(args.textfile)
    if not directory.is_dir():
        raise ServeError(f"--textfile {directory}: not a directory", EXIT_USAGE)
    reader = DaemonReader()
    # write_to_textfile collects synchronously: read first on this loop, then hand the reading over.
    holder: dict = {}
    registry = _registry(make_collector(lambda: holder["reading"], args.per_process))
    stopping = asyncio.ensure_future(_until_stopped())
    counting = asyncio.ensure_future(reader.count_signals())
    try:
        while True:
            holder["reading"] = await reader.read()
            try:  # a temporary file in DIR, renamed over gpukill.prom: never half a file
                await asyncio.to_thread(write_to_textfile, str(directory / TEXTFILE_NAME), registry)
            except OSError as e:
                raise ServeError(f"cannot write {directory / TEXTFILE_NAME}: {e.strerror or e}") from None
            if args.once:
                return EXIT_OK
            done, _ = await asyncio.wait([stopping], timeout=args.interval)
            if done:
                return EXIT_OK
    finally:
        for task in (stopping, counting):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if reader.client is not None:
            reader.client.close()
