"""The door of the dashboard `gpukillctl serve` serves at `/`: the one-time login link and its session (a
cookie and the page's header, each useless alone), the page's refusal without it, the second lock on cross-site changes,
the security headers on every response,
the page's files and nothing else, `--open` and the guard policy routes the Guard page uses.

The session store is checked on its own (no server); the rest against a real server run as an unprivileged
user on TCP on the bed's bus, reached by other local users as on a shared machine.
"""

from __future__ import annotations

import http.client
import os
import re
import stat
import time
from urllib.parse import urlsplit

import pytest

from gpukillctl.web.session import CODE_SECONDS, MAX_CODES, MAX_SESSIONS, Sessions, cookie_name

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "worker-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}


# -- the session store -----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_code_logs_in_once_and_only_for_ten_minutes():
    clock = Clock()
    s = Sessions(clock)
    code = s.new_code()
    login = s.redeem(code)
    assert login and s.valid(login.cookie, login.page)
    assert s.redeem(code) is None, "a code works once"
    late = s.new_code()
    clock.now += CODE_SECONDS
    assert s.redeem(late) is None, "a code is good for 10 minutes"
    assert s.redeem("") is None and s.redeem(login.cookie) is None and s.redeem(login.page) is None
    assert not s.valid(code, code) and not s.valid("", "") and not s.valid(None, None)
    assert not s.valid(login.cookie + "x", login.page) and not s.valid(login.cookie, login.page + "x")


def test_a_session_is_its_two_halves_together():
    s = Sessions(Clock())
    first, second = s.redeem(s.new_code()), s.redeem(s.new_code())
    assert first and second and s.valid(second.cookie, second.page)
    assert not s.valid(first.cookie), "the cookie alone opens no data"
    assert not s.valid(first.cookie, ""), "nor with an empty header"
    assert not s.valid(first.cookie, second.page), "halves of two sessions are no session"
    assert not s.valid(first.page, first.cookie), "each half in its own place"
    assert s.valid(first.cookie, page_files=True), "the cookie alone opens the page's own files"
    assert not s.valid(first.page, page_files=True) and not s.valid(None, page_files=True)


def test_codes_and_sessions_are_bounded():
    s = Sessions(Clock())
    codes = [s.new_code() for _ in range(MAX_CODES + 1)]
    assert s.redeem(codes[0]) is None, "past MAX_CODES the oldest code is dropped"
    assert s.redeem(codes[1]) is not None
    assert len(s.codes) <= MAX_CODES
    logins = [s.redeem(s.new_code()) for _ in range(MAX_SESSIONS + 1)]
    assert not s.valid(logins[0].cookie, logins[0].page), "past MAX_SESSIONS the oldest session is dropped"
    assert all(s.valid(x.cookie, x.page) for x in logins[1:]) and len(s.secrets) == MAX_SESSIONS


def test_the_cookie_is_named_for_the_port():
    assert cookie_name(None) == "gpukill-session" and cookie_name(8080) == "gpukill-session-8080"


# -- a real server ---------------------------------------------------------------------------------------

pytest.importorskip("fastapi", reason="the serve extra (pip install 'gpukill[serve]') is not installed")
pytest.importorskip("mcp", reason="the serve extra (pip install 'gpukill[serve]') is not installed")

from helpers.http_server import Server, request, request_as  # noqa: E402
from helpers.marks import needs_root  # noqa: E402
from helpers.waiting import wait_until  # noqa: E402


@pytest.fixture(scope="module")
def server(bed, users):
    s = Server(bed, users["owner"], tcp=True).wait_ready()
    yield s
    s.stop()


def new_link(server: Server) -> str:
    r = server.call("POST", "/login/link")
    assert r.status == 200 and set(r.body) == {"url"}, r
    return r.body["url"]


def login(server: Server, url: str):
    """GET the one-time link (http.client does not follow the redirect): the response."""
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == ("http", f"127.0.0.1:{server.port}", "/login"), url
    return request(server.port, "GET", f"{parts.path}?{parts.query}")


