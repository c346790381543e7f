"""`gpukillctl exporter`: gpukilld's devices, attribution and Guard counters for Prometheus.

An unprivileged client of the system bus (gpukilld itself opens no port). Each scrape reads the daemon then and
there: one ListDevices, one ListProcesses, the Manager's properties and Guard's GetStatus, run concurrently on
one connection (a custom Collector, no polling loop, so a scrape is never staler than the daemon's sample).
Kills and resets, which no daemon property counts, are counted as gpukilld signals them (ProcessKilled,
DeviceReset), on a second connection, since the exporter started.
Served over HTTP at /metrics (127.0.0.1:9835 unless --listen/--port say otherwise), or, with --textfile DIR,
written to DIR/gpukill.prom for node_exporter's textfile collector (written whole to a temporary file and
renamed over, so node_exporter never reads half a file).

Registered by cli.py without importing prometheus_client: it is the optional extra `exporter`, and only this
command needs it (it says what to install, in one line, when it is missing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import sys
import time
from pathlib import Path

from .client import ClientError, GpukillClient
from .exits import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from .serve import ServeError, port_number

PROG = "gpukillctl exporter"
INSTALL_HINT = "pip install 'gpukill[exporter]' (Debian: apt install python3-prometheus-client)"
DEFAULT_PORT = 9835
TEXTFILE_NAME = "gpukill.prom"
SCRAPE_TIMEOUT = 10.0  # seconds: a scrape that takes longer says the daemon is down rather than hang


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"the interval must be between 1 and 3600 seconds, not {text}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "exporter",
        help="Prometheus metrics: devices, per-user/unit/job/pod memory, Guard counters",
        description="Expose gpukilld's devices, GPU memory per user, unit, Slurm job, pod and container, and "
        "Guard's counters as Prometheus metrics, read from the daemon at each scrape. Serves /metrics "
        f"over HTTP (default 127.0.0.1:{DEFAULT_PORT}), or writes DIR/{TEXTFILE_NAME} for "
        f"node_exporter with --textfile. Needs prometheus_client ({INSTALL_HINT}). The system unit "
        "gpukill-exporter.service runs it. See gpukillctl(1).",
    )
    p.add_argument("--listen", metavar="ADDR", default="127.0.0.1",
                   help="the address to serve /metrics on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument("--textfile", metavar="DIR",
                   help=f"write DIR/{TEXTFILE_NAME} (atomically) instead of serving HTTP")
    p.add_argument("--interval", type=positive_seconds, default=15.0, metavar="SECONDS",
                   help="with --textfile: seconds between writes (default 15)")
    p.add_argument("--once", action="store_true", help="with --textfile: write once and exit")
    p.add_argument("--per-process", action="store_true",
                   help="also one series per GPU process (a new series for every PID: mind the cardinality)")
    p.set_defaults(offline=cmd_exporter)


def say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


# -- reading the daemon ----------------------------------------------------------------------------------


class DaemonReader:
    """One bus connection, kept across scrapes and made again when lost; reads run on the loop it owns."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        from .exporter_metrics import SignalCounts

        self.loop = loop
        self.client: GpukillClient | None = None
        self.signals = SignalCounts()

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
        from .exporter_metrics import Reading

        started = time.monotonic()
        try:
            reading = await asyncio.wait_for(self._read(), SCRAPE_TIMEOUT)
        except TimeoutError:
            reading = Reading()
        # a copy: the HTTP thread renders it while the loop may count the next signal
        signals = dataclasses.replace(self.signals, kills=dict(self.signals.kills), resets=dict(self.signals.resets))
        return dataclasses.replace(reading, seconds=time.monotonic() - started, signals=signals)

    async def _read(self):
        from .exporter_metrics import Reading

        try:
            client = await self._client()
            devices, processes, status = await asyncio.gather(
                client.list_devices(), client.list_processes(), client.status())
        except ClientError:
            return Reading()
        try:
            guard = await client.guard_status()
        except ClientError:  # Guard's counters are left out; devices and attribution still count
            guard = None
        return Reading(tuple(devices), tuple(processes), status.backends, guard, True, status.version)

    def read_from_thread(self):
        """For the HTTP server's threads: run a read on the loop and wait for it (read() bounds its time)."""
        return asyncio.run_coroutine_threadsafe(self.read(), self.loop).result()


def make_collector(read, per_process: bool):
    """A prometheus_client Collector whose collect() exposes read(), a Reading of the daemon."""
    from .exporter_metrics import families

    class GpukillCollector:
        def collect(self):
            return families(read(), per_process)

    return GpukillCollector()


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
    from prometheus_client import start_http_server

    reader = DaemonReader(asyncio.get_running_loop())
    registry = _registry(make_collector(reader.read_from_thread, args.per_process))
    try:
        server, thread = start_http_server(args.port, addr=args.listen, registry=registry)
    except OSError as e:
        raise ServeError(f"cannot listen on {args.listen} port {args.port}: {e.strerror or e}") from None
    say(f"serving /metrics on {args.listen} port {args.port}")
    counting = asyncio.ensure_future(reader.count_signals())
    try:
        await _until_stopped()
    finally:
        counting.cancel()
        server.shutdown()
        thread.join(5)
        if reader.client is not None:
            reader.client.close()
    return EXIT_OK


async def _textfile(args: argparse.Namespace) -> int:
    from prometheus_client import write_to_textfile

    directory = Path(args.textfile)
    if not directory.is_dir():
        raise ServeError(f"--textfile {directory}: not a directory", EXIT_USAGE)
    reader = DaemonReader(asyncio.get_running_loop())
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

