"""Pure functions, no root needed: /proc parsing, cgroup attribution, sizes, config and device-file errors."""

from __future__ import annotations

import os
import textwrap

import pytest

from gpukilld.attribution import parse_cgroup
from gpukilld.backends.simulated import load_sim_config, parse_usage
from gpukilld.bouncer import KILL_ANY, READ_ONLY, RESET_DEVICE, action_for
from gpukilld.config import load_config
from gpukilld.errors import ConfigError
from gpukilld.model import Attribution
from gpukilld.procfs import ProcFS, parse_stat
from gpukilld.units import parse_size

DOCKER_ID = "4f1b6a0f3c2d" + "a" * 52
POD = "1b2c3d4e-5f60-4718-8a9b-0c1d2e3f4a5b"


@pytest.mark.parametrize(("text", "expected"), [
    ("0::/system.slice/cron.service\n", Attribution(unit="cron.service")),
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service\n",
     Attribution(unit="jupyter.service")),
    ("0::/user.slice/user-1000.slice/session-4.scope\n", Attribution(unit="session-4.scope")),
    (f"0::/system.slice/docker-{DOCKER_ID}.scope\n", Attribution(unit=f"docker-{DOCKER_ID}.scope", container_id=DOCKER_ID)),
    (f"0::/machine.slice/libpod-{DOCKER_ID}.scope/container\n",
     Attribution(unit=f"libpod-{DOCKER_ID}.scope", container_id=DOCKER_ID)),
    (f"12:pids:/docker/{DOCKER_ID}\n1:name=systemd:/docker/{DOCKER_ID}\n", Attribution(container_id=DOCKER_ID)),
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}.slice/"
     f"cri-containerd-{DOCKER_ID}.scope\n",
     Attribution(unit=f"cri-containerd-{DOCKER_ID}.scope", container_id=DOCKER_ID, pod_uid=POD)),
    (f"0::/kubepods/burstable/pod{POD}/{DOCKER_ID}\n", Attribution(container_id=DOCKER_ID, pod_uid=POD)),
    ("0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n",
     Attribution(unit="slurmstepd.scope", slurm_job="4242")),
    ("7:freezer:/slurm/uid_1000/job_77/step_batch\n1:name=systemd:/user.slice\n", Attribution(slurm_job="77")),
    ("", Attribution()),
])
def test_cgroup_attribution(text, expected):
    assert parse_cgroup(text) == expected


def test_parse_stat_with_awkward_comm():
    line = "4242 (evil) (name) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 1 0 987654 1000 100 0 0 0 0"
    st = parse_stat(4242, line)
    assert (st.comm, st.state, st.ppid, st.start_time, st.is_kernel_thread) == ("evil) (name", "S", 1, 987654, False)
    kthread = parse_stat(2, "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0")
    assert kthread.is_kernel_thread


def test_procfs_reads_this_process():
    fs = ProcFS()
    me = fs.info(os.getpid())
    assert me is not None and me.uid == os.getuid() and me.start_time == fs.start_time(os.getpid())
    assert fs.stat(4194001) is None and fs.info(4194001) is None


@pytest.mark.parametrize(("text", "value"), [
    (8589934592, 8589934592), ("8GiB", 8 * 2**30), ("8GB", 8 * 10**9), ("8G", 8 * 2**30), ("512MiB", 512 * 2**20),
    ("1.5GiB", int(1.5 * 2**30)), ("100", 100), (" 4 KiB ", 4096),
])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["lots", "-1", -1, True, "8XB", None, 1.5])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_sim_usage_from_environment():
    u = parse_usage({"GPUKILL_SIM_GPU": "0,2", "GPUKILL_SIM_MEM": "4GiB", "GPUKILL_SIM_UTIL": "150"})
    assert u.gpus == (0, 2) and u.memory == 4 * 2**30 and u.utilization == 100.0
    assert parse_usage({}) is None and parse_usage({"GPUKILL_SIM_GPU": "x"}) is None
    assert parse_usage({"GPUKILL_SIM_GPU": "1"}).memory is None  # unknown, not 0
    # a scoped simulated host counts only its own processes
    assert parse_usage({"GPUKILL_SIM_GPU": "1"}, scope="bed1") is None
    assert parse_usage({"GPUKILL_SIM_GPU": "1", "GPUKILL_SIM_SCOPE": "bed2"}, scope="bed1") is None
    assert parse_usage({"GPUKILL_SIM_GPU": "1", "GPUKILL_SIM_SCOPE": "bed1"}, scope="bed1").gpus == (1,)


