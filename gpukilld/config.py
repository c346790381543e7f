"""/etc/gpukill/gpukilld.conf: INI, as admins expect of a daemon's .conf file.

    [daemon]
    sample_interval = 1.0            # seconds between samples
    backends = auto                  # or a list: nvidia, drm, simulated
    simulate = /etc/gpukill/simulate.yaml   # simulated GPUs (hosts without any, demos, tests)
    cuda_checkpoint = /usr/bin/cuda-checkpoint   # NVIDIA's utility that suspends a process's GPU state
                                     # (default: looked up in /usr/bin, /usr/local/bin, /usr/local/cuda/bin)
    suspend_host_memory_max = 64GiB  # host memory suspended workloads may hold in all (default: half of it)

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
from gpukill.units import parse_duration, parse_size

from . import audit_settings
from .audit_settings import ephemeral_range, outside_range
from .ini import IniText

log = logging.getLogger("gpukilld")
DEFAULT_PATH = "/etc/gpukill/gpukilld.conf"
MIN_INTERVAL, MAX_INTERVAL = 0.05, 3600.0
LOGIN_DEFS = "/etc/login.defs"
SYS_UID_MAX = 999  # shadow's and systemd's default when login.defs does not say
# System units whose death takes the machine down or locks people out; Guard never touches their processes.
# Matched against the unit under /system.slice only (model.Attribution.system_unit), which users cannot forge.
DEFAULT_PROTECTED_UNITS = (
    "dbus.service",
    "dbus-broker.service",
    "systemd-*.service",
    "polkit.service",
    "gpukilld.service",
    "display-manager.service",
    "gdm.service",
    "gdm3.service",
    "sddm.service",
    "lightdm.service",
    "ssh.service",
    "sshd.service",
    "getty@*.service",
    "serial-getty@*.service",
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
    cuda_checkpoint: str | None = None  # [daemon] cuda_checkpoint; None: looked up (gpukilld/acts/cuda_checkpoint.py)
    suspend_host_memory_max: int | None = None  # bytes; None: half of MemTotal

    @property
    def guard_protected_uid_max(self) -> int | None:
        """Uids up to this are invisible to Guard; None: none are, for being system accounts."""
        return self.sys_uid_max if self.guard_protect_system_users else None


_KNOWN = {
    "daemon": {"sample_interval", "simulate", "backends", "cuda_checkpoint", "suspend_host_memory_max"},
    "paths": {"proc", "sys", "debugfs"},
    "guard": {"policy_dir", "state_dir", "protect_system_users", "protected_units"},
    "notify": {"smtp_host", "smtp_port", "from", "timeout", "owner_mail", "owner_mesg"},
    "audit": set(audit_settings.KEYS),
    "usage": {"enabled", "keep_days"},
}
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
        return (
            f"backends = {', '.join(names)}: the simulated backend cannot be combined with real backends; "
            "use `simulated` alone (or `auto` with simulate = FILE), or only real ones"
        )
    return None


def check_interval(value: float, where: str) -> float:
    if math.isnan(value) or not (MIN_INTERVAL <= value <= MAX_INTERVAL):
        raise ConfigError(f"{where}: sample_interval must be between {MIN_INTERVAL} and {MAX_INTERVAL:g} seconds")
    return value


def load_config(path: str, required: bool = False) -> Config:
    conf = _read(path, required)
    if conf is None:
        return Config(sys_uid_max=read_sys_uid_max(), audit=_audit_dropin(path, AuditSettings()))
    _check_known(conf)
    values: dict[str, object] = {}
    values.update(_daemon(conf))
    values.update(_paths(conf))
    values.update(_guard_dirs(conf))
    values.update(_protection(conf))
    values.update(_usage(conf))
    audit = _audit(conf, AuditSettings()) if conf.parser.has_section("audit") else AuditSettings()
    values["audit"] = _audit_dropin(path, audit)
    values.update(_notify(conf))
    return Config(**values)  # type: ignore[arg-type]  # each value parsed to its field's type


def _read(path: str, required: bool) -> IniText | None:
    """The file, parsed; None when it is missing and need not be there."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: no such file") from None
        return None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    try:
        return IniText(path, text)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_known(conf: IniText) -> None:
    for section in conf.parser.sections():
        if section not in _KNOWN:
            raise ConfigError(f"{conf.name}: unknown section [{section}] (known: {', '.join(_KNOWN)})")
        for key in conf.parser[section]:
            if key not in _KNOWN[section]:
                raise ConfigError(f"{conf.where(section, key)}: unknown key {key!r} in [{section}]")


