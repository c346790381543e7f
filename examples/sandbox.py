#!/usr/bin/env python3
"""`make sandbox`: the demo's private machine, kept running for you to try gpukill by hand (as root, on Debian).

    examples/sandbox.py
        Starts the machine of `make demo` (examples/demo.py): a private system bus with gpukill's bus policy,
        polkitd with our actions and the example rule, systemd-journald in its own mount namespace, gpukilld on
        examples/simulate.yaml (four simulated GPUs), and the users gpkowner, gpkother and gpkadmin (in group
        gpukill). It prints the two lines to paste into another shell, then waits in the foreground; Ctrl-C
        (or SIGTERM, SIGHUP) stops everything it started and every process started with `run`, and removes
        its directory.

    examples/sandbox.py run --user USER [--gpu N] [--mem SIZE] [--util PERCENT] [--name NAME] -- COMMAND...
        Starts COMMAND as USER "on" simulated GPU N of the sandbox that DBUS_SYSTEM_BUS_ADDRESS names, in the
        background, named NAME if given, and prints its PID. The pasted lines put this on PATH as
        `gpukill-sandbox`, beside the checkout's `gpukillctl`.

Unlike the demo, the sandbox runs in the machine's PID namespace: the clients in other shells are then callers
that the bus and polkitd can see. gpukilld still sees only the sandbox's processes, because the simulated
backend counts only processes whose environment carries the sandbox's scope (GPUKILL_SIM_SCOPE), which `run`
sets and the teardown looks for.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's gpukill, not an installed one

import demo  # noqa: E402  (examples/, the directory of this script)

from gpukill.units import parse_size  # noqa: E402
from tests.helpers import testbed  # noqa: E402
from tests.helpers.testbed import ADMIN, ADMIN_GROUP, ADMIN_RULES, OTHER, OWNER, REPO, Testbed, User  # noqa: E402

SIM_YAML = REPO / "examples" / "simulate.yaml"
SOCKET_NAME = "system_bus_socket"  # the name Testbed.start_bus gives the bus's socket in its directory
WORKDIR_PREFIX = "gpukill-sandbox-"
SCOPE_ENV = "GPUKILL_SIM_SCOPE"


def out(text: str = "") -> None:
    print(text, flush=True)


# -- the sandbox's processes -------------------------------------------------------------------------------


def in_scope(pid: int, scope: str) -> bool:
    """Whether the live process pid carries the sandbox's scope in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:
        return False
    return f"{SCOPE_ENV}={scope}".encode() in environ and demo.alive(pid)


def scoped_processes(scope: str) -> list[int]:
    """Every live process of the sandbox's scope: what `run` started, and their children."""
    return sorted(int(e) for e in os.listdir("/proc") if e.isdigit() and in_scope(int(e), scope))


def kill_scoped(scope: str) -> int:
    """SIGKILL every process of the scope, each through a pidfd opened while its environment still says so;
    the number killed."""
    killed = 0
    for pid in scoped_processes(scope):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if in_scope(pid, scope):  # still the same process: the pidfd pins it
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                killed += 1
        except OSError:
            pass
        finally:
            os.close(pidfd)
    return killed


