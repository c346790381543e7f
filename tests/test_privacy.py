"""What callers see of other users' processes when /proc hides them (hidepid), in the real daemon.

The daemon reads a proc instance of its own mounted with hidepid= ([paths] proc), as a host's /proc would be;
root reads it whole, as it reads the host's. Unprivileged callers must see no more through gpukilld than that
mount shows them: listings, TestPolicies and Guard's status alike.
"""

from __future__ import annotations

import subprocess

import pytest
from helpers.marks import needs_root
from helpers.testbed import ADMIN_RULES, ROOT

pytestmark = needs_root

WATCH = (
    "rules:\n  - {name: watch, action: log, conditions: [{type: gpu_utilization, operator: '>', value: 50,"
    " duration: 1h}]}\n"
)


@pytest.fixture(params=["invisible", "noaccess"])
def hidden(request, fresh_bed, users):
    bed = fresh_bed
    proc = bed.workdir / "proc"
    proc.mkdir()
    # in the mount namespace the daemon runs in (the bed's journald's)
    subprocess.run(
        bed.in_journal_ns(["mount", "-t", "proc", "-o", f"hidepid={request.param}", "proc", str(proc)]), check=True
    )
    try:
        bed.start_polkit([ADMIN_RULES])
        (bed.workdir / "guard.d").mkdir()
        (bed.workdir / "guard.d" / "watch.yaml").write_text(WATCH)
        bed.write_conf(paths={"proc": proc})
        bed.start_daemon(args=["--sample-interval", "0.3"])
        yield bed, request.param
    finally:
        bed.stop_daemon()
        subprocess.run(bed.in_journal_ns(["umount", "-l", str(proc)]), check=False)


def test_hidepid_is_followed(hidden, users):
    bed, mode = hidden
    mine = bed.victim(users["owner"], gpu=0, util=90, comm="mine", padding=8)
    theirs = bed.victim(users["other"], gpu=0, util=90, comm="theirs", padding=8)
    bed.wait_listed(theirs.pid, comm="theirs")
    bed.wait_listed(mine.pid, comm="mine")

    seen = bed.listed(users["owner"])
    assert seen[mine.pid]["comm"] == "mine" and "xxxxxxxx" in seen[mine.pid]["cmdline"]
    if mode == "invisible":
        assert theirs.pid not in seen
    else:  # listed, with what /proc's directory shows (pid, owner) and the GPU facts, nothing of its files
        p = seen[theirs.pid]
        assert (p["user"], p["comm"], p["cmdline"], p["exe"], p["unit"]) == ("gpkother", "", "", None, None)
        assert p["gpu_utilization"] == 90
    for full in (ROOT, users["admin"]):  # root, and org.gpukill.view-all-processes through the example rules
        assert bed.listed(full)[theirs.pid]["comm"] == "theirs"

    # Guard's reports and tests: nothing about the other user's process either
    status = bed.guard_call(users["owner"], "GetStatus")
    assert status.ok, status
    subjects = {w["subject"] for w in status.body[0].get("windows", [])}
    assert any(f"PID {mine.pid} " in s for s in subjects) and not any(f"PID {theirs.pid} " in s for s in subjects)
    root_status = bed.guard_call(ROOT, "GetStatus").body[0]
    assert any(f"PID {theirs.pid} " in w["subject"] for w in root_status["windows"])
    r = bed.guard_call(users["owner"], "TestPolicies", "ss", ["", ""])
    assert r.ok and all(theirs.pid not in d["pids"] for d in r.body[0]), r
    probe = (
        "rules:\n  - {name: probe, action: log, conditions: [{type: process_name, operator: matches, value: '.'}]}\n"
    )
    r = bed.guard_call(users["owner"], "TestPolicies", "ss", ["p", probe])
    assert r.ok and [d["pids"] for d in r.body[0]] == [[mine.pid]], r


def test_a_workload_kills_answer_names_hidden_processes_as_the_listing_would():
    """KillWorkload's reply and its GPU answer, as seen by alice: bob's processes named without their names
    under hidepid=noaccess, and not at all (only counted) under hidepid=invisible, as her listing shows them."""
    import dataclasses

    from gpukill.records.reclaim import Holder, Reclaim, WorkloadEntry, WorkloadReply
    from gpukilld.access.visibility import ANONYMOUS, FULL, HIDDEN, PROGRAM, Viewer
    from gpukilld.bus.manager import _workload_as_seen

    alice, bob = 1000, 1001
    reply = WorkloadReply(
        "unit train.service",
        (
            WorkloadEntry(10, 1, alice, "trainer", "terminated"),
            WorkloadEntry(11, 2, bob, "bobs-secret", "access-denied"),
        ),
        Reclaim(
            "held",
            held=1 << 30,
            holders=(
                Holder(12, 3, bob, "bobs-holder", 0, 1 << 30, "unit"),
                Holder(13, 4, alice, "loader", 0, 1 << 20, "unit"),
            ),
        ),
    )
    for others in (FULL, PROGRAM):
        assert _workload_as_seen(reply, Viewer(alice, others)) == reply
    anonymous = _workload_as_seen(reply, Viewer(alice, ANONYMOUS))
    assert [(e.pid, e.comm) for e in anonymous.entries] == [(10, "trainer"), (11, "")] and anonymous.hidden == 0
    assert [(h.pid, h.comm) for h in anonymous.reclaim.holders] == [(12, ""), (13, "loader")]
    hidden = _workload_as_seen(reply, Viewer(alice, HIDDEN))
    assert [e.pid for e in hidden.entries] == [10] and hidden.hidden == 1
    assert [h.pid for h in hidden.reclaim.holders] == [13] and hidden.reclaim.more == 1
    assert "bobs" not in repr(hidden)
    assert _workload_as_seen(reply, Viewer(bob, HIDDEN)).entries == (dataclasses.replace(reply.entries[1]),)
