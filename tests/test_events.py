"""The client library's signal stream, GpukillClient.events(): the records match the interface XML, and on the
real test bed only gpukilld's signals arrive (a forged one is dropped), a restart is followed, the iteration
ends with the connection, and a slow consumer loses the oldest signals, not its memory."""

from __future__ import annotations

import asyncio
import json
import re
import xml.etree.ElementTree as ET

import pytest
from dbus_fast.aio import MessageBus
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO, Testbed

from gpukill.records.base import names, specs
from gpukill.records.guard import ViolationDetails
from gpukill.records.reclaim import Holder, Reclaim
from gpukill.records.signals import (
    SIGNAL_OF,
    SIGNALS,
    DeviceReset,
    DeviceStateChanged,
    ProcessKilled,
    signal_record,
)
from gpukillctl.client.dbus import GpukillClient
from gpukillctl.top.monitor import ENVELOPE_KEYS

SAMPLE_INTERVAL = "0.2"
PROBE_DEVICE = 2  # the simulated MI210: resets succeed, and no test here puts a process on it


# -- the records against the contract ------------------------------------------------------------------------


def xml_signals() -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Every signal of dbus/org.gpukill1.xml: (interface, member) -> [(argument name, type), ...] in order."""
    root = ET.parse(REPO / "dbus" / "org.gpukill1.xml").getroot()
    return {
        (iface.get("name"), sig.get("name")): [(arg.get("name"), arg.get("type")) for arg in sig.iter("arg")]
        for iface in root.iter("interface")
        for sig in iface.iter("signal")
    }


def test_signals_match_the_interface_xml():
    declared = {key: [(name, spec.sig) for name, spec in specs(cls)] for key, cls in SIGNALS.items()}
    assert declared == xml_signals()
    assert {iface for iface, _ in declared} == {"org.gpukill1.Manager", "org.gpukill1.Guard"}
    assert all(SIGNALS[SIGNAL_OF[cls]] is cls for cls in SIGNALS.values())


def test_signal_record_takes_only_what_fits_the_declaration():
    killed = [41, 7, 1000, "train", ["GPU-1"], "terminated", 1000, "user"]
    # an older gpukilld's 8 arguments: no reclaim, its default ("unwatched")
    assert signal_record("org.gpukill1.Manager", "ProcessKilled", killed) == ProcessKilled(
        41, 7, 1000, "train", ("GPU-1",), "terminated", 1000, "user"
    )
    held = {
        "verdict": "held",
        "held": 5,
        "devices": [0],
        "holders": [
            {"pid": 42, "start_time": 8, "uid": 1000, "comm": "w", "device": 0, "memory": 5, "relation": "orphan"}
        ],
    }
    got = signal_record("org.gpukill1.Manager", "ProcessKilled", [*killed, held])
    assert got.reclaim == Reclaim("held", held=5, devices=(0,), holders=(Holder(42, 8, 1000, "w", 0, 5, "orphan"),))
    assert signal_record("org.gpukill1.Manager", "ProcessKilled", [*killed, held, "more"]) is None
    details = {"scope": "per_user", "reason": "9 GiB", "grace": 2.0, "uid": 1000, "pids": [41], "time": 5.0}
    violated = signal_record("org.gpukill1.Guard", "PolicyViolated", ["r", "user x", "kill", False, details])
    assert violated.details == ViolationDetails("per_user", "9 GiB", 2.0, 1000, (41,), 5.0)
    assert signal_record("org.gpukill1.Guard", "ProcessKilled", killed) is None  # the wrong interface
    assert signal_record("org.gpukill1.Manager", "ProcessGone", killed) is None
    assert signal_record("org.gpukill1.Manager", "ProcessKilled", killed[:-1]) is None
    assert signal_record("org.gpukill1.Manager", "ProcessKilled", [*killed, "more"]) is None
    assert signal_record("org.gpukill1.Manager", "ProcessKilled", ["41", *killed[1:]]) is None
    assert signal_record("org.gpukill1.Manager", "DeviceStateChanged", [1, "GPU-1", "lost", ""]) == DeviceStateChanged(
        1, "GPU-1", "lost", ""
    )
    assert signal_record("org.gpukill1.Guard", "PolicyViolated", ["r", "s", "kill", False, {"scope": "x"}]) is None


def test_monitor_json_keys_are_documented_and_do_not_collide():
    """The `monitor --json` keys docs/using.md lists are the XML's, in order; no argument shadows an envelope
    key."""
    readme = (REPO / "docs" / "using.md").read_text()
    section = readme[readme.index("## Watching signals") :]
    for (_, member), args in xml_signals().items():
        documented = re.search(rf"^\s*- `{member}`: (.*)$", section, re.M)
        assert documented, f"{member} is not in docs/using.md's monitor section"
        assert re.findall(r"`(\w+)`", documented.group(1).split(" — ")[0]) == [name for name, _ in args]
        assert not {name for name, _ in args} & set(ENVELOPE_KEYS)
    details = re.search(r"nested: (.*?)\n\s+- `GuardActionTaken`", section, re.S).group(1)
    assert [k for k in re.findall(r"`(\w+)`", details) if k != "null"] == list(names(ViolationDetails))


# -- on the test bed ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ebed(users):
    """A private system of this module's own: these tests stop and restart gpukilld."""
    b = Testbed()
    try:
        (b.workdir / "guard.d").mkdir()
        b.start_system(args=["--sample-interval", SAMPLE_INTERVAL])
        yield b
    finally:
        b.stop()


async def connect(bed: Testbed) -> GpukillClient:
    return GpukillClient(await MessageBus(bus_address=bed.bus_address).connect())


