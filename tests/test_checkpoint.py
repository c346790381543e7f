"""The checkpoint step on real processes: a job that declared a checkpoint signal (GPUKILL_CHECKPOINT) gets it
before any SIGTERM, saves and exits; one that declared nothing never gets it; the policy caps the wait; of a
tree the leader gets it once (each member with :each), and so of a Slurm job (`kill --job`: one act, its workers
stopped only after the leader saved); Guard sends it when a kill rule's grace begins (to the whole workload its
kill_scope takes, the leader once) and a job without a declaration lives through the whole grace until SIGTERM;
every step is journaled.

Each victim records every signal it receives (with the time) in a file of its own, named by its PID, so a test
can say that a process never got SIGTERM, or never got SIGUSR1."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from helpers.cgroups import slurm_task_cgroups, start_in
from helpers.marks import needs_root
from helpers.testbed import ROOT, SYSTEM_PYTHON, Testbed, User, sim_env
from helpers.waiting import wait_until

from gpukilld import journal as audit

pytestmark = needs_root

CAP = 2.0  # the policy's max_checkpoint_wait
GRACE = 3.0  # the Guard rule's grace period
POLICY = f"""\
max_checkpoint_wait: {CAP:g}s
kill_grace: 1s
rules:
  - name: ckpt-guard
    action: kill
    grace_period: {GRACE:g}s
    conditions:
      - {{type: process_name, operator: '==', value: ckpt-guard}}
  - name: ckpt-rule
    action: kill
    grace_period: {GRACE:g}s
    checkpoint: {{signal: USR1, wait: 1s}}
    conditions:
      - {{type: process_name, operator: '==', value: ckpt-rule}}
  - name: ckpt-now
    action: kill
    conditions:
      - {{type: process_name, operator: '==', value: ckpt-now}}
  - name: ckpt-unit
    scope: per_user
    action: kill
    grace_period: {GRACE:g}s
    kill_scope: unit
    conditions:
      - {{type: unit, operator: matches, value: '^ckpt-train-'}}
      - {{type: user_memory, operator: '>', value: 3GiB}}
"""

# argv: LOGDIR WORKERS ON_USR1 COMM; ON_USR1 "save" (log, save 0.3 s, exit 0), "ignore" (log, keep running) or
# "none" (no handler: USR1 kills it). Every signal caught is logged as "NAME TIME" in LOGDIR/PID. SIGTERM is
# logged and then kills it as the default action would. Workers run the same code with 0 workers.
RECORDER = r"""
import ctypes, os, signal, subprocess, sys, time
logdir, workers, mode, comm = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def log(what):
    with open(f"{logdir}/{os.getpid()}", "a") as f:
        f.write(f"{what} {time.time():.3f}\n")
def on_term(n, frame):
    log("TERM")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
def on_usr1(n, frame):
    log("USR1")
    if mode == "save":
        time.sleep(0.3)
        log("saved")
        os._exit(0)
signal.signal(signal.SIGTERM, on_term)
if mode != "none":
    signal.signal(signal.SIGUSR1, on_usr1)
kids = [subprocess.Popen([sys.executable, "-c", sys.argv[5], logdir, "0", mode, "", sys.argv[5]],
                         stdout=subprocess.PIPE) for _ in range(workers)]
pids = [k.pid for k in kids if k.stdout.readline()]
if comm:
    ctypes.CDLL(None).prctl(15, comm.encode(), 0, 0, 0)  # PR_SET_NAME
print(" ".join(map(str, [os.getpid(), *pids])), flush=True)
while True:
    time.sleep(3600)
