"""Guard policy files: YAML read through PyYAML's composer, so every error can name FILE:LINE:COL.

A policy is a mapping of top-level settings and a `rules:` list. This module only parses and validates; it
imports nothing of the daemon or D-Bus, so `gpukillctl guard validate` works without the daemon. Validation
reports every error it finds, one line each, and nothing of a file with an error is ever used: the daemon
keeps the policy in force instead. What it builds, and what the words of a rule mean, is gpukill.rules;
which condition types exist, and where each fits, is gpukill.condition_types.

Anyone may send a policy (TestPolicies), so the parser treats its text as hostile. It raises nothing but
PolicyError, whatever the text: numbers of any size, `.inf`/`.nan`, deep nesting and characters PyYAML cannot
take are errors at FILE:LINE:COL. Its work and its output are bounded: nesting depth, items visited (an alias
counts each time it is used), errors reported (MAX_ERRORS, then one final line), the length of every string
and of each condition's text. Regular expressions are RE2 (gpukill.regex: linear time), and the module's own
regular expressions only ever see strings whose length was bounded first.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .condition_types import (
    CELSIUS,
    CONDITION_TYPES,
    COUNT,
    DURATION,
    GROUP,
    INDEX,
    LIST_OPS,
    MAX_COUNT,
    MAX_INDEX,
    OPERATORS,
    PERCENT,
    SIZE,
    STRING,
    USER,
    ConditionType,
)
from .errors import InvalidPolicy
from .limits import MAX_GRACE
from .records.reclaim import KILL_PROCESS, KILL_SCOPES
from .regex import MAX_PATTERN, compile_regex
from .rules import (
    ACTIONS,
    EMPTY_POLICY,
    EVERY,
    MATCHES,
    MAX_RESETS_PER_HOUR,
    MEAN,
    OVERS,
    PER_DEVICE,
    PER_PROCESS,
    RESET,
    RESET_COOLDOWN,
    SCOPES,
    SELECTOR,
    SUBJECT,
    Condition,
    Exemptions,
    Policy,
    Rule,
    Settings,
)
from .text import shown
from .units import DURATION_FORMS, format_duration, parse_duration, parse_size, short

MAX_POLICY_BYTES = 1 << 20  # a policy is a few KiB; a bound keeps a client's text from costing much
MAX_RULES = 1000
MAX_LIST = 10_000  # items in one value or exemption list
MAX_REGEX = MAX_PATTERN  # characters of a `matches` pattern (gpukill.regex)
MAX_NAME = 100
MAX_NAME_LOOKUPS = 1000  # distinct user and group names looked up for name_warnings: NSS may be slow (LDAP)
MAX_DURATION = 30 * 86400.0
# Bounds against hostile text. None of them is near what a real policy needs.
MAX_ERRORS = 100  # error lines kept; then TOO_MANY_ERRORS and parsing stops
TOO_MANY_ERRORS = "… and more errors; fix these first"
MAX_ITEMS = 100_000  # list items, mapping entries, rules and conditions visited; an alias counts at each use
MAX_DEPTH = 64  # nesting of lists and mappings (a policy needs 5)
MAX_TEXT = 200  # characters of a condition's text (shown in reasons, audit entries, TestPolicies)
MAX_ERROR_LINE = 1000  # characters of one error line (a path may take 4096: rare, then cut)
MAX_STRING = 4096  # a string compared with a process's text: command lines are cut at 4 KiB, paths at 4096
MAX_ID_TEXT = 256  # user and group names, exemption patterns (unit names are at most 256 characters)
MAX_DESCRIPTION = 1024
MAX_NUMBER_TEXT = 100  # characters of a number as written: the largest sane value (1 EiB) needs 19 digits
MAX_EMAIL = 254  # RFC 5321's limit on a forward path
MAX_URL = 2048
MAX_ID = 2**32 - 2  # uids and gids are 32 bits; (uid_t)-1 means "no uid"
MIN_TEMPERATURE, MAX_TEMPERATURE = -273.15, 1000.0  # °C

TOP_KEYS = ("rules", "sample_interval", "dry_run", "max_kills_per_cycle", "cooldown", "kill_grace", "notify",
            "exemptions")
AT_START = "at_start"  # a warning when the grace period begins (with the violation)
NUMERIC_KINDS = (PERCENT, CELSIUS, SIZE, DURATION, COUNT)  # what a mean can be taken of
MAX_WARNINGS = 8  # warnings per rule: enough for any schedule, a bound on what one episode sends
RULE_KEYS = ("name", "description", "conditions", "match", "scope", "action", "force", "grace_period",
             "kill_grace", "notify", "exemptions", "cooldown", "max_resets_per_hour", "warn", "kill_scope")
RESET_KEYS = ("cooldown", "max_resets_per_hour")  # rule keys of action reset only
MIN_RESET_COOLDOWN, MAX_RESETS_PER_HOUR_LIMIT = 10.0, 60  # a reset takes seconds; a device reset every minute is plenty
CONDITION_KEYS = ("type", "operator", "value", "duration", "over", "scope", "description")
EXEMPTION_KEYS = ("users", "groups", "units", "processes")

# Python's `re`, on text whose length is bounded before matching (MAX_NAME, MAX_EMAIL, MAX_URL); each is linear in that text anyway (tests/test_policy_hostile.py measures 1 MiB).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_EMAIL = re.compile(r"^[^@\s<>,;:\"]+@[A-Za-z0-9.-]+\.[A-Za-z0-9-]+$")
_WEBHOOK = re.compile(r"^(https?)://([^/\s:]+|\[[0-9a-fA-F:]+\])(:\d{1,5})?(/\S*)?$")
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class PolicyError(InvalidPolicy):
    """A policy that cannot be used; `errors` holds every problem as 'FILE:LINE:COL: message'."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = capped_errors(errors) or ["(no reason given)"]
        n = len(self.errors) - 1
        more = "" if not n else (" (and many more; see gpukillctl guard validate)"
                                 if self.errors[-1] == TOO_MANY_ERRORS else
                                 f" (and {n} more; see gpukillctl guard validate)")
        super().__init__(f"{self.errors[0]}{more}")


