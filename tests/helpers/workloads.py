"""Real workloads on the simulated GPUs, for the reclaim tests and bench/reclaim: a trainer and its workers.

A trainer is a real process of a user that spawns worker processes; each worker inherits the trainer's
GPUKILL_SIM_GPU, so each holds simulated GPU memory of its own, as a PyTorch DataParallel or a torchrun worker
does. Variants: workers that ignore SIGTERM, a worker that double-forks into a session of its own (so it is no
longer the trainer's descendant when the kill comes), non-GPU helpers in the trainer's process group, and a
process frozen in a cgroup v1 freezer - the D-state fixture: a frozen task sleeps uninterruptibly in
__refrigerator and outlives SIGKILL until it is thawed, as a process stuck in the NVIDIA driver outlives it
until the GPU is reset. Everything started here is killed by cleanup(), orphans included (they are not the
Testbed's children, so its own cleanup would miss them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .testbed import SYSTEM_PYTHON, Testbed, User

FREEZER = Path("/sys/fs/cgroup/freezer")

# argv[1]: JSON {workers, ignore_term, double_fork, helpers, comm}. Prints one JSON line of the PIDs, then sleeps.
TRAINER = r"""
import json, os, signal, subprocess, sys, time
spec = json.loads(sys.argv[1])
worker = "import signal, time\n"
if spec["ignore_term"]:
    worker += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
worker += "print('ready', flush=True)\ntime.sleep(3600)\n"
workers, helpers = [], []
for i in range(spec["workers"]):
    p = subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE)
    p.stdout.readline()
    workers.append(p.pid)
if spec["double_fork"]:
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            time.sleep(3600)
        os._exit(0)
    os.wait()
    workers.append(int(os.read(r, 32)))
plain = {k: v for k, v in os.environ.items() if not k.startswith("GPUKILL_SIM")}
for i in range(spec["helpers"]):
    p = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(3600)"],
                         stdout=subprocess.PIPE, env=plain)
    p.stdout.readline()
    helpers.append(p.pid)
if spec.get("comm"):
    import ctypes
    ctypes.CDLL(None).prctl(15, spec["comm"].encode(), 0, 0, 0)  # PR_SET_NAME: the trainer alone
print(json.dumps({"workers": workers, "helpers": helpers}), flush=True)
time.sleep(3600)
"""


def _start_time(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[19])


@dataclass
class Workload:
    pid: int  # the trainer
    workers: list[int]
    helpers: list[int]
    proc: subprocess.Popen
    starts: dict[int, int] = field(default_factory=dict)  # every process started, by PID: its start time
    frozen: Path | None = None  # the freezer cgroup of a frozen process

    def alive(self, pid: int) -> bool:
        """The very process started as pid is alive (and not a zombie): a reused PID does not count."""
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        rest = raw[raw.rindex(")") + 2 :].split()
        return rest[0] != "Z" and int(rest[19]) == self.starts.get(pid)

    def left(self) -> list[int]:
        """The GPU processes (trainer and workers) still alive."""
        return [p for p in [self.pid, *self.workers] if self.alive(p)]

    def cleanup(self) -> None:
        if self.frozen is not None:
            with contextlib.suppress(OSError):
                (self.frozen / "freezer.state").write_text("THAWED")
        for pid in self.starts:
            if self.alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.frozen is not None:
            for _ in range(50):
                with contextlib.suppress(OSError):
                    self.frozen.rmdir()
                    break
                time.sleep(0.1)


def trainer(
    bed: Testbed,
    user: User,
    workers: int = 4,
    mem: str = "1GiB",
    ignore_term: bool = False,
    double_fork: bool = False,
    helpers: int = 0,
    gpu: int = 0,
    comm: str = "",
) -> Workload:
    env = {"PATH": "/usr/bin:/bin", "GPUKILL_SIM_GPU": str(gpu), "GPUKILL_SIM_SCOPE": bed.scope, "GPUKILL_SIM_MEM": mem}
    spec = {
        "workers": workers,
        "ignore_term": ignore_term,
        "double_fork": double_fork,
        "helpers": helpers,
        "comm": comm,
    }
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", TRAINER, json.dumps(spec)],
        stdout=subprocess.PIPE,
        env=env,
        cwd="/",
        start_new_session=True,
        **user.popen_kwargs(),
    )
    assert proc.stdout is not None
    pids = json.loads(proc.stdout.readline())
    w = Workload(proc.pid, pids["workers"], pids["helpers"], proc)
    for pid in [proc.pid, *w.workers, *w.helpers]:
        w.starts[pid] = _start_time(pid) or 0
    return w


def frozen(bed: Testbed, user: User, mem: str = "1GiB", gpu: int = 0) -> Workload:
    """A GPU process frozen in a cgroup v1 freezer: state D in __refrigerator, alive after SIGKILL."""
    w = trainer(bed, user, workers=0, mem=mem, gpu=gpu)
    cg = FREEZER / f"gpukill-{bed.scope}-{w.pid}"
    cg.mkdir()
    w.frozen = cg
    (cg / "tasks").write_text(str(w.pid))
    (cg / "freezer.state").write_text("FROZEN")
    for _ in range(50):
        if (cg / "freezer.state").read_text().strip() == "FROZEN":
            break
        time.sleep(0.1)
    return w


def why_no_freezer() -> str | None:
    if os.path.isdir("/run/systemd/system"):
        return "systemd manages this machine's cgroup tree: a test does not write into it"
    if not (FREEZER / "tasks").exists():
        return f"no cgroup v1 freezer at {FREEZER}"
    return None
