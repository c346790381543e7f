"""`gpukillctl top` in a real terminal: tmux running it as an unprivileged user against the bed's gpukilld, keys
sent with send-keys, the screen read with capture-pane. What the view does with a sample and a key, without a
terminal, is tests/test_top_model.py.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import time

import pytest
import yaml
from helpers import tmux
from helpers.marks import needs_root
from helpers.testbed import ADMIN_RULES, PYTHON, ROOT
from helpers.tmux import EXITED, TmuxPane
from helpers.waiting import wait_until

pytestmark = [needs_root, pytest.mark.skipif(tmux.missing() is not None, reason=tmux.missing() or "")]

TOP = [PYTHON, "-m", "gpukillctl", "top"]


@pytest.fixture
def terminal(victims):
    panes: list[TmuxPane] = []

    def open_as(user, **env: str) -> TmuxPane:
        pane = TmuxPane(victims, user)
        pane.env.update(env)
        panes.append(pane)
        pane.start(TOP)
        pane.wait_for("gpukill top - ")
        return pane

    yield open_as
    for pane in panes:
        pane.close()


def process_rows(screen: str) -> list[str]:
    """The process table's rows: between its header and the selected process's details."""
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("PID "))
    end = next(i for i, line in enumerate(lines) if line.startswith("-- selected"))
    return [line for line in lines[start + 1 : end] if line.strip()]


def order(screen: str, *pids: int) -> list[int]:
    """The given PIDs in the order the table shows them."""
    shown = [int(row.split()[0]) for row in process_rows(screen)]
    return [pid for pid in shown if pid in pids]


def test_top_shows_devices_and_processes_sorts_filters_and_escapes(terminal, victims, users):
    owner = users["owner"]
    big = victims.victim(owner, gpu=0, mem="6GiB", util=10, comm="big")
    busy = victims.victim(owner, gpu=1, mem="1GiB", util=95, comm="busy")
    tiny = victims.victim(owner, gpu=2, mem="512MiB", util=50, comm="tiny")
    evil = victims.victim(owner, gpu=3, mem="256MiB", util=1, comm="ev\x1b[2Jil")
    pids = (big.pid, busy.pid, tiny.pid, evil.pid)
    for p in pids:
        victims.wait_listed(p)
    pane = terminal(owner)
    screen = pane.wait_for(lambda s: len(order(s, *pids)) == 4)
    # devices with bars, each of the example's four GPUs
    assert "Simulated H100 80GB HBM3" in screen and "Simulated Arc A770" in screen
    assert re.search(r"util \[\|* *\] +\d+%", screen) and re.search(r"mem \[\|* *\] .* / 80\.0 GiB", screen), screen
    # by GPU memory, biggest first: the default
    assert "sorted by GPU memory" in screen
    assert order(screen, *pids) == [big.pid, busy.pid, tiny.pid, evil.pid]
    # a name with an escape sequence is shown escaped, and the screen around it is intact
    assert "ev\\x1b[2Jil" in screen and screen.startswith("gpukill top - ")

    pane.keys("u")
    screen = pane.wait_for("sorted by utilization")
    assert order(screen, *pids) == [busy.pid, tiny.pid, big.pid, evil.pid]
    pane.keys("u")  # again: the other way round
    screen = pane.wait_for("sorted by utilization (reversed)")
    assert order(screen, *pids) == [evil.pid, big.pid, tiny.pid, busy.pid]

    pane.keys("/")
    pane.keys("tiny", literal=True)
    pane.wait_for("filter: tiny_")
    pane.keys("Enter")
    screen = pane.wait_for("match /tiny")
    assert order(screen, *pids) == [tiny.pid]
    assert f"PID {tiny.pid} (tiny) of gpkowner" in screen  # the selection's details
    pane.keys("Escape")
    screen = pane.wait_for(lambda s: len(order(s, *pids)) == 4)

    pane.keys("q")
    pane.wait_for(f"{EXITED}0]")


def test_top_kills_the_selected_process_after_confirmation(terminal, victims, users):
    owner = users["owner"]
    doomed = victims.victim(owner, gpu=0, mem="2GiB", comm="doomed")
    victims.wait_listed(doomed.pid)
    pane = terminal(owner)
    pane.keys("/")
    pane.keys("doomed", literal=True)
    pane.keys("Enter")
    pane.wait_for(f"PID {doomed.pid} (doomed) of gpkowner")

    pane.keys("k")
    pane.wait_for(f"Kill PID {doomed.pid} (doomed) of gpkowner on GPU 0? y: SIGTERM")
    pane.keys("n")  # anything but y or f: nothing is done
    pane.wait_for("kill cancelled")
    assert doomed.poll() is None

    pane.keys("k")
    pane.wait_for(f"Kill PID {doomed.pid} (doomed)")
    pane.keys("y")
    doomed.wait(15)
    pane.wait_for(f"PID {doomed.pid} (doomed) terminated")
    # the next refresh no longer lists it
    pane.wait_for(lambda s: order(s, doomed.pid) == [] and "no process matches the filter" in s)


def test_top_reports_the_polkit_denial_as_a_message(terminal, victims, users):
    victim = victims.victim(users["owner"], gpu=1, mem="1GiB", comm="notyours")
    victims.wait_listed(victim.pid)
    pane = terminal(users["other"])
    pane.keys("/")
    pane.keys("notyours", literal=True)
    pane.keys("Enter")
    pane.wait_for(f"PID {victim.pid} (notyours) of gpkowner")
    pane.keys("k")
    pane.wait_for(f"Kill PID {victim.pid} (notyours)")
    pane.keys("y")
    # The view steps aside for pkttyagent; polkit asks for an admin's password, which this user does not have:
    # Ctrl-C there makes the agent give up, polkit says no, and the view comes back with the denial.
    screen = pane.wait_for(lambda s: "not stopped" in s or "Password:" in s, timeout=30)
    if shutil.which("pkttyagent"):  # polkitd's package has it; without it the answer is a plain no
        assert f"stopping PID {victim.pid}" in screen and "AUTHENTICATING FOR org.gpukill.kill-any-process" in screen
        pane.keys("C-c")
    screen = pane.wait_for(f"PID {victim.pid} (notyours) not stopped: not authorized to kill", timeout=30)
    assert victim.poll() is None
    assert screen.startswith("gpukill top - ")  # back in the view


# -- 8 GPUs x 256 processes, with Guard's windows and graces ------------------------------------------------

GPUS, PROCESSES = 8, 256
KEY_TO_SCREEN_P50, KEY_TO_SCREEN_MAX = 0.3, 1.5  # seconds, through tmux (whose own round trip is in them)
POLICY = """rules:
  - name: watch-busy
    conditions:
      - {type: process_name, operator: contains_any, value: [guarded]}
      - {type: gpu_utilization, operator: ">", value: 50, duration: 1h}
    action: log
  - name: evict-doomed
    conditions:
      - {type: process_name, operator: contains_any, value: [doomed]}
    action: kill
    grace_period: 10m