"""


@pytest.fixture(scope="module")
def cbed(users):
    b = Testbed()
    logdir = Path(tempfile.mkdtemp(prefix="gpukill-ckpt-"))
    logdir.chmod(0o1777)
    try:
        (b.workdir / "guard.d").mkdir(exist_ok=True)
        b.start_system(args=["--sample-interval", "0.2"])
        policy = b.workdir / "ckpt.yaml"
        policy.write_text(POLICY)
        policy.chmod(0o644)
        b.enforce(policy)
        b.logdir = logdir  # type: ignore[attr-defined]
        yield b
    finally:
        b.stop()
        shutil.rmtree(logdir, ignore_errors=True)


@pytest.fixture
def jobs(cbed):
    before = len(cbed.procs)
    yield cbed
    cbed.kill_since(before)


def start(bed: Testbed, user: User, declare: str | None, on_usr1: str, workers: int = 0, comm: str = "ckpt-job"):
    """A recorder job (and its workers) on simulated GPU 0; returns (its Popen, the PIDs: leader first)."""
    env = sim_env(bed.scope, 0, "1GiB", 50)
    if declare is not None:
        env["GPUKILL_CHECKPOINT"] = declare
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", RECORDER, str(bed.logdir), str(workers), on_usr1, comm, RECORDER],  # type: ignore[attr-defined]
        stdout=subprocess.PIPE,
        env=env,
        cwd="/",
        start_new_session=True,
        **user.popen_kwargs(),
    )
    bed.procs.append(proc)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert pids and pids[0] == proc.pid
    for pid in pids:
        bed.wait_listed(pid, comm=comm if pid == proc.pid else None)
    return proc, pids


def start_job(bed: Testbed, user: User, job: str, declare: str | None, on_usr1: str, workers: int = 0):
    """start()'s recorder as a task of Slurm job `job` (proctrack/linuxproc: in slurmd's unit, SLURM_JOB_ID in
    its environment, which its workers inherit with the declaration); returns (its Popen, the PIDs: leader
    first)."""
    env = sim_env(bed.scope, 0, "1GiB", 50) | {"SLURM_JOB_ID": job}
    if declare is not None:
        env["GPUKILL_CHECKPOINT"] = declare
    argv = ["-c", str(bed.logdir), str(workers), on_usr1, "ckpt-job", RECORDER]  # type: ignore[attr-defined]
    code = f"import sys\nsys.argv = {argv!r}\nprint('ready', flush=True)\nexec(sys.argv[5])\n"
    proc = start_in(user, slurm_task_cgroups(bed, user, None), env, code)
    bed.procs.append(proc)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert pids and pids[0] == proc.pid
    for pid in pids:
        assert bed.wait_listed(pid, comm="ckpt-job" if pid == proc.pid else None)["slurm_job"] == job
    return proc, pids


def received(bed: Testbed, pid: int) -> list[tuple[str, float]]:
    """What PID logged: (what, when), in order."""
    try:
        lines = (bed.logdir / str(pid)).read_text().splitlines()  # type: ignore[attr-defined]
    except FileNotFoundError:
        return []
    return [(w, float(t)) for w, t in (line.split() for line in lines)]


def what(bed: Testbed, pid: int) -> list[str]:
    return [w for w, _ in received(bed, pid)]


def steps(bed: Testbed, pid: int) -> list[str]:
    """The checkpoint journal entries about PID, by step."""
    entries = bed.journal(MESSAGE_ID=audit.CHECKPOINT.message_id, GPUKILL_TARGET_PID=str(pid))
    return [e["GPUKILL_CHECKPOINT"] for e in entries]


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_a_declared_job_gets_its_signal_saves_and_exits_before_any_term(jobs, users):
    bed = jobs
    proc, (pid,) = start(bed, users["owner"], "USR1:5s", "save")
    r = bed.ctl(users["owner"], "kill", str(pid), "--checkpoint")
    assert r.returncode == 0, r
    assert f"PID {pid} (ckpt-job) checkpoint: SIGUSR1 sent to PID {pid}: exited after saving" in r.stdout, r.stdout
    assert proc.wait(5) == 0
    assert what(bed, pid) == ["USR1", "saved"]  # never SIGTERM
    assert wait_until(lambda: steps(bed, pid) == ["sent", "saved"], 10, "the steps were not journaled")
    sent = bed.journal(MESSAGE_ID=audit.CHECKPOINT.message_id, GPUKILL_TARGET_PID=str(pid), GPUKILL_CHECKPOINT="sent")
    assert (sent[0]["GPUKILL_SIGNAL"], sent[0]["GPUKILL_WAIT"], sent[0]["GPUKILL_SOURCE"]) == (
        "SIGUSR1",
        "2",
        "environment",
    )
    kill = bed.wait_journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(pid))
    assert kill[0]["GPUKILL_RESULT"] == "terminated" and kill[0]["GPUKILL_CHECKPOINT"] == "saved"


def test_a_job_that_declared_nothing_gets_no_checkpoint_signal(jobs, users):
    bed = jobs
    proc, (pid,) = start(bed, users["owner"], None, "none")  # SIGUSR1 would kill it: it has no handler
    listed = bed.wait_listed(pid)
    r = bed.manager(
        users["owner"],
        "KillProcessReport",
        "uta{sv}",
        [pid, listed["start_time"], {"checkpoint": {"$variant": ["b", True]}}],
    )
    assert r.ok, r
    report = r.body[0]
    assert report["outcome"] == "terminated"
    assert report["checkpoint"]["result"] == "undeclared"
    assert report["checkpoint"]["text"] == "declared no checkpoint signal"
    assert proc.wait(5) == -signal.SIGTERM and what(bed, pid) == ["TERM"]
    assert steps(bed, pid) == []


def test_a_malformed_declaration_sends_nothing_and_is_said(jobs, users):
    bed = jobs
    proc, (pid,) = start(bed, users["owner"], "KILL:5s", "none")
    r = bed.ctl(users["owner"], "kill", str(pid), "--checkpoint")
    assert r.returncode == 0, r
    assert "SIGKILL cannot be a checkpoint signal" in r.stdout and "no signal sent" in r.stdout, r.stdout
    assert proc.wait(5) == -signal.SIGTERM and what(bed, pid) == ["TERM"]
    assert wait_until(lambda: steps(bed, pid) == ["malformed"], 10, "the malformed declaration was not journaled")


def test_the_declared_wait_is_capped_by_the_policy(jobs, users):
    bed = jobs
    proc, (pid,) = start(bed, users["owner"], "USR1:10m", "ignore")  # handles USR1 and never exits
    t0 = time.monotonic()
    r = bed.ctl(users["owner"], "kill", str(pid), "--checkpoint")
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r
    assert "still running after 2." in r.stdout and "SIGTERM sent" in r.stdout, r.stdout
    assert proc.wait(5) == -signal.SIGTERM
    (usr1, t_usr1), (term, t_term) = received(bed, pid)
    assert (usr1, term) == ("USR1", "TERM")
    assert CAP - 0.2 <= t_term - t_usr1 <= CAP + 1.5, t_term - t_usr1
    assert elapsed < 10
    assert wait_until(lambda: steps(bed, pid) == ["sent", "still-running"], 10, "the steps were not journaled")


def test_a_trees_leader_gets_the_signal_once_and_its_workers_none(jobs, users):
    bed = jobs
    proc, pids = start(bed, users["owner"], "USR1:5s", "save", workers=2)
    leader, workers = pids[0], pids[1:]
    r = bed.ctl(users["owner"], "kill", "--tree", str(leader), "--checkpoint")
    assert r.returncode == 0, r
    assert f"checkpoint: SIGUSR1 sent to PID {leader}: exited after saving" in r.stdout, r.stdout
    assert proc.wait(5) == 0 and what(bed, leader) == ["USR1", "saved"]
    for w in workers:
        wait_until(lambda w=w: gone(w), 10, f"worker {w} still running")
        assert what(bed, w) == ["TERM"], w  # no SIGUSR1: the leader alone was asked
        assert steps(bed, w) == []
    assert steps(bed, leader) == ["sent", "saved"]


def test_kill_job_stops_every_gpu_process_of_the_job_in_one_act(jobs, users):
    bed = jobs
    proc, pids = start_job(bed, users["owner"], "5151", None, "none", workers=2)
    _, (bystander,) = start_job(bed, users["owner"], "515", None, "none")  # another job: left running
    r = bed.ctl(users["owner"], "kill", "--job", "5151", "--grace", "2")
    assert r.returncode == 0, r
    assert proc.wait(5) == -signal.SIGTERM
    for pid in pids:
        wait_until(lambda pid=pid: gone(pid), 10, f"PID {pid} still running")
        assert what(bed, pid) == ["TERM"], pid
        assert f"PID {pid} (" in r.stdout and ") terminated" in r.stdout, r.stdout
    terms = [received(bed, pid)[0][1] for pid in pids]
    assert max(terms) - min(terms) < 1.0, terms  # signalled together: one grace, not one per process
    assert "Slurm job 5151: GPU memory reclaimed" in r.stdout, r.stdout
    for pid in pids:  # each audited as a kill of the one selection
        (kill,) = bed.wait_journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(pid))
        assert kill["GPUKILL_SELECTION"] == "Slurm job 5151" and kill["GPUKILL_RESULT"] == "terminated", kill
    assert not gone(bystander) and what(bed, bystander) == []
    again = bed.ctl(users["owner"], "kill", "--job", "5151")
    assert again.returncode == 0 and again.stdout == "no GPU processes of Slurm job 5151 on this host\n", again


def test_kill_job_checkpoint_asks_the_leader_once_and_terms_no_one_before_it_saved(jobs, users):
    bed = jobs
    proc, pids = start_job(bed, users["owner"], "5252", "USR1:5s", "save", workers=2)
    leader, workers = pids[0], pids[1:]
    r = bed.ctl(users["owner"], "kill", "--job", "5252", "--checkpoint")
    assert r.returncode == 0, r
    assert f"Slurm job 5252 checkpoint: SIGUSR1 sent to PID {leader}: exited after saving" in r.stdout, r.stdout
    assert proc.wait(5) == 0 and what(bed, leader) == ["USR1", "saved"]  # once, and never SIGTERM
    (_, saved_at) = received(bed, leader)[-1]
    for w in workers:
        wait_until(lambda w=w: gone(w), 10, f"worker {w} still running")
        assert what(bed, w) == ["TERM"], w  # no SIGUSR1: the leader alone was asked
        ((_, term_at),) = received(bed, w)
        assert term_at >= saved_at, (w, term_at, saved_at)
        assert steps(bed, w) == []
    assert steps(bed, leader) == ["sent", "saved"]


def test_a_worker_killed_alone_is_left_to_its_leader(jobs, users):
    bed = jobs
    _, pids = start(bed, users["owner"], "USR1:5s", "none", workers=1)  # USR1 would kill the worker
    leader, worker = pids
    r = bed.ctl(users["owner"], "kill", str(worker), "--checkpoint")
    assert r.returncode == 0, r
    assert f"PID {worker} inherits its checkpoint from PID {leader}, which leads it" in r.stdout, r.stdout
    wait_until(lambda: gone(worker), 10, "the worker is still running")
    assert what(bed, worker) == ["TERM"] and what(bed, leader) == []
    assert steps(bed, worker) == [] and steps(bed, leader) == []


def test_each_gives_every_declaring_member_the_signal(jobs, users):
    bed = jobs
    proc, pids = start(bed, users["owner"], "USR1:5s:each", "save", workers=2)
    r = bed.ctl(users["owner"], "kill", "--tree", str(pids[0]), "--checkpoint")
    assert r.returncode == 0, r
    assert "exited after saving" in r.stdout, r.stdout
    assert proc.wait(5) == 0
    for pid in pids:
        wait_until(lambda pid=pid: gone(pid), 10, f"PID {pid} still running")
        assert what(bed, pid) == ["USR1", "saved"], pid
        assert steps(bed, pid) == ["sent", "saved"], pid


def _violation_time(bed: Testbed, rule: str, pid: int) -> float:
    entries = wait_until(
        lambda: [
            e
            for e in bed.journal(MESSAGE_ID=audit.GUARD_VIOLATION.message_id, GPUKILL_RULE=rule)
            if e.get("GPUKILL_TARGET_PIDS") == str(pid)
        ],
        15,
        f"no violation of {rule} for PID {pid}",
    )
    return int(entries[0]["__REALTIME_TIMESTAMP"]) / 1e6


def test_guard_asks_at_the_grace_start_and_an_undeclared_job_lives_until_term(jobs, users):
    bed = jobs
    saver, (saver_pid,) = start(bed, users["owner"], "USR1:5s", "save", comm="ckpt-guard")
    plain, (plain_pid,) = start(bed, users["owner"], None, "none", comm="ckpt-guard")
    # the declared job is asked at once, saves and exits: the episode ends without a kill
    assert saver.wait(GRACE + 10) == 0 and what(bed, saver_pid) == ["USR1", "saved"]
    began = _violation_time(bed, "ckpt-guard", saver_pid)
    (_, t_usr1), _ = received(bed, saver_pid)
    assert t_usr1 - began < GRACE - 1.0, "the checkpoint signal came late in the grace"
    sent = bed.wait_journal(
        MESSAGE_ID=audit.CHECKPOINT.message_id, GPUKILL_TARGET_PID=str(saver_pid), GPUKILL_CHECKPOINT="sent"
    )
    assert sent and sent[0]["GPUKILL_RULE"] == "ckpt-guard" and sent[0]["GPUKILL_INITIATOR"] == "guard:ckpt-guard"
    violation = bed.journal(MESSAGE_ID=audit.GUARD_VIOLATION.message_id, GPUKILL_RULE="ckpt-guard")
    said = [e["MESSAGE"] for e in violation if e.get("GPUKILL_TARGET_PIDS") == str(saver_pid)]
    assert f"sent SIGUSR1 to PID {saver_pid} to save, waiting up to 2s" in said[0], said
    # the job without a declaration gets nothing until the grace ends, then SIGTERM
    assert plain.wait(GRACE + 15) == -signal.SIGTERM
    assert what(bed, plain_pid) == ["TERM"]
    plain_began = _violation_time(bed, "ckpt-guard", plain_pid)
    ((_, t_term),) = received(bed, plain_pid)
    assert t_term - plain_began >= GRACE - 0.3, "SIGTERM came before the grace ended"
    assert steps(bed, plain_pid) == []


def test_a_rules_checkpoint_counts_for_a_job_that_declares_nothing(jobs, users):
    bed = jobs
    proc, (pid,) = start(bed, users["owner"], None, "ignore", comm="ckpt-rule")  # handles USR1, keeps running
    assert proc.wait(GRACE + 15) == -signal.SIGTERM
    (usr1, t_usr1), (term, t_term) = received(bed, pid)
    assert (usr1, term) == ("USR1", "TERM")
    began = _violation_time(bed, "ckpt-rule", pid)
    assert t_usr1 - began < GRACE - 1.0 and t_term - began >= GRACE - 0.3
    assert wait_until(lambda: steps(bed, pid) == ["sent", "still-running"], 10, "the steps were not journaled")
    sent = bed.journal(MESSAGE_ID=audit.CHECKPOINT.message_id, GPUKILL_TARGET_PID=str(pid), GPUKILL_CHECKPOINT="sent")
    assert sent[0]["GPUKILL_SOURCE"].startswith("policy ") and sent[0]["GPUKILL_WAIT"] == "1"


def test_a_guard_kill_without_grace_has_the_kill_paths_own_checkpoint_step(jobs, users):
    bed = jobs
    proc, (pid,) = start(bed, users["owner"], "USR1:5s", "save", comm="ckpt-now")
    assert proc.wait(15) == 0 and what(bed, pid) == ["USR1", "saved"]  # never SIGTERM
    kill = bed.wait_journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(pid))
    assert kill and kill[0]["GPUKILL_INITIATOR"] == "guard:ckpt-now" and kill[0]["GPUKILL_CHECKPOINT"] == "saved"
    assert steps(bed, pid) == ["sent", "saved"]


def test_the_answer_travels_as_json(jobs, users):
    bed = jobs
    _, (pid,) = start(bed, users["owner"], "USR1:5s", "save")
    listed = bed.wait_listed(pid)
    r = bed.manager(
        users["owner"],
        "KillWorkload",
        "a{sv}a{sv}",
        [
            {"tree": {"$variant": ["(ut)", [pid, listed["start_time"]]]}},
            {"checkpoint": {"$variant": ["b", True]}},
        ],
    )
    assert r.ok, r
    step = r.body[0]["checkpoint"]
    assert step["result"] == "saved" and step["signal"] == "SIGUSR1" and step["pids"] == [pid], json.dumps(step)
    assert step["wait"] == CAP and 0 < step["waited"] < CAP


def test_a_dry_run_says_what_it_would_send_and_sends_nothing(jobs, users):
    bed = jobs
    assert bed.ctl(ROOT, "guard", "dry-run", "on").returncode == 0
    try:
        proc, (pid,) = start(bed, users["owner"], "USR1:5s", "none", comm="ckpt-guard")  # USR1 would kill it
        began = _violation_time(bed, "ckpt-guard", pid)
        violation = bed.journal(MESSAGE_ID=audit.GUARD_VIOLATION.message_id, GPUKILL_RULE="ckpt-guard")
        said = [e["MESSAGE"] for e in violation if e.get("GPUKILL_TARGET_PIDS") == str(pid)]
        assert f"would send SIGUSR1 to PID {pid} and wait up to 2s" in said[0], said
        while time.time() < began + GRACE + 1.0:  # the whole grace and the would-be kill
            time.sleep(0.2)
        assert proc.poll() is None and what(bed, pid) == []
        assert steps(bed, pid) == ["would-send"]
    finally:
        assert bed.ctl(ROOT, "guard", "dry-run", "off").returncode == 0


# argv: LOGDIR ROLE CODE GPU_ENV. The launcher (on no GPU) waits for a line on stdin (the test moves it into its
# unit meanwhile), then becomes the trainer: on the GPU (1 GiB) with GPU_ENV, it starts a worker with 3 GiB of it;
# both inherit its unit and its declaration. On SIGUSR1 the trainer saves (0.3 s) and exits; the worker ends when
# its trainer is gone. Each logs what it gets.
TRAINER_SAVES = r"""
import ctypes, json, os, signal, subprocess, sys, time
logdir, role, code = sys.argv[1], sys.argv[2], sys.argv[3]
if role == "launcher":
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    env = {**os.environ, **json.loads(sys.argv[4])}
    os.execve(sys.executable, [sys.executable, "-c", code, logdir, "trainer", code], env)
