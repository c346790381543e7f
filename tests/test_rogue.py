"""The rogue-activity audit without a daemon: each rule of the table (gpukilld/rogue/score.py) one by one, how scores
add up (families and their caps: no family alone reaches a kill), where installers put interpreters (not
hidden), a deleted executable replaced by an upgrade (gpukilld/rogue/exe_replaced.py), what another user sees of a
finding, the history behind windows (gpukilld/rogue/watch.py), TCP tables (gpukilld/rogue/sockets.py) and the [audit]
configuration. The real daemon: tests/test_rogue_daemon.py; the labelled corpus: tests/test_rogue_corpus.py."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from helpers.guard_inputs import GiB, proc

from gpukill.errors import ConfigError
from gpukill.kernel import sock_diag
from gpukill.records.audit import Evidence, Finding
from gpukilld.access.visibility import ANONYMOUS, FULL, HIDDEN, PROGRAM, Viewer
from gpukilld.config import AuditSettings, load_config
from gpukilld.rogue import score as rogue
from gpukilld.rogue import sockets
from gpukilld.rogue.exe_replaced import RECHECK, ExeLookups, exe_replaced, lookup_is_local
from gpukilld.rogue.score import RULE_BY_NAME, RULES, ProcessFacts, UserFacts
from gpukilld.rogue.sockets import Peer
from gpukilld.rogue.watch import RogueWatch

SETTINGS = AuditSettings(idle_after=60.0, idle_min_memory=1 << 20, abuser_window=100.0, abuser_share=80.0)
WALLET_XMR = "4" + "A" + "x" * 93
WALLET_ETH = "0x" + "ab12" * 10


def facts(**kw) -> ProcessFacts:
    base = dict(
        pid=10,
        start_time=5,
        uid=1000,
        user="alice",
        comm="python3",
        cmdline="python3 train.py",
        exe="/usr/bin/python3.11",
        home="/home/alice",
        devices=(0,),
        gpu_memory=GiB,
    )
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
    (
        "stratum-url",
        facts(cmdline="x -o stratum+ssl://eu.pool.example:443 -t 4"),
        "stratum+ssl://eu.pool.example:443",
        facts(cmdline="x --docs https://example.com/stratum"),
    ),
    ("stratum-url", facts(cmdline="x -o STRATUM2+TCP://p:1"), "STRATUM2+TCP://p:1", facts(cmdline="x stratum://p")),
    (
        "pool-host",
        facts(cmdline="x --url xmr-eu1.nanopool.org:14433"),
        "xmr-eu1.nanopool.org",
        facts(cmdline="x --url nanopool.org.example.com"),
    ),
    ("wallet", facts(cmdline=f"x --user {WALLET_XMR}.rig1"), "4Axxxx", facts(cmdline=f"x --hash {WALLET_XMR}z")),
    ("wallet", facts(cmdline=f"x -u={WALLET_ETH}"), "0xab12", facts(cmdline=f"x -u={WALLET_ETH}ff")),
    ("exe-deleted", facts(exe="/usr/bin/python3.11 (deleted)"), "(deleted)", facts(exe="/usr/bin/deleted")),
    # an upgrade (apt, conda) renamed a new interpreter over the running one: deleted, but replaced
    (
        "exe-deleted",
        facts(exe="/tmp/x (deleted)"),
        "/tmp/x",
        facts(exe="/usr/bin/python3.11 (deleted)", exe_replaced=True),
    ),
    # on a filesystem that was not looked up in (FUSE, NFS, overlay): not known, no evidence
    (
        "exe-deleted",
        facts(exe="/tmp/x (deleted)", exe_replaced=False),
        "(deleted)",
        facts(exe="/home/alice/.conda/envs/t/bin/python3.11 (deleted)", exe_replaced=None),
    ),
    ("exe-tmp", facts(exe="/dev/shm/.x/kworker"), "/dev/shm/.x/kworker", facts(exe="/usr/lib/tmp/x")),
    ("exe-hidden", facts(exe="/home/alice/.cache/.x/python3"), "/home/alice/.cache", facts(exe="/home/alice/bin/x")),
    ("exe-hidden", facts(exe="/srv/u/.cache/x", home="/srv/u"), "/srv/u/.cache", facts(exe="/srv/.x/bin")),
    (
        "exe-hidden",
        facts(exe="/home/alice/.local/share/.x/python3"),
        ".local/share/.x",
        facts(exe="/home/alice/.local/share/uv/python/cpython-3.12.7-linux-x86_64-gnu/bin/python3.12"),
    ),
    ("pool-port", facts(pool_peers=(Peer("192.0.2.7", 3333),)), "192.0.2.7:3333", facts(pool_peers=())),
    (
        "allowed-untrusted",
        facts(exe="/usr/bin/sleep", untrusted_allowed="it runs code from /home/b/x.so"),
        "x.so",
        facts(exe="/usr/bin/sleep"),
    ),
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
    found = [
        f
        for f in rogue.evaluate(*((hit,), ()) if isinstance(hit, ProcessFacts) else ((), (hit,)), SETTINGS)
        if any(e.rule == name for e in f.evidence)
    ]
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


# -- families: what one kind of evidence can add ---------------------------------------------------------------

KILL_THRESHOLD = 70  # docs/audit.md's example policy no-miners: rogue_score >= 70 and rogue_kind == miner


def score(f: ProcessFacts) -> int:
    return max((x.score for x in rogue.evaluate([f], [], SETTINGS) if x.kind == "miner"), default=0)


def test_no_family_alone_reaches_the_kill_threshold():
    """Every rule of a family matching at once: the family adds its cap, below the kill threshold of
    docs/audit.md."""
    deleted_tmp = "/tmp/.x/python3 (deleted)"
    everything = {
        "name": facts(comm="xmrig", cmdline="./xmrig --config=config.json", exe="/opt/xmrig-6.21.0/xmrig"),
        "command-line": facts(cmdline=f"python3 -o stratum+tcp://xmr.nanopool.org:3333 -u {WALLET_XMR}"),
        "exe-location": facts(exe=deleted_tmp),
        "sockets": facts(pool_peers=(Peer("192.0.2.7", 3333), Peer("192.0.2.8", 4444))),
    }
    for family, f in everything.items():
        (found,) = rogue.evaluate([f], [], SETTINGS)
        assert {RULE_BY_NAME[e.rule].family.name for e in found.evidence} == {family}
        assert found.score == next(x.cap for x in rogue.FAMILIES if x.name == family) < KILL_THRESHOLD, found
    assert score(everything["name"]) == 60  # three ways of saying one name: 60, not 180
    # the weak families together: an executable deleted under /tmp (or hidden) talking to pool ports
    weak = dataclasses.replace(everything["sockets"], exe=deleted_tmp)
    assert score(weak) == 25 + 30 < KILL_THRESHOLD
    hidden = dataclasses.replace(weak, exe="/home/alice/.cache/x/python3 (deleted)")
    assert score(hidden) == 55
    # a strong family and one more: docs/audit.md's worked examples
    assert score(dataclasses.replace(everything["name"], pool_peers=weak.pool_peers)) == 90
    renamed = facts(cmdline="python3 -o stratum+tcp://p:3333", exe="/tmp/x")
    assert score(renamed) == 75 and score(dataclasses.replace(renamed, pool_peers=weak.pool_peers)) == 100


def test_the_table_keeps_every_family_below_a_kill():
    process_families = {r.family for r in RULES if r.kind != "abuser"}
    assert all(f.cap < KILL_THRESHOLD for f in process_families)
    assert sum(f.cap for f in rogue.FAMILIES if f.weak) < KILL_THRESHOLD
    assert all(r.family in rogue.FAMILIES and r.points <= r.family.cap and r.risk for r in RULES)
    assert len({r.family.name for r in RULES if r.kind == "abuser"} & {f.name for f in process_families}) == 0


def test_a_planted_score_stays_far_below_the_threshold():
    """alice's job on a uv interpreter that apt-style upgrade replaced, with bob's planted pool-port peer: of the
    20 + 20 + 30 = 70 of a scorer counting all three, the planted connection alone is left (and the socket
    reader drops even that)."""
    alice = facts(
        exe="/home/alice/.local/share/uv/python/cpython-3.11.9-linux-x86_64-gnu/bin/python3.11 (deleted)",
        exe_replaced=True,
        pool_peers=(Peer("127.0.0.1", 3333),),
    )
    assert score(alice) == 30
    assert (
        score(
            dataclasses.replace(
                alice, exe="/home/alice/.pyenv/versions/3.11.9/bin/python3.11 (deleted)", exe_replaced=False
            )
        )
        == 50
    )


def test_the_readme_tables_say_what_the_code_does():
    text = (Path(__file__).resolve().parents[1] / "docs" / "audit.md").read_text()
    section = text[text.index("# Rogue-activity audit") :]  # the whole page, its settings too
    rows = [
        [c.strip().strip("`") for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| `") or re.match(r"\| [a-z-]+ \| \d+ \| (yes|no) \|", line)
    ]
    rules = {r[0]: (r[1], r[2], int(r[3])) for r in rows if r[0] in RULE_BY_NAME}
    assert rules == {r.name: (r.kind, r.family.name, r.points) for r in RULES}
    families = {r[0]: (int(r[1]), r[2] == "yes") for r in rows if r[0] in {f.name for f in rogue.FAMILIES}}
    assert families == {f.name: (f.cap, f.weak) for f in rogue.FAMILIES}


UNDER_HOME = [  # where installers put interpreters and toolchains: not hidden
    ".local/share/uv/python/cpython-3.11.9-linux-x86_64-gnu/bin/python3.11",
    ".local/share/uv/tools/vllm/bin/python",
    ".pyenv/versions/3.11.9/bin/python3.11",
    ".pyenv/versions/miniconda3-latest/envs/t/bin/python",
    ".conda/envs/train/bin/python3.11",
    ".local/share/mamba/envs/t/bin/python",
    ".micromamba/envs/t/bin/python",
    ".local/share/pipx/venvs/jupyterlab/bin/python",
    ".local/pipx/venvs/x/bin/python",
    ".local/bin/torchrun",
    ".local/lib/python3.11/site-packages/triton/backends/nvidia/bin/ptxas",
    "proj/.venv/bin/python",
    "w/proj/.pixi/envs/default/bin/python",
    "proj/.tox/py311/bin/python",
    ".cargo/bin/candle",
    ".rustup/toolchains/stable-x86_64-unknown-linux-gnu/bin/rustc",
    ".nvm/versions/node/v20.11.0/bin/node",
    ".local/share/mise/installs/python/3.12/bin/python3.12",
    ".asdf/installs/python/3.12.1/bin/python3.12",
    ".julia/juliaup/julia-1.10.4+0.x64.linux.gnu/bin/julia",
    ".vscode-server/bin/abc123/node",
    "miniconda3/envs/t/bin/python",
    "anaconda3/bin/python",
    ".local/share/virtualenvs/p-1a2b/bin/python",
]
HIDDEN_PATHS = [
    ".cache/x",
    ".config/.x/python3",
    ".local/share/.x/y",
    ".local/bin/.x/python3",
    ".pyenv/python3",
    ".conda/x",
    "proj/.venv/.x/xmrig",
    ".ssh/python3",
    ".local/lib/../.x/y",
    ".x/.venv/bin/python",
]


@pytest.mark.parametrize("path", UNDER_HOME)
def test_interpreters_where_installers_put_them_are_not_hidden(path):
    for home in ("/home/alice", "/srv/homes/alice"):
        assert RULE_BY_NAME["exe-hidden"].test(facts(exe=f"{home}/{path}", home=home), SETTINGS) is None, path


@pytest.mark.parametrize("path", HIDDEN_PATHS)
def test_other_hidden_folders_are_still_hidden(path):
    assert RULE_BY_NAME["exe-hidden"].test(facts(exe=f"/home/alice/{path}"), SETTINGS) is not None, path


def test_evidence_is_bounded():
    (f,) = rogue.evaluate([facts(cmdline="x -o stratum+tcp://" + "p" * 5000)], [], SETTINGS)
    assert len(f.evidence[0].detail.encode()) <= rogue.MAX_DETAIL + 3


def _finding(uid: int = 1000) -> Finding:
    f = facts(
        uid=uid,
        comm="xmrig",
        cmdline=f"xmrig -o stratum+tcp://p:1 {WALLET_ETH}",
        exe="/tmp/xmrig",
        pool_peers=(Peer("192.0.2.1", 3333),),
        idle_for=99.0,
    )
    return rogue.evaluate([f], [], SETTINGS)[0]


def test_another_user_sees_only_the_evidence_the_listing_would_show_them():
    found = _finding()
    assert {e.rule for e in found.evidence} == {
        "miner-name",
        "miner-program",
        "miner-exe",
        "stratum-url",
        "wallet",
        "exe-tmp",
        "pool-port",
    }
    assert rogue.as_seen_by(found, Viewer(1000, HIDDEN)) == found  # its owner
    assert rogue.as_seen_by(found, Viewer(2000, FULL)) == found  # root, view-all
    program = rogue.as_seen_by(found, Viewer(2000, PROGRAM))  # the name and argv[0] only
    # one family (the name), told twice: it adds its cap once
    assert [(e.rule, e.points) for e in program.evidence] == [("miner-name", 60), ("miner-program", 0)]
    assert program.score == 60
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


@pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: sock_diag of the host's namespace is read as the daemon does"
)
def test_connections_to_pool_ports_are_read_from_the_process_sockets():
    with socket.socket() as pool:
        pool.bind(("127.0.0.1", 0))
        pool.listen(1)
        port = pool.getsockname()[1]  # inside the ephemeral range, which the audit leaves out: widened here
        with socket.create_connection(("127.0.0.1", port)):
            me = os.getpid()
            assert sockets.PoolConnections("/proc").read([("me", me, os.getuid())], (port,)) == {
                "me": (Peer("127.0.0.1", port),)
            }
            watch = RogueWatch("/proc", dataclasses.replace(SETTINGS, pool_ports=(port,)))
            watch._ephemeral = (float("inf"), None)  # as if no ephemeral range held the port
            (f,) = watch([gp(me, uid=os.getuid(), util=50.0)], 0.0)
            assert [e.rule for e in f.evidence] == ["pool-port"] and f"127.0.0.1:{port}" in f.evidence[0].detail
            other_ports = RogueWatch("/proc", dataclasses.replace(SETTINGS, pool_ports=(1,)))
            assert other_ports([gp(me, uid=os.getuid(), util=50.0)], 0.0) == ()


def test_the_sock_diag_filter_is_a_program_the_kernel_accepts():
    """Port ranges merged; the bytecode's layout (each block GE, LE, JMP to the end; a JMP past it rejects)."""
    assert sock_diag.port_ranges([3334, 3333, 14444, 3357, 3333]) == [(3333, 3334), (3357, 3357), (14444, 14444)]
    program = sock_diag.bytecode([(3333, 3334)], remote=True)
    assert program == bytes([sock_diag.BC_D_GE, 8, 20, 0, 0, 0]) + (3333).to_bytes(2, "little") + bytes(
        [sock_diag.BC_D_LE, 8, 12, 0, 0, 0]
    ) + (3334).to_bytes(2, "little") + bytes([sock_diag.BC_JMP, 4, 8, 0, sock_diag.BC_JMP, 4, 8, 0])
    with sock_diag.open_in(None) as s:  # the kernel audits the program: a wrong one is EINVAL
        for ranges in ([(1, 1)], [(3333, 3334), (4444, 4444), (60000, 65535)]):
            for remote in (True, False):
                sock_diag.dump(
                    s,
                    socket.AF_INET6,
                    sock_diag.CONNECTING | sock_diag.LISTENING,
                    sock_diag.bytecode(ranges, remote),
                    1 << 20,
                )


