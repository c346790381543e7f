"""Getting in to `gpukillctl serve` as an admin does: `--open` on a headless box prints the link on its terminal,
the server ended by that terminal (SIGHUP) takes its token file with it, the documented ssh tunnel logs in and
acts through a real sshd, and root without XDG_RUNTIME_DIR gets a runtime directory of its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from urllib.parse import urlsplit

import pytest

pytest.importorskip("fastapi", reason="the serve extra (pip install 'gpukill[serve]') is not installed")
pytest.importorskip("mcp", reason="the serve extra (pip install 'gpukill[serve]') is not installed")

from helpers import sshd  # noqa: E402
from helpers.http_server import PYTHON, Server, free_port, request, runtime_dir  # noqa: E402
from helpers.marks import needs_root  # noqa: E402
from helpers.waiting import wait_until  # noqa: E402

from gpukill.procstat import read_stat  # noqa: E402
from gpukillctl.serve import server as serve_server  # noqa: E402

LINK = re.compile(r"log in to the dashboard once with: (http://127\.0\.0\.1:(\d+)/login\?code=[A-Za-z0-9_-]+)")


@needs_root
def test_open_without_a_browser_prints_the_link_and_a_hangup_removes_the_token(bed, users):
    """The server on a terminal (script(1) gives it a pty), $BROWSER a command that does not exist: the link is
    printed there; the terminal's SIGHUP ends the server, and its token file goes with it."""
    owner = users["owner"]
    runtime = runtime_dir(bed, owner)
    env = bed.env(XDG_RUNTIME_DIR=str(runtime), BROWSER="/nonexistent/browser")
    command = f"{PYTHON} -m gpukillctl serve --open"
    proc = subprocess.Popen(
        ["script", "-qfec", command, "/dev/null"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd="/",
        start_new_session=True,
        **owner.popen_kwargs(),
    )
    bed.procs.append(proc)
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    seen = b""

    def printed() -> bool:
        nonlocal seen
        seen += proc.stdout.read() or b""
        return LINK.search(seen.decode(errors="replace")) is not None

    wait_until(printed, 30, lambda: f"no link printed: {seen!r}", interval=0.1)
    link, port = LINK.search(seen.decode(errors="replace")).groups()
    token = runtime / "gpukill" / f"serve-{port}.token"
    assert token.exists()
    r = request(int(port), "GET", f"/login?{urlsplit(link).query}")
    assert r.status == 303, r  # the printed link logs in
    server = [
        int(p)
        for p in subprocess.run(
            ["pgrep", "-f", "-u", str(owner.uid), "gpukillctl serve --open"], capture_output=True, text=True
        ).stdout.split()
    ]
    assert server, "the server is not running"
    for pid in server:
        os.kill(pid, signal.SIGHUP)
    # script(1) may end before the server it ran has finished removing its token: wait for the server itself.
    wait_until(
        lambda: proc.poll() is not None and not any(running(pid) for pid in server),
        15,
        "the server did not end on SIGHUP",
        interval=0.1,
    )
    assert not token.exists(), "the token file outlived a hangup"


def running(pid: int) -> bool:
    """pid is a process that has not ended (a zombie has ended)."""
    stat = read_stat(pid)
    return stat is not None and stat.state != "Z"


@pytest.fixture(scope="module")
def tunnel_sshd(users):
    yield from sshd.serving(users["owner"].name, forwarding=True)


@needs_root
def test_the_documented_ssh_tunnel_logs_in_and_acts(bed, users, tunnel_sshd, victims):
    """docs/dashboard.md's recipe: `ssh -N -L LOCAL:127.0.0.1:PORT` and the printed link with LOCAL for PORT.
    The session works through it (the forwarded connections are the owner's sshd's), no --allow-host needed;
    a page of another port is still refused."""
    owner = users["owner"]
    server = Server(bed, owner, tcp=True).wait_ready()
    local = free_port()
    ssh = subprocess.Popen(
        [
            "ssh",
            "-F",
            str(tunnel_sshd.ssh_config),
            "-N",
            "-o",
            "ExitOnForwardFailure=yes",
            "-L",
            f"{local}:127.0.0.1:{server.port}",
            f"{owner.name}@localhost",
        ],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    bed.procs.append(ssh)
    try:

        def forwarded() -> bool:
            assert ssh.poll() is None, ssh.stderr.read() if ssh.stderr else ssh.returncode
            try:
                return request(local, "GET", "/v1/devices").status == 401
            except OSError:
                return False

        wait_until(forwarded, 20, "the tunnel never answered", interval=0.2)
        link = server.call("POST", "/login/link").body["url"]
        here = {"Host": f"127.0.0.1:{local}"}
        r = request(local, "GET", f"/login?{urlsplit(link).query}", headers=here)
        assert r.status == 303, r
        session = {
            **here,
            "Cookie": r.headers["set-cookie"].split(";", 1)[0],
            "X-Gpukill-Session": r.headers["location"].removeprefix("/#session="),
        }
        assert request(local, "GET", "/", headers={**here, "Cookie": session["Cookie"]}).status == 200
        devices = request(local, "GET", "/v1/devices", headers=session)
        assert devices.status == 200 and len(devices.body["devices"]) == 4, devices
        victim = victims.victim(owner, gpu=0, comm="tunneled")
        listed = victims.wait_listed(victim.pid)
        kill = {"pid": victim.pid, "start_time": listed["start_time"], "grace": 2}
        other_page = {**session, "Origin": f"http://127.0.0.1:{free_port()}", "Content-Type": "application/json"}
        r = request(local, "POST", "/v1/kill", headers=other_page, body=kill)
        assert (r.status, r.error) == (403, "BadOrigin"), r
        own_page = {**session, "Origin": f"http://127.0.0.1:{local}", "Content-Type": "application/json"}
        r = request(local, "POST", "/v1/kill", headers=own_page, body=kill)
        assert r.status == 200 and r.body["outcome"] == "terminated", r
        assert victim.wait(5) is not None
        # a name nobody gave is still refused, and the refusal says how a tunnel gets in
        r = request(local, "GET", "/v1/devices", headers={**session, "Host": f"evil.example:{local}"})
        assert (r.status, r.error) == (421, "BadHost") and "ssh -L" in r.body["message"], r
    finally:
        ssh.terminate()
        ssh.wait(10)
        assert server.stop() == 0, server.output()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the default is root's")
def test_root_without_xdg_runtime_dir_gets_a_directory_of_its_own(tmp_path, monkeypatch):
    base = tmp_path / "run-user-0"
    monkeypatch.setattr(serve_server, "ROOT_RUNTIME_DIR", str(base))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = serve_server.runtime_dir("for the test")
    assert path == base / "gpukill" and path.is_dir()
    assert (os.stat(base).st_mode & 0o777, os.stat(path).st_mode & 0o777) == (0o700, 0o700)
    assert serve_server.runtime_dir("again") == path  # a second start finds it


def test_a_user_without_xdg_runtime_dir_is_told_why(monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    with pytest.raises(serve_server.ServeError, match="XDG_RUNTIME_DIR is not set"):
        serve_server.runtime_dir("for the test")
