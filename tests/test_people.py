"""Limits count people, not uids: a subordinate uid (/etc/subuid) is charged to the owner of its range.

Before: every limit was kept per uid, and a user with a subuid range (Debian gives one to every local account)
called from a user namespace as up to 65,536 uids, each with a bucket of its own, and filled the global caps.
Here: the parse (bounded, re-read when the file changes), the Door's call rate, the polkit queue and the policy
sandbox's slots charged per person, and a real caller in a user namespace mapped to gpkowner's subuids (newuidmap,
from Debian's uidmap package, through `unshare --map-auto`) that shares gpkowner's call rate on the real daemon.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time

import pytest
from dbus_fast import Message, MessageType
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO

from gpukill.errors import TooBusy
from gpukilld.access import callrate, people
from gpukilld.access.bouncer import Caller
from gpukilld.access.people import People, parse_subuid
from gpukilld.bus.door import Door
from gpukilld.guard import sandbox
from gpukilld.guard.conditions import Protection
from gpukilld.model import Snapshot
from gpukilld.names import MANAGER_INTERFACE, OBJECT_PATH

OWNERS = {"alice": 1001, "bob": 1002}
SUBUID = "alice:100000:65536\nbob:165536:65536\n"


def resolve(name: str) -> int | None:
    return OWNERS.get(name)


def table(tmp_path, text: str = SUBUID, **kw) -> People:
    path = tmp_path / "subuid"
    path.write_text(text)
    return People(str(path), resolve=resolve, **kw)


def test_a_subordinate_uid_is_its_owners_person(tmp_path):
    p = table(tmp_path)
    assert [p.person(u) for u in (100000, 100004, 165535)] == [1001, 1001, 1001]
    assert [p.person(u) for u in (165536, 231071)] == [1002, 1002]
    assert [p.person(u) for u in (0, 1001, 1002, 1003, 99999, 231072)] == [0, 1001, 1002, 1003, 99999, 231072]
    assert p.charged(100004) == "uid 1001 (with its subordinate uids, 100004 among them)"
    assert p.charged(1001) == "uid 1001 (with its subordinate uids)"
    assert p.charged(1003) == "uid 1003"


def test_the_parse_is_bounded_and_skips_what_is_not_a_range():
    text = (
        "# comment\n\nalice:100000:65536\nnobody-known:300000:10\nbob:x:10\nbob:10:\nbob:1:2:3\n"
        "1002:200000:0\n1002:200000:10\nbob:\uff11:5\nalice:4294967290:100\n"
    )
    assert [(r.start, r.end, r.owner) for r in parse_subuid(text, resolve)] == [
        (100000, 165536, 1001),
        (200000, 200010, 1002),
    ]
    many = "".join(f"alice:{100000 + 10 * i}:10\n" for i in range(people.MAX_RANGES + 50))
    assert len(parse_subuid(many, resolve)) == people.MAX_RANGES


def test_overlaps_go_to_the_first_range_and_an_owner_is_always_its_own_person(tmp_path):
    # bob's range overlaps alice's and holds carol's own uid: carol is a person, the overlap is alice's
    p = People(str(tmp_path / "none"), resolve=resolve)
    ranges = parse_subuid(
        "alice:100000:1000\nbob:100500:1000\ncarol:5000:1\n1500:100700:5\n",
        lambda n: {"carol": 100700, **OWNERS}.get(n),
    )
    assert [(r.start, r.end, r.owner) for r in ranges] == [
        (5000, 5001, 100700),
        (100000, 101000, 1001),
        (101000, 101500, 1002),
    ]
    t = people.Table(ranges)
    assert t.person(100600) == 1001 and t.person(101200) == 1002
    assert t.person(100700) == 100700  # an account is itself, whoever's range it lies in
    assert p.person(100600) == 100600  # no file: everyone is their own person


def test_roots_ranges_are_one_person_each_never_root(tmp_path):
    (tmp_path / "subuid").write_text("root:1000000:1000000\n")
    p = People(str(tmp_path / "subuid"), resolve={"root": 0}.get)
    assert p.person(1000005) == p.person(1999999) == 1000000
    assert p.charged(1000005) == "root's subordinate uids 1000000-1999999"


def test_a_changed_file_is_read_again(tmp_path):
    now = [0.0]
    p = table(tmp_path, clock=lambda: now[0])
    assert p.person(100004) == 1001
    (tmp_path / "subuid").write_text("bob:100000:65536\n")
    assert p.person(100004) == 1001  # not stat'ed again within RECHECK
    now[0] += people.RECHECK
    deadline = time.monotonic() + 10
    while p.person(100004) != 1002:  # read again in a thread of its own
        assert time.monotonic() < deadline, "the changed file was never read"
        time.sleep(0.01)
    (tmp_path / "subuid").unlink()
    now[0] += people.RECHECK
    p.person(1)
    deadline = time.monotonic() + 10
    while p.person(100004) != 100004:
        assert time.monotonic() < deadline, "the removed file still counts"
        time.sleep(0.01)


def test_an_oversized_file_is_read_up_to_its_bound(tmp_path):
    line = "alice:100000:65536\n"
    path = tmp_path / "subuid"
    path.write_text(line + "#" * (people.MAX_BYTES + 10) + "\nbob:300000:10\n")
    p = People(str(path), resolve=resolve)
    assert p.person(100001) == 1001 and p.person(300001) == 300001


# -- every limit charges the person ---------------------------------------------------------------------------


class KnownBouncer:
    """The Door's view of the bouncer: each sender's uid is known, the people from a test file."""

    def __init__(self, p: People, uids: dict[str, int]) -> None:
        self.people = p
        self.uids = uids

    def known(self, msg: Message) -> Caller | None:
        return Caller(msg.sender, self.uids[msg.sender], 42, False)

    async def caller(self, msg: Message) -> Caller:
        return Caller(msg.sender, self.uids[msg.sender], 42, False)


def busy(answer) -> bool:
    return (
        isinstance(answer, Message)
        and answer.message_type is MessageType.ERROR
        and answer.error_name == TooBusy.dbus_name
    )


def test_the_call_rate_is_one_bucket_per_person(tmp_path):
    """Before: 1,000 subordinate uids had 1,000 buckets (here 1,000 x BURST calls answered)."""
    uids = {f":1.{n}": 100000 + n for n in range(1000)} | {":2.1": 1001, ":3.1": 1002}
    door = Door(None, KnownBouncer(table(tmp_path), uids), early=lambda msg: None)  # type: ignore[arg-type]
    door.rate = callrate.CallRate(clock=lambda: 0.0)  # no refill: every token counts

    def call(sender: str) -> Message | bool | None:
        return door(
            Message(
                destination="org.gpukill1",
                path=OBJECT_PATH,
                interface=MANAGER_INTERFACE,
                member="ListDevices",
                sender=sender,
                serial=1,
            )
        )

    answered = sum(not busy(call(s)) for s in list(uids)[:1000] for _ in range(3))
    assert answered == int(callrate.BURST)
    refused = call(":2.1")  # the owner's own bucket is the one its subordinate uids used up
    assert busy(refused) and "uid 1001 (with its subordinate uids)" in refused.body[0]
    assert not busy(call(":3.1"))  # another person's bucket is whole


def test_a_person_has_one_policy_test_at_a_time_from_any_of_its_uids(tmp_path, monkeypatch):
    started = asyncio.Event()

    async def slow_run(self, *args):
        started.set()
        await asyncio.sleep(0.5)
        return []

    monkeypatch.setattr(sandbox.Sandbox, "_run", slow_run)
    box = sandbox.Sandbox(table(tmp_path))
    empty = Snapshot(generation=0, taken_at=0.0, devices=(), processes=(), backends=())

    async def run() -> list:
        first = asyncio.ensure_future(box.preview("a.yaml", "rules: []\n", empty, 1, 100004, Protection()))
        await started.wait()
        outcomes = []
        for uid in (100005, 1001, 1002):
            try:
                outcomes.append(await box.preview("b.yaml", "rules: []\n", empty, 1, uid, Protection()))
            except TooBusy as e:
                outcomes.append(str(e))
        await first
        return outcomes

    outcomes = asyncio.run(run())
    # before: each uid had a slot of its own, and both of alice's ran beside the first
    assert outcomes[:2] == [
        "uid 1001 (with its subordinate uids, 100005 among them) already has a policy test running; wait for it",
        "uid 1001 (with its subordinate uids) already has a policy test running; wait for it",
    ]
    assert outcomes[2] == [], outcomes  # bob is another person


class Journal:
    def __init__(self) -> None:
        self.entries: list[tuple[str, dict]] = []

    def log(self, kind, message: str, **fields: object) -> None:
        self.entries.append((message, fields))


def test_refusals_of_subordinate_uids_are_folded_as_their_owners(tmp_path):
    """Before: each uid had a window of its own, so 1,000 subordinate uids refused once each made 1,000 journal
    entries in a window (200 one by one, then one folded entry per uid)."""
    from gpukilld import journal as audit
    from gpukilld.access.bouncer import KILL_METHOD, Bouncer, Request
    from gpukilld.access.refusals import WINDOW, RefusalLog

    class NoPolkit(Bouncer):
        async def _check(self, caller, action, details, left=None):
            return False, "not authorized (faked)"

    now = [0.0]
    journal = Journal()
    bouncer = NoPolkit(None, RefusalLog(journal, clock=lambda: now[0]), people=table(tmp_path))  # type: ignore
    request = Request(audit.KILL_DENIED, "Kill of PID 1", "kill PID 1", {})

    async def run() -> None:
        for n in range(1000):
            with pytest.raises(Exception, match="not authorized"):
                await bouncer.check(Caller(f":1.{n}", 100000 + n, n, False), KILL_METHOD, {}, request=request)

    asyncio.run(run())
    now[0] = WINDOW + 1
    bouncer.refusals.flush()
    folded = [f for _, f in journal.entries if f.get("result") == "folded"]
    assert len(journal.entries) <= 21 and len(folded) == 1, len(journal.entries)
    assert folded[0]["caller_uid"] == 1001 and folded[0]["folded"] == 1000 - (len(journal.entries) - 1)


# -- a real caller from a user namespace -----------------------------------------------------------------------

# In a user namespace that gpkowner made with its subordinate uids (uid 0 inside is gpkowner, uid N is the Nth
# subordinate uid), one connection as gpkowner, then one as a subordinate uid: each sends its calls in waves
# (dbus-daemon lets a connection wait on 128 replies). AUTH EXTERNAL without a uid: the bus takes the kernel's.
USERNS_CLIENT = r"""
import asyncio, json, os, sys, time
from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.auth import UID_NOT_SPECIFIED, AuthExternal

