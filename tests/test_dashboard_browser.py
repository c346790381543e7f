"""The dashboard in a real browser: Debian's headless chromium (tests/helpers/browser.py, through Selenium)
on `gpukillctl serve --tcp 127.0.0.1:PORT`, run as the test user gpkowner, on the bed's real gpukilld, polkitd
and journald. One browser for the module (chromium takes seconds to start on two cores).

GPUKILL_SCREENSHOTS=docs/screenshots writes the README's screenshots (test_every_page_draws_its_data).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import cgroups as cgroup_helper
from helpers import lab as lab_helper
from helpers import nvml_host, suspending
from helpers import sshd as sshd_helper
from helpers.browser import Browser, why_not
from helpers.http_server import Server, request_as
from helpers.marks import needs_root, slow
from helpers.procs import pid_alive
from helpers.testbed import REPO, SYSTEM_PYTHON, Testbed, User

from gpukilld import journal as audit

STATIC = REPO / "gpukillctl" / "web" / "static"
PAGES = ("overview", "processes", "guard", "audit", "usage", "events")
# The bed's hostile names: each is a process's argv[0] (its command line) and, cut to the kernel's 15
# characters, its comm.
HOSTILE = ("<img src=x onerror=alert(1)>", "</script><script>alert(1)</script>")
TEST_POLICY = """rules:
  - name: "no-miners"
    conditions:
      - type: "process_name"
        operator: "contains_any"
        value: ["xmrig"]
    action: "kill"
"""

BROWSER_MISSING = why_not()
CLONE_NEWUTS = 0x04000000  # <linux/sched.h>


def in_browser(test):
    """A test with the bed and chromium: root, the browser installed; slow (it still runs in CI)."""
    for mark in (needs_root, slow, pytest.mark.skipif(BROWSER_MISSING is not None, reason=BROWSER_MISSING or "")):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


@pytest.fixture(scope="module")
def server(bed, users):
    s = Server(bed, users["owner"], tcp=True).wait_ready()
    yield s
    s.stop()


def named_victim(
    bed: Testbed, user: User, name: str, gpu: int = 0, mem: str = "1GiB", util: float = 0
) -> subprocess.Popen:
    """A real process on a simulated GPU whose command line starts with `name` (its argv[0]) and whose comm
    is `name` cut to 15 characters (prctl PR_SET_NAME), as a user can name any process of theirs."""
    code = (
        f"import ctypes, time\nctypes.CDLL(None).prctl(15, {name.encode()[:15]!r}, 0, 0, 0)\n"
        "print('ready', flush=True)\ntime.sleep(600)\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUKILL_SIM_GPU": str(gpu),
        "GPUKILL_SIM_SCOPE": bed.scope,
        "GPUKILL_SIM_MEM": mem,
        "GPUKILL_SIM_UTIL": str(util),
    }
    proc = subprocess.Popen(
        [name, "-c", code],
        executable=SYSTEM_PYTHON,
        stdout=subprocess.PIPE,
        env=env,
        cwd="/",
        start_new_session=True,
        **user.popen_kwargs(),
    )
    bed.procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    # gpukilld may have listed it before its prctl (a loaded machine): the comm event is seen in a later sample
    bed.wait_listed(proc.pid, comm=name.encode()[:15].decode(errors="replace"))
    return proc


def row_selector(pid: int, host: int = 0) -> str:
    return f'#processes tr.proc[data-host="{host}"][data-pid="{pid}"]'


def wait_row(browser: Browser, pid: int, host: int = 0, timeout: float = 15.0):
    return browser.wait(
        lambda: browser.css(row_selector(pid, host)),
        timeout,
        f"PID {pid} of host {host} never appeared on the processes page",
    )[0]


def kill_from_page(browser: Browser, pid: int) -> tuple[str, str]:
    """Click the row's kill button, check the confirmation names the process, say yes; (#flash's kind, text)."""
    flash_before = browser.text("#flash")
    wait_row(browser, pid).find_element("css selector", "button.kill").click()
    dialog = browser.wait(
        lambda: [d for d in browser.css("dialog#confirm") if d.is_displayed()], 5, "dialog#confirm did not open"
    )[0]
    question = dialog.find_element("css selector", "#confirm-text").text
    browser.css("#confirm-yes")[0].click()
    browser.wait(
        lambda: browser.css("#flash")[0].is_displayed() and browser.text("#flash") != flash_before,
        30,
        "#flash showed no answer",
    )
    flash = browser.css("#flash")[0]
    return question, f"{flash.get_attribute('data-kind')}\n{flash.text}"


# -- getting in -----------------------------------------------------------------------------------------------


@in_browser
def test_without_the_link_the_page_says_how_to_get_in(browser, server):
    browser.driver.delete_all_cookies()
    browser.driver.get(f"http://{server.host}/#/processes")
    body = browser.css("body")[0].text
    assert "gpukillctl serve --open" in body, body
    assert not browser.css("section.host") and not browser.css("script"), "the refusal page is no dashboard"
    assert not browser.ready()
    link = Browser.login_link(server)
    browser.driver.get(link)  # used once: the second use is refused
    browser.driver.delete_all_cookies()
    browser.driver.get(link)
    assert "used or has expired" in browser.css("body")[0].text
    assert not browser.ready()


@in_browser
def test_the_one_time_link_logs_in(browser, server):
    browser.driver.delete_all_cookies()
    browser.login(server)
    assert browser.driver.current_url == f"http://{server.host}/#/overview", "the page's half left the address"
    host = browser.css('section.host[data-host="0"]')[0]
    assert host.get_attribute("data-state") == "up"
    assert len(browser.css('.gpu[data-host="0"]')) == 4  # examples/simulate.yaml's four GPUs
    cookies = {c["name"]: c for c in browser.driver.get_cookies()}
    cookie = cookies[f"gpukill-session-{server.port}"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict", cookie
    assert browser.driver.execute_script("return document.cookie") == ""  # HttpOnly: no script reads it


# A page another local user serves on another loopback port: it writes each request's headers, one JSON line a
# request, to the file its argument names. Cookies are scoped by host, not port: the browser sends it the
# dashboard's session cookie.
HEADER_RECORDER = """
import http.server, json, sys
out = open(sys.argv[1], "a")
class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        out.write(json.dumps(dict(self.headers)) + "\\n"); out.flush()
        body = b"<!doctype html><title>bob</title><p>nothing to see</p>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args): pass
