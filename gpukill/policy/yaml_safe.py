"""A policy's YAML read safely and within bounds: PyYAML's safe constructor and resolver on libyaml's parser
where it is there, PyYAML's Python composer (its nesting bounded) in every case, so that each node carries
the marks that FILE:LINE:COL needs. Whatever the text, what this raises is NotYaml, one line saying where and
why."""

from __future__ import annotations

import contextlib
import re
from typing import Any, Protocol, cast

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import Node, ScalarNode

from .bounds import MAX_DEPTH, MAX_NUMBER_TEXT

_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class NotYaml(Exception):
    """Text that is not YAML, or that PyYAML cannot read; `line` is the error as 'FILE:LINE:COL: message'."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


class _Events(Protocol):
    """What _Bounded asks of the parser beside it (PyYAML's or libyaml's)."""

    def peek_event(self) -> Any: ...


class _Bounded(yaml.composer.Composer):
    """Nesting bounded for PyYAML's composer, which recurses once per level: 100,000 `[`s would otherwise end
    in RecursionError (or, where the stack is smaller, worse)."""

    _depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = cast(_Events, self).peek_event().start_mark
                raise yaml.composer.ComposerError(
                    None, None, f"lists and mappings nested more than {MAX_DEPTH} levels deep", mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _Loader(_Bounded, yaml.SafeLoader):
    """PyYAML's safe loader (all Python), nesting bounded."""


_CParser: type[Any] | None = None  # libyaml's parser, where PyYAML is built with it
try:
    from yaml._yaml import CParser
except ImportError:  # PyYAML built without libyaml: every policy is read by _Loader alone
    pass
else:
    _CParser = CParser

    class _FastLoader(_Bounded, CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
        """_Loader's composer, constructor and resolver on libyaml's scanner and parser, which make the events
        six times faster than PyYAML's Python ones (20,000 keys: 0.12 s against 0.75 s): a hostile megabyte of
        valid YAML costs a worker thread seconds less. The composer stays the Python one, whose nesting is
        bounded (libyaml's own recurses in C) and whose nodes carry the marks FILE:LINE:COL needs. A text
        libyaml finds fault with is read again by _Loader, so that every error reads as it always has
        (PyYAML's messages name what was expected and what was found; libyaml's are terser)."""

        def __init__(self, text: str) -> None:
            yaml.reader.Reader(text)  # the characters, checked as _Loader checks them, before libyaml reads them
            CParser.__init__(self, text)
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


def compose(text: str, filename: str) -> tuple[Node | None, SafeConstructor]:
    """The document's node tree (None where it is empty) and the loader whose constructor reads its scalars;
    NotYaml for the errors of YAML itself (and of PyYAML) as FILE:LINE:COL."""
    loader = None
    try:
        fast = _fast_nodes(text)
        if fast is not None:
            root, loader = fast
        else:
            loader = _Loader(text)  # the reader checks the characters here already
            root = loader.get_single_node()
        return root, loader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else f"{filename}:1:1"
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise NotYaml(f"{where}: not valid YAML: {what}") from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow (controls, surrogates)
        where = _at(text, filename, e.position)
        raise NotYaml(
            f"{where}: not valid YAML: character #x{e.character:04x} is not allowed ({e.reason})"
            if isinstance(e.character, int)
            else f"{where}: not valid YAML: {e.reason}"
        ) from None
    except yaml.YAMLError as e:
        raise NotYaml(f"{filename}:1:1: not valid YAML: {e}") from None
    except (ValueError, OverflowError, TypeError, RecursionError, MemoryError) as e:
        # PyYAML's scanner calls chr() on escapes ("\U00110000" is ValueError); its composer recurses
        where = f"{filename}:1:1"
        if loader is not None:
            with contextlib.suppress(Exception):
                mark = loader.get_mark()
                where = f"{filename}:{mark.line + 1}:{mark.column + 1}"
        reason = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        raise NotYaml(f"{where}: not valid YAML: {reason}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _at(text: str, filename: str, position: int) -> str:
    """FILE:LINE:COL of a character of the text."""
    position = max(0, min(position, len(text)))
    line = text.count("\n", 0, position)
    column = position - (text.rfind("\n", 0, position) + 1)
    return f"{filename}:{line + 1}:{column + 1}"


def scalar_value(loader: SafeConstructor, node: ScalarNode) -> tuple[Any, str | None]:
    """(value, None) for a scalar node, typed as YAML resolves it; (None, why not) where it cannot be read."""
    if node.tag in (_INT_TAG, _FLOAT_TAG, _TIMESTAMP_TAG) and len(node.value) > MAX_NUMBER_TEXT:
        # Python refuses ints of more than 4300 digits (ValueError), and PyYAML's sexagesimal ints
        # (1:2:3:...) cost quadratic time: no number this long is valid anywhere in a policy.
        return None, (f"a number written with more than {MAX_NUMBER_TEXT} characters is too large for any setting")
    try:
        value = loader.construct_object(node)
    except yaml.YAMLError as e:  # e.g. an unknown tag
        return None, f"cannot read this value: {getattr(e, 'problem', None) or e}"
    except (ValueError, OverflowError, TypeError, AttributeError, RecursionError, MemoryError) as e:
        # PyYAML's constructors call int(), float(), datetime() and friends: a 5,000-digit !!int,
        # a timestamp on 2001-13-40, !!float on a word
        return None, f"cannot read this value: {type(e).__name__}: {e}"
    if isinstance(value, str) and _SURROGATE.search(value):
        return None, "a string with a lone surrogate (an escape such as \\ud800): not valid Unicode text"
    return value, None
