"""A private system with real components: dbus-daemon with our bus policy, polkitd with our actions and
rules, systemd-journald, gpukilld, unprivileged users and victim processes. Used by the tests and `make demo`.

Every process is started in its own process group and is killed on stop(), so nothing is left behind.
Isolation (see ../shared/RECIPES.md): polkitd and journald each run in a private mount namespace, so the
machine's own polkit rules and journal are neither used nor touched.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpukilld.proc.procfs import ProcFS

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
SYSTEM_PYTHON = "/usr/bin/python3"  # world-executable, for victims run as other users
POLKITD = "/usr/lib/polkit-1/polkitd"
JOURNALD = "/lib/systemd/systemd-journald"
POLKIT_BUS_CONF = "/usr/share/dbus-1/system.d/org.freedesktop.PolicyKit1.conf"
ADMIN_RULES = REPO / "polkit" / "49-gpukill-admins.rules"  # the example rules: group gpukill administers

OWNER, OTHER, ADMIN = "gpkowner", "gpkother", "gpkadmin"
ADMIN_GROUP = "gpukill"

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <!-- the default-deny policy of /usr/share/dbus-1/system.conf -->
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
    <deny send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"
          send_member="UpdateActivationEnvironment"/>
  </policy>
  <policy user="root">
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Monitoring"/>
  </policy>
  <include ignore_missing="yes">{polkit_conf}</include>
  <include>{our_conf}</include>
</busconfig>
"""


def is_root() -> bool:
    """Root, unless GPUKILL_PURE is set: `make check` runs the pure tests alone, as root or not."""
    return os.geteuid() == 0 and not os.environ.get("GPUKILL_PURE")


def missing_tools() -> list[str]:
    tools = [
        shutil.which("dbus-daemon"),
        shutil.which("unshare"),
        shutil.which("nsenter"),
        shutil.which("journalctl"),
        POLKITD if os.path.exists(POLKITD) else None,
        JOURNALD if os.path.exists(JOURNALD) else None,
    ]
    names = ["dbus-daemon", "unshare", "nsenter", "journalctl", POLKITD, JOURNALD]
    return [n for n, t in zip(names, tools, strict=True) if t is None]


REGULAR_UID_MIN = 1000  # Debian's UID_MIN: below it are system accounts, which Guard protects by default


def ensure_users() -> None:
    """Real accounts for the authorization matrix: an owner, another user, and an admin in group gpukill.
    They are regular users (uid >= 1000), as the people on a shared GPU machine are; accounts left by an
    older version of this function as system users are made again."""
    try:
        grp.getgrnam(ADMIN_GROUP)
    except KeyError:
        subprocess.run(["groupadd", "--system", ADMIN_GROUP], check=True)
    for name, extra in ((OWNER, []), (OTHER, []), (ADMIN, ["-G", ADMIN_GROUP])):
        try:
            if pwd.getpwnam(name).pw_uid >= REGULAR_UID_MIN:
                continue
            subprocess.run(["userdel", name], check=True)
        except KeyError:
            pass
        subprocess.run(["useradd", "-M", "-U", "-s", "/usr/sbin/nologin", *extra, name], check=True)


def make_traversable(path: Path) -> None:
    """Unprivileged clients run our code from the checkout: every directory above it must be searchable."""
    for p in [path, *path.parents]:
        mode = p.stat().st_mode
        if not mode & 0o001:
            os.chmod(p, mode | 0o001)


@dataclass
class User:
    name: str
    uid: int
    gid: int
    groups: list[int]

    def popen_kwargs(self) -> dict:
        """subprocess arguments that run a child as this user (nothing for root: stay as we are)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": self.groups} if self.uid else {}

    @classmethod
    def get(cls, name: str) -> User:
        pw = pwd.getpwnam(name)
        groups = [g.gr_gid for g in grp.getgrall() if name in g.gr_mem]
        return cls(name, pw.pw_uid, pw.pw_gid, groups)


ROOT = User("root", 0, 0, [])


def _kill_group(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)


class NotifyListener:
    """The NOTIFY_SOCKET end that systemd would hold: records every sd_notify datagram with its time."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            with self._cond:
                for line in data.decode().splitlines():
                    self.messages.append((time.monotonic(), line))
                self._cond.notify_all()

    def wait_for(self, line: str, timeout: float = 15.0, after: float = 0.0) -> float | None:
        """Monotonic time of the first message equal to line received after `after`, or None on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, m in self.messages:
                    if m == line and t >= after:
                        return t
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def times(self, line: str) -> list[float]:
        with self._cond:
            return [t for t, m in self.messages if m == line]

    def close(self) -> None:
        self.sock.close()


@dataclass
class DaemonProcess:
    proc: subprocess.Popen
    notify: NotifyListener
    log_path: Path
    sim_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class CallResult:
    ok: bool
    body: list = field(default_factory=list)
    error: str = ""
    message: str = ""


class SignalRecorder:
    """Signals of org.gpukill1.Manager as a real client (any user) receives them."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.signals: list[dict] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.signals.append(json.loads(line))
                self._cond.notify_all()

    def wait_for(self, member: str, timeout: float = 10.0, where=lambda body: True) -> dict | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for s in self.signals:
                    if s["member"] == member and where(s.get("body")):
                        return s
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)


