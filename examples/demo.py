#!/usr/bin/env python3
"""A guided tour of gpukill, run by `make demo` (as root, on a Debian machine).

Everything is real except the GPUs: a private system bus (dbus-daemon with our bus policy), polkitd with our
actions and the example rule, systemd-journald in its own mount namespace, gpukilld on examples/simulate.yaml,
and real processes, owned by real users, that the simulated backend places on the GPUs. The machine's own
bus, polkit rules and journal are neither used nor touched, and everything started is stopped at the end.

The tour runs in a private PID namespace (it re-executes itself under `unshare --pid --fork --mount-proc`):
gpukilld there sees only the tour's processes, so it can never list or kill anything else on this machine
(the simulated backend treats any process with GPUKILL_SIM_GPU in its environment as a GPU process), and
when the tour ends the kernel ends every process left in the namespace.

The tour doubles as a smoke test: it exits 0 when every step behaved as described, and otherwise prints one
line saying which step did not and exits 1.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import testbed  # noqa: E402
from tests.helpers.testbed import ADMIN, ADMIN_GROUP, OTHER, OWNER, ROOT, Testbed, User  # noqa: E402

SIM_YAML = REPO / "examples" / "simulate.yaml"
ADMIN_RULES = REPO / "polkit" / "49-gpukill-admins.rules"
EXIT_DENIED = 4  # gpukillctl's exit status for "polkit said no"
INNER_ENV = "GPUKILL_DEMO_PIDNS"

TTY = sys.stdout.isatty() and not os.environ.get("NO_COLOR")


class StepFailed(Exception):
    """A step did not behave as the tour says it does."""


class Interrupted(BaseException):
    pass


def _on_signal(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


# -- output ----------------------------------------------------------------------------------------------


def bold(text: str) -> str:
    return f"\033[1m{text}\033[0m" if TTY else text


def dim(text: str) -> str:
    return f"\033[2m{text}\033[0m" if TTY else text


def out(text: str = "") -> None:
    print(text, flush=True)


class Tour:
    def __init__(self) -> None:
        self.step_no = 0
        self.step_title = "setup"

    def step(self, title: str, *explain: str) -> None:
        self.step_no += 1
        self.step_title = title
        out()
        out(bold(f"== {self.step_no}. {title}"))
        for line in explain:
            out(f"   {line}")
        out()

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            raise StepFailed(f"step {self.step_no} ({self.step_title}): {what}")


def show_command(user: User, argv: list[str]) -> None:
    prompt = "#" if user.uid == 0 else "$"
    out(f"{dim(f'[{user.name}]')} {prompt} {shlex.join(argv)}")


def show_output(text: str) -> None:
    for line in text.rstrip("\n").splitlines():
        out(f"    {line}" if line else "")


# -- processes -------------------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _user_of(pid: int) -> str:
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        return pwd.getpwuid(uid).pw_name
    except (OSError, KeyError):
        return "?"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read().rstrip(b"\0").split(b"\0")
    except OSError:
        return "?"
    return " ".join(a.decode(errors="replace") for a in raw)


def members_of_sessions(sids: set[int]) -> list[int]:
    """Every live process whose session is one of sids (each testbed process leads its own session)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        # fields[0] is the state: a zombie has exited and is only waiting to be reaped
        if fields and int(fields[3]) in sids and fields[0] != "Z":
            found.append(int(entry))
    return sorted(found)


def alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def wait_gone(proc: subprocess.Popen, timeout: float = 10.0) -> bool:
    try:
        proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


# -- the tour --------------------------------------------------------------------------------------------


