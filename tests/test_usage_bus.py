"""GetUsage in the real daemon (the test bed: private bus with our policy, polkitd, journald, simulated GPUs):
root and the unprivileged users gpkowner and gpkother each see their own usage, what others see is as the
contract says, bad queries are one-line errors the daemon lives through, and a store deleted while the daemon was
down is rebuilt from the journal, where an entry a user forged with logger is not taken for one of ours. And the
real Door and Manager in-process on a bus of the test's own: at most 4 queries run at once, 16 more wait, the
rest are TooBusy, none on the loop; NotSupported while accounting is off."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from helpers.marks import needs_root
from helpers.testbed import ADMIN_RULES, ROOT

from gpukilld import journal


def usage(bed, caller, **query):
    """GetUsage as `caller`; query values as (signature, value) or plain (str: s, float: d, int: u)."""
    sigs = {str: "s", float: "d", int: "u"}
    body = {k: {"$variant": list(v) if isinstance(v, tuple) else [sigs[type(v)], v]} for k, v in query.items()}
    return bed.manager(caller, "GetUsage", "a{sv}", [body])


def report(bed, caller, **query) -> dict:
    r = usage(bed, caller, **query)
    assert r.ok, r
    return r.body[0]


def rows_by_key(rep: dict) -> dict:
    return {(row["key"], row.get("hidden", False)): row for row in rep["rows"]}


def wait_usage_entry(bed, pid: int, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in bed.journal(MESSAGE_ID=journal.USAGE.message_id) if e.get("GPUKILL_TARGET_PID") == str(pid)]
        if found:
            return found[0]
        time.sleep(0.3)
    raise AssertionError(f"no usage entry for PID {pid} in {timeout}s")


@needs_root
def test_each_user_sees_their_own_usage_and_others_as_listed(victims, users):
    bed = victims
    owner, other = users["owner"], users["other"]
    mine = bed.victim(owner, gpu=0, mem="2GiB", util=50, comm="ownjob")
    theirs = bed.victim(other, gpu=1, mem="1GiB", util=80, comm="otherjob")
    bed.wait_listed(mine.pid, comm="ownjob")
    bed.wait_listed(theirs.pid, comm="otherjob")
    started = time.time()
    time.sleep(3)
    mine.kill()
    mine.wait()
    ran = time.time() - started
    entry = wait_usage_entry(bed, mine.pid)  # closed: in the journal, and in the store
    assert entry["GPUKILL_TARGET_USER"] == owner.name and entry["_UID"] == "0"
    since = started - 60

    # root sees both, the closed one and the live one, by process
    procs = {row["pid"]: row for row in report(bed, ROOT, since=since, by="process")["rows"]}
    own, live = procs[mine.pid], procs[theirs.pid]
    assert own["comm"] == "ownjob" and own["user"] == owner.name and own["live"] == 0
    assert 2.0 <= own["gpu_seconds"] <= ran + 1.5  # within a sample interval or so of its life on the GPU
    assert own["sm_seconds"] == pytest.approx(own["gpu_seconds"] * 0.5, rel=0.05)
    assert own["peak_memory"] == 2 << 30
    assert live["live"] == 1 and live["processes"] == 1 and live["comm"] == "otherjob"

    # each user: their own in full, the other's with its name (hidepid is off: /proc shows names)
    for me, mine_pid, them_pid in ((owner, mine.pid, theirs.pid), (other, theirs.pid, mine.pid)):
        seen = {row["pid"]: row for row in report(bed, me, since=since, by="process")["rows"]}
        assert seen[mine_pid]["user"] == me.name and seen[mine_pid]["comm"] in ("ownjob", "otherjob")
        assert seen[them_pid]["comm"] in ("ownjob", "otherjob")
        users_seen = rows_by_key(report(bed, me, since=since))
        assert (owner.name, False) in users_seen and (other.name, False) in users_seen
        assert report(bed, me, since=since, user=me.name)["rows"][0]["uid"] == me.uid

    by_gpu = rows_by_key(report(bed, ROOT, since=since, by="gpu"))
    assert by_gpu[("0", False)]["device_id"].startswith("GPU-") and ("1", False) in by_gpu
    only = report(bed, ROOT, since=since, by="process", device="0000:18:00.0")["rows"]  # GPU 0 by PCI id
    assert mine.pid in {row["pid"] for row in only} and theirs.pid not in {row["pid"] for row in only}
    assert report(bed, ROOT, since=since, by="process", limit=1)["rows_total"] >= 2


@needs_root
@pytest.mark.parametrize(
    ("query", "says"),
    [
        ({"since2": 1.0}, "unknown usage query key 'since2'"),
        ({"by": "week"}, "'by' must be one of"),
        ({"since": 2e9, "until": 1e9}, "must be before"),
        ({"limit": 0}, "'limit' must be from 1 to 1000"),
        ({"since": ("s", "30d")}, "'since' has type 's'"),
        ({"name": "x" * 5000}, "at most 4096"),
    ],
)
def test_bad_queries_are_one_line_errors_and_the_daemon_lives_on(bed, users, query, says):
    pid = bed.daemon.proc.pid
    r = usage(bed, users["other"], **query)
    assert r.error == "org.freedesktop.DBus.Error.InvalidArgs", r
    assert says in r.message and "\n" not in r.message and "Traceback" not in r.message
    assert bed.daemon.proc.poll() is None and bed.daemon.proc.pid == pid
    assert bed.manager(users["other"], "ListDevices").ok


def forge(bed, user, pid: int) -> None:
    """A usage entry written by an unprivileged user through logger --journald, with our MESSAGE_ID and
    fields: journald gives it the user's _UID."""
    fields = (
        f"MESSAGE=forged\nMESSAGE_ID={journal.USAGE.message_id}\nGPUKILL_TARGET_PID={pid}\n"
        "GPUKILL_TARGET_START_TIME=1\nGPUKILL_TARGET_UID=0\nGPUKILL_TARGET_USER=root\n"
        "GPUKILL_TARGET_COMM=forged\nGPUKILL_DEVICE=GPU-x\nGPUKILL_DEVICE_INDEX=0\n"
        f"GPUKILL_FIRST_SEEN={time.time() - 100:.3f}\nGPUKILL_LAST_SEEN={time.time() - 50:.3f}\n"
        "GPUKILL_GPU_SECONDS=1000000\nGPUKILL_SM_KNOWN_SECONDS=0\nGPUKILL_MEMORY_BYTE_SECONDS=0\n"
        "GPUKILL_PEAK_MEMORY=0\nGPUKILL_ENERGY_KNOWN_SECONDS=0\nGPUKILL_PROCESSES=1\nGPUKILL_ENDED=exited\n"
    )
    path = bed.workdir / "forged.txt"
    path.write_text(fields)
    os.chmod(path, 0o644)
    subprocess.run(
        bed.in_journal_ns(
            ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "logger", f"--journald={path}"]
        ),
        check=True,
        timeout=30,
    )


