"""The guard engine's clocks across a daemon restart: duration windows, grace periods, cooldowns, resets.

A restart (an upgrade, or one a user managed to provoke) must not buy a violating process time, nor count
its violation twice. So what the engine times is kept in the guard's state file (state.py, the "clocks"
section) and given back to the engine at start:

- duration windows (rule, condition, subject -> since), the episodes (a subject violating a rule: when it
  began, when its grace ends, whether a kill was ordered, the owner's postponements; an episode also says
  its violation was counted in `triggers`, so it is not counted again), the cooldowns after a kill, and each
  device's resets of the last hour (max_resets_per_hour).
- The engine measures on CLOCK_MONOTONIC, which does not count a suspend; on disk each instant is written on
  CLOCK_BOOTTIME, which counts from the boot whatever the daemon does, with the boot id
  (/proc/sys/kernel/random/boot_id). At load an instant is put back on the monotonic clock as it is then, so
  the time the daemon was down counts: a grace that would have ended while it was down ends at its first
  evaluation. Clocks saved in another boot are dropped (processes and their start times are another boot's).
- A process subject is (pid, start time): an entry whose process is gone at load (no such PID, or another
  start time: the PID was reused) is dropped. Users (uid) and devices (id) stay; the next evaluation ends
  what no longer holds, as it would have without the restart.
- The checkpoint signals sent when a kill rule's grace began (runner.py, acts/checkpoint.py Asked: process,
  signal, wait, when sent), so that the kill after a restart still waits for what is left of the declared wait
  before SIGTERM. Each is given back while its process runs, whatever became of the rule: its kill, if one
  comes, decides. They are timed on the real CLOCK_MONOTONIC (the kill path's), not the engine's clock.
- A rule's clocks are given back only to a rule of the same name that means the same: the same fingerprint
  and global exemptions, the test a reload applies (Engine.set_policy). A rule that changed starts afresh.

The file is root's, but what is read is still bounded (state.py caps the file's size; here at most
MAX_ENTRIES entries, each checked for its shape): anything else is dropped with one line of warning, never
an error that keeps the daemon from starting.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from gpukill.checkpoint import MAX_CHECKPOINT_WAIT, BadDeclaration, Declaration, parse_signal, signal_name
from gpukill.procstat import read_stat
from gpukill.rules import PER_DEVICE, PER_GROUP, PER_PROCESS, PER_USER

from ..acts.checkpoint import Asked
from .conditions import boot_seconds
from .engine import HOUR, Engine, Episode, RuleState

FORMAT = 1
BOOT_ID = "/proc/sys/kernel/random/boot_id"
MAX_ENTRIES = 50_000  # windows, episodes, cooldowns and resets together: a few per GPU process
MAX_LABEL = 512  # an episode's label ("PID 123 (xmrig, user ann)"): comm is 15 bytes, user names are short
MAX_DEVICE_ID = 256
SLACK = 1.0  # seconds an instant may lie ahead of the clock read at load (the two clocks are read apart)
MAX_ASKED = 4096  # checkpoint signals remembered until their kill; the oldest are forgotten past this
MAX_SOURCE = 4096 + 64  # a declaration's source: "policy FILE:LINE:COL", a policy name at most 4096 characters
_KINDS = {PER_PROCESS: "p", PER_USER: "u", PER_DEVICE: "d", PER_GROUP: "g"}  # how a subject's key is written


def boot_id(path: str = BOOT_ID) -> str:
    """This boot's id, or "" where the kernel does not say (then nothing saved is ever given back)."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return ""


def process_alive(root: str = "/proc") -> Callable[[int, int], bool]:
    """Whether (pid, start time) is still the process it was, read from root (gpukilld.conf's proc root)."""

    def alive(pid: int, start_time: int) -> bool:
        stat = read_stat(pid, root)
        return stat is not None and stat.start_time == start_time

    return alive


def rule_mark(st: RuleState) -> str:
    """What a rule means, as a short stable string: the fingerprint a reload compares, and the exemptions of
    the whole policy. Every part is a tuple, string, number, bool or None (patterns by their text), so its
    repr is the same in every process."""
    text = repr((st.rule.fingerprint, st.compiled.exemptions_key))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _key_out(key: Any, scope: str) -> list[Any]:
    if scope == PER_GROUP:  # a group's name, a str as a device's id is
        return ["g", key]
    if isinstance(key, tuple):
        return ["p", key[0], key[1]]
    return ["u", key] if isinstance(key, int) else ["d", key]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63


