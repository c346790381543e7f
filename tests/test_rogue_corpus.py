"""The rogue audit's labelled corpus: ordinary GPU workloads and miners, as real processes of real unprivileged
users, seen by the real daemon (simulated backend) with the documented example policies in force (not dry run).

Benign (gpkowner, "alice"): a trainer; a Jupyter-like server and an inference server each receiving hundreds of
inbound connections, some of them from source ports equal to pool ports, made by the other user (a planted
attack on port-based scoring); a TensorBoard-like server; interpreters where uv, pyenv, conda, mamba, pipx and venvs put
them under $HOME (real copies of /usr/bin/python3); interpreters replaced mid-run, as apt and uv upgrades do;
torch.distributed-like peers on 29500; a notebook kernel talking to its server on 8888; outbound connections to
443 and 8080. Hostile (gpkother, "bob"): miners by name, renamed, behind 4,096 descriptors, on port 443, each
connecting out to a fake pool of the test's own on loopback and sending a stratum login.

Every process is started before the daemon, so its first look at each (what it reads at once) sees every
connection, replacement and deletion. The test fails if any benign process is killed or scored at or above the
kill threshold, or if a hostile kind's recall is below what docs/audit.md's corpus table states; it prints the
table it measured (pytest -s, or -rA).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from helpers.marks import needs_root
from helpers.testbed import REPO, ROOT, SYSTEM_PYTHON, Testbed, User
from helpers.waiting import wait_until

from gpukilld import journal as audit

pytestmark = needs_root

INTERVAL = 1.0  # the daemon's sample interval
OBSERVE = 12.0  # seconds of samples watched once every corpus process was seen
INBOUND = 300  # connections each busy server receives from alice's clients (the browsers, the load balancer)
PLANTED_PORTS = (3333, 4444, 5555, 14444, 45560, 45700)  # bob's source ports: pool ports of the default list
PADDING = 4096
LATE = 15.0  # seconds a hostile process runs as a trainer before it becomes a miner
WALLET = "4A" + ("a1B2c3D4e5" * 10)[:93]  # Monero-shaped: 95 base58 characters from 4
AUDIT_DOC = REPO / "docs" / "audit.md"  # the audit page: no-miners, the corpus table
GUARD_DOC = REPO / "docs" / "guard.md"  # Guard Mode's first example policy

# Every corpus process runs this, as `INTERPRETER role.py WORD...`. Words of the form verb=ARG are what it does,
# in order; other words are only there for its command line (what a real program's arguments would be).
ROLE = r'''
import ctypes, json, os, resource, socket, sys, threading, time

resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
keep = []


def accept_all(listener):
    while True:
        keep.append(listener.accept()[0])


def connect(spec):
    """[SRC_HOST:SRC_PORT>]HOST:PORT, retried while nobody listens yet (peers start in any order)."""
    src, _, dst = spec.rpartition(">")
    host, port = dst.rsplit(":", 1)
    deadline = time.monotonic() + 30
    while True:
        s = socket.socket()
        if src:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            shost, sport = src.rsplit(":", 1)
            s.bind((shost, int(sport)))
        try:
            s.connect((host, int(port)))
            keep.append(s)
            return s
        except ConnectionRefusedError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def login(url, user):
    """What a miner does first: connect to its pool and log in (stratum, JSON-RPC over TCP)."""
    s = connect(url.split("://")[-1])
    s.sendall(json.dumps({"id": 1, "jsonrpc": "2.0", "method": "login",
                          "params": {"login": user, "pass": "x", "agent": "XMRig/6.21.0"}}).encode() + b"\n")


words = sys.argv[1:]
for i, word in enumerate(words):
    verb, _, arg = word.partition("=")
    if verb == "name":
        ctypes.CDLL(None).prctl(15, arg.encode(), 0, 0, 0)  # PR_SET_NAME
    elif verb == "listen":
        host, port = arg.rsplit(":", 1)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
        s.listen(4096)
        keep.append(s)
        threading.Thread(target=accept_all, args=(s,), daemon=True).start()
    elif verb == "connect":
        spec, _, times = arg.partition("*")
        for _ in range(int(times or 1)):
            connect(spec)
    elif verb == "pad":
        keep.extend(os.open("/dev/null", os.O_RDONLY) for _ in range(int(arg)))
    elif verb == "--config":  # a miner's config file names its pool
        pool = json.load(open(arg))["pools"][0]
        login(pool["url"], pool["user"])
    elif verb == "-o":  # a miner's pool on its command line
        login(words[i + 1], words[words.index("-u") + 1])
    elif verb == "exec-when":  # file:program: a trainer until the file exists, then it execs the rest of its words
        trigger, _, program = arg.partition(":")
        print("ready", flush=True)
        while not os.path.exists(trigger):
            time.sleep(0.1)
        os.execv(program, [program, sys.argv[0], *words[i + 1:]])
print("ready", flush=True)
while True:
    time.sleep(3600)
'''


@dataclass
class Case:
    """One corpus process: who runs it, on what interpreter, doing what; and what it is."""

    kind: str  # the row of docs/audit.md's table
    hostile: bool
    user: str  # "owner" (alice) or "other" (bob)
    exe: str  # the interpreter's path; "{home}" is the user's home
    words: list[str]
    gpu: int = 0
    replace: str = ""  # after it started: "upgrade" (a new file renamed over it) or "delete"
    proc: subprocess.Popen | None = None
    max_score: int = 0
    evidence: set[str] = field(default_factory=set)
    killed_by: str = ""
    started: float = 0.0  # monotonic
    became: float = 0.0  # for exec-when: when it was told to become a miner (monotonic; 0: not yet)
    gone_after: float = 0.0  # seconds from then until it was gone (to within one of the test's polls, ~1.5 s)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def cases(addr: str, workdir: Path) -> list[Case]:
    """The corpus. `addr` is this run's loopback address (127.x.y.1): servers and the fake pool listen there."""
    uv = "{home}/.local/share/uv/python/cpython-3.11.9-linux-x86_64-gnu/bin/python3.11"
    miner = "{home}/xmrig-6.21.0/xmrig"  # as its release tarball unpacks
    config = f"--config={workdir}/config.json"
    return [
        Case("trainer", False, "owner", SYSTEM_PYTHON, ["train.py", "--epochs", "90", "--data", "/data/imagenet"]),
        Case(
            "trainer-apt-upgraded",
            False,
            "owner",
            f"/usr/lib/gpukill-corpus-{workdir.name}/bin/python3.11",
            ["train.py", "--resume"],
            replace="upgrade",
        ),
        Case(
            "jupyter-uv-upgraded",
            False,
            "owner",
            uv,
            ["jupyter-lab", "--port=8888", "name=jupyter-lab", f"listen={addr}:8888"],
            gpu=1,
            replace="upgrade",
        ),
        Case(
            "inference-server",
            False,
            "owner",
            "{home}/miniconda3/envs/serve/bin/python3.11",
            ["-m", "vllm.entrypoints.api_server", "--port", "8000", "name=vllm", f"listen={addr}:8000"],
            gpu=1,
        ),
        Case(
            "tensorboard-pyenv",
            False,
            "owner",
            "{home}/.pyenv/versions/3.11.9/bin/python3.11",
            ["tensorboard", "--logdir", "runs", "name=tensorboard", f"listen={addr}:6006"],
            gpu=2,
        ),
        Case(
            "torch-distributed-rank0",
            False,
            "owner",
            "{home}/.conda/envs/train/bin/python3.11",
            ["train_ddp.py", "--rank", "0", f"listen={addr}:29500", f"connect={addr}:29501"],
            gpu=2,
        ),
        Case(
            "torch-distributed-rank1",
            False,
            "owner",
            "{home}/proj/.venv/bin/python",
            ["train_ddp.py", "--rank", "1", f"listen={addr}:29501", f"connect={addr}:29500"],
            gpu=3,
        ),
        Case(
            "notebook-kernel",
            False,
            "owner",
            "{home}/.local/share/pipx/venvs/jupyterlab/bin/python",
            ["-m", "ipykernel_launcher", f"connect={addr}:8888"],
            gpu=1,
        ),
        Case(
            "outbound-443-8080",
            False,
            "owner",
            "{home}/.local/share/mamba/envs/hf/bin/python3.11",
            ["fetch_weights.py", f"connect={addr}:443", f"connect={addr}:8080"],
            gpu=3,
        ),
        # hostile
        Case("xmrig-by-name", True, "other", miner, [config]),
        Case(
            "renamed-pool-in-cmdline",
            True,
            "other",
            f"/dev/shm/.{workdir.name}/python3",
            ["-o", f"stratum+tcp://{addr}:3333", "-u", WALLET, "-p", "x", "--threads", "8"],
            replace="delete",
        ),
        Case("renamed-config-hidden-exe", True, "other", "{home}/.cache/.sysd/python3", [config]),
        Case("xmrig-behind-4096-fds", True, "other", miner, [f"pad={PADDING}", config]),
        Case(
            "renamed-pool-on-443",
            True,
            "other",
            "{home}/miniconda3/bin/python3",
            [f"--config={workdir}/config443.json"],
        ),
        # a trainer the daemon has seen for LATE seconds (past the sampler's 10 s of youth), then exec'd into
        # xmrig with its pool on the command line
        Case(
            "becomes-xmrig-after-15s",
            True,
            "other",
            SYSTEM_PYTHON,
            ["train.py", f"exec-when={workdir}/late:{miner}", "-o", f"stratum+tcp://{addr}:3333", "-u", WALLET],
        ),
    ]