class Testbed:
    __test__ = False  # not a test class, whatever pytest thinks of the name

    def __init__(self, workdir: Path | None = None) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="gpukill-bed-"))
        os.chmod(self.workdir, 0o755)
        self.scope = self.workdir.name
        self.procs: list[subprocess.Popen] = []
        self.bus_address = ""
        self.journal_pid: int | None = None
        self.daemon: DaemonProcess | None = None
        self.polkit: subprocess.Popen | None = None
        self.cgroups: list[Path] = []

    # -- components ------------------------------------------------------------------------------------

    def start_system(self, rate_limit: tuple[int, int] | None = None, **daemon) -> DaemonProcess:
        """The whole private system: bus, journald (rate_limit: see start_journal), polkitd with the example
        rules (ADMIN_RULES), gpukilld (start_daemon with these keyword arguments)."""
        self.start_bus()
        self.start_journal(rate_limit)
        self.start_polkit([ADMIN_RULES])
        return self.start_daemon(**daemon)

    def _spawn(self, argv: list[str], log_name: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        with open(self.workdir / log_name, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
                **kw,
            )
        self.procs.append(proc)
        return proc

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG", "DBUS_"))}
        env.update(DBUS_SYSTEM_BUS_ADDRESS=self.bus_address, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
        env.update(extra)
        return env

    def start_bus(self) -> str:
        sock = self.workdir / "system_bus_socket"
        conf = self.workdir / "bus.conf"
        conf.write_text(
            BUS_CONFIG.format(socket=sock, polkit_conf=POLKIT_BUS_CONF, our_conf=REPO / "dbus" / "org.gpukill1.conf")
        )
        self._spawn(["dbus-daemon", f"--config-file={conf}", "--nofork", "--nopidfile"], "dbus.log")
        self.bus_address = f"unix:path={sock}"
        _wait(lambda: sock.exists(), 10, "dbus-daemon did not create its socket")
        return self.bus_address

    def start_polkit(self, rules: list[Path] | None = None) -> None:
        """polkitd seeing only our .policy and the given .rules files."""
        actions = self.workdir / "polkit-actions"
        rules_dir = self.workdir / "polkit-rules"
        actions.mkdir(exist_ok=True)
        rules_dir.mkdir(exist_ok=True)
        shutil.copy(REPO / "polkit" / "org.gpukill.policy", actions)
        for r in rules or []:
            shutil.copy(r, rules_dir)
        for d in (actions, rules_dir):
            os.chmod(d, 0o755)
        script = (
            f"mount --bind {actions} /usr/share/polkit-1/actions && "
            f"mount --bind {rules_dir} /etc/polkit-1/rules.d && "
            "mount -t tmpfs tmpfs /usr/share/polkit-1/rules.d && "
            f"exec {POLKITD} --no-debug"
        )
        self.polkit = self._spawn(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script], "polkitd.log", env=self.env()
        )
        _wait(lambda: self.name_has_owner("org.freedesktop.PolicyKit1"), 15, "polkitd did not take its bus name")

    def stop_polkit(self) -> None:
        if self.polkit is not None:
            _kill_group(self.polkit)
            self.polkit = None

    def start_journal(self, rate_limit: tuple[int, int] | None = None) -> None:
        """A journald of our own in a mount namespace; gpukilld and journalctl are run inside it.
        rate_limit (burst, seconds) sets journald's RateLimitBurst and RateLimitIntervalSec, as an admin would in
        journald.conf, so a test can show which entries survive when a flood makes journald drop some."""
        os.makedirs("/run/systemd/journal", exist_ok=True)
        os.makedirs("/run/log/journal", exist_ok=True)
        mounts = ["mount -t tmpfs tmpfs /run/systemd/journal", "mount -t tmpfs tmpfs /run/log/journal"]
        if os.path.isdir("/var/log/journal"):  # persistent storage would land in the machine's journal
            mounts.append("mount -t tmpfs tmpfs /var/log/journal")
        if rate_limit is not None:
            conf = self.workdir / "journald.conf"
            conf.write_text(f"[Journal]\nRateLimitBurst={rate_limit[0]}\nRateLimitIntervalSec={rate_limit[1]}s\n")
            mounts.append(f"mount --bind {conf} /etc/systemd/journald.conf")
        script = " && ".join([*mounts, f"exec {JOURNALD}"])
        proc = self._spawn(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], "journald.log")
        self.journal_pid = proc.pid
        _wait(
            lambda: os.path.exists(f"/proc/{proc.pid}/root/run/systemd/journal/socket"),
            15,
            "journald did not create its socket",
        )

    def in_journal_ns(self, argv: list[str]) -> list[str]:
        if self.journal_pid is None:
            return argv
        return ["nsenter", "-t", str(self.journal_pid), "-m", "--", *argv]

    def _unit_cgroups(self, unit: str) -> list[Path]:
        """cgroups named like a system unit, in systemd's hierarchies (v1 name=systemd and v2), so journald
        takes what the daemon logs as that unit's and applies its per-unit rate limit. Only where systemd does
        not run the machine: its own tree is not ours to write."""
        if os.path.isdir("/run/systemd/system"):
            return []
        roots = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified")]
        if Path("/sys/fs/cgroup/cgroup.controllers").exists():
            roots = [Path("/sys/fs/cgroup")]
        dirs = [r / "system.slice" / unit for r in roots if r.is_dir()]
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        self.cgroups.extend(dirs)
        return dirs

    def start_daemon(
        self,
        sim_yaml: str | Path | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        wait_ready: bool = True,
        as_unit: bool = False,
    ) -> DaemonProcess:
        """gpukilld on the bed's simulated GPUs; as_unit: in cgroups named like a system unit (_unit_cgroups)."""
        sim_path = self.workdir / "simulate.yaml"
        sim = yaml.safe_load(Path(sim_yaml or REPO / "examples" / "simulate.yaml").read_text())
        sim.setdefault("scope", self.scope)  # see only this bed's victims, not other runs' on the machine
        sim_path.write_text(yaml.safe_dump(sim))
        notify_path = self.workdir / f"notify-{len(self.procs)}.sock"
        listener = NotifyListener(notify_path)
        command = [
            PYTHON,
            "-m",
            "gpukilld",
            "--simulate",
            str(sim_path),
            "--config",
            str(self.workdir / "gpukilld.conf"),
            *(args or []),
        ]
        if as_unit and (cgroups := self._unit_cgroups(f"gpukilld-test-{self.scope}.service")):
            enter = "".join(f"echo $$ > {d}/cgroup.procs && " for d in cgroups)
            command = ["sh", "-c", enter + 'exec "$@"', "sh", *command]
        argv = self.in_journal_ns(command)
        if not (self.workdir / "gpukilld.conf").exists():
            self.write_conf()
        log_name = f"gpukilld-{len(self.procs)}.log"
        proc = self._spawn(argv, log_name, env=self.env(NOTIFY_SOCKET=str(notify_path), **(env or {})), cwd=str(REPO))
        daemon = DaemonProcess(proc, listener, self.workdir / log_name, sim_path)
        self.daemon = daemon
        if wait_ready and listener.wait_for("READY=1", 20) is None:
            raise RuntimeError(f"gpukilld did not become ready:\n{daemon.log()}")
        return daemon

    def write_conf(self, **sections: dict) -> Path:
        """The gpukilld.conf that start_daemon passes to --config, from sections: write_conf(daemon={"backends":
        "nvidia"}) writes [daemon] backends = nvidia. [guard] has the bed's policy_dir and state_dir unless they
        are given, so that the machine's /etc/gpukill/guard.d and /var/lib/gpukill are never used."""
        sections["guard"] = {
            "policy_dir": self.workdir / "guard.d",
            "state_dir": self.workdir / "state",
            **sections.get("guard", {}),
        }
        conf = self.workdir / "gpukilld.conf"
        conf.write_text(
            "".join(
                f"[{name}]\n" + "".join(f"{key} = {value}\n" for key, value in items.items())
                for name, items in sections.items()
            )
        )
        return conf

    def stop_daemon(self) -> None:
        if self.daemon is not None:
            _kill_group(self.daemon.proc)
            self.daemon.notify.close()
            self.daemon = None

    def kill_since(self, before: int) -> None:
        """Kill what was started after self.procs had `before` entries, but the daemon and polkitd (a test may
        have restarted those): what a test started is gone before the next one."""
        services = {self.polkit, self.daemon.proc if self.daemon else None}
        for proc in [p for p in self.procs[before:] if p not in services]:
            _kill_group(proc)
            self.procs.remove(proc)

    def stop(self) -> None:
        self.stop_daemon()
        for proc in reversed(self.procs):
            _kill_group(proc)
        self.procs.clear()
        for d in self.cgroups:  # empty now that their processes are gone
            with contextlib.suppress(OSError):
                d.rmdir()
        if not os.environ.get("GPUKILL_KEEP_BED"):  # set it to keep logs and sockets for a post-mortem
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- observation -----------------------------------------------------------------------------------

    def name_has_owner(self, name: str) -> bool:
        r = self.call_as(
            ROOT, "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "NameHasOwner", "s", [name]
        )
        return r.ok and bool(r.body[0])

    def journal(self, **match: str) -> list[dict]:
        matches = [f"{k}={v}" for k, v in match.items()]
        out = subprocess.run(
            self.in_journal_ns(["journalctl", "--no-pager", "-o", "json", *matches]),
            capture_output=True,
            text=True,
            timeout=30,
        )
        return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]

    def wait_journal(self, timeout: float = 10.0, **match: str) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            entries = self.journal(**match)
            if entries or time.monotonic() > deadline:
                return entries
            time.sleep(0.2)

    # -- clients ---------------------------------------------------------------------------------------

    def run_as(
        self, user: User, argv: list[str], timeout: float = 60, env: dict[str, str] | None = None, **kw
    ) -> subprocess.CompletedProcess:
        kwargs = user.popen_kwargs()
        if "input" not in kw:
            kw["stdin"] = subprocess.DEVNULL  # not our terminal: no password prompt from pkttyagent
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=self.env(**(env or {})), cwd="/", **kwargs, **kw
        )

    def ctl(self, user: User, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.run_as(user, [PYTHON, "-m", "gpukillctl", *args], timeout=timeout)

    def gpukill(self, user: User, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """gpu-kill's command line (gpukillctl/cli/compat.py), as `gpukill` runs it."""
        return self.run_as(user, [PYTHON, "-m", "gpukillctl.cli.compat", *args], timeout=timeout)

    def enforce(self, policy: Path) -> None:
        """Guard enabled, out of dry run, with the policy file loaded: as root with gpukillctl, as an admin would."""
        for args in (["enable"], ["dry-run", "off"], ["load", str(policy)]):
            r = self.ctl(ROOT, "guard", *args)
            assert r.returncode == 0, r

    def call_as(
        self,
        user: User,
        dest: str,
        path: str,
        iface: str,
        member: str,
        signature: str = "",
        body: list | None = None,
        timeout: float = 60,
    ) -> CallResult:
        """One raw D-Bus method call made by a real process running as `user`."""
        spec = json.dumps(
            {"dest": dest, "path": path, "iface": iface, "member": member, "signature": signature, "body": body or []}
        )
        r = self.run_as(user, [PYTHON, str(REPO / "tests" / "clients" / "dbus_call.py")], timeout=timeout, input=spec)
        if r.returncode != 0:
            raise RuntimeError(f"dbus_call failed: {r.stderr}")
        return CallResult(**json.loads(r.stdout))

    def manager(
        self, user: User, member: str, signature: str = "", body: list | None = None, timeout: float = 60
    ) -> CallResult:
        return self.call_as(
            user, "org.gpukill1", "/org/gpukill1", "org.gpukill1.Manager", member, signature, body, timeout
        )

    def guard_call(
        self, user: User, member: str, signature: str = "", body: list | None = None, timeout: float = 60
    ) -> CallResult:
        """One raw call of org.gpukill1.Guard, as `user` (see call_as)."""
        return self.call_as(
            user, "org.gpukill1", "/org/gpukill1", "org.gpukill1.Guard", member, signature, body, timeout
        )

    def guard_status(self, user: User = ROOT) -> dict:
        """Guard's GetStatus as `user` sees it; asserts it succeeded."""
        r = self.guard_call(user, "GetStatus")
        assert r.ok, r
        return r.body[0]

    def listing(self, user: User = ROOT, *args: str, timeout: float = 60) -> dict:
        """`gpukillctl list --json ARGS...` as `user`: {"devices": [...], "processes": [...]}; asserts it succeeded."""
        r = self.ctl(user, "list", "--json", *args, timeout=timeout)
        assert r.returncode == 0, r
        return json.loads(r.stdout)

    def listed(self, user: User = ROOT, *args: str, timeout: float = 60) -> dict[int, dict]:
        """The processes of listing(user, *args), by PID."""
        return {p["pid"]: p for p in self.listing(user, *args, timeout=timeout)["processes"]}

    def processes(self) -> list[dict]:
        r = self.manager(ROOT, "ListProcesses", "a{sv}", [{}])
        assert r.ok, r
        return r.body[0]

    def wait_listed(
        self, pid: int, timeout: float = 10.0, present: bool = True, comm: str | None = None
    ) -> dict | None:
        """Wait until pid is listed (with this comm: a victim may be sampled before it renames itself)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((p for p in self.processes() if p["pid"] == pid and comm in (None, p["comm"])), None)
            if (found is not None) == present:
                return found
            time.sleep(0.2)
        raise AssertionError(f"PID {pid} {'never listed' if present else 'still listed'} after {timeout}s")

    def record_signals(self, user: User = ROOT) -> SignalRecorder:
        kwargs = user.popen_kwargs()
        proc = subprocess.Popen(
            [PYTHON, str(REPO / "tests" / "clients" / "dbus_signals.py")],
            stdout=subprocess.PIPE,
            env=self.env(),
            cwd="/",
            start_new_session=True,
            text=True,
            **kwargs,
        )
        self.procs.append(proc)
        rec = SignalRecorder(proc)
        if rec.wait_for("_ready", 15) is None:
            raise RuntimeError("signal recorder did not start")
        return rec

    # -- victims ---------------------------------------------------------------------------------------

    def victim(
        self,
        user: User,
        gpu: int | str = 0,
        mem: str | None = None,
        util: float | None = None,
        comm: str | None = None,
        ignore_term: bool = False,
        padding: int = 0,
        lifetime: float = 3600,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """A real process "on" a simulated GPU, owned by `user`, that exits by itself after `lifetime` seconds;
        returns once it is set up. env: more of its environment (GPUKILL_SIM_UTIL_CYCLE, ...)."""
        env = {**sim_env(self.scope, gpu, mem, util), **(env or {})}
        code = "import ctypes, signal, sys, time\n"
        if comm:
            code += f"ctypes.CDLL(None).prctl(15, {comm.encode()!r}, 0, 0, 0)\n"  # PR_SET_NAME
        if ignore_term:
            code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        code += f"print('ready', flush=True)\ntime.sleep({lifetime})\n"
        kwargs = user.popen_kwargs()
        argv = [SYSTEM_PYTHON, "-c", code] + (["x" * padding] if padding else [])  # a long cmdline, if asked
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, cwd="/", start_new_session=True, **kwargs)
        self.procs.append(proc)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("victim failed to start")
        return proc


def sim_env(scope: str, gpu: int | str = 0, mem: str | None = None, util: float | None = None) -> dict[str, str]:
    """The environment that puts a process "on" simulated GPU `gpu` ("0,2" for two) of the bed whose scope is
    `scope`, holding `mem` of its memory and busy `util` percent (gpukilld/backends/simulated.py reads it)."""
    env = {"PATH": "/usr/bin:/bin", "GPUKILL_SIM_GPU": str(gpu), "GPUKILL_SIM_SCOPE": scope}
    if mem is not None:
        env["GPUKILL_SIM_MEM"] = mem
    if util is not None:
        env["GPUKILL_SIM_UTIL"] = str(util)
    return env


def start_time_of(pid: int) -> int:
    start_time = ProcFS().start_time(pid)
    assert start_time is not None, f"no process {pid}"
    return start_time


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.05)