def session_headers(server: Server) -> dict[str, str]:
    """What a logged-in page sends: the session's cookie and the page's half of it."""
    r = login(server, new_link(server))
    assert r.status == 303, r
    return {
        "Cookie": r.headers["set-cookie"].split(";", 1)[0],
        "X-Gpukill-Session": r.headers["location"].removeprefix("/#session="),
    }


@needs_root
def test_the_one_time_link_logs_in_exactly_once(server):
    url = new_link(server)
    r = login(server, url)
    assert r.status == 303 and re.fullmatch(r"/#session=[A-Za-z0-9_-]{43}", r.headers["location"]), r
    page_half = {"X-Gpukill-Session": r.headers["location"].removeprefix("/#session=")}
    name, _, rest = r.headers["set-cookie"].partition("=")
    secret, *attributes = rest.split("; ")
    assert name == f"gpukill-session-{server.port}" and len(secret) >= 43, r.headers
    assert attributes == ["HttpOnly", "SameSite=Strict", "Path=/"], r.headers  # no Max-Age: the browser's session
    assert r.headers["cache-control"] == "no-store"
    cookie = {"Cookie": f"{name}={secret}"}
    page = request(server.port, "GET", "/", headers=cookie)
    assert page.status == 200 and page.headers["content-type"].startswith("text/html"), page
    assert request(server.port, "GET", "/v1/devices", headers={**cookie, **page_half}).status == 200
    for alone in (cookie, page_half, {**cookie, "X-Gpukill-Session": "A" * 43}):  # each half alone: no data
        r = request(server.port, "GET", "/v1/devices", headers=alone)
        assert (r.status, r.error) == (401, "Unauthorized"), (alone, r)
    assert request(server.port, "GET", "/", headers=page_half).status == 401, "the page's files take the cookie"
    again = login(server, url)
    assert again.status == 403 and "set-cookie" not in again.headers, again
    assert again.headers["content-type"].startswith("text/html") and "was used or has expired" in again.body
    for path in (
        "/login?code=",
        "/login",
        "/login?code=" + "A" * 43,
        f"{urlsplit(url).path}?{urlsplit(url).query}&code=x",
    ):
        r = request(server.port, "GET", path)
        assert r.status == 403 and "set-cookie" not in r.headers, (path, r)
    forged = {"Cookie": f"{name}={'A' * len(secret)}"}
    r = request(server.port, "GET", "/v1/devices", headers=forged)
    assert (r.status, r.error) == (401, "Unauthorized"), r
    # the link names this server: another Host is refused before the code is looked at (and not used up)
    fresh = new_link(server)
    query = urlsplit(fresh).query
    r = request(server.port, "GET", f"/login?{query}", headers={"Host": f"evil.example:{server.port}"})
    assert (r.status, r.error) == (421, "BadHost"), r
    assert login(server, fresh).status == 303


@needs_root
def test_without_a_login_the_page_says_how_to_get_in(server):
    for path in ("/", "/static/app.js", "/static/index.html"):
        r = request(server.port, "GET", path)
        assert r.status == 401 and r.headers["content-type"].startswith("text/html"), (path, r)
        assert "gpukillctl serve --open" in r.body and "one-time link" in r.body, r.body
        assert "<script" not in r.body.lower(), r.body
    r = request(server.port, "HEAD", "/")
    assert r.status == 401 and r.headers["content-type"].startswith("text/html") and r.body == "", r
    for method, path in (("GET", "/v1/devices"), ("POST", "/v1/kill"), ("GET", "/ui/hosts"), ("GET", "/ui/stream")):
        r = request(server.port, method, path)
        assert (r.status, r.error) == (401, "Unauthorized") and r.headers.get("www-authenticate") == "Bearer", r
    # a new link takes the token itself: not the cookie, not nothing
    session = session_headers(server)
    origin = f"http://127.0.0.1:{server.port}"
    for headers in ({}, {**session, "Origin": origin, "Content-Type": "application/json"}):
        r = request(server.port, "POST", "/login/link", headers=headers, raw=b"{}")
        assert (r.status, r.error) == (401, "Unauthorized"), r