# -- the documented example policies and stated recall ---------------------------------------------------------


def readme_policies() -> str:
    """The documented example policies: the Rogue-activity audit's no-miners and Guard Mode's first example."""
    rules = []
    for block in re.findall(r"```yaml\n(.*?)```", AUDIT_DOC.read_text() + GUARD_DOC.read_text(), re.S):
        doc = yaml.safe_load(block)
        if isinstance(doc, dict) and any(
            r.get("name") in ("no-miners", "block-crypto-miners") for r in doc.get("rules") or []
        ):
            rules.extend(doc["rules"])
    assert {r["name"] for r in rules} >= {"no-miners", "block-crypto-miners", "limit-user-memory"}, rules
    return yaml.safe_dump({"rules": rules})


def kill_threshold(policies: str) -> int:
    (rule,) = [r for r in yaml.safe_load(policies)["rules"] if r["name"] == "no-miners"]
    (cond,) = [c for c in rule["conditions"] if c["type"] == "rogue_score"]
    assert cond["operator"] == ">="
    return int(cond["value"])


def readme_recall() -> dict[str, tuple[int, int]]:
    """docs/audit.md's corpus table: kind -> (killed, of) as it states them."""
    text = AUDIT_DOC.read_text()
    table = text[text.index("| corpus process |") :]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        killed, _, of = cells[-1].partition("/")
        rows[cells[0].strip("`")] = (int(killed), int(of))
    return rows