server = http.server.HTTPServer(("127.0.0.1", 0), Page)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@in_browser
def test_another_users_page_sees_the_cookie_and_replaying_it_reads_and_kills_nothing(browser, server, victims, users):
    owner, other = users["owner"], users["other"]
    mine = victims.victim(owner, gpu=0, mem="2GiB", util=30, comm="alice-job")
    browser.login(server, "processes")
    wait_row(browser, mine.pid)
    # bob's page, opened in alice's browser (a link in a chat): the browser hands it her session cookie
    log = victims.workdir / "bobs-page.log"
    log.touch()
    log.chmod(0o666)
    page = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", HEADER_RECORDER, str(log)],
        stdout=subprocess.PIPE,
        cwd="/",
        start_new_session=True,
        **other.popen_kwargs(),
    )
    victims.procs.append(page)
    assert page.stdout is not None
    bobs_port = int(page.stdout.readline())
    browser.driver.get(f"http://127.0.0.1:{bobs_port}/")
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    cookies = [h.get("Cookie", "") for h in seen]
    name = f"gpukill-session-{server.port}"
    stolen = next((c for header in cookies for c in header.split("; ") if c.startswith(name + "=")), None)
    assert stolen, f"the browser did not send bob's page the cookie (the threat this test is about): {seen}"
    assert browser.driver.execute_script("return localStorage.getItem('gpukill-session')") is None, (
        "bob's page (another port, another origin) reads nothing of the dashboard's storage"
    )
    # bob replays it from his own process, with every header a page of alice's would send
    listed = victims.wait_listed(mine.pid)
    origin = f"http://127.0.0.1:{server.port}"
    replay = {
        "Host": f"127.0.0.1:{server.port}",
        "Cookie": stolen,
        "Origin": origin,
        "Content-Type": "application/json",
        "Accept": "application/json",
    }
    kill = {"pid": mine.pid, "start_time": listed["start_time"], "grace": 1}
    for extra in ({}, {"X-Gpukill-Session": "A" * 43}, {"X-Gpukill-Session": stolen.partition("=")[2]}):
        for method, path, body in (
            ("GET", "/v1/processes", None),
            ("POST", "/v1/kill", kill),
            ("GET", "/ui/hosts", None),
        ):
            r = request_as(victims, other, server.port, method, path, {**replay, **extra}, body)
            assert r.status == 401, (extra, path, r)
            assert str(mine.pid) not in json.dumps(r.body), r
    # were bob to hold both halves, his process is not the server's user: the kernel says whose socket it is
    browser.open(server, "processes")
    half = browser.driver.execute_script("return localStorage.getItem('gpukill-session')")
    assert half, "the page keeps its half of the session in its origin's storage"
    r = request_as(victims, other, server.port, "POST", "/v1/kill", {**replay, "X-Gpukill-Session": half}, kill)
    assert (r.status, r.body["error"]) == (403, "NotYourSession"), r
    time.sleep(0.5)
    assert pid_alive(mine.pid), "a replayed session killed alice's process"
    assert not victims.journal(GPUKILL_TARGET_PID=str(mine.pid), MESSAGE_ID=audit.KILL.message_id)
    # alice's own page goes on: live, and its kill button works
    question, answer = kill_from_page(browser, mine.pid)
    assert answer.startswith("ok\n") and "terminated" in answer, answer
    browser.wait(lambda: not browser.css(row_selector(mine.pid)), 5, "the killed process stayed on the page")


# -- live -----------------------------------------------------------------------------------------------------


