"""Guard policy files: YAML read through PyYAML's composer, so every error can name FILE:LINE:COL.

A policy is a mapping of top-level settings and a `rules:` list. This module only parses and validates; it
imports nothing of the daemon or D-Bus, so `gpukillctl guard validate` works without the daemon. Validation
reports every error it finds, one line each, and nothing of a file with an error is ever used: the daemon
keeps the policy in force instead.

Conditions of a rule combine with AND unless the rule says `match: any`. Descriptions are prose for humans
and never change what a rule does.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ..errors import GpukillError
from ..units import parse_size

MAX_POLICY_BYTES = 1 << 20  # a policy is a few KiB; a bound keeps a client's text from costing much
MAX_RULES = 1000
MAX_LIST = 10_000  # items in one value or exemption list
MAX_REGEX = 1024
MAX_NAME = 100
MAX_DURATION = 30 * 86400.0
MAX_KILL_GRACE = 300.0  # the kill path's own limit (killer.MAX_GRACE)

PER_PROCESS, PER_USER, PER_DEVICE = "per_process", "per_user", "per_device"
SCOPES = (PER_PROCESS, PER_USER, PER_DEVICE)
ACTIONS = ("kill", "notify", "log")
MATCHES = ("all", "any")

# What a condition is about in a given scope. SUBJECT: tested on the rule's subject (the process, the user,
# the device). SELECTOR: in per_user and per_device scopes a process condition picks which of the subject's
# processes the rule counts and may kill. A type missing from a scope's table does not apply there.
SUBJECT, SELECTOR = "subject", "selector"

STRING_OPS = ("==", "!=", "in", "contains_any", "matches")
USER_OPS = ("==", "!=", "in", "matches")
GROUP_OPS = ("==", "!=", "in")
NUMBER_OPS = (">", ">=", "<", "<=", "==", "!=")


@dataclass(frozen=True, slots=True)
class ConditionType:
    name: str
    kind: str  # string, user, group, percent, number, size, duration
    operators: tuple[str, ...]
    roles: dict[str, str]  # scope -> SUBJECT or SELECTOR
    needs: str = ""  # why the type does not fit a scope it lacks


_PROC_ROLES = {PER_PROCESS: SUBJECT, PER_USER: SELECTOR, PER_DEVICE: SELECTOR}
CONDITION_TYPES: dict[str, ConditionType] = {
    t.name: t
    for t in (
        ConditionType("process_name", "string", STRING_OPS, _PROC_ROLES),
        ConditionType("cmdline", "string", STRING_OPS, _PROC_ROLES),
        ConditionType("exe", "string", STRING_OPS, _PROC_ROLES),
        ConditionType("unit", "string", STRING_OPS, _PROC_ROLES),
        ConditionType("container", "string", STRING_OPS, _PROC_ROLES),
        ConditionType("user", "user", USER_OPS, {PER_PROCESS: SUBJECT, PER_USER: SUBJECT, PER_DEVICE: SELECTOR}),
        ConditionType("group", "group", GROUP_OPS, {PER_PROCESS: SUBJECT, PER_USER: SUBJECT, PER_DEVICE: SELECTOR}),
        ConditionType("gpu_utilization", "percent", NUMBER_OPS,
                      {PER_PROCESS: SUBJECT, PER_USER: SELECTOR, PER_DEVICE: SUBJECT}),
        ConditionType("gpu_memory", "size", NUMBER_OPS, _PROC_ROLES),
        ConditionType("runtime", "duration", NUMBER_OPS, _PROC_ROLES),
        # Killing every process of a user over a user-wide sum would be a disaster: the sum needs per_user,
        # where only the largest processes are killed until the user is back under.
        ConditionType("user_memory", "size", NUMBER_OPS, {PER_USER: SUBJECT},
                      "user_memory sums a user's processes across devices: it needs scope per_user"),
        ConditionType("device_memory", "size", NUMBER_OPS, {PER_DEVICE: SUBJECT},
                      "device_memory is a device's value: it needs scope per_device"),
        ConditionType("temperature", "number", NUMBER_OPS, {PER_DEVICE: SUBJECT},
                      "temperature is a device's value: it needs scope per_device"),
    )
}

TOP_KEYS = ("rules", "sample_interval", "dry_run", "max_kills_per_cycle", "cooldown", "kill_grace", "notify",
            "exemptions")
RULE_KEYS = ("name", "description", "conditions", "match", "scope", "action", "force", "grace_period",
             "kill_grace", "notify", "exemptions")
CONDITION_KEYS = ("type", "operator", "value", "duration", "scope", "description")
EXEMPTION_KEYS = ("users", "groups", "units", "processes")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_EMAIL = re.compile(r"^[^@\s<>,;:\"]+@[A-Za-z0-9.-]+\.[A-Za-z0-9-]+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class PolicyError(GpukillError):
    """A policy that cannot be used; `errors` holds every problem as 'FILE:LINE:COL: message'."""

    dbus_name = "org.gpukill1.Error.InvalidPolicy"
    result = "invalid-policy"

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        more = f" (and {len(errors) - 1} more; see gpukillctl guard validate)" if len(errors) > 1 else ""
        super().__init__(f"{errors[0]}{more}")


def parse_duration(value: object) -> float:
    """Seconds from 90, "90s", "5m", "1h30m", "500ms"; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        parts = _DURATION_PART.findall(text)
        if not text or "".join(n + u for n, u in parts) != text:
            raise ValueError(f"not a duration: {value!r} (write e.g. 90s, 5m, 1h30m)")
        seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    else:
        raise ValueError(f"not a duration: {value!r} (write e.g. 90s, 5m, 1h30m)")
    if seconds != seconds or seconds < 0:  # NaN or negative
        raise ValueError(f"a duration must not be negative: {value!r}")
    return seconds


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def format_duration(seconds: float) -> str:
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 3600:g}h" if seconds % 3600 == 0 else f"{seconds / 60:g}m"
    return f"{seconds:g}s"


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    operator: str
    value: Any  # normalized: str, int, float, tuple of those, or a compiled pattern for `matches`
    duration: float | None  # seconds the condition must hold continuously; None: at once
    percent_of_total: bool  # device_memory given as "90%" of the device's memory
    role: str  # SUBJECT or SELECTOR in the rule's scope
    where: str  # FILE:LINE:COL
    text: str  # e.g. "gpu_utilization > 95 for 5m"


