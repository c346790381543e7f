"""GPU usage accounting in every other client: the exporter's counters, REST's GET /v1/usage, MCP's tool and
resource, top's totals line and the Slurm epilog's line. First without a daemon (records in, what each one
makes of them out), then end to end on the test bed."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time

import pytest
from helpers.marks import needs_root

from gpukill import errors
from gpukill.records.usage import UsageReport, UsageRow
from gpukillctl.client.dbus import ERRORS

GIB = 1 << 30
NOW = 1_780_000_000.0


def row(key: str, **kw) -> UsageRow:
    values = {
        "processes": 1,
        "gpu_seconds": 100.0,
        "memory_byte_seconds": 100.0 * GIB,
        "peak_memory": GIB,
        "first_seen": NOW - 600,
        "last_seen": NOW - 1,
    }
    values.update(kw)
    return UsageRow(key=key, **values)


def report(by: str, *rows: UsageRow, since: float = NOW - 3600, until: float = NOW) -> UsageReport:
    return UsageReport(since=since, until=until, by=by, rows=rows, rows_total=len(rows))


# -- the exporter's counters ----------------------------------------------------------------------------------

pytest.importorskip("prometheus_client", reason="the `exporter` extra is not installed")

from gpukillctl.exporter import main as exporter_main  # noqa: E402
from gpukillctl.exporter.metrics import RECENT_USAGE, Reading, UsageCounters, families  # noqa: E402


def exposition(reading: Reading) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    class Once:
        def collect(self):
            return families(reading, False)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Once())
    return generate_latest(registry).decode()


def samples(reading: Reading) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if v)): s.value
        for family in text_string_to_metric_families(exposition(reading))
        for s in family.samples
    }


def test_counters_per_user_unit_and_job_from_getusage():
    counters = UsageCounters()
    counters.update(
        "user", report("user", row("alice", sm_seconds=40.0, energy_joules=7000.0), row("bob", gpu_seconds=5.0)), NOW
    )
    counters.update("unit", report("unit", row("jupyter.service"), row(""), row("", hidden=True)), NOW)
    counters.update("slurm_job", report("job", row("4242", gpu_seconds=50.0)), NOW)
    got = samples(Reading(daemon_up=True, usage=counters))
    assert got[("gpukill_gpu_seconds_total", frozenset({("user", "alice")}))] == 100.0
    assert got[("gpukill_gpu_seconds_total", frozenset({("user", "bob")}))] == 5.0
    assert got[("gpukill_gpu_seconds_total", frozenset({("unit", "jupyter.service")}))] == 100.0
    assert got[("gpukill_gpu_seconds_total", frozenset({("slurm_job", "4242")}))] == 50.0
    assert got[("gpukill_memory_byte_seconds_total", frozenset({("user", "alice")}))] == 100.0 * GIB
    assert got[("gpukill_sm_seconds_total", frozenset({("user", "alice")}))] == 40.0
    assert got[("gpukill_energy_joules_total", frozenset({("user", "alice")}))] == 7000.0
    # unknown totals are left out, never 0; no series for "no unit" nor for a unit not ours to see
    assert ("gpukill_sm_seconds_total", frozenset({("user", "bob")})) not in got
    assert ("gpukill_energy_joules_total", frozenset({("user", "bob")})) not in got
    assert not [k for k in got if k[0] == "gpukill_gpu_seconds_total" and not k[1]]
    assert len([k for k in got if k[0] == "gpukill_gpu_seconds_total"]) == 4


def test_counters_never_go_down_and_only_recent_groups_keep_a_series():
    counters = UsageCounters()
    counters.update("user", report("user", row("alice", gpu_seconds=100.0)), NOW)
    counters.update("user", report("user", row("alice", gpu_seconds=90.0)), NOW + 5)  # e.g. a store rebuilding
    assert counters.values[("gpu_seconds", "user", "alice")] == 100.0
    counters.update("user", report("user", row("alice", gpu_seconds=130.0)), NOW + 10)
    assert counters.values[("gpu_seconds", "user", "alice")] == 130.0
    # alice's last sample is now older than RECENT_USAGE and nothing of hers runs: her series goes
    old = row("alice", gpu_seconds=130.0, last_seen=NOW - RECENT_USAGE - 1)
    counters.update("user", report("user", old, row("carol", live=1, last_seen=NOW - 2 * RECENT_USAGE)), NOW)
    assert set(counters.values) == {("gpu_seconds", "user", "carol"), ("memory_byte_seconds", "user", "carol")}
    # another grouping's update leaves this one's series alone
    counters.update("unit", report("unit", row("x.service")), NOW)
    assert ("gpu_seconds", "user", "carol") in counters.values


def test_no_accounting_no_counters():
    got = samples(Reading(daemon_up=True))
    assert not [k for k in got if k[0].startswith(("gpukill_gpu_seconds", "gpukill_memory_byte_seconds"))]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt install prometheus)")
def test_the_counters_pass_promtool_check_metrics():
    counters = UsageCounters()
    counters.update("user", report("user", row("alice", sm_seconds=1.0, energy_joules=2.0)), NOW)
    counters.update("slurm_job", report("job", row("7")), NOW)
    text = exposition(Reading(daemon_up=True, usage=counters))
    assert "# TYPE gpukill_gpu_seconds_total counter" in text or "# TYPE gpukill_gpu_seconds counter" in text
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r


class UsageDaemon:
    """The exporter's client: GetUsage answered from prepared reports, counted; or an error."""

    def __init__(self, error: Exception | None = None) -> None:
        self.queries: list[dict] = []
        self.error = error
        self.gpu_seconds = 10.0

    async def usage(self, query):
        self.queries.append(query)
        if self.error is not None:
            raise self.error
        return report(
            query["by"],
            row(
                "alice" if query["by"] == "user" else "u.service" if query["by"] == "unit" else "42",
                gpu_seconds=self.gpu_seconds,
                last_seen=time.time(),
            ),
            since=query["since"],
            until=query["until"],
        )


