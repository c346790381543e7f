"""gpukill: gpu-kill's command line for admins who know it, translated to the calls gpukillctl makes.

Each invocation becomes a gpukillctl command (or a sequence of them: `--reset --all`, `--kill --filter
--batch`) run by gpukillctl's own command functions on the same client, so output, JSON and exit statuses are
gpukillctl's and polkit decides as it does for gpukillctl. A flag gpukill does not take, or a combination whose
meaning is not certain, is refused with one line naming what to run instead (exit 2): a tool that kills
processes must not guess.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shlex
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn

from gpukill.regex import RegexError, compile_regex

from .audit_cli import cmd_audit
from .cli import build_parser as gpukillctl_parser
from .cli import cmd_kill, cmd_list, cmd_reset, positive_int, seconds
from .client_api import ClientAPI, ClientError, Var
from .exits import (
    EXIT_CODES_HELP,
    EXIT_FAILURE,
    EXIT_NOT_FOUND,
    EXIT_NOT_SUPPORTED,
    EXIT_OK,
    EXIT_USAGE,
    exit_code,
)
from .format import shown
from .guard_cli import cmd_guard

PROG = "gpukill"
WATCH_INTERVAL = 2.0  # seconds between --watch refreshes: gpu-kill's default
CLEAR_SCREEN = "\x1b[H\x1b[2J"
OPERATIONS = ("list", "kill", "reset", "guard", "audit")

# What each operation is in gpukillctl, for messages that name the command to run instead.
EQUIVALENT = {
    "list": "gpukillctl list",
    "kill": "gpukillctl kill PID",
    "reset": "gpukillctl reset GPU",
    "guard": "gpukillctl guard status",
    "audit": "journalctl -t gpukilld",
}

AUDIT_INSTEAD = ("journalctl -t gpukilld (every kill, reset and Guard action, e.g. journalctl -t gpukilld "
                 "GPUKILL_RESULT=denied); processes on the GPUs now: gpukillctl list; rogue activity now: "
                 "gpukill --audit --rogue (gpukillctl audit)")
_POLICY_FILE = "write the rule in a policy file and load it: gpukillctl guard load FILE (see gpukill-policy(5))"
_SSH = "run gpukill on that host: ssh HOST gpukill ..."
_SERVER = "gpukilld is the service, on the system bus; ask it with gpukillctl (gpukillctl status)"
# gpu-kill's group and GPU policies, as gpukill-policy(5) rules. A condition type is named "type: NAME" and a
# scope "scope: NAME" (tests check that each is one gpukill/condition_types.py declares). No condition names one
# GPU: a per_device rule applies to every GPU, and the messages say so rather than promise a GPU of one's own.
_LOAD = "in a policy file and load it: gpukillctl guard load FILE (gpukill-policy(5))"
_GROUP = ("write a rule with a condition type: group (operator ==, value GROUP) " + _LOAD
          + "; to remove it, delete the rule and load the file again")
_GROUP_MEMBERS = ("group membership is the system's (getent group GROUP; gpasswd -a USER GROUP): a condition "
                  "type: group reads it, primary or supplementary")
_GROUP_MEMORY = ("write a rule with conditions type: group (== GROUP) and type: user_memory, scope: per_user (a "
                 "limit for each member, not the group's total) " + _LOAD)
_GROUP_UTILIZATION = ("write a rule with conditions type: group (== GROUP) and type: gpu_utilization with a "
                      "duration (a limit for each of the members' processes) " + _LOAD)
_GROUP_PROCESSES = ("no condition counts processes; limit each member's memory instead: a rule with conditions "
                    "type: group (== GROUP) and type: user_memory, scope: per_user " + _LOAD)
_GPU = ("write a rule with scope: per_device and conditions type: device_memory, type: gpu_utilization or "
        "type: temperature; it applies to every GPU (no condition picks one) " + _LOAD)
_GPU_MEMORY = ("write a rule with a condition type: device_memory (a size or \"90%\"), scope: per_device; it "
               "applies to every GPU " + _LOAD)
_GPU_UTILIZATION = ("write a rule with a condition type: gpu_utilization with a duration, scope: per_device; it "
                    "applies to every GPU " + _LOAD)
_GPU_RESERVED = ("no memory is held back for anyone; keep headroom with a rule with a condition type: "
                 "device_memory (e.g. > \"90%\"), scope: per_device, on every GPU " + _LOAD)
_GPU_USERS = ("no condition picks one GPU, so a GPU's allowed users cannot be a rule; rules apply on every GPU, "
              "and exemptions: users: [USER, ...] keeps a rule off those users " + _LOAD)
_REGISTER_NODE = ("there is no coordinator: each host runs its own gpukilld; scrape each host with Prometheus "
                  "(gpukillctl exporter) or ask one with gpukillctl -H HOST (e.g. gpukillctl -H HOST list)")

# gpu-kill flags that gpukill does not take, with what to use instead. Refused before parsing, so the message
# names the flag's replacement rather than calling it unknown.
UNSUPPORTED: dict[str, str] = {
    "--server": _SERVER,
    "--server-port": _SERVER,
    "--server-host": _SERVER,
    "--remote": _SSH,
    "--ssh-user": _SSH,
    "--ssh-port": _SSH,
    "--ssh-key": _SSH,
    "--ssh-password": _SSH,
    "--ssh-timeout": _SSH,
    "--vendor": "gpukillctl list (the VENDOR column; \"vendor\" in gpukillctl list --json)",
    "--containers": "gpukillctl list (the UNIT/CONTAINER column is always there)",
    "--log-level": "gpukilld logs to the journal: journalctl -u gpukilld",
    "--config": "gpukilld's settings are /etc/gpukill/gpukilld.conf (see gpukilld.conf(5))",
    "--guard-add-user": _POLICY_FILE,
    "--guard-remove-user": _POLICY_FILE,
    "--guard-memory-limit": _POLICY_FILE,
    "--guard-utilization-limit": _POLICY_FILE,
    "--guard-process-limit": _POLICY_FILE,
    "--guard-export-config": "gpukillctl guard status --json",
    "--guard-import-config": "gpukillctl guard load FILE (a gpukill-policy(5) file, not gpu-kill's JSON)",
    "--guard-toggle-dry-run": "gpukill --guard --guard-dry-run, or --guard-enforce (say which: a toggle "
                              "depends on a state you may not know)",
    "--register-node": _REGISTER_NODE,
    "--guard-add-group": _GROUP,
    "--guard-remove-group": _GROUP,
    "--guard-group-members": _GROUP_MEMBERS,
    "--guard-group-memory-limit": _GROUP_MEMORY,
    "--guard-group-utilization-limit": _GROUP_UTILIZATION,
    "--guard-group-process-limit": _GROUP_PROCESSES,
    "--guard-add-gpu": _GPU,
    "--guard-remove-gpu": _GPU,
    "--guard-gpu-memory-limit": _GPU_MEMORY,
    "--guard-gpu-utilization-limit": _GPU_UTILIZATION,
    "--guard-gpu-reserved-memory": _GPU_RESERVED,
    "--guard-gpu-allowed-users": _GPU_USERS,
}
AUDIT_PREFIXES = ("--audit-", "--rogue-")  # gpu-kill's audit options (--audit-hours, --rogue-config, ...)


class Refused(Exception):
    """Input gpukill will not act on: the problem, what to run instead, the exit status."""

    def __init__(self, problem: str, instead: str, code: int = EXIT_USAGE) -> None:
        super().__init__(f"{problem}; instead: {instead}")
        self.code = code


def audit_refusal(flag: str) -> Refused:
    return Refused(f"{flag} is not supported yet (gpukill keeps no usage history of its own)", AUDIT_INSTEAD,
                   EXIT_NOT_SUPPORTED)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line with what to run instead, not usage + message
        raise Refused(message, "gpukill --help, or gpukillctl --help for every command")


EPILOG = f"""\
Each operation runs the gpukillctl command named in its help, the same way: its output, JSON and exit
statuses are gpukillctl's (see gpukillctl(1) and gpukill(1)). A gpu-kill flag that gpukill does not take, or a
combination whose meaning is not certain, is refused with one line naming what to run instead (exit status 2);
nothing is guessed. --kill --filter or --gpu with --batch that finds no process exits with 5 (--dry-run too);
--audit without --rogue exits with 9.

