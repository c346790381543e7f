"""Labels only from the trees that own them: a cgroup a user makes, named like a Slurm job, a pod or a container,
carries no label; a job id read from SLURM_JOB_ID counts only in slurmd's unit and is shown only to those who
could read that environment (the owner, root, view-all).

The parsing on recorded texts (cgroup v1 and v2), then real cgroups in the kernel's hierarchies: a real
unprivileged process moves itself into cgroups its user made under user@UID.service, as systemd's delegation
lets any user, and the real daemon lists it with no job, pod or container.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
from helpers.cgroups import SLEEPER, Cgroups, controller_root, enter, start_in, systemd_roots, why_no_cgroups
from helpers.marks import needs_root
from helpers.testbed import ROOT

from gpukilld.access.visibility import FULL, PROGRAM, Viewer, as_seen_by
from gpukilld.model import Attribution, GpuProcess
from gpukilld.proc.attribution import parse_cgroup, trusts_environment

ID = "4f1b6a0f3c2d" + "b" * 52
POD = "1b2c3d4e-5f60-4718-8a9b-0c1d2e3f4a5b"
USER_SVC = "/user.slice/user-1000.slice/user@1000.service"

FORGED = [
    # v2: in the user's own delegated subtree, any name
    f"0::{USER_SVC}/app.slice/job_4242\n",
    f"0::{USER_SVC}/app.slice/slurmstepd.scope/job_4242/step_0\n",
    f"0::{USER_SVC}/kubepods/burstable/pod{POD}/{ID}\n",
    f"0::{USER_SVC}/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/cri-containerd-{ID}.scope\n",
    f"0::{USER_SVC}/app.slice/docker-{ID}.scope\n",
    f"0::{USER_SVC}/system.slice/docker-{ID}.scope\n",
    f"0::/user.slice/user-1000.slice/session-3.scope/docker/{ID}\n",
    # below a system unit that delegates (Delegate=yes): its owner's names, not a runtime's
    f"0::/system.slice/jupyterhub.service/docker-{ID}.scope/job_7\n",
    # v1: the same in a controller's hierarchy, the job's layout below the user's subtree
    f"7:freezer:{USER_SVC}/slurm/uid_1000/job_4242/step_0\n4:memory:{USER_SVC}/docker/{ID}\n"
    f"1:name=systemd:{USER_SVC}/app.slice/pod{POD}\n0::{USER_SVC}/app.slice\n",
]


@pytest.mark.parametrize("text", FORGED)
def test_a_cgroup_a_user_can_make_carries_no_job_pod_or_container(text):
    a = parse_cgroup(text)
    assert (a.slurm_job, a.pod_uid, a.container_id) == (None, None, None), a


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the trees' owners: slurmstepd, the kubelet, the runtimes (v2 and v1, systemd and cgroupfs drivers)
        ("0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n", {"slurm_job": "4242"}),
        (
            "4:memory:/slurm/uid_1000/job_77/step_0/task_0\n1:name=systemd:/system.slice/slurmd.service\n0::/\n",
            {"slurm_job": "77"},
        ),
        ("4:memory:/slurm_node3/uid_1000/job_78/step_0\n", {"slurm_job": "78"}),
        # what the job's user makes below its own step names nothing new: the job is the first from the root
        ("0::/system.slice/slurmstepd.scope/job_5/step_0/user/task_0/job_6\n", {"slurm_job": "5"}),
        (
            f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice/"
            f"crio-{ID}.scope\n",
            {"pod_uid": POD, "container_id": ID},
        ),
        (
            f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/cri-containerd-{ID}.scope\n",
            {"pod_uid": POD, "container_id": ID},
        ),
        (
            f"9:cpu:/kubepods/pod{POD}/{ID}\n1:name=systemd:/kubepods/pod{POD}/{ID}\n",
            {"pod_uid": POD, "container_id": ID},
        ),
        (f"0::/system.slice/docker-{ID}.scope/inner.scope\n", {"container_id": ID}),
        (f"0::/machine.slice/libpod-{ID}.scope/container\n", {"container_id": ID}),
        (f"5:pids:/docker/{ID}\n", {"container_id": ID}),
        (f"5:pids:/libpod_parent/libpod-{ID}\n", {"container_id": ID}),
    ],
)
def test_the_trees_owners_give_the_labels(text, expected):
    a = parse_cgroup(text)
    got = {k: v for k, v in dataclasses.asdict(a).items() if k in ("slurm_job", "pod_uid", "container_id") and v}
    assert got == expected


@pytest.mark.parametrize(
    "text",
    [
        "0::/system.slice/slurmstepd.scope/job_12345678901/step_0\n",  # past 32 bits: not a job id
        "0::/system.slice/slurmstepd.scope/job_12x/step_0\n",
    ],
)
def test_job_ids_are_bounded(text):
    assert parse_cgroup(text).slurm_job is None


def test_unit_names_are_bounded_to_systemds_grammar():
    assert parse_cgroup(f"0::{USER_SVC}/app.slice/{'x' * 300}.service\n").unit == "user@1000.service"
    assert parse_cgroup(f"0::{USER_SVC}/app.slice/\x1b[31mred.service\n").unit == "user@1000.service"
    assert parse_cgroup(f"0::{USER_SVC}/app.slice/{'a' * 247}.service\n").unit == "a" * 247 + ".service"
    assert parse_cgroup("0::/system.slice/bad\u202e.service\n").system_unit is None


@pytest.mark.parametrize(
    ("text", "trusted"),
    [
        ("1:name=systemd:/system.slice/slurmd.service\n0::/system.slice/slurmd.service\n", True),  # linuxproc
        ("0::/system.slice/slurmstepd.scope\n", True),
        ("0::/system.slice/slurmd@node2.service\n", True),
        ("0::/system.slice/cron.service\n", False),  # users' cron jobs run here, with any environment
        ("0::/user.slice/user-1000.slice/session-3.scope\n", False),
        (f"0::{USER_SVC}/app.slice/slurmd.service\n", False),  # a user unit named like slurmd's
        ("0::/\n", False),  # no systemd: every process is here
        ("0::/system.slice/slurmstepd.scope/job_4/step_0\n", False),  # the cgroup names the job already
    ],
)
def test_the_environment_names_a_job_only_in_slurmds_unit(text, trusted):
    assert trusts_environment(parse_cgroup(text)) is trusted


def _proc(uid: int, job: str, from_environ: bool) -> GpuProcess:
    return GpuProcess(
        pid=10,
        start_time=1,
        uid=uid,
        user="u",
        comm="train",
        cmdline="train --x",
        device=0,
        device_id="GPU-0",
        slurm_job=job,
        job_from_environ=from_environ,
    )


def test_a_job_from_the_environment_is_shown_to_whoever_could_read_it():
    env_job, cgroup_job = _proc(1000, "4242", True), _proc(1000, "77", False)
    for viewer in (Viewer(1000, PROGRAM), Viewer(0, FULL), Viewer(1001, FULL)):  # the owner, root, view-all
        assert as_seen_by(env_job, viewer).slurm_job == "4242"
    assert as_seen_by(env_job, Viewer(1001, PROGRAM)).slurm_job is None
    assert as_seen_by(cgroup_job, Viewer(1001, PROGRAM)).slurm_job == "77"  # a cgroup is everyone's to read


# -- real cgroups, the real daemon ---------------------------------------------------------------------------

NO_CGROUPS = why_no_cgroups()


@pytest.fixture
def cgroups():
    if NO_CGROUPS:
        pytest.skip(NO_CGROUPS)
    c = Cgroups()
    yield c
    c.cleanup()


def _env(bed, **extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "GPUKILL_SIM_GPU": "0", "GPUKILL_SIM_SCOPE": bed.scope, **extra}


def _start(bed, proc: subprocess.Popen) -> subprocess.Popen:
    bed.procs.append(proc)
    return proc


@needs_root
def test_a_users_own_cgroups_named_like_a_job_pod_or_container_carry_no_label(victims, users, cgroups):
    bed, owner = victims, users["owner"]
    uid = owner.uid
    delegated = f"user.slice/user-{uid}.slice/user@{uid}.service"
    forged = f"app.slice/docker-{ID}.scope/pod{POD}/job_4242"
    freezer = controller_root("freezer")
    # systemd's delegation: user@UID.service's subtree belongs to its user, in systemd's hierarchies and here in
    # the freezer's too (as Delegate= does for the controllers it names)
    homes = [cgroups.make(r, delegated, owner=owner) for r in (*systemd_roots(), freezer)]
    # the user cannot make a tree at a hierarchy's root, where slurmd, the kubelet and the runtimes make theirs
    for r in (*systemd_roots(), freezer):
        denied = bed.run_as(owner, ["mkdir", str(r / "slurm")])
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    # the user makes, as themselves, cgroups named like a job's, a pod's and a container's in their own subtree
    paths = [h / forged for h in homes[:-1]] + [homes[-1] / f"slurm/uid_{uid}/job_4242/step_0"]
    for p in paths:
        made = bed.run_as(owner, ["mkdir", "-p", str(p)])
        assert made.returncode == 0, made
    cgroups.made.extend(
        sorted(
            {q for p in paths for q in [p, *p.parents] if q not in cgroups.made and any(h in q.parents for h in homes)},
            key=str,
        )
    )
    # a real process of the user's, started in its subtree (as systemd starts a user's processes), moves itself
    # into them, with a SLURM_JOB_ID of its choice
    victim = _start(bed, start_in(owner, homes, _env(bed, SLURM_JOB_ID="4242"), enter(paths) + SLEEPER))
    cgroup_text = Path(f"/proc/{victim.pid}/cgroup").read_text()
    assert "job_4242" in cgroup_text and f"docker-{ID}.scope" in cgroup_text and f"pod{POD}" in cgroup_text
    for viewer in (ROOT, owner):
        p = bed.wait_listed(victim.pid) and bed.listed(viewer)[victim.pid]
        assert (p.get("slurm_job"), p.get("pod_uid"), p.get("container_id")) == (None, None, None), p


@needs_root
def test_slurms_own_trees_label_the_job_and_an_environments_job_only_for_those_who_may_read_it(victims, users, cgroups):
    bed, owner, other = victims, users["owner"], users["other"]
    # proctrack/linuxproc (tests/package/test_booted_install.py's real Slurm): tasks sit in slurmd's unit with
    # SLURM_JOB_ID in their environment; a unit name of this bed's own, so runs side by side do not share it
    unit = [cgroups.make(r, f"system.slice/slurmd@{bed.scope}.service") for r in systemd_roots()]
    linuxproc = _start(bed, start_in(owner, unit, _env(bed, SLURM_JOB_ID="4242"), SLEEPER))
    # cgroup/v1: the job's cgroup under /slurm/uid_N in the controllers Slurm uses
    freezer = controller_root("freezer")
    step = [cgroups.make(freezer, f"slurm/uid_{owner.uid}/job_77/step_0")]
    in_job = _start(bed, start_in(owner, step, _env(bed, SLURM_JOB_ID="5"), SLEEPER))
    bed.wait_listed(linuxproc.pid)
    bed.wait_listed(in_job.pid)
    for viewer in (ROOT, owner, users["admin"]):  # root, the owner, view-all (the example polkit rules)
        listed = bed.listed(viewer)
        assert listed[linuxproc.pid]["slurm_job"] == "4242", viewer
        assert listed[in_job.pid]["slurm_job"] == "77", viewer  # the cgroup wins over the environment
    # another user: /proc/PID/environ is not theirs to read, so neither is the job id read from it; a cgroup is
    seen = bed.listed(other)
    assert seen[linuxproc.pid].get("slurm_job") is None and seen[in_job.pid]["slurm_job"] == "77"
    # and a Guard rule keyed on the job selects both, as root evaluates it
    rule = (
        "rules:\n  - {name: job, action: log, conditions: [{type: slurm_job, operator: in, value: ['4242', '77']}]}\n"
    )
    r = bed.guard_call(ROOT, "TestPolicies", "ss", ["job", rule])
    assert r.ok, r
    assert {pid for d in r.body[0] for pid in d["pids"]} >= {linuxproc.pid, in_job.pid}, r.body
    # the other user's test sees no env job of the owner's: a policy is no oracle for it
    r = bed.guard_call(other, "TestPolicies", "ss", ["job", rule])
    assert r.ok, r
    pids = {pid for d in r.body[0] for pid in d["pids"]}
    assert in_job.pid in pids and linuxproc.pid not in pids, r.body


def test_attribution_of_a_plain_v1_host():
    # this machine's layout: the unified hierarchy empty beside the v1 ones
    a = parse_cgroup("9:name=systemd:/\n8:pids:/\n4:memory:/process_api/475ed58bf1e457caa732a9850ef99b1d\n0::/\n")
    assert a == Attribution()