def _one_line(line: str) -> str:
    """An error line as it is shown: one line (controls escaped), at most MAX_ERROR_LINE characters."""
    line = shown(line)
    return line if len(line) <= MAX_ERROR_LINE else line[:MAX_ERROR_LINE - 1] + "…"


def capped_errors(errors: list[str]) -> list[str]:
    """At most MAX_ERRORS lines, each one line, then TOO_MANY_ERRORS if any were left out (several files'
    errors together, each list capped already, are capped again)."""
    lines: list[str] = []
    more = False
    for e in errors:
        if e == TOO_MANY_ERRORS:
            more = True
        elif len(lines) == MAX_ERRORS:
            more = True
            break
        else:
            lines.append(_one_line(e))
    return lines + [TOO_MANY_ERRORS] if more else lines


def _q(text: str, limit: int = 60) -> str:
    """A string from the policy, quoted and cut: no message carries much of what a policy wrote."""
    return repr(text[:limit]) + ("…" if len(text) > limit else "")


def _cut(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _list_text(values: tuple[Any, ...]) -> str:
    """[a, b, c] for a condition's text, cut to fit MAX_TEXT with "… N more"."""
    shown: list[str] = []
    size = 0
    for i, v in enumerate(values):
        item = _cut(str(v), 40)
        if i and size + len(item) > MAX_TEXT - 60:
            return "[" + ", ".join(shown) + f", … {len(values) - i} more]"
        shown.append(item)
        size += len(item) + 2
    return "[" + ", ".join(shown) + "]"


@dataclass(frozen=True, slots=True)
class PolicyFile:
    """One parsed file: the settings it sets (with where) and its rules, before files are merged."""

    name: str
    settings: dict[str, tuple[Any, str]]
    rules: tuple[Rule, ...]
    names: tuple[tuple[str, str, str], ...] = ()  # (user or group, name, FILE:LINE:COL): for name_warnings()


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "nothing (null)"
    if isinstance(value, int | float):
        return f"the number {short(value)}"
    if isinstance(value, str):
        return f"the string {_q(value)}"
    if isinstance(value, bytes):
        value = value[:40]
    return f"{type(value).__name__} {_q(str(value)[:100], 40)}"


def _node_kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    return "a value"


class _Stop(Exception):
    """Parsing gives up: too many errors (more=True: TOO_MANY_ERRORS follows), or the policy is too large."""

    def __init__(self, more: bool) -> None:
        super().__init__()
        self.more = more


class _Bounded:
    """Nesting bounded for PyYAML's composer, which recurses once per level: 100,000 `[`s would otherwise end
    in RecursionError (or, where the stack is smaller, worse)."""

    _depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, f"lists and mappings nested more than {MAX_DEPTH} "
                                                              "levels deep", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _Loader(_Bounded, yaml.SafeLoader):
    """PyYAML's safe loader (all Python), nesting bounded."""


try:
    from yaml.cyaml import CParser as _CParser
except ImportError:  # PyYAML built without libyaml: every policy is read by _Loader alone
    _CParser = None
else:
    class _FastLoader(_Bounded, yaml.composer.Composer, _CParser, yaml.constructor.SafeConstructor,
                      yaml.resolver.Resolver):
        """_Loader's composer, constructor and resolver on libyaml's scanner and parser, which make the events
        six times faster than PyYAML's Python ones (20,000 keys: 0.12 s against 0.75 s): a hostile megabyte of
        valid YAML costs a worker thread seconds less. The composer stays the Python one, whose nesting is
        bounded (libyaml's own recurses in C) and whose nodes carry the marks FILE:LINE:COL needs. A text
        libyaml finds fault with is read again by _Loader, so that every error reads as it always has
        (PyYAML's messages name what was expected and what was found; libyaml's are terser)."""

        def __init__(self, text: str) -> None:
            yaml.reader.Reader(text)  # the characters, checked as _Loader checks them, before libyaml reads them
            _CParser.__init__(self, text)
            yaml.composer.Composer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)


def _fast_nodes(text: str) -> tuple[Node | None, Any] | None:
    """The document's node tree and the loader that made it, read by libyaml; None where libyaml is missing
    or finds any fault (then _Loader reads the text again and names the fault its own way)."""
    if _CParser is None:
        return None
    loader = None
    try:
        loader = _FastLoader(text)
        return loader.get_single_node(), loader
    except Exception:  # noqa: BLE001 - whatever it is, the Python reading that follows reports it
        if loader is not None:
            loader.dispose()
        return None


