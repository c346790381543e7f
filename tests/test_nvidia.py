"""The NVIDIA backend through the real pynvml bindings, loading a fake libnvidia-ml built from C
(tests/helpers/fake_nvml/fake_nvml.c), with gpukilld running for real on a private bus."""

from __future__ import annotations

import subprocess

import pytest
from helpers.marks import needs_root
from helpers.nvml_host import fake_nvidia_host, mig_instance, peer_view
from helpers.testbed import ROOT
from helpers.waiting import wait_until

from gpukilld import journal as audit

pytestmark = needs_root

GIB = 2**30
MIB = 2**20
# Entry points that drivers after 550 added (in nvml.h of 12.5 to 12.8): the fake, claiming 550, must lack them
LATER_THAN_550 = [
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetMarginTemperature",
    "nvmlDeviceGetEnforcedPowerLimit_v2",
    "nvmlDeviceGetDriverModel_v2",
]


@pytest.fixture(scope="module")
def nvhost(tmp_path_factory):
    return fake_nvidia_host(tmp_path_factory.mktemp("nvml"))


@pytest.fixture
def nvbed(fresh_bed, nvhost, users):
    """gpukilld with only the NVIDIA backend, on the fake host, sampling every 0.3 s."""
    saved = nvhost.snapshot()
    (fresh_bed.workdir / "gpukilld.conf").write_text("[daemon]\nbackends = nvidia\n")
    fresh_bed.start_polkit()
    fresh_bed.start_daemon(args=["--sample-interval", "0.3"], env=nvhost.env())
    yield fresh_bed
    nvhost.state = saved
    nvhost.write()


def test_eight_gpus_with_every_field_and_real_processes(nvbed, nvhost, users):
    bed = nvbed
    train = bed.victim(users["owner"], comm="train.py")
    render = bed.victim(users["other"], comm="blender")
    nvhost.add_process(0, train.pid, 12 * GIB, sm=87, timestamp=5)
    nvhost.add_process(5, render.pid, 3 * GIB, kind="graphics")
    nvhost.add_process(5, train.pid, 1 * GIB, kind="mps")
    nvhost.write()
    doc = wait_until(
        lambda: (d := bed.listing()) and len(d["processes"]) == 3 and d,
        10,
        lambda: f"not 3 processes listed: {bed.listing()}",
    )
    assert len(doc["devices"]) == 8
    for i, dev in enumerate(doc["devices"]):
        fake = nvhost.device(i)
        assert dev == {
            "index": i,
            "id": fake["uuid"],
            "backend": "nvidia",
            "vendor": "nvidia",
            "name": fake["name"],
            "pci_bus_id": fake["pci_bus_id"],
            "utilization": float(fake["util_gpu"]),
            "memory_used": fake["memory_allocated"],
            "memory_total": fake["memory_total"],
            "temperature": float(fake["temperature"]),
            "power": fake["power_mw"] / 1000,
            "state": "ok",
            "state_reason": None,
            "power_limit": 700.0,
            "mig_mode": False,
            "parent_id": None,
            "clock_mhz": None,  # the nvidia backend does not read clocks
        }, (i, dev)
    procs = {(p["pid"], p["device"]): p for p in doc["processes"]}
    t = procs[(train.pid, 0)]
    assert (t["user"], t["uid"], t["comm"], t["gpu_memory"], t["gpu_utilization"]) == (
        "gpkowner",
        users["owner"].uid,
        "train.py",
        12 * GIB,
        87.0,
    )
    r = procs[(render.pid, 5)]
    assert (r["user"], r["comm"], r["gpu_memory"], r["gpu_utilization"]) == ("gpkother", "blender", 3 * GIB, 0.0)
    assert procs[(train.pid, 5)]["gpu_memory"] == 1 * GIB  # MPS client listed on its device
    table = bed.ctl(users["other"], "list")
    assert "NVIDIA H100 80GB HBM3" in table.stdout and "train.py" in table.stdout