{EXIT_CODES_HELP}"""


def version() -> str:
    """The installed package's version (what pip and the .deb installed), as `gpukill --version` prints it."""
    try:
        return importlib.metadata.version("gpukill")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


class PrintVersion(argparse.Action):
    """--version: the version is read when asked for, not each time the parser is built."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        print(f"{PROG} {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, allow_abbrev=False,  # `--kil` must not be taken for --kill
               description="gpu-kill's command line, translated to gpukillctl: see, stop and reset GPU "
                           "processes through gpukilld.",
               epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ops = p.add_argument_group("operations (exactly one)")
    ops.add_argument("--list", action="store_true", help="the GPUs and the processes on them (gpukillctl list)")
    ops.add_argument("--kill", action="store_true",
                     help="stop GPU processes: one with --pid, or with --batch every --filter match or every "
                          "process on --gpu (gpukillctl kill)")
    ops.add_argument("--reset", action="store_true",
                     help="reset one GPU (--gpu) or every GPU (--all) (gpukillctl reset)")
    ops.add_argument("--guard", action="store_true",
                     help="Guard Mode: alone, its status (gpukillctl guard status); with one --guard-* option or "
                          "--policy-file, that change")
    ops.add_argument("--audit", action="store_true",
                     help="with --rogue: the rogue-activity audit (gpukillctl audit); alone, not supported yet "
                          "(exit status 9): the audit trail is in the journal, journalctl -t gpukilld")

    ls = p.add_argument_group("with --list")
    ls.add_argument("--details", action="store_true",
                    help="accepted for gpu-kill's sake: the list always has a row per process")
    ls.add_argument("--watch", action="store_true",
                    help=f"refresh the list every {WATCH_INTERVAL:g} seconds until interrupted (Ctrl-C ends it "
                         "with exit status 0); with --output json, one JSON document per line")
    p.add_argument("--output", choices=["table", "json"], default="table",
                   help="json: the stable format of gpukillctl list --json (with --list), or gpukillctl guard "
                        "status/test --json (with --guard alone or --guard-test-policies); table: the default")

    kill = p.add_argument_group("with --kill")
    kill.add_argument("--pid", type=positive_int, metavar="PID", help="the process to stop (gpukillctl kill PID)")
    kill.add_argument("--filter", metavar="REGEX",
                      help="processes whose name matches this RE2 regular expression: alone, lists them and kills "
                           "nothing (gpukillctl list --name-regex REGEX); with --batch, kills them. With --batch "
                           "a pattern that matches the empty string (so every name) is refused")
    kill.add_argument("--batch", action="store_true",
                      help="kill every process --filter matches or --gpu has, one after the other, each by the PID "
                           "and start time listed (the first failure's exit status; the others are still tried)")
    kill.add_argument("--dry-run", "--safe", action="store_true", dest="dry_run",
                      help="preview: list the processes the kill would stop, by PID, and signal none (exit status "
                           "0; 5 when there is none)")
    kill.add_argument("--timeout-secs", type=seconds, metavar="SECONDS",
                      help="wait this long after SIGTERM before --force sends SIGKILL (default 5; gpukillctl kill "
                           "--grace)")
    p.add_argument("--force", action="store_true",
                   help="with --kill: SIGKILL a process that outlives the grace period; with --reset: kill the "
                        "processes on the GPU first")

    reset = p.add_argument_group("with --reset (--gpu: with --kill too)")
    reset.add_argument("--gpu", metavar="GPU",
                       help="the GPU: index as --list shows it, UUID or PCI bus id (gpukillctl reset GPU); with "
                            "--kill, its processes: alone, lists them and kills nothing (gpukillctl list --device "
                            "GPU); with --batch, kills each")
    reset.add_argument("--all", action="store_true",
                       help="every GPU, in index order (the first failure's exit status; the others are still "
                            "tried)")

    guard = p.add_argument_group("with --guard (one at a time)")
    guard.add_argument("--guard-config", action="store_true", help="the status, as --guard alone")
    guard.add_argument("--guard-enable", action="store_true",
                       help="evaluate the policy and act on it (gpukillctl guard enable)")
    guard.add_argument("--guard-disable", action="store_true",
                       help="stop evaluating (gpukillctl guard disable)")
    guard.add_argument("--guard-dry-run", action="store_true",
                       help="evaluate and report, never signal (gpukillctl guard dry-run on)")
    guard.add_argument("--guard-enforce", action="store_true",
                       help="end the dry run: act on the policy (gpukillctl guard dry-run off)")
    guard.add_argument("--guard-test-policies", action="store_true",
                       help="what the policy in force, or --policy-file FILE, would do now; acts on nothing "
                            "(gpukillctl guard test)")
    guard.add_argument("--policy-file", metavar="FILE",
                       help="alone: validate FILE (gpukill-policy(5) format) and make it the policy in force "
                            "(gpukillctl guard load FILE); with --guard-test-policies: test it instead")

    audit = p.add_argument_group("with --audit")
    audit.add_argument("--rogue", action="store_true",
                       help="crypto miners, GPU hogs and idle memory holders, each with its score and evidence "
                            "(gpukillctl audit; --output json: gpukillctl audit --json)")
    p.add_argument("--version", action=PrintVersion,
                   help="print gpukill's version and exit")
    return p


# Options that belong to some operations only: (dest, flag, the operations they go with).
OPTION_OWNERS: list[tuple[str, str, tuple[str, ...]]] = [
    ("details", "--details", ("list",)),
    ("watch", "--watch", ("list",)),
    ("pid", "--pid", ("kill",)),
    ("filter", "--filter", ("kill",)),
    ("batch", "--batch", ("kill",)),
    ("timeout_secs", "--timeout-secs", ("kill",)),
    ("dry_run", "--dry-run (--safe)", ("kill",)),
    ("force", "--force", ("kill", "reset")),
    ("gpu", "--gpu", ("kill", "reset")),
    ("all", "--all", ("reset",)),
    ("guard_config", "--guard-config", ("guard",)),
    ("guard_enable", "--guard-enable", ("guard",)),
    ("guard_disable", "--guard-disable", ("guard",)),
    ("guard_dry_run", "--guard-dry-run", ("guard",)),
    ("guard_enforce", "--guard-enforce", ("guard",)),
    ("guard_test_policies", "--guard-test-policies", ("guard",)),
    ("policy_file", "--policy-file", ("guard",)),
    ("rogue", "--rogue", ("audit",)),
]


def _given(args: argparse.Namespace, dest: str) -> bool:
    value = getattr(args, dest)
    return value not in (None, False)


@dataclass(frozen=True)
class Plan:
    """What an invocation does with a connected client; `endless`: it runs until interrupted (--watch)."""

    run: Callable[[ClientAPI], Awaitable[int]]
    endless: bool = False


def refuse_unsupported(argv: list[str]) -> None:
    """Refuse gpu-kill's flags that gpukill does not take, naming the replacement."""
    for token in argv:
        if token == "--":
            return
        flag = token.split("=", 1)[0]
        if flag in UNSUPPORTED:
            raise Refused(f"gpu-kill's {flag} is not supported", UNSUPPORTED[flag])
        if flag.startswith(AUDIT_PREFIXES):
            raise audit_refusal(flag)