class _Parser:
    def __init__(self, text: str, filename: str) -> None:
        self.text = text
        self.file = filename
        self.errors: list[str] = []
        self.failures = 0  # errors found, reported or not: a part is valid only if none was found while reading it
        self.items = 0  # nodes visited, for MAX_ITEMS
        self.loader: yaml.constructor.SafeConstructor | None = None  # _Loader or _FastLoader
        self.values: dict[int, tuple[bool, Any]] = {}  # id(scalar node) -> scalar(): an alias reads it once
        self.unreadable: set[int] = set()  # ids of scalar nodes whose one error was reported already
        self.patterns: dict[str, Any] = {}  # pattern text -> compiled (or the RegexError)
        self.names: dict[tuple[str, str], str] = {}  # (user or group, name) -> where it is first written

    # -- helpers ---------------------------------------------------------------------------------------

    def where(self, node: Node) -> str:
        return f"{self.file}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"

    def named(self, kind: str, values: tuple[Any, ...], node: Node) -> None:
        """Note the user or group names (not the ids) a value gives, each where it is first written."""
        items = node.value if isinstance(node, SequenceNode) else [node]
        for value, item in zip(values, items, strict=False):
            if isinstance(value, str) and not value.isdigit():
                self.names.setdefault((kind, value), self.where(item))

    def add(self, line: str) -> None:
        """Record an error line; past MAX_ERRORS of them, parsing stops."""
        self.failures += 1
        if len(self.errors) >= MAX_ERRORS:
            raise _Stop(more=True)
        self.errors.append(_one_line(line))

    def error(self, node: Node, message: str) -> None:
        if id(node) in self.unreadable:  # "cannot read this value" said it already (once, however aliased)
            self.failures += 1
            return
        self.add(f"{self.where(node)}: {message}")

    def budget(self, node: Node, n: int) -> None:
        """Count n items about to be visited; past MAX_ITEMS the policy is refused and parsing stops. Aliases
        share nodes, so a list aliased into every rule costs its length at every use: this is what bounds it."""
        self.items += n
        if self.items > MAX_ITEMS:
            self.add(f"{self.where(node)}: the policy is too large: more than {MAX_ITEMS} list items, fields, "
                     "rules and conditions (an alias counts each time it is used)")
            raise _Stop(more=False)

    def scalar(self, node: Node) -> tuple[bool, Any]:
        """(True, value) for a scalar node, typed as YAML resolves it; (False, None) otherwise. A value that
        cannot be read is reported here, once per node, and makes no second error at the caller."""
        if not isinstance(node, ScalarNode):
            return False, None
        key = id(node)
        known = self.values.get(key)
        if known is None:
            known = self.values[key] = self._construct(node)
            if not known[0]:
                self.unreadable.add(key)
        return known

    def _construct(self, node: ScalarNode) -> tuple[bool, Any]:
        problem = None
        if node.tag in (_INT_TAG, _FLOAT_TAG, _TIMESTAMP_TAG) and len(node.value) > MAX_NUMBER_TEXT:
            # Python refuses ints of more than 4300 digits (ValueError), and PyYAML's sexagesimal ints
            # (1:2:3:...) cost quadratic time: no number this long is valid anywhere in a policy.
            problem = f"a number written with more than {MAX_NUMBER_TEXT} characters is too large for any setting"
        else:
            assert self.loader is not None
            try:
                value = self.loader.construct_object(node)
            except yaml.YAMLError as e:  # e.g. an unknown tag
                problem = f"cannot read this value: {getattr(e, 'problem', None) or e}"
            except (ValueError, OverflowError, TypeError, AttributeError, RecursionError, MemoryError) as e:
                # PyYAML's constructors call int(), float(), datetime() and friends: a 5,000-digit !!int,
                # a timestamp on 2001-13-40, !!float on a word
                problem = f"cannot read this value: {type(e).__name__}: {e}"
            else:
                if isinstance(value, str) and _SURROGATE.search(value):
                    problem = "a string with a lone surrogate (an escape such as \\ud800): not valid Unicode text"
                else:
                    return True, value
        self.add(f"{self.where(node)}: {problem}")
        return False, None

    def mapping(self, node: Node, what: str, known: tuple[str, ...]) -> dict[str, tuple[Node, Node]] | None:
        """Keys of a mapping node with their key and value nodes; unknown and duplicate keys are errors."""
        if not isinstance(node, MappingNode):
            self.error(node, f"{what} must be a mapping, not {_node_kind(node)}")
            return None
        self.budget(node, len(node.value))
        out: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            ok, key = self.scalar(key_node)
            if not ok or not isinstance(key, str):
                self.error(key_node, f"keys of {what} must be names, not {_describe(key) if ok else _node_kind(key_node)}")
                continue
            if key in out:
                first = self.where(out[key][0])
                self.error(key_node, f"duplicate key {_q(key)} in {what} (first at {first})")
                continue
            if key not in known:
                hint = _close_match(key, known)
                self.error(key_node, f"unknown field {_q(key)} in {what}{hint} (known: {', '.join(known)})")
                continue
            out[key] = (key_node, value_node)
        return out

    def string(self, node: Node, what: str, allow_empty: bool = False, max_len: int = MAX_STRING) -> str | None:
        ok, value = self.scalar(node)
        if not ok or not isinstance(value, str):
            self.error(node, f"{what} must be a string, not {_describe(value) if ok else _node_kind(node)}")
            return None
        if not allow_empty and not value.strip():
            self.error(node, f"{what} must not be empty")
            return None
        if len(value) > max_len:
            self.error(node, f"{what} is longer than {max_len} characters")
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
            self.error(node, f"{what} must be a duration such as {DURATION_FORMS}, not {_node_kind(node)}")
            return None
        try:
            seconds = parse_duration(value)
        except ValueError as e:
            self.error(node, f"{what}: {e}")
            return None
        if not minimum <= seconds <= maximum:
            shown = value.strip() if isinstance(value, str) else short(value)  # parsed: short
            self.error(node, f"{what} must be between {format_duration(minimum)} and {format_duration(maximum)}, "
                             f"not {shown}")
            return None
        return seconds

    def string_list(self, node: Node, what: str, allow_int: bool = False,
                    max_len: int = MAX_STRING) -> tuple[Any, ...] | None:
        """A list of strings (or a single string, for convenience); with allow_int, uids or gids too."""
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
        self.budget(node, len(items))
        out: list[Any] = []
        good = True
        for item in items:
            ok, value = self.scalar(item)
            is_text = ok and isinstance(value, str) and value != ""
            is_id = ok and allow_int and isinstance(value, int) and not isinstance(value, bool)
            if is_id and not 0 <= value <= MAX_ID:
                self.error(item, f"each item of {what}: a uid or gid is from 0 to {MAX_ID}, not "
                                 f"{short(value)}")
                good = False
            elif is_text and len(value) > max_len:
                self.error(item, f"each item of {what} must be at most {max_len} characters, not {len(value)}")
                good = False
            elif is_text or is_id:
                out.append(value)
            else:
                kinds = "a string or a number" if allow_int else "a string"
                self.error(item, f"each item of {what} must be {kinds}, not "
                                 f"{_describe(value) if ok else _node_kind(item)}")
                good = False
        return tuple(out) if good else None

    # -- document --------------------------------------------------------------------------------------

    def parse(self) -> PolicyFile | None:
        """The file's settings and rules; None (with self.errors) when it has none to give."""
        try:
            root = self.compose()
            return None if root is None else self.document(root)
        except _Stop as stop:
            if stop.more:
                self.errors.append(TOO_MANY_ERRORS)
            return None
        except RecursionError:  # not expected (depth is bounded), but never a crash
            self.errors.append(f"{self.file}:1:1: the policy is nested too deeply to be read")
            return None

    def compose(self) -> Node | None:
        """The document's node tree; errors of YAML itself (and of PyYAML) as FILE:LINE:COL."""
        loader = None
        try:
            fast = _fast_nodes(self.text)
            if fast is not None:
                root, loader = fast
                self.loader = loader
            else:
                loader = self.loader = _Loader(self.text)  # the reader checks the characters here already
                root = loader.get_single_node()
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            where = f"{self.file}:{mark.line + 1}:{mark.column + 1}" if mark else f"{self.file}:1:1"
            what = " ".join(x for x in (e.context, e.problem) if x)
            self.add(f"{where}: not valid YAML: {what}")
            return None
        except yaml.reader.ReaderError as e:  # a character YAML does not allow (controls, surrogates)
            self.add(f"{self._at(e.position)}: not valid YAML: character #x{e.character:04x} is not allowed "
                     f"({e.reason})" if isinstance(e.character, int) else
                     f"{self._at(e.position)}: not valid YAML: {e.reason}")
            return None
        except yaml.YAMLError as e:
            self.add(f"{self.file}:1:1: not valid YAML: {e}")
            return None
        except (ValueError, OverflowError, TypeError, RecursionError, MemoryError) as e:
            # PyYAML's scanner calls chr() on escapes ("\U00110000" is ValueError); its composer recurses
            where = f"{self.file}:1:1"
            if loader is not None:
                with contextlib.suppress(Exception):
                    mark = loader.get_mark()
                    where = f"{self.file}:{mark.line + 1}:{mark.column + 1}"
            reason = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
            self.add(f"{where}: not valid YAML: {reason}")
            return None
        finally:
            if loader is not None:
                loader.dispose()
        if root is None:
            self.add(f"{self.file}:1:1: the policy is empty: expected a mapping with a 'rules:' list "
                     "(write 'rules: []' for none)")
        return root

    def _at(self, position: int) -> str:
        position = max(0, min(position, len(self.text)))
        line = self.text.count("\n", 0, position)
        column = position - (self.text.rfind("\n", 0, position) + 1)
        return f"{self.file}:{line + 1}:{column + 1}"

    def document(self, root: Node) -> PolicyFile | None:
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
                self.budget(rules_node, len(rules_node.value))
                seen: dict[str, str] = {}
                for rule_node in rules_node.value:
                    rule = self.rule(rule_node)
                    if rule is None:
                        continue
                    if rule.name in seen:
                        self.add(f"{rule.where}: duplicate rule name {rule.name!r} "
                                 f"(first defined at {seen[rule.name]})")
                        continue
                    seen[rule.name] = rule.where
                    rules.append(rule)
        return PolicyFile(self.file, settings, tuple(rules),
                          tuple((kind, name, where) for (kind, name), where in self.names.items()))

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
                value = self.duration(node, "kill_grace", 0.0, MAX_GRACE)
            elif key == "notify":
                value = self.notify_targets(node)
            elif key == "exemptions":
                value = self.exemptions(node)
            if value is not None:
                out[key] = (value, self.where(node))
        return out

    # -- rules -----------------------------------------------------------------------------------------

    def rule(self, node: Node) -> Rule | None:
        before = self.failures
        fields = self.mapping(node, "a rule", RULE_KEYS)
        if fields is None:
            return None
        name = None
        if "name" not in fields:
            self.error(node, "a rule needs a 'name'")
        else:
            name = self.string(fields["name"][1], "the rule name")
            if name is not None and (len(name) > MAX_NAME or not _NAME.match(name)):
                self.error(fields["name"][1], f"rule name {_q(name)} must be at most {MAX_NAME} letters, digits, "
                                              "'.', '_' or '-', starting with a letter or digit")
                name = None
        label = f"rule {name!r}" if name else "the rule"
        description = ""
        if "description" in fields:
            description = self.string(fields["description"][1], "description", allow_empty=True,
                                      max_len=MAX_DESCRIPTION) or ""

        match = "all"
        if "match" in fields:
            m = self.string(fields["match"][1], "match")
            if m is not None and m not in MATCHES:
                self.error(fields["match"][1], f"match must be 'all' or 'any', not {_q(m)}")
            elif m is not None:
                match = m

        rule_scope = None
        if "scope" in fields:
            rule_scope = self.scope(fields["scope"][1])

        action = None
        if "action" not in fields:
            self.error(node, f"{label} needs an 'action': kill, notify, log or reset")
        else:
            action = self.string(fields["action"][1], "action")
            if action is not None and action not in ACTIONS:
                self.error(fields["action"][1], f"unknown action {_q(action)} (known: {', '.join(ACTIONS)})")
                action = None

        force = False
        if "force" in fields:
            force = bool(self.boolean(fields["force"][1], "force"))
        grace = 0.0
        if "grace_period" in fields:
            grace = self.duration(fields["grace_period"][1], "grace_period", 0.0, 86400.0) or 0.0
        kill_grace = None
        if "kill_grace" in fields:
            kill_grace = self.duration(fields["kill_grace"][1], "kill_grace", 0.0, MAX_GRACE)
        kill_scope = KILL_PROCESS
        if "kill_scope" in fields:
            ks = self.string(fields["kill_scope"][1], "kill_scope")
            if ks is not None and ks not in KILL_SCOPES:
                self.error(fields["kill_scope"][1], f"kill_scope must be one of {', '.join(KILL_SCOPES)}, "
                                                    f"not {_q(ks)}")
            elif ks is not None:
                kill_scope = ks
        if action in ("notify", "log", RESET):
            for key in (("grace_period", "kill_grace", "warn", "kill_scope") if action == RESET
                        else ("force", "grace_period", "kill_grace", "warn", "kill_scope")):
                if key in fields:
                    self.error(fields[key][0], f"{key} applies only to action kill, not {action}")
        warn: tuple[float, ...] = ()
        if "warn" in fields and action == "kill":
            warn = self.warn_schedule(fields["warn"][1], grace, fields["warn"][0] if not grace else None)
        reset_cooldown, max_resets = RESET_COOLDOWN, MAX_RESETS_PER_HOUR
        if action != RESET:
            for key in RESET_KEYS:
                if key in fields and action is not None:
                    self.error(fields[key][0], f"{key} applies only to action reset, not {action}")
        else:
            if "cooldown" in fields:
                reset_cooldown = self.duration(fields["cooldown"][1], "cooldown", MIN_RESET_COOLDOWN, 86400.0) \
                    or RESET_COOLDOWN
            if "max_resets_per_hour" in fields:
                ok, raw = self.scalar(fields["max_resets_per_hour"][1])
                if ok and isinstance(raw, int) and not isinstance(raw, bool) and 1 <= raw <= MAX_RESETS_PER_HOUR_LIMIT:
                    max_resets = raw
                else:
                    self.error(fields["max_resets_per_hour"][1], "max_resets_per_hour must be a whole number from 1 "
                                                                 f"to {MAX_RESETS_PER_HOUR_LIMIT}, not "
                               f"{_describe(raw) if ok else _node_kind(fields['max_resets_per_hour'][1])}")
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
                self.budget(cnode, len(cond_nodes))
        scope = rule_scope
        for cn in cond_nodes:
            if isinstance(cn, MappingNode):
                self.budget(cn, len(cn.value))
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
        naming = [t for t in CONDITION_TYPES.values() if scope in t.names]
        if naming and conditions and self.failures == before and not any(
                c.type in {t.name for t in naming} and c.role == SUBJECT and c.operator in ("==", "in")
                for c in conditions):
            # Its subjects are what that condition names: a rule without one would look at every group of
            # every user (their primary groups, "users", ...), not at the group its author means.
            names = " or ".join(t.name for t in naming)
            self.error(node, f"{label} in scope {scope} needs a {names} condition with == or in naming its "
                             f"{scope.removeprefix('per_')}(s)")
        elif naming and match == "any":
            # The naming condition holds for every subject it names: with any, the rule would hold for all.
            self.error(fields["match"][1], f"match any is not supported in scope {scope}: its "
                                           f"{naming[0].name} condition holds for every subject it names")
        if action == RESET and scope != PER_DEVICE:
            self.error(fields["action"][1], f"action reset resets a device: {label} needs scope per_device, "
                                            f"not {scope}")
        elif action == RESET and any(c.role == SELECTOR for c in conditions):
            # A reset stops everything on the device: which processes a rule counts cannot change that.
            self.error(fields["action"][1], f"action reset acts on the whole device: {label} may have only device "
                                            "conditions, no process conditions")
        if self.failures > before or name is None or action is None:
            return None
        return Rule(name=name, description=description, conditions=tuple(conditions), match=match, scope=scope,
                    action=action, force=force, grace_period=grace, kill_grace=kill_grace, notify=notify,
                    exemptions=exemptions, where=self.where(node), cooldown=reset_cooldown,
                    max_resets_per_hour=max_resets, warn=warn, kill_scope=kill_scope)

    def warn_schedule(self, node: Node, grace: float, no_grace: Node | None) -> tuple[float, ...]:
        """`warn: [at_start, 15m, 1m]`: when to warn during the grace period, each item `at_start` or a duration
        before the grace ends; as seconds before the end, largest first (at_start: the grace period itself)."""
        if no_grace is not None:
            self.error(no_grace, "warn needs a grace_period: the warnings are sent during it")
            return ()
        items = node.value if isinstance(node, SequenceNode) else None
        if not items:
            self.error(node, "warn must be a list such as [at_start, 15m, 1m] (at_start, or a duration before the "
                             f"grace period ends), not {'an empty list' if items == [] else _node_kind(node)}")
            return ()
        if len(items) > MAX_WARNINGS:
            self.error(node, f"warn has more than {MAX_WARNINGS} warnings")
            return ()
        before = self.failures
        offsets: list[float] = []
        for item in items:
            ok, raw = self.scalar(item)
            if ok and raw == AT_START:
                offset: float | None = grace
            else:
                offset = self.duration(item, "a warning", 0.0, MAX_DURATION)
                if offset is not None and not 0 < offset < grace:
                    self.error(item, f"a warning {format_duration(offset)} before the end must fall within the "
                                     f"grace period ({format_duration(grace)}): more than 0s and less than it "
                                     "(at_start warns when it begins)")
                    offset = None
            if offset is None:
                continue
            if offset in offsets:
                self.error(item, "this warning is in the list twice")
                continue
            offsets.append(offset)
        return tuple(sorted(offsets, reverse=True)) if self.failures == before else ()

    def scope(self, node: Node) -> str | None:
        s = self.string(node, "scope")
        if s is not None and s not in SCOPES:
            self.error(node, f"unknown scope {_q(s)} (known: {', '.join(SCOPES)})")
            return None
        return s

    def condition(self, node: Node, scope: str) -> Condition | None:
        before = self.failures
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
            self.error(fields["type"][1], f"unknown condition type {_q(type_name)}{hint} "
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
            what = "unknown operator" if op not in OPERATORS else "operator"
            self.error(fields["operator"][1], f"{what} {_q(op)} does not fit {type_name} "
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
        over = EVERY
        if "over" in fields:
            over = self.string(fields["over"][1], "over") or EVERY
            if over not in OVERS:
                self.error(fields["over"][1], f"over must be one of {', '.join(OVERS)}, not {_q(over)}")
            elif over == MEAN and duration is None:
                self.error(fields["over"][0], "over: mean needs a duration: the mean is taken over it")
            elif over == MEAN and ctype.kind not in NUMERIC_KINDS:
                self.error(fields["over"][0], f"over: mean needs a condition on a number, not {type_name}")
        if "description" in fields:
            self.string(fields["description"][1], "description", allow_empty=True, max_len=MAX_DESCRIPTION)
        if self.failures > before or role is None:
            return None
        text = f"{type_name} {op} {shown}"
        if duration:
            text += (f" on average over {format_duration(duration)}" if over == MEAN
                     else f" for {format_duration(duration)}")
        return Condition(type_name, op, value, duration, percent, role, self.where(node), _cut(text), over)

    def regex(self, node: Node, what: str) -> Any:
        """A compiled RE2 pattern (linear-time matching), or None with the error recorded."""
        pattern = self.string(node, what, max_len=MAX_POLICY_BYTES)
        if pattern is None:
            return None
        if len(pattern) > MAX_REGEX:
            self.error(node, f"the regular expression is longer than {MAX_REGEX} characters")
            return None
        compiled = self.patterns.get(pattern)
        if compiled is None:  # an aliased pattern is compiled once
            try:
                compiled = compile_regex(pattern)
            except (ValueError, MemoryError) as e:  # RegexError is a ValueError
                compiled = e
            self.patterns[pattern] = compiled
        if isinstance(compiled, BaseException):
            self.error(node, f"bad regular expression {_q(pattern)}: {_regex_hint(pattern, str(compiled))}{compiled}")
            return None
        return compiled

    def number(self, node: Node, what: str, raw: Any, lo: float, hi: float, unit: str = "") -> float | None:
        """A finite number from lo to hi (ints of any size, floats, "95%" for percentages)."""
        if isinstance(raw, str) and unit == "%" and raw.strip().endswith("%"):
            digits = raw.strip()[:-1]
            if len(digits) <= MAX_NUMBER_TEXT:
                with contextlib.suppress(ValueError):  # not a number: reported just below
                    raw = float(digits)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            self.error(node, f"{what} must be a number, not {_describe(raw)}")
            return None
        if isinstance(raw, float) and math.isnan(raw):
            self.error(node, f"{what} must be a number, not nan")
            return None
        if not lo <= raw <= hi:  # inf included; exact for ints of any size
            self.error(node, f"{what} must be from {lo:g} to {hi:g}{unit}, not {short(raw)}")
            return None
        return float(raw) + 0.0  # -0.0 is 0

    def condition_value(self, ctype: ConditionType, op: str, node: Node) -> tuple[Any, bool, str]:
        """(normalized value, percent_of_total, how to show it), read as the type's kind says; errors
        recorded on failure."""
        kind = ctype.kind
        what = f"the value of {ctype.name} {op}"
        if op in LIST_OPS:
            values = self.string_list(node, what, allow_int=kind == USER,
                                      max_len=MAX_ID_TEXT if kind in (USER, GROUP) else MAX_STRING)
            if values is None:
                return None, False, ""
            if kind == GROUP:
                values = tuple(str(v) for v in values)
            if not self.closed_set(ctype, values, node):
                return None, False, ""
            if kind in (USER, GROUP):
                self.named(kind, values, node)
            return values, False, _list_text(values)
        if op == "matches":
            pattern = self.regex(node, what)
            return (None, False, "") if pattern is None else (pattern, False, f"/{pattern.pattern}/")
        ok, raw = self.scalar(node)
        if not ok:
            self.error(node, f"{what} must be a single value, not {_node_kind(node)}")
            return None, False, ""
        if kind in (COUNT, INDEX):
            lo, hi = (0, MAX_COUNT) if kind == COUNT else (0, MAX_INDEX)
            if isinstance(raw, bool) or not isinstance(raw, int) or not lo <= raw <= hi:
                what_kind = "a whole number" if kind == COUNT else "a GPU index (a whole number)"
                self.error(node, f"{what} must be {what_kind} from {lo} to {hi}, not {_describe(raw)}")
                return None, False, ""
            return raw, False, str(raw)
        if kind in (STRING, GROUP, USER):
            is_id = isinstance(raw, int) and not isinstance(raw, bool) and kind in (GROUP, USER)
            if is_id and not 0 <= raw <= MAX_ID:
                self.error(node, f"{what}: a {'uid' if kind == USER else 'gid'} is from 0 to {MAX_ID}, "
                                 f"not {short(raw)}")
                return None, False, ""
            if is_id:
                return (raw if kind == USER else str(raw)), False, str(raw)
            if not isinstance(raw, str) or (not raw and kind != STRING):
                names = {STRING: "a string", GROUP: "a group name or gid", USER: "a user name or uid"}
                self.error(node, f"{what} must be {names[kind]}, not {_describe(raw)}")
                return None, False, ""
            limit = MAX_STRING if kind == STRING else MAX_ID_TEXT
            if len(raw) > limit:
                self.error(node, f"{what} must be at most {limit} characters, not {len(raw)}")
                return None, False, ""
            if not self.closed_set(ctype, (raw,), node):
                return None, False, ""
            if kind in (USER, GROUP):
                self.named(kind, (raw,), node)
            return raw, False, _cut(repr(raw) if kind == STRING else raw, MAX_TEXT - 40)
        if ctype.share is not None and isinstance(raw, str) and raw.strip().endswith("%"):
            pct = self.number(node, what, raw, 0, 100, "%")
            return (None, False, "") if pct is None else (pct, True, f"{pct:g}% of {ctype.share.of}")
        if kind == PERCENT:
            number = self.number(node, what, raw, 0, 100, "%")
            return (None, False, "") if number is None else (number, False, f"{number:g}%")
        if kind == CELSIUS:
            number = self.number(node, what, raw, MIN_TEMPERATURE, MAX_TEMPERATURE, "°C")
            return (None, False, "") if number is None else (number, False, f"{number:g}")
        if kind == SIZE:
            try:
                size = parse_size(raw, limit=True)  # a threshold is a limit: "8" or "0.5M" is a mistake
            except ValueError as e:
                self.error(node, f"{what}: {e}")
                return None, False, ""
            return size, False, raw.strip()
        if kind == DURATION:
            try:
                seconds = parse_duration(raw)
            except ValueError as e:
                self.error(node, f"{what}: {e}")
                return None, False, ""
            return seconds, False, format_duration(seconds)
        raise AssertionError(kind)

    def closed_set(self, ctype: ConditionType, values: tuple[Any, ...], node: Node) -> bool:
        """Whether every value is one the type can ever read (a type with a closed set of values): a typo
        would otherwise make a condition that never holds."""
        wrong = [v for v in values if ctype.values and v not in ctype.values]
        if wrong:
            self.error(node, f"{ctype.name} is one of {', '.join(ctype.values)}, not {_q(str(wrong[0]))}")
        return not wrong

    # -- notify and exemptions -------------------------------------------------------------------------

    def notify_targets(self, node: Node) -> tuple[str, ...] | None:
        if isinstance(node, SequenceNode) and not node.value:
            return ()  # an explicit "notify: []": no notification for this rule
        targets = self.string_list(node, "notify", max_len=len("webhook:") + MAX_URL)
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
            items = self.string_list(v, f"exemptions.{key}", allow_int=key in ("users", "groups"),
                                     max_len=MAX_ID_TEXT)
            if items is not None:
                values[key] = tuple(str(i) for i in items)
                if key in ("users", "groups"):
                    self.named(USER if key == "users" else GROUP, items, v)
        return Exemptions(**values)


def notify_target_problem(target: str) -> str | None:
    """None when target is an e-mail address, webhook:URL, owner, desktop or journal; else why not."""
    if target in ("desktop", "journal", "owner"):
        return None
    if target.startswith("webhook:"):
        url = target[len("webhook:"):]
        if len(url) > MAX_URL:
            return f"bad webhook URL {_q(url, 80)}: longer than {MAX_URL} characters"
        if not _WEBHOOK.match(url):
            return f"bad webhook URL {_q(url, 80)}: expected webhook:http://HOST[:PORT]/PATH or https://..."
        return None
    if len(target) > MAX_EMAIL and "@" in target:
        return f"e-mail address {_q(target, 80)} is longer than {MAX_EMAIL} characters"
    if len(target) <= MAX_EMAIL and _EMAIL.match(target):
        return None
    return (f"not a notify target: {_q(target, 80)} (an e-mail address, webhook:URL, owner, desktop or "
            "journal)")


def _regex_hint(pattern: str, reason: str) -> str:
    """What RE2's reason means when the pattern needs backtracking (Python's re would take it). The pattern is
    at most MAX_REGEX characters, the reason one line."""
    if re.search(r"invalid escape sequence: \\[1-9]", reason) or ("(?P=" in pattern and "(?P" in reason):
        return "backreferences (\\1, (?P=name)) are not supported: "
    if re.search(r"\(\?<?[=!]", reason):
        return "lookahead and lookbehind ((?=...), (?!...), (?<=...), (?<!...)) are not supported: "
    return ""


def _close_match(word: str, known: tuple[str, ...]) -> str:
    import difflib

    if len(word) > 64:  # no known name is that long; and difflib's cost grows with the word
        return ""

    close = difflib.get_close_matches(word, known, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


# -- public API ------------------------------------------------------------------------------------------


def check_text(text: str, filename: str) -> None:
    """PolicyError unless text could be a policy at all (text, at most MAX_POLICY_BYTES, no NUL): cheap, so a
    caller's 30 MiB message is refused before anything is spent on it."""
    if not isinstance(text, str):
        raise PolicyError([f"{filename}:1:1: the policy is not text"])
    if len(text) > MAX_POLICY_BYTES or len(text.encode("utf-8", "replace")) > MAX_POLICY_BYTES:
        raise PolicyError([f"{filename}:1:1: the policy is larger than {MAX_POLICY_BYTES // 1024} KiB"])
    if "\0" in text:
        raise PolicyError([f"{filename}:1:1: the policy contains a NUL byte: not a text file"])


def parse_file_text(text: str, filename: str) -> PolicyFile:
    """Parse one policy file's text; PolicyError lists the problems found (at most MAX_ERRORS). Nothing else
    is raised, whatever the text: the daemon's start-up and reload rely on it."""
    check_text(text, filename)
    parser = _Parser(text, filename)
    try:
        parsed = parser.parse()
    except Exception as e:  # a bug of ours or PyYAML's: still an invalid policy, never a crash
        raise PolicyError(parser.errors[:MAX_ERRORS - 1] + [
            f"{filename}:1:1: the policy could not be read ({type(e).__name__}: {e})"]) from e
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
    names: dict[tuple[str, str], str] = {}
    for f in files:
        for kind, name, where in f.names:
            names.setdefault((kind, name), where)
    for rule in rules:
        if rule.action == "notify" and not (rule.notify if rule.notify is not None else settings.notify):
            errors.append(f"{rule.where}: rule {rule.name!r} has action notify but no notify targets "
                          "(give 'notify:' in the rule or at the top of the policy)")
    if errors:
        raise PolicyError(errors)
    return Policy(settings, tuple(rules), tuple(f.name for f in files),
                  tuple((kind, name, where) for (kind, name), where in names.items()))


def name_warnings(policy: Policy, limit: int = MAX_NAME_LOOKUPS) -> list[str]:
    """'FILE:LINE:COL: warning: no user 'alcie' on this host' for each user or group name the policy writes
    that this host's user and group databases (NSS: files, LDAP, ...) do not know. Not an error: the name may
    be created later, and a condition on it matches nobody until then. Each lookup may wait on NSS, so the
    daemon calls this off its main loop; at most `limit` names are looked up, the rest counted in one line."""
    import grp
    import pwd

    out: list[str] = []
    for kind, name, where in policy.names[:limit]:
        try:
            (pwd.getpwnam if kind == USER else grp.getgrnam)(name)
        except (KeyError, UnicodeEncodeError, ValueError):  # ValueError: an embedded NUL
            out.append(f"{where}: warning: no {kind} {_q(name)} on this host")
        except OSError as e:  # NSS itself failed (an LDAP server down): say so rather than guess
            out.append(f"{where}: warning: {kind} {_q(name)} could not be looked up: {e.strerror or e}")
    if len(policy.names) > limit:
        out.append(f"{policy.source}: warning: {len(policy.names) - limit} more user and group names not looked up")
    return out


def parse_policy(text: str, filename: str) -> Policy:
    return build_policy([parse_file_text(text, filename)])


def read_text(path: str, regular_only: bool = False) -> str:
    """A policy file's text; PolicyError (FILE:1:1) when it cannot be read. With regular_only (the daemon
    reading guard.d) nothing but a regular file is read: a FIFO would block the daemon's start-up. Without it
    (gpukillctl guard load FILE) a pipe such as /dev/stdin is read too. At most MAX_POLICY_BYTES + 1 bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)  # no wait for a writer
    except OSError as e:
        raise PolicyError([f"{path}:1:1: cannot read: {e.strerror}"]) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise PolicyError([f"{path}:1:1: cannot read: Is a directory"])
        if not stat.S_ISREG(mode):
            if regular_only:
                raise PolicyError([f"{path}:1:1: cannot read: not a regular file"])
            os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_POLICY_BYTES:
            chunk = os.read(fd, MAX_POLICY_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise PolicyError([f"{path}:1:1: cannot read: {e.strerror}"]) from None
    finally:
        os.close(fd)
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


def read_paths(paths: list[str], regular_only: bool = False) -> list[tuple[str, str]]:
    errors: list[str] = []
    texts: list[tuple[str, str]] = []
    for path in paths:
        try:
            texts.append((path, read_text(path, regular_only)))
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
    return read_paths(policy_paths(directory), regular_only=True)  # the daemon's: a FIFO must not block it


def load_directory(directory: str) -> Policy:
    """The policy of a guard.d directory; a missing directory is an empty policy (nothing to enforce)."""
    texts = directory_texts(directory)
    return load_texts(texts) if texts else EMPTY_POLICY
