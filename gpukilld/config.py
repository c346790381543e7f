"""/etc/gpukill/gpukilld.conf: INI, as admins expect of a daemon's .conf file.

    [daemon]
    sample_interval = 1.0            # seconds between samples
    backends = auto                  # or a list: nvidia, drm, simulated
    simulate = /etc/gpukill/simulate.yaml   # simulated GPUs (hosts without any, demos, tests)

    [paths]                          # where the kernel's trees are: for containers and test fixtures
    proc = /proc
    sys = /sys
    debugfs = /sys/kernel/debug

    [guard]                          # Guard Mode (docs/guard.md)
    policy_dir = /etc/gpukill/guard.d   # *.yaml read in name order, again on reload
    state_dir = /var/lib/gpukill     # enabled, dry run, counters and the policy in force, across restarts
    protect_system_users = yes       # uids up to SYS_UID_MAX of /etc/login.defs (999): invisible to Guard
    protected_units = dbus.service systemd-*.service ...   # system units invisible to Guard; empty: none

    [audit]                          # the rogue-activity audit (AuditRogue, docs/audit.md)
    idle_after = 1800                # seconds of GPU memory held at 0% utilization: an idle holder
    idle_min_memory = 256MiB         # less than this held idle is not reported
    abuser_window = 3600             # seconds over which users' shares of GPU memory and time are compared
    abuser_share = 80                # percent of the memory (or time) used in the window: an abuser
    pool_ports = 3333 4444 5555 ...  # TCP ports of mining pools; empty: none. Ports inside the host's
                                     # ephemeral range (net.ipv4.ip_local_port_range) are ignored, logged
    min_score = 0                    # AuditRogue reports findings of at least this score (not Guard's rogue_score)
    allowed_users =                  # user names never reported (Guard's rogue_score reads 0 for them)
    allowed_processes =              # executables (absolute paths, root's) whose processes are never reported

    gpukilld.conf.d/50-audit.conf, beside this file, is read after it: the [audit] keys that gpukillctl audit
    settings (SetAuditSettings, ImportAuditSettings) wrote, which win over these (gpukilld/audit_settings.py).

    [notify]                         # where guard e-mail goes: a relay that delivers onwards (postfix, ...)
    smtp_host = localhost
    smtp_port = 25
    from = gpukilld@HOSTNAME
    timeout = 10                     # seconds per delivery attempt (SMTP or webhook); 3 attempts
    owner_mail =                     # notify target `owner`: its mail address, {user} (or {uid}) filled in:
                                     # {user}@example.org, or {user} for the relay's local delivery; empty: no mail
    owner_mesg = respect             # ignore: warn on the owner's terminals even where they said `mesg n`

    [usage]                          # GPU usage accounting (gpukillctl usage)
    enabled = yes                    # no: nothing is accounted, GetUsage answers NotSupported
    keep_days = 400                  # the store's records older than this are deleted, once a day

Command-line options win over the file. A missing file is fine (defaults); a broken one is an error that
names the file and line.
"""

from __future__ import annotations

import configparser
import dataclasses
import logging
import math
import re
from dataclasses import dataclass

from gpukill.errors import ConfigError
from gpukill.records.audit import (  # noqa: F401  (the daemon's names for them)
    DEFAULT_POOL_PORTS,
    AuditSettings,
)
from gpukill.units import parse_duration

from . import audit_settings
from .audit_settings import ephemeral_range, outside_range

log = logging.getLogger("gpukilld")
DEFAULT_PATH = "/etc/gpukill/gpukilld.conf"
MIN_INTERVAL, MAX_INTERVAL = 0.05, 3600.0
LOGIN_DEFS = "/etc/login.defs"
SYS_UID_MAX = 999  # shadow's and systemd's default when login.defs does not say
# System units whose death takes the machine down or locks people out; Guard never touches their processes.
# Matched against the unit under /system.slice only (model.Attribution.system_unit), which users cannot forge.
DEFAULT_PROTECTED_UNITS = (
    "dbus.service", "dbus-broker.service", "systemd-*.service", "polkit.service", "gpukilld.service",
    "display-manager.service", "gdm.service", "gdm3.service", "sddm.service", "lightdm.service",
    "ssh.service", "sshd.service", "getty@*.service", "serial-getty@*.service",
)
_UNIT_PATTERN = re.compile(r"[A-Za-z0-9:_.@\\*?\[\]-]*(?:\.service|\.scope|\*)")  # a unit name, or a pattern of one


