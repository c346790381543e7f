"""gpukillctl audit: the daemon's rogue-activity audit (miners, abusers, idle holders), as a table or JSON, and
its settings (`gpukillctl audit settings ...`).

The audit runs in gpukilld on every sample (gpukilld/rogue/score.py); this asks for its findings as the caller may
see them, with the settings in force, or with other thresholds for this one scan (--min-score, --idle-after,
--idle-min-memory, --abuser-share: AuditRogueWith). Text from processes (names, what the evidence quotes of a
command line) is escaped before it reaches the terminal.

`audit settings` shows, changes, exports and imports the thresholds and allow-lists (GetAuditSettings,
SetAuditSettings, ExportAuditSettings, ImportAuditSettings; polkit's org.gpukill.configure-audit for changes).
GPU_KILL_THRESHOLDS says what each of gpu-kill's --rogue-*-threshold flags is here (gpukill, the compatible
command line, uses it too).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from gpukill.records.base import to_plain

from ..client.api import ClientAPI
from ..client.exits import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from ..client.format import shown, size, table

if TYPE_CHECKING:  # annotations only: the audit's records load when `audit` runs, not at every start
    from gpukill.records.audit import AuditSettings, Finding

JSON_FORMAT = 1

# gpu-kill's rogue thresholds (its --rogue-*-threshold flags, rogue_config.toml's [detection]) and what each is
# here: (our key, the factor from its value to ours), or (None, why it has no meaning here and what to use).
GPU_KILL_THRESHOLDS: dict[str, tuple[str | None, float | str]] = {
    "--rogue-confidence-threshold": ("min_score", 100.0),  # its confidence 0.0-1.0 is our score 0-100
    "--rogue-memory-threshold": (
        None,
        "gpu-kill flags each process over N GB as a resource abuser; here an abuser is a user holding "
        "abuser_share percent of the GPU memory used (gpukillctl audit settings set abuser_share=PCT), "
        "and a memory limit is a Guard policy: gpukillctl guard policy add user USER --memory-limit SIZE",
    ),
    "--rogue-utilization-threshold": (
        None,
        "a busy GPU is no evidence of rogue activity here (a trainer is busy); users' GPU time is compared "
        "by abuser_share (gpukillctl audit settings set abuser_share=PCT), and a utilization limit is a "
        "Guard policy: gpukillctl guard policy add user USER --utilization-limit PCT",
    ),
    "--rogue-duration-threshold": (
        None,
        "a long run is no evidence of rogue activity here (a trainer runs for days); memory held at 0% "
        "utilization is: gpukillctl audit settings set idle_after=DURATION",
    ),
}
PER_CALL = (
    ("min_score", "--min-score", "PTS", "report only findings of at least this score (0-100)"),
    (
        "idle_after",
        "--idle-after",
        "DURATION",
        "idle holders: memory held unused (no utilization) this long, e.g. 30min",
    ),
    (
        "idle_min_memory",
        "--idle-min-memory",
        "SIZE",
        "idle holders: at least this much memory (not below the configured value)",
    ),
    ("abuser_share", "--abuser-share", "PCT", "abusers: this share of the GPU memory or time"),
)


def gpu_kill_threshold(flag: str, value: str) -> tuple[str, float]:
    """gpu-kill's threshold flag and value as our setting (key, value); ValueError, one line, when it has no
    meaning here or the value is not a number."""
    key, factor = GPU_KILL_THRESHOLDS[flag]
    if key is None:
        raise ValueError(f"{flag} has no meaning in gpukill: {factor}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{flag}: {value[:64]!r} is not a number") from None
    return key, number * float(factor)


def _setting_type(key: str) -> Any:
    """An argparse type for a per-scan setting: setting_value's, its one-line error naming the option."""

    def convert(text: str) -> Any:
        try:
            return setting_value(key, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = key
    return convert


def register(sub: argparse._SubParsersAction) -> None:
    audit = sub.add_parser(
        "audit",
        help="rogue activity: crypto miners, GPU hogs, idle memory holders",
        description="The rogue-activity audit of gpukilld's last sample: each finding with "
        "its score (0-100) and the evidence behind it. Of other users' processes "
        "only what you may list is shown. Threshold options score the last "
        "sample again for this one scan; `audit settings` changes them for good.",
    )
    audit.add_argument("--json", action="store_true", help="machine-readable output (stable format)")
    for key, option, metavar, text in PER_CALL:
        audit.add_argument(option, dest=key, metavar=metavar, type=_setting_type(key), help=text + " (this scan only)")
    asub = audit.add_subparsers(dest="audit_command", metavar="settings")
    settings = asub.add_parser(
        "settings",
        help="the audit's thresholds and allow-lists (see man gpukilld.conf)",
        description="Show, change, export or import the rogue-activity audit's settings, "
        "kept by gpukilld in gpukilld.conf.d/50-audit.conf. Changes need "
        "polkit's org.gpukill.configure-audit.",
    )
    ssub = settings.add_subparsers(dest="settings_command", metavar="COMMAND")
    show = ssub.add_parser("show", help="the settings in force (the default)")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    setp = ssub.add_parser("set", help="change settings: KEY=VALUE ... (lists: comma-separated; empty: none)")
    setp.add_argument("assignments", nargs="+", metavar="KEY=VALUE")
    for name, what in (
        ("allow-process", "an executable's absolute path (root's; never a name)"),
        ("disallow-process", "an executable's path"),
        ("allow-user", "a user name"),
        ("disallow-user", "a user name"),
    ):
        ssub.add_parser(name, help=f"{name.split('-')[0]} {what}").add_argument("entry")
    export = ssub.add_parser("export", help="the settings as an [audit] section (to stdout or FILE)")
    export.add_argument("file", nargs="?")
    imp = ssub.add_parser("import", help="change the settings an [audit] FILE names (all or nothing)")
    imp.add_argument("file")


def _subject(f: Finding) -> str:
    if f.pid is None:
        return f"user {f.user}"
    return f"PID {f.pid} ({f.comm or '?'}, user {f.user})"


def findings_text(findings: list[Finding]) -> str:
    """A table of findings, then each one's evidence."""
    if not findings:
        return "No rogue activity found."
    rows = [
        [str(f.score), f.kind, _subject(f), ",".join(map(str, f.devices)) or "-", size(f.gpu_memory)] for f in findings
    ]
    lines = [table(["SCORE", "KIND", "SUBJECT", "GPU", "MEMORY"], rows), ""]
    for f in findings:
        lines.append(shown(f"{f.kind} {_subject(f)}, score {f.score}:"))
        lines.extend(shown(f"  +{e.points} {e.rule}: {e.detail}") for e in f.evidence)
    return "\n".join(lines)


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"gpukillctl: {shown(message)}", file=sys.stderr)
    return code


