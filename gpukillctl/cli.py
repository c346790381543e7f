"""gpukillctl: see who is on which GPU, stop a process safely, reset a GPU. Everything goes through gpukilld.

Errors are one line on stderr with a distinct exit code (listed in --help); never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import NoReturn

from dbus_fast import Variant

from gpukill.limits import MAX_GRACE
from gpukill.outcome import Outcome
from gpukill.procstat import read_stat
from gpukill.records import STATE_OK, Process, to_plain

from .audit_cli import cmd_audit
from .audit_cli import register as register_audit
from .client import ClientError, GpukillClient
from .exits import (
    EXIT_CODES_HELP,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_STILL_ALIVE,
    EXIT_USAGE,
    exit_code,
)
from .exporter import register as register_exporter
from .format import devices_table, processes_table, shown
from .guard_cli import cmd_guard
from .guard_cli import register as register_guard
from .job_kill import kill_job, slurm_job_id
from .mcp_cli import register as register_mcp
from .monitor import cmd_monitor
from .monitor import register as register_monitor
from .notify_agent import register as register_notify_agent
from .polkit_agent import PolkitAgent
from .serve import register as register_serve
from .top import cmd_top
from .top import register as register_top

JSON_FORMAT = 1


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + message
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a PID: {text!r}") from None
    if not 0 < value < 2**22:
        raise argparse.ArgumentTypeError(f"PID out of range: {value}")
    return value


def byte_count(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of bytes must not be negative, not {text}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= MAX_GRACE:
        raise argparse.ArgumentTypeError(f"grace must be between 0 and {MAX_GRACE:g} seconds, not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="gpukillctl", description="See and stop GPU processes, reset GPUs, through gpukilld.",
               epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-H", "--host", metavar="[USER@]HOST[:PORT]",
                   help="act on this host's gpukilld, over ssh and its systemd-stdio-bridge (as systemctl -H)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    ls = sub.add_parser("list", help="devices and the processes on them")
    ls.add_argument("--json", action="store_true", help="machine-readable output (stable format)")
    ls.add_argument("--device", help="only processes on this GPU (index, UUID or PCI bus id)")
    ls.add_argument("--user", help="only processes of this user (name or uid)")
    ls.add_argument("--name", help="only processes whose name contains this")
    ls.add_argument("--name-regex", help="only processes whose name matches this regular expression")
    ls.add_argument("--min-memory", type=byte_count, metavar="BYTES", help="only processes using at least BYTES")

    kill = sub.add_parser("kill", help="stop a GPU process: SIGTERM, then SIGKILL with --force")
    target = kill.add_mutually_exclusive_group(required=True)
    target.add_argument("pid", type=positive_int, metavar="PID", nargs="?")
    target.add_argument("--job", type=slurm_job_id, metavar="ID",
                        help="every GPU process of this Slurm job on this host, each as listed")
    kill.add_argument("--force", action="store_true", help="send SIGKILL if it outlives the grace period")
    kill.add_argument("--grace", type=seconds, metavar="SECONDS", help="wait this long after SIGTERM (default 5)")
    kill.add_argument("--start-time", type=int, metavar="TICKS",
                      help="the start time from `list --json`: refuse if PID now names another process")

    reset = sub.add_parser("reset", help="reset a GPU (refused while processes use it unless --force)")
    reset.add_argument("device", metavar="DEVICE", help="index, UUID or PCI bus id")
    reset.add_argument("--force", action="store_true", help="kill the processes on the GPU first")

    sub.add_parser("status", help="daemon version, backends and a summary")
    register_guard(sub)
    register_top(sub)
    register_notify_agent(sub)
    register_monitor(sub)
    register_audit(sub)
    register_mcp(sub)
    register_serve(sub)
    register_exporter(sub)
    return p


def fail(message: str, code: int) -> int:
    print(f"gpukillctl: {shown(message)}", file=sys.stderr)  # daemon messages name processes: escape them
    return code


def _start_time_from_proc(pid: int) -> int:
    """For a PID the daemon does not list (so it can say why it refuses): its start time, or 0 if gone."""
    stat = read_stat(pid)
    return stat.start_time if stat else 0


def _filter(args: argparse.Namespace) -> dict[str, Variant]:
    f: dict[str, Variant] = {}
    if args.device is not None:
        f["device"] = Variant("s", args.device)
    if args.user is not None:
        f["user"] = Variant("s", args.user)
    if args.name is not None:
        f["name"] = Variant("s", args.name)
    if args.name_regex is not None:
        f["name_regex"] = Variant("s", args.name_regex)
    if args.min_memory is not None:
        f["min_memory"] = Variant("t", args.min_memory)
    return f


async def cmd_list(client: GpukillClient, args: argparse.Namespace) -> int:
    devices = await client.list_devices()
    procs = await client.list_processes(_filter(args))
    if args.json:
        json.dump({"format": JSON_FORMAT, "devices": [to_plain(d) for d in devices],
                   "processes": [to_plain(p) for p in procs]}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(devices_table(devices) if devices else "No GPUs.")
        print()
        print(processes_table(procs))
    return EXIT_OK


async def cmd_kill(client: GpukillClient, args: argparse.Namespace) -> int:
    if args.job is not None:
        if args.start_time is not None:
            return fail("--start-time names one process: it does not go with --job", EXIT_USAGE)
        agent = PolkitAgent(client.unique_name)
        try:
            return await kill_job(client, args, agent.active)
        finally:
            agent.close()
    start_time = args.start_time
    listed: Process | None = None
    if start_time is None:
        listed = next((p for p in await client.list_processes() if p.pid == args.pid), None)
        # this host's /proc says nothing of a PID on another host: 0 lets that daemon say why it refuses
        start_time = listed.start_time if listed else 0 if args.host else _start_time_from_proc(args.pid)
    agent = PolkitAgent(client.unique_name)
    try:
        outcome = await client.kill(args.pid, start_time, force=args.force, grace=args.grace,
                                    interactive=agent.active)
    finally:
        agent.close()
    name = f" ({shown(listed.comm)})" if listed else ""
    if outcome == Outcome.TERMINATED:
        print(f"PID {args.pid}{name} {Outcome.TERMINATED.text}")
        return EXIT_OK
    if outcome == Outcome.KILLED:
        print(f"PID {args.pid}{name} {Outcome.KILLED.text} after the grace period")
        return EXIT_OK
    return fail(f"PID {args.pid}{name} is {Outcome.STILL_ALIVE.text}; use --force to send SIGKILL",
                EXIT_STILL_ALIVE)


async def cmd_reset(client: GpukillClient, args: argparse.Namespace) -> int:
    agent = PolkitAgent(client.unique_name)
    try:
        result = await client.reset(args.device, force=args.force, interactive=agent.active)
    finally:
        agent.close()
    if result.killed:
        print(f"killed first: {', '.join(map(str, result.killed))}")
    print(f"GPU {result.device} ({shown(result.device_id)}): {shown(result.message)}")
    return EXIT_OK


async def cmd_status(client: GpukillClient, args: argparse.Namespace) -> int:
    status = await client.status()
    devices = await client.list_devices()
    procs = await client.list_processes()
    lost = [d for d in devices if d.state != STATE_OK]
    print(f"gpukilld {status.version}, sampling every {status.sample_interval:g}s")
    print(f"{len(devices)} GPUs ({len(lost)} lost), {len(procs)} GPU processes")
    print("backends:")
    if not status.backends:
        print("  none configured")
    for b in status.backends:
        print(shown(f"  {b.name}: {'available' if b.available else 'unavailable'}"
                    + (f" - {b.detail}" if b.detail else "")))
    for d in lost:
        print(shown(f"GPU {d.index} ({d.id}) lost" + (f": {d.state_reason}" if d.state_reason else "")))
    return EXIT_OK


COMMANDS = {"list": cmd_list, "kill": cmd_kill, "reset": cmd_reset, "status": cmd_status, "guard": cmd_guard,
            "monitor": cmd_monitor, "top": cmd_top, "audit": cmd_audit}


async def run(args: argparse.Namespace) -> int:
    client = await GpukillClient.connect(host=args.host)
    try:
        return await COMMANDS[args.command](client, args)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "offline", None) is not None:  # guard validate: needs neither the bus nor gpukilld
            if args.host:  # these run here, or serve, or connect on their own: -H is not theirs (yet)
                return fail(f"-H is not supported by {args.command} (see --help)", EXIT_USAGE)
            return args.offline(args)
        return asyncio.run(run(args))
    except ClientError as e:  # which host said no, when it is not this one
        return fail(f"host {args.host}: {e}" if args.host else str(e), exit_code(e))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # a bug must still end in one line, not a traceback
        return fail(f"internal error: {type(e).__name__}: {e}", EXIT_FAILURE)


if __name__ == "__main__":
    sys.exit(main())
