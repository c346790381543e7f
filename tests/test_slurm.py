"""Slurm: a process's job from its cgroup or, where Slurm makes none, its SLURM_JOB_ID; `gpukillctl kill --job`."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from helpers.cgroups import SLEEPER, slurm_task_cgroups, start_in
from helpers.guard_inputs import FakeGroups, FakeTime, GiB, proc, snap
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO, ROOT

from gpukill.errors import InvalidArgs
from gpukill.policy import load_texts
from gpukillctl.cli.kill_answer import slurm_job_id
from gpukilld.access.visibility import FULL, HIDDEN, PROGRAM, Viewer
from gpukilld.acts.selection import Selection
from gpukilld.guard.engine import Engine
from gpukilld.proc.attribution import parse_cgroup, slurm_job_from_environ
from gpukilld.proc.procfs import MAX_ENVIRON, ProcFS

# /proc/PID/cgroup of job tasks as Slurm's cgroup plugins lay them out (recorded on Slurm 22.05 and 23.02 hosts).
RECORDED_CGROUPS = [
    # cgroup/v2 under slurmd's own scope; with several slurmd on one host the scope carries the node name
    ("0::/system.slice/slurmstepd.scope/job_123/step_0/user/task_0\n", "123"),
    ("0::/system.slice/node7_slurmstepd.scope/job_9001/step_batch/user/task_0\n", "9001"),
    ("0::/system.slice/slurmstepd.scope/job_55/step_extern/user/task_special\n", "55"),
    # cgroup/v1: the job under /slurm/uid_N in the controllers Slurm uses, name=systemd elsewhere
    (
        "12:memory:/slurm/uid_1000/job_77/step_0/task_1\n11:devices:/slurm/uid_1000/job_77/step_0\n"
        "1:name=systemd:/system.slice/slurmd.service\n",
        "77",
    ),
    # no job: slurmd itself, a login session
    ("0::/system.slice/slurmd.service\n", None),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
]


@pytest.mark.parametrize(("text", "job"), RECORDED_CGROUPS)
def test_the_job_is_read_from_slurms_cgroups(text, job):
    assert parse_cgroup(text).slurm_job == job


@pytest.mark.parametrize(
    ("raw", "job"),
    [
        (b"PATH=/bin\0SLURM_JOB_ID=4242\0SLURM_STEP_ID=0\0", "4242"),
        (b"SLURM_JOB_ID=7\0", "7"),
        (b"PATH=/bin\0SLURM_JOBID=4242\0", None),  # the old name alone: Slurm sets both, so the new one is there
        (b"XSLURM_JOB_ID=5\0", None),
        (b"SLURM_JOB_ID=12x\0", None),  # not a job id: nothing, rather than a job nobody has
        (b"SLURM_JOB_ID=\0", None),
        (b"SLURM_JOB_ID=12345678901\0", None),
        (b"SLURM_JOB_ID=\xff\0", None),
        (b"", None),
    ],
)
def test_the_job_is_read_from_the_environment(raw, job):
    assert slurm_job_from_environ(raw) == job


def _fake_proc(root: Path, cgroup: str, environ: bytes) -> int:
    """A /proc/PID under root: this process's real stat and status, the given cgroup and environ."""
    pid = os.getpid()
    d = root / str(pid)
    d.mkdir()
    for name in ("stat", "status", "cmdline"):
        (d / name).write_bytes(Path(f"/proc/{pid}/{name}").read_bytes())
    (d / "cgroup").write_text(cgroup)
    (d / "environ").write_bytes(environ)
    return pid


def test_the_cgroup_job_wins_over_the_environment(tmp_path):
    # a process may rewrite its environment; only slurmd puts it in a job's cgroup
    pid = _fake_proc(tmp_path, "0::/system.slice/slurmstepd.scope/job_1/step_0\n", b"SLURM_JOB_ID=2\0")
    info = ProcFS(str(tmp_path)).info(pid)
    assert info is not None and info.attribution.slurm_job == "1"


def test_without_a_job_cgroup_the_environment_names_the_job(tmp_path):
    # proctrack/linuxproc: the task in slurmd's unit, SLURM_JOB_ID in its environment
    pid = _fake_proc(tmp_path, "0::/system.slice/slurmd.service\n", b"A=1\0SLURM_JOB_ID=31\0")
    info = ProcFS(str(tmp_path)).info(pid)
    assert info is not None and info.attribution.slurm_job == "31" and info.attribution.job_from_environ
    assert info.attribution.unit == "slurmd.service"  # the rest of the attribution is the cgroup's