def plan(argv: list[str]) -> Plan:
    """The plan for a gpukill command line; Refused if it is not one gpukill acts on."""
    refuse_unsupported(argv)
    return translate(build_parser().parse_args(argv))


def translate(args: argparse.Namespace) -> Plan:
    ops = [op for op in OPERATIONS if getattr(args, op)]
    if not ops:
        owned = [(flag, owners) for dest, flag, owners in OPTION_OWNERS if _given(args, dest)]
        if owned:  # gpu-kill requires the operation too (`--guard-enable` alone is an error there)
            flag, owners = owned[0]
            raise Refused(f"{flag} without an operation: it is an option of {' or '.join('--' + o for o in owners)}",
                          _equivalent(owners[0], args))
        raise Refused("say what to do: one of --list, --kill, --reset, --guard",
                      "gpukill --help, or gpukillctl --help for every command")
    if len(ops) > 1:
        raise Refused(f"{' and '.join('--' + op for op in ops)} together: one operation at a time",
                      "; ".join(EQUIVALENT[op] for op in ops))
    op = ops[0]
    if op == "audit" and not args.rogue:  # gpu-kill's usage history: gpukill keeps none of its own
        raise audit_refusal("--audit")
    for dest, flag, owners in OPTION_OWNERS:
        if _given(args, dest) and op not in owners:
            raise Refused(f"{flag} is an option of {' or '.join('--' + o for o in owners)}, not of --{op}",
                          _equivalent(op, args))
    if args.output == "json" and op not in ("list", "guard", "audit"):
        raise Refused(f"--output json does not go with --{op}: it prints no JSON", _equivalent(op, args))
    return {"list": _list, "kill": _kill, "reset": _reset, "guard": _guard, "audit": _audit}[op](args)