@dataclass(frozen=True, slots=True)
class Config:
    sample_interval: float = 1.0
    simulate: str | None = None
    backends: tuple[str, ...] | None = None  # None: auto
    proc_root: str = "/proc"
    sys_root: str = "/sys"
    debugfs_root: str = "/sys/kernel/debug"
    guard_policy_dir: str = "/etc/gpukill/guard.d"
    guard_state_dir: str = "/var/lib/gpukill"
    smtp_host: str = "localhost"
    smtp_port: int = 25
    mail_from: str = ""  # "": gpukilld@HOSTNAME
    notify_timeout: float = 10.0
    owner_mail: str = ""  # [notify] owner_mail: "{user}@example.org"; "": the owner target sends no mail
    owner_mesg: bool = True  # [notify] owner_mesg = respect | ignore: a terminal's mesg n
    sys_uid_max: int = SYS_UID_MAX  # the last system account's uid, from login.defs (read by load_config)
    guard_protect_system_users: bool = True
    guard_protected_units: tuple[str, ...] = DEFAULT_PROTECTED_UNITS
    audit: AuditSettings = AuditSettings()
    usage_enabled: bool = True
    usage_keep_days: int = 400

    @property
    def guard_protected_uid_max(self) -> int | None:
        """Uids up to this are invisible to Guard; None: none are, for being system accounts."""
        return self.sys_uid_max if self.guard_protect_system_users else None


_KNOWN = {"daemon": {"sample_interval", "simulate", "backends"}, "paths": {"proc", "sys", "debugfs"},
          "guard": {"policy_dir", "state_dir", "protect_system_users", "protected_units"},
          "notify": {"smtp_host", "smtp_port", "from", "timeout", "owner_mail", "owner_mesg"},
          "audit": set(audit_settings.KEYS), "usage": {"enabled", "keep_days"}}
MAX_KEEP_DAYS = 36500  # a century: past it, a typo


def read_sys_uid_max(path: str = LOGIN_DEFS) -> int:
    """SYS_UID_MAX from login.defs (the last one set, as shadow's getdef reads it); 999 if absent or unreadable."""
    value = SYS_UID_MAX
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                words = line.split()
                if len(words) >= 2 and words[0] == "SYS_UID_MAX" and words[1].isdigit():
                    value = int(words[1])
    except OSError:
        pass
    return value


def backends_problem(names: tuple[str, ...]) -> str | None:
    """Why these backends cannot run together, or None. Fake GPUs listed, indexed, killed for and "reset" next
    to real ones would be a demo setting that reaches production unnoticed."""
    if "simulated" in names and len(names) > 1:
        return (f"backends = {', '.join(names)}: the simulated backend cannot be combined with real backends; "
                "use `simulated` alone (or `auto` with simulate = FILE), or only real ones")
    return None


def check_interval(value: float, where: str) -> float:
    if math.isnan(value) or not (MIN_INTERVAL <= value <= MAX_INTERVAL):
        raise ConfigError(f"{where}: sample_interval must be between {MIN_INTERVAL} and {MAX_INTERVAL:g} seconds")
    return value


def _line_of(path: str, section: str, key: str) -> int | None:
    """configparser forgets line numbers; find the key's line so the error can point at it."""
    current = None
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                s = line.strip()
                if s.startswith("[") and s.endswith("]"):
                    current = s[1:-1].strip()
                elif current == section and s.split("=", 1)[0].split(":", 1)[0].strip() == key:
                    return n
    except OSError:
        pass
    return None