def test_the_exporter_asks_getusage_once_per_grouping_per_usage_interval(monkeypatch):
    """Since its start, for user, unit and job, and not again before USAGE_REFRESH: readings in between (every
    scrape interval) serve the last answer."""
    clock = [1000.0]
    reader = exporter_main.DaemonReader(clock=lambda: clock[0])
    daemon = UsageDaemon()

    async def read(n: int) -> None:
        for _ in range(n):
            await reader._read_usage(daemon)
            clock[0] += 1.0

    asyncio.run(read(5))
    assert [q["by"] for q in daemon.queries] == ["user", "unit", "job"]
    assert {q["since"] for q in daemon.queries} == {reader.started}
    daemon.gpu_seconds = 20.0
    clock[0] += exporter_main.USAGE_REFRESH
    asyncio.run(read(1))
    assert len(daemon.queries) == 6
    assert reader.usage.values[("gpu_seconds", "slurm_job", "42")] == 20.0
    # a daemon without the accounting: no counters at all (not zeros)
    off = UsageDaemon(ERRORS[errors.NotSupported.dbus_name](errors.NotSupported.dbus_name, "usage accounting is off"))
    clock[0] += exporter_main.USAGE_REFRESH
    asyncio.run(reader._read_usage(off))
    assert reader.usage is None


# -- REST: GET /v1/usage ----------------------------------------------------------------------------------------

pytest.importorskip("fastapi", reason="the serve extra (pip install 'gpukill[serve]') is not installed")
httpx2 = pytest.importorskip("httpx2", reason="the serve extra's HTTP client is not installed")

from gpukillctl.serve.rest import build_rest  # noqa: E402


class FakeClient:
    """What a server's connection answers: GetUsage's report for the query, recorded."""

    def __init__(self, error: Exception | None = None) -> None:
        self.queries: list[dict] = []
        self.error = error

    async def usage(self, query=None):
        self.queries.append(dict(query or {}))
        if self.error is not None:
            raise self.error
        return report(query.get("by", "user"), row("alice", uid=1000, user="alice", energy_joules=5.0))

    def close(self) -> None:
        pass


def rest_get(client: FakeClient, path: str) -> tuple[int, dict]:
    async def connect():
        return client

    async def go():
        transport = httpx2.ASGITransport(app=build_rest(connect))
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            r = await http.get(path)
            return r.status_code, r.json()

    return asyncio.run(go())


def test_rest_usage_takes_the_clis_forms_and_epoch_seconds():
    client = FakeClient()
    before = time.time()
    status, body = rest_get(
        client, "/v1/usage?since=24h&by=job&user=alice&job=42&limit=10&device=0&name=py&unit=x.service&pod=p"
    )
    assert status == 200, body
    (q,) = client.queries
    assert q.pop("since") == pytest.approx(before - 86400, abs=5)
    assert q == {
        "by": "job",
        "user": "alice",
        "name": "py",
        "unit": "x.service",
        "job": "42",
        "pod": "p",
        "device": "0",
        "limit": 10,
    }
    assert body["rows"][0]["key"] == "alice" and body["rows"][0]["energy_joules"] == 5.0
    assert set(body) == {"since", "until", "by", "rows", "rows_total", "rebuilding"}
    status, _ = rest_get(client, "/v1/usage?since=1700000000&until=2026-05-01T00:00:00Z")
    assert status == 200 and client.queries[-1]["since"] == 1_700_000_000.0
    assert client.queries[-1]["until"] == 1_777_593_600.0
    status, _ = rest_get(client, "/v1/usage")
    assert status == 200 and client.queries[-1] == {"by": "user"}  # the daemon's defaults