class Demo:
    def __init__(self, tour: Tour, tb: Testbed) -> None:
        self.tour = tour
        self.tb = tb
        self.owner = User.get(OWNER)
        self.other = User.get(OTHER)
        self.admin = User.get(ADMIN)

    def ctl(self, user: User, *args: str) -> subprocess.CompletedProcess:
        """Run gpukillctl as `user`, show the command line and its real output."""
        show_command(user, ["gpukillctl", *args])
        # stdin is not the terminal: on a terminal gpukillctl would start pkttyagent and ask for a password
        r = self.tb.run_as(user, [testbed.PYTHON, "-m", "gpukillctl", *args], stdin=subprocess.DEVNULL)
        show_output(r.stdout + r.stderr)
        if r.returncode != 0:
            out(dim(f"    (exit status {r.returncode})"))
        out()
        return r

    def run(self) -> None:
        tour, tb = self.tour, self.tb

        tour.step(
            "Start a private system: bus, journald, polkitd, gpukilld",
            "Real components, isolated from this machine's own, all in a private PID namespace (gpukilld",
            "sees only the tour's processes): dbus-daemon with gpukill's bus policy,",
            "systemd-journald and polkitd each in a private mount namespace (polkitd sees only our actions",
            f"and the example rule {ADMIN_RULES.relative_to(REPO)}), and gpukilld on",
            f"{SIM_YAML.relative_to(REPO)} (four simulated GPUs).",
        )
        address = tb.start_bus()
        tb.start_journal()
        tb.start_polkit([ADMIN_RULES])
        tb.start_daemon(SIM_YAML)
        tour.expect(tb.name_has_owner("org.gpukill1"), "gpukilld did not take the name org.gpukill1")
        out(f"   system bus: DBUS_SYSTEM_BUS_ADDRESS={address}")
        out(f"   work directory (configs, logs): {tb.workdir}")
        out()
        pids = members_of_sessions({p.pid for p in tb.procs})
        out("   These are real processes (PIDs as seen inside the tour's PID namespace):")
        out(f"   {'PID':>7}  {'USER':<9} COMMAND")
        for pid in pids:
            out(f"   {pid:>7}  {_user_of(pid):<9} {_cmdline(pid)[:90]}")
        tour.expect(len(pids) >= 4, f"expected at least 4 running processes, found {len(pids)}")

        tour.step(
            "Start some GPU work",
            "Real processes owned by real users. The simulated backend puts a process on a GPU when its",
            "environment says GPUKILL_SIM_GPU=N; each is renamed like the program it pretends to be.",
            f"{ADMIN} is in group '{ADMIN_GROUP}', which the example polkit rule lets do anything.",
        )
        self.train = tb.victim(self.owner, gpu=0, mem="12GiB", util=87, comm="train.py")
        self.notebook = tb.victim(self.other, gpu=1, mem="6GiB", util=9, comm="ipykernel")
        self.miner = tb.victim(self.owner, gpu=1, mem="2GiB", util=99, comm="xmrig")
        self.server = tb.victim(self.other, gpu=2, mem="20GiB", util=41, comm="llama-server")
        work = [
            ("train.py", self.train, self.owner, "GPU 0, 12 GiB, 87%"),
            ("ipykernel", self.notebook, self.other, "GPU 1, 6 GiB, 9%"),
            ("xmrig", self.miner, self.owner, "GPU 1, 2 GiB, 99% - a crypto miner"),
            ("llama-server", self.server, self.other, "GPU 2, 20 GiB, 41%"),
        ]
        for name, proc, user, where in work:
            out(f"   PID {proc.pid:<5} {name:<13} as {f'{user.name} (uid {user.uid})':<21} {where}")
        out()
        out("   waiting for gpukilld to see them (it samples every second) ...")
        for name, proc, _user, _where in work:
            try:
                tb.wait_listed(proc.pid, timeout=15)
            except AssertionError:
                tour.expect(False, f"gpukilld never listed {name} (PID {proc.pid})")

        tour.step("Who is on which GPU?", "Listing needs no privilege: any user may look.")
        r = self.ctl(self.other, "list")
        tour.expect(r.returncode == 0, f"gpukillctl list failed with exit status {r.returncode}")
        for name, proc, _user, _where in work:
            tour.expect(f"{proc.pid}" in r.stdout and name in r.stdout, f"{name} (PID {proc.pid}) is not listed")

        tour.step("Daemon status")
        r = self.ctl(self.other, "status")
        tour.expect(r.returncode == 0, f"gpukillctl status failed with exit status {r.returncode}")

        tour.step(
            f"{OTHER} tries to kill {OWNER}'s miner",
            "Stopping another user's process is org.gpukill.kill-any-process, which needs an admin.",
            "gpukilld asks polkit; polkit says no (no agent to ask for a password), so nothing is sent.",
        )
        r = self.ctl(self.other, "kill", str(self.miner.pid))
        tour.expect(
            r.returncode == EXIT_DENIED,
            f"expected exit status {EXIT_DENIED} (denied), got {r.returncode}: {r.stderr.strip()!r}",
        )
        time.sleep(0.3)
        tour.expect(self.miner.poll() is None and alive(self.miner.pid), "the miner died although the kill was denied")
        out(f"   xmrig (PID {self.miner.pid}) is still running.")

        tour.step(
            f"{OWNER} kills their own miner",
            "Stopping your own process is org.gpukill.kill-own-process, allowed for everyone.",
            "gpukilld pins the process with a pidfd, checks it is the one that was listed, sends SIGTERM.",
        )
        r = self.ctl(self.owner, "kill", str(self.miner.pid))
        tour.expect(r.returncode == 0, f"gpukillctl kill failed with exit status {r.returncode}: {r.stderr.strip()!r}")
        tour.expect("terminated" in r.stdout, f"expected 'terminated', got {r.stdout.strip()!r}")
        tour.expect(wait_gone(self.miner), "the miner is still running after a successful kill")
        out(f"   xmrig (PID {self.miner.pid}) is gone (exit status {self.miner.returncode}).")

        tour.step(
            f"An admin steps in: {ADMIN} stops {OTHER}'s notebook, root resets GPU 0",
            f"{ADMIN} is in group '{ADMIN_GROUP}'; the example rule says yes to every org.gpukill.* action.",
            "A reset with --force first stops every process on the GPU (here train.py).",
        )
        r = self.ctl(self.admin, "kill", str(self.notebook.pid))
        tour.expect(r.returncode == 0, f"{ADMIN}'s kill failed with exit status {r.returncode}: {r.stderr.strip()!r}")
        tour.expect(wait_gone(self.notebook), "the notebook is still running after a successful kill")
        r = self.ctl(ROOT, "reset", "0")
        tour.expect(r.returncode != 0, "a reset of a busy GPU without --force was allowed")
        r = self.ctl(ROOT, "reset", "0", "--force")
        tour.expect(r.returncode == 0, f"reset --force failed with exit status {r.returncode}: {r.stderr.strip()!r}")
        tour.expect(str(self.train.pid) in r.stdout, f"the reset did not report killing train.py: {r.stdout.strip()!r}")
        tour.expect(wait_gone(self.train), "train.py is still running after reset --force")
        try:
            tb.wait_listed(self.train.pid, timeout=10, present=False)
        except AssertionError:
            tour.expect(False, "train.py is still listed after the reset")
        r = self.ctl(self.other, "list")
        tour.expect(r.returncode == 0, f"gpukillctl list failed with exit status {r.returncode}")

        tour.step(
            "The audit trail in the journal",
            "gpukilld writes one journal entry per privileged request - allowed, denied or failed - with",
            "structured GPUKILL_* fields saying who asked for what. (journalctl runs in journald's namespace.)",
        )
        self.show_journal()

        tour.step(
            "Who used the GPUs?",
            "gpukilld adds up what each sample saw of every process on every GPU. When a process ends, its",
            'totals go to the journal (the "consumed" lines above) and to a store; `usage` asks for them,',
            "the running processes' totals so far included. Each user sees their own in full.",
        )
        r = self.ctl(ROOT, "usage", "--by", "process")
        tour.expect(r.returncode == 0, f"gpukillctl usage failed with exit status {r.returncode}: {r.stderr.strip()!r}")
        tour.expect(str(self.train.pid) in r.stdout, f"train.py (PID {self.train.pid}) is not in the usage by process")
        r = self.ctl(self.owner, "usage")
        tour.expect(r.returncode == 0, f"gpukillctl usage failed with exit status {r.returncode}: {r.stderr.strip()!r}")

    def show_journal(self) -> None:
        tour, tb = self.tour, self.tb
        want = {"kill-denied": 1, "kill": 3, "reset": 1}
        deadline = time.monotonic() + 10
        while True:
            entries = tb.journal(SYSLOG_IDENTIFIER="gpukilld")
            events = [e.get("GPUKILL_EVENT") for e in entries]
            if all(events.count(k) >= n for k, n in want.items()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)

        argv = ["journalctl", "-t", "gpukilld", "-o", "short-iso", "--no-pager"]
        show_command(ROOT, argv)
        r = subprocess.run(tb.in_journal_ns(argv), capture_output=True, text=True, timeout=30)
        show_output(r.stdout + r.stderr)
        out()

        argv = ["journalctl", "--no-pager", "-o", "json", "SYSLOG_IDENTIFIER=gpukilld", "GPUKILL_ACTION=kill"]
        show_command(ROOT, argv)
        r = subprocess.run(tb.in_journal_ns(argv), capture_output=True, text=True, timeout=30)
        tour.expect(r.returncode == 0, f"journalctl failed: {r.stderr.strip()!r}")
        out(dim("    (MESSAGE and a few GPUKILL_* fields of each entry)"))
        fields = [
            "GPUKILL_EVENT",
            "GPUKILL_RESULT",
            "GPUKILL_CALLER_UID",
            "GPUKILL_TARGET_PID",
            "GPUKILL_TARGET_COMM",
            "GPUKILL_POLKIT_ACTION",
            "GPUKILL_INITIATOR",
        ]
        for line in r.stdout.splitlines():
            e = json.loads(line)
            out(f"    {e.get('MESSAGE')}")
            out("      " + " ".join(f"{f}={e[f]}" for f in fields if f in e))
        out()

        by_event: dict[str, list[dict]] = {}
        for e in entries:
            by_event.setdefault(e.get("GPUKILL_EVENT", ""), []).append(e)
        for kind, n in want.items():
            tour.expect(
                len(by_event.get(kind, [])) >= n,
                f"expected {n} '{kind}' journal entr{'y' if n == 1 else 'ies'}, found {len(by_event.get(kind, []))}",
            )
        denied = by_event["kill-denied"][0]
        tour.expect(
            denied.get("GPUKILL_TARGET_PID") == str(self.miner.pid)
            and denied.get("GPUKILL_CALLER_UID") == str(self.other.uid),
            f"the kill-denied entry does not name {OTHER} and the miner: {json.dumps(denied)[:200]}",
        )
        killers = {(e.get("GPUKILL_TARGET_PID"), e.get("GPUKILL_CALLER_UID")) for e in by_event["kill"]}
        tour.expect(
            (str(self.miner.pid), str(self.owner.uid)) in killers, f"no journal entry for {OWNER} killing the miner"
        )
        tour.expect(
            (str(self.notebook.pid), str(self.admin.uid)) in killers,
            f"no journal entry for {ADMIN} killing the notebook",
        )


