"""The rogue-activity audit without a daemon: each rule of the table (gpukilld/rogue.py) one by one, how scores
add up, what another user sees of a finding, the history behind windows (gpukilld/rogue_watch.py), TCP tables
(gpukilld/sockets.py) and the [audit] configuration. The real daemon: tests/test_rogue_daemon.py."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
from helpers.guard_inputs import GiB, proc

from gpukill.errors import ConfigError
from gpukill.records import Evidence, Finding
from gpukilld import rogue, sockets
from gpukilld.config import AuditSettings, load_config
from gpukilld.rogue import RULE_BY_NAME, RULES, ProcessFacts, UserFacts
from gpukilld.rogue_watch import RogueWatch
from gpukilld.sockets import Peer
from gpukilld.visibility import ANONYMOUS, FULL, HIDDEN, PROGRAM, Viewer

SETTINGS = AuditSettings(idle_after=60.0, idle_min_memory=1 << 20, abuser_window=100.0, abuser_share=80.0)
WALLET_XMR = "4" + "A" + "x" * 93
WALLET_ETH = "0x" + "ab12" * 10


def facts(**kw) -> ProcessFacts:
    base = dict(pid=10, start_time=5, uid=1000, user="alice", comm="python3", cmdline="python3 train.py",
                exe="/usr/bin/python3.11", home="/home/alice", devices=(0,), gpu_memory=GiB)
    return ProcessFacts(**{**base, **kw})


def user(**kw) -> UserFacts:
    base = dict(uid=1000, user="alice", devices=(0,), gpu_memory=GiB, users=2, memory_share=10.0, time_share=10.0)
    return UserFacts(**{**base, **kw})


# (rule, facts it matches, a word of what it says, facts it does not match): one row per rule of the table
CASES = [
    ("miner-name", facts(comm="xmrig"), "xmrig", facts(comm="xmrigged")),
    ("miner-name", facts(comm="T-Rex"), "T-Rex", facts(comm="python3")),
    ("miner-program", facts(cmdline="/opt/lolMiner --algo ETHASH"), "lolMiner", facts(cmdline="python3 lolminer.py")),
    ("miner-exe", facts(exe="/opt/x/nbminer-42.1"), "nbminer", facts(exe="/opt/x/nbminers")),
    ("stratum-url", facts(cmdline="x -o stratum+ssl://eu.pool.example:443 -t 4"), "stratum+ssl://eu.pool.example:443",
     facts(cmdline="x --docs https://example.com/stratum")),
    ("stratum-url", facts(cmdline="x -o STRATUM2+TCP://p:1"), "STRATUM2+TCP://p:1", facts(cmdline="x stratum://p")),
    ("pool-host", facts(cmdline="x --url xmr-eu1.nanopool.org:14433"), "xmr-eu1.nanopool.org",
     facts(cmdline="x --url nanopool.org.example.com")),
    ("wallet", facts(cmdline=f"x --user {WALLET_XMR}.rig1"), "4Axxxx", facts(cmdline=f"x --hash {WALLET_XMR}z")),
    ("wallet", facts(cmdline=f"x -u={WALLET_ETH}"), "0xab12", facts(cmdline=f"x -u={WALLET_ETH}ff")),
    ("exe-deleted", facts(exe="/usr/bin/python3.11 (deleted)"), "(deleted)", facts(exe="/usr/bin/deleted")),
    ("exe-tmp", facts(exe="/dev/shm/.x/kworker"), "/dev/shm/.x/kworker", facts(exe="/usr/lib/tmp/x")),
    ("exe-hidden", facts(exe="/home/alice/.cache/.x/python3"), "/home/alice/.cache", facts(exe="/home/alice/bin/x")),
    ("exe-hidden", facts(exe="/srv/u/.local/bin/x", home="/srv/u"), "/srv/u/.local", facts(exe="/srv/.x/bin")),
    ("pool-port", facts(pool_peers=(Peer("192.0.2.7", 3333),)), "192.0.2.7:3333", facts(pool_peers=())),
    ("idle-memory", facts(idle_for=61.0, gpu_memory=2 * GiB), "2.0 GiB", facts(idle_for=59.0)),
    ("memory-hog", user(memory_share=85.0), "85%", user(memory_share=85.0, users=1)),
    ("time-hog", user(time_share=99.0), "99%", user(time_share=79.0)),
]


def test_every_rule_of_the_table_is_tested_here():
    assert {name for name, *_ in CASES} == set(RULE_BY_NAME) and len(RULES) == len(RULE_BY_NAME)


@pytest.mark.parametrize(("name", "hit", "word", "miss"), CASES, ids=[c[0] for c in CASES])
def test_each_rule_one_by_one(name, hit, word, miss):
    rule = RULE_BY_NAME[name]
    detail = rule.test(hit, SETTINGS)
    assert detail is not None and word in detail
    assert rule.test(miss, SETTINGS) is None
    # the rule alone makes a finding of its kind, worth its points
    found = [f for f in rogue.evaluate(*((hit,), ()) if isinstance(hit, ProcessFacts) else ((), (hit,)),
                                       SETTINGS) if any(e.rule == name for e in f.evidence)]
    assert [(f.kind, f.score) for f in found] == [(rule.kind, min(100, sum(e.points for e in found[0].evidence)))]


def test_a_plain_trainer_has_no_finding():
    assert rogue.evaluate([facts(), facts(pid=11, idle_for=10.0)], [user()], SETTINGS) == ()


def test_scores_add_up_per_kind_and_stop_at_100():
    renamed = facts(cmdline=f"python3 -o {'stratum+tcp://p:3333'}", exe="/tmp/x")
    (f,) = rogue.evaluate([renamed], [], SETTINGS)
    assert (f.kind, f.score, [e.rule for e in f.evidence]) == ("miner", 75, ["stratum-url", "exe-tmp"])
    loud = dataclasses.replace(renamed, comm="xmrig", pool_peers=(Peer("10.0.0.1", 4444),), idle_for=3600.0)
    found = {f.kind: f for f in rogue.evaluate([loud], [], SETTINGS)}
    assert found["miner"].score == 100 and sum(e.points for e in found["miner"].evidence) == 165
    assert found["idle"].score == 50  # the same process, another kind: a finding of its own
    assert rogue.process_scores(found.values()) == {(10, 5): (100, "miner")}


def test_evidence_is_bounded():
    (f,) = rogue.evaluate([facts(cmdline="x -o stratum+tcp://" + "p" * 5000)], [], SETTINGS)
    assert len(f.evidence[0].detail.encode()) <= rogue.MAX_DETAIL + 3


def _finding(uid: int = 1000) -> Finding:
    f = facts(uid=uid, comm="xmrig", cmdline=f"xmrig -o stratum+tcp://p:1 {WALLET_ETH}", exe="/tmp/xmrig",
              pool_peers=(Peer("192.0.2.1", 3333),), idle_for=99.0)
    return rogue.evaluate([f], [], SETTINGS)[0]


def test_another_user_sees_only_the_evidence_the_listing_would_show_them():
    found = _finding()
    assert {e.rule for e in found.evidence} == {"miner-name", "miner-program", "miner-exe", "stratum-url",
                                                "wallet", "exe-tmp", "pool-port"}
    assert rogue.as_seen_by(found, Viewer(1000, HIDDEN)) == found  # its owner
    assert rogue.as_seen_by(found, Viewer(2000, FULL)) == found  # root, view-all
    program = rogue.as_seen_by(found, Viewer(2000, PROGRAM))  # the name and argv[0] only
    assert [e.rule for e in program.evidence] == ["miner-name", "miner-program"] and program.score == 100
    assert program.comm == "xmrig" and "stratum" not in str(program) and "/tmp" not in str(program)
    assert rogue.as_seen_by(found, Viewer(2000, ANONYMOUS)) is None  # nothing of it derives from GPU figures
    assert rogue.as_seen_by(found, Viewer(2000, HIDDEN)) is None
    idle = next(f for f in rogue.evaluate([facts(comm="nb", idle_for=99.0)], [], SETTINGS))
    anonymous = rogue.as_seen_by(idle, Viewer(2000, ANONYMOUS))
    assert anonymous.comm == "" and anonymous.evidence == idle.evidence
    hog = Finding(kind="abuser", score=50, uid=1000, user="alice", evidence=(Evidence("memory-hog", 50, "x"),))
    assert rogue.as_seen_by(hog, Viewer(2000, ANONYMOUS)) == hog and rogue.as_seen_by(hog, Viewer(2000, HIDDEN)) is None


def test_an_unknown_rule_name_is_never_shown_to_another_user():
    odd = Finding(kind="miner", score=10, uid=1, user="a", pid=1, start_time=1, evidence=(Evidence("new", 10, "s"),))
    assert rogue.as_seen_by(odd, Viewer(2, PROGRAM)) is None


# -- the history: idle holders and abusers over windows ------------------------------------------------------


def gp(pid: int, uid: int = 1000, mem: int | None = GiB, util: float | None = 0.0, device: int = 0, **kw):
    return dataclasses.replace(proc(pid, mem=mem, util=util, uid=uid, user=f"u{uid}", device=device), **kw)


def kinds(found) -> set[tuple[str, int | None, int]]:
    return {(f.kind, f.pid, f.uid) for f in found}


def test_idle_is_held_memory_at_zero_percent_for_the_threshold():
    watch = RogueWatch("/nonexistent", SETTINGS)
    assert watch([gp(1), gp(2, util=5.0), gp(3, util=None), gp(4, mem=1000)], 0.0) == ()
    assert watch([gp(1), gp(2, util=5.0), gp(3, util=None), gp(4, mem=1000)], 59.0) == ()
    assert kinds(watch([gp(1), gp(2, util=5.0), gp(3, util=None)], 60.0)) == {("idle", 1, 1000)}
    # busy for one sample: the clock starts again
    assert watch([gp(1, util=1.0)], 61.0) == ()
    assert watch([gp(1)], 62.0) == () and kinds(watch([gp(1)], 122.0)) == {("idle", 1, 1000)}
    # on two GPUs, busy on one: not idle; shared usage is a lower bound: not idle either
    assert watch([gp(1), gp(1, util=50.0, device=1)], 200.0) == ()
    assert watch([gp(5, shared_usage=True)], 300.0) == () and watch([gp(5, shared_usage=True)], 400.0) == ()


def test_an_abuser_holds_most_of_the_gpus_over_the_window_while_others_want_them():
    watch = RogueWatch("/nonexistent", SETTINGS)
    hog = [gp(1, uid=1000, mem=9 * GiB, util=90.0), gp(2, uid=2000, mem=1 * GiB, util=10.0)]
    assert watch(hog, 0.0) == ()
    assert watch(hog, 40.0) == ()  # less than half the window of history: nothing compared yet
    found = watch(hog, 60.0)
    assert kinds(found) == {("abuser", None, 1000)}
    (f,) = found
    assert {e.rule for e in f.evidence} == {"memory-hog", "time-hog"} and f.score == 100
    assert "90%" in f.evidence[0].detail and f.gpu_memory == 9 * GiB
    # alone on the GPUs, a user abuses no one
    alone = RogueWatch("/nonexistent", SETTINGS)
    for t in (0.0, 60.0, 120.0):
        assert alone([gp(1, uid=1000, mem=9 * GiB, util=90.0)], t) == ()
    # the window slides: once the other user has held more for a window, the first is no longer an abuser
    fair = [gp(1, uid=1000, mem=1 * GiB, util=10.0), gp(2, uid=2000, mem=9 * GiB, util=90.0)]
    for t in range(70, 200, 10):
        found = watch(fair, float(t))
    assert kinds(found) == {("abuser", None, 2000)}


def test_connections_to_pool_ports_are_read_from_the_process_sockets():
    with socket.socket() as pool:
        pool.bind(("127.0.0.1", 0))
        pool.listen(1)
        port = pool.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            me = os.getpid()
            table = sockets.read_tables("/proc", me)
            mine = sockets.socket_inodes("/proc", me)
            assert Peer("127.0.0.1", port) in {table[i] for i in mine if i in table}
            watch = RogueWatch("/proc", dataclasses.replace(SETTINGS, pool_ports=(port,)))
            (f,) = watch([gp(me, util=50.0)], 0.0)
            assert [e.rule for e in f.evidence] == ["pool-port"] and f"127.0.0.1:{port}" in f.evidence[0].detail
            other_ports = RogueWatch("/proc", dataclasses.replace(SETTINGS, pool_ports=(1,)))
            assert other_ports([gp(me, util=50.0)], 0.0) == ()


def test_tcp_tables_are_parsed_v4_v6_and_mapped():
    text = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
            "   0: 0100007F:A1B2 0702000A:0D05 01 00000000:00000000 00:00000000 00000000  1000        0 4242 1\n"
            "   1: 0100007F:A1B3 0702000A:0D05 0A 00000000:00000000 00:00000000 00000000  1000        0 4343 1\n")
    assert sockets.parse_table(text) == {4242: Peer("10.0.2.7", 3333)}  # LISTEN (0A) is not a connection
    v6 = ("sl local remote st a b c d e f\n"
          " 0: 0:0 B80D0120000000000000000001000000:115C 01 0 0 0 1000 0 77 1\n"
          " 1: 0:0 0000000000000000FFFF00000100007F:0D05 02 0 0 0 1000 0 78 1\n")
    assert sockets.parse_table(v6) == {77: Peer("2001:db8::1", 4444), 78: Peer("127.0.0.1", 3333)}
    assert str(Peer("2001:db8::1", 4444)) == "[2001:db8::1]:4444"


# -- [audit] in gpukilld.conf --------------------------------------------------------------------------------


def test_audit_settings_are_read_and_checked(tmp_path):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text("[audit]\nidle_after = 90\nidle_min_memory = 1GiB\nabuser_window = 600\nabuser_share = 75\n"
                    "pool_ports = 3333, 14444\n")
    assert load_config(str(conf)).audit == AuditSettings(90.0, GiB, 600.0, 75.0, (3333, 14444))
    assert load_config(str(tmp_path / "absent.conf")).audit == AuditSettings()
    for line, why in (("abuser_share = 101", "abuser_share must be between 1 and 100"),
                      ("idle_after = nan", "idle_after must be between"),
                      ("idle_min_memory = lots", "idle_min_memory: not a size"),
                      ("pool_ports = 3333 http", "pool_ports must be TCP ports"), ("colour = red", "unknown key")):
        conf.write_text(f"[audit]\n\n{line}\n")
        with pytest.raises(ConfigError) as info:
            load_config(str(conf))
        assert str(info.value).startswith(f"{conf}:3: ") and why in str(info.value), info.value