async def connect():
    return await MessageBus(bus_type=BusType.SYSTEM, auth=AuthExternal(UID_NOT_SPECIFIED)).connect()

async def flood(bus, n):
    out = {}
    while n > 0:
        wave = [bus.call(Message(destination="org.gpukill1", path="/org/gpukill1", interface="org.gpukill1.Manager",
                                 member="ListDevices")) for _ in range(min(n, 100))]
        n -= len(wave)
        for reply in await asyncio.gather(*wave):
            key = reply.error_name if reply.message_type == MessageType.ERROR else "ok"
            out[key] = out.get(key, 0) + 1
            if key != "ok":
                out["message"] = reply.body[0]
    return out

async def uid_of(bus, name):
    reply = await bus.call(Message(destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                                   interface="org.freedesktop.DBus", member="GetConnectionUnixUser",
                                   signature="s", body=[name]))
    return reply.body[0]

async def main():
    owner = await connect()                # uid 0 here: gpkowner outside
    os.setgroups([]); os.setgid(5); os.setuid(5)
    sub = await connect()                  # uid 5 here: a subordinate uid of gpkowner outside
    await flood(owner, 1); await flood(sub, 1)  # gpukilld knows both connections: no call is charged late
    t0 = time.monotonic()
    sub_out = await flood(sub, int(sys.argv[1]))
    owner_out = await flood(owner, int(sys.argv[2]))
    print(json.dumps({"owner_uid": await uid_of(sub, owner.unique_name), "sub_uid": await uid_of(sub, sub.unique_name),
                      "sub": sub_out, "owner": owner_out, "took": time.monotonic() - t0}))