def _equivalent(op: str, args: argparse.Namespace) -> str:
    if op == "list" and args.filter is not None:
        return f"gpukillctl list --name-regex {shlex.quote(args.filter)}"
    if op == "list" and args.output == "json":
        return "gpukillctl list --json"
    if op == "kill" and args.pid is not None:
        return f"gpukillctl kill {args.pid}"
    if op == "kill" and args.gpu is not None:
        return f"gpukillctl list --device {shlex.quote(args.gpu)}"
    if op == "audit" and args.rogue:
        return "gpukillctl audit"
    if op == "reset" and args.gpu is not None:
        return f"gpukillctl reset {shlex.quote(args.gpu)}"
    switches = [command for dest, _, command in GUARD_SWITCHES if getattr(args, dest)]
    if op == "guard" and len(switches) == 1:
        return guard_equivalent(switches[0], args.policy_file)
    return EQUIVALENT[op]


def kill_args(pid: int, start_time: int | None, force: bool, grace: float | None) -> argparse.Namespace:
    """`gpukillctl kill`'s arguments, parsed by gpukillctl's own parser, so they carry whatever it adds."""
    argv = ["kill", str(pid)]
    if start_time is not None:
        argv += ["--start-time", str(start_time)]
    if force:
        argv.append("--force")
    if grace is not None:
        argv += ["--grace", repr(float(grace))]
    return gpukillctl_parser(full=False).parse_args(argv)  # kill is one-shot: its parser alone


