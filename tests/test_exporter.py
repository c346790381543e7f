"""`gpukillctl exporter` on the test bed's simulated 8-GPU host, scraped by a real Prometheus; the shipped alert
rules checked and unit-tested by promtool."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO, Testbed
from helpers.waiting import wait_until

pytest.importorskip("prometheus_client", reason="the `exporter` extra is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpukill.records.manager import Device, Process  # noqa: E402
from gpukill.records.status import BackendStatus  # noqa: E402
from gpukill.records.suspend import SuspendedProcess  # noqa: E402
from gpukillctl.exporter.metrics import Reading, families  # noqa: E402

GIB = 1 << 30
DEPLOY = REPO / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt install prometheus)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def eight_gpus(path: Path) -> Path:
    devices = [
        {
            "name": "Simulated H100 80GB HBM3",
            "vendor": "nvidia",
            "uuid": f"GPU-0000000{i}-e5e5",
            "pci_bus_id": f"0000:{0x18 + i:02x}:00.0",
            "memory_total": "80GiB",
            "temperature": 40 + i,
            "power": 70.0 + i,
        }
        for i in range(8)
    ]
    path.write_text(yaml.safe_dump({"devices": devices}))
    return path


@pytest.fixture(scope="module")
def host(users):
    """A private system of its own on 8 simulated GPUs, with gpkowner on GPUs 0 and 5 and gpkother on GPU 3."""
    bed = Testbed()
    try:
        bed.start_system(sim_yaml=eight_gpus(bed.workdir / "eight.yaml"))
        victims = [
            bed.victim(users["owner"], gpu=0, mem="3GiB"),
            bed.victim(users["owner"], gpu=5, mem="1GiB"),
            bed.victim(users["other"], gpu=3, mem="2GiB"),
        ]
        for v in victims:
            bed.wait_listed(v.pid)
        yield bed
    finally:
        bed.stop()


@pytest.fixture(scope="module")
def exporter_process(host, users):
    """The exporter as an unprivileged user (as the unit's DynamicUser is), on a free port: (url, process)."""
    port = free_port()
    proc = subprocess.Popen(
        [PYTHON, "-m", "gpukillctl", "exporter", "--port", str(port)],
        env=host.env(),
        cwd="/",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        **users["other"].popen_kwargs(),
    )
    host.procs.append(proc)
    url = f"http://127.0.0.1:{port}/metrics"
    wait_until(lambda: _get(url), 20, "the exporter never answered")
    return url, proc


@pytest.fixture(scope="module")
def exporter(exporter_process):
    return exporter_process[0]


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()
    except OSError:
        return None


@needs_root
def test_metrics_of_eight_gpus_and_per_user_memory(exporter, users):
    text = _get(exporter)
    got = samples(text)
    ups = {dict(k[1])["gpu"]: v for k, v in got.items() if k[0] == "gpukill_device_up"}
    assert ups == {str(i): 1.0 for i in range(8)}
    labels = frozenset(
        {
            "gpu": "3",
            "uuid": "GPU-00000003-e5e5",
            "pci_bus_id": "0000:1b:00.0",
            "vendor": "nvidia",
            "model": "Simulated H100 80GB HBM3",
        }.items()
    )
    assert got[("gpukill_device_temperature_celsius", labels)] == 43.0
    assert got[("gpukill_device_memory_total_bytes", labels)] == 80 * GIB
    user = {dict(k[1])["user"]: v for k, v in got.items() if k[0] == "gpukill_user_gpu_memory_bytes"}
    assert user == {users["owner"].name: 4.0 * GIB, users["other"].name: 2.0 * GIB}
    count = {dict(k[1])["user"]: v for k, v in got.items() if k[0] == "gpukill_user_gpu_processes"}
    assert count == {users["owner"].name: 2.0, users["other"].name: 1.0}
    assert got[("gpukill_up", frozenset())] == 1.0
    assert got[("gpukill_backend_up", frozenset({("backend", "simulated")}))] == 1.0
    assert got[("gpukill_guard_enabled", frozenset())] in (0.0, 1.0)
    assert not any(name.startswith("gpukill_process_") for name, _ in got), "per-process only with --per-process"


@needs_root
@needs_promtool
def test_exposition_passes_promtool_check_metrics(exporter):
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=_get(exporter), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r


@contextlib.contextmanager
def prometheus(exporter: str):
    """A real Prometheus scraping the exporter every second; yields query(PromQL) -> {label user: value}, None
    while it has no answer (for wait_until), and what it logged."""
    target = urllib.parse.urlsplit(exporter).netloc
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gpukill-prom-") as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s"},
                    "scrape_configs": [{"job_name": "gpukill", "static_configs": [{"targets": [target]}]}],
                }
            )
        )
        with open(Path(tmp) / "prometheus.log", "wb") as log:
            prom = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp}/data",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

        def per_user(promql: str) -> dict[str, float] | None:
            body = _get(f"http://127.0.0.1:{port}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
            result = json.loads(body)["data"]["result"] if body else []
            return {r["metric"]["user"]: float(r["value"][1]) for r in result} or None

        try:
            yield per_user, lambda: (Path(tmp) / "prometheus.log").read_text()[-2000:]
        finally:
            prom.terminate()
            prom.wait(20)


@needs_root
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt install prometheus)")
def test_a_real_prometheus_scrapes_it_and_answers_per_user_memory(exporter, users):
    with prometheus(exporter) as (per_user, logged):
        found = wait_until(lambda: per_user('gpukill_user_gpu_memory_bytes{job="gpukill"}'), 40, logged)
        assert found == {users["owner"].name: 4.0 * GIB, users["other"].name: 2.0 * GIB}