ctypes.CDLL(None).prctl(15, role.encode(), 0, 0, 0)  # PR_SET_NAME
def log(what):
    with open(f"{logdir}/{os.getpid()}", "a") as f:
        f.write(f"{what} {time.time():.3f}\n")
def on_term(n, frame):
    log("TERM")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
def on_usr1(n, frame):
    log("USR1")
    if role == "trainer":
        time.sleep(0.3)
        log("saved")
        os._exit(0)
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, on_usr1)
if role == "worker":
    trainer = os.getppid()
    print(os.getpid(), flush=True)
    while os.getppid() == trainer:
        time.sleep(0.05)
    log("done")
    sys.exit(0)
env = {**os.environ, "GPUKILL_SIM_MEM": "3GiB"}
worker = subprocess.Popen([sys.executable, "-c", code, logdir, "worker", code], stdout=subprocess.PIPE, env=env)
print(os.getpid(), int(worker.stdout.readline()), flush=True)
while True:
    time.sleep(3600)
"""


def test_a_unit_kill_asks_the_trainer_that_leads_the_worker_it_targets(jobs, users):
    """A per_user rule, kill_scope unit: its victim is the worker with the most memory, whose trainer (in the
    same unit, declaring the same) leads it. The trainer is asked when the grace begins, saves and exits, its
    worker with it: nobody gets SIGTERM, and the worker no SIGUSR1."""
    from helpers.cgroups import Cgroups, systemd_roots, why_no_cgroups

    if why := why_no_cgroups():
        pytest.skip(why)
    bed = jobs
    unit = f"ckpt-train-{bed.scope[-6:]}.service".replace("_", "-")
    groups = Cgroups()
    try:
        dirs = [groups.make(root, f"system.slice/{unit}") for root in systemd_roots()]
        gpu_env = {**sim_env(bed.scope, 0, "1GiB", 50), "GPUKILL_CHECKPOINT": "USR1:5s"}
        logdir = str(bed.logdir)  # type: ignore[attr-defined]
        proc = subprocess.Popen(
            [SYSTEM_PYTHON, "-c", TRAINER_SAVES, logdir, "launcher", TRAINER_SAVES, json.dumps(gpu_env)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
            start_new_session=True,
            **users["owner"].popen_kwargs(),
        )
        bed.procs.append(proc)
        assert proc.stdin is not None and proc.stdout is not None
        assert int(proc.stdout.readline()) == proc.pid
        for d in dirs:
            (d / "cgroup.procs").write_text(str(proc.pid))
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        trainer, worker = (int(p) for p in proc.stdout.readline().split())
        assert proc.wait(GRACE + 10) == 0, "the trainer did not save and exit by itself"
        wait_until(lambda: gone(worker), 10, "the worker is still running")
        assert what(bed, trainer) == ["USR1", "saved"] and what(bed, worker) == ["done"]
        began = _violation_time(bed, "ckpt-unit", worker)
        (_, t_usr1), _ = received(bed, trainer)
        assert t_usr1 - began < GRACE - 1.0, "the trainer was asked late in the grace"
        assert steps(bed, trainer) == ["sent"] and steps(bed, worker) == []
        violation = bed.journal(MESSAGE_ID=audit.GUARD_VIOLATION.message_id, GPUKILL_RULE="ckpt-unit")
        assert f"sent SIGUSR1 to PID {trainer} to save" in violation[0]["MESSAGE"], violation
        ended = bed.wait_journal(MESSAGE_ID=audit.GUARD_ACTION.message_id, GPUKILL_RULE="ckpt-unit")
        assert [e["GPUKILL_RESULT"] for e in ended] == ["cancelled"], "the episode did not end without a kill"
        assert not bed.journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(worker))
    finally:
        groups.cleanup()