def test_not_supported_is_null_and_mig_instances(nvbed, nvhost, users):
    bed = nvbed
    job = bed.victim(users["owner"], comm="mig-job")
    dev = nvhost.device(2)
    dev["mig_mode"] = 1
    dev["mig_devices"] = [
        {
            "uuid": "MIG-11111111-2222-3333-4444-555555555555",
            "gi": 1,
            "ci": 0,
            "memory_total": 10 * GIB,
            "memory_allocated": 2 * GIB,
            "compute": [{"pid": job.pid, "used_memory": 2 * GIB}],
        }
    ]
    nvhost.fault(3, not_supported=["temperature", "power", "process_utilization"])
    doc = wait_until(
        lambda: (d := bed.listing()) and len(d["devices"]) == 9 and d["processes"] and d,
        10,
        "the MIG instance and its process were never listed",
    )
    by_id = {d["id"]: d for d in doc["devices"]}
    mig = by_id["MIG-11111111-2222-3333-4444-555555555555"]
    assert (mig["parent_id"], mig["memory_total"], mig["name"]) == (
        dev["uuid"],
        10 * GIB,
        "NVIDIA H100 80GB HBM3 MIG 1/0",
    )
    assert by_id[dev["uuid"]]["mig_mode"] is True
    (p,) = doc["processes"]
    assert (p["pid"], p["device_id"], p["gpu_memory"]) == (job.pid, mig["id"], 2 * GIB)
    d3 = doc["devices"][3]
    assert d3["temperature"] is None and d3["power"] is None and d3["utilization"] == 13.0


def test_wrong_struct_version_gives_no_garbage(nvbed, nvhost, users):
    """The driver writes v1-sized records into the v3 buffer pynvml hands it: the rows pynvml decodes are
    garbage (shifted PIDs and sizes). The backend must notice and use the v1 call."""
    bed = nvbed
    a = bed.victim(users["owner"], comm="proc-a")
    b = bed.victim(users["other"], comm="proc-b")
    nvhost.add_process(4, a.pid, 3 * GIB)
    nvhost.add_process(4, b.pid, 5 * GIB)
    nvhost.fault(4, process_struct="v1")
    doc = wait_until(
        lambda: (d := bed.listing()) and len(d["processes"]) == 2 and d,
        10,
        lambda: f"not 2 processes listed: {bed.listing()}",
    )
    got = sorted((p["pid"], p["gpu_memory"], p["device"]) for p in doc["processes"])
    assert got == sorted([(a.pid, 3 * GIB, 4), (b.pid, 5 * GIB, 4)])
    assert "struct-version mismatch" in bed.daemon.log()


def test_lost_gpu_is_signalled_while_others_keep_updating(nvbed, nvhost, users):
    bed = nvbed
    rec = bed.record_signals(users["other"])
    nvhost.fault(6, lost=True)
    sig = rec.wait_for("DeviceStateChanged", where=lambda b: b[0] == 6 and b[2] == "lost")
    assert sig and sig["body"][3] == "NVML: GPU is lost", sig
    nvhost.device(1)["util_gpu"] = 77
    nvhost.write()
    wait_until(lambda: bed.listing()["devices"][1]["utilization"] == 77.0, 10, "GPU 1 stopped updating")
    doc = bed.listing()
    assert doc["devices"][6]["state"] == "lost" and doc["devices"][6]["id"] == nvhost.device(6)["uuid"]
    assert bed.wait_journal(MESSAGE_ID=audit.DEVICE_STATE.message_id, GPUKILL_STATE="lost", GPUKILL_DEVICE_INDEX="6")
    status = bed.ctl(users["other"], "status")
    assert "8 GPUs (1 lost)" in status.stdout and "NVML: GPU is lost" in status.stdout


def test_hung_nvml_call_marks_only_that_gpu_lost(nvbed, nvhost, users):
    bed = nvbed
    nvhost.fault(7, slow_ms=60000)
    doc = wait_until(
        lambda: (d := bed.listing()) and d["devices"][7]["state"] == "lost" and d, 15, "GPU 7 was never marked lost"
    )
    assert doc["devices"][7]["state_reason"] == "NVML did not answer within 2s"
    nvhost.device(0)["util_gpu"] = 55
    nvhost.write()
    wait_until(lambda: bed.listing()["devices"][0]["utilization"] == 55.0, 15, "GPU 0 stopped updating")
    assert bed.daemon.proc.poll() is None


def test_xid_error_surfaces_with_the_recovery_action(nvbed, nvhost, users):
    bed = nvbed
    rec = bed.record_signals()
    nvhost.device(1)["recovery_action"] = 1
    nvhost.state["xid_events"] = [{"device": 1, "xid": 79, "seq": 1}]
    nvhost.write()
    sig = rec.wait_for("DeviceStateChanged", where=lambda b: b[0] == 1 and b[2] == "error")
    assert sig and sig["body"][3] == "Xid 79; recovery action: GPU reset", sig


