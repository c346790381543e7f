"""gpukillctl audit: the daemon's rogue-activity audit (miners, abusers, idle holders), as a table or JSON.

The audit runs in gpukilld on every sample (gpukilld/rogue.py); this asks for its findings as the caller may
see them. Text from processes (names, what the evidence quotes of a command line) is escaped before it
reaches the terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from gpukill.records import to_plain

from .client_api import ClientAPI
from .exits import EXIT_OK
from .format import shown, size, table

if TYPE_CHECKING:  # annotations only: the audit's records load when `audit` runs, not at every start
    from gpukill.records import Finding

JSON_FORMAT = 1


def register(sub: argparse._SubParsersAction) -> None:
    audit = sub.add_parser("audit", help="rogue activity: crypto miners, GPU hogs, idle memory holders",
                           description="The rogue-activity audit of gpukilld's last sample: each finding with "
                                       "its score (0-100) and the evidence behind it. Of other users' processes "
                                       "only what you may list is shown.")
    audit.add_argument("--json", action="store_true", help="machine-readable output (stable format)")


def _subject(f: Finding) -> str:
    if f.pid is None:
        return f"user {f.user}"
    return f"PID {f.pid} ({f.comm or '?'}, user {f.user})"


def findings_text(findings: list[Finding]) -> str:
    """A table of findings, then each one's evidence."""
    if not findings:
        return "No rogue activity found."
    rows = [[str(f.score), f.kind, _subject(f), ",".join(map(str, f.devices)) or "-", size(f.gpu_memory)]
            for f in findings]
    lines = [table(["SCORE", "KIND", "SUBJECT", "GPU", "MEMORY"], rows), ""]
    for f in findings:
        lines.append(shown(f"{f.kind} {_subject(f)}, score {f.score}:"))
        lines.extend(shown(f"  +{e.points} {e.rule}: {e.detail}") for e in f.evidence)
    return "\n".join(lines)


async def cmd_audit(client: ClientAPI, args: argparse.Namespace) -> int:
    findings = await client.audit_rogue()
    if args.json:
        json.dump({"format": JSON_FORMAT, "findings": [to_plain(f) for f in findings]}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(findings_text(findings))
    return EXIT_OK
