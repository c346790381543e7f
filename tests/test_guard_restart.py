"""Guard's clocks across a daemon restart: windows, graces and counters are not started again.

First the engine with injected clocks (clocks.save / clocks.restore: what is given back, what is dropped,
and nothing saved can make it fail), then the real daemon on the simulated backend, restarted the way the
other daemon tests restart it (SIGTERM), and once killed with SIGKILL, as a crash would.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from types import SimpleNamespace

from helpers.guard_inputs import OWN_PID, FakeTime, proc, snap
from helpers.marks import needs_root
from helpers.testbed import ROOT, SYSTEM_PYTHON, Testbed, sim_env, start_time_of
from helpers.waiting import wait_until

from gpukill.checkpoint import Declaration
from gpukill.outcome import Outcome
from gpukill.policy import load_texts
from gpukilld import journal as audit
from gpukilld.acts.checkpoint import Asked
from gpukilld.guard import clocks
from gpukilld.guard.engine import Clock, Engine
from gpukilld.guard.notify import NotifyConfig
from gpukilld.guard.runner import GuardRunner

BOOT = "7d3f0c1e-0000-4000-8000-000000000001"


def grace_policy(grace: str = "30s", name: str = "miners") -> str:
    return (
        f"rules:\n  - name: {name}\n    action: kill\n    force: true\n    grace_period: {grace}\n"
        "    conditions:\n      - {type: process_name, operator: ==, value: xmrig}\n"
        "      - {type: gpu_utilization, operator: '>', value: 95}\n"
    )


def window_policy(duration: str = "60s") -> str:
    return (
        "rules:\n  - name: slow\n    action: kill\n    force: true\n    grace_period: 0s\n"
        "    conditions:\n      - {type: process_name, operator: ==, value: xmrig}\n"
        f"      - {{type: gpu_utilization, operator: '>', value: 95, duration: {duration}}}\n"
    )


def engine(text: str, t: FakeTime, offset: float = 0.0) -> Engine:
    """An engine whose monotonic clock reads `offset` seconds behind CLOCK_BOOTTIME (a suspend, or another
    daemon: only boottime is comparable across the restart)."""
    clock = Clock(monotonic=lambda: t.now - offset, boottime=lambda: t.now, wall=lambda: 1.7e9 + t.now)
    return Engine(load_texts([("test.yaml", text)]), clock, own_pid=OWN_PID)


def alive(pid: int, start: int) -> bool:
    return True


def restarted(saved: dict, text: str, t: FakeTime, boot: str = BOOT, is_alive=alive) -> tuple[Engine, str | None]:
    """A new engine on the same policy, given the saved clocks through JSON (as the file carries them)."""
    e = engine(text, t, offset=500.0)
    _, note = clocks.restore(e, json.loads(json.dumps(saved)), boot, is_alive)
    return e, note


MINER = snap(proc(10, "xmrig", util=99))


def kinds(events) -> list[str]:
    return [type(ev).__name__ for ev in events]


# -- the engine: what is given back ----------------------------------------------------------------------


def test_a_grace_goes_on_from_where_it_was_and_its_violation_is_not_counted_again():
    t = FakeTime()
    e = engine(grace_policy(), t)
    assert kinds(e.evaluate(MINER, False)) == ["Violation"]
    assert e.clocks_changed, "a grace that begins is saved at once"
    t.now += 20
    e.evaluate(MINER, False)
    saved = clocks.save(e, BOOT)
    t.now += 5  # the daemon is down for 5 s
    e2, note = restarted(saved, grace_policy(), t)
    assert note is None
    assert e2.stats["miners"].triggers == 0  # the counters come from the state file, not from the clocks
    assert round(e2.grace_report()[0]["remaining"], 6) == 5.0
    t.now += 4.9
    assert e2.evaluate(MINER, False) == []  # the same episode: no second Violation, still in its grace
    t.now += 0.1
    assert kinds(e2.evaluate(MINER, False)) == ["KillOrder"]  # 30 s after it began, not 30 s after the restart


def test_a_duration_window_goes_on_from_where_it_was():
    t = FakeTime()
    e = engine(window_policy(), t)
    e.evaluate(MINER, False)
    t.now += 40
    e.evaluate(MINER, False)
    saved = clocks.save(e, BOOT)
    t.now += 10
    e2, _ = restarted(saved, window_policy(), t)
    assert [round(w["elapsed"], 6) for w in e2.windows_report()] == [50.0]
    t.now += 9.9
    assert e2.evaluate(MINER, False) == []
    t.now += 0.1
    assert kinds(e2.evaluate(MINER, False)) == ["Violation", "KillOrder"]


def test_cooldowns_and_reset_history_are_kept():
    t = FakeTime()
    e = engine(grace_policy("0s"), t)
    order = e.evaluate(MINER, False)[1]
    e.kill_finished(order, order.targets[0], "terminated")
    e.resets["GPU-0"] = [t.now - 10]
    saved = clocks.save(e, BOOT)
    e2, _ = restarted(saved, grace_policy("0s"), t)
    cooldown = e.policy.settings.cooldown
    assert list(e2.states[0].cooldown.values()) == [e2.clock.monotonic() + cooldown]
    assert e2.resets == {"GPU-0": [e2.clock.monotonic() - 10]}


# -- the engine: what is dropped -------------------------------------------------------------------------


def saved_grace(t: FakeTime) -> dict:
    e = engine(grace_policy(), t)
    e.evaluate(MINER, False)
    return clocks.save(e, BOOT)


def test_clocks_of_another_boot_are_dropped():
    t = FakeTime()
    e2, note = restarted(saved_grace(t), grace_policy(), t, boot="another-boot")
    assert e2.grace_report() == [] and "another boot" in note
    e3, _ = restarted(saved_grace(t), grace_policy(), t, boot="")  # the kernel did not say: never trusted
    assert e3.grace_report() == []


def test_entries_of_a_process_gone_or_of_a_reused_pid_are_dropped():
    t = FakeTime()
    asked = []

    def gone(pid: int, start: int) -> bool:
        asked.append((pid, start))
        return False

    e2, note = restarted(saved_grace(t), grace_policy(), t, is_alive=gone)
    assert asked == [(10, 100)] and e2.grace_report() == [] and "processes gone" in note
    assert kinds(e2.evaluate(MINER, False)) == ["Violation"]  # a new process: a new episode


def test_a_rule_that_changed_meaning_starts_afresh_and_a_rule_that_did_not_keeps_its_clocks():
    t = FakeTime()
    e2, note = restarted(saved_grace(t), grace_policy("20s"), t)
    assert e2.grace_report() == [] and "miners changed meaning" in note
    e3, _ = restarted(saved_grace(t), grace_policy().replace("force: true", "force: false"), t)
    assert e3.grace_report() == []
    e4, note = restarted(saved_grace(t), grace_policy() + "exemptions: {users: [root]}\n", t)
    assert e4.grace_report() == [], "the policy's exemptions changed what the rule sees"
    e5, note = restarted(saved_grace(t), grace_policy("30s", "other"), t)
    assert e5.grace_report() == [] and note is None  # another rule: nothing of it was saved


def test_nothing_saved_can_make_the_restore_fail_and_what_is_read_is_bounded():
    t = FakeTime()
    good = saved_grace(t)
    rule = good["rules"][0]
    hostile = [
        None,
        [],
        "x",
        {"format": 2, "boot_id": BOOT, "rules": []},
        {"format": 1, "boot_id": BOOT, "rules": {}},
        {**good, "rules": [None, 1, {"name": 3}, {**rule, "windows": "x", "episodes": [[1], None]}]},
        {
            **good,
            "rules": [
                {
                    **rule,
                    "episodes": [
                        [["p", -1, 100], 1, 2, "l", None, False],
                        [["u", 5], 1, 2, "l", None, False],  # a uid for a process rule
                        [["p", 10, 100], float("nan"), 2, "l", None, False],
                        [["p", 10, 100], 1e300, 2, "l", None, False],  # in the future
                        [["p", 10, 100], 1, 2, "x" * 10_000, None, False],
                        [["p", 10, 100], 1, 2, "l", "root", False],
                    ],
                }
            ],
        },
        {**good, "rules": [], "resets": {"": [1.0], "GPU-0": ["x", float("inf")], "GPU-1": 5}, "dry_resets": []},
    ]
    for data in hostile:
        e2 = engine(grace_policy(), t)
        restored, _ = clocks.restore(e2, data, BOOT, alive)
        assert restored == 0 and e2.grace_report() == [] and e2.resets == {}, data
    flood = {**good, "rules": [{**rule, "episodes": rule["episodes"] * (clocks.MAX_ENTRIES + 10)}]}
    e2 = engine(grace_policy(), t)
    restored, note = clocks.restore(e2, flood, BOOT, alive)
    assert restored == clocks.MAX_ENTRIES and "10 malformed or excess entries dropped" in note


def awaited(pid: int = 10, sent_ago: float = 3.0) -> Asked:
    """A checkpoint signal sent `sent_ago` seconds ago, with 8 s to save (the kill path's real clock)."""
    return Asked(
        pid, 100, "train", Declaration(signal.SIGUSR1, 8.0, False, "environment"), 8.0, time.monotonic() - sent_ago
    )


def test_checkpoint_signals_awaited_are_kept_with_what_is_left_of_their_wait():
    t = FakeTime()
    saved = json.loads(json.dumps(clocks.save(engine(grace_policy(), t), BOOT, [awaited(10), awaited(11)])))
    back, note = clocks.restore_asked(saved, BOOT, alive)
    assert note is None and [(a.pid, a.start_time, a.comm, a.declaration, a.wait) for a in back] == [
        (pid, 100, "train", Declaration(signal.SIGUSR1, 8.0, False, "environment"), 8.0) for pid in (10, 11)
    ]
    assert 4.5 < back[0].left(time.monotonic()) <= 5.0  # 3 s of the 8 were spent before the restart
    back, note = clocks.restore_asked(saved, BOOT, lambda pid, start: pid != 11)
    assert [a.pid for a in back] == [
        10
    ] and note == "checkpoint signals awaited restored (1); 1 of processes gone dropped"
    assert clocks.restore_asked(saved, "another-boot", alive) == ([], None)
    assert clocks.restore_asked(saved, "", alive) == ([], None)


def test_a_saved_checkpoint_signal_that_is_not_one_is_dropped():
    good = clocks.save(engine(grace_policy(), FakeTime()), BOOT, [awaited()])
    entry = good["asked"][0]  # pid, start, comm, signal, declared wait, each, source, wait, sent at
    bad = [
        [*entry[:3], int(signal.SIGKILL), *entry[4:]],  # no process saves on KILL
        [*entry[:3], 1 << 40, *entry[4:]],
        [*entry[:7], 9.0, entry[8]],  # waits longer than it declared
        [*entry[:8], entry[8] + 3600],  # sent in the future
        [*entry[:6], "x" * (clocks.MAX_SOURCE + 1), *entry[7:]],
        [*entry[:2], None, *entry[3:]],
        entry[:8],
        "entry",
    ]
    back, note = clocks.restore_asked({**good, "asked": [*bad, entry]}, BOOT, alive)
    assert [a.pid for a in back] == [
        10
    ] and note == "checkpoint signals awaited restored (1); 8 malformed or excess dropped"
    flood = {**good, "asked": [entry] * (clocks.MAX_ASKED + 5)}
    back, note = clocks.restore_asked(flood, BOOT, alive)
    assert len(back) == clocks.MAX_ASKED and note is not None and "5 malformed or excess dropped" in note
    assert clocks.restore_asked({**good, "asked": {"no": "list"}}, BOOT, alive) == ([], None)


class Journal:
    def log(self, kind, message, **fields) -> None:
        pass


def test_the_runner_keeps_a_signal_sent_saved_until_its_kill_is_over(tmp_path):
    """Saved when the grace's signal goes; still saved while the kill waits for the save (a restart then
    resumes the wait); forgotten once the kill is over."""
    t = FakeTime()
    sent = awaited(10, sent_ago=0.0)
    release = asyncio.Event()
    options: dict = {}

    async def ask(targets, initiator, rule, rule_checkpoint, dry_run):
        return [sent] if targets == [(10, 100)] else []

    async def kill(caller, pid, start_time, grace, force, initiator, **checkpoint):
        options.update(checkpoint)
        await release.wait()
        return SimpleNamespace(outcome=Outcome.TERMINATED)

    r = GuardRunner(kill, Journal(), NotifyConfig(), str(tmp_path / "g"), str(tmp_path / "s"), t.clock(), OWN_PID)
    r.ask_to_save = ask
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "10.yaml").write_text(grace_policy("30s"))
    r.start()

    def saved() -> list:
        return json.loads((tmp_path / "s" / "guard-state.json").read_text())["clocks"]["asked"]

    async def go() -> None:
        r.on_snapshot(MINER)  # the grace begins: the signal goes, and is saved at once
        await asyncio.gather(*r._tasks)
        assert [e[0] for e in saved()] == [10]
        t.now += 31
        r.on_snapshot(MINER)  # the grace is over: the kill waits for the rest of the save
        await asyncio.sleep(0.01)
        assert options["asked"] == {(10, 100): sent} and not options["checkpoint"]
        r._save_now()
        assert [e[0] for e in saved()] == [10]
        release.set()
        await asyncio.gather(*r._tasks)
        r._save_now()
        assert saved() == []

    asyncio.run(go())
    r.stop()