def load_config(path: str, required: bool = False) -> Config:
    parser = configparser.ConfigParser(inline_comment_prefixes=("#", ";"), interpolation=None)
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f, source=path)
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: no such file") from None
        return Config(sys_uid_max=read_sys_uid_max(), audit=_audit_dropin(path, AuditSettings()))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except configparser.Error as e:
        first = str(e).splitlines()[0]
        line = getattr(e, "lineno", None)
        raise ConfigError(f"{path}:{line}: {first}" if line else f"{path}: {first}") from None

    for section in parser.sections():
        if section not in _KNOWN:
            raise ConfigError(f"{path}: unknown section [{section}] (known: {', '.join(_KNOWN)})")
        for key in parser[section]:
            if key not in _KNOWN[section]:
                where = f"{path}:{_line_of(path, section, key) or '?'}"
                raise ConfigError(f"{where}: unknown key {key!r} in [{section}]")
    values: dict[str, object] = {}
    if parser.has_option("daemon", "sample_interval"):
        where = f"{path}:{_line_of(path, 'daemon', 'sample_interval') or '?'}"
        try:
            seconds = parse_duration(parser["daemon"]["sample_interval"])  # 0.5, 500ms, 2s
        except ValueError as e:
            raise ConfigError(f"{where}: sample_interval: {e}") from None
        values["sample_interval"] = check_interval(seconds, where)
    if parser.has_option("daemon", "simulate"):
        values["simulate"] = parser["daemon"]["simulate"].strip() or None
    if parser.has_option("daemon", "backends"):
        names = tuple(n.strip() for n in parser["daemon"]["backends"].replace(",", " ").split())
        if names and names != ("auto",):
            if (why := backends_problem(names)) is not None:
                raise ConfigError(f"{path}:{_line_of(path, 'daemon', 'backends') or '?'}: {why}")
            values["backends"] = names
    for key, field in (("proc", "proc_root"), ("sys", "sys_root"), ("debugfs", "debugfs_root")):
        if parser.has_option("paths", key):
            values[field] = parser["paths"][key].strip()
    for key, field in (("policy_dir", "guard_policy_dir"), ("state_dir", "guard_state_dir")):
        if parser.has_option("guard", key):
            if not (value := parser["guard"][key].strip()):
                raise ConfigError(f"{path}:{_line_of(path, 'guard', key) or '?'}: {key} must not be empty")
            values[field] = value
    values.update(_protection(parser, path))
    values.update(_usage(parser, path))
    audit = AuditSettings()
    if parser.has_section("audit"):
        with open(path, encoding="utf-8") as f:
            audit = _audit(parser, path, f.read(), audit)
    values["audit"] = _audit_dropin(path, audit)
    if parser.has_option("notify", "smtp_host"):
        values["smtp_host"] = parser["notify"]["smtp_host"].strip() or "localhost"
    if parser.has_option("notify", "from"):
        values["mail_from"] = parser["notify"]["from"].strip()
    if parser.has_option("notify", "owner_mail"):
        values["owner_mail"] = _owner_mail(parser["notify"]["owner_mail"].strip(),
                                           f"{path}:{_line_of(path, 'notify', 'owner_mail') or '?'}")
    if parser.has_option("notify", "owner_mesg"):
        word = parser["notify"]["owner_mesg"].strip()
        if word not in ("respect", "ignore"):
            where = f"{path}:{_line_of(path, 'notify', 'owner_mesg') or '?'}"
            raise ConfigError(f"{where}: owner_mesg is respect or ignore, not {word[:40]!r}")
        values["owner_mesg"] = word == "respect"
    for key, field, kind, low, high in (("smtp_port", "smtp_port", int, 1, 65535),
                                        ("timeout", "notify_timeout", float, 0.1, 300.0)):
        if parser.has_option("notify", key):
            where = f"{path}:{_line_of(path, 'notify', key) or '?'}"
            try:
                number = kind(parser["notify"][key])
            except ValueError:
                raise ConfigError(f"{where}: {key} must be a number") from None
            if not low <= number <= high:  # also rejects NaN
                raise ConfigError(f"{where}: {key} must be between {low} and {high:g}")
            values[field] = number
    return Config(**values)  # type: ignore[arg-type]


def _owner_mail(template: str, where: str) -> str:
    """A template of one address with {user} (and {uid}) in it, e.g. {user}@example.org, or {user} for local
    delivery by the relay."""
    if not template:
        return ""
    rest = template.replace("{user}", "").replace("{uid}", "")
    if "{user}" not in template and "{uid}" not in template:
        raise ConfigError(f"{where}: owner_mail must name the user: {{user}}@DOMAIN (or {{uid}})")
    if not re.fullmatch(r"[A-Za-z0-9._%+-]*(@[A-Za-z0-9.-]+)?", rest) or len(template) > 254:
        raise ConfigError(f"{where}: owner_mail is one address made of {{user}} or {{uid}}, letters, digits, "
                          f"'._%+-' and @DOMAIN, not {template[:80]!r}")
    return template