def fail(message: str, code: int) -> int:
    print(f"{PROG}: {shown(message)}", file=sys.stderr)  # daemon messages name processes: escape them
    return code


# -- --audit --rogue ---------------------------------------------------------------------------------------


def _audit(args: argparse.Namespace) -> Plan:
    audit_ns = argparse.Namespace(json=args.output == "json")
    return Plan(lambda client: cmd_audit(client, audit_ns))


# -- --list ------------------------------------------------------------------------------------------------


def list_args(json: bool = False, name_regex: str | None = None, device: str | None = None) -> argparse.Namespace:
    """The arguments of `gpukillctl list [--json] [--name-regex R] [--device GPU]`, as cmd_list reads them."""
    return argparse.Namespace(json=json, device=device, user=None, name=None, name_regex=name_regex,
                              min_memory=None)


def _list(args: argparse.Namespace) -> Plan:
    # gpu-kill's --list is a table of GPUs and --details adds the processes; gpukillctl list always has both.
    list_ns = list_args(json=args.output == "json")
    if args.watch:
        return Plan(lambda client: watch(client, list_ns), endless=True)
    return Plan(lambda client: cmd_list(client, list_ns))


async def sleep(seconds: float) -> None:
    import asyncio  # --watch alone runs on an event loop (run_plan): the one-shot plans do without asyncio

    await asyncio.sleep(seconds)