# -- the daemon ----------------------------------------------------------------------------------------------

INTERVAL = 0.2
SLACK = 1.0  # a loaded CI machine; a fresh grace or window would come seconds later (see each test)


def start(bed: Testbed, policy: str) -> None:
    (bed.workdir / "guard.d").mkdir(exist_ok=True)
    (bed.workdir / "guard.d" / "10-test.yaml").write_text(policy)
    bed.write_conf()
    bed.start_daemon(args=["--sample-interval", str(INTERVAL)])


def restart(bed: Testbed, crash: bool = False) -> None:
    if crash:  # what was written on change is all there is
        os.killpg(bed.daemon.proc.pid, signal.SIGKILL)
        bed.daemon.proc.wait(5)
    bed.stop_daemon()
    bed.start_daemon(args=["--sample-interval", str(INTERVAL)])


def status(bed: Testbed) -> dict:
    r = bed.guard_call(ROOT, "GetStatus")
    assert r.ok, r
    return r.body[0]


def rule_stats(bed: Testbed) -> dict:
    return status(bed)["rules"][0]


def exit_time(proc: subprocess.Popen, timeout: float) -> float:
    wait_until(lambda: proc.poll() is not None, timeout, f"PID {proc.pid} still running", interval=0.02)
    return time.monotonic()


