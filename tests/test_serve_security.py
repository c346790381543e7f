"""The HTTP surface of `gpukillctl serve`: the token on every request, Host and Origin, bounded bodies and
requests in flight, where it may listen and with what token. The server runs as an unprivileged user on the
bed's bus; other local users reach its port as they would on a shared machine."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra (pip install 'gpukill[serve]') is not installed")
pytest.importorskip("mcp", reason="the serve extra (pip install 'gpukill[serve]') is not installed")

from helpers.http_server import Server, request, request_as  # noqa: E402
from helpers.marks import needs_root  # noqa: E402

from gpukillctl.http_gate import Gate  # noqa: E402


@pytest.fixture(scope="module")
def server(bed, users):
    s = Server(bed, users["owner"]).wait_ready()
    yield s
    s.stop()


def _unauthorized(r) -> None:
    assert r.status == 401, r
    assert r.error == "Unauthorized" and r.headers.get("www-authenticate") == "Bearer", r


@needs_root
def test_every_request_needs_the_token(server):
    token = server.token
    wrong_last = token[:-1] + ("A" if token[-1] != "A" else "B")
    for headers in (
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer "},
        {"Authorization": f"Basic {token}"},
        {"Authorization": f"Bearer {wrong_last}"},
        {"Authorization": f"Bearer {token[:-1]}"},
        {"Authorization": f"Bearer {token}x"},
    ):
        for method, path in (
            ("GET", "/v1/devices"),
            ("GET", "/v1/openapi.json"),
            ("POST", "/v1/kill"),
            ("POST", "/mcp"),
            ("GET", "/no/such/path"),
        ):
            _unauthorized(
                request(
                    server.port, method, path, headers=headers, body={"pid": 1} if method == "POST" else None
                )
            )
    assert server.call("GET", "/v1/devices").status == 200
    assert server.call("GET", "/v1/openapi.json").status == 200
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    r = server.call("POST", "/mcp", initialize, headers={"Accept": "application/json, text/event-stream"})
    assert r.status == 200 and "gpukill" in str(r.body), r  # the MCP app behind the same gate
    # two Authorization headers: which would count? Neither.
    conn_headers = [("Authorization", f"Bearer {token}"), ("Authorization", "Bearer other")]
    _unauthorized(_raw_request(server.port, "GET", "/v1/devices", conn_headers))


def _raw_request(port: int, method: str, path: str, headers: list[tuple[str, str]]):
    import http.client

    from helpers.http_server import Response

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest(method, path)
    for name, value in headers:
        conn.putheader(name, value)
    conn.endheaders()
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    return Response(response.status, {k.lower(): v for k, v in response.getheaders()}, body)


@needs_root
def test_another_local_user_cannot_use_the_server(server, bed, users):
    """bob reaches alice's port, but not her token: the file is hers alone, and a guess is refused."""
    other = users["other"]
    path = server.token_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == users["owner"].uid
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert bed.run_as(other, ["cat", str(path)]).returncode != 0
    stolen_looking = "x" * len(server.token)
    for method, path_, body in (
        ("GET", "/v1/devices", None),
        ("POST", "/v1/kill", {"pid": 1}),
        ("POST", "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
    ):
        r = request_as(
            bed, other, server.port, method, path_, {"Authorization": f"Bearer {stolen_looking}"}, body
        )
        _unauthorized(r)
    # the right token works from any user: it is the secret, not the uid, that the server checks
    assert (
        request_as(
            bed, other, server.port, "GET", "/v1/devices", {"Authorization": f"Bearer {server.token}"}
        ).status
        == 200
    )


@needs_root
def test_host_and_origin_are_checked(server):
    """DNS rebinding: a page of evil.example resolved to 127.0.0.1 sends Host: evil.example; a browser's
    cross-site request carries its Origin. Both are refused, on /v1 and /mcp alike."""
    p = server.port
    for path in ("/v1/devices", "/mcp"):
        r = server.call("GET", path, headers={"Host": f"evil.example:{p}"})
        assert (r.status, r.error) == (421, "BadHost"), r
        r = server.call("GET", path, headers={"Origin": "http://evil.example"})
        assert (r.status, r.error) == (403, "BadOrigin"), r
    for host in (f"127.0.0.1:{p}", f"localhost:{p}"):
        assert (
            server.call("GET", "/v1/devices", headers={"Host": host, "Origin": f"http://{host}"}).status
            == 200
        )
    assert server.call("GET", "/v1/devices", headers={"Host": f"localhost:{p + 1}"}).status == 421


@needs_root
def test_request_bodies_are_bounded(server):
    from gpukillctl.serve_app import MAX_BODY

    r = server.call("POST", "/v1/guard/test", raw=b"x" * (MAX_BODY + 1))
    assert (r.status, r.error) == (413, "PayloadTooLarge"), r
    r = server.call("POST", "/v1/guard/test", headers={"Content-Length": "1" + "0" * 30}, raw=b"")
    assert r.status in (400, 413), r


def _run_gate(gate: Gate, scope: dict, chunks: list[bytes]) -> list[dict]:
    sent: list[dict] = []

    async def go() -> None:
        messages = [
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)
        ]

        async def receive() -> dict:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        await gate(scope, receive, send)

    asyncio.run(go())
    return sent