async def watch(client: ClientAPI, list_ns: argparse.Namespace) -> int:
    """gpukillctl list again and again until interrupted. A failed refresh (gpukilld restarting) is one line on
    stderr, and the next refresh tries again, as gpu-kill's watch does."""
    clear = not list_ns.json and sys.stdout.isatty()
    while True:
        if clear:
            sys.stdout.write(CLEAR_SCREEN)
        try:
            await cmd_list(client, list_ns)
        except ClientError as e:
            fail(str(e), exit_code(e))
        if not list_ns.json and not clear:
            print()  # refreshes one after another in a file or a pipe: a blank line between them
        sys.stdout.flush()
        await sleep(WATCH_INTERVAL)


# -- --kill ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """The processes a --kill without --pid is about: --filter's name pattern, --gpu's GPU, or both (AND), as
    the daemon's ListProcesses filter and as words for messages."""

    pattern: str | None
    gpu: str | None

    def filter(self) -> dict[str, Var]:
        f: dict[str, Var] = {}
        if self.pattern is not None:
            f["name_regex"] = Var("s", self.pattern)
        if self.gpu is not None:
            f["device"] = Var("s", self.gpu)
        return f

    def words(self, one: bool) -> str:
        """" on GPU 0 match '^py'" (one: "... matches ...") for "N process(es)..." and "no GPU process..."."""
        on_gpu = f" on GPU {self.gpu}" if self.gpu is not None else ""
        if self.pattern is None:
            return on_gpu
        return f"{on_gpu} {'matches' if one else 'match'} {self.pattern!r}"

    def gpukillctl_list(self) -> str:
        words = ["gpukillctl", "list"]
        if self.pattern is not None:
            words += ["--name-regex", self.pattern]
        if self.gpu is not None:
            words += ["--device", self.gpu]
        return shlex.join(words)


def _kill(args: argparse.Namespace) -> Plan:
    if args.pid is not None and args.filter is not None:
        raise Refused("--pid and --filter together: stop one PID, or every process --filter matches",
                      f"gpukillctl kill {args.pid}")
    if args.pid is not None and args.gpu is not None:
        raise Refused("--pid and --gpu together: stop one PID, or every process on the GPU",
                      f"gpukillctl kill {args.pid}")
    if args.pid is None and args.filter is None and args.gpu is None:
        raise Refused("--kill needs --pid PID, or --filter REGEX or --gpu GPU with --batch", "gpukillctl kill PID")
    if args.batch and args.pid is not None:
        raise Refused("--batch goes with --filter or --gpu (it kills every match), not with --pid",
                      f"gpukillctl kill {args.pid}")
    if args.pid is not None:
        if args.dry_run:
            return Plan(lambda client: preview_pid(client, args.pid, args.force, args.timeout_secs))
        kill_ns = kill_args(args.pid, None, args.force, args.timeout_secs)
        return Plan(lambda client: cmd_kill(client, kill_ns))
    selection = Selection(args.filter, args.gpu)
    if not args.batch:
        # gpu-kill's --filter without --batch lists the matches and kills nothing: so does gpukill, and --gpu too.
        if args.force or args.timeout_secs is not None:
            stray = "--force" if args.force else "--timeout-secs"
            raise Refused(f"{stray} without --batch: --kill {'--filter' if args.filter is not None else '--gpu'} "
                          "alone only lists the matches", selection.gpukillctl_list())
        return Plan(lambda client: preview(client, selection))
    if args.filter is not None:
        _check_batch_pattern(args.filter)
    if args.dry_run:
        return Plan(lambda client: preview_batch(client, selection, args.force, args.timeout_secs))
    return Plan(lambda client: kill_matching(client, selection, args.force, args.timeout_secs))


def _check_batch_pattern(pattern: str) -> None:
    """A pattern that matches the empty string matches every name (the daemon searches the name, as gpu-kill
    does): "", ".*", "x*", "a|". Killing every GPU process is a different request from killing some by name,
    and a pattern like that is usually a slip, so it is refused rather than taken literally."""
    try:
        matches_nothing_too = compile_regex(pattern).search("") is not None
    except RegexError as e:
        raise Refused(f"--filter: {e}", "gpukillctl list --name-regex REGEX to try a pattern") from None
    if matches_nothing_too:
        raise Refused(f"--filter {shlex.quote(pattern)} matches the empty string, so every process name: "
                      "refused with --batch", "name the processes, e.g. --filter '^python3$'; or gpukillctl list, "
                      "then gpukillctl kill PID for each")


