"""`make test-package`: the .deb installed into a debootstrapped Debian bookworm booted with systemd as PID 1
under systemd-nspawn, and checked there with the real systemctl, dbus-daemon, polkitd and journald.

The bookworm tree is built once (debootstrap, about a minute) and cached in $GPUKILL_NSPAWN_CACHE
(default /var/cache/gpukill-test); each run boots a fresh copy of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUKILL_NSPAWN_CACHE", "/var/cache/gpukill-test"))
MIRROR = os.environ.get("GPUKILL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEB = sorted((REPO / "dist").glob("gpukill_*_amd64.deb"))
# The optional parts, built from the same source by `make deb`: the serve stack (bundled) and the exporter's unit
SERVE_DEB = sorted((REPO / "dist").glob("gpukill-serve_*_amd64.deb"))
EXPORTER_DEB = sorted((REPO / "dist").glob("gpukill-exporter_*_all.deb"))
INCLUDE = "systemd,systemd-sysv,libpam-systemd,dbus,polkitd,python3"
CLEAN_ENV = ["env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND=noninteractive", "LANG=C.UTF-8"]

# `systemd-analyze security gpukilld.service` in the booted bookworm (systemd 252) rates the installed unit 3.6
# (3.3 for the hardening alone; CAP_NET_ADMIN for the kernel's proc connector adds 0.2,
# and RestrictNamespaces=net for sock_diag, +0.1: `systemd-analyze security --offline=yes` on the unit file).
# A change that loosens systemd/gpukilld.service fails here; one that tightens it should lower this figure with it.
EXPOSURE_MAX = 3.6
# What the unit's CapabilityBoundingSet= leaves (capability numbers of linux/capability.h): CAP_DAC_READ_SEARCH 2,
# CAP_KILL 5, CAP_SETGID 6, CAP_SETUID 7, CAP_NET_ADMIN 12, CAP_SYS_PTRACE 19, CAP_SYS_ADMIN 21. CAP_DAC_OVERRIDE
# (1) is not there.
CAP_BOUNDING = sum(1 << n for n in (2, 5, 6, 7, 12, 19, 21))

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("systemd-nspawn") or not shutil.which("debootstrap") or not DEB,
    reason="needs root, systemd-nspawn, debootstrap and a built package (make deb)",
)

timings: dict[str, float] = {}


def cached_bookworm() -> Path:
    root = CACHE / "bookworm"
    if (root / ".gpukill-complete").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    fresh = CACHE / "bookworm.new"
    shutil.rmtree(fresh, ignore_errors=True)
    t0 = time.monotonic()
    subprocess.run(
        ["debootstrap", "--variant=minbase", f"--include={INCLUDE}", "bookworm", str(fresh), MIRROR],
        check=True,
        capture_output=True,
    )
    subprocess.run(["chroot", str(fresh), *CLEAN_ENV, "apt-get", "update", "-qq"], check=True, capture_output=True)
    (fresh / ".gpukill-complete").touch()
    shutil.rmtree(root, ignore_errors=True)
    fresh.rename(root)
    timings["debootstrap (first run only)"] = time.monotonic() - t0
    return root


class Machine:
    """A booted container; run() executes a command inside it through nsenter."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.log = open(root.parent / "console.log", "wb")  # noqa: SIM115 - lives as long as the machine
        self.proc = subprocess.Popen(
            # --capability=CAP_NET_ADMIN: a host's PID 1 has every capability, nspawn's container not this one
            # (it leaves it out without a private network); the unit's bounding set must be seen as on a host
            [
                "systemd-nspawn",
                "--register=no",
                "--keep-unit",
                "-q",
                "--capability=CAP_NET_ADMIN",
                "-D",
                str(root),
                "-b",
                "--console=pipe",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.leader = self._find_leader()

    def _find_leader(self) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == self.proc.pid and "(systemd)" in stat:
                    return int(entry)
            time.sleep(0.1)
        raise RuntimeError("the container's systemd did not start")

    def run(
        self, *argv: str, check: bool = True, user: str | None = None, timeout: float = 120, env: tuple[str, ...] = ()
    ) -> subprocess.CompletedProcess:
        cmd = ["nsenter", "-t", str(self.leader), "-a", *CLEAN_ENV, *env]
        if user:
            cmd += ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"]
        r = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nspawn asks the container's systemd to power off
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def machine():
    t0 = time.monotonic()
    base = cached_bookworm()
    work = Path(tempfile.mkdtemp(prefix="gpukill-nspawn-"))
    root = work / "root"
    subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(root)], check=True)
    m = Machine(root)
    try:
        state = ""
        deadline = time.monotonic() + 60
        while state not in ("running", "degraded") and time.monotonic() < deadline:
            # right after boot starts, the container's bus may not be up yet: ask again
            state = m.run("systemctl", "is-system-running", "--wait", check=False).stdout.strip()
            time.sleep(0.2)
        assert state in ("running", "degraded"), f"container did not boot: {state!r}"
        timings["copy and boot"] = time.monotonic() - t0
        yield m
    finally:
        m.stop()
        shutil.rmtree(work, ignore_errors=True)
        print(
            "\nbooted install test timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()), file=sys.stderr
        )


def pid_of(m: Machine, unit: str) -> int:
    return int(m.run("systemctl", "show", "-P", "MainPID", unit).stdout.strip())


def wait_until(check, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.3)
    return False


def test_install_enables_and_starts(machine):
    t0 = time.monotonic()
    shutil.copy(DEB[-1], machine.root / "root" / DEB[-1].name)
    machine.run("apt-get", "install", "-y", "-q", f"/root/{DEB[-1].name}", timeout=600)
    timings["apt install"] = time.monotonic() - t0
    assert machine.run("systemctl", "is-enabled", "gpukilld").stdout.strip() == "enabled"
    machine.run("systemctl", "enable", "--now", "gpukilld")
    assert wait_until(lambda: machine.run("systemctl", "is-active", "gpukilld", check=False).stdout.strip() == "active")
    machine.run("useradd", "-m", "alice")
    for user in (None, "alice"):
        r = machine.run("gpukillctl", "status", user=user)
        assert "gpukilld 0.1.0" in r.stdout and "backends:" in r.stdout


def test_install_creates_the_sandbox_account(machine):
    """sysusers.d/gpukill.conf, applied by the postinst: a system account without home or shell, with its own
    group, for the TestPolicies child."""
    _, _, uid, gid, gecos, home, shell = machine.run("getent", "passwd", "gpukill-sandbox").stdout.strip().split(":")
    assert 0 < int(uid) < 1000 and (gecos, home, shell) == ("gpukill policy sandbox", "/", "/usr/sbin/nologin")
    assert machine.run("getent", "group", "gpukill-sandbox").stdout.split(":")[2] == gid


