"""gpukillctl usage: who used the GPUs, how much and for how long, from gpukilld's accounting (GetUsage).

The daemon integrates every sample into a record per process and GPU and keeps the records (the journal, and
a store beside it); this asks for their totals over a range, grouped by user, unit, Slurm job, pod, GPU or
process, with the processes still running counted up to the latest sample. Other users' records are counted
as the caller may see them (docs/security.md). The time forms and the table are gpukillctl/client/usage.py's;
--json prints the reply as it is (gpukill/records/usage.py, UsageReport).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from gpukill.records.base import to_plain
from gpukill.text import shown

from ..client.api import ClientAPI
from ..client.exits import EXIT_NO_SUCH_NAME, EXIT_OK, EXIT_USAGE

MAX_LIMIT = 1000  # GetUsage's own bound
# gpukill.records.USAGE_BY's keys (tests/test_usage_cli.py checks they agree), written out so that parsing the
# command line does not build the usage records: `gpukillctl list` builds every subcommand's parser.
BY = ("user", "unit", "job", "pod", "gpu", "process")
# The filters, each a GetUsage key of the same name: (option, help).
FILTERS = (
    ("user", "only this user's records (name or uid)"),
    ("name", "only processes whose name contains this"),
    ("unit", "only this systemd unit's (e.g. jupyter.service)"),
    ("job", "only this Slurm job's"),
    ("pod", "only this Kubernetes pod's (its UID)"),
    ("device", "only on this GPU (index, UUID or PCI bus id)"),
)


def when(now: Callable[[], float] = time.time) -> Callable[[str], float]:
    """argparse's type for --since/--until: seconds since the epoch, a one-line error (exit 2) otherwise."""

    def parse(text: str) -> float:
        from ..client.usage import parse_when

        try:
            return parse_when(text, now())
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "time"  # argparse names the type in its errors
    return parse


def limit(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text[:64]!r}") from None
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"the limit must be between 1 and {MAX_LIMIT}, not {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "usage",
        help="who used the GPUs: GPU time, memory, energy per user, unit, job, pod",
        description="GPU use recorded by gpukilld over a range (default: the last 24 hours), "
        "grouped: GPU time, utilization-weighted (SM) time, memory over time in "
        "GiB·h, peak memory and energy, with running processes counted so far. "
        '"unknown" where the GPU could not measure it. Of other users\' records '
        "only what you may see is counted. TIME is a duration ago (30d, 24h, 90min, "
        "1h30m), a date (YYYY-MM-DD, 'YYYY-MM-DD HH:MM[:SS]', ISO 8601 with an "
        "offset; local time otherwise), today, yesterday, now or @SECONDS.",
    )
    p.add_argument("--since", type=when(), metavar="TIME", help="from this time (default: 24h before --until)")
    p.add_argument("--until", type=when(), metavar="TIME", help="up to this time (default: now)")
    p.add_argument("--by", choices=BY, default="user", help="group by this (default: user)")
    for key, text in FILTERS:
        p.add_argument(f"--{key}", metavar=key.upper(), help=text)
    p.add_argument("--limit", type=limit, metavar="N", help=f"at most N groups, largest first (1-{MAX_LIMIT})")
    p.add_argument("--json", action="store_true", help="the reply as JSON (gpukill's UsageReport)")
    p.set_defaults(check=check_range)


def check_range(args: argparse.Namespace) -> str | None:
    """What is wrong with the options together (cli.main says it before connecting), or None."""
    if args.since is not None and args.until is not None and args.since >= args.until:
        return "--since must be before --until"
    return None


def query_of(args: argparse.Namespace) -> dict[str, Any]:
    """GetUsage's query from the parsed options (what is not given is the daemon's default)."""
    query: dict[str, Any] = {"by": args.by}
    for key in ("since", "until", *(k for k, _ in FILTERS), "limit"):
        if getattr(args, key, None) is not None:
            query[key] = getattr(args, key)
    return query


async def _no_such_name(client: ClientAPI, args: argparse.Namespace) -> str | None:
    """For a report that found nothing: why its --user, --unit or --device names nothing that exists (names.py),
    or None. Only then is it asked: a user or unit removed since still has its records."""
    from .names import no_such_device, no_such_unit, no_such_user

    if args.device is not None:
        problem = no_such_device(await client.list_devices(), args.device)
        if problem:
            return problem
    if getattr(args, "host", None):  # another host's users and units: not this one's to tell
        return None
    if args.user is not None and (problem := no_such_user(args.user)):
        return problem
    if args.unit is not None and (problem := no_such_unit(args.unit)):
        return problem
    return None


async def cmd_usage(client: ClientAPI, args: argparse.Namespace) -> int:
    problem = check_range(args)
    if problem:  # called by another command (gpukill's --audit) without cli.main's check
        print(f"gpukillctl: usage: {problem}", file=sys.stderr)
        return EXIT_USAGE
    report = await client.usage(query_of(args))
    if not report.rows and any(getattr(args, key, None) is not None for key in ("user", "unit", "device")):
        problem = await _no_such_name(client, args)
        if problem:
            print(f"gpukillctl: usage: {problem}", file=sys.stderr)
            return EXIT_NO_SUCH_NAME
        named = [
            f"{'GPU' if key == 'device' else key} {getattr(args, key)}"
            for key in ("user", "unit", "device")
            if getattr(args, key, None) is not None
        ]
        print(shown(f"gpukillctl: usage: {' on '.join(named)} has no GPU use recorded in this range"), file=sys.stderr)
    if args.json:
        sys.stdout.write(json.dumps(to_plain(report)) + "\n")
        return EXIT_OK
    from ..client.usage import usage_table

    print(usage_table(report))
    return EXIT_OK
