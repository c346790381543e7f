"""Guard policies as gpu-kill manages them (user, group and GPU policies), as records written into ordinary policy
files.

gpu-kill's admins add a limit for a user, a group or a GPU with one command; here each such policy is a
ManagedPolicy record that render() turns into an ordinary Guard policy file in guard.d, so it is visible,
diffable, validated FILE:LINE:COL by gpukill.policy and enforced by the same engine as every hand-written rule.
Nothing is enforced from the record itself. The file's first line carries the record (read_file), so the
daemon recovers its managed policies from the directory alone, and a hand edit of the rest shows (edited).

What each setting becomes (rules named "<kind>-<target>-<setting>", every kill after the grace, largest first
only until the subject is back under, protected and system processes never counted nor touched):
- user: memory_limit -> per_user user_memory > N; utilization_limit -> per_user user_utilization > P (on each
  GPU the user's processes' utilization added up, the highest over GPUs); process_limit -> per_user
  user_processes > N (the largest by memory go until N are left).
- group: the same for the group's members together (per_group group_memory, group_utilization,
  group_processes; membership primary or supplementary, from the system's groups as the group condition reads it).
- gpu: memory_limit -> per_device device_memory > N; utilization_limit -> per_device gpu_utilization > P;
  allowed_users -> per_process: a process on that GPU of a user not in the list; reserved_memory -> per_device
  device_memory_free < N, counting (so stopping) only other users' processes where allowed_users is set.

This module imports nothing of the daemon: the daemon (SERVICE) writes, reads and lists the files through it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from yaml.nodes import MappingNode, Node, SequenceNode

from .condition_types import MAX_COUNT, MAX_INDEX
from .errors import InvalidArgs
from .policy import PolicyError, _Parser, _Stop, check_text
from .units import MAX_SIZE, exact_size, format_size, parse_duration, parse_size

KINDS = ("user", "group", "gpu")
SETTINGS = ("memory_limit", "utilization_limit", "process_limit", "allowed_users", "reserved_memory", "grace")
LIMITS = SETTINGS[:-1]  # a policy sets at least one of these
APPLIES = {
    "user": ("memory_limit", "utilization_limit", "process_limit", "grace"),
    "group": ("memory_limit", "utilization_limit", "process_limit", "grace"),
    "gpu": ("memory_limit", "utilization_limit", "allowed_users", "reserved_memory", "grace"),
}
_FLOATS = ("utilization_limit", "grace")
DEFAULT_GRACE = 30.0
MAX_GRACE_PERIOD = 86400.0  # as a rule's grace_period (gpukill.policy)
MAX_ALLOWED_USERS = 1000
MAX_POLICIES = 10_000  # in one import
# User and group names as useradd and groupadd take them (and as file and rule names may carry them): a letter
# or _ first, then letters, digits, _ . -; at most 32. Never all digits: those would read as uids.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
_INDEX = re.compile(r"0|[1-9][0-9]{0,3}")
HEADER = "# gpukill managed policy: "
PREFIX = "60-managed-"
EXPORT_HEADER = "# gpukill managed Guard policies (gpukillctl guard policy export)\n"


@dataclass(frozen=True, slots=True)
class ManagedPolicy:
    kind: str  # "user", "group" or "gpu"
    target: str  # a user name, a group name, or a GPU index ("0")
    memory_limit: int | None = None  # bytes: the user's / the group's members' memory summed; the device's in use
    utilization_limit: float | None = None  # percent (see the module's docstring for what is compared)
    process_limit: int | None = None  # user/group: GPU processes at once
    allowed_users: tuple[str, ...] = ()  # gpu only: only these users may hold the GPU; () = everyone
    reserved_memory: int | None = None  # gpu only: bytes kept free on the device
    grace: float = DEFAULT_GRACE  # seconds over a limit before the kill


# -- validation ------------------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _check_target(kind: str, target: Any) -> str:
    if kind not in KINDS:
        raise InvalidArgs(f"unknown policy kind {_shown(kind)} (known: {', '.join(KINDS)})")
    if not isinstance(target, str):
        raise InvalidArgs(f"the target of a {kind} policy must be a string, not {_shown(target)}")
    if kind == "gpu":
        if not _INDEX.fullmatch(target) or int(target) > MAX_INDEX:
            raise InvalidArgs(f"GPU index {_shown(target)} is out of range: a whole number from 0 to {MAX_INDEX}")
    elif not _NAME.fullmatch(target):
        raise InvalidArgs(
            f"bad {kind} name {_shown(target)}: a letter or _ first, then letters, digits, _ . or -, "
            "at most 32 characters"
        )
    return target


def _whole(key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgs(f"{key} must be a whole number from {lo} to {hi}, not {_shown(value)}")
    return value


def _real(key: str, value: Any, lo: float, hi: float, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgs(f"{key} must be a number ({unit}), not {_shown(value)}")
    if isinstance(value, float) and not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidArgs(f"{key} must be from {lo:g} to {hi:g} ({unit}), not {_shown(value)}")
    return float(value) + 0.0  # -0.0 is 0


def _check_setting(kind: str, key: Any, value: Any, caller: bool = False) -> Any:
    """The setting's value normalized; InvalidArgs (one line) when it is unknown, does not apply, or is wrong.
    caller: the value comes from a caller (SetPolicy), whose typed byte count is checked as a limit too."""
    if key not in SETTINGS:
        raise InvalidArgs(f"unknown setting {_shown(key)} (known: {', '.join(SETTINGS)})")
    if key not in APPLIES[kind]:
        raise InvalidArgs(f"{key} does not apply to a {kind} policy (it takes: {', '.join(APPLIES[kind])})")
    if key in ("memory_limit", "reserved_memory"):
        # a typed integer is bytes; a text takes the size grammar. A limit under 1 MiB from a caller is refused
        # unless a text's unit says it is small on purpose (parse_size's limit); a record read back (a file's
        # header, an import already parsed) holds what was once accepted.
        typed = isinstance(value, int) and not isinstance(value, bool)
        if not typed and not isinstance(value, str) or typed and not 1 <= value <= MAX_SIZE:
            raise InvalidArgs(f"{key} must be a whole number of bytes from 1 to 2^60 (1 EiB), not {_shown(value)}")
        try:
            size = parse_size(value, bare=1 if typed else None, limit=caller or not typed)
        except ValueError as e:
            raise InvalidArgs(f"{key}: {e}") from None
        if size < 1:
            raise InvalidArgs(f"{key} must be more than 0 bytes, not {_shown(value)}")
        return size
    if key == "utilization_limit":
        return _real(key, value, 0.0, 100.0, "percent")
    if key == "process_limit":
        return _whole(key, value, 0, MAX_COUNT)
    if key == "grace":
        if isinstance(value, str):  # a text takes the duration grammar ("90s", "2min")
            try:
                value = parse_duration(value)
            except ValueError as e:
                raise InvalidArgs(f"grace: {e}") from None
        return _real(key, value, 0.0, MAX_GRACE_PERIOD, "seconds")
    # allowed_users: a list of user names (a lone string would read as its letters)
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise InvalidArgs(f"allowed_users must be a list of user names, not {_shown(value)}")
    if len(value) > MAX_ALLOWED_USERS:
        raise InvalidArgs(f"allowed_users has more than {MAX_ALLOWED_USERS} names")
    for name in value:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidArgs(
                f"bad user name {_shown(name)} in allowed_users: a letter or _ first, then letters, "
                "digits, _ . or -, at most 32 characters"
            )
    return tuple(sorted(set(value)))  # a set of users: one order, so one file and one export


def parse_settings(kind: str, target: str, settings: Mapping[str, Any], *, caller: bool = False) -> ManagedPolicy:
    """A record from a{sv} settings as plain Python values (sizes as bytes or as text such as "8GiB", grace as
    seconds or as text such as "2min"); InvalidArgs (one line) for an unknown key, a wrong type or range, a
    setting of another kind, a bad target, or no limit at all. caller: the settings come from a caller, whose
    byte counts under 1 MiB are refused as likely mistakes (a text in B or KiB says it is meant)."""
    target = _check_target(kind, target)
    if not isinstance(settings, Mapping):
        raise InvalidArgs(f"settings must be a mapping, not {_shown(settings)}")
    values = {key: _check_setting(kind, key, value, caller) for key, value in settings.items()}
    if not any(values.get(k) not in (None, ()) for k in LIMITS):
        limits = [k for k in APPLIES[kind] if k in LIMITS]
        raise InvalidArgs(f"a {kind} policy needs at least one limit ({', '.join(limits)})")
    return ManagedPolicy(kind, target, **values)


def as_settings(p: ManagedPolicy) -> dict[str, Any]:
    """The a{sv} settings of a record: only the keys that are set (grace always), allowed_users as a list."""
    out: dict[str, Any] = {}
    for key in SETTINGS:
        value = getattr(p, key)
        if key == "grace" or value not in (None, ()):
            # floats as floats even in a record made by hand (ManagedPolicy(..., grace=30)): one header, one export
            out[key] = list(value) if key == "allowed_users" else float(value) if key in _FLOATS else value
    return out


# -- files -----------------------------------------------------------------------------------------------


def file_name(p: ManagedPolicy) -> str:
    """The policy's file in guard.d: "60-managed-user-alice.yaml" (targets are validated names or indexes)."""
    return f"{PREFIX}{p.kind}-{p.target}.yaml"


