"""The rogue-activity audit's settings as admins manage them: checked, kept, exported, imported, applied.

Where they are kept: gpukilld.conf's [audit] section, then the daemon's own file beside it,
gpukilld.conf.d/50-audit.conf (/etc/gpukill/gpukilld.conf.d/50-audit.conf), read after it by load_config
(gpukilld/config.py), at start and on reload. SetAuditSettings and ImportAuditSettings write that file (whole,
atomically: every key, in the canonical form of export_text, so that it is exactly what ExportAuditSettings
says and `diff` against an export shows what changed); its keys win over gpukilld.conf's. Delete it (and
reload) to go back to gpukilld.conf's [audit].

Every value a caller sends is checked here (check_value): types, ranges, list sizes (MAX_ENTRIES entries of at
most MAX_ENTRY characters), names as printable text without blanks. A change that fails any check changes
nothing. An allowed process is named by its executable's absolute path, never by a name: a process chooses
its own name (comm, argv[0], the file name of a copy), so a miner could take any name an allow-list holds
(gpukilld/rogue/trusted_exe.py says how a process is recognised as running that executable).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import posixpath
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from gpukill.errors import GpukillError, InvalidArgs
from gpukill.records.audit import AUDIT_DURATIONS, AuditSettings
from gpukill.records.base import names

from .files import replace_file
from .ini import IniText

KEYS = names(AuditSettings)
# The keys AuditRogueWith takes for one scan, and why the others cannot be (refused in one line, never dropped).
PER_CALL_KEYS = ("min_score", "idle_after", "idle_min_memory", "abuser_share")
NOT_PER_CALL = {
    "abuser_window": "the users' history is kept for the configured abuser_window only",
    "pool_ports": "connections are read for the configured pool_ports only (sock_diag, on a budget)",
    "allowed_users": "allow-lists are the site's, not a scan's: change them with SetAuditSettings",
    "allowed_processes": "allow-lists are the site's, not a scan's: change them with SetAuditSettings",
}
MAX_ENTRIES = 256  # per allow-list, and pool ports
MAX_ENTRY = 255  # characters of a user name or an executable's path
MAX_TEXT = 256 << 10  # bytes of an imported text: every list full is ~130 KiB
DAY = 86400.0
_NUMBERS = {
    "idle_after": (0.0, 30 * DAY, "seconds"),
    "abuser_window": (1.0, 7 * DAY, "seconds"),
    "abuser_share": (1.0, 100.0, "percent"),
    "min_score": (0.0, 100.0, "points"),
}
_FORBIDDEN = set(" \t,#;=")  # separators and comment marks of the [audit] text: never inside one entry
DROPIN_NAME = "50-audit.conf"
# Seconds a change waits for a sample made with it before it returns anyway (well inside clients' 25 s timeout):
# with samples further apart, the findings follow at the next sample.
APPLY_WAIT = 15.0
HEADER = (
    "# The rogue-activity audit's settings, written by gpukilld (gpukillctl audit settings); read after\n"
    "# gpukilld.conf, whose [audit] keys these replace. Delete this file and reload to use gpukilld.conf's.\n"
)


# Which pool ports can say anything about a connection. Here, beside the check of pool_ports, and not with the
# sockets they are read from (gpukilld/rogue/sockets.py): the configuration (config.py) applies the same rule
# and sits below the audit.
def ephemeral_range(proc_root: str = "/proc") -> tuple[int, int] | None:
    """net.ipv4.ip_local_port_range (the ports connect() picks local ports from; IPv6 uses it too)."""
    try:
        with open(f"{proc_root}/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(w) for w in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return (low, high) if 0 < low <= high <= 65535 else None


def outside_range(ports: Iterable[int], span: tuple[int, int] | None) -> tuple[int, ...]:
    """The ports that are not local ports connect() may pick: a pool port inside that range is also the source
    port of some client of every busy server, so it says nothing."""
    return tuple(p for p in ports if span is None or not span[0] <= p <= span[1])


def dropin_path(conf_path: str) -> str:
    """Where the daemon keeps the settings admins change over D-Bus: gpukilld.conf.d/ beside gpukilld.conf."""
    return f"{conf_path}.d/{DROPIN_NAME}"


def check_value(key: str, value: Any) -> Any:
    """The value in the record's type, or ValueError saying what is wrong, in one line."""
    if key in _NUMBERS:
        low, high, unit = _NUMBERS[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number of {unit}")
        if math.isnan(value) or not low <= value <= high:
            raise ValueError(f"{key} must be between {low:g} and {high:g} {unit}")
        return float(value)
    if key == "idle_min_memory":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 60:
            raise ValueError("idle_min_memory must be a size in bytes, 0 to 1 EiB")
        return value
    if key == "pool_ports":
        ports = _entries(key, value, int)
        if any(isinstance(p, bool) or not 1 <= p <= 65535 for p in ports):
            raise ValueError("pool_ports must be TCP ports (1 to 65535)")
        span = ephemeral_range()
        inside = [p for p in ports if span[0] <= p <= span[1]] if span is not None else []
        if span is not None and inside:
            raise ValueError(
                f"pool_ports: {inside[0]} lies inside the ephemeral port range {span[0]}-{span[1]} "
                "(net.ipv4.ip_local_port_range), where any client's source port may lie"
            )
        return ports
    if key == "allowed_users":
        users = _entries(key, value, str)
        for user in users:
            _check_text(key, user)
        return users
    if key == "allowed_processes":
        paths = _entries(key, value, str)
        for path in paths:
            _check_text(key, path)
            if not path.startswith("/"):
                raise ValueError(
                    f"allowed_processes: {path[:64]!r} is not an absolute path: a process chooses its "
                    "own name, so an allowed process is named by its executable (e.g. "
                    "/usr/bin/python3), owned by root"
                )
            if posixpath.normpath(path) != path:
                raise ValueError(
                    f"allowed_processes: {path[:64]!r} is not a normalized path "
                    f"(write {posixpath.normpath(path)[:64]!r})"
                )
        return paths
    raise ValueError(f"unknown audit setting {key[:64]!r} (known: {', '.join(KEYS)})")


def _entries(key: str, value: Any, kind: type) -> tuple:
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise ValueError(f"{key} must be a list")
    if len(value) > MAX_ENTRIES:
        raise ValueError(f"{key} has {len(value)} entries; at most {MAX_ENTRIES}")
    if not all(isinstance(v, kind) for v in value):
        raise ValueError(f"{key} must be a list of {'numbers' if kind is int else 'strings'}")
    return tuple(dict.fromkeys(value))  # repeated entries once, in their first place


def _check_text(key: str, text: str) -> None:
    if not text or len(text) > MAX_ENTRY:
        raise ValueError(f"{key}: an entry must have 1 to {MAX_ENTRY} characters")
    if not text.isprintable() or _FORBIDDEN & set(text):
        raise ValueError(f"{key}: {text[:64]!r} must be printable text without blanks, ',', '#', ';' or '='")


def checked(changes: dict[str, Any], keys: tuple[str, ...] = KEYS, *, where: str = "setting") -> dict[str, Any]:
    """Every change checked (InvalidArgs, one line, at the first bad one); nothing is applied here."""
    if len(changes) > len(KEYS):
        raise InvalidArgs(f"{len(changes)} settings given; there are {len(KEYS)}")
    out = {}
    for key, value in changes.items():
        if key not in keys:
            why = NOT_PER_CALL.get(key) if keys is PER_CALL_KEYS else None
            if why:
                raise InvalidArgs(f"{key} cannot be set for one scan: {why}")
            raise InvalidArgs(f"unknown audit {where} {shown_key(key)} (known: {', '.join(keys)})")
        try:
            out[key] = check_value(key, value)
        except ValueError as e:
            raise InvalidArgs(str(e)) from None
    return out


def shown_key(key: str) -> str:
    return repr(key[:64])


# -- the [audit] text ----------------------------------------------------------------------------------------


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def value_text(key: str, value: Any) -> str:
    """One setting as the [audit] section writes it."""
    if key == "idle_min_memory":
        from gpukill.units import exact_size

        return exact_size(value)
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    return _number(value)


def export_text(settings: AuditSettings) -> str:
    """The settings as an [audit] section, every key in the record's order: canonical, so that
    export_text(import(export_text(s))) is export_text(s), byte for byte."""
    lines = [f"{key} = {value_text(key, getattr(settings, key))}".rstrip() for key in KEYS]
    return HEADER + "[audit]\n" + "\n".join(lines) + "\n"


def parse_value(key: str, raw: str) -> Any:
    """A setting from its text in an [audit] section (ValueError, one line)."""
    from gpukill.units import parse_duration, parse_size

    raw = raw.strip()
    if key in AUDIT_DURATIONS:
        try:
            return check_value(key, parse_duration(raw))
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    if key in _NUMBERS:
        try:
            number = float(raw)
        except ValueError:
            raise ValueError(f"{key} must be a number of {_NUMBERS[key][2]}") from None
        return check_value(key, number)
    if key == "idle_min_memory":
        try:  # a bare number is bytes, as gpukilld.conf has always read it; a unit as everywhere else
            return check_value(key, parse_size(raw, bare=1))
        except ValueError as e:
            raise ValueError(f"idle_min_memory: {e}") from None
    if key in ("pool_ports", "allowed_users", "allowed_processes"):
        words = raw.replace(",", " ").split()
        if key == "pool_ports":
            if not all(w.isdigit() and len(w) <= 5 for w in words):
                raise ValueError("pool_ports must be TCP ports (1 to 65535)")
            return tuple(int(w) for w in words)  # the ephemeral range is the caller's to apply (see config.py)
        return check_value(key, words)
    raise ValueError(f"unknown key {key[:64]!r} in [audit] (known: {', '.join(KEYS)})")


def parse_text(name: str, text: str, *, imported: bool = True) -> dict[str, Any]:
    """The settings an [audit] text names (an import, or a file of ours: imported=False), each checked:
    ValueError "NAME:LINE: what" at the first problem. Nothing but an [audit] section may be in it. An import's
    pool ports must lie outside the ephemeral range; a file's that do are left out by load_config, logged (the
    range is a sysctl, which may change under a file written before)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT:
        raise ValueError(f"{name}: larger than {MAX_TEXT >> 10} KiB")
    parsed = IniText(name, text)
    parser = parsed.parser
    for section in parser.sections():
        if section != "audit":
            raise ValueError(
                f"{name}:{_section_line(text, section)}: unknown section [{section[:64]}] (only [audit] belongs here)"
            )
    if not parser.has_section("audit"):
        raise ValueError(f"{name}:1: no [audit] section")
    values = {}
    for key in parser["audit"]:
        where = parsed.where("audit", key)
        if key not in KEYS:
            raise ValueError(f"{where}: unknown key {key[:64]!r} in [audit] (known: {', '.join(KEYS)})")
        try:
            values[key] = parse_value(key, parser["audit"][key])
            if key == "pool_ports" and imported:
                values[key] = check_value(key, values[key])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return values


def _section_line(text: str, section: str) -> int | str:
    return next((n for n, line in enumerate(text.splitlines(), 1) if line.strip() == f"[{section}]"), "?")


def write_atomically(path: str, text: str) -> None:
    """The whole file or none of it (gpukilld/files.py), readable by all as gpukilld.conf is: anyone may see what
    the audit uses."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
        os.chmod(folder, 0o755)  # the unit's UMask=0077 would hide it: the settings are for everyone to read
    replace_file(path, text, 0o644)


class SettingsFailed(GpukillError):
    """The settings could not be written: nothing changed."""


# -- the keeper: what SetAuditSettings and ImportAuditSettings change ---------------------------------------------


class AuditSettingsKeeper:
    """The settings in force (the audit's, RogueWatch.settings), and their changes: written to the file first, then
    applied, then audited; a change returns once a sample's findings were made with it (or after a bound), so the
    next AuditRogue reflects it. One change at a time."""

    def __init__(
        self,
        path: str,
        watch: Any,
        auditor: Any,
        resample: Callable[[], Awaitable[Any]] | None = None,
        samples: int = 4,
    ) -> None:
        self.path = path
        self.watch = watch  # rogue/watch.py RogueWatch: .settings, .made_with
        self._auditor = auditor
        self._resample = resample
        self._samples = samples
        self._lock = asyncio.Lock()

    @property
    def current(self) -> AuditSettings:
        return self.watch.settings

    async def change(
        self,
        changes: dict[str, Any],
        *,
        operation: str,
        caller_uid: int,
        caller_pid: int | None,
        source: str | None = None,
    ) -> AuditSettings:
        """Apply checked changes (checked() or parse_text()): the file, then the audit, then the journal."""
        async with self._lock:
            new = dataclasses.replace(self.current, **changes)
            text = export_text(new)
            try:
                await asyncio.to_thread(write_atomically, self.path, text)
            except OSError as e:
                why = f"cannot write {self.path}: {e.strerror or e}"
                self._auditor.log(
                    _kind(),
                    f"Audit settings not changed ({operation}) for uid {caller_uid}: {why}",
                    operation=operation,
                    result="failed",
                    error=why,
                    file=self.path,
                    caller_uid=caller_uid,
                    caller_pid=caller_pid,
                    source=source,
                )
                raise SettingsFailed(f"{why}; the settings in force are unchanged") from None
            self.watch.settings = new
            listed = ", ".join(f"{k}={value_text(k, v)}" for k, v in changes.items())
            self._auditor.log(
                _kind(),
                f"Audit settings changed ({operation}) by uid {caller_uid}: {listed[:2048] or 'nothing'}",
                operation=operation,
                result="changed",
                keys=" ".join(changes) or None,
                file=self.path,
                caller_uid=caller_uid,
                caller_pid=caller_pid,
                source=source,
                settings=text,
            )
            await self._applied(new)
            return new

    async def _applied(self, settings: AuditSettings) -> None:
        """Wait (not holding the loop) for a snapshot whose findings were made with these settings."""
        if self._resample is None or not self.watch.made_with:
            return  # the audit has not run yet: its first round uses them
        deadline = asyncio.get_running_loop().time() + APPLY_WAIT
        for _ in range(self._samples):
            try:
                left = deadline - asyncio.get_running_loop().time()
                snap = await asyncio.wait_for(self._resample(), max(left, 0.0))
            except (GpukillError, TimeoutError):
                return  # samples far apart, or a sampler stuck: the settings are in force from its next round
            if any(found is snap.findings and used is settings for found, used in list(self.watch.made_with)):
                return


def _kind() -> Any:
    from . import journal

    return journal.AUDIT_SETTINGS