@in_browser
def test_a_kill_made_elsewhere_leaves_the_open_page_within_2s(browser, server, victims, users):
    owner = users["owner"]
    by_cli = victims.victim(owner, gpu=0, mem="2GiB", util=50, comm="cli-victim")
    exits = victims.victim(owner, gpu=1, mem="1GiB", util=10, comm="exits")
    browser.login(server, "processes")
    for pid in (by_cli.pid, exits.pid):
        wait_row(browser, pid)
    r = victims.ctl(owner, "kill", str(by_cli.pid), "--grace", "2")
    assert r.returncode == 0, r
    assert by_cli.wait(5) is not None
    gone_at = time.monotonic()
    browser.wait(
        lambda: not browser.css(row_selector(by_cli.pid)),
        2.0,
        "a process killed with gpukillctl kill was still on the page 2 s later",
    )
    exits.kill()
    exits.wait(5)
    gone_at = time.monotonic()
    browser.wait(
        lambda: not browser.css(row_selector(exits.pid)), 2.0, "a process that exited was still on the page 2 s later"
    )
    assert time.monotonic() - gone_at <= 2.5
    # Live from the stream alone: the page never asked /v1/processes.
    asked = browser.driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => new URL(e.name).pathname)"
    )
    assert not [p for p in asked if p.endswith("/processes")], asked


