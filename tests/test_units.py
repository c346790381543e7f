"""Pure functions, no root needed: /proc parsing, cgroup attribution, sizes, config and device-file errors."""

from __future__ import annotations

import os
import textwrap

import pytest

from gpukill.errors import ConfigError
from gpukill.procstat import parse_stat
from gpukill.units import exact_size, parse_duration, parse_size
from gpukilld.access.bouncer import KILL_ANY, READ_ONLY, RESET_DEVICE, action_for
from gpukilld.backends.simulated import load_sim_config, parse_usage
from gpukilld.config import load_config
from gpukilld.model import Attribution
from gpukilld.proc.attribution import parse_cgroup
from gpukilld.proc.procfs import ProcFS

DOCKER_ID = "4f1b6a0f3c2d" + "a" * 52
POD = "1b2c3d4e-5f60-4718-8a9b-0c1d2e3f4a5b"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0::/system.slice/cron.service\n", Attribution(unit="cron.service", system_unit="cron.service")),
        (
            "0::/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service\n",
            Attribution(unit="jupyter.service"),
        ),
        ("0::/user.slice/user-1000.slice/session-4.scope\n", Attribution(unit="session-4.scope")),
        (
            f"0::/system.slice/docker-{DOCKER_ID}.scope\n",
            Attribution(
                unit=f"docker-{DOCKER_ID}.scope", container_id=DOCKER_ID, system_unit=f"docker-{DOCKER_ID}.scope"
            ),
        ),
        (
            f"0::/machine.slice/libpod-{DOCKER_ID}.scope/container\n",
            Attribution(unit=f"libpod-{DOCKER_ID}.scope", container_id=DOCKER_ID),
        ),
        (f"12:pids:/docker/{DOCKER_ID}\n1:name=systemd:/docker/{DOCKER_ID}\n", Attribution(container_id=DOCKER_ID)),
        (
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}.slice/"
            f"cri-containerd-{DOCKER_ID}.scope\n",
            Attribution(unit=f"cri-containerd-{DOCKER_ID}.scope", container_id=DOCKER_ID, pod_uid=POD),
        ),
        (f"0::/kubepods/burstable/pod{POD}/{DOCKER_ID}\n", Attribution(container_id=DOCKER_ID, pod_uid=POD)),
        (
            "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n",
            Attribution(unit="slurmstepd.scope", slurm_job="4242", system_unit="slurmstepd.scope"),
        ),
        ("7:freezer:/slurm/uid_1000/job_77/step_batch\n1:name=systemd:/user.slice\n", Attribution(slurm_job="77")),
        ("", Attribution()),
        # a user can name a cgroup in its own delegated subtree like a system unit: that is not one
        ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/dbus.service\n", Attribution(unit="dbus.service")),
        (
            "0::/system.slice/delegated.service/dbus.service\n",
            Attribution(unit="dbus.service", system_unit="delegated.service"),
        ),
        (
            "0::/system.slice/system-getty.slice/getty@tty1.service\n",
            Attribution(unit="getty@tty1.service", system_unit="getty@tty1.service"),
        ),
        (
            "12:pids:/system.slice/dbus.service\n1:name=systemd:/user.slice/user-1000.slice/session-2.scope\n",
            Attribution(unit="session-2.scope"),
        ),
    ],
)
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


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8GiB", 8 * 2**30),
        ("8GB", 8 * 10**9),
        ("8G", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", int(1.5 * 2**30)),
        ("100B", 100),
        (" 4 KiB ", 4096),
        ("8gib", 8 * 2**30),
    ],
)
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bare", ["8", 8, "8589934592", 8589934592, " 100 ", "1.5"])
def test_a_bare_number_is_no_size_unless_the_caller_says_its_unit(bare):
    with pytest.raises(ValueError, match="a bare number is not a size.*write a unit: 8GiB, 8GB, 512MiB, 4096B"):
        parse_size(bare)
    assert parse_size(bare, bare=1) == int(float(str(bare)))  # a typed byte count (D-Bus 't', device files)
    if float(str(bare)) < 1 << 30:
        assert parse_size(bare, bare=2**30) == int(float(str(bare)) * 2**30)  # gpu-kill's GB


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("4096B", True),
        ("512KiB", True),
        ("512K", True),
        ("1000KB", True),
        ("0GiB", True),
        ("0B", True),
        ("1MiB", True),
        ("1GiB", True),
        ("0.5M", False),
        ("0.0001GiB", False),
        ("999KB", True),
        ("0.9MB", False),
    ],
)
def test_a_limit_under_one_mebibyte_needs_a_unit_that_says_it_is_small(text, ok):
    if ok:
        assert parse_size(text, limit=True) == parse_size(text)
    else:
        with pytest.raises(ValueError, match="under 1 MiB, likely a mistake"):
            parse_size(text, limit=True)
        assert parse_size(text) > 0  # not a limit (a filter): any size
    with pytest.raises(ValueError, match="under 1 MiB"):
        parse_size(4096, bare=1, limit=True)  # a typed byte count has no unit to say so
    assert parse_size(1 << 20, bare=1, limit=True) == 1 << 20


