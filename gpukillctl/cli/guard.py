"""gpukillctl guard: enable, disable, dry-run, status, test, load, validate, policy (Guard Mode).

`validate` needs no daemon: it parses with the daemon's own policy module, so what it accepts the daemon
accepts. `load` validates locally first, so every error is shown, not just the first the daemon reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from gpukill.outcome import Outcome
from gpukill.records.base import to_plain
from gpukill.text import UNKNOWN

from ..client.api import ClientAPI
from ..client.exits import EXIT_FAILURE, EXIT_INVALID_POLICY, EXIT_USAGE
from ..client.format import shown, table

if TYPE_CHECKING:  # annotations only: the Guard's records load when `guard` runs, not at every start
    from gpukill.records.guard import Decision, GuardStatus, ManagedPolicyEntry, NotificationCounters

# The policy module (and PyYAML), the units and the polkit agent (subprocess) are imported by the guard commands
# that use them: `gpukillctl list` starts faster.


def register(sub: argparse._SubParsersAction) -> None:
    guard = sub.add_parser(
        "guard",
        help="Guard Mode: policies the daemon enforces (see man gpukill-policy)",
        description="Guard Mode: policies gpukilld enforces on its own samples. The policy "
        "format, with every key and condition type: man gpukill-policy.",
    )
    gsub = guard.add_subparsers(dest="guard_command", metavar="GUARD_COMMAND", parser_class=type(guard))
    gsub.required = True
    gsub.add_parser("enable", help="evaluate the policy and act on it")
    gsub.add_parser("disable", help="stop evaluating (kills already started finish)")
    dry = gsub.add_parser("dry-run", help="on: evaluate and report 'would kill', never signal")
    dry.add_argument("state", choices=["on", "off"])
    status = gsub.add_parser("status", help="switches, rules with their counters, windows, graces, recent events")
    status.add_argument("--json", action="store_true", help="the whole status as JSON")
    test = gsub.add_parser("test", help="what the policy in force (or --policy FILE) would do now; never acts")
    test.add_argument("--policy", metavar="FILE", help="test this policy instead, as if loaded now")
    test.add_argument("--json", action="store_true", help="decisions as JSON")
    load = gsub.add_parser("load", help="validate FILE and make it the policy in force (the old one stays on error)")
    load.add_argument("file", metavar="FILE")
    validate = gsub.add_parser("validate", help="check policy files without the daemon (FILE:LINE:COL errors)")
    validate.add_argument("files", metavar="FILE", nargs="+", help="policy files, or a directory of *.yaml")
    validate.set_defaults(offline=cmd_validate)
    _register_policy(gsub)


def _register_policy(gsub: argparse._SubParsersAction) -> None:
    policy = gsub.add_parser(
        "policy",
        help="user, group and GPU policies gpukilld keeps in guard.d (gpu-kill's)",
        description="Managed policies: per-user, per-group and per-GPU limits that gpukilld "
        "writes as ordinary policy files into the Guard policy directory "
        "(/etc/gpukill/guard.d) and applies at once. Changing them needs "
        "polkit's org.gpukill.manage-policies.",
    )
    psub = policy.add_subparsers(dest="policy_command", metavar="POLICY_COMMAND", parser_class=type(policy))
    psub.required = True
    add = psub.add_parser("add", help="create or replace the policy of a user, group or GPU")
    add.add_argument("kind", metavar="KIND", help="user, group or gpu")
    add.add_argument("target", metavar="TARGET", help="the user name, group name or GPU index")
    add.add_argument(
        "--memory-limit",
        metavar="SIZE",
        type=_size,
        help="GPU memory (user, group: summed over their processes), e.g. 8GiB",
    )
    add.add_argument("--utilization-limit", metavar="PCT", type=_percent, help="GPU utilization, percent")
    add.add_argument("--process-limit", metavar="N", type=_count, help="GPU processes at once (user, group)")
    add.add_argument("--allowed-users", metavar="U[,U...]", type=_names, help="gpu: only these users may hold the GPU")
    add.add_argument("--reserved-memory", metavar="SIZE", type=_size, help="gpu: memory kept free on the device")
    add.add_argument(
        "--grace", metavar="DURATION", type=_duration, help="time over a limit before the kill, e.g. 30s (default 30s)"
    )
    remove = psub.add_parser("remove", help="remove the policy of a user, group or GPU")
    remove.add_argument("kind", metavar="KIND", help="user, group or gpu")
    remove.add_argument("target", metavar="TARGET")
    listing = psub.add_parser("list", help="the managed policies, with their files (edited: changed by hand)")
    listing.add_argument("--json", action="store_true", help="as JSON")
    export = psub.add_parser("export", help="every managed policy as one YAML document (to stdout or FILE)")
    export.add_argument("file", metavar="FILE", nargs="?")
    imp = psub.add_parser("import", help="create or replace the policies of an exported FILE (all or nothing)")
    imp.add_argument("file", metavar="FILE")
    imp.add_argument("--replace", action="store_true", help="also remove the managed policies FILE does not name")


def _argument(convert: Any) -> Any:
    """An argparse type from a converter raising ValueError: argparse's one line names the option."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = convert.__name__
    return parse