def _number(value: float) -> str:
    """A float as YAML reads it back as that very float: Python's shortest repr, with a point in the mantissa
    (PyYAML reads 1e-05 as a string, 1.0e-05 as the number)."""
    text = repr(value)
    mantissa, e, exponent = text.partition("e")
    return (mantissa if "." in mantissa else mantissa + ".0") + e + exponent


def _quoted(text: str) -> str:
    """A YAML single-quoted scalar (its one escape: '' for ')."""
    return "'" + text.replace("'", "''") + "'"


def _names(users: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{u}'" for u in users) + "]"


def _rule(name: str, description: str, scope: str, grace: float, conditions: list[str]) -> list[str]:
    lines = [
        f"  - name: {name}",
        f"    description: {_quoted(description)}",
        f"    scope: {scope}",
        "    action: kill",
        f"    grace_period: {_number(float(grace))}",
        "    conditions:",
    ]
    return lines + [f"      - {c}" for c in conditions]


def _condition(type_name: str, op: str, value: str) -> str:
    return f"{{type: {type_name}, operator: '{op}', value: {value}}}"


def _rules(p: ManagedPolicy) -> list[str]:
    out: list[str] = []
    if p.kind in ("user", "group"):
        scope = "per_user" if p.kind == "user" else "per_group"
        who = _condition(p.kind, "==", f"'{p.target}'")
        whose = f"user {p.target}" if p.kind == "user" else f"the members of group {p.target} together"
        if p.memory_limit is not None:
            out += _rules_for(
                p,
                "memory",
                f"{whose}: at most {format_size(p.memory_limit)} of GPU memory summed over GPUs",
                scope,
                [who, _condition(f"{p.kind}_memory", ">", exact_size(p.memory_limit))],
            )
        if p.utilization_limit is not None:
            out += _rules_for(
                p,
                "utilization",
                f"{whose}: at most {p.utilization_limit:g}% of any GPU",
                scope,
                [who, _condition(f"{p.kind}_utilization", ">", _number(float(p.utilization_limit)))],
            )
        if p.process_limit is not None:
            out += _rules_for(
                p,
                "processes",
                f"{whose}: at most {p.process_limit} GPU process(es)",
                scope,
                [who, _condition(f"{p.kind}_processes", ">", str(p.process_limit))],
            )
        return out
    gpu = _condition("gpu", "==", p.target)
    others = [_condition("user", "not_in", _names(p.allowed_users))] if p.allowed_users else []
    if p.memory_limit is not None:
        out += _rules_for(
            p,
            "memory",
            f"GPU {p.target}: at most {format_size(p.memory_limit)} of memory in use",
            "per_device",
            [gpu, _condition("device_memory", ">", exact_size(p.memory_limit))],
        )
    if p.utilization_limit is not None:
        out += _rules_for(
            p,
            "utilization",
            f"GPU {p.target}: at most {p.utilization_limit:g}% utilization",
            "per_device",
            [gpu, _condition("gpu_utilization", ">", _number(float(p.utilization_limit)))],
        )
    if p.allowed_users:
        out += _rules_for(
            p, "allowed-users", f"GPU {p.target}: only {', '.join(p.allowed_users)}", "per_process", [gpu, *others]
        )
    if p.reserved_memory is not None:
        whose = ", stopping other users' processes" if p.allowed_users else ""
        out += _rules_for(
            p,
            "reserved-memory",
            f"GPU {p.target}: {format_size(p.reserved_memory)} kept free{whose}",
            "per_device",
            [gpu, _condition("device_memory_free", "<", exact_size(p.reserved_memory)), *others],
        )
    return out  # never empty: parse_settings refuses a policy without a limit


def _rules_for(p: ManagedPolicy, what: str, description: str, scope: str, conditions: list[str]) -> list[str]:
    return _rule(f"{p.kind}-{p.target}-{what}", description, scope, p.grace, conditions)


def _header(p: ManagedPolicy) -> str:
    record = {"kind": p.kind, "target": p.target, **as_settings(p)}
    return HEADER + json.dumps(record, sort_keys=True, separators=(",", ":"))


def render(p: ManagedPolicy) -> str:
    """The policy as an ordinary Guard policy file: the record on the first line (read_file), then its rules.
    Deterministic: the same record gives the same bytes."""
    lines = [
        _header(p),
        "# Written by gpukilld for `gpukillctl guard policy add`: change it with gpukillctl guard policy; a hand",
        "# edit shows as edited in `gpukillctl guard policy list` and is replaced by the next change.",
        "rules:",
        *_rules(p),
    ]
    return "\n".join(lines) + "\n"


def read_file(name: str, text: str) -> ManagedPolicy | None:
    """The record a managed file carries on its first line; None for any other file (no such line, a record
    that does not parse, or a file under another name than the record's: a copy is not managed)."""
    first = text.split("\n", 1)[0]
    if not first.startswith(HEADER) or len(first) > 1 << 16:
        return None
    try:
        record = json.loads(first[len(HEADER) :])
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    kind, target = record.pop("kind", None), record.pop("target", None)
    try:
        p = parse_settings(kind, target, record)
    except InvalidArgs:
        return None
    return p if os.path.basename(name) == file_name(p) else None


def edited(p: ManagedPolicy, text: str) -> bool:
    """Whether the file is no longer what gpukilld wrote for the record (changed by hand)."""
    return text != render(p)


# -- export and import -----------------------------------------------------------------------------------


def _sort_key(p: ManagedPolicy) -> tuple[str, str]:
    return (p.kind, p.target.zfill(4) if p.kind == "gpu" else p.target)  # GPUs in numeric order


def export_text(policies: Iterable[ManagedPolicy]) -> str:
    """Canonical YAML of the policies, sorted by (kind, target): import_text reads it back to the same."""
    items = sorted(policies, key=_sort_key)
    if not items:
        return EXPORT_HEADER + "policies: []\n"
    lines = [EXPORT_HEADER.rstrip("\n"), "policies:"]
    for p in items:
        lines += [f"  - kind: {p.kind}", f"    target: '{p.target}'"]
        for key, value in as_settings(p).items():
            if key == "allowed_users":
                shown = _names(tuple(value))
            elif key in ("memory_limit", "reserved_memory"):
                shown = exact_size(value)
            elif isinstance(value, float):
                shown = _number(value)
            else:
                shown = str(value)
            lines.append(f"    {key}: {shown}")
    return "\n".join(lines) + "\n"


def _import_value(parser: _Parser, key: str, node: Node) -> Any:
    """A setting as a file writes it, as parse_settings takes it: sizes in the size grammar ("8GiB"; a bare
    number is refused), grace as seconds or in the duration grammar ("30s")."""
    if key == "allowed_users":
        if not isinstance(node, SequenceNode):
            raise InvalidArgs("allowed_users must be a list of user names")
        parser.budget(node, len(node.value))
        return [parser.scalar(item)[1] for item in node.value]
    ok, raw = parser.scalar(node)
    if not ok:
        shape = "a mapping" if isinstance(node, MappingNode) else "a list"
        raise InvalidArgs(f"{key} must be a single value, not {shape}")
    if key in ("memory_limit", "reserved_memory"):
        try:  # a file takes the size grammar: a bare number is refused with the units
            return parse_size(raw, limit=True)
        except ValueError as e:
            raise InvalidArgs(f"{key}: {e}") from None
    if key == "utilization_limit" and isinstance(raw, str) and raw.strip().endswith("%"):
        try:
            return float(raw.strip()[:-1])
        except ValueError:
            raise InvalidArgs(f"utilization_limit must be a number (percent), not {_shown(raw)}") from None
    return raw


def import_text(text: str, name: str) -> list[ManagedPolicy]:
    """The policies of an export (or a file written like one), strictly: PolicyError with NAME:LINE:COL for an
    unknown key, a bad value, a duplicate (kind, target), or text that is not such a file. All or nothing."""
    check_text(text, name)
    parser = _Parser(text, name)
    out: list[ManagedPolicy] = []
    try:
        root = parser.compose()
        if root is not None:
            out = _import_document(parser, root)
    except _Stop:
        pass
    except Exception as e:  # a bug of ours or PyYAML's: still text that cannot be imported, never a crash
        raise PolicyError(
            parser.errors[:50] + [f"{name}:1:1: the policies could not be read ({type(e).__name__}: {e})"]
        ) from e
    if parser.errors:
        raise PolicyError(parser.errors)
    return out


def _import_document(parser: _Parser, root: Node) -> list[ManagedPolicy]:
    top = parser.mapping(root, "the managed policies", ("policies",))
    if top is None:
        return []
    if "policies" not in top:
        parser.error(root, "no 'policies:' list (write 'policies: []' for none)")
        return []
    node = top["policies"][1]
    if not isinstance(node, SequenceNode):
        parser.error(node, "'policies' must be a list")
        return []
    if len(node.value) > MAX_POLICIES:
        parser.error(node, f"more than {MAX_POLICIES} policies")
        return []
    parser.budget(node, len(node.value))
    out: list[ManagedPolicy] = []
    seen: dict[tuple[str, str], str] = {}
    for item in node.value:
        p = _import_policy(parser, item)
        if p is None:
            continue
        key = (p.kind, p.target)
        if key in seen:
            parser.error(item, f"a second {p.kind} policy for {p.target} (first at {seen[key]})")
            continue
        seen[key] = parser.where(item)
        out.append(p)
    return out


def _import_policy(parser: _Parser, item: Node) -> ManagedPolicy | None:
    before = parser.failures
    entries = parser.mapping(item, "a policy", ("kind", "target", *SETTINGS))
    if entries is None:
        return None
    for key in ("kind", "target"):
        if key not in entries:
            parser.error(item, f"a policy needs a '{key}'")
            return None
    kind = parser.string(entries["kind"][1], "kind")
    ok, target = parser.scalar(entries["target"][1])
    if isinstance(target, int) and not isinstance(target, bool):
        target = str(target)  # target: 0 for a GPU
    if kind is None or not ok:
        return None
    try:
        _check_target(kind, target)
    except InvalidArgs as e:
        parser.error(entries["kind" if kind not in KINDS else "target"][1], str(e))
        return None
    settings: dict[str, Any] = {}
    good = True
    for key, (_key_node, value_node) in entries.items():
        if key in ("kind", "target"):
            continue
        try:
            if key not in APPLIES[kind]:
                _check_setting(kind, key, None)  # "does not apply", before what the value is
            settings[key] = _check_setting(kind, key, _import_value(parser, key, value_node))
        except InvalidArgs as e:
            parser.error(value_node if key in APPLIES[kind] else _key_node, str(e))
            good = False
    if not good or parser.failures > before:  # an unknown key reported: no second error for what it meant
        return None
    try:
        return parse_settings(kind, target, settings)
    except InvalidArgs as e:
        parser.error(item, str(e))
        return None