@needs_root
def test_a_deleted_store_is_rebuilt_from_the_journal_without_forged_entries(fresh_bed, users):
    bed = fresh_bed
    bed.start_polkit([ADMIN_RULES])
    bed.start_daemon(args=["--sample-interval", "0.3"])
    victim = bed.victim(users["owner"], gpu=0, mem="1GiB", util=100, comm="rebuilt")
    bed.wait_listed(victim.pid, comm="rebuilt")
    time.sleep(1.5)
    victim.kill()
    victim.wait()
    wait_usage_entry(bed, victim.pid)
    before = {row["pid"]: row for row in report(bed, ROOT, since=0.0, by="process")["rows"]}[victim.pid]
    forge(bed, users["other"], pid=424242)
    forged = [e for e in bed.journal(MESSAGE_ID=journal.USAGE.message_id) if e.get("GPUKILL_TARGET_PID") == "424242"]
    assert forged and forged[0]["_UID"] == str(users["other"].uid)

    bed.stop_daemon()
    store = bed.workdir / "state" / "usage.sqlite"
    assert store.exists() and (store.stat().st_mode & 0o777) == 0o600
    for suffix in ("", "-wal", "-shm"):
        (bed.workdir / "state" / f"usage.sqlite{suffix}").unlink(missing_ok=True)
    bed.start_daemon(args=["--sample-interval", "0.3"])
    deadline = time.monotonic() + 30
    while True:
        rep = report(bed, ROOT, since=0.0, by="process")
        rows = {row["pid"]: row for row in rep["rows"]}
        if victim.pid in rows and not rep.get("rebuilding"):
            break
        assert time.monotonic() < deadline, rep
        time.sleep(0.3)
    after = rows[victim.pid]
    assert after["gpu_seconds"] == pytest.approx(before["gpu_seconds"], abs=0.002)  # journal has 3 decimals
    assert after["processes"] == 1 and 424242 not in rows
    assert store.exists()