@needs_root
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt install prometheus)")
def test_a_real_prometheus_gives_gpukillctl_usages_answer_per_user(host, exporter, users):
    """The accounting's counters, scraped: Prometheus' `sum by (user) (gpukill_gpu_seconds_total{user!=""})` is
    the GPU time `gpukillctl usage --since @START` gives the exporter's user (its own processes; the exporter
    started at START), within what the exporter's USAGE_REFRESH and the scrape leave between the two."""
    started = time.time()
    with prometheus(exporter) as (per_user, logged):
        found = wait_until(lambda: per_user('sum by (user) (gpukill_gpu_seconds_total{user!=""})'), 40, logged)
        other = users["other"].name
        assert other in found and found[other] > 0, found
        text = _get(exporter)
        exported = {
            dict(k[1])["user"]: v
            for k, v in samples(text).items()
            if k[0] == "gpukill_gpu_seconds_total" and dict(k[1]).get("user")
        }
        r = host.ctl(users["other"], "usage", "--since", f"@{started - 3600:.0f}", "--user", other, "--json")
        assert r.returncode == 0, r
        (mine,) = json.loads(r.stdout)["rows"]
        # the counter counts from the exporter's start, which came before `started`: at most all of it
        assert 0 < exported[other] <= mine["gpu_seconds"] + 1, (exported, mine)