def test_force_reset_kills_then_calls_nvidia_smi(nvbed, nvhost, users, alive):
    bed = nvbed
    stuck = bed.victim(users["owner"], ignore_term=True, comm="stuck")
    nvhost.add_process(3, stuck.pid, 4 * GIB)
    nvhost.write()
    wait_until(lambda: bed.listing()["processes"], 10, "the stuck process was never listed")
    uuid = nvhost.device(3)["uuid"]
    busy = bed.ctl(ROOT, "reset", "3")
    assert busy.returncode == 8 and nvhost.resets() == [], busy
    r = bed.ctl(ROOT, "reset", uuid, "--force")
    assert r.returncode == 0, r
    assert f"killed first: {stuck.pid}" in r.stdout and f"GPU {uuid} was successfully reset." in r.stdout
    assert not alive(stuck.pid)
    assert nvhost.resets() == [["--gpu-reset", "-i", uuid]]
    kill = bed.wait_journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(stuck.pid))
    assert kill and kill[0]["GPUKILL_INITIATOR"] == "reset" and kill[0]["GPUKILL_RESULT"] == "killed"
    reset = bed.wait_journal(MESSAGE_ID=audit.RESET.message_id, GPUKILL_DEVICE=uuid)
    assert reset and reset[0]["GPUKILL_KILLED"] == str(stuck.pid)


def test_failed_nvidia_smi_reset_returns_its_text(fresh_bed, nvhost, users):
    bed = fresh_bed
    (bed.workdir / "gpukilld.conf").write_text("[daemon]\nbackends = nvidia\n")
    bed.start_daemon(
        args=["--sample-interval", "0.3"],
        env={
            **nvhost.env(),
            "GPUKILL_FAKE_SMI_FAIL": "Unable to reset this GPU because it's being used by some other process",
        },
    )
    wait_until(lambda: len(bed.listing()["devices"]) == 8, 10, "the 8 GPUs were never listed")
    r = bed.ctl(ROOT, "reset", "0")
    assert r.returncode == 11, r
    assert "nvidia-smi --gpu-reset failed (exit 255): Unable to reset this GPU" in r.stderr
    assert r.stderr.count("\n") == 1


def test_no_nvidia_library_daemon_runs_and_says_why(fresh_bed, nvhost, users):
    bed = fresh_bed
    (bed.workdir / "gpukilld.conf").write_text("[daemon]\nbackends = nvidia\n")
    bed.start_daemon(env=nvhost.env(with_library=False))
    r = bed.ctl(users["other"], "status")
    assert r.returncode == 0, r
    assert "nvidia: unavailable - no NVIDIA driver: libnvidia-ml.so.1 not found; retrying in" in r.stdout
    assert "0 GPUs" in r.stdout
    assert bed.listing()["devices"] == []


def test_driver_not_loaded_is_reported(fresh_bed, nvhost, users):
    bed = fresh_bed
    nvhost.state["init_error"] = 9
    nvhost.write()
    try:
        (bed.workdir / "gpukilld.conf").write_text("[daemon]\nbackends = nvidia\n")
        bed.start_daemon(env=nvhost.env())
        r = bed.ctl(users["other"], "status")
        assert "nvidia: unavailable - NVML could not start: Driver Not Loaded; retrying in 5s" in r.stdout, r.stdout
    finally:
        del nvhost.state["init_error"]
        nvhost.write()


def with_mig_instance(nvhost, job_pid: int) -> tuple[dict, dict]:
    """GPU 2 in MIG mode with one instance (128 MiB reserved, as seen on a real instance) running
    job_pid with 2 GiB; the GPU itself keeps the 512 MiB reserved of every fake H100."""
    gpu = nvhost.device(2)
    gpu["mig_mode"] = 1
    gpu["mig_devices"] = [mig_instance("MIG-11111111-2222-3333-4444-555555555555", 1, 0, 10 * GIB, reserved=128 * MIB)]
    nvhost.add_process(2, job_pid, 2 * GIB, mig=0)
    nvhost.write()
    return gpu, gpu["mig_devices"][0]


