"""An owner asks for more time before a Guard kill, in the real daemon with real users and the real polkitd:
ReclaimPending reaches a bus listener with the process, its owner and the deadline when the grace starts; the
owner's `gpukillctl postpone` is granted within the rule's caps (`postpone: {max: 8s, times: 2}`), granted in
part past the max, refused past the times; another user's is refused by polkit (postpone-any needs an admin);
each postponement sends ReclaimPending again with the new deadline, shows in `guard status`, and is journaled;
the kill comes at the postponed deadline, not before. Durations are scaled down (a 6 s grace)."""

from __future__ import annotations

import signal
import time

import pytest
from helpers.marks import needs_root
from helpers.testbed import ROOT, Testbed, start_time_of
from helpers.waiting import wait_until

from gpukilld import journal as audit

RULE = "idle-gpu"
GRACE, MAX = 6.0, 8.0
POLICY = f"""rules:
  - name: {RULE}
    conditions:
      - {{type: gpu_utilization, operator: "<", value: 5}}
    action: kill
    grace_period: {GRACE:g}s
    postpone: {{max: {MAX:g}s, times: 2}}
"""


@pytest.fixture
def pbed(users, tmp_path):
    b = Testbed()
    try:
        (b.workdir / "guard.d").mkdir(exist_ok=True)
        b.start_system(args=["--sample-interval", "0.2"])
        policy = tmp_path / "postpone.yaml"
        policy.write_text(POLICY)
        policy.chmod(0o644)
        b.enforce(policy)
        yield b
    finally:
        b.stop()


def pending(rec, pid: int, after: float = 0.0) -> list:
    """The ReclaimPending signals about pid received so far, with a deadline past `after`."""
    return [
        s["body"]
        for s in rec.signals
        if s["member"] == "ReclaimPending" and s["body"][0] == pid and s["body"][5] > after
    ]


@needs_root
def test_the_owner_postpones_within_the_caps_and_the_kill_comes_at_the_new_deadline(pbed, users):
    bed = pbed
    owner, other = users["owner"], users["other"]
    listener = bed.record_signals(owner)
    victim = bed.victim(owner, gpu=0, mem="2GiB", util=0, comm="notebook")
    start = start_time_of(victim.pid)
    got = wait_until(lambda: pending(listener, victim.pid), 15, "no ReclaimPending for the idle process")
    pid, start_time, uid, unit, rule, deadline = got[0]
    assert (pid, start_time, uid, rule) == (victim.pid, start, owner.uid, RULE)
    assert isinstance(unit, str)
    assert deadline == pytest.approx(time.time() + GRACE, abs=2.5)

    # another user may not: postpone-any needs an admin, and nothing here can type a password
    refused = bed.ctl(other, "postpone", str(victim.pid), "5s", "--reason", "not mine")
    assert refused.returncode != 0 and "not authorized" in refused.stderr, refused

    first = bed.ctl(owner, "postpone", str(victim.pid), "5s", "--reason", "saving")
    assert first.returncode == 0, first
    assert f"rule {RULE}: granted 5s;" in first.stdout and "1 more postponement(s) allowed" in first.stdout
    moved = wait_until(lambda: pending(listener, victim.pid, deadline + 1), 5, "no ReclaimPending after it")
    assert moved[0][5] == pytest.approx(deadline + 5, abs=1)

    part = bed.guard_call(owner, "Postpone", "utds", [victim.pid, start, 5.0, "still saving"])
    assert part.ok, part
    (answer,) = part.body[0]["rules"]
    assert answer["granted"] == 3 and answer["left"] == 0
    assert answer["text"] == "granted 3s of 5s asked: the rule's max is 8s and 5s were granted before"
    final = answer["deadline"]
    assert final == pytest.approx(deadline + MAX, abs=1)

    third = bed.ctl(owner, "postpone", str(victim.pid), "1s")
    assert third.returncode == 1, third
    assert third.stderr.strip().endswith(f"rule {RULE} allows 2 postponements per episode; both used"), third

    status = bed.ctl(ROOT, "guard", "status")
    assert f"postponed 8s in 2 postponements by {owner.name}: still saving" in status.stdout, status.stdout

    # the kill comes at the postponed deadline, not at the grace's first end
    assert victim.poll() is None, "killed before the postponed deadline"
    wait_until(lambda: victim.poll() is not None, final - time.time() + 10, "never killed")
    killed_at = time.time()
    assert victim.returncode == -signal.SIGTERM
    assert killed_at >= final - 0.5, f"killed {final - killed_at:.1f}s before the postponed deadline"

    entries = bed.journal(MESSAGE_ID=audit.GUARD_POSTPONE.message_id)
    results = [(e.get("GPUKILL_RESULT"), e.get("GPUKILL_CALLER_UID")) for e in entries]
    assert results == [
        ("denied", str(other.uid)),
        ("granted", str(owner.uid)),
        ("partly-granted", str(owner.uid)),
        ("refused", str(owner.uid)),
    ], results
    granted = entries[1]
    assert granted["GPUKILL_RULE"] == RULE and granted["GPUKILL_TARGET_PID"] == str(victim.pid)
    assert granted["GPUKILL_TARGET_START_TIME"] == str(start) and granted["GPUKILL_POSTPONE_REASON"] == "saving"
    assert float(granted["GPUKILL_ASKED"]) == 5 and float(granted["GPUKILL_GRANTED"]) == 5
    assert float(granted["GPUKILL_DEADLINE"]) == pytest.approx(deadline + 5, abs=1)


@needs_root
def test_no_grace_pending_is_one_line(pbed, users):
    """A GPU process no kill rule counts down to (busy: the rule does not hold): refused in one line."""
    bed = pbed
    owner = users["owner"]
    busy = bed.victim(owner, gpu=1, mem="2GiB", util=90, comm="train")
    bed.wait_listed(busy.pid, comm="train")
    r = bed.ctl(owner, "postpone", str(busy.pid), "10min")
    assert r.returncode == 1 and r.stdout == "", r
    assert (
        r.stderr
        == f"gpukillctl: PID {busy.pid}: no grace is running on PID {busy.pid}: no kill rule is counting down to it\n"
    )