@needs_root
def test_a_cross_site_form_post_is_refused_and_the_process_lives(server, victims, users, alive):
    owner = users["owner"]
    victim = victims.victim(owner, gpu=0, comm="mine")
    listed = victims.wait_listed(victim.pid)
    cookie = session_headers(server)
    form = f"pid={victim.pid}&start_time={listed['start_time']}".encode()
    origin = f"http://127.0.0.1:{server.port}"
    kill = f'{{"pid": {victim.pid}, "start_time": {listed["start_time"]}, "grace": 2}}'.encode()
    refused = [
        # what evil.example's <form method=post> sends, if the browser sent the cookie at all
        (
            {**cookie, "Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"},
            form,
            "BadOrigin",
        ),
        ({**cookie, "Content-Type": "application/x-www-form-urlencoded"}, form, "CrossSite"),
        ({**cookie, "Origin": origin, "Content-Type": "application/x-www-form-urlencoded"}, form, "CrossSite"),
        ({**cookie, "Origin": origin, "Content-Type": "text/plain"}, kill, "CrossSite"),
        ({**cookie, "Content-Type": "application/json"}, kill, "CrossSite"),  # no Origin
        ({**cookie, "Origin": "http://evil.example", "Content-Type": "application/json"}, kill, "BadOrigin"),
    ]
    for headers, body, error in refused:
        r = request(server.port, "POST", "/v1/kill", headers=headers, raw=body)
        assert (r.status, r.error) == (403, error), (headers, r)
    r = request(server.port, "GET", "/v1/devices", headers={**cookie, "Origin": "http://evil.example"})
    assert (r.status, r.error) == (403, "BadOrigin"), r  # a wrong Origin, even on a read
    time.sleep(0.5)
    assert alive(victim.pid)
    # the page's own request: this Origin, JSON; the cookie acts as the server's user
    r = request(
        server.port,
        "POST",
        "/v1/kill",
        headers={**cookie, "Origin": origin, "Content-Type": "application/json; charset=utf-8"},
        raw=kill,
    )
    assert r.status == 200 and r.body["outcome"] == "terminated", r
    assert victim.wait(5) is not None


@needs_root
def test_the_security_headers_on_html_json_and_static(server):
    cookie = session_headers(server)
    responses = {
        "html": request(server.port, "GET", "/", headers=cookie),
        "json": server.call("GET", "/v1/devices"),
        "js": request(server.port, "GET", "/static/app.js", headers=cookie),
        "css": request(server.port, "GET", "/static/app.css", headers=cookie),
        "401": request(server.port, "GET", "/"),
        "json 401": request(server.port, "GET", "/v1/devices"),
        "404": server.call("GET", "/v1/nothing"),
    }
    for what, r in responses.items():
        for name, value in SECURITY.items():
            assert r.headers.get(name) == value, (what, name, r.headers)
    assert responses["html"].status == 200 and responses["json"].status == 200
    assert responses["js"].status == 200 and responses["js"].headers["content-type"].startswith("text/javascript")
    assert responses["css"].status == 200 and responses["css"].headers["content-type"].startswith("text/css")
    for what in ("html", "json", "401", "json 401", "404"):
        assert responses[what].headers.get("cache-control") == "no-store", (what, responses[what].headers)
    for what in ("js", "css"):
        assert responses[what].headers.get("cache-control") == "no-cache", responses[what].headers
        etag = responses[what].headers["etag"]
        path = f"/static/app.{what}"
        again = request(server.port, "GET", path, headers={**cookie, "If-None-Match": etag})
        assert again.status == 304, again
    # the page loads nothing but its own files: no inline script, no other origin
    html = responses["html"].body
    assert not re.search(r"<script(?![^>]*\bsrc=\"/static/)", html), html
    assert "http://" not in html and "https://" not in html, html


@needs_root
def test_only_the_pages_files_are_served(server):
    cookie = session_headers(server)
    assert _raw_get(server.port, "/static/app.js", cookie)[0] == 200  # the route is there, for its own files
    for path in (
        "/static/../session.py",
        "/static/..%2fsession.py",
        "/static/%2e%2e/session.py",
        "/static/../../http/gate.py",
        "/static/..",
        "/static/",
        "/static/.hidden",
        "/static/app.js/x",
        "/static/../__init__.py",
        "/index.html",
        "/static/nothing.js",
    ):
        r = _raw_get(server.port, path, cookie)
        assert r[0] in (400, 404), (path, r)
        assert b"import " not in r[1] and b"def " not in r[1], (path, r)


