"""Guard `action: suspend` in the real daemon on the fake NVIDIA host: the C NVML fake and the fake cuda-checkpoint
(tests/helpers/fake_cuda_checkpoint/, installed by FakeNvidiaHost.install_cuda_checkpoint) sharing its state. The
shipped examples/guard.d/reclaim-idle-suspend.yaml, its durations scaled down, suspends an idle process: in dry run
not at all (the journal says it would), for real through the daemon's suspend path (its memory gone from the
listing, listed as suspended by the rule, journaled with the rule, alive and stopped, never killed), and its owner
reads how to resume it, in the rule's notice and on their desktop (the notification agent with a dbusmock server
in their session), as they do when an admin suspends and resumes their workload by hand.

Scaled: 2h -> 2s (the memory and the mean windows), 30m -> 2s (the grace), warnings at_start and 1s before its end.
"""

from __future__ import annotations

import time

import pytest
from helpers.desktop_session import DesktopSession, dbusmock_missing
from helpers.marks import needs_root
from helpers.nvml_host import fake_nvidia_host
from helpers.procs import pid_alive
from helpers.testbed import REPO, ROOT, Testbed, User
from helpers.waiting import wait_until

from gpukill.outcome import guard_initiator
from gpukilld import journal as audit

pytestmark = needs_root

GIB = 2**30
TEXT = (REPO / "examples" / "guard.d" / "reclaim-idle-suspend.yaml").read_text()
SCALED = (
    TEXT.replace("duration: 2h", "duration: 2s")
    .replace("grace_period: 30m", "grace_period: 2s")
    .replace("warn: [at_start, 15m, 1m]", "warn: [at_start, 1s]")
)
RULE = "reclaim-idle-gpus"
WAIT = 15.0  # the windows, the grace and a few samples, with room for a loaded machine


@pytest.fixture(scope="module")
def nvhost(tmp_path_factory):
    host = fake_nvidia_host(tmp_path_factory.mktemp("nvml"), devices=2)
    host.install_cuda_checkpoint()
    return host


def start(bed: Testbed, nvhost) -> None:
    (bed.workdir / "guard.d").mkdir(exist_ok=True)
    bed.write_conf(daemon={"backends": "nvidia", "cuda_checkpoint": nvhost.bin / "cuda-checkpoint"})
    bed.start_daemon(args=["--sample-interval", "0.2"], env=nvhost.env())


@pytest.fixture
def gbed(fresh_bed, nvhost, users):
    saved = nvhost.snapshot()
    fresh_bed.start_polkit()
    start(fresh_bed, nvhost)
    try:
        yield fresh_bed
    finally:
        fresh_bed.stop_daemon()
        nvhost.state = saved
        nvhost.write()


def idle(bed: Testbed, nvhost, owner: User, comm: str = "notebook") -> int:
    """A process of owner's holding 1 GiB of GPU 0 at 0% (no utilization samples: NVML's NOT_FOUND), listed."""
    p = bed.victim(owner, comm=comm)
    nvhost.refresh()  # the fake cuda-checkpoint writes the state too
    nvhost.add_process(0, p.pid, GIB)
    nvhost.write()
    bed.wait_listed(p.pid, comm=comm)
    return p.pid


def guard(bed: Testbed, *commands: list[str]) -> None:
    for args in commands:
        r = bed.ctl(ROOT, "guard", *args)
        assert r.returncode == 0, r


def policy_file(bed: Testbed):
    path = bed.workdir / "reclaim-idle-suspend.yaml"
    path.write_text(SCALED)
    path.chmod(0o644)
    return path


def suspended(bed: Testbed) -> dict[int, dict]:
    r = bed.manager(ROOT, "ListSuspended")
    assert r.ok, r
    return {p["pid"]: p for p in r.body[0]}


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def test_reclaim_idle_with_action_suspend_would_suspend_in_dry_run_then_suspends(gbed, nvhost, users):
    bed, owner = gbed, users["owner"]
    heard = bed.record_signals(owner)
    guard(bed, ["enable"], ["dry-run", "on"], ["load", str(policy_file(bed))])
    pid = idle(bed, nvhost, owner)

    (dry,) = wait_until(
        lambda: bed.journal(
            MESSAGE_ID=audit.GUARD_DRY_RUN.message_id, GPUKILL_RESULT="would-suspend", GPUKILL_TARGET_PID=str(pid)
        ),
        WAIT,
        "no would-suspend in the journal",
    )
    assert f"would suspend PID {pid} (notebook, 1.0 GiB, user {owner.name})" in dry["MESSAGE"], dry["MESSAGE"]
    assert dry["MESSAGE"].endswith("nothing was suspended") and dry["GPUKILL_RULE"] == RULE
    time.sleep(1.0)  # a few more evaluations: still nothing done
    assert pid in bed.listed() and not stopped(pid) and suspended(bed) == {}
    assert [c for c in nvhost.checkpoint_calls() if c.get("pid") == pid] == []
    (rule,) = bed.guard_status()["rules"]
    assert (rule["action"], rule["would_suspend"], rule["suspends"]) == ("suspend", 1, 0)

    guard(bed, ["dry-run", "off"])
    bed.wait_listed(pid, timeout=WAIT, present=False)
    held = wait_until(lambda: suspended(bed).get(pid), 5, "not listed as suspended")
    assert (held["state"], held["memory"], held["initiator"]) == ("suspended", GIB, guard_initiator(RULE))
    wait_until(lambda: bed.listing()["devices"][0]["memory_used"] == 0, 5, "the GPU's memory was not freed")
    assert pid_alive(pid) and stopped(pid)  # suspended and frozen, never killed
    assert nvhost.checkpoint_states()[pid] == "checkpointed"
    (entry,) = bed.wait_journal(MESSAGE_ID=audit.SUSPEND.message_id, GPUKILL_TARGET_PID=str(pid))
    assert entry["GPUKILL_INITIATOR"] == guard_initiator(RULE) and "GPUKILL_CALLER_UID" not in entry, entry
    assert f"requested by {guard_initiator(RULE)}" in entry["MESSAGE"]
    (done,) = bed.wait_journal(MESSAGE_ID=audit.GUARD_ACTION.message_id, GPUKILL_RULE=RULE, GPUKILL_TARGET_PID=str(pid))
    assert done["GPUKILL_RESULT"] == "suspended", done
    assert f"suspended; resume with: gpukillctl resume {pid}" in done["MESSAGE"], done["MESSAGE"]
    notices = bed.journal(MESSAGE_ID=audit.GUARD_NOTICE.message_id, GPUKILL_RULE=RULE)
    assert any(f"resume with: gpukillctl resume {pid}" in n["MESSAGE"] for n in notices), notices
    (rule,) = bed.guard_status()["rules"]
    assert (rule["suspends"], rule["kills"], rule["failed"]) == (1, 0, 0)
    signal = heard.wait_for("ProcessSuspended")
    assert signal is not None and signal["body"][0]["pid"] == pid, signal
    taken = heard.wait_for("GuardActionTaken", where=lambda body: body[5] == "suspended")
    assert taken is not None and taken["body"][2] == "suspend" and taken["body"][3] == pid, taken

    r = bed.ctl(owner, "resume", str(pid))  # as the notice says
    assert r.returncode == 0, r
    bed.wait_listed(pid)
    assert not stopped(pid)