def _daemon(conf: IniText) -> dict[str, object]:
    """[daemon] sample_interval, simulate, backends, cuda_checkpoint and suspend_host_memory_max."""
    values: dict[str, object] = {}
    if conf.has("daemon", "sample_interval"):
        where = conf.where("daemon", "sample_interval")
        try:
            seconds = parse_duration(conf.get("daemon", "sample_interval"))  # 0.5, 500ms, 2s
        except ValueError as e:
            raise ConfigError(f"{where}: sample_interval: {e}") from None
        values["sample_interval"] = check_interval(seconds, where)
    if conf.has("daemon", "simulate"):
        values["simulate"] = conf.get("daemon", "simulate").strip() or None
    if conf.has("daemon", "backends"):
        names = tuple(n.strip() for n in conf.get("daemon", "backends").replace(",", " ").split())
        if names and names != ("auto",):
            if (why := backends_problem(names)) is not None:
                raise ConfigError(f"{conf.where('daemon', 'backends')}: {why}")
            values["backends"] = names
    if conf.has("daemon", "cuda_checkpoint"):
        path = conf.get("daemon", "cuda_checkpoint").strip()
        if path and not path.startswith("/"):
            raise ConfigError(f"{conf.where('daemon', 'cuda_checkpoint')}: cuda_checkpoint must be an absolute path")
        values["cuda_checkpoint"] = path or None
    if conf.has("daemon", "suspend_host_memory_max"):
        try:  # gpukill.units' size grammar: 64GiB, 512MiB
            values["suspend_host_memory_max"] = parse_size(conf.get("daemon", "suspend_host_memory_max"))
        except ValueError as e:
            raise ConfigError(
                f"{conf.where('daemon', 'suspend_host_memory_max')}: suspend_host_memory_max: {e}"
            ) from None
    return values


def _paths(conf: IniText) -> dict[str, object]:
    """[paths]: where the kernel's trees are."""
    return {
        field: conf.get("paths", key).strip()
        for key, field in (("proc", "proc_root"), ("sys", "sys_root"), ("debugfs", "debugfs_root"))
        if conf.has("paths", key)
    }


def _guard_dirs(conf: IniText) -> dict[str, object]:
    """[guard] policy_dir and state_dir, neither empty."""
    values: dict[str, object] = {}
    for key, field in (("policy_dir", "guard_policy_dir"), ("state_dir", "guard_state_dir")):
        if conf.has("guard", key):
            if not (value := conf.get("guard", key).strip()):
                raise ConfigError(f"{conf.where('guard', key)}: {key} must not be empty")
            values[field] = value
    return values


def _notify(conf: IniText) -> dict[str, object]:
    """[notify]: the relay, the sender, owner_mail's template, owner_mesg, and the port and timeout in range."""
    values: dict[str, object] = {}
    if conf.has("notify", "smtp_host"):
        values["smtp_host"] = conf.get("notify", "smtp_host").strip() or "localhost"
    if conf.has("notify", "from"):
        values["mail_from"] = conf.get("notify", "from").strip()
    if conf.has("notify", "owner_mail"):
        values["owner_mail"] = _owner_mail(conf.get("notify", "owner_mail").strip(), conf.where("notify", "owner_mail"))
    if conf.has("notify", "owner_mesg"):
        word = conf.get("notify", "owner_mesg").strip()
        if word not in ("respect", "ignore"):
            raise ConfigError(
                f"{conf.where('notify', 'owner_mesg')}: owner_mesg is respect or ignore, not {word[:40]!r}"
            )
        values["owner_mesg"] = word == "respect"
    for key, field, kind, low, high in (
        ("smtp_port", "smtp_port", int, 1, 65535),
        ("timeout", "notify_timeout", float, 0.1, 300.0),
    ):
        if conf.has("notify", key):
            where = conf.where("notify", key)
            try:
                number = kind(conf.get("notify", key))
            except ValueError:
                raise ConfigError(f"{where}: {key} must be a number") from None
            if not low <= number <= high:  # also rejects NaN
                raise ConfigError(f"{where}: {key} must be between {low} and {high:g}")
            values[field] = number
    return values


