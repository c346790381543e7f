"""`gpukillctl postpone PID DURATION [--reason TEXT]`: the owner of a process asks for more time before a Guard kill
rule stops it. gpukilld grants what the rule's caps allow (`postpone: {max, times}`) and says so per rule; polkit
lets an owner ask for their own processes without a password, an admin for anyone's."""

from __future__ import annotations

import argparse
import sys
import time

from ..client.api import ClientAPI
from ..client.exits import EXIT_FAILURE, EXIT_OK
from ..client.format import shown
from .pids import pid_number

MAX_REASON = 200  # characters, as gpukilld bounds it (gpukilld/bus/guard.py)
MAX_POSTPONE = 7 * 86400.0  # a week: gpukilld refuses more (a rule's max caps it further)


def duration(text: str) -> float:
    """How much more time, in gpukill.units' duration grammar (20min, 1h, 90s)."""
    from gpukill.units import parse_duration

    try:
        value = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not 0 < value <= MAX_POSTPONE:
        raise argparse.ArgumentTypeError(f"the time asked must be more than 0 and at most 7d, not {text}")
    return value


def reason_text(text: str) -> str:
    if len(text) > MAX_REASON:
        raise argparse.ArgumentTypeError(f"the reason is longer than {MAX_REASON} characters")
    return text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "postpone", help="ask for more time before a Guard rule stops your process (within the rule's caps)"
    )
    p.add_argument("pid", type=pid_number, metavar="PID")
    p.add_argument("duration", type=duration, metavar="DURATION", help="how much more time, e.g. 20min or 1h")
    p.add_argument("--reason", type=reason_text, default="", metavar="TEXT", help="why, for the administrators")
    p.add_argument(
        "--start-time",
        type=int,
        metavar="TICKS",
        help="the start time from `list --json`: refuse if PID now names another process",
    )


async def cmd_postpone(client: ClientAPI, args: argparse.Namespace) -> int:
    from gpukill.procstat import read_stat

    from ..client.polkit_agent import PolkitAgent

    start_time = args.start_time
    if start_time is None:
        listed = next((p for p in await client.list_processes() if p.pid == args.pid), None)
        stat = None if listed or args.host else read_stat(args.pid)
        # this host's /proc says nothing of a PID on another host: 0 lets that daemon say why it refuses
        start_time = listed.start_time if listed else stat.start_time if stat else 0
    agent = PolkitAgent()
    try:
        answer = await client.guard_postpone(args.pid, start_time, args.duration, args.reason, interactive=agent.active)
    finally:
        agent.close()
    if not answer.granted:
        print(f"gpukillctl: {shown(f'PID {args.pid}: {answer.text}')}", file=sys.stderr)
        return EXIT_FAILURE
    for r in answer.rules:
        if r.granted > 0:
            until = time.strftime("%H:%M:%S", time.localtime(r.deadline))
            left = "no more postponements" if not r.left else f"{r.left} more postponement(s) allowed"
            print(
                shown(f"rule {r.rule}: {r.text}; {r.subject} is stopped at {until} unless it comes back under ({left})")
            )
        else:
            print(shown(f"rule {r.rule}: {r.text}"))
    return EXIT_OK