def test_mig_instance_used_memory_is_allocated_only_as_the_parents_and_nvitops(nvbed, nvhost, users):
    """nvml.h: v1's used = reserved + allocated, v2's used = allocated. An instance read through v1 while its
    parent is read through v2 would list 2 GiB + 128 MiB here, and disagree with nvitop's MigDevice."""
    bed = nvbed
    job = bed.victim(users["owner"], comm="mig-job")
    gpu, mig = with_mig_instance(nvhost, job.pid)
    doc = wait_until(
        lambda: (d := bed.listing()) and len(d["devices"]) == 9 and d["processes"] and d,
        10,
        "the MIG instance and its process were never listed",
    )
    by_id = {d["id"]: d for d in doc["devices"]}
    listed_mig, listed_gpu = by_id[mig["uuid"]], by_id[gpu["uuid"]]
    assert listed_mig["memory_used"] == mig["memory_allocated"] == 2 * GIB
    assert listed_gpu["memory_used"] == gpu["memory_allocated"] == 2 * GIB  # the parent counts the same way
    (p,) = doc["processes"]
    assert (p["device_id"], p["gpu_memory"]) == (mig["uuid"], listed_mig["memory_used"])

    view = peer_view(nvhost)
    (nvitop_gpu,) = [g for g in view["nvitop"] if g["uuid"] == gpu["uuid"]]
    (nvitop_mig,) = nvitop_gpu["mig"]
    assert nvitop_mig["uuid"] == mig["uuid"]
    assert nvitop_mig["memory"] == {
        "total": listed_mig["memory_total"],
        "used": listed_mig["memory_used"],
        "free": 10 * GIB - 128 * MIB - 2 * GIB,
        "reserved": 128 * MIB,
    }
    assert nvitop_gpu["memory"]["used"] == listed_gpu["memory_used"]


def test_without_memory_v2_instances_and_gpus_fall_back_to_v1_alike(nvbed, nvhost, users):
    """A driver (or device) without the v2 call: the v1 struct for the GPU and its instances, whose used
    memory then includes the reserved memory, for both alike."""
    bed = nvbed
    job = bed.victim(users["owner"], comm="mig-job")
    gpu, mig = with_mig_instance(nvhost, job.pid)
    nvhost.fault(2, not_supported=["memory_v2"])
    doc = wait_until(
        lambda: (d := bed.listing()) and len(d["devices"]) == 9 and d["processes"] and d,
        10,
        "the MIG instance and its process were never listed",
    )
    by_id = {d["id"]: d for d in doc["devices"]}
    assert by_id[mig["uuid"]]["memory_used"] == 2 * GIB + 128 * MIB
    assert by_id[gpu["uuid"]]["memory_used"] == 2 * GIB + 512 * MIB
    assert by_id[nvhost.device(1)["uuid"]]["memory_used"] == 0  # the others keep v2


@pytest.fixture(scope="module")
def nvhost_o0(tmp_path_factory):
    """The fake built without optimisation, where undefined behaviour in it shows rather than hides."""
    return fake_nvidia_host(tmp_path_factory.mktemp("nvml-O0"), devices=3, optimize="-O0")


def test_fake_follows_550s_nvml_h_and_nvitop_reads_temperatures(nvhost_o0):
    host = nvhost_o0
    host.device(1)["mig_mode"] = 1
    host.device(1)["mig_devices"] = [
        mig_instance("MIG-aaaaaaaa-2222-3333-4444-555555555555", 1, 0, 10 * GIB, reserved=128 * MIB)
    ]
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        host.add_process(0, sleeper.pid, None)  # NVML does not know its memory: NVML_VALUE_NOT_AVAILABLE
        host.add_process(1, sleeper.pid, 3 * GIB, mig=0)
        host.write()
        view = peer_view(host, LATER_THAN_550)
    finally:
        sleeper.kill()
        sleeper.wait()
    # nvitop prefers nvmlDeviceGetTemperatureV where exported: with it gone it reads the 550 call
    assert [g["temperature"] for g in view["nvitop"]] == [host.device(i)["temperature"] for i in range(3)]
    assert view["exports"] == dict.fromkeys(LATER_THAN_550, False)
    assert view["processes"][host.device(0)["uuid"]] == [[sleeper.pid, None]]  # pynvml's None for the sentinel
    for uuid, memory in view["pynvml"].items():
        v1, v2 = memory["v1"], memory["v2"]
        assert v1["used"] == v2["used"] + v2["reserved"] and v1["free"] == v2["free"], uuid
        assert v2["total"] == v2["reserved"] + v2["used"] + v2["free"], uuid
    assert view["pynvml"]["MIG-aaaaaaaa-2222-3333-4444-555555555555"]["v2"] == {
        "total": 10 * GIB,
        "reserved": 128 * MIB,
        "used": 3 * GIB,
        "free": 10 * GIB - 128 * MIB - 3 * GIB,
    }