def test_outside_slurmds_unit_the_environment_names_no_job(tmp_path):
    # a login session (or cron, a user unit): the user chose that environment
    pid = _fake_proc(tmp_path, "0::/user.slice/user-1000.slice/session-3.scope\n", b"A=1\0SLURM_JOB_ID=31\0")
    info = ProcFS(str(tmp_path)).info(pid)
    assert info is not None and info.attribution.slurm_job is None


def test_the_environment_is_read_bounded(tmp_path):
    pad = b"P=" + b"x" * MAX_ENVIRON + b"\0"
    pid = _fake_proc(tmp_path, "0::/\n", pad + b"SLURM_JOB_ID=31\0")
    assert ProcFS(str(tmp_path)).slurm_job(pid) is None
    assert ProcFS(str(tmp_path)).slurm_job(pid + 1) is None  # no such process


def test_kill_workloads_job_selects_each_gpu_process_of_the_job_once():
    procs = [
        proc(30, slurm_job="12", device=0),
        proc(30, slurm_job="12", device=1),  # on two GPUs: one process
        proc(20, slurm_job="12", start=7),
        proc(40, slurm_job="123"),
        proc(50),
        proc(60, slurm_job="1"),
    ]
    job = Selection.parse({"job": "012"})
    assert job == Selection("job", "12") and job.text == "Slurm job 12"
    assert job.resolve(ProcFS(), snap(*procs)) == ([(20, 7), (30, 100)], [])
    assert Selection.parse({"job": "99"}).resolve(ProcFS(), snap(*procs)) == ([], [])
    for bad in ("12_3", "12+1", "", "12345678901", "١٢", 12):
        with pytest.raises(InvalidArgs, match="Slurm job id"):
            Selection.parse({"job": bad})
    with pytest.raises(InvalidArgs, match="exactly one"):
        Selection.parse({"job": "12", "unit": "a.service"})


def test_a_callers_job_is_the_job_its_listing_shows():
    """A job read from SLURM_JOB_ID is its owner's (and full viewers') to see: another user's job id selects none
    of that owner's processes, so it tells nothing of which carry it; a job cgroup's is everyone's."""
    from_environ = dataclasses.replace(proc(30, uid=1000, slurm_job="12"), job_from_environ=True)
    from_cgroup = proc(31, uid=1000, slurm_job="12")
    hers = snap(from_environ, from_cgroup)
    job = Selection.parse({"job": "12"})
    assert dataclasses.replace(job, viewer=Viewer(1000, PROGRAM)).resolve(ProcFS(), hers)[0] == [(30, 100), (31, 100)]
    assert dataclasses.replace(job, viewer=Viewer(0, FULL)).resolve(ProcFS(), hers)[0] == [(30, 100), (31, 100)]
    assert dataclasses.replace(job, viewer=Viewer(1001, PROGRAM)).resolve(ProcFS(), hers)[0] == [(31, 100)]
    assert dataclasses.replace(job, viewer=Viewer(1001, HIDDEN)).resolve(ProcFS(), hers)[0] == []


@pytest.mark.parametrize(("text", "job"), [("42", "42"), ("007", "7")])
def test_job_ids_are_read_as_the_daemon_lists_them(text, job):
    assert slurm_job_id(text) == job


@pytest.mark.parametrize("text", ["", "x", "12_3", "12+1", "-1", "12345678901", "١٢"])
def test_what_is_not_a_job_id_is_refused(text):
    with pytest.raises(Exception, match="not a Slurm job id"):
        slurm_job_id(text)


def _job_victim(
    bed, user, job: str | None, gpu: int = 0, comm: str | None = None, job_cgroup: bool = False
) -> subprocess.Popen:
    """A process on a simulated GPU started as Slurm with proctrack/linuxproc starts a task: no job cgroup, in
    slurmd's unit, SLURM_JOB_ID in its environment (job_cgroup: in the job's cgroup instead, as cgroup/v1 puts
    it); named `comm` (prctl PR_SET_NAME, as any process may name itself) if given."""
    env = {"PATH": "/usr/bin:/bin", "GPUKILL_SIM_GPU": str(gpu), "GPUKILL_SIM_SCOPE": bed.scope}
    if job is not None:
        env["SLURM_JOB_ID"] = job
    rename = f"import ctypes\nctypes.CDLL(None).prctl(15, {comm.encode()!r}, 0, 0, 0)\n" if comm else ""
    proc = start_in(user, slurm_task_cgroups(bed, user, job if job_cgroup else None), env, rename + SLEEPER)
    bed.procs.append(proc)
    return proc


