"""The typed readers of a policy's fields: a mapping with known keys, a string, a boolean, a duration, a list
of strings, notify targets, exemptions. Each reports what is wrong at FILE:LINE:COL and counts what it visits
against the bounds."""

from __future__ import annotations

import re
from typing import Any, TypeAlias

from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ..condition_types import GROUP, USER
from ..rules import Exemptions
from ..units import DURATION_FORMS, format_duration, parse_duration, short
from .bounds import (
    MAX_DURATION,
    MAX_EMAIL,
    MAX_ERRORS,
    MAX_ID,
    MAX_ID_TEXT,
    MAX_ITEMS,
    MAX_LIST,
    MAX_STRING,
    MAX_URL,
)
from .messages import close_match, described, one_line, quoted
from .yaml_safe import scalar_value

EXEMPTION_KEYS = ("users", "groups", "units", "processes")
Fields: TypeAlias = dict[str, tuple[Node, Node]]  # a mapping's known keys -> (key node, value node)

# Python's `re`, on text whose length is bounded before matching (MAX_EMAIL, MAX_URL); each is linear in that
# text anyway (tests/test_policy_hostile.py measures 1 MiB).
_EMAIL = re.compile(r"^[^@\s<>,;:\"]+@[A-Za-z0-9.-]+\.[A-Za-z0-9-]+$")
_WEBHOOK = re.compile(r"^(https?)://([^/\s:]+|\[[0-9a-fA-F:]+\])(:\d{1,5})?(/\S*)?$")


class Stop(Exception):
    """Parsing gives up: too many errors (more=True: TOO_MANY_ERRORS follows), or the policy is too large."""

    def __init__(self, more: bool) -> None:
        super().__init__()
        self.more = more


def node_kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    return "a value"


class FieldReader:
    """One file's reading: its errors, its bounds, and the typed readers of its fields."""

    def __init__(self, text: str, filename: str) -> None:
        self.text = text
        self.file = filename
        self.errors: list[str] = []
        self.failures = 0  # errors found, reported or not: a part is valid only if none was found while reading it
        self.items = 0  # nodes visited, for MAX_ITEMS
        self.loader: SafeConstructor | None = None  # the loader of the nodes (yaml_safe.compose)
        self.values: dict[int, tuple[bool, Any]] = {}  # id(scalar node) -> scalar(): an alias reads it once
        self.unreadable: set[int] = set()  # ids of scalar nodes whose one error was reported already
        self.patterns: dict[str, Any] = {}  # pattern text -> compiled (or the RegexError)
        self.names: dict[tuple[str, str], str] = {}  # (user or group, name) -> where it is first written

    # -- errors and bounds -----------------------------------------------------------------------------

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
            raise Stop(more=True)
        self.errors.append(one_line(line))

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
            self.add(
                f"{self.where(node)}: the policy is too large: more than {MAX_ITEMS} list items, fields, "
                "rules and conditions (an alias counts each time it is used)"
            )
            raise Stop(more=False)

    # -- values ----------------------------------------------------------------------------------------

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
        assert self.loader is not None
        value, problem = scalar_value(self.loader, node)
        if problem is None:
            return True, value
        self.add(f"{self.where(node)}: {problem}")
        return False, None

    def mapping(self, node: Node, what: str, known: tuple[str, ...]) -> Fields | None:
        """Keys of a mapping node with their key and value nodes; unknown and duplicate keys are errors."""
        if not isinstance(node, MappingNode):
            self.error(node, f"{what} must be a mapping, not {node_kind(node)}")
            return None
        self.budget(node, len(node.value))
        out: Fields = {}
        for key_node, value_node in node.value:
            ok, key = self.scalar(key_node)
            if not ok or not isinstance(key, str):
                shape = described(key) if ok else node_kind(key_node)
                self.error(key_node, f"keys of {what} must be names, not {shape}")
                continue
            if key in out:
                first = self.where(out[key][0])
                self.error(key_node, f"duplicate key {quoted(key)} in {what} (first at {first})")
                continue
            if key not in known:
                hint = close_match(key, known)
                self.error(key_node, f"unknown field {quoted(key)} in {what}{hint} (known: {', '.join(known)})")
                continue
            out[key] = (key_node, value_node)
        return out

    def string(self, node: Node, what: str, allow_empty: bool = False, max_len: int = MAX_STRING) -> str | None:
        ok, value = self.scalar(node)
        if not ok or not isinstance(value, str):
            self.error(node, f"{what} must be a string, not {described(value) if ok else node_kind(node)}")
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
            shape = described(value) if ok else node_kind(node)
            self.error(node, f"{what} must be true or false, not {shape}")
            return None
        return value

    def duration(self, node: Node, what: str, minimum: float = 0.0, maximum: float = MAX_DURATION) -> float | None:
        ok, value = self.scalar(node)
        if not ok:
            self.error(node, f"{what} must be a duration such as {DURATION_FORMS}, not {node_kind(node)}")
            return None
        try:
            seconds = parse_duration(value)
        except ValueError as e:
            self.error(node, f"{what}: {e}")
            return None
        if not minimum <= seconds <= maximum:
            shown = value.strip() if isinstance(value, str) else short(value)  # parsed: short
            self.error(
                node, f"{what} must be between {format_duration(minimum)} and {format_duration(maximum)}, not {shown}"
            )
            return None
        return seconds

    def string_list(
        self, node: Node, what: str, allow_int: bool = False, max_len: int = MAX_STRING
    ) -> tuple[Any, ...] | None:
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
                self.error(item, f"each item of {what}: a uid or gid is from 0 to {MAX_ID}, not {short(value)}")
                good = False
            elif is_text and len(value) > max_len:
                self.error(item, f"each item of {what} must be at most {max_len} characters, not {len(value)}")
                good = False
            elif is_text or is_id:
                out.append(value)
            else:
                kinds = "a string or a number" if allow_int else "a string"
                self.error(
                    item, f"each item of {what} must be {kinds}, not {described(value) if ok else node_kind(item)}"
                )
                good = False
        return tuple(out) if good else None

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
            items = self.string_list(v, f"exemptions.{key}", allow_int=key in ("users", "groups"), max_len=MAX_ID_TEXT)
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
        url = target[len("webhook:") :]
        if len(url) > MAX_URL:
            return f"bad webhook URL {quoted(url, 80)}: longer than {MAX_URL} characters"
        if not _WEBHOOK.match(url):
            return f"bad webhook URL {quoted(url, 80)}: expected webhook:http://HOST[:PORT]/PATH or https://..."
        return None
    if len(target) > MAX_EMAIL and "@" in target:
        return f"e-mail address {quoted(target, 80)} is longer than {MAX_EMAIL} characters"
    if len(target) <= MAX_EMAIL and _EMAIL.match(target):
        return None
    return f"not a notify target: {quoted(target, 80)} (an e-mail address, webhook:URL, owner, desktop or journal)"