@needs_root
def test_textfile_is_written_whole(host, users):
    tmp_path = Path(tempfile.mkdtemp(dir=host.workdir))  # the bed's directory is searchable by other users
    os.chmod(tmp_path, 0o777)
    r = host.run_as(users["other"], [PYTHON, "-m", "gpukillctl", "exporter", "--textfile", str(tmp_path), "--once"])
    assert r.returncode == 0, r
    assert [p.name for p in tmp_path.iterdir()] == ["gpukill.prom"], "no temporary file may be left behind"
    got = samples((tmp_path / "gpukill.prom").read_text())
    assert got[("gpukill_user_gpu_memory_bytes", frozenset({("user", users["other"].name)}))] == 2.0 * GIB
    r = host.run_as(users["other"], [PYTHON, "-m", "gpukillctl", "exporter", "--textfile", "/nonexistent", "--once"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a directory" in r.stderr, r


def test_unknown_values_are_left_out_and_attribution_is_bounded():
    device = Device(
        index=0,
        id="GPU-x",
        backend="simulated",
        vendor="amd",
        name="MI",
        utilization=50.0,
        temperature=None,
        clock_mhz=1500.0,
    )
    procs = [
        Process(
            pid=10 + i,
            start_time=1,
            uid=1000,
            user="alice",
            comm="python",
            cmdline="python",
            device=0,
            device_id="GPU-x",
            gpu_memory=GIB,
            slurm_job="42" if i else None,
        )
        for i in range(50)
    ]
    got = samples_of(Reading(devices=(device,), processes=tuple(procs), daemon_up=True))
    names = {name for name, _ in got}
    assert "gpukill_device_temperature_celsius" not in names, "an unknown value is no series, never 0"
    labels = frozenset({"gpu": "0", "uuid": "GPU-x", "pci_bus_id": "", "vendor": "amd", "model": "MI"}.items())
    assert got[("gpukill_device_utilization_ratio", labels)] == 0.5
    assert got[("gpukill_device_clock_hertz", labels)] == 1.5e9
    assert got[("gpukill_user_gpu_memory_bytes", frozenset({("user", "alice")}))] == 50.0 * GIB
    assert got[("gpukill_slurm_job_gpu_processes", frozenset({("slurm_job", "42")}))] == 49.0
    assert not [k for k in got if k[0] == "gpukill_unit_gpu_memory_bytes"], "no series with an empty label"
    assert len([k for k in got if k[0].startswith("gpukill_process_")]) == 0
    per_process = samples_of(Reading(devices=(device,), processes=tuple(procs), daemon_up=True), True)
    assert len([k for k in per_process if k[0] == "gpukill_process_gpu_memory_bytes"]) == 50
    down = samples_of(Reading())
    assert down[("gpukill_up", frozenset())] == 0.0 and not any(k[0].startswith("gpukill_device") for k in down)


def test_guard_notices_are_counted_per_channel_and_result_delivered_apart_from_skipped_and_failed():
    from gpukill.records.guard import GuardStatus, NotificationCounters

    guard = GuardStatus(
        enabled=True,
        dry_run=False,
        policy_dry_run=False,
        source="files",
        notifications=(
            NotificationCounters(channel="tty", queued=9, delivered=2, skipped=6, failed=1),
            NotificationCounters(channel="email", queued=3, delivered=2, failed=1, dropped=1),
            NotificationCounters(channel="desktop", announced=9),
        ),
    )
    got = samples_of(Reading(guard=guard, daemon_up=True))
    counts = {
        tuple(sorted(dict(labels).items())): v
        for (name, labels), v in got.items()
        if name == "gpukill_guard_notifications_total"
    }
    assert counts[(("channel", "tty"), ("result", "delivered"))] == 2.0
    assert counts[(("channel", "tty"), ("result", "skipped"))] == 6.0
    assert counts[(("channel", "tty"), ("result", "failed"))] == 1.0
    assert counts[(("channel", "email"), ("result", "dropped"))] == 1.0
    assert counts[(("channel", "desktop"), ("result", "announced"))] == 9.0
    assert (("channel", "desktop"), ("result", "delivered")) not in counts, "the desktop only announces"


def exposition(reading: Reading, per_process: bool = False) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    class Once:
        def collect(self):
            return families(reading, per_process)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Once())
    return generate_latest(registry).decode()


def samples_of(reading: Reading, per_process: bool = False) -> dict[tuple[str, frozenset], float]:
    return samples(exposition(reading, per_process))


def test_suspended_processes_and_the_host_memory_they_hold_per_user_gpu_and_state():
    def held(pid: int, uid: int, devices: tuple[int, ...], memory: int, state: str = "suspended") -> SuspendedProcess:
        return SuspendedProcess(
            pid=pid, start_time=1, uid=uid, comm="train.py", state=state, devices=devices, memory=memory
        )

    reading = Reading(
        suspended=(
            held(10, 1000, (0,), 8 * GIB),
            held(11, 1000, (0,), 2 * GIB),
            held(12, 1000, (1,), GIB, state="stuck"),
            held(13, 1001, (0, 1), 4 * GIB),
            held(14, 4242, (2,), GIB),  # a uid without a name here: the number
        ),
        user_names=((1000, "alice"), (1001, "bob")),
        daemon_up=True,
    )
    got = samples_of(reading)

    def series(name: str) -> dict[tuple[str, str, str], float]:
        return {
            (d["user"], d["gpu"], d["state"]): v for (n, labels), v in got.items() if n == name for d in [dict(labels)]
        }

    assert series("gpukill_suspended_processes") == {
        ("alice", "0", "suspended"): 2.0,
        ("alice", "1", "stuck"): 1.0,
        ("bob", "0,1", "suspended"): 1.0,
        ("4242", "2", "suspended"): 1.0,
    }
    assert series("gpukill_suspended_host_memory_bytes") == {
        ("alice", "0", "suspended"): 10.0 * GIB,
        ("alice", "1", "stuck"): 1.0 * GIB,
        ("bob", "0,1", "suspended"): 4.0 * GIB,
        ("4242", "2", "suspended"): 1.0 * GIB,
    }
    assert not [k for k in got if k[0] == "gpukill_suspended_process_host_memory_bytes"]
    per_process = samples_of(reading, True)
    assert len([k for k in per_process if k[0] == "gpukill_suspended_process_host_memory_bytes"]) == 5
    if PROMTOOL is not None:
        for text in (exposition(reading, True), exposition(Reading(daemon_up=True))):
            r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r


@needs_promtool
def test_alert_rules_pass_promtool_check_and_unit_tests():
    check = subprocess.run(
        [PROMTOOL, "check", "rules", str(DEPLOY / "gpukill-alerts.yml")], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0 and "SUCCESS: 4 rules found" in check.stdout, check
    unit = subprocess.run(
        [PROMTOOL, "test", "rules", "gpukill-alerts.test.yml"], cwd=DEPLOY, capture_output=True, text=True, timeout=60
    )
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit


def test_grafana_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((DEPLOY / "gpukill-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs
    reading = Reading(
        devices=(
            Device(
                index=0,
                id="g",
                backend="s",
                vendor="v",
                name="n",
                utilization=1.0,
                memory_used=1,
                memory_total=2,
                temperature=1.0,
                power=1.0,
                power_limit=2.0,
                clock_mhz=1.0,
            ),
        ),
        backends=(BackendStatus("s", True, ""),),
        daemon_up=True,
    )
    exported = {name.removesuffix("_total") for name, _ in samples_of(reading)}
    used = {
        word
        for expr in exprs
        for word in expr.replace("(", " ").replace("{", " ").split()
        if word.startswith("gpukill_")
    }
    assert used and {u.removesuffix("_total") for u in used} <= exported | {
        f"gpukill_{g}_gpu_{k}"
        for g in ("user", "unit", "slurm_job", "pod_uid", "container")
        for k in ("memory_bytes", "processes")
    } | {"gpukill_guard_actions", "gpukill_guard_violations"}, used


class BusCalls:
    """gpukilld's method calls of one member, as dbus-monitor (root, BecomeMonitor) sees them on the bed's bus."""

    def __init__(self, host: Testbed, member: str) -> None:
        self.member = member
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            ["dbus-monitor", "--address", host.bus_address, "--profile", f"type='method_call',member='{member}'"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        host.procs.append(self.proc)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("mc") and line.rstrip("\n").endswith(f"\t{self.member}"):
                self.lines.append(line)

    def count(self) -> int:
        return len(self.lines)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@needs_root
def test_fifty_scrapes_a_second_are_served_from_one_reading_per_sample_interval(host, exporter, users):
    """50 scrapes a second for 4 s keep gpukill_up 1 (each one reading the daemon was 200 calls a second, the
    daemon's per-uid rate: its TooBusy answers were gpukill_up 0), and the daemon is read about once per
    SampleInterval (1 s here), counted on the bus."""
    calls = BusCalls(host, "ListDevices")
    try:
        # the monitor is in place once it sees a call of ours
        wait_until(
            lambda: (host.manager(users["root"], "ListDevices"), calls.count())[1], 10, "dbus-monitor saw no call"
        )
        before = calls.count()
        rate, seconds = 50, 4.0
        t0 = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            futures = []
            for i in range(int(rate * seconds)):
                time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
                futures.append(pool.submit(_get, exporter))
            bodies = [f.result() for f in futures]
        elapsed = time.monotonic() - t0
        time.sleep(0.5)  # a read started at the end is counted too
        reads = calls.count() - before
    finally:
        calls.close()
    assert all(bodies), f"{bodies.count(None)} of {len(bodies)} scrapes failed"
    ups = [samples(b)[("gpukill_up", frozenset())] for b in bodies]
    assert ups.count(1.0) == len(ups), f"gpukill_up was 0 in {ups.count(0.0)} of {len(ups)} scrapes"
    assert elapsed < 2 * seconds + 2, f"{len(bodies)} scrapes took {elapsed:.1f} s"  # a loaded machine is slower
    assert 1 <= reads <= elapsed / 1.0 + 2, (
        f"{reads} readings of the daemon for {len(bodies)} scrapes in {elapsed:.1f} s"
    )
    ages = [samples(b)[("gpukill_exporter_reading_age_seconds", frozenset())] for b in bodies]
    assert max(ages) < 1.0 + 2.0, max(ages)  # an interval, and the time a reading takes on a loaded machine


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _idle_connection(url: str, head: bytes = b"GET /metrics HTTP/1.1\r\nHost: x\r\n") -> socket.socket:
    """A client that sends part of a request head and then nothing: a slow or stalled scraper."""
    netloc = urllib.parse.urlsplit(url)
    s = socket.create_connection((netloc.hostname, netloc.port), timeout=10)
    s.sendall(head)
    return s


@needs_root
def test_slow_connections_get_no_thread_each_and_are_closed_at_the_deadline(exporter_process):
    from gpukillctl.exporter.http import HEAD_DEADLINE, MAX_CONNECTIONS, RENDER_THREADS

    url, proc = exporter_process
    assert _get(url)
    baseline = _threads(proc.pid) + RENDER_THREADS  # the rendering pool starts its threads as it needs them
    idle = [_idle_connection(url) for _ in range(100)]
    try:
        time.sleep(0.5)
        assert _threads(proc.pid) <= baseline, f"{_threads(proc.pid)} threads with 100 idle connections"
        got = _get(url)  # served meanwhile
        assert got and samples(got)[("gpukill_up", frozenset())] == 1.0
        # each idle one is closed once its head is late (recv: end of file, or reset)
        t0 = time.monotonic()
        for s in idle:
            s.settimeout(max(0.1, t0 + HEAD_DEADLINE + 5 - time.monotonic()))
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(100) == b"", "an idle connection got an answer"
        assert time.monotonic() - t0 < HEAD_DEADLINE + 5
    finally:
        for s in idle:
            s.close()
    # past the limit of open connections, one more is refused at once (503), not queued
    idle = [_idle_connection(url) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10)
        assert refused.value.code == 503 and time.monotonic() - t0 < 2
        assert _threads(proc.pid) <= baseline
    finally:
        for s in idle:
            s.close()
    wait_until(lambda: _get(url), 10, "the exporter did not serve again once the idle connections closed")


@needs_root
def test_http_formats_and_methods(exporter):
    request = urllib.request.Request(
        exporter, headers={"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        assert r.headers["Content-Encoding"] == "gzip"
        text = gzip.decompress(r.read()).decode()
    assert text.endswith("# EOF\n") and "gpukill_up 1.0" in text
    with urllib.request.urlopen(urllib.request.Request(exporter, method="HEAD"), timeout=10) as r:
        assert r.status == 200 and r.read() == b"" and int(r.headers["Content-Length"]) > 0
    for path, method, code in (("/nothing", "GET", 404), ("/metrics", "POST", 405)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(
                urllib.request.Request(
                    exporter.replace("/metrics", path), method=method, data=b"" if method == "POST" else None
                ),
                timeout=10,
            )
        assert e.value.code == code


def test_concurrent_scrapes_share_one_read_and_a_reading_serves_one_interval():
    """DaemonReader's cache alone, with a clock of the test's and a daemon that answers slowly."""
    from gpukillctl.exporter.main import DaemonReader

    now = [0.0]

    class Slow(DaemonReader):
        async def _read(self):
            await asyncio.sleep(0.05)
            self.refresh = 2.0  # the daemon's SampleInterval
            return Reading(daemon_up=True, version=str(self.reads))

    async def scenario():
        reader = Slow(clock=lambda: now[0])
        first = await asyncio.gather(*(reader.current() for _ in range(20)))
        assert reader.reads == 1 and {r.version for r in first} == {"1"}
        now[0] = 1.9
        assert (await reader.current()).version == "1" and reader.reads == 1
        assert (await reader.current()).age == pytest.approx(1.9)
        now[0] = 2.0
        again = await asyncio.gather(*(reader.current() for _ in range(20)))
        assert reader.reads == 2 and {r.version for r in again} == {"2"}

    asyncio.run(scenario())


@needs_root
def test_kills_are_counted_per_outcome_and_initiator_kind(host, exporter, users):
    """Runs last of the bed's tests: it adds and kills a process of gpkowner."""
    victim = host.victim(users["owner"], gpu=7, mem="1GiB")
    host.wait_listed(victim.pid)
    r = host.ctl(users["owner"], "kill", str(victim.pid))
    assert r.returncode == 0, r
    key = ("gpukill_kills_total", frozenset({"outcome": "terminated", "initiator": "user"}.items()))
    assert wait_until(lambda: samples(_get(exporter)).get(key), 10, "the kill was never counted") == 1.0