def ends_at(bed: Testbed, what: str, remaining) -> float:
    """Monotonic time (this machine's) at which the daemon's grace or window in GetStatus ends."""
    wait_until(lambda: status(bed)[what], 10, f"no {what} in GetStatus")
    before = time.monotonic()
    entry = status(bed)[what][0]
    return (before + time.monotonic()) / 2 + remaining(entry)


@needs_root
def test_a_crash_during_a_grace_does_not_start_a_fresh_grace_nor_count_the_violation_twice(fresh_bed, users):
    bed = fresh_bed
    start(bed, grace_policy("5s"))
    miner = bed.victim(users["owner"], util=99, comm="xmrig")
    end = ends_at(bed, "graces", lambda g: g["remaining"])
    # Written in the evaluation that began the grace, before GetStatus could show it (not a second later)
    saved = json.loads((bed.workdir / "state" / "guard-state.json").read_text())
    assert [e[0] for e in saved["clocks"]["rules"][0]["episodes"]] == [["p", miner.pid, start_time_of(miner.pid)]]
    time.sleep(max(0.0, end - 3.0 - time.monotonic()))  # 2 s into the grace: a fresh one would end 2 s late
    restart(bed, crash=True)
    t_exit = exit_time(miner, 20)
    assert miner.returncode == -signal.SIGTERM
    assert end - 0.3 <= t_exit <= end + INTERVAL + SLACK, t_exit - end
    wait_until(lambda: rule_stats(bed)["kills"] == 1, 5, "the kill was not counted")
    stats = rule_stats(bed)
    assert (stats["triggers"], stats["cancelled"]) == (1, 0), stats
    assert "Traceback" not in bed.daemon.log()