def write_commands(tb: Testbed) -> Path:
    """WORKDIR/bin: `gpukillctl` of this checkout and `gpukill-sandbox`, for any user of the sandbox."""
    bin_dir = tb.workdir / "bin"
    bin_dir.mkdir()
    python, repo = shlex.quote(testbed.PYTHON), shlex.quote(str(REPO))
    scripts = {
        "gpukillctl": f'PYTHONPATH={repo} PYTHONDONTWRITEBYTECODE=1 exec {python} -m gpukillctl "$@"\n',
        "gpukill-sandbox": f'exec {python} {shlex.quote(str(Path(__file__).resolve()))} "$@"\n',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        os.chmod(bin_dir / name, 0o755)
    os.chmod(bin_dir, 0o755)
    return bin_dir


def show_how_to_use(tb: Testbed, bin_dir: Path) -> None:
    devices = len(yaml.safe_load(SIM_YAML.read_text())["devices"])
    out(f"gpukill sandbox: a private system bus, polkitd, journald and gpukilld on {devices} simulated GPUs")
    out(f"({SIM_YAML.relative_to(REPO)}), in {tb.workdir}.")
    out(
        f"Users: {OWNER}, {OTHER}, and {ADMIN} in group '{ADMIN_GROUP}', which the example rule "
        f"{ADMIN_RULES.relative_to(REPO)} lets do everything."
    )
    out()
    out("Paste these two lines into another shell, as root:")
    out()
    out(f"export DBUS_SYSTEM_BUS_ADDRESS={tb.bus_address} PATH={bin_dir}:$PATH")
    out(f"alias journalctl={shlex.quote(shlex.join(tb.in_journal_ns(['journalctl'])))}")
    out()
    out("Then, for example:")
    out()
    examples = [
        (f"gpukill-sandbox run --user {OWNER} --gpu 0 --mem 12GiB --util 87 -- sleep 600", "prints its PID"),
        ("gpukillctl list", "the GPUs, then who is on them"),
        (f"runuser -u {OTHER} -- gpukillctl kill PID </dev/null", "denied: not theirs (no password asked)"),
        (f"runuser -u {ADMIN} -- gpukillctl kill PID", "an admin: terminated"),
        ("journalctl -t gpukilld", "the audit trail"),
    ]
    width = max(len(line) for line, _ in examples)
    for line, why in examples:
        out(f"{line:<{width}}  # {why}")
    out()
    out("Ctrl-C here stops everything and removes the directory.")


# -- running and stopping ----------------------------------------------------------------------------------


def watch(tb: Testbed, names: dict[int, str]) -> str:
    """Wait until a signal comes (the exception ends the wait) or a component exits: what exited, in one line."""
    while True:
        for proc in tb.procs:
            if proc.poll() is not None:
                return f"{names.get(proc.pid, 'a component')} exited with status {proc.returncode}"
        time.sleep(1)


def teardown(tb: Testbed) -> str | None:
    """Stop the run processes and the components, remove the directory: a problem (one line) or None."""
    sids = {p.pid for p in tb.procs}
    killed = kill_scoped(tb.scope)
    tb.stop()
    shutil.rmtree(tb.workdir, ignore_errors=True)  # even where GPUKILL_KEEP_BED keeps a test's bed
    deadline = time.monotonic() + 5
    while leftover := demo.members_of_sessions(sids) + scoped_processes(tb.scope):
        if time.monotonic() > deadline:
            return "still running: " + ", ".join(f"{p} ({demo._cmdline(p)[:40]})" for p in leftover)
        time.sleep(0.1)
    if tb.workdir.exists():
        return f"{tb.workdir} is still there"
    processes = f"{killed} process{'' if killed == 1 else 'es'}"
    out(f"sandbox: stopped {len(sids)} components and {processes} started with run; removed {tb.workdir}")
    return None


def serve() -> int:
    if problem := demo.unready("sandbox"):
        print(f"sandbox: {problem}", file=sys.stderr)
        return 1
    if problem := demo.make_users():
        print(f"sandbox: {problem}", file=sys.stderr)
        return 1
    others = demo.other_simulations()
    if others:
        print(
            f"sandbox: note: other simulated gpukilld running (PID {', '.join(map(str, others))}); they see "
            "the sandbox's processes on their simulated GPUs too",
            file=sys.stderr,
        )
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: a shell's `&` ignores it
        signal.signal(sig, demo._on_signal)
    tb = Testbed(Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX)))
    failure: str | None = None
    try:
        tb.start_bus()
        tb.start_journal()
        tb.start_polkit([ADMIN_RULES])
        tb.start_daemon(SIM_YAML)
        names = dict(zip([p.pid for p in tb.procs], ["dbus-daemon", "journald", "polkitd", "gpukilld"], strict=True))
        show_how_to_use(tb, write_commands(tb))
        failure = watch(tb, names)
    except demo.Interrupted:
        out()
    except Exception as e:  # a broken component must still end in one line, after cleaning up
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        failure = f"{type(e).__name__}: {first}"
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not leave anything
            signal.signal(sig, signal.SIG_IGN)
        try:
            problem = teardown(tb)
        except Exception as e:
            problem = f"teardown: {type(e).__name__}: {e}"
    if failure or problem:
        print(f"sandbox: FAILED: {failure or problem}", file=sys.stderr)
        return 1
    return 0


# -- `run`: a process on a simulated GPU -------------------------------------------------------------------


class Refused(Exception):
    """What `run` cannot do, in one line."""


def sandbox_dir() -> Path:
    """The directory of the sandbox DBUS_SYSTEM_BUS_ADDRESS names."""
    address = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS", "")
    path = Path(address.removeprefix("unix:path="))
    if not (
        address.startswith("unix:path=")
        and path.name == SOCKET_NAME
        and path.parent.name.startswith(WORKDIR_PREFIX)
        and path.exists()
    ):
        raise Refused(
            "DBUS_SYSTEM_BUS_ADDRESS names no running sandbox: paste the export line that `make sandbox` printed"
        )
    return path.parent