async def preview(client: ClientAPI, selection: Selection) -> int:
    code = await cmd_list(client, list_args(name_regex=selection.pattern, device=selection.gpu))
    print(f"{PROG}: nothing was killed: add --batch to kill the processes listed", file=sys.stderr)
    return code


def _how(force: bool, grace: float | None) -> str:
    if not force:
        return "SIGTERM"
    return f"SIGTERM, then SIGKILL if alive after {'the grace period' if grace is None else f'{grace:g}s'}"


async def targets_of(client: ClientAPI, selection: Selection) -> list:
    procs = await client.list_processes(selection.filter())
    return list({(p.pid, p.start_time): p for p in procs}.values())  # one process on two GPUs: once


def _matched(selection: Selection, targets: list) -> str:
    return shown(f"{len(targets)} process(es){selection.words(one=False)}: "
                 + ", ".join(f"{p.pid} ({p.comm})" for p in targets))


async def kill_matching(client: ClientAPI, selection: Selection, force: bool, grace: float | None) -> int:
    """gpukillctl kill for every process the daemon lists as selected, each by the (PID, start time) listed, so
    a PID reused since the listing is refused, not killed. Every one is tried; the first failure's status."""
    targets = await targets_of(client, selection)
    if not targets:
        return fail(f"no GPU process{selection.words(one=True)}; nothing was killed", EXIT_NOT_FOUND)
    print(_matched(selection, targets))
    first_failure = EXIT_OK
    for p in targets:
        kill_ns = kill_args(p.pid, p.start_time, force, grace)
        try:
            code = await cmd_kill(client, kill_ns)
        except ClientError as e:
            code = fail(f"PID {p.pid} ({p.comm}): {e}", exit_code(e))
        first_failure = first_failure or code
    return first_failure


# --dry-run / --safe: the same listing and decisions as the kill, and no Kill call. What polkit would decide is
# not previewed: asking it is the kill itself.


async def preview_batch(client: ClientAPI, selection: Selection, force: bool, grace: float | None) -> int:
    targets = await targets_of(client, selection)
    if not targets:
        return fail(f"no GPU process{selection.words(one=True)}; nothing would be killed", EXIT_NOT_FOUND)
    print(_matched(selection, targets))
    for p in targets:
        print(shown(f"would kill PID {p.pid} ({p.comm}), start time {p.start_time}: {_how(force, grace)}"))
    print(f"{PROG}: dry run: nothing was killed (polkit decides at the kill)", file=sys.stderr)
    return EXIT_OK


async def preview_pid(client: ClientAPI, pid: int, force: bool, grace: float | None) -> int:
    listed = next((p for p in await client.list_processes() if p.pid == pid), None)
    if listed is None:
        return fail(f"PID {pid} is not a GPU process gpukilld lists: the kill would be refused; nothing was killed",
                    EXIT_NOT_FOUND)
    print(shown(f"would kill PID {pid} ({listed.comm}), start time {listed.start_time}: {_how(force, grace)}"))
    print(f"{PROG}: dry run: nothing was killed (polkit decides at the kill)", file=sys.stderr)
    return EXIT_OK


# -- --reset -----------------------------------------------------------------------------------------------


def _reset(args: argparse.Namespace) -> Plan:
    if args.gpu is None and not args.all:
        raise Refused("--reset needs --gpu GPU or --all", "gpukillctl reset GPU")
    if args.gpu is not None and args.all:
        raise Refused("--gpu and --all together: reset one GPU, or every GPU", _equivalent("reset", args))
    if args.gpu is not None:
        reset_ns = argparse.Namespace(device=args.gpu, force=args.force)
        return Plan(lambda client: cmd_reset(client, reset_ns))
    return Plan(lambda client: reset_all(client, args.force))