# -- the bed ---------------------------------------------------------------------------------------------------


def loopback_of(scope: str) -> tuple[str, str]:
    """Two loopback addresses of this run's own: other tests on the machine may listen on 127.0.0.1:3333."""
    h = hashlib.sha256(scope.encode()).digest()
    return f"127.{20 + h[0] % 200}.{h[1]}.1", f"127.{20 + h[0] % 200}.{h[1]}.2"


class Pool:
    """The fake pool (and the HTTPS and HTTP servers): loopback listeners that accept and keep what comes first."""

    def __init__(self, addr: str, ports: tuple[int, ...]) -> None:
        self.logins: list[tuple[int, bytes]] = []
        self.listeners = []
        for port in ports:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            s.listen(256)
            self.listeners.append(s)
            threading.Thread(target=self._serve, args=(s, port), daemon=True).start()

    def _serve(self, listener: socket.socket, port: int) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                conn.settimeout(10)
                threading.Thread(target=self._read, args=(conn, port), daemon=True).start()

    def _read(self, conn: socket.socket, port: int) -> None:
        with contextlib.suppress(OSError):
            line = conn.recv(4096)
            if line:
                self.logins.append((port, line))
            time.sleep(300)  # the pool keeps the miner connected

    def close(self) -> None:
        for s in self.listeners:
            s.close()