def _raw_get(port: int, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """The path sent exactly as written (no client normalizes it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@needs_root
def test_another_user_with_a_used_code_gets_nothing(server, bed, users):
    other = users["other"]
    url = new_link(server)
    path = f"{urlsplit(url).path}?{urlsplit(url).query}"
    assert login(server, url).status == 303  # the owner's browser used it
    r = request_as(bed, other, server.port, "GET", path, {"Host": f"127.0.0.1:{server.port}"})
    assert r.status == 403 and "set-cookie" not in r.headers, r
    for where in ("/", "/v1/devices"):
        r = request_as(bed, other, server.port, "GET", where, {"Host": f"127.0.0.1:{server.port}"})
        assert r.status == 401, r


def _listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(hex address, port) of each listening TCP socket of the process."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    address, port = fields[1].split(":")
                    found.add((address, int(port, 16)))
    return found


@needs_root
def test_open_opens_the_browser_on_a_link_that_works_on_loopback(bed, users):
    """--open without --tcp: the browser ($BROWSER, a script recording its URL) gets the one-time link of a
    server on 127.0.0.1 and a port the kernel picked; the token file is named for that port."""
    owner = users["owner"]
    home = bed.workdir / "browser-home"
    home.mkdir(exist_ok=True)
    os.chown(home, owner.uid, owner.gid)
    opened = home / "opened"
    browser = home / "browser"
    browser.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$1\" >> {opened}\n")
    browser.chmod(0o755)
    s = Server(bed, owner, "--open", env={"BROWSER": str(browser)})
    try:
        wait_until(
            lambda: opened.exists() and opened.read_text().endswith("\n"),
            30,
            lambda: f"no browser was opened: {s.output()}",
            interval=0.2,
        )
        urls = opened.read_text().split()
        assert len(urls) == 1, urls
        parts = urlsplit(urls[0])
        port = parts.port
        assert parts.hostname == "127.0.0.1" and parts.path == "/login" and parts.query.startswith("code="), urls
        assert _listening_addresses(s.proc.pid) == {("0100007F", port)}, "listening beyond loopback"
        token = s.runtime / "gpukill" / f"serve-{port}.token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert parts.query not in s.output(), "the link went to a log, not a terminal"
        r = request(port, "GET", f"/login?{parts.query}")
        assert r.status == 303 and r.headers["set-cookie"].startswith(f"gpukill-session-{port}="), r
        cookie = {"Cookie": r.headers["set-cookie"].split(";", 1)[0]}
        page_half = {"X-Gpukill-Session": r.headers["location"].removeprefix("/#session=")}
        assert request(port, "GET", "/", headers=cookie).status == 200
        assert request(port, "GET", "/v1/devices", headers={**cookie, **page_half}).status == 200
        assert request(port, "GET", f"/login?{parts.query}").status == 403
    finally:
        assert s.stop() == 0, s.output()


@needs_root
def test_a_bad_host_is_a_one_line_usage_error(bed, users):
    """A host ssh would take for an option is refused before anything listens, saying where it was given."""
    owner = users["owner"]
    r = bed.ctl(owner, "serve", "--tcp", "127.0.0.1:1", "--host=-oProxyCommand=x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r
    assert "--host '-oProxyCommand=x': " in r.stderr and "unrecognized" not in r.stderr, r
    home = bed.workdir / "hosts-home"
    home.mkdir(exist_ok=True)
    os.chown(home, owner.uid, owner.gid)
    hosts = home / "hosts"
    hosts.write_text("# the lab\nnode2\n\n-oProxyCommand=x\n")
    r = bed.ctl(owner, "serve", "--tcp", "127.0.0.1:1", "--hosts-file", str(hosts))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"{hosts}:4: " in r.stderr, r


@needs_root
def test_the_banner_names_the_dashboard_and_how_to_log_in(server):
    out = server.output()
    url = f"http://127.0.0.1:{server.port}"
    assert f"the dashboard at {url}/" in out, out
    assert "/login?code=" not in out, "a login link went to a log, not a terminal"
    assert f"POST {url}/login/link with the token" in out, out