@pytest.mark.parametrize("n", [1, 1000, 1 << 10, 3 << 20, 8 << 30, 10**9, 1 << 60])
def test_exact_size_reads_back_to_the_same_bytes(n):
    assert parse_size(exact_size(n)) == n


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("90s", 90),
        ("90sec", 90),
        ("2 seconds", 2),
        ("5m", 300),
        ("5min", 300),
        ("5 minutes", 300),
        ("90min", 5400),
        ("1h30m", 5400),
        ("1h 30min", 5400),
        ("1H30M", 5400),
        ("2hr", 7200),
        ("3 hours", 10800),
        ("2d 4h", 2 * 86400 + 4 * 3600),
        ("1day", 86400),
        ("1w", 7 * 86400),
        ("2 weeks", 14 * 86400),
        ("500ms", 0.5),
        ("1.5h", 5400),
        (" 1h ", 3600),
        (90, 90),
        (2.5, 2.5),
    ],
)
def test_durations_as_systemd_admins_write_them(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "bad", ["5 parsecs", "m", "-5m", "", "5m3", "h30", "1e3s", "5mx", "1y", True, None, "1" * 65, "40000d"]
)
def test_what_is_no_duration_is_one_line(bad):
    with pytest.raises(ValueError) as e:
        parse_duration(bad)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200


@pytest.mark.parametrize("bad", ["lots", "-1", -1, True, "8XB", None, 1.5])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (2**60, 2**60),
        ("1EiB", 2**60),
        ("1024PiB", 2**60),
        ("1152921504606846976B", 2**60),
        (-0, 0),
        ("0.5KiB", 512),
        ("1.1GB", 1_100_000_000),
        ("0" * 60 + "1K", 1024),
    ],
)
def test_sizes_up_to_one_exbibyte_exactly(text, value):
    assert parse_size(text, bare=1) == value


@pytest.mark.parametrize(
    "bad",
    [
        2**60 + 1,
        10**5000,
        -(10**5000),
        "1152921504606846977B",
        "2EiB",
        "1.5EiB",
        "1025PiB",
        "2EB",
        "9" * 400,
        "9" * 400 + "GiB",  # int(float("9"*400) * 2**30) was OverflowError (int of inf)
        "9" * 60 + "P",
        "1" * 65,
        "1" + " " * 100_000 + "x",
        float("inf"),
        float("nan"),
        1e400,
        "inf",
        "nan",
        "1e400",
        "1e3",
        "0x10",
        "٨GiB",
        "8 GiB B",
        b"8GiB",
    ],
    ids=lambda v: f"{type(v).__name__}-{v.bit_length()}-bits" if isinstance(v, int) else ascii(v)[:30],
)
def test_sizes_beyond_the_maximum_or_not_sizes_are_value_errors(bad):
    with pytest.raises(ValueError) as e:
        parse_size(bad, bare=1)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200


