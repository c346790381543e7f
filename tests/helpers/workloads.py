"""Real workloads on the simulated GPUs, for the reclaim tests and bench/reclaim: a trainer and its workers.

A trainer is a real process of a user that spawns worker processes; each worker inherits the trainer's
GPUKILL_SIM_GPU, so each holds simulated GPU memory of its own, as a PyTorch DataParallel or a torchrun worker
does. Variants: workers that ignore SIGTERM, a worker that double-forks into a session of its own (so it is no
longer the trainer's descendant when the kill comes), non-GPU helpers in the trainer's process group, and a
process frozen in a cgroup v1 freezer - the D-state fixture: a frozen task sleeps uninterruptibly in
__refrigerator and outlives SIGKILL until it is thawed, as a process stuck in the NVIDIA driver outlives it
until the GPU is reset. Everything started here is killed by cleanup(), orphans included (they are not the
Testbed's children, so its own cleanup would miss them).

A stepper is a training job whose work can be counted: it does steps at a steady rate, saves a checkpoint every N
steps, and saves at once and exits 0 on the signal its environment declares (GPUKILL_CHECKPOINT=USR1:120s), as
Lightning and Transformers do on theirs. Steps lost to a reclaim = the last step done - the last step saved.
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

from .testbed import SYSTEM_PYTHON, Testbed, User, sim_env

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


# argv[1]: JSON {dir, step, every, save, comm}. Writes DIR/progress (the last step done) after each step and
# DIR/checkpoint (the last step saved) when a save ends, each atomically; prints "ready" once both hold 0. A save
# takes `save` seconds. Every `every` steps it saves, then exits 0 if DIR/stop exists (the owner asked it to stop
# at the end of its epoch). With GPUKILL_CHECKPOINT=SIG:... in its environment, SIG saves at once and exits 0;
# without, Python's default action for that signal applies (USR1 ends the process).
STEPPER = r"""
import json, os, signal, sys, time
spec = json.loads(sys.argv[1])
d = spec["dir"]
def put(name, step):
    tmp = os.path.join(d, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
    os.replace(tmp, os.path.join(d, name))
def save(step):
    time.sleep(spec["save"])
    put("checkpoint", step)
if spec["comm"]:
    import ctypes
    ctypes.CDLL(None).prctl(15, spec["comm"].encode(), 0, 0, 0)  # PR_SET_NAME
done = 0
declared = os.environ.get("GPUKILL_CHECKPOINT", "").split(":")[0].upper()
if declared:
    def on_checkpoint(signum, frame):
        put("progress", done)  # the step in hand when the signal came is the one saved
        save(done)
        os._exit(0)
    signal.signal(getattr(signal, declared if declared.startswith("SIG") else "SIG" + declared), on_checkpoint)
put("checkpoint", 0)
put("progress", 0)
print("ready", flush=True)
while True:
    time.sleep(spec["step"])
    done += 1
    put("progress", done)
    if done % spec["every"] == 0:
        save(done)
        if os.path.exists(os.path.join(d, "stop")):
            os._exit(0)
"""


@dataclass
class Stepper:
    proc: subprocess.Popen
    dir: Path  # progress, checkpoint and stop: the job's files
    start_time: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, name: str) -> int:
        return int((self.dir / name).read_text())

    def progress(self) -> int:
        """The last step done."""
        return self._read("progress")

    def checkpoint(self) -> int:
        """The step of the last checkpoint saved."""
        return self._read("checkpoint")

    def lost(self) -> int:
        return self.progress() - self.checkpoint()

    def wait_progress(self, step: int, timeout: float = 60.0) -> int:
        """Wait until `step` is done; the last step done then."""
        deadline = time.monotonic() + timeout
        while (done := self.progress()) < step:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stepper {self.pid} stopped at step {done} of {step} (exit {self.proc.poll()})")
            time.sleep(0.01)
        return done

    def stop_at_epoch_end(self) -> None:
        """What the owner does to have it save and exit at its next checkpoint."""
        (self.dir / "stop").touch()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def stepper(
    scope: str,
    directory: Path,
    user: User | None = None,
    step: float = 0.05,
    every: int = 100,
    save: float = 0.0,
    declare: str | None = None,
    mem: str = "1GiB",
    gpu: int = 0,
    comm: str = "",
) -> Stepper:
    """A stepper on simulated GPU `gpu` of the bed whose scope is `scope`, run as `user` (None: as we are), its
    files in `directory` (made, and given to the user); declare: its GPUKILL_CHECKPOINT ("USR1:120s"), or none."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    if user is not None:
        os.chown(directory, user.uid, user.gid)
    env = sim_env(scope, gpu, mem)
    if declare is not None:
        env["GPUKILL_CHECKPOINT"] = declare
    spec = {"dir": str(directory), "step": step, "every": every, "save": save, "comm": comm}
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", STEPPER, json.dumps(spec)],
        stdout=subprocess.PIPE,
        env=env,
        cwd="/",
        start_new_session=True,
        **(user.popen_kwargs() if user is not None else {}),
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        proc.kill()
        proc.wait()
        raise RuntimeError("stepper failed to start")
    return Stepper(proc, directory, _start_time(proc.pid) or 0)
