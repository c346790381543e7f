"""The compact listing (ListProcessesCompact, gpukill/listing.py) and SnapshotChanged: the compact form decodes
to exactly what ListProcesses gives, whoever asks and whatever the filter, with the same errors; the signal
comes when the listing changes and not while it does not."""

from __future__ import annotations

import io
import json
import subprocess
import time
import xml.etree.ElementTree as ET

import pytest
from dbus_fast import Message
from dbus_fast._private.unmarshaller import Unmarshaller
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO, User
from helpers.waiting import wait_until

from gpukill import listing
from gpukill.records.base import names
from gpukill.records.manager import MemoryRegion, Process

XML = REPO / "dbus" / "org.gpukill1.xml"


def _v(sig: str, value) -> dict:
    return {"$variant": [sig, value]}


# -- the format ------------------------------------------------------------------------------------------


def test_columns_are_the_records_fields_and_the_signature_is_the_contracts():
    assert names(Process) == listing.COLUMNS
    root = ET.parse(XML).getroot()
    method = next(m for m in root.iter("method") if m.get("name") == listing.METHOD)
    args = [(a.get("direction"), a.get("type")) for a in method.findall("arg")]
    assert args == [("in", listing.IN_SIGNATURE), ("out", "u"), ("out", listing.OUT_SIGNATURE[1:])]


FULL = Process(
    pid=7,
    start_time=1 << 40,
    uid=1000,
    user="alice",
    comm="train\x1b[31m",
    cmdline="python t.py",
    exe="/usr/bin/python3",
    device=3,
    device_id="GPU-3",
    gpu_memory=0,
    gpu_utilization=0.0,
    unit="job.scope",
    container_id="abc",
    pod_uid="pod",
    slurm_job="42",
    container_pid=0,
    memory_regions=(MemoryRegion("vram", 5, None), MemoryRegion("gtt", None, 0)),
    shared_usage=True,
)
BARE = Process(pid=8, start_time=9, uid=0, user="", comm="", cmdline="", device=0, device_id="")


def _through_the_bus(rows: list[tuple]) -> list:
    """The reply body as dbus-fast hands it to a client: marshalled, then unmarshalled."""
    msg = Message(
        path="/x", interface="x.y", member="Z", signature=listing.OUT_SIGNATURE, body=listing.reply_body(rows)
    )
    return Unmarshaller(io.BytesIO(bytes(msg._marshall(False)))).unmarshall().body  # type: ignore[arg-type]


def test_known_values_zeros_and_unknown_values_survive_the_bus():
    """0, 0.0 and "" known stay known; unknown stays unknown (None), in rows and in memory regions."""
    assert listing.processes_from_reply(_through_the_bus([listing.encode_row(FULL), listing.encode_row(BARE)])) == [
        FULL,
        BARE,
    ]


def test_an_unknown_format_is_one_line():
    body = _through_the_bus([listing.encode_row(FULL)])
    with pytest.raises(listing.UnknownListingFormat) as e:
        listing.processes_from_reply([listing.FORMAT + 1, body[1]])
    assert "\n" not in str(e.value) and f"format {listing.FORMAT + 1}" in str(e.value)


def test_the_compact_reply_is_smaller_than_the_records():
    from gpukilld.bus.wire import to_dbus
    from gpukilld.bus.writer import marshal_body

    processes = [
        Process(
            pid=p,
            start_time=p,
            uid=1000,
            user="alice",
            comm="python3",
            cmdline="python3 t.py",
            exe="/usr/bin/python3",
            device=p % 8,
            device_id=f"GPU-{p % 8}",
            gpu_memory=1 << 30,
            gpu_utilization=2.0,
            unit="session-1.scope",
        )
        for p in range(256)
    ]
    compact = marshal_body(listing.OUT_SIGNATURE, listing.reply_body([listing.encode_row(p) for p in processes]))
    records = marshal_body("aa{sv}", [[to_dbus(p) for p in processes]])
    assert len(compact) < len(records) * 0.6  # 47 KB against 90 KB


# -- on the test bed ------------------------------------------------------------------------------------


def both(bed, user: User, filters: list[dict]) -> list[dict]:
    """For each filter, what ListProcesses and ListProcessesCompact give `user`, as plain records."""
    r = bed.run_as(user, [PYTHON, str(REPO / "tests" / "clients" / "list_both.py")], input=json.dumps(filters))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@needs_root