def _scope(path: str = "/v1/kill", token: str = "t" * 32) -> dict:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"host", b"127.0.0.1:1"), (b"authorization", f"Bearer {token}".encode())],
    }


async def _reading_app(scope, receive, send) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


def test_a_streamed_body_is_cut_off_at_the_bound():
    """Without a Content-Length (chunked), the gate counts what the app reads."""
    gate = Gate(
        _reading_app,
        token="t" * 32,
        allowed_hosts=["127.0.0.1:1"],
        allowed_origins=[],
        max_body=10,
        max_in_flight=4,
    )
    assert _run_gate(gate, _scope(), [b"12345", b"12345"])[0]["status"] == 200
    sent = _run_gate(gate, _scope(), [b"12345", b"12345", b"1"])
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"])["error"] == "PayloadTooLarge"


def test_requests_in_flight_are_bounded():
    """Past max_in_flight, a REST request is refused at once (429), not queued; /mcp is the SDK's to bound."""

    async def go() -> list[int]:
        release = asyncio.Event()

        async def slow_app(scope, receive, send) -> None:
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        gate = Gate(
            slow_app,
            token="t" * 32,
            allowed_hosts=["127.0.0.1:1"],
            allowed_origins=[],
            max_body=10,
            max_in_flight=2,
        )
        statuses: list[int] = []

        async def one(path: str) -> None:
            async def receive() -> dict:
                return {"type": "http.request", "body": b""}

            async def send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            await gate(_scope(path), receive, send)

        held = [asyncio.create_task(one("/v1/kill")) for _ in range(2)]
        await asyncio.sleep(0.05)
        await one("/v1/devices")  # answered at once, while the two wait
        mcp = asyncio.create_task(one("/mcp"))
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(*held, mcp)
        assert gate.in_flight == 0
        return statuses

    assert asyncio.run(go()) == [429, 200, 200, 200]


@needs_root
def test_listening_elsewhere_needs_a_token_file(bed, users):
    owner = users["owner"]
    r = bed.ctl(owner, "serve", "--listen", "0.0.0.0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r
    assert "--token-file" in r.stderr and "refusing to start" in r.stderr, r
    # a token file others can read is no secret
    token_file = _users_dir(bed, owner) / "token"
    token_file.write_text("s" * 40 + "\n")
    os.chown(token_file, owner.uid, owner.gid)
    os.chmod(token_file, 0o640)
    r = bed.ctl(owner, "serve", "--listen", "0.0.0.0", "--token-file", str(token_file))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "chmod 600" in r.stderr, r
    os.chmod(token_file, 0o644)
    r = bed.ctl(users["other"], "serve", "--token-file", str(token_file))  # a file bob can read, but not his
    assert r.returncode == 2 and "not yours" in r.stderr, r
    # without a login session there is nowhere to keep a token made at start
    r = bed.run_as(owner, [*_ctl_argv(), "serve"], env={"XDG_RUNTIME_DIR": ""})
    assert r.returncode == 2 and "XDG_RUNTIME_DIR" in r.stderr and r.stderr.count("\n") == 1, r


def _users_dir(bed, user) -> Path:
    """A directory of the user's, which the user can reach (pytest's tmp_path is root's alone)."""
    path = bed.workdir / f"home-{user.name}"
    path.mkdir(exist_ok=True)
    os.chown(path, user.uid, user.gid)
    return path


def _ctl_argv() -> list[str]:
    from helpers.testbed import PYTHON

    return [PYTHON, "-m", "gpukillctl"]


@needs_root
def test_a_token_file_of_the_users_own(bed, users):
    """--token-file: that token, and no token is made or kept in the runtime directory."""
    owner = users["owner"]
    secret = "k" * 48
    token_file = _users_dir(bed, owner) / "own-token"
    token_file.write_text(secret + "\n")
    os.chown(token_file, owner.uid, owner.gid)
    os.chmod(token_file, 0o600)
    s = Server(bed, owner, "--token-file", str(token_file)).wait_ready()
    try:
        assert request(s.port, "GET", "/v1/devices", token=secret).status == 200
        assert not s.token_path.exists()
        assert secret not in s.output()
    finally:
        assert s.stop() == 0


@needs_root
def test_the_token_is_announced_once_and_removed_at_exit(bed, users):
    s = Server(bed, users["owner"]).wait_ready()
    path = s.token_path
    token = s.token
    out = s.output()
    # not a terminal (as under the user unit, into the journal): the header names the file, not the secret
    assert token not in out and f"Authorization: Bearer $(cat {path})" in out, out
    assert f"http://127.0.0.1:{s.port}" in out and "serving as gpkowner" in out, out
    assert s.stop() == 0, s.output()
    assert not path.exists()


def test_without_the_serve_extra_it_says_what_to_install(tmp_path):
    """The optional packages missing (made so by blocking the import of FastAPI): one line, exit status 1."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from gpukillctl.cli import main; sys.exit(main(['serve', '--port', '3999']))")
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r
    assert "pip install 'gpukill[serve]'" in r.stderr and "fastapi" in r.stderr, r
    assert not list(runtime.rglob("*.token")), "no token for a server that did not start"
