"""A reload of gpukilld (SIGHUP, `systemctl reload`) never changes dry run or the policy in force behind the
admin's back: a policy loaded with `guard load` that kept Guard in dry run gives way to guard.d's, but dry run
stays on until an admin ends it, and the journal and `guard status` say what was replaced, by whom it had been
loaded and when. `guard dry-run off` says when the policy in force keeps dry run on.

The model, case by case, on the runner itself (no daemon); then in a real gpukilld on the simulated backend, with
polkitd (the example rules: group gpukill administers) and
journald; victims are real processes. The rules act after 1 s; the daemon samples every 0.2 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from helpers.marks import needs_root
from helpers.procs import pid_alive
from helpers.testbed import ADMIN_RULES, ROOT, Testbed
from helpers.waiting import wait_until

from gpukilld import journal as audit
from gpukilld.guard.notify import Notice, NotifyConfig
from gpukilld.guard.runner import GuardRunner
from gpukilld.guard.state import MAX_NOTE

INTERVAL = 0.2
ACT = 1.0  # seconds a miner must be busy before the rule kills it
ENFORCING = (
    "rules:\n  - name: miners\n    action: kill\n    force: true\n    conditions:\n"
    "      - {type: process_name, operator: ==, value: xmrig}\n"
    f"      - {{type: gpu_utilization, operator: '>', value: 95, duration: {ACT:g}s}}\n"
)
SITE = "dry_run: true\n" + ENFORCING.replace("name: miners", "name: site-miners")


def start(bed: Testbed) -> None:
    """guard.d holds an enforcing policy that kills a busy xmrig after ACT seconds; Guard is enabled."""
    (bed.workdir / "guard.d").mkdir()
    (bed.workdir / "guard.d" / "10-miners.yaml").write_text(ENFORCING)
    bed.write_conf()
    bed.start_polkit([ADMIN_RULES])
    bed.start_daemon(args=["--sample-interval", str(INTERVAL)])


def reload(bed: Testbed) -> None:
    """One reload, waited for as systemd waits for it: RELOADING=1, then READY=1."""
    t0 = time.monotonic()
    os.kill(bed.daemon.proc.pid, signal.SIGHUP)
    reloading = bed.daemon.notify.wait_for("RELOADING=1", 10, after=t0)
    assert reloading is not None and bed.daemon.notify.wait_for("READY=1", 10, after=reloading), bed.daemon.log()


def site_policy(bed: Testbed, text: str = SITE) -> str:
    path = bed.workdir / "site.yaml"
    path.write_text(text)
    os.chmod(path, 0o644)
    return str(path)


def kills_of(bed: Testbed, pid: int) -> list[dict]:
    return bed.journal(GPUKILL_TARGET_PID=str(pid), MESSAGE_ID=audit.KILL.message_id)


def killed(proc: subprocess.Popen, timeout: float) -> bool:
    return (
        wait_until(lambda: proc.poll() is not None, timeout, fail=False, interval=0.05)
        and proc.returncode == -signal.SIGTERM
    )


# -- the model, on the runner ------------------------------------------------------------------------------


class _Journal:
    def __init__(self) -> None:
        self.entries: list[tuple[str, str, dict]] = []

    def log(self, kind, message, **fields) -> None:
        self.entries.append((kind.name, message, fields))

    def results(self) -> list[str]:
        return [f.get("result", "") for _, _, f in self.entries]


def _runner(tmp_path, guard_d: str, journal: _Journal) -> GuardRunner:
    async def kill(*args):
        raise AssertionError("nothing is killed here")

    (tmp_path / "guard.d").mkdir(exist_ok=True)
    (tmp_path / "guard.d" / "10-miners.yaml").write_text(guard_d)
    runner = GuardRunner(kill, journal, NotifyConfig(), str(tmp_path / "guard.d"), str(tmp_path / "state"))
    runner.start()
    return runner


DRY = "dry_run: true\n"


# (guard.d at start, the admin's switch, a loaded policy or None, guard.d at the reload) -> dry run after it, kept
@pytest.mark.parametrize(
    ("start_d", "switch", "loaded", "reload_d", "dry_after", "kept"),
    [
        ("", False, DRY, "", True, True),  # the must-show case: guard load of a dry run, then a reload
        ("", False, "", "", False, False),  # an enforcing loaded policy: nothing held dry run on
        ("", True, "", "", True, False),  # the admin's switch is the admin's: a reload leaves it as it is
        (DRY, False, None, "", False, False),  # guard.d's own dry_run turned off: the admin edited the file
        (DRY, False, DRY, "", False, False),  # the same, with a loaded dry run in between
        ("", False, DRY, DRY, True, False),  # guard.d now says dry run itself: nothing to keep
        ("", False, None, "", False, False),  # nothing changed
    ],
    ids=[
        "loaded-dry",
        "loaded-enforcing",
        "switch-on",
        "files-edited",
        "files-edited-over-loaded",
        "files-dry",
        "unchanged",
    ],
)
def test_a_re_read_of_guard_d_ends_a_dry_run_only_when_guard_d_ends_it(
    tmp_path, start_d, switch, loaded, reload_d, dry_after, kept
):
    journal = _Journal()
    runner = _runner(tmp_path, start_d + ENFORCING, journal)
    runner.set_dry_run(switch, "uid 0")
    if loaded is not None:
        runner.load_policy("/srv/site.yaml", loaded + SITE.removeprefix(DRY), "uid 1000 (PID 7)", 1000)
    (tmp_path / "guard.d" / "10-miners.yaml").write_text(reload_d + ENFORCING)
    assert runner.reload_files()
    assert runner.dry_run is dry_after
    st = runner.status()
    assert bool(st.dry_run_kept) is kept and ("dry-run-kept" in journal.results()) is kept
    assert st.replaced.startswith("the policy /srv/site.yaml loaded by ") is (loaded is not None)


def test_what_a_reload_kept_and_replaced_survives_a_restart(tmp_path):
    journal = _Journal()
    runner = _runner(tmp_path, ENFORCING, journal)
    runner.load_policy("/srv/site.yaml", SITE, "uid 0 (PID 7)", 0)
    assert runner.status().loaded_by == "root (uid 0)"
    assert runner.reload_files()
    before = runner.status()
    runner.stop()
    again = _runner(tmp_path, ENFORCING, _Journal())
    after = again.status()
    assert after.dry_run is True and again.dry_run is True
    assert (after.dry_run_kept, after.replaced, after.replaced_at) == (
        before.dry_run_kept,
        before.replaced,
        before.replaced_at,
    )
    assert before.dry_run_kept and before.replaced
    again.set_dry_run(False, "uid 0")  # the admin ends it: enforcing, and nothing says "kept" any more
    assert again.dry_run is False and again.status().dry_run_kept == ""
    again.stop()


def test_what_a_reload_keeps_is_bounded_by_the_policy_names_bound(tmp_path):
    """LoadPolicy takes names of up to 4096 characters: the sentences that carry one stay whole, and are read
    back whole after a restart."""
    runner = _runner(tmp_path, ENFORCING, _Journal())
    name = "/srv/" + "n" * (4096 - len("/srv/.yaml")) + ".yaml"
    runner.load_policy(name, SITE, "uid 0 (PID 7)", 0)
    assert runner.reload_files()
    st = runner.status()
    assert name in st.replaced and name in st.dry_run_kept and len(st.dry_run_kept) <= MAX_NOTE
    runner.stop()
    again = _runner(tmp_path, ENFORCING, _Journal()).status()
    assert (again.replaced, again.dry_run_kept) == (st.replaced, st.dry_run_kept)


def test_owner_warnings_are_still_journaled_after_a_reload_changes_the_relay(tmp_path):
    """A reload that changes [notify] builds a new notifier: each warning to an owner is still audited."""
    journal = _Journal()
    runner = _runner(tmp_path, ENFORCING, journal)
    runner.configure(
        NotifyConfig(smtp_port=2525, logind_bus=None),
        str(tmp_path / "guard.d"),
        str(tmp_path / "state"),
        runner.engine.protection,
    )
    runner.notifier.send(("owner",), Notice("warning", "miners", "user nobody", "miners: warned", "body"))
    warned = [fields for kind, _, fields in journal.entries if fields.get("result") == "owner-warned"]
    assert [(w["channel"], w["outcome"]) for w in warned] == [("owner", "skipped")]
    runner.stop()


# -- in the daemon ---------------------------------------------------------------------------------------------


@needs_root
def test_a_reload_after_guard_load_keeps_dry_run_and_says_what_it_replaced(fresh_bed, users):
    bed = fresh_bed
    start(bed)
    admin = users["admin"]
    site = site_policy(bed)
    load = bed.ctl(admin, "guard", "load", site)
    assert load.returncode == 0, load
    assert load.stdout.strip() == (
        f"policy {site} in force until the next reload of gpukilld (systemctl reload, "
        "SIGHUP) or guard load: 1 rule(s): site-miners"
    )
    st = bed.guard_status()
    assert st["source"] == "loaded" and st["loaded_by"] == f"gpkadmin (uid {admin.uid})" and st["loaded_at"] > 0
    shown = bed.ctl(ROOT, "guard", "status").stdout
    assert f"policy: {site} (loaded with gpukillctl guard load by gpkadmin (uid {admin.uid}) at " in shown, shown
    assert "until the next reload of gpukilld or guard load)" in shown and "DRY RUN" in shown

    miner = bed.victim(users["owner"], gpu=0, util=99, comm="xmrig")
    assert bed.wait_journal(MESSAGE_ID=audit.GUARD_DRY_RUN.message_id, GPUKILL_TARGET_PID=str(miner.pid)), (
        "the loaded policy, a dry run, reports the miner it would kill"
    )
    reload(bed)  # logrotate, config management or a colleague: systemctl reload gpukilld
    t_reload = time.monotonic()

    st = bed.guard_status()
    assert [r["name"] for r in st["rules"]] == ["miners"] and st["source"] == "files", "guard.d's is in force"
    assert st["dry_run"] is True and st["policy_dry_run"] is False
    assert st["loaded_by"] == "" and st["replaced_at"] > 0
    assert st["replaced"].startswith(f"the policy {site} loaded by gpkadmin (uid {admin.uid}) at "), st["replaced"]
    assert st["dry_run_kept"].startswith("kept on when guard.d was re-read (reload) at "), st["dry_run_kept"]
    assert f"the policy it replaced, {st['replaced']}, had dry_run: true" in st["dry_run_kept"]

    # well past the rule's act time: the miner lives, nothing reached the kill path
    time.sleep(max(0.0, t_reload + ACT + 10 * INTERVAL + 1.0 - time.monotonic()))
    assert pid_alive(miner.pid) and kills_of(bed, miner.pid) == []
    would = bed.wait_journal(MESSAGE_ID=audit.GUARD_DRY_RUN.message_id, GPUKILL_RULE="miners")
    assert would and would[0]["GPUKILL_TARGET_PID"] == str(miner.pid), "guard.d's rule, still a dry run"

    loaded = bed.journal(
        MESSAGE_ID=audit.GUARD_POLICY.message_id, GPUKILL_RESULT="loaded", GPUKILL_REQUESTED_BY="reload"
    )
    assert loaded and loaded[-1]["GPUKILL_REPLACED"] == st["replaced"]
    assert loaded[-1]["MESSAGE"].endswith(f"rules miners; it replaces {st['replaced']}")
    kept = bed.journal(MESSAGE_ID=audit.GUARD_POLICY.message_id, GPUKILL_RESULT="dry-run-kept")
    assert [e["MESSAGE"] for e in kept] == [f"Guard dry run {st['dry_run_kept']}"]

    shown = bed.ctl(ROOT, "guard", "status").stdout
    lines = shown.splitlines()
    assert lines[0] == "guard: enabled, DRY RUN (nothing is signalled)", shown
    assert lines[1] == f"dry run: {st['dry_run_kept']}"
    assert lines[2] == f"policy: {bed.workdir / 'guard.d' / '10-miners.yaml'} (guard.d)"
    assert lines[3].startswith("replaced at ") and lines[3].endswith(f"by a re-read of guard.d: {st['replaced']}")

    # the admin ends the dry run: guard.d's rule enforces at once
    off = bed.ctl(admin, "guard", "dry-run", "off")
    assert off.returncode == 0 and off.stderr == "", off
    assert killed(miner, ACT + 8), "enforcing once the admin ended the dry run"
    st = bed.guard_status()
    assert st["dry_run"] is False and st["dry_run_kept"] == ""


@needs_root
def test_a_reload_over_an_enforcing_loaded_policy_enforces_and_says_what_it_replaced(fresh_bed, users):
    bed = fresh_bed
    start(bed)
    site = site_policy(bed, SITE.replace("dry_run: true\n", ""))
    assert bed.ctl(ROOT, "guard", "load", site).returncode == 0
    reload(bed)
    st = bed.guard_status()
    assert st["dry_run"] is False and st["dry_run_kept"] == "" and st["source"] == "files"
    assert st["replaced"].startswith(f"the policy {site} loaded by root (uid 0) at ")
    miner = bed.victim(users["owner"], gpu=0, util=99, comm="xmrig")
    assert killed(miner, ACT + 8), "nothing held dry run on: guard.d's rule enforces"
    # the next `guard load` is the admin's own act: what the reload replaced is no longer news
    assert bed.ctl(ROOT, "guard", "load", site).returncode == 0
    assert bed.guard_status()["replaced"] == ""


@needs_root
def test_a_dry_run_that_guard_d_itself_ends_ends_on_reload(fresh_bed, users):
    """The files changed it: guard.d said dry_run: true when last read and no longer does."""
    bed = fresh_bed
    (bed.workdir / "guard.d").mkdir()
    policy = bed.workdir / "guard.d" / "10-miners.yaml"
    policy.write_text("dry_run: true\n" + ENFORCING)
    bed.write_conf()
    bed.start_polkit([ADMIN_RULES])
    bed.start_daemon(args=["--sample-interval", str(INTERVAL)])
    assert bed.guard_status()["policy_dry_run"] is True
    policy.write_text(ENFORCING)
    reload(bed)
    st = bed.guard_status()
    assert st["dry_run"] is False and st["policy_dry_run"] is False and st["dry_run_kept"] == ""
    assert "enabled, enforcing" in bed.ctl(ROOT, "guard", "status").stdout


@needs_root
def test_dry_run_off_says_when_the_policy_in_force_keeps_it_on(fresh_bed, users):
    bed = fresh_bed
    start(bed)
    site = site_policy(bed)
    assert bed.ctl(ROOT, "guard", "load", site).returncode == 0
    assert bed.ctl(ROOT, "guard", "dry-run", "on").returncode == 0
    off = bed.ctl(users["admin"], "guard", "dry-run", "off")
    assert off.returncode == 0, off  # the switch is off, as asked
    assert off.stdout == "guard dry run off\n"
    assert off.stderr == (
        f"gpukillctl: dry run stays on: the policy in force ({site}) sets dry_run: true; "
        "remove it there and load or reload the policy to enforce\n"
    )
    shown = bed.ctl(ROOT, "guard", "status").stdout.splitlines()
    assert shown[:2] == [
        "guard: enabled, DRY RUN (nothing is signalled)",
        f"dry run: the policy in force ({site}) sets dry_run: true",
    ], shown
    entry = bed.wait_journal(MESSAGE_ID=audit.GUARD_POLICY.message_id, GPUKILL_RESULT="dry-run-off")
    assert (
        entry
        and entry[-1]["MESSAGE"].endswith(f"; dry run stays on: the policy in force ({site}) sets dry_run: true")
        and entry[-1]["GPUKILL_DRY_RUN"] == "1"
    )
    miner = bed.victim(users["owner"], gpu=0, util=99, comm="xmrig")
    time.sleep(ACT + 10 * INTERVAL + 1.0)
    assert pid_alive(miner.pid) and kills_of(bed, miner.pid) == []
