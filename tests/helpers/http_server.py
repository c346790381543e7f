"""`gpukillctl serve` run as a test user on the bed's bus, and HTTP requests to it (standard library only).

The server runs as the user with a runtime directory of that user's (what logind makes as $XDG_RUNTIME_DIR),
a fresh one for each server unless one is given, in the bed's process list, so the bed's cleanup stops it. By
default it listens on its Unix socket, as it does by default; tcp=True: on 127.0.0.1 and a free port.

A target is where a request goes: an int, a TCP port on 127.0.0.1, or a Path, a Unix socket (the request
then names Host: localhost, as `curl --unix-socket PATH http://localhost/...` does).
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .testbed import PYTHON, REPO, Testbed, User
from .waiting import wait_until

Target = int | Path
_runtime_dirs = itertools.count(1)
_logs = itertools.count(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket: HTTP as usual, the connection made to a path."""

    def __init__(self, path: Path | str, timeout: float = 60) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def connection(target: Target, timeout: float = 60) -> http.client.HTTPConnection:
    if isinstance(target, int):
        return http.client.HTTPConnection("127.0.0.1", target, timeout=timeout)
    return UnixHTTPConnection(target, timeout)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: object

    @property
    def error(self) -> str | None:
        return self.body.get("error") if isinstance(self.body, dict) else None


def request(
    target: Target,
    method: str,
    path: str,
    token: str | None = None,
    body: object = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    chunked: bool = False,
) -> Response:
    """One request; token: sent as Authorization: Bearer TOKEN; chunked: raw sent in 64 KiB chunks
    (Transfer-Encoding: chunked, no Content-Length)."""
    conn = connection(target)
    sent = dict(headers or {})
    if token is not None:
        sent.setdefault("Authorization", f"Bearer {token}")
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    if data is not None:
        sent.setdefault("Content-Type", "application/json")
    try:
        if chunked:
            assert data is not None
            pieces = (data[i : i + 65536] for i in range(0, len(data), 65536))
            conn.request(method, path, body=pieces, headers=sent, encode_chunked=True)
        else:
            conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    try:
        parsed: object = json.loads(payload)
    except ValueError:
        parsed = payload.decode("utf-8", "replace")
    return Response(response.status, {k.lower(): v for k, v in response.getheaders()}, parsed)


def request_as(
    bed: Testbed,
    user: User,
    target: Target,
    method: str,
    path: str,
    headers: dict[str, str],
    body: object = None,
) -> Response:
    """The same request made by a process of `user` (tests/clients/http_call.py)."""
    where = {"port": target} if isinstance(target, int) else {"unix": str(target)}
    spec = json.dumps({**where, "method": method, "path": path, "headers": headers, "body": body})
    r = bed.run_as(user, [PYTHON, str(REPO / "tests" / "clients" / "http_call.py")], input=spec)
    assert r.returncode == 0, r
    out = json.loads(r.stdout)
    return Response(out["status"], out["headers"], out["body"])


def runtime_dir(bed: Testbed, user: User) -> Path:
    """A fresh $XDG_RUNTIME_DIR of the user's own, 0700, as logind makes it."""
    path = bed.workdir / f"run-{user.name}-{next(_runtime_dirs)}"
    path.mkdir()
    os.chown(path, user.uid, user.gid)
    os.chmod(path, 0o700)
    return path


class Server:
    """`gpukillctl serve ARGS` as `user`; its stderr in a log file."""

    def __init__(
        self,
        bed: Testbed,
        user: User,
        *args: str,
        tcp: bool = False,
        port: int | None = None,
        runtime: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.bed, self.user = bed, user
        self.port = (port or free_port()) if tcp else None
        self.runtime = runtime or runtime_dir(bed, user)
        self.target: Target = self.port if self.port is not None else self.socket_path
        where = ["--tcp", f"127.0.0.1:{self.port}"] if self.port is not None else []
        self.log = bed.workdir / f"serve-{next(_logs)}.log"
        environment = bed.env(XDG_RUNTIME_DIR=str(self.runtime), **(env or {}))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "gpukillctl", "serve", *where, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment,
                cwd="/",
                start_new_session=True,
                **user.popen_kwargs(),
            )
        bed.procs.append(self.proc)

    @property
    def socket_path(self) -> Path:
        return self.runtime / "gpukill" / "serve.sock"

    @property
    def token_path(self) -> Path:
        name = "serve.token" if self.port is None else f"serve-{self.port}.token"
        return self.runtime / "gpukill" / name

    @property
    def host(self) -> str:
        """The Host header its clients send."""
        return "localhost" if self.port is None else f"127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> Server:
        """Until the server answers (a request without the token: 401)."""

        def answering() -> bool:
            assert self.proc.poll() is None, f"gpukillctl serve exited {self.proc.returncode}: {self.output()}"
            try:
                return request(self.target, "GET", "/v1/devices").status == 401
            except OSError:
                return False

        wait_until(answering, timeout, lambda: f"gpukillctl serve did not answer: {self.output()}", interval=0.2)
        return self

    @property
    def token(self) -> str:
        return self.token_path.read_text().strip()

    def call(self, method: str, path: str, body: object = None, **kw) -> Response:
        return request(self.target, method, path, token=self.token, body=body, **kw)

    def stop(self, timeout: float = 15.0) -> int:
        self.proc.terminate()
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()
