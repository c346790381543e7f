"""`gpukillctl exporter` on the test bed's simulated 8-GPU host, scraped by a real Prometheus; the shipped alert
rules checked and unit-tested by promtool."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO, Testbed
from helpers.waiting import wait_until

prometheus_client = pytest.importorskip("prometheus_client", reason="the `exporter` extra is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpukill.records import BackendStatus, Device, Process  # noqa: E402
from gpukillctl.exporter_metrics import Reading, families  # noqa: E402

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
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def eight_gpus(path: Path) -> Path:
    devices = [{"name": "Simulated H100 80GB HBM3", "vendor": "nvidia", "uuid": f"GPU-0000000{i}-e5e5",
                "pci_bus_id": f"0000:{0x18 + i:02x}:00.0", "memory_total": "80GiB", "temperature": 40 + i,
                "power": 70.0 + i} for i in range(8)]
    path.write_text(yaml.safe_dump({"devices": devices}))
    return path


@pytest.fixture(scope="module")
def host(users):
    """A private system of its own on 8 simulated GPUs, with gpkowner on GPUs 0 and 5 and gpkother on GPU 3."""
    bed = Testbed()
    try:
        bed.start_system(sim_yaml=eight_gpus(bed.workdir / "eight.yaml"))
        victims = [bed.victim(users["owner"], gpu=0, mem="3GiB"), bed.victim(users["owner"], gpu=5, mem="1GiB"),
                   bed.victim(users["other"], gpu=3, mem="2GiB")]
        for v in victims:
            bed.wait_listed(v.pid)
        yield bed
    finally:
        bed.stop()


@pytest.fixture(scope="module")
def exporter(host, users):
    """The exporter as an unprivileged user (as the unit's DynamicUser is), on a free port."""
    port = free_port()
    proc = subprocess.Popen([PYTHON, "-m", "gpukillctl", "exporter", "--port", str(port)], env=host.env(),
                            cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            **users["other"].popen_kwargs())
    host.procs.append(proc)
    url = f"http://127.0.0.1:{port}/metrics"
    wait_until(lambda: _get(url), 20, "the exporter never answered")
    return url


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
    labels = frozenset({"gpu": "3", "uuid": "GPU-00000003-e5e5", "pci_bus_id": "0000:1b:00.0", "vendor": "nvidia",
                        "model": "Simulated H100 80GB HBM3"}.items())
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
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=_get(exporter), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r


@needs_root
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt install prometheus)")
def test_a_real_prometheus_scrapes_it_and_answers_per_user_memory(exporter, users):
    target = urllib.parse.urlsplit(exporter).netloc
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gpukill-prom-") as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": "gpukill", "static_configs": [{"targets": [target]}]}]}))
        with open(Path(tmp) / "prometheus.log", "wb") as log:
            prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                                     f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log,
                                    start_new_session=True)
        try:
            query = urllib.parse.urlencode({"query": 'gpukill_user_gpu_memory_bytes{job="gpukill"}'})

            def per_user() -> dict[str, float] | None:
                body = _get(f"http://127.0.0.1:{port}/api/v1/query?{query}")
                result = json.loads(body)["data"]["result"] if body else []
                return {r["metric"]["user"]: float(r["value"][1]) for r in result} or None

            found = wait_until(per_user, 40, lambda: (Path(tmp) / "prometheus.log").read_text()[-2000:])
            assert found == {users["owner"].name: 4.0 * GIB, users["other"].name: 2.0 * GIB}
        finally:
            prom.terminate()
            prom.wait(20)


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
    device = Device(index=0, id="GPU-x", backend="simulated", vendor="amd", name="MI", utilization=50.0,
                    temperature=None, clock_mhz=1500.0)
    procs = [Process(pid=10 + i, start_time=1, uid=1000, user="alice", comm="python", cmdline="python",
                     device=0, device_id="GPU-x", gpu_memory=GIB, slurm_job="42" if i else None) for i in range(50)]
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


def samples_of(reading: Reading, per_process: bool = False) -> dict[tuple[str, frozenset], float]:
    from prometheus_client import CollectorRegistry, generate_latest

    class Once:
        def collect(self):
            return families(reading, per_process)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Once())
    return samples(generate_latest(registry).decode())


@needs_promtool
def test_alert_rules_pass_promtool_check_and_unit_tests():
    check = subprocess.run([PROMTOOL, "check", "rules", str(DEPLOY / "gpukill-alerts.yml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 4 rules found" in check.stdout, check
    unit = subprocess.run([PROMTOOL, "test", "rules", "gpukill-alerts.test.yml"], cwd=DEPLOY, capture_output=True,
                          text=True, timeout=60)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit


def test_grafana_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((DEPLOY / "gpukill-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs
    reading = Reading(devices=(Device(index=0, id="g", backend="s", vendor="v", name="n", utilization=1.0,
                                      memory_used=1, memory_total=2, temperature=1.0, power=1.0, power_limit=2.0,
                                      clock_mhz=1.0),), backends=(BackendStatus("s", True, ""),),
                      daemon_up=True)
    exported = {name.removesuffix("_total") for name, _ in samples_of(reading)}
    used = {word for expr in exprs for word in expr.replace("(", " ").replace("{", " ").split()
            if word.startswith("gpukill_")}
    assert used and {u.removesuffix("_total") for u in used} <= exported | {
        f"gpukill_{g}_gpu_{k}" for g in ("user", "unit", "slurm_job", "pod_uid", "container")
        for k in ("memory_bytes", "processes")} | {"gpukill_guard_actions", "gpukill_guard_violations"}, used


@needs_root
def test_kills_are_counted_per_outcome_and_initiator_kind(host, exporter, users):
    """Runs last of the bed's tests: it adds and kills a process of gpkowner."""
    victim = host.victim(users["owner"], gpu=7, mem="1GiB")
    host.wait_listed(victim.pid)
    r = host.ctl(users["owner"], "kill", str(victim.pid))
    assert r.returncode == 0, r
    key = ("gpukill_kills_total", frozenset({"outcome": "terminated", "initiator": "user"}.items()))
    assert wait_until(lambda: samples(_get(exporter)).get(key), 10, "the kill was never counted") == 1.0
