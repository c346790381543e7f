"""`gpukillctl usage` without a daemon: its time forms, the query it sends, its table and JSON, its exit statuses
(a recording client); and end to end on the test bed (tests further down, once gpukilld answers GetUsage)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta

import pytest
from helpers.marks import needs_root

from gpukill import errors
from gpukill.records.base import from_plain, to_plain
from gpukill.records.usage import UsageReport, UsageRow
from gpukillctl.cli import main as cli
from gpukillctl.cli.usage import query_of
from gpukillctl.client.api import ClientAPI, ClientError, Var, usage_variants
from gpukillctl.client.dbus import ERRORS
from gpukillctl.client.usage import gib_hours, parse_when, usage_table

GIB = 1 << 30
NOW = 1_780_000_000.0  # a fixed instant: 2026-05-28


# -- the time forms ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,ago",
    [
        ("30d", 30 * 86400),
        ("24h", 86400),
        ("90min", 5400),
        ("1h30m", 5400),
        ("2d 4h", 2 * 86400 + 4 * 3600),
        ("45s", 45),
        ("1w", 7 * 86400),
        ("1.5h", 5400),
        ("2days", 2 * 86400),
        ("now", 0),
    ],
)
def test_a_duration_is_that_long_ago(text, ago):
    assert parse_when(text, NOW) == NOW - ago


def test_dates_are_local_time_unless_they_say_their_offset():
    assert parse_when("2026-05-01", NOW) == datetime(2026, 5, 1).timestamp()
    assert parse_when("2026-05-01 10:30", NOW) == datetime(2026, 5, 1, 10, 30).timestamp()
    assert parse_when("2026-05-01 10:30:15", NOW) == datetime(2026, 5, 1, 10, 30, 15).timestamp()
    assert parse_when("2026-05-01T10:30:00+02:00", NOW) == datetime(2026, 5, 1, 8, 30, tzinfo=UTC).timestamp()
    assert parse_when("2026-05-01T10:30:00Z", NOW) == datetime(2026, 5, 1, 10, 30, tzinfo=UTC).timestamp()
    midnight = datetime.fromtimestamp(NOW).replace(hour=0, minute=0, second=0, microsecond=0)
    assert parse_when("today", NOW) == midnight.timestamp()
    assert parse_when("yesterday", NOW) == (midnight - timedelta(days=1)).timestamp()
    assert parse_when("@1700000000", NOW) == 1_700_000_000.0


@pytest.mark.parametrize(
    "text",
    [
        "",
        "24",
        "1700000000",
        "24 hours ago",
        "2026-13-01",
        "2026-02-30",
        "1969-12-31",
        "h",
        "h30",
        "2026-05-01 25:00",
        "x" * 100,
        "-1h",
        "200y",
        "99999d",
    ],
)
def test_what_is_not_a_time_is_one_line(text):
    with pytest.raises(ValueError) as e:
        parse_when(text, NOW)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_a_bare_number_is_epoch_seconds_only_where_asked_for():
    assert parse_when("1700000000.5", NOW, epoch=True) == 1_700_000_000.5
    with pytest.raises(ValueError):
        parse_when("1700000000.5", NOW)
    assert parse_when("1h 30min ", NOW) == NOW - 5400


# -- the command line ------------------------------------------------------------------------------------


def parse(*argv: str):
    return cli.build_parser().parse_args(["usage", *argv])


def test_the_options_make_getusages_query():
    before = time.time()
    args = parse(
        "--since",
        "24h",
        "--until",
        "1h",
        "--by",
        "job",
        "--user",
        "alice",
        "--name",
        "py",
        "--unit",
        "x.service",
        "--job",
        "42",
        "--pod",
        "p",
        "--device",
        "1",
        "--limit",
        "5",
    )
    q = query_of(args)
    assert q.pop("since") == pytest.approx(before - 86400, abs=5) and q.pop("until") == pytest.approx(
        before - 3600, abs=5
    )
    assert q == {
        "by": "job",
        "user": "alice",
        "name": "py",
        "unit": "x.service",
        "job": "42",
        "pod": "p",
        "device": "1",
        "limit": 5,
    }
    assert query_of(parse()) == {"by": "user"}  # the rest is the daemon's default (the last 24 hours)
    variants = usage_variants({"since": 5, "until": 6.5, "by": "user", "limit": 5, "user": "1000", "pod": None})
    assert variants == {
        "since": Var("d", 5.0),
        "until": Var("d", 6.5),
        "by": Var("s", "user"),
        "limit": Var("u", 5),
        "user": Var("s", "1000"),
    }


@pytest.mark.parametrize(
    "argv,text",
    [
        (["--since", "last week"], "argument --since: 'last week' is not a time"),
        (["--until", "2026-02-30"], "argument --until: '2026-02-30' is not a date"),
        (["--by", "host"], "argument --by: invalid choice"),
        (["--limit", "0"], "the limit must be between 1 and 1000"),
        (["--limit", "ten"], "not a number"),
        (["--since", "1h", "--until", "2h"], "--since must be before --until"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(argv, text, capsys, monkeypatch):
    """Said before any connection (there is no bus here: a bad option that reached it would exit 3)."""
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent")
    try:
        code = cli.main(["usage", *argv])
    except SystemExit as e:  # argparse's error: exit status 2
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and text in err and err.startswith("gpukillctl"), err


class UsageClient(ClientAPI):
    """The client API over a transport that answers GetUsage with a prepared body (or an error)."""

    unique_name = ":1.7"

    def __init__(self, reply=None, error: ClientError | None = None) -> None:
        self.reply, self.error, self.sent = reply, error, []

    def close(self) -> None:
        pass

    async def _call(self, member, signature="", body=None, **kw):
        self.sent.append((member, signature, body))
        if self.error is not None:
            raise self.error
        return [self.reply]


def row(key: str, **kw) -> UsageRow:
    values = {
        "processes": 1,
        "gpu_seconds": 3720.0,
        "memory_byte_seconds": 6.1 * GIB * 3600,
        "peak_memory": 4 * GIB,
        "first_seen": NOW - 7200,
        "last_seen": NOW - 60,
    }
    values.update(kw)
    return UsageRow(key=key, **values)


REPORT = UsageReport(
    since=NOW - 86400,
    until=NOW,
    by="user",
    rows_total=3,
    rows=(
        row(
            "alice",
            uid=1000,
            user="alice",
            sm_seconds=2280.0,
            sm_known_seconds=3720.0,
            energy_joules=212_000.0,
            energy_known_seconds=3720.0,
            live=1,
            processes=2,
        ),
        row("bob\x1b[2J", uid=1001, user="bob", gpu_seconds=60.0, sm_known_seconds=30.0, sm_seconds=3.0),
    ),
)


def run_cmd(client: UsageClient, *argv: str) -> int:
    args = cli.build_parser().parse_args(["usage", *argv])
    return asyncio.run(cli.COMMANDS["usage"](client, args))


def test_the_table_says_each_total_and_unknown_where_unmeasured(capsys):
    client = UsageClient(to_plain(REPORT))
    assert run_cmd(client, "--since", "24h") == 0
    ((member, signature, (query,)),) = client.sent
    assert (member, signature) == ("GetUsage", "a{sv}") and query["by"] == Var("s", "user")
    assert query["since"].signature == "d"
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["USER", "PROCESSES", "GPU", "TIME", "SM", "TIME", "MEMORY", "PEAK", "ENERGY"]
    assert lines[1].split() == [
        "alice",
        "2",
        "(1",
        "live)",
        "1h",
        "2min",
        "38min",
        "6.10",
        "GiB·h",
        "4.0",
        "GiB",
        "212",
        "kJ",
    ]
    # bob's name is escaped; his SM time known over half his GPU time says so; no energy measured: "–", not 0
    assert "bob\\x1b[2J" in lines[2] and "\x1b" not in out
    assert "3s (50% known)" in lines[2] and lines[2].rstrip().endswith(" \u2013")
    assert "by user, the first 2 of 3 groups." in out


def test_json_is_the_reply_as_it_is(capsys):
    assert run_cmd(UsageClient(to_plain(REPORT)), "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert from_plain(UsageReport, doc) == REPORT
    assert doc["rows"][1]["energy_joules"] is None and doc["rows"][1]["user"] == "bob"


def test_no_records_is_said(capsys):
    empty = UsageReport(since=NOW - 3600, until=NOW, by="unit")
    assert run_cmd(UsageClient(to_plain(empty)), "--by", "unit") == 0
    assert capsys.readouterr().out.startswith("No GPU use recorded from ")


def test_daemon_errors_are_gpukillctls_exit_statuses():
    invalid = ERRORS[errors.InvalidArgs.dbus_name](errors.InvalidArgs.dbus_name, "since: after until")
    with pytest.raises(errors.InvalidArgs):
        run_cmd(UsageClient(error=invalid))
    from gpukillctl.client.exits import exit_code

    assert exit_code(invalid) == 2
    busy = ERRORS[errors.TooBusy.dbus_name](errors.TooBusy.dbus_name, "too many usage queries")
    assert exit_code(busy) == 13
    # a gpukilld that keeps no accounting ([usage] enabled = no): not supported (9), said in one line
    off = ERRORS[errors.NotSupported.dbus_name](errors.NotSupported.dbus_name, "usage accounting is disabled")
    with pytest.raises(errors.NotSupported) as e:
        run_cmd(UsageClient(error=off))
    assert exit_code(e.value) == 9


def test_gib_hours():
    assert gib_hours(GIB * 3600) == "1.00 GiB·h" and gib_hours(0) == "0.00 GiB·h"


def test_rows_are_labelled_by_what_they_are_grouped_by():
    procs = UsageReport(
        since=0,
        until=1,
        by="process",
        rows=(row("4242:77", pid=4242, start_time=77, comm="python3", user="alice", uid=1000), row("", hidden=True)),
    )
    text = usage_table(procs)
    assert "4242 python3 (alice)" in text and "(hidden)" in text
    units = UsageReport(since=0, until=1, by="unit", rows=(row(""),))
    assert "(no unit)" in usage_table(units)
    gpus = UsageReport(since=0, until=1, by="gpu", rows=(row("0", device=0, device_id="GPU-abc"),))
    assert "0 GPU-abc" in usage_table(gpus)


def test_usage_is_a_one_shot_command():
    """Its parser alone parses it as the whole one does, on the blocking transport (no event loop)."""
    argv = ["usage", "--by", "pod", "--json", "--limit", "3"]
    assert cli.command_word(argv) in cli.ONE_SHOT
    assert cli.build_parser(full=False, only="usage").parse_args(argv) == cli.build_parser().parse_args(argv)
    assert not cli.needs_event_loop(cli.build_parser().parse_args(argv))


# -- end to end: gpukilld on the test bed's simulated GPUs -----------------------------------------------------


@needs_root
def test_the_owner_sees_a_running_process_totals(victims, users):
    """A process at 2 GiB and 50 % on GPU 0 (71.5 W): after a few seconds its partial totals are there, as
    table and JSON, for its owner."""
    owner = users["owner"]
    v = victims.victim(owner, gpu=0, mem="2GiB", util=50, comm="acctme")
    victims.wait_listed(v.pid, comm="acctme")
    time.sleep(4)
    r = victims.ctl(owner, "usage", "--by", "process", "--name", "acctme", "--since", "10min", "--json")
    assert r.returncode == 0, r
    doc = json.loads(r.stdout)
    assert doc["by"] == "process" and doc["until"] - doc["since"] == pytest.approx(600, abs=30)
    (mine,) = [row for row in doc["rows"] if row["pid"] == v.pid]
    assert mine["live"] == 1 and mine["user"] == owner.name and mine["comm"] == "acctme"
    assert 2 <= mine["gpu_seconds"] <= 30, mine
    assert mine["memory_byte_seconds"] == pytest.approx(2 * GIB * mine["gpu_seconds"], rel=0.35), mine
    assert mine["sm_seconds"] == pytest.approx(0.5 * mine["sm_known_seconds"], rel=0.05), mine
    assert mine["energy_joules"] is not None and mine["energy_joules"] > 0 and mine["peak_memory"] == 2 * GIB
    r = victims.ctl(owner, "usage", "--user", owner.name)
    assert r.returncode == 0 and r.stdout.splitlines()[0].startswith("USER "), r
    assert any(line.startswith(owner.name + " ") for line in r.stdout.splitlines()), r.stdout
    r = victims.ctl(owner, "usage", "--since", "tomorrow")  # since after until (now): the daemon says no
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("gpukillctl: "), r
    r = victims.ctl(owner, "usage", "--since", "a while")
    assert r.returncode == 2 and "is not a time" in r.stderr, r


@needs_root
def test_gpukill_audit_summary_is_top_users_then_top_processes(victims, users):
    """gpu-kill's `gpukill --audit --audit-summary --audit-hours 1 --output json`: two reports, by user then by
    process, each the JSON of gpukillctl usage."""
    owner = users["owner"]
    v = victims.victim(owner, gpu=0, mem="1GiB", comm="auditme")
    victims.wait_listed(v.pid, comm="auditme")
    time.sleep(2)
    r = victims.gpukill(
        owner, "--audit", "--audit-summary", "--audit-hours", "1", "--audit-process", "auditme", "--output", "json"
    )
    assert r.returncode == 0, r
    by_user, by_process = (json.loads(line) for line in r.stdout.splitlines())
    assert by_user["by"] == "user" and [row["key"] for row in by_user["rows"]] == [owner.name]
    assert by_process["by"] == "process" and [row["pid"] for row in by_process["rows"]] == [v.pid]
    assert by_process["until"] - by_process["since"] == pytest.approx(3600, abs=30)


def test_the_groupings_are_getusages():
    from gpukill.records.usage import USAGE_BY
    from gpukillctl.cli import usage as cli_usage

    assert tuple(USAGE_BY) == cli_usage.BY