@dataclass(frozen=True, slots=True)
class Exemptions:
    users: tuple[str, ...] = ()  # names, or uids written as numbers
    groups: tuple[str, ...] = ()
    units: tuple[str, ...] = ()  # shell patterns on the systemd unit (e.g. "slurmstepd*")
    processes: tuple[str, ...] = ()  # shell patterns on the process name

    def __bool__(self) -> bool:
        return bool(self.users or self.groups or self.units or self.processes)

    def merged(self, other: Exemptions) -> Exemptions:
        def union(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(dict.fromkeys(a + b))

        return Exemptions(union(self.users, other.users), union(self.groups, other.groups),
                          union(self.units, other.units), union(self.processes, other.processes))


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    description: str
    conditions: tuple[Condition, ...]
    match: str
    scope: str
    action: str
    force: bool
    grace_period: float
    kill_grace: float | None  # None: the policy's kill_grace
    notify: tuple[str, ...] | None  # None: the policy's default targets
    exemptions: Exemptions
    where: str

    @property
    def fingerprint(self) -> tuple:
        """What the rule does, without where it was written: an unchanged rule keeps its windows on reload."""
        return (self.name, self.match, self.scope, self.action, self.force, self.grace_period, self.kill_grace,
                self.notify, self.exemptions,
                tuple((c.type, c.operator, _fingerprint_value(c.value), c.duration, c.percent_of_total)
                      for c in self.conditions))


def _fingerprint_value(value: Any) -> Any:
    return ("re", value.pattern) if isinstance(value, re.Pattern) else value


@dataclass(frozen=True, slots=True)
class Settings:
    sample_interval: float | None = None  # None: every snapshot the daemon takes
    dry_run: bool = False
    max_kills_per_cycle: int = 10
    cooldown: float = 10.0
    kill_grace: float = 5.0
    notify: tuple[str, ...] = ()
    exemptions: Exemptions = field(default_factory=Exemptions)


@dataclass(frozen=True, slots=True)
class PolicyFile:
    """One parsed file: the settings it sets (with where) and its rules, before files are merged."""

    name: str
    settings: dict[str, tuple[Any, str]]
    rules: tuple[Rule, ...]


@dataclass(frozen=True, slots=True)
class Policy:
    settings: Settings
    rules: tuple[Rule, ...]
    sources: tuple[str, ...]  # file names, in the order they were read

    @property
    def source(self) -> str:
        return ", ".join(self.sources) if self.sources else "(none)"


EMPTY_POLICY = Policy(Settings(), (), ())


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "nothing (null)"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value[:60]!r}"
    return f"{type(value).__name__} {str(value)[:40]!r}"