def setting_value(key: str, text: str) -> Any:
    """A setting typed on the command line, as the daemon takes it (ValueError, one line). The daemon checks
    ranges and entries; this only gives the value its type."""
    from gpukill.records.audit import AUDIT_DURATIONS, AuditSettings
    from gpukill.records.base import specs
    from gpukill.units import parse_duration, parse_size

    sigs = dict(specs(AuditSettings))
    if key not in sigs:
        flag = f"--rogue-{key.removesuffix('_threshold')}-threshold"
        if flag in GPU_KILL_THRESHOLDS:
            return gpu_kill_threshold(flag, text)
        raise ValueError(f"unknown audit setting {key[:64]!r} (known: {', '.join(sigs)})")
    sig = sigs[key].sig
    if key in AUDIT_DURATIONS:
        try:
            return parse_duration(text)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    if sig == "d":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{key}: {text[:64]!r} is not a number") from None
    if sig == "t":
        try:
            return parse_size(text)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    words = text.replace(",", " ").split()
    if sig == "aq":
        if not all(w.isdigit() and len(w) <= 5 for w in words):
            raise ValueError(f"{key} must be TCP ports (1 to 65535), comma-separated")
        return [int(w) for w in words]
    return words


def _assignments(items: list[str]) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"{item[:64]!r}: write KEY=VALUE (e.g. min_score=70)")
        value = setting_value(key.strip(), text.strip())
        if isinstance(value, tuple):  # a gpu-kill threshold: (our key, value)
            key, value = value
        changes[key.strip()] = value
    return changes


