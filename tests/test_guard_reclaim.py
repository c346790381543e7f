"""The shipped reclaim-idle policy (examples/guard.d/reclaim-idle.yaml) in the real daemon on the
simulated host, with its durations scaled down: a process holding memory at 0% and one at 0% with a burst every
2 s (a keep-alive, GPUKILL_SIM_UTIL_CYCLE) are warned on the schedule and then killed at the end of the grace; a
trainer at 90% and an idle process in an exempted unit (slurmstepd*) are untouched; every warning is journaled.

Scaled: 2h -> 6s (the memory and the mean windows), 30m -> 4s (the grace), warnings at_start, 2s and 1s before
its end (15m and 1m in the file); the keep-alive bursts 0.2 s of every 2 s (10%, as 1 s in 10 s), sampled
every 0.2 s. The test checks that nothing else differs from the shipped file."""

from __future__ import annotations

import signal
import time

import pytest
from helpers.cgroups import SLEEPER, Cgroups, start_in, systemd_roots, why_no_cgroups
from helpers.marks import needs_root
from helpers.procs import pid_alive
from helpers.testbed import REPO, ROOT, Testbed
from helpers.waiting import wait_until

from gpukill.policy import load_paths
from gpukilld import journal as audit

SHIPPED = REPO / "examples" / "guard.d" / "reclaim-idle.yaml"
TEXT = SHIPPED.read_text()
SCALED = (
    TEXT.replace("duration: 2h", "duration: 6s")
    .replace("grace_period: 30m", "grace_period: 4s")
    .replace("warn: [at_start, 15m, 1m]", "warn: [at_start, 2s, 1s]")
)
WINDOW, GRACE = 6.0, 4.0
RULE = "reclaim-idle-gpus"
KEEP_ALIVE = {"GPUKILL_SIM_UTIL_CYCLE": "100:0.2,0:1.8"}


def test_the_shipped_policy_is_valid_and_the_scaled_copy_differs_only_in_its_durations():
    (rule,) = load_paths([str(SHIPPED)]).rules
    assert rule.grace_period == 1800 and rule.warn == (1800, 900, 60)
    assert [c.text for c in rule.conditions] == [
        "gpu_memory > 256MiB for 2h",
        "gpu_utilization < 15% on average over 2h",
    ]
    diff = [(a, b) for a, b in zip(TEXT.splitlines(), SCALED.splitlines(), strict=True) if a != b]
    assert [a.split(":")[0].strip(" -{") for a, _ in diff] == ["type", "type", "grace_period", "warn"]


@pytest.fixture
def rbed(users, tmp_path):
    b = Testbed()
    made = Cgroups()
    try:
        (b.workdir / "guard.d").mkdir(exist_ok=True)
        b.start_system(args=["--sample-interval", "0.2"])
        policy = tmp_path / "reclaim.yaml"
        policy.write_text(SCALED)
        policy.chmod(0o644)
        b.enforce(policy)
        yield b, made
    finally:
        b.stop()
        made.cleanup()


def warnings_of(bed: Testbed, pid: int) -> list[dict]:
    return [
        e
        for e in bed.journal(MESSAGE_ID=audit.GUARD_WARNING.message_id, GPUKILL_RULE=RULE)
        if str(pid) in e.get("GPUKILL_TARGET_PIDS", "").split(",")
    ]