@needs_root
def test_kill_job_stops_the_jobs_processes_and_leaves_the_others(victims, users, alive):
    bed = victims
    owner = users["owner"]
    job = [_job_victim(bed, owner, "4242", gpu=0), _job_victim(bed, owner, "4242", gpu=1)]
    other_job = _job_victim(bed, owner, "42", gpu=0)
    no_job = _job_victim(bed, owner, None, gpu=1)
    for p in (*job, other_job):
        bed.wait_listed(p.pid)
    listed = bed.listed(owner)
    assert [listed[p.pid]["slurm_job"] for p in job] == ["4242", "4242"]
    assert listed[other_job.pid]["slurm_job"] == "42"
    assert bed.wait_listed(no_job.pid).get("slurm_job") is None

    cli = bed.ctl(owner, "kill", "--job", "4242", "--grace", "2")
    assert cli.returncode == 0, cli
    for p in job:
        assert p.wait(5) is not None
        assert f"PID {p.pid} (python3) terminated" in cli.stdout
    assert alive(other_job.pid) and alive(no_job.pid)

    # nothing of the job is left: said, and not a failure (the epilog runs this on every job)
    for p in job:
        bed.wait_listed(p.pid, present=False)
    again = bed.ctl(owner, "kill", "--job", "4242")
    assert again.returncode == 0 and "no GPU processes of Slurm job 4242" in again.stdout, again


@needs_root
def test_kill_job_asks_polkit_for_each_process(victims, users, alive):
    bed = victims
    # in a job cgroup: the job is everyone's to see (one from SLURM_JOB_ID only its owner's, test_label_trust.py)
    theirs = _job_victim(bed, users["owner"], "77", job_cgroup=True)
    bed.wait_listed(theirs.pid)
    cli = bed.ctl(users["other"], "kill", "--job", "77")  # another user's job: kill-any-process, denied
    assert cli.returncode == 4, cli
    assert alive(theirs.pid)
    assert cli.stderr.count("\n") == 1 and "Traceback" not in cli.stderr


def test_a_guard_rule_selects_processes_by_slurm_job():
    policy = load_texts(
        [
            (
                "p.yaml",
                "rules:\n  - name: job-12\n    scope: per_process\n    action: log\n"
                "    conditions:\n      - {type: slurm_job, operator: '==', value: '12'}\n",
            )
        ]
    )
    engine = Engine(policy, clock=FakeTime().clock(), groups=FakeGroups({}), own_pid=1)
    procs = [
        dataclasses.replace(proc(500, mem=GiB), slurm_job="12"),
        dataclasses.replace(proc(501, mem=GiB), slurm_job="123"),
        proc(502, mem=GiB),
    ]
    assert [p.pids for p in engine.preview(snap(*procs))] == [(500,)]


SLURM_SCRIPTS = REPO / "packaging" / "slurm"


def _script_env(tmp_path: Path, job: str, gpus: str, gpukillctl: str, **extra: str) -> dict[str, str]:
    """What slurmd gives a prolog or epilog, and where the map goes and which gpukillctl runs (settings the
    admin may change in /etc/default/gpukill-slurm)."""
    wrapper = tmp_path / "gpukillctl"
    wrapper.write_text(f"#!/bin/sh\n{gpukillctl}\n")
    wrapper.chmod(0o755)
    return {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_GPUS": gpus,
        "GPUKILL_JOB_MAP_DIR": str(tmp_path / "map"),
        "GPUKILLCTL": str(wrapper),
        **extra,
    }


