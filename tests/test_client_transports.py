"""One client API over two transports: the blocking one (jeepney, one-shot commands) and the asyncio one (dbus-fast,
long-lived front ends) give the same records, the same errors and the same pages; the one-shot commands load
neither asyncio nor dbus-fast."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest
from dbus_fast.aio import MessageBus
from helpers.marks import needs_root
from helpers.testbed import PYTHON, ROOT
from jeepney.io.blocking import open_dbus_connection

from gpukill import errors, listing
from gpukill.records.base import from_plain
from gpukill.records.manager import Process
from gpukillctl.client import api as client_api
from gpukillctl.client.api import Var
from gpukillctl.client.blocking import BlockingClient, finish
from gpukillctl.client.dbus import GpukillClient

pytestmark = needs_root

HEAVY = ("asyncio", "dbus_fast")


def both(bed, act):
    """act(client) on each transport, as (blocking's answer, asyncio's answer)."""
    return on(bed, act, blocking=True), on(bed, act, blocking=False)


def on(bed, act, *, blocking: bool):
    """act(client) on a fresh connection to the bed's bus through one transport."""
    if blocking:
        client = BlockingClient(open_dbus_connection(bus=bed.bus_address))
        try:
            return finish(act(client))
        finally:
            client.close()

    async def on_asyncio():
        client = GpukillClient(await MessageBus(bus_address=bed.bus_address).connect())
        try:
            return await act(client)
        finally:
            client.close()

    return asyncio.run(on_asyncio())


def test_both_transports_give_the_same_records(victims, users):
    bed = victims
    victim = bed.victim(users["owner"], gpu=1, comm="same")
    bed.wait_listed(victim.pid)
    for act in (
        lambda c: c.list_devices(),
        lambda c: c.status(),
        lambda c: c.guard_status(),
        lambda c: c.audit_rogue(),
        lambda c: c.list_processes({"device": Var("s", "1"), "min_memory": Var("t", 0)}),
    ):
        blocking, on_asyncio = both(bed, act)
        assert blocking == on_asyncio
    procs, _ = both(bed, lambda c: c.list_processes({"device": Var("s", "1")}))
    assert victim.pid in {p.pid for p in procs} and {p.device for p in procs} == {1}


def test_both_transports_page_alike(victims, users, monkeypatch):
    bed = victims
    for gpu in (0, 1, 2):
        bed.wait_listed(bed.victim(users["owner"], gpu=gpu, comm="paged").pid)
    monkeypatch.setattr(client_api, "PAGE_SIZE", 1)  # every page is full but the last: the "after" key is used
    whole, _ = both(bed, lambda c: c.list_processes())
    keys = sorted((p.device, p.pid) for p in whole)
    assert len(whole) >= 3
    blocking, on_asyncio = both(bed, lambda c: c._compact_pages({}))
    for body in (blocking, on_asyncio):
        assert [(p.device, p.pid) for p in listing.processes_from_reply(body)] == keys


def test_the_compact_listing_is_the_records_listing(victims, users):
    bed = victims
    bed.wait_listed(bed.victim(users["owner"], gpu=2, comm="compact").pid)

    async def as_records(client):
        (procs,) = await client._call("ListProcesses", "a{sv}", [{}])
        return [from_plain(Process, p) for p in procs]

    compact, records = on(bed, lambda c: c.list_processes(), blocking=True), on(bed, as_records, blocking=True)
    assert compact == records and len(compact) >= 1


def test_an_unknown_listing_format_is_one_error(bed):
    class NewerDaemon(BlockingClient):
        async def _call(self, member, *args, **kwargs):
            return (
                [listing.FORMAT + 1, []] if member == listing.METHOD else await super()._call(member, *args, **kwargs)
            )

    newer = NewerDaemon(open_dbus_connection(bus=bed.bus_address))
    try:
        with pytest.raises(client_api.ClientError, match=f"format {listing.FORMAT + 1}"):
            finish(newer.list_processes())
    finally:
        newer.close()


def test_both_transports_raise_the_daemons_error(bed):
    for act in (lambda c: c.reset("no-such-gpu"), lambda c: c.kill(4194000, 0)):
        for blocking in (True, False):
            with pytest.raises(errors.GpukillError) as caught:
                on(bed, act, blocking=blocking)
            assert isinstance(caught.value, client_api.ClientError)
            assert isinstance(caught.value, errors.NoSuchDevice | errors.NoSuchProcess)


def imported(stderr: str) -> set[str]:
    """The top-level modules a `python -X importtime` run imported."""
    return {
        line.split("|")[-1].strip().split(".")[0]
        for line in stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


@pytest.mark.parametrize(
    "args",
    [
        ["list", "--json"],
        ["status"],
        ["guard", "status", "--json"],
        ["audit"],
        ["kill", "4194000"],
        ["reset", "no-such-gpu"],
    ],
)
def test_one_shot_commands_load_no_event_loop(bed, args):
    r = bed.run_as(ROOT, [PYTHON, "-X", "importtime", "-m", "gpukillctl", *args], timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode in (0, 5), r  # 5: the kill and reset of what does not exist, answered by gpukilld
    assert "jeepney" in imported(r.stderr)  # it did talk to gpukilld, on the blocking transport
    assert not imported(r.stderr) & set(HEAVY), sorted(imported(r.stderr) & set(HEAVY))
    if args[:2] == ["list", "--json"]:
        assert json.loads(r.stdout.strip())["format"] == 1


def test_help_before_a_one_shot_command_still_lists_every_command():
    # a one-shot command line gets the parser of the one-shot commands alone; --help before it is not one
    for argv in (["--help"], ["--help", "list"], ["-H", "somewhere", "-h", "list"]):
        r = subprocess.run([PYTHON, "-m", "gpukillctl", *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "top" in r.stdout and "exporter" in r.stdout, (argv, r)