@needs_root
def test_idle_holders_and_keep_alives_are_warned_then_killed_and_workers_and_exempt_units_are_not(rbed, users):
    bed, made = rbed
    owner = users["owner"]
    t0 = time.monotonic()
    idle = bed.victim(owner, gpu=0, mem="4GiB", util=0, comm="notebook")
    keep_alive = bed.victim(owner, gpu=1, mem="4GiB", util=0, comm="keepgpu", env=KEEP_ALIVE)
    trainer = bed.victim(owner, gpu=2, mem="30GiB", util=90, comm="train")
    exempt = None
    if why_no_cgroups() is None:
        dirs = [made.make(r, f"system.slice/slurmstepd-{bed.scope}.scope") for r in systemd_roots()]
        exempt = start_in(
            owner,
            dirs,
            {
                "PATH": "/usr/bin:/bin",
                "GPUKILL_SIM_GPU": "3",
                "GPUKILL_SIM_MEM": "4GiB",
                "GPUKILL_SIM_UTIL": "0",
                "GPUKILL_SIM_SCOPE": bed.scope,
            },
            SLEEPER,
        )
        bed.procs.append(exempt)

    def in_grace() -> list[dict]:
        r = bed.guard_call(ROOT, "GetStatus")
        return [g for g in r.body[0]["graces"] if g["subject"].startswith(f"PID {idle.pid} ")] if r.ok else []

    grace = wait_until(
        lambda: [g for g in in_grace() if g["warnings_sent"] >= 2],
        WINDOW + GRACE + 10,
        "the idle process was never seen in its grace with its warnings",
    )
    assert grace[0]["remaining"] <= 2.2
    if grace[0]["warnings_sent"] == 2:  # the 1 s warning still to come (absent once it is sent)
        assert grace[0]["next_warning"] == pytest.approx(grace[0]["remaining"] - 1.0, abs=0.05)
    else:
        assert grace[0]["warnings_sent"] == 3 and "next_warning" not in grace[0]
    shown = bed.ctl(ROOT, "guard", "status")
    assert shown.returncode == 0 and "warning(s) sent" in shown.stdout, shown
    for proc in (idle, keep_alive):
        wait_until(lambda p=proc: p.poll() is not None, WINDOW + GRACE + 15, f"PID {proc.pid} still running")
        assert proc.returncode == -signal.SIGTERM
    assert time.monotonic() - t0 >= WINDOW + GRACE - 0.5, "killed before the window and the grace had run"
    time.sleep(1.0)
    assert pid_alive(trainer.pid), "the trainer at 90% was killed"
    if exempt is not None:
        assert pid_alive(exempt.pid), "the process in an exempted unit was killed"

    for proc in (idle, keep_alive):
        violation = [
            e
            for e in bed.journal(MESSAGE_ID=audit.GUARD_VIOLATION.message_id, GPUKILL_RULE=RULE)
            if e.get("GPUKILL_TARGET_PIDS") == str(proc.pid)
        ]
        assert len(violation) == 1 and "on average over 6s (mean" in violation[0]["GPUKILL_REASON"]
        warned = warnings_of(bed, proc.pid)
        assert [w["GPUKILL_WARNING"] for w in warned] == ["2", "3"], warned
        assert [float(w["GPUKILL_REMAINING"]) for w in warned] == pytest.approx([2.0, 1.0], abs=0.45)
        notices = [
            e
            for e in bed.journal(MESSAGE_ID=audit.GUARD_NOTICE.message_id, GPUKILL_RULE=RULE)
            if f"PID {proc.pid} " in e.get("GPUKILL_SUBJECT", "")
        ]
        # at_start (the violation's notice), the two warnings, then what the kill did
        assert [n["GPUKILL_RESULT"] for n in notices] == ["violation", "warning", "warning", "action"]
        # the owner target: each notice to the owner's desktop, and the terminals looked for, audited
        owner = [
            e
            for e in bed.journal(MESSAGE_ID=audit.GUARD_WARNING.message_id, GPUKILL_RESULT="owner-warned")
            if e.get("GPUKILL_SUBJECT", "").startswith(f"PID {proc.pid} ")
        ]
        assert sum(e["GPUKILL_CHANNEL"] == "desktop" for e in owner) == 4, owner
        assert any(e["GPUKILL_CHANNEL"] == "tty" for e in owner), owner
    for proc in [trainer] + ([exempt] if exempt is not None else []):
        assert not warnings_of(bed, proc.pid)
    if exempt is None:
        pytest.skip(f"the exempted unit was not tried: {why_no_cgroups()}")


@needs_root
def test_guard_test_leaves_a_busy_holder_out_of_the_kill_list_and_says_why(rbed, users):
    """`guard test` of the policy in force: the trainer (mean 90%, above the 15% threshold) is watched, not met,
    with its mean, not "kill in T"; the idle holder is in the kill list. Status lists only the idle one."""
    bed, _ = rbed
    owner = users["owner"]
    idle = bed.victim(owner, gpu=0, mem="4GiB", util=0, comm="notebook")
    trainer = bed.victim(owner, gpu=2, mem="30GiB", util=90, comm="train")

    def windows() -> list[dict]:
        r = bed.guard_call(ROOT, "GetStatus")
        return r.body[0]["windows"] if r.ok else []

    wait_until(
        lambda: {w["subject"].split(" ")[1] for w in windows()} >= {str(idle.pid)},
        5,
        "the idle holder never entered its windows",
    )
    assert not [w for w in windows() if w["subject"].startswith(f"PID {trainer.pid} ")], windows()
    shown = bed.ctl(ROOT, "guard", "status")
    assert shown.returncode == 0 and f"PID {idle.pid} (notebook" in shown.stdout, shown
    assert f"PID {trainer.pid} " not in shown.stdout, shown.stdout
    cli = bed.ctl(ROOT, "guard", "test")
    assert cli.returncode == 0, cli
    listed, _, watched = cli.stdout.partition("watched, not met")
    assert f"kill {idle.pid}" in listed and f"PID {trainer.pid} " not in listed, cli.stdout
    (line,) = [x for x in watched.splitlines() if f"PID {trainer.pid} " in x]
    assert line.strip() == (
        f"{RULE}: PID {trainer.pid} (train, user {owner.name}): not met: gpu_utilization < 15% "
        "on average over 6s (mean 90%)"
    ), cli.stdout


def test_the_simulated_keep_alive_pattern():
    from gpukilld.backends.simulated import parse_usage

    env = {"GPUKILL_SIM_GPU": "0", "GPUKILL_SIM_UTIL": "3", **KEEP_ALIVE}
    u = parse_usage(env)
    assert [u.utilization_now(t) for t in (0.0, 0.19, 0.2, 1.99, 2.05)] == [100, 100, 0, 0, 100]
    for bad in ("100", "100:0", "150:1", "x:1", "100:1,"):
        assert parse_usage({**env, "GPUKILL_SIM_UTIL_CYCLE": bad}).utilization_now(0.5) == 3  # ignored: the fixed value