asyncio.run(main())
"""


SUBORDINATE = 4  # the subordinate uid the client becomes: uid 5 in the namespace, the range's fifth outside


@pytest.fixture
def subordinate(users):
    """gpkowner's subordinate uid that the client calls as, with an account name. dbus-daemon refuses a
    connection whose uid it cannot find groups for (bus_policy_allow_unix_user); dbus-broker (Fedora, Arch)
    does not ask, and NSS names subordinate uids on hosts that register them (nss-systemd, SSSD). The name is
    the account that a plain Debian host lacks for them; gpukilld never reads it."""
    owner = users["owner"]
    if shutil.which("newuidmap") is None:
        pytest.skip("newuidmap is not installed (Debian's uidmap package; make test installs it)")
    mine = [r for r in people.shared().ranges if r.owner == owner.uid]
    if not mine or mine[0].end - mine[0].start <= SUBORDINATE + 1:
        pytest.skip(f"{owner.name} has no subordinate uids in {people.SUBUID} (useradd gives them on Debian)")
    uid = mine[0].start + SUBORDINATE
    made = subprocess.run(["getent", "passwd", str(uid)], capture_output=True).returncode != 0
    if made:
        subprocess.run(
            ["useradd", "--system", "-u", str(uid), "-M", "-N", "-s", "/usr/sbin/nologin", "gpksubuid"],
            check=True,
            capture_output=True,
        )
    try:
        yield uid
    finally:
        if made:
            subprocess.run(["userdel", "gpksubuid"], capture_output=True)


@needs_root
def test_a_caller_in_a_user_namespace_is_charged_to_its_owner(bed, users, subordinate):
    """Before: the subordinate uid had a bucket of its own, and gpkowner's 300 calls were all answered after it had
    used BURST; now they share gpkowner's."""
    owner = users["owner"]
    client = bed.workdir / "userns_client.py"
    client.write_text(USERNS_CLIENT)
    os.chmod(client, 0o644)
    burst = int(callrate.BURST)
    r = bed.run_as(
        owner,
        ["unshare", "--user", "--map-auto", "--map-root-user", "--", PYTHON, str(client), str(burst + 100), "300"],
        timeout=120,
        env={"PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["owner_uid"] == owner.uid and out["sub_uid"] == subordinate, out  # what the daemon is told
    answered = out["sub"].get("ok", 0) + out["owner"].get("ok", 0)
    assert answered <= burst + callrate.RATE * out["took"] + 5, out  # one bucket for both
    assert out["owner"].get(TooBusy.dbus_name, 0) > 0, out  # the owner is refused: its subuid spent its calls
    assert f"uid {owner.uid} (with its subordinate uids)" in out["owner"]["message"], out
