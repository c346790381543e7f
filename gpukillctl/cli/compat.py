"""gpukill: gpu-kill's command line for admins who know it, translated to the calls gpukillctl makes.

Each invocation becomes a gpukillctl command (or a sequence of them: `--reset --all`, `--kill --filter
--batch`, several `--rogue-*` settings) run by gpukillctl's own command functions on the same client (with
--remote, that host's, as `gpukillctl -H`), so output, JSON and exit statuses are gpukillctl's and polkit
decides as it does for gpukillctl; `--server` is `gpukillctl serve`, run by gpukillctl. A flag gpukill does not
take, or a combination whose meaning is not certain, is refused with one line naming what to run instead (exit
2): a tool that kills processes must not guess. tests/test_gpukill_flags.py runs every gpu-kill flag and example
(tests/data/gpu-kill/) through it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shlex
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from gpukill.regex import RegexError

from ..client.api import ClientAPI, ClientError, Var
from ..client.batch import MatchesEveryName, check_batch_pattern, once_per_process
from ..client.exits import (
    EXIT_CODES_HELP,
    EXIT_FAILURE,
    EXIT_NO_SUCH_NAME,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    exit_code,
)
from ..client.format import shown
from ..client.ports import port_number
from .audit import GPU_KILL_THRESHOLDS, gpu_kill_threshold
from .gpu_kill_files import guard_import, read_file, rogue_import
from .guard import cmd_guard
from .main import COMMANDS, cmd_kill, cmd_list, cmd_reset, seconds
from .main import build_parser as gpukillctl_parser
from .pids import pid_number

PROG = "gpukill"
WATCH_INTERVAL = 2.0  # seconds between --watch refreshes: gpu-kill's default
CLEAR_SCREEN = "\x1b[H\x1b[2J"
OPERATIONS = ("list", "kill", "reset", "guard", "audit", "server")

# What each operation is in gpukillctl, for messages that name the command to run instead.
EQUIVALENT = {
    "list": "gpukillctl list",
    "kill": "gpukillctl kill PID",
    "reset": "gpukillctl reset GPU",
    "guard": "gpukillctl guard status",
    "audit": "gpukillctl audit",
    "server": "gpukillctl serve",
}

_REGISTER_NODE = (
    "there is no coordinator: each host runs its own gpukilld; scrape each host with Prometheus "
    "(gpukillctl exporter), or ask one: gpukillctl -H HOST list"
)
# ssh settings gpukillctl -H cannot pass: ssh reads them from the user's ssh configuration, where they belong
# (-H passes no ssh options of its own; a password on a command line is readable by every user in ps).
_SSH_CONFIG = "under Host HOST in ~/.ssh/config, then gpukillctl -H HOST list (ssh reads it there)"

# gpu-kill flags that gpukill does not take, with what to use instead. Refused before parsing, so the message
# names the flag's replacement rather than calling it unknown.
UNSUPPORTED: dict[str, str] = {
    "--log-level": "gpukilld logs to the journal: journalctl -u gpukilld; its state: gpukillctl status",
    "--config": "gpukilld's settings are /etc/gpukill/gpukilld.conf (see gpukilld.conf(5)); its state: "
    "gpukillctl status",
    "--register-node": _REGISTER_NODE,
    "--ssh-key": "put IdentityFile KEY " + _SSH_CONFIG,
    "--ssh-timeout": "put ConnectTimeout SECONDS " + _SSH_CONFIG,
    "--ssh-password": "ssh asks for the password itself: gpukillctl -H HOST list, and type it at ssh's prompt "
    "(or use a key); a password on the command line is visible to every user in ps",
}

# gpu-kill's usage audit (--audit alone or with --audit-*) is gpukillctl usage, gpukilld's accounting: each flag
# the option of gpukillctl usage that means the same (usage_argvs).
USAGE_DESTS = ("audit_user", "audit_process", "audit_hours", "audit_summary")
GPU_KILL_AUDIT_HOURS = 24  # gpu-kill's --audit-hours default: gpukillctl usage's own default range too


class Refused(Exception):
    """Input gpukill will not act on: the problem, what to run instead, the exit status."""

    def __init__(self, problem: str, instead: str, code: int = EXIT_USAGE) -> None:
        super().__init__(f"{problem}; instead: {instead}")
        self.code = code


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line with what to run instead, not usage + message
        raise Refused(message, "gpukill --help, or gpukillctl --help for every command")


EPILOG = f"""\
Each operation runs the gpukillctl command named in its help, the same way: its output, JSON and exit
statuses are gpukillctl's (see gpukillctl(1) and gpukill(1)). A gpu-kill flag that gpukill does not take, or a
combination whose meaning is not certain, is refused with one line naming what to run instead (exit status 2);
nothing is guessed. --kill --filter or --gpu with --batch that finds no process exits with 5 (--dry-run too);
with 15 where --gpu names no GPU, as gpukillctl does for a user, group, unit or GPU that does not exist.
gpu-kill's usage audit (--audit alone, --audit-user, --audit-process, --audit-hours, --audit-summary) is
gpukillctl usage: gpukilld's accounting of every GPU process.

{EXIT_CODES_HELP}"""


# gpu-kill's defaults for a limit its --guard-add-* is not given (src/main.rs), in its units: GB (GiB: it divides
# NVML's bytes by 1024 three times, src/nvml_api.rs and src/guard_mode.rs), percent, processes. gpukill does not
# fill them in: a limit here is a kill after the grace, and none is made that the admin did not name. A
# --guard-add-* with no limit at all is refused, naming the command with gpu-kill's defaults.
GIB = 1 << 30
POLICY_DEFAULTS: dict[str, dict[str, str]] = {
    "user": {"memory_limit": "16", "utilization_limit": "80", "process_limit": "5"},
    "group": {"memory_limit": "32", "utilization_limit": "80", "process_limit": "10"},
    "gpu": {"memory_limit": "24", "utilization_limit": "90", "reserved_memory": "2"},
}
# Which --guard-* limit sets which setting, for each kind.
POLICY_LIMITS: dict[str, dict[str, str]] = {
    "user": {
        "guard_memory_limit": "memory_limit",
        "guard_utilization_limit": "utilization_limit",
        "guard_process_limit": "process_limit",
    },
    "group": {
        "guard_group_memory_limit": "memory_limit",
        "guard_group_utilization_limit": "utilization_limit",
        "guard_group_process_limit": "process_limit",
    },
    "gpu": {
        "guard_gpu_memory_limit": "memory_limit",
        "guard_gpu_utilization_limit": "utilization_limit",
        "guard_gpu_reserved_memory": "reserved_memory",
        "guard_gpu_allowed_users": "allowed_users",
    },
}
SIZE_SETTINGS = ("memory_limit", "reserved_memory")
# gpukillctl guard policy add's option for each setting
SETTING_OPTIONS = {
    "memory_limit": "--memory-limit",
    "utilization_limit": "--utilization-limit",
    "process_limit": "--process-limit",
    "reserved_memory": "--reserved-memory",
    "allowed_users": "--allowed-users",
}


def _help_defaults(kind: str) -> str:
    return _defaults(kind).replace("%", "%%")  # argparse formats help with %


def _defaults(kind: str) -> str:
    words = {
        "memory_limit": "{}GB memory",
        "utilization_limit": "{}% utilization",
        "process_limit": "{} processes",
        "reserved_memory": "{}GB reserved",
    }
    return ", ".join(words[k].format(v) for k, v in POLICY_DEFAULTS[kind].items())


# gpu-kill's rogue thresholds that mean what an audit setting means (gpukillctl audit's table, one for both):
# flag -> the setting. The others are refused (UNSUPPORTED) with the reason and nearest setting that table gives.
ROGUE_THRESHOLDS: dict[str, str] = {flag: key for flag, (key, _) in GPU_KILL_THRESHOLDS.items() if key is not None}
UNSUPPORTED.update({flag: str(why) for flag, (key, why) in GPU_KILL_THRESHOLDS.items() if key is None})


def _number(text: str, what: str, low: float, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not low <= value <= high:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"{what} must be between {low:g} and {high:g}, not {text}")
    return value


def hours(text: str) -> float:
    """gpu-kill's --audit-hours: a number of hours, more than 0 and at most a century."""
    value = _number(text, "a number of hours", 0, 100 * 365 * 24)  # gpukillctl usage goes back a century
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a number of hours must be more than 0, not {text}")
    return value


