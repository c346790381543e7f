"""gpu-kill's own configuration files, as `gpukill --guard-import-config FILE` and `--rogue-import-config FILE`
read them.

gpu-kill (github.com/kagehq/gpu-kill) writes both as JSON with --guard-export-config and --rogue-export-config
(serde_json of its GuardModeConfig, src/guard_mode.rs, and RogueConfig, src/rogue_config.rs) and keeps them
on disk as TOML (~/.config/gpukill/*.toml: the same structs). Either is read here, as is gpukill's own export
(gpukillctl guard policy export's YAML, audit settings export's [audit] section), which passes through as it
is. Each gpu-kill setting that has a meaning here becomes its gpukill equivalent (a managed user, group or GPU
policy, an audit setting); each that has none is named in one line saying why it is ignored. A file in no
such format is refused in one line naming the formats taken. Nothing of gpu-kill's structs is required: a key
left out is a setting not made.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from .audit import GPU_KILL_THRESHOLDS

GIB = 1 << 30  # gpu-kill's GB: NVML's bytes divided by 1024 three times (src/nvml_api.rs, src/guard_mode.rs)
# The top-level keys that tell each file (both also have "metadata": not a setting, and not telling).
GUARD_KEYS = ("global", "user_policies", "group_policies", "gpu_policies", "time_policies", "enforcement")
ROGUE_KEYS = ("detection", "scoring", "patterns", "alerts")
GUARD_FORMATS = (
    "gpu-kill's Guard Mode configuration (the JSON of gpu-kill --guard --guard-export-config, or "
    "its TOML file) or gpukill's managed policies (gpukillctl guard policy export)"
)
ROGUE_FORMATS = (
    "gpu-kill's rogue detection configuration (the JSON of gpu-kill --audit --rogue-export-config, "
    "or its rogue_config.toml) or gpukill's [audit] section (gpukillctl audit settings export)"
)

# Why each gpu-kill Guard Mode setting without a gpukill equivalent is ignored: (path, why).
_GUARD_IGNORED = {
    "global.enabled": "Guard stays enabled or disabled as it is (gpukillctl guard status); it is switched by "
    "gpukillctl guard enable/disable (gpukill --guard-enable), not by a file",
    "global.dry_run": "Guard's dry run stays as it is (gpukillctl guard status); it is switched by gpukillctl "
    "guard dry-run on/off (gpukill --guard-dry-run), not by a file",
    "global.default_memory_limit_gb": "a policy here has only the limits it names: no default limit applies to "
    "users without one",
    "global.default_utilization_limit_pct": "a policy here has only the limits it names",
    "global.default_duration_limit_hours": "a policy here has only the limits it names",
    "global.check_interval_seconds": "gpukilld evaluates Guard at every sample (sample_interval in a policy file)",
    "duration_limit_hours": "a run's length is not a managed limit here: a policy file's rule with a runtime "
    "condition (man gpukill-policy)",
    "priority": "gpukill has no priorities: each limit holds for everyone it names",
    "allowed_gpus": "which users a GPU takes is the GPU's policy: --guard-add-gpu N --guard-gpu-allowed-users",
    "blocked_gpus": "which users a GPU takes is the GPU's policy: --guard-add-gpu N --guard-gpu-allowed-users",
    "time_overrides": "limits do not change with the time of day here",
    "members": "a group's members are the system's (gpasswd -a USER GROUP), as gpukilld reads them",
    "blocked_users": "a GPU's users are given as allowed_users, not blocked ones",
    "maintenance_window": "gpukill has no maintenance windows",
    "time_policies": "limits do not change with the time of day here",
    "enforcement.soft_enforcement": "every managed policy warns and kills after its grace; gpukillctl guard "
    "dry-run on makes Guard only report",
    "enforcement.hard_enforcement": "every managed policy kills after its grace while Guard enforces, whatever "
    "gpu-kill did; gpukillctl guard dry-run on makes Guard only report",
    "enforcement.max_warnings": "warnings are sent during a rule's grace (warn: in a policy file)",
    "enforcement.notifications": "notices go where a policy file's notify: says (owner, e-mail, webhook, journal)",
}
# Each policy kind's settings that mean a gpukill one: gpu-kill's key -> (gpukill's, factor; None for a list).
_GUARD_SETTINGS: dict[str, dict[str, tuple[str, float | None]]] = {
    "user": {
        "memory_limit_gb": ("memory_limit", GIB),
        "utilization_limit_pct": ("utilization_limit", 1.0),
        "max_concurrent_processes": ("process_limit", 1.0),
    },
    "group": {
        "total_memory_limit_gb": ("memory_limit", GIB),
        "total_utilization_limit_pct": ("utilization_limit", 1.0),
        "max_concurrent_processes": ("process_limit", 1.0),
    },
    "gpu": {
        "max_memory_gb": ("memory_limit", GIB),
        "max_utilization_pct": ("utilization_limit", 1.0),
        "reserved_memory_gb": ("reserved_memory", GIB),
        "allowed_users": ("allowed_users", None),
    },
}
_NAMED_BY = {"user": ("username",), "group": ("group_name",), "gpu": ("gpu_index",)}  # the target, repeated

# gpu-kill's [detection] thresholds, as its --rogue-*-threshold flags (GPU_KILL_THRESHOLDS says what each is here).
_DETECTION_FLAGS = {
    "min_confidence_threshold": "--rogue-confidence-threshold",
    "max_memory_usage_gb": "--rogue-memory-threshold",
    "max_utilization_pct": "--rogue-utilization-threshold",
    "max_duration_hours": "--rogue-duration-threshold",
}
_ROGUE_IGNORED = {
    "detection.enabled_detections": "every rule of the audit runs; a finding's kind and score say which fired",
    "scoring": "scores are the audit's own rules (0-100), not weights (man gpukilld.conf, [audit])",
    "patterns.crypto_miner_patterns": "a process chooses its own name: the audit judges miners by what they do "
    "(mining pool connections, the executable), not by name patterns",
    "patterns.suspicious_process_names": "a process chooses its own name: the audit does not go by names",
    "patterns.custom_patterns": "the audit's rules are its own: no custom patterns",
    "alerts": "findings go to the journal and Guard's rogue_score condition; notices are Guard policies' notify:",
}


class WrongFormat(ValueError):
    """A file that is none of the formats taken: one line, naming them."""


def read_file(path: str) -> str:
    """The file's text, read as a policy file is (at most 1 MiB, UTF-8); ValueError (one line) otherwise."""
    from gpukill.policy import PolicyError, read_text

    try:
        return read_text(path)
    except PolicyError as e:
        raise ValueError(str(e)) from None


