"""The client library's snapshot_changes(): observers list on SnapshotChanged, spread over a quarter of the
sample interval instead of all in the same millisecond (bench/README.md, list_latency)."""

from __future__ import annotations

import asyncio
import time

import pytest
from dbus_fast.aio import MessageBus
from helpers.marks import needs_root
from helpers.testbed import Testbed

from gpukillctl.client.dbus import SPREAD_FRACTION, GpukillClient, spread_delay

SAMPLE_INTERVAL = 0.2


def test_the_delay_is_drawn_within_a_quarter_of_the_interval():
    assert spread_delay(2.0, rand=lambda: 0.0) == 0.0
    assert spread_delay(2.0, rand=lambda: 0.999999) == pytest.approx(2.0 * SPREAD_FRACTION, rel=1e-5)
    assert SPREAD_FRACTION <= 0.25
    draws = [spread_delay(1.0) for _ in range(2000)]
    assert all(0.0 <= d < 0.25 for d in draws)
    assert max(draws) > 0.2 and min(draws) < 0.05, "not spread over the window"
    assert spread_delay(-1.0) == 0.0


@pytest.fixture(scope="module")
def sbed(users):
    b = Testbed()
    try:
        b.start_system(args=["--sample-interval", str(SAMPLE_INTERVAL)])
        yield b
    finally:
        b.stop()


async def next_change(changes, bed: Testbed, user) -> tuple:
    """The next change, made by a process appearing on a GPU (again, until one is heard: the subscription
    may not be in place yet)."""
    nxt = asyncio.ensure_future(anext(changes))
    procs = []
    try:
        for _ in range(20):
            procs.append(await asyncio.to_thread(bed.victim, user, gpu=1))
            done, _ = await asyncio.wait({nxt}, timeout=1.0)
            if done:
                return nxt.result(), time.monotonic()
        raise AssertionError("no SnapshotChanged heard")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        if not nxt.done():
            nxt.cancel()


@needs_root
def test_changes_come_spread_and_a_second_iteration_on_the_same_client_works(sbed, users):
    async def run():
        client = GpukillClient(await MessageBus(bus_address=sbed.bus_address).connect())
        try:
            interval = 2.0  # larger than the bed's: the delay is then long enough to see
            for _ in range(2):  # before the fix of events(), the second iteration ended at once
                changes = client.snapshot_changes(interval)
                change, delivered = await next_change(changes, sbed, users["owner"])
                assert change.generation > 0
                waited = delivered - change.heard_at
                assert waited < interval * SPREAD_FRACTION + 0.5, waited
                await changes.aclose()
        finally:
            client.close()

    asyncio.run(run())
