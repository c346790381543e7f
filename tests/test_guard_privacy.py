"""Guard's reports follow the viewer, and TestPolicies leaves no trace in the daemon's log; in the real daemon, on
a real bus, with real polkitd and journald.

gpkowner runs a miner whose evidence only its owner and root may see (a stratum URL and a wallet among its
arguments: a caller who may not see all is shown another user's command line up to its first word, and
AuditRogue none of that evidence). The policy in force scores it: root and gpkowner read why in GetStatus,
TestPolicies and PolicyViolated; gpkother reads that a rule holds, never the score or what matched.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from helpers.marks import needs_root
from helpers.testbed import ROOT, SYSTEM_PYTHON, Testbed
from helpers.waiting import wait_until

pytestmark = needs_root

INTERVAL = 0.3
POLICY = """\
rules:
  - name: score-watch
    action: log
    conditions: [{type: rogue_score, operator: '>=', value: 1, duration: 1h}]
  - name: score-now
    action: notify
    notify: [desktop]
    conditions: [{type: rogue_score, operator: '>=', value: 1}]
  - name: args
    action: log
    conditions: [{type: cmdline, operator: contains_any, value: ['stratum+tcp']}]
"""
WALLET = "0x" + "5a" * 20
MINER_ARGS = ["-o", "stratum+tcp://pool.example.net:3333", "-u", WALLET]
SCORE = re.compile(r"rogue_score \d")  # a reason with the score's value ("rogue_score 80 >= 1")


@pytest.fixture(scope="module")
def gbed(users):
    b = Testbed()
    try:
        (b.workdir / "guard.d").mkdir()
        (b.workdir / "guard.d" / "p.yaml").write_text(POLICY)
        b.write_conf()
        b.start_system(args=["--sample-interval", str(INTERVAL)])
        yield b
    finally:
        b.stop()


def _miner(bed: Testbed, user) -> subprocess.Popen:
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUKILL_SIM_GPU": "0",
        "GPUKILL_SIM_SCOPE": bed.scope,
        "GPUKILL_SIM_UTIL": "99",
        "GPUKILL_SIM_MEM": "2GiB",
    }
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", "import time\nprint('ready', flush=True)\ntime.sleep(600)\n", *MINER_ARGS],
        stdout=subprocess.PIPE,
        env=env,
        cwd="/",
        start_new_session=True,
        **user.popen_kwargs(),
    )
    bed.procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def _decisions(bed: Testbed, user, pid: int) -> dict[str, str]:
    """TestPolicies of the policy in force, as `user`: rule -> reason, for the decisions about pid."""
    r = bed.guard_call(user, "TestPolicies", "ss", ["", ""])
    assert r.ok, r
    return {d["rule"]: d["reason"] for d in r.body[0] if pid in d["pids"]}


def _windows(bed: Testbed, user, pid: int) -> list[str]:
    r = bed.guard_call(user, "GetStatus")
    assert r.ok, r
    return [w["condition"] for w in r.body[0].get("windows", []) if f"PID {pid} " in w["subject"]]


def test_reasons_about_another_users_process_withhold_what_the_viewer_may_not_see(gbed, users):
    bed, owner, other = gbed, users["owner"], users["other"]
    rec = bed.record_signals(other)
    miner = _miner(bed, owner)
    wait_until(lambda: len(_decisions(bed, ROOT, miner.pid)) == 3, 15, "the policy never held for the miner")
    # root and the owner: the score and what matched
    for viewer in (ROOT, owner):
        reasons = _decisions(bed, viewer, miner.pid)
        assert SCORE.search(reasons["score-watch"]) and SCORE.search(reasons["score-now"]), reasons
        assert "stratum+tcp" in reasons["args"], reasons
        assert _windows(bed, viewer, miner.pid) == ["rogue_score >= 1% for 1h"]
    # another user: that the rules hold (Guard acts in the open), not the score nor the arguments they matched
    reasons = _decisions(bed, other, miner.pid)
    assert reasons == {
        "score-watch": "rogue_score withheld",
        "score-now": "rogue_score withheld",
        "args": "cmdline withheld",
    }, reasons
    assert _windows(bed, other, miner.pid) == ["rogue_score withheld"]
    # what another user sees of the process itself, and of its audit, says no more
    seen = bed.listed(other)[miner.pid]
    assert "stratum" not in seen["cmdline"] and seen["exe"] is None
    # PolicyViolated goes to every listener: it carries the reason as others may read it
    for rule, shown in (("score-now", "rogue_score withheld"), ("args", "cmdline withheld")):
        sig = rec.wait_for(
            "PolicyViolated", 10, where=lambda b, rule=rule: b[0] == rule and f"PID {miner.pid} " in b[1]
        )
        assert sig is not None, rec.signals
        assert sig["body"][4]["reason"] == shown, sig
    # so does the desktop notice (the Notification signal, for the owner's agent, heard by every listener)
    note = rec.wait_for("Notification", 10, where=lambda b: b[1] == "score-now" and f"PID {miner.pid}" in b[3])
    assert note is not None, rec.signals
    assert "Why: rogue_score withheld" in note["body"][3] and not SCORE.search(note["body"][3]), note
    # the journal (root's to read) keeps the whole reason
    entry = bed.wait_journal(GPUKILL_RULE="score-now", GPUKILL_TARGET_PIDS=str(miner.pid))
    assert entry and SCORE.search(entry[0]["GPUKILL_REASON"]), entry


def test_test_policies_adds_no_line_to_the_daemons_log_or_journal(gbed, users):
    bed = gbed
    policy = "rules:\n  - {name: probe, action: log, conditions: [{type: gpu_memory, operator: '>', value: 0B}]}\n"
    r = bed.guard_call(users["other"], "TestPolicies", "ss", ["probe", policy])  # the first child, warmed up
    assert r.ok, r
    time.sleep(1.0)
    log_before = bed.daemon.log()

    def entries() -> int:  # but usage accounting's: an earlier test's victim may end while this one runs
        return sum(1 for e in bed.journal(_PID=str(bed.daemon.proc.pid)) if e.get("GPUKILL_EVENT") != "usage")

    journal_before = entries()
    for user in (users["other"], users["owner"]) * 5:
        r = bed.guard_call(user, "TestPolicies", "ss", ["probe", policy])
        assert r.ok, r
    time.sleep(1.0)  # a waiter thread's warning comes after the reply
    added = bed.daemon.log()[len(log_before) :]
    assert added == "", added
    assert entries() == journal_before
