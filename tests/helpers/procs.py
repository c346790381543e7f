"""Real processes the tests start and watch, outside the testbed's simulated GPU victims."""

from __future__ import annotations

import subprocess

from .testbed import SYSTEM_PYTHON, sim_env


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie (a killed child not yet reaped is dead for our purposes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def spawn(bed, user) -> subprocess.Popen:
    """A real process of `user` doing nothing, as a GPU job would between kernels; bed kills it on stop."""
    kwargs = user.popen_kwargs()
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
        start_new_session=True,
        **kwargs,
    )
    bed.procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def signal_recorder(bed, user, gpu: int = 0, mem: str = "1GiB") -> subprocess.Popen:
    """A real process of `user` "on" a simulated GPU of the bed that handles every signal it can (all but KILL and
    STOP) by writing the signal's name to its stdout, one a line, and going on: SIGTERM does not end it, SIGKILL
    does. Read the names with `received(proc)` once it has ended."""
    code = (
        "import signal, time\n"
        "def said(n, _):\n"
        "    print(signal.Signals(n).name, flush=True)\n"
        "for s in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:\n"
        "    try:\n"
        "        signal.signal(s, said)\n"
        "    except (OSError, ValueError):\n"
        "        pass\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    time.sleep(3600)\n"
    )
    kwargs = user.popen_kwargs()
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", code],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=sim_env(bed.scope, gpu, mem),
        cwd="/",
        start_new_session=True,
        **kwargs,
    )
    bed.procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def received(proc: subprocess.Popen) -> list[str]:
    """The signals a signal_recorder handled, in order, once it has ended."""
    assert proc.stdout is not None
    return proc.stdout.read().decode().split()
