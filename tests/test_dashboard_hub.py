"""The dashboard's live hub (gpukillctl/web/hub.py) and its hosts (gpukillctl/web/hosts.py), against the real bed:
`gpukillctl serve --tcp` as an unprivileged user, its /ui/stream read over TCP as a browser's EventSource reads
it, gpukilld's method calls counted by a bus monitor (dbus-monitor, BecomeMonitor on the bed's private bus, as
root), a second host over a real sshd on loopback and a stopped one (tests/helpers/lab.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections import Counter

import pytest

pytest.importorskip("starlette", reason="the serve extra (pip install 'gpukill[serve]') is not installed")

from helpers import lab as labs  # noqa: E402
from helpers.http_server import Server  # noqa: E402
from helpers.lab import BusMonitor, EventReader, pids_of  # noqa: E402
from helpers.marks import needs_root  # noqa: E402
from helpers.testbed import SYSTEM_PYTHON  # noqa: E402

from gpukill.records.manager import Process  # noqa: E402
from gpukillctl.web import hosts as hosts_mod  # noqa: E402
from gpukillctl.web import hub as hub_mod  # noqa: E402

VIEW_KEYS = {"id", "name", "state", "error", "generation", "at", "interval", "devices", "processes", "suspended"}
SCRIPT_NAME = "</script><script>alert(1)</script>"
CHANGE_WITHIN = 2.0  # the dashboard's bound: a kill made elsewhere is gone from the open page within 2 s


@pytest.fixture(scope="module")
def server(bed, users):
    """This machine only, as gpkowner, on TCP."""
    s = Server(bed, users["owner"], tcp=True).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lab(bed, users):
    yield from labs.serving(bed, users["owner"])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def up_view(reader: EventReader, host: int = 0, where=lambda v: True, timeout: float = 30.0) -> dict:
    return await reader.host_view(lambda v: v["id"] == host and v["state"] == "up" and where(v), timeout)


def until_gone(reader: EventReader, pid: int, host: int = 0, signals: list | None = None) -> asyncio.Task:
    """A task that reads until a view of `host` without pid: (the view, time.monotonic() it was read); the
    signal events read on the way are added to `signals`."""

    async def read() -> tuple[dict, float]:
        while True:
            event = await reader.next(30)
            if event.event == "signal" and signals is not None:
                signals.append(event.json())
            if (
                event.event == "host"
                and (view := event.json())["id"] == host
                and view["state"] == "up"
                and pid not in pids_of(view)
            ):
                return view, event.at

    return asyncio.ensure_future(read())


# -- the stream, one host -------------------------------------------------------------------------------------


@needs_root
def test_the_first_host_event_carries_the_live_listing(bed, victims, users):
    owner = users["owner"]
    victim = bed.victim(owner, gpu=1, mem="3GiB", util=0)
    bed.wait_listed(victim.pid)
    s = Server(bed, owner, tcp=True).wait_ready()  # a feed of its own: its first listing is the one looked at

    async def go() -> None:
        r = await EventReader.open(s.port, s.token)
        assert r.status == 200, r.body
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        assert r.headers["cache-control"] == "no-store" and r.headers["x-accel-buffering"] == "no", r.headers
        first = await r.next()
        assert first.event == "host", first
        view = first.json()
        assert view["id"] == 0 and set(view) == VIEW_KEYS and view["state"] in ("connecting", "up"), view
        if view["state"] != "up":
            view = await up_view(r)
        assert victim.pid in pids_of(view), view  # the first listing already: nothing to wait for
        row = next(p for p in view["processes"] if p["pid"] == victim.pid)
        assert set(row) == {*Process.__dataclass_fields__, "runtime", "idle_seconds"}, row
        assert row["user"] == owner.name and row["gpu_memory"] == 3 << 30, row
        assert 0 < row["runtime"] < 120, row  # seconds since it started, from CLOCK_BOOTTIME
        assert row["idle_seconds"] is not None and row["idle_seconds"] >= 0, row  # 3 GiB held at 0%
        assert view["devices"] and view["interval"] > 0 and view["error"] == "", view
        assert abs(view["at"] - time.time()) < 60, view
        r.close()

    try:
        run(go())
        hosts = s.call("GET", "/ui/hosts")
        assert hosts.status == 200 and hosts.body == {
            "hosts": [{"id": 0, "name": hosts.body["hosts"][0]["name"], "api": "/v1"}]
        }, hosts
    finally:
        s.stop()


@needs_root
@pytest.mark.parametrize("how", ["gpukillctl kill", "the victim ended"])
def test_a_process_ended_elsewhere_is_gone_from_the_next_host_event_within_2s(server, bed, victims, users, how):
    owner = users["owner"]
    victim = bed.victim(owner, gpu=0)
    bed.wait_listed(victim.pid)

    async def go() -> None:
        r = await EventReader.open(server.port, server.token)
        await up_view(r, where=lambda v: victim.pid in pids_of(v))
        signals: list[dict] = []
        gone = until_gone(r, victim.pid, signals=signals)
        if how == "gpukillctl kill":
            done = await asyncio.to_thread(bed.ctl, owner, "kill", str(victim.pid), "--grace", "1")
            assert done.returncode == 0, done
        else:
            victim.kill()
            await asyncio.to_thread(victim.wait, 10)
        ended = time.monotonic()
        view, at = await gone
        assert at - ended <= CHANGE_WITHIN, f"gone from the stream {at - ended:.2f} s after it ended"
        if how == "gpukillctl kill":  # the daemon's ProcessKilled, forwarded as it came
            while not any(sig["record"].get("pid") == victim.pid for sig in signals):
                if (event := await r.next(10)).event == "signal":
                    signals.append(event.json())
            sig = next(sig for sig in signals if sig["record"].get("pid") == victim.pid)
            assert sig["host"] == 0 and sig["type"] == "ProcessKilled", sig
            assert sig["record"]["outcome"] in ("terminated", "killed") and sig["record"]["caller_uid"] == owner.uid
        r.close()

    run(go())


@needs_root
def test_a_process_name_of_markup_arrives_as_the_exact_json_string(server, bed, victims, users):
    """The hub sends text as JSON, never as markup: the name, as the process set it, is the JSON string (and the
    page sets it as text, tests/test_dashboard_browser.py)."""
    owner = users["owner"]
    # comm holds 15 bytes (the kernel's TASK_COMM_LEN): the whole name is in the command line
    code = (
        f"import ctypes, time; ctypes.CDLL(None).prctl(15, {SCRIPT_NAME[:15].encode()!r}, 0, 0, 0); "
        "print('ready', flush=True); time.sleep(600)"
    )
    victim = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", code, SCRIPT_NAME],
        stdout=subprocess.PIPE,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "GPUKILL_SIM_GPU": "0", "GPUKILL_SIM_SCOPE": bed.scope},
        start_new_session=True,
        **owner.popen_kwargs(),
    )
    bed.procs.append(victim)  # killed after the test (victims)
    assert victim.stdout is not None and victim.stdout.readline().strip() == b"ready"
    bed.wait_listed(victim.pid, comm=SCRIPT_NAME[:15])

    async def go() -> str:
        r = await EventReader.open(server.port, server.token)
        while True:
            event = await r.next(30)
            if (
                event.event == "host"
                and victim.pid in pids_of(view := event.json())
                and any(p["comm"] == SCRIPT_NAME[:15] for p in view["processes"] if p["pid"] == victim.pid)
            ):
                r.close()
                return event.data

    data = run(go())
    row = next(p for p in json.loads(data)["processes"] if p["pid"] == victim.pid)
    assert row["comm"] == SCRIPT_NAME[:15] and row["cmdline"].endswith(" " + SCRIPT_NAME), row
    assert json.dumps(SCRIPT_NAME)[1:-1] in data and "&lt;" not in data, data[:2000]  # as JSON writes it


# -- what 32 pages cost gpukilld ------------------------------------------------------------------------------


@needs_root
def test_32_pages_cost_gpukilld_one_listing_per_change(server, bed, victims, users):
    owner = users["owner"]
    monitor = BusMonitor(bed)
    changes = 3

    async def changed_by_victims(readers: list[EventReader]) -> None:
        """`changes` changes of the listing, each seen by every reader before the next."""
        for i in range(changes):
            victim = await asyncio.to_thread(bed.victim, owner, gpu=i % 2)
            pid = victim.pid
            await asyncio.gather(*(up_view(r, where=lambda v, pid=pid: pid in pids_of(v)) for r in readers))
        await asyncio.sleep(1.5)  # a listing the last change started is counted in this phase, not the next

    async def open_pages(n: int) -> list[EventReader]:
        readers = [await EventReader.open(server.port, server.token) for _ in range(n)]
        assert all(r.status == 200 for r in readers), [r.body for r in readers if r.status != 200]
        await asyncio.gather(*(up_view(r) for r in readers))
        return readers

    def counted(seen: list[tuple[str, str]]) -> Counter:
        """The server's calls by member (its connections found by their pid), and SnapshotChanged."""
        pids = {sender: monitor.pid_of(sender) for sender in {s for s, m in seen if m != "SnapshotChanged"}}
        out = Counter(m for s, m in seen if m != "SnapshotChanged" and pids[s] == server.proc.pid)
        out["SnapshotChanged"] = sum(1 for _s, m in seen if m == "SnapshotChanged")
        return out

    async def go() -> tuple[Counter, Counter, Counter]:
        first = await open_pages(1)
        await asyncio.sleep(2.5)  # past the feed's catch-up listing, one interval after its first
        monitor.take()
        await changed_by_victims(first)
        one = counted(monitor.take())
        rest = await open_pages(31)
        await asyncio.sleep(1.0)
        joined = counted(monitor.take())  # 31 pages joined the running feed: they cost gpukilld nothing
        await changed_by_victims(first + rest)
        many = counted(monitor.take())
        for r in first + rest:
            r.close()
        return one, joined, many

    try:
        one, joined, many = run(go())
    finally:
        monitor.close()
    lists = ("ListDevices", "ListProcessesCompact", "ListProcesses")
    assert not any(joined[m] for m in lists), joined
    for phase in (one, many):
        assert phase["ListProcesses"] == 0, phase  # the compact listing, one call for this bed's few processes
        # one ListDevices and one ListProcessesCompact per change heard (folded when they come close together)
        assert 1 <= phase["ListProcessesCompact"] <= phase["SnapshotChanged"], phase
        assert phase["ListDevices"] == phase["ListProcessesCompact"], phase
    assert many["ListProcessesCompact"] <= one["ListProcessesCompact"] + 1, (one, many)  # 32 pages cost one's