def _size_value(text: str) -> str:
    """A limit checked here (a one-line error naming the option) and sent as written: the daemon reads the
    same grammar, and a text in B or KiB says a limit under 1 MiB is meant, which a byte count cannot."""
    from gpukill.units import parse_size

    parse_size(text, limit=True)
    return text.strip()


def _percent_value(text: str) -> float:
    value = text.strip().removesuffix("%")
    try:
        pct = float(value)
    except ValueError:
        raise ValueError(f"not a percentage: {text!r} (write e.g. 90 or 90%)") from None
    if not 0 <= pct <= 100:
        raise ValueError(f"a percentage is 0 to 100, not {text!r}")
    return pct


def _count_value(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"not a whole number: {text!r}") from None
    if not 0 <= n < 1 << 32:
        raise ValueError(f"not a count: {text!r}")
    return n


def _names_value(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise ValueError(f"not a list of user names: {text!r} (write alice,bob)")
    return names


def _duration_value(text: str) -> float:
    from gpukill.units import parse_duration

    return parse_duration(text)


_size, _percent, _count = _argument(_size_value), _argument(_percent_value), _argument(_count_value)
_names, _duration = _argument(_names_value), _argument(_duration_value)


def _print_errors(e: Any) -> int:
    for line in e.errors:
        print(shown(line), file=sys.stderr)
    return EXIT_INVALID_POLICY


def _print_warnings(policy: Any, args: argparse.Namespace) -> None:
    """The user and group names this host does not know, one warning line each (the policy is still valid: the
    user may be created later). Over -H the policy is for another host, whose users this one cannot tell."""
    from gpukill.policy import name_warnings

    if getattr(args, "host", None):
        return
    for line in name_warnings(policy):
        print(shown(line), file=sys.stderr)


def _warn_unknown_target(kind: str, target: str, args: argparse.Namespace) -> None:
    """A managed user or group policy for a name this host does not know: in force (the user may be created
    later), with a warning line, as a policy file naming it gets."""
    from .names import no_such_group, no_such_user

    if getattr(args, "host", None) or kind not in ("user", "group"):
        return
    problem = (no_such_user if kind == "user" else no_such_group)(target)
    if problem:
        print(f"gpukillctl: warning: {problem}: the policy matches nobody until it exists", file=sys.stderr)


def _texts(names: list[str]) -> list[tuple[str, str]]:
    from gpukill.policy import policy_paths, read_paths

    return read_paths([p for name in names for p in (policy_paths(name) if os.path.isdir(name) else [name])])


def cmd_validate(args: argparse.Namespace) -> int:
    """Offline: the files together, as the daemon would read them from guard.d (names unique across files)."""
    from gpukill.policy import PolicyError, load_texts

    try:
        texts = _texts(args.files)
        if not texts:
            print("gpukillctl: no policy files (*.yaml) found", file=sys.stderr)
            return EXIT_INVALID_POLICY
        policy = load_texts(texts)
    except PolicyError as e:
        return _print_errors(e)
    _print_warnings(policy, args)
    for name, _ in texts:
        rules = [r.name for r in policy.rules if r.where.startswith(f"{name}:")]
        print(f"{name}: valid, {len(rules)} rule(s)" + (f": {', '.join(rules)}" if rules else ""))
    return 0


async def cmd_guard(client: ClientAPI, args: argparse.Namespace) -> int:
    command = args.guard_command
    if command in ("enable", "disable", "dry-run", "load"):
        return await _change(client, args)
    if command == "status":
        return await _status(client, args)
    if command == "policy":
        return await _policy(client, args)
    return await _test(client, args)


async def _change(client: ClientAPI, args: argparse.Namespace) -> int:
    from gpukill.policy import PolicyError, load_texts, read_text

    command = args.guard_command
    text = ""
    if command == "load":
        try:
            text = read_text(args.file)
            policy = load_texts([(args.file, text)])
        except PolicyError as e:
            return _print_errors(e)
        _print_warnings(policy, args)
    from ..client.polkit_agent import PolkitAgent

    agent = PolkitAgent()
    try:
        if command in ("enable", "disable"):
            await client.guard_enable(command == "enable", interactive=agent.active)
            print(f"guard {command}d")
        elif command == "dry-run":
            await client.guard_set_dry_run(args.state == "on", interactive=agent.active)
            print(f"guard dry run {args.state}")
        else:
            result = await client.guard_load_policy(os.path.abspath(args.file), text, interactive=agent.active)
            names = ", ".join(result.rules) or "none"
            print(
                shown(
                    f"policy {args.file} in force until the next reload of gpukilld (systemctl reload, "
                    f"SIGHUP) or guard load: {len(policy.rules)} rule(s): {names}"
                )
            )
        st = await client.guard_status()
        if command == "dry-run" and args.state == "off" and st.policy_dry_run:
            # the switch is off, yet nothing is signalled: say why, and how to end it
            print(
                shown(
                    f"gpukillctl: dry run stays on: the policy in force ({', '.join(st.files)}) sets "
                    "dry_run: true; remove it there and load or reload the policy to enforce"
                ),
                file=sys.stderr,
            )
        if st.state_error:  # in force now; a restart would go back to what was last saved
            print(
                shown(f"gpukillctl: in force, but not kept across a restart of gpukilld: {st.state_error}"),
                file=sys.stderr,
            )
    finally:
        agent.close()
    return 0


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else UNKNOWN


def _seconds(s: float | None) -> str:
    from gpukill.units import format_duration  # imported when a duration is printed: not at every start

    return format_duration(s)


async def _status(client: ClientAPI, args: argparse.Namespace) -> int:
    st = await client.guard_status()
    if args.json:
        json.dump(to_plain(st), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    dry = st.dry_run or st.policy_dry_run
    mode = (
        "disabled" if not st.enabled else ("enabled, DRY RUN (nothing is signalled)" if dry else "enabled, enforcing")
    )
    print(f"guard: {mode}")
    for why in _dry_run_reasons(st):
        print(shown(f"dry run: {why}"))
    source = "guard.d"
    if st.source == "loaded":
        source = (
            f"loaded with gpukillctl guard load by {st.loaded_by or 'an unknown caller'} at "
            f"{_when(st.loaded_at)}, until the next reload of gpukilld or guard load"
        )
    print(shown(f"policy: {', '.join(st.files) or 'none'} ({source})"))
    if st.replaced:
        print(shown(f"replaced at {_when(st.replaced_at)} by a re-read of guard.d: {st.replaced}"))
    if st.policy_error:
        print(shown(f"policy files rejected (the policy above stays in force): {st.policy_error}"))
    if st.state_error:
        print(shown(f"state not saved (a restart resumes from it as last saved): {st.state_error}"))
    print(f"evaluations: {st.evaluations}, last {st.last_eval_ms:.1f} ms, slowest {st.max_eval_ms:.1f} ms")
    if st.rules:
        print()
        print(
            table(
                [
                    "RULE",
                    "ACTION",
                    "SCOPE",
                    "TRIGGERS",
                    "KILLS",
                    "WOULD-KILL",
                    "SUSPENDS",
                    "CANCELLED",
                    "FAILED",
                    "RESETS",
                    "LAST",
                ],
                [
                    [
                        r.name,
                        r.action,
                        r.scope,
                        str(r.triggers),
                        str(r.kills),
                        str(r.would_kill),
                        f"{r.suspends} ({r.would_suspend} would)" if r.would_suspend else str(r.suspends),
                        str(r.cancelled),
                        str(r.failed),
                        str(r.resets),
                        _when(r.last_triggered),
                    ]
                    for r in st.rules
                ],
            )
        )
    if st.windows:
        print("\nin a duration window:")
        for w in st.windows:
            print(shown(f"  {w.rule}: {w.subject}: {w.condition}: {_seconds(w.elapsed)} of {_seconds(w.duration)}"))
    if st.graces:
        print("\nin a grace period:")
        for g in st.graces:
            warned = ""
            if g.warnings_sent or g.next_warning is not None:
                warned = f"; {g.warnings_sent} warning(s) sent" + (
                    f", next in {_seconds(g.next_warning)}" if g.next_warning is not None else ""
                )
            postponed = ""
            if g.postponements:  # "postponed 20min by alice: saving"
                times = "" if g.postponements == 1 else f" in {g.postponements} postponements"
                postponed = f"; postponed {_seconds(g.postponed)}{times}" + (
                    f" by {g.postponed_by}" if g.postponed_by else ""
                )
                postponed += f": {g.postpone_reason}" if g.postpone_reason else ""
            print(shown(f"  {g.rule}: {g.subject}: {_seconds(g.remaining)} left{warned}{postponed}"))
    if st.recent:
        print("\nrecent:")
        for r in st.recent[-10:]:
            outcome = r.outcome or r.event
            dry_tag = (
                " (dry run)"
                if r.dry_run and outcome not in (Outcome.WOULD_KILL, Outcome.WOULD_RESET, Outcome.WOULD_SUSPEND)
                else ""
            )
            folded = f" (×{r.repeats} since {_when(r.since or 0)})" if r.repeats else ""
            detail = f"; {r.detail}" if r.detail else ""  # what its kill_scope stopped with it, or left running
            print(shown(f"  {_when(r.time)}  {r.rule}: {r.subject}: {outcome}{dry_tag}{folded}{detail}"))
    used = [c for c in st.notifications if c.queued or c.skipped or c.announced]
    if used:
        print("\nnotifications:")
        for c in used:
            print(shown(f"  {_notification_counts(c)}"))
    return 0


def _dry_run_reasons(st: GuardStatus) -> list[str]:
    """Each thing that holds dry run on, as `guard status` names it."""
    reasons = []
    if st.dry_run:
        reasons.append(st.dry_run_kept or "set with gpukillctl guard dry-run on")
    if st.policy_dry_run:
        reasons.append(f"the policy in force ({', '.join(st.files) or 'none'}) sets dry_run: true")
    return reasons


def _notification_counts(c: NotificationCounters) -> str:
    """One channel's counters as `guard status` says them: the desktop only announces (no agent answers)."""
    if c.channel == "desktop":
        return f"desktop: {c.announced} announced (signalled on the bus; shown or not, no agent says)"
    return f"{c.channel}: {c.delivered} delivered, {c.skipped} skipped, {c.failed} failed, {c.dropped} dropped"


def _decision_row(d: Decision) -> list[str]:
    from gpukill.rules import RESET, stops_subject  # here: the listing path imports this module, and not the rules

    if d.status == "now":
        when = "now"
    elif d.status == "waiting":
        when = f"in {_seconds(d.wait)}"
    else:
        when = d.status
    pids = ", ".join(map(str, d.pids)) or "-"
    if stops_subject(d.action):  # kill, suspend, requeue or cancel: the processes concerned (the reason names jobs)
        what = f"{d.action} {pids}"
    elif d.action == RESET and d.pids:  # force: its holders are killed first
        what = f"kill {pids}, reset"
    else:
        what = d.action
    return [d.rule, d.subject, what, when, d.reason]


async def _test(client: ClientAPI, args: argparse.Namespace) -> int:
    from gpukill.policy import PolicyError, load_texts, read_text

    if args.policy:
        try:
            text = read_text(args.policy)
            policy = load_texts([(args.policy, text)])  # every error here, before asking the daemon
        except PolicyError as e:
            return _print_errors(e)
        _print_warnings(policy, args)
        decisions = await client.guard_test(os.path.abspath(args.policy), text)
    else:
        decisions = await client.guard_test()
    if args.json:
        json.dump({"decisions": [to_plain(d) for d in decisions]}, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    from gpukill.records.guard import NOT_MET

    acting = [d for d in decisions if d.status != NOT_MET]
    watched = [d for d in decisions if d.status == NOT_MET]
    if acting:
        print(table(["RULE", "SUBJECT", "WOULD", "WHEN", "WHY"], [_decision_row(d) for d in acting]))
    else:
        print("no rule matches anything now; nothing would be done")
    if watched:  # why nothing happens to them: the condition that does not hold, with its value
        print("\nwatched, not met (nothing is done while so):")
        for d in watched:
            print(shown(f"  {d.rule}: {d.subject}: {d.reason}"))
    if acting:
        print("(a test: nothing was signalled)")
    return 0


# -- guard policy: the managed user, group and GPU policies --------------------------------------------------

SETTING_OPTIONS = ("memory_limit", "utilization_limit", "process_limit", "allowed_users", "reserved_memory", "grace")


def _fail(message: str, code: int) -> int:
    print(f"gpukillctl: {shown(message)}", file=sys.stderr)
    return code


def _limits(entry: ManagedPolicyEntry) -> str:
    from gpukill.units import format_size

    parts = []
    if entry.memory_limit is not None:
        parts.append(f"memory {format_size(entry.memory_limit)}")
    if entry.utilization_limit is not None:
        parts.append(f"utilization {entry.utilization_limit:g}%")
    if entry.process_limit is not None:
        parts.append(f"processes {entry.process_limit}")
    if entry.allowed_users:
        parts.append(f"allowed {','.join(entry.allowed_users)}")
    if entry.reserved_memory is not None:
        parts.append(f"reserved {format_size(entry.reserved_memory)}")
    parts.append(f"grace {_seconds(entry.grace)}")
    return ", ".join(parts)


async def _policy(client: ClientAPI, args: argparse.Namespace) -> int:
    from gpukill.policy import PolicyError, read_text

    command = args.policy_command
    if command == "list":
        entries = await client.guard_list_policies()
        if args.json:
            json.dump({"policies": [to_plain(e) for e in entries]}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        elif not entries:
            print("no managed policies (gpukillctl guard policy add KIND TARGET ... makes one)")
        else:
            print(
                table(
                    ["KIND", "TARGET", "LIMITS", "FILE", "EDITED"],
                    [[e.kind, e.target, _limits(e), e.file, "edited" if e.edited else "-"] for e in entries],
                )
            )
        return 0
    if command == "export":
        text = await client.guard_export_policies()
        if args.file is None:
            sys.stdout.write(text)
            return 0
        try:
            with open(args.file, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            return _fail(f"cannot write {args.file}: {e.strerror or e}", EXIT_FAILURE)
        return 0
    text = ""
    if command == "import":
        given = getattr(args, "text", None)  # given: the file read and converted already (gpukill: gpu-kill's)
        try:
            text = read_text(args.file) if given is None else given
        except PolicyError as e:
            return _fail(str(e), EXIT_INVALID_POLICY)
    elif command == "add":
        settings = {key: getattr(args, key) for key in SETTING_OPTIONS if getattr(args, key) is not None}
        if not settings or set(settings) == {"grace"}:
            return _fail(
                "guard policy add: give at least one limit (--memory-limit, --utilization-limit, "
                "--process-limit, --allowed-users, --reserved-memory)",
                EXIT_USAGE,
            )
    from ..client.polkit_agent import PolkitAgent

    agent = PolkitAgent()
    try:
        if command == "add":
            entry = await client.guard_set_policy(args.kind, args.target, settings, interactive=agent.active)
            print(shown(f"{entry.kind} policy for {entry.target} in force ({_limits(entry)}): {entry.file}"))
            _warn_unknown_target(entry.kind, entry.target, args)
        elif command == "remove":
            await client.guard_remove_policy(args.kind, args.target, interactive=agent.active)
            print(shown(f"{args.kind} policy for {args.target} removed"))
        else:
            entries = await client.guard_import_policies(
                args.file, text, replace=args.replace, interactive=agent.active
            )
            names = ", ".join(f"{e.kind} {e.target}" for e in entries) or "none"
            print(shown(f"{len(entries)} policies from {args.file} in force: {names}"))
    finally:
        agent.close()
    return 0