def test_the_unit_runs_hardened(machine):
    """The exposure score of the installed unit, and what the running daemon really got from it."""
    report = machine.run("systemd-analyze", "security", "--no-pager", "gpukilld.service").stdout
    score = re.search(r"Overall exposure level for gpukilld\.service: (\d+\.\d+)", report)
    assert score, report
    assert float(score[1]) <= EXPOSURE_MAX + 0.0, report
    pid = pid_of(machine, "gpukilld")
    status = dict(
        line.split(":\t", 1) for line in machine.run("cat", f"/proc/{pid}/status").stdout.splitlines() if ":\t" in line
    )
    assert (status["NoNewPrivs"], status["Seccomp"]) == ("1", "2"), status
    assert int(status["CapBnd"], 16) == CAP_BOUNDING, status["CapBnd"]
    assert int(status["CapAmb"], 16) == 0
    mounts = {}  # mount point -> its per-mount options, as the daemon sees them
    for line in machine.run("cat", f"/proc/{pid}/mountinfo").stdout.splitlines():
        fields = line.split()
        mounts[fields[4]] = fields[5].split(",")
    assert "ro" in mounts["/proc/sys"] and "ro" in mounts["/sys"], mounts  # ProtectKernelTunables=
    assert "/sys/devices" in mounts, mounts  # ReadWritePaths=: its own mount, so the PCI reset stays writable
    limits = machine.run("cat", f"/proc/{pid}/limits").stdout
    assert re.search(r"Max core file size\s+0\s+0", limits), limits  # LimitCORE=0
    shown = machine.run(
        "systemctl",
        "show",
        "gpukilld",
        "-p",
        "DevicePolicy",
        "-p",
        "TasksMax",
        "-p",
        "MemoryMax",
        "-p",
        "PrivateIPC",
        "-p",
        "OOMPolicy",
    ).stdout.split()
    assert sorted(shown) == sorted(
        ["DevicePolicy=closed", "TasksMax=256", f"MemoryMax={1 << 30}", "PrivateIPC=yes", "OOMPolicy=continue"]
    ), shown


def test_simulated_gpus_through_etc_and_reload(machine):
    (machine.root / "etc/gpukill/simulate.yaml").write_text((REPO / "examples/simulate.yaml").read_text())
    (machine.root / "etc/gpukill/gpukilld.conf").write_text(
        "[daemon]\nsample_interval = 0.5\nsimulate = /etc/gpukill/simulate.yaml\n"
    )
    pid = pid_of(machine, "gpukilld")
    machine.run("systemctl", "reload", "gpukilld")
    assert pid_of(machine, "gpukilld") == pid, "reload must not restart"
    assert wait_until(lambda: "4 GPUs" in machine.run("gpukillctl", "status").stdout)
    assert "Configuration reloaded" in machine.run("journalctl", "-u", "gpukilld", "--no-pager").stdout


def test_owner_kill_is_audited_with_catalog_text(machine):
    machine.run(
        "systemd-run",
        "--uid=alice",
        "--unit=victim",
        "--setenv=GPUKILL_SIM_GPU=0",
        "--setenv=GPUKILL_SIM_MEM=2GiB",
        "/bin/sleep",
        "600",
    )
    victim = pid_of(machine, "victim")
    listed = wait_until(lambda: str(victim) in machine.run("gpukillctl", "list", user="alice").stdout)
    assert listed, (
        victim,
        machine.run("gpukillctl", "list").stdout,
        machine.run("journalctl", "-u", "gpukilld", "--no-pager", "-n", "30").stdout,
    )
    r = machine.run("gpukillctl", "kill", str(victim), user="alice")
    assert f"PID {victim} (sleep) terminated" in r.stdout
    journal = machine.run("journalctl", "-u", "gpukilld", "-x", "--no-pager", f"GPUKILL_TARGET_PID={victim}").stdout
    assert f"PID {victim} (sleep, user alice) terminated" in journal
    assert "gpukilld sent SIGTERM" in journal, journal  # the catalog text, installed and indexed by the package


def test_guard_state_lives_in_the_state_directory(machine):
    """Under the unit's ProtectSystem=strict only StateDirectory= is writable: the guard state must land there."""
    assert "enabled" in machine.run("gpukillctl", "guard", "status", user="alice").stdout.lower()
    machine.run("gpukillctl", "guard", "dry-run", "on")
    assert wait_until(lambda: (machine.root / "var/lib/gpukill/guard-state.json").exists())
    machine.run("gpukillctl", "guard", "dry-run", "off")


def test_managed_policy_is_written_into_guard_d_under_the_unit(machine):
    """`gpukillctl guard policy add` as root: under ProtectSystem=strict the daemon must be able to write
    /etc/gpukill/guard.d (ConfigurationDirectory= keeps /etc/gpukill writable); the rule is in force at once."""
    r = machine.run("gpukillctl", "guard", "policy", "add", "user", "nobody", "--memory-limit", "1GiB")
    path = machine.root / "etc/gpukill/guard.d/60-managed-user-nobody.yaml"
    assert path.exists(), r
    st = path.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o644)
    assert "user-nobody-memory" in machine.run("gpukillctl", "guard", "status").stdout
    refused = machine.run("gpukillctl", "guard", "policy", "remove", "user", "nobody", user="alice", check=False)
    assert refused.returncode == 4 and path.exists(), refused  # polkit: no for a user without a session
    machine.run("gpukillctl", "guard", "policy", "remove", "user", "nobody")
    assert not path.exists()


