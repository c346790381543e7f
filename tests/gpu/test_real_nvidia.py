"""`make test-gpu`: the NVIDIA backend against a real driver, compared with nvidia-smi on the same machine.

Skipped, with the reason, where there is no NVIDIA driver. Values that move between two reads (memory used,
temperature, power, utilization) are compared with tolerances; identities must match exactly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.testbed import Testbed, is_root  # noqa: E402

SMI = shutil.which("nvidia-smi")
pytestmark = pytest.mark.skipif(
    SMI is None or not os.path.exists("/dev/nvidiactl") or not is_root(),
    reason="needs an NVIDIA driver (nvidia-smi and /dev/nvidiactl) and root",
)


def smi(query: str, what: str = "--query-gpu") -> list[list[str]]:
    out = subprocess.run(
        [SMI, f"{what}={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


@pytest.fixture(scope="module")
def real_bed():
    bed = Testbed()
    try:
        bed.start_bus()
        (bed.workdir / "gpukilld.conf").write_text("[daemon]\nbackends = nvidia\n")
        bed.start_daemon()
        yield bed
    finally:
        bed.stop()


def test_devices_match_nvidia_smi(real_bed):
    time.sleep(2)  # two samples, so process utilization has a baseline
    doc = real_bed.listing()
    rows = smi(
        "index,uuid,name,pci.bus_id,memory.total,memory.used,utilization.gpu,temperature.gpu,power.draw,power.limit"
    )
    physical = [d for d in doc["devices"] if d["parent_id"] is None]
    assert len(physical) == len(rows)
    for d, (index, uuid, name, bus, mem_total, mem_used, util, temp, power, limit) in zip(physical, rows, strict=True):
        assert d["id"] == uuid and d["name"] == name and d["index"] == int(index)
        assert d["pci_bus_id"].lower() == bus.lower()
        assert d["memory_total"] == pytest.approx(float(mem_total) * 2**20, rel=0.01)
        assert d["memory_used"] == pytest.approx(float(mem_used) * 2**20, abs=512 * 2**20)
        for ours, theirs, tolerance in (
            (d["utilization"], util, 30),
            (d["temperature"], temp, 5),
            (d["power"], power, 100),
            (d["power_limit"], limit, 1),
        ):
            if number(theirs) is None:
                assert ours is None, (d, theirs)
            else:
                assert ours == pytest.approx(number(theirs), abs=tolerance)


def test_compute_apps_match_nvidia_smi(real_bed):
    apps = smi("pid,used_memory,gpu_uuid", "--query-compute-apps")
    doc = real_bed.listing()
    ours = {(p["pid"], p["device_id"]): p for p in doc["processes"]}
    for pid, used, uuid in apps:
        assert (int(pid), uuid) in ours, (pid, uuid, ours)
        if number(used) is not None:
            assert ours[(int(pid), uuid)]["gpu_memory"] == pytest.approx(float(used) * 2**20, abs=256 * 2**20)