def test_sim_usage_from_environment():
    u = parse_usage({"GPUKILL_SIM_GPU": "0,2", "GPUKILL_SIM_MEM": "4GiB", "GPUKILL_SIM_UTIL": "150"})
    assert u.gpus == (0, 2) and u.memory == 4 * 2**30 and u.utilization == 100.0
    assert parse_usage({}) is None and parse_usage({"GPUKILL_SIM_GPU": "x"}) is None
    assert parse_usage({"GPUKILL_SIM_GPU": "1"}).memory is None  # unknown, not 0
    # a scoped simulated host counts only its own processes
    assert parse_usage({"GPUKILL_SIM_GPU": "1"}, scope="bed1") is None
    assert parse_usage({"GPUKILL_SIM_GPU": "1", "GPUKILL_SIM_SCOPE": "bed2"}, scope="bed1") is None
    assert parse_usage({"GPUKILL_SIM_GPU": "1", "GPUKILL_SIM_SCOPE": "bed1"}, scope="bed1").gpus == (1,)


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("devices: [\n", ":2:1: not valid YAML"),
        ("- a\n", "expected a mapping with a 'devices:' list"),
        ("devices: []\ncolour: red\n", "unknown key 'colour'"),
        ("devices:\n  - name: x\n    memory_total: lots\n", "devices[0]: not a size"),
        ("devices:\n  - name: x\n    state: melted\n", "state must be 'ok', 'lost' or 'error'"),
        ("devices:\n  - name: x\n    temperature: hot\n", "expected a number"),
        ("devices:\n  - uuid: a\n  - uuid: a\n", "two devices share one uuid"),
        ("devices:\n  - reset: sometimes\n", "reset must be"),
        ("devices: []\nfaults: {explode: true}\n", "'faults' takes only"),
        # numbers of any size, and YAML that makes PyYAML raise more than YAMLError
        ("devices:\n  - memory_total: " + "9" * 5000 + "\n", "not valid YAML: ValueError: Exceeds the limit"),
        ("devices:\n  - memory_total: '" + "9" * 400 + "GiB'\n", "devices[0]: not a size"),
        ("devices:\n  - memory_total: 1.0e+400\n", "devices[0]: not a size: inf"),
        ("devices:\n  - memory_total: 2EiB\n", "larger than the maximum, 1 EiB"),
        ("devices:\n  - memory_used: " + str(2**61) + "\n", "larger than the maximum, 1 EiB"),
        ("devices:\n  - memory_used: " + "9" * 4000 + "\n", "larger than the maximum, 1 EiB"),
        ("devices:\n  - memory_used: .nan\n", "devices[0]: not a size: nan"),
        ("devices:\n  - utilization: .nan\n", "utilization: expected a number, got nan"),
        ("devices:\n  - utilization: 1.0e+400\n", "utilization: expected a number from 0 to 100, got inf"),
        ("devices:\n  - utilization: " + "9" * 4000 + "\n", "got a number of about 400"),
        ("devices:\n  - temperature: .inf\n", "temperature: expected a number from -273.15 to 1000, got inf"),
        ("devices:\n  - temperature: -.inf\n", "temperature: expected a number from -273.15 to 1000, got -inf"),
        ("devices:\n  - power: true\n", "power: expected a number, got True"),
        ("devices:\n  - power: " + "1" + "0" * 30 + "\n", "power: expected a number from 0 to 1e+06"),
        ("devices:\n  - name: 0b" + "1" * 20_000 + "\n", "devices[0]: Exceeds the limit"),  # str() of it
        ("devices:\n  - {1: x, name: y}\n", "devices[0]: unknown key 1"),
        ("devices: " + "[" * 100_000 + "\n", "not valid YAML"),
        ("devices: []\n# \x01\n", "not valid YAML: unacceptable character #x0001"),
        ('devices: ["\\U00110000"]\n', "not valid YAML: ValueError"),
    ],
)
def test_sim_file_errors(tmp_path, content, error):
    path = tmp_path / "sim.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        load_sim_config(str(path))
    message = str(e.value)
    assert message.startswith(str(path)) and error in message, message[:300]
    assert "\n" not in message and len(message) < 500 + len(str(path))


def test_sim_file_minus_zero_and_the_largest_sizes_load(tmp_path):
    path = tmp_path / "sim.yaml"
    path.write_text(
        "devices:\n  - {memory_total: 1EiB, memory_used: -0, utilization: -0.0, temperature: -0, power: 0}\n"
    )
    (dev,) = load_sim_config(str(path)).devices
    assert (dev.memory_total, dev.memory_used, dev.utilization, dev.temperature, dev.power) == (2**60, 0, 0, 0, 0)
    assert str(dev.utilization) == "0.0"