def _structured(text: str) -> dict | None:
    """The text as JSON, else as TOML: a table, or None when it is neither."""
    import tomllib

    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        try:
            data = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, RecursionError, ValueError):
            return None
    return data if isinstance(data, dict) else None


def _table(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{path} must be a table (an object), not {type(value).__name__}")
    return value


def _number(value: Any, path: str) -> float:
    """A number of gpu-kill's, most of them Rust f32: its TOML writes an f32 widened (0.7 as 0.699999988079071),
    so it is taken to the 7 significant digits an f32 holds (0.7)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{path} must be a number, not {json.dumps(value)[:40]}")
    return float(value) if isinstance(value, int) else float(f"{value:.7g}")


def _set(value: Any) -> bool:
    """Whether a setting says something: not null, and not an empty list or table."""
    return value is not None and value != [] and value != {}


def _guard_import(path: str, text: str) -> tuple[str | None, list[str]]:
    """guard_import's reading; its errors without the file's name."""
    from gpukill import managed_policy
    from gpukill.errors import InvalidArgs

    data = _structured(text)
    if data is None or not set(data) & set(GUARD_KEYS):
        if any(line.startswith("policies:") for line in text.splitlines()):
            return None, []
        raise WrongFormat(f"{path}: not {GUARD_FORMATS}")
    ignored: dict[str, str] = {}
    for key in _table(data.get("global", {}), "global"):
        if f"global.{key}" in _GUARD_IGNORED:
            ignored[f"global.{key}"] = _GUARD_IGNORED[f"global.{key}"]
    enforcement = _table(data.get("enforcement", {}), "enforcement")
    grace = None
    for key, value in enforcement.items():
        if key == "grace_period_seconds":
            grace = _number(value, "enforcement.grace_period_seconds")
        elif f"enforcement.{key}" in _GUARD_IGNORED and _set(value):
            ignored[f"enforcement.{key}"] = _GUARD_IGNORED[f"enforcement.{key}"]
    if _set(data.get("time_policies")):
        ignored["time_policies"] = _GUARD_IGNORED["time_policies"]
    policies = []
    for kind in ("user", "group", "gpu"):
        section = f"{kind}_policies"
        for target, policy in _table(data.get(section, {}), section).items():
            where = f"{section}.{target}"
            settings: dict[str, Any] = {}
            for key, value in _table(policy, where).items():
                if key in _GUARD_SETTINGS[kind]:
                    ours, factor = _GUARD_SETTINGS[kind][key]
                    if factor is None:
                        if _set(value):
                            settings[ours] = value
                    else:
                        number = _number(value, f"{where}.{key}") * factor
                        settings[ours] = round(number) if ours != "utilization_limit" else number
                elif key in _GUARD_IGNORED and _set(value):
                    ignored[f"{section}.*.{key}"] = _GUARD_IGNORED[key]
                elif key not in _NAMED_BY[kind] and key not in _GUARD_IGNORED:
                    ignored[f"{section}.*.{key}"] = "not a setting of gpu-kill's that gpukill knows"
            if grace is not None:
                settings["grace"] = grace
            try:
                policies.append(managed_policy.parse_settings(kind, str(target), settings))
            except InvalidArgs as e:
                raise ValueError(f"{where}: {e}") from None
    notes = [f"{path}: {key} ignored: {why}" for key, why in ignored.items()]
    return managed_policy.export_text(policies), notes


def _rogue_import(path: str, text: str) -> tuple[str | None, list[str]]:
    """rogue_import's reading; its errors without the file's name."""
    data = _structured(text)
    if data is None or not set(data) & set(ROGUE_KEYS):
        if any(line.strip() == "[audit]" for line in text.splitlines()):
            return None, []
        raise WrongFormat(f"{path}: not {ROGUE_FORMATS}")
    ignored: dict[str, str] = {}
    lines: list[str] = []
    for key, value in _table(data.get("detection", {}), "detection").items():
        flag = _DETECTION_FLAGS.get(key)
        if flag is None:
            if f"detection.{key}" in _ROGUE_IGNORED:
                ignored[f"detection.{key}"] = _ROGUE_IGNORED[f"detection.{key}"]
            continue
        ours, factor = GPU_KILL_THRESHOLDS[flag]
        number = _number(value, f"detection.{key}")
        if ours is None:
            ignored[f"detection.{key}"] = str(factor)
        else:
            lines.append(f"{ours} = {round(number * float(factor), 9)!r}")
    if _set(data.get("scoring")):
        ignored["scoring"] = _ROGUE_IGNORED["scoring"]
    patterns = _table(data.get("patterns", {}), "patterns")
    for key, value in patterns.items():
        if key == "user_whitelist":
            lines.append(f"allowed_users = {' '.join(_words(value, 'patterns.user_whitelist'))}")
        elif key == "process_whitelist":
            words = _words(value, "patterns.process_whitelist")
            paths = [w for w in words if os.path.isabs(w)]
            if paths:
                lines.append(f"allowed_processes = {' '.join(paths)}")
            if len(paths) < len(words):
                ignored["patterns.process_whitelist"] = (
                    f"{', '.join(w for w in words if not os.path.isabs(w))[:200]}: names, not executables' "
                    "paths; a process chooses its own name (gpukillctl audit settings allow-process /PATH)"
                )
        elif f"patterns.{key}" in _ROGUE_IGNORED and _set(value):
            ignored[f"patterns.{key}"] = _ROGUE_IGNORED[f"patterns.{key}"]
    if _set(data.get("alerts")):
        ignored["alerts"] = _ROGUE_IGNORED["alerts"]
    notes = [f"{path}: {key} ignored: {why}" for key, why in ignored.items()]
    return "[audit]\n" + "".join(line + "\n" for line in lines), notes


def guard_import(path: str, text: str) -> tuple[str | None, list[str]]:
    """The managed policies of gpu-kill's Guard Mode file as gpukillctl guard policy import's YAML, and a line for
    each setting ignored; (None, []) for gpukill's own export (imported as it is). ValueError "FILE: where:
    what" for a setting that is wrong, WrongFormat for a file in neither format."""
    return _with_file(path, text, _guard_import)


def rogue_import(path: str, text: str) -> tuple[str | None, list[str]]:
    """The audit settings of gpu-kill's rogue detection file as an [audit] section (the settings it names; the
    others stay as they are), and a line for each setting ignored; (None, []) for gpukill's own [audit] text.
    ValueError "FILE: where: what" for a setting that is wrong, WrongFormat for a file in neither format."""
    return _with_file(path, text, _rogue_import)


def _with_file(path: str, text: str, read: Any) -> tuple[str | None, list[str]]:
    try:
        return read(path, text)
    except WrongFormat:
        raise
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _words(value: Any, path: str) -> list[str]:
    """A list of names or paths as the [audit] section writes them: words, none holding its separators."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{path} must be a list of strings")
    bad = next((v for v in value if not v or set(v) & set(" \t,#;=\n")), None)
    if bad is not None:
        raise ValueError(f"{path}: {json.dumps(bad)[:60]} is not a name or a path")
    return list(dict.fromkeys(value))