def home_of(user: User) -> Path:
    return Path(pwd.getpwuid(user.uid).pw_dir)


def install(path: Path, made: list[Path]) -> None:
    """A real copy of python3 at `path`, as an installer puts it, inside directories this test made (and
    removes at the end): nothing of the machine's is ever written or replaced."""
    if not path.exists():
        for d in reversed([p for p in [path.parent, *path.parent.parents] if not p.exists()]):
            d.mkdir(mode=0o755)
            made.append(d)
    assert any(path.is_relative_to(d) for d in made), f"{path} is not in a directory of this test's"
    if not path.exists():
        shutil.copy(SYSTEM_PYTHON, path)
        os.chmod(path, 0o755)


def socket_count(pid: int) -> int:
    with contextlib.suppress(OSError):
        return sum(
            1 for fd in os.listdir(f"/proc/{pid}/fd") if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        )
    return 0


def spawn(bed: Testbed, user: User, argv: list[str], gpu: int | None) -> subprocess.Popen:
    env = {"PATH": "/usr/bin:/bin"}
    if gpu is not None:
        env.update(
            GPUKILL_SIM_GPU=str(gpu),
            GPUKILL_SIM_SCOPE=bed.scope,
            GPUKILL_SIM_MEM="512MiB",
            GPUKILL_SIM_UTIL="99" if user.name == "gpkother" else "80",
        )
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd="/",
        start_new_session=True,
        **user.popen_kwargs(),
    )
    bed.procs.append(proc)
    return proc


def ready(proc: subprocess.Popen) -> subprocess.Popen:
    """proc once it has done what its words say (peers wait for each other: spawn them all first)."""
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == b"ready", f"{proc.args} did not start: {line!r}"
    return proc


def start(bed: Testbed, user: User, argv: list[str], gpu: int | None) -> subprocess.Popen:
    return ready(spawn(bed, user, argv, gpu))