def _instant(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _postponed_out(ep: Episode) -> dict[str, Any]:
    """An episode's postponements ({} for none): seconds granted, how many, the last reason and who asked."""
    if not ep.postponements:
        return {}
    return {"seconds": ep.postponed, "times": ep.postponements, "reason": ep.postpone_reason, "by": ep.postponed_by}


def _postponed_in(raw: Any, ep: Episode, times: int) -> bool:
    """Puts saved postponements back into the episode; False when they are not of the shape written."""
    if raw == {}:
        return True
    if not isinstance(raw, dict):
        return False
    seconds, count, reason, by = raw.get("seconds"), raw.get("times"), raw.get("reason"), raw.get("by")
    if not (
        isinstance(seconds, int | float)
        and _instant(seconds)
        and seconds >= 0
        and isinstance(count, int)
        and _int(count)
        and count <= times
        and isinstance(reason, str)
        and isinstance(by, str)
        and len(reason) <= MAX_LABEL
        and len(by) <= MAX_LABEL
    ):
        return False
    ep.postponed, ep.postponements, ep.postpone_reason, ep.postponed_by = float(seconds), count, reason, by
    return True


def _asked_offset() -> float:
    """CLOCK_BOOTTIME less the real CLOCK_MONOTONIC now: what puts an Asked's sent_at on the boot's clock."""
    return boot_seconds() - time.monotonic()


def _asked_out(a: Asked, offset: float) -> list[Any]:
    d = a.declaration
    return [a.pid, a.start_time, a.comm, d.signal, d.wait, d.each, d.source, a.wait, a.sent_at + offset]


def save(engine: Engine, boot: str, asked: Iterable[Asked] = ()) -> dict[str, Any]:
    """The engine's clocks as JSON, on CLOCK_BOOTTIME, and the checkpoint signals Guard's kills still await."""
    asked_offset = _asked_offset()
    offset = engine.clock.boottime() - engine.clock.monotonic()
    rules = []
    for st in engine.states:
        rules.append(
            {
                "name": st.rule.name,
                "mark": rule_mark(st),
                "windows": [
                    [index, _key_out(key, st.rule.scope), since + offset]
                    for index, window in st.windows.items()
                    for key, since in window.items()
                ],
                "episodes": [
                    [
                        _key_out(key, st.rule.scope),
                        ep.since + offset,
                        ep.grace_until + offset,
                        ep.label,
                        ep.uid,
                        ep.acted,
                        ep.warned,
                        _postponed_out(ep),
                    ]
                    for key, ep in st.episodes.items()
                ],
                "cooldown": [[_key_out(key, st.rule.scope), until + offset] for key, until in st.cooldown.items()],
                "dry_cooldown": [
                    [_key_out(key, st.rule.scope), until + offset] for key, until in st.dry_cooldown.items()
                ],
            }
        )
    return {
        "format": FORMAT,
        "boot_id": boot,
        "rules": rules,
        "resets": {d: [t + offset for t in ts] for d, ts in engine.resets.items() if ts},
        "dry_resets": {d: [t + offset for t in ts] for d, ts in engine.dry_resets.items() if ts},
        "asked": [_asked_out(a, asked_offset) for a in asked],
    }


class _Reader:
    """Puts saved entries back into the engine, checking each; counts what it dropped and why."""

    def __init__(self, engine: Engine, alive: Callable[[int, int], bool]) -> None:
        self.engine = engine
        self.alive = alive
        self.boot_now = engine.clock.boottime()
        self.mono_now = engine.clock.monotonic()
        self.offset = self.boot_now - self.mono_now
        self.budget = MAX_ENTRIES
        self.restored = 0
        self.gone = 0  # entries of processes gone (or PIDs reused) while the daemon was down
        self.bad = 0  # entries of the wrong shape, past the cap, or of a rule that changed

    def key(self, raw: Any, scope: str) -> Any:
        """The subject's key, or None (counted) when it is malformed, of another scope, or a process gone."""
        if not isinstance(raw, list) or not raw or raw[0] != _KINDS.get(scope):
            self.bad += 1
            return None
        if raw[0] == "p" and len(raw) == 3 and _int(raw[1]) and _int(raw[2]):
            if not self.alive(raw[1], raw[2]):
                self.gone += 1
                return None
            return (raw[1], raw[2])
        if raw[0] == "u" and len(raw) == 2 and _int(raw[1]) and raw[1] < 1 << 32:
            return raw[1]
        if raw[0] in ("d", "g") and len(raw) == 2 and isinstance(raw[1], str) and 0 < len(raw[1]) <= MAX_DEVICE_ID:
            return raw[1]
        self.bad += 1
        return None

    def entries(self, raw: Any, width: int) -> list[list[Any]]:
        """The list's entries of `width` items, within the cap (the rest counted as dropped)."""
        if not isinstance(raw, list):
            return []
        good = [e for e in raw if isinstance(e, list) and len(e) == width]
        self.bad += len(raw) - len(good)
        if len(good) > self.budget:
            self.bad += len(good) - self.budget
            good = good[: self.budget]
        self.budget -= len(good)
        return good

    def past(self, t: Any) -> float | None:
        """A saved instant that has happened (a window's or episode's start), on the monotonic clock now."""
        if not _instant(t) or t > self.boot_now + SLACK:
            self.bad += 1
            return None
        return t - self.offset

    def any_time(self, t: Any) -> float | None:
        """A saved instant, past or to come (the end of a grace or cooldown), on the monotonic clock now."""
        if not _instant(t):
            self.bad += 1
            return None
        return t - self.offset

    def rule(self, st: RuleState, raw: dict[str, Any]) -> None:
        scope = st.rule.scope
        for index, rkey, since in self.entries(raw.get("windows"), 3):
            window = st.windows.get(index) if _int(index) else None
            if window is None:
                self.bad += 1
                continue
            key, t = self.key(rkey, scope), self.past(since)
            if key is not None and t is not None:
                window[key] = t
                self.restored += 1
        episodes = raw.get("episodes")
        if isinstance(episodes, list):  # an older daemon's entries have no count of warnings sent (none were)
            episodes = [e + [0] if isinstance(e, list) and len(e) == 6 else e for e in episodes]
            # nor postponements (none were granted)
            episodes = [e + [{}] if isinstance(e, list) and len(e) == 7 else e for e in episodes]
        for rkey, since, grace_until, label, uid, acted, warned, postponed in self.entries(episodes, 8):
            key, t, until = self.key(rkey, scope), self.past(since), self.any_time(grace_until)
            if key is None or t is None or until is None:
                continue
            if (
                not isinstance(label, str)
                or len(label) > MAX_LABEL
                or not isinstance(acted, bool)
                or not (uid is None or (_int(uid) and uid < 1 << 32))
                or not (_int(warned) and warned <= len(st.rule.warn))
            ):
                self.bad += 1
                continue
            ep = Episode(t, until, label, uid, acted, warned)
            caps = st.rule.postpone
            if not _postponed_in(postponed, ep, caps.times if caps is not None else 0):
                self.bad += 1
                continue
            if isinstance(key, tuple):  # a process's own episode names it before the next evaluation does
                ep.members = frozenset((key,))
            st.episodes[key] = ep
            self.restored += 1
        for name in ("cooldown", "dry_cooldown"):
            cooldowns = getattr(st, name)
            for rkey, until in self.entries(raw.get(name), 2):
                key, t = self.key(rkey, scope), self.any_time(until)
                if key is not None and t is not None and t > self.mono_now:  # not over yet
                    cooldowns[key] = t
                    self.restored += 1

    def resets(self, history: dict[str, list[float]], raw: Any) -> None:
        if not isinstance(raw, dict):
            return
        hour_ago = self.boot_now - HOUR
        for device, times in list(raw.items())[: self.budget]:
            if not isinstance(device, str) or not 0 < len(device) <= MAX_DEVICE_ID or not isinstance(times, list):
                self.bad += 1
                continue
            kept = sorted(
                t - self.offset for t in times[: self.budget] if _instant(t) and hour_ago < t <= self.boot_now + SLACK
            )
            self.budget -= len(kept)
            if kept:
                history[device] = kept
                self.restored += len(kept)


def restore(engine: Engine, data: Any, boot: str, alive: Callable[[int, int], bool]) -> tuple[int, str | None]:
    """Give saved clocks back to the engine (its policy already set). Returns how many entries were given
    back and, where some or all were dropped, one line saying why (for the log)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("rules"), list):
        return 0, "the guard's saved clocks are not in a format this daemon reads: windows and graces start afresh"
    if not boot or data.get("boot_id") != boot:
        saved = data.get("boot_id")
        shown = saved[:40] if isinstance(saved, str) else "none"
        return 0, (f"the guard's saved clocks are from another boot (boot id {shown}): windows and graces start afresh")
    reader = _Reader(engine, alive)
    by_name = {st.rule.name: st for st in engine.states}
    changed = []
    for raw in data["rules"][: len(by_name) + 1]:  # one entry per rule: more is not ours
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            reader.bad += 1
            continue
        st = by_name.pop(raw["name"], None)
        if st is None:
            continue  # the rule is gone from the policy: nothing to give back
        if raw.get("mark") != rule_mark(st):
            changed.append(st.rule.name)
            continue
        reader.rule(st, raw)
    reader.resets(engine.resets, data.get("resets"))
    reader.resets(engine.dry_resets, data.get("dry_resets"))
    notes = []
    if changed:
        notes.append(f"rule(s) {', '.join(changed)[:200]} changed meaning: their clocks start afresh")
    if reader.gone:
        notes.append(f"{reader.gone} entr{'y' if reader.gone == 1 else 'ies'} of processes gone dropped")
    if reader.bad:
        notes.append(f"{reader.bad} malformed or excess entr{'y' if reader.bad == 1 else 'ies'} dropped")
    line = f"guard clocks restored ({reader.restored} entries); " + "; ".join(notes) if notes else None
    return reader.restored, line


def _declaration_in(number: Any, declared: Any, each: Any, source: Any) -> Declaration | None:
    """A saved declaration, checked as the grammar checks one; None when it is not one."""
    if not (_int(number) and _instant(declared) and declared > 0 and isinstance(each, bool)):
        return None
    if not (isinstance(source, str) and 0 < len(source) <= MAX_SOURCE):
        return None
    try:
        parse_signal(signal_name(number))
    except BadDeclaration:
        return None
    return Declaration(number, float(declared), each, source)


def restore_asked(data: Any, boot: str, alive: Callable[[int, int], bool]) -> tuple[list[Asked], str | None]:
    """The checkpoint signals saved with the clocks, on the monotonic clock now, of processes still running;
    nothing from another boot or a format this daemon does not read. Returns them and, where some were
    dropped, one line saying why (for the log)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not boot or data.get("boot_id") != boot:
        return [], None  # restore() says why the clocks were not given back
    raw = data.get("asked")
    entries = raw[-MAX_ASKED:] if isinstance(raw, list) else []
    boot_now, offset = boot_seconds(), _asked_offset()
    out: list[Asked] = []
    gone, bad = 0, (len(raw) - len(entries)) if isinstance(raw, list) else 0
    for e in entries:
        if not (isinstance(e, list) and len(e) == 9):
            bad += 1
            continue
        pid, start_time, comm, number, declared, each, source, wait, sent_at = e
        d = _declaration_in(number, declared, each, source)
        if (
            d is None
            or not (_int(pid) and _int(start_time) and isinstance(comm, str) and len(comm) <= MAX_LABEL)
            or not (_instant(wait) and 0 <= wait <= min(d.wait, MAX_CHECKPOINT_WAIT))
            or not (_instant(sent_at) and sent_at <= boot_now + SLACK)
        ):
            bad += 1
        elif not alive(pid, start_time):
            gone += 1
        else:
            out.append(Asked(pid, start_time, comm, d, float(wait), sent_at - offset))
    notes = []
    if gone:
        notes.append(f"{gone} of processes gone dropped")
    if bad:
        notes.append(f"{bad} malformed or excess dropped")
    line = f"checkpoint signals awaited restored ({len(out)}); " + "; ".join(notes) if notes else None
    return out, line