def gigabytes(text: str) -> int:
    """gpu-kill's GB (a bare number is GiB, as gpu-kill documents) as bytes, exactly: "1.5" is 1610612736; a
    size with a unit (512MiB) in gpukill.units' grammar too. A limit: under 1 MiB only in B or KiB."""
    from gpukill.units import parse_size

    try:
        return parse_size(text, bare=GIB, limit=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def percent(text: str) -> float:
    return _number(text, "a percentage", 0, 100)


def count(text: str) -> int:
    if not text.isdigit() or int(text) >= 1 << 32:
        raise argparse.ArgumentTypeError(f"not a number of processes: {text!r}")
    return int(text)


def gpu_index(text: str) -> str:
    if not text.isdigit() or int(text) >= 1 << 16:
        raise argparse.ArgumentTypeError(f"not a GPU index: {text!r} (the GPU column of --list)")
    return str(int(text))


def user_list(text: str) -> tuple[str, ...]:
    """gpu-kill's comma-separated names, blanks dropped as it drops them."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def vendor_name(text: str) -> str:
    if not text or not all(c.isascii() and (c.isalnum() or c == "-") for c in text):
        raise argparse.ArgumentTypeError(f"not a vendor: {text!r} (nvidia, amd, intel, apple, all)")
    return text.lower()


def _threshold_type(flag: str) -> Callable[[str], str]:
    """gpu-kill's threshold as typed (a confidence: 0 to 1), converted by gpukillctl audit's table when used."""

    def threshold(text: str) -> str:
        if flag == "--rogue-confidence-threshold":
            _number(text, "a confidence", 0, 1)
        else:
            _number(text, "a threshold", 0, float("inf"))
        return text

    return threshold


def number_text(value: float) -> str:
    """A number as short as it reads ("80", "12.5") where that is the same number, else all its digits."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


def gib_text(size: int) -> str:
    """Bytes as gpukillctl's sizes read them, in GiB where exact ("8GiB", "1.5GiB"), else exact_size's form."""
    from fractions import Fraction

    from gpukill.units import exact_size

    gib = Fraction(size, GIB)
    text = f"{float(gib):.10g}"
    return f"{text}GiB" if "e" not in text and Fraction(text) == gib else exact_size(size)


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

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> NoReturn:
        print(f"{PROG} {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG,
        allow_abbrev=False,  # `--kil` must not be taken for --kill
        description="gpu-kill's command line, translated to gpukillctl: see, stop and reset GPU "
        "processes through gpukilld.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ops = p.add_argument_group("operations (exactly one)")
    ops.add_argument("--list", action="store_true", help="the GPUs and the processes on them (gpukillctl list)")
    ops.add_argument(
        "--kill",
        action="store_true",
        help="stop GPU processes: one with --pid, or with --batch every --filter match or every "
        "process on --gpu (gpukillctl kill)",
    )
    ops.add_argument(
        "--reset", action="store_true", help="reset one GPU (--gpu) or every GPU (--all) (gpukillctl reset)"
    )
    ops.add_argument(
        "--guard",
        action="store_true",
        help="Guard Mode: alone, its status (gpukillctl guard status); with one --guard-* option or "
        "--policy-file, that change",
    )
    ops.add_argument(
        "--audit",
        action="store_true",
        help="with --rogue: the rogue-activity audit (gpukillctl audit); with a --rogue-* setting, "
        "that change (gpukillctl audit settings); alone or with --audit-*, gpu-kill's usage "
        "audit: GPU use per process over the last 24 hours (gpukillctl usage --by process)",
    )
    ops.add_argument(
        "--server",
        action="store_true",
        help="the web dashboard, the REST API and MCP over HTTP, as you (gpukillctl serve): on its "
        "Unix socket, or with --server-port or --open on TCP on loopback",
    )

    ls = p.add_argument_group("with --list")
    ls.add_argument(
        "--details", action="store_true", help="accepted for gpu-kill's sake: the list always has a row per process"
    )
    ls.add_argument(
        "--watch",
        action="store_true",
        help=f"refresh the list every {WATCH_INTERVAL:g} seconds until interrupted (Ctrl-C ends it "
        "with exit status 0); with --output json, one JSON document per line",
    )
    ls.add_argument(
        "--vendor",
        type=vendor_name,
        metavar="VENDOR",
        help="only that vendor's GPUs and the processes on them: nvidia, amd, intel, apple (or any "
        "vendor gpukillctl list shows), all for every GPU",
    )
    ls.add_argument(
        "--containers",
        action="store_true",
        help="accepted for gpu-kill's sake: the list always shows each process's container, pod, "
        "Slurm job or unit (UNIT/CONTAINER; container_id, pod_uid in --output json)",
    )
    p.add_argument(
        "--output",
        choices=["table", "json"],
        default="table",
        help="json: the stable format of gpukillctl list --json (with --list), or gpukillctl guard "
        "status/test --json (with --guard alone or --guard-test-policies); table: the default",
    )

    kill = p.add_argument_group("with --kill")
    kill.add_argument("--pid", type=pid_number, metavar="PID", help="the process to stop (gpukillctl kill PID)")
    kill.add_argument(
        "--filter",
        metavar="REGEX",
        help="processes whose name matches this RE2 regular expression: alone, lists them and kills "
        "nothing (gpukillctl list --name-regex REGEX); with --batch, kills them. With --batch "
        "a pattern that matches the empty string (so every name) is refused",
    )
    kill.add_argument(
        "--batch",
        action="store_true",
        help="kill every process --filter matches or --gpu has, one after the other, each by the PID "
        "and start time listed (the first failure's exit status; the others are still tried)",
    )
    kill.add_argument(
        "--dry-run",
        "--safe",
        action="store_true",
        dest="dry_run",
        help="preview: list the processes the kill would stop, by PID, and signal none (exit status "
        "0; 5 when there is none)",
    )
    kill.add_argument(
        "--timeout-secs",
        type=seconds,
        metavar="SECONDS",
        help="wait this long after SIGTERM before --force sends SIGKILL (default 5; gpukillctl kill --grace)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --kill: SIGKILL a process that outlives the grace period; with --reset: kill the "
        "processes on the GPU first",
    )

    reset = p.add_argument_group("with --reset (--gpu: with --kill too)")
    reset.add_argument(
        "--gpu",
        metavar="GPU",
        help="the GPU: index as --list shows it, UUID or PCI bus id (gpukillctl reset GPU); with "
        "--kill, its processes: alone, lists them and kills nothing (gpukillctl list --device "
        "GPU); with --batch, kills each",
    )
    reset.add_argument(
        "--all",
        action="store_true",
        help="every GPU, in index order (the first failure's exit status; the others are still tried)",
    )

    guard = p.add_argument_group("with --guard (one at a time)")
    guard.add_argument("--guard-config", action="store_true", help="the status, as --guard alone")
    guard.add_argument(
        "--guard-enable", action="store_true", help="evaluate the policy and act on it (gpukillctl guard enable)"
    )
    guard.add_argument("--guard-disable", action="store_true", help="stop evaluating (gpukillctl guard disable)")
    guard.add_argument(
        "--guard-dry-run", action="store_true", help="evaluate and report, never signal (gpukillctl guard dry-run on)"
    )
    guard.add_argument(
        "--guard-enforce", action="store_true", help="end the dry run: act on the policy (gpukillctl guard dry-run off)"
    )
    guard.add_argument(
        "--guard-test-policies",
        action="store_true",
        help="what the policy in force, or --policy-file FILE, would do now; acts on nothing (gpukillctl guard test)",
    )
    guard.add_argument(
        "--policy-file",
        metavar="FILE",
        help="alone: validate FILE (gpukill-policy(5) format) and make it the policy in force "
        "(gpukillctl guard load FILE); with --guard-test-policies: test it instead",
    )

    managed = p.add_argument_group(
        "with --guard: user, group and GPU policies (gpukillctl guard policy; sizes in GB as gpu-kill's are GiB, "
        "2^30 bytes; only the limits given are set: gpu-kill filled in defaults, gpukill makes no limit you did not "
        "name)"
    )
    managed.add_argument(
        "--guard-add-user",
        metavar="USER",
        help="create or replace USER's policy with the limits given (gpukillctl guard policy add "
        f"user USER); gpu-kill's defaults were {_help_defaults('user')}",
    )
    managed.add_argument(
        "--guard-remove-user", metavar="USER", help="remove USER's policy (gpukillctl guard policy remove user USER)"
    )
    managed.add_argument(
        "--guard-memory-limit",
        type=gigabytes,
        metavar="GB",
        help="with --guard-add-user: the user's GPU memory, summed over their processes",
    )
    managed.add_argument(
        "--guard-utilization-limit",
        type=percent,
        metavar="PERCENT",
        help="with --guard-add-user: the user's GPU utilization",
    )
    managed.add_argument(
        "--guard-process-limit",
        type=count,
        metavar="COUNT",
        help="with --guard-add-user: the user's GPU processes at once",
    )
    managed.add_argument(
        "--guard-add-group",
        metavar="GROUP",
        help="create or replace the policy of GROUP, a system group (gpukillctl guard policy add "
        f"group GROUP), with the limits given; gpu-kill's defaults were {_help_defaults('group')}",
    )
    managed.add_argument(
        "--guard-remove-group",
        metavar="GROUP",
        help="remove GROUP's policy (gpukillctl guard policy remove group GROUP)",
    )
    managed.add_argument(
        "--guard-group-memory-limit",
        type=gigabytes,
        metavar="GB",
        help="with --guard-add-group: the members' GPU memory, summed",
    )
    managed.add_argument(
        "--guard-group-utilization-limit",
        type=percent,
        metavar="PERCENT",
        help="with --guard-add-group: the members' GPU utilization",
    )
    managed.add_argument(
        "--guard-group-process-limit",
        type=count,
        metavar="COUNT",
        help="with --guard-add-group: the members' GPU processes at once",
    )
    managed.add_argument(
        "--guard-group-members",
        type=user_list,
        metavar="MEMBERS",
        help="refused, naming the commands to run: a group's members are the system's "
        "(gpasswd -a USER GROUP), as gpukilld reads them",
    )
    managed.add_argument(
        "--guard-add-gpu",
        type=gpu_index,
        metavar="GPU_INDEX",
        help="create or replace the policy of that GPU with the limits given (gpukillctl guard "
        f"policy add gpu INDEX); gpu-kill's defaults were {_help_defaults('gpu')}",
    )
    managed.add_argument(
        "--guard-remove-gpu",
        type=gpu_index,
        metavar="GPU_INDEX",
        help="remove that GPU's policy (gpukillctl guard policy remove gpu INDEX)",
    )
    managed.add_argument(
        "--guard-gpu-memory-limit",
        type=gigabytes,
        metavar="GB",
        help="with --guard-add-gpu: the device's memory in use",
    )
    managed.add_argument(
        "--guard-gpu-utilization-limit",
        type=percent,
        metavar="PERCENT",
        help="with --guard-add-gpu: the device's utilization",
    )
    managed.add_argument(
        "--guard-gpu-reserved-memory",
        type=gigabytes,
        metavar="GB",
        help="with --guard-add-gpu: memory kept free on the device",
    )
    managed.add_argument(
        "--guard-gpu-allowed-users",
        type=user_list,
        metavar="USERS",
        help="with --guard-add-gpu: only these users (comma-separated) may hold the GPU",
    )
    managed.add_argument(
        "--guard-export-config",
        action="store_true",
        help="print every user, group and GPU policy (gpukillctl guard policy export): gpukill's "
        "YAML, not gpu-kill's JSON",
    )
    managed.add_argument(
        "--guard-import-config",
        metavar="FILE",
        help="make FILE's policies the user, group and GPU policies, replacing the others, as "
        "gpu-kill's import does (gpukillctl guard policy import FILE --replace)",
    )
    managed.add_argument(
        "--guard-toggle-dry-run",
        action="store_true",
        help="turn the dry run off if it is on, on if off (gpukillctl guard status, then "
        "gpukillctl guard dry-run on|off), and say which",
    )

    audit = p.add_argument_group("with --audit")
    audit.add_argument("--audit-user", metavar="USER", help="only USER's GPU use (gpukillctl usage --user USER)")
    audit.add_argument(
        "--audit-process", metavar="NAME", help="only processes whose name contains NAME (gpukillctl usage --name NAME)"
    )
    audit.add_argument(
        "--audit-hours",
        type=hours,
        metavar="HOURS",
        help=f"over the last HOURS hours (gpukillctl usage --since HOURSh; default {GPU_KILL_AUDIT_HOURS})",
    )
    audit.add_argument(
        "--audit-summary",
        action="store_true",
        help="the top users and the top processes (gpukillctl usage --by user, then --by process)",
    )
    audit.add_argument(
        "--rogue",
        action="store_true",
        help="crypto miners, GPU hogs and idle memory holders, each with its score and evidence "
        "(gpukillctl audit; --output json: gpukillctl audit --json); with a --rogue-*-threshold, "
        "that threshold for this scan only",
    )
    audit.add_argument(
        "--rogue-config",
        action="store_true",
        help="the audit's settings (gpukillctl audit settings show; --output json: --json)",
    )
    for flag, key in ROGUE_THRESHOLDS.items():
        audit.add_argument(
            flag,
            type=_threshold_type(flag),
            metavar="VALUE",
            help=f"keep gpu-kill's threshold as the audit setting {key} (gpukillctl audit settings "
            f"set {key}=...; a confidence 0 to 1 is a score 0 to 100); with --rogue, for this "
            "scan only (gpukillctl audit --min-score ...)",
        )
    audit.add_argument(
        "--rogue-whitelist-process",
        metavar="PATH",
        help="never report the processes running the executable at PATH (gpukillctl audit settings "
        "allow-process PATH); a name, as gpu-kill took, is refused: a process chooses its name",
    )
    audit.add_argument(
        "--rogue-unwhitelist-process",
        metavar="PATH",
        help="report them again (gpukillctl audit settings disallow-process PATH)",
    )
    audit.add_argument(
        "--rogue-whitelist-user",
        metavar="USER",
        help="never report USER's processes (gpukillctl audit settings allow-user USER)",
    )
    audit.add_argument(
        "--rogue-unwhitelist-user",
        metavar="USER",
        help="report USER's processes again (gpukillctl audit settings disallow-user USER)",
    )
    audit.add_argument(
        "--rogue-export-config",
        action="store_true",
        help="print the audit's settings (gpukillctl audit settings export): an [audit] section, not gpu-kill's JSON",
    )
    audit.add_argument(
        "--rogue-import-config",
        metavar="FILE",
        help="make FILE's [audit] section the audit's settings (gpukillctl audit settings import FILE)",
    )

    server = p.add_argument_group("with --server")
    server.add_argument(
        "--server-port",
        type=port_number,
        metavar="PORT",
        help="listen on TCP PORT instead of the Unix socket (gpukillctl serve --tcp HOST:PORT; "
        "HOST 127.0.0.1 unless --server-host)",
    )
    server.add_argument(
        "--open",
        action="store_true",
        help="open the dashboard in your browser, logged in by a one-time link (gpukillctl serve "
        "--tcp 127.0.0.1:8080 --open; the port: --server-port)",
    )
    server.add_argument(
        "--server-host",
        metavar="HOST",
        help="with a loopback address (127.0.0.1, ::1, localhost): listen there, on --server-port "
        "or 8080; another address is refused (gpukillctl serve needs --token-file off "
        "loopback, which gpu-kill has no flag for)",
    )

    remote = p.add_argument_group("on another host")
    remote.add_argument(
        "--remote",
        metavar="HOST",
        help="act on HOST's gpukilld over ssh (gpukillctl -H HOST): the host's polkit judges the "
        "ssh user and its journal records what is done",
    )
    remote.add_argument("--ssh-user", metavar="USER", help="log in as USER (gpukillctl -H USER@HOST)")
    remote.add_argument("--ssh-port", type=port_number, metavar="PORT", help="ssh to PORT (gpukillctl -H HOST:PORT)")
    p.add_argument("--version", action=PrintVersion, help="print gpukill's version and exit")
    return p


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


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
    *[(dest, _flag(dest), ("audit",)) for dest in USAGE_DESTS],
    ("vendor", "--vendor", ("list",)),
    ("containers", "--containers", ("list",)),
    *[
        (flag[2:].replace("-", "_"), flag, ("guard",))
        for flag in (
            "--guard-add-user",
            "--guard-remove-user",
            "--guard-memory-limit",
            "--guard-utilization-limit",
            "--guard-process-limit",
            "--guard-add-group",
            "--guard-remove-group",
            "--guard-group-memory-limit",
            "--guard-group-utilization-limit",
            "--guard-group-process-limit",
            "--guard-group-members",
            "--guard-add-gpu",
            "--guard-remove-gpu",
            "--guard-gpu-memory-limit",
            "--guard-gpu-utilization-limit",
            "--guard-gpu-reserved-memory",
            "--guard-gpu-allowed-users",
            "--guard-export-config",
            "--guard-import-config",
            "--guard-toggle-dry-run",
        )
    ],
    *[
        (flag[2:].replace("-", "_"), flag, ("audit",))
        for flag in (
            "--rogue-config",
            *ROGUE_THRESHOLDS,
            "--rogue-whitelist-process",
            "--rogue-unwhitelist-process",
            "--rogue-whitelist-user",
            "--rogue-unwhitelist-user",
            "--rogue-export-config",
            "--rogue-import-config",
        )
    ],
    ("server_port", "--server-port", ("server",)),
    ("server_host", "--server-host", ("server",)),
    ("open", "--open", ("server",)),
]


def _given(args: argparse.Namespace, dest: str) -> bool:
    value = getattr(args, dest)
    return value not in (None, False)


@dataclass(frozen=True)
class Plan:
    """What an invocation does with a connected client; `endless`: it runs until interrupted (--watch); `host`:
    the client is that host's gpukilld over ssh (--remote). A plan with `gpukillctl` instead of `run` is a
    gpukillctl command that runs on its own (serve): run as it is, by gpukillctl."""

    run: Callable[[ClientAPI], Coroutine[Any, Any, int]] | None
    endless: bool = False
    host: str | None = None
    gpukillctl: tuple[str, ...] = ()
    note: str | None = None  # said on stderr first: where gpukill's answer differs from gpu-kill's
    commands: tuple[str, ...] = ()  # the gpukillctl command lines a plan of gpukillctl commands runs


def refuse_unsupported(argv: list[str]) -> None:
    """Refuse gpu-kill's flags that gpukill does not take, naming the replacement."""
    words = iter(argv)
    for token in words:
        if token == "--":
            return
        flag = token.split("=", 1)[0]
        if flag in UNSUPPORTED:
            raise Refused(f"gpu-kill's {flag} is not supported", UNSUPPORTED[flag])


def shorthand(argv: list[str]) -> list[str]:
    """gpu-kill's cheat-sheet shorthands (src/args.rs, before parsing), where no operation is given:
    `gpukill PID [...]` is --kill --pid PID, `gpukill watch` is --list --watch, `gpukill up` is --server; and
    `--reset ID` is --reset --gpu ID."""
    words = list(argv)
    if not any(w in ("--list", "--kill", "--reset", "--audit", "--server", "--guard") for w in words):
        pid = next((i for i, w in enumerate(words) if w.isdigit() and (i == 0 or not _takes_value(words[i - 1]))), None)
        if pid is not None:
            words = ["--kill", "--pid", words[pid], *words[:pid], *words[pid + 1 :]]
        elif "watch" in words:
            i = words.index("watch")
            words = ["--list", "--watch", *words[:i], *words[i + 1 :]]
        elif "up" in words:
            i = words.index("up")
            words = ["--server", *words[:i], *words[i + 1 :]]
    if "--reset" in words and "--gpu" not in words:
        i = words.index("--reset")
        if i + 1 < len(words) and words[i + 1].isdigit():
            words.insert(i + 1, "--gpu")
    return words


def _takes_value(word: str) -> bool:
    """Whether `word` is an option whose value is the next word (so a number after it is not a PID)."""
    action = build_parser()._option_string_actions.get(word)
    return action is not None and action.nargs is None and not isinstance(action, argparse._StoreTrueAction)


def plan(argv: list[str]) -> Plan:
    """The plan for a gpukill command line; Refused if it is not one gpukill acts on."""
    refuse_unsupported(argv)
    return translate(build_parser().parse_args(shorthand(argv)))


def translate(args: argparse.Namespace) -> Plan:
    ops = [op for op in OPERATIONS if getattr(args, op)]
    host = remote_host(args)
    if not ops:
        owned = [(flag, owners) for dest, flag, owners in OPTION_OWNERS if _given(args, dest)]
        if owned:  # gpu-kill requires the operation too (`--guard-enable` alone is an error there)
            flag, owners = owned[0]
            raise Refused(
                f"{flag} without an operation: it is an option of {' or '.join('--' + o for o in owners)}",
                _on_host(host, _equivalent(owners[0], args)),
            )
        raise Refused(
            "say what to do: one of --list, --kill, --reset, --guard, --audit --rogue, --server",
            "gpukill --help, or gpukillctl --help for every command",
        )
    if len(ops) > 1:
        raise Refused(
            f"{' and '.join('--' + op for op in ops)} together: one operation at a time",
            "; ".join(_on_host(host, EQUIVALENT[op]) for op in ops),
        )
    op = ops[0]
    for dest, flag, owners in OPTION_OWNERS:
        if _given(args, dest) and op not in owners:
            raise Refused(
                f"{flag} is an option of {' or '.join('--' + o for o in owners)}, not of --{op}",
                _on_host(host, _equivalent(op, args)),
            )
    if args.output == "json" and op not in ("list", "guard", "audit"):
        raise Refused(
            f"--output json does not go with --{op}: it prints no JSON", _on_host(host, _equivalent(op, args))
        )
    if op == "server":
        if host is not None:
            raise Refused(
                "--remote with --server: gpukillctl serve runs here, as you, and reaches this host's gpukilld",
                "ssh HOST gpukillctl serve, or gpukillctl serve here",
            )
        return _server(args)
    args.host = host
    p = {"list": _list, "kill": _kill, "reset": _reset, "guard": _guard, "audit": _audit}[op](args)
    return replace(p, host=host) if host is not None else p


def remote_host(args: argparse.Namespace) -> str | None:
    """--remote HOST with --ssh-user and --ssh-port, as gpukillctl -H takes it: [USER@]HOST[:PORT]."""
    if args.remote is None:
        for flag, value in (("--ssh-user", args.ssh_user), ("--ssh-port", args.ssh_port)):
            if value is not None:
                raise Refused(f"{flag} goes with --remote HOST", "gpukillctl -H [USER@]HOST[:PORT] list")
        return None
    name = f"[{args.remote}]" if ":" in args.remote else args.remote  # an IPv6 address, as -H writes it
    if "@" in args.remote and args.ssh_user is not None:
        raise Refused(f"--remote {args.remote} names a user and --ssh-user another", "gpukillctl -H USER@HOST list")
    text = f"{args.ssh_user + '@' if args.ssh_user else ''}{name}{f':{args.ssh_port}' if args.ssh_port else ''}"
    from ..client.remote import Host

    try:
        Host.parse(text)
    except ValueError as e:
        raise Refused(f"--remote: {e}", "gpukillctl -H [USER@]HOST[:PORT] list") from None
    return text


def _on_host(host: str | None, command: str) -> str:
    """A gpukillctl command line, with -H HOST where the request was for another host."""
    if host is None or not command.startswith("gpukillctl "):
        return command
    return f"gpukillctl -H {shlex.quote(host)} {command.removeprefix('gpukillctl ')}"


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


def kill_args(
    pid: int, start_time: int | None, force: bool, grace: float | None, host: str | None = None
) -> argparse.Namespace:
    """`gpukillctl [-H HOST] kill`'s arguments, parsed by gpukillctl's own parser, so they carry whatever it
    adds (with -H, a PID the host's daemon does not list is asked about with start time 0, not this host's)."""
    argv = (["-H", host] if host else []) + ["kill", str(pid)]
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


# -- --list ------------------------------------------------------------------------------------------------


def list_args(json: bool = False, name_regex: str | None = None, device: str | None = None) -> argparse.Namespace:
    """The arguments of `gpukillctl list [--json] [--name-regex R] [--device GPU]`, as cmd_list reads them."""
    return argparse.Namespace(json=json, device=device, user=None, name=None, name_regex=name_regex, min_memory=None)


def _list(args: argparse.Namespace) -> Plan:
    # gpu-kill's --list is a table of GPUs and --details adds the processes; gpukillctl list always has both,
    # and the UNIT/CONTAINER column (--containers) too.
    list_ns = list_args(json=args.output == "json")
    vendor = None if args.vendor in (None, "all") else args.vendor

    def seen(client: ClientAPI) -> ClientAPI:
        # VendorView answers the listings it is used for, and hands the rest to the client (__getattr__)
        return client if vendor is None else VendorView(client, vendor)  # type: ignore[return-value]

    if args.watch:
        return Plan(lambda client: watch(seen(client), list_ns), endless=True)
    return Plan(lambda client: cmd_list(seen(client), list_ns))


class VendorView:
    """A client as gpu-kill's --vendor shows it: only that vendor's GPUs (Device.vendor) and the processes on
    them. gpukillctl list prints what this returns, table or JSON, as it prints every listing."""

    def __init__(self, client: ClientAPI, vendor: str) -> None:
        self.client = client
        self.vendor = vendor
        self.indexes: set[int] | None = None  # the vendor's GPUs, from the listing of devices just made

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    async def list_devices(self) -> list:
        devices = [d for d in await self.client.list_devices() if d.vendor.lower() == self.vendor]
        self.indexes = {d.index for d in devices}
        return devices

    async def list_processes(self, filter: dict[str, Var] | None = None) -> list:
        if self.indexes is None:
            await self.list_devices()
        assert self.indexes is not None
        return [p for p in await self.client.list_processes(filter) if p.device in self.indexes]


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
        """ " on GPU 0 match '^py'" (one: "... matches ...") for "N process(es)..." and "no GPU process..."."""
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
        raise Refused(
            "--pid and --filter together: stop one PID, or every process --filter matches",
            f"gpukillctl kill {args.pid}",
        )
    if args.pid is not None and args.gpu is not None:
        raise Refused(
            "--pid and --gpu together: stop one PID, or every process on the GPU", f"gpukillctl kill {args.pid}"
        )
    if args.pid is None and args.filter is None and args.gpu is None:
        raise Refused("--kill needs --pid PID, or --filter REGEX or --gpu GPU with --batch", "gpukillctl kill PID")
    if args.batch and args.pid is not None:
        raise Refused(
            "--batch goes with --filter or --gpu (it kills every match), not with --pid", f"gpukillctl kill {args.pid}"
        )
    if args.pid is not None:
        if args.dry_run:
            return Plan(lambda client: preview_pid(client, args.pid, args.force, args.timeout_secs))
        kill_ns = kill_args(args.pid, None, args.force, args.timeout_secs, args.host)
        return Plan(lambda client: cmd_kill(client, kill_ns))
    selection = Selection(args.filter, args.gpu)
    if not args.batch:
        # gpu-kill's --filter without --batch lists the matches and kills nothing: so does gpukill, and --gpu too.
        if args.force or args.timeout_secs is not None:
            stray = "--force" if args.force else "--timeout-secs"
            raise Refused(
                f"{stray} without --batch: --kill {'--filter' if args.filter is not None else '--gpu'} "
                "alone only lists the matches",
                selection.gpukillctl_list(),
            )
        return Plan(lambda client: preview(client, selection))
    if args.filter is not None:
        _check_batch_pattern(args.filter)
    if args.dry_run:
        return Plan(lambda client: preview_batch(client, selection, args.force, args.timeout_secs))
    return Plan(lambda client: kill_matching(client, selection, args.force, args.timeout_secs, args.host))


def _check_batch_pattern(pattern: str) -> None:
    """client.batch's check, refused as gpukill refuses: with what to run instead."""
    try:
        check_batch_pattern(pattern)
    except RegexError as e:
        raise Refused(f"--filter: {e}", "gpukillctl list --name-regex REGEX to try a pattern") from None
    except MatchesEveryName as e:
        raise Refused(
            f"--filter {e}: refused with --batch",
            "name the processes, e.g. --filter '^python3$'; or gpukillctl list, then gpukillctl kill PID for each",
        ) from None


async def preview(client: ClientAPI, selection: Selection) -> int:
    code = await cmd_list(client, list_args(name_regex=selection.pattern, device=selection.gpu))
    if code == EXIT_OK:
        print(f"{PROG}: nothing was killed: add --batch to kill the processes listed", file=sys.stderr)
    return code


def _how(force: bool, grace: float | None) -> str:
    from gpukill.units import format_duration

    if not force:
        return "SIGTERM"
    return f"SIGTERM, then SIGKILL if alive after {'the grace period' if grace is None else format_duration(grace)}"


async def targets_of(client: ClientAPI, selection: Selection) -> list:
    return once_per_process(await client.list_processes(selection.filter()))


async def no_targets(client: ClientAPI, selection: Selection, done: str) -> int:
    """A batch that selected nothing: exit status 15 when --gpu names no GPU (a typo), else 5 (nothing matched)."""
    if selection.gpu is not None:
        from .names import no_such_device

        problem = no_such_device(await client.list_devices(), selection.gpu)
        if problem:
            return fail(f"{problem}; {done}", EXIT_NO_SUCH_NAME)
    return fail(f"no GPU process{selection.words(one=True)}; {done}", EXIT_NOT_FOUND)


def _matched(selection: Selection, targets: list) -> str:
    return shown(
        f"{len(targets)} process(es){selection.words(one=False)}: " + ", ".join(f"{p.pid} ({p.comm})" for p in targets)
    )


async def kill_matching(
    client: ClientAPI, selection: Selection, force: bool, grace: float | None, host: str | None = None
) -> int:
    """gpukillctl kill for every process the daemon lists as selected, each by the (PID, start time) listed, so
    a PID reused since the listing is refused, not killed. Every one is tried; the first failure's status."""
    targets = await targets_of(client, selection)
    if not targets:
        return await no_targets(client, selection, "nothing was killed")
    print(_matched(selection, targets))
    first_failure = EXIT_OK
    for p in targets:
        kill_ns = kill_args(p.pid, p.start_time, force, grace, host)
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
        return await no_targets(client, selection, "nothing would be killed")
    print(_matched(selection, targets))
    for p in targets:
        print(shown(f"would kill PID {p.pid} ({p.comm}), start time {p.start_time}: {_how(force, grace)}"))
    print(f"{PROG}: dry run: nothing was killed (polkit decides at the kill)", file=sys.stderr)
    return EXIT_OK


async def preview_pid(client: ClientAPI, pid: int, force: bool, grace: float | None) -> int:
    listed = next((p for p in await client.list_processes() if p.pid == pid), None)
    if listed is None:
        return fail(
            f"PID {pid} is not a GPU process gpukilld lists: the kill would be refused; nothing was killed",
            EXIT_NOT_FOUND,
        )
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


# gpu-kill's user, group and GPU policy changes, each as gpukillctl guard policy's: (dest, flag, kind, verb).
MANAGED_CHANGES: list[tuple[str, str, str, str]] = [
    ("guard_add_user", "--guard-add-user", "user", "add"),
    ("guard_remove_user", "--guard-remove-user", "user", "remove"),
    ("guard_add_group", "--guard-add-group", "group", "add"),
    ("guard_remove_group", "--guard-remove-group", "group", "remove"),
    ("guard_add_gpu", "--guard-add-gpu", "gpu", "add"),
    ("guard_remove_gpu", "--guard-remove-gpu", "gpu", "remove"),
    ("guard_export_config", "--guard-export-config", "", "export"),
    ("guard_import_config", "--guard-import-config", "", "import"),
    ("guard_toggle_dry_run", "--guard-toggle-dry-run", "", "toggle"),
]
_LIMIT_FLAGS = {dest: "--" + dest.replace("_", "-") for limits in POLICY_LIMITS.values() for dest in limits}


def policy_settings(kind: str, args: argparse.Namespace, defaults: bool = False) -> dict:
    """The settings of the --guard-add-KIND policy: the limits given (with defaults, gpu-kill's for the others:
    for a message only)."""
    settings: dict = {}
    for key, text in POLICY_DEFAULTS[kind].items() if defaults else ():
        settings[key] = (
            gigabytes(text) if key in SIZE_SETTINGS else float(text) if key == "utilization_limit" else int(text)
        )
    for dest, key in POLICY_LIMITS[kind].items():
        value = getattr(args, dest)
        if value is not None:
            settings[key] = list(value) if key == "allowed_users" else value
    return settings


def policy_equivalent(
    verb: str, kind: str = "", target: str = "", settings: dict | None = None, file: str | None = None
) -> str:
    if verb == "toggle":
        return "gpukillctl guard status, then gpukillctl guard dry-run on (or off)"
    words = ["gpukillctl", "guard", "policy", verb]
    if kind:
        words += [kind, target]
    for key, value in (settings or {}).items():
        shown_value = (
            gib_text(value)
            if key in SIZE_SETTINGS
            else ",".join(value)
            if key == "allowed_users"
            else number_text(value)
            if isinstance(value, float)
            else str(value)
        )
        words += [SETTING_OPTIONS[key], shown_value]
    if file is not None:
        words += [file, "--replace"]
    return shlex.join(words)


def _guard(args: argparse.Namespace) -> Plan:
    chosen = [(flag, command) for dest, flag, command in GUARD_SWITCHES if getattr(args, dest)]
    managed = [(dest, flag, kind, verb) for dest, flag, kind, verb in MANAGED_CHANGES if _given(args, dest)]
    limits = [dest for dest in _LIMIT_FLAGS if _given(args, dest)]
    if len(chosen) + len(managed) > 1:
        # gpu-kill did them all in its own order (enable before dry-run: enforcing for a moment): say the order.
        flags = [flag for flag, _ in chosen] + [flag for _, flag, _, _ in managed]
        steps = [guard_equivalent(command) for _, command in chosen] + [
            policy_equivalent(
                verb,
                kind,
                str(getattr(args, dest)) if kind else "",
                policy_settings(kind, args) if verb == "add" else None,
            )
            for dest, _, kind, verb in managed
        ]
        raise Refused(
            f"{' and '.join(flags)} together: one Guard change at a time, in the order you mean", "; ".join(steps)
        )
    if args.guard_group_members is not None and not any(v == "add" and k == "group" for _, _, k, v in managed):
        return _managed(args, "guard_add_group", "--guard-group-members", "group", "add", limits)
    if managed:
        if args.policy_file is not None:
            raise Refused(
                f"--policy-file with {managed[0][1]}: two changes",
                f"one at a time: {guard_equivalent({'guard_command': 'load'}, args.policy_file)}",
            )
        return _managed(args, *managed[0], limits)
    if limits:
        kind = next(k for k, dests in POLICY_LIMITS.items() if limits[0] in dests)
        raise Refused(
            f"{_LIMIT_FLAGS[limits[0]]} goes with --guard-add-{kind}: alone it changes nothing (in gpu-kill too)",
            policy_equivalent("add", kind, kind.upper() if kind != "gpu" else "INDEX", policy_settings(kind, args)),
        )
    flag, command = chosen[0] if chosen else ("--guard", {"guard_command": "status"})
    if args.policy_file is not None:
        if not chosen:
            flag, command = "--policy-file", {"guard_command": "load", "file": args.policy_file}
        elif command["guard_command"] != "test":
            raise Refused(
                f"--policy-file with {flag}: loading a policy and {flag} are two changes",
                f"{guard_equivalent({'guard_command': 'load'}, args.policy_file)}; then {guard_equivalent(command)}",
            )
    json_out = args.output == "json"
    if json_out and command["guard_command"] not in ("status", "test"):
        raise Refused(
            f"--output json does not go with {flag}: it prints no JSON", guard_equivalent(command, args.policy_file)
        )
    guard_ns = argparse.Namespace(**command, json=json_out, policy=args.policy_file)
    return Plan(lambda client: cmd_guard(client, guard_ns))


def _managed(args: argparse.Namespace, dest: str, flag: str, kind: str, verb: str, limits: list[str]) -> Plan:
    target = str(getattr(args, dest) or "GROUP") if kind else ""
    stray = [d for d in limits if verb != "add" or d not in POLICY_LIMITS[kind]]
    if stray:
        owner = next(k for k, dests in POLICY_LIMITS.items() if stray[0] in dests)
        raise Refused(
            f"{_LIMIT_FLAGS[stray[0]]} does not go with {flag}: it is a limit of --guard-add-{owner}",
            policy_equivalent(verb, kind, target, policy_settings(kind, args) if verb == "add" else None),
        )
    if args.output == "json":
        raise Refused(
            f"--output json does not go with {flag}: it prints no JSON",
            policy_equivalent(verb, kind, target, None, args.guard_import_config),
        )
    if verb == "toggle":
        return Plan(toggle_dry_run)
    settings = policy_settings(kind, args) if verb == "add" else None
    if args.guard_group_members is not None:
        group = target if kind == "group" else "GROUP"
        joins = "; ".join(f"gpasswd -a {shlex.quote(u)} {shlex.quote(group)}" for u in args.guard_group_members)
        raise Refused(
            "--guard-group-members: a group's members are the system's, as gpukilld reads them (primary "
            "or supplementary), not a list in a policy",
            f"{joins + '; then ' if joins else ''}"
            f"{policy_equivalent('add', 'group', group, settings if kind == 'group' else None)}"
            f"{'' if kind == 'group' and settings else ' --memory-limit SIZE'}",
        )
    if verb == "add" and not settings:
        raise Refused(
            f"{flag} {target} names no limit: gpu-kill filled in its defaults ({_defaults(kind)}); here a "
            "policy has the limits you name, so name them",
            policy_equivalent("add", kind, target, policy_settings(kind, args, defaults=True)),
        )
    argv = shlex.split(policy_equivalent(verb, kind, target, settings, args.guard_import_config))[1:]
    if verb == "import":
        return gpu_kill_import(argv, args.guard_import_config, guard_import)
    return steps([argv])


async def toggle_dry_run(client: ClientAPI) -> int:
    """gpu-kill's toggle: the dry run as the daemon has it now, then the other state (gpukillctl guard dry-run)."""
    status = await client.guard_status()
    state = "off" if status.dry_run else "on"
    # off: gpukillctl guard dry-run says when the policy in force keeps dry run on
    return await cmd_guard(client, argparse.Namespace(guard_command="dry-run", state=state, json=False, policy=None))


# -- gpukillctl commands, run as they are ---------------------------------------------------------------------


def gpukillctl_args(argv: list[str]) -> argparse.Namespace:
    """A gpukillctl command line as gpukillctl's own parser reads it (so it carries whatever gpukillctl adds);
    its one-line error, should it refuse, as a refusal naming the command."""
    import contextlib
    import io

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return gpukillctl_parser(full=False, only=argv[0]).parse_args(argv)
    except SystemExit:
        reason = said.getvalue().strip().splitlines()[-1:] or ["refused"]
        raise Refused(reason[0], "gpukillctl " + argv[0] + " --help") from None


def steps(argvs: list[list[str]]) -> Plan:
    """gpukillctl commands (guard, audit), one after the other on the same client, stopping at the first
    that fails: what gpu-kill did in one invocation."""
    parsed = [gpukillctl_args(argv) for argv in argvs]  # every one checked before the first runs

    async def run(client: ClientAPI) -> int:
        for args in parsed:
            code = await COMMANDS[args.command](client, args)
            if code != EXIT_OK:
                return code
        return EXIT_OK

    return Plan(run, commands=tuple(shlex.join(["gpukillctl", *argv]) for argv in argvs))


def gpu_kill_import(argv: list[str], file: str, convert: Callable[[str, str], tuple[str | None, list[str]]]) -> Plan:
    """The gpukillctl import command `argv` for FILE in gpu-kill's format (gpu_kill_files.py: converted, each
    setting ignored said in a line) or in gpukill's own (imported as it is); refused in one line otherwise."""
    plain = steps([argv])
    args = gpukillctl_args(argv)

    async def run(client: ClientAPI) -> int:
        try:
            converted, notes = convert(file, read_file(file))
        except ValueError as e:  # WrongFormat too: the formats taken, named
            return fail(str(e), EXIT_USAGE)
        if converted is None:
            return await plain.run(client)  # type: ignore[misc]  # steps' plan always has its run
        for note in notes:
            print(f"{PROG}: {shown(note)}", file=sys.stderr)
        return await COMMANDS[args.command](client, argparse.Namespace(**vars(args), text=converted))

    return replace(plain, run=run)


# -- --audit: the scan with gpu-kill's thresholds, and the audit's settings ------------------------------------

AUDIT_SETTING_DESTS = (
    "rogue_config",
    *(flag[2:].replace("-", "_") for flag in ROGUE_THRESHOLDS),
    "rogue_whitelist_process",
    "rogue_unwhitelist_process",
    "rogue_whitelist_user",
    "rogue_unwhitelist_user",
    "rogue_export_config",
    "rogue_import_config",
)
_ALONE = ("rogue_config", "rogue_export_config", "rogue_import_config")  # requests, not changes: one at a time
_SETTINGS_WORDS = {
    "rogue_config": "show",
    "rogue_export_config": "export",
    "rogue_import_config": "import",
    "rogue_whitelist_process": "allow-process",
    "rogue_unwhitelist_process": "disallow-process",
    "rogue_whitelist_user": "allow-user",
    "rogue_unwhitelist_user": "disallow-user",
}


def _threshold(dest: str, args: argparse.Namespace) -> str:
    """gpu-kill's threshold as KEY=VALUE in our setting's unit (gpukillctl audit's table converts it)."""
    key, value = gpu_kill_threshold(_flag(dest), getattr(args, dest))
    return f"{key}={number_text(round(value, 9))}"


def _audit_argv(dest: str, args: argparse.Namespace) -> list[str]:
    """The gpukillctl command (after the word gpukillctl) for one of gpu-kill's audit settings flags."""
    if _flag(dest) in ROGUE_THRESHOLDS:
        return ["audit", "settings", "set", _threshold(dest, args)]
    value = getattr(args, dest)
    json_out = ["--json"] if dest == "rogue_config" and args.output == "json" else []
    return ["audit", "settings", _SETTINGS_WORDS[dest], *([] if isinstance(value, bool) else [value]), *json_out]


def usage_argvs(args: argparse.Namespace) -> list[list[str]]:
    """gpu-kill's usage audit as gpukillctl usage command lines: its records (per process sample) are the totals
    per process here; --audit-summary's top users and top processes are two reports, by user and by process."""
    filters: list[str] = []
    if args.audit_user is not None:
        filters += ["--user", args.audit_user]
    if args.audit_process is not None:
        filters += ["--name", args.audit_process]
    if args.audit_hours is not None:
        filters += ["--since", f"{number_text(args.audit_hours)}h"]
    if args.output == "json":
        filters.append("--json")
    groupings = ("user", "process") if args.audit_summary else ("process",)
    return [["usage", "--by", by, *filters] for by in groupings]


def _audit(args: argparse.Namespace) -> Plan:
    json_out = ["--json"] if args.output == "json" else []
    given = [dest for dest in AUDIT_SETTING_DESTS if _given(args, dest)]
    usage = [dest for dest in USAGE_DESTS if _given(args, dest)]
    if usage and (args.rogue or given):
        other = "--rogue" if args.rogue else _flag(given[0])
        now = "gpukillctl audit" if args.rogue else shlex.join(["gpukillctl", *_audit_argv(given[0], args)])
        raise Refused(
            f"{_flag(usage[0])} with {other}: the usage over time and "
            + ("the rogue-activity audit of the GPUs now" if args.rogue else "the audit's settings")
            + " are two requests",
            f"{shlex.join(['gpukillctl', *usage_argvs(args)[0]])}; then {now}",
        )
    if not args.rogue and not given:
        return steps(usage_argvs(args))
    thresholds = [d for d in given if _flag(d) in ROGUE_THRESHOLDS]
    if args.rogue:
        others = [d for d in given if d not in thresholds]
        if others:
            raise Refused(
                f"--rogue with {_flag(others[0])}: a scan and a change of settings are two requests",
                f"gpukillctl audit; then {shlex.join(['gpukillctl', *_audit_argv(others[0], args)])}",
            )
        # gpu-kill's thresholds for this scan only: gpukillctl audit --min-score ... (AuditRogueWith)
        per_call = [
            word
            for d in thresholds
            for word in (f"--{_threshold(d, args).split('=')[0].replace('_', '-')}", _threshold(d, args).split("=")[1])
        ]
        return steps([["audit", *json_out, *per_call]])
    alone = [d for d in given if d in _ALONE]
    if alone and len(given) > 1:
        raise Refused(
            f"{' and '.join(_flag(d) for d in given)} together: one request at a time",
            "; ".join(shlex.join(["gpukillctl", *_audit_argv(d, args)]) for d in given),
        )
    if json_out and given[0] != "rogue_config":
        raise Refused(
            f"--output json does not go with {_flag(given[0])}: it prints no JSON",
            shlex.join(["gpukillctl", *_audit_argv(given[0], args)]),
        )
    for dest in given:
        value = getattr(args, dest)
        if dest.endswith("whitelist_process") and not os.path.isabs(value):
            raise Refused(
                f"{_flag(dest)} {value}: the audit allows an executable by its absolute path, not a "
                "process name (a process chooses its own name)",
                f"gpukillctl audit settings {_SETTINGS_WORDS[dest]} /PATH/OF/{shlex.quote(value)} "
                f"(command -v {shlex.quote(value)} finds it)",
            )
    argvs = []
    if thresholds:  # every threshold in one change
        argvs.append(["audit", "settings", "set", *(_threshold(d, args) for d in thresholds)])
    argvs += [_audit_argv(d, args) for d in given if d not in thresholds]
    if given == ["rogue_import_config"]:
        return gpu_kill_import(argvs[0], args.rogue_import_config, rogue_import)
    return steps(argvs)


# -- --server ----------------------------------------------------------------------------------------------

LOOPBACK = ("127.0.0.1", "::1", "localhost")
GPU_KILL_PORT = 8080  # gpu-kill's --server-port default


def _server(args: argparse.Namespace) -> Plan:
    opening = ("--open",) if args.open else ()
    if args.server_host is None and args.server_port is None and not args.open:
        return Plan(
            None,
            gpukillctl=("serve",),
            note="on gpukillctl serve's Unix socket (yours alone), not on gpu-kill's 0.0.0.0:8080; "
            "--server-port PORT for TCP on loopback",
        )
    host = args.server_host or "127.0.0.1"
    port = args.server_port or GPU_KILL_PORT
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if host.lower() not in LOOPBACK:
        raise Refused(
            f"--server-host {host}: off loopback gpukillctl serve needs a token file of yours, and "
            "gpu-kill has no flag for one",
            f"gpukillctl serve --tcp {address} --token-file FILE",
        )
    note = None if args.server_host else f"on {address}, loopback only, not on gpu-kill's 0.0.0.0"
    return Plan(None, gpukillctl=("serve", "--tcp", address, *opening), note=note)


# -- running -----------------------------------------------------------------------------------------------


def run_plan(p: Plan) -> int:
    """A one-shot plan on the blocking transport; --watch (endless, it sleeps between refreshes) and --remote
    (ssh) on asyncio; a gpukillctl command that runs on its own (serve) by gpukillctl."""
    if p.note:
        print(f"{PROG}: {p.note}", file=sys.stderr)
    if p.run is None:
        from .main import main as gpukillctl_main

        return gpukillctl_main(list(p.gpukillctl))
    if not p.endless and p.host is None:
        from ..client.blocking import BlockingClient, finish

        blocking = BlockingClient.connect()
        try:
            return finish(p.run(blocking))
        finally:
            blocking.close()
    import asyncio

    from ..client.dbus import GpukillClient

    run = p.run

    async def run_async() -> int:
        client = await GpukillClient.connect(host=p.host)
        try:
            return await run(client)
        finally:
            client.close()

    return asyncio.run(run_async())


def main(argv: list[str] | None = None) -> int:
    try:
        p = plan(sys.argv[1:] if argv is None else argv)
    except Refused as e:
        return fail(str(e), e.code)
    try:
        return run_plan(p)
    except ClientError as e:  # which host said no, when it is not this one
        return fail(f"host {p.host}: {e}" if p.host else str(e), exit_code(e))
    except KeyboardInterrupt:
        return EXIT_OK if p.endless else 130  # Ctrl-C is how --watch ends
    except BrokenPipeError:  # `gpukill --list --watch | head`: the reader is done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return EXIT_OK
    except Exception as e:  # a bug must still end in one line, not a traceback
        return fail(f"internal error: {type(e).__name__}: {e}", EXIT_FAILURE)


if __name__ == "__main__":
    sys.exit(main())