@needs_root
def test_with_every_stream_open_the_server_still_answers_requests(server):
    """Streams hold their connections: the hub's bound leaves room under the server's (protocol.py), so REST
    requests are answered, and one stream more is the hub's 503, not the connection limit's."""
    from helpers.http_server import request

    async def go() -> tuple[list[int], int, list[int]]:
        readers = [await EventReader.open(server.port, server.token) for _ in range(hub_mod.MAX_SUBSCRIBERS)]
        try:
            one_more = await EventReader.open(server.port, server.token)
            one_more.close()
            answered = await asyncio.gather(
                *(
                    asyncio.to_thread(lambda: request(server.port, "GET", "/v1/devices", server.token).status)
                    for _ in range(8)
                )
            )
            return [r.status for r in readers], one_more.status, list(answered)
        finally:
            for r in readers:
                r.close()

    streams, refused, answered = run(go())
    assert streams == [200] * hub_mod.MAX_SUBSCRIBERS
    assert refused == 503
    assert answered == [200] * 8, answered


@needs_root
def test_a_kill_for_another_host_goes_to_that_hosts_gpukilld_over_ssh(lab, bed, victims, users):
    """/hosts/1/v1/kill reaches host 1's gpukilld over ssh (this machine's bus is out of the server's reach
    here, so nothing can take the local way), where that host's polkit decides as the ssh user and its journal
    records: the owner's process is stopped, another user's is refused with polkit's word and stays alive."""
    from gpukilld import journal as audit

    owner, other = users["owner"], users["other"]
    mine, theirs = bed.victim(owner, gpu=0), bed.victim(other, gpu=1)
    bed.wait_listed(mine.pid)
    bed.wait_listed(theirs.pid)
    s = lab.serve(owner, "--host", lab.remote, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent/bus"})
    try:
        assert s.call("GET", "/v1/devices").status >= 500  # host 0: no bus
        listed = {p["pid"]: p for p in s.call("GET", "/hosts/1/v1/processes").body["processes"]}
        r = s.call(
            "POST", "/hosts/1/v1/kill", {"pid": mine.pid, "start_time": listed[mine.pid]["start_time"], "grace": 2}
        )
        assert r.status == 200 and r.body["outcome"] in ("terminated", "killed"), r
        assert mine.wait(10) is not None
        entry = bed.wait_journal(GPUKILL_TARGET_PID=str(mine.pid), MESSAGE_ID=audit.KILL.message_id)
        assert entry and entry[0]["GPUKILL_CALLER_UID"] == str(owner.uid), entry
        r = s.call("POST", "/hosts/1/v1/kill", {"pid": theirs.pid, "start_time": listed[theirs.pid]["start_time"]})
        assert r.status == 403 and r.error == "org.freedesktop.DBus.Error.AccessDenied", r
        assert "not authorized to kill" in r.body["message"] and theirs.poll() is None, r
        assert bed.wait_journal(GPUKILL_TARGET_PID=str(theirs.pid), MESSAGE_ID=audit.KILL_DENIED.message_id)
    finally:
        s.stop()


# -- a slow page ------------------------------------------------------------------------------------------------


def padded_sleepers(bed, user, n: int, gpus: int = 2) -> list[subprocess.Popen]:
    """n light processes on the simulated GPUs whose command lines are as long as the daemon keeps (4096
    bytes): `sleep` with an argv[0] of 4,000 characters (bash's exec -a). Killed after the test (victims)."""
    procs = []
    for i in range(n):
        env = {"PATH": "/usr/bin:/bin", "GPUKILL_SIM_GPU": str(i % gpus), "GPUKILL_SIM_SCOPE": bed.scope}
        procs.append(
            subprocess.Popen(
                ["bash", "-c", 'exec -a "$0" sleep 600', f"{i:04d}" + "x" * 3996],
                env=env,
                cwd="/",
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                **user.popen_kwargs(),
            )
        )
    bed.procs.extend(procs)
    return procs


@needs_root
def test_a_slow_page_does_not_hold_up_the_others(server, bed, victims, users):
    """A page that reads nothing (its connection's buffers full) while each view is larger than those buffers can
    take in a few changes: the others see each change within 2 s, and once it reads it gets the newest view, the
    older ones it missed dropped (kept in the hub: one view per host)."""
    padded = padded_sleepers(bed, users["owner"], 160)  # ~700 KB a view; the kernel's buffers take ~4 MB
    changes = 10

    async def go() -> None:
        slow = await EventReader.open(server.port, server.token, rcvbuf=4096)
        slow.pause()
        fast = [await EventReader.open(server.port, server.token) for _ in range(3)]
        everyone = {v.pid for v in padded}
        await asyncio.gather(*(up_view(r, where=lambda v: everyone <= pids_of(v), timeout=60) for r in fast))
        for v in padded[:changes]:
            ended = time.monotonic()
            v.kill()
            seen = await asyncio.gather(*(until_gone(r, v.pid) for r in fast))
            late = max(at for _view, at in seen) - ended
            assert late <= CHANGE_WITHIN, f"the other pages saw the change {late:.2f} s after it"
        left = everyone - {v.pid for v in padded[:changes]}
        views = 0
        slow.resume()
        while True:  # the slow page now reads: what it was owed comes, ending with the newest view
            view = await slow.host_view(lambda v: v["state"] == "up", timeout=30)
            views += 1
            if pids_of(view) & everyone == left:
                break
        assert views < changes, f"the slow page got {views} views: the older ones were not dropped"
        for r in [slow, *fast]:
            r.close()

    run(go())


# -- several hosts -----------------------------------------------------------------------------------------------


@needs_root
def test_a_stopped_host_is_down_while_the_other_stays_live(lab, bed, victims, users):
    owner = users["owner"]
    victim = bed.victim(owner, gpu=0)
    bed.wait_listed(victim.pid)
    s = lab.serve(owner, *lab.hosts)

    async def go() -> None:
        r = await EventReader.open(s.port, s.token)
        first = [(await r.next()).json() for _ in range(3)]  # one host event per host, at once
        assert [v["id"] for v in first] == [0, 1, 2], first
        assert [v["name"] for v in first[1:]] == [lab.remote, lab.stopped], first
        views: dict[int, dict] = {}
        deadline = time.monotonic() + 90
        while not (
            views.get(1, {}).get("state") == "up"
            and victim.pid in pids_of(views[1])
            and views.get(2, {}).get("state") == "down"
        ):
            assert time.monotonic() < deadline, views
            event = await r.next(deadline - time.monotonic())
            if event.event == "host":
                views[event.json()["id"]] = event.json()
        down = views[2]
        assert "refused" in down["error"] and "\n" not in down["error"], down  # ssh's one line
        assert down["processes"] == [] and down["devices"] == [], down
        # host 1 (over ssh) stays live while host 2 is down: a kill elsewhere is gone from it within 2 s
        gone = until_gone(r, victim.pid, host=1)
        victim.kill()
        ended = time.monotonic()
        view, at = await gone
        assert at - ended <= CHANGE_WITHIN, f"gone from host 1 {at - ended:.2f} s after it ended"
        assert all(p["runtime"] is None for p in view["processes"]), view  # a remote host's boot is not ours
        r.close()

    try:
        run(go())
        hosts = s.call("GET", "/ui/hosts").body["hosts"]
        assert [(h["id"], h["name"], h["api"]) for h in hosts[1:]] == [
            (1, lab.remote, "/hosts/1/v1"),
            (2, lab.stopped, "/hosts/2/v1"),
        ], hosts
    finally:
        s.stop()


# -- the bound on subscribers, in the hub itself -------------------------------------------------------------


async def asgi_stream(app, path: str = "/ui/stream"):
    """One GET of the ASGI app, driven as a server drives it: (status, the task, a function that disconnects)."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    requested = [False]

    async def receive() -> dict:
        if not requested[0]:
            requested[0] = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"localhost")],
        "root_path": "",
        "scheme": "http",
        "http_version": "1.1",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1),
        "asgi": {"version": "3.0", "spec_version": "2.3"},
    }
    task = asyncio.ensure_future(app(scope, receive, sent.put))
    start = await sent.get()
    body = b""
    if start["status"] != 200:
        body = (await sent.get())["body"]
    return start["status"], body, task, gone.set


@needs_root
def test_a_subscriber_past_the_bound_is_refused_and_one_that_leaves_is_forgotten_at_once(bed, monkeypatch):
    from starlette.applications import Starlette

    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bed.bus_address)

    async def go() -> None:
        hub = hub_mod.Hub([hosts_mod.local_host()])
        app = Starlette(routes=hub.routes)
        streams = [await asgi_stream(app) for _ in range(hub_mod.MAX_SUBSCRIBERS)]
        assert [s[0] for s in streams] == [200] * hub_mod.MAX_SUBSCRIBERS
        status, body, _task, _ = await asgi_stream(app)
        assert status == 503 and json.loads(body)["error"] == "ServiceUnavailable", body
        assert len(hub.subscribers) == hub_mod.MAX_SUBSCRIBERS
        streams[0][3]()  # its page closed
        await asyncio.sleep(0.05)
        assert len(hub.subscribers) == hub_mod.MAX_SUBSCRIBERS - 1 and streams[0][2].done()
        status, _body, task, leave = await asgi_stream(app)
        assert status == 200
        for _s, _b, _t, disconnect in [*streams[1:], (0, b"", task, leave)]:
            disconnect()
        await asyncio.gather(*(s[2] for s in streams), task)
        assert not hub.subscribers
        await hub.aclose()

    run(go())


@needs_root
def test_the_feed_starts_with_the_first_page_outlives_the_last_by_linger_and_a_quiet_stream_pings(bed, monkeypatch):
    from starlette.applications import Starlette

    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bed.bus_address)

    async def go() -> None:
        hub = hub_mod.Hub([hosts_mod.local_host()], linger=1.0, ping=0.3)
        app = Starlette(routes=hub.routes)
        feed = hub.feeds[0]
        assert not feed.running  # no page yet: no connection to gpukilld
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        _status, _body, task, leave = await asgi_stream(app)
        first_task = feed.task
        assert feed.running
        leave()
        await task
        await asyncio.sleep(0.5)
        assert feed.running and not hub.subscribers  # within linger: kept for a page that comes back
        _status, _body, task, leave = await asgi_stream(app)
        assert feed.task is first_task  # the same feed, not a new connection
        leave()
        await task
        await asyncio.sleep(1.5)
        assert not feed.running  # linger passed with no page
        # a quiet stream: after the views, `: ping` comments
        requested = [False]

        async def receive() -> dict:
            if not requested[0]:
                requested[0] = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "method": "GET",
            "path": "/ui/stream",
            "raw_path": b"/ui/stream",
            "query_string": b"",
            "headers": [],
            "root_path": "",
            "scheme": "http",
            "http_version": "1.1",
            "server": ("127.0.0.1", 80),
            "client": ("127.0.0.1", 1),
            "asgi": {"version": "3.0"},
        }
        stream = asyncio.ensure_future(app(scope, receive, send))
        deadline = time.monotonic() + 30
        while not any(m.get("body") == b": ping\n\n" for m in sent):
            assert time.monotonic() < deadline, sent[-3:]
            await asyncio.sleep(0.1)
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
        await hub.aclose()
        assert not feed.running

    run(go())


@needs_root
def test_a_gpukilld_that_stops_is_down_and_up_again_when_it_is_back(fresh_bed, users, monkeypatch):
    from starlette.applications import Starlette

    bed = fresh_bed
    bed.start_daemon()
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bed.bus_address)

    async def go() -> None:
        hub = hub_mod.Hub([hosts_mod.local_host()])
        app = Starlette(routes=hub.routes)
        _status, _body, task, leave = await asgi_stream(app)
        feed = hub.feeds[0]

        async def state(want: str, timeout: float) -> dict:
            deadline = time.monotonic() + timeout
            while (view := json.loads(feed.view.split(b"data: ", 1)[1]))["state"] != want:
                assert time.monotonic() < deadline, view
                await asyncio.sleep(0.1)
            return view

        assert (await state("up", 30))["devices"]
        await asyncio.sleep(2.5)  # past the feed's catch-up listing: from now on it lists only on changes
        await asyncio.to_thread(bed.stop_daemon)
        down = await state("down", 10)  # not the last listing shown as live
        assert "gpukilld is not running" in down["error"] and not down["processes"], down
        await asyncio.to_thread(bed.start_daemon)
        assert (await state("up", 30))["devices"]  # retried (2 s, then 4 s) and live again
        leave()
        await task
        await hub.aclose()

    run(go())


# -- parts without the bed ---------------------------------------------------------------------------------------


def test_a_slow_subscriber_keeps_the_newest_view_per_host_and_the_last_256_signals():
    async def go() -> None:
        sub = hub_mod.Subscriber({0: b"first 0", 1: b"first 1"})
        for i in range(1000):
            sub.offer_signal(b"signal %d" % i)
            sub.offer_view(i % 2, b"view %d" % i)
        out = sub.take()
        assert out == [b"signal %d" % i for i in range(744, 1000)] + [b"view 998", b"view 999"]
        assert sub.take() == [] and not sub.ready.is_set()

    asyncio.run(go())


def test_idle_seconds_count_from_the_first_listing_that_saw_memory_held_at_zero_percent():
    clock = hub_mod.IdleClock()

    def proc(pid: int, util: float | None, mem: int | None = 1 << 30) -> Process:
        return Process(
            pid=pid,
            start_time=pid * 10,
            uid=0,
            user="u",
            comm="c",
            cmdline="c",
            device=0,
            device_id="GPU-0",
            gpu_memory=mem,
            gpu_utilization=util,
        )

    assert clock.update([proc(1, 0.0), proc(2, 5.0), proc(3, None), proc(4, 0.0, 0)], 100.0) == [0.0, None, None, None]
    assert clock.update([proc(1, 0.0), proc(2, 0.0)], 130.0) == [30.0, 0.0]
    assert clock.update([proc(1, 1.0), proc(2, 0.0)], 140.0) == [None, 10.0]  # 1 worked: a break
    assert clock.update([proc(1, 0.0)], 150.0) == [0.0]


def test_an_event_is_one_data_line_whatever_the_text():
    data = hub_mod.sse("host", {"comm": "a\n\nevent: signal\ndata: {}\r\n"})
    assert data.count(b"\n") == 3 and data.endswith(b"\n\n"), data
    assert json.loads(data.split(b"\n")[1][len(b"data: ") :]) == {"comm": "a\n\nevent: signal\ndata: {}\r\n"}


def test_host_specs(tmp_path):
    specs = hosts_mod.host_specs(["gk@node2:2222", "node3"], None)
    assert [(h.id, h.name, h.api) for h in specs[1:]] == [
        (1, "gk@node2:2222", "/hosts/1/v1"),
        (2, "node3", "/hosts/2/v1"),
    ]
    assert specs[0].id == 0 and specs[0].api == "/v1" and specs[0].name
    listed = tmp_path / "hosts"
    listed.write_text("# the lab\nnode4   # rack 2\n\n  gk@[fe80::1%eth0]:22\n")
    assert [h.name for h in hosts_mod.host_specs(["node3"], str(listed))[1:]] == [
        "node3",
        "node4",
        "gk@[fe80::1%eth0]:22",
    ]
    listed.write_text("node4\n$(reboot)\n")
    with pytest.raises(ValueError, match=rf"^{listed}:2: not a host: '\$\(reboot\)'$"):
        hosts_mod.host_specs([], str(listed))
    with pytest.raises(ValueError, match=r"^--host '-oProxyCommand=x': not a host"):
        hosts_mod.host_specs(["-oProxyCommand=x"], None)
    listed.write_text("node4\n<img/src=x/onerror=alert(1)>@node5\n")  # shown on the page as the host's name
    with pytest.raises(ValueError, match=rf"^{listed}:2: not a user name: '<img/src=x/onerror=alert\(1\)>' in "):
        hosts_mod.host_specs([], str(listed))
    listed.write_text("node4\nnode5\nnode4\n")
    with pytest.raises(ValueError, match=rf"^{listed}:3: 'node4' is given twice \(first at {listed}:1\)$"):
        hosts_mod.host_specs([], str(listed))
    listed.write_text("".join(f"node{i}\n" for i in range(64)))
    assert len(hosts_mod.host_specs([], str(listed))) == 65  # this machine and 64 others
    with pytest.raises(ValueError, match="65 hosts given: at most 64"):
        hosts_mod.host_specs(["node99"], str(listed))
    with pytest.raises(ValueError, match=rf"^--hosts-file {tmp_path / 'none'}: No such file or directory$"):
        hosts_mod.host_specs([], str(tmp_path / "none"))