def test_example_sim_file_loads():
    from helpers.testbed import REPO

    config = load_sim_config(str(REPO / "examples" / "simulate.yaml"))
    assert len(config.devices) == 4 and config.devices[3].temperature is None


def test_config_file(tmp_path):
    path = tmp_path / "gpukilld.conf"
    assert load_config(str(path)).sample_interval == 1.0  # missing file: defaults
    path.write_text("[daemon]\nsample_interval = 2.5  # seconds\nsimulate = /etc/gpukill/sim.yaml\n")
    c = load_config(str(path))
    assert (c.sample_interval, c.simulate) == (2.5, "/etc/gpukill/sim.yaml")
    path.write_text("[daemon]\nsample_interval = 500ms\n")  # a duration in the one grammar
    assert load_config(str(path)).sample_interval == 0.5
    for content, error in [
        ("[daemon]\n\nsampel_interval = 1\n", ":3: unknown key 'sampel_interval'"),
        ("[demon]\n", "unknown section [demon]"),
        ("[daemon]\nsample_interval = 0\n", ":2: sample_interval must be between"),
        ("[daemon]\nsample_interval = nan\n", ":2: sample_interval: not a duration: 'nan'"),
        ("[daemon]\nsample_interval = 2h\n", ":2: sample_interval must be between"),
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
    from gpukilld import journal as audit

    monkeypatch.setattr(audit, "JOURNAL_SOCKET", "/nonexistent/socket")
    a = audit.Audit()
    assert not a.to_journal
    a.log(audit.KILL_DENIED, "Kill of PID 42 denied to uid 1000", caller_uid=1000, target_pid=42, device=None)
    err = capsys.readouterr().err
    assert err == (
        "<4>Kill of PID 42 denied to uid 1000 [GPUKILL_CALLER_UID=1000 GPUKILL_TARGET_PID=42 "
        "GPUKILL_EVENT=kill-denied]\n"
    )


def test_backend_selection(tmp_path):
    import dataclasses

    from gpukilld.backends.registry import backend_names, build_backends
    from gpukilld.config import Config

    path = tmp_path / "gpukilld.conf"
    path.write_text("[daemon]\nbackends = drm, nvidia\n[paths]\nproc = /fixture/proc\nsys = /fixture/sys\n")
    c = load_config(str(path))
    assert c.backends == ("drm", "nvidia") and (c.proc_root, c.sys_root) == ("/fixture/proc", "/fixture/sys")
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

    from helpers.testbed import REPO
    from helpers.waiting import wait_until

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
        found = wait_until(
            lambda: [p for p in backend.sample().processes if p.pid == proc.pid],
            30,
            "the exec'd process was never sampled",
            interval=0.05,
        )
        assert found[0].device_id == "0000:c1:00.0"
    finally:
        proc.kill()
        proc.wait()


def test_a_unit_exists_by_its_file_alias_template_or_cgroup(tmp_path):
    """gpukillctl's check of a unit name that selected nothing (names.no_such_unit): systemd's unit directories
    (a file, an alias link even dangling, a template for an instance) or a running unit's cgroup."""
    from gpukillctl.cli.names import no_such_unit

    units, cgroups = tmp_path / "system", tmp_path / "cgroup"
    units.mkdir()
    (units / "train.service").write_text("[Service]\nExecStart=/bin/true\n")
    (units / "worker@.service").write_text("[Service]\nExecStart=/bin/true\n")
    (units / "alias.service").symlink_to("/nonexistent/target.service")
    (cgroups / "user.slice" / "user-1000.slice" / "user@1000.service" / "app.slice" / "lab.service").mkdir(parents=True)
    (cgroups / "cgroup.controllers").write_text("memory pids\n")
    dirs = [str(units), str(tmp_path / "missing")]
    for unit in ("train.service", "worker@3.service", "alias.service", "lab.service", "user@1000.service"):
        assert no_such_unit(unit, dirs, str(cgroups)) is None, unit
    for unit in ("train2.service", "worker@3.scope", "lab.scope", "session-1.scope"):
        assert no_such_unit(unit, dirs, str(cgroups)) == (
            f"no such unit {unit!r} on this host (systemd has no unit file and no running unit of that name)"
        )