def settings_text(s: AuditSettings) -> str:
    from gpukill.units import format_duration, format_size

    def listed(values: tuple) -> str:
        return ", ".join(map(str, values)) or "(none)"

    rows = [
        ["idle_after", f"{s.idle_after:g}", f"idle holder after {format_duration(s.idle_after)} at 0%"],
        ["idle_min_memory", str(s.idle_min_memory), f"{format_size(s.idle_min_memory)} held at least"],
        ["abuser_window", f"{s.abuser_window:g}", f"users compared over {format_duration(s.abuser_window)}"],
        ["abuser_share", f"{s.abuser_share:g}", "percent of the GPU memory or time: an abuser"],
        ["pool_ports", listed(s.pool_ports), "mining pools' ports"],
        ["min_score", f"{s.min_score:g}", "AuditRogue reports findings of at least this score"],
        ["allowed_users", listed(s.allowed_users), "never reported (rogue_score 0)"],
        ["allowed_processes", listed(s.allowed_processes), "executables never reported (rogue_score 0)"],
    ]
    return table(["SETTING", "VALUE", "MEANING"], rows)  # every cell escaped (an entry is printable already)


async def cmd_audit(client: ClientAPI, args: argparse.Namespace) -> int:
    if getattr(args, "audit_command", None) == "settings":
        return await _settings(client, args)
    thresholds: dict[str, Any] = {}
    for key, _, _, _ in PER_CALL:
        if getattr(args, key, None) is not None:
            thresholds[key] = getattr(args, key)  # typed by _setting_type
    findings = await client.audit_rogue(thresholds or None)
    if args.json:
        json.dump({"format": JSON_FORMAT, "findings": [to_plain(f) for f in findings]}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(findings_text(findings))
    return EXIT_OK


async def _settings(client: ClientAPI, args: argparse.Namespace) -> int:
    command = args.settings_command or "show"
    if command == "show":
        settings = await client.audit_settings()
        if getattr(args, "json", False):
            json.dump({"settings": to_plain(settings)}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            print(settings_text(settings))
        return EXIT_OK
    if command == "export":
        text = await client.export_audit_settings()
        if args.file is None:
            sys.stdout.write(text)
            return EXIT_OK
        try:
            with open(args.file, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            return _fail(f"cannot write {args.file}: {e.strerror or e}", EXIT_FAILURE)
        return EXIT_OK
    text = ""
    changes: dict[str, Any] = {}
    if command == "import" and getattr(args, "text", None) is not None:
        text = args.text  # the file read and converted already (gpukill: gpu-kill's rogue configuration)
    elif command == "import":
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read(1 << 20)
        except (OSError, UnicodeDecodeError) as e:
            return _fail(f"cannot read {args.file}: {getattr(e, 'strerror', None) or e}", EXIT_FAILURE)
    elif command == "set":
        try:
            changes = _assignments(args.assignments)
        except ValueError as e:
            return _fail(f"audit settings set: {e}")
    else:  # allow-/disallow- a process or a user: the list in force with the entry added or taken out
        current = await client.audit_settings()
        key = "allowed_processes" if command.endswith("process") else "allowed_users"
        entries = list(getattr(current, key))
        if command.startswith("allow"):
            entries += [] if args.entry in entries else [args.entry]
        elif args.entry in entries:
            entries.remove(args.entry)
        else:
            return _fail(f"audit settings {command}: {args.entry!r} is not in {key}")
        changes = {key: entries}
    from ..client.polkit_agent import PolkitAgent

    agent = PolkitAgent()
    try:
        if command == "import":
            settings = await client.import_audit_settings(args.file, text, interactive=agent.active)
        else:
            settings = await client.set_audit_settings(changes, interactive=agent.active)
    finally:
        agent.close()
    print(settings_text(settings))
    return EXIT_OK
