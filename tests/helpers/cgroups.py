"""Real cgroups for attribution tests: directories in the kernel's cgroup hierarchies, processes moved in.

These machines run cgroup v1 (a hierarchy per controller, name=systemd, and the v2 "unified" one beside them,
systemd's hybrid layout) with no systemd managing the tree, so a test may lay out what slurmd, a container
runtime or systemd's delegation to user@UID.service would make. Where systemd runs the machine its tree is not
ours to write: the tests that need this skip there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .testbed import SYSTEM_PYTHON, User

CGROUP_ROOT = Path("/sys/fs/cgroup")


def why_no_cgroups() -> str | None:
    if os.path.isdir("/run/systemd/system"):
        return "systemd manages this machine's cgroup tree: a test does not write into it"
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return None  # pure v2: one hierarchy
    if not (CGROUP_ROOT / "systemd").is_dir():
        return "no cgroup v1 name=systemd hierarchy mounted at /sys/fs/cgroup/systemd"
    return None


def systemd_roots() -> list[Path]:
    """The hierarchies systemd lays out (v1 name=systemd and v2 unified; or the one v2 tree)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT]
    return [r for r in (CGROUP_ROOT / "systemd", CGROUP_ROOT / "unified") if r.is_dir()]


def controller_root(name: str) -> Path:
    """A v1 controller's hierarchy (freezer, memory...): where Slurm's cgroup/v1 puts /slurm/uid_N/job_N."""
    root = CGROUP_ROOT / name
    if not (root / "tasks").exists():
        pytest.skip(f"no cgroup v1 {name} hierarchy mounted at {root}")
    return root


class Cgroups:
    """Directories made by a test, removed (deepest first) once their processes are gone."""

    def __init__(self) -> None:
        self.made: list[Path] = []

    def make(self, root: Path, rel: str, owner: User | None = None) -> Path:
        """root/rel and its missing parents (as root); owner: the last of them and its cgroup.procs (and v1's
        tasks) given to that user, as systemd delegates user@UID.service's subtree to its user."""
        d = root
        for part in Path(rel).parts:
            d = d / part
            if not d.exists():
                d.mkdir()
                self.made.append(d)
        if owner is not None:
            for p in (d, d / "cgroup.procs", d / "tasks"):
                if p.exists():
                    os.chown(p, owner.uid, owner.gid)
        return d

    def cleanup(self) -> None:
        """Stop what the test left in its cgroups (its own processes, by pid), then remove them."""
        deadline = time.monotonic() + 10
        for d in sorted(self.made, key=lambda p: len(p.parts), reverse=True):
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    d.rmdir()
                    break
                with contextlib.suppress(OSError):
                    for pid in (d / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.05)
        self.made.clear()


def enter(dirs: list[Path]) -> str:
    """Python that writes its own pid into each cgroup's cgroup.procs: the move into them."""
    procs = [str(d / "cgroup.procs") for d in dirs]
    return f"import os\nfor f in {procs!r}:\n    open(f, 'w').write(str(os.getpid()))\n"


def start_in(user: User, dirs: list[Path], env: dict[str, str], code: str) -> subprocess.Popen:
    """A real process of `user` that root puts in `dirs` (each a cgroup) and that then drops to the user and
    runs `code`, as slurmd starts a task or systemd a user's process. Returns once `code` printed "ready".
    `env` is the environment of `code` alone (env -i at the last exec): the root process before it carries no
    GPUKILL_SIM_* variable, so the simulated backend never lists it as root, or outside its cgroups, in a
    sample taken before the move (a process's facts are read again only every few minutes after that)."""
    groups = ",".join(map(str, user.groups)) or None
    assignments = [f"{k}={v}" for k, v in env.items()]
    argv = [
        SYSTEM_PYTHON,
        "-c",
        enter(dirs) + "os.execv('/usr/bin/setpriv', ['setpriv', '--reuid', "
        f"'{user.uid}', '--regid', '{user.gid}', "
        + (f"'--groups', '{groups}'" if groups else "'--clear-groups'")
        + f", '--', '/usr/bin/env', '-i', *{assignments!r}, {SYSTEM_PYTHON!r}, '-c', "
        f"{code!r}])\n",
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"}, cwd="/", start_new_session=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != b"ready":
        proc.kill()
        raise RuntimeError(f"the process in {dirs} did not start: exit {proc.wait()}")
    return proc


def slurm_task_cgroups(bed, user: User, job: str | None) -> list[Path]:
    """Where slurmd puts a task: with proctrack/linuxproc in slurmd's unit (a name of the bed's own, so runs
    side by side do not share it); with job set, in the job's cgroup as cgroup/v1 makes it (the freezer's
    /slurm/uid_N/job_N/step_0). Made as root, removed when the bed stops (bed.cgroups, deepest first)."""
    if why := why_no_cgroups():
        pytest.skip(why)
    made = Cgroups()
    if job is not None:
        dirs = [made.make(controller_root("freezer"), f"slurm/uid_{user.uid}/job_{job}/step_0")]
    else:
        dirs = [made.make(r, f"system.slice/slurmd@{bed.scope}.service") for r in systemd_roots()]
    bed.cgroups.extend(sorted(made.made, key=lambda d: len(d.parts), reverse=True))
    return dirs


SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(3600)\n"