@pytest.mark.parametrize(("content", "error"), [
    ("devices: [\n", ":2:1: not valid YAML"),
    ("- a\n", "expected a mapping with a 'devices:' list"),
    ("devices: []\ncolour: red\n", "unknown key 'colour'"),
    ("devices:\n  - name: x\n    memory_total: lots\n", "devices[0]: not a size"),
    ("devices:\n  - name: x\n    state: melted\n", "state must be 'ok' or 'lost'"),
    ("devices:\n  - name: x\n    temperature: hot\n", "expected a number"),
    ("devices:\n  - uuid: a\n  - uuid: a\n", "two devices share one uuid"),
    ("devices:\n  - reset: sometimes\n", "reset must be"),
    ("devices: []\nfaults: {explode: true}\n", "'faults' takes only"),
])
def test_sim_file_errors(tmp_path, content, error):
    path = tmp_path / "sim.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        load_sim_config(str(path))
    assert str(e.value).startswith(str(path)) and error in str(e.value)


def test_example_sim_file_loads():
    from testbed import REPO

    config = load_sim_config(str(REPO / "examples" / "simulate.yaml"))
    assert len(config.devices) == 4 and config.devices[3].temperature is None


def test_config_file(tmp_path):
    path = tmp_path / "gpukilld.conf"
    assert load_config(str(path)).sample_interval == 1.0  # missing file: defaults
    path.write_text("[daemon]\nsample_interval = 2.5  # seconds\nsimulate = /etc/gpukill/sim.yaml\n")
    c = load_config(str(path))
    assert (c.sample_interval, c.simulate) == (2.5, "/etc/gpukill/sim.yaml")
    for content, error in [
        ("[daemon]\n\nsampel_interval = 1\n", ":3: unknown key 'sampel_interval'"),
        ("[demon]\n", "unknown section [demon]"),
        ("[daemon]\nsample_interval = 0\n", ":2: sample_interval must be between"),
        ("[daemon]\nsample_interval = nan\n", ":2: sample_interval must be between"),
        ("sample_interval = 1\n", ":1: File contains no section headers"),
    ]:
        path.write_text(textwrap.dedent(content))
        with pytest.raises(ConfigError) as e:
            load_config(str(path))
        assert error in str(e.value), str(e.value)


def test_bouncer_table():
    assert action_for("org.gpukill1.Manager", "ListProcesses") == READ_ONLY
    assert action_for("org.gpukill1.Manager", "KillProcess") == KILL_ANY
    assert action_for(None, "ResetDevice") == RESET_DEVICE  # no interface: matched by member
    assert action_for("org.gpukill1.Manager", "Frobnicate") is None
    assert action_for("org.gpukill1.Other", "KillProcess") is None


def test_audit_without_a_journal_goes_to_stderr(monkeypatch, capsys):
    from gpukilld import audit

    monkeypatch.setattr(audit, "JOURNAL_SOCKET", "/nonexistent/socket")
    a = audit.Audit()
    assert not a.to_journal
    a.log(audit.KILL_DENIED, "Kill of PID 42 denied to uid 1000", caller_uid=1000, target_pid=42, device=None)
    err = capsys.readouterr().err
    assert err == ("<4>Kill of PID 42 denied to uid 1000 [GPUKILL_CALLER_UID=1000 GPUKILL_TARGET_PID=42 "
                   "GPUKILL_EVENT=kill-denied]\n")


def test_backend_selection(tmp_path):
    import dataclasses

    from gpukilld.backends.registry import backend_names, build_backends
    from gpukilld.config import Config

    path = tmp_path / "gpukilld.conf"
    path.write_text("[daemon]\nbackends = drm, simulated\n[paths]\nproc = /fixture/proc\nsys = /fixture/sys\n")
    c = load_config(str(path))
    assert c.backends == ("drm", "simulated") and (c.proc_root, c.sys_root) == ("/fixture/proc", "/fixture/sys")
    assert backend_names(Config(simulate="x.yaml")) == ("simulated",)
    with pytest.raises(ConfigError, match="unknown backend 'quantum'"):
        build_backends(Config(backends=("quantum",)))
    with pytest.raises(ConfigError, match="needs a device file"):
        build_backends(dataclasses.replace(Config(), backends=("simulated",)))


def test_simulated_backend_reads_the_environment_again_after_exec(tmp_path):
    """A process seen between fork and exec has its parent's environment; after exec (same pid and start
    time, new name) it must be read again, or it would never be listed."""
    import shutil
    import subprocess
    import time

    from testbed import REPO

    from gpukilld.backends.simulated import SimulatedBackend

    sim = tmp_path / "sim.yaml"
    shutil.copy(REPO / "examples" / "simulate.yaml", sim)
    backend = SimulatedBackend(str(sim))
    # sh renames nothing and has no GPUKILL_SIM_GPU; it then execs sleep with the variable set
    proc = subprocess.Popen(["sh", "-c", "read x; exec env GPUKILL_SIM_GPU=2 sleep 30"], stdin=subprocess.PIPE)
    try:
        time.sleep(0.2)
        assert all(p.pid != proc.pid for p in backend.sample().processes)
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            found = [p for p in backend.sample().processes if p.pid == proc.pid]
            if found:
                break
            time.sleep(0.05)
        assert found and found[0].device_id == "0000:c1:00.0"
    finally:
        proc.kill()
        proc.wait()
