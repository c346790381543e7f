"""What people and programs see of a suspended workload: `gpukillctl top`, the REST API, the exporter and the
usage accounting, on the fake NVIDIA host (the real pynvml against the C NVML fake) with the fake cuda-checkpoint
(tests/helpers/fake_cuda_checkpoint/). The suspend and resume themselves are tests/test_suspend.py's; the
dashboard's section is tests/test_dashboard_browser.py's; what top lays out, without a terminal,
tests/test_top_model.py's."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest
from helpers import suspending, tmux
from helpers.http_server import Server
from helpers.marks import needs_root
from helpers.nvml_host import fake_nvidia_host
from helpers.testbed import PYTHON
from helpers.tmux import EXITED, TmuxPane

from gpukilld import journal as audit

pytestmark = needs_root

GIB = 2**30


@pytest.fixture(scope="module")
def nvhost(tmp_path_factory):
    return fake_nvidia_host(tmp_path_factory.mktemp("nvml"), devices=2)


@pytest.fixture
def suspended_bed(fresh_bed, nvhost, users):
    """gpukilld on the fake NVIDIA host with the fake cuda-checkpoint, and a process of gpkowner holding 8 GiB of
    GPU 0, suspended: (the bed, its PID)."""
    saved = nvhost.snapshot()
    suspending.start_daemon(fresh_bed, nvhost)
    yield fresh_bed, suspending.suspended(fresh_bed, nvhost, users["owner"], "notebook", 8 * GIB)
    nvhost.state = saved
    nvhost.write()


@pytest.mark.skipif(tmux.missing() is not None, reason=tmux.missing() or "")
def test_top_lists_the_suspended_process_apart_and_the_resume_brings_it_back_among_the_running(suspended_bed, users):
    bed, pid = suspended_bed
    owner = users["owner"]
    pane = TmuxPane(bed, owner)
    try:
        pane.start([PYTHON, "-m", "gpukillctl", "top"])
        screen = pane.wait_for("SUSPENDED: 1 process, 8.0 GiB held in host memory")
        assert "0 processes, 1 suspended" in screen.splitlines()[0], screen
        (row,) = [line for line in screen.splitlines() if line.startswith(f"{pid} ")]
        assert row.split()[:6] == [str(pid), owner.name, "0", "8.0", "GiB", "suspended"], row
        assert "notebook" in row and f"PID {pid}" in row  # its workload
        r = bed.ctl(owner, "resume", str(pid))
        assert r.returncode == 0, r
        # heard (ProcessResumed, SnapshotChanged), not polled: well inside top's 30 s safety net
        screen = pane.wait_for(lambda s: "SUSPENDED" not in s and "1 processes" in s, timeout=10)
        assert re.search(rf"^{pid} +{owner.name} +0 +8\.0 GiB", screen, re.M), screen
        pane.keys("q")
        pane.wait_for(f"{EXITED}0]")
    finally:
        pane.close()


def test_rest_exporter_and_usage_see_the_suspended_process(suspended_bed, users):
    parser = pytest.importorskip("prometheus_client.parser", reason="the `exporter` extra is not installed")
    bed, pid = suspended_bed
    owner, other = users["owner"], users["other"]
    server = Server(bed, owner).wait_ready()
    try:
        r = server.call("GET", "/v1/suspended")
        assert r.status == 200, r
        (held,) = r.body["suspended"]
        assert (held["pid"], held["state"], held["memory"], held["devices"]) == (pid, "suspended", 8 * GIB, [0])
        assert held["uid"] == owner.uid and str(pid) in held["workload"]
        openapi = server.call("GET", "/v1/openapi.json").body
        assert openapi["paths"]["/v1/suspended"]["get"]["operationId"] == "list_suspended"
    finally:
        server.stop()

    out = Path(tempfile.mkdtemp(dir=bed.workdir))
    os.chmod(out, 0o777)
    r = bed.run_as(other, [PYTHON, "-m", "gpukillctl", "exporter", "--textfile", str(out), "--once"])
    assert r.returncode == 0, r
    exported = {
        s.name: (s.labels, s.value)
        for family in parser.text_string_to_metric_families((out / "gpukill.prom").read_text())
        for s in family.samples
        if s.name.startswith("gpukill_suspended_")
    }
    labels = {"user": owner.name, "gpu": "0", "state": "suspended"}
    assert exported == {
        "gpukill_suspended_processes": (labels, 1.0),
        "gpukill_suspended_host_memory_bytes": (labels, 8.0 * GIB),
    }, exported

    # GPU time stops while suspended: its usage record closed as "left" (it runs on, off the GPU) when it left
    # the lists, and nothing of it is open now
    (entry,) = bed.wait_journal(MESSAGE_ID=audit.USAGE.message_id, GPUKILL_TARGET_PID=str(pid))
    assert entry["GPUKILL_ENDED"] == "left", entry