def _node_kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    return "a value"


class _Parser:
    def __init__(self, text: str, filename: str) -> None:
        self.text = text
        self.file = filename
        self.errors: list[str] = []
        self.loader = yaml.SafeLoader(text)

    # -- helpers ---------------------------------------------------------------------------------------

    def where(self, node: Node) -> str:
        return f"{self.file}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"

    def error(self, node: Node, message: str) -> None:
        self.errors.append(f"{self.where(node)}: {message}")

    def scalar(self, node: Node) -> tuple[bool, Any]:
        """(True, value) for a scalar node, typed as YAML resolves it; (False, None) otherwise."""
        if not isinstance(node, ScalarNode):
            return False, None
        try:
            return True, self.loader.construct_object(node)
        except yaml.YAMLError as e:  # e.g. a malformed timestamp
            self.error(node, f"cannot read this value: {getattr(e, 'problem', e)}")
            return False, None

    def mapping(self, node: Node, what: str, known: tuple[str, ...]) -> dict[str, tuple[Node, Node]] | None:
        """Keys of a mapping node with their key and value nodes; unknown and duplicate keys are errors."""
        if not isinstance(node, MappingNode):
            self.error(node, f"{what} must be a mapping, not {_node_kind(node)}")
            return None
        out: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            ok, key = self.scalar(key_node)
            if not ok or not isinstance(key, str):
                self.error(key_node, f"keys of {what} must be names, not {_describe(key) if ok else _node_kind(key_node)}")
                continue
            if key in out:
                first = self.where(out[key][0])
                self.error(key_node, f"duplicate key {key!r} in {what} (first at {first})")
                continue
            if key not in known:
                hint = _close_match(key, known)
                self.error(key_node, f"unknown field {key!r} in {what}{hint} (known: {', '.join(known)})")
                continue
            out[key] = (key_node, value_node)
        return out

    def string(self, node: Node, what: str, allow_empty: bool = False) -> str | None:
        ok, value = self.scalar(node)
        if not ok or not isinstance(value, str):
            self.error(node, f"{what} must be a string, not {_describe(value) if ok else _node_kind(node)}")
            return None
        if not allow_empty and not value.strip():
            self.error(node, f"{what} must not be empty")
            return None
        return value

    def boolean(self, node: Node, what: str) -> bool | None:
        ok, value = self.scalar(node)
        if not ok or not isinstance(value, bool):
            self.error(node, f"{what} must be true or false, not {_describe(value) if ok else _node_kind(node)}")
            return None
        return value

    def duration(self, node: Node, what: str, minimum: float = 0.0, maximum: float = MAX_DURATION) -> float | None:
        ok, value = self.scalar(node)
        if not ok:
            self.error(node, f"{what} must be a duration such as 90s, 5m or 1h30m, not {_node_kind(node)}")
            return None
        try:
            seconds = parse_duration(value)
        except ValueError as e:
            self.error(node, f"{what}: {e}")
            return None
        if not minimum <= seconds <= maximum:
            self.error(node, f"{what} must be between {format_duration(minimum)} and {format_duration(maximum)}, "
                             f"not {value}")
            return None
        return seconds

    def string_list(self, node: Node, what: str, allow_int: bool = False) -> tuple[Any, ...] | None:
        """A list of strings (or a single string, for convenience)."""
        items = node.value if isinstance(node, SequenceNode) else [node]
        if isinstance(node, MappingNode):
            self.error(node, f"{what} must be a list of strings, not a mapping")
            return None
        if isinstance(node, SequenceNode) and not items:
            self.error(node, f"{what} must not be an empty list")
            return None
        if len(items) > MAX_LIST:
            self.error(node, f"{what} has more than {MAX_LIST} items")
            return None
        out: list[Any] = []
        good = True
        for item in items:
            ok, value = self.scalar(item)
            is_text = ok and isinstance(value, str) and value != ""
            is_id = ok and allow_int and isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if is_text or is_id:
                out.append(value)
            else:
                kinds = "a string or a number" if allow_int else "a string"
                self.error(item, f"each item of {what} must be {kinds}, not "
                                 f"{_describe(value) if ok else _node_kind(item)}")
                good = False
        return tuple(out) if good else None

    # -- document --------------------------------------------------------------------------------------

    def parse(self) -> PolicyFile | None:
        try:
            root = self.loader.get_single_node()
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            where = f"{self.file}:{mark.line + 1}:{mark.column + 1}" if mark else self.file
            what = " ".join(x for x in (e.context, e.problem) if x)
            self.errors.append(f"{where}: not valid YAML: {what}")
            return None
        except yaml.YAMLError as e:
            self.errors.append(f"{self.file}:1:1: not valid YAML: {e}")
            return None
        finally:
            self.loader.dispose()
        if root is None:
            self.errors.append(f"{self.file}:1:1: the policy is empty: expected a mapping with a 'rules:' list "
                               "(write 'rules: []' for none)")
            return None
        top = self.mapping(root, "the policy", TOP_KEYS)
        if top is None:
            return None
        settings = self.settings(top)
        rules: list[Rule] = []
        if "rules" not in top:
            self.error(root, "the policy has no 'rules:' list (write 'rules: []' for none)")
        else:
            key_node, rules_node = top["rules"]
            ok, value = self.scalar(rules_node)
            if not isinstance(rules_node, SequenceNode):
                self.error(rules_node, f"'rules' must be a list, not {_describe(value) if ok else _node_kind(rules_node)}")
            elif len(rules_node.value) > MAX_RULES:
                self.error(rules_node, f"more than {MAX_RULES} rules")
            else:
                seen: dict[str, str] = {}
                for rule_node in rules_node.value:
                    rule = self.rule(rule_node)
                    if rule is None:
                        continue
                    if rule.name in seen:
                        self.errors.append(f"{rule.where}: duplicate rule name {rule.name!r} "
                                           f"(first defined at {seen[rule.name]})")
                        continue
                    seen[rule.name] = rule.where
                    rules.append(rule)
        return PolicyFile(self.file, settings, tuple(rules))

    def settings(self, top: dict[str, tuple[Node, Node]]) -> dict[str, tuple[Any, str]]:
        out: dict[str, tuple[Any, str]] = {}
        for key, (_key_node, node) in top.items():
            value: Any = None
            if key == "sample_interval":
                value = self.duration(node, "sample_interval", 0.05, 3600.0)
            elif key == "dry_run":
                value = self.boolean(node, "dry_run")
            elif key == "max_kills_per_cycle":
                ok, raw = self.scalar(node)
                if ok and isinstance(raw, int) and not isinstance(raw, bool) and 1 <= raw <= 10_000:
                    value = raw
                else:
                    self.error(node, "max_kills_per_cycle must be a whole number from 1 to 10000, not "
                                     f"{_describe(raw) if ok else _node_kind(node)}")
            elif key == "cooldown":
                value = self.duration(node, "cooldown", 0.0, 86400.0)
            elif key == "kill_grace":
                value = self.duration(node, "kill_grace", 0.0, MAX_KILL_GRACE)
            elif key == "notify":
                value = self.notify_targets(node)
            elif key == "exemptions":
                value = self.exemptions(node)
            if value is not None:
                out[key] = (value, self.where(node))
        return out

    # -- rules -----------------------------------------------------------------------------------------

    def rule(self, node: Node) -> Rule | None:
        before = len(self.errors)
        fields = self.mapping(node, "a rule", RULE_KEYS)
        if fields is None:
            return None
        name = None
        if "name" not in fields:
            self.error(node, "a rule needs a 'name'")
        else:
            name = self.string(fields["name"][1], "the rule name")
            if name is not None and (len(name) > MAX_NAME or not _NAME.match(name)):
                self.error(fields["name"][1], f"rule name {name[:60]!r} must be at most {MAX_NAME} letters, digits, "
                                              "'.', '_' or '-', starting with a letter or digit")
                name = None
        label = f"rule {name!r}" if name else "the rule"
        description = ""
        if "description" in fields:
            description = self.string(fields["description"][1], "description", allow_empty=True) or ""

        match = "all"
        if "match" in fields:
            m = self.string(fields["match"][1], "match")
            if m is not None and m not in MATCHES:
                self.error(fields["match"][1], f"match must be 'all' or 'any', not {m!r}")
            elif m is not None:
                match = m

        rule_scope = None
        if "scope" in fields:
            rule_scope = self.scope(fields["scope"][1])

        action = None
        if "action" not in fields:
            self.error(node, f"{label} needs an 'action': kill, notify or log")
        else:
            action = self.string(fields["action"][1], "action")
            if action is not None and action not in ACTIONS:
                self.error(fields["action"][1], f"unknown action {action!r} (known: {', '.join(ACTIONS)})")
                action = None

        force = False
        if "force" in fields:
            force = bool(self.boolean(fields["force"][1], "force"))
        grace = 0.0
        if "grace_period" in fields:
            grace = self.duration(fields["grace_period"][1], "grace_period", 0.0, 86400.0) or 0.0
        kill_grace = None
        if "kill_grace" in fields:
            kill_grace = self.duration(fields["kill_grace"][1], "kill_grace", 0.0, MAX_KILL_GRACE)
        if action in ("notify", "log"):
            for key in ("force", "grace_period", "kill_grace"):
                if key in fields:
                    self.error(fields[key][0], f"{key} applies only to action kill, not {action}")
        notify = None
        if "notify" in fields:
            notify = self.notify_targets(fields["notify"][1])
        exemptions = Exemptions()
        if "exemptions" in fields:
            exemptions = self.exemptions(fields["exemptions"][1]) or Exemptions()

        # The scope: the rule's own, or the one its conditions state (they must agree).
        cond_nodes: list[Node] = []
        if "conditions" not in fields:
            self.error(node, f"{label} needs 'conditions'")
        else:
            cnode = fields["conditions"][1]
            if not isinstance(cnode, SequenceNode):
                self.error(cnode, f"conditions must be a list, not {_node_kind(cnode)}")
            elif not cnode.value:
                self.error(cnode, f"{label} has an empty conditions list: it would match every process")
            else:
                cond_nodes = list(cnode.value)
        scope = rule_scope
        for cn in cond_nodes:
            if isinstance(cn, MappingNode):
                for k, v in cn.value:
                    if isinstance(k, ScalarNode) and k.value == "scope":
                        s = self.scope(v)
                        if s is None:
                            continue
                        if scope is None:
                            scope = s
                        elif s != scope:
                            where = "the rule's scope" if rule_scope else "another condition's scope"
                            self.error(v, f"condition scope {s} conflicts with {where} {scope}")
        scope = scope or PER_PROCESS
        conditions = [c for c in (self.condition(cn, scope) for cn in cond_nodes) if c is not None]
        if match == "any" and any(c.role == SELECTOR for c in conditions):
            # selectors pick the processes a per_user/per_device rule counts; OR-ing them has no clear meaning
            self.error(fields["match"][1], f"match any is not supported with process conditions in scope {scope}; "
                                           "write one rule per alternative")
        if conditions and scope != PER_PROCESS and all(c.role == SELECTOR for c in conditions) and action == "kill":
            self.error(node, f"{label} in scope {scope} has only process conditions: with action kill it would "
                             f"kill every selected process; add a {scope.removeprefix('per_')} condition or use "
                             "scope per_process")
        if len(self.errors) > before or name is None or action is None:
            return None
        return Rule(name=name, description=description, conditions=tuple(conditions), match=match, scope=scope,
                    action=action, force=force, grace_period=grace, kill_grace=kill_grace, notify=notify,
                    exemptions=exemptions, where=self.where(node))

    def scope(self, node: Node) -> str | None:
        s = self.string(node, "scope")
        if s is not None and s not in SCOPES:
            self.error(node, f"unknown scope {s!r} (known: {', '.join(SCOPES)})")
            return None
        return s

    def condition(self, node: Node, scope: str) -> Condition | None:
        before = len(self.errors)
        fields = self.mapping(node, "a condition", CONDITION_KEYS)
        if fields is None:
            return None
        if "type" not in fields:
            self.error(node, f"a condition needs a 'type' (one of: {', '.join(CONDITION_TYPES)})")
            return None
        type_name = self.string(fields["type"][1], "the condition type")
        if type_name is None:
            return None
        ctype = CONDITION_TYPES.get(type_name)
        if ctype is None:
            hint = _close_match(type_name, tuple(CONDITION_TYPES))
            self.error(fields["type"][1], f"unknown condition type {type_name!r}{hint} "
                                          f"(known: {', '.join(CONDITION_TYPES)})")
            return None
        role = ctype.roles.get(scope)
        if role is None:
            self.error(fields["type"][1], f"{ctype.needs} (the rule's scope is {scope})")
        if "operator" not in fields:
            self.error(node, f"the {type_name} condition needs an 'operator' ({', '.join(ctype.operators)})")
            return None
        op = self.string(fields["operator"][1], "operator")
        if op is None:
            return None
        if op not in ctype.operators:
            all_ops = dict.fromkeys(STRING_OPS + NUMBER_OPS)
            what = "unknown operator" if op not in all_ops else "operator"
            self.error(fields["operator"][1], f"{what} {op!r} does not fit {type_name} "
                                              f"(use one of: {', '.join(ctype.operators)})")
            return None
        if "value" not in fields:
            self.error(node, f"the {type_name} condition needs a 'value'")
            return None
        value, percent, shown = self.condition_value(ctype, op, fields["value"][1])
        duration = None
        if "duration" in fields:
            duration = self.duration(fields["duration"][1], "duration", 0.001)
            if duration is not None and role == SELECTOR:
                self.error(fields["duration"][0], f"a duration on {type_name} is not supported in scope {scope}: "
                                                  "process conditions select processes there; put the duration "
                                                  "on a condition about the subject")
        if "description" in fields:
            self.string(fields["description"][1], "description", allow_empty=True)
        if len(self.errors) > before or role is None:
            return None
        text = f"{type_name} {op} {shown}" + (f" for {format_duration(duration)}" if duration else "")
        return Condition(type_name, op, value, duration, percent, role, self.where(node), text)

    def condition_value(self, ctype: ConditionType, op: str, node: Node) -> tuple[Any, bool, str]:
        """(normalized value, percent_of_total, how to show it); errors recorded on failure."""
        kind = ctype.kind
        what = f"the value of {ctype.name} {op}"
        if op in ("in", "contains_any"):
            values = self.string_list(node, what, allow_int=kind == "user")
            if values is None:
                return None, False, ""
            if kind == "group":
                values = tuple(str(v) for v in values)
            return values, False, "[" + ", ".join(map(str, values)) + "]"
        if op == "matches":
            pattern = self.string(node, what)
            if pattern is None:
                return None, False, ""
            if len(pattern) > MAX_REGEX:
                self.error(node, f"the regular expression is longer than {MAX_REGEX} characters")
                return None, False, ""
            try:
                return re.compile(pattern), False, f"/{pattern}/"
            except re.error as e:
                self.error(node, f"bad regular expression {pattern[:60]!r}: {e}")
                return None, False, ""
        ok, raw = self.scalar(node)
        if not ok:
            self.error(node, f"{what} must be a single value, not {_node_kind(node)}")
            return None, False, ""
        if kind in ("string", "group"):
            if isinstance(raw, int) and not isinstance(raw, bool) and kind == "group":
                return str(raw), False, str(raw)
            if not isinstance(raw, str) or (not raw and kind == "group"):
                self.error(node, f"{what} must be a string, not {_describe(raw)}")
                return None, False, ""
            return raw, False, repr(raw)
        if kind == "user":
            if isinstance(raw, bool) or not isinstance(raw, str | int) or (isinstance(raw, str) and not raw):
                self.error(node, f"{what} must be a user name or uid, not {_describe(raw)}")
                return None, False, ""
            return raw, False, str(raw)
        if kind in ("percent", "number"):
            if isinstance(raw, str) and kind == "percent" and raw.strip().endswith("%"):
                with contextlib.suppress(ValueError):  # not a number: reported just below
                    raw = float(raw.strip()[:-1])
            if isinstance(raw, bool) or not isinstance(raw, int | float) or raw != raw:
                self.error(node, f"{what} must be a number, not {_describe(raw)}")
                return None, False, ""
            if kind == "percent" and not 0 <= raw <= 100:
                self.error(node, f"{what} is a percentage: 0 to 100, not {raw}")
                return None, False, ""
            return float(raw), False, f"{raw:g}" + ("%" if kind == "percent" else "")
        if kind == "size":
            if ctype.name == "device_memory" and isinstance(raw, str) and raw.strip().endswith("%"):
                try:
                    pct = float(raw.strip()[:-1])
                except ValueError:
                    pct = -1.0
                if not 0 <= pct <= 100:
                    self.error(node, f"{what}: {raw!r} is not a percentage from 0% to 100%")
                    return None, False, ""
                return pct, True, f"{pct:g}% of the device's memory"
            try:
                size = parse_size(raw)
            except ValueError as e:
                self.error(node, f"{what}: {e}")
                return None, False, ""
            return size, False, format_size(size) if isinstance(raw, int) else str(raw)
        if kind == "duration":
            try:
                seconds = parse_duration(raw)
            except ValueError as e:
                self.error(node, f"{what}: {e}")
                return None, False, ""
            return seconds, False, format_duration(seconds)
        raise AssertionError(kind)

    # -- notify and exemptions -------------------------------------------------------------------------

    def notify_targets(self, node: Node) -> tuple[str, ...] | None:
        if isinstance(node, SequenceNode) and not node.value:
            return ()  # an explicit "notify: []": no notification for this rule
        targets = self.string_list(node, "notify")
        if targets is None:
            return None
        items = node.value if isinstance(node, SequenceNode) else [node]
        good = True
        for target, item in zip(targets, items, strict=True):
            problem = notify_target_problem(target)
            if problem:
                self.error(item, problem)
                good = False
        return tuple(dict.fromkeys(targets)) if good else None

    def exemptions(self, node: Node) -> Exemptions | None:
        fields = self.mapping(node, "exemptions", EXEMPTION_KEYS)
        if fields is None:
            return None
        values: dict[str, tuple[str, ...]] = {}
        for key, (_k, v) in fields.items():
            items = self.string_list(v, f"exemptions.{key}", allow_int=key in ("users", "groups"))
            if items is not None:
                values[key] = tuple(str(i) for i in items)
        return Exemptions(**values)