@needs_root
def test_a_corrupt_store_does_not_stop_the_daemon(fresh_bed, users):
    bed = fresh_bed
    bed.start_polkit([ADMIN_RULES])
    state = bed.workdir / "state"
    state.mkdir(mode=0o700)
    (state / "usage.sqlite").write_bytes(b"SQLite format 3\0" + b"\xff" * 4096)
    bed.start_daemon(args=["--sample-interval", "0.3"])
    rep = report(bed, users["owner"])
    assert rep["by"] == "user" and isinstance(rep["rows"], list)
    assert (state / "usage.sqlite.broken").exists()


# -- the method's own bounds, in-process ---------------------------------------------------------------------


class BlockingStore:
    """A store whose queries wait until released, counting how many run at once (in worker threads)."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = self.most = 0

    def query(self, q, viewer, live):
        from gpukill.records.usage import UsageReport

        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            assert self.release.wait(30)
            return UsageReport(since=q.since, until=q.until, by=q.by, rows_total=len(live))
        finally:
            with self.lock:
                self.running -= 1


class Keeper:
    """What the daemon's usage keeper offers the manager (gpukilld/usage/keeper.py): live() and store."""

    def __init__(self) -> None:
        self.store = BlockingStore()

    def live(self):
        return []


def _blocked_queries(tmp_path, per_client: list[int]):
    """GetUsage against a store that answers only when released: `per_client[i]` calls from client i, each
    client another uid. Returns the NotSupported reply before the keeper runs, the replies that came before
    the release (TooBusy), a ListDevices answered meanwhile, every reply, and the most queries run at once."""
    import asyncio

    from dbus_fast import Message, Variant
    from dbus_fast.aio import MessageBus
    from helpers.open_bus import open_bus

    from gpukilld.access.bouncer import Bouncer, Caller
    from gpukilld.access.people import People
    from gpukilld.bus.door import Door
    from gpukilld.bus.manager import USAGE_QUERIES_AT_ONCE, ManagerInterface
    from gpukilld.model import Snapshot
    from gpukilld.names import MANAGER_INTERFACE, OBJECT_PATH

    uids: dict[str, int] = {}

    class OrdinaryUsers(Bouncer):  # the real Bouncer, each client an ordinary user, polkit saying no to view-all
        def known(self, msg):
            return Caller(msg.sender, uids.get(msg.sender, 4242), None, False)

        async def caller(self, msg):
            return self.known(msg)

        async def _check(self, caller, action, details, left=None):
            return False, "not authorized (faked)"

    bus = open_bus(tmp_path)
    address = next(bus)

    async def run():
        snap = Snapshot(generation=1, taken_at=0.0, devices=(), processes=(), backends=(), findings=())
        service = await MessageBus(bus_address=address).connect()
        clients = [await MessageBus(bus_address=address).connect() for _ in per_client]
        for i, c in enumerate(clients):
            uids[c.unique_name] = 5000 + i
        bouncer = OrdinaryUsers(service, people=People("/nonexistent/subuid"))
        running: list[Keeper] = []  # the keeper the daemon runs: none, then one
        manager = ManagerInterface(
            lambda: snap,
            None,
            bouncer,
            lambda: 1.0,
            bus=service,  # type: ignore[arg-type]
            usage=lambda: running[0] if running else None,
        )
        service.add_message_handler(Door(service, bouncer, manager.early_answer))
        service.export(OBJECT_PATH, manager)

        def call(client, member="GetUsage"):
            signature, body = ("a{sv}", [{"by": Variant("s", "gpu")}]) if member == "GetUsage" else ("", [])
            return client.call(
                Message(
                    destination=service.unique_name,
                    path=OBJECT_PATH,
                    interface=MANAGER_INTERFACE,
                    member=member,
                    signature=signature,
                    body=body,
                )
            )

        async def until(cond, what: str) -> None:
            """Polled rather than slept for: on a loaded machine the calls may take seconds to arrive."""
            deadline = time.monotonic() + 60
            while not cond():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.02)

        calls: list[asyncio.Future] = []

        def arrived() -> bool:
            """The daemon holds each call sent (running or waiting for a turn) or has answered it TooBusy."""
            return manager._usage_calls + sum(c.done() for c in calls) == len(calls)

        try:
            off = await call(clients[0])
            keeper = Keeper()
            running.append(keeper)
            for client, n in zip(clients, per_client, strict=True):
                calls += [asyncio.ensure_future(call(client)) for _ in range(n)]
                await until(arrived, "not every call arrived")  # in this order
            store = keeper.store
            await until(
                lambda: store.running >= min(manager._usage_calls, USAGE_QUERIES_AT_ONCE),
                "the queries never took their turns",
            )
            busy = [c.result() for c in calls if c.done()]
            ping = await call(clients[0], "ListDevices")
            keeper.store.release.set()
            answered = await asyncio.gather(*calls)
            return off, busy, ping, answered, keeper.store.most
        finally:
            for c in clients:
                c.disconnect()
            service.disconnect()

    try:
        return asyncio.run(run())
    finally:
        bus.close()