def _owner_mail(template: str, where: str) -> str:
    """A template of one address with {user} (and {uid}) in it, e.g. {user}@example.org, or {user} for local
    delivery by the relay."""
    if not template:
        return ""
    rest = template.replace("{user}", "").replace("{uid}", "")
    if "{user}" not in template and "{uid}" not in template:
        raise ConfigError(f"{where}: owner_mail must name the user: {{user}}@DOMAIN (or {{uid}})")
    if not re.fullmatch(r"[A-Za-z0-9._%+-]*(@[A-Za-z0-9.-]+)?", rest) or len(template) > 254:
        raise ConfigError(
            f"{where}: owner_mail is one address made of {{user}} or {{uid}}, letters, digits, "
            f"'._%+-' and @DOMAIN, not {template[:80]!r}"
        )
    return template


def _protection(conf: IniText) -> dict[str, object]:
    """[guard] protect_system_users (yes/no) and protected_units (unit patterns; empty: none)."""
    values: dict[str, object] = {"sys_uid_max": read_sys_uid_max()}
    if conf.has("guard", "protect_system_users"):
        try:
            values["guard_protect_system_users"] = conf.parser.getboolean("guard", "protect_system_users")
        except ValueError:
            raise ConfigError(
                f"{conf.where('guard', 'protect_system_users')}: protect_system_users must be yes or no"
            ) from None
    if conf.has("guard", "protected_units"):
        patterns = tuple(conf.get("guard", "protected_units").replace(",", " ").split())
        for pattern in patterns:
            if not _UNIT_PATTERN.fullmatch(pattern):
                raise ConfigError(
                    f"{conf.where('guard', 'protected_units')}: protected_units: {pattern!r} is not "
                    "a unit name or pattern (e.g. dbus.service, getty@*.service)"
                )
        values["guard_protected_units"] = patterns
    return values


def _usage(conf: IniText) -> dict[str, object]:
    """[usage] enabled (yes/no) and keep_days (whole days, 1 to MAX_KEEP_DAYS)."""
    values: dict[str, object] = {}
    if conf.has("usage", "enabled"):
        try:
            values["usage_enabled"] = conf.parser.getboolean("usage", "enabled")
        except ValueError:
            raise ConfigError(f"{conf.where('usage', 'enabled')}: enabled must be yes or no") from None
    if conf.has("usage", "keep_days"):
        text = conf.get("usage", "keep_days").strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 6 and 1 <= int(text) <= MAX_KEEP_DAYS):
            raise ConfigError(
                f"{conf.where('usage', 'keep_days')}: keep_days must be a whole number of days "
                f"between 1 and {MAX_KEEP_DAYS}"
            )
        values["usage_keep_days"] = int(text)
    return values


def _audit(conf: IniText, base: AuditSettings) -> AuditSettings:
    """[audit]: the rogue-activity audit's settings (gpukilld/rogue/score.py), each checked with its line, over base."""
    section = conf.parser["audit"]
    values: dict[str, object] = {}
    for key in section:
        try:
            values[key] = audit_settings.parse_value(key, section[key])
        except ValueError as e:
            raise ConfigError(f"{conf.where('audit', key)}: {e}") from None
    if "pool_ports" in values:
        ports = tuple(dict.fromkeys(values["pool_ports"]))  # type: ignore[call-overload]  # ints, as parsed
        if not all(1 <= p <= 65535 for p in ports):
            raise ConfigError(f"{conf.where('audit', 'pool_ports')}: pool_ports must be TCP ports (1 to 65535)")
        span = ephemeral_range()
        usable = outside_range(ports, span)
        if span is not None and len(usable) < len(ports):
            inside = ", ".join(str(p) for p in ports if p not in usable)
            log.warning(
                "%s: pool_ports %s ignored: inside the ephemeral port range %d-%d "
                "(net.ipv4.ip_local_port_range), where any client's source port may lie",
                conf.where("audit", "pool_ports"),
                inside,
                *span,
            )
        values["pool_ports"] = usable
    return dataclasses.replace(base, **values)  # type: ignore[arg-type]  # each parsed to its field's type


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
    return _audit(IniText(dropin, text), base)