@pytest.mark.parametrize(
    "query,text",
    [
        ("since=soon", "query.since"),
        ("by=host", "query.by"),
        ("limit=0", "query.limit"),
        ("limit=1001", "query.limit"),
        ("hours=24", "unknown parameter"),
        ("by=user&by=job", "given more than once"),
        ("until=2026-02-30", "query.until"),
    ],
)
def test_rest_usage_refuses_what_it_does_not_take(query, text):
    client = FakeClient()
    status, body = rest_get(client, f"/v1/usage?{query}")
    assert status == 422 and body["error"] == errors.InvalidArgs.dbus_name and text in body["message"], body
    assert not client.queries  # refused before the daemon was asked


def test_rest_usage_errors_are_the_daemons():
    busy = ERRORS[errors.TooBusy.dbus_name](errors.TooBusy.dbus_name, "too many usage queries at once")
    status, body = rest_get(FakeClient(busy), "/v1/usage")
    assert status == 429 and body["error"] == errors.TooBusy.dbus_name
    off = ERRORS[errors.NotSupported.dbus_name](errors.NotSupported.dbus_name, "usage accounting is off")
    status, body = rest_get(FakeClient(off), "/v1/usage")
    assert status == 409 and body["error"] == errors.NotSupported.dbus_name


def test_rest_schema_documents_the_report_from_the_records():
    async def connect():
        return FakeClient()

    schema = build_rest(connect).openapi()
    op = schema["paths"]["/v1/usage"]["get"]
    assert {p["name"] for p in op["parameters"]} == {
        "since",
        "until",
        "by",
        "user",
        "name",
        "unit",
        "job",
        "pod",
        "device",
        "limit",
    }
    rows = schema["components"]["schemas"]["UsageRow"]["properties"]
    assert "utilization-weighted" in rows["sm_seconds"]["description"]
    assert {"gpu_seconds", "memory_byte_seconds", "energy_joules", "hidden"} <= set(rows)


# -- MCP: the usage tool and gpukill://usage ------------------------------------------------------------------

pytest.importorskip("mcp", reason="the serve extra (pip install 'gpukill[serve]') is not installed")

from gpukillctl.serve.mcp import build_mcp  # noqa: E402


def mcp_session(client: FakeClient, act):
    async def connect():
        return client

    server = build_mcp(connect)

    async def go():
        return await act(server)

    return asyncio.run(go())


def test_mcp_usage_tool_asks_getusage_for_the_hours():
    client = FakeClient()
    before = time.time()
    result = mcp_session(client, lambda s: s.call_tool("usage", {"hours": 48, "by": "process", "user": 1000}))
    (q,) = client.queries
    assert q.pop("since") == pytest.approx(before - 48 * 3600, abs=5)
    assert q == {"by": "process", "user": "1000"}
    structured = result[1] if isinstance(result, tuple) else result.structured_content
    assert structured["usage"]["rows"][0]["key"] == "alice"


def test_mcp_usage_refuses_unknown_arguments_and_says_daemon_errors():
    client = FakeClient()
    with pytest.raises(Exception) as e:  # the SDK's ToolError for an argument the tool does not declare
        mcp_session(client, lambda s: s.call_tool("usage", {"hours": 1, "filter": "x"}))
    assert "filter" in str(e.value) and not client.queries
    off = FakeClient(
        ERRORS[errors.NotSupported.dbus_name](errors.NotSupported.dbus_name, "usage accounting is off in gpukilld.conf")
    )
    result = mcp_session(off, lambda s: s.call_tool("usage", {}))
    text = result.content[0].text if hasattr(result, "content") else result[0][0].text
    assert text.startswith("org.gpukill1.Error.NotSupported: usage accounting is off")


def test_mcp_usage_resource_is_the_last_day_by_user():
    client = FakeClient()
    contents = mcp_session(client, lambda s: s.read_resource("gpukill://usage"))
    first = list(contents)[0]
    text = getattr(first, "content", None) or getattr(first, "text", None)
    assert json.loads(text)["usage"]["by"] == "user" and client.queries == [{"by": "user"}]


