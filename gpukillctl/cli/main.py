"""gpukillctl: see who is on which GPU, stop a process safely, reset a GPU. Everything goes through gpukilld.

Errors are one line on stderr with a distinct exit code (listed in --help); never a traceback.

Start-up time is most of a one-shot command's time, so this module and what it imports for the one-shot
commands (list, kill PID, reset, status, guard, postpone, audit, usage) load neither asyncio nor dbus-fast: those
commands run on the blocking transport (gpukillctl/client/blocking.py). The long-lived commands (top, monitor,
notify-agent, mcp, serve, exporter) and -H (ssh's start dwarfs any import) run on asyncio; their modules are
imported only when one of them is asked for (tests/test_imports.py checks it).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any, NoReturn

from gpukill.records.base import to_plain
from gpukill.records.manager import STATE_OK, Process

from ..client.api import ClientAPI, ClientError, Var
from ..client.exits import (
    EXIT_CODES_HELP,
    EXIT_FAILURE,
    EXIT_NO_SUCH_NAME,
    EXIT_OK,
    EXIT_USAGE,
    exit_code,
)
from ..client.format import devices_table, processes_table, shown
from .pids import pid_number

JSON_FORMAT = 1
# The commands that run on the blocking transport and whose parsers need no asyncio module: for these
# alone the parser is built without the others (each of the others imports asyncio and dbus-fast to register).
ONE_SHOT = ("list", "kill", "suspend", "resume", "reset", "status", "guard", "postpone", "audit", "usage")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + message
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see --help)\n")

    def _get_formatter(self) -> argparse.HelpFormatter:
        # argparse makes a formatter for every add_argument (to check its metavar), and a formatter given no width
        # imports shutil (with bz2, lzma, zlib: ~1.5 ms of every start) to ask the terminal's: give it the same width
        # every HelpFormatter takes width; typeshed's protocol for formatter_class names prog only
        return self.formatter_class(prog=self.prog, width=help_width())  # type: ignore[call-arg]


@functools.cache
def help_width() -> int:
    """The width argparse gives help by default, shutil.get_terminal_size().columns - 2, read as shutil reads it
    (COLUMNS where it is a positive number, else the terminal on stdout, else 80), without importing shutil."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            # no stdout (None): the AttributeError below
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 80
    return columns - 2


def byte_count(text: str) -> int:
    """A size in gpukill.units' grammar (4GiB, 512MiB, 4096B): a filter, not a limit, so any size."""
    from gpukill.units import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seconds(text: str) -> float:
    """A kill's grace in gpukill.units' duration grammar (5, 5s, 2min), at most MAX_GRACE."""
    from gpukill.limits import MAX_GRACE  # here: kill's --grace needs it, `list` does not
    from gpukill.units import parse_duration

    try:
        value = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value > MAX_GRACE:
        raise argparse.ArgumentTypeError(f"grace must be between 0 and {MAX_GRACE:g} seconds, not {text}")
    return value


