"""`make test-gpu`: suspend and resume through gpukilld on a real NVIDIA GPU, with NVIDIA's cuda-checkpoint.

A workload (hold_and_count.cu built with nvcc; else hold_and_count.py on cupy, else on torch) holds N GiB filled
with a pattern and counts on the GPU. `gpukillctl suspend PID` must take it off the GPU (gone from nvidia-smi's
compute apps, its memory free, its count stopped); another process must then be able to allocate that memory;
`gpukillctl resume PID` must give it back (listed again, the count going on from where it stopped, the pattern
intact). The seconds per GiB of both acts are printed beside the memory moved.

Skipped, with the reason, where there is no NVIDIA driver (or not root), the driver is older than 550, there is no
cuda-checkpoint (looked up where gpukilld looks: /usr/bin, /usr/local/bin, /usr/local/cuda/bin; or named by
$GPUKILL_CUDA_CHECKPOINT, written to gpukilld.conf), no GPU out of MIG mode, or no way to build the workload.
$GPUKILL_SUSPEND_GIB sets N (4 by default; at most 40 % of the GPU's free memory, at least 2).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.testbed import ROOT, Testbed, is_root  # noqa: E402
from helpers.waiting import wait_until  # noqa: E402

HERE = Path(__file__).resolve().parent
SMI = shutil.which("nvidia-smi")
CHECKPOINT_DIRS = ("/usr/bin", "/usr/local/bin", "/usr/local/cuda/bin")  # gpukilld/acts/checkpoint.py's search
MIB = 2**20
GIB = 2**30
MARGIN_MIB = 1024  # left free by the other process's allocation: its own context, and the driver's slack


def smi(*args: str) -> list[list[str]]:
    out = subprocess.run([SMI, *args], capture_output=True, text=True, check=True, timeout=60).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def cuda_checkpoint() -> str | None:
    named = os.environ.get("GPUKILL_CUDA_CHECKPOINT")
    if named:
        return named if os.access(named, os.X_OK) else None
    found = (os.path.join(d, "cuda-checkpoint") for d in CHECKPOINT_DIRS)
    return next((p for p in found if os.access(p, os.X_OK)), None)


def nvcc() -> str | None:
    fallback = "/usr/local/cuda/bin/nvcc"
    return shutil.which("nvcc") or (fallback if os.access(fallback, os.X_OK) else None)


def binding() -> str | None:
    """The Python binding the workload runs on where there is no nvcc: cupy, else torch."""
    return next((name for name in ("cupy", "torch") if importlib.util.find_spec(name) is not None), None)


def gpu_out_of_mig() -> tuple[str, int] | None:
    """(UUID, free MiB) of the first GPU not in MIG mode (gpukilld refuses to suspend on MIG instances)."""
    for uuid, mig, free in smi("--query-gpu=uuid,mig.mode.current,memory.free", "--format=csv,noheader,nounits"):
        if mig != "Enabled":
            return uuid, int(float(free))
    return None


def why_not() -> str | None:
    if SMI is None or not os.path.exists("/dev/nvidiactl") or not is_root():
        return "needs an NVIDIA driver (nvidia-smi and /dev/nvidiactl) and root"
    version = smi("--query-gpu=driver_version", "--format=csv,noheader")[0][0]
    if int(version.split(".")[0]) < 550:
        return f"needs NVIDIA driver 550 or later for the checkpoint API; this one is {version}"
    if cuda_checkpoint() is None:
        return (
            "needs NVIDIA's cuda-checkpoint (github.com/NVIDIA/cuda-checkpoint) in "
            + ", ".join(CHECKPOINT_DIRS)
            + " or named by $GPUKILL_CUDA_CHECKPOINT"
        )
    if gpu_out_of_mig() is None:
        return "every GPU is in MIG mode, where the driver cannot checkpoint"
    if nvcc() is None and binding() is None:
        return "no way to build the workload: neither nvcc nor cupy nor torch"
    return None


WHY_NOT = why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> list[str]:
    """The argv that starts the workload (hold_and_count's command line follows)."""
    compiler = nvcc()
    if compiler is None:
        return [sys.executable, str(HERE / "hold_and_count.py"), "--binding", str(binding())]
    out = tmp_path_factory.mktemp("hold") / "hold_and_count"
    r = subprocess.run(
        [compiler, "-O2", "-o", str(out), str(HERE / "hold_and_count.cu")], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"nvcc could not build hold_and_count.cu:\n{r.stderr}"
    return [str(out)]


@pytest.fixture(scope="module")
def suspend_bed():
    bed = Testbed()
    try:
        bed.start_bus()
        bed.start_journal()
        daemon = {"backends": "nvidia"}
        if os.environ.get("GPUKILL_CUDA_CHECKPOINT"):
            daemon["cuda_checkpoint"] = os.environ["GPUKILL_CUDA_CHECKPOINT"]
        bed.write_conf(daemon=daemon)
        bed.start_daemon()
        yield bed
    finally:
        bed.stop()


def compute_pids() -> set[int]:
    return {int(row[0]) for row in smi("--query-compute-apps=pid", "--format=csv,noheader")}


def free_mib(uuid: str) -> int:
    return int(float(smi("--query-gpu=memory.free", f"--id={uuid}", "--format=csv,noheader,nounits")[0][0]))


def counts(path: Path) -> tuple[int, int, int]:
    """(count, verifications, mismatches) the workload last wrote."""
    try:
        count, verified, bad = path.read_text().split()
    except (FileNotFoundError, ValueError):
        return 0, 0, 0
    return int(count), int(verified), int(bad)


def test_suspend_frees_the_gpu_and_resume_gives_it_back(suspend_bed, workload, tmp_path, capsys):
    bed = suspend_bed
    uuid, free = gpu_out_of_mig() or ("", 0)
    gib = max(2.0, min(float(os.environ.get("GPUKILL_SUSPEND_GIB", "4")), free * 0.4 / 1024))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid}
    count_file = tmp_path / "count"
    holder = subprocess.Popen(
        [*workload, "--gib", f"{gib:g}", "--count-file", str(count_file)], env=env, start_new_session=True
    )
    suspended = False
    try:
        wait_until(lambda: counts(count_file)[0] >= 5, 300, "the workload never started counting")
        pid = holder.pid
        wait_until(lambda: pid in compute_pids(), 30, "the workload never showed in nvidia-smi")
        wait_until(lambda: pid in bed.listed(), 30, "gpukilld never listed the workload")
        free_before = free_mib(uuid)

        t0 = time.monotonic()
        r = bed.ctl(ROOT, "suspend", str(pid), timeout=900)
        suspend_s = time.monotonic() - t0
        assert r.returncode == 0, r.stdout + r.stderr
        suspended = True
        wait_until(lambda: pid not in compute_pids(), 10, "still in nvidia-smi's compute apps after the suspend")
        stopped = counts(count_file)
        time.sleep(1.5)  # fifteen of its ticks
        assert counts(count_file) == stopped, "the count went on while suspended"
        table = bed.ctl(ROOT, "list").stdout
        assert any(str(pid) in line.split() and "suspended" in line for line in table.splitlines()), table
        free_after = free_mib(uuid)
        assert free_after - free_before >= gib * 1024 * 0.9, (free_before, free_after)

        # another process allocates what is free now: more than was free before, so the workload's memory too
        want = free_after - MARGIN_MIB
        assert want > free_before, f"{gib:g} GiB is too little to tell (free {free_before} -> {free_after} MiB)"
        other = subprocess.run(
            [*workload, "--alloc-only", "--mib", str(want), "--hold", "0.5"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert other.returncode == 0 and "allocated" in other.stdout, other.stdout + other.stderr
        wait_until(lambda: free_mib(uuid) >= free_after - 256, 30, "the other process's memory was not given back")

        t0 = time.monotonic()
        r = bed.ctl(ROOT, "resume", str(pid), timeout=900)
        resume_s = time.monotonic() - t0
        assert r.returncode == 0, r.stdout + r.stderr
        suspended = False
        wait_until(lambda: pid in compute_pids(), 10, "not back in nvidia-smi's compute apps after the resume")
        count, verified, _ = counts(count_file)
        assert count >= stopped[0], (stopped, count)  # from where it stopped: a counter lost with the memory restarts
        wait_until(lambda: counts(count_file)[1] >= verified + 2, 60, "the workload never compared its memory again")
        final = counts(count_file)
        assert final[0] > stopped[0] and final[2] == 0, f"memory differs after the resume: {final}"
        with capsys.disabled():
            print(
                f"\nsuspend/resume on {uuid}, {gib:g} GiB held ({free_after - free_before} MiB freed): "
                f"suspend {suspend_s:.2f} s = {suspend_s / gib:.3f} s/GiB, "
                f"resume {resume_s:.2f} s = {resume_s / gib:.3f} s/GiB (gpukillctl's wall time, CLI start included)"
            )
    finally:
        if suspended:  # never kill a process mid-restore or checkpointed (NVIDIA/cuda-checkpoint#53)
            bed.ctl(ROOT, "resume", str(holder.pid), timeout=900)
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(60)