# -- top's totals line ---------------------------------------------------------------------------------------

from test_top_model import proc, sample  # noqa: E402

from gpukillctl.top import app as top_app  # noqa: E402
from gpukillctl.top.model import TopState, render, text_of  # noqa: E402


def test_top_shows_the_sessions_totals_between_the_gpus_and_the_processes():
    state = TopState()
    state.update(sample(proc(1)))
    state.usage = report(
        "user",
        row("alice", gpu_seconds=3720.0, memory_byte_seconds=6.1 * GIB * 3600, energy_joules=212_000.0),
        row("bob\x1b[2J", gpu_seconds=60.0),
        since=NOW - 720,
        until=NOW,
    )
    screen = text_of(render(state, 120, 30))
    line = next(ln for ln in screen.splitlines() if ln.startswith("session"))
    assert line == "session (12min): GPU time 1h 3min, memory 6.13 GiB·h, energy 212 kJ"
    state.usage = report("user", row("bob", gpu_seconds=60.0), since=NOW - 60, until=NOW)
    assert "energy \u2013" in text_of(render(state, 120, 30))  # no device reported power: not 0 J
    state.usage, state.usage_note = None, "no totals: this gpukilld keeps no usage accounting"
    assert "session: no totals: this gpukilld keeps no usage accounting" in text_of(render(state, 120, 30))


class TopClient:
    def __init__(self, error: Exception | None = None) -> None:
        self.queries: list[dict] = []
        self.error = error

    async def usage(self, query):
        self.queries.append(query)
        if self.error is not None:
            raise self.error
        return report("user", row("alice"), since=query["since"], until=query["until"])


def view(client: TopClient) -> top_app.TopView:
    """A TopView without a terminal: only what session_usage touches."""
    v = top_app.TopView.__new__(top_app.TopView)
    v.client, v.state, v.started = client, TopState(), time.time() - 5
    v.usage_at, v.usage_off = None, False
    return v


def test_top_asks_getusage_at_most_every_ten_seconds_not_per_frame(monkeypatch):
    clock = [500.0]
    monkeypatch.setattr(top_app.time, "monotonic", lambda: clock[0])
    client = TopClient()
    v = view(client)
    for _ in range(30):  # 30 frames at 0.25 s
        asyncio.run(v.session_usage())
        clock[0] += 0.25
    assert len(client.queries) == 1 and client.queries[0]["since"] == v.started and client.queries[0]["by"] == "user"
    assert v.state.usage is not None
    clock[0] += top_app.USAGE_EVERY
    asyncio.run(v.session_usage())
    assert len(client.queries) == 2
    off = TopClient(ERRORS[errors.NotSupported.dbus_name](errors.NotSupported.dbus_name, "accounting is off"))
    v = view(off)
    for _ in range(3):
        asyncio.run(v.session_usage())
        clock[0] += top_app.USAGE_EVERY
    assert len(off.queries) == 1 and v.usage_off and "accounting is off" in v.state.usage_note


# -- end to end: gpukilld on the test bed --------------------------------------------------------------------


@needs_root
def test_rest_and_mcp_answer_what_gpukillctl_usage_answers(victims, users):
    from helpers.http_server import Server
    from test_mcp import run_mcp, structured

    owner = users["owner"]
    v = victims.victim(owner, gpu=1, mem="1GiB", util=80, comm="restacct")
    victims.wait_listed(v.pid, comm="restacct")
    time.sleep(3)
    server = Server(victims, owner).wait_ready()
    try:
        r = server.call("GET", "/v1/usage?since=1h&by=process&name=restacct")
        assert r.status == 200, r
        (mine,) = [x for x in r.body["rows"] if x["pid"] == v.pid]
        assert mine["gpu_seconds"] > 1 and mine["live"] == 1, mine
        r = server.call("GET", "/v1/usage?since=1h&hours=2")
        assert (r.status, r.error) == (422, errors.InvalidArgs.dbus_name), r
    finally:
        server.stop()

    async def session(client):
        return (
            await client.call_tool("usage", {"hours": 1, "by": "process", "name": "restacct"}),
            await client.read_resource("gpukill://usage"),
        )

    tool, resource = run_mcp(victims, owner, session)
    (row_,) = [x for x in structured(tool)["usage"]["rows"] if x["pid"] == v.pid]
    assert row_["gpu_seconds"] >= mine["gpu_seconds"]
    by_user = json.loads(resource.contents[0].text)["usage"]
    assert by_user["by"] == "user" and owner.name in {x["key"] for x in by_user["rows"]}
