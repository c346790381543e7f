"""Real processes the tests start and watch, outside the testbed's simulated GPU victims."""

from __future__ import annotations

import subprocess

from .testbed import SYSTEM_PYTHON


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