def test_policy_test_in_the_sandbox_under_the_hardened_unit(machine):
    """An unprivileged caller's `guard test --policy`: the daemon evaluates it in a child that must drop to
    gpukill-sandbox (setgroups/setgid/setuid, nice, SCHED_IDLE) or refuse, so the unit's capabilities and system
    call filter must leave it all of that."""
    machine.run(
        "systemd-run",
        "--uid=alice",
        "--unit=sandbox-probe",
        "--setenv=GPUKILL_SIM_GPU=1",
        "--setenv=GPUKILL_SIM_MEM=1GiB",
        "/bin/sleep",
        "600",
    )
    pid = pid_of(machine, "sandbox-probe")
    try:
        assert wait_until(lambda: str(pid) in machine.run("gpukillctl", "list", user="alice").stdout)
        policy = machine.root / "srv/sandbox-probe.yaml"  # the container's /tmp is a tmpfs of its own
        policy.write_text(
            'rules:\n  - name: "sleepers"\n    conditions:\n      - type: "process_name"\n'
            '        operator: "=="\n        value: "sleep"\n    action: "log"\n'
        )
        policy.chmod(0o644)
        r = machine.run("gpukillctl", "guard", "test", "--policy", "/srv/sandbox-probe.yaml", "--json", user="alice")
        decisions = json.loads(r.stdout)["decisions"]
        assert any(d["rule"] == "sleepers" and pid in d["pids"] for d in decisions), decisions
    finally:
        machine.run("systemctl", "stop", "sandbox-probe", check=False)
    assert machine.run("systemctl", "is-active", "gpukilld", check=False).stdout.strip() == "active"


def test_sigkill_is_followed_by_a_restart(machine):
    pid = pid_of(machine, "gpukilld")
    machine.run("systemctl", "kill", "-s", "SIGKILL", "gpukilld")
    assert wait_until(lambda: pid_of(machine, "gpukilld") not in (0, pid), timeout=30)
    assert wait_until(lambda: machine.run("systemctl", "is-active", "gpukilld", check=False).stdout.strip() == "active")
    assert machine.run("gpukillctl", "status").returncode == 0


def test_the_desktop_agent_and_the_gpu_kill_command(machine):
    """The notification agent's user unit, enabled for every user by the postinst (dh_installsystemduser), the
    autostart entry for desktops without systemd user sessions, the gpukill command and the manual pages."""
    assert machine.run("systemctl", "--global", "is-enabled", "gpukill-notify.service").stdout.strip() == "enabled"
    r = machine.run("systemd-analyze", "verify", "/usr/lib/systemd/user/gpukill-notify.service", check=False)
    # anything said about our unit is a problem in it, but that the container has no man command to read the
    # pages Documentation= names (the pages themselves are checked below)
    said = [line for line in r.stderr.splitlines() if "gpukill-notify" in line and "Command 'man " not in line]
    assert not said, r.stderr
    desktop = (machine.root / "etc/xdg/autostart/gpukill-notify.desktop").read_text()
    assert "Exec=gpukillctl notify-agent" in desktop, desktop
    assert "usage:" in machine.run("gpukillctl", "notify-agent", "--help", user="alice").stdout
    listed = json.loads(machine.run("gpukill", "--list", "--output", "json", user="alice").stdout)
    assert listed["format"] == 1 and listed["devices"], listed
    for page in (
        "man1/gpukill.1.gz",
        "man5/gpukill-policy.5.gz",
        "man5/gpukilld.conf.5.gz",
        "man8/gpukill-notify.service.8.gz",
    ):
        assert (machine.root / "usr/share/man" / page).exists(), page


def test_bus_activation_starts_a_stopped_daemon(machine):
    machine.run("systemctl", "stop", "gpukilld")
    assert machine.run("systemctl", "is-active", "gpukilld", check=False).stdout.strip() == "inactive"
    r = machine.run("gpukillctl", "status", user="alice")
    assert "gpukilld 0.1.0" in r.stdout
    assert machine.run("systemctl", "is-active", "gpukilld", check=False).stdout.strip() == "active"