def _protection(parser: configparser.ConfigParser, path: str) -> dict[str, object]:
    """[guard] protect_system_users (yes/no) and protected_units (unit patterns; empty: none)."""
    values: dict[str, object] = {"sys_uid_max": read_sys_uid_max()}
    if parser.has_option("guard", "protect_system_users"):
        try:
            values["guard_protect_system_users"] = parser.getboolean("guard", "protect_system_users")
        except ValueError:
            where = f"{path}:{_line_of(path, 'guard', 'protect_system_users') or '?'}"
            raise ConfigError(f"{where}: protect_system_users must be yes or no") from None
    if parser.has_option("guard", "protected_units"):
        patterns = tuple(parser["guard"]["protected_units"].replace(",", " ").split())
        for pattern in patterns:
            if not _UNIT_PATTERN.fullmatch(pattern):
                where = f"{path}:{_line_of(path, 'guard', 'protected_units') or '?'}"
                raise ConfigError(f"{where}: protected_units: {pattern!r} is not a unit name or pattern "
                                  "(e.g. dbus.service, getty@*.service)")
        values["guard_protected_units"] = patterns
    return values


def _usage(parser: configparser.ConfigParser, path: str) -> dict[str, object]:
    """[usage] enabled (yes/no) and keep_days (whole days, 1 to MAX_KEEP_DAYS)."""
    values: dict[str, object] = {}
    if parser.has_option("usage", "enabled"):
        try:
            values["usage_enabled"] = parser.getboolean("usage", "enabled")
        except ValueError:
            where = f"{path}:{_line_of(path, 'usage', 'enabled') or '?'}"
            raise ConfigError(f"{where}: enabled must be yes or no") from None
    if parser.has_option("usage", "keep_days"):
        where = f"{path}:{_line_of(path, 'usage', 'keep_days') or '?'}"
        text = parser["usage"]["keep_days"].strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 6 and 1 <= int(text) <= MAX_KEEP_DAYS):
            raise ConfigError(f"{where}: keep_days must be a whole number of days between 1 and {MAX_KEEP_DAYS}")
        values["usage_keep_days"] = int(text)
    return values


def _audit(parser: configparser.ConfigParser, path: str, text: str, base: AuditSettings) -> AuditSettings:
    """[audit]: the rogue-activity audit's settings (gpukilld/rogue/score.py), each checked with its line, over base."""
    section = parser["audit"]
    values: dict[str, object] = {}
    for key in section:
        try:
            values[key] = audit_settings.parse_value(key, section[key])
        except ValueError as e:
            raise ConfigError(f"{path}:{audit_settings.line_of(text, 'audit', key) or '?'}: {e}") from None
    if "pool_ports" in values:
        ports = tuple(dict.fromkeys(values["pool_ports"]))  # type: ignore[call-overload]
        if not all(1 <= p <= 65535 for p in ports):
            raise ConfigError(f"{path}:{audit_settings.line_of(text, 'audit', 'pool_ports') or '?'}: "
                              "pool_ports must be TCP ports (1 to 65535)")
        span = ephemeral_range()
        usable = outside_range(ports, span)
        if span is not None and len(usable) < len(ports):
            inside = ", ".join(str(p) for p in ports if p not in usable)
            log.warning("%s:%s: pool_ports %s ignored: inside the ephemeral port range %d-%d "
                        "(net.ipv4.ip_local_port_range), where any client's source port may lie",
                        path, audit_settings.line_of(text, "audit", "pool_ports") or "?", inside, *span)
        values["pool_ports"] = usable
    return dataclasses.replace(base, **values)  # type: ignore[arg-type]


def _audit_dropin(path: str, base: AuditSettings) -> AuditSettings:
    """gpukilld.conf.d/50-audit.conf over gpukilld.conf's [audit]: what admins set with gpukillctl audit settings.
    Only an [audit] section belongs there; a broken file is an error naming its line, as gpukilld.conf's are."""
    dropin = audit_settings.dropin_path(path)
    try:
        with open(dropin, encoding="utf-8") as f:
            text = f.read(audit_settings.MAX_TEXT + 1)
    except FileNotFoundError:
        return base
    except OSError as e:
        raise ConfigError(f"{dropin}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{dropin}: not UTF-8 text") from None
    try:
        audit_settings.parse_text(dropin, text, imported=False)  # checked whole: only [audit], known keys
    except ValueError as e:
        raise ConfigError(str(e)) from None
    parser = configparser.ConfigParser(inline_comment_prefixes=("#", ";"), interpolation=None)
    parser.read_string(text, source=dropin)
    return _audit(parser, dropin, text, base)