def notify_target_problem(target: str) -> str | None:
    """None when target is an e-mail address, webhook:URL, desktop or journal; else why not."""
    if target in ("desktop", "journal") or _EMAIL.match(target):
        return None
    if target.startswith("webhook:"):
        url = target[len("webhook:"):]
        m = re.match(r"^(https?)://([^/\s:]+|\[[0-9a-fA-F:]+\])(:\d{1,5})?(/\S*)?$", url)
        if not m:
            return f"bad webhook URL {url[:80]!r}: expected webhook:http://HOST[:PORT]/PATH or https://..."
        return None
    return (f"not a notify target: {target[:80]!r} (an e-mail address, webhook:URL, desktop or journal)")


def _close_match(word: str, known: tuple[str, ...]) -> str:
    import difflib

    close = difflib.get_close_matches(word, known, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


# -- public API ------------------------------------------------------------------------------------------


def parse_file_text(text: str, filename: str) -> PolicyFile:
    """Parse one policy file's text; PolicyError lists every problem found."""
    if len(text.encode("utf-8", "replace")) > MAX_POLICY_BYTES:
        raise PolicyError([f"{filename}:1:1: the policy is larger than {MAX_POLICY_BYTES // 1024} KiB"])
    if "\0" in text:
        raise PolicyError([f"{filename}:1:1: the policy contains a NUL byte: not a text file"])
    parser = _Parser(text, filename)
    parsed = parser.parse()
    if parser.errors or parsed is None:
        raise PolicyError(parser.errors or [f"{filename}:1:1: the policy could not be read"])
    return parsed


def build_policy(files: list[PolicyFile]) -> Policy:
    """Merge parsed files in order: rules are concatenated (names unique across files), a setting in a later
    file overrides an earlier one, exemption lists are joined."""
    errors: list[str] = []
    seen: dict[str, str] = {}
    rules: list[Rule] = []
    values: dict[str, Any] = {}
    exemptions = Exemptions()
    for f in files:
        for key, (value, _where) in f.settings.items():
            if key == "exemptions":
                exemptions = exemptions.merged(value)
            else:
                values[key] = value
        for rule in f.rules:
            if rule.name in seen:
                errors.append(f"{rule.where}: duplicate rule name {rule.name!r} (first defined at {seen[rule.name]})")
                continue
            seen[rule.name] = rule.where
            rules.append(rule)
    settings = Settings(exemptions=exemptions, **values)
    for rule in rules:
        if rule.action == "notify" and not (rule.notify if rule.notify is not None else settings.notify):
            errors.append(f"{rule.where}: rule {rule.name!r} has action notify but no notify targets "
                          "(give 'notify:' in the rule or at the top of the policy)")
    if errors:
        raise PolicyError(errors)
    return Policy(settings, tuple(rules), tuple(f.name for f in files))


def parse_policy(text: str, filename: str) -> Policy:
    return build_policy([parse_file_text(text, filename)])


def read_text(path: str) -> str:
    """A policy file's text; PolicyError (FILE:1:1) when it cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_POLICY_BYTES + 1)
    except OSError as e:
        raise PolicyError([f"{path}:1:1: cannot read: {e.strerror}"]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError([f"{path}:1:1: not UTF-8 text (byte {e.start})"]) from None


def policy_paths(directory: str) -> list[str]:
    """*.yaml in the directory, in name order (as systemd reads drop-ins)."""
    return sorted(glob.glob(os.path.join(glob.escape(directory), "*.yaml")))


def load_texts(texts: list[tuple[str, str]]) -> Policy:
    """Parse (name, text) pairs and merge them; every file's errors are collected before giving up."""
    errors: list[str] = []
    files: list[PolicyFile] = []
    for name, text in texts:
        try:
            files.append(parse_file_text(text, name))
        except PolicyError as e:
            errors.extend(e.errors)
    if errors:
        raise PolicyError(errors)
    return build_policy(files)


def read_paths(paths: list[str]) -> list[tuple[str, str]]:
    errors: list[str] = []
    texts: list[tuple[str, str]] = []
    for path in paths:
        try:
            texts.append((path, read_text(path)))
        except PolicyError as e:
            errors.extend(e.errors)
    if errors:
        raise PolicyError(errors)
    return texts


def load_paths(paths: list[str]) -> Policy:
    return load_texts(read_paths(paths))


def directory_texts(directory: str) -> list[tuple[str, str]]:
    """(path, text) of each policy file in a guard.d directory; none when the directory does not exist."""
    if not os.path.exists(directory):
        return []
    if not os.path.isdir(directory):
        raise PolicyError([f"{directory}:1:1: not a directory"])
    return read_paths(policy_paths(directory))


def load_directory(directory: str) -> Policy:
    """The policy of a guard.d directory; a missing directory is an empty policy (nothing to enforce)."""
    texts = directory_texts(directory)
    return load_texts(texts) if texts else EMPTY_POLICY