@needs_root
def test_a_restart_during_a_duration_window_goes_on_with_the_window(fresh_bed, users):
    bed = fresh_bed
    start(bed, window_policy("5s"))
    miner = bed.victim(users["owner"], util=99, comm="xmrig")
    end = ends_at(bed, "windows", lambda w: w["duration"] - w["elapsed"])
    time.sleep(max(0.0, end - 3.0 - time.monotonic()))
    restart(bed)
    t_exit = exit_time(miner, 20)
    assert end - 0.3 <= t_exit <= end + INTERVAL + SLACK, t_exit - end
    wait_until(lambda: rule_stats(bed)["kills"] == 1, 5, "the kill was not counted")
    assert rule_stats(bed)["triggers"] == 1


@needs_root
def test_clocks_of_another_boot_or_a_corrupt_file_are_ignored_with_a_line_and_the_daemon_runs(fresh_bed, users):
    bed = fresh_bed
    start(bed, window_policy("60s"))
    bed.victim(users["owner"], util=99, comm="xmrig")
    wait_until(lambda: status(bed)["windows"], 10, "no window")
    time.sleep(1.5)
    bed.stop_daemon()
    path = bed.workdir / "state" / "guard-state.json"
    saved = json.loads(path.read_text())
    assert saved["clocks"]["boot_id"] == clocks.boot_id() != ""
    saved["clocks"]["boot_id"] = BOOT
    path.write_text(json.dumps(saved))
    bed.start_daemon(args=["--sample-interval", str(INTERVAL)])
    assert "the guard's saved clocks are from another boot" in bed.daemon.log()
    windows = wait_until(lambda: status(bed)["windows"], 10, "no window after the restart")
    assert windows[0]["elapsed"] < 1.4, "the window of another boot was kept"
    bed.stop_daemon()
    path.write_bytes(b'{"clocks": \xff')
    bed.start_daemon(args=["--sample-interval", str(INTERVAL)])
    assert "cannot be read" in bed.daemon.log()
    assert [r["name"] for r in status(bed)["rules"]] == ["slow"]
    assert wait_until(lambda: status(bed)["windows"], 10, "the daemon does not evaluate")


