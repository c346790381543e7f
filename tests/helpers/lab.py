"""A lab for the dashboard's tests: the bed as host 0, the same bed again as a second host reached over a real
OpenSSH server on loopback (ssh, then systemd-stdio-bridge to the bed's bus, as `gpukillctl -H` goes), and a
stopped host (ssh to a loopback port nothing listens on); `gpukillctl serve` over them as a test user; and a
reader of its Server-Sent Events.

The second host is the bed's own gpukilld: what ssh reaches is real (sshd, the bridge, the bed's polkit judging
the SSH user), only the machine is the same. The serving user gets a copy of the client key of its own (ssh
refuses a key others can read, and the test's is root's), in a 0700 directory of the bed's.

Use it from a module fixture:

    @pytest.fixture(scope="module")
    def lab(bed, users):
        yield from helpers.lab.serving(bed, users["owner"])

then `lab.serve(users["owner"], *lab.hosts)` starts the server (`--host` for each), and `await
EventReader.open(server.port, server.token)` follows its /ui/stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import sshd
from .http_server import Server
from .testbed import ROOT, Testbed, User


@dataclass
class Lab:
    bed: Testbed
    server: sshd.Sshd  # the second host's sshd
    ssh_user: User  # who ssh logs in as there
    closed_port: int  # where the stopped host "listens"
    configs: dict[str, str] = field(default_factory=dict)  # client user -> its ssh_config

    @property
    def remote(self) -> str:
        """The second host, as --host takes it."""
        return f"{self.ssh_user.name}@localhost"

    @property
    def stopped(self) -> str:
        """A host that does not answer: ssh gets "connection refused" at once."""
        return f"{self.ssh_user.name}@localhost:{self.closed_port}"

    @property
    def hosts(self) -> list[str]:
        """--host ARG for each of the two other hosts: [--host, REMOTE, --host, STOPPED]."""
        return ["--host", self.remote, "--host", self.stopped]

    def client_env(self, user: User) -> dict[str, str]:
        """What a process of `user` needs to reach the second host: its ssh command line, and the bus the bridge
        joins there (the bed's)."""
        return {"GPUKILL_SSH": f"ssh -F {self._ssh_config(user)}", "GPUKILL_REMOTE_BUS": self.bed.bus_address}

    def serve(self, user: User, *args: str, env: dict[str, str] | None = None) -> Server:
        """`gpukillctl serve --tcp 127.0.0.1:PORT ARGS` as `user`, answering; in the bed's processes."""
        return Server(self.bed, user, *args, tcp=True, env={**self.client_env(user), **(env or {})}).wait_ready()

    def _ssh_config(self, user: User) -> str:
        if user.name not in self.configs:
            home = self.bed.workdir / f"ssh-{user.name}"
            home.mkdir(mode=0o700, exist_ok=True)
            key = home / "client_key"
            shutil.copy(self.server.dir / "client_key", key)
            os.chmod(key, 0o600)
            config = home / "ssh_config"
            config.write_text(
                self.server.ssh_config.read_text().replace(
                    f"IdentityFile {self.server.dir / 'client_key'}", f"IdentityFile {key}"
                )
            )
            for path in (home, key, config):
                os.chown(path, user.uid, user.gid)
            self.configs[user.name] = str(config)
        return self.configs[user.name]


def serving(bed: Testbed, ssh_user: User) -> Iterator[Lab]:
    """A module fixture's body: the lab, its sshd letting `ssh_user` in; skipped with the reason where sshd
    cannot run here."""
    servers = sshd.serving(ssh_user.name)
    server = next(servers)  # skips the test here when sshd cannot run
    try:
        yield Lab(bed, server, ssh_user, sshd.free_port())
    finally:
        servers.close()  # stops sshd and puts the user's shell back


# -- what gpukilld is asked ----------------------------------------------------------------------------------


class BusMonitor:
    """Every method call to org.gpukill1 and every SnapshotChanged on the bed's bus, as dbus-monitor (a monitor
    connection: BecomeMonitor, root only by the bed's bus policy) sees them, by sender."""

    def __init__(self, bed: Testbed) -> None:
        self.bed = bed
        self.proc = subprocess.Popen(
            [
                "dbus-monitor",
                "--address",
                bed.bus_address,
                "--profile",
                "type='method_call',destination='org.gpukill1'",
                "type='signal',member='SnapshotChanged'",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        bed.procs.append(self.proc)
        self.seen: list[tuple[str, str]] = []  # (sender, member)
        self.lock = threading.Lock()
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.ready.wait(15), "dbus-monitor did not start"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            fields = line.rstrip("\n").split("\t")
            if fields[0] == "sig" and fields[-1] == "NameLost":  # its own name, once it became a monitor
                self.ready.set()
            elif fields[0] in ("mc", "sig") and len(fields) >= 8:
                with self.lock:
                    self.seen.append((fields[3], fields[7]))

    def take(self) -> list[tuple[str, str]]:
        with self.lock:
            seen, self.seen = self.seen, []
        return seen

    def pid_of(self, sender: str) -> int | None:
        r = self.bed.call_as(
            ROOT,
            "org.freedesktop.DBus",
            "/org/freedesktop/DBus",
            "org.freedesktop.DBus",
            "GetConnectionUnixProcessID",
            "s",
            [sender],
        )
        return r.body[0] if r.ok else None

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# -- the stream ---------------------------------------------------------------------------------------------


@dataclass
class Event:
    event: str  # "host", "signal", or "" for a comment (": ping")
    data: str
    at: float  # time.monotonic() when it was read whole

    def json(self) -> dict:
        return json.loads(self.data)


class EventReader:
    """One GET /ui/stream over a TCP connection of its own, its events parsed as a browser's EventSource parses
    them (chunked transfer decoded, `event:`/`data:` lines, comments kept as event ""). Standard library only."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""  # the whole body of a response that is not a stream (a refusal)
        self._buffer = bytearray()

    @classmethod
    async def open(
        cls,
        port: int,
        token: str | None,
        path: str = "/ui/stream",
        *,
        headers: dict[str, str] | None = None,
        rcvbuf: int | None = None,
    ) -> EventReader:
        """rcvbuf: a receive buffer this small (SO_RCVBUF, set before connecting), for a reader that is slow."""
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 24)
        self = cls(reader, writer)
        sent = {"Host": f"127.0.0.1:{port}", "Accept": "text/event-stream", **(headers or {})}
        if token is not None:
            sent.setdefault("Authorization", f"Bearer {token}")
        writer.write((f"GET {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in sent.items()) + "\r\n").encode())
        await writer.drain()
        status_line = await reader.readline()
        self.status = int(status_line.split()[1])
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()
        if self.status != 200:
            length = int(self.headers.get("content-length", "0"))
            self.body = await reader.readexactly(length) if length else b""
        return self

    def pause(self) -> None:
        """Read nothing more from the connection (asyncio's reader would go on filling its buffer): the kernel's
        receive buffer fills, then the server's send buffer, as with a page that does not keep up."""
        self.writer.transport.pause_reading()

    def resume(self) -> None:
        self.writer.transport.resume_reading()

    async def _chunk(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() != "chunked":
            data = await self.reader.read(65536)
            if not data:
                raise EOFError("the stream ended")
            return data
        size = int((await self.reader.readline()).split(b";")[0], 16)
        if size == 0:
            raise EOFError("the stream ended")
        data = await self.reader.readexactly(size)
        await self.reader.readexactly(2)
        return data

    async def next(self, timeout: float = 30.0) -> Event:
        """The next event (or comment); TimeoutError when none comes in time, EOFError when the stream ends."""
        async with asyncio.timeout(timeout):
            searched = 0  # the buffer is searched once, however many chunks a large event comes in
            while (end := self._buffer.find(b"\n\n", searched)) < 0:
                searched = max(0, len(self._buffer) - 1)
                data = await self._chunk()
                self._buffer += data
        block = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        event, data = "", []
        for line in block.decode().split("\n"):
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
            elif name == "":  # a comment
                data.append(line)
        return Event(event, "\n".join(data), time.monotonic())

    async def host_view(self, where: Callable[[dict], bool] = lambda view: True, timeout: float = 30.0) -> dict:
        """The next `host` event whose view satisfies `where`, skipping the others; TimeoutError past timeout."""
        deadline = time.monotonic() + timeout
        while True:
            event = await self.next(max(0.0, deadline - time.monotonic()))
            if event.event == "host" and where(view := event.json()):
                return view

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


def pids_of(view: dict) -> set[int]:
    return {p["pid"] for p in view["processes"]}
