"""Self-healing resets in the real daemon: a simulated GPU put into `error` by its device file is reset by a Guard
`action: reset` rule after its duration, only once within the cooldown, not while a process holds it (without
force); with force its holder is killed first through the kill path; every reset is in the journal with its
rule; dry run and TestPolicies report it without resetting. The engine's rules in detail:
test_guard_reset_engine.py."""

from __future__ import annotations

import os
import time

import pytest
import yaml
from helpers.marks import needs_root
from helpers.testbed import ROOT, Testbed
from helpers.waiting import wait_until

from gpukill.device_faults import xid_reason
from gpukilld import journal as audit

pytestmark = needs_root

INTERVAL, DURATION, COOLDOWN = 0.2, 1.0, 10.0  # the smallest cooldown a policy may set
GPU0 = "GPU-8f1c6a2e-0b7d-4c1e-9a55-3d2e7f10a001"  # examples/simulate.yaml's first two devices
GPU1 = "GPU-8f1c6a2e-0b7d-4c1e-9a55-3d2e7f10a002"


def policy(name: str, force: bool) -> str:
    return (
        f"rules:\n  - name: {name}\n    scope: per_device\n    action: reset\n    force: {str(force).lower()}\n"
        f"    cooldown: {COOLDOWN:g}s\n    max_resets_per_hour: 5\n    conditions:\n"
        f"      - {{type: device_state, operator: ==, value: error, duration: {DURATION:g}s}}\n"
        "      - {type: recovery_action, operator: ==, value: GPU reset}\n"
    )


@pytest.fixture
def rbed(users):
    b = Testbed()
    try:
        (b.workdir / "guard.d").mkdir(exist_ok=True)
        b.write_conf()
        b.start_system(args=["--sample-interval", str(INTERVAL)])
        for args in (["enable"], ["dry-run", "off"]):
            assert b.ctl(ROOT, "guard", *args).returncode == 0
        yield b
    finally:
        b.stop()


def break_devices(bed: Testbed, *indexes: int) -> None:
    """Put devices into `error` (an Xid asking for a GPU reset) by editing the simulated device file."""
    sim = yaml.safe_load(bed.daemon.sim_path.read_text())
    for i in indexes:
        sim["devices"][i].update(state="error", state_reason=xid_reason(79, "GPU reset"))
    tmp = bed.daemon.sim_path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(sim))
    os.replace(tmp, bed.daemon.sim_path)


def load(bed: Testbed, name: str, text: str) -> None:
    path = bed.workdir / f"{name}.yaml"
    path.write_text(text)
    os.chmod(path, 0o644)
    r = bed.ctl(ROOT, "guard", "load", str(path))
    assert r.returncode == 0, r


def resets_of(bed: Testbed, device: str) -> list[dict]:
    return bed.journal(MESSAGE_ID=audit.RESET.message_id, GPUKILL_DEVICE=device)


def test_a_device_in_error_is_reset_once_per_cooldown_and_never_under_a_holder(rbed, users):
    bed = rbed
    holder = bed.victim(users["owner"], gpu=0, comm="trainer")
    bed.wait_listed(holder.pid, comm="trainer")
    rec = bed.record_signals()
    load(bed, "heal", policy("heal", force=False))
    break_devices(bed, 0)
    assert rec.wait_for("PolicyViolated", timeout=DURATION + 8, where=lambda b: b[0] == "heal") is not None
    # TestPolicies, open to anyone, says what holds the reset back and does nothing
    r = bed.guard_call(users["other"], "TestPolicies", "ss", ["", ""])
    assert r.ok, r
    (decision,) = [d for d in r.body[0] if d["rule"] == "heal"]
    assert decision["status"] == "waiting" and "held by 1 process(es)" in decision["reason"], decision
    time.sleep(DURATION + 1.5)
    assert resets_of(bed, GPU0) == [], "never reset while a process holds the device without force"
    assert holder.poll() is None
    holder.kill()
    holder.wait()
    t_gone = time.monotonic()
    (entry,) = bed.wait_journal(MESSAGE_ID=audit.RESET.message_id, GPUKILL_DEVICE=GPU0)
    assert time.monotonic() - t_gone < 5
    assert entry["GPUKILL_RULE"] == "heal" and entry["GPUKILL_INITIATOR"] == "guard:heal", entry
    assert "GPUKILL_CALLER_UID" not in entry and "reset #1" in entry["MESSAGE"]
    action = bed.wait_journal(MESSAGE_ID=audit.GUARD_ACTION.message_id, GPUKILL_RULE="heal")
    assert action and action[0]["GPUKILL_RESULT"] == "reset" and action[0]["GPUKILL_DEVICE"] == GPU0
    taken = rec.wait_for("GuardActionTaken", where=lambda b: b[0] == "heal")
    assert taken is not None and taken["body"][2:6] == ["reset", 0, 0, "reset"]
    assert rec.wait_for("DeviceReset") is not None
    # still in error (the file says so): within the cooldown nothing more, after it a second reset
    time.sleep(COOLDOWN - 3)
    assert len(resets_of(bed, GPU0)) == 1, "a second reset within the cooldown"
    wait_until(lambda: len(resets_of(bed, GPU0)) == 2, 8, "no second reset after the cooldown")
    stats = next(r for r in bed.guard_call(ROOT, "GetStatus").body[0]["rules"] if r["name"] == "heal")
    assert stats["resets"] == 2 and stats["failed"] == 0


def test_with_force_the_holder_is_killed_first_and_dry_run_resets_nothing(rbed, users):
    bed = rbed
    holder = bed.victim(users["owner"], gpu=1, comm="stuck")
    bed.wait_listed(holder.pid, comm="stuck")
    assert bed.ctl(ROOT, "guard", "dry-run", "on").returncode == 0
    load(bed, "heal-force", policy("heal-force", force=True))
    break_devices(bed, 1)
    dry = bed.wait_journal(MESSAGE_ID=audit.GUARD_DRY_RUN.message_id, GPUKILL_RULE="heal-force", timeout=DURATION + 8)
    assert dry and dry[0]["GPUKILL_RESULT"] == "would-reset" and dry[0]["GPUKILL_TARGET_PIDS"] == str(holder.pid)
    time.sleep(1.0)
    assert holder.poll() is None and resets_of(bed, GPU1) == [], "a dry run kills and resets nothing"
    assert bed.ctl(ROOT, "guard", "dry-run", "off").returncode == 0
    (entry,) = bed.wait_journal(MESSAGE_ID=audit.RESET.message_id, GPUKILL_DEVICE=GPU1)
    assert entry["GPUKILL_RULE"] == "heal-force" and entry["GPUKILL_KILLED"] == str(holder.pid)
    (kill,) = bed.journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(holder.pid))
    assert kill["GPUKILL_INITIATOR"] == "guard:heal-force", "the holder went through the kill path"
    assert holder.wait(5) is not None