def cleanup(tour: Tour, tb: Testbed, keep_workdir: bool) -> str | None:
    """Stop everything; return a problem (one line) or None."""
    sids = {p.pid for p in tb.procs}
    tour.step("Clean up", "Stop everything that was started and check that nothing is left.")
    tb.stop()
    leftover: list[int] = []
    deadline = time.monotonic() + 5
    while True:
        leftover = members_of_sessions(sids)
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not keep_workdir:
        shutil.rmtree(tb.workdir, ignore_errors=True)
    if leftover:
        return "still running after cleanup: " + ", ".join(f"{p} ({_cmdline(p)[:40]})" for p in leftover)
    out(f"   stopped {len(sids)} process groups; none of their processes is left.")
    if keep_workdir:
        out(f"   logs kept in {tb.workdir}")
    return None


def other_simulations() -> list[int]:
    """gpukilld --simulate processes running outside this tour (they would see the tour's processes)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            argv = _cmdline(int(entry)).split()
            if "gpukilld" in argv and "--simulate" in argv:
                found.append(int(entry))
    return found


def reexec_in_pid_namespace() -> None:
    """Become PID 1 of a new PID namespace with its own /proc; unshare waits and passes on the exit status."""
    env = {**os.environ, INNER_ENV: "1"}
    argv = [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "--kill-child",
        "--",
        sys.executable,
        str(Path(__file__).resolve()),
        *sys.argv[1:],
    ]
    sys.stdout.flush()
    os.execvpe("unshare", argv, env)


def unready(prog: str) -> str | None:
    """Why `make PROG` cannot start here (not root, a tool missing), in one line; None when it can."""
    if not testbed.is_root():
        return f"`make {prog}` must run as root (it starts a private bus, polkitd and journald, and creates test users)"
    missing = testbed.missing_tools()
    if missing:
        return f"missing {', '.join(missing)}; run `make {prog}`, which installs them"
    return None


def make_users() -> str | None:
    """The three users and their group, created if missing, and a checkout they can run: a one-line problem
    or None."""
    try:
        testbed.ensure_users()
        testbed.make_traversable(REPO)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"setting up users and permissions: {e}"
    return None


def main() -> int:
    if problem := unready("demo"):
        print(f"demo: {problem}", file=sys.stderr)
        return 1
    if os.environ.get(INNER_ENV) != "1":
        others = other_simulations()
        if others:
            print(
                f"demo: note: other simulated gpukilld running (PID {', '.join(map(str, others))}); they see "
                "the tour's processes on their simulated GPUs too",
                file=sys.stderr,
            )
        reexec_in_pid_namespace()
    if os.getpid() != 1:
        print("demo: expected to run as PID 1 of a private PID namespace", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    out(bold("gpukill guided tour"))
    out("A private, real system with simulated GPUs; nothing on this machine is changed except three")
    out(f"system users ({OWNER}, {OTHER}, {ADMIN}) and group '{ADMIN_GROUP}', created if missing.")
    if problem := make_users():
        print(f"demo: FAILED: {problem}", file=sys.stderr)
        return 1

    tour = Tour()
    tb = Testbed()
    failure: str | None = None
    try:
        Demo(tour, tb).run()
    except StepFailed as e:
        failure = str(e)
    except (KeyboardInterrupt, Interrupted) as e:
        failure = f"interrupted in step {tour.step_no} ({tour.step_title}){f' by {e}' if str(e) else ''}"
    except Exception as e:  # a broken component must still end in one line, after cleaning up
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        failure = f"step {tour.step_no} ({tour.step_title}): {type(e).__name__}: {first}"
    finally:
        # a second Ctrl-C or SIGTERM during cleanup must not leave processes behind
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        try:
            problem = cleanup(tour, tb, keep_workdir=failure is not None)
        except Exception as e:
            problem = f"cleanup: {type(e).__name__}: {e}"
    if failure or problem:
        print(f"demo: FAILED: {failure or problem}", file=sys.stderr)
        return 1
    out()
    out(bold("Done: every step behaved as described."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
