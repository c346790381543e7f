"""A condition's value, read as its type's kind says: a count, a GPU index, a string, a user or group (name or
id), a percentage or a share of a total, a temperature, a size, a duration, a list of any of these, or an RE2
pattern; normalized, and with the text a condition shows it as."""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any

from yaml.nodes import Node

from ..condition_types import (
    CELSIUS,
    COUNT,
    DURATION,
    GROUP,
    INDEX,
    LIST_OPS,
    MAX_COUNT,
    MAX_INDEX,
    PERCENT,
    SIZE,
    STRING,
    USER,
    ConditionType,
)
from ..regex import compile_regex
from ..units import format_duration, parse_duration, parse_size, short
from .bounds import (
    MAX_ID,
    MAX_ID_TEXT,
    MAX_NUMBER_TEXT,
    MAX_POLICY_BYTES,
    MAX_REGEX,
    MAX_STRING,
    MAX_TEMPERATURE,
    MAX_TEXT,
    MIN_TEMPERATURE,
)
from .messages import cut, described, quoted
from .readers import FieldReader, node_kind

_NO_VALUE: tuple[Any, bool, str] = (None, False, "")  # a value that cannot be read (its error recorded)


class ValueReader(FieldReader):
    """The typed readers, and the reader of a condition's value."""

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
            hint = _regex_hint(pattern, str(compiled))
            self.error(node, f"bad regular expression {quoted(pattern)}: {hint}{compiled}")
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
            self.error(node, f"{what} must be a number, not {described(raw)}")
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
        what = f"the value of {ctype.name} {op}"
        if op in LIST_OPS:
            return self.list_value(ctype, node, what)
        if op == "matches":
            pattern = self.regex(node, what)
            return _NO_VALUE if pattern is None else (pattern, False, f"/{pattern.pattern}/")
        ok, raw = self.scalar(node)
        if not ok:
            self.error(node, f"{what} must be a single value, not {node_kind(node)}")
            return _NO_VALUE
        if ctype.kind in (COUNT, INDEX):
            return self.whole_value(ctype, node, what, raw)
        if ctype.kind in (STRING, GROUP, USER):
            return self.text_value(ctype, node, what, raw)
        return self.measured_value(ctype, node, what, raw)

    def list_value(self, ctype: ConditionType, node: Node, what: str) -> tuple[Any, bool, str]:
        """The list of an `in` or `not in`: strings, or user names and uids, or group names and gids (as
        strings)."""
        kind = ctype.kind
        values = self.string_list(
            node, what, allow_int=kind == USER, max_len=MAX_ID_TEXT if kind in (USER, GROUP) else MAX_STRING
        )
        if values is None:
            return _NO_VALUE
        if kind == GROUP:
            values = tuple(str(v) for v in values)
        if not self.closed_set(ctype, values, node):
            return _NO_VALUE
        if kind in (USER, GROUP):
            self.named(kind, values, node)
        return values, False, list_text(values)

    def whole_value(self, ctype: ConditionType, node: Node, what: str, raw: Any) -> tuple[Any, bool, str]:
        """A count or a GPU index: a whole number in its range."""
        lo, hi = (0, MAX_COUNT) if ctype.kind == COUNT else (0, MAX_INDEX)
        if isinstance(raw, bool) or not isinstance(raw, int) or not lo <= raw <= hi:
            what_kind = "a whole number" if ctype.kind == COUNT else "a GPU index (a whole number)"
            self.error(node, f"{what} must be {what_kind} from {lo} to {hi}, not {described(raw)}")
            return _NO_VALUE
        return raw, False, str(raw)

    def text_value(self, ctype: ConditionType, node: Node, what: str, raw: Any) -> tuple[Any, bool, str]:
        """A string, a user (a name, or a uid as a number) or a group (a name, or a gid as a string)."""
        kind = ctype.kind
        is_id = isinstance(raw, int) and not isinstance(raw, bool) and kind in (GROUP, USER)
        if is_id and not 0 <= raw <= MAX_ID:
            self.error(node, f"{what}: a {'uid' if kind == USER else 'gid'} is from 0 to {MAX_ID}, not {short(raw)}")
            return _NO_VALUE
        if is_id:
            return (raw if kind == USER else str(raw)), False, str(raw)
        if not isinstance(raw, str) or (not raw and kind != STRING):
            names = {STRING: "a string", GROUP: "a group name or gid", USER: "a user name or uid"}
            self.error(node, f"{what} must be {names[kind]}, not {described(raw)}")
            return _NO_VALUE
        limit = MAX_STRING if kind == STRING else MAX_ID_TEXT
        if len(raw) > limit:
            self.error(node, f"{what} must be at most {limit} characters, not {len(raw)}")
            return _NO_VALUE
        if not self.closed_set(ctype, (raw,), node):
            return _NO_VALUE
        if kind in (USER, GROUP):
            self.named(kind, (raw,), node)
        return raw, False, cut(repr(raw) if kind == STRING else raw, MAX_TEXT - 40)

    def measured_value(self, ctype: ConditionType, node: Node, what: str, raw: Any) -> tuple[Any, bool, str]:
        """A percentage, a share of a total ("50%" where the type has one), a temperature, a size or a
        duration."""
        kind = ctype.kind
        if ctype.share is not None and isinstance(raw, str) and raw.strip().endswith("%"):
            pct = self.number(node, what, raw, 0, 100, "%")
            return _NO_VALUE if pct is None else (pct, True, f"{pct:g}% of {ctype.share.of}")
        if kind == PERCENT:
            number = self.number(node, what, raw, 0, 100, "%")
            return _NO_VALUE if number is None else (number, False, f"{number:g}%")
        if kind == CELSIUS:
            number = self.number(node, what, raw, MIN_TEMPERATURE, MAX_TEMPERATURE, "°C")
            return _NO_VALUE if number is None else (number, False, f"{number:g}")
        if kind == SIZE:
            try:
                size = parse_size(raw, limit=True)  # a threshold is a limit: "8" or "0.5M" is a mistake
            except ValueError as e:
                self.error(node, f"{what}: {e}")
                return _NO_VALUE
            return size, False, raw.strip()
        if kind == DURATION:
            try:
                seconds = parse_duration(raw)
            except ValueError as e:
                self.error(node, f"{what}: {e}")
                return _NO_VALUE
            return seconds, False, format_duration(seconds)
        raise AssertionError(kind)

    def closed_set(self, ctype: ConditionType, values: tuple[Any, ...], node: Node) -> bool:
        """Whether every value is one the type can ever read (a type with a closed set of values): a typo
        would otherwise make a condition that never holds."""
        wrong = [v for v in values if ctype.values and v not in ctype.values]
        if wrong:
            self.error(node, f"{ctype.name} is one of {', '.join(ctype.values)}, not {quoted(str(wrong[0]))}")
        return not wrong


def list_text(values: tuple[Any, ...]) -> str:
    """[a, b, c] for a condition's text, cut to fit MAX_TEXT with "… N more"."""
    shown: list[str] = []
    size = 0
    for i, v in enumerate(values):
        item = cut(str(v), 40)
        if i and size + len(item) > MAX_TEXT - 60:
            return "[" + ", ".join(shown) + f", … {len(values) - i} more]"
        shown.append(item)
        size += len(item) + 2
    return "[" + ", ".join(shown) + "]"


def _regex_hint(pattern: str, reason: str) -> str:
    """What RE2's reason means when the pattern needs backtracking (Python's re would take it). The pattern is
    at most MAX_REGEX characters, the reason one line."""
    if re.search(r"invalid escape sequence: \\[1-9]", reason) or ("(?P=" in pattern and "(?P" in reason):
        return "backreferences (\\1, (?P=name)) are not supported: "
    if re.search(r"\(\?<?[=!]", reason):
        return "lookahead and lookbehind ((?=...), (?!...), (?<=...), (?<!...)) are not supported: "
    return ""