@pytest.fixture(scope="module")
def corpus(users):
    owner, other = users["owner"], users["other"]
    bed = Testbed()
    addr, bob_addr = loopback_of(bed.scope)
    made: list[Path] = []  # directories this test created, removed at the end (deepest first)
    pool = None
    try:
        for user in (owner, other):
            home = home_of(user)
            if not home.exists():
                home.mkdir(mode=0o755)
                os.chown(home, user.uid, user.gid)
                made.append(home)
        corpus_dir = bed.workdir / "corpus"
        corpus_dir.mkdir(mode=0o755)
        role = corpus_dir / "role.py"
        role.write_text(ROLE)
        for name, port in (("config.json", 3333), ("config443.json", 443)):
            (bed.workdir / name).write_text(
                json.dumps({"pools": [{"url": f"{addr}:{port}", "user": WALLET, "tls": port == 443}]})
            )
        pool = Pool(addr, (3333, 443, 8080))
        policies = readme_policies()
        (bed.workdir / "guard.d").mkdir()
        (bed.workdir / "guard.d" / "10-readme.yaml").write_text(policies)

        corpus = cases(addr, bed.workdir)
        by_kind = {c.kind: c for c in corpus}
        for c in corpus:
            user = owner if c.user == "owner" else other
            c.exe = c.exe.format(home=home_of(user))
            c.words = [w.format(home=home_of(user)) for w in c.words]
            for exe in [c.exe, *(w.rpartition(":")[2] for w in c.words if w.startswith("exec-when="))]:
                if exe != SYSTEM_PYTHON:
                    install(Path(exe), made)
            c.proc = spawn(bed, user, [c.exe, str(role), *c.words], c.gpu)
            c.started = time.monotonic()
        for c in corpus:
            ready(c.proc)
            # only a copy this test installed is ever replaced or deleted, never the machine's own python3
            assert not c.replace or any(Path(c.exe).is_relative_to(d) for d in made), c.exe
            if c.replace == "upgrade":  # dpkg, uv: the new file is written beside it, then renamed over it
                new = Path(c.exe + ".new")
                shutil.copy(SYSTEM_PYTHON, new)
                os.rename(new, c.exe)
            elif c.replace == "delete":
                os.unlink(c.exe)
            target = os.readlink(f"/proc/{c.pid}/exe")
            assert target == os.path.realpath(c.exe) + (" (deleted)" if c.replace else ""), (c.kind, target)

        # alice's clients (not GPU processes): her browsers and load balancer, from ephemeral ports
        start(
            bed,
            owner,
            [
                SYSTEM_PYTHON,
                str(role),
                "browser",
                f"connect={addr}:8888*{INBOUND}",
                f"connect={addr}:8000*{INBOUND}",
                f"connect={addr}:6006*20",
            ],
            gpu=None,
        )
        # bob's planted connections: from pool ports (his own address, so his binds meet no listener) to every
        # port alice's GPU processes listen on
        planted = [
            f"connect={bob_addr}:{src}>{addr}:{dst}" for src in PLANTED_PORTS for dst in (8888, 8000, 6006, 29500)
        ]
        start(bed, other, [SYSTEM_PYTHON, str(role), *planted], gpu=None)
        expected_sockets = {
            "jupyter-uv-upgraded": INBOUND + len(PLANTED_PORTS) + 2,
            "inference-server": INBOUND + len(PLANTED_PORTS) + 1,
            "tensorboard-pyenv": 20 + len(PLANTED_PORTS) + 1,
        }
        for kind, n in expected_sockets.items():
            wait_until(
                lambda kind=kind, n=n: socket_count(by_kind[kind].pid) >= n,
                30,
                lambda kind=kind, n=n: f"{kind} accepted {socket_count(by_kind[kind].pid)} of {n}",
            )
        wait_until(lambda: len(pool.logins) >= 5, 20, lambda: f"the pool saw {pool.logins}")

        # now the daemon: its first look at each process sees all of the above
        bed.write_conf()
        bed.start_system(args=["--sample-interval", str(INTERVAL)])
        yield bed, corpus, kill_threshold(policies), pool
    finally:
        bed.stop()
        if pool is not None:
            pool.close()
        for d in sorted(made, key=lambda p: len(p.parts), reverse=True):  # the copies went into these
            shutil.rmtree(d, ignore_errors=True)