def test_a_suspend_refused_here_is_the_rules_outcome_and_never_a_kill(gbed, nvhost, users):
    bed, owner = gbed, users["owner"]
    bed.stop_daemon()
    bed.write_conf(  # a cap of host memory held below the process's 1 GiB: refused, one line
        daemon={
            "backends": "nvidia",
            "cuda_checkpoint": nvhost.bin / "cuda-checkpoint",
            "suspend_host_memory_max": "512MiB",
        }
    )
    bed.start_daemon(args=["--sample-interval", "0.2"], env=nvhost.env())
    guard(bed, ["enable"], ["dry-run", "off"], ["load", str(policy_file(bed))])
    pid = idle(bed, nvhost, owner)
    (done,) = wait_until(
        lambda: bed.journal(MESSAGE_ID=audit.GUARD_ACTION.message_id, GPUKILL_TARGET_PID=str(pid)),
        WAIT,
        "the rule's outcome was never journaled",
    )
    assert done["GPUKILL_RESULT"] == "not-supported", done
    assert "not suspended: " in done["MESSAGE"] and "suspend_host_memory_max" in done["MESSAGE"], done["MESSAGE"]
    time.sleep(2.0)  # past the cooldown: not ordered again, never killed
    assert pid_alive(pid) and not stopped(pid) and pid in bed.listed()
    assert len(bed.journal(MESSAGE_ID=audit.GUARD_ACTION.message_id, GPUKILL_TARGET_PID=str(pid))) == 1
    assert bed.journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(pid)) == []
    assert suspended(bed) == {}


@pytest.mark.skipif(dbusmock_missing() is not None, reason=dbusmock_missing() or "")
def test_the_owners_desktop_hears_of_an_admins_suspend_and_resume_and_of_guards(gbed, nvhost, users):
    bed, owner = gbed, users["owner"]
    session = DesktopSession(bed, owner)
    session.start_bus()
    session.start_server()
    session.start_agent()

    def suspend_by_root() -> tuple[int, object]:
        """Until the agent has subscribed (nothing tells when), a suspend may go unseen: try again."""
        for _ in range(10):
            before = len(session.notifications())
            pid = idle(bed, nvhost, owner, comm="mine")
            r = bed.ctl(ROOT, "suspend", str(pid))
            assert r.returncode == 0, r
            shown = wait_until(lambda b=before: session.notifications()[b:], 3, fail=False)
            if shown:
                return pid, shown[-1]
        raise AssertionError(f"the agent never showed a suspend:\n{session.agent_log()}")

    pid, n = suspend_by_root()
    assert n.summary == f"GPU process suspended: mine (PID {pid})", n
    assert "1.0 GiB of GPU memory set aside in host memory, asked by root" in n.body, n
    assert f"resume with: gpukillctl resume {pid}" in n.body, n
    mark = len(session.notifications())
    assert bed.ctl(ROOT, "resume", str(pid)).returncode == 0
    (back,) = wait_until(lambda: session.notifications()[mark:], 5, "no notice of the resume")
    assert back.summary == f"GPU process resumed: mine (PID {pid})" and "asked by root" in back.body, back

    guard(bed, ["enable"], ["dry-run", "off"], ["load", str(policy_file(bed))])
    mark = len(session.notifications())
    idle_pid = idle(bed, nvhost, owner)
    final = wait_until(
        lambda: [n for n in session.notifications()[mark:] if "resume with" in n.body and f"{idle_pid}" in n.body],
        WAIT,
        lambda: f"no notice of Guard's suspend: {session.notifications()[mark:]}",
    )
    assert f"notebook (PID {idle_pid}) suspended; resume with: gpukillctl resume {idle_pid}." in final[-1].body
    shown = session.notifications()[mark:]
    assert any(s.summary.endswith("will be suspended in 2s") for s in shown), shown
