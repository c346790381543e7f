"""/etc/gpukill/gpukilld.conf: INI, as admins expect of a daemon's .conf file.

    [daemon]
    sample_interval = 1.0            # seconds between samples
    backends = auto                  # or a list: nvidia, drm, simulated
    simulate = /etc/gpukill/simulate.yaml   # simulated GPUs (hosts without any, demos, tests)

    [paths]                          # where the kernel's trees are: for containers and test fixtures
    proc = /proc
    sys = /sys
    debugfs = /sys/kernel/debug

    [guard]                          # Guard Mode (README.md)
    policy_dir = /etc/gpukill/guard.d   # *.yaml read in name order, again on reload
    state_dir = /var/lib/gpukill     # enabled, dry run, counters and the policy in force, across restarts

    [notify]                         # where guard e-mail goes: a relay that delivers onwards (postfix, ...)
    smtp_host = localhost
    smtp_port = 25
    from = gpukilld@HOSTNAME
    timeout = 10                     # seconds per delivery attempt (SMTP or webhook); 3 attempts

Command-line options win over the file. A missing file is fine (defaults); a broken one is an error that
names the file and line.
"""

from __future__ import annotations

import configparser
import math
from dataclasses import dataclass

from .errors import ConfigError

DEFAULT_PATH = "/etc/gpukill/gpukilld.conf"
MIN_INTERVAL, MAX_INTERVAL = 0.05, 3600.0


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


_KNOWN = {"daemon": {"sample_interval", "simulate", "backends"}, "paths": {"proc", "sys", "debugfs"},
          "guard": {"policy_dir", "state_dir"}, "notify": {"smtp_host", "smtp_port", "from", "timeout"}}


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
        return Config()
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
            values["sample_interval"] = check_interval(float(parser["daemon"]["sample_interval"]), where)
        except ValueError:
            raise ConfigError(f"{where}: sample_interval must be a number of seconds") from None
    if parser.has_option("daemon", "simulate"):
        values["simulate"] = parser["daemon"]["simulate"].strip() or None
    if parser.has_option("daemon", "backends"):
        names = tuple(n.strip() for n in parser["daemon"]["backends"].replace(",", " ").split())
        if names and names != ("auto",):
            values["backends"] = names
    for key, field in (("proc", "proc_root"), ("sys", "sys_root"), ("debugfs", "debugfs_root")):
        if parser.has_option("paths", key):
            values[field] = parser["paths"][key].strip()
    for key, field in (("policy_dir", "guard_policy_dir"), ("state_dir", "guard_state_dir")):
        if parser.has_option("guard", key):
            if not (value := parser["guard"][key].strip()):
                raise ConfigError(f"{path}:{_line_of(path, 'guard', key) or '?'}: {key} must not be empty")
            values[field] = value
    if parser.has_option("notify", "smtp_host"):
        values["smtp_host"] = parser["notify"]["smtp_host"].strip() or "localhost"
    if parser.has_option("notify", "from"):
        values["mail_from"] = parser["notify"]["from"].strip()
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