def test_compact_listing_is_the_records_for_every_caller_and_filter(victims, users):
    bed = victims
    owner, other = users["owner"], users["other"]
    mine = [bed.victim(owner, gpu=g, mem="1GiB", util=3, comm="compact-own") for g in (0, 0, 1)]
    theirs = bed.victim(other, gpu=1, comm="compact-other")  # no memory or utilization given: unknown
    for v in mine:
        bed.wait_listed(v.pid, comm="compact-own")  # under its own name: it renames itself once started
    bed.wait_listed(theirs.pid, comm="compact-other")
    first = sorted((0, v.pid) for v in mine[:2])[0]
    filters = [
        {},
        {"user": _v("u", owner.uid)},
        {"device": _v("s", "1")},
        {"name": _v("s", "compact-o")},
        {"name_regex": _v("s", "^compact-(own|other)$")},
        {"min_memory": _v("t", 1 << 30)},
        {"limit": _v("u", 1)},
        {"limit": _v("u", 2), "after": _v("(uu)", list(first))},
        {"after": _v("(uu)", [1 << 31, 0])},
        {"device": _v("s", "no-such-gpu")},
    ]
    for user in (owner, other, users["root"]):
        for f, got in zip(filters, both(bed, user, filters), strict=True):
            assert got["compact"] == got["records"], (user.name, f)
    seen_by_owner = {p["pid"]: p for p in both(bed, owner, [{}])[0]["compact"]}
    assert seen_by_owner[theirs.pid]["exe"] is None, "another user's executable stays hidden"
    assert seen_by_owner[theirs.pid]["gpu_utilization"] is None, "unknown, not 0"
    assert seen_by_owner[mine[0].pid]["exe"] and seen_by_owner[mine[0].pid]["gpu_utilization"] == 3.0


@needs_root
def test_hostile_sizes_are_refused_alike(bed, users):
    filters = [
        {"limit": _v("u", 0)},
        {"limit": _v("u", 1 << 31)},
        {"limit": _v("s", "5")},
        {"after": _v("(uu)", [1 << 32 - 1, 1 << 32 - 1])},
        {"after": _v("u", 5)},
        {"bogus": _v("u", 1)},
        {"name_regex": _v("s", "(")},
    ]
    got = both(bed, users["other"], filters)
    assert [g["compact"] for g in got] == [g["records"] for g in got]
    errors = [g["records"]["error"] if isinstance(g["records"], dict) else None for g in got]
    assert (
        errors
        == ["org.freedesktop.DBus.Error.InvalidArgs"] * 3 + [None] + ["org.freedesktop.DBus.Error.InvalidArgs"] * 3
    )
    assert got[3]["compact"] == []


# -- SnapshotChanged ------------------------------------------------------------------------------------


def changes(rec) -> list[int]:
    return [s["body"][0] for s in list(rec.signals) if s["member"] == "SnapshotChanged"]


@needs_root
def test_snapshot_changed_when_a_process_comes_and_goes_and_only_then(victims, users):
    bed = victims
    rec = bed.record_signals(users["other"])  # every listener hears it
    victim = bed.victim(users["owner"], gpu=2, mem="2GiB", util=5, comm="changes")
    bed.wait_listed(victim.pid)
    wait_until(lambda: changes(rec), 5, "no SnapshotChanged when a process appeared")
    time.sleep(1.5)  # the sample after the one that listed it
    quiet_from = len(changes(rec))
    time.sleep(3.5)  # several sample intervals (1 s) with nothing changing
    assert changes(rec)[quiet_from:] == [], "SnapshotChanged while nothing changed"
    before = changes(rec)
    victim.kill()
    victim.wait(5)
    wait_until(lambda: len(changes(rec)) > len(before), 5, "no SnapshotChanged when a process went away")
    after = changes(rec)
    assert after == sorted(set(after)), "one signal per new generation, growing"


@needs_root
def test_snapshot_changed_is_a_typed_event(bed, users):
    """GpukillClient.events() yields it as gpukill.records.SnapshotChanged."""
    code = (
        "import asyncio\nfrom gpukillctl.client.dbus import GpukillClient\n"
        "async def main():\n"
        "    c = await GpukillClient.connect()\n"
        "    async for e in c.events():\n"
        "        print(type(e).__name__, e.generation, flush=True)\n"
        "        return\n"
        "asyncio.run(main())\n"
    )
    kwargs = users["other"].popen_kwargs()
    proc = subprocess.Popen(
        [PYTHON, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env=bed.env(),
        cwd="/",
        start_new_session=True,
        **kwargs,
    )
    bed.procs.append(proc)
    time.sleep(1.0)  # subscribed
    victim = bed.victim(users["owner"], gpu=3, comm="typed")
    bed.procs.append(victim)
    out, _ = proc.communicate(timeout=15)
    victim.kill()
    name, generation = out.split()
    assert name == "SnapshotChanged" and int(generation) > 0