# -- a deleted executable, replaced or not (gpukilld/rogue/exe_replaced.py) -----------------------------------------


@pytest.fixture
def interpreter(tmp_path):
    """A real process on a copy of python3 under tmp_path, and its exe's path."""
    os.chmod(tmp_path, 0o755)
    exe = tmp_path / "bin" / "python3.11"
    exe.parent.mkdir()
    shutil.copy("/usr/bin/python3", exe)
    proc = subprocess.Popen(
        [str(exe), "-c", "import time; print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        yield proc, exe
    finally:
        proc.kill()
        proc.wait()


def test_an_upgraded_interpreter_is_replaced_and_a_removed_one_is_deleted(interpreter):
    proc, exe = interpreter
    watch = RogueWatch("/proc", SETTINGS)

    samples = iter(range(1, 100))

    def seen():
        # a new sample (utilization moved) looks at the process again, and its deleted executable is looked up
        # again once RECHECK has passed (with the same records, when its sockets are re-read: SOCKETS_TTL)
        target = os.readlink(f"/proc/{proc.pid}/exe")
        n = next(samples)
        found = watch([gp(proc.pid, util=float(n), exe=target)], n * RECHECK)
        deleted = [e.rule for f in found for e in f.evidence if e.rule != "exe-tmp"]  # tmp_path is under /tmp
        return target, exe_replaced("/proc", proc.pid, target), deleted

    assert seen() == (str(exe), False, [])
    new = exe.with_name("python3.11.dpkg-new")  # as dpkg unpacks: a new file renamed over the old one
    shutil.copy("/usr/bin/python3", new)
    os.rename(new, exe)
    assert seen() == (f"{exe} (deleted)", True, [])
    exe.unlink()  # now nothing stands at its path: that is the rule's evidence
    assert seen() == (f"{exe} (deleted)", False, ["exe-deleted"])
    os.symlink("/usr/bin/python3", exe)  # a symbolic link is not followed (it would be, from the daemon's root)
    assert seen() == (f"{exe} (deleted)", None, [])  # not known: no evidence
    exe.unlink()
    exe.mkdir()
    assert exe_replaced("/proc", proc.pid, f"{exe} (deleted)") is False  # not a file
    assert exe_replaced("/proc", proc.pid, str(exe)) is False  # not deleted: nothing to look up
    assert exe_replaced("/proc", proc.pid, "/x/../etc/passwd (deleted)") is None


def test_a_deleted_executable_is_looked_up_once_per_recheck(monkeypatch):
    from gpukilld.rogue import exe_replaced as module

    asked: list[int] = []
    monkeypatch.setattr(module, "exe_replaced", lambda root, pid, exe: asked.append(pid) or True)
    lookups = ExeLookups("/proc")
    for t in (0.0, 1.0, RECHECK - 1):
        assert lookups((7, 1), "/usr/bin/python3.11 (deleted)", t) is True
    assert lookups((7, 1), "/usr/bin/python3.11", 2.0) is False  # not deleted: nothing looked up
    assert asked == [7]
    assert lookups((7, 1), "/usr/bin/python3.11 (deleted)", RECHECK) is True and asked == [7, 7]
    assert lookups((7, 1), "/usr/lib/other (deleted)", RECHECK + 1) is True and asked == [7, 7, 7]  # a new exe
    for pid in range(100, 300):  # processes come and go: the gone ones are forgotten as new ones come
        lookups((pid, 1), "/x (deleted)", 10 * RECHECK)
    for pid in range(1000, 1500):
        lookups((pid, 1), "/x (deleted)", 20 * RECHECK)
    assert not any(pid < 1000 for pid, _ in lookups._seen) and len(lookups._seen) <= 2 * 500 + 64


MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
28 27 0:25 / /home rw,relatime shared:5 - ext4 /dev/vdb rw
29 28 0:26 / /home/bob/mnt rw,nosuid,nodev - fuse.sshfs bob@host: rw,user_id=1001
30 27 0:27 / /srv/nfs rw - nfs4 server:/export rw
31 27 0:28 / /with\\040space rw - tmpfs tmpfs rw
"""


def test_a_lookup_never_waits_on_a_server():
    """FUSE (served by a user) and network filesystems are not looked up in: not known to be replaced."""
    assert lookup_is_local(MOUNTINFO, "/usr/bin/python3.11")
    assert lookup_is_local(MOUNTINFO, "/home/alice/.conda/envs/t/bin/python")
    assert not lookup_is_local(MOUNTINFO, "/home/bob/mnt/xmrig")
    assert lookup_is_local(MOUNTINFO, "/home/bob/mntx/python3")
    assert not lookup_is_local(MOUNTINFO, "/srv/nfs/conda/bin/python")
    assert lookup_is_local(MOUNTINFO, "/with space/x")
    assert not lookup_is_local(MOUNTINFO.replace("ext4 /dev/vda", "overlay overlay"), "/usr/bin/python3")
    assert not lookup_is_local("garbage\n", "/usr/bin/python3") and not lookup_is_local("", "/usr/bin/python3")


# -- [audit] in gpukilld.conf --------------------------------------------------------------------------------


def test_audit_settings_are_read_and_checked(tmp_path):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text(
        "[audit]\nidle_after = 90\nidle_min_memory = 1GiB\nabuser_window = 600\nabuser_share = 75\n"
        "pool_ports = 3333, 14444\n"
    )
    assert load_config(str(conf)).audit == AuditSettings(90.0, GiB, 600.0, 75.0, (3333, 14444))
    assert load_config(str(tmp_path / "absent.conf")).audit == AuditSettings()
    conf.write_text("[audit]\nidle_after = 30min\nabuser_window = 1h\n")  # durations in the one grammar
    assert (load_config(str(conf)).audit.idle_after, load_config(str(conf)).audit.abuser_window) == (1800.0, 3600.0)
    for line, why in (
        ("abuser_share = 101", "abuser_share must be between 1 and 100"),
        ("idle_after = nan", "idle_after: not a duration: 'nan'"),
        ("idle_after = 40d", "idle_after must be between"),
        ("idle_min_memory = lots", "idle_min_memory: not a size"),
        ("pool_ports = 3333 http", "pool_ports must be TCP ports"),
        ("colour = red", "unknown key"),
    ):
        conf.write_text(f"[audit]\n\n{line}\n")
        with pytest.raises(ConfigError) as info:
            load_config(str(conf))
        assert str(info.value).startswith(f"{conf}:3: ") and why in str(info.value), info.value