@in_browser
def test_the_kill_button_kills_ones_own_process_and_shows_polkits_refusal(browser, server, victims, users):
    owner, other = users["owner"], users["other"]
    mine = victims.victim(owner, gpu=0, mem="3GiB", util=40, comm="mine")
    theirs = victims.victim(other, gpu=1, mem="3GiB", util=40, comm="theirs")
    browser.login(server, "processes")
    hostname = wait_row(browser, mine.pid).find_element("css selector", "td.col-host").get_attribute("textContent")

    question, answer = kill_from_page(browser, mine.pid)
    for part in (str(mine.pid), "mine", owner.name, hostname):
        assert part in question, (part, question)
    assert answer.startswith("ok\n") and "terminated" in answer, answer
    assert mine.wait(10) is not None
    entries = victims.wait_journal(GPUKILL_TARGET_PID=str(mine.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entries and entries[0]["GPUKILL_CALLER_UID"] == str(owner.uid), entries

    question, answer = kill_from_page(browser, theirs.pid)
    assert str(theirs.pid) in question and other.name in question, question
    listed = victims.wait_listed(theirs.pid)
    same = server.call("POST", "/v1/kill", {"pid": theirs.pid, "start_time": listed["start_time"]})
    assert same.status == 403 and "not authorized" in same.body["message"], same
    assert answer == f"error\n{same.body['message']}", "the page must show polkit's answer as it is"
    denied = victims.wait_journal(GPUKILL_TARGET_PID=str(theirs.pid), MESSAGE_ID=audit.KILL_DENIED.message_id)
    assert denied and denied[0]["GPUKILL_CALLER_UID"] == str(owner.uid), denied
    time.sleep(0.3)
    assert pid_alive(theirs.pid)


@in_browser
def test_hostile_process_names_render_as_text(browser, server, victims, users):
    procs = [named_victim(victims, users["owner"], name, gpu=i) for i, name in enumerate(HOSTILE)]
    browser.login(server, "processes")
    for proc, name in zip(procs, HOSTILE, strict=True):
        row = wait_row(browser, proc.pid)
        cell = row.find_element("css selector", "td.col-name")
        assert cell.find_element("css selector", ".comm").get_attribute("textContent") == name[:15]
        assert cell.find_element("css selector", ".cmdline").get_attribute("textContent").startswith(name + " -c ")
    assert browser.alert_text() is None and not browser.css("img"), "a process's name became markup"
    # In the confirmation too (then cancelled), on the overview as idle holders, and among the events.
    wait_row(browser, procs[1].pid).find_element("css selector", "button.kill").click()
    assert HOSTILE[1][:15] in browser.text("#confirm-text")
    assert browser.text("#confirm-cmdline").startswith(HOSTILE[1])
    browser.css("#confirm-no")[0].click()
    assert pid_alive(procs[1].pid)
    browser.open(server, "overview")
    browser.driver.find_element("css selector", '#idle-after option[value="0"]').click()
    browser.wait(lambda: len(browser.css(".reclaim")) >= 2, 10, "the idle holders were not listed to reclaim")
    reclaim = " ".join(r.get_attribute("textContent") for r in browser.css(".reclaim"))
    assert HOSTILE[0][:15] in reclaim and HOSTILE[1][:15] in reclaim, reclaim
    r = victims.ctl(users["owner"], "kill", str(procs[1].pid), "--grace", "2")
    assert r.returncode == 0, r
    browser.open(server, "events")
    browser.wait(
        lambda: [e for e in browser.css("#events tr.event") if HOSTILE[1][:15] in e.text],
        10,
        "the kill's ProcessKilled signal did not reach the events page",
    )
    assert browser.alert_text() is None, "a process's name ran as script"
    assert not browser.css("img"), "a process's name became markup"
    assert len(browser.css("script")) == 1  # index.html's own


# -- labels and hosts named with markup -------------------------------------------------------------------

# A user names a unit of theirs freely within systemd's grammar, whose escapes ("\x3c") stand for what it
# excludes: this one is `systemd-escape '<img src=x onerror=alert(1)>'`, shown as written, never unescaped.
ESCAPED_UNIT = r"run-\x3cimg\x20src\x3dx\x20onerror\x3dalert\x281\x29\x3e-{}.service"
MARKUP_POLICY = """rules:
  - {{name: "by-unit", action: log, conditions: [{{type: unit, operator: "==", value: '{unit}'}}]}}
  - {{name: "by-container", action: log, conditions: [{{type: container, operator: "==", value: "{container}"}}]}}
  - {{name: "by-job", action: log, conditions: [{{type: slurm_job, operator: "==", value: "{job}"}}]}}
"""


@contextlib.contextmanager
def machine_named(name: str):
    """Children started inside see `name` as the machine's host name: the calling thread enters a UTS namespace
    of its own (what `unshare --uts` makes), sets it, and goes back to the machine's at the end."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/uts") as home:
        if libc.unshare(CLONE_NEWUTS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS)")
        try:
            socket.sethostname(name)
            yield
        finally:
            if libc.setns(home.fileno(), CLONE_NEWUTS) != 0:
                raise OSError(ctypes.get_errno(), "setns(CLONE_NEWUTS)")


def labelled_victim(bed: Testbed, user: User, dirs: list[Path], comm: str, gpu: int, util: float = 0):
    """A real process of `user` on a simulated GPU, put by root in `dirs` (cgroups, as systemd, slurmd or a
    container runtime puts a task), that names itself `comm` (cut to 15 characters)."""
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUKILL_SIM_GPU": str(gpu),
        "GPUKILL_SIM_SCOPE": bed.scope,
        "GPUKILL_SIM_MEM": "2GiB",
        "GPUKILL_SIM_UTIL": str(util),
    }
    rename = f"import ctypes\nctypes.CDLL(None).prctl(15, {comm.encode()[:15]!r}, 0, 0, 0)\n"
    proc = cgroup_helper.start_in(user, dirs, env, rename + cgroup_helper.SLEEPER)
    bed.procs.append(proc)
    bed.wait_listed(proc.pid, comm=comm[:15])
    return proc


def assert_no_markup(browser: Browser, page: str) -> None:
    assert browser.alert_text() is None, f"a name ran as script on the {page} page"
    assert not browser.css("img") and not browser.css("main script"), f"a name became markup on the {page} page"
    assert len(browser.css("script")) == 1, f"a script was added on the {page} page"  # index.html's own


@in_browser
def test_hostile_unit_container_job_pod_and_host_names_render_as_text_on_every_page(browser, victims, users):
    """Host 0 is named `<img src=x onerror=alert(1)>` (the server runs in a UTS namespace of that host name;
    a second host, where nothing answers, shows the host column and picker; --host refuses markup in its user
    part, test_remote.py); processes sit in cgroups whose names carry markup below a real unit, container, pod
    and Slurm job, and name themselves with markup. Every page shows each as text: no element, no dialog, no
    script, and the text is the one given."""
    if why := cgroup_helper.why_no_cgroups():
        pytest.skip(why)
    owner = users["owner"]
    uid, tag = owner.uid, os.getpid()  # ids of this run's own: runs side by side do not share a cgroup
    unit, job = ESCAPED_UNIT.format(tag), str(tag)
    container, pod_container = f"{tag:08x}" + "c" * 56, f"{tag:08x}" + "d" * 56
    pod = f"{tag:08x}-0bad-4f00-8d00-0123456789ab"
    made = cgroup_helper.Cgroups()
    roots = cgroup_helper.systemd_roots()
    try:
        places = {  # a real label, then a directory named with markup below it (no label: not the grammar's)
            "unit": [
                made.make(r, f"user.slice/user-{uid}.slice/user@{uid}.service/app.slice/{unit}/{HOSTILE[0]}")
                for r in roots
            ],
            # "</script>..." holds slashes: it is a path of three directories here, shown in no label
            "container": [made.make(r, f"system.slice/docker-{container}.scope/{HOSTILE[1]}") for r in roots],
            "pod": [made.make(r, f"kubepods/burstable/pod{pod}/{pod_container}/{HOSTILE[0]}") for r in roots],
            "job": [
                made.make(cgroup_helper.controller_root("freezer"), f"slurm/uid_{uid}/job_{job}/step_0/{HOSTILE[0]}")
            ],
        }
        procs = {
            what: labelled_victim(victims, owner, dirs, HOSTILE[i % 2], gpu=i)
            for i, (what, dirs) in enumerate(places.items())
        }
        # a miner whose command line's pool URL carries markup: the audit's evidence quotes it
        miner = named_victim(victims, owner, f"xmrig stratum+tcp://{HOSTILE[1]}", gpu=0, util=99)
        expected = {"unit": unit, "container": container[:12], "pod": pod, "job": job}
        fields = {
            "unit": ("unit", unit),
            "container": ("container_id", container),
            "pod": ("pod_uid", pod),
            "job": ("slurm_job", job),
        }
        for what, proc in procs.items():
            listed = victims.wait_listed(proc.pid)
            assert listed.get(fields[what][0]) == fields[what][1], listed
        remote = f"{owner.name}@localhost:{sshd_helper.free_port()}"
        with machine_named(HOSTILE[0]):
            served = Server(victims, owner, "--host", remote, tcp=True)
        served.wait_ready()
        try:
            _every_page_shows_the_names_as_text(
                browser,
                served,
                victims,
                owner,
                procs,
                miner,
                expected,
                unit=unit,
                job=job,
                pod=pod,
                container=container,
                remote=remote,
            )
        finally:
            served.stop()
    finally:
        made.cleanup()  # stops the processes in them first


def _every_page_shows_the_names_as_text(
    browser, served, victims, owner, procs, miner, expected, *, unit, job, pod, container, remote
):
    browser.login(served, "overview", timeout=60)
    browser.wait(
        lambda: browser.css('section.host[data-host="1"][data-state="down"]'),
        60,
        "the host where nothing answers is not shown down",
    )
    names = [h.get_attribute("textContent") for h in browser.css("section.host .host-name")]
    assert names == [HOSTILE[0], remote], names
    assert [o.get_attribute("textContent") for o in browser.css("#host-select option")] == [HOSTILE[0], remote]
    browser.driver.find_element("css selector", '#idle-after option[value="0"]').click()
    browser.wait(lambda: len(browser.css('.reclaim[data-host="0"]')) >= len(procs), 10, "idle holders not listed")
    reclaim = " ".join(r.get_attribute("textContent") for r in browser.css(".reclaim"))
    assert HOSTILE[0][:15] in reclaim and HOSTILE[1][:15] in reclaim, reclaim
    assert_no_markup(browser, "overview")
    browser.screenshot("markup-overview")

    browser.open(served, "processes")
    for what, proc in procs.items():
        row = wait_row(browser, proc.pid)
        cell = row.find_element("css selector", f"td.col-{what}").get_attribute("textContent")
        assert cell == expected[what], (what, cell)
        assert row.find_element("css selector", "td.col-host").get_attribute("textContent") == HOSTILE[0]
        assert (
            row.find_element("css selector", ".comm").get_attribute("textContent")
            == HOSTILE[list(procs).index(what) % 2][:15]
        )
    wait_row(browser, procs["unit"].pid).find_element("css selector", "button.kill").click()
    assert f"on host {HOSTILE[0]}?" in browser.driver.find_element("css selector", "#confirm-text").get_attribute(
        "textContent"
    )
    browser.css("#confirm-no")[0].click()
    # the long unit is cut to its column (a container's scope, docker-<64 hex>.scope, is long too), whole in the
    # cell's tooltip
    cell = wait_row(browser, procs["unit"].pid).find_element("css selector", "td.col-unit")
    assert cell.get_attribute("title") == unit
    assert browser.driver.execute_script("return arguments[0].scrollWidth > arguments[0].clientWidth", cell), (
        "a long unit name widens its column to the whole name"
    )
    browser.css("#filter")[0].send_keys(r"\x3cimg")
    browser.wait(
        lambda: [r.get_attribute("data-pid") for r in browser.css("#processes tr.proc")] == [str(procs["unit"].pid)],
        5,
        "the filter does not match the unit as written",
    )
    browser.css("#filter")[0].clear()
    browser.css("#filter")[0].send_keys(" ")
    assert_no_markup(browser, "processes")
    browser.screenshot("markup-processes")

    browser.open(served, "guard")
    browser.wait(lambda: browser.css("#guard-rules"), 15, "no Guard status")
    policy = MARKUP_POLICY.format(unit=unit, container=container, job=job)
    browser.driver.execute_script("arguments[0].value = arguments[1]", browser.css("#policy-text")[0], policy)
    browser.css("#policy-test")[0].click()
    rows = browser.wait(
        lambda: len(browser.css("#decisions tbody tr")) >= 3 and browser.css("#decisions tbody tr"),
        15,
        lambda: f"no decisions for the pasted policy: {browser.text('#guard-decisions')!r}",
    )
    decided = {}
    for row in rows:
        cells = [td.get_attribute("textContent") for td in row.find_elements("css selector", "td")]
        decided[cells[0]] = cells
    for rule, what in (("by-unit", "unit"), ("by-container", "container"), ("by-job", "job")):
        _, subject, *_, pids, reason = decided[rule]
        assert pids == str(procs[what].pid), decided[rule]
        assert HOSTILE[list(procs).index(what) % 2][:15] in subject, subject  # the process's name, as text
    assert unit in decided["by-unit"][-1] or unit.replace("\\", "\\\\") in decided["by-unit"][-1], decided
    assert_no_markup(browser, "guard")
    browser.driver.execute_script("arguments[0].scrollIntoView()", browser.css("#decisions")[0])
    browser.screenshot("markup-guard")

    browser.open(served, "audit")
    finding = browser.wait(
        lambda: [r for r in browser.css("#findings tr.finding") if r.get_attribute("data-pid") == str(miner.pid)],
        15,
        lambda: f"the miner was not found: {browser.text('#audit-findings')!r}",
    )[0]
    details = [d.get_attribute("textContent") for d in finding.find_elements("css selector", ".evidence .detail")]
    assert f"stratum URL in the command line: stratum+tcp://{HOSTILE[1]}" in details, details
    assert_no_markup(browser, "audit")
    browser.screenshot("markup-audit")

    browser.open(served, "usage")
    for by, key in (("unit", unit), ("job", job), ("pod", pod)):
        browser.driver.find_element("css selector", f'#usage-by option[value="{by}"]').click()

        def keys():
            return [
                tr.find_element("css selector", "td").get_attribute("textContent")
                for tr in browser.css("#usage-table tbody tr")
            ]

        browser.wait(lambda: key in keys(), 30, lambda: f"no usage row of {by} {key}: {keys()}")  # noqa: B023
        # each label whole in its tooltip, and drawn inside the chart (a long one cut, not run off its left)
        labels = browser.driver.execute_script(
            "return [...document.querySelectorAll('#usage-report svg text.chart-label')]"
            ".map((t) => [t.querySelector('title').textContent, t.getBBox().x])"
        )
        assert key in [name for name, _ in labels], (by, labels)
        assert all(x >= 0 for _, x in labels), (by, labels)
        assert_no_markup(browser, f"usage by {by}")
        if by == "unit":
            browser.screenshot("markup-usage")

    assert victims.ctl(owner, "kill", str(procs["container"].pid), "--grace", "2").returncode == 0
    browser.open(served, "events")
    event = browser.wait(
        lambda: [
            e
            for e in browser.css("#events tr.event")
            if f"PID {procs['container'].pid} " in e.get_attribute("textContent")
        ],
        15,
        "the kill did not reach the events page",
    )[0]
    cells = [td.get_attribute("textContent") for td in event.find_elements("css selector", "td")]
    assert cells[1] == HOSTILE[0] and f"({HOSTILE[1][:15]})" in cells[3], cells
    assert_no_markup(browser, "events")
    browser.screenshot("markup-events")


# -- a lab --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(bed, users):
    yield from lab_helper.serving(bed, users["owner"])


@in_browser
def test_two_hosts_over_ssh_on_one_page_one_of_them_stopped(browser, lab, victims, users):
    owner = users["owner"]
    mine = victims.victim(owner, gpu=2, mem="5GiB", util=70, comm="lab-job")
    served = lab.serve(owner, *lab.hosts)
    try:
        browser.login(served, "overview", timeout=60)
        browser.wait(
            lambda: browser.css('section.host[data-host="1"][data-state="up"]'),
            60,
            lambda: "the second host is not up: " + browser.text('section.host[data-host="1"]'),
        )
        stopped = browser.wait(
            lambda: browser.css('section.host[data-host="2"][data-state="down"]'),
            60,
            "the stopped host is not shown down",
        )[0]
        assert stopped.find_element("css selector", ".host-error").text, "the stopped host's error is not said"
        assert len(browser.css('.gpu[data-host="1"]')) == 4 and not browser.css('.gpu[data-host="2"]')
        assert len(browser.css('section.host[data-host="0"] .gpu')) == 4
        names = [o.text for o in browser.css("#host-select option")]
        assert names[1:] == [lab.remote, lab.stopped], names
        assert browser.css("#host-picker")[0].is_displayed()
        browser.screenshot("lab")
        browser.open(served, "processes")
        for host in (0, 1):
            wait_row(browser, mine.pid, host, timeout=30)
    finally:
        served.stop()


# -- suspended workloads -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nvhost(tmp_path_factory):
    return nvml_host.fake_nvidia_host(tmp_path_factory.mktemp("nvml"), devices=2)


@in_browser
def test_suspended_processes_have_their_section_and_leave_it_when_resumed(browser, fresh_bed, nvhost, users):
    """On the fake NVIDIA host with the fake cuda-checkpoint: the overview's host and the processes page show a
    "Suspended" section (the host memory held, a stuck process in red with its remedy), kept apart from the
    running processes; a resume made elsewhere moves the process back among them, without a reload."""
    owner = users["owner"]
    # the log from here on is this test's: the last test's page (its server stopped) is left first, and what it
    # logged on the way out is drained
    browser.driver.get("about:blank")
    browser.driver.get_log("browser")
    saved = nvhost.snapshot()
    suspending.start_daemon(fresh_bed, nvhost)
    served = Server(fresh_bed, owner, tcp=True).wait_ready()
    try:
        running = suspending.on_gpu(fresh_bed, nvhost, owner, "train.py", 30 * suspending.GIB)
        held = suspending.suspended(fresh_bed, nvhost, owner, "notebook", 4 * suspending.GIB)
        stuck = suspending.suspended(fresh_bed, nvhost, owner, "eval.py", 2 * suspending.GIB, gpu=1)
        nvhost.checkpoint_fault(stuck, restore_oom=True)
        assert fresh_bed.ctl(owner, "resume", str(stuck)).returncode == 1  # its restore fails: stuck
        browser.login(served, "overview")
        section = browser.wait(
            lambda: [t for t in browser.css("section.host table.suspended-table") if t.is_displayed()],
            15,
            lambda: "no suspended table on the overview: " + browser.text("#hosts-overview"),
        )[0]
        assert "2 processes, 6.0 GiB of GPU memory held in host memory" in browser.text("#hosts-overview")
        rows = {r.get_attribute("data-pid"): r for r in section.find_elements("css selector", "tr.suspended")}
        assert set(rows) == {str(held), str(stuck)}, rows
        assert "notebook" in rows[str(held)].text and "4.0 GiB" in rows[str(held)].text
        assert rows[str(stuck)].get_attribute("data-state") == "stuck" and "kill" in rows[str(stuck)].text
        browser.screenshot("suspended-overview")

        browser.open(served, "processes")
        wait_row(browser, running)
        browser.wait(lambda: browser.css("#suspended tr.suspended"), 10, "no suspended section on the processes page")
        assert browser.css("#suspended-section")[0].is_displayed()
        assert not browser.css(row_selector(held)), "a suspended process is not a running row"
        assert "(2 processes, 6.0 GiB of GPU memory held in host memory)" in browser.text("#suspended-count")
        browser.screenshot("suspended-processes")

        assert fresh_bed.ctl(owner, "resume", str(held)).returncode == 0
        wait_row(browser, held)  # back among the running ones
        browser.wait(
            lambda: [r.get_attribute("data-pid") for r in browser.css("#suspended tr.suspended")] == [str(stuck)],
            10,
            "the resumed process is still in the suspended section",
        )
        problems = [e for e in browser.driver.get_log("browser") if e.get("source") != "network"]
        assert not problems, problems
    finally:
        served.stop()
        nvhost.state = saved
        nvhost.write()


# -- every page --------------------------------------------------------------------------------------------


@in_browser
def test_every_page_draws_its_data(browser, server, victims, users):
    """And, with GPUKILL_SCREENSHOTS=DIR, a screenshot of each page into DIR (the README's)."""
    owner, other, admin = users["owner"], users["other"], users["admin"]
    for i, (user, comm, mem, util) in enumerate(
        [
            (owner, "train.py", "30GiB", 97),
            (owner, "eval.py", "12GiB", 64),
            (other, "notebook", "9GiB", 0),
            (admin, "xmrig", "6GiB", 99),
            (other, "infer", "20GiB", 35),
        ]
    ):
        victims.victim(user, gpu=i % 3, mem=mem, util=util, comm=comm)
    browser.login(server, "overview")
    browser.wait(lambda: len(browser.css("#hosts-overview .gpu")) == 4, 10, "no GPU cards")
    browser.driver.find_element("css selector", '#idle-after option[value="0"]').click()
    browser.wait(lambda: browser.css(".reclaim"), 10, "the idle notebook is not listed to reclaim")
    browser.screenshot("overview")

    browser.open(server, "processes")
    browser.wait(lambda: len(browser.css("#processes tr.proc")) >= 5, 10, "processes missing")
    browser.screenshot("processes")
    runtime = browser.css("#processes tr.proc td.col-runtime")[0]
    before = runtime.text
    browser.wait(lambda: runtime.text != before, 5, "the runtimes do not go on between changes")
    browser.css('th[data-sort="memory"]')[0].click()  # memory was descending: now ascending
    memories = [r.find_element("css selector", "td.col-memory").text for r in browser.css("#processes tr.proc")]
    assert memories == ["6.0 GiB", "9.0 GiB", "12.0 GiB", "20.0 GiB", "30.0 GiB"], memories
    browser.css('th[data-sort="memory"]')[0].click()
    browser.css("#filter")[0].send_keys("train")
    browser.wait(lambda: len(browser.css("#processes tr.proc")) == 1, 5, "the filter did not apply")
    browser.css("#filter")[0].clear()
    browser.css("#filter")[0].send_keys(" ")  # clear() fires no input event
    browser.wait(lambda: len(browser.css("#processes tr.proc")) >= 5, 5, "the filter was not lifted")

    browser.open(server, "guard")
    browser.wait(lambda: browser.css("#guard-rules"), 10, "no Guard status")
    heads = [h.text for h in browser.css("#guard-notifications th")]
    assert heads == ["channel", "delivered", "skipped", "failed", "dropped", "announced"], heads
    counted = {r.find_element("css selector", "td").text: r.text for r in browser.css("#guard-notifications tbody tr")}
    assert {"email", "webhook", "owner-mail", "tty", "desktop"} <= counted.keys(), counted
    assert counted["desktop"].startswith("desktop – – – –"), counted  # it announces only
    browser.css("#policy-text")[0].send_keys(TEST_POLICY)
    browser.css("#policy-test")[0].click()
    rows = browser.wait(lambda: browser.css("#decisions tbody tr"), 15, "no decisions for the pasted policy")
    assert "no-miners" in rows[0].text, rows[0].text
    browser.screenshot("guard")
    # Setting a managed policy is polkit's manage-policies: refused to the serving user, said as it is.
    browser.css("#mp-target")[0].send_keys(other.name)
    # the form sends what was typed: the server reads it in the one size grammar, and a bare number is no size
    browser.css("#mp-memory")[0].send_keys("8")
    browser.css("#mp-set")[0].click()
    browser.wait(
        lambda: "a bare number is not a size: '8' (write a unit" in browser.text("#flash"),
        15,
        lambda: f"#flash says {browser.text('#flash')!r}",
    )
    browser.css("#mp-memory")[0].clear()
    browser.css("#mp-memory")[0].send_keys("8GiB")
    browser.css("#mp-set")[0].click()
    refused = server.call("PUT", f"/v1/guard/policies/user/{other.name}", {"memory_limit": 8 << 30})
    assert refused.status == 403, refused
    browser.wait(
        lambda: browser.text("#flash") == refused.body["message"],
        15,
        lambda: f"#flash says {browser.text('#flash')!r}, not {refused.body['message']!r}",
    )

    browser.open(server, "audit")
    finding = browser.wait(
        lambda: [r for r in browser.css("#findings tr.finding") if "xmrig" in r.text], 15, "the miner was not found"
    )[0]
    assert "miner-name" in finding.text, finding.text
    browser.screenshot("audit")

    browser.open(server, "usage")
    browser.wait(lambda: browser.css("#usage-report svg rect.chart-bar"), 20, "no usage chart")
    browser.driver.find_element("css selector", '#usage-by option[value="gpu"]').click()
    browser.wait(lambda: "GPU 0" in browser.text("#usage-report"), 15, "no usage by GPU")
    browser.screenshot("usage")

    victim = victims.victim(owner, gpu=1, mem="1GiB", util=5, comm="short-run")
    victims.wait_listed(victim.pid)
    assert victims.ctl(owner, "kill", str(victim.pid), "--grace", "2").returncode == 0
    browser.open(server, "events")
    browser.wait(
        lambda: [e for e in browser.css("#events tr.event") if "short-run" in e.text],
        10,
        "the kill did not reach the events page",
    )
    browser.screenshot("events")
    # No script error and nothing the Content-Security-Policy refused, on any page of this module's visits
    # (the refused requests' 401s and 403s are the network's entries, and expected).
    problems = [
        e
        for e in browser.driver.get_log("browser")
        if e.get("source") != "network" or "Content Security Policy" in e.get("message", "")
    ]
    assert not problems, problems


@in_browser
def test_the_page_prints_what_the_cli_prints_and_colours_load(browser, server, victims, users):
    """Unknown energy (a GPU without a power sensor) is "–", never "0 J"; a duration reads as the CLI writes it;
    a busy GPU's bar is red and its cool neighbour's idle one green, with the legend saying so."""
    owner, other, admin = users["owner"], users["other"], users["admin"]
    pids = {}
    for gpu, util, comm in ((0, 95, "hotload"), (1, 2, "coolload"), (2, 40, "nopower")):
        pids[comm] = victims.victim(owner, gpu=gpu, mem="2GiB", util=util, comm=comm).pid
        victims.wait_listed(pids[comm])
    browser.login(server, "overview")
    browser.wait(
        lambda: browser.css('#hosts-overview .gpu[data-index="0"] .bar-fill.load-heavy'),
        15,
        "GPU 0 at 95% is not drawn heavy",
    )
    assert browser.css('#hosts-overview .gpu[data-index="1"] .bar-fill.load-light')
    assert browser.text('#hosts-overview .gpu[data-index="3"] .gpu-temp') == "\u2013"  # no sensor: not 0 °C
    assert "heavy (from 75 %" in browser.text("#load-legend")
    browser.screenshot("display-overview")

    browser.open(server, "processes")
    row = wait_row(browser, pids["hotload"])
    assert row.find_element("css selector", "td.col-utilization").get_attribute("data-load") == "heavy"

    browser.open(server, "usage")
    browser.driver.find_element("css selector", '#usage-by option[value="gpu"]').click()

    def energy_of(index: int) -> str | None:
        for tr in browser.css("#usage-table tbody tr"):
            cells = tr.find_elements("css selector", "td")
            if cells and cells[0].text.startswith(f"GPU {index}"):
                return cells[-1].text
        return None

    browser.wait(lambda: energy_of(2) is not None and energy_of(0) is not None, 30, "no usage of GPUs 0 and 2")
    assert energy_of(2) == "\u2013", energy_of(2)  # the MI210 of the bed reports no power
    assert re.fullmatch(r"\d+(\.\d+)? k?J", energy_of(0) or ""), energy_of(0)
    assert "0 J" not in browser.text("#usage-report").replace(energy_of(0) or "", "")
    browser.screenshot("display-usage")

    # a managed policy's grace: the page writes what `gpukillctl guard policy list` writes
    added = victims.ctl(
        admin, "guard", "policy", "add", "user", other.name, "--memory-limit", "64GiB", "--grace", "150s"
    )
    assert added.returncode == 0, added
    try:
        listed = victims.ctl(admin, "guard", "policy", "list")
        assert "grace 2min 30s" in listed.stdout, listed
        browser.open(server, "guard")
        browser.wait(
            lambda: "grace 2min 30s" in browser.text("#managed-list"),
            15,
            lambda: f"the page says {browser.text('#managed-list')!r} {browser.driver.get_log('browser')}",
        )
        assert "users" not in browser.text("#managed table")  # no allowed_users: none listed, the page draws on
        assert "In a grace period" in browser.text("#guard-status")
        browser.screenshot("display-guard")
    finally:
        victims.ctl(admin, "guard", "policy", "remove", "user", other.name)


# -- without a browser ----------------------------------------------------------------------------------------


def test_the_page_never_makes_markup_from_text():
    """Text is set as text: no innerHTML, outerHTML, insertAdjacentHTML or document.write in the page's
    scripts, no inline script or style (the CSP refuses them), no eval, no library fetched from elsewhere."""
    scripts = sorted(STATIC.glob("*.js"))
    assert {p.name for p in scripts} >= {"app.js", "stream-worker.js"}
    banned = re.compile(
        r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\s*\(|new Function|"
        r"setAttribute\(\s*[\"']style|https?://(?!www\.w3\.org/2000/svg)"
    )
    for path in scripts:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not banned.search(line), f"{path.name}:{n}: {line.strip()}"
    html = (STATIC / "index.html").read_text()
    assert not re.search(r"\sstyle\s*=|<style|\son[a-z]+\s*=|javascript:", html, re.I)
    assert re.findall(r"<script\b[^>]*>", html) == ['<script type="module" src="/static/app.js">']


def test_the_readme_shows_every_page():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## The dashboard", 1)[1].split("\n## ", 1)[0]
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", section)
    for page in PAGES:
        assert f"docs/screenshots/{page}.png" in images, page
    for image in images:
        path = REPO / image
        assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image
