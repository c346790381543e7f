"""Malformed input to every method gets a D-Bus error, never a crash; the daemon keeps answering."""

from __future__ import annotations

import pytest
from helpers.marks import needs_root

pytestmark = needs_root

INVALID = "org.freedesktop.DBus.Error.InvalidArgs"
UNKNOWN_METHOD = "org.freedesktop.DBus.Error.UnknownMethod"
HUGE = "x" * 1_000_000


def v(sig: str, value) -> dict:
    return {"$variant": [sig, value]}


CASES = [
    # wrong types / arity: no method with that signature
    ("ListDevices", "s", ["extra"], UNKNOWN_METHOD),
    ("ListProcesses", "", [], UNKNOWN_METHOD),
    ("ListProcesses", "s", ["device"], UNKNOWN_METHOD),
    ("KillProcess", "sta{sv}", ["123", 1, {}], UNKNOWN_METHOD),
    ("KillProcess", "ut", [123, 1], UNKNOWN_METHOD),
    ("ResetDevice", "ua{sv}", [0, {}], UNKNOWN_METHOD),
    ("ResetDevice", "s", ["0"], UNKNOWN_METHOD),
    # unknown option and filter keys
    ("ListProcesses", "a{sv}", [{"colour": v("s", "red")}], INVALID),
    ("KillProcess", "uta{sv}", [1, 1, {"signal": v("u", 9)}], INVALID),
    ("ResetDevice", "sa{sv}", ["0", {"grace": v("d", 1.0)}], INVALID),
    # option values of the wrong type or out of range
    ("KillProcess", "uta{sv}", [1, 1, {"force": v("s", "yes")}], INVALID),
    ("KillProcess", "uta{sv}", [1, 1, {"grace": v("s", "5")}], INVALID),
    ("KillProcess", "uta{sv}", [1, 1, {"grace": v("d", -1.0)}], INVALID),
    ("KillProcess", "uta{sv}", [1, 1, {"grace": v("d", 1e308)}], INVALID),
    ("KillProcess", "uta{sv}", [1, 1, {"grace": v("t", 2**64 - 1)}], INVALID),
    ("ResetDevice", "sa{sv}", ["0", {"force": v("u", 1)}], INVALID),
    ("ListProcesses", "a{sv}", [{"min_memory": v("s", "lots")}], INVALID),
    ("ListProcesses", "a{sv}", [{"name_regex": v("s", "([unclosed")}], INVALID),
    ("ListProcesses", "a{sv}", [{"name_regex": v("s", "a" * 5000)}], INVALID),
    # huge and extreme numbers
    ("KillProcess", "uta{sv}", [2**32 - 1, 2**64 - 1, {}], INVALID),
    ("KillProcess", "uta{sv}", [0, 0, {}], INVALID),
    ("KillProcess", "uta{sv}", [4194000, 2**64 - 1, {}], "org.gpukill1.Error.NoSuchProcess"),
    # huge strings
    ("ResetDevice", "sa{sv}", [HUGE, {}], "org.gpukill1.Error.NoSuchDevice"),
    ("ResetDevice", "sa{sv}", ["", {}], "org.gpukill1.Error.NoSuchDevice"),
    ("ResetDevice", "sa{sv}", ["-1", {}], "org.gpukill1.Error.NoSuchDevice"),
    ("ResetDevice", "sa{sv}", ["99999999999999999999999", {}], "org.gpukill1.Error.NoSuchDevice"),
    ("ListProcesses", "a{sv}", [{"name": v("s", HUGE)}], None),  # valid, matches nothing
    ("ListProcesses", "a{sv}", [{HUGE[:255]: v("s", "x")}], INVALID),
]


@pytest.mark.parametrize(
    ("member", "signature", "body", "error"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_malformed_input(bed, users, member, signature, body, error):
    for who in ("root", "other"):
        r = bed.manager(users[who], member, signature, body)
        if error is None:
            assert r.ok and r.body == [[]], r
        else:
            assert not r.ok and r.error == error, (who, r)
            assert "Traceback" not in r.message and len(r.message) < 600
    # the daemon keeps answering
    assert bed.daemon.proc.poll() is None
    alive = bed.manager(users["other"], "ListDevices")
    assert alive.ok and len(alive.body[0]) == 4


def test_properties_are_read_only(bed, users):
    for who in ("root", "other"):
        r = bed.call_as(
            users[who],
            "org.gpukill1",
            "/org/gpukill1",
            "org.freedesktop.DBus.Properties",
            "Set",
            "ssv",
            ["org.gpukill1.Manager", "SampleInterval", v("d", 0.001)],
        )
        assert not r.ok, r
    r = bed.call_as(
        users["other"],
        "org.gpukill1",
        "/org/gpukill1",
        "org.freedesktop.DBus.Properties",
        "Get",
        "ss",
        ["org.gpukill1.Manager", "SampleInterval"],
    )
    assert r.ok and r.body == [1.0]


def test_filters_work(victims, users):
    bed = victims
    a = bed.victim(users["owner"], gpu=0, mem="2GiB", comm="trainer")
    b = bed.victim(users["other"], gpu=1, mem="8GiB", comm="notebook")
    bed.wait_listed(a.pid, comm="trainer")
    bed.wait_listed(b.pid, comm="notebook")

    def pids(filt: dict) -> set[int]:
        r = bed.manager(users["other"], "ListProcesses", "a{sv}", [filt])
        assert r.ok, r
        return {p["pid"] for p in r.body[0]}

    assert pids({"device": v("s", "0")}) >= {a.pid} and b.pid not in pids({"device": v("u", 0)})
    assert pids({"device": v("s", "0000:2A:00.0")}) == {b.pid}  # PCI id, any case
    assert pids({"user": v("s", "gpkowner")}) == {a.pid}
    assert pids({"user": v("u", users["other"].uid)}) == {b.pid}
    assert pids({"name": v("s", "book")}) == {b.pid}
    assert pids({"name_regex": v("s", "^tr.*er$")}) == {a.pid}
    assert pids({"min_memory": v("t", 4 * 2**30)}) >= {b.pid} and a.pid not in pids({"min_memory": v("t", 4 * 2**30)})
    assert pids({"user": v("s", "gpkowner"), "name": v("s", "book")}) == set()
