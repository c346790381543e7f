"""An audit round has a budget (gpukilld/rogue/sockets.py RoundBudget): 300 GPU processes, each in an unprivileged user
+network namespace of its own (`unshare -Urn` as gpkowner or gpkother) with a padded TCP table, keep the real
daemon's watchdog fed (the gap between its WATCHDOG=1 pings, one per sample, is the longest sampler round plus
the interval) and its memory bounded, and every namespace's miner is found all the same: what a round cannot
read waits for the next one.

Without the budget (one parse of /proc/PID/net/tcp* and one walk of /proc/PID/fd per namespace, all in one
round) the first round after the processes come takes seconds, growing with the namespaces and their padding.
PADDING connection pairs per namespace (2 sockets each); GPUKILL_TEST_NETNS_PADDING sets it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from helpers.marks import needs_root, slow
from helpers.testbed import ROOT, SYSTEM_PYTHON, Testbed

pytestmark = [needs_root, slow, pytest.mark.timeout(900)]  # ~60-70 s on 2 idle cores

NAMESPACES = 300
PADDING = int(os.environ.get("GPUKILL_TEST_NETNS_PADDING", "1000"))
MINER_EVERY = 10  # every 10th namespace holds a miner's connection to a pool (on 3333, in the namespace)
INTERVAL = 0.5
WATCHDOG_SEC = 30  # systemd/gpukilld.service
# A process that pads its namespace's TCP table with loopback connections, holds one to a pool if asked, and
# becomes `sleep` holding them all (a small process: 300 of them fit on a test machine). It is a GPU process
# from that exec on (GPUKILL_SIM_* in its environment), all its sockets made.
PADDED = """\
import json, os, resource, socket, sys
pairs, miner, env = int(sys.argv[1]), sys.argv[2] == "1", json.loads(sys.argv[3])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2 * pairs + 64), hard))
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen(64)
held = [listener]
for _ in range(pairs):
    held.append(socket.create_connection(listener.getsockname())); held.append(listener.accept()[0])
if miner:
    pool = socket.socket(); pool.bind(("127.0.0.1", 3333)); pool.listen(8)
    held += [pool, socket.create_connection(("127.0.0.1", 3333))]
for s in held:
    s.set_inheritable(True)
print("ready", flush=True)
os.execve("/bin/sleep", ["sleep", "900"], env)
"""


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def daemon_pid(bed: Testbed) -> int:
    """The python of gpukilld (nsenter, which starts it in the journal's mount namespace, execs it)."""
    pid = bed.daemon.proc.pid
    for _ in range(2):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"gpukilld" in f.read() and os.readlink(f"/proc/{pid}/exe").split("/")[-1].startswith("python"):
                return pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pid = int(f.read().split()[0])
    raise AssertionError("gpukilld's process not found")


def start_padded(bed: Testbed, users) -> tuple[list[subprocess.Popen], set[int]]:
    people = [users["owner"], users["other"]]
    procs = []
    for i in range(NAMESPACES):
        env = {
            "PATH": "/usr/bin:/bin",
            "GPUKILL_SIM_GPU": str(i % 2),
            "GPUKILL_SIM_SCOPE": bed.scope,
            "GPUKILL_SIM_MEM": "1GiB",
            "GPUKILL_SIM_UTIL": "50",
        }
        argv = [
            "unshare",
            "-Urn",
            "sh",
            "-c",
            'ip link set lo up && exec "$0" "$@"',
            SYSTEM_PYTHON,
            "-c",
            PADDED,
            str(PADDING),
            "1" if i % MINER_EVERY == 0 else "0",
            json.dumps(env),
        ]
        p = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
            start_new_session=True,
            **people[i % 2].popen_kwargs(),
        )
        bed.procs.append(p)
        procs.append(p)
        if i % 8 == 7:  # a few at a time: 2 cores
            for q in procs[-8:]:
                assert q.stdout.readline().strip() == b"ready", q.args
    for q in procs[len(procs) // 8 * 8 :]:
        assert q.stdout.readline().strip() == b"ready", q.args
    return procs, {p.pid for i, p in enumerate(procs) if i % MINER_EVERY == 0}


def test_300_padded_namespaces_keep_the_watchdog_fed_and_memory_bounded(users):
    """The daemon starts (or restarts) on a host where the 300 namespaces are already there: every process is
    new to it at once, the round that once read them all in one go."""
    bed = Testbed()
    try:
        (bed.workdir / "guard.d").mkdir()
        bed.write_conf(audit={"pool_ports": "3333"})
        t = time.monotonic()
        procs, miners = start_padded(bed, users)
        assert len({os.stat(f"/proc/{p.pid}/ns/net").st_ino for p in procs}) == NAMESPACES
        print(f"\n{NAMESPACES} namespaces of {2 * PADDING + 1} sockets each started in {time.monotonic() - t:.1f}s")
        started = time.monotonic()
        bed.start_system(args=["--sample-interval", str(INTERVAL)], env={"WATCHDOG_USEC": str(WATCHDOG_SEC * 10**6)})
        pid = daemon_pid(bed)
        ready = time.monotonic()
        rss_first = rss_peak = rss_kib(pid)
        found: set[int] = set()
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            time.sleep(2.0)
            rss_peak = max(rss_peak, rss_kib(pid))
            r = bed.ctl(ROOT, "audit", "--json", timeout=120)
            assert r.returncode == 0, r
            found = {
                f["pid"]
                for f in json.loads(r.stdout)["findings"]
                if any(e["rule"] == "pool-port" for e in f["evidence"])
            }
            if found >= miners:
                break
        all_found = time.monotonic() - started
        assert found >= miners, f"{len(miners - found)} of {len(miners)} miners not found"
        assert not found - miners, "a padded namespace without a pool connection was flagged"
        listed = {p["pid"] for p in bed.listing(ROOT)["processes"]}
        assert {p.pid for p in procs} <= listed
        rss_peak = max(rss_peak, rss_kib(pid))

        # from the daemon's start (systemd's watchdog counts from there) to the last ping, and on to now
        pings = [started, *(t for t in bed.daemon.notify.times("WATCHDOG=1") if t >= started), time.monotonic()]
        gaps = [b - a for a, b in zip(pings, pings[1:], strict=False)]
        print(
            f"daemon ready in {ready - started:.1f}s, every miner found {all_found:.1f}s after its start; "
            f"{len(pings) - 2} watchdog pings, longest gap {max(gaps):.2f}s (WatchdogSec={WATCHDOG_SEC}); "
            f"RSS {rss_first // 1024} MiB when ready, {rss_peak // 1024} MiB at most"
        )
        # well under WatchdogSec: a gap is one sample (its audit round within the budget) and the interval
        assert max(gaps) < WATCHDOG_SEC / 4, sorted(gaps)[-5:]
        # bounded: the daemon keeps what it derived, not what it read (MemoryHigh=512M in the unit)
        assert rss_peak - rss_first < 64 * 1024, (rss_first, rss_peak)
    finally:
        bed.stop()
