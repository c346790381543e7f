"""`gpukillctl serve` run as a test user on the bed's bus, and HTTP requests to it (standard library only).

The server runs as the user with a runtime directory of that user's (what logind makes as $XDG_RUNTIME_DIR),
in the bed's process list, so the bed's cleanup stops it.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .testbed import PYTHON, REPO, Testbed, User
from .waiting import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: object

    @property
    def error(self) -> str | None:
        return self.body.get("error") if isinstance(self.body, dict) else None


def request(
    port: int,
    method: str,
    path: str,
    token: str | None = None,
    body: object = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> Response:
    """One request to 127.0.0.1:port; token: sent as Authorization: Bearer TOKEN."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    sent = dict(headers or {})
    if token is not None:
        sent.setdefault("Authorization", f"Bearer {token}")
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    if data is not None:
        sent.setdefault("Content-Type", "application/json")
    try:
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
    bed: Testbed, user: User, port: int, method: str, path: str, headers: dict[str, str], body: object = None
) -> Response:
    """The same request made by a process of `user` (tests/clients/http_call.py)."""
    spec = json.dumps({"port": port, "method": method, "path": path, "headers": headers, "body": body})
    r = bed.run_as(user, [PYTHON, str(REPO / "tests" / "clients" / "http_call.py")], input=spec)
    assert r.returncode == 0, r
    out = json.loads(r.stdout)
    return Response(out["status"], out["headers"], out["body"])


def runtime_dir(bed: Testbed, user: User) -> Path:
    """A $XDG_RUNTIME_DIR of the user's own, 0700, as logind makes it."""
    path = bed.workdir / f"run-{user.name}"
    path.mkdir(exist_ok=True)
    os.chown(path, user.uid, user.gid)
    os.chmod(path, 0o700)
    return path


class Server:
    """`gpukillctl serve ARGS` as `user`; its stderr in a log file."""

    def __init__(
        self, bed: Testbed, user: User, *args: str, port: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.bed, self.user = bed, user
        self.port = port or free_port()
        self.runtime = runtime_dir(bed, user)
        self.log = bed.workdir / f"serve-{self.port}.log"
        environment = bed.env(XDG_RUNTIME_DIR=str(self.runtime), **(env or {}))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "gpukillctl", "serve", "--port", str(self.port), *args],
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
    def token_path(self) -> Path:
        return self.runtime / "gpukill" / f"serve-{self.port}.token"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> Server:
        """Until the server answers (a request without the token: 401)."""

        def answering() -> bool:
            assert self.proc.poll() is None, (
                f"gpukillctl serve exited {self.proc.returncode}: {self.output()}"
            )
            try:
                return request(self.port, "GET", "/v1/devices").status == 401
            except OSError:
                return False

        wait_until(
            answering, timeout, lambda: f"gpukillctl serve did not answer: {self.output()}", interval=0.2
        )
        return self

    @property
    def token(self) -> str:
        return self.token_path.read_text().strip()

    def call(self, method: str, path: str, body: object = None, **kw) -> Response:
        return request(self.port, method, path, token=self.token, body=body, **kw)

    def stop(self, timeout: float = 15.0) -> int:
        self.proc.terminate()
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()
