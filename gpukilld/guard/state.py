"""What Guard Mode keeps across restarts, in one JSON file under the state directory (/var/lib/gpukill).

Kept: enabled, dry run (and why the daemon keeps it on, where a re-read of guard.d did), per-rule counters,
recent violations, and the policy in force with its source (the guard.d files, or a policy loaded with LoadPolicy,
by whom and when), guard.d's dry_run as last read, what the last re-read of guard.d replaced, and the engine's
clocks (windows, grace periods,
cooldowns, and the checkpoint signals sent at a grace's start that its kill still awaits: the "clocks" section,
written and read by clocks.py, which checks it). Keeping the policy text means a
restart enforces
what was in force before even if a file in guard.d was broken meanwhile. Written atomically (a temporary
file in the same directory, fsync, rename, fsync of the directory): a crash leaves the old file or the new
one, never half of one. The file is 0600: webhook URLs can carry tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..files import read_kept, replace_file

STATE_FILE = "guard-state.json"
FORMAT = 1
MAX_RECENT = 100
# Who loaded the policy, why dry run is kept, what a re-read replaced: sentences the daemon wrote, each with a
# policy name of at most 4096 characters (LoadPolicy's bound) and a few dozen words around it.
MAX_NOTE = 8192
# The policy texts (guard.d holds a few KiB, a loaded policy at most gpukill.policy.MAX_POLICY_BYTES) and the
# clocks (clocks.MAX_ENTRIES, under 100 bytes each): a file past this is not one we wrote, and is not read.
MAX_STATE_BYTES = 32 << 20


@dataclass(slots=True)
class GuardState:
    enabled: bool = True
    dry_run: bool = False
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # rule name -> RuleStats.to_dict()
    recent: list[dict[str, Any]] = field(default_factory=list)  # newest last, at most MAX_RECENT
    policy_source: str = "files"  # "files" (guard.d) or "loaded" (LoadPolicy)
    policy_files: list[tuple[str, str]] = field(default_factory=list)  # (name, text) of the policy in force
    clocks: dict[str, Any] | None = None  # clocks.save()'s form, checked by clocks.restore(); None: none saved
    loaded_by: str = ""  # who loaded the policy in force with LoadPolicy ("alice (uid 1000)"); "" for guard.d's
    loaded_at: float = 0.0  # when, seconds since the epoch
    files_dry_run: bool = False  # guard.d's dry_run as last read: a re-read that turns it off changes dry run
    dry_run_kept: str = ""  # why a re-read of guard.d, not an admin, holds the dry-run switch on
    replaced: str = ""  # the loaded policy the last re-read of guard.d replaced: name, by whom, when
    replaced_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "enabled": self.enabled,
            "dry_run": self.dry_run,
            "stats": self.stats,
            "recent": self.recent[-MAX_RECENT:],
            "policy_source": self.policy_source,
            "policy_files": [list(f) for f in self.policy_files],
            "loaded_by": self.loaded_by,
            "loaded_at": self.loaded_at,
            "files_dry_run": self.files_dry_run,
            "dry_run_kept": self.dry_run_kept,
            "replaced": self.replaced,
            "replaced_at": self.replaced_at,
            **({"clocks": self.clocks} if self.clocks is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Any) -> GuardState:
        """Lenient: a field of the wrong type is left at its default rather than failing the daemon."""
        s = cls()
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if isinstance(data.get("enabled"), bool):
            s.enabled = data["enabled"]
        if isinstance(data.get("dry_run"), bool):
            s.dry_run = data["dry_run"]
        if isinstance(data.get("stats"), dict):
            s.stats = {k: v for k, v in data["stats"].items() if isinstance(k, str) and isinstance(v, dict)}
        if isinstance(data.get("recent"), list):
            s.recent = [r for r in data["recent"] if isinstance(r, dict)][-MAX_RECENT:]
        if data.get("policy_source") in ("files", "loaded"):
            s.policy_source = data["policy_source"]
        files = data.get("policy_files")
        if isinstance(files, list):
            s.policy_files = [
                (f[0], f[1])
                for f in files
                if isinstance(f, list) and len(f) == 2 and all(isinstance(x, str) for x in f)
            ]
        for key in ("loaded_by", "dry_run_kept", "replaced"):
            if isinstance(data.get(key), str):
                setattr(s, key, data[key][:MAX_NOTE])
        for key in ("loaded_at", "replaced_at"):
            if isinstance(data.get(key), (int, float)) and not isinstance(data[key], bool):
                setattr(s, key, float(data[key]))
        if isinstance(data.get("files_dry_run"), bool):
            s.files_dry_run = data["files_dry_run"]
        if isinstance(data.get("clocks"), dict):
            s.clocks = data["clocks"]
        return s


FOLDED_BY = ("rule", "subject", "event", "action", "outcome", "pid", "dry_run")  # what makes a recent event a repeat


def add_recent(recent: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    """Append a recent event (RecentEvent's plain form), newest last, at most MAX_RECENT. One that repeats an
    event kept (the same rule, subject, event, outcome, process and dry run) is folded into it: the kept one
    moves to the end with the new time, the number of times (repeats) and when it first happened (since)."""
    key = tuple(entry.get(k) for k in FOLDED_BY)
    for i in range(len(recent) - 1, -1, -1):
        old = recent[i]
        if tuple(old.get(k) for k in FOLDED_BY) != key:
            continue
        del recent[i]
        n = old.get("repeats")
        n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
        entry = {**entry, "repeats": n + 1}
        for first in (old.get("since"), old.get("time")):  # read leniently: an older daemon's entries have no since
            if isinstance(first, int | float) and not isinstance(first, bool):
                entry["since"] = first
                break
        break
    recent.append(entry)
    del recent[:-MAX_RECENT]


def state_path(directory: str) -> str:
    return os.path.join(directory, STATE_FILE)


def load_state(directory: str) -> tuple[GuardState, str | None]:
    """The saved state, or defaults; the second item says why the saved state could not be used."""
    data, why = read_kept(state_path(directory), MAX_STATE_BYTES)
    if why is not None:
        return GuardState(), f"{why}, starting from defaults"
    return (GuardState() if data is None else GuardState.from_json(data)), None


def save_state(directory: str, state: GuardState) -> None:
    """Write atomically; raises OSError (the caller logs it: the daemon keeps running)."""
    os.makedirs(directory, mode=0o755, exist_ok=True)
    replace_file(state_path(directory), json.dumps(state.to_json(), indent=1, sort_keys=True).encode())
