"""gpukillctl guard: enable, disable, dry-run, status, test, load, validate (Guard Mode).

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
from gpukill.records import to_plain

from .client_api import ClientAPI
from .exits import EXIT_INVALID_POLICY
from .format import shown, table

if TYPE_CHECKING:  # annotations only: the Guard's records load when `guard` runs, not at every start
    from gpukill.records import Decision

# The policy module (and PyYAML), the units and the polkit agent (subprocess) are imported by the guard commands
# that use them: `gpukillctl list` starts faster.


def register(sub: argparse._SubParsersAction) -> None:
    guard = sub.add_parser("guard", help="Guard Mode: policies the daemon enforces (see man gpukill-policy)",
                           description="Guard Mode: policies gpukilld enforces on its own samples. The policy "
                                       "format, with every key and condition type: man gpukill-policy.")
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


def _print_errors(e: Any) -> int:
    for line in e.errors:
        print(shown(line), file=sys.stderr)
    return EXIT_INVALID_POLICY


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
    from .polkit_agent import PolkitAgent

    agent = PolkitAgent(client.unique_name)
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
            print(shown(f"policy {args.file} in force: {len(policy.rules)} rule(s): {names}"))
    finally:
        agent.close()
    return 0


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _seconds(s: float) -> str:
    from gpukill.units import format_duration

    return format_duration(round(s)) if s >= 1 else f"{s:.1f}s"


async def _status(client: ClientAPI, args: argparse.Namespace) -> int:
    st = await client.guard_status()
    if args.json:
        json.dump(to_plain(st), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    dry = st.dry_run or st.policy_dry_run
    mode = "disabled" if not st.enabled else ("enabled, DRY RUN (nothing is signalled)" if dry else
                                              "enabled, enforcing")
    print(f"guard: {mode}")
    source = "loaded with gpukillctl guard load" if st.source == "loaded" else "guard.d"
    print(shown(f"policy: {', '.join(st.files) or 'none'} ({source})"))
    if st.policy_error:
        print(shown(f"policy files rejected (the policy above stays in force): {st.policy_error}"))
    print(f"evaluations: {st.evaluations}, last {st.last_eval_ms:.1f} ms, slowest {st.max_eval_ms:.1f} ms")
    if st.rules:
        print()
        print(table(["RULE", "ACTION", "SCOPE", "TRIGGERS", "KILLS", "WOULD-KILL", "CANCELLED", "FAILED", "RESETS",
                     "LAST"],
                    [[r.name, r.action, r.scope, str(r.triggers), str(r.kills), str(r.would_kill),
                      str(r.cancelled), str(r.failed), str(r.resets), _when(r.last_triggered)] for r in st.rules]))
    if st.windows:
        print("\nin a duration window:")
        for w in st.windows:
            print(shown(f"  {w.rule}: {w.subject}: {w.condition}: {_seconds(w.elapsed)} "
                        f"of {_seconds(w.duration)}"))
    if st.graces:
        print("\nin a grace period:")
        for g in st.graces:
            print(shown(f"  {g.rule}: {g.subject}: {_seconds(g.remaining)} left"))
    if st.recent:
        print("\nrecent:")
        for r in st.recent[-10:]:
            outcome = r.outcome or r.event
            dry_tag = " (dry run)" if r.dry_run and outcome not in (Outcome.WOULD_KILL, Outcome.WOULD_RESET) else ""
            print(shown(f"  {_when(r.time)}  {r.rule}: {r.subject}: {outcome}{dry_tag}"))
    if any(c.queued for c in st.notifications):
        print("\nnotifications: " + "; ".join(
            f"{c.channel}: {c.delivered} delivered, {c.failed} failed, {c.dropped} dropped"
            for c in st.notifications))
    return 0


def _decision_row(d: Decision) -> list[str]:
    if d.status == "now":
        when = "now"
    elif d.status == "waiting":
        when = f"in {_seconds(d.wait)}"
    else:
        when = d.status
    pids = ", ".join(map(str, d.pids)) or "-"
    if d.action == "kill":
        what = f"{d.action} {pids}"
    elif d.action == "reset" and d.pids:  # force: its holders are killed first
        what = f"kill {pids}, reset"
    else:
        what = d.action
    return [d.rule, d.subject, what, when, d.reason]


async def _test(client: ClientAPI, args: argparse.Namespace) -> int:
    from gpukill.policy import PolicyError, load_texts, read_text

    if args.policy:
        try:
            text = read_text(args.policy)
            load_texts([(args.policy, text)])  # every error here, before asking the daemon
        except PolicyError as e:
            return _print_errors(e)
        decisions = await client.guard_test(os.path.abspath(args.policy), text)
    else:
        decisions = await client.guard_test()
    if args.json:
        json.dump({"decisions": [to_plain(d) for d in decisions]}, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    if not decisions:
        print("no rule matches anything now; nothing would be done")
        return 0
    print(table(["RULE", "SUBJECT", "WOULD", "WHEN", "WHY"], [_decision_row(d) for d in decisions]))
    print("(a test: nothing was signalled)")
    return 0