def check_gpus(spec: str, sim_path: Path) -> None:
    count = len(yaml.safe_load(sim_path.read_text())["devices"])
    try:
        gpus = [int(x) for x in spec.split(",")]
    except ValueError:
        raise Refused(f"--gpu {spec!r}: a GPU index, or indexes separated by commas (0,2)") from None
    if not all(0 <= g < count for g in gpus):
        raise Refused(f"--gpu {spec}: the sandbox has GPUs 0 to {count - 1}")


def named(workdir: Path, name: str, executable: str) -> str:
    """A link called `name` to executable: run through it, a process is named `name` (the kernel names a
    process after the file it executes), as a miner renamed to look harmless is, or the reverse."""
    if not name or "/" in name or name in (".", "..") or len(name) > 15:
        raise Refused(f"--name {name!r}: a file name of at most 15 characters (the kernel's limit)")
    names = workdir / "names"
    names.mkdir(mode=0o755, exist_ok=True)
    link = names / name
    link.unlink(missing_ok=True)
    link.symlink_to(os.path.realpath(executable))
    return str(link)


def start(args: argparse.Namespace) -> str:
    workdir = sandbox_dir()
    check_gpus(args.gpu, workdir / "simulate.yaml")
    try:
        user = User.get(args.user)
    except KeyError:
        raise Refused(f"no user {args.user!r}") from None
    if os.geteuid() != 0 and user.uid != os.geteuid():
        raise Refused(f"only root starts processes as another user ({args.user})")
    if args.mem is not None:
        try:
            parse_size(args.mem, bare=1)
        except ValueError as e:
            raise Refused(f"--mem: {e}") from None
    if args.util is not None and not 0 <= args.util <= 100:
        raise Refused(f"--util {args.util:g}: a percentage from 0 to 100")
    env = testbed.sim_env(workdir.name, args.gpu, args.mem, args.util)
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env["HOME"] = pwd.getpwuid(user.uid).pw_dir
    executable = shutil.which(args.command[0], path=env["PATH"])
    if executable is None:
        raise Refused(f"no command {args.command[0]!r} on {env['PATH']}")
    argv = list(args.command)
    if args.name:
        executable, argv[0] = named(workdir, args.name, executable), args.name
    try:
        proc = subprocess.Popen(
            argv,
            executable=executable,
            env=env,
            cwd="/",
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **user.popen_kwargs(),
        )
    except OSError as e:
        raise Refused(f"{args.command[0]}: {e.strerror}") from None
    what = shlex.join(args.command) + (f", named {args.name}," if args.name else "")
    try:
        status = proc.wait(0.3)
    except subprocess.TimeoutExpired:
        return f"PID {proc.pid}: {what} as {user.name}, on simulated GPU {args.gpu} (listed within a second)"
    raise Refused(f"{what} exited at once with status {status}")


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gpukill-sandbox run",
        description="Start COMMAND as USER on a simulated GPU of the sandbox DBUS_SYSTEM_BUS_ADDRESS names, in "
        "the background; print its PID. The sandbox's teardown ends it.",
    )
    parser.add_argument("--user", required=True, help="whose process it is (gpkowner, gpkother, gpkadmin, root)")
    parser.add_argument("--gpu", default="0", help="the simulated GPU's index, or indexes: 0,2 (default 0)")
    parser.add_argument("--mem", help="the GPU memory it holds: 12GiB, 500MiB")
    parser.add_argument("--util", type=float, help="how busy it keeps the GPU, in percent")
    parser.add_argument("--name", help="the process's name, as gpukillctl list shows it (xmrig, train.py)")
    parser.add_argument("command", nargs="+", metavar="COMMAND", help="after --: the command and its arguments")
    args = parser.parse_args(argv)
    try:
        out(start(args))
    except Refused as e:
        print(f"gpukill-sandbox run: {e}", file=sys.stderr)
        return 2
    return 0


def main() -> int:
    if sys.argv[1:2] == ["run"]:
        return run(sys.argv[2:])
    if len(sys.argv) > 1:
        print(
            f"usage: {Path(sys.argv[0]).name} [run --user USER [--gpu N] [--mem SIZE] [--util PERCENT] "
            "[--name NAME] -- COMMAND [ARG...]]",
            file=sys.stderr,
        )
        return 2
    return serve()


if __name__ == "__main__":
    sys.exit(main())
