"""The authorization matrix with real users, a real polkitd with our .policy and the example rules, and the
audit trail in a real journald."""

from __future__ import annotations

import pytest
from helpers.marks import needs_root
from helpers.testbed import ADMIN_RULES

from gpukilld import journal as audit

pytestmark = needs_root

DENIED = "org.freedesktop.DBus.Error.AccessDenied"

# caller, whose process, allowed?  (owner/other: plain users; admin: in group "gpukill", see the example rules)
KILL_MATRIX = [
    ("root", "root", True),
    ("root", "owner", True),
    ("owner", "owner", True),
    ("owner", "other", False),
    ("other", "other", True),
    ("other", "owner", False),
    ("admin", "admin", True),
    ("admin", "owner", True),
]
RESET_MATRIX = [("root", True), ("owner", False), ("other", False), ("admin", True)]


def _one(entries: list[dict]) -> dict:
    assert len(entries) == 1, entries
    return entries[0]


@pytest.mark.parametrize(("caller", "target", "allowed"), KILL_MATRIX)
def test_kill_matrix(victims, users, alive, caller, target, allowed):
    bed = victims
    victim = bed.victim(users[target], gpu=0, mem="1GiB", comm=f"victim-{target}"[:15])
    listed = bed.wait_listed(victim.pid)
    r = bed.manager(
        users[caller], "KillProcess", "uta{sv}", [victim.pid, listed["start_time"], {"grace": {"$variant": ["d", 3.0]}}]
    )
    expected_action = "org.gpukill.kill-own-process" if caller == target else "org.gpukill.kill-any-process"
    if allowed:
        assert r.ok, r
        assert r.body == ["terminated"]
        victim.wait(5)
        entry = _one(bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id))
        assert entry["GPUKILL_RESULT"] == "terminated"
    else:
        assert not r.ok and r.error == DENIED, r
        assert "not authorized" in r.message
        assert alive(victim.pid), "a denied kill must not signal"
        entry = _one(bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL_DENIED.message_id))
        assert entry["GPUKILL_RESULT"] == "denied"
        assert bed.journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id) == []
    assert entry["GPUKILL_ACTION"] == "kill"
    assert entry["GPUKILL_POLKIT_ACTION"] == expected_action
    assert entry["GPUKILL_CALLER_UID"] == str(users[caller].uid)
    assert int(entry["GPUKILL_CALLER_PID"]) > 0
    assert entry["GPUKILL_TARGET_UID"] == str(users[target].uid)
    assert entry["GPUKILL_TARGET_COMM"] == f"victim-{target}"[:15]
    assert entry["GPUKILL_DEVICE"] == listed["device_id"]
    assert entry["SYSLOG_IDENTIFIER"] == "gpukilld"


@pytest.mark.parametrize(("caller", "allowed"), RESET_MATRIX)
def test_reset_matrix(bed, users, caller, allowed):
    device = "2"  # a simulated device without processes whose reset succeeds
    kind = audit.RESET if allowed else audit.RESET_DENIED
    # other tests in the session may have written reset entries of other kinds for this caller: count this kind
    before = len(bed.journal(MESSAGE_ID=kind.message_id, GPUKILL_CALLER_UID=str(users[caller].uid)))
    r = bed.manager(users[caller], "ResetDevice", "sa{sv}", [device, {}])
    if allowed:
        assert r.ok, r
        assert r.body[0]["device"] == 2
    else:
        assert not r.ok and r.error == DENIED, r
    entries = bed.wait_journal(MESSAGE_ID=kind.message_id, GPUKILL_CALLER_UID=str(users[caller].uid))
    assert len(entries) == before + 1
    entry = entries[-1]
    assert entry["GPUKILL_POLKIT_ACTION" if not allowed else "GPUKILL_RESULT"] == (
        "org.gpukill.reset-device" if not allowed else "reset"
    )
    assert entry["GPUKILL_DEVICE_INDEX"] == "2"
    assert entry["GPUKILL_DEVICE"] == "0000:c1:00.0"
    assert int(entry["GPUKILL_CALLER_PID"]) > 0


def test_polkitd_absent_means_denied(victims, users, alive):
    """Without polkitd no unprivileged caller is authorized, not even for its own process's sake by accident."""
    bed = victims
    victim = bed.victim(users["owner"], gpu=1)
    listed = bed.wait_listed(victim.pid)
    bed.stop_polkit()
    try:
        r = bed.manager(users["admin"], "KillProcess", "uta{sv}", [victim.pid, listed["start_time"], {}])
        assert not r.ok and r.error == DENIED, r
        assert "polkit unavailable" in r.message
        assert alive(victim.pid)
        # root needs no polkit
        r = bed.manager(users["root"], "KillProcess", "uta{sv}", [victim.pid, listed["start_time"], {}])
        assert r.ok, r
    finally:
        bed.start_polkit([ADMIN_RULES])


def test_unmapped_method_is_denied(bed, users):
    """The bouncer denies a member of our interface that its table does not map, before any handler runs."""
    for user in ("root", "other"):
        r = bed.manager(users[user], "Frobnicate", "", [])
        assert r.error == DENIED, r
        assert "not a method gpukilld allows" in r.message