def _run_script(bed, name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return bed.run_as(ROOT, ["/bin/sh", str(SLURM_SCRIPTS / name)], env=env)


@needs_root
def test_the_epilog_stops_the_ended_jobs_leftovers_and_updates_the_gpu_map(victims, users, alive, tmp_path):
    bed = victims
    ctl = f'exec {PYTHON} -m gpukillctl "$@"'
    for job, gpus in (("4242", "0,2"), ("77", "2")):
        r = _run_script(bed, "prolog", _script_env(tmp_path, job, gpus, ctl))
        assert r.returncode == 0, r
    mapped = {f.name: f.read_text() for f in (tmp_path / "map").iterdir() if not f.name.startswith(".")}
    assert mapped == {"0": "4242\n", "2": "4242\n77\n"}  # dcgm-exporter's format: a file per GPU, a job a line

    leftover = _job_victim(bed, users["owner"], "4242", gpu=2)
    running = _job_victim(bed, users["owner"], "77", gpu=2)
    bed.wait_listed(leftover.pid)
    bed.wait_listed(running.pid)
    r = _run_script(bed, "epilog", _script_env(tmp_path, "4242", "0,2", ctl, GPUKILL_EPILOG_GRACE="1"))
    assert r.returncode == 0, r
    assert leftover.wait(5) is not None and alive(running.pid)
    assert f"PID {leftover.pid} (python3) terminated" in r.stderr
    mapped = {f.name: f.read_text() for f in (tmp_path / "map").iterdir() if not f.name.startswith(".")}
    assert mapped == {"2": "77\n"}


@needs_root
@pytest.mark.parametrize(("drain", "status"), [("", 0), ("yes", 1)])
def test_the_epilog_fails_only_when_asked_to_drain(bed, tmp_path, drain, status):
    # gpukilld not answering: gpukillctl's exit 3
    env = _script_env(
        tmp_path,
        "5",
        "",
        "echo 'gpukillctl: gpukilld is not reachable' >&2; exit 3",
        **({"GPUKILL_EPILOG_DRAIN": drain} if drain else {}),
    )
    r = _run_script(bed, "epilog", env)
    assert r.returncode == status, r
    assert "gpukilld is not reachable" in r.stderr


@needs_root
def test_the_epilogs_line_keeps_a_process_name_with_backslashes(victims, users, tmp_path):
    """A process names itself `x\\c`: dash's echo would stop printing at `\\c` (and act on any other backslash
    escape), cutting the rest of what the epilog says; printf '%s' prints it as it is."""
    bed = victims
    ctl = f'exec {PYTHON} -m gpukillctl "$@"'
    named = _job_victim(bed, users["owner"], "4343", gpu=1, comm="x\\c")
    assert Path(f"/proc/{named.pid}/comm").read_text() == "x\\c\n"
    bed.wait_listed(named.pid, comm="x\\c")  # it may have been sampled before it named itself
    r = _run_script(bed, "epilog", _script_env(tmp_path, "4343", "1", ctl, GPUKILL_EPILOG_GRACE="1"))
    assert r.returncode == 0, r
    assert named.wait(5) is not None
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("gpukill-slurm: job 4343:")]
    assert f"PID {named.pid} (x\\c) terminated" in line, r.stderr


@needs_root
def test_the_epilog_says_the_ended_jobs_gpu_use_in_one_line(victims, users, tmp_path):
    """After the cleanup, the job's totals on this node from gpukilld's accounting (gpukillctl usage --job ID
    --by job), as systemd's "Consumed ..." line; a gpukillctl that fails there never fails the epilog."""
    bed = victims
    ctl = f'exec {PYTHON} -m gpukillctl "$@"'
    job = _job_victim(bed, users["owner"], "6161", gpu=0)
    bed.wait_listed(job.pid)
    time.sleep(3)
    started = int(time.time()) - 60
    r = _run_script(
        bed,
        "epilog",
        _script_env(tmp_path, "6161", "0", ctl, GPUKILL_EPILOG_GRACE="1", SLURM_JOB_START_TIME=str(started)),
    )
    assert r.returncode == 0, r
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("gpukill-slurm: job 6161 used: ")]
    assert re.fullmatch(
        r"gpukill-slurm: job 6161 used: GPU time [\d.]+s, SM time \S+( \S+)?, memory \d+\.\d+ GiB·h, "
        r"peak [\d.]+ \S+, energy [\d.]+ k?J; processes: 1( \(1 live\))?",
        line,
    ), line
    r = _run_script(bed, "epilog", _script_env(tmp_path, "6262", "", ctl))  # a job that never used a GPU here
    assert r.returncode == 0 and "gpukill-slurm: job 6262 used: no GPU on this node" in r.stderr, r
    fails = 'case "$1" in usage) echo "gpukillctl: GetUsage failed" >&2; exit 1 ;; esac; exec ' + ctl[5:]
    r = _run_script(bed, "epilog", _script_env(tmp_path, "6363", "", fails))
    assert r.returncode == 0 and "job 6363 used: unknown (gpukillctl: GetUsage failed)" in r.stderr, r
