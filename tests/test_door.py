"""The Door's rate limit counts a connection's first calls too, made before gpukilld knows whose they are.

Found by CI under load: a flood from a new connection had its first calls answered uncounted while the
credentials lookup was on its way (639 answered where the rate allowed 628). Now a connection gets at most
MAX_UNIDENTIFIED calls (all connections together MAX_UNIDENTIFIED_TOTAL) before it is identified, the Door starts
the lookup itself, and those calls are charged
to the uid once it is known.
"""

from __future__ import annotations

import asyncio

from dbus_fast import Message, MessageType

from gpukilld.access import callrate
from gpukilld.access.bouncer import Caller
from gpukilld.access.people import People
from gpukilld.bus.door import MAX_UNIDENTIFIED, MAX_UNIDENTIFIED_TOTAL, Door
from gpukilld.names import MANAGER_INTERFACE, OBJECT_PATH

UID = 1002


class SlowBouncer:
    """Knows a sender once its lookup has finished, as the real bouncer's credentials cache does."""

    def __init__(self) -> None:
        self.people = People("/nonexistent/subuid")  # no subordinate uids: every uid is its own person
        self.identified: set[str] = set()
        self.lookups: list[str] = []

    def known(self, msg: Message) -> Caller | None:
        return Caller(msg.sender, UID, 42, False) if msg.sender in self.identified else None

    async def caller(self, msg: Message) -> Caller:
        self.lookups.append(msg.sender)
        await asyncio.sleep(0)
        self.identified.add(msg.sender)
        return Caller(msg.sender, UID, 42, False)


def call(sender: str, member: str = "ListDevices") -> Message:
    return Message(
        destination="org.gpukill1",
        path=OBJECT_PATH,
        interface=MANAGER_INTERFACE,
        member=member,
        sender=sender,
        serial=1,
    )


def busy(answer) -> bool:
    return (
        isinstance(answer, Message)
        and answer.message_type is MessageType.ERROR
        and answer.error_name == "org.gpukill1.Error.TooBusy"
    )


def test_a_new_connection_cannot_outrun_its_identification():
    async def run() -> tuple[list, list, SlowBouncer, int]:
        bouncer = SlowBouncer()
        door = Door(None, bouncer, early=lambda msg: None)
        door.rate = callrate.CallRate(clock=lambda: 0.0)  # no refill: every token counts
        before = [door(call(":1.7")) for _ in range(MAX_UNIDENTIFIED + 3)]  # all before the lookup answers
        await asyncio.sleep(0.01)  # the lookup the Door started finishes
        after = [door(call(":1.7")) for _ in range(int(callrate.BURST) + 10)]
        return before, after, bouncer, sum(not busy(a) for a in before + after)

    before, after, bouncer, answered = asyncio.run(run())
    assert [busy(a) for a in before] == [False] * MAX_UNIDENTIFIED + [True] * 3
    assert bouncer.lookups == [":1.7"]  # one lookup, started by the first call (ListDevices never asks)
    # the calls made before it was known are charged: the uid gets its burst and not one call more
    assert answered == int(callrate.BURST)
    assert busy(after[-1])


def test_charging_takes_the_bucket_below_zero_and_it_refills():
    now = [0.0]
    rate = callrate.CallRate(clock=lambda: now[0])
    rate.charge(UID, int(callrate.BURST) + 10)
    assert not rate.allow(UID)
    now[0] = 10 / callrate.RATE  # the debt of 10 repaid: the next token is a second 1/RATE away
    assert not rate.allow(UID)
    now[0] += 1.5 / callrate.RATE
    assert rate.allow(UID)
    rate.charge(0, 10**6)  # root is never limited
    assert rate.allow(0)


def test_calls_before_identification_are_charged_even_if_the_connection_never_calls_again():
    async def run() -> int:
        bouncer = SlowBouncer()
        door = Door(None, bouncer, early=lambda msg: None)
        door.rate = callrate.CallRate(clock=lambda: 0.0)
        for n in range(3):  # three connections of one user, five calls each, gone before they are known
            for _ in range(5):
                door(call(f":1.{10 + n}"))
        await asyncio.sleep(0.01)
        bouncer.identified.add(":1.99")  # the same user's next connection, already known
        return sum(not busy(door(call(":1.99"))) for _ in range(int(callrate.BURST)))

    assert run_answered(run) == int(callrate.BURST) - 15


def test_all_unidentified_connections_together_are_bounded():
    async def run() -> int:
        door = Door(None, SlowBouncer(), early=lambda msg: None)
        return sum(not busy(door(call(f":2.{n}"))) for n in range(MAX_UNIDENTIFIED_TOTAL + 50))

    assert run_answered(run) == MAX_UNIDENTIFIED_TOTAL


def run_answered(run) -> int:
    return asyncio.run(run())