SAVE = 7.0  # seconds the declared victim's handler takes to save: longer than the grace and the restart
DECLARED = "USR1:10s"
CHECKPOINT_POLICY = """max_checkpoint_wait: 20s
rules:
  - name: savers
    action: kill
    grace_period: 2s
    conditions:
      - {type: process_name, operator: ==, value: ckpt-saver}
"""
# Saves for SAVE seconds on SIGUSR1 and exits 0; says each signal on stdout ("USR1 TIME"). A SIGTERM during the
# save is said and ends it, as SIGTERM's default action would.
SAVER = r"""
import ctypes, os, signal, time
def say(what):
    print(what, f"{time.time():.3f}", flush=True)
def on_term(n, frame):
    say("TERM")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
def on_usr1(n, frame):
    say("USR1")
    time.sleep(%r)
    say("saved")
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, on_usr1)
ctypes.CDLL(None).prctl(15, b"ckpt-saver", 0, 0, 0)
say("ready")
time.sleep(3600)
"""


@needs_root
def test_a_restart_during_the_grace_keeps_the_kill_waiting_for_the_declared_save(fresh_bed, users):
    """The victim was sent SIGUSR1 when the grace began and saves for longer than the grace; gpukilld crashes
    and restarts during the grace: the kill after the restart waits for what is left of the declared wait, so
    the victim saves and exits by itself, never SIGTERMed."""
    bed = fresh_bed
    start(bed, CHECKPOINT_POLICY)
    env = {**sim_env(bed.scope, 0, "1GiB", 50), "GPUKILL_CHECKPOINT": DECLARED}
    saver = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", SAVER % SAVE],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd="/",
        start_new_session=True,
        **users["owner"].popen_kwargs(),
    )
    bed.procs.append(saver)
    assert saver.stdout is not None and saver.stdout.readline().startswith("ready")
    assert saver.stdout.readline().startswith("USR1")  # the grace began: asked to save at once
    state = bed.workdir / "state" / "guard-state.json"
    asked = wait_until(lambda: json.loads(state.read_text())["clocks"]["asked"], 5, "the signal sent was not saved")
    assert [(a[0], a[3], a[7]) for a in asked] == [(saver.pid, signal.SIGUSR1, 10.0)], asked
    restart(bed, crash=True)  # within the 2 s grace; the new daemon ends it at its first evaluation
    assert saver.wait(SAVE + 10) == 0, "SIGTERM came before the declared wait was over"
    assert [line.split()[0] for line in saver.stdout.read().splitlines()] == ["saved"]
    kill = bed.wait_journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(saver.pid))
    assert kill and kill[0]["GPUKILL_INITIATOR"] == "guard:savers" and kill[0]["GPUKILL_CHECKPOINT"] == "saved", kill
    assert "Traceback" not in bed.daemon.log()