async def reset_all(client: ClientAPI, force: bool) -> int:
    """gpukillctl reset for every GPU in index order. Each is tried (GPUs are independent, and the daemon
    refuses a busy one without --force before touching it); the first failure's status."""
    devices = await client.list_devices()
    if not devices:
        return fail("no GPUs", EXIT_NOT_FOUND)
    first_failure = EXIT_OK
    for d in devices:
        try:
            code = await cmd_reset(client, argparse.Namespace(device=str(d.index), force=force))
        except ClientError as e:
            code = fail(f"GPU {d.index}: {e}", exit_code(e))
        first_failure = first_failure or code
    return first_failure


# -- --guard -----------------------------------------------------------------------------------------------

# The --guard-* switches, each as the gpukillctl guard command it is (arguments as cmd_guard reads them).
GUARD_SWITCHES: list[tuple[str, str, dict]] = [
    ("guard_config", "--guard-config", {"guard_command": "status"}),
    ("guard_enable", "--guard-enable", {"guard_command": "enable"}),
    ("guard_disable", "--guard-disable", {"guard_command": "disable"}),
    ("guard_dry_run", "--guard-dry-run", {"guard_command": "dry-run", "state": "on"}),
    ("guard_enforce", "--guard-enforce", {"guard_command": "dry-run", "state": "off"}),
    ("guard_test_policies", "--guard-test-policies", {"guard_command": "test"}),
]


def guard_equivalent(command: dict, policy_file: str | None = None) -> str:
    words = ["gpukillctl", "guard", command["guard_command"]]
    if "state" in command:
        words.append(command["state"])
    if policy_file is not None and command["guard_command"] == "test":
        words += ["--policy", policy_file]
    if policy_file is not None and command["guard_command"] == "load":
        words.append(policy_file)
    return shlex.join(words)


def _guard(args: argparse.Namespace) -> Plan:
    chosen = [(flag, command) for dest, flag, command in GUARD_SWITCHES if getattr(args, dest)]
    if len(chosen) > 1:
        # gpu-kill did them all in its own order (enable before dry-run: enforcing for a moment): say the order.
        raise Refused(f"{' and '.join(flag for flag, _ in chosen)} together: one Guard change at a time, in the "
                      "order you mean", "; ".join(guard_equivalent(command) for _, command in chosen))
    flag, command = chosen[0] if chosen else ("--guard", {"guard_command": "status"})
    if args.policy_file is not None:
        if not chosen:
            flag, command = "--policy-file", {"guard_command": "load", "file": args.policy_file}
        elif command["guard_command"] != "test":
            raise Refused(f"--policy-file with {flag}: loading a policy and {flag} are two changes",
                          f"{guard_equivalent({'guard_command': 'load'}, args.policy_file)}; "
                          f"then {guard_equivalent(command)}")
    json_out = args.output == "json"
    if json_out and command["guard_command"] not in ("status", "test"):
        raise Refused(f"--output json does not go with {flag}: it prints no JSON",
                      guard_equivalent(command, args.policy_file))
    guard_ns = argparse.Namespace(**command, json=json_out, policy=args.policy_file)
    return Plan(lambda client: cmd_guard(client, guard_ns))


# -- running -----------------------------------------------------------------------------------------------


def run_plan(p: Plan) -> int:
    """A one-shot plan on the blocking transport; --watch (endless, it sleeps between refreshes) on asyncio."""
    if not p.endless:
        from .blocking_client import BlockingClient, finish

        blocking = BlockingClient.connect()
        try:
            return finish(p.run(blocking))
        finally:
            blocking.close()
    import asyncio

    from .client import GpukillClient

    async def run() -> int:
        client = await GpukillClient.connect()
        try:
            return await p.run(client)
        finally:
            client.close()

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    try:
        p = plan(sys.argv[1:] if argv is None else argv)
    except Refused as e:
        return fail(str(e), e.code)
    try:
        return run_plan(p)
    except ClientError as e:
        return fail(str(e), exit_code(e))
    except KeyboardInterrupt:
        return EXIT_OK if p.endless else 130  # Ctrl-C is how --watch ends
    except BrokenPipeError:  # `gpukill --list --watch | head`: the reader is done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return EXIT_OK
    except Exception as e:  # a bug must still end in one line, not a traceback
        return fail(f"internal error: {type(e).__name__}: {e}", EXIT_FAILURE)


if __name__ == "__main__":
    sys.exit(main())