def _comm(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return ""


def observe(bed: Testbed, corpus: list[Case]) -> None:
    """Every corpus process listed (or gone), then OBSERVE seconds of AuditRogue: each one's highest miner
    score and its evidence; then who Guard killed, from the journal."""

    def all_seen() -> bool:
        listed = {p["pid"] for p in bed.processes()}
        return all(c.pid in listed or c.proc.poll() is not None for c in corpus)

    wait_until(all_seen, 30, "the daemon did not list every corpus process")
    deadline = time.monotonic() + OBSERVE
    late = [c for c in corpus if any(w.startswith("exec-when=") for w in c.words)]
    while time.monotonic() < deadline or any(not c.became for c in late):
        for c in late:  # once the daemon has seen it as a trainer for LATE seconds; then watched for OBSERVE
            if not c.became and time.monotonic() - c.started >= LATE:
                listed = {p["pid"]: p for p in bed.processes()}
                assert listed.get(c.pid, {}).get("comm") == "python3", f"{c.kind} not seen as a trainer"
                trigger = next(w for w in c.words if w.startswith("exec-when=")).partition("=")[2].partition(":")[0]
                Path(trigger).touch()
                c.became = time.monotonic()
                deadline = max(deadline, c.became + OBSERVE)
            if c.became and not c.gone_after and c.proc.poll() is not None:
                c.gone_after = time.monotonic() - c.became
        r = bed.ctl(ROOT, "audit", "--json")
        assert r.returncode == 0, r
        by_pid = {c.pid: c for c in corpus}
        for f in json.loads(r.stdout)["findings"]:
            c = by_pid.get(f["pid"])
            if c is not None and f["kind"] == "miner":
                c.max_score = max(c.max_score, f["score"])
                c.evidence |= {e["rule"] for e in f["evidence"]}
        time.sleep(INTERVAL)
    for entry in bed.journal(MESSAGE_ID=audit.KILL.message_id):
        c = next((c for c in corpus if str(c.pid) == entry.get("GPUKILL_TARGET_PID")), None)
        if c is not None:
            c.killed_by = entry.get("GPUKILL_INITIATOR", "?")
    for c in corpus:
        if c.proc.poll() is not None and not c.killed_by:
            c.killed_by = f"exited {c.proc.returncode}"


def report(corpus: list[Case], threshold: int) -> str:
    benign_hits = sum(1 for c in corpus if not c.hostile and (c.killed_by or c.max_score >= threshold))
    lines = [
        f"rogue audit corpus, documented example policies enforced (no-miners: rogue_score >= {threshold})",
        f"{'process':28} {'label':8} {'score':>5} {'flagged':>7} {'killed':>6} {'recall':>6} {'precision':>9}"
        "  evidence",
    ]
    for c in corpus:
        flagged = c.max_score >= threshold
        killed = bool(c.killed_by)
        if c.hostile:
            recall = f"{int(killed)}/1"
            precision = f"{int(killed)}/{int(killed) + benign_hits}" if killed else "-"
        else:
            recall = precision = "-"
        lines.append(
            f"{c.kind:28} {'hostile' if c.hostile else 'benign':8} {c.max_score:>5} {int(flagged):>7} "
            f"{int(killed):>6} {recall:>6} {precision:>9}  {','.join(sorted(c.evidence)) or '-'}"
            + (f" [{c.killed_by}]" if c.killed_by else "")
        )
    hostile = [c for c in corpus if c.hostile]
    caught = sum(1 for c in hostile if c.killed_by)
    lines.extend(
        f"{c.kind}: gone {c.gone_after:.1f} s after it became a miner (sample interval {INTERVAL:g} s)"
        for c in corpus
        if c.gone_after
    )
    lines.append(
        f"benign killed or flagged: {benign_hits} of {len(corpus) - len(hostile)}; hostile killed: "
        f"{caught} of {len(hostile)} (recall {caught / len(hostile):.2f}); precision "
        f"{caught}/{caught + benign_hits}"
    )
    return "\n".join(lines)


def test_the_corpus_no_benign_process_is_touched_and_recall_is_as_stated(corpus):
    bed, cases_, threshold, pool = corpus
    observe(bed, cases_)
    table = report(cases_, threshold)
    print("\n" + table)  # pytest -s, or -rA in the PASSES section
    assert {port for port, _ in pool.logins} >= {3333, 443}  # the miners really logged in to the fake pool
    benign = [c for c in cases_ if not c.hostile]
    wrongly = [
        (c.kind, c.max_score, sorted(c.evidence), c.killed_by)
        for c in benign
        if c.killed_by or c.max_score >= threshold
    ]
    assert not wrongly, f"benign processes killed or flagged:\n{table}"
    stated = readme_recall()
    assert set(stated) == {c.kind for c in cases_}, "docs/audit.md's corpus table lists other processes than the test"
    below = [
        (c.kind, int(bool(c.killed_by)), stated[c.kind])
        for c in cases_
        if c.hostile
        if int(bool(c.killed_by)) < stated[c.kind][0]
    ]
    assert not below, f"recall below what docs/audit.md states:\n{table}"
    # the benign rows state 0 killed, and each hostile one killed is by the policy meant to kill it
    assert all(stated[c.kind] == (0, 1) for c in benign)
    assert all(c.killed_by == "guard:no-miners" for c in cases_ if c.hostile and c.killed_by), table