def build_parser(full: bool = True, only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with full=False only the one-shot commands' (enough to parse a one-shot command line);
    with only=COMMAND, one of ONE_SHOT, that command's alone. Building a subparser costs its gettext look-ups and
    formatters (~0.3 ms each, the guard's a dozen): a one-shot command line needs only its own."""

    def wanted(name: str) -> bool:
        return only is None or name == only

    p = Parser(
        prog="gpukillctl",
        description="See and stop GPU processes, reset GPUs, through gpukilld.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-H",
        "--host",
        metavar="[USER@]HOST[:PORT]",
        help="act on this host's gpukilld, over ssh and its systemd-stdio-bridge (as systemctl -H)",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    if wanted("list"):
        _register_list(sub)
    if wanted("kill"):
        _register_kill(sub)
    for name in ("suspend", "resume"):
        if wanted(name):
            _register_suspend(sub, name)
    if wanted("reset"):
        reset = sub.add_parser("reset", help="reset a GPU (refused while processes use it unless --force)")
        reset.add_argument("device", metavar="DEVICE", help="index, UUID or PCI bus id")
        reset.add_argument("--force", action="store_true", help="kill the processes on the GPU first")
    if wanted("status"):
        sub.add_parser("status", help="daemon version, backends and a summary")
    # the other commands' modules here, when their parser is built: a one-shot command imports only its own
    if wanted("guard"):
        from .guard import register as register_guard

        register_guard(sub)
    if wanted("postpone"):
        from .postpone import register as register_postpone

        register_postpone(sub)
    if full and only is None:
        _register_long_lived(sub)
    if wanted("audit"):
        from .audit import register as register_audit

        register_audit(sub)
    if wanted("usage"):
        from .usage import register as register_usage

        register_usage(sub)
    if full and only is None:
        _register_servers(sub)
    return p


def _register_list(sub: argparse._SubParsersAction) -> None:
    ls = sub.add_parser("list", help="devices and the processes on them")
    ls.add_argument("--json", action="store_true", help="machine-readable output (stable format)")
    ls.add_argument("--device", help="only processes on this GPU (index, UUID or PCI bus id)")
    ls.add_argument("--user", help="only processes of this user (name or uid)")
    ls.add_argument("--name", help="only processes whose name contains this")
    ls.add_argument("--name-regex", help="only processes whose name matches this regular expression")
    ls.add_argument(
        "--min-memory", type=byte_count, metavar="SIZE", help="only processes using at least SIZE (e.g. 4GiB, 512MiB)"
    )


def _register_kill(sub: argparse._SubParsersAction) -> None:
    from .kill_answer import container_id, slurm_job_id, unit_name

    kill = sub.add_parser("kill", help="stop a GPU process (or a workload's) and say whether its GPU memory is back")
    target = kill.add_mutually_exclusive_group(required=True)
    target.add_argument("pid", type=pid_number, metavar="PID", nargs="?")
    target.add_argument(
        "--job",
        type=slurm_job_id,
        metavar="ID",
        help="every GPU process of this Slurm job on this host, together",
    )
    target.add_argument(
        "--tree",
        type=pid_number,
        metavar="PID",
        help="PID and its descendants on a GPU (the others are left running)",
    )
    target.add_argument("--unit", type=unit_name, metavar="UNIT", help="every GPU process of this systemd unit")
    target.add_argument(
        "--container",
        type=container_id,
        metavar="ID",
        help="every GPU process of this container (an id or a prefix of 12 or more hex digits)",
    )
    kill.add_argument("--force", action="store_true", help="send SIGKILL if it outlives the grace period")
    kill.add_argument(
        "--grace", type=seconds, metavar="DURATION", help="wait this long after SIGTERM, e.g. 30s or 2min (default 5s)"
    )
    kill.add_argument(
        "--checkpoint",
        action="store_true",
        help="before SIGTERM, send the signal the job declared (GPUKILL_CHECKPOINT=USR1:2m) and wait for it to save",
    )
    kill.add_argument(
        "--start-time",
        type=int,
        metavar="TICKS",
        help="the start time from `list --json`: refuse if PID (or --tree PID) now names another process",
    )


def _register_suspend(sub: argparse._SubParsersAction, name: str) -> None:
    from .kill_answer import slurm_job_id, unit_name

    what = {
        "suspend": "set a workload's GPU memory aside in host memory and free the GPU, without ending it (NVIDIA)",
        "resume": "give a suspended workload its GPU memory back",
    }[name]
    cmd = sub.add_parser(name, help=what)
    target = cmd.add_mutually_exclusive_group(required=True)
    target.add_argument("pid", type=pid_number, metavar="PID", nargs="?")
    target.add_argument("--tree", type=pid_number, metavar="PID", help="PID and its descendants on a GPU, together")
    target.add_argument("--unit", type=unit_name, metavar="UNIT", help="every GPU process of this systemd unit")
    target.add_argument("--job", type=slurm_job_id, metavar="ID", help="every GPU process of this Slurm job here")


def _register_long_lived(sub: argparse._SubParsersAction) -> None:
    from ..notify.agent import register as register_notify_agent
    from ..top.app import register as register_top
    from ..top.monitor import register as register_monitor

    register_top(sub)
    register_notify_agent(sub)
    register_monitor(sub)


def _register_servers(sub: argparse._SubParsersAction) -> None:
    from ..exporter.main import register as register_exporter
    from ..serve.mcp_cli import register as register_mcp
    from ..serve.server import register as register_serve

    register_mcp(sub)
    register_serve(sub)
    register_exporter(sub)


def command_word(argv: list[str]) -> str | None:
    """The subcommand of a command line, read before parsing: the first word that is not -H/--host or its value.
    None where --help comes first: it lists every command."""
    words = iter(argv)
    for word in words:
        if word in ("-h", "--help"):
            return None
        if word in ("-H", "--host"):
            next(words, None)
        elif word == "--":
            return next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def fail(message: str, code: int) -> int:
    print(f"gpukillctl: {shown(message)}", file=sys.stderr)  # daemon messages name processes: escape them
    return code


def polkit_agent() -> Any:
    """pkttyagent for this process, for a call polkit may ask a password for (imported here: it brings
    subprocess, which `list` does without)."""
    from ..client.polkit_agent import PolkitAgent

    return PolkitAgent()


def _start_time_from_proc(pid: int) -> int:
    """For a PID the daemon does not list (so it can say why it refuses): its start time, or 0 if gone."""
    from gpukill.procstat import read_stat  # here: `list`, the commonest one-shot command, never reads /proc

    stat = read_stat(pid)
    return stat.start_time if stat else 0


def _filter(args: argparse.Namespace) -> dict[str, Var]:
    f: dict[str, Var] = {}
    if args.device is not None:
        f["device"] = Var("s", args.device)
    if args.user is not None:
        f["user"] = Var("s", args.user)
    if args.name is not None:
        f["name"] = Var("s", args.name)
    if args.name_regex is not None:
        f["name_regex"] = Var("s", args.name_regex)
    if args.min_memory is not None:
        f["min_memory"] = Var("t", args.min_memory)
    return f


def _named_selection(args: argparse.Namespace, devices: list) -> tuple[str, str | None]:
    """For a listing that selected nothing: what its names (--user, --device) name, and why one of them names
    nothing that exists (names.py), or None when they all exist."""
    from .names import no_such_device, no_such_user

    problem = None
    if args.device is not None:
        problem = no_such_device(devices, args.device)
    if problem is None and args.user is not None and not getattr(args, "host", None):
        problem = no_such_user(args.user)
    subject = " on ".join(
        w
        for w in (
            f"user {args.user}" if args.user is not None else "",
            f"GPU {args.device}" if args.device is not None else "",
        )
        if w
    )
    return subject, problem


def _suspended_selected(args: argparse.Namespace, records: list) -> list:
    """The suspended processes (gpukill.records.suspend.SuspendedProcess) that list's filters select, as the
    daemon selects the processes on a GPU: a GPU by index or UUID, a user by name or uid."""
    if args.name_regex is not None:
        from gpukill.regex import compile_regex

        rx = compile_regex(args.name_regex)
    out = []
    for r in records:
        if args.device is not None and args.device not in (*map(str, r.devices), *r.device_ids):
            continue
        if args.user is not None and args.user != str(r.uid):
            import pwd

            try:
                if pwd.getpwuid(r.uid).pw_name != args.user:
                    continue
            except KeyError:
                continue
        if args.name is not None and args.name not in r.comm:
            continue
        if args.name_regex is not None and rx.search(r.comm) is None:
            continue
        if args.min_memory is not None and r.memory < args.min_memory:
            continue
        out.append(r)
    return out


async def cmd_list(client: ClientAPI, args: argparse.Namespace) -> int:
    devices = await client.list_devices()
    procs = await client.list_processes(_filter(args))
    suspended = _suspended_selected(args, await client.suspended())
    if not procs and (args.device is not None or args.user is not None):
        subject, problem = _named_selection(args, devices)
        if problem:
            return fail(problem, EXIT_NO_SUCH_NAME)
        from .names import none_selected

        none_selected(subject)
    if args.json:
        # dumps, not dump: json.dump streams through the pure-Python encoder, dumps uses the C one (~10 ms less
        # for 256 processes)
        sys.stdout.write(
            json.dumps(
                {
                    "format": JSON_FORMAT,
                    "devices": [to_plain(d) for d in devices],
                    "processes": [to_plain(p) for p in procs],
                    "suspended": [to_plain(p) for p in suspended],
                }
            )
            + "\n"
        )
    else:
        print(devices_table(devices) if devices else "No GPUs.")
        print()
        print(processes_table(procs))
        if suspended:
            from ..client.format import suspended_table

            print()
            print(suspended_table(suspended))
    return EXIT_OK


async def cmd_kill(client: ClientAPI, args: argparse.Namespace) -> int:
    from .kill_answer import answer, workload_answer

    if (args.unit or args.container or args.job is not None) and args.start_time is not None:
        return fail("--start-time names one process: it does not go with --unit, --container or --job", EXIT_USAGE)
    pid = args.tree or args.pid
    start_time = args.start_time
    listed: Process | None = None
    if pid is not None and start_time is None:
        listed = next((p for p in await client.list_processes() if p.pid == pid), None)
        # this host's /proc says nothing of a PID on another host: 0 lets that daemon say why it refuses
        start_time = listed.start_time if listed else 0 if args.host else _start_time_from_proc(pid)
    if args.tree or args.unit or args.container or args.job is not None:
        selection = (
            {"tree": Var("(ut)", (args.tree, start_time))}
            if args.tree
            else {"unit": Var("s", args.unit)}
            if args.unit
            else {"job": Var("s", args.job)}
            if args.job is not None
            else {"container": Var("s", args.container)}
        )
        agent = polkit_agent()
        try:
            reply = await client.kill_workload(
                selection, force=args.force, grace=args.grace, interactive=agent.active, checkpoint=args.checkpoint
            )
        finally:
            agent.close()
        if not reply.entries and args.unit and not args.host:
            from .names import no_such_unit

            problem = no_such_unit(args.unit)
            if problem:
                return fail(problem, EXIT_NO_SUCH_NAME)
        return workload_answer(reply)
    agent = polkit_agent()
    try:
        report = await client.kill_report(
            pid, start_time, force=args.force, grace=args.grace, interactive=agent.active, checkpoint=args.checkpoint
        )
    finally:
        agent.close()
    name = f" ({shown(listed.comm)})" if listed else ""
    return answer(f"PID {pid}{name}", report.outcome, report.reclaim, report.checkpoint)


async def cmd_suspend(client: ClientAPI, args: argparse.Namespace) -> int:
    from .suspend import cmd_suspend

    return await cmd_suspend(client, args)


async def cmd_reset(client: ClientAPI, args: argparse.Namespace) -> int:
    agent = polkit_agent()
    try:
        result = await client.reset(args.device, force=args.force, interactive=agent.active)
    finally:
        agent.close()
    if result.killed:
        print(f"killed first: {', '.join(map(str, result.killed))}")
    print(f"GPU {result.device} ({shown(result.device_id)}): {shown(result.message)}")
    return EXIT_OK


async def cmd_status(client: ClientAPI, args: argparse.Namespace) -> int:
    from gpukill.units import format_duration

    status = await client.status()
    devices = await client.list_devices()
    procs = await client.list_processes()
    lost = [d for d in devices if d.state != STATE_OK]
    print(f"gpukilld {status.version}, sampling every {format_duration(status.sample_interval)}")
    if status.sampling is not None:  # events: a process's exec or rename is seen in the next sample
        print(shown(f"process changes: {status.sampling.mode} - {status.sampling.detail}"))
    print(f"{len(devices)} GPUs ({len(lost)} lost), {len(procs)} GPU processes")
    print("backends:")
    if not status.backends:
        print("  none configured")
    for b in status.backends:
        print(
            shown(
                f"  {b.name}: {'available' if b.available else 'unavailable'}" + (f" - {b.detail}" if b.detail else "")
            )
        )
    for d in lost:
        print(shown(f"GPU {d.index} ({d.id}) lost" + (f": {d.state_reason}" if d.state_reason else "")))
    return EXIT_OK


# guard, audit and usage are in modules of their own, imported when one of them runs (not at every start)
async def cmd_guard(client: ClientAPI, args: argparse.Namespace) -> int:
    from .guard import cmd_guard

    return await cmd_guard(client, args)


async def cmd_postpone(client: ClientAPI, args: argparse.Namespace) -> int:
    from .postpone import cmd_postpone

    return await cmd_postpone(client, args)


async def cmd_audit(client: ClientAPI, args: argparse.Namespace) -> int:
    from .audit import cmd_audit

    return await cmd_audit(client, args)


async def cmd_usage(client: ClientAPI, args: argparse.Namespace) -> int:
    from .usage import cmd_usage

    return await cmd_usage(client, args)


COMMANDS = {
    "list": cmd_list,
    "kill": cmd_kill,
    "suspend": cmd_suspend,
    "resume": cmd_suspend,
    "reset": cmd_reset,
    "status": cmd_status,
    "guard": cmd_guard,
    "postpone": cmd_postpone,
    "audit": cmd_audit,
    "usage": cmd_usage,
}


def command(name: str) -> Any:
    """The coroutine function of a command that talks to gpukilld."""
    if name == "monitor":
        from ..top.monitor import cmd_monitor

        return cmd_monitor
    if name == "top":
        from ..top.app import cmd_top

        return cmd_top
    return COMMANDS[name]


def needs_event_loop(args: argparse.Namespace) -> bool:
    return args.command not in ONE_SHOT or bool(args.host)


def run_blocking(args: argparse.Namespace) -> int:
    from ..client.blocking import BlockingClient, finish

    client = BlockingClient.connect()
    try:
        return finish(command(args.command)(client, args))
    finally:
        client.close()


def run_async(args: argparse.Namespace) -> int:
    import asyncio

    from ..client.dbus import GpukillClient

    async def run() -> int:
        client = await GpukillClient.connect(host=args.host)
        try:
            return await command(args.command)(client, args)
        finally:
            client.close()

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    word = command_word(words)
    one_shot = word if word in ONE_SHOT else None
    args = build_parser(full=one_shot is None, only=one_shot).parse_args(words)
    problem = args.check(args) if getattr(args, "check", None) else None  # options that go wrong together
    if problem:
        return fail(f"{args.command}: {problem}", EXIT_USAGE)
    try:
        if getattr(args, "offline", None) is not None:  # guard validate: needs neither the bus nor gpukilld
            if args.host:  # these run here, or serve, or connect on their own: -H is not theirs (yet)
                return fail(f"-H is not supported by {args.command} (see --help)", EXIT_USAGE)
            return args.offline(args)
        return run_async(args) if needs_event_loop(args) else run_blocking(args)
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
