"""The audit's socket evidence (gpukilld/rogue/sockets.py, gpukill/kernel/sock_diag.py): only connections a GPU process
made
count, read through sock_diag, on real sockets of real processes of two unprivileged users on loopback.

- planted: bob binds his client socket's source port to a pool port and connects to alice's server: her
  accepted socket's remote port is the pool port, and must not count; her own connection to a pool does;
- a miner that opens 4,096 descriptors before its pool socket is still found;
- a connection in a process's own user+net namespace is found (setns into it), and one it made in the host's
  namespace before moving into a namespace of its own too;
- a pool port inside the ephemeral range is not used (config and audit).
The 300-namespace budget run: tests/test_audit_budget.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import time

import pytest
from helpers import pools
from helpers.guard_inputs import proc
from helpers.testbed import SYSTEM_PYTHON, User

from gpukill.kernel import sock_diag
from gpukilld import audit_settings
from gpukilld.config import AuditSettings, load_config
from gpukilld.rogue import sockets
from gpukilld.rogue.sockets import Peer, PoolConnections
from gpukilld.rogue.watch import RogueWatch

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: runs processes as two other users and reads their descriptors"
)

SETTINGS = AuditSettings(
    idle_after=60.0, idle_min_memory=1 << 20, abuser_window=100.0, abuser_share=80.0, pool_ports=(3333,)
)

# alice's server: listens, accepts and holds every connection (saying "accepted"), and connects out where told.
SERVER = """\
import resource, socket, sys, threading, time
padding = int(sys.argv[3]) if len(sys.argv) > 3 else 0
if padding:
    resource.setrlimit(resource.RLIMIT_NOFILE, (padding + 256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held_fds = [open("/dev/null") for _ in range(padding)]  # before the pool socket: they come first in fd/
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(64)
held = []
def serve():
    while True:
        held.append(l.accept()[0]); print("accepted", flush=True)
threading.Thread(target=serve, daemon=True).start()
if sys.argv[1] != "-":
    held.append(socket.create_connection((sys.argv[1], int(sys.argv[2]))))
print(l.getsockname()[1], flush=True)
time.sleep(300)
"""
# bob: a client socket bound to a pool port as its source, connected to alice's server
PLANTER = """\
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.connect(("127.0.0.1", int(sys.argv[3])))
print("connected", flush=True)
time.sleep(300)
"""


@pytest.fixture
def people():
    started: list[subprocess.Popen] = []

    def run(user: User, code: str, *args: str, wrap: list[str] | None = None) -> subprocess.Popen:
        argv = [*(wrap or []), SYSTEM_PYTHON, "-c", code, *args]
        p = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            cwd="/",
            text=True,
            start_new_session=True,
            **user.popen_kwargs(),
        )
        started.append(p)
        return p

    yield run
    for p in started:
        p.kill()
        p.wait()


def line(p: subprocess.Popen) -> str:
    assert p.stdout is not None
    text = p.stdout.readline().strip()
    assert text, f"process {p.args!r} ended: {p.wait()}"
    return text


def pool_peers(pid: int, uid: int, settings: AuditSettings = SETTINGS, watch: RogueWatch | None = None):
    """What the audit counts as the process's connections to pool ports: the `pool-port` evidence's peers, read
    as the daemon reads them (RogueWatch on /proc), and the socket layer's answer beside it."""
    watch = watch or RogueWatch("/proc", settings)
    record = dataclasses.replace(proc(pid, util=50.0, uid=uid, user=f"u{uid}", mem=1 << 30))
    key = (record.pid, record.start_time)
    for _ in range(50):  # a round past its budget (a loaded host) leaves the process for the next one
        found = watch([record], time.monotonic())
        if key in watch._peers:
            break
    evidence = [e.detail for f in found for e in f.evidence if e.rule == "pool-port"]
    return watch._peers[key][0], evidence


def read_all(reader: PoolConnections, due: list, ports) -> dict:
    """Rounds of reader.read until every one of `due` is read (each round's budget may defer some)."""
    done: dict = {}
    for _ in range(50):
        done.update(reader.read([d for d in due if d[0] not in done], ports))
        if len(done) == len(due):
            return done
    raise AssertionError(f"not read in 50 rounds: {reader.last_round}")


def test_bob_cannot_plant_pool_port_evidence_on_alices_server(people, users):
    alice, bob = users["owner"], users["other"]
    pool = pools.listen(3333)
    try:
        pool_host = pool.getsockname()[0]
        server = people(alice, SERVER, pool_host, "3333")
        port = int(line(server))
        # bob, from 127.0.0.9:3333 (or another loopback address, should that be taken), to alice's server
        source = "127.0.0.9" if pool_host != "127.0.0.9" else "127.0.0.10"
        planter = people(bob, PLANTER, source, "3333", str(port))
        assert line(planter) == "connected" and line(server) == "accepted"
        # the planted socket is there, with the pool port as its remote end (what a reading of /proc/net/tcp would
        # count)
        s = sock_diag.open_in(None)
        with s:
            seen, _ = sock_diag.dump(
                s, socket.AF_INET, sock_diag.CONNECTING, sock_diag.bytecode([(3333, 3333)], remote=True), 1 << 20
            )
        assert any(c.local_port == port and c.remote_address == source and c.uid == alice.uid for c in seen), seen

        peers, evidence = pool_peers(server.pid, alice.uid)
        # her own connection to the pool counts; bob's connection to her server does not
        assert peers == (Peer(pool_host, 3333),), peers
        assert evidence and f"{pool_host}:3333" in evidence[0] and source not in evidence[0], evidence

        # and with no connection of her own, nothing at all
        quiet = people(alice, SERVER, "-", "0")
        quiet_port = int(line(quiet))
        people(bob, PLANTER, source, "3333", str(quiet_port)).stdout.readline()
        assert line(quiet) == "accepted"
        assert pool_peers(quiet.pid, alice.uid) == ((), [])
    finally:
        pool.close()


def test_a_miner_behind_4096_padding_descriptors_is_found(people, users):
    alice = users["owner"]
    pool = pools.listen(3333)
    try:
        miner = people(alice, SERVER, pool.getsockname()[0], "3333", "4096")
        line(miner)
        assert len(os.listdir(f"/proc/{miner.pid}/fd")) > 4096
        peers, evidence = pool_peers(miner.pid, alice.uid)
        assert peers == (Peer(pool.getsockname()[0], 3333),) and evidence, (peers, evidence)
        # another user's uid is not the socket's owner: its descriptors are not even looked at
        other = PoolConnections("/proc")
        assert read_all(other, [("k", miner.pid, 4242424)], (3333,)) == {"k": ()}
        assert other.last_round["fds"] == 0
    finally:
        pool.close()


NETNS_MINER = """\
import ctypes, socket, sys, time
if sys.argv[1] == "move":  # connect in the host's namespace, then move into a user+net namespace of its own
    s = socket.create_connection((sys.argv[2], int(sys.argv[3])))
    assert ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) == 0, ctypes.get_errno()
else:  # already in a namespace of its own: its pool listens there too
    pool = socket.socket(); pool.bind(("127.0.0.1", 3333)); pool.listen(8)
    s = socket.create_connection(("127.0.0.1", 3333))
print("ready", flush=True)
time.sleep(300)
"""


def test_connections_in_a_user_and_network_namespace_of_its_own_are_found(people, users):
    alice = users["owner"]
    inside = people(
        alice, NETNS_MINER, "inside", wrap=["unshare", "-Urn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']
    )
    assert line(inside) == "ready"
    assert os.stat(f"/proc/{inside.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
    assert pool_peers(inside.pid, alice.uid)[0] == (Peer("127.0.0.1", 3333),)

    pool = pools.listen(3333)
    try:
        moved = people(alice, NETNS_MINER, "move", pool.getsockname()[0], "3333")
        assert line(moved) == "ready"
        assert os.stat(f"/proc/{moved.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
        assert pool_peers(moved.pid, alice.uid)[0] == (Peer(pool.getsockname()[0], 3333),)
    finally:
        pool.close()


def test_a_pool_port_inside_the_ephemeral_range_is_not_used(people, users, tmp_path, caplog):
    alice = users["owner"]
    span = audit_settings.ephemeral_range()
    assert span is not None
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))  # a port the kernel picks: inside the ephemeral range
    busy.listen(8)
    try:
        port = busy.getsockname()[1]
        assert span[0] <= port <= span[1]
        client = people(alice, SERVER, "127.0.0.1", str(port))
        line(client)
        inside = dataclasses.replace(SETTINGS, pool_ports=(port,))
        assert pool_peers(client.pid, alice.uid, inside) == ((), [])
        # the same connection, its port counted as a pool port (were it outside the range), is seen
        reader = PoolConnections("/proc")
        assert read_all(reader, [("k", client.pid, alice.uid)], (port,)) == {"k": (Peer("127.0.0.1", port),)}
    finally:
        busy.close()

    # the defaults hold no port of the default ephemeral range, nor Jupyter's
    assert not [p for p in AuditSettings().pool_ports if 32768 <= p <= 60999 or p == 8888]
    # configured ones inside it are left out with a line naming them and where they are
    conf = tmp_path / "gpukilld.conf"
    conf.write_text(f"[audit]\npool_ports = 3333 {span[0]} {span[1]} 14444\n")
    with caplog.at_level(logging.WARNING, logger="gpukilld"):
        assert load_config(str(conf)).audit.pool_ports == (3333, 14444)
    assert f"{conf}:2: pool_ports {span[0]}, {span[1]} ignored" in caplog.text


def test_the_round_budget_defers_and_finishes_everything(people, users):
    """A budget of two namespaces a round: five processes in namespaces of their own are read over rounds, the
    ones waiting first, none dropped."""
    alice = users["owner"]
    wrap = ["unshare", "-Urn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']
    miners = [people(alice, NETNS_MINER, "inside", wrap=wrap) for _ in range(5)]
    for m in miners:
        assert line(m) == "ready"
    reader = PoolConnections("/proc", sockets.RoundBudget(namespaces=2))
    waiting = [(m.pid, m.pid, alice.uid) for m in miners]
    rounds = 0
    while waiting:
        done = reader.read(waiting, (3333,))
        assert done and reader.last_round["namespaces"] <= 2, reader.last_round
        assert all(peers == (Peer("127.0.0.1", 3333),) for peers in done.values()), done
        assert [w[0] for w in waiting if w[0] in done] == [w[0] for w in waiting][: len(done)]  # first come first
        waiting = [w for w in waiting if w[0] not in done]
        rounds += 1
    assert rounds >= 3


# alice's job: no connection until told (a line on stdin), then one to the pool, as after an exec into a miner
LATE_CONNECTOR = """\
import socket, sys, time
print("ready", flush=True)
sys.stdin.readline()
held = socket.create_connection((sys.argv[1], int(sys.argv[2])))
print("connected", flush=True)
time.sleep(300)
"""


def test_a_process_that_execs_into_another_program_has_its_connections_read_again_at_once(users):
    """Connections are re-read a TTL (60 to 90 s) after the last read, but at once when the process's
    executable or command line changed: the proc connector shows an exec in the next sample, and the pool
    socket a miner opens right after it must not wait a minute to count."""
    alice = users["owner"]
    pool = pools.listen(3333)
    job = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", LATE_CONNECTOR, pool.getsockname()[0], "3333"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        start_new_session=True,
        **alice.popen_kwargs(),
    )
    try:
        assert line(job) == "ready"
        watch = RogueWatch("/proc", SETTINGS)
        before = proc(
            job.pid, comm="python3", util=50.0, uid=alice.uid, user="alice", mem=1 << 30, cmdline="python3 train.py"
        )
        key = (before.pid, before.start_time)
        for _ in range(50):  # a round past its budget (a loaded host) leaves the process for the next one
            watch([before], time.monotonic())
            if key in watch._peers:
                break
        assert watch._peers[key][0] == ()
        assert job.stdin is not None
        job.stdin.write("go\n")
        job.stdin.flush()
        assert line(job) == "connected"
        # the same program as before: its connections are not read again yet
        watch([before], time.monotonic())
        assert watch._peers[key][0] == ()
        # the same process after an exec: read again in this very sample
        after = dataclasses.replace(before, comm="xmrig", cmdline="xmrig -o pool", exe="/home/alice/xmrig")
        found = watch([after], time.monotonic())
        assert watch._peers[key][0] == (Peer(pool.getsockname()[0], 3333),)
        assert any(e.rule == "pool-port" for f in found for e in f.evidence), found
    finally:
        job.kill()
        job.wait()
        pool.close()


# alice's job: connects to the pool when told, and closes that connection when told
CONNECT_THEN_CLOSE = """\
import socket, sys, time
print("ready", flush=True)
sys.stdin.readline()
held = socket.create_connection((sys.argv[1], int(sys.argv[2])))
print("connected", flush=True)
sys.stdin.readline()
held.close()
print("closed", flush=True)
time.sleep(300)
"""


def test_the_hosts_dump_serves_its_ttl_and_never_counts_a_socket_the_process_let_go(users, monkeypatch):
    """The host's namespace is dumped again for a process read for the first time, else at most every HOST_TTL
    seconds (a dump walks the kernel's whole TCP hash table): a connection made after the dump waits for the
    next one; and a connection in a kept dump counts only while the process still holds that socket."""
    alice = users["owner"]
    pool = pools.listen(3333)
    clock = [1000.0]
    monkeypatch.setattr(sockets, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    dumps = []
    real_dump = sock_diag.dump

    def counted(*args, **kwargs):
        dumps.append(clock[0])
        return real_dump(*args, **kwargs)

    monkeypatch.setattr(sock_diag, "dump", counted)
    job = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", CONNECT_THEN_CLOSE, pool.getsockname()[0], "3333"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        start_new_session=True,
        **alice.popen_kwargs(),
    )
    assert job.stdin is not None

    def say(word: str, answer: str) -> None:
        job.stdin.write(word + "\n")
        job.stdin.flush()
        assert line(job) == answer

    try:
        assert line(job) == "ready"
        reader = PoolConnections("/proc")
        due = [("job", job.pid, alice.uid)]
        assert reader.read(due, [3333], new=["job"]) == {"job": ()}  # new: the host's namespace dumped now
        first = len(dumps)
        assert first >= 1
        say("go", "connected")
        clock[0] += sockets.HOST_TTL - 1
        assert reader.read(due, [3333]) == {"job": ()}  # read before: the dump of HOST_TTL - 1 s ago serves
        assert len(dumps) == first
        clock[0] += 1
        assert reader.read(due, [3333]) == {"job": (Peer(pool.getsockname()[0], 3333),)}  # a fresh dump
        assert len(dumps) > first
        kept = len(dumps)
        say("close", "closed")
        clock[0] += 1
        # the kept dump still names the connection; the process no longer holds it, so it does not count
        assert reader.read(due, [3333]) == {"job": ()}
        assert len(dumps) == kept
    finally:
        job.kill()
        job.wait()
        pool.close()