def test_queries_run_four_at_once_sixteen_wait_and_the_rest_are_too_busy(tmp_path):
    from dbus_fast import MessageType

    from gpukilld.bus.manager import USAGE_OFF

    off, busy, ping, answered, most = _blocked_queries(tmp_path, [4, 4, 4, 4, 4, 4, 1])  # 25 from 7 users
    assert off.error_name == "org.gpukill1.Error.NotSupported" and off.body == [USAGE_OFF]
    assert len(busy) == 5 and all(r.error_name == "org.gpukill1.Error.TooBusy" for r in busy), busy
    assert all("too many usage queries" in r.body[0] for r in busy)
    assert ping.message_type is MessageType.METHOD_RETURN  # the loop answers while 4 queries run
    assert most == 4
    ok = [r for r in answered if r.message_type is MessageType.METHOD_RETURN]
    assert len(ok) == 20 and all(r.body[0]["by"].value == "gpu" for r in ok)


def test_one_user_cannot_take_every_turn(tmp_path):
    from dbus_fast import MessageType

    from gpukilld.bus.manager import USAGE_QUERIES_PER_PERSON

    # one user floods: only 4 of theirs are taken; the next user's query still is
    _, busy, _, answered, _ = _blocked_queries(tmp_path, [10, 1])
    assert len(busy) == 10 - USAGE_QUERIES_PER_PERSON, busy
    assert all(r.error_name == "org.gpukill1.Error.TooBusy" and "of yours" in r.body[0] for r in busy)
    ok = [r for r in answered if r.message_type is MessageType.METHOD_RETURN]
    assert len(ok) == USAGE_QUERIES_PER_PERSON + 1
    assert answered[-1].message_type is MessageType.METHOD_RETURN  # the other user's


def test_where_proc_hides_names_others_usage_is_uid_and_gpu_facts_only(fresh_bed, users):
    bed = fresh_bed
    proc = bed.workdir / "proc"
    proc.mkdir()
    # hidepid=noaccess in the daemon's mount namespace (the bed's journald's), as tests/test_privacy.py does
    subprocess.run(bed.in_journal_ns(["mount", "-t", "proc", "-o", "hidepid=noaccess", "proc", str(proc)]), check=True)
    try:
        bed.start_polkit([ADMIN_RULES])
        bed.write_conf(paths={"proc": proc})
        bed.start_daemon(args=["--sample-interval", "0.3"])
        owner, other = users["owner"], users["other"]
        mine = bed.victim(owner, gpu=0, util=40, comm="mine")
        theirs = bed.victim(other, gpu=0, util=90, comm="theirs")
        bed.wait_listed(mine.pid, comm="mine")
        bed.wait_listed(theirs.pid, comm="theirs")
        time.sleep(1.5)
        theirs.kill()
        theirs.wait()
        wait_usage_entry(bed, theirs.pid)
        since = time.time() - 600
        seen = {row["pid"]: row for row in report(bed, owner, since=since, by="process")["rows"]}
        assert seen[mine.pid]["comm"] == "mine" and seen[theirs.pid]["comm"] == ""  # pid, user, GPU facts
        assert seen[theirs.pid]["user"] == other.name and seen[theirs.pid]["gpu_seconds"] > 0.5
        units = rows_by_key(report(bed, owner, since=since, by="unit"))
        assert units[("", True)]["processes"] == 1  # the other's record, its unit not shown
        assert report(bed, owner, since=since, name="theirs")["rows"] == []  # filters match only what is seen
        assert report(bed, ROOT, since=since, name="theirs")["rows"][0]["user"] == other.name
        assert {row["pid"]: row for row in report(bed, users["admin"], since=since, by="process")["rows"]}[theirs.pid][
            "comm"
        ] == "theirs"  # view-all-processes (the example rules): everything
    finally:
        bed.stop_daemon()
        subprocess.run(bed.in_journal_ns(["umount", "-l", str(proc)]), check=False)