"""


@pytest.fixture
def crowded(fresh_bed, users):
    """8 simulated GPUs, 256 processes of the owner each on all 8 (2,048 records), and a Guard policy with a
    window (watch-busy) and a grace (evict-doomed) pending."""
    bed = fresh_bed
    bed.start_polkit([ADMIN_RULES])
    (bed.workdir / "guard.d").mkdir()
    (bed.workdir / "guard.d" / "top.yaml").write_text(POLICY)
    sim = bed.workdir / "eight.yaml"
    sim.write_text(
        yaml.safe_dump(
            {
                "devices": [
                    {"name": f"Simulated H100 {i}", "vendor": "nvidia", "uuid": f"GPU-top-{i}", "memory_total": "80GiB"}
                    for i in range(GPUS)
                ]
            }
        )
    )
    bed.start_daemon(sim_yaml=sim)
    assert bed.ctl(ROOT, "guard", "enable").returncode == 0
    read_end, write_end = os.pipe()  # the crowd waits on stdin; the pipe stays open until the bed stops
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUKILL_SIM_GPU": ",".join(map(str, range(GPUS))),
        "GPUKILL_SIM_SCOPE": bed.scope,
        "GPUKILL_SIM_MEM": "1GiB",
        "GPUKILL_SIM_UTIL": "3",
    }
    for _ in range(PROCESSES - 2):
        bed.procs.append(
            subprocess.Popen(
                ["/bin/sh", "-c", "read x"],
                stdin=read_end,
                env=env,
                cwd="/",
                start_new_session=True,
                **users["owner"].popen_kwargs(),
            )
        )
    os.close(read_end)
    guarded = bed.victim(users["owner"], gpu=",".join(map(str, range(GPUS))), util=60, comm="guarded")
    doomed = bed.victim(users["owner"], gpu=",".join(map(str, range(GPUS))), comm="doomed")
    wait_until(
        lambda: len(bed.listing(ROOT)["processes"]) >= GPUS * PROCESSES,
        60,
        "the 2,048 records were never listed",
        interval=1.0,
    )
    yield bed, guarded, doomed
    os.close(write_end)


def test_top_stays_responsive_with_8_gpus_and_2048_processes_and_shows_guard(crowded, users):
    bed, guarded, doomed = crowded
    pane = TmuxPane(bed, users["owner"])
    try:
        pane.start(TOP)
        screen = pane.wait_for(f"{GPUS * PROCESSES} processes", timeout=30)
        assert all(f"Simulated H100 {i}" in screen for i in range(GPUS))

        # key to screen: each Down moves the selection, and the details under the table name another process
        def selected(s: str) -> str:
            return next(line for line in s.splitlines()[::-1] if re.match(r"PID \d+ \(", line))

        latencies = []
        for _ in range(30):  # over 3 s, so that keys also land while a refresh (5 pages of 500) is running
            time.sleep(0.1)
            before = selected(pane.screen())
            t0 = time.monotonic()
            pane.keys("Down")
            pane.wait_for(lambda s, before=before: selected(s) != before, timeout=10)
            latencies.append(time.monotonic() - t0)
        # a sort of all 2,048 records, then filters, each from the key to the screen
        t0 = time.monotonic()
        pane.keys("n")
        pane.wait_for("sorted by user")
        latencies.append(time.monotonic() - t0)
        print(
            f"key to screen with {GPUS * PROCESSES} records: p50 {statistics.median(latencies) * 1000:.0f} ms,"
            f" max {max(latencies) * 1000:.0f} ms over {len(latencies)} keys"
        )
        assert statistics.median(latencies) < KEY_TO_SCREEN_P50 and max(latencies) < KEY_TO_SCREEN_MAX, latencies

        # Guard: the window against the process it concerns, on each of its 8 rows; the grace likewise
        pane.keys("/")
        pane.keys("guarded", literal=True)
        pane.keys("Enter")
        screen = pane.wait_for(lambda s: len(order(s, guarded.pid)) == GPUS and "watch-busy" in s, timeout=30)
        assert all(re.search(r"window [0-9.a-z ]+/1h: watch-busy", row) for row in process_rows(screen)), screen
        assert "rule watch-busy, gpu_utilization > 50" in screen  # the details say which condition holds
        pane.keys("/")
        pane.keys("C-u")
        pane.keys("doomed", literal=True)
        pane.keys("Enter")
        screen = pane.wait_for(lambda s: len(order(s, doomed.pid)) == GPUS and "evict-doomed" in s, timeout=30)
        assert all(re.search(r"KILL in [0-9.a-z ]+: evict-doomed", row) for row in process_rows(screen)), screen
        assert f"rule evict-doomed kills PID {doomed.pid} (doomed, user gpkowner) in" in screen
    finally:
        pane.close()


def test_top_shows_the_sessions_gpu_totals(terminal, victims, users):
    """The line between the GPUs and the processes: GPU time, memory and energy since top started (GetUsage)."""
    owner = users["owner"]
    victims.wait_listed(victims.victim(owner, gpu=0, mem="4GiB", util=60, comm="sessiontot").pid)
    pane = terminal(owner)
    screen = pane.wait_for(
        lambda s: re.search(
            r"^session \([\d.]+s\): GPU time [1-9][\d.]*s, memory \d+\.\d\d "
            r"GiB·h, energy [1-9][\d.]* k?J",
            s,
            re.M,
        ),
        timeout=30,
    )
    assert screen.startswith("gpukill top - ")
    pane.keys("q")
    pane.wait_for(f"{EXITED}0]")


# SGR colour sequences as tmux writes them back: 30-37 and 90-97 (8 and bright colours), 38;5;N and 38;2;R;G;B
_COLOUR = re.compile(r"\x1b\[(?:[0-9;]*;)?(?:3[0-7]|9[0-7]|38;[25];[0-9;]+)(?:;[0-9;]*)?m")
_RED, _GREEN = re.compile(r"\x1b\[(?:[0-9;]*;)?31(?:;[0-9;]*)?m"), re.compile(r"\x1b\[(?:[0-9;]*;)?32(?:;[0-9;]*)?m")


def test_top_colours_load_as_nvitop_does_and_not_under_no_color(terminal, victims, users):
    """A busy process's UTIL is red and an idle one's green (nvitop's thresholds, 75% and 10%); with NO_COLOR set
    the same screen has bold and reverse but no colour at all."""
    owner = users["owner"]
    hot = victims.victim(owner, gpu=1, mem="1GiB", util=95, comm="hotcolour")
    idle = victims.victim(owner, gpu=2, mem="1GiB", util=2, comm="idlecolour")
    first = victims.victim(owner, gpu=0, mem="6GiB", util=50, comm="selected")  # the selection: drawn reversed
    for p in (hot, idle, first):
        victims.wait_listed(p.pid)

    def row_of(screen: str, pid: int) -> str:
        return next(line for line in screen.splitlines() if re.match(rf"(\x1b\[[0-9;]*m)*{pid} ", line))

    pane = terminal(owner)
    pane.wait_for(
        lambda s: (
            order(s, first.pid, hot.pid, idle.pid) in ([first.pid, hot.pid, idle.pid], [first.pid, idle.pid, hot.pid])
        )
    )
    coloured = pane.screen(escapes=True)
    busy_row, idle_row = row_of(coloured, hot.pid), row_of(coloured, idle.pid)
    assert re.search(_RED.pattern + r" *95%", busy_row), busy_row
    assert re.search(_GREEN.pattern + r" *2%", idle_row), idle_row
    pane.keys("q")
    pane.wait_for(f"{EXITED}0]")

    plain = terminal(owner, NO_COLOR="1")
    plain.wait_for(
        lambda s: (
            order(s, first.pid, hot.pid, idle.pid) in ([first.pid, hot.pid, idle.pid], [first.pid, idle.pid, hot.pid])
        )
    )
    screen = plain.screen(escapes=True)
    assert "\x1b[" in screen, "attributes (bold, reverse) are still drawn"
    assert not _COLOUR.search(screen), screen
    plain.keys("q")
    plain.wait_for(f"{EXITED}0]")