class Listener:
    """A client's events() consumed in the background, every record kept."""

    def __init__(self, client: GpukillClient) -> None:
        self.client = client
        self.records: list = []
        self.absent = 0  # how often events() said gpukilld is not running
        self.ended = asyncio.Event()
        self.task = asyncio.ensure_future(self._consume())

    def _on_absent(self) -> None:
        self.absent += 1

    async def _consume(self) -> None:
        async for record in self.client.events(on_absent=self._on_absent):
            self.records.append(record)
        self.ended.set()

    async def wait_for(self, cond, timeout: float = 10.0):
        async def found():
            while not (hits := [r for r in self.records if cond(r)]):
                await asyncio.sleep(0.05)
            return hits[0]

        try:
            return await asyncio.wait_for(found(), timeout)
        except TimeoutError:
            return None


def is_probe(record) -> bool:
    return isinstance(record, DeviceReset) and record.index == PROBE_DEVICE


async def probe_until_heard(prober: GpukillClient, *listeners: Listener) -> None:
    """Reset the probe device until every listener has its DeviceReset: the subscription is in place (there is
    no other way to know when the bus has taken a match rule)."""
    for _ in range(40):
        await prober.reset(str(PROBE_DEVICE))
        heard = [await listener.wait_for(is_probe, 0.5) for listener in listeners]
        if all(h is not None for h in heard):
            for listener in listeners:
                listener.records.clear()
            return
    raise AssertionError("events() never heard a reset")


def forge(bed: Testbed, user, member: str, signature: str, body: list) -> str:
    spec = json.dumps(
        {
            "path": "/org/gpukill1",
            "iface": "org.gpukill1.Manager",
            "member": member,
            "signature": signature,
            "body": body,
        }
    )
    r = bed.run_as(user, [PYTHON, str(REPO / "tests" / "clients" / "emit_signal.py")], input=spec)
    assert r.returncode == 0, r
    return json.loads(r.stdout)["sender"]


FORGED_PID = 4242


def signature(cls: type) -> str:
    return "".join(spec.sig for _, spec in specs(cls))


@needs_root
def test_a_forged_signal_is_dropped(ebed, users):
    async def run():
        plain = await connect(ebed)
        # A connection that also listens to every Manager signal for some other purpose (another consumer in the
        # process): the bus then delivers forged signals to it, and events() itself must drop them.
        broad = await connect(ebed)
        await broad._bus_call("AddMatch", "type='signal',interface='org.gpukill1.Manager'")
        reached: list = []
        broad.bus.add_message_handler(lambda m: reached.append(m.sender) if m.member == "ProcessKilled" else None)
        listeners = [Listener(plain), Listener(broad)]
        await probe_until_heard(plain, *listeners)

        sender = await asyncio.to_thread(
            forge,
            ebed,
            users["other"],
            "ProcessKilled",
            signature(ProcessKilled),
            [
                FORGED_PID,
                1,
                0,
                "forged",
                ["GPU-x"],
                "terminated",
                0,
                "user",
                {"verdict": {"$variant": ["s", "reclaimed"]}},
            ],
        )
        await plain.reset(str(PROBE_DEVICE))  # a real signal after the forged one: delivered in order
        for listener in listeners:
            assert await listener.wait_for(is_probe) is not None
            assert [r for r in listener.records if isinstance(r, ProcessKilled)] == []
        assert sender in reached, "the forged signal never reached the broad connection: the test proves nothing"
        plain.close()
        broad.close()

    asyncio.run(run())


@needs_root
def test_a_restart_of_gpukilld_is_followed_and_the_iteration_ends_with_the_connection(ebed, users):
    async def run():
        client = await connect(ebed)
        listener = Listener(client)
        await probe_until_heard(client, listener)
        await asyncio.to_thread(ebed.stop_daemon)
        await asyncio.sleep(0.3)
        assert not listener.ended.is_set(), "gpukilld going away must not end the iteration"
        assert listener.absent == 1, "events() says when gpukilld goes away"
        await asyncio.to_thread(ebed.start_daemon, args=["--sample-interval", SAMPLE_INTERVAL])
        await client.reset(str(PROBE_DEVICE))  # no probing: the daemon is new, our subscription is not
        assert await listener.wait_for(is_probe) is not None, "the restarted daemon's signal was not followed"
        assert listener.absent == 1

        client.close()
        await asyncio.wait_for(listener.ended.wait(), 5)
        assert listener.task.done() and listener.task.exception() is None

    asyncio.run(run())


@needs_root
def test_a_slow_consumer_loses_the_oldest_beyond_max_queued(ebed, users):
    async def run():
        client = await connect(ebed)
        events = client.events(max_queued=1)
        first = asyncio.ensure_future(anext(events))
        for _ in range(40):  # probe until the subscription is in place
            await client.reset(str(PROBE_DEVICE))
            await asyncio.wait({first}, timeout=0.5)
            if first.done():
                break
        assert is_probe(first.result())
        # Nobody reads now: three resets, each signalled before its reply (so, on this connection, before it);
        # with room for one, only the newest is kept, whatever else was still queued.
        for device in ("0", "1", str(PROBE_DEVICE)):
            await client.reset(device)
        kept = await asyncio.wait_for(anext(events), 5)
        assert isinstance(kept, DeviceReset) and kept.index == PROBE_DEVICE, kept
        more = asyncio.ensure_future(anext(events))
        await asyncio.wait({more}, timeout=0.5)
        assert not more.done(), f"the older resets were kept: {more.result()}"
        client.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(more, 5)

    asyncio.run(run())


@needs_root
def test_max_queued_must_keep_something(ebed):
    async def run():
        client = await connect(ebed)
        with pytest.raises(ValueError, match="at least 1"):
            await anext(client.events(max_queued=0))
        client.close()

    asyncio.run(run())