def apt_install(m: Machine, *what: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """apt-get install, with the package lists refreshed once if the cached ones are older than the archive."""
    install = ("apt-get", "install", "-y", "-q", "--no-install-recommends", *what)
    r = m.run(*install, check=False, timeout=timeout)
    if r.returncode != 0:
        m.run("apt-get", "update", "-qq", check=False, timeout=120)
        r = m.run(*install, check=False, timeout=timeout)
    return r


def test_the_optional_parts_say_which_package_then_install(machine):
    """Without gpukill-serve and gpukill-exporter, serve, mcp and exporter say in one line which package brings
    them (from the main package alone they cannot run); then both packages install beside it."""
    for argv, package in (
        (("serve",), "gpukill-serve"),
        (("mcp",), "gpukill-serve"),
        (("exporter",), "gpukill-exporter"),
    ):
        r = machine.run("gpukillctl", *argv, user="alice", check=False, env=("XDG_RUNTIME_DIR=/tmp",))
        assert r.returncode == 1 and f"the package {package}" in r.stderr and len(r.stderr.splitlines()) == 1, r
    assert SERVE_DEB and EXPORTER_DEB, "make deb builds gpukill-serve and gpukill-exporter too"
    t0 = time.monotonic()
    for deb in (SERVE_DEB[-1], EXPORTER_DEB[-1]):
        shutil.copy(deb, machine.root / "root" / deb.name)
    r = apt_install(machine, f"/root/{SERVE_DEB[-1].name}", f"/root/{EXPORTER_DEB[-1].name}")
    if r.returncode != 0 and "python3-prometheus-client" in r.stdout + r.stderr and "Unable to" in r.stderr:
        pytest.fail(f"python3-prometheus-client cannot be installed (no Debian archive?): {r.stderr[-300:]}")
    assert r.returncode == 0, r
    timings["apt install serve, exporter"] = time.monotonic() - t0
    # the bundled stack is gpukill-serve's alone: nothing of it in the main package's tree, which the daemon reads
    owner = machine.run("dpkg", "-S", "/usr/lib/gpukill/vendor-serve/mcp/__init__.py").stdout
    assert owner.startswith("gpukill-serve:"), owner
    assert not (machine.root / "usr/lib/gpukill/vendor/mcp").exists()
    # and it needs nothing of Debian's Python stack for it (bookworm's pydantic 1, starlette 0.26 ... are too old)
    depends = machine.run("dpkg-query", "-W", "-f", "${Depends}", "gpukill-serve").stdout
    bundled = ("pydantic", "starlette", "fastapi", "uvicorn", "anyio", "mcp", "jsonschema", "httpx", "jwt")
    assert not [d for d in depends.split(", ") if any(name in d for name in bundled)], depends
    # py3compile (the postinst) made the bytecode of the bundled tree: no compile at each start
    assert list((machine.root / "usr/lib/gpukill/vendor-serve/pydantic").glob("__pycache__/*.pyc"))


PROMETHEUS_CONFIG = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: gpukill
    static_configs:
      - targets: ["127.0.0.1:9835"]
"""

# A query of the container's Prometheus on loopback, run there (its python3; the container has no curl).
PROMQL = """\
import json, sys, urllib.parse, urllib.request
url = "http://127.0.0.1:9090/api/v1/query?query=" + urllib.parse.quote(sys.argv[1])
print(json.dumps(json.load(urllib.request.urlopen(url, timeout=10))["data"]["result"]))
"""


def promql(m: Machine, query: str) -> list[dict]:
    r = m.run("python3", "-c", PROMQL, query, check=False)
    return json.loads(r.stdout) if r.returncode == 0 else []


def test_the_exporter_unit_is_scraped_by_prometheus(machine):
    """gpukill-exporter's unit, enabled and started by its postinst, as its own account; a real Prometheus
    (Debian's, in the container) scrapes it and has every simulated GPU, and a GPU process by its user."""
    assert machine.run("systemctl", "is-enabled", "gpukill-exporter").stdout.strip() == "enabled"
    assert wait_until(
        lambda: machine.run("systemctl", "is-active", "gpukill-exporter", check=False).stdout.strip() == "active"
    )
    pid = pid_of(machine, "gpukill-exporter")
    uid = machine.run("stat", "-c", "%u", f"/proc/{pid}").stdout.strip()
    # its own system account, made by the postinst from sysusers.d (a DynamicUser= uid dbus-daemon refuses)
    _, _, account, _, gecos, home, shell = machine.run("getent", "passwd", "gpukill-exporter").stdout.strip().split(":")
    assert account == uid and 0 < int(uid) < 1000 and (home, shell) == ("/", "/usr/sbin/nologin"), (uid, gecos)
    t0 = time.monotonic()
    r = apt_install(machine, "prometheus")
    if r.returncode != 0:
        pytest.fail(f"cannot install Debian's prometheus in the container: {r.stderr.strip()[-300:]}")
    (machine.root / "etc/prometheus/prometheus.yml").write_text(PROMETHEUS_CONFIG)
    machine.run("systemctl", "restart", "prometheus")
    timings["Prometheus install and start"] = time.monotonic() - t0
    machine.run(
        "systemd-run",
        "--uid=alice",
        "--unit=exported",
        "--setenv=GPUKILL_SIM_GPU=2",
        "--setenv=GPUKILL_SIM_MEM=3GiB",
        "/bin/sleep",
        "600",
    )
    try:
        up = 'up{job="gpukill"} == 1'
        assert wait_until(lambda: promql(machine, up), timeout=90), (
            promql(machine, 'up{job="gpukill"}'),
            machine.run("journalctl", "-u", "prometheus", "-u", "gpukill-exporter", "--no-pager", "-n", "30").stdout,
        )
        # gpukill_up: the exporter reached gpukilld on the system bus
        assert wait_until(lambda: promql(machine, 'gpukill_up{job="gpukill"} == 1'), timeout=30), (
            promql(machine, "gpukill_up"),
            machine.run("journalctl", "-u", "gpukill-exporter", "-u", "dbus", "--no-pager", "-n", "30").stdout,
        )
        devices = promql(machine, 'count(gpukill_device_up{job="gpukill"} == 1)')
        assert devices and devices[0]["value"][1] == "4", devices  # examples/simulate.yaml's four GPUs
        by_user = 'gpukill_user_gpu_memory_bytes{job="gpukill", user="alice"}'
        assert wait_until(lambda: any(float(s["value"][1]) >= 3 << 30 for s in promql(machine, by_user)), timeout=60), (
            promql(machine, '{job="gpukill", user="alice"}')
        )
    finally:
        machine.run("systemctl", "stop", "exported", check=False)


# Run as the serve unit's user in the container: REST and the dashboard over the socket of `gpukillctl serve`
# (stdlib only: http.client on an AF_UNIX socket), with and without the token the server made.
SERVE_CLIENT = """\
import http.client, json, os, socket, sys
run = os.environ["XDG_RUNTIME_DIR"] + "/gpukill"
token = open(run + "/serve.token").read().strip()

class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(60)
        self.sock.connect(run + "/serve.sock")

def call(method, path, body=None, auth=True):
    c = Unix("localhost")
    headers = {"Authorization": "Bearer " + token} if auth else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    c.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    r = c.getresponse()
    return {"status": r.status, "type": r.getheader("content-type", ""), "body": r.read().decode()}

out = {"anonymous": call("GET", "/v1/devices", auth=False), "devices": call("GET", "/v1/devices"),
       "page": call("GET", "/"), "script": call("GET", "/static/app.js")}
if len(sys.argv) > 1:
    out["kill"] = call("POST", "/v1/kill", {"pid": int(sys.argv[1])})
print(json.dumps(out))
"""

# The MCP SDK's own client (the one gpukill-serve bundles) driving `gpukillctl mcp` over stdio, as that user.
MCP_CLIENT = """\
import sys
sys.path[:0] = ["/usr/lib/gpukill/vendor-serve"]
import asyncio, json
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

async def main():
    params = StdioServerParameters(command="gpukillctl", args=["mcp"], cwd="/")
    async with Client(stdio_client(params), read_timeout_seconds=60) as client:
        tools = sorted(t.name for t in (await client.list_tools()).tools)
        devices = await client.call_tool("list_devices", {})
        processes = await client.call_tool("list_processes", {})
        return {"tools": tools, "devices": devices.structured_content, "processes": processes.structured_content,
                "error": devices.is_error or processes.is_error}

print(json.dumps(asyncio.run(asyncio.wait_for(main(), 120))))
"""


@pytest.fixture(scope="module")
def serving(machine):
    """gpukill-serve.service enabled by alice in her user manager, which lingering keeps running without a login;
    the environment her commands need to reach it."""
    uid = int(machine.run("id", "-u", "alice").stdout)
    runtime = f"/run/user/{uid}"
    machine.run("loginctl", "enable-linger", "alice")
    assert wait_until(
        lambda: machine.run("systemctl", "is-active", f"user@{uid}.service", check=False).stdout.strip() == "active",
        timeout=60,
    )
    env = (f"XDG_RUNTIME_DIR={runtime}", f"DBUS_SESSION_BUS_ADDRESS=unix:path={runtime}/bus", "HOME=/home/alice")
    machine.run("systemctl", "--user", "enable", "--now", "gpukill-serve.service", user="alice", env=env)
    sock = f"{runtime}/gpukill/serve.sock"  # /run/user/UID is a tmpfs of the container's: looked at from inside
    assert wait_until(lambda: machine.run("test", "-S", sock, check=False).returncode == 0, timeout=60), machine.run(
        "journalctl", f"_UID={uid}", "--no-pager", "-n", "30"
    ).stdout
    return uid, env


def test_the_serve_user_unit_answers_rest_and_the_dashboard_and_kills(machine, serving):
    """The REST API and the dashboard through the user unit's socket with its token (refused without), and a
    kill through REST that the daemon's audit records as requested by that user."""
    uid, env = serving
    machine.run(
        "systemd-run",
        "--uid=alice",
        "--unit=served-victim",
        "--setenv=GPUKILL_SIM_GPU=3",
        "--setenv=GPUKILL_SIM_MEM=1GiB",
        "/bin/sleep",
        "600",
    )
    victim = pid_of(machine, "served-victim")
    assert wait_until(lambda: str(victim) in machine.run("gpukillctl", "list", user="alice").stdout)
    out = json.loads(machine.run("python3", "-c", SERVE_CLIENT, str(victim), user="alice", env=env).stdout)
    assert out["anonymous"]["status"] == 401, out["anonymous"]
    assert out["devices"]["status"] == 200 and len(json.loads(out["devices"]["body"])["devices"]) == 4, out["devices"]
    assert out["page"]["status"] == 200 and out["page"]["type"].startswith("text/html"), out["page"]
    assert "<title>gpukill</title>" in out["page"]["body"]
    assert out["script"]["status"] == 200 and "javascript" in out["script"]["type"], out["script"]
    assert out["kill"]["status"] == 200 and json.loads(out["kill"]["body"])["outcome"] == "terminated", out["kill"]
    audit = machine.run(
        "journalctl", "-u", "gpukilld", "-o", "verbose", "--no-pager", f"GPUKILL_TARGET_PID={victim}"
    ).stdout
    assert f"PID {victim} (sleep, user alice) terminated; GPU memory reclaimed" in audit, audit
    assert f"; requested by uid {uid}" in audit, audit
    # the server ran as alice, under her user manager (not root's, not a system unit)
    main = int(
        machine.run("systemctl", "--user", "show", "-P", "MainPID", "gpukill-serve", user="alice", env=env).stdout
    )
    assert machine.run("stat", "-c", "%u", f"/proc/{main}").stdout.strip() == str(uid)
    said = machine.run("journalctl", f"_UID={uid}", "_SYSTEMD_USER_UNIT=gpukill-serve.service", "--no-pager").stdout
    assert "gpukillctl serve: serving as alice" in said, said


def test_mcp_over_stdio_driven_by_the_sdk_client(machine):
    out = json.loads(machine.run("python3", "-c", MCP_CLIENT, user="alice", timeout=180).stdout)
    assert not out["error"], out
    assert {"list_devices", "kill_process", "list_processes"} <= set(out["tools"]), out["tools"]
    assert len(out["devices"]["devices"]) == 4, out["devices"]


SLURM_PACKAGES = ("slurm-wlm", "munge", "procps")


@pytest.fixture(scope="module")
def slurm(machine):
    """Real Slurm from Debian (slurmctld + slurmd, one node) in the booted container, with the shipped epilog.
    proctrack/linuxproc and task/none: these hosts run cgroup v1, where Slurm's cgroup plugins cannot start inside
    nspawn, so a job's processes carry their job only as SLURM_JOB_ID in their environment."""
    t0 = time.monotonic()
    install = ("apt-get", "install", "-y", "-q", "--no-install-recommends", *SLURM_PACKAGES)
    r = machine.run(*install, check=False, timeout=300)
    if r.returncode != 0:  # the cached package lists may be older than the archive
        machine.run("apt-get", "update", "-qq", check=False, timeout=120)
        r = machine.run(*install, check=False, timeout=300)
    if r.returncode != 0:
        pytest.skip(f"cannot install Slurm in the container (no Debian archive?): {r.stderr.strip()[-300:]}")
    host = machine.run("cat", "/proc/sys/kernel/hostname").stdout.strip()
    with open(machine.root / "etc/hosts", "a") as hosts:
        hosts.write(f"127.0.1.1 {host}\n")
    (machine.root / "etc/slurm/slurm.conf").write_text(
        f"ClusterName=gpukilltest\nSlurmctldHost={host}\nAuthType=auth/munge\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/cons_tres\n"
        "StateSaveLocation=/var/lib/slurm/slurmctld\nSlurmdSpoolDir=/var/lib/slurm/slurmd\nReturnToService=2\n"
        "Epilog=/usr/share/gpukill/slurm/epilog\nPrologEpilogTimeout=120\n"
        f"NodeName={host} CPUs=2 RealMemory=1000\nPartitionName=debug Nodes=ALL Default=YES State=UP\n"
    )
    (machine.root / "etc/slurm/cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
    machine.run("systemctl", "restart", "munge", "slurmctld", "slurmd")
    idle = wait_until(lambda: machine.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle")
    assert idle, (
        machine.run("sinfo", check=False).stdout,
        machine.run("journalctl", "-u", "slurmctld", "-u", "slurmd", "--no-pager", "-n", "30").stdout,
    )
    timings["Slurm install and start"] = time.monotonic() - t0
    return host


def sbatch(m: Machine, script: str, *options: str) -> str:
    """Submit `script` as alice, with sbatch's `options`; the job id."""
    argv = ("sbatch", "--parsable", "--chdir=/tmp", "-o", "/tmp/slurm-%j.out", *options, "--wrap", script)
    return m.run(*argv, user="alice").stdout.strip().split(";")[0]


def job_gpu_pids(m: Machine, job: str) -> set[int]:
    procs = json.loads(m.run("gpukillctl", "list", "--json").stdout)["processes"]
    return {p["pid"] for p in procs if p["slurm_job"] == job}


def job_state(m: Machine, job: str) -> str:
    return m.run("scontrol", "show", "job", job, check=False).stdout


def test_slurm_job_listed_and_killed_by_job(machine, slurm):
    """A job's GPU process is listed with its job id (SLURM_JOB_ID: proctrack/linuxproc makes no job cgroup),
    and `gpukillctl kill --job` run by the job's owner stops it."""
    t0 = time.monotonic()
    job = sbatch(machine, "env GPUKILL_SIM_GPU=0 GPUKILL_SIM_MEM=1GiB sleep 300")
    assert wait_until(lambda: job_gpu_pids(machine, job)), (
        job_state(machine, job),
        machine.run("gpukillctl", "list", "--json").stdout,
    )
    (pid,) = job_gpu_pids(machine, job)
    assert machine.run("cat", f"/proc/{pid}/comm").stdout.strip() == "sleep"
    r = machine.run("gpukillctl", "kill", "--job", job, user="alice")
    assert f"PID {pid} (sleep) terminated" in r.stdout, r.stdout
    assert wait_until(
        lambda: "JobState=COMPLETED" in job_state(machine, job) or "JobState=FAILED" in job_state(machine, job)
    ), job_state(machine, job)
    assert wait_until(lambda: not job_gpu_pids(machine, job))  # gone from the next sample
    timings["Slurm kill --job"] = time.monotonic() - t0


def test_slurm_epilog_cleans_up_a_leftover(machine, slurm):
    """A GPU process that escaped its job (setsid, the batch script exits) is stopped by the shipped epilog when the
    job ends, through gpukilld (audited as a user kill by uid 0), and the epilog says so in syslog."""
    t0 = time.monotonic()
    job = sbatch(
        machine,
        "setsid env GPUKILL_SIM_GPU=1 GPUKILL_SIM_MEM=1GiB sleep 300 </dev/null >/dev/null 2>&1 & "
        "while [ ! -e /tmp/go-$SLURM_JOB_ID ]; do sleep 0.2; done",
    )
    assert wait_until(lambda: job_gpu_pids(machine, job)), (
        job_state(machine, job),
        machine.run("gpukillctl", "list", "--json").stdout,
    )
    (pid,) = job_gpu_pids(machine, job)
    machine.run("touch", f"/tmp/go-{job}")  # the batch script ends: the job ends with the process left behind
    assert wait_until(lambda: not job_gpu_pids(machine, job)), (
        job_state(machine, job),
        machine.run("gpukillctl", "list").stdout,
    )
    # the epilog's kill makes the process vanish before the epilog itself returns: COMPLETING until then
    assert wait_until(lambda: "JobState=COMPLETED" in job_state(machine, job)), job_state(machine, job)
    audit = machine.run(
        "journalctl", "-u", "gpukilld", "-o", "verbose", "--no-pager", f"GPUKILL_TARGET_PID={pid}"
    ).stdout
    assert f"PID {pid} (sleep, user alice) terminated; GPU memory reclaimed" in audit, audit
    assert "; requested by uid 0" in audit and "GPUKILL_RECLAIM=reclaimed" in audit, audit
    assert "GPUKILL_INITIATOR=user" in audit, audit
    assert wait_until(
        lambda: (
            f"job {job}: PID {pid} (sleep) terminated"
            in machine.run("journalctl", "-t", "gpukill-slurm", "--no-pager").stdout
        ),
        timeout=10,
    ), machine.run("journalctl", "-t", "gpukill-slurm", "--no-pager").stdout
    timings["Slurm epilog"] = time.monotonic() - t0


SLURM_POLICY = """rules:
  - name: slurm-{action}
    action: {action}
    grace_period: 2s
    conditions:
      - {{type: gpu_memory, operator: '>', value: 1GiB}}
      - {{type: cmdline, operator: matches, value: '^(/bin/)?sleep {seconds}$'}}
"""


def guard_slurm_entry(m: Machine, result: str, field: str = "", **fields: str) -> str:
    """The messages (or one field) of gpukilld's journal entries with GPUKILL_RESULT=result and the fields given."""
    match = [f"GPUKILL_{k.upper()}={v}" for k, v in fields.items()]
    shown = ["--output-fields", f"GPUKILL_{field}"] if field else []
    argv = ("journalctl", "-u", "gpukilld", "--no-pager", "-o", "cat", *shown, f"GPUKILL_RESULT={result}", *match)
    return m.run(*argv).stdout


def load_slurm_policy(m: Machine, action: str, seconds: int) -> None:
    (m.root / "root/slurm-policy.yaml").write_text(SLURM_POLICY.format(action=action, seconds=seconds))
    for args in (["enable"], ["dry-run", "off"], ["load", "/root/slurm-policy.yaml"]):
        m.run("gpukillctl", "guard", *args)


def test_slurm_guard_requeues_a_requeueable_job_and_leaves_others_running(machine, slurm):
    """Guard's `action: requeue` asks Slurm: a job submitted with --requeue whose GPU process violates the rule is
    requeued (PENDING again, its process gone: Slurm ended it), journaled with Slurm's job id; one submitted with
    --no-requeue is refused with the reason and runs on; a process of no Slurm job is left running."""
    t0 = time.monotonic()
    load_slurm_policy(machine, "requeue", 311)
    jobs = []
    try:
        requeueable = sbatch(machine, "env GPUKILL_SIM_GPU=0 GPUKILL_SIM_MEM=2GiB sleep 311", "--requeue")
        pinned = sbatch(machine, "env GPUKILL_SIM_GPU=1 GPUKILL_SIM_MEM=2GiB sleep 311", "--no-requeue")
        jobs += [requeueable, pinned]
        machine.run(
            "systemd-run",
            "--uid=alice",
            "--unit=no-job-holder",
            "--setenv=GPUKILL_SIM_GPU=2",
            "--setenv=GPUKILL_SIM_MEM=2GiB",
            "/bin/sleep",
            "311",
        )
        assert wait_until(lambda: guard_slurm_entry(machine, "requeued", slurm_job=requeueable), 40), (
            job_state(machine, requeueable),
            machine.run("journalctl", "-u", "gpukilld", "--no-pager", "-n", "40").stdout,
            machine.run("gpukillctl", "guard", "status").stdout,
        )
        pid = int(guard_slurm_entry(machine, "requeued", "TARGET_PID", slurm_job=requeueable))
        said = guard_slurm_entry(machine, "requeued", slurm_job=requeueable)
        assert f"Guard rule slurm-requeue: requeued job {requeueable} for PID {pid} (sleep, user alice)" in said, said
        assert wait_until(lambda: "JobState=PENDING" in job_state(machine, requeueable), 60), job_state(
            machine, requeueable
        )
        assert wait_until(lambda: machine.run("test", "-e", f"/proc/{pid}", check=False).returncode != 0, 60)
        assert "Restarts=1" in job_state(machine, requeueable)  # Slurm's own count of its requeues
        assert wait_until(lambda: guard_slurm_entry(machine, "not-requeueable", slurm_job=pinned), 40)
        (pinned_pid,) = job_gpu_pids(machine, pinned)
        refused = guard_slurm_entry(machine, "not-requeueable", slurm_job=pinned)
        assert (
            f"job {pinned} is not requeueable (sbatch --no-requeue or JobRequeue=0): not requeued for PID {pinned_pid}"
            in refused
        ), refused
        stray = guard_slurm_entry(machine, "not-a-slurm-job", rule="slurm-requeue")
        holder = pid_of(machine, "no-job-holder")
        assert f"PID {holder} (sleep, user alice) left running: not a Slurm job's process" in stray, stray
        assert "JobState=RUNNING" in job_state(machine, pinned), job_state(machine, pinned)
        assert pinned_pid in job_gpu_pids(machine, pinned)
        assert machine.run("systemctl", "is-active", "no-job-holder", check=False).stdout.strip() == "active"
    finally:
        machine.run("gpukillctl", "guard", "disable", check=False)
        machine.run("systemctl", "stop", "no-job-holder", check=False)
        for job in jobs:
            machine.run("scancel", job, check=False)
    timings["Slurm requeue through Guard"] = time.monotonic() - t0


def test_slurm_guard_cancels_a_job_through_scancel(machine, slurm):
    """`action: cancel`: the job is cancelled by Slurm (CANCELLED, its epilog run), journaled as job-cancelled."""
    t0 = time.monotonic()
    load_slurm_policy(machine, "cancel", 312)
    job = ""
    try:
        job = sbatch(machine, "env GPUKILL_SIM_GPU=0 GPUKILL_SIM_MEM=2GiB sleep 312")
        assert wait_until(lambda: guard_slurm_entry(machine, "job-cancelled", slurm_job=job), 40), (
            job_state(machine, job),
            machine.run("journalctl", "-u", "gpukilld", "--no-pager", "-n", "40").stdout,
        )
        assert "Guard rule slurm-cancel: cancelled job" in guard_slurm_entry(machine, "job-cancelled", slurm_job=job)
        assert wait_until(lambda: "JobState=CANCELLED" in job_state(machine, job), 60), job_state(machine, job)
        assert wait_until(lambda: not job_gpu_pids(machine, job))
    finally:
        machine.run("gpukillctl", "guard", "disable", check=False)
        if job:
            machine.run("scancel", job, check=False)
    timings["Slurm cancel through Guard"] = time.monotonic() - t0


def test_slurm_signal_is_read_back_from_the_batch_script_only(machine, slurm):
    """Where root can read a job's `--signal=[B:]SIG@SECONDS` in Slurm 22.05: not in `scontrol show job` (which has
    no --json there), not in squeue's fields, not in the job's SLURM_* environment; a `#SBATCH --signal` line of its
    batch script is (`scontrol write batch_script`), and slurm_checkpoint reads it from there."""
    wrapped = sbatch(machine, "env GPUKILL_SIM_GPU=3 GPUKILL_SIM_MEM=1GiB sleep 313", "--signal=B:USR1@120")
    (machine.root / "srv/ckpt.sh").write_text("#!/bin/sh\n#SBATCH --signal=B:USR2@90\nsleep 314\n")
    scripted = machine.run(
        "sbatch", "--parsable", "--chdir=/tmp", "-o", "/tmp/slurm-%j.out", "/srv/ckpt.sh", user="alice"
    ).stdout.strip()
    try:
        assert wait_until(lambda: job_gpu_pids(machine, wrapped)), job_state(machine, wrapped)
        (pid,) = job_gpu_pids(machine, wrapped)
        shown = machine.run("scontrol", "show", "job", "-dd", wrapped).stdout
        assert "USR1" not in shown and "Signal" not in shown and "Warn" not in shown, shown
        assert machine.run("scontrol", "show", "job", "--json", wrapped, check=False).returncode != 0
        assert "USR1" not in machine.run("squeue", "-j", wrapped, "-o", "%all").stdout
        environ = machine.run("cat", f"/proc/{pid}/environ").stdout.split("\0")
        slurm_vars = [v for v in environ if v.startswith(("SLURM", "SBATCH"))]
        assert "SLURM_JOB_ID=" + wrapped in slurm_vars and not [v for v in slurm_vars if "USR1" in v], slurm_vars
        read = (
            "import asyncio, sys; sys.path.insert(0, '/usr/lib/gpukill'); from gpukilld.acts.slurm import Slurm; "
            "print([asyncio.run(Slurm().slurm_checkpoint(j)) for j in sys.argv[1:]])"
        )
        said = machine.run("python3", "-c", read, wrapped, scripted).stdout.strip()
        assert said == f"[None, ({int(signal.SIGUSR2)}, 90.0)]", said
    finally:
        machine.run("scancel", wrapped, scripted, check=False)


SAVER = """import os, signal, sys, time
def save(number, frame):
    open("/tmp/saved-" + os.environ["SLURM_JOB_ID"], "w").write("saved on " + signal.Signals(number).name)
    sys.exit(0)
signal.signal(signal.SIGUSR1, save)
while True:
    time.sleep(0.1)
"""


def test_a_batch_scripts_signal_is_the_jobs_checkpoint_signal(machine, slurm):
    """A job that declares `#SBATCH --signal=B:USR1@30` in its batch script and nothing in its environment: its
    owner's `gpukillctl kill --checkpoint` sends SIGUSR1 first (read from the job through Slurm), the job saves
    and exits, and no SIGTERM is needed."""
    (machine.root / "srv/saver.py").write_text(SAVER)
    (machine.root / "srv/saving-job.sh").write_text(
        "#!/bin/sh\n#SBATCH --signal=B:USR1@30\nexec env GPUKILL_SIM_GPU=2 GPUKILL_SIM_MEM=1GiB python3 /srv/saver.py\n"
    )
    job = machine.run(
        "sbatch", "--parsable", "--chdir=/tmp", "-o", "/tmp/slurm-%j.out", "/srv/saving-job.sh", user="alice"
    ).stdout.strip()
    try:
        assert wait_until(lambda: job_gpu_pids(machine, job)), job_state(machine, job)
        (pid,) = job_gpu_pids(machine, job)
        r = machine.run("gpukillctl", "kill", "--checkpoint", str(pid), user="alice")
        assert f"SIGUSR1 sent to PID {pid}" in r.stdout and "exited after saving" in r.stdout, r.stdout
        assert machine.run("cat", f"/tmp/saved-{job}").stdout == "saved on SIGUSR1"
        entry = machine.run(
            "journalctl", "-u", "gpukilld", "-o", "verbose", "--no-pager", f"GPUKILL_TARGET_PID={pid}"
        ).stdout
        assert "GPUKILL_SOURCE=slurm" in entry, entry
    finally:
        machine.run("scancel", job, check=False)


OWNER_POLICY = """rules:
  - name: idle-owner
    action: kill
    grace_period: 3s
    warn: [at_start, 1s]
    notify: [owner]
    conditions:
      - {type: gpu_memory, operator: '>', value: 1GiB}
      - {type: gpu_utilization, operator: '<', value: 5, duration: 1s, over: mean}
"""


def test_the_owner_is_warned_on_the_terminal_of_their_logind_session(machine):
    """The owner's terminal warning through the real logind: su's PAM stack (pam_systemd) opens a session for alice on
    script's
    pty, which no utmp record names (neither su nor script writes one); Guard's warning reaches that terminal
    through the unit's device policy (DeviceAllow=char-pts w), and the kill still comes at the end of the grace.
    Before it is given to her the pty is root's, and the warning is refused there (owned by another uid)."""
    # the terminal given to alice as sshd and login give it (hers, group tty, mesg y), then her session on it
    machine.run(
        "systemd-run",
        "--unit=alice-login",
        "script",
        "-qfc",
        "t=$(tty); chown alice:tty $t; chmod 620 $t; exec su - alice -c 'sleep 600'",
        "/run/alice-terminal",
    )
    sessions = []

    def alice_tty() -> str:
        sessions[:] = machine.run("loginctl", "--no-legend", "list-sessions", check=False).stdout.split("\n")
        for line in sessions:
            fields = line.split()
            if len(fields) >= 3 and fields[2] == "alice":
                tty = machine.run("loginctl", "show-session", fields[0], "-P", "TTY", check=False).stdout.strip()
                if tty.startswith("pts/"):
                    return tty
        return ""

    assert wait_until(alice_tty), ("no logind session with a terminal for alice", sessions)
    tty = alice_tty()
    assert tty not in machine.run("who", check=False).stdout  # utmp does not name it: only logind does
    policy = machine.root / "root/owner-policy.yaml"
    policy.write_text(OWNER_POLICY)
    for args in (["enable"], ["dry-run", "off"], ["load", "/root/owner-policy.yaml"]):
        machine.run("gpukillctl", "guard", *args)
    try:
        machine.run(
            "systemd-run",
            "--uid=alice",
            "--unit=idle-holder",
            "--setenv=GPUKILL_SIM_GPU=0",
            "--setenv=GPUKILL_SIM_MEM=2GiB",
            "--setenv=GPUKILL_SIM_UTIL=0",
            "/bin/sleep",
            "600",
        )
        holder = pid_of(machine, "idle-holder")
        assert wait_until(
            lambda: machine.run("systemctl", "is-active", "idle-holder", check=False).stdout.strip() != "active", 30
        ), machine.run("gpukillctl", "guard", "status").stdout
        written = machine.run(
            "journalctl",
            "--no-pager",
            "-o",
            "cat",
            "GPUKILL_RESULT=owner-warned",
            "GPUKILL_CHANNEL=tty",
            f"GPUKILL_TARGET=/dev/{tty}",
            "GPUKILL_OUTCOME=written",
        ).stdout
        assert written.count("by tty") >= 2, machine.run(  # at_start (the violation's notice) and the 1 s warning
            "journalctl", "--no-pager", "-o", "cat", "GPUKILL_RESULT=owner-warned"
        ).stdout
        seen = machine.run("cat", "/run/alice-terminal").stdout  # what script read off alice's terminal
        assert "Message from gpukilld@" in seen and f"PID {holder} (sleep" in seen, seen[-2000:]
        # the kill's entry comes with the GPU's answer: a few samples after the process exited
        assert wait_until(
            lambda: machine.run(
                "journalctl", "--no-pager", "-o", "cat", f"GPUKILL_TARGET_PID={holder}", "GPUKILL_RESULT=terminated"
            ).stdout.strip(),
            20,
        ), "the idle holder's kill is not in the journal"
    finally:
        machine.run("gpukillctl", "guard", "disable", check=False)  # the policy stays loaded, and does nothing
        machine.run("systemctl", "stop", "alice-login", "idle-holder", check=False)


def test_purge_leaves_nothing_of_ours(machine):
    machine.run("apt-get", "purge", "-y", "-q", "gpukill", "gpukill-serve", "gpukill-exporter", timeout=300)
    ours = [
        "usr/lib/gpukill",
        "usr/sbin/gpukilld",
        "usr/bin/gpukillctl",
        "lib/systemd/system/gpukilld.service",
        "etc/systemd/system/dbus-org.gpukill1.service",
        "etc/systemd/system/multi-user.target.wants/gpukilld.service",
        "usr/share/dbus-1/system.d/org.gpukill1.conf",
        "usr/share/dbus-1/system-services/org.gpukill1.service",
        "usr/share/dbus-1/interfaces/org.gpukill1.xml",
        "usr/share/polkit-1/actions/org.gpukill.policy",
        "usr/lib/systemd/catalog/gpukill.catalog",
        "usr/lib/sysusers.d/gpukill.conf",
        "etc/gpukill/gpukilld.conf",
        "etc/gpukill/guard.d",
        "var/lib/gpukill",
        "usr/share/man/man8/gpukilld.8.gz",
        "usr/share/bash-completion/completions/gpukillctl",
        "usr/share/doc/gpukill",
        "usr/bin/gpukill",
        "usr/lib/systemd/user/gpukill-notify.service",
        "etc/xdg/autostart/gpukill-notify.desktop",
        "etc/systemd/user/graphical-session.target.wants/gpukill-notify.service",
        "usr/share/man/man5/gpukill-policy.5.gz",
        # gpukill-serve and gpukill-exporter (the bytecode py3compile made is py3clean's to remove)
        "usr/lib/gpukill/vendor-serve",
        "usr/lib/systemd/user/gpukill-serve.service",
        "lib/systemd/system/gpukill-exporter.service",
        "usr/lib/sysusers.d/gpukill-exporter.conf",
        "etc/systemd/system/multi-user.target.wants/gpukill-exporter.service",
        "usr/share/doc/gpukill-serve",
        "usr/share/doc/gpukill-exporter",
    ]
    left = [p for p in ours if (machine.root / p).exists() or (machine.root / p).is_symlink()]
    assert left == [], left
    # what is left under /etc/gpukill is what the admin wrote there (simulate.yaml above): policy keeps it
    assert sorted(p.name for p in (machine.root / "etc/gpukill").iterdir()) == ["simulate.yaml"]
    for package in ("gpukill", "gpukill-serve", "gpukill-exporter"):
        listed = machine.run("dpkg", "-l", package, check=False)
        assert listed.returncode != 0 or f"pn  {package} " in listed.stdout, listed.stdout
