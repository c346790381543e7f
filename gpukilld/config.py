"""/etc/gpukill/gpukilld.conf: INI, as admins expect of a daemon's .conf file.

    [daemon]
    sample_interval = 1.0            # seconds between samples
    backends = auto                  # or a list: nvidia, drm, simulated
    simulate = /etc/gpukill/simulate.yaml   # simulated GPUs (hosts without any, demos, tests)

    [paths]                          # where the kernel's trees are: for containers and test fixtures
    proc = /proc
    sys = /sys
    debugfs = /sys/kernel/debug

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


_KNOWN = {"daemon": {"sample_interval", "simulate", "backends"}, "paths": {"proc", "sys", "debugfs"}}


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
    return Config(**values)  # type: ignore[arg-type]
